"""Floor client: raw asyncio TCP with length-prefixed frames, requests pipelined in order."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from . import HOST, Mode
from ._fifo import FifoReplies

MODE: Mode = "async"
HEADER = struct.Struct("!I")


class _Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._replies = FifoReplies()

    async def call(self, payload: bytes) -> bytes:
        reply = self._replies.expect()
        self._writer.writelines((HEADER.pack(len(payload)), payload))
        await self._writer.drain()
        return await reply

    async def receive_loop(self) -> None:
        reader = self._reader
        try:
            while True:
                (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                self._replies.deliver(await reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._replies.fail(exc)


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[_Client]:
    reader, writer = await asyncio.open_connection(HOST, port)
    client = _Client(reader, writer)
    receiver = asyncio.create_task(client.receive_loop())
    try:
        yield client
    finally:
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
