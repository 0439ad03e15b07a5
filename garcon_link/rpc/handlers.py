"""The handlers running on one session: the peer's calls' slots and the one runner.

Theory of operation (the rules are in the module docstring of :mod:`.rpc`): every handler the
:class:`~.dispatcher.Dispatcher` admits runs through :meth:`Handlers.run`, parameterised by its
:class:`ReplyPolicy`: a unary call sends its result or error, a stream produces items against the
peer's credit, a notification sends nothing (a failure is logged), a keyed call's outcome is
returned to be recorded in the worker's idempotency table. That runner is the server side's
outcome point: the reply it decides is what the observer is told. A call keeps its slot in the
incoming table (what ``max_incoming_calls`` counts, with the notifications running) until its
reply is handed to the session; a ``cancel`` or the session's retirement cancels its scope.
On asyncio a unary call's handler enters that scope only if it suspends (:meth:`Handlers.run`):
one that runs to its end in its first step could not have been cancelled, and pays for none.

On asyncio a call's handler is a plain task started at the end of the message that carried its
call (:meth:`Handlers.start_handlers`; eagerly, :func:`_start_handler`); on trio
a child of the session's task group, as notifications are on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import sys
import types
from asyncio.tasks import _enter_task, _leave_task
from collections import deque
from collections.abc import Callable, Coroutine, Generator, Mapping, Sized
from typing import Any, TypeVar

import anyio
import anyio.abc
import cbor2

from ..endpoint.transport import SessionTransport
from ..errors import (
    CallError,
    NotDispatched,
    OutcomeUnknown,
    PayloadTooLarge,
    RemoteError,
    SessionFailed,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields
from ..net.backend import OutermostScope, cancel_scope_factory, late_scopes
from .chunks import ChunkSender
from .envelopes import (
    ERROR,
    RESULT,
    Cancel,
    Credit,
    End,
    encode,
    encode_item,
    encode_reply,
    encode_result,
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
from .idempotency import Await, Execute, KeyedExecutions, Replay
from .interface import MethodSpec
from .observer import CallObserver
from .registry import INTERNAL_SERVICE
from .resources import ServiceScope, _current
from .splice import SPLICE_BYTES, Spliced
from .towire import to_wire

__all__ = ["Handlers", "Incoming", "ReplyPolicy", "current_session"]

_NO_EXTRA: Mapping[str, Any] = types.MappingProxyType({})
_T = TypeVar("_T")

# The session a handler runs in (the coordinator, ``rpc.ExecutorRpc``): ``rpc.current_rpc``.
current_session: contextvars.ContextVar[Any] = contextvars.ContextVar("garcon_link_rpc")


class ReplyPolicy(enum.Enum):
    """What :meth:`Handlers.run` does with a handler's outcome."""

    UNARY = "unary"  # send the result, or the error that replaces it
    STREAM = "stream"  # produce items against the peer's credit, then the end (or an error)
    NOTIFY = "notify"  # nothing to send: a failure is logged
    KEYED = "keyed"  # return the reply, to be recorded in the worker's idempotency table


UNARY, STREAM, NOTIFY, KEYED = ReplyPolicy


class Incoming:
    """One peer call's slot: its cancel scope, the credit it may use, its task."""

    __slots__ = (
        "cancelled",
        "credit",
        "credit_bytes",
        "credit_event",
        "on_cancel",
        "scope",
        "task",
    )

    def __init__(self, credit: int, credit_bytes: int, scope: anyio.CancelScope | None) -> None:
        # None until the handler enters one (Handlers.run): a cancel or retirement meanwhile
        # sets ``cancelled``, which the handler reads before it starts and when it enters it.
        self.scope = scope
        self.cancelled = False
        self.credit = credit
        self.credit_bytes = credit_bytes
        # Created by the producer only when it has to wait for credit.
        self.credit_event: anyio.Event | None = None
        # The handler's task, on asyncio (see Dispatcher.on_call).
        self.task: asyncio.Task[None] | None = None
        # A call held without a handler (Handlers.hold): told of its cancel (False) or of the
        # session's retirement (True) instead of a scope.
        self.on_cancel: Callable[[bool], None] | None = None


class Handlers:
    """The peer's calls and notifications running on one session.

    Args:
        session: the coordinator handlers see as ``current_rpc()``.
        transport: the session.
        limits: budgets and windows.
        observer: the endpoint's hooks and counters (the server side's outcome point).
        chunks: the session's sender of bodies in parts (results and items go through it).
        settled: called whenever a handler ends (the session's ``wait_idle``).
        peer_log: the session's limiter for what the peer makes us log.
        pending: the caller's pending table, read for its size only (:meth:`alone`).
        scope: the service scope handlers run in (worker side).
    """

    def __init__(
        self,
        session: object,
        transport: SessionTransport,
        limits: Limits,
        observer: CallObserver,
        chunks: ChunkSender,
        settled: Callable[[], None],
        peer_log: PeerLogLimiter,
        pending: Sized,
        scope: ServiceScope | None,
    ) -> None:
        self._session = session
        self.transport = transport
        self.limits = limits
        self.observer = observer
        self.scope = scope
        self._chunks = chunks
        self._note_settled = settled
        self._peer_log = peer_log
        self._pending = pending
        self._retired = False
        self._max_body = limits.max_frame_bytes - 32
        # The peer's calls by id, each until its reply is handed over (what the budget counts,
        # with the notifications running).
        self.incoming: dict[int, Incoming] = {}
        self.notifications = 0  # one-way handlers running
        self.eager_handlers = 0
        self._eager_seen = 0  # eager_handlers when alone() last asked
        # Call handlers on asyncio are plain tasks (see Dispatcher.on_call); on trio, children
        # of tg.
        self.tg: anyio.abc.TaskGroup | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        # A call's cancel scope, for the backend that runs them (set by attach).
        self.new_scope: Callable[[], anyio.CancelScope] = anyio.CancelScope
        # Whether a unary call's handler enters its scope only once it suspends (run).
        self.late_scopes = False
        # The scope of every held call (hold): never entered, as no handler runs for one; a
        # cancel or a retirement is told to its on_cancel instead.
        self._held_scope: anyio.CancelScope | None = None
        # asyncio: handlers of the message being dispatched, started at its end.
        self.to_start: deque[tuple[Incoming, Coroutine[Any, Any, None]]] = deque()

    @property
    def running(self) -> int:
        """Handlers running (or waiting to hand over their reply): what the budget counts."""
        return len(self.incoming) + self.notifications

    def attach(
        self,
        tg: anyio.abc.TaskGroup,
        loop: asyncio.AbstractEventLoop | None,
        context: contextvars.Context,
    ) -> None:
        """Where handlers run from now on: ``tg`` (trio, notifications), ``loop`` (asyncio call
        handlers as plain tasks), each in a copy of ``context``."""
        self.tg, self.loop = tg, loop
        # The asyncio call handlers' tasks copy this one, where the session and its service
        # scope are already set (run() sets them in every other handler's own context).
        self._context = context.copy()
        self._context.run(self._enter_session)
        self.new_scope = cancel_scope_factory()
        self.late_scopes = loop is not None and late_scopes()

    def _enter_session(self) -> None:
        """Set, in the current context, what a handler of this session sees: ``current_rpc()``
        and ``current_scope()``."""
        current_session.set(self._session)
        if self.scope is not None:
            _current.set(self.scope)

    def retire(self) -> None:
        """Cancel every running handler and held call (idempotent)."""
        self._retired = True
        for incoming in list(self.incoming.values()):
            incoming.cancelled = True
            if incoming.on_cancel is not None:
                incoming.on_cancel(True)
            elif incoming.scope is not None:
                incoming.scope.cancel()

    def close_unstarted(self) -> None:
        """Drop the handlers of a message whose dispatch was cut short by an exception."""
        while self.to_start:
            incoming, handler = self.to_start.popleft()
            handler.close()
            for call_id in [k for k, v in self.incoming.items() if v is incoming]:
                del self.incoming[call_id]

    def alone(self) -> bool:
        """Whether at most one call (or notification handler) is pending or running on this
        session: a request/reply at a time, where the transport's reader lets the woken task
        run before reading on. Not when the message was a call whose handler already ran to
        its end in the dispatch (an eager handler): no task was woken, and a yield would cost
        the reader a loop turn for nothing. Asked once per message with payloads."""
        eager = self.eager_handlers != self._eager_seen
        self._eager_seen = self.eager_handlers
        return not eager and len(self._pending) + len(self.incoming) + self.notifications <= 1

    def start_handlers(self) -> None:
        """Start, in call order, the handlers of the calls the message just dispatched carried
        (asyncio: eagerly where the runtime can, see :func:`_start_handler`). Called by the
        transport's reader once the message's payloads were handed over."""
        to_start = self.to_start
        if not to_start:
            return
        assert self.loop is not None
        loop, context = self.loop, self._context
        while to_start:
            incoming, handler = to_start.popleft()
            task = incoming.task = _start_handler(loop, handler, context.copy())
            if task.done():
                self.eager_handlers += 1

    async def join_handlers(self) -> None:
        """Wait for the handler tasks (cancelled by retire_unknown) to end, as a task group's
        exit would; shielded, so shutdown cannot leave them running unobserved."""
        with anyio.CancelScope(shield=True):
            while tasks := [
                i.task for i in self.incoming.values() if i.task is not None and not i.task.done()
            ]:
                await asyncio.wait(tasks)

    def start_keyed(
        self,
        call_id: int,
        keyed: KeyedExecutions,
        decision: Execute | Await | Replay,
    ) -> None:
        """Hold ``call_id``'s slot while it waits for the reply of its keyed execution (run in
        the worker's task group: it outlives this session), then send that reply."""
        incoming = Incoming(0, 0, self.new_scope())
        self.incoming[call_id] = incoming
        self.note_incoming()
        waiter = self._wait_keyed(
            call_id, incoming, keyed, decision, owner=isinstance(decision, Execute)
        )
        if self.loop is not None:
            incoming.task = self.loop.create_task(waiter, context=self._context.copy())
        else:
            assert self.tg is not None
            self.tg.start_soon(lambda: waiter)

    def note_incoming(self) -> None:
        """Raise the endpoint's ``incoming_peak`` to what runs now, if it is higher."""
        running = len(self.incoming) + self.notifications
        if running > self.observer.incoming_peak:
            self.observer.incoming_peak = running

    async def _wait_keyed(
        self,
        call_id: int,
        incoming: Incoming,
        keyed: KeyedExecutions,
        decision: Execute | Await | Replay,
        *,
        owner: bool,
    ) -> None:
        try:
            assert incoming.scope is not None
            with incoming.scope:
                kind, body = await keyed.wait(decision.entry)
                await self.send_reply(call_id, encode_reply(kind, call_id, body))
            # Cancelled. By the caller's ``cancel`` (the session is open): the call that started
            # the execution cancels it; a repeat only stops waiting. By this session's
            # retirement: the execution goes on, for the retry on the next session.
            if owner and incoming.cancelled and not self._retired:
                keyed.cancel(decision.entry)
        finally:
            self.incoming.pop(call_id, None)

    def on_cancel(self, envelope: Cancel) -> None:
        incoming = self.incoming.get(envelope.id)
        if incoming is not None:
            incoming.cancelled = True
            if incoming.on_cancel is not None:
                incoming.on_cancel(False)
            elif incoming.scope is not None:
                incoming.scope.cancel()

    # -- calls held without a handler task (a relay's forwarded calls)

    def hold(self, call_id: int, on_cancel: Callable[[bool], None]) -> Incoming:
        """Give the admitted call ``call_id`` its slot without a handler: whoever holds it
        answers with :meth:`reply_held` or gives it up with :meth:`release_held`; a ``cancel``
        or the session's retirement is told to ``on_cancel`` (``True``: retired, nothing can be
        sent)."""
        scope = self._held_scope
        if scope is None:
            scope = self._held_scope = self.new_scope()
        incoming = Incoming(0, 0, scope)
        incoming.on_cancel = on_cancel
        self.incoming[call_id] = incoming
        if len(self.incoming) + self.notifications > self.observer.incoming_peak:
            self.note_incoming()
        return incoming

    def reply_held(
        self,
        call_id: int,
        incoming: Incoming,
        body: bytes,
        error: CallError | None = None,
        cancelled: bool = False,
    ) -> None:
        """Hand a held call's reply (``body``, an encoded ``result`` or ``error``) to the
        session -- at once if it admits it, else from a task that keeps the slot meanwhile --
        and free its slot; ``error`` is what the observer is told it ended with."""
        if self.incoming.get(call_id) is not incoming:
            return  # released meanwhile (the session retired)
        incoming.on_cancel = None
        try:
            if self._chunks.send_nowait(body) is not None:
                # release_held's work, here: every held call's path
                if self.incoming.get(call_id) is incoming:
                    del self.incoming[call_id]
                    self._note_settled()
                    self.observer.server_ended(None, error, cancelled)
                return
        except SessionFailed:
            self.release_held(call_id, incoming, error, cancelled)
            return
        except PayloadTooLarge:
            pass  # send_reply replaces it with its error
        sender = self._send_held(call_id, incoming, body, error, cancelled)
        if self.loop is not None:
            incoming.task = self.loop.create_task(sender, context=self._context.copy())
        else:
            assert self.tg is not None
            self.tg.start_soon(lambda: sender)

    async def _send_held(
        self,
        call_id: int,
        incoming: Incoming,
        body: bytes,
        error: CallError | None,
        cancelled: bool,
    ) -> None:
        replaced = None
        try:
            replaced = await self.send_reply(call_id, body)
        finally:
            self.release_held(call_id, incoming, replaced or error, cancelled)

    def release_held(
        self, call_id: int, incoming: Incoming, error: CallError | None, cancelled: bool
    ) -> None:
        """Free a held call's slot (its reply handed over, or none can be sent)."""
        if self.incoming.get(call_id) is not incoming:
            return
        del self.incoming[call_id]
        incoming.on_cancel = None
        self._note_settled()
        self.observer.server_ended(None, error, cancelled)

    def on_credit(self, envelope: Credit) -> None:
        call_id, items, nbytes = envelope.id, envelope.items, envelope.bytes
        incoming = self.incoming.get(call_id)
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

    async def run(
        self,
        policy: ReplyPolicy,
        call_id: int,
        incoming: Incoming | None,
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
        if (policy is not UNARY and policy is not STREAM) or self.loop is None:
            # (an asyncio call handler's task inherits them: attach)
            self._enter_session()
        # A handler's own task and context (a keyed execution's task is the worker's: reset).
        token = _current_metadata.set(metadata) if metadata else None
        observer = self.observer if policy is not UNARY or service != INTERNAL_SERVICE else None
        observed = (
            observer.server_started(service, spec, metadata, "notify" if policy is NOTIFY else None)
            if observer is not None and observer.hooks
            else None
        )
        error: CallError | None = None
        extra: Mapping[str, Any] = _NO_EXTRA
        cancelled = False
        reply = False  # whether ``error`` is still to be sent (UNARY and STREAM)
        body = b""
        refusal = observed.refusal if observed is not None else None
        try:
            if refusal is not None:
                # A server-side hook refused the call: the handler does not run.
                error, reply = refusal, policy is UNARY or policy is STREAM
            elif policy is NOTIFY:
                result = target(*pos, **kw)
                if hasattr(result, "__await__"):
                    await result
            elif policy is KEYED:
                body, error, extra = self._recordable(await target(*pos, **kw), spec)
            else:
                assert incoming is not None  # a call's handler holds its slot
                if incoming.cancelled:
                    error = NotDispatched("CANCELLED", "cancelled before dispatch")
                    extra, cancelled, reply = {"cancel": NOT_STARTED}, True, True
                elif self.late_scopes and policy is UNARY:
                    # asyncio: the handler's first step runs without a cancel scope: nothing
                    # can cancel it before it suspends (a cancel or the session's retirement is
                    # read by another task, or the socket's callback, neither of which runs
                    # meanwhile). Only a handler that suspends -- until its reply is handed
                    # over -- gets its scope, there, as the outermost of its task's scopes:
                    # from then on it is cancelled as if that scope had been entered first.
                    unary = self._unary(call_id, target, pos, kw, spec)
                    try:
                        waiting = unary.send(None)
                    except StopIteration as stop:
                        error, extra, reply = stop.value
                    else:
                        scope = self._enter_scope(incoming)
                        with OutermostScope(scope):
                            error, extra, reply = await _resume(unary, waiting)
                        if scope.cancelled_caught:
                            error, extra, cancelled, reply = *_interrupted(), True, True
                else:
                    scope = self._enter_scope(incoming)
                    with scope:
                        if policy is STREAM:
                            await self._produce(call_id, incoming, target(*pos, **kw), spec)
                        else:
                            error, extra, reply = await self._unary(call_id, target, pos, kw, spec)
                    if scope.cancelled_caught:
                        error, extra, cancelled, reply = *_interrupted(), True, True
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
                        self.notifications -= 1
                    else:
                        self.incoming.pop(call_id, None)
                    self._note_settled()
                    if observer is not None:
                        observer.server_ended(observed, error, cancelled)
        if policy is not KEYED:
            return None
        # A keyed execution's outcome is the reply to record.
        self.observer.server_ended(observed, error, False)
        if error is not None:
            message = error.message
            if len(message) > MAX_ERROR_MESSAGE:
                message = message[:MAX_ERROR_MESSAGE] + "... (cut)"
            return ERROR, cbor2.dumps(error_body(error.outcome, error.code, message, **extra))
        return RESULT, body

    def _enter_scope(self, incoming: Incoming) -> anyio.CancelScope:
        """The call's cancel scope, about to be entered: cancelled already if the call was
        meanwhile (a handler's first step can retire its own session)."""
        scope = incoming.scope = self.new_scope()
        if incoming.cancelled:
            scope.cancel()
        return scope

    async def _unary(
        self,
        call_id: int,
        target: Callable[..., Any],
        pos: list[Any],
        kw: dict[str, Any],
        spec: MethodSpec,
    ) -> tuple[CallError | None, Mapping[str, Any], bool]:
        """A unary call's handler, then its result handed over: the error that replaced the
        result, its extra fields, and whether that error is still to be sent."""
        result = await target(*pos, **kw)
        try:
            reply_body = encode_result(
                call_id,
                to_wire(result, with_defaults=spec.result_with_defaults),
                splice=SPLICE_BYTES,
            )
        except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
            return RemoteError("UNENCODABLE_RESULT", str(exc)), TYPE_ERROR, True
        # The result, or the error that replaced it, is sent: at once when the session admits
        # it (no coroutine), else by send_reply (which also handles what send_nowait raised).
        try:
            if self._chunks.send_nowait(reply_body) is not None:
                return None, _NO_EXTRA, False
        except (PayloadTooLarge, SessionFailed):
            pass
        return await self.send_reply(call_id, reply_body), _NO_EXTRA, False

    def _recordable(
        self, result: Any, spec: MethodSpec
    ) -> tuple[bytes, CallError | None, dict[str, Any]]:
        """A keyed handler's result as the body to record, or the error that replaces it."""
        try:
            body = cbor2.dumps(to_wire(result, with_defaults=spec.result_with_defaults))
        except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
            return b"", RemoteError("UNENCODABLE_RESULT", str(exc)), TYPE_ERROR
        if len(body) + 16 > self._max_body:
            error = RemoteError(
                "RESULT_TOO_LARGE", f"the result ({len(body)} bytes) exceeds the frame limit"
            )
            return b"", error, {"remote_type": "PayloadTooLarge"}
        return body, None, {}

    async def send_reply(self, call_id: int, body: bytes | Spliced) -> CallError | None:
        """Hand a result over; if it is too large, send the error that replaces it (and return
        it: what the caller is told)."""
        try:
            if self._chunks.send_nowait(body) is None:  # (no coroutine when it need not wait)
                await self._chunks.send(body)
        except PayloadTooLarge as exc:
            error = RemoteError("RESULT_TOO_LARGE", str(exc), remote_type="PayloadTooLarge")
            await self._send_error(call_id, error)
            return error
        except SessionFailed:
            pass
        return None

    async def _produce(
        self, call_id: int, incoming: Incoming, iterator: Any, spec: MethodSpec
    ) -> None:
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
                    body = encode_item(
                        call_id,
                        to_wire(item, with_defaults=spec.result_with_defaults),
                        splice=SPLICE_BYTES,
                    )
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


if sys.version_info >= (3, 12):

    def _start_handler(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, None],
        context: contextvars.Context,
    ) -> asyncio.Task[None]:
        """Start a handler task on asyncio; eagerly on Python 3.12+.

        An eager task runs its first step at once, when the message that carried its call has
        been dispatched (:meth:`Handlers.start_handlers`, in the socket reader's turn; a
        ``cancel`` in the same message still finds it not started), instead of one event-loop
        turn later. A handler that never suspends runs to its end there, and its reply is
        handed to the session -- and, on a quiet socket, written -- before the reader reads on:
        one loop turn less per call. A handler that suspends goes on as an ordinary task. Either
        way it is a task of its own from its first line: ``current_task()`` is that task, its
        cancel scopes bind to it, it runs in ``context`` (its own copy), and the reader's
        context and task state are untouched (asyncio swaps the current task around the eager
        step). Replies of handlers that do not suspend are handed over in call order, as those of
        tasks started in order and run in order would be.

        A loop with a task factory of its own keeps it (``loop.create_task``; not eager unless that
        factory is): what it does per task is the application's choice. Trio never starts a task
        eagerly (handlers there are task-group children).
        """
        if loop.get_task_factory() is None:
            return asyncio.Task(coro, loop=loop, context=context, eager_start=True)
        return loop.create_task(coro, context=context)

else:
    from asyncio.tasks import _current_tasks  # type: ignore[attr-defined]

    def _start_handler(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, None],
        context: contextvars.Context,
    ) -> asyncio.Task[None]:
        """Start a handler task on asyncio, its first step at once (Python 3.11).

        Python 3.11 has no eager tasks; this does what 3.12's ``eager_start`` does, on asyncio's
        own event loop (``BaseEventLoop``, whose ready queue is the deque ``_ready``): the new
        task's first step, which ``Task()`` has just appended to that queue, is taken back out
        and run here, with the task as asyncio's current task (the task running now, if any,
        is set aside meanwhile and put back after). So the task is the same from its first line
        to its last, its cancel scopes bind to it, it runs in ``context``; a handler that never
        suspends ends here, one loop turn earlier, and one that suspends goes on as an ordinary
        task. On any other loop (uvloop) or a loop with a task factory of its own, an ordinary
        task.
        """
        ready = getattr(loop, "_ready", None)
        if type(ready) is not deque or loop.get_task_factory() is not None:
            return loop.create_task(coro, context=context)
        queued = len(ready)
        task = asyncio.Task(coro, loop=loop, context=context)
        if len(ready) != queued + 1:  # (not the one step a new task schedules)
            return task
        step: asyncio.Handle = ready.pop()
        current = _current_tasks.get(loop)  # asyncio.current_task(loop), one call less
        if current is not None:
            _leave_task(loop, current)
        try:
            step._run()
        finally:
            if current is not None:
                _enter_task(loop, current)
        return task


def _interrupted() -> tuple[CallError, Mapping[str, Any]]:
    """A call interrupted by its scope (the caller's cancel; by retirement nothing can be sent):
    a receipt tells the caller it ran, perhaps partly."""
    error = OutcomeUnknown("CANCELLED", "cancelled while running; it may have had effects")
    return error, {"cancel": INTERRUPTED}


@types.coroutine
def _resume(coro: Coroutine[Any, Any, _T], waiting: Any) -> Generator[Any, Any, _T]:
    """Await ``coro`` from where its last step stopped (``waiting``: what that step yielded to
    the event loop), as ``await coro`` would have gone on."""
    while True:
        try:
            sent = yield waiting
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # (a cancellation, thrown into the task)
            try:
                waiting = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            continue
        if sent is None:  # (what asyncio sends: the rest is plain delegation)
            return (yield from coro)  # type: ignore[no-any-return]
        try:
            waiting = coro.send(sent)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
