"""ExecutorRpc: typed calls, replies, cancellation and streams over one logical session.

Theory of operation
-------------------
One :class:`ExecutorRpc` lives exactly as long as one
:class:`~garcon_link.transport.SessionTransport`.
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

A body (any of the envelopes above, encoded) longer than ``Limits.bulk_chunk_bytes`` is sent as
``part`` envelopes, paced so that small messages interleave with it, and dispatched whole once
its final part arrives, through a path that refuses ``part`` (parts do not nest;
:mod:`garcon_link.chunks`: the rules, pacing and hostile parts). A request's ordinal is that of
its final part, so a call cancelled or timed out before its final part left is
``NOT_DISPATCHED`` (an abort part frees the peer's buffer). Call ids must increase in the order
calls *arrive*: a call sent in parts is given a fresh id when its turn to send comes (calls
issued meanwhile overtook it), and the receiver checks and records it at the first part, so
small calls with higher ids may complete before it is reassembled.

The envelopes are typed (one frozen dataclass per kind) and encoded and decoded only in
:mod:`garcon_link.envelopes`; :meth:`ExecutorRpc._dispatch` matches on them. ``call`` may carry a
tenth element and ``notify`` a sixth, the call's *metadata* (a bounded map of text to text, sent
only when non-empty; :mod:`garcon_link.hooks`): a peer sending more than
``Limits.max_metadata_entries``/``max_metadata_bytes`` or a malformed map is refused
``Rejected("INVALID_METADATA")`` (a notification: dropped and logged).

Where outcomes are decided (one place per side, :class:`CallObserver`): a caller's call ends at
the endpoint's :meth:`CallObserver.call` (a facade call, with its session lookup and retries) or
its stream's end; a handler ends in :meth:`ExecutorRpc._run_handler` (``_run_notification``,
``_execute_keyed``), which decides the one reply it sends; a refusal in
:meth:`ExecutorRpc._refuse`. Counters and per-call hooks sit there and nowhere else.

``call`` may carry a ninth element, an idempotency key: ``[0, id, service, method,
args, kwargs, credit_items, credit_bytes, key]`` with ``key`` 1 to 128 bytes (a CBOR byte
string). An eight-element ``call`` is unkeyed, as before. A key of another type or size, a key
on a stream, or a key sent to a side that keeps no idempotency table (the controller) is refused
``Rejected("INVALID_ARGUMENTS")`` (``OPERATION_UNSUPPORTED`` for the last) without running
anything. A keyed unary call is run through the worker's
:class:`~garcon_link.idempotency.KeyedExecutions` (see that module for what is guaranteed).

A ``cancel`` is answered with what happened to the call (*cancel receipts*), in the grammar above:
an ``error`` whose body carries ``cancel`` (a text field callers of old versions ignore):

* not started -- ``[2, id, {outcome: not_dispatched, code: CANCELLED, cancel: "not_started"}]``
  (what a cancel before dispatch always answered, now marked);
* cancelled (the running handler was interrupted) -- ``[2, id, {outcome: unknown, code:
  CANCELLED, cancel: "cancelled"}]`` (new: a handler interrupted used to end without a reply);
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
  (:meth:`SessionTransport.consume` ``hold``): nothing more is read from the socket until the
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
import contextlib
import contextvars
import inspect
import logging
import math
import sys
import time
import traceback
import types
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.abc
import cbor2

from ..core.wire import array_prefix, decode_item, encode_head
from ..endpoint.transport import SessionTransport
from ..errors import (
    CallError,
    MalformedFrame,
    NotDispatched,
    Outcome,
    OutcomeUnknown,
    PayloadTooLarge,
    Rejected,
    RemoteError,
    SessionFailed,
    StaleResource,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_text
from ..net.backend import loop_scheduler, on_asyncio
from .chunks import ChunkSender, PartViolation, Reassembler, parse_part
from .envelopes import (
    CALL,
    CANCEL,
    CREDIT,
    END,
    ERROR,
    ITEM,
    MAX_ARITY,
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
    encode,
    encode_call,
    encode_item,
    encode_result,
    metadata_problem,
)
from .envelopes import decode as decode_envelope
from .hooks import CallEnd, CallHook, CallInfo, CallKind, CallSide, _current_metadata
from .idempotency import (
    Await,
    Conflict,
    Execute,
    Full,
    KeyedExecutions,
    Replay,
    Reply,
    arguments_digest,
    key_problem,
    reply_envelope,
)
from .interface import MethodKind, MethodSpec, ServiceSpec, from_wire, to_wire
from .resources import ResourceRef, ServiceScope, _current

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
    "Observed",
    "Registry",
    "RemoteStream",
    "RpcStatistics",
    "current_rpc",
    "end_of",
    "register_exception",
]

log = logging.getLogger("garcon_link.rpc")  # the name users configure (README)

INTERNAL_SERVICE = "$link"
# The ``cancel`` field of an error body that answers a cancel (module docstring).
NOT_STARTED, INTERRUPTED = "not_started", "cancelled"

MAX_REFUSAL_MESSAGE = 512
"""Characters of a refusal's message that are sent (it may quote peer-supplied names)."""
MAX_ERROR_MESSAGE = 16000
"""Characters of a handler's error message (and, separately, of its traceback) that are sent."""

T = TypeVar("T")

_registered_exceptions: dict[str, type[BaseException]] = {}
_current_rpc: contextvars.ContextVar[ExecutorRpc] = contextvars.ContextVar("garcon_link_rpc")


def register_exception(cls: type[BaseException]) -> type[BaseException]:
    """Allow ``cls`` raised by a remote handler to be re-raised locally as itself.

    Only registered classes are reconstructed (by qualified name, never by import), with the
    remote message as their single argument; anything else arrives as :class:`RemoteError`.
    Usable as a class decorator.
    """
    _registered_exceptions[_qualname(cls)] = cls
    return cls


def current_rpc() -> ExecutorRpc:
    """The session a handler is running in (for calls back to the peer).

    Raises:
        LookupError: outside a handler.
    """
    return _current_rpc.get()


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True, slots=True)
class _Bound:
    spec: ServiceSpec
    target: object
    scope: ServiceScope | None = None  # set for a worker-scoped service


class Registry:
    """Services one side exposes: name -> (interface spec, implementation object)."""

    def __init__(self) -> None:
        self._services: dict[str, _Bound] = {}

    def add(
        self, name: str, target: object, spec: ServiceSpec, *, scope: ServiceScope | None = None
    ) -> None:
        """Expose ``target`` as ``name``; with ``scope``, its handlers run in that scope (their
        ``current_scope()``) instead of the session's: a worker-scoped service."""
        if not name or name.startswith(("_", "$")):
            raise ValueError(f"invalid service name {name!r}")
        self._services[name] = _Bound(spec, target, scope)

    def get(self, name: str) -> _Bound | None:
        return self._services.get(name)

    def names(self) -> list[str]:
        return sorted(self._services)

    def manifest(self) -> dict[str, Any]:
        return {name: b.spec.manifest() for name, b in sorted(self._services.items())}


def _in_scope(scope: ServiceScope, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` run with ``scope`` as its ``current_scope()``.

    Each handler runs in a task (and context) of its own, so setting the variable for the rest
    of that task reaches a coroutine's body and an async generator's alike.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        _current.set(scope)
        return target(*args, **kwargs)

    return call


def _error_body(outcome: Outcome, code: str, message: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"outcome": outcome.value, "code": code, "message": message}
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _malformed_error(why: str) -> OutcomeUnknown:
    return OutcomeUnknown("MALFORMED_ERROR", f"the peer's error reply is unreadable: {why}")


_OPTIONAL_ERROR_FIELDS: dict[str, type] = {
    "message": str,
    "remote_type": str,
    "traceback": str,
    "details": dict,
    "cancel": str,  # a cancel receipt (module docstring)
}


def _error_from_body(body: Any) -> CallError:
    """The caller's exception for a received error body ``{outcome, code, message, ...}``.

    Strict: a body that is not a map, lacks a text ``code``, names no known outcome, or holds a
    known field of the wrong type is *unreadable*, and an unreadable error says nothing about
    whether the handler ran: :class:`OutcomeUnknown` (``MALFORMED_ERROR``), never
    :class:`RemoteError`. Unknown extra keys are ignored (room for later fields). Peer values are
    type-checked before any is converted to text, so no value can make this raise.
    """
    if not isinstance(body, dict):
        return _malformed_error(f"a {type(body).__name__}, not a map")
    code = body.get("code")
    if type(code) is not str:
        return _malformed_error("no text 'code'")
    for key, kind in _OPTIONAL_ERROR_FIELDS.items():
        if key in body and type(body[key]) is not kind:
            return _malformed_error(f"{key!r} is not a {kind.__name__}")
    message: str = body.get("message", "")
    remote_type: str | None = body.get("remote_type")
    outcome = body.get("outcome")
    if outcome == Outcome.NOT_DISPATCHED.value:
        return NotDispatched(code, message)
    if outcome == Outcome.REJECTED.value:
        stale = code == "STALE_RESOURCE" or remote_type == _qualname(StaleResource)
        return StaleResource(code, message) if stale else Rejected(code, message)
    if outcome == Outcome.FAILED.value:
        return RemoteError(
            code,
            message,
            remote_type=remote_type,
            remote_traceback=body.get("traceback"),
            details=body.get("details"),
        )
    if outcome == Outcome.UNKNOWN.value:
        return OutcomeUnknown(code, message)
    return _malformed_error("no known 'outcome'")


def _envelope_head(payload: bytes) -> tuple[int, int] | None:
    """``(kind, id)`` read from the first bytes of an envelope that did not decode as a whole.

    Only the exact prefix every envelope naming a call starts with is accepted: a definite array
    head of 2 to ``MAX_ARITY`` items, a kind of 0..7 and an unsigned integer id. This lets an
    undecodable *reply* (e.g. a result whose value holds a tag) fail the call it names at once
    instead of leaving it to its timeout.
    """
    prefix = array_prefix(payload)
    if prefix is None:
        return None
    length, kind, call_id = prefix
    if not 2 <= length <= MAX_ARITY or kind > CREDIT:
        return None
    return kind, call_id


def _local_exception(error: CallError) -> BaseException:
    """Re-create an allow-listed remote exception, else return ``error`` itself."""
    if isinstance(error, RemoteError) and error.remote_type in _registered_exceptions:
        cls = _registered_exceptions[error.remote_type]
        try:
            exc = cls(error.message)
        except Exception:
            return error
        exc.__cause__ = error
        return exc
    return error


_KIND: dict[MethodKind, CallKind] = {
    MethodKind.UNARY: "unary",
    MethodKind.STREAM: "stream",
    MethodKind.ONEWAY: "notify",
}
_NO_METADATA: Mapping[str, str] = types.MappingProxyType({})


def end_of(exc: BaseException) -> tuple[Outcome, str, bool]:
    """``(outcome, code, cancelled)`` of a call that raised ``exc``.

    An allow-listed remote exception (:func:`register_exception`) carries its
    :class:`RemoteError` as ``__cause__``; a cancellation (any ``BaseException`` that is not an
    ``Exception``) may have left after its request was sent: ``UNKNOWN``/``CANCELLED``.
    """
    if isinstance(exc, CallError):
        return exc.outcome, exc.code, False
    cause = exc.__cause__
    if isinstance(cause, CallError):
        return cause.outcome, cause.code, False
    if not isinstance(exc, Exception):
        return Outcome.UNKNOWN, "CANCELLED", True
    return Outcome.UNKNOWN, "LOCAL_ERROR", False


@dataclass(frozen=True, slots=True)
class CallStatistics:
    """Calls ended so far, by side, outcome label and code (see :meth:`CallObserver.statistics`).

    Attributes:
        client: ``{(label, code): count}`` for the calls this endpoint made; ``label`` is
            :attr:`garcon_link.hooks.CallEnd.label` (``"ok"``, ``"cancelled"`` or an outcome's
            value), ``code`` is ``None`` for ``"ok"``.
        server: the same for the peer's calls this endpoint served, refusals included (calls
            refused without running: ``rejected``/``not_dispatched`` with their code).
    """

    client: Mapping[tuple[str, str | None], int]
    server: Mapping[tuple[str, str | None], int]

    def total(self, side: CallSide, label: str | None = None) -> int:
        """Calls of ``side`` ended with ``label`` (all labels when ``None``)."""
        counts = self.client if side == "client" else self.server
        return sum(n for (lab, _), n in counts.items() if label is None or lab == label)


class Observed:
    """A call being observed by hooks: what ``call_ended`` needs."""

    __slots__ = ("done", "info", "started", "states")

    def __init__(self, info: CallInfo, states: list[object], started: float) -> None:
        self.info = info
        self.states = states
        self.started = started
        self.done = False


class CallObserver:
    """The one place where every call's outcome is counted and told to the hooks.

    One per endpoint (a :class:`~garcon_link.api.controller.RemoteExecutor`, a
    :class:`~garcon_link.api.worker.Worker`), shared by all its sessions, so its counters survive
    session replacement. Client side: :meth:`call` wraps one facade call (session lookup,
    retries and all); streams use :meth:`stream_started`/:meth:`stream_ended`. Server side: the
    session's :class:`ExecutorRpc` calls :meth:`server_started`/:meth:`server_ended` around each
    handler and :meth:`refused` for each call refused without running. With no hook registered
    the only work per call is one dictionary update (and one truth test of ``hooks``).

    Args:
        hooks: the endpoint's :class:`~garcon_link.hooks.CallHook` objects, in call order
            (``call_ended`` runs in the reverse order).
        limits: for the metadata bounds.
        executor: the executor id hooks are told (``None`` when not known).
    """

    __slots__ = (
        "_client",
        "_server",
        "_warned",
        "executor",
        "hooks",
        "incoming_peak",
        "limits",
        "pending_peak",
    )

    def __init__(
        self,
        hooks: Sequence[CallHook] = (),
        limits: Limits | None = None,
        executor: str | None = None,
    ) -> None:
        self.hooks = tuple(hooks)
        self.limits = limits or Limits()
        self.executor = executor
        self._client: dict[tuple[str, str | None], int] = {}
        self._server: dict[tuple[str, str | None], int] = {}
        self._warned: set[tuple[int, str]] = set()
        # The most calls pending / handlers running at once on any session of the endpoint.
        self.pending_peak = 0
        self.incoming_peak = 0

    def statistics(self) -> CallStatistics:
        return CallStatistics(
            client=types.MappingProxyType(dict(self._client)),
            server=types.MappingProxyType(dict(self._server)),
        )

    # -- counting and hooks

    @staticmethod
    def _count(
        counts: dict[tuple[str, str | None], int],
        outcome: Outcome | None,
        code: str | None,
        cancelled: bool,
    ) -> None:
        # The key is CallEnd.label's, without building a CallEnd when no hook needs one.
        key = ("cancelled" if cancelled else "ok" if outcome is None else outcome.value, code)
        counts[key] = counts.get(key, 0) + 1

    def _start(self, info: CallInfo) -> Observed:
        states: list[object] = []
        for index, hook in enumerate(self.hooks):
            try:
                states.append(hook.call_started(info))
            except Exception:
                self._hook_failed(index, hook, "call_started")
                states.append(None)
        return Observed(info, states, time.monotonic())

    def _end(self, observed: Observed, end: CallEnd) -> None:
        if observed.done:
            return
        observed.done = True
        for index in range(len(self.hooks) - 1, -1, -1):
            hook = self.hooks[index]
            try:
                hook.call_ended(observed.info, observed.states[index], end)
            except Exception:
                self._hook_failed(index, hook, "call_ended")

    def _hook_failed(self, index: int, hook: CallHook, method: str) -> None:
        if (index, method) in self._warned:
            return
        self._warned.add((index, method))
        log.warning("call hook %r raised in %s (ignored from now on)", hook, method, exc_info=True)

    def check_metadata(self, metadata: Mapping[str, str]) -> None:
        """Raise ``NotDispatched("INVALID_METADATA")`` for metadata over the bounds."""
        problem = metadata_problem(
            metadata, self.limits.max_metadata_entries, self.limits.max_metadata_bytes
        )
        if problem is not None:
            raise NotDispatched("INVALID_METADATA", problem)

    # -- client side

    async def call(
        self,
        service: str,
        spec: MethodSpec,
        metadata: Mapping[str, str] | None,
        run: Callable[[Mapping[str, str] | None], Awaitable[T]],
    ) -> T:
        """Run one call, ``run(metadata)``, counting its outcome and telling the hooks."""
        observed = None
        if self.hooks:
            metadata = dict(metadata) if metadata else {}  # the hooks may add to it
            info = CallInfo("client", service, spec.name, _KIND[spec.kind], self.executor, metadata)
            observed = self._start(info)
        try:
            if metadata:
                self.check_metadata(metadata)
            value = await run(metadata or None)
        except BaseException as exc:
            self.client_ended(observed, *end_of(exc))
            raise
        if observed is None:
            counts = self._client
            counts[_OK] = counts.get(_OK, 0) + 1
        else:
            self.client_ended(observed, None, None, False)
        return value

    def stream_started(
        self, service: str, spec: MethodSpec, metadata: Mapping[str, str] | None
    ) -> Observed | None:
        """A stream's first iteration: the hooks' handle (``None`` without hooks). The metadata
        to send is then the handle's ``info.metadata`` (hooks may have added to it); the caller
        validates it (:meth:`check_metadata`) and ends the stream with :meth:`client_ended`."""
        if not self.hooks:
            return None
        sent = dict(metadata) if metadata else {}
        return self._start(CallInfo("client", service, spec.name, "stream", self.executor, sent))

    def client_ended(
        self, observed: Observed | None, outcome: Outcome | None, code: str | None, cancelled: bool
    ) -> None:
        """A client call or stream ended (the stream's handle may be ``None``: no hooks)."""
        if observed is None:
            self._count(self._client, outcome, code, cancelled)
            return
        if observed.done:
            return
        end = CallEnd(outcome, code, time.monotonic() - observed.started, cancelled)
        self._count(self._client, outcome, code, cancelled)
        self._end(observed, end)

    # -- server side

    def server_started(
        self,
        service: str,
        spec: MethodSpec,
        metadata: Mapping[str, str],
        kind: CallKind | None = None,
    ) -> Observed | None:
        """A handler starts (in its own task); ``kind`` overrides the method's (a notification
        may name a unary method)."""
        if not self.hooks:
            return None
        kind = kind or _KIND[spec.kind]
        return self._start(CallInfo("server", service, spec.name, kind, self.executor, metadata))

    def server_ended(
        self, observed: Observed | None, error: CallError | None, cancelled: bool
    ) -> None:
        """A handler ended: ``error`` is what its caller is told (``None``: it succeeded)."""
        if error is None:
            outcome: Outcome | None = None
            code = None
        else:
            outcome, code = error.outcome, error.code
        if observed is None:
            self._count(self._server, outcome, code, cancelled)
            return
        end = CallEnd(outcome, code, time.monotonic() - observed.started, cancelled)
        self._count(self._server, outcome, code, cancelled)
        self._end(observed, end)

    def refused(self, error: CallError) -> None:
        """A peer's call refused without running (no hooks: no handler ran)."""
        self._count(self._server, error.outcome, error.code, False)


_OK: tuple[str, str | None] = ("ok", None)


_TYPE_ERROR: dict[str, Any] = {"remote_type": "TypeError"}


def _handler_error(exc: Exception) -> tuple[CallError, dict[str, Any]]:
    """What a caller is told about a handler that raised ``exc``, and the error body's extras.

    A handler may refuse (``Rejected``, e.g. ``scope.check`` -> ``StaleResource``, whatever its
    code); a failure of a call it made itself already says FAILED. Both keep their code; the
    type tells the caller which ``Rejected`` to raise. Anything else -- including
    NotDispatched/OutcomeUnknown from a call the handler made -- is a failure of *this* call,
    which did execute: never report it as not-dispatched (safe to retry) or unknown.
    """
    if isinstance(exc, Rejected | RemoteError):
        remote_type = exc.remote_type if isinstance(exc, RemoteError) else None
        return exc, {"remote_type": remote_type or _qualname(type(exc))}
    tb = "".join(traceback.format_exception(exc))
    return RemoteError("HANDLER_FAILED", str(exc)), {
        "remote_type": _qualname(type(exc)),
        "traceback": tb[-MAX_ERROR_MESSAGE:],
    }


class _Pending:
    __slots__ = ("done", "error", "id", "ordinal", "receipt", "spec", "stream", "value")

    def __init__(self, call_id: int, spec: MethodSpec, stream: _StreamState | None) -> None:
        self.id = call_id
        self.spec = spec
        self.stream = stream
        self.ordinal: int | None = None
        self.done = anyio.Event()
        self.value: Any = None
        self.error: CallError | None = None
        self.receipt: str | None = None  # the ``cancel`` field of the error that ended it


class _StreamState:
    """What a stream call has received and the credit it has granted (consumer side).

    Held by the pending call, *not* by the :class:`RemoteStream` the application iterates, so
    the session never keeps that iterator alive (see :func:`_reclaim_when_dropped`).
    ``credit_items``/``credit_bytes`` are what the producer may still send: the initial window
    plus every grant, minus every item received.
    """

    __slots__ = ("arrived", "credit_bytes", "credit_items", "ended", "error", "items")

    def __init__(self, credit_items: int, credit_bytes: int) -> None:
        self.items: deque[tuple[Any, int]] = deque()
        self.arrived = anyio.Event()
        self.ended = False
        self.error: CallError | None = None
        self.credit_items = credit_items
        self.credit_bytes = credit_bytes

    def deliver_item(self, value: Any, size: int) -> None:
        self.items.append((value, size))
        self.arrived.set()

    def deliver_end(self, error: CallError | None) -> None:
        self.ended = True
        self.error = error
        self.arrived.set()


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
            (asyncio on Python 3.12+ only; see :func:`_start_handler`). Always 0 elsewhere.
        parts_sent: ``part`` envelopes we sent (bodies over ``bulk_chunk_bytes``;
            :mod:`garcon_link.chunks`), aborts included.
        parts_received: ``part`` envelopes the peer sent us.
        transfers_received: bodies reassembled from parts and dispatched.
        transfers_aborted: transfers the peer abandoned (an abort part freed our buffer).
        part_violations: parts refused as malformed, out of turn (an abort or a final part
            with no transfer in progress) or beyond the size limit, and transfers whose body
            is itself a part (parts do not nest); all dropped.
        part_buffered: bytes of the peer's transfer in progress held now (0 between transfers).
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
    malformed_envelopes: int = 0
    notifications_dropped: int = 0


class _CallIds:
    """Strictly increasing call ids, stored as LEB128 deltas: about as many bytes per id as it
    took on the wire. Holds the refusals queued past ``max_queued_refusals`` (see the module
    docstring), which all share one error."""

    __slots__ = ("_count", "_data", "_head", "_last_in", "_last_out")

    def __init__(self) -> None:
        self._data = bytearray()
        self._head = 0
        self._count = 0
        self._last_in = 0
        self._last_out = 0

    def __len__(self) -> int:
        return self._count

    def append(self, call_id: int) -> None:
        delta = call_id - self._last_in
        if delta <= 0:  # never: call ids are checked to increase when they are received
            raise ValueError(f"call id {call_id} does not increase")
        self._last_in = call_id
        while True:
            byte = delta & 0x7F
            delta >>= 7
            if delta:
                self._data.append(byte | 0x80)
            else:
                self._data.append(byte)
                break
        self._count += 1

    def popleft(self) -> int:
        if not self._count:
            raise IndexError("no call id queued")
        delta = shift = 0
        while True:
            byte = self._data[self._head]
            self._head += 1
            delta |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        self._count -= 1
        self._last_out += delta
        if not self._count:
            self._data.clear()
            self._head = 0
        elif self._head > 4096 and self._head * 2 > len(self._data):
            del self._data[: self._head]
            self._head = 0
        return self._last_out

    def clear(self) -> None:
        self._data.clear()
        self._head = self._count = 0
        self._last_out = self._last_in


# What waits in ExecutorRpc._deferred: (kind, body) with one of these kinds.
_REFUSAL, _CANCEL, _CONTROL = range(3)


class _Incoming:
    __slots__ = ("cancelled", "credit", "credit_bytes", "credit_event", "scope", "started", "task")

    def __init__(self, credit: int, credit_bytes: int) -> None:
        self.scope = anyio.CancelScope()
        self.cancelled = False
        self.started = False
        self.credit = credit
        self.credit_bytes = credit_bytes
        # Created by the producer only when it has to wait for credit.
        self.credit_event: anyio.Event | None = None
        self.task: asyncio.Task[None] | None = None  # the handler's, on asyncio (see _on_call)


class ExecutorRpc:
    """Typed RPC over one logical session.

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
    ) -> None:
        self.idempotency = idempotency
        self.observer = observer if observer is not None else CallObserver(limits=limits)
        self.transport = transport
        self.peer = peer
        self.registry = registry
        self.limits = limits
        self.scope = scope
        self._describe = describe or (lambda: {"services": registry.manifest()})
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._incoming: dict[int, _Incoming] = {}
        self._notifications = 0  # one-way handlers running
        self._last_incoming_id = 0
        # Bodies over bulk_chunk_bytes go in parts (garcon_link.chunks). A call sent in parts
        # has its id claimed when its first part arrives (_on_part); _whole_id is that id while
        # the reassembled call is dispatched, so _on_call does not take it for a reuse.
        self._chunks = ChunkSender(
            transport, limits.bulk_chunk_bytes, limits.bulk_window_bytes, limits.max_frame_bytes
        )
        self._reassembler = Reassembler(limits.max_frame_bytes)
        self._claimed: int | None = None  # the call id claimed by the transfer in progress
        self._whole_id: int | None = None
        self._part_violations = 0
        self._malformed_envelopes = 0
        self._notifications_dropped = 0
        # What the peer makes us log: at most one line per reason per log_interval (the exact
        # counts are in statistics()).
        self._peer_log = PeerLogLimiter(
            log, interval=limits.log_interval, max_lines=limits.max_log_lines
        )
        self._retired: CallError | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # Call handlers on asyncio are plain tasks (see _on_call); on trio, children of _tg.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        self._max_body = limits.max_frame_bytes - 32
        self.peer_instance_id: bytes | None = None
        # The worker's runtime: what worker-scoped references carry.
        self.peer_worker_instance_id: bytes | None = None
        # Envelopes that met full retention, for the one drain task (see the module docstring):
        # (kind, body) -- refusals, cancels of our abandoned calls, credit grants -- and, past
        # max_queued_refusals, bare call ids refused OVERLOADED.
        self._deferred: deque[tuple[int, bytes]] = deque()
        self._overflow = _CallIds()
        self._queued_refusals = 0  # _REFUSAL entries in _deferred, plus len(_overflow)
        self._owed_cancels = 0  # _CANCEL entries in _deferred: they count as pending calls
        self._queued_controls = 0  # _CANCEL and _CONTROL entries in _deferred
        self._deferred_added = anyio.Event()
        self._hold: anyio.Event | None = None  # set when the reader may read on
        self._refusals = 0
        self._reader_holds = 0
        self._flow_violations = 0
        self._malformed_replies = 0
        self._eager_handlers = 0
        self._eager_seen = 0  # _eager_handlers when _alone() last asked
        # asyncio: handlers of the message being dispatched, started at its end.
        self._to_start: deque[tuple[_Incoming, Coroutine[Any, Any, None]]] = deque()
        self._draining = False
        # Set (and dropped) whenever a call of ours or a handler of the peer's ends: wait_idle.
        self._settled: anyio.Event | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def retired(self) -> bool:
        return self._retired is not None

    @property
    def draining(self) -> bool:
        return self._draining

    def start_drain(self) -> None:
        """Refuse the peer's new calls with ``NotDispatched("DRAINING")`` from now on; running
        handlers and our own calls go on (module docstring). Idempotent."""
        self._draining = True

    async def wait_idle(self) -> bool:
        """Wait until no call of ours awaits a reply and no handler of the peer's calls runs.

        Unbounded: the caller bounds it (a drain's deadline).

        Returns:
            ``True`` once idle; ``False`` if the session was retired first.
        """
        while self._pending or self._incoming or self._notifications:
            if self._retired is not None:
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
        return RpcStatistics(
            pending_calls=len(self._pending) + self._owed_cancels,
            incoming_calls=len(self._incoming) + self._notifications,
            queued_refusals=self._queued_refusals,
            queued_controls=self._queued_controls,
            refusals=self._refusals,
            reader_holds=self._reader_holds,
            reader_held=self._hold is not None,
            flow_violations=self._flow_violations,
            malformed_replies=self._malformed_replies,
            eager_handlers=self._eager_handlers,
            parts_sent=self._chunks.parts_sent + self._chunks.aborts_sent,
            parts_received=self._reassembler.parts,
            transfers_received=self._reassembler.completed,
            transfers_aborted=self._reassembler.aborted,
            part_violations=self._part_violations,
            malformed_envelopes=self._malformed_envelopes,
            notifications_dropped=self._notifications_dropped,
            part_buffered=self._reassembler.buffered,
        )

    async def run(self) -> None:
        """Consume the session's payloads until it is retired, then retire every call."""
        # Dispatch never blocks (handlers run in tasks of their own), so the transport's socket
        # reader calls it directly. It does so in this task's context: handlers inherit what a
        # service scope set in the task that runs the session, not the link's context.
        context = self._context = contextvars.copy_context()
        self._loop = asyncio.get_running_loop() if on_asyncio() else None

        def dispatch(payload: bytes) -> None:
            context.run(self._dispatch, payload)

        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._drain_deferred)
                await self.transport.consume(
                    dispatch,
                    yield_first=self._alone,
                    hold=self._hold_reader,
                    batch_end=self._start_handlers,
                )
                self.retire_unknown()
                tg.cancel_scope.cancel()
        finally:
            self.retire_unknown()
            while self._to_start:  # only if a message's dispatch was cut short by an exception
                incoming, handler = self._to_start.popleft()
                handler.close()
                self._incoming = {k: v for k, v in self._incoming.items() if v is not incoming}
            await self._join_handlers()

    def retire_unknown(self) -> None:
        """Fail every pending call honestly and cancel every incoming handler (idempotent)."""
        if self._retired is not None:
            return
        failure = self.transport.failure
        why = str(failure) if failure is not None else "session ended"
        self._retired = NotDispatched("OFFLINE", why)
        offered = self.transport.offered
        for pending in list(self._pending.values()):
            if pending.ordinal is not None and pending.ordinal <= offered:
                error: CallError = OutcomeUnknown("CONTINUITY_LOST", f"the request was sent; {why}")
            else:
                error = NotDispatched("CONTINUITY_LOST", f"the request never left; {why}")
            self._finish(pending, error=error)
        self._pending.clear()
        for incoming in self._incoming.values():
            incoming.cancelled = True
            incoming.scope.cancel()
        self._reassembler.reset()  # a partial transfer of the peer's never completes
        # Nothing queued can be sent any more.
        self._deferred.clear()
        self._overflow.clear()
        self._queued_refusals = self._owed_cancels = self._queued_controls = 0
        self._release_hold()
        self._note_settled()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    # ------------------------------------------------------------------ outgoing

    def _check_open(self) -> None:
        if self._retired is not None:
            raise NotDispatched("OFFLINE", self._retired.message)
        if self.transport.failure is not None:
            raise NotDispatched("OFFLINE", str(self.transport.failure))

    def _encode(self, envelope: Envelope) -> bytes:
        try:
            return encode(envelope)
        except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
            raise NotDispatched("INVALID_ARGUMENTS", f"cannot encode the request: {exc}") from exc

    def _prepare(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        credit: tuple[int, int],
        key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[_Pending | None, bytes]:
        self._check_open()
        try:
            pos, kw = spec.bind(args, kwargs)
            wire_args = to_wire(pos)
            wire_kwargs = to_wire(kw)
        except TypeError as exc:
            raise NotDispatched("INVALID_ARGUMENTS", f"{service}.{spec.name}: {exc}") from exc
        self._check_resources(pos, kw)
        if spec.kind is MethodKind.ONEWAY:
            return None, self._encode(Notify(service, spec.name, wire_args, wire_kwargs, metadata))
        if len(self._pending) + self._owed_cancels >= self.limits.max_pending_calls:
            raise NotDispatched(
                "OVERLOADED",
                f"{self.limits.max_pending_calls} calls already pending on this session",
            )
        call_id = self._next_id
        self._next_id += 1
        try:
            body = encode_call(
                call_id, service, spec.name, wire_args, wire_kwargs, *credit, key, metadata
            )
        except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
            raise NotDispatched("INVALID_ARGUMENTS", f"cannot encode the request: {exc}") from exc
        return _Pending(call_id, spec, None), body

    def _renumber(self, pending: _Pending, body: bytes) -> tuple[bytes, int]:
        """A fresh id for ``body`` (a ``call`` sent in parts, about to be issued): the head that
        replaces its first bytes and how many it replaces; ``pending`` moves to the new id.
        Calls issued while it waited for its turn have overtaken it, and the peer requires ids
        to increase in the order calls arrive (:mod:`garcon_link.chunks`)."""
        old, new = pending.id, self._next_id
        self._next_id += 1
        # [0, id, ...]: a one-byte array head (at most MAX_ARITY items), the kind, then the id.
        assert body[0] & 0xE0 == 0x80 and body[1] == CALL
        head = encode_head(0, old)
        if self._pending.get(old) is pending:
            del self._pending[old]
            self._pending[new] = pending
        pending.id = new
        return body[:2] + encode_head(0, new), 2 + len(head)

    def _check_resources(self, args: list[Any], kwargs: Mapping[str, Any]) -> None:
        instance = self.peer_instance_id
        if instance is None:
            return
        valid = (instance, self.peer_worker_instance_id)
        for value in (*args, *kwargs.values()):
            if isinstance(value, ResourceRef) and value.instance_id not in valid:
                raise StaleResource(message=f"{value!r} belongs to a replaced session")

    def _alone(self) -> bool:
        """Whether at most one call (or notification handler) is pending or running on this
        session: a request/reply at a time, where the transport's reader lets the woken task
        run before reading on. Not when the message was a call whose handler already ran to
        its end in the dispatch (an eager handler): no task was woken, and a yield would cost
        the reader a loop turn for nothing. Asked once per message with payloads."""
        eager = self._eager_handlers != self._eager_seen
        self._eager_seen = self._eager_handlers
        return not eager and len(self._pending) + len(self._incoming) + self._notifications <= 1

    def _hold_reader(self) -> anyio.Event | None:
        """Asked by the transport's reader after each message: an event to wait for while the
        refusal backlog is full (back-pressure on the peer), else ``None``."""
        if self._hold is None and self._queued_refusals >= self.limits.max_queued_refusals:
            self._hold = anyio.Event()
            self._reader_holds += 1
            self._peer_log.log(
                self.transport.label,
                "reader held",
                "session %s: %d refusals wait for the peer's receipts; reading paused",
                self.transport.label,
                self._queued_refusals,
                extra=log_fields(session=self.transport.session_id),
            )
        return self._hold

    def _release_hold(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.set()

    async def _send_request(
        self, body: bytes, renumber: Callable[[bytes], tuple[bytes, int]] | None = None
    ) -> int:
        """Issue a request envelope; a refusal before an ordinal is assigned is NOT_DISPATCHED."""
        try:
            return await self._chunks.send(body, renumber)
        except PayloadTooLarge as exc:
            raise NotDispatched("PAYLOAD_TOO_LARGE", str(exc)) from exc
        except SessionFailed as exc:
            raise NotDispatched("OFFLINE", str(exc)) from exc

    async def _issue(self, pending: _Pending, body: bytes) -> None:
        self._pending[pending.id] = pending
        if len(self._pending) > self.observer.pending_peak:
            self.observer.pending_peak = len(self._pending)
        renumber = None
        if len(body) > self._chunks.chunk:

            def renumber(body: bytes) -> tuple[bytes, int]:
                return self._renumber(pending, body)

        try:
            pending.ordinal = await self._send_request(body, renumber)
        except NotDispatched:
            self._pending.pop(pending.id, None)
            self._note_settled()
            raise

    async def call(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        timeout: float | None,
        idempotency_key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Any:
        """Call ``service.method`` and return its converted result.

        ``idempotency_key`` (normalised bytes, see :func:`garcon_link.idempotency.normalize_key`)
        is sent with the call; the worker runs the call at most once per key. ``metadata``
        (already validated: :class:`CallObserver`) is sent with it.

        This is one attempt on this session; the caller's outcome point (counting, hooks) is
        the endpoint's :meth:`CallObserver.call` around it.

        Raises:
            NotDispatched, Rejected, StaleResource, OutcomeUnknown, RemoteError: per the outcome;
                or an allow-listed remote exception type (see :func:`register_exception`).
        """
        if spec.kind is MethodKind.ONEWAY:
            await self.notify(service, spec, args, kwargs, metadata)
            return None
        pending, body = self._prepare(
            service, spec, args, kwargs, (0, 0), idempotency_key, metadata
        )
        assert pending is not None
        # A bare cancel scope with a deadline: what fail_after does, without its generator-based
        # context manager (this is on every call's path).
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                await self._issue(pending, body)
                await pending.done.wait()
        except BaseException:
            if not pending.done.is_set():
                self._abandon(pending)
            raise
        if scope.cancelled_caught and not pending.done.is_set():
            if pending.ordinal is None:
                self._abandon(pending)
                raise NotDispatched("TIMEOUT", f"not issued within {timeout}s")
            await self._cancel_after_timeout(pending, timeout)
        if pending.error is not None:
            raise _local_exception(pending.error)
        return pending.value

    async def notify(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Send a one-way notification (returns once it is queued on the session)."""
        _, body = self._prepare(service, spec, args, kwargs, (0, 0), None, metadata)
        await self._send_request(body)

    def stream(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
    ) -> RemoteStream:
        """Open a remote stream; the request is sent on first iteration."""
        return RemoteStream(self, service, spec, args, kwargs, metadata)

    def _abandon(self, pending: _Pending) -> None:
        """The caller gave up: forget the call and tell the peer to cancel it (best effort)."""
        self._pending.pop(pending.id, None)
        self._note_settled()
        if pending.ordinal is not None:
            self._send_cancel(pending.id)

    async def _cancel_after_timeout(self, pending: _Pending, timeout: float | None) -> None:
        """Send ``cancel`` for a timed-out call and wait up to ``cancel_grace`` for the peer's
        answer, the call still pending so that its answer is matched (module docstring).

        Returns with ``pending`` finished by the answer (a receipt mapped to a ``TIMEOUT``
        error); raises ``OutcomeUnknown("TIMEOUT")`` if none came.
        """
        self._send_cancel(pending.id)
        try:
            with anyio.move_on_after(self.limits.cancel_grace):
                await pending.done.wait()
        finally:
            if not pending.done.is_set():
                self._pending.pop(pending.id, None)  # a later answer is dropped
                self._note_settled()
        if not pending.done.is_set():
            raise OutcomeUnknown("TIMEOUT", f"no reply within {timeout}s; cancel sent")
        error = pending.error
        not_started = isinstance(error, NotDispatched) and error.code == "CANCELLED"
        if pending.receipt == NOT_STARTED or not_started:  # (an old peer: the same, unmarked)
            pending.error = NotDispatched(
                "TIMEOUT", f"no reply within {timeout}s; cancelled before it started"
            )
        elif pending.receipt == INTERRUPTED:
            pending.error = OutcomeUnknown(
                "TIMEOUT",
                f"no reply within {timeout}s; cancelled while running (it may have had effects)",
            )

    def _send_cancel(self, call_id: int) -> None:
        # A deferred cancel keeps counting as a pending call (see _prepare) until handed over.
        self._send_soon(_CANCEL, self._encode(Cancel(call_id)))

    def _reclaim_stream(self, pending: _Pending) -> None:
        """A stream's iterator was dropped without ``aclose()``: free its slot, cancel it.

        Runs as a plain event-loop callback (scheduled by the iterator's finalizer), so it only
        queues: the drain task writes the ``cancel``.
        """
        if self._pending.get(pending.id) is not pending:
            return  # it ended, was closed, or the session was retired meanwhile
        log.debug(
            "stream %d was dropped without aclose(); cancelling it",
            pending.id,
            extra=log_fields(session=self.transport.session_id),
        )
        self._pending.pop(pending.id, None)
        self._note_settled()
        if pending.ordinal is not None:
            self._defer(_CANCEL, self._encode(Cancel(pending.id)))

    def _send_soon(self, kind: int, body: bytes) -> None:
        """Hand a small envelope to the session without waiting: at once if retention has room
        and nothing is queued before it, else queued for the drain task (no task per send)."""
        if self._retired is not None or self.transport.failure is not None:
            return
        if not self._deferred and not self._overflow:
            try:
                if self.transport.try_send(body) is not None:
                    return
            except (SessionFailed, PayloadTooLarge):
                return
        self._defer(kind, body)

    def _defer(self, kind: int, body: bytes) -> None:
        if self._retired is not None:
            return
        self._deferred.append((kind, body))
        if kind == _REFUSAL:
            self._queued_refusals += 1
        else:
            self._queued_controls += 1
            if kind == _CANCEL:
                self._owed_cancels += 1
        self._deferred_added.set()

    async def _drain_deferred(self) -> None:
        """The one task that writes what met full retention, in order, as capacity frees."""
        while True:
            if self._deferred:
                kind, body = self._deferred.popleft()
            elif self._overflow:
                kind, body = _REFUSAL, self._overloaded(self._overflow.popleft())
            else:
                added = self._deferred_added = anyio.Event()
                await added.wait()
                continue
            try:
                await self.transport.send(body)
            except PayloadTooLarge:
                pass  # never for these small envelopes; nothing else to do with one
            except SessionFailed:
                return
            finally:
                # Only now is its slot free: a refusal or cancel counts until handed over.
                if kind == _REFUSAL:
                    if self._queued_refusals:
                        self._queued_refusals -= 1
                    if self._queued_refusals <= self.limits.max_queued_refusals // 2:
                        self._release_hold()
                elif self._queued_controls:  # not reset by a retirement meanwhile
                    self._queued_controls -= 1
                    if kind == _CANCEL and self._owed_cancels:
                        self._owed_cancels -= 1

    def _finish(
        self, pending: _Pending, *, value: Any = None, error: CallError | None = None
    ) -> None:
        pending.value = value
        pending.error = error
        if pending.stream is not None:
            pending.stream.deliver_end(error)
        pending.done.set()
        self._note_settled()

    # ------------------------------------------------------------------ inbound dispatch

    def _dispatch(self, payload: bytes) -> None:
        """One session message's envelope: a part goes to the transfer in progress
        (:meth:`_on_part`), any other kind is dispatched whole."""
        if len(payload) > 1 and payload[1] == PART and payload[0] == 0x83:
            part = parse_part(payload)  # the chunk without a copy (else decoded as any other)
            if part is not None:
                self._on_part(Part(*part))
                return
        envelope = self._decode(payload)
        if isinstance(envelope, Part):
            self._on_part(envelope)
        elif envelope is not None:
            self._dispatch_whole(envelope, len(payload))

    def _decode(self, payload: bytes) -> Envelope | None:
        """The envelope ``payload`` holds; ``None`` when it is dropped (and logged) as
        undecodable or malformed."""
        try:
            # plain=True: refuses shared references and cycles, so no envelope can expand into
            # a structure larger than its own bytes (a DAG of 2**n paths) later on.
            item = decode_item(payload, self.limits.max_frame_bytes)
        except MalformedFrame as exc:
            self._dropped_envelope(None, peer_text(exc))
            self._undecodable(payload)
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
        reassembler = self._reassembler
        starting = not reassembler.in_progress
        try:
            body = reassembler.feed(envelope.flags, envelope.chunk)
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
        if starting:  # its first part (a transfer is at least two parts)
            first = reassembler.first_chunk()  # None: the rest of a refused one is discarded
            if first is not None:
                self._claimed = self._claim_call(first)
        if body is None:
            return
        claimed, self._claimed = self._claimed, None
        if claimed == -1:
            return  # a reused call id, dropped (and logged) at its first part
        self._whole_id = claimed
        try:
            # Never through _dispatch: a body is not a part (the reassembler refused the usual
            # encoding of one before joining it; any other is refused here, once decoded).
            whole = self._decode(body)
            if isinstance(whole, Part):
                self._part_violations += 1
                self._malformed(BadEnvelope(PART, "a body sent in parts is itself a part"))
            elif whole is not None:
                self._dispatch_whole(whole, len(body))
        finally:
            self._whole_id = None

    def _claim_call(self, first: bytes) -> int | None:
        """The call id a transfer's first chunk names, recorded as the last incoming id; ``-1``
        for one that does not increase (the whole call is then dropped); ``None`` if the body
        is not a call whose head is readable (it is then checked whole, as any call)."""
        head = _envelope_head(first)
        if head is None or head[0] != CALL:
            return None
        call_id = head[1]
        if call_id <= self._last_incoming_id:
            self._dropped_envelope(
                CALL,
                f"call id {peer_text(call_id)} does not increase "
                f"(last {peer_text(self._last_incoming_id)})",
            )
            return -1
        self._last_incoming_id = call_id
        return call_id

    def _malformed(self, exc: BadEnvelope) -> None:
        """An envelope of the wrong shape: dropped; a reply naming a call of ours fails it."""
        kind = exc.kind
        if kind is None or not CALL <= kind <= PART:
            self._dropped_envelope(None, peer_text(exc))
            return
        if kind in REPLY_KINDS and exc.call_id is not None:
            pending = self._pending.get(exc.call_id)
            if pending is not None:
                self._fail_unreadable(
                    pending, "MALFORMED_REPLY", f"the peer's reply: {peer_text(exc)}"
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

    def _undecodable(self, payload: bytes) -> None:
        """An envelope that did not decode, named by its head (``[kind, id``) where it has one.

        A reply kind naming one of our calls: that call's reply is unreadable (``UNKNOWN``). A
        ``call`` with a new id: refused ``Rejected("INVALID_ARGUMENTS")`` at once -- it did not
        run, and its caller need not wait for its timeout (a value past the decoder's bounds,
        such as a bignum over ``wire.MAX_BIGNUM_BYTES``, is the usual cause). Anything else
        stays dropped.
        """
        head = _envelope_head(payload)
        if head is None:
            return
        kind, call_id = head
        if kind == CALL and (call_id > self._last_incoming_id or call_id == self._whole_id):
            self._last_incoming_id = max(call_id, self._last_incoming_id)
            self._refuse(
                call_id, Rejected("INVALID_ARGUMENTS", "the call's arguments do not decode")
            )
            return
        if kind not in (RESULT, ERROR, ITEM, END):
            return
        pending = self._pending.get(call_id)
        if pending is not None:
            self._fail_unreadable(pending, "MALFORMED_REPLY", "the peer's reply does not decode")

    def _fail_unreadable(self, pending: _Pending, code: str, why: str) -> None:
        """Fail ``pending`` as ``UNKNOWN``: what the peer sent about it cannot be read, so it
        may have run, be running or have failed. ``cancel`` in case it still runs."""
        self._malformed_replies += 1
        self._pending.pop(pending.id, None)
        self._send_cancel(pending.id)
        self._finish(pending, error=OutcomeUnknown(code, why))

    def _on_result(self, envelope: Result) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None or pending.stream is not None:
            return  # late reply to a retired, timed-out or cancelled call: dropped
        del self._pending[pending.id]
        try:
            value = from_wire(envelope.value, pending.spec.result)
        except Exception as exc:
            # FAILED, not UNKNOWN: the call certainly ran to completion (module docstring).
            self._finish(
                pending,
                error=RemoteError("INVALID_RESULT", f"result does not match the interface: {exc}"),
            )
            return
        self._finish(pending, value=value)

    def _on_error(self, envelope: Error) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None:
            return
        error = _error_from_body(envelope.body)
        if isinstance(error, OutcomeUnknown) and error.code == "MALFORMED_ERROR":
            self._fail_unreadable(pending, error.code, error.message)
            return
        del self._pending[pending.id]
        pending.receipt = envelope.body.get("cancel")  # a map: _error_from_body checked it
        self._finish(pending, error=error)

    def _on_item(self, envelope: Item, size: int) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None or pending.stream is None:
            return
        stream = pending.stream
        # Byte credit is counted in encoded envelope bytes, exactly what the producer charges
        # per item (``_produce``), after encoding it: so the last item may overdraw the bytes,
        # never the items, and nothing may follow it until more credit is granted.
        if stream.credit_items <= 0 or stream.credit_bytes <= 0:
            self._flow_violations += 1
            self._peer_log.log(
                self.transport.label,
                "flow",
                "session %s: stream %d got an item beyond its credit; ending it",
                self.transport.label,
                pending.id,
                extra=log_fields(session=self.transport.session_id),
            )
            self._end_stream(
                pending,
                "FLOW_CONTROL_VIOLATION",
                f"the {self.peer} violated flow control: it sent a stream item beyond the "
                "credit granted; the stream was cancelled (items already received stand)",
            )
            return
        stream.credit_items -= 1
        stream.credit_bytes -= size
        try:
            value = from_wire(envelope.value, pending.spec.result)
        except Exception as exc:
            self._end_stream(
                pending, "INVALID_RESULT", f"stream item does not match the interface: {exc}"
            )
            return
        stream.deliver_item(value, size)

    def _end_stream(self, pending: _Pending, code: str, message: str) -> None:
        """End a stream we can no longer trust: cancel it on the peer; ``UNKNOWN`` for the
        consumer, after the items already buffered (module docstring)."""
        del self._pending[pending.id]
        self._send_cancel(pending.id)
        self._finish(pending, error=OutcomeUnknown(code, message))

    def _on_end(self, envelope: End) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None or pending.stream is None:
            return
        del self._pending[pending.id]
        self._finish(pending)

    # -- serving side

    def _error_envelope(
        self, call_id: int, error: CallError, *, limit: int = MAX_ERROR_MESSAGE, **extra: Any
    ) -> bytes:
        message = error.message
        if len(message) > limit:
            message = message[:limit] + "... (cut)"
        return self._encode(
            Error(call_id, _error_body(error.outcome, error.code, message, **extra))
        )

    def _refuse(self, call_id: int, error: CallError) -> None:
        """Answer a call that will not run (from dispatch: no task, bounded; module docstring).

        Past ``max_queued_refusals`` -- only within the message being handed over, as the
        reader then pauses -- the call is refused ``OVERLOADED`` and only its id is kept.
        """
        self._refusals += 1
        if self._queued_refusals >= self.limits.max_queued_refusals:
            self.observer.refused(NotDispatched("OVERLOADED"))
            if self._retired is None and self.transport.failure is None:
                self._overflow.append(call_id)
                self._queued_refusals += 1
                self._deferred_added.set()
            return
        self.observer.refused(error)
        self._send_soon(_REFUSAL, self._error_envelope(call_id, error, limit=MAX_REFUSAL_MESSAGE))

    def _overloaded(self, call_id: int) -> bytes:
        """The refusal of a call queued past ``max_queued_refusals`` (see :meth:`_refuse`)."""
        return self._error_envelope(
            call_id,
            NotDispatched(
                "OVERLOADED",
                f"{self.limits.max_queued_refusals} refusals were waiting for the peer's receipts",
            ),
        )

    async def _send_error(self, call_id: int, error: CallError, **extra: Any) -> None:
        """A handler's error reply, written by the handler's own task (which keeps its
        incoming slot meanwhile): waits for retention capacity like a result."""
        body = self._error_envelope(call_id, error, **extra)
        try:
            await self.transport.send(body)
        except PayloadTooLarge:
            # A frame limit too small for the traceback: the outcome and code still go.
            with contextlib.suppress(PayloadTooLarge, SessionFailed):
                await self.transport.send(
                    self._error_envelope(call_id, error, limit=MAX_REFUSAL_MESSAGE)
                )
        except SessionFailed:
            pass

    def _resolve(self, service: Any, method: Any) -> tuple[MethodSpec, Callable[..., Any]]:
        if not isinstance(service, str) or not isinstance(method, str):
            raise Rejected("OPERATION_UNSUPPORTED", "service and method must be strings")
        if service == INTERNAL_SERVICE:
            if method == "describe":
                return _DESCRIBE_SPEC, self._internal_describe
            raise Rejected("OPERATION_UNSUPPORTED", f"no internal method {peer_text(method)}")
        bound = self.registry.get(service)
        if bound is None:
            raise Rejected("UNKNOWN_SERVICE", f"no service named {peer_text(service)}")
        spec = bound.spec.methods.get(method)
        if spec is None or method.startswith("_"):
            raise Rejected(
                "OPERATION_UNSUPPORTED",
                f"{service!r} has no callable method {peer_text(method)}",
            )
        target = getattr(bound.target, method, None)
        if target is None or not callable(target):
            raise Rejected("OPERATION_UNSUPPORTED", f"{service!r} does not implement {method!r}")
        if bound.scope is not None:
            target = _in_scope(bound.scope, target)
        return spec, target

    async def _internal_describe(self) -> dict[str, Any]:
        return self._describe()

    def _on_call(self, envelope: Call) -> None:
        call_id, service, method = envelope.id, envelope.service, envelope.method
        args, kwargs, key = envelope.args, envelope.kwargs, envelope.key
        credit, credit_bytes = envelope.credit_items, envelope.credit_bytes
        if call_id <= self._last_incoming_id and call_id != self._whole_id:
            self._dropped_envelope(
                CALL,
                f"call id {peer_text(call_id)} does not increase "
                f"(last {peer_text(self._last_incoming_id)})",
            )
            return
        if call_id > self._last_incoming_id:
            self._last_incoming_id = call_id
        if self._draining and service != INTERNAL_SERVICE:
            self._refuse(
                call_id,
                NotDispatched(
                    "DRAINING", "shutting down: running calls finish, new ones are refused"
                ),
            )
            return
        if (
            not isinstance(args, list)
            or not isinstance(kwargs, dict)
            or not all(isinstance(k, str) for k in kwargs)
        ):
            self._refuse(
                call_id, Rejected("INVALID_ARGUMENTS", "args must be a list and kwargs a map")
            )
            return
        if (
            type(credit) is not int
            or type(credit_bytes) is not int
            or credit < 0
            or credit_bytes < 0
        ):
            self._refuse(
                call_id, Rejected("INVALID_ARGUMENTS", "credit must be non-negative integers")
            )
            return
        if key is not None and (problem := key_problem(key)) is not None:
            self._refuse(call_id, Rejected("INVALID_ARGUMENTS", problem))
            return
        metadata = _NO_METADATA
        if envelope.metadata is not None:
            checked = self._received_metadata(envelope.metadata)
            if isinstance(checked, str):
                self._refuse(call_id, Rejected("INVALID_METADATA", checked))
                return
            metadata = checked
        if len(self._incoming) + self._notifications >= self.limits.max_incoming_calls:
            self._refuse(
                call_id,
                NotDispatched(
                    "OVERLOADED", f"{self.limits.max_incoming_calls} calls already running"
                ),
            )
            return
        try:
            spec, target = self._resolve(service, method)
            if spec.kind is MethodKind.STREAM and credit == 0:
                raise Rejected("INVALID_ARGUMENTS", "a stream call needs initial credit")
            pos, kw = spec.convert_arguments(args, kwargs)
            self._check_scope(pos, kw)
        except CallError as exc:
            self._refuse(call_id, exc)
            return
        except ValueError as exc:
            self._refuse(call_id, Rejected("INVALID_ARGUMENTS", str(exc)))
            return
        if key is not None:
            self._on_keyed_call(
                call_id, service, spec, target, pos, kw, args, kwargs, key, metadata
            )
            return
        incoming = _Incoming(min(credit, self.limits.stream_window_items * 4), credit_bytes)
        self._incoming[call_id] = incoming
        if len(self._incoming) + self._notifications > self.observer.incoming_peak:
            self._note_incoming()
        handler = self._run_handler(call_id, incoming, service, spec, target, pos, kw, metadata)
        if self._loop is not None:
            # asyncio: a plain task, tracked here (see run()); anyio's start_soon costs ~10 us
            # more per task, which is a tenth of a call. It runs in a copy of the session
            # task's context, as a task group's child would, and starts eagerly where the
            # runtime can (_start_handler).
            # It leaves _incoming itself when it ends (a done callback would cost an event-loop
            # turn per call).
            # Started at the end of the message (_start_handlers): a cancel in the same
            # message then finds it not yet started, as before eager starts.
            self._to_start.append((incoming, handler))
        else:
            assert self._tg is not None
            self._tg.start_soon(lambda: handler)

    def _start_handlers(self) -> None:
        """Start, in call order, the handlers of the calls the message just dispatched carried
        (asyncio: eagerly where the runtime can, see :func:`_start_handler`). Called by the
        transport's reader once the message's payloads were handed over."""
        to_start = self._to_start
        if not to_start:
            return
        assert self._loop is not None
        loop, context = self._loop, self._context
        while to_start:
            incoming, handler = to_start.popleft()
            task = incoming.task = _start_handler(loop, handler, context.copy())
            if task.done():
                self._eager_handlers += 1

    def _note_incoming(self) -> None:
        running = len(self._incoming) + self._notifications
        if running > self.observer.incoming_peak:
            self.observer.incoming_peak = running

    def _received_metadata(self, metadata: object) -> Mapping[str, str] | str:
        """A peer's metadata, read-only (empty when absent), or why it is refused."""
        if metadata is None:
            return _NO_METADATA
        limits = self.limits
        problem = metadata_problem(metadata, limits.max_metadata_entries, limits.max_metadata_bytes)
        if problem is not None:
            return problem
        assert isinstance(metadata, dict)
        return types.MappingProxyType(metadata)

    async def _join_handlers(self) -> None:
        """Wait for the handler tasks (cancelled by retire_unknown) to end, as a task group's
        exit would; shielded, so shutdown cannot leave them running unobserved."""
        with anyio.CancelScope(shield=True):
            while tasks := [
                i.task for i in self._incoming.values() if i.task is not None and not i.task.done()
            ]:
                await asyncio.wait(tasks)

    # -- keyed calls (garcon_link.idempotency)

    def _on_keyed_call(
        self,
        call_id: int,
        service: str,
        spec: MethodSpec,
        target: Callable[..., Any],
        pos: list[Any],
        kw: dict[str, Any],
        args: list[Any],
        kwargs: dict[str, Any],
        key: bytes,
        metadata: Mapping[str, str],
    ) -> None:
        """A call with an idempotency key: run it at most once per key on this worker.

        The handler runs in the worker's task group (it outlives this session); this session
        only waits for its reply, in a task that holds the call's incoming slot.
        """
        keyed = self.idempotency
        if keyed is None:
            self._refuse(
                call_id,
                Rejected(
                    "OPERATION_UNSUPPORTED",
                    "this side keeps no idempotency table: keyed calls go to a worker",
                ),
            )
            return
        if spec.kind is not MethodKind.UNARY:
            self._refuse(
                call_id,
                Rejected(
                    "INVALID_ARGUMENTS",
                    f"idempotency keys apply to unary calls only; {spec.name!r} is a "
                    f"{spec.kind.value} method",
                ),
            )
            return
        try:
            digest = arguments_digest(args, kwargs)
        except ValueError as exc:
            self._refuse(call_id, Rejected("INVALID_ARGUMENTS", str(exc)))
            return
        decision = keyed.admit((service, spec.name, key), digest)
        if isinstance(decision, Conflict):
            shown = key.decode("utf-8", "replace")[:64]
            self._refuse(
                call_id,
                Rejected(
                    "IDEMPOTENCY_CONFLICT",
                    f"idempotency key {shown!r} was already used for {service}.{spec.name} "
                    "with other arguments",
                ),
            )
            return
        if isinstance(decision, Full):
            self._refuse(call_id, NotDispatched("OVERLOADED", decision.reason))
            return
        if isinstance(decision, Execute):
            keyed.start(
                decision.entry,
                lambda: self._execute_keyed(service, spec, target, pos, kw, metadata),
            )
        assert isinstance(decision, Execute | Await | Replay)
        incoming = _Incoming(0, 0)
        self._incoming[call_id] = incoming
        self._note_incoming()
        waiter = self._run_keyed(
            call_id, incoming, keyed, decision, owner=isinstance(decision, Execute)
        )
        if self._loop is not None:
            incoming.task = self._loop.create_task(waiter, context=self._context.copy())
        else:
            assert self._tg is not None
            self._tg.start_soon(lambda: waiter)

    async def _run_keyed(
        self,
        call_id: int,
        incoming: _Incoming,
        keyed: KeyedExecutions,
        decision: Execute | Await | Replay,
        *,
        owner: bool,
    ) -> None:
        try:
            with incoming.scope:
                incoming.started = True
                kind, body = await keyed.wait(decision.entry)
                await self._send_reply(call_id, reply_envelope(kind, call_id, body))
            # Cancelled. By the caller's ``cancel`` (the session is open): the call that started
            # the execution cancels it; a repeat only stops waiting. By this session's
            # retirement: the execution goes on, for the retry on the next session.
            if owner and incoming.cancelled and self._retired is None:
                keyed.cancel(decision.entry)
        finally:
            self._incoming.pop(call_id, None)

    async def _execute_keyed(
        self,
        service: str,
        spec: MethodSpec,
        target: Callable[..., Any],
        pos: list[Any],
        kw: dict[str, Any],
        metadata: Mapping[str, str],
    ) -> Reply:
        """Run a keyed handler and map its outcome to the reply to record: what
        :meth:`_run_handler` would send (cancellation propagates). Observed once per
        execution, not per repeat of the key."""
        self._enter_context()
        token = _current_metadata.set(metadata) if metadata else None
        observed = self.observer.server_started(service, spec, metadata)
        error: CallError | None = None
        extra: dict[str, Any] = {}
        try:
            result = await target(*pos, **kw)
            try:
                body = cbor2.dumps(to_wire(result))
            except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
                error, extra = RemoteError("UNENCODABLE_RESULT", str(exc)), _TYPE_ERROR
            else:
                if len(body) + 16 > self._max_body:
                    error = RemoteError(
                        "RESULT_TOO_LARGE",
                        f"the result ({len(body)} bytes) exceeds the frame limit",
                    )
                    extra = {"remote_type": "PayloadTooLarge"}
        except Exception as exc:
            error, extra = _handler_error(exc)
        except BaseException:
            self.observer.server_ended(
                observed, OutcomeUnknown("CANCELLED", "cancelled while running"), True
            )
            raise
        finally:
            if token is not None:
                _current_metadata.reset(token)
        self.observer.server_ended(observed, error, False)
        if error is not None:
            return self._keyed_error(error, **extra)
        return RESULT, body

    def _keyed_error(self, error: CallError, **extra: Any) -> Reply:
        message = error.message
        if len(message) > MAX_ERROR_MESSAGE:
            message = message[:MAX_ERROR_MESSAGE] + "... (cut)"
        return ERROR, cbor2.dumps(_error_body(error.outcome, error.code, message, **extra))

    def _check_scope(self, args: list[Any], kwargs: Mapping[str, Any]) -> None:
        if self.scope is None:
            return
        for value in (*args, *kwargs.values()):
            # The session's references or its worker's (worker-scoped services).
            if isinstance(value, ResourceRef) and not self.scope.admits(value):
                self.scope.check(value)  # raises StaleResource

    def _on_notify(self, envelope: Notify) -> None:
        service, method, args, kwargs = (
            envelope.service,
            envelope.method,
            envelope.args,
            envelope.kwargs,
        )
        try:
            spec, target = self._resolve(service, method)
            if spec.kind is MethodKind.STREAM:
                raise Rejected("OPERATION_UNSUPPORTED", f"stream {spec.name!r} cannot be notified")
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise ValueError("args must be a list and kwargs a map")
            metadata = self._received_metadata(envelope.metadata)
            if type(metadata) is str:
                raise Rejected("INVALID_METADATA", metadata)
            assert not isinstance(metadata, str)
            pos, kw = spec.convert_arguments(args, kwargs)
        except (CallError, ValueError) as exc:
            self._dropped_notification("unreadable", service, method, peer_text(exc))
            return
        if self._draining:
            self._dropped_notification("draining", service, method, "draining")
            return
        if len(self._incoming) + self._notifications >= self.limits.max_incoming_calls:
            # One-way handlers count against the incoming budget too; with no reply to send,
            # an excess notification is dropped (and logged).
            self._dropped_notification(
                "overloaded",
                service,
                method,
                f"{self.limits.max_incoming_calls} handlers already running",
            )
            return
        self._notifications += 1
        self._note_incoming()
        assert self._tg is not None
        self._tg.start_soon(self._run_notification, service, spec, target, pos, kw, metadata)

    def _dropped_notification(self, reason: str, service: object, method: object, why: str) -> None:
        """Count a dropped notification; log it, at most once per reason per ``log_interval``."""
        self._notifications_dropped += 1
        self._peer_log.log(
            self.transport.label,
            f"notification {reason}",
            "session %s: dropping notification %s.%s: %s",
            self.transport.label,
            peer_text(service),
            peer_text(method),
            why,
            extra=log_fields(session=self.transport.session_id),
        )

    async def _run_notification(
        self,
        service: str,
        spec: MethodSpec,
        target: Callable[..., Any],
        pos: list[Any],
        kw: dict[str, Any],
        metadata: Mapping[str, str],
    ) -> None:
        self._enter_context()
        if metadata:
            _current_metadata.set(metadata)  # this task's own context: no reset needed
        observed = self.observer.server_started(service, spec, metadata, "notify")
        error: CallError | None = None
        cancelled = False
        try:
            result = target(*pos, **kw)
            if hasattr(result, "__await__"):
                await result
        except Exception as exc:
            self._peer_log.log(
                self.transport.label,
                "notification handler",
                "notification handler %s.%s raised",
                service,
                spec.name,
                exc_info=True,
                extra=log_fields(session=self.transport.session_id),
                level=logging.ERROR,
            )
            error = _handler_error(exc)[0]
        except BaseException:
            error, cancelled = OutcomeUnknown("CANCELLED", "cancelled while running"), True
            raise
        finally:
            self._notifications -= 1
            self._note_settled()
            self.observer.server_ended(observed, error, cancelled)

    def _on_cancel(self, envelope: Cancel) -> None:
        incoming = self._incoming.get(envelope.id)
        if incoming is not None:
            incoming.cancelled = True
            incoming.scope.cancel()

    def _on_credit(self, envelope: Credit) -> None:
        call_id, items, nbytes = envelope.id, envelope.items, envelope.bytes
        incoming = self._incoming.get(call_id)
        if incoming is None or items < 0 or nbytes < 0:
            return
        cap = self.limits.stream_window_items * 4
        incoming.credit = min(incoming.credit + items, cap)
        incoming.credit_bytes = min(
            incoming.credit_bytes + nbytes, self.limits.stream_window_bytes * 4
        )
        if incoming.credit_event is not None:
            incoming.credit_event.set()

    def _enter_context(self) -> None:
        _current_rpc.set(self)
        if self.scope is not None:
            _current.set(self.scope)

    async def _run_handler(
        self,
        call_id: int,
        incoming: _Incoming,
        service: str,
        spec: MethodSpec,
        target: Callable[..., Any],
        pos: list[Any],
        kw: dict[str, Any],
        metadata: Mapping[str, str],
    ) -> None:
        """Run one handler and send its reply: the server side's outcome point (the reply it
        decides is what :meth:`CallObserver.server_ended` is told)."""
        self._enter_context()
        if metadata:
            _current_metadata.set(metadata)  # this task's own context: no reset needed
        # The internal describe is no application call: neither hooked nor counted.
        observer = self.observer if service != INTERNAL_SERVICE else None
        observed = observer.server_started(service, spec, metadata) if observer else None
        error: CallError | None = None
        extra: dict[str, Any] = {}
        cancelled = False
        reply = True
        try:
            if incoming.cancelled:
                error = NotDispatched("CANCELLED", "cancelled before dispatch")
                extra, cancelled = {"cancel": NOT_STARTED}, True
            else:
                with incoming.scope:
                    incoming.started = True
                    if spec.kind is MethodKind.STREAM:
                        await self._produce(call_id, incoming, target(*pos, **kw))
                    else:
                        result = await target(*pos, **kw)
                        try:
                            body = encode_result(call_id, to_wire(result))
                        except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
                            error = RemoteError("UNENCODABLE_RESULT", str(exc))
                            extra = _TYPE_ERROR
                        else:
                            error = await self._send_reply(call_id, body)
                            reply = False  # a result, or the error that replaced it, is sent
                if incoming.scope.cancelled_caught:
                    # Interrupted (by the caller's cancel; by retirement nothing can be sent):
                    # a receipt tells the caller it ran, perhaps partly.
                    error = OutcomeUnknown(
                        "CANCELLED", "cancelled while running; it may have had effects"
                    )
                    extra, cancelled, reply = {"cancel": INTERRUPTED}, True, True
        except Exception as exc:
            error, extra, reply = *_handler_error(exc), True
        except BaseException:
            # This task was cancelled (not by the scope above): nothing can be sent any more.
            error, cancelled = OutcomeUnknown("CANCELLED", "cancelled while running"), True
            reply = False
            raise
        finally:
            try:
                if error is not None and reply:
                    await self._send_error(call_id, error, **extra)
            finally:
                # Only now, with its reply handed to the session, does the call leave the
                # budget.
                self._incoming.pop(call_id, None)
                self._note_settled()
                if observer is not None:
                    observer.server_ended(observed, error, cancelled)

    async def _send_reply(self, call_id: int, body: bytes) -> CallError | None:
        """Hand a result over; if it is too large, send the error that replaces it (and return
        it: what the caller is told)."""
        try:
            await self._chunks.send(body)
        except PayloadTooLarge as exc:
            error = RemoteError("RESULT_TOO_LARGE", str(exc), remote_type="PayloadTooLarge")
            await self._send_error(call_id, error)
            return error
        except SessionFailed:
            pass
        return None

    async def _produce(self, call_id: int, incoming: _Incoming, iterator: Any) -> None:
        if not hasattr(iterator, "__anext__"):
            raise TypeError(
                f"stream handler returned {type(iterator).__name__}, not an async iterator"
            )
        try:
            while True:
                while incoming.credit <= 0 or incoming.credit_bytes <= 0:
                    incoming.credit_event = anyio.Event()
                    await incoming.credit_event.wait()
                try:
                    item = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                try:
                    body = encode_item(call_id, to_wire(item))
                except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
                    raise TypeError(f"cannot encode stream item: {exc}") from exc
                incoming.credit -= 1
                incoming.credit_bytes -= len(body)
                await self._chunks.send(body)
            await self.transport.send(encode(End(call_id)))
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                with (
                    anyio.CancelScope(shield=True),
                    anyio.move_on_after(self.limits.scope_cleanup_timeout),
                ):
                    await aclose()

    # ------------------------------------------------------------------ describe

    async def describe_peer(self, timeout: float) -> dict[str, Any]:
        """Call the peer's internal ``describe`` and return its manifest."""
        result = await self.call(INTERNAL_SERVICE, _DESCRIBE_SPEC, (), {}, timeout=timeout)
        if not isinstance(result, dict):
            raise RemoteError("MALFORMED_MANIFEST", "describe returned no map")
        return result


# The one internal method ("$link".describe): no arguments, the manifest map as its result.
_DESCRIBE_SPEC = MethodSpec(
    name="describe",
    kind=MethodKind.UNARY,
    signature=inspect.Signature(),
    hints={},
    result=Any,
)


if sys.version_info >= (3, 12):

    def _start_handler(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, None],
        context: contextvars.Context,
    ) -> asyncio.Task[None]:
        """Start a handler task on asyncio; eagerly on Python 3.12+.

        An eager task runs its first step at once, when the message that carried its call has
        been dispatched (:meth:`ExecutorRpc._start_handlers`, in the socket reader's turn; a
        ``cancel`` in the same message still finds it not started), instead of one event-loop
        turn later. A handler that never suspends runs to its end there, and its reply is
        handed to the session -- and, on a quiet socket, written -- before the reader reads on:
        one loop turn less per call. A handler that suspends goes on as an ordinary task. Either
        way it is a task of its own from its first line: ``current_task()`` is that task, its
        cancel scopes bind to it, it runs in ``context`` (its own copy), and the reader's
        context and task state are untouched (asyncio swaps the current task around the eager
        step). Replies of handlers that do not suspend are handed over in call order, as before
        (tasks started in order ran in order).

        A loop with a task factory of its own keeps it (``loop.create_task``; not eager unless that
        factory is): what it does per task is the application's choice. Python 3.11 has no eager
        tasks, and trio never starts a task eagerly (handlers there are task-group children).
        """
        if loop.get_task_factory() is None:
            return asyncio.Task(coro, loop=loop, context=context, eager_start=True)
        return loop.create_task(coro, context=context)

else:

    def _start_handler(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, None],
        context: contextvars.Context,
    ) -> asyncio.Task[None]:
        """Start a handler task on asyncio (Python 3.11: never eagerly)."""
        return loop.create_task(coro, context=context)


def _reclaim_when_dropped(stream: RemoteStream, rpc: ExecutorRpc, pending: _Pending) -> Any:
    """Reclaim ``pending`` if ``stream`` is collected while the call still runs.

    The finalizer holds no reference to ``stream`` (that would keep it alive) and only a weak
    one to ``rpc``; all it does is schedule :func:`_reclaim`, since it may run inside the
    garbage collector, where touching the session (a dict in mid-iteration, a half-written
    frame) is not safe. It must never raise: an exception there is "unraisable".
    """
    schedule = loop_scheduler()
    finalizer = weakref.finalize(stream, _schedule_reclaim, schedule, weakref.ref(rpc), pending)
    finalizer.atexit = False  # at interpreter exit there is no loop to run it on
    return finalizer


def _schedule_reclaim(
    schedule: Callable[..., object], rpc: weakref.ref[ExecutorRpc], pending: _Pending
) -> None:
    try:
        schedule(_reclaim, rpc, pending)
    except Exception:  # the loop is closed: the session (and its slot) is gone with it
        pass


def _reclaim(rpc_ref: weakref.ref[ExecutorRpc], pending: _Pending) -> None:
    # A plain loop callback: an exception here would reach the loop (trio: a TrioInternalError).
    rpc = rpc_ref()
    if rpc is None:
        return
    try:
        rpc._reclaim_stream(pending)
    except Exception:
        log.exception("reclaiming a dropped stream failed")


class RemoteStream(AsyncIterator[Any]):
    """A remote async iterator with credit-based flow control.

    The request is sent on the first ``__anext__``. ``aclose()`` cancels the generator on the
    peer; so does dropping the iterator without it (``break`` out of ``async for``): once it is
    collected its pending slot is freed and ``cancel`` is sent (see the module docstring). If the
    session is retired mid-stream, iteration raises :class:`OutcomeUnknown` (items already
    delivered stand); so does a flow-control violation by the producer
    (``FLOW_CONTROL_VIOLATION``).
    """

    def __init__(
        self,
        rpc: ExecutorRpc,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._rpc = rpc
        self._metadata = metadata
        self._service = service
        self._spec = spec
        self._args = args
        self._kwargs = kwargs
        self._pending: _Pending | None = None
        limits = rpc.limits
        self._state = _StreamState(limits.stream_window_items, limits.stream_window_bytes)
        self._consumed = 0
        self._consumed_bytes = 0
        self._closed = False
        self._finalizer: Any = None

    def __aiter__(self) -> RemoteStream:
        return self

    async def _start(self) -> None:
        limits = self._rpc.limits
        pending, body = self._rpc._prepare(
            self._service,
            self._spec,
            self._args,
            self._kwargs,
            (limits.stream_window_items, limits.stream_window_bytes),
            None,
            self._metadata,
        )
        assert pending is not None
        pending.stream = self._state
        self._pending = pending
        self._finalizer = _reclaim_when_dropped(self, self._rpc, pending)
        try:
            await self._rpc._issue(pending, body)
        except BaseException:
            self._rpc._abandon(pending)  # e.g. cancelled while waiting for retention capacity
            raise

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self._pending is None:
            try:
                await self._start()
            except BaseException:
                # Not issued (offline, too large, cancelled): nothing will ever arrive, so a
                # later iteration must not wait for it.
                self._close()
                raise
        state = self._state
        while not state.items:
            if state.ended:
                self._close()
                if state.error is not None:
                    raise _local_exception(state.error)
                raise StopAsyncIteration
            state.arrived = anyio.Event()
            await state.arrived.wait()
        value, size = state.items.popleft()
        self._grant(size)
        return value

    def _grant(self, size: int) -> None:
        self._consumed += 1
        self._consumed_bytes += size
        limits = self._rpc.limits
        state = self._state
        if state.ended or self._pending is None:
            return
        if (
            self._consumed >= limits.stream_window_items // 2
            or self._consumed_bytes >= limits.stream_window_bytes // 2
        ):
            items, nbytes = self._consumed, max(self._consumed_bytes, 1)
            # What the producer may send grows with the grant at once (the consumer's view
            # can only be ahead of the producer's, never behind: no false violation).
            state.credit_items += items
            state.credit_bytes += nbytes
            self._rpc._send_soon(
                _CONTROL, self._rpc._encode(Credit(self._pending.id, items, nbytes))
            )
            self._consumed = 0
            self._consumed_bytes = 0

    def _close(self) -> None:
        self._closed = True
        self._state.items.clear()
        if self._finalizer is not None:
            self._finalizer.detach()  # nothing left to reclaim

    async def aclose(self) -> None:
        """Stop the stream; cancels the generator on the peer if it is still running."""
        if self._closed:
            return
        if self._pending is not None and not self._state.ended:
            self._rpc._abandon(self._pending)
        self._close()
