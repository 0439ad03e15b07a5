"""The asyncio byte stream the link uses instead of anyio's SocketStream (asyncio backend only).

It must keep anyio's stream contract -- bytes in order, anyio's exceptions, back-pressure both
ways, bounded buffering -- while skipping anyio's per-read pause/resume and per-send extra loop
iteration. Each test checks one piece of that contract over real loopback sockets.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import SocketAttribute

from garcon_link.net import _asyncio_stream
from garcon_link.net._asyncio_stream import READ_HIGH_WATER, WRITE_SLICE, AsyncioByteStream
from garcon_link.net._frames import MaskedFrame

pytestmark = pytest.mark.anyio

Handler = Callable[[AsyncioByteStream], Coroutine[Any, Any, None]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def served(handler: Handler) -> AsyncIterator[int]:
    """Listen on 127.0.0.1 and run ``handler`` for each accepted stream; yields the port."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    async with anyio.create_task_group() as tg, listener:
        tg.start_soon(_asyncio_stream.serve_accepted, listener, handler)
        yield port
        tg.cancel_scope.cancel()


async def echo(stream: AsyncioByteStream) -> None:
    async with stream:
        try:
            while True:
                await stream.send(await stream.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass


async def receive_exactly(stream: AsyncioByteStream, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        part = await stream.receive(size - got)
        parts.append(part)
        got += len(part)
    return b"".join(parts)


async def test_echo_round_trip_keeps_bytes_in_order_and_exposes_addresses() -> None:
    async with served(echo) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        async with stream:
            assert stream.extra(SocketAttribute.remote_address) == ("127.0.0.1", port)
            payload = os.urandom(300_000)
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.send, payload)
                assert await receive_exactly(stream, len(payload)) == payload


def test_event_loops_in_two_threads_read_their_own_bytes() -> None:
    # Reads land in a buffer that is reused: one per thread, or two loops reading at once
    # (each read releases the GIL) would write into each other's bytes.
    results: list[bool] = []

    async def round_trip() -> None:
        async with served(echo) as port:
            stream = await _asyncio_stream.connect("127.0.0.1", port)
            async with stream:
                payload = os.urandom(2_000_000)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stream.send, payload)
                    results.append(await receive_exactly(stream, len(payload)) == payload)

    threads = [threading.Thread(target=anyio.run, args=(round_trip,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [True, True]


async def test_receive_joins_queued_chunks_up_to_max_bytes_and_splits_larger_ones() -> None:
    sent = anyio.Event()

    async def three_writes(stream: AsyncioByteStream) -> None:
        async with stream:
            for part in (b"a" * 10, b"b" * 10, b"c" * 10):
                await stream.send(part)
                await anyio.sleep(0.01)  # separate TCP segments, separate data_received calls
            sent.set()
            await anyio.sleep(5)

    async with served(three_writes) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        async with stream:
            await sent.wait()
            await anyio.sleep(0.05)  # everything is buffered on our side by now
            assert await stream.receive(5) == b"a" * 5  # split
            assert await stream.receive(25) == b"a" * 5 + b"b" * 10 + b"c" * 10  # joined
            with anyio.move_on_after(0.05) as scope:
                await stream.receive()
            assert scope.cancelled_caught  # nothing more: a receive waits


async def test_unread_bytes_pause_the_transport_and_memory_stays_bounded() -> None:
    total = 8 * READ_HIGH_WATER
    payload = os.urandom(total)

    async def flood(stream: AsyncioByteStream) -> None:
        async with stream:
            await stream.send(payload)
            await anyio.sleep(10)

    async with served(flood) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        async with stream:
            # Wait (bounded) until the sender fills what TCP lets through and we pause reading.
            with anyio.fail_after(5):
                while not stream.reading_paused:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # had reading gone on, more would arrive now
            assert stream.buffered < READ_HIGH_WATER + 256 * 1024
            # Reading everything resumes the transport and loses nothing.
            assert await receive_exactly(stream, total) == payload
            assert not stream.reading_paused


async def test_receive_is_a_checkpoint_even_when_bytes_are_waiting() -> None:
    """Regression: with bytes already buffered, ``receive`` returned them without
    yielding, so the reader of a peer that keeps our buffers full (a flood of tiny WebSocket
    frames) never let another task run. Now every receive is a checkpoint, as anyio's is."""
    total = 100_000
    wrote = anyio.Event()

    async def burst(stream: AsyncioByteStream) -> None:
        async with stream:
            await stream.send(b"x" * total)
            wrote.set()
            await anyio.sleep(10)

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with served(burst) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        async with stream, anyio.create_task_group() as tg:
            with anyio.fail_after(5):
                await wrote.wait()
                while stream.buffered < total:
                    await anyio.sleep(0.01)
            tg.start_soon(ticker)
            before = ticks
            for _ in range(50):  # all waiting already: none of these has to wait
                assert await stream.receive(100) == b"x" * 100
            ran = ticks - before
            tg.cancel_scope.cancel()
        assert ran >= 25, f"the other task ran {ran} times during 50 receives"


async def test_send_waits_while_the_peer_does_not_read() -> None:
    release = anyio.Event()
    received: list[int] = []

    async def slow_reader(stream: AsyncioByteStream) -> None:
        async with stream:
            await release.wait()
            try:
                while True:
                    received.append(len(await stream.receive()))
            except anyio.EndOfStream:
                pass

    async with served(slow_reader) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        chunk = b"x" * (1 << 20)
        sent = 0
        blocked = False
        for _ in range(64):  # at most 64 MiB before the kernel buffers must be full
            with anyio.move_on_after(0.2) as scope:
                await stream.send(chunk)
            if scope.cancelled_caught:
                blocked = True
                break
            sent += len(chunk)
        assert blocked, "send never waited although the peer read nothing"
        release.set()
        await stream.send_eof()  # the half-finished send stays in the transport's buffer
        with anyio.fail_after(10):
            while sum(received) < sent:
                await anyio.sleep(0.01)
        await stream.aclose()


class _RecordingTransport:
    """Takes every write at once (as a kernel with room would) and records its size."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def write_eof(self) -> None:
        self.writes.append(b"<eof>")

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


async def test_a_large_item_is_written_a_slice_per_loop_turn_and_nothing_overtakes_it() -> None:
    """Over WRITE_SLICE bytes, an item goes to the transport a slice per loop turn: until its
    last slice the stream is not writable_now and a further send waits, so the next item's
    bytes follow it whole."""
    transport = _RecordingTransport()
    protocol = _asyncio_stream._Protocol()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    stream = AsyncioByteStream(transport, protocol)  # type: ignore[arg-type]
    item = os.urandom(3 * WRITE_SLICE + 5)
    stream.send_nowait(item)
    assert [len(w) for w in transport.writes] == [WRITE_SLICE]
    assert not stream.writable_now()
    turns = 0
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.send, b"next")
            while not stream.writable_now() and turns < 100:
                await anyio.lowlevel.checkpoint()
                turns += 1
    assert [len(w) for w in transport.writes] == [WRITE_SLICE] * 3 + [5, 4]
    assert b"".join(transport.writes) == item + b"next"
    assert turns >= 3  # a slice per loop turn, not all at once

    transport.writes.clear()
    stream.send_nowait(item)
    with anyio.fail_after(5):
        await stream.send_eof()  # after the item's last slice
    assert b"".join(transport.writes) == item + b"<eof>"


async def test_a_masked_frame_goes_out_masked_and_abort_ends_a_large_write() -> None:
    transport = _RecordingTransport()
    protocol = _asyncio_stream._Protocol()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    stream = AsyncioByteStream(transport, protocol)  # type: ignore[arg-type]
    frame = MaskedFrame(b"\x82\xff" + bytes(8) + os.urandom(4), os.urandom(2 * WRITE_SLICE))
    with anyio.fail_after(5):
        await stream.send(cast("bytes", frame))  # (typed bytes as anyio's; takes a frame)
    assert b"".join(transport.writes) == bytes(frame)

    transport.writes.clear()
    stream.send_nowait(os.urandom(4 * WRITE_SLICE))
    with anyio.fail_after(5):  # (a send_eof left waiting by abort() would hang here)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.send_eof)  # waits for the rest, which abort() drops
            await anyio.lowlevel.checkpoint()
            stream.abort()
            written = len(transport.writes)
    assert 1 <= written < 4
    with anyio.fail_after(5), pytest.raises(anyio.ClosedResourceError):
        await stream.send(b"after")
    await anyio.lowlevel.checkpoint()
    assert transport.writes[written:] == [b"<eof>"]  # no slice more once aborted


async def test_end_of_stream_after_the_peer_closes_its_side() -> None:
    async def say_bye(stream: AsyncioByteStream) -> None:
        async with stream:
            await stream.send(b"bye")
            await stream.send_eof()
            await anyio.sleep(5)

    async with served(say_bye) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        async with stream:
            assert await stream.receive() == b"bye"
            with pytest.raises(anyio.EndOfStream):
                await stream.receive()
            await stream.send(b"still writable after the peer's EOF")


async def test_aclose_wakes_a_waiting_receive_and_later_calls_say_closed() -> None:
    async with served(echo) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        outcome: list[type[BaseException]] = []

        async def receiver() -> None:
            try:
                await stream.receive()
            except Exception as exc:
                outcome.append(type(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver)
            await anyio.sleep(0.02)
            await stream.aclose()
        assert outcome == [anyio.ClosedResourceError]
        with pytest.raises(anyio.ClosedResourceError):
            await stream.send(b"x")
        await stream.aclose()  # idempotent


async def test_a_reset_connection_is_a_broken_resource() -> None:
    async def reset(stream: AsyncioByteStream) -> None:
        await stream.aclose()  # abort with unread data: the kernel answers with RST

    async with served(reset) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)

        async def poke() -> None:
            for _ in range(1000):
                await stream.send(b"data the peer will not read")
                await anyio.sleep(0.005)
                await stream.receive()

        async with stream:
            with anyio.fail_after(5), pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
                await poke()
            with pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
                await stream.receive()


async def test_two_concurrent_receives_are_refused() -> None:
    async with served(echo) as port:
        stream = await _asyncio_stream.connect("127.0.0.1", port)
        async with stream, anyio.create_task_group() as tg:
            tg.start_soon(stream.receive)
            await anyio.sleep(0.02)
            with pytest.raises(anyio.BusyResourceError):
                await stream.receive()
            tg.cancel_scope.cancel()


async def test_a_failed_accept_is_logged_and_the_listener_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_asyncio_stream, "ACCEPT_ERROR_PAUSE", 0.01)
    real_accept = _asyncio_stream._accept
    failures = [OSError(errno.EMFILE, "Too many open files")]

    def flaky_accept(sock: Any) -> Any:
        if failures:
            raise failures.pop()
        return real_accept(sock)

    monkeypatch.setattr(_asyncio_stream, "_accept", flaky_accept)
    with caplog.at_level(logging.WARNING, logger="garcon_link._asyncio_stream"):
        async with served(echo) as port:
            stream = await _asyncio_stream.connect("127.0.0.1", port)
            async with stream:
                await stream.send(b"ping")
                with anyio.fail_after(5):
                    assert await stream.receive() == b"ping"
    assert not failures
    assert any("Too many open files" in r.getMessage() for r in caplog.records)


async def test_connect_failure_is_an_os_error() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    await listener.aclose()  # nobody listens there any more
    with pytest.raises(OSError):
        await _asyncio_stream.connect("127.0.0.1", port)


async def test_the_handlers_end_with_the_accept_loop_cancelled_and_awaited() -> None:
    """Ending ``serve_accepted`` cancels every running handler (an anyio cancellation: its
    ``finally`` runs, and sees no deadline left) and returns only once all have ended."""
    started: list[int] = []
    ended: list[float] = []

    async def waits(stream: AsyncioByteStream) -> None:
        async with stream:
            started.append(1)
            try:
                await anyio.sleep_forever()
            finally:
                ended.append(anyio.current_effective_deadline())

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    clients: list[AsyncioByteStream] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, listener:
            tg.start_soon(_asyncio_stream.serve_accepted, listener, waits)
            for _ in range(3):
                clients.append(await _asyncio_stream.connect("127.0.0.1", port))
            while len(started) < 3:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert ended == [-math.inf] * 3  # all ended before the task group did
    for client in clients:
        await client.aclose()


async def test_a_handlers_exception_ends_the_accept_loop_and_is_raised_from_it() -> None:
    class Boom(Exception):
        pass

    async def fails(stream: AsyncioByteStream) -> None:
        async with stream:
            raise Boom

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    async with listener:
        client = await _asyncio_stream.connect("127.0.0.1", port)  # waits in the backlog
        with anyio.fail_after(10), pytest.raises(Boom):
            await _asyncio_stream.serve_accepted(listener, fails)
        await client.aclose()
