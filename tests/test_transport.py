"""SessionTransport over in-memory sockets with injected faults (docs/design.md#transport).

A :class:`FakeSocket` is a scripted ``MessageSocket``: the test feeds it inbound WebSocket messages
(hand-encoded session packets), ends it, or makes it fail, and reads what the transport wrote.
Waiting uses ``anyio.wait_all_tasks_blocked`` or bounded polling, never a bare sleep.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from faultutil import PeakRss
from linkutil import wait_until

from garcon_link.core.session import MessageSession, SessionState, encoded_message_size
from garcon_link.core.wire import (
    Message,
    Ordinal,
    Receipt,
    decode_packets,
    encode_message,
    encode_receipt,
)
from garcon_link.endpoint import transport as transport_module
from garcon_link.endpoint.transport import COALESCE_BYTES, SessionTransport, TransportState
from garcon_link.errors import (
    FailureReason,
    FrameTooLarge,
    MalformedFrame,
    PayloadTooLarge,
    SessionFailed,
)
from garcon_link.limits import Limits

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

DEADLINE = 5.0
SESSION_ID = b"S" * 32
PEER_RUNTIME = b"R" * 16


class FakeSocket:
    """A scripted socket: ``feed`` inbound messages, ``end`` it, or make writes fail."""

    def __init__(self) -> None:
        self._tx, self._rx = anyio.create_memory_object_stream[bytes | None | Exception](100)
        self.written: list[bytes] = []
        self.fail_writes: Exception | None = None
        self.block_writes = False
        self._unblock = anyio.Event()
        self.nowait = False  # offer synchronous writes (the link's asyncio sockets do)
        self.nowait_writes = 0
        self.reads = 0  # receive_message() calls

    def feed(self, *packets: bytes) -> None:
        """One inbound WebSocket message holding ``packets``."""
        self._tx.send_nowait(b"".join(packets))

    def end(self) -> None:
        self._tx.send_nowait(None)

    def raise_on_read(self, exc: Exception) -> None:
        self._tx.send_nowait(exc)

    def unblock(self) -> None:
        self.block_writes = False
        self._unblock.set()

    async def send_message(self, data: bytes) -> None:
        if self.block_writes:
            await self._unblock.wait()
        if self.fail_writes is not None:
            raise self.fail_writes
        self.written.append(data)

    def retired_by_peer(self) -> str | None:
        return None

    def writable_now(self) -> bool:
        return self.nowait and not self.block_writes and self.fail_writes is None

    def send_message_nowait(self, data: bytes) -> None:
        assert self.writable_now()
        self.written.append(data)
        self.nowait_writes += 1

    async def receive_message(self) -> bytes | None:
        self.reads += 1
        try:
            item = await self._rx.receive()
        except anyio.EndOfStream:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def packets(self) -> list[Message | Receipt]:
        return [p for data in self.written for p in decode_packets(data, 1 << 30)]

    def bodies(self) -> list[bytes]:
        return [bytes(p.body) for p in self.packets() if isinstance(p, Message)]

    def close(self) -> None:
        self._tx.close()
        self._rx.close()


def msg(ordinal: int, body: bytes) -> bytes:
    return encode_message(ordinal, body)


def rcpt(through: int) -> bytes:
    return encode_receipt(through)


class Harness:
    """A transport, its task group, a consumer that records payloads, and helpers."""

    def __init__(self, transport: SessionTransport, tg: anyio.abc.TaskGroup) -> None:
        self.t = transport
        self.tg = tg
        self.received: list[bytes] = []
        self.states: list[TransportState] = []
        self.queued_at_ready: list[int] = []
        self.sockets: list[FakeSocket] = []
        self.run_errors: list[BaseException] = []
        self.consuming = anyio.Event()
        transport.add_listener(self._on_state)

    def _on_state(self, state: TransportState) -> None:
        self.states.append(state)
        if state is TransportState.READY:
            self.queued_at_ready.append(self.t.statistics().queued_payloads)

    async def consume(self) -> None:
        await self.consuming.wait()
        try:
            async with self.t.payloads() as stream:
                async for payload in stream:
                    self.received.append(payload)
        except anyio.ClosedResourceError:
            pass  # the test closed the stream itself

    def attach(self, peer_received: int = 0, sock: FakeSocket | None = None) -> FakeSocket:
        sock = sock or FakeSocket()
        self.sockets.append(sock)

        async def run() -> None:
            try:
                await self.t.run(sock, peer_received)
            except SessionFailed as exc:
                self.run_errors.append(exc)

        self.tg.start_soon(run)
        return sock


@asynccontextmanager
async def harness(limits: Limits | None = None, *, consume: bool = True) -> AsyncIterator[Harness]:
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            h = Harness(SessionTransport(SESSION_ID, PEER_RUNTIME, limits or Limits(), tg), tg)
            tg.start_soon(h.consume)
            if consume:
                h.consuming.set()
            try:
                yield h
            finally:
                h.t.retire(FailureReason.CLOSED, "test over")
                h.consuming.set()
                for sock in h.sockets:
                    sock.close()
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()


async def settle() -> None:
    await anyio.wait_all_tasks_blocked()


# ------------------------------------------------------------------------------------------------
# readiness, the fence and the pre-readiness buffer


async def test_fresh_attachment_writes_the_fence_and_is_ready_on_the_peers_fence() -> None:
    async with harness() as h:
        assert h.t.state is TransportState.DETACHED and not h.t.attached
        sock = h.attach()
        await settle()
        assert h.t.state is TransportState.REPLAYING and h.t.attached
        assert sock.packets() == [Receipt(0)]  # our trailing receipt: the peer's fence
        sock.feed(rcpt(0))
        await settle()
        assert h.t.state is TransportState.READY
        assert h.states == [TransportState.REPLAYING, TransportState.READY]


async def test_payloads_before_the_fence_are_buffered_and_drain_in_order_before_ready() -> None:
    async with harness() as h:
        sock = h.attach()
        sock.feed(msg(1, b"a"), msg(2, b"b"))
        sock.feed(msg(3, b"c"))
        await settle()
        stats = h.t.statistics()
        assert h.t.state is TransportState.REPLAYING
        assert stats.buffered_payloads == 3 and stats.buffered_bytes == 3
        assert h.received == []  # nothing reaches the consumer before the fence
        # Receipts for them still go out (the peer may evict), but readiness waits.
        await wait_until(lambda: Receipt(3) in sock.packets())
        sock.feed(rcpt(0))
        await settle()
        assert h.t.state is TransportState.READY
        assert h.received == [b"a", b"b", b"c"]
        assert h.t.statistics().buffered_payloads == 0


async def test_buffered_payloads_are_queued_before_ready_with_a_stalled_consumer() -> None:
    async with harness(consume=False) as h:
        sock = h.attach()
        sock.feed(msg(1, b"a"), msg(2, b"b"), rcpt(0))
        await settle()
        assert h.t.state is TransportState.READY
        assert h.queued_at_ready == [2]  # in the delivery queue when READY was announced
        h.consuming.set()
        await wait_until(lambda: h.received == [b"a", b"b"])


async def test_buffered_payloads_count_as_buffered_until_the_consumer_takes_them() -> None:
    limits = Limits(delivery_queue=2)
    async with harness(limits, consume=False) as h:
        sock = h.attach()
        sock.feed(*(msg(i, f"p{i}".encode()) for i in range(1, 7)))
        await settle()
        assert h.t.statistics().buffered_payloads == 6
        sock.feed(rcpt(0))
        await wait_until(lambda: h.t.statistics().queued_payloads == 3)  # 2 queued, 1 handed over
        stats = h.t.statistics()
        assert stats.buffered_payloads == 3 and stats.buffered_bytes == 6
        assert h.t.state is TransportState.REPLAYING  # not READY before they are all queued
        h.consuming.set()
        await wait_until(lambda: h.t.state is TransportState.READY)
        await wait_until(lambda: len(h.received) == 6)
        assert h.received == [f"p{i}".encode() for i in range(1, 7)]
        assert h.t.statistics().buffered_payloads == 0


async def test_fence_in_the_same_message_after_the_replay() -> None:
    async with harness() as h:
        sock = h.attach()
        sock.feed(msg(1, b"a"), msg(2, b"b"), rcpt(0), msg(3, b"c"))
        await wait_until(lambda: h.received == [b"a", b"b", b"c"])
        assert h.t.state is TransportState.READY


async def test_pre_readiness_buffer_survives_another_detach() -> None:
    async with harness() as h:
        first = h.attach()
        first.feed(msg(1, b"a"), msg(2, b"b"))
        await settle()
        first.end()
        await settle()
        assert h.t.state is TransportState.DETACHED
        assert h.t.statistics().buffered_payloads == 2 and h.received == []
        second = h.attach(peer_received=0)
        second.feed(msg(2, b"b"), msg(3, b"c"))  # the peer replays; 2 is a duplicate
        await settle()
        # Handed over before the next attachment read anything; its own replay is buffered.
        assert h.received == [b"a", b"b"] and h.t.statistics().buffered_payloads == 1
        assert h.t.state is TransportState.REPLAYING
        second.feed(rcpt(0))
        await wait_until(lambda: h.received == [b"a", b"b", b"c"])
        assert h.t.state is TransportState.READY
        assert h.t.statistics().session.duplicates_suppressed == 1
        assert h.t.statistics().attachments == 2


@pytest.mark.parametrize("after_a_cut", [False, True], ids=["first", "after-a-cut"])
@pytest.mark.parametrize("bound", ["payloads", "bytes"])
async def test_pre_readiness_buffer_overflow_retires_the_session(
    bound: str, after_a_cut: bool
) -> None:
    """A peer that sends more before its fence than the bound (more than an honest peer's
    retention holds) is retired -- also on an attachment that follows one cut before its
    fence, whose payloads are handed over first and do not count."""
    limits = (
        Limits(max_inbound_buffer_payloads=3)
        if bound == "payloads"
        else Limits(max_inbound_buffer_bytes=10)
    )
    async with harness(limits) as h:
        first = 0
        if after_a_cut:
            cut = h.attach()
            cut.feed(msg(1, b"xx"), msg(2, b"xx"))
            await settle()
            cut.end()
            await wait_until(lambda: h.t.state is TransportState.DETACHED)
            first = 2
        sock = h.attach()
        for i in range(first + 1, first + 5):
            sock.feed(msg(i, b"xxxx"))
        await settle()
        assert h.t.state is TransportState.RETIRED
        failure = h.t.failure
        assert failure is not None and failure.reason is FailureReason.INBOUND_OVERFLOW
        assert h.run_errors == [failure]


async def test_an_honest_replay_after_a_cut_before_the_fence_fits_in_the_buffer() -> None:
    """Regression (chaos soak, worker:INBOUND_OVERFLOW): payloads an attachment accepted before
    its fence were acknowledged, so the peer evicted them and may retain a full window of new
    frames. After a cut before the fence, the next attachment hands them over before it reads,
    and the peer's replay of that window fits in the buffer beside nothing."""
    limits = Limits(max_inbound_buffer_payloads=4)
    async with harness(limits) as h:
        first = h.attach()
        first.feed(msg(1, b"p1"), msg(2, b"p2"))
        first.feed(msg(3, b"p3"))
        await wait_until(lambda: Receipt(3) in first.packets())  # the peer evicts 1..3
        first.end()
        await wait_until(lambda: h.t.state is TransportState.DETACHED)
        assert h.t.statistics().buffered_payloads == 3 and h.received == []  # kept while detached
        second = h.attach(peer_received=0)
        # The peer replays its whole retention (four new frames), then its fence.
        second.feed(*(msg(i, b"p%d" % i) for i in range(4, 8)))
        await settle()
        assert h.t.failure is None
        assert h.received == [b"p1", b"p2", b"p3"]  # handed over before the replay was read
        assert h.t.statistics().buffered_payloads == 4
        assert h.t.state is TransportState.REPLAYING
        second.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        await wait_until(lambda: len(h.received) == 7)
        assert h.received == [b"p%d" % i for i in range(1, 8)]
        assert h.t.failure is None and h.run_errors == []


async def test_a_new_attachment_reads_only_once_payloads_released_earlier_are_queued() -> None:
    """Regression: payloads released at a fence whose delivery a cut interrupted (the consumer
    is slow) were acknowledged, so the peer may replay a full new window on the next socket:
    the next attachment reads nothing until they are queued (back-pressure), so the buffer
    holds only that window -- and the replay deadline does not run meanwhile."""
    limits = Limits(max_inbound_buffer_payloads=4, delivery_queue=1, replay_inactivity=0.1)
    async with harness(limits, consume=False) as h:
        first = h.attach()
        # The replay and the fence: the four are released to the stalled consumer.
        first.feed(*(msg(i, b"p%d" % i) for i in range(1, 5)), rcpt(0))
        await wait_until(lambda: Receipt(4) in first.packets())  # the peer evicts 1..4
        stats = h.t.statistics()
        assert h.t.state is TransportState.REPLAYING and stats.buffered_payloads > 0
        h.t.detach_socket()  # a cut while the reader waits for the consumer
        await wait_until(lambda: h.t.state is TransportState.DETACHED)
        second = h.attach(peer_received=0)
        # The peer's new window (its whole retention), then its fence.
        second.feed(*(msg(i, b"p%d" % i) for i in range(5, 9)))
        second.feed(rcpt(0))
        await settle()
        assert h.t.failure is None and h.t.state is TransportState.REPLAYING
        assert second.reads == 0  # back-pressure: nothing read while the consumer is behind
        await anyio.sleep(limits.replay_inactivity * 2)  # our consumer's time, not the peer's
        assert h.t.failure is None and second.reads == 0
        h.consuming.set()
        await wait_until(lambda: h.t.state is TransportState.READY)
        await wait_until(lambda: len(h.received) == 8)
        assert h.received == [b"p%d" % i for i in range(1, 9)]
        assert h.t.failure is None and h.run_errors == []


# ------------------------------------------------------------------------------------------------
# sending, retention and the writer


async def test_send_while_detached_is_replayed_on_attach() -> None:
    async with harness() as h:
        assert await h.t.send(b"one") == 1
        assert await h.t.send(b"two") == 2
        assert h.t.offered == 0
        sock = h.attach()
        await settle()
        assert sock.bodies() == [b"one", b"two"]
        assert sock.packets()[-1] == Receipt(0)  # the trailing receipt comes after the replay
        assert h.t.offered == 2


async def test_packets_ready_together_are_coalesced_into_one_message() -> None:
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        written = len(sock.written)
        for i in range(10):
            h.t.try_send(f"m{i}".encode())
        await settle()
        assert len(sock.written) == written + 1
        assert sock.bodies() == [f"m{i}".encode() for i in range(10)]


@pytest.fixture
def never_quiet_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    """No frame is ever issued long enough after the previous one to be written at once."""
    monkeypatch.setattr(transport_module, "WRITE_NOW_QUIET", 3600.0)


@pytest.fixture
def always_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every frame counts as issued on a quiet socket (written at once when possible)."""
    monkeypatch.setattr(transport_module, "WRITE_NOW_QUIET", 0.0)


def attach_nowait(h: Harness) -> FakeSocket:
    """Attach a socket that offers synchronous writes, as the link's asyncio sockets do."""
    sock = h.attach()
    sock.nowait = True
    return sock


@pytest.mark.usefixtures("always_quiet")
async def test_a_frame_issued_on_a_quiet_socket_is_written_at_once_with_the_receipt() -> None:
    async with harness(Limits(receipt_delay=60.0)) as h:  # the receipt waits for the reply
        sock = attach_nowait(h)
        await settle()  # our fence is out
        sock.feed(rcpt(0), msg(1, b"request"))
        await wait_until(lambda: h.received == [b"request"])
        written = len(sock.written)
        h.t.try_send(b"reply")  # no await: written synchronously, by this task
        assert sock.nowait_writes == 1 and len(sock.written) == written + 1
        assert decode_packets(sock.written[-1], 1 << 20) == [
            Message(Ordinal(1), b"reply"),
            Receipt(1),
        ]
        await settle()
        assert len(sock.written) == written + 1  # the writer had nothing left to send


@pytest.mark.usefixtures("never_quiet_enough")
async def test_frames_issued_in_a_burst_are_left_to_the_writer_which_coalesces_them() -> None:
    async with harness() as h:
        sock = attach_nowait(h)
        sock.feed(rcpt(0))
        await settle()
        written, at_once = len(sock.written), sock.nowait_writes
        for i in range(10):
            h.t.try_send(f"m{i}".encode())
        await settle()
        # The first may go at once (nothing was issued before it); the nine others, one message.
        at_once = sock.nowait_writes - at_once
        assert at_once <= 1
        assert len(sock.written) == written + 1 + at_once
        assert sock.bodies() == [f"m{i}".encode() for i in range(10)]


@pytest.mark.usefixtures("always_quiet")
async def test_no_frame_is_written_at_once_before_the_fence() -> None:
    async with harness() as h:
        sock = attach_nowait(h)
        await settle()
        h.t.try_send(b"early")  # still replaying: the writer keeps the replay order
        await settle()
        assert sock.nowait_writes == 0 and sock.bodies() == [b"early"]


@pytest.mark.usefixtures("always_quiet")
async def test_a_failed_immediate_write_detaches_and_the_frame_is_replayed() -> None:
    async with harness() as h:
        sock = attach_nowait(h)
        sock.feed(rcpt(0))
        await settle()

        def broken(data: bytes) -> None:
            raise anyio.BrokenResourceError

        sock.send_message_nowait = broken  # type: ignore[method-assign]
        h.t.try_send(b"lost with the socket")
        await wait_until(lambda: h.t.state is TransportState.DETACHED)
        assert h.t.failure is None and h.run_errors == []
        again = h.attach(peer_received=0)
        await settle()
        assert again.bodies() == [b"lost with the socket"]


async def test_coalescing_respects_the_frame_limit() -> None:
    limits = Limits(max_frame_bytes=64 * 1024, max_handshake_frame_bytes=1024)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        sock.written.clear()
        for i in range(5):
            h.t.try_send(bytes([i]) * 30_000)
        await settle()
        assert len(sock.written) >= 3
        assert all(len(m) <= limits.max_frame_bytes for m in sock.written)
        assert sock.bodies() == [bytes([i]) * 30_000 for i in range(5)]


async def test_coalescing_stops_at_coalesce_bytes_and_big_packets_go_alone() -> None:
    # Regression: merging up to max_frame_bytes (16 MiB) multiplied peak memory with retention
    # full; merging is for small packets, so merged messages stop at COALESCE_BYTES.
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        sock.written.clear()
        big = COALESCE_BYTES  # a single packet over the cap (its encoding adds a few bytes)
        sizes = [10, 20, big, 30, 40, COALESCE_BYTES // 3, COALESCE_BYTES // 3, COALESCE_BYTES // 3]
        for i, size in enumerate(sizes):
            h.t.try_send(bytes([i]) * size)
        await settle()
        assert sock.bodies() == [bytes([i]) * size for i, size in enumerate(sizes)]
        lone = [m for m in sock.written if len(m) > COALESCE_BYTES]
        assert len(lone) == 1  # the big packet, alone in its message
        assert [
            len(p.body) for p in decode_packets(lone[0], 1 << 30) if isinstance(p, Message)
        ] == [big]
        assert all(len(m) <= COALESCE_BYTES for m in sock.written if m is not lone[0])
        assert len(sock.written) >= 4  # small ones merged, three thirds do not all fit in one


async def test_a_payload_over_the_frame_limit_is_refused_without_an_ordinal() -> None:
    limits = Limits(max_frame_bytes=1024, max_handshake_frame_bytes=512)
    async with harness(limits) as h:
        with pytest.raises(PayloadTooLarge):
            await h.t.send(b"x" * 1024)
        assert await h.t.send(b"fits") == 1


async def test_full_retention_makes_send_wait_and_receipts_release_it() -> None:
    limits = Limits(max_retained_frames=2)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await h.t.send(b"1")
        await h.t.send(b"2")
        assert not h.t.has_capacity(1) and h.t.try_send(b"x") is None
        done: list[int] = []

        async def third() -> None:
            done.append(await h.t.send(b"3"))

        h.tg.start_soon(third)
        await settle()
        assert done == []  # waiting, not failed
        assert h.t.state is TransportState.READY and h.t.failure is None
        sock.feed(rcpt(1))
        await wait_until(lambda: done == [3])
        stats = h.t.statistics().session
        assert stats.confirmed == 1 and stats.retained_frames == 2
        assert sock.bodies() == [b"1", b"2", b"3"]


async def test_waiting_senders_are_admitted_in_the_order_they_called() -> None:
    """Regression: senders waiting for retention retried in wake-up order (not FIFO on trio),
    so call ids reached the worker out of order and it dropped them as "does not increase";
    a newcomer could also pass the waiters when a receipt freed room."""
    limits = Limits(max_retained_frames=1)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await h.t.send(b"0")
        order: list[bytes] = []

        async def sender(body: bytes) -> None:
            await h.t.send(body)
            order.append(body)

        waiting = [str(i).encode() for i in range(1, 9)]
        for body in waiting:
            h.tg.start_soon(sender, body)
            await settle()  # each is waiting before the next calls send()
        assert order == []
        for through in range(1, 9):
            sock.feed(rcpt(through))
            await wait_until(lambda n=through: len(order) == n)  # type: ignore[misc]
        assert order == waiting
        assert sock.bodies() == [b"0", *waiting]


async def test_send_nowait_keeps_behind_waiting_senders_and_try_send_goes_ahead() -> None:
    """A sender waits for room for a large body; retention still admits a small one:
    ``send_nowait`` issues nothing (it keeps the order of the waiting senders), ``try_send``
    issues it ahead of them."""
    limits = Limits(max_retained_bytes=4096, max_frame_bytes=4096, max_handshake_frame_bytes=2048)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await h.t.send(b"a" * 3000)
        done: list[int] = []

        async def large() -> None:
            done.append(await h.t.send(b"b" * 3000))

        h.tg.start_soon(large)
        await settle()
        assert done == [] and h.t.has_capacity(16)
        assert h.t.send_nowait(b"small") is None
        assert h.t.try_send(b"small") == 2
        await wait_until(lambda: sock.bodies() == [b"a" * 3000, b"small"])
        sock.feed(rcpt(2))
        await wait_until(lambda: done == [3])
        assert sock.bodies() == [b"a" * 3000, b"small", b"b" * 3000]


async def test_a_freed_slot_wakes_one_waiting_sender_not_all() -> None:
    """Each waiting sender has its own event: a receipt that frees one slot wakes the first in
    line only (one wake-up, however many wait), and room for several is handed down the line,
    one wake-up per sender admitted."""
    limits = Limits(max_retained_frames=1)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await h.t.send(b"0")
        order: list[bytes] = []

        async def sender(body: bytes) -> None:
            await h.t.send(body)
            order.append(body)

        waiting = [str(i).encode() for i in range(1, 9)]
        for body in waiting:
            h.tg.start_soon(sender, body)
            await settle()  # each is waiting before the next calls send()
        assert order == [] and h.t.statistics().capacity_wakeups == 0
        for through in range(1, 9):
            sock.feed(rcpt(through))
            await wait_until(lambda n=through: len(order) == n)  # type: ignore[misc]
            await settle()
            assert h.t.statistics().capacity_wakeups == through
        assert order == waiting

    limits = Limits(max_retained_frames=4)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        for i in range(4):
            await h.t.send(b"%d" % i)
        done: list[int] = []

        async def waiter(body: bytes) -> None:
            done.append(await h.t.send(body))

        for body in (b"a", b"b", b"c", b"d", b"e"):
            h.tg.start_soon(waiter, body)
        await settle()
        assert done == []
        sock.feed(rcpt(3))  # three slots: the first three senders, one wake-up each
        await wait_until(lambda: len(done) == 3)
        await settle()
        assert done == [5, 6, 7]
        assert h.t.statistics().capacity_wakeups == 3
        sock.feed(rcpt(7))
        await wait_until(lambda: len(done) == 5)
        assert done == [5, 6, 7, 8, 9] and h.t.statistics().capacity_wakeups == 5


async def test_waiting_sender_is_released_when_the_resume_position_confirms_its_frames() -> None:
    """Regression: receipts lost with the old socket, the peer's hello confirmed them; the
    attach freed retention but never woke the sender waiting for capacity (it hung)."""
    limits = Limits(max_retained_frames=2)
    async with harness(limits) as h:
        first = h.attach()
        first.feed(rcpt(0))
        await h.t.send(b"1")
        await h.t.send(b"2")
        done: list[int] = []

        async def third() -> None:
            done.append(await h.t.send(b"3"))

        h.tg.start_soon(third)
        await settle()
        assert done == []
        first.end()  # the receipts for 1 and 2 never arrived
        await settle()
        second = h.attach(peer_received=2)  # ... but the peer has them
        second.feed(rcpt(0))  # its fence is stale: nothing new
        await wait_until(lambda: done == [3])
        # send() returns once the frame is retained; the writer task writes it after that.
        await wait_until(lambda: second.bodies() != [])
        assert second.bodies() == [b"3"]  # 1 and 2 are not replayed


async def test_write_failure_detaches_and_keeps_the_session() -> None:
    """Regression: a write to a dead socket escaped the transport (and crashed the link)."""
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        sock.fail_writes = anyio.BrokenResourceError()
        await h.t.send(b"lost with the socket")
        await wait_until(lambda: h.t.state is TransportState.DETACHED)
        assert h.t.failure is None and h.run_errors == []
        again = h.attach(peer_received=0)
        await settle()
        assert again.bodies() == [b"lost with the socket"]


@pytest.mark.parametrize(
    "exc",
    [MalformedFrame("text frame"), FrameTooLarge(20 << 20, 16 << 20)],
    ids=["text", "too-big"],
)
async def test_protocol_error_from_the_socket_retires_the_session(exc: Exception) -> None:
    """Regression: a ProtocolError from receive_message escaped the transport (and the link)."""
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"kept"))
        sock.raise_on_read(exc)
        await wait_until(lambda: h.t.state is TransportState.RETIRED)
        failure = h.t.failure
        assert failure is not None and failure.reason is FailureReason.MALFORMED_PACKET
        # run() raises once its pumps have ended, a few task switches after the retirement.
        await wait_until(lambda: h.run_errors == [failure])
        await wait_until(lambda: h.received == [b"kept"])


# ------------------------------------------------------------------------------------------------
# delivery: ordered, back-pressured, never lost when a socket ends


async def test_payloads_accepted_while_the_consumer_stalls_survive_a_socket_end() -> None:
    """Regression: a socket that ended while the reader waited for the consumer dropped the
    rest of the batch it had already accepted (and acknowledged): lost for good."""
    limits = Limits(delivery_queue=2)
    async with harness(limits, consume=False) as h:
        sock = h.attach()
        sock.feed(rcpt(0), *(msg(i, f"p{i}".encode()) for i in range(1, 9)))
        await settle()
        assert h.t.accepted == 8  # the session accepted the whole batch ...
        h.t.detach_socket()  # ... and then the socket ends (heartbeat, cut, takeover)
        await wait_until(lambda: h.t.state is TransportState.DETACHED)
        h.consuming.set()
        await wait_until(lambda: len(h.received) == 8)
        assert h.received == [f"p{i}".encode() for i in range(1, 9)]


async def test_slow_consumer_back_pressures_the_reader_not_the_session() -> None:
    limits = Limits(delivery_queue=2)
    async with harness(limits, consume=False) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        for i in range(1, 11):
            sock.feed(msg(i, f"p{i}".encode()))
        await settle()
        # The reader stopped pulling messages: the queue and one batch in hand, no more.
        assert h.t.accepted < 10
        assert h.t.statistics().queued_payloads <= limits.delivery_queue + 1
        assert h.t.state is TransportState.READY and h.t.failure is None
        h.consuming.set()
        await wait_until(lambda: len(h.received) == 10)
        assert h.received == [f"p{i}".encode() for i in range(1, 11)]


# ------------------------------------------------------------------------------------------------
# inbound order and malformed packets


async def test_duplicates_are_suppressed_and_a_gap_retires() -> None:
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"a"))
        sock.feed(msg(1, b"a"), msg(2, b"b"))
        await wait_until(lambda: h.received == [b"a", b"b"])
        assert h.t.statistics().session.duplicates_suppressed == 1
        sock.feed(msg(4, b"d"))
        await wait_until(lambda: h.t.state is TransportState.RETIRED)
        failure = h.t.failure
        assert failure is not None and failure.reason is FailureReason.GAP


async def test_receipt_beyond_offered_retires() -> None:
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(5))
        await wait_until(lambda: h.t.state is TransportState.RETIRED)
        failure = h.t.failure
        assert failure is not None and failure.reason is FailureReason.RECEIPT_BEYOND_OFFERED


async def test_a_resume_position_outside_the_replayable_range_retires() -> None:
    async with harness() as h:
        await h.t.send(b"never written")
        sock = FakeSocket()
        h.sockets.append(sock)
        with pytest.raises(SessionFailed) as info:
            await h.t.run(sock, 1)  # the peer claims a frame that was never offered
        assert info.value.reason is FailureReason.RESUME_REFUSED
        assert h.t.state is TransportState.RETIRED


# ------------------------------------------------------------------------------------------------
# deadlines: replay inactivity and grace


async def test_replay_stall_retires_although_the_socket_stays_open() -> None:
    limits = Limits(replay_inactivity=0.2)
    async with harness(limits) as h:
        first = h.attach()
        first.feed(rcpt(0))
        await h.t.send(b"x")
        await settle()
        first.end()
        await settle()
        second = h.attach(peer_received=0)
        start = anyio.current_time()
        await wait_until(lambda: h.t.state is TransportState.RETIRED, timeout=3.0)
        assert anyio.current_time() - start >= 0.2 * 0.9
        failure = h.t.failure
        assert failure is not None and failure.reason is FailureReason.REPLAY_STALLED
        assert second.bodies() == [b"x"]  # it was replayed; no receipt ever came back


async def test_replay_progress_refreshes_the_inactivity_deadline() -> None:
    limits = Limits(replay_inactivity=0.3)
    async with harness(limits) as h:
        sock = h.attach()
        # Keep making progress (new ordinals) for longer than the deadline, fence last.
        for i in range(1, 8):
            sock.feed(msg(i, b"p"))
            await anyio.sleep(0.1)
            assert h.t.state is TransportState.REPLAYING
        sock.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        assert h.t.failure is None


async def test_grace_expiry_retires_a_detached_session() -> None:
    limits = Limits(detached_grace=0.2)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        sock.end()
        start = anyio.current_time()
        await wait_until(lambda: h.t.state is TransportState.RETIRED, timeout=3.0)
        assert anyio.current_time() - start >= 0.2 * 0.9
        failure = h.t.failure
        assert failure is not None and failure.reason is FailureReason.GRACE_EXPIRED


async def test_reattaching_within_grace_cancels_the_expiry() -> None:
    limits = Limits(detached_grace=0.3)
    async with harness(limits) as h:
        first = h.attach()
        first.feed(rcpt(0))
        await settle()
        first.end()
        await settle()
        second = h.attach()
        second.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        await anyio.sleep(0.6)  # let the old grace deadline pass: nothing may happen
        assert h.t.state is TransportState.READY and h.t.failure is None


# ------------------------------------------------------------------------------------------------
# retirement


async def test_retire_ends_delivery_after_accepted_payloads_and_fails_senders() -> None:
    limits = Limits(max_retained_frames=1)
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"a"), msg(2, b"b"))
        await wait_until(lambda: h.received == [b"a", b"b"])
        await h.t.send(b"1")
        errors: list[BaseException] = []

        async def blocked() -> None:
            try:
                await h.t.send(b"2")
            except SessionFailed as exc:
                errors.append(exc)

        h.tg.start_soon(blocked)
        await settle()
        failure = h.t.retire(FailureReason.GRACE_EXPIRED, "test")
        assert h.t.retire(FailureReason.CLOSED) is failure  # idempotent, first cause kept
        await wait_until(lambda: errors == [failure])
        assert h.t.state is TransportState.RETIRED
        # run() detaches and raises once its pumps have ended, a few task switches later.
        await wait_until(lambda: not h.t.attached and h.run_errors == [failure])
        with pytest.raises(SessionFailed):
            await h.t.send(b"late")
        with pytest.raises(SessionFailed):
            h.t.try_send(b"late")
        assert not h.t.has_capacity(1)
        assert h.t.statistics().session.state is SessionState.FAILED
        assert h.t.statistics().session.retained_frames == 0


async def test_retire_hands_over_payloads_buffered_before_the_fence() -> None:
    async with harness() as h:
        sock = h.attach()
        sock.feed(msg(1, b"a"), msg(2, b"b"))
        await settle()
        h.t.retire(FailureReason.PEER_RETIRED)
        await wait_until(lambda: h.received == [b"a", b"b"])


async def test_listener_errors_do_not_break_the_transport() -> None:
    async with harness() as h:

        def broken(state: TransportState) -> None:
            raise RuntimeError("listener bug")

        seen: list[TransportState] = []
        unsubscribe = h.t.add_listener(broken)
        h.t.add_listener(seen.append)
        sock = h.attach()
        sock.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        assert seen == [TransportState.REPLAYING, TransportState.READY]
        unsubscribe()
        unsubscribe()  # idempotent


async def test_statistics_track_the_session_and_the_sockets() -> None:
    async with harness() as h:
        sock = h.attach()
        await wait_until(lambda: len(sock.written) == 1)  # our fence
        sock.feed(rcpt(0), msg(1, b"in"))
        await wait_until(lambda: h.received == [b"in"] and len(sock.written) == 2)  # a receipt
        await h.t.send(b"out-1")
        await h.t.send(b"out-2")
        await wait_until(lambda: len(sock.written) == 3)  # both, coalesced
        sock.feed(rcpt(2))
        await wait_until(lambda: h.t.statistics().session.confirmed == 2)
        stats = h.t.statistics()
        assert stats.state is TransportState.READY
        assert stats.attachments == 1
        assert stats.messages_read == 2 and stats.messages_written == 3
        assert stats.buffered_payloads == 0 and stats.buffered_bytes == 0
        assert stats.queued_payloads == 0
        s = stats.session
        assert (s.issued, s.offered, s.confirmed, s.accepted) == (2, 2, 2, 1)
        assert s.retained_frames == 0 and s.retained_bytes == 0
        assert s.receipts_received == 2 and s.receipts_sent == 2 and s.delivered == 1
        assert s.replays == 0 and s.duplicates_suppressed == 0
        # A snapshot does not change afterwards.
        await h.t.send(b"out-3")
        assert stats.session.issued == 2
        assert h.t.statistics().session.retained_bytes == encoded_message_size(3, 5)


async def test_a_consumer_that_closes_its_stream_does_not_break_the_session() -> None:
    """Payloads nobody will read are dropped; the session itself carries on."""
    async with harness(consume=False) as h:
        h.t.payloads().close()
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"a"), msg(2, b"b"))
        await wait_until(lambda: h.t.accepted == 2 and Receipt(2) in sock.packets())
        sock.feed(msg(3, b"c"))
        await wait_until(lambda: Receipt(3) in sock.packets())
        assert h.t.state is TransportState.READY and h.t.failure is None
        assert h.t.statistics().queued_payloads == 0


# ------------------------------------------------------------------------------------------------
# consume(): a direct, non-blocking consumer instead of the payload stream


@dataclass
class Direct:
    """A :class:`~garcon_link.endpoint.transport.PayloadConsumer` that only delivers: it never
    asks the reader to yield or to hold, and counts the ends of messages."""

    deliver: Callable[[bytes | memoryview], None]
    yield_first: bool = False
    batches: int = 0

    def wants_yield(self) -> bool:
        return self.yield_first

    def hold(self) -> anyio.Event | None:
        return None

    def batch_end(self) -> None:
        self.batches += 1


async def test_direct_consumer_takes_over_in_order_from_a_stalled_queue() -> None:
    """Payloads already in the queue, in the delivery task's hands and pending reach the direct
    consumer first, in order; later ones are handed to it straight from the reader."""
    limits = Limits(delivery_queue=2)
    async with harness(limits, consume=False) as h:
        sock = h.attach()
        sock.feed(rcpt(0), *(msg(i, f"p{i}".encode()) for i in range(1, 7)))
        await settle()
        stats = h.t.statistics()  # all accepted: queue full, one in flight, the rest pending
        assert h.t.accepted == 6 and stats.queued_payloads + stats.buffered_payloads == 6
        direct: list[bytes | memoryview] = []
        h.tg.start_soon(h.t.consume, Direct(direct.append))
        await wait_until(lambda: len(direct) == 6)
        sock.feed(msg(7, b"p7"), msg(8, b"p8"))
        await wait_until(lambda: len(direct) == 8)
        assert direct == [f"p{i}".encode() for i in range(1, 9)]
        assert h.t.statistics().queued_payloads == 0


async def test_direct_consumer_returns_at_retirement_with_pre_fence_payloads_handed_over() -> None:
    async with harness(consume=False) as h:
        direct: list[bytes | memoryview] = []
        done = anyio.Event()

        async def consume() -> None:
            await h.t.consume(Direct(direct.append))
            done.set()

        h.tg.start_soon(consume)
        sock = h.attach()
        sock.feed(msg(1, b"a"), msg(2, b"b"))  # before the fence: buffered, not delivered
        await settle()
        assert direct == [] and not done.is_set()
        h.t.retire(FailureReason.PEER_RETIRED)
        await done.wait()
        assert direct == [b"a", b"b"]


async def test_a_failing_direct_consumer_loses_only_that_payload(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with harness(consume=False) as h:
        direct: list[bytes | memoryview] = []

        def consumer(body: bytes | memoryview) -> None:
            if body == b"bad":
                raise RuntimeError("consumer bug")
            direct.append(body)

        h.tg.start_soon(h.t.consume, Direct(consumer))
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"a"), msg(2, b"bad"), msg(3, b"c"))
        await wait_until(lambda: len(direct) == 2)
        assert direct == [b"a", b"c"]
        assert h.t.state is TransportState.READY and h.t.failure is None
        assert "consumer failed" in caplog.text


async def test_consume_takes_the_consumers_methods_once_and_ends_every_message() -> None:
    """batch_end follows the payloads of each message (a payload from the queue is a message of
    its own); the reader calls the methods consume() took, not what the consumer holds later."""
    async with harness(Limits(delivery_queue=2), consume=False) as h:
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"q1"), msg(2, b"q2"))  # queued: nothing consumes yet
        await settle()
        direct: list[bytes | memoryview] = []
        consumer = Direct(direct.append)
        h.tg.start_soon(h.t.consume, consumer)
        await wait_until(lambda: len(direct) == 2)
        assert consumer.batches == 2
        later: list[bytes | memoryview] = []
        consumer.deliver = later.append
        sock.feed(msg(3, b"a") + msg(4, b"b"))  # one message, two payloads
        await wait_until(lambda: len(direct) == 4)
        assert direct == [b"q1", b"q2", b"a", b"b"] and later == []
        assert consumer.batches == 3


# ------------------------------------------------------------------------------------------------
# writes held while one inbound message is handed to a direct consumer


@asynccontextmanager
async def relay_target(
    h: Harness, limits: Limits | None = None, *, nowait: bool = True
) -> AsyncIterator[tuple[SessionTransport, FakeSocket]]:
    """A second transport, ready, on a socket of its own in ``h``'s task group: where a
    consumer of ``h.t`` forwards (a gateway's executor session)."""
    target = SessionTransport(b"T" * 32, PEER_RUNTIME, limits or Limits(), h.tg)
    sock = FakeSocket()
    sock.nowait = nowait

    async def run() -> None:
        with pytest.raises(SessionFailed):  # retired when the test is over
            await target.run(sock, 0)

    h.tg.start_soon(run)
    sock.feed(rcpt(0))
    await wait_until(lambda: target.state is TransportState.READY)
    try:
        yield target, sock
    finally:
        target.retire(FailureReason.CLOSED, "test over")
        target.payloads().close()  # nothing reads them
        sock.close()


@pytest.mark.usefixtures("always_quiet")
async def test_frames_issued_during_one_hand_over_are_one_write_per_destination() -> None:
    """A consumer that forwards each payload of one inbound message to another transport and
    answers it on this one: each destination gets one message, written synchronously at the
    end of the hand-over (not one per frame, though each would be written at once alone)."""
    async with harness(Limits(receipt_delay=60.0), consume=False) as h:
        sock = attach_nowait(h)
        async with relay_target(h) as (target, target_sock):
            before, target_before = h.t.statistics(), target.statistics()
            at_once = sock.nowait_writes + target_sock.nowait_writes

            def relay(body: bytes | memoryview) -> None:
                assert target.try_send(b"fwd-" + body) is not None
                assert h.t.try_send(b"re-" + body) is not None

            h.tg.start_soon(h.t.consume, Direct(relay))
            sock.feed(rcpt(0))
            await settle()  # the consumer took over: payloads are handed to it by the reader
            sock.feed(*(msg(i, f"p{i}".encode()) for i in range(1, 6)))
            await wait_until(lambda: h.t.statistics().session.issued == 5)
            assert target.statistics().messages_written == target_before.messages_written + 1
            assert h.t.statistics().messages_written == before.messages_written + 1
            assert sock.nowait_writes + target_sock.nowait_writes == at_once + 2
            assert target_sock.bodies() == [f"fwd-p{i}".encode() for i in range(1, 6)]
            assert decode_packets(sock.written[-1], 1 << 20) == [
                *(Message(Ordinal(i), f"re-p{i}".encode()) for i in range(1, 6)),
                Receipt(5),  # the receipt rides with the answers
            ]
            await settle()
            assert target.statistics().messages_written == target_before.messages_written + 1


@pytest.mark.usefixtures("always_quiet")
async def test_held_writes_past_one_messages_bound_go_to_the_writer_split_at_it() -> None:
    small = Limits(max_frame_bytes=4096, max_handshake_frame_bytes=4096)
    async with harness(consume=False) as h:
        sock = attach_nowait(h)
        async with relay_target(h, small) as (target, target_sock):
            bodies = [bytes([i]) * 1000 for i in range(10)]

            def relay(body: bytes | memoryview) -> None:
                assert target.try_send(bytes(body)) is not None

            h.tg.start_soon(h.t.consume, Direct(relay))
            sock.feed(rcpt(0))
            await settle()
            sock.feed(*(msg(i + 1, body) for i, body in enumerate(bodies)))
            await wait_until(lambda: target_sock.bodies() == bodies)
            sizes = [len(data) for data in target_sock.written]
            assert len(sizes) >= 3 and max(sizes) <= small.max_frame_bytes, sizes


async def test_held_writes_go_to_the_writer_when_the_socket_does_not_take_them_now() -> None:
    async with harness(consume=False) as h:
        sock = attach_nowait(h)
        async with relay_target(h, nowait=False) as (target, target_sock):
            written = len(target_sock.written)

            def relay(body: bytes | memoryview) -> None:
                assert target.try_send(bytes(body)) is not None

            h.tg.start_soon(h.t.consume, Direct(relay))
            sock.feed(rcpt(0))
            await settle()
            sock.feed(msg(1, b"a"), msg(2, b"b"), msg(3, b"c"))
            await wait_until(lambda: target_sock.bodies() == [b"a", b"b", b"c"])
            assert len(target_sock.written) == written + 1  # coalesced by the writer


# ------------------------------------------------------------------------------------------------
# lone receipts: the writer polls for them while they keep coming due


async def test_lone_receipts_are_written_within_the_delay_while_the_writer_polls(
    anyio_backend: str,
) -> None:
    """Once receipts keep coming due, the reader stops waking the writer for each one; the
    writer's own ticks must still send every lone receipt (a receipt never sent would stall the
    peer's retention). On asyncio a loop timer sends them instead of the writer's ticks."""
    async with harness(Limits(receipt_delay=0.02)) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        for ordinal in range(1, 6):
            sock.feed(msg(ordinal, b"x"))

            def receipted(o: int = ordinal) -> bool:
                return Receipt(o) in sock.packets()

            with anyio.fail_after(2):
                await wait_until(receipted)
        stats = h.t.statistics()
        if anyio_backend == "trio":
            assert stats.receipt_poll_writes == 5  # each one from a tick of the writer's poll
            assert stats.receipt_polls_started >= 1 and stats.receipt_timer_fires == 0
        else:
            assert stats.receipt_timer_fires >= 5  # ... from the timer, each one
            assert stats.receipt_polls_started == stats.receipt_poll_writes == 0


async def test_the_writer_stops_polling_when_nothing_comes_due_and_is_woken_again(
    anyio_backend: str,
) -> None:
    """(The writer polls where no loop timer sends lone receipts: trio.)"""
    async with harness(Limits(receipt_delay=0.005)) as h:
        sock = h.attach()
        sock.feed(rcpt(0), msg(1, b"x"))
        await wait_until(lambda: Receipt(1) in sock.packets())
        if anyio_backend == "trio":
            stats = h.t.statistics()
            assert stats.receipt_polls_started == stats.receipt_polls_stopped + 1  # polling

            def stopped() -> bool:
                stats = h.t.statistics()
                return stats.receipt_polls_stopped == stats.receipt_polls_started

            with anyio.fail_after(2):  # a few ticks of 5 ms with nothing due
                await wait_until(stopped)
        before = h.t.statistics()
        sock.feed(msg(2, b"y"))  # the reader wakes the writer again
        with anyio.fail_after(2):
            await wait_until(lambda: Receipt(2) in sock.packets())
        after = h.t.statistics()
        if anyio_backend == "trio":  # ... and it polls again, to send the receipt at a tick
            assert after.receipt_polls_started == before.receipt_polls_started + 1
            assert after.receipt_poll_writes == before.receipt_poll_writes + 1


async def test_a_lone_receipt_is_sent_within_the_delay_without_waking_the_writer(
    anyio_backend: str,
) -> None:
    """Counted, not timed: a receipt due with no frame to ride with is written once it has
    waited receipt_delay -- on asyncio by the loop timer, straight to a socket that takes it
    at once, so the writer task is not woken for it at all."""
    async with harness(Limits(receipt_delay=0.01)) as h:
        sock = h.attach()
        sock.nowait = True
        sock.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        await settle()
        before = h.t.statistics()
        sock.feed(msg(1, b"x"))
        with anyio.fail_after(2):
            await wait_until(lambda: Receipt(1) in sock.packets())
        await settle()
        after = h.t.statistics()
        assert after.session.receipts_sent == before.session.receipts_sent + 1
        assert after.messages_written == before.messages_written + 1
        if anyio_backend == "asyncio":
            assert after.writer_wakeups == before.writer_wakeups
            assert after.receipt_timer_fires >= 1 and sock.nowait_writes == 1


async def test_a_lone_receipt_the_socket_cannot_take_at_once_is_handed_to_the_writer(
    anyio_backend: str,
) -> None:
    """The timer's fallback (asyncio): a socket that would make the write wait gets the due
    receipt from the writer, woken once for it. (trio: the writer polls, see above.)"""
    if anyio_backend == "trio":
        pytest.skip("no receipt timer on trio: the writer polls")
    async with harness(Limits(receipt_delay=0.01)) as h:
        sock = h.attach()  # nowait off: no synchronous writes
        sock.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        await settle()
        before = h.t.statistics()
        sock.feed(msg(1, b"x"))
        with anyio.fail_after(2):
            await wait_until(lambda: Receipt(1) in sock.packets())
        await settle()
        after = h.t.statistics()
        assert after.messages_written == before.messages_written + 1
        assert after.writer_wakeups == before.writer_wakeups + 1


async def test_replies_carry_due_receipts_without_a_write_or_a_wakeup_of_their_own(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequential calls, counted: each inbound message makes a receipt due and each reply
    carries it -- one write per reply, no lone receipt, and the writer is never woken (the
    replies are written by the task issuing them, the receipts wait on one timer; on trio
    the reader wakes the polling writer instead)."""
    monkeypatch.setattr(transport_module, "WRITE_NOW_QUIET", 0.0)  # every reply written now
    async with harness(Limits(receipt_delay=30)) as h:
        sock = h.attach()
        sock.nowait = True
        sock.feed(rcpt(0))
        await wait_until(lambda: h.t.state is TransportState.READY)
        await settle()
        before = h.t.statistics()
        written = len(sock.written)
        for ordinal in range(1, 21):
            sock.feed(msg(ordinal, b"call"))

            def accepted(o: int = ordinal) -> bool:
                return h.t.accepted == o

            await wait_until(accepted)
            await settle()
            await h.t.send(b"reply")
            assert sock.packets()[-2:] == [
                Message(Ordinal(h.t.issued), b"reply"),
                Receipt(Ordinal(ordinal)),
            ]
        after = h.t.statistics()
        assert len(sock.written) == written + 20
        assert after.messages_written == before.messages_written + 20
        assert after.session.receipts_sent == before.session.receipts_sent + 20
        if anyio_backend == "asyncio":
            assert after.writer_wakeups == before.writer_wakeups


@pytest.mark.parametrize("yield_first", [True, False])
async def test_the_reader_lets_a_woken_lone_task_run_before_it_reads_on(
    yield_first: bool, anyio_backend: str
) -> None:
    """wants_yield() says the payloads woke a lone task: it runs before the reader re-arms its
    read (that re-arm is not on the peer's round trip); otherwise the reader reads on first.
    (trio does not promise to run the woken task first: there it is only a checkpoint.)"""
    if yield_first and anyio_backend == "trio":
        pytest.skip("trio's scheduler does not order the tasks a checkpoint lets run")
    async with harness(consume=False) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        seen: list[int] = []  # reads the reader had started when the woken task ran
        woken = anyio.Event()

        async def woken_task() -> None:
            await woken.wait()
            seen.append(sock.reads)

        h.tg.start_soon(woken_task)
        h.tg.start_soon(h.t.consume, Direct(lambda body: woken.set(), yield_first))
        await settle()
        reads = sock.reads
        sock.feed(msg(1, b"wake"))
        await wait_until(lambda: bool(seen))
        # The reader is inside the read that returned this message (reads) -- or already in
        # the next one (reads + 1) when it did not let the task run first.
        assert seen == [reads if yield_first else reads + 1]


async def test_an_urgent_receipt_goes_out_before_a_long_hand_over_which_survives_a_cut() -> None:
    """A message of many payloads makes its receipt urgent: it is written at once, before the
    direct consumer starts on the payloads (dispatching thousands can take a while), and a
    socket that ends during the hand-over loses none of them."""
    async with harness(consume=False) as h:
        sock = attach_nowait(h)
        sock.feed(rcpt(0))
        await settle()
        direct: list[bytes | memoryview] = []
        receipt_out_at: list[int] = []

        def consumer(body: bytes | memoryview) -> None:
            if not receipt_out_at and Receipt(200) in sock.packets():
                receipt_out_at.append(len(direct))
            direct.append(body)
            if len(direct) == 100:
                h.t.detach_socket()  # the socket ends in the middle of the hand-over

        h.tg.start_soon(h.t.consume, Direct(consumer))
        await settle()
        sock.feed(*(msg(i, b"%d" % i) for i in range(1, 201)))
        await wait_until(lambda: len(direct) == 200)
        assert direct == [b"%d" % i for i in range(1, 201)]  # all, in order, once
        assert receipt_out_at == [0]  # confirmed before the first was handed over


# ------------------------------------------------------------------------------------------------
# hostile input: packets per message and work per message

MiB = 1024 * 1024


async def test_the_writer_never_coalesces_more_packets_than_the_peer_accepts() -> None:
    """Whatever is queued at once, every message written holds at most max_packets_per_message
    packets, so a peer with the same limits accepts everything a legitimate writer sends. (Before
    the fix the 3,000 tiny frames below, 31 KB, went out as one message of 3,000 packets.)"""
    limits = Limits()
    bound = limits.max_packets_per_message
    async with harness(limits) as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        assert h.t.state is TransportState.READY
        sock.block_writes = True  # everything issued now is ready together
        bodies = [b"%d" % i for i in range(3000)]
        for body in bodies:
            assert h.t.try_send(body) is not None
        await settle()
        sock.unblock()
        await wait_until(lambda: len(sock.bodies()) == 3000)
        counts = [len(decode_packets(data, limits.max_frame_bytes)) for data in sock.written]
        assert max(counts) == bound  # coalesced up to the bound, never past it
        peer = MessageSession(limits)
        peer.attach(0)
        received = [body for data in sock.written for body in peer.receive(data).bodies]
        assert received == bodies
        assert peer.failure is None


class PipelinedSocket(FakeSocket):
    """Returns messages it already holds without yielding, as the link does with what wsproto
    has buffered from one read."""

    def __init__(self) -> None:
        super().__init__()
        self.buffered: list[bytes] = []

    async def receive_message(self) -> bytes | None:
        if self.buffered:
            self.reads += 1
            return self.buffered.pop(0)
        return await super().receive_message()


async def test_the_reader_yields_within_a_packet_budget_when_messages_come_without_yielding() -> (
    None
):
    """Break 5, CPU side: 40 messages of 16 packets each (the bound here), 39 of them returned by
    the socket without yielding, are handed to a direct consumer; another task gets to run at
    least every two messages' worth of packets. Before the fix the reader handed over all 640
    payloads without letting anything run."""
    limits = Limits(max_packets_per_message=16)
    async with harness(limits, consume=False) as h:
        sock = PipelinedSocket()
        h.attach(sock=sock)
        sock.feed(rcpt(0))
        await settle()
        assert h.t.state is TransportState.READY
        direct: list[bytes | memoryview] = []
        h.tg.start_soon(h.t.consume, Direct(direct.append))
        await settle()
        ordinals = iter(range(1, 641))
        messages = [b"".join(msg(next(ordinals), b"p") for _ in range(16)) for _ in range(40)]
        sock.buffered = messages[1:]
        seen: list[int] = []
        sock.feed(messages[0])  # the reader waits in the socket: this wakes it
        for _ in range(10_000):  # bounded: the reader needs ~40 turns
            seen.append(len(direct))
            if len(direct) == 640:
                break
            await anyio.lowlevel.checkpoint()
        assert len(direct) == 640
        steps = [b - a for a, b in itertools.pairwise(seen)]
        assert max(steps) <= 2 * 16, seen


async def test_a_hostile_message_of_tiny_packets_retires_the_session_cheaply() -> None:
    """Break 5 through the transport: one 16 MiB message of 3-byte receipts. Before the fix
    the reader's session.receive() built 5.6 million packets (~300 MiB, ~9 s of CPU) before
    acting; now the session is retired (4008) after 1,025 packets."""
    data = rcpt(0) * (16 * MiB // 3)
    async with harness() as h:
        sock = h.attach()
        sock.feed(rcpt(0))
        await settle()
        with PeakRss() as rss:
            cpu = time.process_time()
            sock.feed(data)
            await wait_until(lambda: h.t.state is TransportState.RETIRED)
            cpu = time.process_time() - cpu
        if rss.exact:
            assert rss.growth <= 64 * MiB
        assert cpu < 2.0  # CPU time, not wall clock
        failure = h.t.failure
        assert failure is not None
        assert failure.reason is FailureReason.MALFORMED_PACKET
        assert failure.close_code == 4008


async def test_the_retirement_line_says_retired_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="garcon_link.transport")
    async with harness() as h:
        h.t.retire(FailureReason.REPLACED, "a fresh session replaced it")
    lines = [r.getMessage() for r in caplog.records if "retired" in r.getMessage()]
    assert lines, caplog.text
    assert all(line.count("retired") == 1 for line in lines), lines
    assert "retired: replaced by a fresh logical session (a fresh session replaced it)" in lines[0]


# ------------------------------------------------------------------------------------------------
# memory: the owner and its parts


async def test_a_retired_transport_is_freed_by_its_reference_count_alone() -> None:
    """The owner and its parts make no reference cycle: a transport that served a socket and
    retired is freed the moment its last reference goes, not at some later GC pass (a fleet
    retires thousands of sessions; cycles would wait for the collector's full passes)."""
    import gc
    import weakref

    collecting = gc.isenabled()
    gc.disable()
    try:
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                transport = SessionTransport(SESSION_ID, PEER_RUNTIME, Limits(), tg)
                received: list[bytes] = []

                async def consume(t: SessionTransport) -> None:
                    async with t.payloads() as stream:
                        async for payload in stream:
                            received.append(payload)

                async def run(t: SessionTransport, sock: FakeSocket) -> None:
                    try:
                        await t.run(sock, 0)
                    except SessionFailed:
                        pass

                sock = FakeSocket()
                tg.start_soon(consume, transport)
                tg.start_soon(run, transport, sock)
                sock.feed(rcpt(0), msg(1, b"hello"))
                await wait_until(lambda: received == [b"hello"])
                await transport.send(b"reply")
                await wait_until(lambda: Message(Ordinal(1), b"reply") in sock.packets())
                sock.end()
                await transport.wait_detached()
                transport.retire(FailureReason.CLOSED, "test over")
                sock.close()
                freed = weakref.ref(transport)
                del transport
                await anyio.wait_all_tasks_blocked()
                assert freed() is None, gc.get_referrers(freed())
    finally:
        if collecting:
            gc.enable()
