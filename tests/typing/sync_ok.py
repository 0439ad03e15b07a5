"""mypy --strict must accept this file: a sync client's facade is typed as its sync view."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import garcon_link as gl


class CalcSync(Protocol):
    """The sync view of the worker's async ``Calc``: plain ``def``, streams as iterators."""

    def add(self, a: int, b: int) -> int: ...
    def count(self, n: int) -> Iterator[int]: ...
    @gl.oneway
    def note(self, text: str) -> None: ...


def script(config: gl.LinkConfig) -> int:
    with gl.connect_sync(config) as executor:
        executor.wait_ready(10)
        calc = executor.service("calc", CalcSync)
        total: int = calc.add(1, 2)
        for i in calc.count(3):
            total += i
        calc.note("done")
        patient = gl.with_options(calc, timeout=5, dispatch_deadline=2)
        total += patient.add(total, 1)
        explore = executor.service("calc")  # dynamic: Any
        total += explore.add(1, 2)
        info: gl.ExecutorInfo = executor.info()
        assert info.executor_id == executor.executor_id
        return total


def notebook(config: gl.LinkConfig) -> gl.SyncExecutor:
    executor = gl.connect_sync(config)  # closed by executor.close(), or at exit
    executor.close(drain=1.0)
    return executor
