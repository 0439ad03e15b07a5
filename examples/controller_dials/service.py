"""The controller_dials example's service: a greeter with a call, a stream and a failure."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import anyio


class Greeter(Protocol):
    async def greet(self, name: str) -> str: ...

    def countdown(self, start: int) -> AsyncIterator[int]: ...


class FriendlyGreeter:
    """Served with ``--service greeter=service:FriendlyGreeter`` (a class: instantiated once)."""

    def __init__(self) -> None:
        self.calls = 0

    async def greet(self, name: str) -> str:
        self.calls += 1
        return f"Hello, {name}! (call #{self.calls} on this worker)"

    async def countdown(self, start: int) -> AsyncIterator[int]:
        for i in range(start, -1, -1):
            yield i
            await anyio.sleep(0.01)
