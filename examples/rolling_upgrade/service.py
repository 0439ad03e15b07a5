"""The service before and after the upgrade: v2 adds ``mul`` and changes what ``scale`` returns.

``add`` is unchanged, ``mul`` is additive (a caller of v1 never calls it), and ``scale`` returns
text in v2 where v1 returned a number: an incompatible change, so a caller typed by v1 is refused
``Rejected("CONTRACT_CHANGED")`` on a v2 worker before anything is sent. Every handler writes
what it ran into a ledger, so the script can show that no v2 ``scale`` ever ran for a v1 caller.
"""

from __future__ import annotations

from typing import Protocol

Ledger = list[tuple[str, str, str]]  # (worker, version, method)


class CalcV1(Protocol):
    async def add(self, a: int, b: int) -> int: ...

    async def scale(self, x: float) -> float: ...


class CalcV2(Protocol):
    async def add(self, a: int, b: int) -> int: ...

    async def scale(self, x: float) -> str: ...

    async def mul(self, a: int, b: int) -> int: ...


class CalcV1Impl:
    def __init__(self, worker: str, ledger: Ledger) -> None:
        self.worker = worker
        self.ledger = ledger

    async def add(self, a: int, b: int) -> int:
        self.ledger.append((self.worker, "v1", "add"))
        return a + b

    async def scale(self, x: float) -> float:
        self.ledger.append((self.worker, "v1", "scale"))
        return x * 2


class CalcV2Impl:
    def __init__(self, worker: str, ledger: Ledger) -> None:
        self.worker = worker
        self.ledger = ledger

    async def add(self, a: int, b: int) -> int:
        self.ledger.append((self.worker, "v2", "add"))
        return a + b

    async def scale(self, x: float) -> str:
        self.ledger.append((self.worker, "v2", "scale"))
        return f"{x * 2:.2f}"

    async def mul(self, a: int, b: int) -> int:
        self.ledger.append((self.worker, "v2", "mul"))
        return a * b
