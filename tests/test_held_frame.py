"""``WebSocket.hold_message_nowait``: a frame held for the next write (the listener's proof).

What it must do: the held message reaches the peer before anything written after it, whole and
once; a write that comes along takes it in front of itself; with nothing written, it still goes
out on its own a couple of loop turns later. Counted in loop turns, never timed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Request

from garcon_link.limits import Limits
from garcon_link.net import _asyncio_stream
from garcon_link.net.ws import WebSocket

pytestmark = pytest.mark.anyio

DEADLINE = 10.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the hold needs a stream that takes bytes synchronously


class Peer:
    """The other end: raw bytes in, whole messages out (a wsproto client)."""

    def __init__(self, stream: anyio.abc.SocketStream, ws: WSConnection) -> None:
        self.stream = stream
        self.ws = ws

    async def messages(self, count: int) -> list[bytes]:
        out: list[bytes] = []
        while len(out) < count:
            self.ws.receive_data(await self.stream.receive())
            out.extend(bytes(e.data) for e in self.ws.events() if isinstance(e, BytesMessage))
        return out


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[WebSocket, Peer]]:
    """A server-side WebSocket on an asyncio stream, upgraded, and its peer."""
    client, server = WSConnection(ConnectionType.CLIENT), WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="localhost", target="/executor")))
    assert any(isinstance(e, Request) for e in server.events())
    client.receive_data(server.send(AcceptConnection()))
    assert any(isinstance(e, AcceptConnection) for e in client.events())
    accepted: list[anyio.abc.SocketStream] = []
    ready = anyio.Event()
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:

        async def accept() -> None:
            accepted.append(await listener.listeners[0].accept())  # type: ignore[attr-defined]
            ready.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            stream = await _asyncio_stream.connect("127.0.0.1", port)
            await ready.wait()
        sock = WebSocket(stream, server, peer="test", limits=Limits())
        try:
            yield sock, Peer(accepted[0], client)
        finally:
            await sock.abort()
            await accepted[0].aclose()


async def test_a_held_message_goes_in_front_of_the_next_write() -> None:
    with anyio.fail_after(DEADLINE):
        async with pair() as (sock, peer):
            assert sock.hold_message_nowait(b"proof")
            assert not sock.hold_message_nowait(b"another")  # one at a time
            await sock.send_message(b"first frames")
            assert await peer.messages(2) == [b"proof", b"first frames"]
            await sock.send_message(b"then")
            assert await peer.messages(1) == [b"then"]  # held once, not again


async def test_a_held_message_goes_alone_when_nothing_is_written() -> None:
    with anyio.fail_after(DEADLINE):
        async with pair() as (sock, peer):
            assert sock.hold_message_nowait(b"proof")
            for _ in range(3):  # two loop turns, and one to spare
                await anyio.sleep(0)
            assert await peer.messages(1) == [b"proof"]
            sock.authenticated()
            assert sock.writable_now()
            sock.send_message_nowait(b"later")
            assert await peer.messages(1) == [b"later"]


async def test_nothing_is_held_once_the_socket_ended() -> None:
    with anyio.fail_after(DEADLINE):
        async with pair() as (sock, _peer):
            await sock.abort()
            assert not sock.hold_message_nowait(b"proof")
