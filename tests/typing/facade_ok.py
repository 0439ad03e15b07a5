"""mypy --strict must accept this file: a facade is typed as its Protocol interface."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import garcon_link as gl


class Calc(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    @gl.oneway
    async def note(self, text: str) -> None: ...


class CalcImpl:
    """A plain class: no base class, no registration decorator."""

    async def add(self, a: int, b: int) -> int:
        return a + b

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def note(self, text: str) -> None:
        pass


def implements(impl: CalcImpl) -> Calc:
    return impl  # the plain class satisfies the Protocol structurally


async def controller(executor: gl.RemoteExecutor) -> int:
    calc = executor.service("calc", Calc)
    total: int = await calc.add(1, 2)
    async for i in calc.count(3):
        total += i
    await calc.note("done")
    patient = gl.with_options(calc, timeout=5, dispatch_deadline=2)
    total += await patient.add(total, 1)
    return total


async def handler() -> int:
    calc = gl.peer("calc", Calc)
    return await calc.add(1, 2)


async def worker(config: gl.LinkConfig) -> None:
    await gl.serve(config, {"calc": CalcImpl()})


async def checked_worker(config: gl.LinkConfig) -> None:
    # Naming the interface as the type argument makes mypy check the implementation against it.
    await gl.serve(config, {"calc": gl.Service[Calc](CalcImpl(), Calc)})
    unchecked = gl.Service(CalcImpl(), Calc)  # accepted too (checked at run time only)
    await gl.serve(config, {"calc": unchecked})
