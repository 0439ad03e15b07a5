"""SessionTransport: one logical session carried over a succession of sockets.

:class:`SessionTransport` is one state machine (below) whose pumps -- reader, writer, delivery
task, grace and replay watches -- must see each other's changes synchronously, within the loop
turn that made them (a fence passed, a receipt due, retention freed). What more than one of
them reads is one small object, :class:`~garcon_link.endpoint._shared.Shared`; the replay and
grace watches are :class:`~garcon_link.endpoint._watches.Watches`, and the send side -- senders,
writes, the writer and when receipts go out -- is
:class:`~garcon_link.endpoint._outbound.Outbound`. The rules that need no I/O are sans-IO objects
of their own (:class:`~garcon_link.endpoint.transport_types.PreReadinessBuffer`,
:class:`~garcon_link.core.replay.ReplayWatch`, the session itself). What the transport meets --
the socket, the consumer, its states and statistics -- is
:mod:`garcon_link.endpoint.transport_types`, all imported from here too.

Theory of operation
-------------------
A :class:`SessionTransport` owns one sans-IO :class:`~garcon_link.core.session.MessageSession` for
its whole life and is attached to at most one socket at a time. The link calls :meth:`run` with each
authenticated socket; ``run`` pumps bytes until the socket ends and then *detaches* (the session
survives, its retained frames wait for the next socket) -- or the session fails and the transport
is *retired* for good.

States (``TransportState``)::

    DETACHED --attach--> REPLAYING --fence--> READY
        ^                    |                  |
        +------- socket lost +------------------+
    any --terminal failure--> RETIRED           (final; failure stored in ``failure``)

Rules implemented here:

* **Replay fence**: the first receipt received on the current attachment. The peer writes it after
  everything it replays, so when it arrives every replayed inbound frame has been seen. The
  session reports it (:class:`~garcon_link.core.session.Received`), as it reports whether a
  message confirmed more of our frames or made a receipt due: the reader obeys those events.
* **Pre-readiness buffer** (:class:`PreReadinessBuffer`): inbound payloads accepted before the
  fence are held and drain *in order* into the delivery queue *before* ``READY`` is announced.
  The bound (``max_inbound_buffer_payloads``/``_bytes``; overflow retires the session) covers what
  the *current* attachment accepted before its fence: for an honest peer at most what it retains.
  Nothing we accepted is in the peer's retention any more (our receipts, and the resume position
  of the next handshake, acknowledged it), so the peer may replay a whole new window beside it.
  Therefore a new attachment first hands over what an earlier one left -- its pre-fence payloads
  if it ended before its fence (they survive the detach), and whatever a detach interrupted on
  its way to the consumer -- and reads nothing until all of it is in the delivery queue
  (back-pressure, as from a full queue; the replay inactivity clock is paused meanwhile). So the
  pre-readiness payloads held at any time, released or not, never exceed the bound.
* **Replay inactivity** (:class:`~garcon_link.core.replay.ReplayWatch`): while replaying (fence
  not yet passed, or frames we replayed not yet confirmed), the session is retired with
  ``REPLAY_STALLED`` if ``replay_inactivity`` passes with no progress. Progress is a new inbound
  ordinal or a receipt that confirms more of our frames; heartbeats and duplicates are not
  progress. Time the reader spends waiting for our own slow
  consumer is not the peer's inactivity: the deadline is paused meanwhile.
* **Grace**: a detached session is retired with ``GRACE_EXPIRED`` after ``detached_grace``.
* **Ordered delivery**: payloads go through one bounded memory stream read by one consumer
  (:meth:`payloads`); a full queue pauses the socket reader (back-pressure), never the session.
  The reader hands what the session accepted to a small pending queue *synchronously* and one
  delivery task per transport moves it into the stream, so a socket that ends while the reader
  waits for the consumer loses nothing (those payloads are accepted -- and acknowledged -- already).
  Pre-readiness payloads count as buffered until the delivery task takes them. A consumer that
  never blocks (the RPC dispatch) can instead take payloads straight from the reader with
  :meth:`consume` (a :class:`PayloadConsumer`): same order, no queue, no task switch; it
  back-pressures the peer by asking the reader to pause between messages (``hold``) while one of
  its own bounds is full.
* **Socket faults**: a write to a dead socket (``BrokenResourceError``) ends the attachment, the
  session waits for the next socket; a ``ProtocolError`` from the socket (text frame, over-size
  message) retires the session like a malformed packet.
* **Sending** (:meth:`send`) waits while retention is full -- full retention is back-pressure, never
  a failure. A lone frame on a quiet socket is written at once by the task that issued it (when the
  socket takes it without waiting: the link's asyncio sockets); otherwise the socket writer is
  woken, and it coalesces every packet ready at that moment into one WebSocket message (bounded by
  ``COALESCE_BYTES``, the frame limit and ``Limits.max_packets_per_message``: what we write never
  exceeds what our peer's session accepts in one message). Frames issued while one inbound
  message is handed to a direct consumer (the RPC dispatch: replies, a gateway's forwards and
  answers, on this transport or another) are held instead and each transport that got some writes
  them as one message at the end of that hand-over, in the same callback (``Outbound._write_now``):
  one write per destination per inbound message, no task switch to the writer. Past the
  bounds of one message a transport stops holding and its writer sends what it has queued.
* **Bounded synchronous work**: one inbound message costs at most ``max_packets_per_message``
  packets of session work and consumer hand-overs (the session refuses more). The socket may hand
  over messages it already buffered without yielding (the link's does), so the reader also
  yields to the other tasks once the packets it handled since it last yielded reach
  ``max_packets_per_message``, or their bytes ``YIELD_EVERY_BYTES``: a peer that pipelines many
  full messages cannot hold the event loop for longer than about one message's work. The yield is
  taken after a message was completely handed over, where a cancellation loses nothing.
* **Receipts** ride with outgoing frames when they can. An urgent one (the fence, or
  ``receipt_interval`` messages unconfirmed) goes out at once, before the payloads are handed
  over; a lone one waits at most ``receipt_delay``. On asyncio one loop timer per attachment
  sees to that (``Outbound.receipt_waits``): armed when a receipt comes due and none is armed, it
  writes a receipt that has waited ``receipt_delay`` straight to a socket that takes it at once
  (else wakes the writer for it), re-arms for a younger one, and does nothing if a frame carried
  it -- so the writer task is never woken for a receipt a reply carries. Elsewhere (trio) the
  writer polls for them at that period while they keep coming due, instead of being woken for
  each.

At retirement the payloads accepted but not yet queued are handed over if the delivery queue has
room (the rest are dropped, with a warning: the RPC layer drops late replies anyway), then the
delivery stream is closed, so the consumer sees them and then the end; :attr:`failure` says why.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..core.replay import ReplayWatch
from ..core.session import MessageSession, Received, RetentionPool
from ..core.wire import Gathered, Ordinal
from ..errors import FailureReason, ProtocolError, SessionFailed
from ..limits import Limits
from ..logs import log_fields
from ..net.backend import checkpointer
from ._outbound import Outbound, held_writes, hold_writes, write_held
from ._shared import Shared, log
from ._watches import Watches
from .transport_types import (
    MessageSocket,
    PayloadConsumer,
    PreReadinessBuffer,
    TransportState,
    TransportStatistics,
)

__all__ = [
    "MessageSocket",
    "PayloadConsumer",
    "PreReadinessBuffer",
    "SessionTransport",
    "TransportState",
    "TransportStatistics",
]

COALESCE_BYTES = 256 * 1024
"""Packets ready together are merged into WebSocket messages of at most this many bytes."""

YIELD_EVERY_BYTES = 1024 * 1024
"""The socket reader yields to other tasks after handling this many inbound bytes without a
yield (or ``Limits.max_packets_per_message`` packets, whichever comes first)."""

WRITE_NOW_QUIET = 100e-6
"""A frame issued at least this many seconds after the previous one, on an idle socket, is
written at once by the task that issued it instead of by the writer task (one task switch less
on a quiet link); frames issued closer together are left to the writer, which coalesces them.
(Read when a transport is made.)"""


Listener = Callable[[TransportState], None]


class SessionTransport:
    """One logical session over a succession of sockets.

    Args:
        session_id: the logical session's id (from the handshake).
        peer_runtime: the runtime id of the peer this session belongs to.
        limits: bounds; shared with the session.
        task_group: where the transport's own timers (grace) run; normally the link's.
        pool: a retention budget shared with other sessions (see
            :class:`~garcon_link.core.session.RetentionPool`), or None.
    """

    def __init__(
        self,
        session_id: bytes,
        peer_runtime: bytes,
        limits: Limits,
        task_group: anyio.abc.TaskGroup,
        *,
        label: str = "",
        pool: RetentionPool | None = None,
    ) -> None:
        self.session_id = session_id
        self.peer_runtime = peer_runtime
        self.limits = limits
        self.label = label or session_id.hex()[:8]
        self._session = session = MessageSession(limits, pool)
        self._shared = shared = Shared(session, limits, session_id, self.label)
        self._watches = Watches(shared, task_group, self.retire)
        self._outbound = outbound = Outbound(
            shared,
            coalesce_limit=min(limits.max_frame_bytes, COALESCE_BYTES),
            quiet=WRITE_NOW_QUIET,
        )
        # The outbound side's methods the reader calls for each message, bound once.
        self._capacity_freed = outbound.capacity_freed
        self._receipt_urgent = outbound.receipt_urgent
        self._receipt_waits = outbound.receipt_waits
        self._tg = task_group
        self._state = TransportState.DETACHED
        self._listeners: list[Listener] = []
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
        self._run_done = anyio.Event()
        self._attachments = 0
        # The socket's callback hands messages to _take_nowait while the reader waits (see
        # there): a hold that stops the reader from reading on, and an error to raise in run().
        self._direct_held: anyio.Event | None = None
        self._direct_error: Exception | None = None
        self._messages_read = 0
        self._messages_read_directly = 0

    # ------------------------------------------------------------------ observation

    @property
    def state(self) -> TransportState:
        return self._state

    @property
    def failure(self) -> SessionFailed | None:
        return self._session.failure

    @property
    def offered(self) -> int:
        """Highest ordinal ever handed to a socket (never decreases, survives retirement)."""
        return self._session.offered

    @property
    def accepted(self) -> int:
        """Highest inbound ordinal accepted (what a resuming hello advertises as ``received``)."""
        return self._session.accepted

    @property
    def attached(self) -> bool:
        return self._shared.scope is not None

    @property
    def _receipt_poll(self) -> bool:
        """Whether the writer polls for lone receipts now (read by a white-box test of the
        polling, tests/test_transport.py)."""
        return self._outbound.receipt_poll

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(state)`` on every state change; returns an unsubscribe callable."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def statistics(self) -> TransportStatistics:
        outbound = self._outbound
        return TransportStatistics(
            state=self._state,
            session=self._session.statistics(),
            attachments=self._attachments,
            # Pre-readiness payloads count as buffered until the delivery task has taken them.
            buffered_payloads=len(self._buffer) + self._pending_buffered,
            buffered_bytes=self._buffer.size + self._pending_buffered_bytes,
            queued_payloads=self._deliver_send.statistics().current_buffer_used
            + len(self._pending)
            - self._pending_buffered
            + self._in_flight,
            messages_written=outbound.messages_written,
            messages_read=self._messages_read,
            messages_read_directly=self._messages_read_directly,
            capacity_wakeups=outbound.capacity_wakeups,
            writer_wakeups=outbound.writer_wakeups,
            receipt_timer_fires=outbound.receipt_timer_fires,
        )

    def _set_state(self, state: TransportState) -> None:
        if state is self._state:
            return
        log.debug(
            "session %s: %s -> %s",
            self.label,
            self._state.value,
            state.value,
            extra=log_fields(session=self.session_id),
        )
        self._state = state
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a listener must not break the transport
                log.exception(
                    "session %s: state listener failed",
                    self.label,
                    extra=log_fields(session=self.session_id),
                )

    # ------------------------------------------------------------------ consumer side

    def payloads(self) -> MemoryObjectReceiveStream[bytes]:
        """The ordered delivery stream (one consumer). Ends after retirement."""
        return self._deliver_recv

    async def consume(self, consumer: PayloadConsumer) -> None:
        """Hand every payload to ``consumer``, in order, until the session is retired.

        The alternative to reading :meth:`payloads` (use one or the other) for a consumer that
        never blocks -- the RPC layer's dispatch: the socket reader calls
        ``consumer.deliver(payload)`` directly as the session accepts each payload, which saves a
        queue and a task switch per message (the rules of each call: :class:`PayloadConsumer`).
        What was queued before this call is handed over first. Returns once the session is
        retired and everything it had accepted was handed over; closes the stream of
        :meth:`payloads` on return (as leaving ``async with transport.payloads()`` does).
        """
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
                self.label,
                extra=log_fields(session=self.session_id),
            )

    def _consumer_failed(self) -> None:
        """Log the exception the payload consumer just raised (called in its ``except``; the
        payload is dropped, the session goes on)."""
        log.exception(
            "session %s: the payload consumer failed; payload dropped",
            self.label,
            extra=log_fields(session=self.session_id),
        )

    def _hand_over(
        self, deliver: Callable[[bytes | memoryview], None], body: bytes | memoryview
    ) -> None:
        try:
            deliver(body)
        except Exception:
            self._consumer_failed()

    def _hand_over_all(
        self, deliver: Callable[[bytes | memoryview], None], bodies: Sequence[bytes | memoryview]
    ) -> None:
        """:meth:`_hand_over` of each of ``bodies`` in turn (in one frame: a call less each)."""
        for body in bodies:
            try:
                deliver(body)
            except Exception:
                self._consumer_failed()

    async def send(self, body: bytes | Gathered) -> Ordinal:
        """Issue ``body`` as the next message of this session.

        Waits while retention is full (back-pressure, never failure); waiting senders are
        admitted in the order they called, so bodies keep that order on the wire. On a quiet
        socket the frame is written at once by this task; otherwise the writer sends it,
        coalesced with whatever is issued meanwhile.

        Returns:
            The ordinal assigned to ``body``.

        Raises:
            PayloadTooLarge: the encoded frame exceeds ``max_frame_bytes``; nothing was issued.
            SessionFailed: the session is retired; nothing was issued.
        """
        return await self._outbound.send(body)

    async def wait_acknowledged(self) -> bool:
        """Wait until the peer's receipts cover every frame issued so far (a graceful drain
        waits for this before closing, so the replies it let finish are not lost with the
        socket). Unbounded: the caller bounds it.

        Returns:
            ``True`` once acknowledged; ``False`` if the session was retired first.
        """
        return await self._outbound.wait_acknowledged()

    async def wait_retained_below(self, size: int) -> bool:
        """Wait until fewer than ``size`` bytes of our frames await the peer's receipts (the
        pacing of a bulk transfer: :mod:`garcon_link.rpc.chunks`). Unbounded: the caller bounds it.

        Returns:
            ``True`` once below; ``False`` if the session was retired first.
        """
        return await self._outbound.wait_retained_below(size)

    @property
    def issued(self) -> int:
        """Highest ordinal assigned so far (0 before the first send)."""
        return self._session.issued

    def has_capacity(self, size: int) -> bool:
        """Whether retention would admit a ``size``-byte body now (``False`` once retired)."""
        return self._session.has_capacity(size)

    def send_nowait(self, body: bytes | Gathered) -> Ordinal | None:
        """:meth:`send` if it need not wait (no earlier sender waits, retention admits
        ``body``); ``None`` (nothing issued) otherwise."""
        return self._outbound.send_nowait(body)

    def try_send(self, body: bytes | Gathered) -> Ordinal | None:
        """Like :meth:`send` but returns ``None`` instead of waiting when retention is full."""
        return self._outbound.try_send(body)

    # ------------------------------------------------------------------ lifecycle

    def retire(self, reason: FailureReason, detail: str = "") -> SessionFailed:
        """Retire the logical session for good (idempotent; the first cause is kept).

        Closes the delivery stream after what was already accepted, releases senders waiting for
        capacity (they raise), detaches the current socket (the link closes it with the
        reason's close code) and notifies listeners with ``RETIRED``.
        """
        already = self._session.failure is not None
        failure = self._session.fail(reason, detail)
        if already and self._state is TransportState.RETIRED:
            return failure
        log.info(
            "session %s retired: %s",
            self.label,
            failure.cause,
            extra=log_fields(session=self.session_id),
        )
        if self._pending or self._buffer:
            # Accepted and not yet queued for the consumer: hand them over if there is room.
            self._drain_buffer_nowait()
        self._deliver_send.close()
        self._pending_added.set()  # the delivery task ends
        self._delivery_progress.set()
        self._outbound.retire()
        self._retired.set()
        self._watches.retire()
        if self._shared.scope is not None:
            self._shared.scope.cancel()
        self._set_state(TransportState.RETIRED)
        return failure

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
                    self.label,
                    len(self._pending),
                    extra=log_fields(session=self.session_id),
                )
                break
            self._pending.popleft()
        self._clear_pending()

    def _raise_if_failed(self) -> None:
        failure = self._session.failure
        if failure is not None:
            raise failure

    async def wait_detached(self) -> None:
        """Wait until no socket is attached (after :meth:`detach_socket` or :meth:`retire`)."""
        while self._shared.scope is not None:
            await self._run_done.wait()

    def detach_socket(self) -> None:
        """Stop the current socket's pumps (the session stays; used for takeover and tests)."""
        if self._shared.scope is not None:
            self._shared.scope.cancel()

    async def run(self, sock: MessageSocket, peer_received: int) -> None:
        """Attach ``sock`` and pump it until it ends, then detach.

        Args:
            sock: an authenticated socket.
            peer_received: the peer's advertised ``received`` (0 for a fresh session).

        Raises:
            SessionFailed: the session failed (it is retired; the link closes the socket with
                ``failure.close_code``). A socket that merely ends is not an error: ``run``
                returns and the session waits, detached, for the next socket.
        """
        self._raise_if_failed()
        if self._shared.scope is not None:
            raise RuntimeError("a socket is already attached to this session")
        try:
            attached = self._session.attach(peer_received)
        except SessionFailed:
            self.retire(FailureReason.RESUME_REFUSED)
            raise
        if attached.confirmed_advanced:
            # The peer's resume position acknowledged frames whose receipts were lost: that
            # frees retention just as a receipt would, so wake senders waiting for capacity.
            self._outbound.capacity_freed()
        self._attachments += 1
        self._shared.fence_passed = False
        self._shared.replay = ReplayWatch(
            self._session.issued, anyio.current_time(), self.limits.replay_inactivity
        )
        self._watches.attached()
        self._set_state(TransportState.REPLAYING)
        self._outbound.attached()
        scope = anyio.CancelScope()
        self._shared.scope = scope
        self._run_done = anyio.Event()
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    # The writer and the watch end in scopes of their own, shielded from the
                    # run's (a detach, a retirement, the link's end cancel that one), so that
                    # their tasks return instead of ending in a CancelledError (garbage in a
                    # reference cycle at every detach), as the heartbeat does
                    # (endpoint._attaching). The reader ends them, however it ends.
                    writing = anyio.CancelScope(shield=True)
                    tg.start_soon(self._outbound.writer, sock, tg.cancel_scope, writing)
                    watching = self._watches.watch_replay(tg)
                    self._shared.sock = sock
                    try:
                        await self._reader(sock)
                    finally:
                        writing.cancel()
                        if watching is not None:
                            watching.cancel()
        finally:
            self._shared.sock = None
            self._shared.scope = None
            self._direct_held = None
            self._outbound.detached()
            self._watches.detached()
            self._run_done.set()
            self._after_socket()
        error, self._direct_error = self._direct_error, None
        if error is not None:
            raise error
        self._raise_if_failed()

    def _after_socket(self) -> None:
        """Synchronous detach bookkeeping (runs in ``finally``, possibly under cancellation)."""
        if self._session.failure is not None:
            if self._state is not TransportState.RETIRED:
                self.retire(self._session.failure.reason)
            return
        now = anyio.current_time()
        self._session.detach(now)
        self._set_state(TransportState.DETACHED)
        self._watches.watch_grace()

    # ------------------------------------------------------------------ pumps

    async def _reader(self, sock: MessageSocket) -> None:
        checkpoint = checkpointer()
        # What earlier attachments accepted and did not deliver was acknowledged, so the peer's
        # replay may fill a whole window beside it: hand it over and read nothing until it is
        # queued, so the pre-readiness buffer holds only this attachment's replay.
        carried = self._buffer.attach()
        if carried:
            self._release(carried, buffered=True)
        await self._wait_delivered()
        # While this task waits for the next message with nothing buffered, the socket may hand
        # a small one to _take_nowait in its callback instead (asyncio: one loop turn less).
        take_directly: Callable[[Callable[[bytes], bool] | None], bool] | None = getattr(
            sock, "take_messages_directly", None
        )
        if take_directly is not None and not take_directly(self._take_nowait):
            take_directly = None
        try:
            await self._read_messages(sock, checkpoint)
        finally:
            if take_directly is not None:
                take_directly(None)

    async def _read_messages(
        self, sock: MessageSocket, checkpoint: Callable[[], Awaitable[None]]
    ) -> None:
        session = self._session
        packet_budget = self.limits.max_packets_per_message
        unyielded_packets = 0  # handled since this task last yielded on purpose
        unyielded_bytes = 0
        while True:
            try:
                data = await sock.receive_message()
            except ProtocolError as exc:
                # A text frame, an over-size message or broken framing: the peer broke the
                # protocol, which is terminal for the session like a malformed packet (the link
                # closes the socket with the specific code it recorded, e.g. 1003 or 1009).
                self.retire(FailureReason.MALFORMED_PACKET, str(exc))
                return
            if data is None:
                retired_by_peer = sock.retired_by_peer()
                if retired_by_peer is not None:
                    # The peer closed because *it* retired the session (or shut down): retire
                    # here too, before detaching, so observers see one transition (to RETIRED).
                    self.retire(FailureReason.PEER_RETIRED, retired_by_peer)
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
            if not self._shared.fence_passed:
                for body in bodies:
                    if not self._buffer_payload(body):
                        return
                if received.fence:
                    # The first receipt on this attachment. Drain, then announce readiness.
                    self._shared.fence_passed = True
                    self._release(self._buffer.release(), buffered=True)
            else:
                self._release(bodies)
            if session.receipt_due:
                # *After* the release: the tasks the payloads woke (a handler, a caller) run
                # first and usually queue a frame, which the receipt then rides with.
                self._receipt_waits()
            if self._shared.fence_passed:
                await self._wait_delivered()
            if received.fence:
                self._set_state(TransportState.READY)
            wants_yield = self._wants_yield
            if bodies and self._shared.fence_passed and wants_yield is not None and wants_yield():
                # The consumer says these payloads woke a lone task (a handler, a waiting
                # caller): let it run before this reader re-arms its read, which is not on the
                # peer's round trip. (Never under load: it would split the batches the writer
                # coalesces.) After READY: what the task does next sees the session ready.
                await checkpoint()
            hold = self._hold
            if bodies and self._shared.fence_passed and hold is not None:
                held = hold()
                if held is not None:
                    await self._wait_for_consumer(held)
            replay = self._shared.replay
            if not replay.done and replay.observe(
                received.progress,
                fence_passed=self._shared.fence_passed,
                confirmed=session.confirmed,
                now=anyio.current_time(),
            ):
                self._watches.replay_finished()
            if unyielded_packets >= packet_budget or unyielded_bytes >= YIELD_EVERY_BYTES:
                # Everything this message carried was handed over: let the other tasks run
                # before the next message, which the socket may return without yielding.
                unyielded_packets = unyielded_bytes = 0
                await checkpoint()

    def _accept(self, data: bytes) -> Received | None:
        """The session's reading of one message, and the receipts it makes due or urgent;
        ``None`` if it retired the session."""
        self._messages_read += 1
        try:
            received = self._session.receive(data)
        except SessionFailed as failure:
            self.retire(failure.reason, failure.detail)
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

    def _take_nowait(self, data: bytes) -> bool:
        """One message, taken in the socket's callback as the waiting reader (asyncio): what
        the reader would do with it, when that needs no wait -- the replay fence has passed,
        the consumer is direct (:meth:`consume`) and nothing awaits delivery or a hold. The
        reader's yield to the task a payload woke is not needed here: that task runs before
        the loop polls the socket again. ``False`` (nothing done): the reader reads it."""
        scope = self._shared.scope
        consumer = self._consumer
        if (
            consumer is None
            or not self._shared.fence_passed
            or scope is None
            or scope.cancel_called
            or self._direct_held is not None
            or self._direct_error is not None
            or ((self._pending or self._in_flight) and self._undelivered())
        ):
            return False
        self._messages_read_directly += 1
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
            replay = self._shared.replay
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
            self.detach_socket()
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
            for body in bodies:  # _hand_over_all, inline: this runs for every message
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
            for body in bodies:  # _hand_over_all, inline: this runs for every message
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
                    self.label,
                    extra=log_fields(session=self.session_id),
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
        # attachment read anything (see _reader).
        overflow = self._buffer.hold(body)
        if overflow is not None:
            self.retire(FailureReason.INBOUND_OVERFLOW, overflow)
            return False
        return True
