"""ExecutorRpc: typed calls, replies, cancellation and streams over one logical session.

Theory of operation
-------------------
One :class:`ExecutorRpc` lives exactly as long as one
:class:`~garcon_link.endpoint.transport.SessionTransport`. It owns the transport's consumer and the
dispatch of envelopes, and delegates the rest: our calls to a :class:`~.caller.Caller`, the
peer's to a :class:`~.dispatcher.Dispatcher` (admission, refusals) that hands what it admits to
:class:`~.handlers.Handlers` (running them), small envelopes sent without a task to an
:class:`~.outbox.Outbox`. This docstring states the rules all of them implement.
It is symmetric: each side may serve a registry of local services and call the peer's. Envelopes
are CBOR arrays inside session message bodies; call ids are per-session increasing integers chosen
by the caller, so ``result``/``error``/``stream_item``/``stream_end`` name *our* outgoing calls and
``call``/``cancel``/``credit`` name the peer's::

    call         [0, id, service, method, args, kwargs, credit_items, credit_bytes]
    result       [1, id, value]
    error        [2, id, {outcome, code, message, remote_type?, traceback?, details?}]
    cancel       [3, id]
    notify       [4, service, method, args, kwargs]
    stream_item  [5, id, value]
    stream_end   [6, id]
    credit       [7, id, items, bytes]
    part         [8, flags, chunk]
                 [8, flags, transfer, chunk]

A body (any of the envelopes above, encoded) longer than ``Limits.bulk_chunk_bytes`` is sent as
``part`` envelopes, paced so that small messages interleave with it, and dispatched whole once
its final part arrives, through a path that refuses ``part`` (parts do not nest;
:mod:`garcon_link.rpc.chunks`: the rules, pacing and hostile parts). Parts name their transfer
once the peer said it reads ids (the internal notification ``$link.parts``), so several
transfers interleave. A request's ordinal is that of
its final part, so a call cancelled or timed out before its final part left is
``NOT_DISPATCHED`` (an abort part frees the peer's buffer). Call ids must increase in the order
calls *arrive*: a call sent in parts is given a fresh id when its turn to send comes (calls
issued meanwhile overtook it), and the receiver checks and records it at the first part, so
small calls with higher ids may complete before it is reassembled.

The envelopes are typed (one frozen dataclass per kind) and encoded and decoded only in
:mod:`garcon_link.rpc.envelopes`; :meth:`ExecutorRpc._dispatch` matches on them. ``call`` may carry
a tenth element and ``notify`` a sixth, the call's *metadata* (a bounded map of text to text, sent
only when non-empty; :mod:`garcon_link.rpc.hooks`): a peer sending more than
``Limits.max_metadata_entries``/``max_metadata_bytes`` or a malformed map is refused
``Rejected("INVALID_METADATA")`` (a notification: dropped and logged).

Where outcomes are decided (one place per side, :class:`~.observer.CallObserver`): a caller's
call ends at the endpoint's :meth:`CallObserver.call` (a facade call, with its session lookup and
retries) or its stream's end; a handler ends in the one runner of :mod:`.handlers`
(:meth:`Handlers.run`, by reply policy: unary, stream, notification, keyed), which decides
the one reply it sends; a refusal in :meth:`Dispatcher._refuse`. Counters and per-call hooks sit
there and nowhere else.

``call`` may carry a ninth element, an idempotency key: ``[0, id, service, method,
args, kwargs, credit_items, credit_bytes, key]`` with ``key`` 1 to 128 bytes (a CBOR byte
string). An eight-element ``call`` is unkeyed. A key of another type or size, a key
on a stream, or a key sent to a side that keeps no idempotency table (the controller) is refused
``Rejected("INVALID_ARGUMENTS")`` (``OPERATION_UNSUPPORTED`` for the last) without running
anything. A keyed unary call is run through the worker's
:class:`~garcon_link.rpc.idempotency.KeyedExecutions` (see that module for what is guaranteed).

A ``cancel`` is answered with what happened to the call (*cancel receipts*), in the grammar above:
an ``error`` whose body carries ``cancel`` (a text field a caller that does not know it ignores):

* not started -- ``[2, id, {outcome: not_dispatched, code: CANCELLED, cancel: "not_started"}]``
  (the answer to any cancel before dispatch);
* cancelled (the running handler was interrupted) -- ``[2, id, {outcome: unknown, code:
  CANCELLED, cancel: "cancelled"}]``;
* completed -- nothing more: the call's own reply (result or error) was handed to the session
  before the cancel was handled, so it precedes (session order) anything sent for the cancel.

Outcomes (who may have executed what):

* A call whose request could not be issued (offline, over budget, too large, encode failure) is
  ``NOT_DISPATCHED``; nothing was written.
* When the session is retired (:meth:`ExecutorRpc.retire_unknown`), a pending call whose
  request ordinal was handed to a socket (``ordinal <= transport.offered``) is ``UNKNOWN``; one
  whose request never reached any socket is ``NOT_DISPATCHED``. Later replies are dropped.
* A timeout sends ``cancel`` (``NotDispatched("TIMEOUT")`` at once if the request was still
  waiting for retention capacity) and then waits up to ``Limits.cancel_grace`` for the peer's
  answer, the call still pending meanwhile: the call's own reply -- a result is *delivered*, an
  error raised as received (the call completed before the cancel reached it); a receipt
  "not started" -> ``NotDispatched("TIMEOUT")``; a receipt "cancelled" -> ``OutcomeUnknown
  ("TIMEOUT")`` (it ran, perhaps partly: it may have had effects). No answer within the grace (an
  old peer sends no receipt for an interrupted handler; a handler that ignores cancellation) is
  today's ``OutcomeUnknown("TIMEOUT")``; so is continuity lost meanwhile (``CONTINUITY_LOST``).
  Cancelling the awaiting task sends ``cancel`` and raises the cancellation at once (there is no
  caller left to tell): the peer's answer is dropped.
* A reply we cannot read is ``UNKNOWN`` (``MALFORMED_REPLY`` / ``MALFORMED_ERROR``), never
  ``FAILED``: a result or error envelope of the wrong shape, one whose value does not decode (its
  ``[kind, id`` head still names the call), or an error body whose fields are missing or mistyped
  says nothing trustworthy about whether the handler ran, finished or raised -- so nothing is
  claimed, and ``cancel`` is sent in case it still runs. ``FAILED`` (:class:`RemoteError`) means
  the peer *said* the handler executed and raised, in a well-formed error body.
* A well-formed result whose value does not convert to the interface's return hint is
  ``FAILED`` (``RemoteError("INVALID_RESULT")``, no ``remote_type``): the peer attests, in a
  readable envelope, that the call ran to completion -- as certain as any result -- and only its
  value breaks the contract, so it executed and failed; ``UNKNOWN`` would understate what is known
  and invite a retry of a call that certainly ran. A stream item that does not convert, or that
  exceeds the credit we granted (``FLOW_CONTROL_VIOLATION``), ends the stream with ``UNKNOWN``
  instead: we cancel a generator that was still running, so how far it got is not known (as for
  a stream cut by retirement); items delivered before stand.

Graceful drain: :meth:`ExecutorRpc.start_drain` makes the receiving side refuse every
new call, unexecuted, with ``NotDispatched("DRAINING")`` (the internal ``describe`` is still
answered; a new notification is dropped and logged), while the handlers already running go on and
reply as usual; our own calls are not affected (a handler may still call back). The endpoint then
awaits :meth:`ExecutorRpc.wait_idle` and :meth:`SessionTransport.wait_acknowledged`, bounded by
its drain time, before it closes.

Goodbye: ``start_drain`` also tells the peer, once per session, with the internal notification
``notify [4, "$link", "draining", [], {}]`` -- a session message like any other, so it is
retained and replayed across a socket loss and arrives after everything sent before it. The
peer's side sets :attr:`ExecutorRpc.peer_draining` for the rest of the session and tells the
``on_peer_draining`` callback once (the controller's availability becomes ``draining``). Nothing
clears it: draining ends with the session. A side that does not know the method drops the
notification and logs it (at most once per ``log_interval``).

Receiving side rules: arguments are converted against the interface's type hints before the
handler runs (``Rejected("INVALID_ARGUMENTS")`` names the field); unknown services, unknown or
private methods are ``Rejected("OPERATION_UNSUPPORTED")``; at most ``max_incoming_calls`` handlers,
streams and one-way handlers run at once (excess: ``NotDispatched("OVERLOADED")``; an excess
notification, which has no reply, is dropped and logged); a ``notify`` may name a one-way or a
unary method (a worker serving a plain class does not know which methods the caller's interface
marks one-way), never a stream; a call id that does not increase
is dropped and logged (it cannot be answered without confusing the caller). A malformed envelope
fails only the call or stream it names -- or is dropped if it names none -- never the session.

Replies never grow without bound, whatever the peer sends and whether or not it acknowledges:

* A handler's reply (result, error, "cancelled before dispatch") is written by the handler's own
  task, which keeps its ``max_incoming_calls`` slot until the reply is handed to the session
  (when retention is full, it waits there for capacity).
* A *refusal* -- an error reply to a call that never ran (over budget, unknown service or method,
  bad arguments) -- has no task: it is written at once if retention has room, else queued for
  the one drain task. At ``max_queued_refusals`` queued refusals the transport's reader is paused
  (:meth:`PayloadConsumer.hold`): nothing more is read from the socket until the
  backlog halves, so the peer is back-pressured instead of the queue growing. The payloads of the
  message being handed over when the bound is reached are still answered: past the bound they are
  refused ``OVERLOADED`` (honest: not run) and kept as call ids only, about as many bytes as the
  ids took on the wire. A peer that respects its own ``max_pending_calls`` (<= our bound) never
  meets it. Refusal messages are cut to ``MAX_REFUSAL_MESSAGE`` characters. The backlog drains
  only as the peer's receipts free retention, and those arrive on the socket we stopped reading:
  a peer that floods calls *and* withholds receipts therefore stalls its own session until it
  leaves (a heartbeat ping then fails and the session detaches) -- nothing it holds grows
  meanwhile. Like any authenticated peer that stays connected, it keeps the session until then
  (the link's takeover probe counts a socket we are not reading as healthy).
* Our own control envelopes (``cancel``, ``credit``) that meet full retention are queued for the
  same drain task; an abandoned call keeps counting against ``max_pending_calls`` until its
  ``cancel`` is handed over, and credit is only granted for items consumed, so both queues are
  bounded by the pending budget.

Streams use credit: the consumer grants ``stream_window_items``/``stream_window_bytes`` and tops up
as it consumes; the producer waits for credit *before* pulling the next item from the generator,
so a paused stream holds at most one item in flight. The consumer *enforces* the credit: an item
that arrives when the granted items or bytes are used up (the producer may overdraw bytes by its
last item only, as it charges after encoding) is a flow-control violation -- that stream ends
with ``OutcomeUnknown("FLOW_CONTROL_VIOLATION")`` and is cancelled on the peer, the session stays
-- so the consumer's buffer is bounded by the credit by construction.

A :class:`RemoteStream` dropped without ``aclose()`` (``break`` out of ``async for``, or lost to
a reference cycle) is reclaimed: a ``weakref.finalize`` hook, which may run inside the garbage
collector at any point, only *schedules* (thread-safely) a callback on the event loop; that
callback frees the call's pending slot and cancels it on the peer. The stream's buffered state
lives in a separate object the pending call points to, so nothing the session holds keeps the
iterator alive.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from ..core.wire import CloseCode, decode_item, peer_retired_detail
from ..endpoint.transport import PayloadConsumer, SessionTransport
from ..errors import CallError, FailureReason, MalformedFrame, RemoteError, SessionFailed
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_text
from ..net.backend import on_asyncio
from .caller import Caller, Expected, Forward, RemoteStream
from .chunks import ChunkSender, PartViolation, Transfers, parse_part, parse_transfer_part
from .dispatcher import Dispatcher
from .envelopes import (
    CALL,
    CANCEL,
    CREDIT,
    END,
    ERROR,
    ITEM,
    NOTIFY,
    PART,
    REPLY_KINDS,
    RESULT,
    BadEnvelope,
    Call,
    Cancel,
    Credit,
    End,
    Envelope,
    Error,
    Item,
    Notify,
    Part,
    Result,
    Whole,
    envelope_head,
)
from .envelopes import decode as decode_envelope
from .envelopes import encode as encode_envelope
from .errorbody import MAX_REFUSAL_MESSAGE, register_exception, unregister_exception
from .handlers import Handlers, Incoming, current_session
from .idempotency import KeyedExecutions
from .interface import MethodSpec
from .observer import CallObserver, CallStatistics, Observed, end_of
from .outbox import CONTROL_KIND, Outbox
from .registry import (
    DESCRIBE_SPEC,
    DRAINING_METHOD,
    INTERNAL_SERVICE,
    INVENTORY_SPEC,
    PARTS_METHOD,
    Registry,
)
from .resources import ServiceScope
from .splice import SPLICE_TAG, Splicer

__all__ = [
    "CALL",
    "CANCEL",
    "CallObserver",
    "CallStatistics",
    "CREDIT",
    "END",
    "ERROR",
    "ITEM",
    "MAX_REFUSAL_MESSAGE",
    "NOTIFY",
    "RESULT",
    "ExecutorRpc",
    "Forward",
    "Incoming",
    "Observed",
    "Registry",
    "RemoteStream",
    "RpcStatistics",
    "current_rpc",
    "end_of",
    "register_exception",
    "unregister_exception",
]

log = logging.getLogger("garcon_link.rpc")  # the name users configure (README)


_GOING_AWAY = peer_retired_detail(CloseCode.GOING_AWAY)
"""How a session retired by the peer's 1001 close (its process shutting down) is detailed."""


def _shut_down(failure: Exception | None) -> bool:
    """Whether ``failure`` is the peer's process shutting down (its link closed with 1001)."""
    return (
        isinstance(failure, SessionFailed)
        and failure.reason is FailureReason.PEER_RETIRED
        and (failure.detail == _GOING_AWAY or failure.detail.startswith(f"{_GOING_AWAY} ("))
    )


@dataclass(frozen=True, slots=True)
class _ReaderConsumer:
    """What :meth:`ExecutorRpc.run` hands the transport's reader (a :class:`PayloadConsumer`):
    the dispatch and the bound methods of the halves that answer the reader's questions, held as
    plain fields so that a message costs no call through this object."""

    deliver: Callable[[bytes | memoryview], None]
    """The coordinator's dispatch, in the context of the task that runs the session."""
    wants_yield: Callable[[], bool]
    """:meth:`Handlers.alone`."""
    hold: Callable[[], anyio.Event | None]
    """:meth:`Outbox.hold_reader`: the refusal backlog's back-pressure."""
    batch_end: Callable[[], None]
    """:meth:`Handlers.start_handlers`."""


def current_rpc() -> ExecutorRpc:
    """The session a handler is running in (for calls back to the peer).

    Raises:
        LookupError: outside a handler.
    """
    session: ExecutorRpc = current_session.get()
    return session


@dataclass(frozen=True, slots=True)
class RpcStatistics:
    """A snapshot of one :class:`ExecutorRpc` (see :meth:`ExecutorRpc.statistics`).

    Attributes:
        pending_calls: our calls and streams awaiting a reply, plus abandoned ones whose
            ``cancel`` still waits for retention capacity (what ``max_pending_calls`` counts).
        incoming_calls: the peer's calls, streams and one-way calls whose handlers run (or
            wait to hand over their reply) -- what ``max_incoming_calls`` counts.
        queued_refusals: refusals waiting for retention capacity (bounded by
            ``max_queued_refusals`` plus what one inbound message carried past it).
        queued_controls: our ``cancel``/``credit`` envelopes waiting for retention capacity.
        refusals: calls refused without running, since the session began.
        reader_holds: how many times the refusal backlog paused the socket reader.
        reader_held: whether it is paused now.
        flow_violations: streams ended because the peer sent items beyond our credit.
        malformed_replies: our calls failed by a reply or error we could not read.
        eager_handlers: the peer's calls whose handler ran to its end (reply handed over)
            within the dispatch of the message that carried them, without a task switch
            (asyncio only; on 3.11 asyncio's own loop, not uvloop; see
            :func:`.handlers._start_handler`). Always 0 elsewhere.
        parts_sent: ``part`` envelopes we sent (bodies over ``bulk_chunk_bytes``;
            :mod:`garcon_link.rpc.chunks`), aborts included.
        parts_received: ``part`` envelopes the peer sent us.
        transfers_received: bodies reassembled from parts and dispatched.
        transfers_aborted: transfers the peer abandoned (an abort part freed our buffer).
        part_violations: parts refused as malformed, out of turn (an abort or a final part
            with no transfer in progress; a transfer id unknown, reused, of another type or
            size, or one transfer beyond ``Limits.bulk_transfers``) or
            beyond the size limit, and transfers whose body is itself a part (parts do not
            nest); all dropped.
        part_buffered: bytes of the peer's transfers in progress held now (0 between transfers).
        transfers_in_progress: the peer's transfers begun and not yet ended (at most
            ``Limits.bulk_transfers`` with ids, and one without).
        transfers_sending: our transfers in progress (aborted ones whose abort part is owed
            included).
        malformed_envelopes: the peer's envelopes dropped as malformed or undecodable (a call
            id that does not increase included).
        notifications_dropped: the peer's notifications dropped (unknown or unreadable,
            draining, or too many handlers running).
    """

    pending_calls: int
    incoming_calls: int
    queued_refusals: int
    queued_controls: int
    refusals: int
    reader_holds: int
    reader_held: bool
    flow_violations: int
    malformed_replies: int
    eager_handlers: int = 0
    parts_sent: int = 0
    parts_received: int = 0
    transfers_received: int = 0
    transfers_aborted: int = 0
    part_violations: int = 0
    part_buffered: int = 0
    transfers_in_progress: int = 0
    transfers_sending: int = 0
    malformed_envelopes: int = 0
    notifications_dropped: int = 0


class ExecutorRpc:
    """Typed RPC over one logical session.

    The coordinator: it consumes the session's payloads and dispatches each envelope to its
    :class:`~.caller.Caller` (replies to our calls) or :class:`~.dispatcher.Dispatcher` (the
    peer's calls), which share its :class:`~.outbox.Outbox` and chunk sender. ``call``,
    ``notify`` and ``stream`` are the caller's own methods (no indirection per call).

    Args:
        transport: the session.
        registry: local services the peer may call.
        limits: budgets and windows.
        scope: the service scope handlers run in (worker side), exposed via ``current_scope()``.
        describe: returns this side's manifest for the internal ``describe`` call.
        peer: what to call the peer in messages (``"worker"``, ``"controller"``).
        idempotency: the worker's keyed calls (shared by all its sessions); without it, keyed
            calls from the peer are refused.
        observer: the endpoint's hooks and call counters (shared by all its sessions); the
            server side's outcome point (:class:`CallObserver`).
        on_peer_draining: called once, from the dispatch of the peer's goodbye (module
            docstring), when :attr:`peer_draining` becomes true.
    """

    def __init__(
        self,
        transport: SessionTransport,
        registry: Registry,
        limits: Limits,
        *,
        scope: ServiceScope | None = None,
        describe: Callable[[], dict[str, Any]] | None = None,
        peer: str = "peer",
        idempotency: KeyedExecutions | None = None,
        observer: CallObserver | None = None,
        on_peer_draining: Callable[[], None] | None = None,
    ) -> None:
        self.idempotency = idempotency
        self.peer_state_id: bytes | None = None
        """The id of the worker's state directory (``describe``'s ``state_id``), if it keeps
        one: a worker process restarted on the same directory still knows its keyed calls."""
        self.observer = observer if observer is not None else CallObserver(limits=limits)
        self.transport = transport
        self.peer = peer
        self.registry = registry
        self.limits = limits
        self.scope = scope
        # Bodies over bulk_chunk_bytes go in parts (garcon_link.chunks), both ways.
        self._chunks = ChunkSender(
            transport,
            limits.bulk_chunk_bytes,
            limits.bulk_window_bytes,
            limits.max_frame_bytes,
            transfers=limits.bulk_transfers,
        )
        self._transfers = Transfers(
            limits.max_frame_bytes, transfers=limits.bulk_transfers, splice=True
        )
        self._parts_told = False  # whether $link.parts was sent (at the peer's first part)
        self._part_violations = 0
        self._malformed_envelopes = 0
        # What the peer makes us log: at most one line per reason per log_interval (the exact
        # counts are in statistics()).
        self._peer_log = PeerLogLimiter(
            log, interval=limits.log_interval, max_lines=limits.max_log_lines
        )
        self._retired = False
        self._tg: anyio.abc.TaskGroup | None = None
        # Set (and dropped) whenever a call of ours or a handler of the peer's ends: wait_idle.
        self._settled: anyio.Event | None = None
        self._outbox = Outbox(transport, limits, self._peer_log)
        caller = self._caller = Caller(
            transport,
            limits,
            self.observer,
            self._chunks,
            self._outbox,
            self._note_settled,
            self._peer_log,
            peer,
        )
        handlers = self._handlers = Handlers(
            self,
            transport,
            limits,
            self.observer,
            self._chunks,
            self._note_settled,
            self._peer_log,
            caller._pending,
            scope,
        )
        self._dispatcher = Dispatcher(
            transport,
            registry,
            limits,
            self.observer,
            handlers,
            self._outbox,
            self._dropped_envelope,
            self._peer_log,
            scope=scope,
            describe=describe or (lambda: {"services": registry.manifest()}),
            idempotency=idempotency,
        )
        self._dispatcher.on_peer_draining = on_peer_draining
        # Our calls are the caller's own methods: no indirection on the per-call path.
        self.call = caller.call
        self.call_relayed = caller.call_relayed
        self.forward = caller.forward
        self.notify_relayed = caller.notify_relayed
        self.stream_relayed = caller.stream_relayed
        self.notify = caller.notify
        self.stream = caller.stream
        # Where each envelope goes (read per envelope by _dispatch_whole).
        self._on_result = caller.on_result
        self._on_error = caller.on_error
        self._on_item = caller.on_item
        self._on_end = caller.on_end
        self._on_call = self._dispatcher.on_call
        self._on_notify = self._notify
        self._on_cancel = handlers.on_cancel
        # serve_raw_calls: offered each whole ``call`` envelope before it is decoded.
        self._raw_calls: Callable[[bytes], bool] | None = None
        self._on_credit = handlers.on_credit

    # ------------------------------------------------------------------ lifecycle

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def draining(self) -> bool:
        return self._dispatcher.draining

    @property
    def peer_instance_id(self) -> bytes | None:
        """The peer's runtime: what session-scoped references we send must carry."""
        return self._caller.peer_instance_id

    @peer_instance_id.setter
    def peer_instance_id(self, value: bytes | None) -> None:
        self._caller.peer_instance_id = value

    @property
    def peer_worker_instance_id(self) -> bytes | None:
        """The worker's runtime: what worker-scoped references carry."""
        return self._caller.peer_worker_instance_id

    @peer_worker_instance_id.setter
    def peer_worker_instance_id(self, value: bytes | None) -> None:
        self._caller.peer_worker_instance_id = value

    @property
    def peer_draining(self) -> bool:
        """Whether the peer said goodbye on this session (module docstring): it drains, and
        refuses every new call until the session ends."""
        return self._dispatcher.peer_draining

    def start_drain(self) -> None:
        """Refuse the peer's new calls with ``NotDispatched("DRAINING")`` from now on, and tell
        the peer so (its goodbye, sent once); running handlers and our own calls go on (module
        docstring). Idempotent."""
        if self._dispatcher.draining:
            return
        self._dispatcher.draining = True
        # A small control envelope: at once, or after what already waits for retention.
        self._outbox.send_soon(
            CONTROL_KIND, encode_envelope(Notify(INTERNAL_SERVICE, DRAINING_METHOD, [], {}))
        )

    async def wait_idle(self) -> bool:
        """Wait until no call of ours awaits a reply and no handler of the peer's calls runs.

        Unbounded: the caller bounds it (a drain's deadline).

        Returns:
            ``True`` once idle; ``False`` if the session was retired first.
        """
        pending, handlers = self._caller._pending, self._handlers
        while pending or handlers.running:
            if self._retired:
                return False
            if self._settled is None:
                self._settled = anyio.Event()
            await self._settled.wait()
        return True

    async def drained(self, seconds: float) -> bool:
        """A drain's wait: up to ``seconds`` until idle (:meth:`wait_idle`) and every frame of
        ours is acknowledged by the peer. Returns ``False`` only when the time ran out (a session
        retired meanwhile ends the wait too: nothing is left to drain)."""
        with anyio.move_on_after(seconds) as deadline:
            if await self.wait_idle():
                await self.transport.wait_acknowledged()
        return not deadline.cancelled_caught

    def _note_settled(self) -> None:
        settled, self._settled = self._settled, None
        if settled is not None:
            settled.set()

    def statistics(self) -> RpcStatistics:
        """A snapshot of this session's calls, handlers and queued replies."""
        caller, dispatcher, outbox = self._caller, self._dispatcher, self._outbox
        handlers = self._handlers
        return RpcStatistics(
            pending_calls=caller.pending,
            incoming_calls=handlers.running,
            queued_refusals=outbox.queued_refusals,
            queued_controls=outbox.queued_controls,
            refusals=dispatcher.refusals,
            reader_holds=outbox.reader_holds,
            reader_held=outbox.reader_held,
            flow_violations=caller.flow_violations,
            malformed_replies=caller.malformed_replies,
            eager_handlers=handlers.eager_handlers,
            parts_sent=self._chunks.parts_sent + self._chunks.aborts_sent,
            parts_received=self._transfers.parts,
            transfers_received=self._transfers.completed,
            transfers_aborted=self._transfers.aborted,
            part_violations=self._part_violations,
            malformed_envelopes=self._malformed_envelopes,
            notifications_dropped=dispatcher.notifications_dropped,
            part_buffered=self._transfers.buffered,
            transfers_in_progress=self._transfers.in_progress,
            transfers_sending=self._chunks.active,
        )

    async def run(self) -> None:
        """Consume the session's payloads until it is retired, then retire every call."""
        # Dispatch never blocks (handlers run in tasks of their own), so the transport's socket
        # reader calls it directly. It does so in this task's context: handlers inherit what a
        # service scope set in the task that runs the session, not the link's context.
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop() if on_asyncio() else None
        handlers = self._handlers

        def dispatch(payload: bytes | memoryview) -> None:
            context.run(self._dispatch, payload)

        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                handlers.attach(tg, loop, context)
                self._outbox.attach(tg)
                consumer: PayloadConsumer = _ReaderConsumer(
                    deliver=dispatch,
                    wants_yield=handlers.alone,
                    hold=self._outbox.hold_reader,
                    batch_end=handlers.start_handlers,
                )
                await self.transport.consume(consumer)
                self.retire_unknown()
                tg.cancel_scope.cancel()
        finally:
            self.retire_unknown()
            handlers.close_unstarted()  # only if a message's dispatch was cut short
            await handlers.join_handlers()

    def retire_unknown(self) -> None:
        """Fail every pending call honestly and cancel every incoming handler (idempotent)."""
        if self._retired:
            return
        self._retired = True
        failure = self.transport.failure
        if _shut_down(failure):
            assert isinstance(failure, SessionFailed)
            # The peer's process stopped (a worker whose drain time ran out, say): said as
            # such, not as a retirement of the session the reader must decode.
            self._caller.retire(
                f"the {self.peer} stopped (shut down) ({failure.detail})",
                sent=f"the {self.peer} stopped (shut down) while the call ran ({failure.detail})",
            )
        else:
            self._caller.retire(str(failure) if failure is not None else "session ended")
        self._handlers.retire()
        self._transfers.reset()  # a partial transfer of the peer's never completes
        self._outbox.retire()  # nothing queued can be sent any more
        self._note_settled()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def describe_peer(self, timeout: float) -> dict[str, Any]:
        """Call the peer's internal ``describe`` and return its manifest."""
        result = await self._caller.call(INTERNAL_SERVICE, DESCRIBE_SPEC, (), {}, timeout=timeout)
        if not isinstance(result, dict):
            raise RemoteError("MALFORMED_MANIFEST", "describe returned no map")
        return result

    def on_inventory(self, listener: Callable[[list[Any]], None]) -> None:
        """Hand every ``$link.inventory`` notification of the peer (its arguments, unchecked:
        ``[sequence, services]`` from an honest worker) to ``listener``, in session order."""
        self._dispatcher.inventory_listener = listener

    async def announce_inventory(self, sequence: int, services: dict[str, Any]) -> None:
        """Tell the peer this side's services changed: ``$link.inventory(sequence, services)``
        (a notification; ``sequence`` increases with each announcement of one endpoint)."""
        await self._caller.notify(INTERNAL_SERVICE, INVENTORY_SPEC, (sequence, services), {})

    # ------------------------------------------------------------------ relaying without tasks
    # A relay (the gateway) answers a call of its peer with a call of its own on another
    # session, each end completing the other from its dispatch (docs/design.md#gateway).

    def serve_directly(self, direct: Callable[[Call, Mapping[str, str]], bool]) -> None:
        """Offer each admitted call of the peer to ``direct`` first (``Dispatcher.direct``)."""
        self._dispatcher.direct = direct

    def serve_raw_calls(self, raw: Callable[[bytes], bool]) -> None:
        """Offer each ``call`` envelope of the peer that arrives whole (not in parts) to
        ``raw`` as its bytes, before it is decoded: ``True`` when ``raw`` took it (checked with
        :meth:`admits_raw_call`, then answered or held, and :meth:`took_raw_call` told), else
        ``False``, and it goes the usual way as if ``raw`` had not seen it."""
        self._raw_calls = raw

    def admits_raw_call(self, call_id: int) -> bool:
        """Whether the dispatcher would admit the peer's call ``call_id`` now and offer it to
        ``Dispatcher.direct``: its id increases, the session is not draining, and fewer than
        ``max_incoming_calls`` calls are running. Otherwise the usual way refuses or drops it."""
        dispatcher = self._dispatcher
        return (
            call_id > dispatcher._last_incoming_id
            and not dispatcher.draining
            and len(dispatcher._incoming) + self._handlers.notifications
            < self.limits.max_incoming_calls
        )

    def took_raw_call(self, call_id: int) -> None:
        """``raw`` (:meth:`serve_raw_calls`) took the peer's call ``call_id``, which
        :meth:`admits_raw_call` admitted: a later call must have a higher id."""
        self._dispatcher._last_incoming_id = call_id

    def hold(self, call_id: int, on_cancel: Callable[[bool], None]) -> Incoming:
        """A slot for the peer's call ``call_id`` without a handler (:meth:`Handlers.hold`)."""
        return self._handlers.hold(call_id, on_cancel)

    def reply_held(
        self,
        call_id: int,
        incoming: Incoming,
        body: bytes,
        error: CallError | None = None,
        cancelled: bool = False,
    ) -> None:
        """Answer a held call (:meth:`Handlers.reply_held`)."""
        self._handlers.reply_held(call_id, incoming, body, error, cancelled)

    def release_held(
        self, call_id: int, incoming: Incoming, error: CallError | None, cancelled: bool
    ) -> None:
        """Free a held call's slot without an answer (:meth:`Handlers.release_held`)."""
        self._handlers.release_held(call_id, incoming, error, cancelled)

    # ------------------------------------------------------------------ test seam
    # For tests and tools that write envelopes by hand on the session (``transport.send``):
    # the ids they must use and the replies they await, without reaching into the halves.

    @property
    def last_incoming_id(self) -> int:
        """The highest call id the peer has used on this session: a hand-written ``call`` from
        the peer's side is served only with a higher one."""
        return self._dispatcher.last_incoming_id

    def pending_call_ids(self) -> list[int]:
        """The ids of our calls awaiting a reply, in increasing order."""
        return sorted(self._caller._pending)

    def next_call_id(self) -> int:
        """Take the next id of our calls for a request written by hand (ids keep increasing)."""
        return self._caller.take_id()

    def expect_reply(self, call_id: int, spec: MethodSpec) -> Expected:
        """Match the peer's replies to ``call_id`` (a request written by hand, with an id from
        :meth:`next_call_id`) as those of a call of ``spec``, from now on, until
        :meth:`Expected.close`. Call it before sending the request: a reply may arrive while
        the send is awaited."""
        return self._caller.expect(call_id, spec)

    # ------------------------------------------------------------------ inbound dispatch

    def _dispatch(self, payload: bytes | memoryview) -> None:
        """One session message's envelope: a part goes to the transfer in progress
        (:meth:`_on_part`; a large one is a view of the received message, its chunk not
        copied until the value is built from it), a result of a forwarded call ends it
        undecoded (:meth:`Caller.on_raw_result`), a whole call is offered undecoded to
        :meth:`serve_raw_calls`' taker first, any other kind is dispatched whole."""
        if len(payload) > 1 and payload[1] == PART:
            # The chunk without a copy (else decoded as any other).
            if payload[0] == 0x84:
                numbered = parse_transfer_part(payload)
                if numbered is not None:
                    self._on_part(Part(numbered[0], numbered[2], numbered[1]))
                    return
            elif payload[0] == 0x83:
                part = parse_part(payload)
                if part is not None:
                    self._on_part(Part(*part))
                    return
        if type(payload) is memoryview:
            payload = payload.tobytes()  # not a part: what follows keeps what it is given
        if (
            self._raw_calls is not None
            and payload[1:2] == b"\x00"
            and 0x88 <= payload[0] <= 0x8A
            and self._raw_calls(payload)
        ):
            return
        if (
            self._caller.forwards
            and payload[:2] == b"\x83\x01"
            and self._caller.on_raw_result(payload)
        ):
            return
        envelope = self._decode(payload)
        if isinstance(envelope, Part):
            self._on_part(envelope)
        elif envelope is not None:
            self._dispatch_whole(envelope, len(payload))

    def _decode(self, payload: bytes, splicer: Splicer | None = None) -> Envelope | None:
        """The envelope ``payload`` holds (with ``splicer``: a body whose large byte strings
        were filled part by part, placeholders in their stead); ``None`` when it is dropped
        (and logged) as undecodable or malformed."""
        try:
            # plain=True: refuses shared references and cycles, so no envelope can expand into
            # a structure larger than its own bytes (a DAG of 2**n paths) later on.
            item = decode_item(
                payload,
                self.limits.max_frame_bytes,
                splice=None if splicer is None else (SPLICE_TAG, splicer.resolve),
            )
        except MalformedFrame as exc:
            self._dropped_envelope(None, peer_text(exc))
            self._undecodable(payload, exc)
            return None
        try:
            return decode_envelope(item)
        except BadEnvelope as exc:
            self._malformed(exc)
            return None

    def _dispatch_whole(self, envelope: Whole, size: int) -> None:
        """An envelope of any kind but ``part`` (``size``: its encoded bytes). The one path a
        body reassembled from parts takes, so parts never nest."""
        match envelope:
            case Result():
                self._on_result(envelope)
            case Item():
                self._on_item(envelope, size)
            case Call():
                self._on_call(envelope)
            case Error():
                self._on_error(envelope)
            case End():
                self._on_end(envelope)
            case Credit():
                self._on_credit(envelope)
            case Cancel():
                self._on_cancel(envelope)
            case Notify():
                self._on_notify(envelope)

    def _on_part(self, envelope: Part) -> None:
        """A part of a body sent in parts: buffered; the whole is dispatched at its final part
        as if it had arrived in one message. A call's id is claimed at its first part, so small
        calls with later ids may complete meanwhile (module docstring of :mod:`.chunks`)."""
        if not self._parts_told:
            # The peer sends parts: tell it, once, that this side reads transfer ids, so that
            # it may interleave its transfers, as many at once as we hold (a peer that does not
            # know it drops this).
            self._parts_told = True
            notice = Notify(INTERNAL_SERVICE, PARTS_METHOD, [self.limits.bulk_transfers], {})
            self._outbox.send_soon(CONTROL_KIND, encode_envelope(notice))
        try:
            fed = self._transfers.feed(envelope.transfer, envelope.flags, envelope.chunk)
        except PartViolation as exc:
            self._part_violations += 1
            self._peer_log.log(
                self.transport.label,
                "parts",
                "session %s: dropping the peer's transfer in parts: %s",
                self.transport.label,
                peer_text(exc),
                extra=log_fields(session=self.transport.session_id),
            )
            return
        if fed is None:
            return  # the rest of a refused transfer
        reassembler, starting, body = fed
        if starting:  # its first part (a transfer is at least two parts)
            first = reassembler.first_chunk()  # None: the rest of a refused one is discarded
            if first is not None:
                reassembler.claimed = self._dispatcher.claim(first)
        if body is None:
            return
        claimed, reassembler.claimed = reassembler.claimed, None
        if claimed == -1:
            return  # a reused call id, dropped (and logged) at its first part
        self._dispatcher.whole_id = claimed
        try:
            # Never through _dispatch: a body is not a part (the reassembler refused the usual
            # encoding of one before joining it; any other is refused here, once decoded).
            whole = self._decode(body, reassembler.splicer)
            reassembler.splicer = None  # its values now belong to the envelope
            if isinstance(whole, Part):
                self._part_violations += 1
                self._malformed(BadEnvelope(PART, "a body sent in parts is itself a part"))
            elif whole is not None:
                self._dispatch_whole(whole, reassembler.body_size)
        finally:
            self._dispatcher.whole_id = None

    def _notify(self, envelope: Notify) -> None:
        """A notification: the peer's ``$link.parts`` (it reads transfer ids) here, without a
        task, any other to the dispatcher."""
        if envelope.method == PARTS_METHOD and envelope.service == INTERNAL_SERVICE:
            # Its first argument, if any, is how many transfers the peer holds at once (further
            # ones are ignored: a later version may send some).
            args = envelope.args
            if not isinstance(args, list) or not args:
                self._chunks.read_ids()
            elif type(args[0]) is int and args[0] >= 1:
                self._chunks.read_ids(args[0])
            else:  # transfers stay one at a time without ids, which any receiver reads
                self._dropped_envelope(NOTIFY, "$link.parts: the count is not an integer >= 1")
            return
        self._dispatcher.on_notify(envelope)

    def _malformed(self, exc: BadEnvelope) -> None:
        """An envelope of the wrong shape: dropped; a reply naming a call of ours fails it."""
        kind = exc.kind
        if kind is None or not CALL <= kind <= PART:
            self._dropped_envelope(None, peer_text(exc))
            return
        if kind in REPLY_KINDS and exc.call_id is not None:
            self._caller.fail_call(
                exc.call_id, "MALFORMED_REPLY", f"the peer's reply: {peer_text(exc)}"
            )
        self._dropped_envelope(kind, peer_text(exc))

    def _dropped_envelope(self, kind: int | None, why: str) -> None:
        """Count a dropped envelope; log it, at most once per ``log_interval``."""
        self._malformed_envelopes += 1
        self._peer_log.log(
            self.transport.label,
            "malformed",
            "session %s: dropping malformed envelope%s: %s",
            self.transport.label,
            "" if kind is None else f" (kind {kind})",
            why,
            extra=log_fields(session=self.transport.session_id),
        )

    def _undecodable(self, payload: bytes, why: MalformedFrame) -> None:
        """An envelope that did not decode, named by its head (``[kind, id``) where it has one.

        A reply kind naming one of our calls: that call's reply is unreadable (``UNKNOWN``). A
        ``call`` with a new id: refused ``Rejected("INVALID_ARGUMENTS")`` at once -- it did not
        run, and its caller need not wait for its timeout (a value past the decoder's bounds,
        such as a bignum over ``wire.MAX_BIGNUM_BYTES``, is the usual cause). Anything else
        stays dropped. The refusal names why (``why``, bounded): the caller's own values that a
        decoder bound refused.
        """
        head = envelope_head(payload)
        if head is None:
            return
        kind, call_id = head
        if kind == CALL:
            self._dispatcher.on_undecodable_call(call_id, peer_text(why, 200))
        elif kind in (RESULT, ERROR, ITEM, END):
            self._caller.fail_call(call_id, "MALFORMED_REPLY", "the peer's reply does not decode")
