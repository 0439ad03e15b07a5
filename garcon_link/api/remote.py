"""Stable remote facades (controller) and the worker runtime (docs/design.md#facades).

Theory of operation
-------------------
Both :class:`RemoteExecutor` (controller) and :class:`Worker` (what :func:`serve` runs) are an
*endpoint*: one :class:`~garcon_link.link.WebSocketLink` plus, for each logical session it carries,
one :class:`~garcon_link.rpc.ExecutorRpc`. Which side dials is configuration, not role.

Controller availability::

    offline --(fresh session: fence passed + describe matched)--> ready
    ready <--(socket lost / replay done)--> reconnecting
    ready | reconnecting --(continuity lost: session retired)--> offline   (exactly one transition)
    any --aclose()--> disposed                                            (final)

A fresh session is *installed* (made current, availability ``ready``) only after its replay fence
and a ``describe`` call whose contract hash matches the first one seen. A changed contract is
refused: the executor stays ``offline`` and calls raise ``NotDispatched("CONTRACT_CHANGED")``,
whose message lists the methods that changed, with their old and new signatures (return types
included; :func:`~garcon_link.interface.manifest_changes`).
A session that is not installed -- contract changed, or ``describe`` failed or timed out (it is
bounded by ``call_timeout``) -- is retired at once (close 4005, logged with its cause), never
left connected: the dialing side dials again per its backoff, and each new session is checked
afresh; until one is installed the cause is in :attr:`RemoteExecutor.last_error` and in every
call's ``NotDispatched``.

Facades (:meth:`RemoteExecutor.service`) hold no session: each call resolves the current one at
call time. While ``reconnecting`` a call waits up to its ``dispatch_deadline`` for ``ready``; while
``offline`` (or past the deadline) it raises ``NotDispatched`` at once. There is no hidden offline
queue. Resource references carry the worker's ``instance_id``; after replacement they raise
``StaleResource`` before anything is sent. A facade created without an interface is *dynamic*:
its methods are looked up in the manifest of the installed contract (which cannot change for the
executor's life), arguments are validated by the worker only.

Registration is checked up front: :class:`Service` checks its target against the interface when
constructed, and a worker checks each plain object it serves (as its own interface) when built,
raising one ``ConfigError`` that lists every problem (see :mod:`garcon_link.interface`).

Graceful drain: ``await executor.aclose(drain=seconds)`` first refuses every new
call through the facades at once with ``NotDispatched("DRAINING")`` (nothing is sent), waits --
at most ``seconds`` -- until the calls already made have their replies and the worker's callbacks
into this controller have finished (``ExecutorRpc.wait_idle``) and until the worker acknowledged
everything this side sent (``SessionTransport.wait_acknowledged``), then disposes as usual (close
1001). A worker drains the same way (``Worker(..., drain=)``, ``Worker.aclose(drain=)``, ``serve
(..., drain=)``, and ``garcon-link worker`` on SIGTERM): its session refuses the controller's new
calls, unexecuted, with ``NotDispatched("DRAINING")`` (``ExecutorRpc.start_drain``; so does a
session that begins during the drain) while running handlers finish and their replies are
acknowledged. What is still running when the drain time is up ends as any close ends it: the
caller's call fails ``OutcomeUnknown`` (never a result that did not happen). ``serve`` runs until
cancelled, so it runs its worker in a shielded task of its own and drains it when cancelled.

Worker scopes: ``services`` is either a mapping of name -> object, or a factory called once per
logical session with its :class:`~garcon_link.resources.ServiceScope` that returns an async
context manager yielding that mapping. A retired session's scope is closed in the background,
bounded by ``scope_cleanup_timeout``, never blocking the new session. Beside them, one
:class:`~garcon_link.resources.WorkerScope` lives as long as the :class:`Worker` (its id is the
link's ``runtime_id``): a ``Service(..., scope="worker")`` runs its handlers there, ``describe``
reports it as ``worker_instance_id``, and the controller accepts references of either scope
(docs/design.md#durable-work). The worker scope is closed after the link, when the worker stops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import types
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast, overload

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..core.session import RetentionPool
from ..endpoint.link import ExecutorLink, LinkStatistics, WebSocketLink
from ..endpoint.transport import SessionTransport, TransportState, TransportStatistics
from ..errors import (
    AuthenticationError,
    CallError,
    ConfigError,
    FailureReason,
    HandshakeError,
    NotDispatched,
    Outcome,
    Rejected,
)
from ..limits import Limits
from ..logs import log_fields, peer_message, peer_text
from ..net.backend import loop_scheduler
from ..rpc.hooks import CallHook
from ..rpc.idempotency import IdempotencyStatistics, KeyedExecutions, normalize_key
from ..rpc.interface import (
    MethodKind,
    MethodSpec,
    ServiceSpec,
    contract_hash,
    derive_spec,
    manifest_changes,
    manifest_method,
    registration_problems,
    service_spec,
)
from ..rpc.resources import ServiceScope, WorkerScope
from ..rpc.rpc import (
    CallObserver,
    CallStatistics,
    ExecutorRpc,
    Observed,
    Registry,
    RemoteStream,
    RpcStatistics,
    end_of,
)
from ..settings.config import LinkConfig
from .keyed import call_with_key

__all__ = [
    "Availability",
    "ExecutorInfo",
    "ExecutorStatistics",
    "RemoteExecutor",
    "Service",
    "Worker",
    "connect",
    "serve",
]

log = logging.getLogger("garcon_link.remote")  # the name users configure (README)

_CAUSE_CHARS = 1000
"""The longest cause of a refused session (a contract change lists the changed methods)."""

T = TypeVar("T")
Availability = Literal["offline", "ready", "reconnecting", "disposed"]
ServiceMap = Mapping[str, Any]  # name -> object, or Service
ServiceFactory = Callable[[ServiceScope], contextlib.AbstractAsyncContextManager[ServiceMap]]
EventSink = Callable[[str], None]

_UNSET: Any = object()


@dataclass(frozen=True, slots=True)
class Service(Generic[T]):
    """An object exposed under an explicit interface (only the interface's methods are callable).

    Checked when constructed: every method of ``interface`` must be implemented by ``target``
    with the right kind (``async def`` for a unary call, an async generator function for a
    stream), accept the interface's parameters, annotate none of them (or a unary result) with a
    class that contradicts the interface's, and use only hints msgspec can convert (see
    :func:`garcon_link.interface.registration_problems`).

    ``scope`` is the lifetime of the resources it hands out: ``"session"`` (the
    default) -- its handlers run in the logical session's scope and the references they mint die
    with the session; ``"worker"`` -- its handlers run in the worker's scope
    (:class:`~garcon_link.resources.WorkerScope`): references carry the worker's runtime id,
    survive session replacement and controller restarts, and are stale only after the worker
    restarts. A worker-scoped object must outlive sessions: serve it in a mapping, or hand the
    same object to every session from a factory (``await scope.worker.shared(key, make)``).

    For mypy to check the target against the interface too, name the interface as the type
    argument: ``gl.Service[Calculator](impl, Calculator)`` (or annotate the variable,
    ``svc: gl.Service[Calculator] = ...``). ``gl.Service(impl, Calculator)`` alone cannot be
    checked statically: mypy infers ``T`` from ``impl``, and a ``Protocol`` cannot be
    accepted as ``type[T]`` (``type-abstract``), so ``interface`` is typed as any class.

    Raises:
        ConfigError: the message lists every problem and its fix.
        TypeError: ``interface`` is not a class, or its hints cannot be resolved.
    """

    target: T
    interface: Callable[..., object]
    scope: Literal["session", "worker"] = "session"

    def __post_init__(self) -> None:
        if self.scope not in ("session", "worker"):
            raise ConfigError(f"Service scope must be 'session' or 'worker', got {self.scope!r}")
        interface = _interface_class(self.interface)
        _check_registration(self.target, interface, f"Service(..., {_name(interface)})")


def _name(interface: object) -> str:
    return getattr(interface, "__qualname__", repr(interface))


def _check_registration(target: object, interface: type, what: str) -> ServiceSpec:
    """The spec of ``interface`` once ``target`` is known to fit it (else ``ConfigError``)."""
    spec, problems = derive_spec(interface)
    if not problems:
        spec = service_spec(interface)  # cached
        problems = registration_problems(target, spec)
    if problems:
        raise ConfigError(
            f"{what}: {type(target).__qualname__} cannot be served as written:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return spec


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """What the worker described for the current session."""

    executor_id: str
    instance_id: bytes
    session_id: bytes
    services: Mapping[str, Any]
    contract: str
    worker_instance_id: bytes | None = None
    """The worker's runtime id, which worker-scoped references carry (``None``: an older
    worker that does not say)."""


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """A snapshot of one endpoint (:meth:`RemoteExecutor.statistics`, :meth:`Worker.statistics`):
    its calls, its sessions, its link. README "Operating it" lists what each field means.

    Counters (``calls``, ``*_peak``, ``sessions``, ``replays``, ``replayed_frames``) cover the
    endpoint's lifetime, across session replacements; ``pending_calls``, ``incoming_calls``,
    ``retained_*`` (without ``_peak``) are the current session's, 0 without one. The link's
    figures (``resumes``, ``fresh_sessions``, ``handshakes_failed``, ``bytes_*``) are its link's:
    for a fleet member, the fleet's link it shares with the other members.

    Attributes:
        executor_id: the executor this endpoint is (worker) or talks to (controller).
        calls: calls ended, by side, outcome label and code (:class:`~garcon_link.rpc.
            CallStatistics`): counted where each call's outcome is decided.
        pending_calls: our calls awaiting a reply on the current session.
        pending_calls_peak: the most ever pending at once on one session.
        incoming_calls: the peer's calls whose handlers run now.
        incoming_calls_peak: the most ever running at once on one session.
        retained_frames: our frames awaiting the peer's receipt (current session).
        retained_frames_peak: the most ever retained at once by one session.
        retained_bytes: bytes of those frames.
        retained_bytes_peak: the most bytes ever retained at once by one session.
        sessions: logical sessions this endpoint ran (ended ones and the current one).
        resumes: sockets that resumed a session (the link's count).
        fresh_sessions: sessions the link began afresh.
        replays: attachments that re-sent frames a lost socket may not have delivered.
        replayed_frames: frames re-sent by those replays.
        handshakes_failed: failed handshakes by reason (``AUTH_FAILED``, ...).
        bytes_sent: bytes written to the link's sockets.
        bytes_received: bytes read from them.
        link: the link's full :class:`~garcon_link.link.LinkStatistics`.
        transport: the current session's transport snapshot, if any.
        rpc: the current session's :class:`~garcon_link.rpc.RpcStatistics`, if any.
    """

    executor_id: str
    calls: CallStatistics
    pending_calls: int
    pending_calls_peak: int
    incoming_calls: int
    incoming_calls_peak: int
    retained_frames: int
    retained_frames_peak: int
    retained_bytes: int
    retained_bytes_peak: int
    sessions: int
    resumes: int
    fresh_sessions: int
    replays: int
    replayed_frames: int
    handshakes_failed: Mapping[str, int]
    bytes_sent: int
    bytes_received: int
    link: LinkStatistics
    transport: TransportStatistics | None
    rpc: RpcStatistics | None


class _SessionTotals:
    """What ended sessions counted, kept by the endpoint (a session's own counters go with it)."""

    __slots__ = ("bytes_peak", "frames_peak", "replayed_frames", "replays", "sessions")

    def __init__(self) -> None:
        self.sessions = self.replays = self.replayed_frames = 0
        self.frames_peak = self.bytes_peak = 0

    def ended(self, transport: SessionTransport) -> None:
        session = transport.statistics().session
        self.replays += session.replays
        self.replayed_frames += session.replayed_frames
        self.frames_peak = max(self.frames_peak, session.retained_frames_peak)
        self.bytes_peak = max(self.bytes_peak, session.retained_bytes_peak)

    def snapshot(
        self,
        executor_id: str,
        observer: CallObserver,
        link: LinkStatistics,
        rpc: ExecutorRpc | None,
    ) -> ExecutorStatistics:
        transport = rpc.transport.statistics() if rpc is not None else None
        calls = rpc.statistics() if rpc is not None else None
        session = transport.session if transport is not None else None
        return ExecutorStatistics(
            executor_id=executor_id,
            calls=observer.statistics(),
            pending_calls=calls.pending_calls if calls is not None else 0,
            pending_calls_peak=observer.pending_peak,
            incoming_calls=calls.incoming_calls if calls is not None else 0,
            incoming_calls_peak=observer.incoming_peak,
            retained_frames=session.retained_frames if session is not None else 0,
            retained_frames_peak=max(
                self.frames_peak, session.retained_frames_peak if session is not None else 0
            ),
            retained_bytes=session.retained_bytes if session is not None else 0,
            retained_bytes_peak=max(
                self.bytes_peak, session.retained_bytes_peak if session is not None else 0
            ),
            sessions=self.sessions,
            resumes=link.resumed,
            fresh_sessions=link.fresh_sessions,
            replays=self.replays + (session.replays if session is not None else 0),
            replayed_frames=self.replayed_frames
            + (session.replayed_frames if session is not None else 0),
            handshakes_failed=types.MappingProxyType(dict(link.handshakes_failed)),
            bytes_sent=link.bytes_sent,
            bytes_received=link.bytes_received,
            link=link,
            transport=transport,
            rpc=calls,
        )


def _registry_from(services: ServiceMap, worker: WorkerScope | None = None) -> Registry:
    registry = Registry()
    for name, value in services.items():
        if isinstance(value, Service):
            scope = worker.scope if worker is not None and value.scope == "worker" else None
            spec = service_spec(_interface_class(value.interface))
            registry.add(name, value.target, spec, scope=scope)
        else:
            registry.add(name, value, _check_registration(value, type(value), f"service {name!r}"))
    return registry


def _fresh(error: HandshakeError) -> HandshakeError:
    """A new exception equal to a stored one (raising a stored object again would chain every
    raise's traceback onto it)."""
    if isinstance(error, AuthenticationError):
        return AuthenticationError(error.detail)
    return HandshakeError(error.reason, error.detail)


def _link_from_config(
    config: LinkConfig, limits: Limits, retention: RetentionPool | None = None
) -> WebSocketLink:
    return WebSocketLink(
        retention=retention,
        role=config.role,
        executor_id=config.executor_id,
        secret=config.secret.reveal(),
        limits=limits,
        listen=config.listen,
        dial=config.dial_target if config.dial is not None else None,
        ssl_context=config.ssl_context(),
        allow_insecure_development=config.allow_insecure_development,
    )


async def _wait_state(transport: SessionTransport, *states: TransportState) -> TransportState:
    if transport.state in states:
        return transport.state
    event = anyio.Event()
    unsubscribe = transport.add_listener(lambda s: event.set() if s in states else None)
    try:
        await event.wait()
    finally:
        unsubscribe()
    return transport.state


class _Endpoint:
    """Shared machinery: a link, and an ExecutorRpc per logical session.

    An endpoint built from a config owns its link (it enters and closes it); a fleet member
    (:meth:`RemoteExecutor._fleet_member`) shares its fleet's link and task group.
    """

    def __init__(self, config: LinkConfig, *, limits: Limits | None = None) -> None:
        self.limits = limits or config.limits
        self._own_link: WebSocketLink | None = _link_from_config(config, self.limits)
        self.link: WebSocketLink | ExecutorLink = self._own_link
        self._own_link.on_session(self._on_session)
        self._tg: anyio.abc.TaskGroup | None = None

    # The task group and the link are entered and exited by hand, not through an
    # ``AsyncExitStack``: when the host task is cancelled, the stack re-raises the same
    # ``CancelledError`` from two exits and its context fix-up makes the exception its own
    # ``__context__``; anyio's asyncio backend then loops forever walking that chain.

    async def _start(self) -> None:
        assert self._own_link is not None
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            await self._own_link.__aenter__()
        except BaseException:
            # Exit the task group as if nothing happened, so the caller gets the link's own
            # exception (e.g. LinkError "cannot listen"), not an ExceptionGroup around it.
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise

    async def _stop(self) -> None:
        link = self._own_link
        if link is None:
            return  # a fleet member: the fleet closes the link
        tg = self._tg
        try:
            with anyio.CancelScope(shield=True):
                await link.aclose()
            await link.__aexit__(None, None, None)
        except BaseException as exc:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        raise NotImplementedError

    _draining = False

    @property
    def draining(self) -> bool:
        """Whether a graceful stop is under way (``aclose(drain=...)``, a worker's SIGTERM): new
        calls fail with ``NotDispatched("DRAINING")``, calls in flight finish."""
        return self._draining


class RemoteExecutor(_Endpoint):
    """The controller's handle on one worker; use ``async with connect(config) as executor``.

    Args:
        config: the controller's configuration (dial or listen).
        services: controller-side services the worker may call back (optional).
        limits: overrides ``config.limits``.
        hooks: per-call hooks (:mod:`garcon_link.hooks`) told about every call made through
            this executor's facades and every call back from the worker it serves.
    """

    def __init__(
        self,
        config: LinkConfig,
        *,
        services: ServiceMap | None = None,
        limits: Limits | None = None,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        super().__init__(config, limits=limits)
        self._init_member(config.executor_id, _registry_from(services or {}), hooks)
        assert self._own_link is not None
        self._own_link.on_refusal(lambda _error: self._wake())

    @classmethod
    def _fleet_member(
        cls,
        executor_id: str,
        link: ExecutorLink,
        registry: Registry,
        limits: Limits,
        tg: anyio.abc.TaskGroup,
        on_change: Callable[[RemoteExecutor, Availability], None],
        hooks: Sequence[CallHook] = (),
    ) -> RemoteExecutor:
        """An executor of a fleet: sessions are routed to it by the fleet, which owns the link
        and the task group; :meth:`aclose` only marks it disposed."""
        self = cls.__new__(cls)
        self.limits = limits
        self._own_link = None
        self.link = link
        self._tg = tg
        self._init_member(executor_id, registry, hooks)
        self._callbacks.append(lambda value: on_change(self, value))
        link.on_refusal(lambda _error: self._wake())
        return self

    def _init_member(self, executor_id: str, registry: Registry, hooks: Sequence[CallHook]) -> None:
        self.executor_id = executor_id
        # The outcome point of every call through this executor (counters and hooks), shared
        # by all its sessions (so the counters survive session replacement).
        self._observer = CallObserver(hooks, self.limits, executor_id)
        self._totals = _SessionTotals()
        self._registry = registry
        self._availability: Availability = "offline"
        self.since = time.time()
        """Wall-clock time of the last availability change (for tables and events)."""
        self.calls = 0
        """Calls and streams started through this executor's facades."""
        self.errors = 0
        """Of those, how many raised a :class:`~garcon_link.CallError`."""
        self._callbacks: list[Callable[[Availability], None]] = []
        self._rpc: ExecutorRpc | None = None
        self._info: ExecutorInfo | None = None
        self._contract: str | None = None
        self._services: Mapping[str, Any] = {}  # the manifest that set self._contract
        self._changed = anyio.Event()
        self.last_error: str | None = None
        self._contract_refused = False  # the latest fresh session was refused for its contract
        self._draining = False

    async def __aenter__(self) -> RemoteExecutor:
        await self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self, *, drain: float = 0.0) -> None:
        """Dispose: retire the session (pending calls fail honestly), stop the link. Idempotent.

        It exits the task group the executor entered: call it from the task that entered it,
        not inside a cancel scope opened since (the drain is bounded by ``drain`` itself).

        Args:
            drain: seconds to drain first (module docstring): new calls fail at once with
                ``NotDispatched("DRAINING")`` while the calls already made finish and their
                replies are acknowledged; whatever still runs when the time is up fails as a
                plain close fails it (``OutcomeUnknown``). 0 (the default): close at once.
        """
        if self._availability == "disposed":
            return
        try:
            if drain > 0 and not self._draining:
                await self._drain(drain)
        finally:
            if self._mark_disposed():  # not by another aclose() meanwhile
                await self._stop()

    def _mark_disposed(self) -> bool:
        """Make availability ``disposed``; False if it already was."""
        if self._availability == "disposed":
            return False
        self._set_availability("disposed")
        return True

    async def _drain(self, seconds: float) -> None:
        self._draining = True
        rpc = self._rpc
        log.info(
            "executor %s: draining for up to %.1fs",
            self.executor_id,
            seconds,
            extra=log_fields(executor=self.executor_id),
        )
        if rpc is None:
            return
        if not await rpc.drained(seconds):
            stats = rpc.statistics()
            log.warning(
                "executor %s: drain time (%.1fs) is up with %d call(s) pending and %d handler(s) "
                "running; closing",
                self.executor_id,
                seconds,
                stats.pending_calls,
                stats.incoming_calls,
                extra=log_fields(executor=self.executor_id),
            )

    # -- availability

    @property
    def availability(self) -> Availability:
        return self._availability

    def on_availability_changed(
        self, callback: Callable[[Availability], None]
    ) -> Callable[[], None]:
        """Call ``callback(new_availability)`` on each transition; returns an unsubscriber."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def _set_availability(self, value: Availability) -> None:
        if self._availability == value or self._availability == "disposed":
            return
        log.info(
            "executor %s: %s -> %s",
            self.executor_id,
            self._availability,
            value,
            extra=log_fields(executor=self.executor_id),
        )
        self._availability = value
        self.since = time.time()
        self._changed.set()
        self._changed = anyio.Event()
        for callback in list(self._callbacks):
            try:
                callback(value)
            except Exception:
                log.exception(
                    "availability callback failed", extra=log_fields(executor=self.executor_id)
                )

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the executor is ``ready``.

        Raises:
            TimeoutError: not ready within ``timeout`` (the message carries the last link error).
            NotDispatched: the executor was disposed.
            AuthenticationError: the other end refused our key (wrong secret, or an executor id
                it does not serve), at once rather than at the timeout; the message says what
                to fix. The link keeps redialing: a later ``wait_ready`` succeeds once fixed.
            HandshakeError: likewise for a protocol version or role mismatch.
        """
        with anyio.move_on_after(timeout):
            while self._availability != "ready":
                if self._availability == "disposed":
                    raise NotDispatched("DISPOSED", "the executor was closed")
                refusal = self._refusal()
                if refusal is not None:
                    # Fail fast: a redial will not heal this (the link keeps dialing anyway).
                    raise _fresh(refusal)
                await self._changed.wait()
            return
        why = self.last_error or self.link.last_error or "no session yet"
        raise TimeoutError(f"executor {self.executor_id!r} not ready within {timeout}s: {why}")

    def _refusal(self) -> HandshakeError | None:
        return self.link.refusal

    def _wake(self) -> None:
        """Wake every waiter on ``_changed`` (availability or a refusal)."""
        self._changed.set()
        self._changed = anyio.Event()

    async def _rpc_for_call(self, dispatch_deadline: float) -> ExecutorRpc:
        if self._availability == "reconnecting" and dispatch_deadline > 0 and not self._draining:
            with anyio.move_on_after(dispatch_deadline):
                while self._availability == "reconnecting":
                    await self._changed.wait()
        if self._draining and self._availability != "disposed":
            raise NotDispatched("DRAINING", "the executor is closing: new calls are refused")
        rpc = self._rpc
        state = self._availability
        if state == "ready" and rpc is not None:
            return rpc
        if state == "disposed":
            raise NotDispatched("DISPOSED", "the executor was closed")
        if state == "reconnecting":
            raise NotDispatched("RECONNECTING", "the executor is reconnecting")
        if self._contract_refused:
            raise NotDispatched("CONTRACT_CHANGED", self.last_error or "the contract changed")
        raise NotDispatched("OFFLINE", self.last_error or "the executor is offline")

    # -- sessions

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        rpc = ExecutorRpc(
            transport,
            self._registry,
            self.limits,
            describe=self._describe_self,
            peer="worker",
            observer=self._observer,
        )
        assert self._tg is not None
        self._tg.start_soon(self._session_task, transport, rpc)

    def _describe_self(self) -> dict[str, Any]:
        manifest = self._registry.manifest()
        return {"services": manifest, "contract": contract_hash(manifest)}

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of this executor's calls, sessions and link (:class:`ExecutorStatistics`)."""
        return self._totals.snapshot(
            self.executor_id, self._observer, self.link.statistics(), self._rpc
        )

    async def _session_task(self, transport: SessionTransport, rpc: ExecutorRpc) -> None:
        self._totals.sessions += 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(rpc.run)
            if (
                await _wait_state(transport, TransportState.READY, TransportState.RETIRED)
                is TransportState.READY
            ):
                await self._install(transport, rpc)
            await _wait_state(transport, TransportState.RETIRED)
            self._totals.ended(transport)  # (and self._rpc is no longer it: no double count)
            if self._rpc is rpc:
                self._rpc = None
                self._set_availability("offline")

    async def _install(self, transport: SessionTransport, rpc: ExecutorRpc) -> None:
        try:
            manifest = await rpc.describe_peer(timeout=self.limits.call_timeout)
            info = ExecutorInfo(
                executor_id=str(manifest["executor_id"]),
                instance_id=bytes(manifest["instance_id"]),
                session_id=transport.session_id,
                services=dict(manifest["services"]),
                contract=str(manifest["contract"]),
                worker_instance_id=_optional_bytes(manifest.get("worker_instance_id")),
            )
        except (CallError, KeyError, TypeError, ValueError) as exc:
            self._refuse_session(transport, f"describe failed: {peer_text(exc)}", contract=False)
            return
        if self._contract is not None and info.contract != self._contract:
            changes = manifest_changes(self._services, info.services)
            self._refuse_session(
                transport,
                "the worker's contract changed; refusing the replacement session"
                + (
                    " (changed: " + "; ".join(changes) + ")"
                    if changes
                    else f" ({self._contract[:12]} -> {info.contract[:12]})"
                ),
                contract=True,
            )
            return
        self._contract = info.contract
        self._services = info.services
        self._contract_refused = False
        rpc.peer_instance_id = info.instance_id
        rpc.peer_worker_instance_id = info.worker_instance_id
        self._info = info
        self._rpc = rpc
        self.last_error = None

        def follow(state: TransportState) -> None:
            if self._rpc is not rpc:
                return
            if state is TransportState.READY:
                self._set_availability("ready")
            elif state in (TransportState.DETACHED, TransportState.REPLAYING):
                self._set_availability("reconnecting")

        transport.add_listener(follow)
        if transport.state is TransportState.READY:
            self._set_availability("ready")
        else:
            follow(transport.state)

    def _refuse_session(self, transport: SessionTransport, why: str, *, contract: bool) -> None:
        """Retire a fresh session that will not be installed, and say why.

        Left connected, it would hold the link (a healthy socket is never redialed) while every
        call fails: retiring it closes the socket with 4005, so both sides drop it and the
        dialing side dials again per its backoff -- each new session is described afresh. The
        cause stays visible meanwhile in :attr:`last_error`, in ``wait_ready``'s timeout and in
        the ``NotDispatched`` of every call (``CONTRACT_CHANGED`` or ``OFFLINE``); availability
        stays ``offline``.
        """
        why = peer_message(why, _CAUSE_CHARS)  # names from the worker's manifest
        self.last_error = why
        self._contract_refused = contract
        log.error(
            "executor %s: session %s not installed: %s",
            self.executor_id,
            transport.session_id.hex()[:12],
            why,
            extra=log_fields(executor=self.executor_id, session=transport.session_id),
        )
        transport.retire(FailureReason.REFUSED, why)

    # -- calls

    async def info(self) -> ExecutorInfo:
        """The current session's description (executor id, instance id, services, contract)."""
        await self._rpc_for_call(0)
        assert self._info is not None
        return self._info

    @overload
    def service(self, name: str) -> Any: ...

    @overload
    def service(self, name: str, interface: Callable[..., T]) -> T: ...

    def service(self, name: str, interface: Callable[..., T] | None = None) -> T | Any:
        """A stable facade for service ``name``, typed as ``interface``.

        The facade survives every session replacement and resolves the current session at call
        time. Use :func:`with_options` (or ``facade.with_options``) for per-call options.

        ``interface`` must be a class, usually a ``typing.Protocol``. It is annotated as a
        callable returning ``T`` rather than ``type[T]`` because mypy refuses a Protocol (or any
        abstract class) where ``type[T]`` is expected (``type-abstract``); the callable form
        infers ``T`` as the interface itself.

        Without ``interface`` the facade is *dynamic* (typed ``Any``), for exploring a worker
        from a notebook or a script: its methods are those of the worker's manifest (``dir()``
        lists them once a session was installed), arguments are validated by the worker only,
        results against the return types the manifest declares. The typed form is the
        recommended one: mypy checks its calls.

        Raises:
            TypeError: ``interface`` is not a class.
            ConfigError: ``interface`` has a public plain ``def`` method (see
                :mod:`garcon_link.interface`).
        """
        if interface is None:
            return _DynamicFacade(self, name, _NO_METHODS, None, None)
        return cast("T", _Facade(self, name, service_spec(_interface_class(interface)), None, None))

    def _manifest(self) -> Mapping[str, Any]:
        """The services manifest of the installed contract (it cannot change afterwards).

        Raises:
            NotDispatched: no session was ever installed, so the manifest is not known yet.
        """
        if not self._services and self._contract is None:
            if self._availability == "disposed":
                raise NotDispatched("DISPOSED", "the executor was closed")
            raise NotDispatched(
                "OFFLINE",
                "the worker's manifest is not known yet: await executor.wait_ready() first",
            )
        return self._services

    @property
    def current_rpc(self) -> ExecutorRpc | None:
        return self._rpc


def _optional_bytes(value: object) -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes):
        raise TypeError("worker_instance_id is not bytes")
    return value


class _Facade:
    """Runtime object behind a typed facade: one bound coroutine/stream function per method."""

    def __init__(
        self,
        executor: RemoteExecutor,
        name: str,
        spec: ServiceSpec,
        timeout: float | None,
        dispatch_deadline: float | None,
        *,
        idempotency_key: bytes | None = None,
        retry_unknown: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._executor = executor
        self._metadata = metadata
        self._key = idempotency_key
        self._retry_unknown = retry_unknown
        self._name = name
        self._spec = spec
        self._timeout = executor.limits.call_timeout if timeout is None else timeout
        self._deadline = (
            executor.limits.dispatch_deadline if dispatch_deadline is None else dispatch_deadline
        )
        for method in spec.methods.values():
            setattr(self, method.name, self._bind(method))

    def __repr__(self) -> str:
        interface = self._spec.interface.__qualname__
        return f"<facade {self._name}: {interface} @ {self._executor.executor_id}>"

    def with_options(
        self,
        *,
        timeout: float | None = _UNSET,
        dispatch_deadline: float | None = _UNSET,
        idempotency_key: str | bytes | None = _UNSET,
        retry_unknown: bool = _UNSET,
        metadata: Mapping[str, str] | None = _UNSET,
    ) -> Any:
        key = self._key if idempotency_key is _UNSET else idempotency_key
        if key is not None:
            key = normalize_key(key)
        retry = self._retry_unknown if retry_unknown is _UNSET else retry_unknown
        if not isinstance(retry, bool):
            raise TypeError(f"retry_unknown must be a bool, got {type(retry).__name__}")
        if retry and key is None:
            raise ValueError(
                "retry_unknown=True needs an idempotency_key: without one a retry could run "
                "the call twice"
            )
        return type(self)(  # a dynamic facade stays dynamic
            self._executor,
            self._name,
            self._spec,
            self._timeout if timeout is _UNSET else timeout,
            self._deadline if dispatch_deadline is _UNSET else dispatch_deadline,
            idempotency_key=key,
            retry_unknown=retry,
            metadata=_frozen_metadata(self._metadata if metadata is _UNSET else metadata),
        )

    def _bind(self, method: MethodSpec) -> Callable[..., Any]:
        executor, name, facade = self._executor, self._name, self

        if method.kind is MethodKind.STREAM:

            def open_stream(*args: Any, **kwargs: Any) -> _FacadeStream:
                if facade._key is not None:
                    raise TypeError(
                        f"{name}.{method.name} is a stream: idempotency keys apply to unary "
                        "calls only"
                    )
                return _FacadeStream(
                    executor, name, method, args, kwargs, facade._deadline, facade._metadata
                )

            open_stream.__name__ = method.name
            return open_stream

        async def call(*args: Any, **kwargs: Any) -> Any:
            executor.calls += 1

            async def attempt(metadata: Mapping[str, str] | None) -> Any:
                if facade._key is not None:
                    return await call_with_key(
                        executor,
                        name,
                        method,
                        args,
                        kwargs,
                        key=facade._key,
                        timeout=facade._timeout,
                        dispatch_deadline=facade._deadline,
                        retry_unknown=facade._retry_unknown,
                        metadata=metadata,
                    )
                rpc = await executor._rpc_for_call(facade._deadline)
                return await rpc.call(
                    name, method, args, kwargs, timeout=facade._timeout, metadata=metadata
                )

            try:
                return await executor._observer.call(name, method, facade._metadata, attempt)
            except CallError:
                executor.errors += 1
                raise

        call.__name__ = method.name
        return call


class _DynamicFacade(_Facade):
    """A facade without an interface: each method is looked up in the worker's manifest."""

    def __repr__(self) -> str:
        return f"<dynamic facade {self._name} @ {self._executor.executor_id}>"

    def __getattr__(self, method: str) -> Callable[..., Any]:
        # Only called for names the instance does not have (never for _name, _executor...).
        if method.startswith("_"):
            raise AttributeError(method)
        try:
            spec = manifest_method(self._executor._manifest(), self._name, method)
        except Rejected as exc:
            raise AttributeError(exc.message) from None
        return self._bind(spec)

    def __dir__(self) -> list[str]:
        try:
            methods = self._executor._manifest().get(self._name)
        except NotDispatched:
            methods = None
        known = sorted(methods) if isinstance(methods, Mapping) else []
        return sorted({*super().__dir__(), *known})


class _NoInterface:
    """The interface of a dynamic facade: no methods of its own."""


_NO_METHODS = ServiceSpec(interface=_NoInterface, methods={})


class _StreamOutcome:
    """Ends one facade stream at its executor's outcome point exactly once (the facade and, if it
    is dropped unclosed, its finalizer share it)."""

    __slots__ = ("done", "observed", "observer")

    def __init__(self, observer: CallObserver, observed: Observed | None) -> None:
        self.observer = observer
        self.observed = observed
        self.done = False

    def end(self, outcome: Outcome | None, code: str | None, cancelled: bool) -> None:
        if not self.done:
            self.done = True
            self.observer.client_ended(self.observed, outcome, code, cancelled)

    def dropped(self) -> None:
        self.end(Outcome.UNKNOWN, "CANCELLED", True)


def _schedule_dropped(schedule: Callable[..., object], outcome: _StreamOutcome) -> None:
    # A finalizer (maybe inside the garbage collector): only schedule; never raise.
    try:
        schedule(outcome.dropped)
    except Exception:
        pass


class _FacadeStream(AsyncIterator[Any]):
    """Resolves the current session on first iteration, then delegates to a RemoteStream.

    It is the client side's outcome point of a stream: exhausted (ok), raised (its outcome),
    closed before its end or dropped unclosed (``cancelled``).
    """

    def __init__(
        self,
        executor: RemoteExecutor,
        name: str,
        method: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        deadline: float,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._executor = executor
        self._name = name
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._deadline = deadline
        self._metadata = metadata
        self._stream: RemoteStream | None = None
        self._outcome: _StreamOutcome | None = None
        self._finalizer: Any = None
        self._closed = False

    def __aiter__(self) -> _FacadeStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        executor = self._executor
        try:
            if self._stream is None:
                self._start()
                observer = executor._observer
                observed = self._outcome.observed if self._outcome is not None else None
                metadata = self._metadata
                if observed is not None:
                    metadata = cast("dict[str, str]", observed.info.metadata) or None
                if metadata:
                    observer.check_metadata(metadata)
                rpc = await executor._rpc_for_call(self._deadline)
                self._stream = rpc.stream(
                    self._name, self._method, self._args, self._kwargs, metadata
                )
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._end(None, None, False)
            raise
        except BaseException as exc:
            if isinstance(exc, CallError):
                executor.errors += 1
            self._end(*end_of(exc))
            raise

    def _start(self) -> None:
        if self._outcome is not None:
            return  # a first iteration that raised before the stream was opened
        self._executor.calls += 1
        observer = self._executor._observer
        observed = observer.stream_started(self._name, self._method, self._metadata)
        self._outcome = outcome = _StreamOutcome(observer, observed)
        self._finalizer = weakref.finalize(self, _schedule_dropped, loop_scheduler(), outcome)
        self._finalizer.atexit = False

    def _end(self, outcome: Outcome | None, code: str | None, cancelled: bool) -> None:
        if self._outcome is not None:
            self._outcome.end(outcome, code, cancelled)
        if self._finalizer is not None:
            self._finalizer.detach()

    async def aclose(self) -> None:
        """Stop the stream (idempotent); it is never started if it had not been yet."""
        self._closed = True
        self._end(Outcome.UNKNOWN, "CANCELLED", True)
        if self._stream is not None:
            await self._stream.aclose()


def _frozen_metadata(metadata: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """A read-only copy of a facade's metadata (validated when a call is made)."""
    if not metadata:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__}")
    return types.MappingProxyType(dict(metadata))


def connect(
    config: LinkConfig,
    *,
    services: ServiceMap | None = None,
    limits: Limits | None = None,
    hooks: Sequence[CallHook] = (),
) -> RemoteExecutor:
    """The controller side: ``async with connect(config) as executor: ...``.

    ``hooks`` (:mod:`garcon_link.hooks`) are told about every call the executor makes or serves.

    Raises:
        ConfigError: ``config`` is not a controller configuration.
    """
    if config.role.value != "controller":
        raise ConfigError(
            f"connect() needs a controller configuration, got role {config.role.value!r}"
        )
    return RemoteExecutor(config, services=services, limits=limits, hooks=hooks)


# ---------------------------------------------------------------------- worker


class Worker(_Endpoint):
    """The worker side: serves ``services`` to one controller at a time.

    Args:
        config: the worker's configuration (listen or dial).
        services: name -> object (or :class:`Service`), or a per-session scope factory.
        on_event: receives one ``key=value`` diagnostic line per event (``executor-listening``,
            ``executor-ready``); the CLI prints them.
        drain: seconds :meth:`aclose` (and so leaving ``async with``) drains before it closes
            (module docstring); 0, the default, closes at once. A block left because its
            enclosing scope was cancelled has had its tasks cancelled too: no drain then
            (:func:`serve` drains on cancellation).
        controller_services: not used by the worker itself; see :func:`garcon_link.peer`.
        hooks: per-call hooks (:mod:`garcon_link.hooks`), run around every handler this worker
            runs (and every call back it makes through :func:`peer`).
    """

    def __init__(
        self,
        config: LinkConfig,
        services: ServiceMap | ServiceFactory,
        *,
        limits: Limits | None = None,
        on_event: EventSink | None = None,
        drain: float = 0.0,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        if config.role.value != "worker":
            raise ConfigError(
                f"serve() needs a worker configuration, got role {config.role.value!r}"
            )
        super().__init__(config, limits=limits)
        self.config = config
        self._services = services
        self._on_event = on_event or (lambda line: None)
        if not callable(services):
            # Validate the exposure once, up front, so a bad interface fails at start-up.
            _registry_from(services)
        self.sessions = 0
        self._observer = CallObserver(hooks, self.limits, config.executor_id)
        self._totals = _SessionTotals()
        self._rpc: ExecutorRpc | None = None
        assert self._own_link is not None
        self.worker_scope = WorkerScope(config.executor_id, self._own_link.runtime_id)
        """Shared by every logical session of this worker (worker-scoped services);
        closed when the worker stops."""
        # Keyed calls, for the process lifetime: shared by every session, run in our task group.
        self._keyed = KeyedExecutions(self.limits, self._spawn_keyed)
        self.drain = drain
        self._draining = False
        self._closed = False

    def _spawn_keyed(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, *args)

    def idempotency_statistics(self) -> IdempotencyStatistics:
        """A snapshot of this worker's table of idempotency keys."""
        return self._keyed.statistics()

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of this worker's calls, sessions and link (:class:`ExecutorStatistics`)."""
        return self._totals.snapshot(
            self.config.executor_id, self._observer, self.link.statistics(), self._rpc
        )

    async def __aenter__(self) -> Worker:
        await self._start()
        if self.config.listen is not None:
            self._on_event(
                f"executor-listening url={self.link.url} executor={self.config.executor_id}"
            )
        else:
            self._on_event(
                f"executor-dialing url={self.link.url} executor={self.config.executor_id}"
            )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self, *, drain: float | None = None) -> None:
        """Stop serving and close the link (1001). Idempotent. Like
        :meth:`RemoteExecutor.aclose`, call it from the task that entered the worker, not inside
        a cancel scope opened since.

        Args:
            drain: seconds to drain first (module docstring; default: the ``drain`` given to
                the constructor). Shielded from cancellation, bounded by these seconds.
        """
        if self._closed:
            return
        seconds = self.drain if drain is None else drain
        try:
            if seconds > 0 and not self._draining:
                with anyio.CancelScope(shield=True):
                    await self._drain(seconds)
        finally:
            if not self._closed:
                self._closed = True
                try:
                    await self._stop()
                finally:
                    # After the sessions: worker-scoped objects (e.g. the process service)
                    # outlive them.
                    with anyio.CancelScope(shield=True):
                        await self.worker_scope.aclose()

    async def _drain(self, seconds: float) -> None:
        self._draining = True
        rpc = self._rpc
        if rpc is None:
            return
        rpc.start_drain()
        stats = rpc.statistics()
        log.info(
            "executor %s: draining %d running call(s) for up to %.1fs",
            self.config.executor_id,
            stats.incoming_calls,
            seconds,
            extra=log_fields(executor=self.config.executor_id),
        )
        if not await rpc.drained(seconds):
            stats = rpc.statistics()
            log.warning(
                "executor %s: drain time (%.1fs) is up with %d call(s) still running; closing "
                "(their callers see OutcomeUnknown)",
                self.config.executor_id,
                seconds,
                stats.incoming_calls,
                extra=log_fields(executor=self.config.executor_id),
            )

    @property
    def url(self) -> str:
        return self.link.url

    @property
    def taken_over(self) -> str | None:
        """Why this worker stopped for good: another process with its executor id took over
        its session, else None. :meth:`wait_stopped` returns once it is set."""
        return self._own_link.taken_over if self._own_link is not None else None

    async def wait_stopped(self) -> None:
        """Return once the worker gave up for good (see :attr:`taken_over`)."""
        assert self._own_link is not None
        await self._own_link.stopped.wait()

    @property
    def current_rpc(self) -> ExecutorRpc | None:
        """The RPC of the session being served (for its ``statistics()``), if any."""
        return self._rpc

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        scope = self.worker_scope.session_scope(os.urandom(16))
        assert self._tg is not None
        if not callable(self._services):
            registry = _registry_from(self._services, self.worker_scope)
            rpc = self._make_rpc(transport, registry, scope)
            self._tg.start_soon(self._run_session, transport, rpc, scope)
        else:
            # A scope factory is async: queue payloads until it is built (the transport buffers).
            self._tg.start_soon(self._build_scope_and_run, transport, scope)

    def _make_rpc(
        self, transport: SessionTransport, registry: Registry, scope: ServiceScope
    ) -> ExecutorRpc:
        manifest = registry.manifest()
        contract = contract_hash(manifest)

        def describe() -> dict[str, Any]:
            return {
                "executor_id": self.config.executor_id,
                "instance_id": scope.instance_id,
                "worker_instance_id": self.worker_scope.instance_id,
                "services": manifest,
                "contract": contract,
            }

        rpc = ExecutorRpc(
            transport,
            registry,
            self.limits,
            scope=scope,
            describe=describe,
            peer="controller",
            idempotency=self._keyed,
            observer=self._observer,
        )
        if self._draining:
            rpc.start_drain()  # a session that begins during the drain admits no call either
        return rpc

    async def _build_scope_and_run(self, transport: SessionTransport, scope: ServiceScope) -> None:
        factory = cast("ServiceFactory", self._services)
        stack = contextlib.AsyncExitStack()
        try:
            services = await stack.enter_async_context(factory(scope))
            registry = _registry_from(services, self.worker_scope)
        except Exception as exc:
            log.exception(
                "service scope factory failed; retiring the session",
                extra=log_fields(executor=self.config.executor_id, session=transport.session_id),
            )
            transport.retire(FailureReason.CLOSED, f"service scope failed: {exc}")
            transport.payloads().close()  # no ExecutorRpc will ever consume this session
            await stack.aclose()
            return
        rpc = self._make_rpc(transport, registry, scope)
        try:
            await self._run_session(transport, rpc, scope)
        finally:
            # Exit the scope in the task that entered it (factories may hold task groups or
            # cancel scopes across their yield); this task is per session, so the new session
            # is never blocked by it.
            await self._close_scope(stack, scope)

    async def _run_session(
        self,
        transport: SessionTransport,
        rpc: ExecutorRpc,
        scope: ServiceScope,
    ) -> None:
        self.sessions += 1
        self._totals.sessions += 1

        def announce(state: TransportState) -> None:
            if state is TransportState.READY and not announced:
                announced.append(True)
                self._on_event(
                    f"executor-ready executor={self.config.executor_id} "
                    f"session={transport.session_id.hex()} instance={scope.instance_id.hex()} "
                    "resumed=false"
                )

        announced: list[bool] = []
        unsubscribe = transport.add_listener(announce)
        announce(transport.state)
        self._rpc = rpc
        try:
            await rpc.run()
        finally:
            unsubscribe()
            self._totals.ended(transport)
            if self._rpc is rpc:
                self._rpc = None

    async def _close_scope(self, stack: contextlib.AsyncExitStack, scope: ServiceScope) -> None:
        with anyio.move_on_after(self.limits.scope_cleanup_timeout, shield=True) as cleanup:
            try:
                await stack.aclose()
            except Exception:
                log.exception(
                    "closing service scope %s failed",
                    scope.instance_id.hex()[:8],
                    extra=log_fields(executor=scope.executor_id),
                )
        if cleanup.cancelled_caught:
            log.warning(
                "service scope %s did not close within %.1fs",
                scope.instance_id.hex()[:8],
                self.limits.scope_cleanup_timeout,
                extra=log_fields(executor=scope.executor_id),
            )


async def serve(
    config: LinkConfig,
    services: ServiceMap | ServiceFactory,
    *,
    limits: Limits | None = None,
    on_event: EventSink | None = None,
    drain: float = 0.0,
    hooks: Sequence[CallHook] = (),
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a worker until cancelled. With ``await tg.start(serve, ...)`` returns the link URL.

    With ``drain`` > 0, cancellation drains first (up to ``drain`` seconds, shielded): new calls
    are refused with ``NotDispatched("DRAINING")`` while running ones finish (see
    :meth:`Worker.aclose`). (An ``async with Worker(..., drain=...)`` block drains when it is
    left normally; when its enclosing scope is cancelled, the worker's tasks are cancelled with
    it, so there is nothing left to drain: use ``serve`` for that.)
    """
    worker = Worker(config, services, limits=limits, on_event=on_event, drain=drain, hooks=hooks)
    if drain <= 0:
        async with worker:
            task_status.started(worker.url)
            await anyio.sleep_forever()
        return
    # The cancellation that stops serve() would cancel the worker's own tasks too (its task
    # group is entered here), and a drain needs them: the worker runs shielded in a task of its
    # own, told to drain and close when this one is cancelled.
    stop = anyio.Event()

    async def run(*, task_status: anyio.abc.TaskStatus[str]) -> None:
        with anyio.CancelScope(shield=True):
            async with worker:
                task_status.started(worker.url)
                await stop.wait()

    async with anyio.create_task_group() as tg:
        task_status.started(await tg.start(run))
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()


def peer(name: str, interface: Callable[..., T]) -> T:
    """Inside a handler: a facade on the *caller's* service ``name`` (bidirectional calls).

    The facade is bound to the session the handler runs in. ``interface`` is a class, as for
    :meth:`RemoteExecutor.service` (which explains the annotation).

    Raises:
        LookupError: called outside a handler.
        TypeError: ``interface`` is not a class.
    """
    from ..rpc.rpc import current_rpc

    rpc = current_rpc()
    return cast("T", _PeerFacade(rpc, name, service_spec(_interface_class(interface))))


def _interface_class(interface: object) -> type:
    if not isinstance(interface, type):
        raise TypeError(f"an interface must be a class, got {interface!r}")
    return interface


class _PeerFacade:
    def __init__(self, rpc: ExecutorRpc, name: str, spec: ServiceSpec) -> None:
        for method in spec.methods.values():
            setattr(self, method.name, self._bind(rpc, name, method))

    @staticmethod
    def _bind(rpc: ExecutorRpc, name: str, method: MethodSpec) -> Callable[..., Any]:
        if method.kind is MethodKind.STREAM:
            return lambda *a, **k: rpc.stream(name, method, a, k)

        async def call(*args: Any, **kwargs: Any) -> Any:
            async def attempt(metadata: Mapping[str, str] | None) -> Any:
                timeout = rpc.limits.call_timeout
                return await rpc.call(
                    name, method, args, kwargs, timeout=timeout, metadata=metadata
                )

            return await rpc.observer.call(name, method, None, attempt)

        return call
