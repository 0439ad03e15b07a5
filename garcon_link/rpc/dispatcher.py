"""The serving side of one session: the peer's calls, notifications, cancels and credit.

Theory of operation (the rules are in the module docstring of :mod:`.rpc`): :class:`Dispatcher`
admits each incoming call or refuses it without running it (a call id that does not increase,
draining, bad arguments, credit, key or metadata, the ``max_incoming_calls`` budget, an unknown
service or method), and runs each admitted handler in a task of its own through one runner,
:meth:`Dispatcher._run`, parameterised by its :class:`ReplyPolicy`: a unary call sends its result
or error, a stream produces items against the peer's credit, a notification sends nothing (a
failure is logged), a keyed call's outcome is recorded in the worker's idempotency table. That
runner is the server side's outcome point: the reply it decides is what the observer is told.

On asyncio a handler is a plain task started at the end of the message that carried its call
(eagerly on Python 3.12+, :func:`_start_handler`); on trio a child of the session's task group.

Why :class:`Dispatcher` is longer than ~500 lines: admission and running share the incoming
table, the budget and the refusal path on every call, and splitting them would add a call per
call on the hot path; the admission checks of ``call`` alone are ~100 lines of plain rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import sys
import types
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sized
from typing import Any

import anyio
import anyio.abc
import cbor2

from ..endpoint.transport import SessionTransport
from ..errors import (
    CallError,
    NotDispatched,
    OutcomeUnknown,
    PayloadTooLarge,
    Rejected,
    RemoteError,
    SessionFailed,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_text
from .chunks import ChunkSender
from .envelopes import (
    CALL,
    ERROR,
    RESULT,
    Call,
    Cancel,
    Credit,
    End,
    Notify,
    encode,
    encode_item,
    encode_result,
    envelope_head,
    metadata_problem,
)
from .errorbody import (
    INTERRUPTED,
    MAX_ERROR_MESSAGE,
    MAX_REFUSAL_MESSAGE,
    NOT_STARTED,
    TYPE_ERROR,
    error_body,
    error_envelope,
    handler_error,
)
from .hooks import _current_metadata
from .idempotency import (
    Await,
    Conflict,
    Execute,
    Full,
    KeyedExecutions,
    Replay,
    arguments_digest,
    key_problem,
    reply_envelope,
)
from .interface import MethodKind, MethodSpec, to_wire
from .observer import CallObserver
from .outbox import REFUSAL_KIND, Outbox
from .registry import DESCRIBE_SPEC, INTERNAL_SERVICE, Registry, in_scope
from .resources import ResourceRef, ServiceScope, _current

__all__ = ["Dispatcher", "ReplyPolicy", "current_session"]

# The session a handler runs in (the coordinator, ``rpc.ExecutorRpc``): ``rpc.current_rpc``.
current_session: contextvars.ContextVar[Any] = contextvars.ContextVar("garcon_link_rpc")

_NO_METADATA: Mapping[str, str] = types.MappingProxyType({})


class ReplyPolicy(enum.Enum):
    """What :meth:`Dispatcher._run` does with a handler's outcome."""

    UNARY = "unary"  # send the result, or the error that replaces it
    STREAM = "stream"  # produce items against the peer's credit, then the end (or an error)
    NOTIFY = "notify"  # nothing to send: a failure is logged
    KEYED = "keyed"  # return the reply, to be recorded in the worker's idempotency table


UNARY, STREAM, NOTIFY, KEYED = ReplyPolicy


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


class Dispatcher:
    """The peer's calls on one session: admission, budgets, handlers, refusals.

    Args:
        session: the coordinator handlers see as ``current_rpc()``.
        transport: the session.
        registry: local services the peer may call.
        limits: budgets and windows.
        observer: the endpoint's hooks and counters (the server side's outcome point).
        chunks: the session's sender of bodies in parts (results and items go through it).
        outbox: where refusals go without a task.
        settled: called whenever a handler ends (the session's ``wait_idle``).
        dropped: counts and logs an envelope dropped as malformed (``kind``, why).
        peer_log: the session's limiter for what the peer makes us log.
        pending: the caller's pending table, read for its size only (:meth:`alone`).
        scope: the service scope handlers run in (worker side).
        describe: returns this side's manifest for the internal ``describe`` call.
        idempotency: the worker's keyed calls; without it, keyed calls are refused.
    """

    def __init__(
        self,
        session: object,
        transport: SessionTransport,
        registry: Registry,
        limits: Limits,
        observer: CallObserver,
        chunks: ChunkSender,
        outbox: Outbox,
        settled: Callable[[], None],
        dropped: Callable[[int | None, str], None],
        peer_log: PeerLogLimiter,
        pending: Sized,
        *,
        scope: ServiceScope | None,
        describe: Callable[[], dict[str, Any]],
        idempotency: KeyedExecutions | None,
    ) -> None:
        self._session = session
        self.transport = transport
        self.registry = registry
        self.limits = limits
        self.observer = observer
        self.scope = scope
        self.idempotency = idempotency
        self._describe = describe
        self._chunks = chunks
        self._outbox = outbox
        self._note_settled = settled
        self._dropped_envelope = dropped
        self._peer_log = peer_log
        self._pending = pending
        self._retired = False
        self._incoming: dict[int, _Incoming] = {}
        self._notifications = 0  # one-way handlers running
        self._last_incoming_id = 0
        # The call id of a call sent in parts, claimed at its first part (claim()), while the
        # reassembled call is dispatched: on_call does not take it for a reuse.
        self.whole_id: int | None = None
        self._max_body = limits.max_frame_bytes - 32
        self.draining = False
        self.refusals = 0
        self.notifications_dropped = 0
        self.eager_handlers = 0
        self._eager_seen = 0  # eager_handlers when alone() last asked
        # Call handlers on asyncio are plain tasks (see on_call); on trio, children of _tg.
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        # asyncio: handlers of the message being dispatched, started at its end.
        self._to_start: deque[tuple[_Incoming, Coroutine[Any, Any, None]]] = deque()

    @property
    def running(self) -> int:
        """Handlers running (or waiting to hand over their reply): what the budget counts."""
        return len(self._incoming) + self._notifications

    def attach(
        self,
        tg: anyio.abc.TaskGroup,
        loop: asyncio.AbstractEventLoop | None,
        context: contextvars.Context,
    ) -> None:
        """Where handlers run from now on: ``tg`` (trio, notifications), ``loop`` (asyncio call
        handlers as plain tasks), each in a copy of ``context``."""
        self._tg, self._loop, self._context = tg, loop, context

    def retire(self) -> None:
        """Cancel every running handler (idempotent)."""
        self._retired = True
        for incoming in self._incoming.values():
            incoming.cancelled = True
            incoming.scope.cancel()

    def close_unstarted(self) -> None:
        """Drop the handlers of a message whose dispatch was cut short by an exception."""
        while self._to_start:
            incoming, handler = self._to_start.popleft()
            handler.close()
            self._incoming = {k: v for k, v in self._incoming.items() if v is not incoming}

    def alone(self) -> bool:
        """Whether at most one call (or notification handler) is pending or running on this
        session: a request/reply at a time, where the transport's reader lets the woken task
        run before reading on. Not when the message was a call whose handler already ran to
        its end in the dispatch (an eager handler): no task was woken, and a yield would cost
        the reader a loop turn for nothing. Asked once per message with payloads."""
        eager = self.eager_handlers != self._eager_seen
        self._eager_seen = self.eager_handlers
        return not eager and len(self._pending) + len(self._incoming) + self._notifications <= 1

    def claim(self, first: bytes) -> int | None:
        """The call id a transfer's first chunk names, recorded as the last incoming id; ``-1``
        for one that does not increase (the whole call is then dropped); ``None`` if the body
        is not a call whose head is readable (it is then checked whole, as any call)."""
        head = envelope_head(first)
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

    def on_undecodable_call(self, call_id: int) -> None:
        """A ``call`` that did not decode: refused ``Rejected("INVALID_ARGUMENTS")`` at once if
        its id is new (it did not run; its caller need not wait for its timeout), else dropped."""
        if call_id > self._last_incoming_id or call_id == self.whole_id:
            self._last_incoming_id = max(call_id, self._last_incoming_id)
            self._refuse(
                call_id, Rejected("INVALID_ARGUMENTS", "the call's arguments do not decode")
            )

    def _refuse(self, call_id: int, error: CallError) -> None:
        """Answer a call that will not run (from dispatch: no task, bounded; module docstring).

        Past ``max_queued_refusals`` -- only within the message being handed over, as the
        reader then pauses -- the call is refused ``OVERLOADED`` and only its id is kept.
        """
        self.refusals += 1
        outbox = self._outbox
        if outbox.refusals_full:
            self.observer.refused(NotDispatched("OVERLOADED"))
            outbox.overflow(call_id)
            return
        self.observer.refused(error)
        outbox.send_soon(REFUSAL_KIND, error_envelope(call_id, error, limit=MAX_REFUSAL_MESSAGE))

    async def _send_error(self, call_id: int, error: CallError, **extra: Any) -> None:
        """A handler's error reply, written by the handler's own task (which keeps its
        incoming slot meanwhile): waits for retention capacity like a result."""
        body = error_envelope(call_id, error, **extra)
        try:
            await self.transport.send(body)
        except PayloadTooLarge:
            # A frame limit too small for the traceback: the outcome and code still go.
            with contextlib.suppress(PayloadTooLarge, SessionFailed):
                await self.transport.send(error_envelope(call_id, error, limit=MAX_REFUSAL_MESSAGE))
        except SessionFailed:
            pass

    def _resolve(self, service: Any, method: Any) -> tuple[MethodSpec, Callable[..., Any]]:
        if not isinstance(service, str) or not isinstance(method, str):
            raise Rejected("OPERATION_UNSUPPORTED", "service and method must be strings")
        if service == INTERNAL_SERVICE:
            if method == "describe":
                return DESCRIBE_SPEC, self._internal_describe
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
            target = in_scope(bound.scope, target)
        return spec, target

    async def _internal_describe(self) -> dict[str, Any]:
        return self._describe()

    def on_call(self, envelope: Call) -> None:
        call_id, service, method = envelope.id, envelope.service, envelope.method
        args, kwargs, key = envelope.args, envelope.kwargs, envelope.key
        credit, credit_bytes = envelope.credit_items, envelope.credit_bytes
        if call_id <= self._last_incoming_id and call_id != self.whole_id:
            self._dropped_envelope(
                CALL,
                f"call id {peer_text(call_id)} does not increase "
                f"(last {peer_text(self._last_incoming_id)})",
            )
            return
        if call_id > self._last_incoming_id:
            self._last_incoming_id = call_id
        if self.draining and service != INTERNAL_SERVICE:
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
        policy = STREAM if spec.kind is MethodKind.STREAM else UNARY
        handler = self._run(policy, call_id, incoming, service, spec, target, pos, kw, metadata)
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

    def start_handlers(self) -> None:
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
                self.eager_handlers += 1

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

    async def join_handlers(self) -> None:
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
                lambda: self._run(KEYED, 0, None, service, spec, target, pos, kw, metadata),
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
            if owner and incoming.cancelled and not self._retired:
                keyed.cancel(decision.entry)
        finally:
            self._incoming.pop(call_id, None)

    def _check_scope(self, args: list[Any], kwargs: Mapping[str, Any]) -> None:
        if self.scope is None:
            return
        for value in (*args, *kwargs.values()):
            # The session's references or its worker's (worker-scoped services).
            if isinstance(value, ResourceRef) and not self.scope.admits(value):
                self.scope.check(value)  # raises StaleResource

    def on_notify(self, envelope: Notify) -> None:
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
        if self.draining:
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
        self._tg.start_soon(self._run, NOTIFY, 0, None, service, spec, target, pos, kw, metadata)

    def _dropped_notification(self, reason: str, service: object, method: object, why: str) -> None:
        """Count a dropped notification; log it, at most once per reason per ``log_interval``."""
        self.notifications_dropped += 1
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

    def on_cancel(self, envelope: Cancel) -> None:
        incoming = self._incoming.get(envelope.id)
        if incoming is not None:
            incoming.cancelled = True
            incoming.scope.cancel()

    def on_credit(self, envelope: Credit) -> None:
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

    # -- running handlers: the server side's outcome point

    async def _run(
        self,
        policy: ReplyPolicy,
        call_id: int,
        incoming: _Incoming | None,
        service: str,
        spec: MethodSpec,
        target: Callable[..., Any],
        pos: list[Any],
        kw: dict[str, Any],
        metadata: Mapping[str, str],
    ) -> Any:
        """Run one handler and act on its outcome by ``policy``: the server side's outcome point
        (the reply it decides is what :meth:`CallObserver.server_ended` is told).

        ``incoming`` is the call's slot (``None`` for a notification and a keyed execution,
        which hold none here). Returns the reply to record for ``KEYED`` (cancellation
        propagates), else ``None``. A keyed execution is observed once, not per repeat of its
        key; the internal ``describe`` is no application call: neither hooked nor counted.
        """
        current_session.set(self._session)
        if self.scope is not None:
            _current.set(self.scope)
        # A handler's own task and context (a keyed execution's task is the worker's: reset).
        token = _current_metadata.set(metadata) if metadata else None
        observer = self.observer if policy is not UNARY or service != INTERNAL_SERVICE else None
        observed = (
            observer.server_started(service, spec, metadata, "notify" if policy is NOTIFY else None)
            if observer
            else None
        )
        error: CallError | None = None
        extra: dict[str, Any] = {}
        cancelled = False
        reply = False  # whether ``error`` is still to be sent (UNARY and STREAM)
        body = b""
        try:
            if policy is NOTIFY:
                result = target(*pos, **kw)
                if hasattr(result, "__await__"):
                    await result
            elif policy is KEYED:
                body, error, extra = self._recordable(await target(*pos, **kw))
            else:
                assert incoming is not None  # a call's handler holds its slot
                if incoming.cancelled:
                    error = NotDispatched("CANCELLED", "cancelled before dispatch")
                    extra, cancelled, reply = {"cancel": NOT_STARTED}, True, True
                else:
                    with incoming.scope:
                        incoming.started = True
                        if policy is STREAM:
                            await self._produce(call_id, incoming, target(*pos, **kw))
                        else:
                            result = await target(*pos, **kw)
                            try:
                                body = encode_result(call_id, to_wire(result))
                            except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
                                error = RemoteError("UNENCODABLE_RESULT", str(exc))
                                extra, reply = TYPE_ERROR, True
                            else:
                                # A result, or the error that replaced it, is sent.
                                error = await self._send_reply(call_id, body)
                    if incoming.scope.cancelled_caught:
                        # Interrupted (by the caller's cancel; by retirement nothing can be
                        # sent): a receipt tells the caller it ran, perhaps partly.
                        error = OutcomeUnknown(
                            "CANCELLED", "cancelled while running; it may have had effects"
                        )
                        extra, cancelled, reply = {"cancel": INTERRUPTED}, True, True
        except Exception as exc:
            error, extra = handler_error(exc)
            reply = policy is UNARY or policy is STREAM
            if policy is NOTIFY:
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
        except BaseException:
            # This task was cancelled (not by the call's scope): nothing can be sent any more.
            error, cancelled = OutcomeUnknown("CANCELLED", "cancelled while running"), True
            reply = False
            if policy is KEYED:
                self.observer.server_ended(observed, error, True)
            raise
        finally:
            if policy is KEYED:
                if token is not None:
                    _current_metadata.reset(token)
            else:
                try:
                    if error is not None and reply:
                        await self._send_error(call_id, error, **extra)
                finally:
                    # Only now, with its reply handed to the session, does the call leave the
                    # budget.
                    if policy is NOTIFY:
                        self._notifications -= 1
                    else:
                        self._incoming.pop(call_id, None)
                    self._note_settled()
                    if observer is not None:
                        observer.server_ended(observed, error, cancelled)
        # KEYED only from here: the reply to record.
        self.observer.server_ended(observed, error, False)
        if error is not None:
            message = error.message
            if len(message) > MAX_ERROR_MESSAGE:
                message = message[:MAX_ERROR_MESSAGE] + "... (cut)"
            return ERROR, cbor2.dumps(error_body(error.outcome, error.code, message, **extra))
        return RESULT, body

    def _recordable(self, result: Any) -> tuple[bytes, CallError | None, dict[str, Any]]:
        """A keyed handler's result as the body to record, or the error that replaces it."""
        try:
            body = cbor2.dumps(to_wire(result))
        except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
            return b"", RemoteError("UNENCODABLE_RESULT", str(exc)), TYPE_ERROR
        if len(body) + 16 > self._max_body:
            error = RemoteError(
                "RESULT_TOO_LARGE", f"the result ({len(body)} bytes) exceeds the frame limit"
            )
            return b"", error, {"remote_type": "PayloadTooLarge"}
        return body, None, {}

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
