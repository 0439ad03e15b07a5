"""mypy --strict must reject this file: the lines marked E (error) or N (note) are checked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, reveal_type

import garcon_link as gl


class Calc(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    def count(self, n: int) -> AsyncIterator[int]: ...


async def controller(executor: gl.RemoteExecutor) -> None:
    calc = executor.service("calc", Calc)
    reveal_type(calc)  # N: Revealed type is "facade_bad.Calc"
    reveal_type(await calc.add(1, 2))  # N: Revealed type is "int"
    reveal_type(gl.with_options(calc, timeout=1))  # N: Revealed type is "facade_bad.Calc"
    await calc.add("x", 1)  # E: Argument 1 to "add" of "Calc" has incompatible type "str"
    await calc.mul(2, 3)  # E: "Calc" has no attribute "mul"
    async for item in calc.count(3):
        reveal_type(item)  # N: Revealed type is "int"
    peer = gl.peer("calc", Calc)
    await peer.add(1)  # E: Missing positional argument "b" in call to "add" of "Calc"


async def wrong_result(executor: gl.RemoteExecutor) -> str:
    calc = executor.service("calc", Calc)
    return await calc.add(1, 2)  # E: Incompatible return value type (got "int", expected "str")


class WrongImpl:
    async def add(self, a: str, b: int) -> str:
        return a


def wrong_implementation() -> None:
    gl.Service[Calc](WrongImpl(), Calc)  # E: Argument 1 to "Service" has incompatible type
