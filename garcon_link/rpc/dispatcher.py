"""The serving side of one session: admitting or refusing the peer's calls and notifications.

Theory of operation (the rules are in the module docstring of :mod:`.rpc`): :class:`Dispatcher`
admits each incoming call or refuses it without running it -- a call id that does not increase
(dropped), draining, bad arguments, credit, key or metadata, the ``max_incoming_calls`` budget,
an unknown service or method, a keyed call the idempotency table refuses -- and hands each
admitted one to :class:`~.handlers.Handlers`, which runs it. A refusal has no task: it goes to
the session's :class:`~.outbox.Outbox` at once (:meth:`Dispatcher._refuse`, where refusals are
counted). An excess or unreadable notification, which has no reply, is dropped and logged.

The peer's goodbye (the internal notification ``draining``) is handled inline, without a task:
it sets :attr:`Dispatcher.peer_draining` for the rest of the session -- there is no message that
clears it -- and tells ``on_peer_draining`` the first time. A peer repeating it in a flood
changes nothing more and costs one comparison each: nothing is logged, queued or allocated.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

from ..endpoint.transport import SessionTransport
from ..errors import CallError, NotDispatched, Rejected
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_text
from .envelopes import CALL, Call, Notify, envelope_head, metadata_problem
from .errorbody import MAX_REFUSAL_MESSAGE, error_envelope
from .handlers import KEYED, NOTIFY, STREAM, UNARY, Handlers, Incoming
from .idempotency import (
    Await,
    Conflict,
    Execute,
    Full,
    KeyedExecutions,
    Replay,
    arguments_digest,
    key_problem,
)
from .interface import MethodKind, MethodSpec
from .observer import CallObserver
from .outbox import REFUSAL_KIND, Outbox
from .registry import (
    DESCRIBE_SPEC,
    DRAINING_METHOD,
    INTERNAL_SERVICE,
    INVENTORY_SPEC,
    Registry,
    in_scope,
)
from .resources import ResourceRef, ServiceScope
from .values import JSON_VALUES, VALUES_METADATA_KEY, ValueMode

__all__ = ["Dispatcher"]

_NO_METADATA: Mapping[str, str] = types.MappingProxyType({})


def _value_mode(metadata: Mapping[str, str]) -> ValueMode:
    """How the caller represents values: a JSON client says so in its metadata."""
    if metadata and metadata.get(VALUES_METADATA_KEY) == JSON_VALUES:
        return "json"
    return "wire"


class Dispatcher:
    """The peer's calls on one session: admission, budgets, refusals.

    Args:
        transport: the session.
        registry: local services the peer may call.
        limits: budgets and windows.
        observer: the endpoint's hooks and counters (refusals are counted here).
        handlers: what runs the admitted calls (and holds the budget's count).
        outbox: where refusals go without a task.
        dropped: counts and logs an envelope dropped as malformed (``kind``, why).
        peer_log: the session's limiter for what the peer makes us log.
        scope: the service scope handlers run in (worker side): references are checked in it.
        describe: returns this side's manifest for the internal ``describe`` call.
        idempotency: the worker's keyed calls; without it, keyed calls are refused.
    """

    def __init__(
        self,
        transport: SessionTransport,
        registry: Registry,
        limits: Limits,
        observer: CallObserver,
        handlers: Handlers,
        outbox: Outbox,
        dropped: Callable[[int | None, str], None],
        peer_log: PeerLogLimiter,
        *,
        scope: ServiceScope | None,
        describe: Callable[[], dict[str, Any]],
        idempotency: KeyedExecutions | None,
    ) -> None:
        self.transport = transport
        self.registry = registry
        self.limits = limits
        self.observer = observer
        self.scope = scope
        self.idempotency = idempotency
        self._describe = describe
        self._handlers = handlers
        # The handlers' own table and runner, read on every call without a lookup through them.
        self._incoming = handlers.incoming
        self._run = handlers.run
        self._outbox = outbox
        self._dropped_envelope = dropped
        self._peer_log = peer_log
        self._last_incoming_id = 0
        self._max_credit = limits.stream_window_items * 4  # a stream's credit is capped here
        # The call id of a call sent in parts, claimed at its first part (claim()), while the
        # reassembled call is dispatched: on_call does not take it for a reuse.
        self.whole_id: int | None = None
        self.draining = False
        self.peer_draining = False
        """The peer said goodbye on this session (it drains: its new calls are refused)."""
        self.on_peer_draining: Callable[[], None] | None = None
        """Told once, when :attr:`peer_draining` becomes true."""
        self.refusals = 0
        self.notifications_dropped = 0
        # Told each ``$link.inventory`` notification's arguments (a list), synchronously and in
        # session order; without one (a worker's side), such a notification is dropped.
        self.inventory_listener: Callable[[list[Any]], None] | None = None
        # Offered every call admitted so far (not draining, well formed, within the budget)
        # before it is resolved: ``True`` if it took the call (it answers it itself, e.g. from
        # a held slot: Handlers.hold), ``False`` to serve it as usual.
        self.direct: Callable[[Call, Mapping[str, str]], bool] | None = None

    @property
    def last_incoming_id(self) -> int:
        """The highest call id the peer has used (a call with an id not above it is dropped)."""
        return self._last_incoming_id

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

    def on_undecodable_call(self, call_id: int, why: str) -> None:
        """A ``call`` that did not decode (``why``: the decoder's reason, bounded): refused
        ``Rejected("INVALID_ARGUMENTS")`` at once if its id is new (it did not run; its caller
        need not wait for its timeout), else dropped."""
        if call_id > self._last_incoming_id or call_id == self.whole_id:
            self._last_incoming_id = max(call_id, self._last_incoming_id)
            self._refuse(
                call_id, Rejected("INVALID_ARGUMENTS", f"the call's arguments do not decode: {why}")
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
        if call_id > self._last_incoming_id:
            self._last_incoming_id = call_id
        elif call_id != self.whole_id:
            self._dropped_envelope(
                CALL,
                f"call id {peer_text(call_id)} does not increase "
                f"(last {peer_text(self._last_incoming_id)})",
            )
            return
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
            or (kwargs and not all(isinstance(k, str) for k in kwargs))
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
        if len(self._incoming) + self._handlers.notifications >= self.limits.max_incoming_calls:
            self._refuse(
                call_id,
                NotDispatched(
                    "OVERLOADED", f"{self.limits.max_incoming_calls} calls already running"
                ),
            )
            return
        direct = self.direct
        if direct is not None and direct(envelope, metadata):
            return
        try:
            spec, target = self._resolve(service, method)
            if spec.kind is MethodKind.STREAM and credit == 0:
                raise Rejected("INVALID_ARGUMENTS", "a stream call needs initial credit")
            pos, kw = spec.convert_arguments(
                args, kwargs, mode=_value_mode(metadata) if metadata else "wire"
            )
            if self.scope is not None:  # (no call per call without one)
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
        handlers = self._handlers
        incoming = Incoming(min(credit, self._max_credit), credit_bytes, None)
        self._incoming[call_id] = incoming
        if len(self._incoming) + handlers.notifications > self.observer.incoming_peak:
            handlers.note_incoming()
        policy = STREAM if spec.kind is MethodKind.STREAM else UNARY
        handler = self._run(policy, call_id, incoming, service, spec, target, pos, kw, metadata)
        if handlers.loop is not None:
            # asyncio: a plain task, tracked by the handlers; anyio's start_soon costs ~10 us
            # more per task, which is a tenth of a call. It runs in a copy of the session
            # task's context, as a task group's child would, and starts eagerly where the
            # runtime can (handlers._start_handler).
            # It leaves the incoming table itself when it ends (a done callback would cost an
            # event-loop turn per call).
            # Started at the end of the message (Handlers.start_handlers): a cancel in the
            # same message then finds it not yet started, eager start or not.
            handlers.to_start.append((incoming, handler))
        else:
            assert handlers.tg is not None
            handlers.tg.start_soon(lambda: handler)

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
        self._handlers.start_keyed(call_id, keyed, decision)

    def _check_scope(self, args: list[Any], kwargs: Mapping[str, Any]) -> None:
        scope = self.scope
        if scope is None:
            return
        for value in args:
            # The session's references or its worker's (worker-scoped services).
            if isinstance(value, ResourceRef) and not scope.admits(value):
                scope.check(value)  # raises StaleResource
        if kwargs:
            for value in kwargs.values():
                if isinstance(value, ResourceRef) and not scope.admits(value):
                    scope.check(value)

    def on_notify(self, envelope: Notify) -> None:
        service, method, args, kwargs = (
            envelope.service,
            envelope.method,
            envelope.args,
            envelope.kwargs,
        )
        if method == DRAINING_METHOD and service == INTERNAL_SERVICE:
            # Arguments are ignored (a later version may send some); see the module docstring.
            if not self.peer_draining:
                self.peer_draining = True
                if self.on_peer_draining is not None:
                    self.on_peer_draining()
            return
        if service == INTERNAL_SERVICE and method == INVENTORY_SPEC.name:
            listener = self.inventory_listener
            if listener is None or not isinstance(args, list) or kwargs:
                self._dropped_notification("unreadable", service, method, "not expected here")
                return
            listener(args)  # no handler task: it only replaces the manifest it holds
            return
        try:
            spec, target = self._resolve(service, method)
        except CallError as exc:
            self._dropped_notification("unreadable", service, method, peer_text(exc))
            return
        try:
            if spec.kind is MethodKind.STREAM:
                raise Rejected("OPERATION_UNSUPPORTED", f"stream {spec.name!r} cannot be notified")
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise ValueError("args must be a list and kwargs a map")
            metadata = self._received_metadata(envelope.metadata)
            if type(metadata) is str:
                raise Rejected("INVALID_METADATA", metadata)
            assert not isinstance(metadata, str)
            pos, kw = spec.convert_arguments(args, kwargs, mode=_value_mode(metadata))
        except (CallError, ValueError) as exc:
            # A one-way call of a method we serve, refused by its contract: nobody gets an
            # answer, so it is counted (the endpoint's oneway_refused, and in its calls as a
            # refused call is) and logged, at most once per log_interval.
            error = exc if isinstance(exc, CallError) else Rejected("INVALID_ARGUMENTS", str(exc))
            self.observer.refused_oneway(error)
            self._dropped_notification(
                "refused", service, method, peer_text(exc), "refusing one-way call"
            )
            return
        if self.draining:
            self._dropped_notification("draining", service, method, "draining")
            return
        if len(self._incoming) + self._handlers.notifications >= self.limits.max_incoming_calls:
            # One-way handlers count against the incoming budget too; with no reply to send,
            # an excess notification is dropped (and logged).
            self._dropped_notification(
                "overloaded",
                service,
                method,
                f"{self.limits.max_incoming_calls} handlers already running",
            )
            return
        handlers = self._handlers
        handlers.notifications += 1
        handlers.note_incoming()
        assert handlers.tg is not None
        handlers.tg.start_soon(self._run, NOTIFY, 0, None, service, spec, target, pos, kw, metadata)

    def _dropped_notification(
        self,
        reason: str,
        service: object,
        method: object,
        why: str,
        what: str = "dropping notification",
    ) -> None:
        """Count a dropped notification; log it, at most once per reason per ``log_interval``."""
        self.notifications_dropped += 1
        self._peer_log.log(
            self.transport.label,
            f"notification {reason}",
            "session %s: %s %s.%s: %s",
            self.transport.label,
            what,
            peer_text(service),
            peer_text(method),
            why,
            extra=log_fields(session=self.transport.session_id),
        )
