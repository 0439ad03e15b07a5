"""Floor clients: raw wsproto over anyio sockets, binary messages pipelined in order.

Written with anyio primitives only (socket stream, lock, events, task group), as the stack
garcon_link stands on; the harness runs them on the asyncio backend.  ``connect`` writes each
message with a send of its own; ``connect_coalesced`` writes all the messages issued in one
event-loop turn with one send.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import anyio
from anyio.abc import SocketStream, TaskGroup
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
)

from . import HOST, Mode

MODE: Mode = "async"
RECEIVE_BYTES = 256 * 1024


class _Waiter:
    __slots__ = ("done", "error", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply = b""
        self.error: BaseException | None = None


class _Client:
    def __init__(self, stream: SocketStream, ws: WSConnection) -> None:
        self._stream = stream
        self._ws = ws
        self._send_lock = anyio.Lock()
        self._pending: deque[_Waiter] = deque()
        self._error: BaseException | None = None

    async def call(self, payload: bytes) -> bytes:
        waiter = _Waiter()
        async with self._send_lock:  # keeps the queue in the order of the wire
            if self._error is not None:
                raise ConnectionError(f"connection failed: {self._error!r}")
            self._pending.append(waiter)
            await self._stream.send(self._ws.send(BytesMessage(data=payload)))
        await waiter.done.wait()
        if waiter.error is not None:
            raise ConnectionError(f"connection failed: {waiter.error!r}")
        return waiter.reply

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:
            await self._stream.send(data)

    def _deliver(self, reply: bytes) -> None:
        if not self._pending:
            raise RuntimeError("a reply arrived that no request was waiting for")
        waiter = self._pending.popleft()
        waiter.reply = reply
        waiter.done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        while self._pending:
            waiter = self._pending.popleft()
            waiter.error = error
            waiter.done.set()

    async def receive_loop(self) -> None:
        parts: list[bytes] = []
        try:
            while True:
                self._ws.receive_data(await self._stream.receive(RECEIVE_BYTES))
                for event in self._ws.events():
                    if isinstance(event, BytesMessage):
                        parts.append(bytes(event.data))
                        if event.message_finished:
                            self._deliver(parts[0] if len(parts) == 1 else b"".join(parts))
                            parts.clear()
                    elif isinstance(event, Ping):
                        await self._send(self._ws.send(event.response()))
                    elif isinstance(event, CloseConnection):
                        raise ConnectionError(f"server closed the connection ({event.code})")
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError) as exc:
            self._fail(exc)

    def start(self, tg: TaskGroup) -> None:
        tg.start_soon(self.receive_loop)

    async def close(self) -> None:
        if self._error is None:
            with anyio.move_on_after(2):
                await self._send(self._ws.send(CloseConnection(code=1000)))


@dataclass(frozen=True)
class SendStatistics:
    """What a coalescing client has written so far."""

    messages: int
    """Messages (frames, the close frame included) handed to the writer."""
    sends: int
    """Calls of the socket stream's ``send``."""


class CoalescingClient(_Client):
    """The frames issued during one event-loop turn leave with one ``send``.

    A call appends its frame to the outgoing buffer; the first frame of a buffer wakes the
    writer task, whose step runs after the steps already scheduled in this turn (the other
    callers woken by the same read, say), so it writes what they all appended, in order.
    Frames appended while a send is under way go out with the next one.
    """

    def __init__(self, stream: SocketStream, ws: WSConnection) -> None:
        super().__init__(stream, ws)
        self._outgoing: list[bytes] = []
        self._wake = anyio.Event()
        self._closing = False
        self._writer_done = anyio.Event()
        self._messages = 0
        self._sends = 0

    def statistics(self) -> SendStatistics:
        return SendStatistics(messages=self._messages, sends=self._sends)

    async def call(self, payload: bytes) -> bytes:
        if self._error is not None:
            raise ConnectionError(f"connection failed: {self._error!r}")
        waiter = _Waiter()
        self._pending.append(waiter)  # the order of the buffer, so of the wire
        self._queue(self._ws.send(BytesMessage(data=payload)))
        await waiter.done.wait()
        if waiter.error is not None:
            raise ConnectionError(f"connection failed: {waiter.error!r}")
        return waiter.reply

    def _queue(self, frame: bytes) -> None:
        self._messages += 1
        self._outgoing.append(frame)
        if len(self._outgoing) == 1:
            self._wake.set()

    async def _send(self, data: bytes) -> None:
        self._queue(data)

    async def write_loop(self) -> None:
        try:
            while not (self._closing and not self._outgoing):
                await self._wake.wait()
                self._wake = anyio.Event()
                batch, self._outgoing = self._outgoing, []
                self._sends += 1
                await self._stream.send(batch[0] if len(batch) == 1 else b"".join(batch))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self._fail(exc)
        finally:
            self._writer_done.set()

    def start(self, tg: TaskGroup) -> None:
        super().start(tg)
        tg.start_soon(self.write_loop)

    async def close(self) -> None:
        """Queue the close frame and wait (at most 2 s) until the writer has written it."""
        if self._error is None:
            self._closing = True
            self._queue(self._ws.send(CloseConnection(code=1000)))
            with anyio.move_on_after(2):
                await self._writer_done.wait()


_C = TypeVar("_C", bound=_Client)


async def _handshake(stream: SocketStream, ws: WSConnection, port: int) -> None:
    await stream.send(ws.send(Request(host=f"{HOST}:{port}", target="/")))
    while True:
        ws.receive_data(await stream.receive(RECEIVE_BYTES))
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                return
            if isinstance(event, RejectConnection):
                raise ConnectionError(f"handshake rejected ({event.status_code})")


@asynccontextmanager
async def _connected(port: int, client_type: type[_C]) -> AsyncIterator[_C]:
    async with await anyio.connect_tcp(HOST, port) as stream:
        ws = WSConnection(ConnectionType.CLIENT)
        with anyio.fail_after(10):
            await _handshake(stream, ws, port)
        client = client_type(stream, ws)
        async with anyio.create_task_group() as tg:
            client.start(tg)
            try:
                yield client
            finally:
                await client.close()
                tg.cancel_scope.cancel()


def connect(port: int) -> AbstractAsyncContextManager[_Client]:
    """A client that writes every message with a send of its own."""
    return _connected(port, _Client)


def connect_coalesced(port: int) -> AbstractAsyncContextManager[CoalescingClient]:
    """A client that writes the messages issued in one event-loop turn with one send."""
    return _connected(port, CoalescingClient)
