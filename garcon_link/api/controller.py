"""The controller's handle on one worker: :class:`RemoteExecutor` and :func:`connect`
(docs/design.md#facades).

Theory of operation
-------------------
Controller availability::

    offline --(fresh session: fence passed + describe matched)--> ready
    ready <--(socket lost / replay done)--> reconnecting
    ready | reconnecting --(continuity lost: session retired)--> offline   (exactly one transition)
    any --aclose()--> disposed                                            (final)

A fresh session is *installed* (made current, availability ``ready``) only after its replay fence
and a ``describe`` call whose contract hash matches the first one seen. A changed contract is
refused: the executor stays ``offline`` and calls raise ``NotDispatched("CONTRACT_CHANGED")``,
whose message lists the methods that changed, with their old and new signatures (return types
included; :func:`~garcon_link.rpc.interface.manifest_changes`).
A session that is not installed -- contract changed, or ``describe`` failed or timed out (it is
bounded by ``call_timeout``) -- is retired at once (close 4005, logged with its cause), never
left connected: the dialing side dials again per its backoff, and each new session is checked
afresh; until one is installed the cause is in :attr:`RemoteExecutor.last_error` and in every
call's ``NotDispatched``.

The facades of :meth:`RemoteExecutor.service` (:mod:`garcon_link.api.facades`) resolve the
current session at each call through :meth:`RemoteExecutor._rpc_for_call`. Resource references
carry the worker's ``instance_id``; after replacement they raise ``StaleResource`` before
anything is sent. The controller accepts references of either scope, session or worker
(docs/design.md#durable-work).

Graceful drain: ``await executor.aclose(drain=seconds)`` first refuses every new
call through the facades at once with ``NotDispatched("DRAINING")`` (nothing is sent), waits --
at most ``seconds`` -- until the calls already made have their replies and the worker's callbacks
into this controller have finished (``ExecutorRpc.wait_idle``) and until the worker acknowledged
everything this side sent (``SessionTransport.wait_acknowledged``), then disposes as usual (close
1001). What is still running when the drain time is up ends as any close ends it: the caller's
call fails ``OutcomeUnknown`` (never a result that did not happen). A worker drains the same way
(:mod:`garcon_link.api.worker`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast, overload

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..endpoint.link import ExecutorLink
from ..endpoint.transport import SessionTransport, TransportState
from ..errors import (
    AuthenticationError,
    CallError,
    ConfigError,
    FailureReason,
    HandshakeError,
    NotDispatched,
)
from ..limits import Limits
from ..logs import log_fields, peer_message, peer_text
from ..rpc.hooks import CallHook
from ..rpc.interface import contract_hash, manifest_changes, service_spec
from ..rpc.rpc import CallObserver, ExecutorRpc, Registry
from ..settings.config import LinkConfig
from .endpoint import Endpoint, ExecutorStatistics, SessionTotals
from .facades import NO_METHODS, DynamicFacade, Facade
from .registration import ServiceMap, interface_class, registry_from

__all__ = ["Availability", "ExecutorInfo", "RemoteExecutor", "connect"]

log = logging.getLogger("garcon_link.remote")  # the name users configure (README)

_CAUSE_CHARS = 1000
"""The longest cause of a refused session (a contract change lists the changed methods)."""

T = TypeVar("T")
Availability = Literal["offline", "ready", "reconnecting", "disposed"]


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


def _fresh(error: HandshakeError) -> HandshakeError:
    """A new exception equal to a stored one (raising a stored object again would chain every
    raise's traceback onto it)."""
    if isinstance(error, AuthenticationError):
        return AuthenticationError(error.detail)
    return HandshakeError(error.reason, error.detail)


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


class RemoteExecutor(Endpoint):
    """The controller's handle on one worker; use ``async with connect(config) as executor``.

    Args:
        config: the controller's configuration (dial or listen).
        services: controller-side services the worker may call back (optional).
        limits: overrides ``config.limits``.
        hooks: per-call hooks (:mod:`garcon_link.rpc.hooks`) told about every call made through
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
        self._init_member(config.executor_id, registry_from(services or {}), hooks)
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
        self._totals = SessionTotals()
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
                :mod:`garcon_link.rpc.interface`).
        """
        if interface is None:
            return DynamicFacade(self, name, NO_METHODS, None, None)
        return cast("T", Facade(self, name, service_spec(interface_class(interface)), None, None))

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


def connect(
    config: LinkConfig,
    *,
    services: ServiceMap | None = None,
    limits: Limits | None = None,
    hooks: Sequence[CallHook] = (),
    controller_id: str | None = None,
) -> RemoteExecutor:
    """The controller side: ``async with connect(config) as executor: ...``.

    ``hooks`` (:mod:`garcon_link.rpc.hooks`) are told about every call the executor makes or serves.
    ``controller_id`` replaces the config's: the name the worker knows this controller by (a
    worker holds one session per controller; by default each process is a controller of its
    own, and a new process with the same ``controller_id`` takes the old one's session over).

    Raises:
        ConfigError: ``config`` is not a controller configuration.
    """
    if config.role.value != "controller":
        raise ConfigError(
            f"connect() needs a controller configuration, got role {config.role.value!r}"
        )
    if controller_id is not None:
        config = dataclasses.replace(config, controller_id=controller_id)
    return RemoteExecutor(config, services=services, limits=limits, hooks=hooks)
