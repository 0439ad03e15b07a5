"""Benchmark clients: one module per measured system, all of the same shape.

Every client module defines:

``MODE``
    ``"async"`` (asyncio; the harness runs it on its event loop and shares ONE connection
    between the concurrent callers) or ``"sync"`` (the harness uses one connection per thread).

``connect(port)``
    A context manager (``async with`` for ``"async"``, ``with`` for ``"sync"``) that connects
    to the server on ``127.0.0.1:port`` and yields an object with a ``call(payload) -> bytes``
    method (a coroutine for ``"async"``) that sends ``payload`` and returns the echoed bytes.
    For ``"async"`` clients, ``call`` must be safe to run from many tasks at once.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Literal, Protocol

Mode = Literal["async", "sync"]


class AsyncEcho(Protocol):
    """A connected asynchronous client."""

    async def call(self, payload: bytes) -> bytes: ...


class SyncEcho(Protocol):
    """A connected synchronous client (used by one thread)."""

    def call(self, payload: bytes) -> bytes: ...


AsyncConnect = Callable[[int], AbstractAsyncContextManager[AsyncEcho]]
SyncConnect = Callable[[int], AbstractContextManager[SyncEcho]]

HOST = "127.0.0.1"
"""Every benchmark talks to loopback only."""
