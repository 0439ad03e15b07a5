"""Peer client: grpcio asyncio, one channel, a unary bytes method (no protoc, no serializers)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc.aio

from . import HOST, Mode

MODE: Mode = "async"
MAX_MESSAGE = 64 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.enable_http_proxy", 0),  # loopback only, whatever the environment says
]
METHOD = "/bench.Echo/Echo"


class _Client:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        # No (de)serializer: requests and replies are the raw bytes (identity serialization).
        self._echo = channel.unary_unary(
            METHOD, request_serializer=None, response_deserializer=None
        )

    async def call(self, payload: bytes) -> bytes:
        reply = await self._echo(payload)
        assert isinstance(reply, bytes)
        return reply


@asynccontextmanager
async def connect(port: int) -> AsyncIterator[_Client]:
    async with grpc.aio.insecure_channel(f"{HOST}:{port}", options=OPTIONS) as channel:
        await channel.channel_ready()
        yield _Client(channel)
