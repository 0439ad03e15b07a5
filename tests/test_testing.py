"""FaultProxy over real loopback sockets, between a test client and an in-test TCP server.

Every test runs under ``anyio.fail_after`` and every loop is bounded; the only time assertions
are lower bounds of a configured delay or rate, which the proxy guarantees on the same clock.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.abc
import pytest
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.memory import MemoryObjectReceiveStream

from garcon_link.testing import FaultProxy, ProxyStatistics, free_tcp_port

pytestmark = pytest.mark.timeout(30)

DEADLINE = 5.0  # seconds any single test may take before it is failed rather than hung
_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


@dataclass
class Server:
    """An in-test TCP server: echoes (or only swallows) and reports each connection's bytes."""

    port: int
    finished: MemoryObjectReceiveStream[bytes]  # everything one connection received, at its end
    connections: int = 0


@asynccontextmanager
async def tcp_server(*, echo: bool = True) -> AsyncIterator[Server]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    send_finished, receive_finished = anyio.create_memory_object_stream[bytes](64)
    server = Server(port=listener.extra(SocketAttribute.local_port), finished=receive_finished)

    async def handle(stream: SocketStream) -> None:
        server.connections += 1
        data = bytearray()
        async with stream:
            try:
                while True:  # ends at end-of-stream or reset
                    chunk = await stream.receive()
                    data += chunk
                    if echo:
                        await stream.send(chunk)
            except _CLOSED:
                pass
        send_finished.send_nowait(bytes(data))

    async with listener, anyio.create_task_group() as tg, send_finished, receive_finished:
        tg.start_soon(listener.serve, handle)
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


async def connect(proxy: FaultProxy) -> SocketStream:
    return await anyio.connect_tcp("127.0.0.1", proxy.port)


async def receive_exactly(stream: SocketStream, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:  # at most n passes: each receive returns at least one byte
        data += await stream.receive(n - len(data))
    return bytes(data)


async def receive_until_closed(stream: SocketStream, limit: int = 1_000_000) -> bytes:
    """Everything received before end-of-stream or a reset; fails if more than ``limit``."""
    data = bytearray()
    while len(data) <= limit:  # bounded by limit (each pass gets >= 1 byte) and the deadline
        try:
            data += await stream.receive()
        except _CLOSED:
            return bytes(data)
    raise AssertionError(f"still open after {len(data)} bytes")


def payload(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


@pytest.mark.anyio
async def test_forwards_both_ways_and_counts() -> None:
    data = payload(100_000)
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            assert proxy.host == "127.0.0.1"
            assert proxy.url() == f"ws://127.0.0.1:{proxy.port}/executor"
            assert proxy.url("x", scheme="http") == f"http://127.0.0.1:{proxy.port}/x"
            async with await connect(proxy) as client, anyio.create_task_group() as tg:
                tg.start_soon(client.send, data)
                assert await receive_exactly(client, len(data)) == data
                assert proxy.statistics() == ProxyStatistics(
                    connections_accepted=1,
                    connections_active=1,
                    cuts=0,
                    bytes_up=len(data),
                    bytes_down=len(data),
                )


@pytest.mark.anyio
async def test_cut_closes_both_sides_and_later_connections_work() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            async with await connect(proxy) as first:
                await first.send(b"ping")
                assert await receive_exactly(first, 4) == b"ping"
                proxy.cut()
                assert await receive_until_closed(first) == b""
                assert await server.finished.receive() == b"ping"  # the target side closed too
            assert proxy.statistics().cuts == 1
            async with await connect(proxy) as second:
                await second.send(b"again")
                assert await receive_exactly(second, 5) == b"again"
            stats = proxy.statistics()
            assert (stats.connections_accepted, stats.cuts) == (2, 1)


@pytest.mark.anyio
async def test_cut_after_up_forwards_exactly_n_bytes_then_closes() -> None:
    data = payload(1000)
    with anyio.fail_after(DEADLINE):
        async with tcp_server(echo=False) as sink, FaultProxy("127.0.0.1", sink.port) as proxy:
            proxy.cut_after(377, "up")
            async with await connect(proxy) as client:
                await client.send(data)
                assert await sink.finished.receive() == data[:377]
                assert await receive_until_closed(client) == b""
            stats = proxy.statistics()
            assert (stats.bytes_up, stats.cuts) == (377, 1)
            # One-shot: the next connection is not cut.
            async with await connect(proxy) as client:
                await client.send(data)
            assert await sink.finished.receive() == data
            assert proxy.statistics().cuts == 1


@pytest.mark.anyio
async def test_cut_after_down_delivers_exactly_n_bytes_then_end_of_stream() -> None:
    data = payload(1000)
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            proxy.cut_after(30, "down")
            async with await connect(proxy) as client:
                await client.send(data)
                assert await receive_until_closed(client) == data[:30]
            assert (proxy.statistics().bytes_down, proxy.statistics().cuts) == (30, 1)


@pytest.mark.anyio
async def test_blackhole_stalls_without_closing_and_heal_resumes() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            async with await connect(proxy) as client:
                await client.send(b"a")
                assert await receive_exactly(client, 1) == b"a"
                proxy.blackhole()
                await client.send(b"b")
                with anyio.move_on_after(0.2) as stalled:
                    await client.receive()  # neither data nor end-of-stream may arrive
                assert stalled.cancelled_caught
                # A connection accepted meanwhile is held too: the target never sees it.
                async with await connect(proxy) as late:
                    await proxy.wait_connections(2, timeout=DEADLINE)
                    assert server.connections == 1
                    assert proxy.statistics().bytes_up == 1
                    proxy.heal()
                    await client.send(b"c")
                    assert await receive_exactly(client, 2) == b"bc"  # held data kept its order
                    await late.send(b"late")
                    assert await receive_exactly(late, 4) == b"late"
            assert server.connections == 2
            assert proxy.statistics().cuts == 0


@pytest.mark.anyio
async def test_blackhole_pushes_back_on_the_writer() -> None:
    limit = 64 * 1024 * 1024  # far above what loopback kernel buffers hold
    block = b"x" * 65536
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            proxy.blackhole()
            async with await connect(proxy) as client:  # accepted while blackholed
                sent = 0
                with anyio.move_on_after(0.3) as stalled:
                    while sent < limit:  # at most limit / 64 KiB passes
                        await client.send(block)
                        sent += len(block)
                # A proxy that buffered in memory would have taken all of it by now.
                assert stalled.cancelled_caught, f"{sent} bytes accepted without backpressure"
                assert proxy.statistics().bytes_up == 0


@pytest.mark.anyio
async def test_throttle_paces_forwarding() -> None:
    data = payload(200_000)
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            proxy.throttle(1_000_000)
            async with await connect(proxy) as client, anyio.create_task_group() as tg:
                start = anyio.current_time()
                tg.start_soon(client.send, data)
                assert await receive_exactly(client, len(data)) == data
                # Lower bound only: at 1 MB/s, 200 kB cannot get through in under ~0.18 s.
                assert anyio.current_time() - start >= 0.1
                proxy.throttle(None)
                await client.send(b"fast")
                assert await receive_exactly(client, 4) == b"fast"


@pytest.mark.anyio
async def test_delay_adds_latency_each_way() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            proxy.delay(0.05)
            async with await connect(proxy) as client:
                start = anyio.current_time()
                await client.send(b"x")
                assert await receive_exactly(client, 1) == b"x"
                # Lower bound only: 0.05 s up plus 0.05 s down, on the proxy's own clock.
                assert anyio.current_time() - start >= 0.099
                proxy.heal()
                await client.send(b"y")
                assert await receive_exactly(client, 1) == b"y"


@pytest.mark.anyio
async def test_refuse_closes_new_connections_only() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            async with await connect(proxy) as existing:
                proxy.refuse()
                async with await connect(proxy) as refused:
                    assert await receive_until_closed(refused) == b""
                await existing.send(b"still")
                assert await receive_exactly(existing, 5) == b"still"
                stats = proxy.statistics()
                assert stats.connections_refused == 1
                assert (stats.connections_accepted, stats.connections_active) == (2, 1)
                proxy.refuse(False)
                async with await connect(proxy) as accepted:
                    await accepted.send(b"ok")
                    assert await receive_exactly(accepted, 2) == b"ok"
            assert server.connections == 2


@pytest.mark.anyio
async def test_aclose_is_idempotent_and_closes_client_connections() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            async with await connect(proxy) as client:
                await client.send(b"hi")
                assert await receive_exactly(client, 2) == b"hi"
                await proxy.aclose()
                await proxy.aclose()
                assert await receive_until_closed(client) == b""
            assert await server.finished.receive() == b"hi"
            assert proxy.statistics().connections_active == 0
            with pytest.raises(OSError):
                await anyio.connect_tcp("127.0.0.1", proxy.port)
        await proxy.aclose()


@pytest.mark.anyio
async def test_unreachable_target_closes_the_dialer() -> None:
    with anyio.fail_after(DEADLINE):
        async with FaultProxy("127.0.0.1", free_tcp_port()) as proxy:
            async with await connect(proxy) as client:
                assert await receive_until_closed(client) == b""
            stats = proxy.statistics()
            assert (stats.connections_accepted, stats.connections_active) == (1, 0)


@pytest.mark.anyio
async def test_a_reset_ends_only_its_own_connection() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            doomed = await connect(proxy)
            await doomed.send(b"bye")
            assert await receive_exactly(doomed, 3) == b"bye"
            raw = doomed.extra(SocketAttribute.raw_socket)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await doomed.aclose()  # SO_LINGER 0: the proxy sees a reset, not end-of-stream
            assert await server.finished.receive() == b"bye"
            async with await connect(proxy) as client:
                await client.send(b"fine")
                assert await receive_exactly(client, 4) == b"fine"
            assert proxy.statistics().cuts == 0


@pytest.mark.anyio
async def test_wait_connections() -> None:
    with anyio.fail_after(DEADLINE):
        async with tcp_server() as server, FaultProxy("127.0.0.1", server.port) as proxy:
            with pytest.raises(TimeoutError):
                await proxy.wait_connections(1, timeout=0.05)
            async with await connect(proxy):
                await proxy.wait_connections(1, timeout=DEADLINE)


def test_arguments_are_validated() -> None:
    proxy = FaultProxy("127.0.0.1", 9)
    with pytest.raises(ValueError):
        proxy.cut_after(-1)
    with pytest.raises(ValueError):
        proxy.cut_after(1, "sideways")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        proxy.delay(-0.1)
    with pytest.raises(ValueError):
        proxy.throttle(0)
    with pytest.raises(ValueError):
        FaultProxy("127.0.0.1", 0)
    with pytest.raises(RuntimeError):
        _ = proxy.port
    proxy.refuse()  # faults may be set before the proxy starts
    proxy.heal()
    assert proxy.statistics() == ProxyStatistics(0, 0, 0, 0, 0)


def test_free_tcp_port_is_bindable() -> None:
    port = free_tcp_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
