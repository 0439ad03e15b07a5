"""Floor client: the ``websockets`` library (asyncio API, compression off), pipelined in order."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from . import HOST, Mode
from ._fifo import FifoReplies

MODE: Mode = "async"
MAX_SIZE = 64 * 1024 * 1024


class _Client:
    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._replies = FifoReplies()
        self._send_lock = asyncio.Lock()

    async def call(self, payload: bytes) -> bytes:
        async with self._send_lock:  # keeps the queue in the order of the wire
            reply = self._replies.expect()
            await self._ws.send(payload)
        return await reply

    async def receive_loop(self) -> None:
        try:
            async for message in self._ws:
                if isinstance(message, str):
                    raise TypeError("the echo server sent a text message")
                self._replies.deliver(message)
            self._replies.fail(ConnectionError("connection closed"))
        except ConnectionClosed as exc:
            self._replies.fail(exc)


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[_Client]:
    options: dict[str, Any] = {"compression": None, "max_size": MAX_SIZE, "ping_interval": None}
    if "proxy" in inspect.signature(ws_connect).parameters:
        options["proxy"] = None  # loopback only, whatever the environment says
    async with ws_connect(f"ws://{HOST}:{port}/", **options) as ws:
        client = _Client(ws)
        receiver = asyncio.create_task(client.receive_loop())
        try:
            yield client
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver
