"""Floor client: raw wsproto over anyio sockets, binary messages pipelined in order.

Written with anyio primitives only (socket stream, lock, events, task group), as the stack
garcon_link stands on; the harness runs it on the asyncio backend.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import SocketStream
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

    async def close(self) -> None:
        if self._error is None:
            with anyio.move_on_after(2):
                await self._send(self._ws.send(CloseConnection(code=1000)))


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
async def connect(port: int) -> AsyncIterator[_Client]:
    async with await anyio.connect_tcp(HOST, port) as stream:
        ws = WSConnection(ConnectionType.CLIENT)
        with anyio.fail_after(10):
            await _handshake(stream, ws, port)
        client = _Client(stream, ws)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.receive_loop)
            try:
                yield client
            finally:
                await client.close()
                tg.cancel_scope.cancel()
