"""mypy --strict must reject this file: the lines marked E (error) or N (note) are checked."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, reveal_type

import garcon_link as gl


class CalcSync(Protocol):
    def add(self, a: int, b: int) -> int: ...
    def count(self, n: int) -> Iterator[int]: ...


def script(executor: gl.SyncExecutor) -> None:
    calc = executor.service("calc", CalcSync)
    reveal_type(calc)  # N: Revealed type is "sync_bad.CalcSync"
    reveal_type(calc.add(1, 2))  # N: Revealed type is "int"
    reveal_type(gl.with_options(calc, timeout=1))  # N: Revealed type is "sync_bad.CalcSync"
    calc.add("x", 1)  # E: Argument 1 to "add" of "CalcSync" has incompatible type "str"
    calc.mul(2, 3)  # E: "CalcSync" has no attribute "mul"
    for item in calc.count(3):
        reveal_type(item)  # N: Revealed type is "int"
    executor.wait_ready("soon")  # E: Argument 1 to "wait_ready" of "SyncExecutor"
    len(calc.count(3))  # E: Argument 1 to "len" has incompatible type "Iterator[int]"


def wrong_result(executor: gl.SyncExecutor) -> str:
    calc = executor.service("calc", CalcSync)
    return calc.add(1, 2)  # E: Incompatible return value type (got "int", expected "str")
