"""The transport's inbound side: the socket reader and the hand-over to the consumer.

One :class:`Inbound` per transport. What it does (the rules are the transport's: see
:mod:`garcon_link.endpoint.transport`):

* **Reading**: :meth:`Inbound.reader` reads the socket's messages and gives each to the session;
  what the session reports it obeys -- the fence passed (``Shared.fence_passed``), receipts due or
  urgent and frames confirmed (told to the outbound side), replay progress (the replay watch in
  ``Shared.replay``; its end told to the watches). On asyncio the socket may hand a message to
  :meth:`Inbound.take_nowait` in its callback instead, when the reader would not wait over it.
* **Pre-readiness buffer**: payloads accepted before the fence are held, and released in order
  when it passes; a new attachment first hands over what an earlier one left.
* **Hand-over**: payloads go to the direct consumer (:meth:`Inbound.consume`) synchronously, or
  through the delivery queue, moved into it by one delivery task (:meth:`Inbound._deliver`); the
  reader waits while it is full, or while the direct consumer holds it, and those waits pause
  the replay inactivity clock (the watches' ``pause`` and ``resume``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..core.session import Received
from ..errors import FailureReason, ProtocolError, SessionFailed
from ..logs import log_fields
from ..net.backend import checkpointer
from ._outbound import Outbound, held_writes, hold_writes, write_held
from ._shared import Shared, log
from ._watches import Watches
from .transport_types import MessageSocket, PayloadConsumer, PreReadinessBuffer, TransportState

__all__ = ["Inbound"]


class Inbound:
    """The inbound side of one transport.

    Args:
        shared: the state the transport's sides share.
        outbound: the outbound side (told what the reader accepted).
        watches: the watches (told of the replay's end and of waits for our consumer).
        task_group: where the delivery task runs; normally the link's.
        retire: the owner's ``retire(reason, detail)``.
        set_state: the owner's state change (the reader announces ``READY``).
        yield_every_bytes: the inbound bytes after which the reader yields.
    """

    def __init__(
        self,
        shared: Shared,
        outbound: Outbound,
        watches: Watches,
        task_group: anyio.abc.TaskGroup,
        *,
        retire: Callable[[FailureReason, str], SessionFailed],
        set_state: Callable[[TransportState], None],
        yield_every_bytes: int,
    ) -> None:
        limits = shared.limits
        self._shared = shared
        self._session = shared.session
        self._watches = watches
        self._tg = task_group
        self._retire = retire
        self._set_state = set_state
        self._yield_every_bytes = yield_every_bytes
        # The outbound side's methods the reader calls for each message, bound once.
        self._capacity_freed = outbound.capacity_freed
        self._receipt_urgent = outbound.receipt_urgent
        self._receipt_waits = outbound.receipt_waits
        self._deliver_send: MemoryObjectSendStream[bytes]
        self._deliver_recv: MemoryObjectReceiveStream[bytes]
        self._deliver_send, self._deliver_recv = anyio.create_memory_object_stream[bytes](
            limits.delivery_queue
        )
        self._buffer = PreReadinessBuffer(limits)
        # Released payloads (fence passed) not yet in the delivery queue, and the delivery task
        # that moves them there (see _release).
        self._pending: deque[tuple[bytes, bool]] = deque()  # (payload, came from _buffer)
        self._pending_buffered = 0  # ... of which came from the pre-readiness buffer
        self._pending_buffered_bytes = 0
        self._in_flight = False
        self._delivering = False
        self._consumer_gone = False
        # A PayloadConsumer's bound methods while consume() runs, else None (all four together).
        self._consumer: Callable[[bytes | memoryview], None] | None = None
        self._wants_yield: Callable[[], bool] | None = None
        self._hold: Callable[[], anyio.Event | None] | None = None
        self._batch_end: Callable[[], None] | None = None
        self._retired = anyio.Event()
        self._pending_added = anyio.Event()
        self._delivery_progress = anyio.Event()
        # The socket's callback hands messages to take_nowait while the reader waits (see
        # there): a hold that stops the reader from reading on, and an error to raise in run().
        self._direct_held: anyio.Event | None = None
        self._direct_error: Exception | None = None
        self.messages_read = 0
        self.messages_read_directly = 0

    # ------------------------------------------------------------------ observation

    @property
    def buffered_payloads(self) -> int:
        """Pre-readiness payloads, counted as buffered until the delivery task has taken them."""
        return len(self._buffer) + self._pending_buffered

    @property
    def buffered_bytes(self) -> int:
        return self._buffer.size + self._pending_buffered_bytes

    @property
    def queued_payloads(self) -> int:
        """Released payloads on their way to the consumer through the queue."""
        return (
            self._deliver_send.statistics().current_buffer_used
            + len(self._pending)
            - self._pending_buffered
            + self._in_flight
        )

    # ------------------------------------------------------------------ the owner's calls

    def detached(self) -> None:
        """The socket is gone: a hold the socket's callback took no longer applies."""
        self._direct_held = None

    def take_error(self) -> Exception | None:
        """What the socket's callback raised (:meth:`take_nowait`), to raise in ``run`` as the
        reader's own; ``None`` if nothing."""
        error, self._direct_error = self._direct_error, None
        return error

    def retire(self) -> None:
        """The session is retired: what was accepted and not yet queued goes to the queue if it
        has room, then the queue is closed (the consumer sees them, then the end)."""
        if self._pending or self._buffer:
            # Accepted and not yet queued for the consumer: hand them over if there is room.
            self._drain_buffer_nowait()
        self._deliver_send.close()
        self._pending_added.set()  # the delivery task ends
        self._delivery_progress.set()
        self._retired.set()

    def _drain_buffer_nowait(self) -> None:
        # After the released ones.
        self._pending.extend(
            (body if type(body) is bytes else bytes(body), True) for body in self._buffer.release()
        )
        while self._pending:
            body, _ = self._pending[0]
            try:
                self._deliver_send.send_nowait(body)
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                log.warning(
                    "session %s: dropped %d accepted payload(s) at retirement",
                    self._shared.label,
                    len(self._pending),
                    extra=log_fields(session=self._shared.session_id),
                )
                break
            self._pending.popleft()
        self._clear_pending()

    # ------------------------------------------------------------------ consumer side

    def payloads(self) -> MemoryObjectReceiveStream[bytes]:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.payloads`."""
        return self._deliver_recv

    async def consume(self, consumer: PayloadConsumer) -> None:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.consume`."""
        deliver = consumer.deliver
        batch_end = consumer.batch_end
        with self._deliver_recv:
            # Drain the queue path until nothing is left on its way through it.
            if not await self._drain_queue(deliver, batch_end, until_idle=True):
                return
            self._consumer = deliver
            self._wants_yield = consumer.wants_yield
            self._hold = consumer.hold
            self._batch_end = batch_end
            try:
                await self._retired.wait()
            finally:
                self._consumer = None
                self._wants_yield = None
                self._hold = None
                self._batch_end = None
            # What retirement handed over (pre-readiness payloads) went to the queue.
            await self._drain_queue(deliver, batch_end, until_idle=False)

    async def _drain_queue(
        self,
        deliver: Callable[[bytes | memoryview], None],
        batch_end: Callable[[], None],
        *,
        until_idle: bool,
    ) -> bool:
        """Hand what the delivery queue holds to ``deliver``, each payload a batch of its own;
        with ``until_idle`` also wait for what is still on its way into it (pending, in flight).
        ``False`` once the queue ended."""
        receive = self._deliver_recv
        while True:
            try:
                body = receive.receive_nowait()
            except anyio.WouldBlock:
                if not (until_idle and (self._pending or self._in_flight)):
                    return True
                try:
                    body = await receive.receive()
                except anyio.EndOfStream:
                    return False
            except anyio.EndOfStream:
                return False
            self._hand_over(deliver, body)
            self._end_batch(batch_end)

    def _end_batch(self, batch_end: Callable[[], None]) -> None:
        try:
            batch_end()
        except Exception:
            log.exception(
                "session %s: the payload consumer failed at the end of a message",
                self._shared.label,
                extra=log_fields(session=self._shared.session_id),
            )

    def _consumer_failed(self) -> None:
        """Log the exception the payload consumer just raised (called in its ``except``; the
        payload is dropped, the session goes on)."""
        log.exception(
            "session %s: the payload consumer failed; payload dropped",
            self._shared.label,
            extra=log_fields(session=self._shared.session_id),
        )

    def _hand_over(
        self, deliver: Callable[[bytes | memoryview], None], body: bytes | memoryview
    ) -> None:
        try:
            deliver(body)
        except Exception:
            self._consumer_failed()

    # ------------------------------------------------------------------ the reader

    async def reader(self, sock: MessageSocket) -> None:
        """The reader task of one attachment: reads ``sock`` until it ends."""
        checkpoint = checkpointer()
        # What earlier attachments accepted and did not deliver was acknowledged, so the peer's
        # replay may fill a whole window beside it: hand it over and read nothing until it is
        # queued, so the pre-readiness buffer holds only this attachment's replay.
        carried = self._buffer.attach()
        if carried:
            self._release(carried, buffered=True)
        await self._wait_delivered()
        # While this task waits for the next message with nothing buffered, the socket may hand
        # a small one to take_nowait in its callback instead (asyncio: one loop turn less).
        take_directly: Callable[[Callable[[bytes], bool] | None], bool] | None = getattr(
            sock, "take_messages_directly", None
        )
        if take_directly is not None and not take_directly(self.take_nowait):
            take_directly = None
        try:
            await self._read_messages(sock, checkpoint)
        finally:
            if take_directly is not None:
                take_directly(None)

    async def _read_messages(
        self, sock: MessageSocket, checkpoint: Callable[[], Awaitable[None]]
    ) -> None:
        shared = self._shared
        session = self._session
        packet_budget = shared.limits.max_packets_per_message
        yield_every_bytes = self._yield_every_bytes
        unyielded_packets = 0  # handled since this task last yielded on purpose
        unyielded_bytes = 0
        while True:
            try:
                data = await sock.receive_message()
            except ProtocolError as exc:
                # A text frame, an over-size message or broken framing: the peer broke the
                # protocol, which is terminal for the session like a malformed packet (the link
                # closes the socket with the specific code it recorded, e.g. 1003 or 1009).
                self._retire(FailureReason.MALFORMED_PACKET, str(exc))
                return
            if data is None:
                retired_by_peer = sock.retired_by_peer()
                if retired_by_peer is not None:
                    # The peer closed because *it* retired the session (or shut down): retire
                    # here too, before detaching, so observers see one transition (to RETIRED).
                    self._retire(FailureReason.PEER_RETIRED, retired_by_peer)
                return
            held = self._direct_held
            if held is not None:
                # A message taken in the socket's callback asked the reader to read nothing
                # more until the consumer releases it: this one waits until then.
                self._direct_held = None
                await self._wait_for_consumer(held)
            received = self._accept(data)
            if received is None:
                return
            unyielded_packets += received.packets
            unyielded_bytes += len(data)
            bodies = received.bodies
            if not shared.fence_passed:
                for body in bodies:
                    if not self._buffer_payload(body):
                        return
                if received.fence:
                    # The first receipt on this attachment. Drain, then announce readiness.
                    shared.fence_passed = True
                    self._release(self._buffer.release(), buffered=True)
            else:
                self._release(bodies)
            if session.receipt_due:
                # *After* the release: the tasks the payloads woke (a handler, a caller) run
                # first and usually queue a frame, which the receipt then rides with.
                self._receipt_waits()
            fence_passed = shared.fence_passed
            if fence_passed:
                await self._wait_delivered()
            if received.fence:
                self._set_state(TransportState.READY)
            wants_yield = self._wants_yield
            if bodies and fence_passed and wants_yield is not None and wants_yield():
                # The consumer says these payloads woke a lone task (a handler, a waiting
                # caller): let it run before this reader re-arms its read, which is not on the
                # peer's round trip. (Never under load: it would split the batches the writer
                # coalesces.) After READY: what the task does next sees the session ready.
                await checkpoint()
            hold = self._hold
            if bodies and fence_passed and hold is not None:
                held = hold()
                if held is not None:
                    await self._wait_for_consumer(held)
            replay = shared.replay
            if not replay.done and replay.observe(
                received.progress,
                fence_passed=fence_passed,
                confirmed=session.confirmed,
                now=anyio.current_time(),
            ):
                self._watches.replay_finished()
            if unyielded_packets >= packet_budget or unyielded_bytes >= yield_every_bytes:
                # Everything this message carried was handed over: let the other tasks run
                # before the next message, which the socket may return without yielding.
                unyielded_packets = unyielded_bytes = 0
                await checkpoint()

    def _accept(self, data: bytes) -> Received | None:
        """The session's reading of one message, and the receipts it makes due or urgent;
        ``None`` if it retired the session."""
        self.messages_read += 1
        try:
            received = self._session.receive(data)
        except SessionFailed as failure:
            self._retire(failure.reason, failure.detail)
            return None
        if received.receipt_became_due:
            self._shared.receipt_due_at = time.monotonic()
        if received.confirmed_advanced:
            self._capacity_freed()
        if received.receipt_urgent:
            # Before the hand-over, which may be long (a direct consumer dispatching a
            # replay of thousands of payloads in this task): confirming what was accepted
            # frees the peer's retention -- at once if the socket takes it, else by the
            # writer as soon as this task yields.
            self._receipt_urgent()
        return received

    def take_nowait(self, data: bytes) -> bool:
        """One message, taken in the socket's callback as the waiting reader (asyncio): what
        the reader would do with it, when that needs no wait -- the replay fence has passed,
        the consumer is direct (:meth:`consume`) and nothing awaits delivery or a hold. The
        reader's yield to the task a payload woke is not needed here: that task runs before
        the loop polls the socket again. ``False`` (nothing done): the reader reads it."""
        shared = self._shared
        scope = shared.scope
        if (
            self._consumer is None
            or not shared.fence_passed
            or scope is None
            or scope.cancel_called
            or self._direct_held is not None
            or self._direct_error is not None
            or ((self._pending or self._in_flight) and self._undelivered())
        ):
            return False
        self.messages_read_directly += 1
        try:
            received = self._accept(data)
            if received is None:
                return True
            bodies = received.bodies
            if bodies:
                self._release(bodies)
            session = self._session
            if session.receipt_due:
                self._receipt_waits()  # after the release, as in the reader
            if received.fence:
                self._set_state(TransportState.READY)
            hold = self._hold
            if bodies and hold is not None:
                self._direct_held = hold()
            replay = shared.replay
            if not replay.done and replay.observe(
                received.progress,
                fence_passed=True,
                confirmed=session.confirmed,
                now=anyio.current_time(),
            ):
                self._watches.replay_finished()
        except Exception as exc:
            # Raised by run(), as if the reader had raised it; the socket is let go.
            self._direct_error = exc
            scope.cancel()
        return True

    # -- delivery: the reader hands accepted payloads over synchronously, so a socket that ends
    # (cancelling the reader) while the consumer is slow never loses a payload the session has
    # already accepted -- and acknowledged. One task per transport moves them into the bounded
    # delivery queue, in order; the reader waits for it (back-pressure).

    def _release(self, bodies: Sequence[bytes | memoryview], *, buffered: bool = False) -> None:
        if self._consumer_gone:
            return
        consumer = self._consumer
        if consumer is not None:
            if len(bodies) > 1 and held_writes.batch is None:
                self._hand_over_holding(consumer, bodies)
                return
            for body in bodies:  # _hand_over of each, inline: this runs for every message
                try:
                    consumer(body)
                except Exception:
                    self._consumer_failed()
            if self._batch_end is not None:
                self._end_batch(self._batch_end)
            return
        send_nowait = self._deliver_send.send_nowait
        for body in bodies:
            if type(body) is memoryview:
                body = body.tobytes()  # the queue's readers are given bytes
            if not self._pending and not self._in_flight:
                # Fast path: nothing is ahead of it, so hand it straight to the queue if there
                # is room. send_nowait either queues it or raises, so nothing can be lost here.
                # A closed or broken queue falls through too: _deliver reports and cleans up.
                try:
                    send_nowait(body)
                    continue
                except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
            self._pending.append((body, buffered))
            if buffered:
                self._pending_buffered += 1
                self._pending_buffered_bytes += len(body)
        if not self._pending:
            return
        self._pending_added.set()
        if not self._delivering:
            self._delivering = True
            self._tg.start_soon(self._deliver)

    def _hand_over_holding(
        self, consumer: Callable[[bytes | memoryview], None], bodies: Sequence[bytes | memoryview]
    ) -> None:
        """Hand ``bodies`` (one inbound message's) to the direct consumer, holding the frames
        issued meanwhile (:func:`~garcon_link.endpoint._outbound.hold_writes`) and writing them
        at the end: one message per transport that got some. (A single payload is handed over
        without: nothing to merge.)"""
        batch = hold_writes()
        try:
            for body in bodies:  # _hand_over of each, inline: this runs for every message
                try:
                    consumer(body)
                except Exception:
                    self._consumer_failed()
            if self._batch_end is not None:
                self._end_batch(self._batch_end)
        finally:
            write_held(batch)

    def _undelivered(self) -> bool:
        return bool(self._pending or self._in_flight) and not (
            self._session.failure or self._consumer_gone
        )

    async def _wait_delivered(self) -> None:
        """Wait until every released payload is in the delivery queue.

        Time spent here is our consumer's, not the peer's: the replay inactivity clock is paused
        meanwhile and restarts when the wait ends.
        """
        if not self._undelivered():
            return
        waiting = self._watches.pause()
        try:
            while self._undelivered():
                progress = self._delivery_progress = anyio.Event()
                await progress.wait()
        finally:
            self._watches.resume(waiting)

    async def _wait_for_consumer(self, released: anyio.Event) -> None:
        """Read nothing until the direct consumer's ``released`` is set (see :meth:`consume`);
        like :meth:`_wait_delivered`, the replay inactivity clock is paused meanwhile."""
        waiting = self._watches.pause()
        try:
            await released.wait()
        finally:
            self._watches.resume(waiting)

    async def _deliver(self) -> None:
        """The delivery task: runs until retirement (or until the consumer goes away)."""
        try:
            while self._session.failure is None:
                if not self._pending:
                    added = self._pending_added = anyio.Event()
                    await added.wait()
                    continue
                body, buffered = self._pending.popleft()
                if buffered:
                    self._pending_buffered -= 1
                    self._pending_buffered_bytes -= len(body)
                self._in_flight = True
                try:
                    await self._deliver_send.send(body)
                finally:
                    self._in_flight = False
                    self._delivery_progress.set()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # Retired (the queue is closed) or the consumer closed its end: nobody to deliver to.
            if self._session.failure is None:
                log.warning(
                    "session %s: the consumer closed the payload stream",
                    self._shared.label,
                    extra=log_fields(session=self._shared.session_id),
                )
            self._consumer_gone = True
            self._clear_pending()
            self._delivery_progress.set()

    def _clear_pending(self) -> None:
        self._pending.clear()
        self._pending_buffered = 0
        self._pending_buffered_bytes = 0

    def _buffer_payload(self, body: bytes | memoryview) -> bool:
        # Only this attachment's payloads count: what earlier ones left was queued before this
        # attachment read anything (see reader).
        overflow = self._buffer.hold(body)
        if overflow is not None:
            self._retire(FailureReason.INBOUND_OVERFLOW, overflow)
            return False
        return True
