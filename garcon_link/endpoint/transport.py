"""SessionTransport: one logical session carried over a succession of sockets.

:class:`SessionTransport` is one state machine (below) run by four parts and their owner. The
parts' pumps -- reader, writer, delivery task, grace and replay watches -- must see each other's
changes synchronously, within the loop turn that made them (a fence passed, a receipt due,
retention freed), so what more than one part reads is one small object,
:class:`~garcon_link.endpoint._shared.Shared`, and each part calls the others only through
their public methods:

* the **inbound side** (:mod:`._inbound`): the socket reader and the pre-readiness buffer;
* the **delivery** (:mod:`._delivery`): the hand-over of accepted payloads to the consumer, in
  order (the delivery queue and its task, or a direct consumer);
* the **outbound side** (:mod:`._outbound`): senders and their capacity waits, writes from the
  issuing task and held writes, the writer task, and when receipts go out;
* the **watches** (:mod:`._watches`): replay inactivity and the detached grace;
* the **owner**, :class:`SessionTransport`: the public face, the states and their listeners,
  statistics, and the life cycle -- :meth:`~SessionTransport.run` (attach, pump, detach) and
  :meth:`~SessionTransport.retire`, which it tells each part.

The rules that need no I/O are sans-IO objects of their own
(:class:`~garcon_link.endpoint.transport_types.PreReadinessBuffer`,
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

from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from ..core.replay import ReplayWatch
from ..core.session import MessageSession, RetentionPool
from ..core.wire import Gathered, Ordinal
from ..errors import FailureReason, SessionFailed
from ..limits import Limits
from ..logs import log_fields
from ._delivery import Delivery
from ._inbound import Inbound
from ._outbound import Outbound
from ._shared import Shared, log, weak_method
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
        self._state = TransportState.DETACHED
        self._listeners: list[Listener] = []
        # The parts hold the owner's methods weakly: the owner and its parts make no cycle.
        retire = weak_method(self.retire)
        self._watches = watches = Watches(shared, task_group, retire)
        self._outbound = outbound = Outbound(
            shared,
            coalesce_limit=min(limits.max_frame_bytes, COALESCE_BYTES),
            quiet=WRITE_NOW_QUIET,
        )
        self._delivery = delivery = Delivery(shared, watches, task_group)
        self._inbound = Inbound(
            shared,
            delivery,
            outbound,
            watches,
            retire=retire,
            set_state=weak_method(self._set_state),
            yield_every_bytes=YIELD_EVERY_BYTES,
        )
        self._run_done = anyio.Event()
        self._attachments = 0

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

    def add_listener(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(state)`` on every state change; returns an unsubscribe callable."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def statistics(self) -> TransportStatistics:
        inbound = self._inbound
        delivery = self._delivery
        outbound = self._outbound
        return TransportStatistics(
            state=self._state,
            session=self._session.statistics(),
            attachments=self._attachments,
            # Pre-readiness payloads count as buffered until the delivery task has taken them.
            buffered_payloads=inbound.buffered_payloads + delivery.buffered_payloads,
            buffered_bytes=inbound.buffered_bytes + delivery.buffered_bytes,
            queued_payloads=delivery.queued_payloads,
            messages_written=outbound.messages_written,
            messages_read=inbound.messages_read,
            messages_read_directly=inbound.messages_read_directly,
            capacity_wakeups=outbound.capacity_wakeups,
            writer_wakeups=outbound.writer_wakeups,
            receipt_timer_fires=outbound.receipt_timer_fires,
            receipt_polls_started=outbound.receipt_polls_started,
            receipt_polls_stopped=outbound.receipt_polls_stopped,
            receipt_poll_writes=outbound.receipt_poll_writes,
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
        return self._delivery.payloads()

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
        await self._delivery.consume(consumer)

    # ------------------------------------------------------------------ sending

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

    def send_nowait(self, body: bytes | Gathered) -> Ordinal | None:
        """:meth:`send` if it need not wait (no earlier sender waits, retention admits
        ``body``); ``None`` (nothing issued) otherwise."""
        return self._outbound.send_nowait(body, False)

    def try_send(self, body: bytes | Gathered) -> Ordinal | None:
        """Like :meth:`send` but returns ``None`` instead of waiting when retention is full; unlike
        :meth:`send_nowait`, issues ``body`` ahead of the senders waiting for capacity if
        retention admits it."""
        return self._outbound.send_nowait(body, True)

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
        self._delivery.retire(self._inbound.release_held())
        self._outbound.retire()
        self._watches.retire()
        if self._shared.scope is not None:
            self._shared.scope.cancel()
        self._set_state(TransportState.RETIRED)
        return failure

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
        shared = self._shared
        if shared.scope is not None:
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
        shared.fence_passed = False
        shared.replay = ReplayWatch(
            self._session.issued, anyio.current_time(), self.limits.replay_inactivity
        )
        self._watches.attached()
        self._set_state(TransportState.REPLAYING)
        self._outbound.attached()
        scope = anyio.CancelScope()
        shared.scope = scope
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
                    shared.sock = sock
                    try:
                        await self._inbound.reader(sock)
                    finally:
                        writing.cancel()
                        if watching is not None:
                            watching.cancel()
        finally:
            shared.sock = None
            shared.scope = None
            self._inbound.detached()
            self._outbound.detached()
            self._watches.detached()
            self._run_done.set()
            self._after_socket()
        error = self._inbound.take_error()
        if error is not None:
            raise error
        self._raise_if_failed()

    def _after_socket(self) -> None:
        """Synchronous detach bookkeeping (runs in ``finally``, possibly under cancellation)."""
        if self._session.failure is not None:
            if self._state is not TransportState.RETIRED:
                self.retire(self._session.failure.reason)
            return
        self._session.detach(anyio.current_time())
        self._set_state(TransportState.DETACHED)
        self._watches.watch_grace(self.retire)
