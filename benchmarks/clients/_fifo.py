"""Replies matched to requests in order: an echo server answers each connection in order."""

from __future__ import annotations

import asyncio
from collections import deque


class FifoReplies:
    """The callers waiting on one connection, oldest first.

    A caller registers with :meth:`expect` right before its request goes out (with nothing
    awaited in between, or under the connection's send lock), so the order of the queue is
    the order of the requests on the wire and so of the replies.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._pending: deque[asyncio.Future[bytes]] = deque()
        self._error: BaseException | None = None

    def expect(self) -> asyncio.Future[bytes]:
        if self._error is not None:
            raise ConnectionError(f"connection failed: {self._error!r}")
        future: asyncio.Future[bytes] = self._loop.create_future()
        self._pending.append(future)
        return future

    def deliver(self, reply: bytes) -> None:
        if not self._pending:
            raise RuntimeError("a reply arrived that no request was waiting for")
        future = self._pending.popleft()
        if not future.done():  # done: its caller was cancelled; the reply was still its own
            future.set_result(reply)

    def fail(self, error: BaseException) -> None:
        self._error = error
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"connection failed: {error!r}"))
