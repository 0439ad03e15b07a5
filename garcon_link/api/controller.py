"""The controller's handle on one worker: :class:`RemoteExecutor` and :func:`connect`
(docs/design.md#facades).

Theory of operation
-------------------
Controller availability::

    offline --(fresh session: fence passed + describe matched)--> ready
    ready <--(socket lost / replay done)--> reconnecting
    ready --(the worker's goodbye)--> draining
    draining <--(socket lost / replay done)--> reconnecting
    ready | draining | reconnecting --(continuity lost: session retired)--> offline
                                                             (exactly one transition)
    any --aclose()--> disposed                                            (final)

``draining``: the worker said goodbye on the current session (it drains: a SIGTERM,
``Worker.aclose(drain=)``; :mod:`garcon_link.rpc.rpc`, "Goodbye"). It lasts as long as that
session -- there is no way back to ``ready`` but a new session -- so a worker repeating its
goodbye, or sending it in a flood, makes at most one transition per session. Calls already sent
finish as usual; a new call fails at once with ``NotDispatched("DRAINING")``, nothing sent, as
the worker would refuse it anyway. A refusal for a drain is not counted in :attr:`errors`.
A draining worker admits no new session (close 4010 at the handshake): an executor without a
session there stays ``offline`` with that refusal as its link's and as its :attr:`last_error`
(until a dial finds nothing there: the worker has gone), and its calls fail
``NotDispatched("DRAINING")`` until a handshake completes (the restarted worker's).

A fresh session is *installed* (made current, availability ``ready``) after its replay fence
and a ``describe`` call; its manifest becomes the executor's, whatever it changed: contracts are
compared per method by the facades (:mod:`garcon_link.api.facades`), so a worker upgraded with
new methods or services stays usable, and only the calls of a method whose contract changed
incompatibly (or was removed) fail, each at once. What changed is logged once per session
(additive changes at INFO, the others at WARNING, by method, at most 64 compared;
:func:`~garcon_link.rpc.contract.compare_method`). A worker may also announce a new manifest
on the same session (``$link.inventory``, when it adds or removes a service): it replaces the
executor's at once if it is well formed and at most ``Limits.max_manifest_bytes``, and is
dropped (counted, the manifest unchanged) otherwise; an older announcement than one applied is
ignored. Each change increments ``manifest_version``, which tells facades to compare again.
A session that is not installed -- ``describe`` failed, timed out (it is bounded by
``call_timeout``) or answered a manifest over ``max_manifest_bytes`` -- is retired at once
(close 4005, logged with its cause), never left connected: the dialing side dials again per its
backoff, and each new session is checked afresh; until one is installed the cause is in
:attr:`RemoteExecutor.last_error` and in every call's ``NotDispatched``.

The facades of :meth:`RemoteExecutor.service` (:mod:`garcon_link.api.facades`) resolve the
current session at each call through :meth:`RemoteExecutor.rpc_for_call`. Resource references
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
import enum
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
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
    HandshakeFailure,
    LinkError,
    NotDispatched,
    WrongScheme,
)
from ..limits import Limits
from ..logs import log_fields, peer_message, peer_text
from ..rpc.hooks import CallHook
from ..rpc.interface import service_spec
from ..rpc.manifest import contract_hash
from ..rpc.rpc import CallObserver, ExecutorRpc, Registry
from ..settings.config import LinkConfig
from ._contract_log import CAUSE_CHARS, ContractLog
from ._stalls import StallWatch
from .described import (
    Described,
    ExecutorInfo,
    described,
    executor_info,
    manifest_bytes,
)
from .endpoint import Endpoint, ExecutorStatistics, SessionTotals
from .facades import NO_METHODS, DynamicFacade, Facade, contract_refusals
from .registration import ServiceMap, interface_class, registry_from

__all__ = ["Availability", "ExecutorInfo", "RemoteExecutor", "connect"]

log = logging.getLogger("garcon_link.remote")  # the name users configure (README)


T = TypeVar("T")
Availability = Literal["offline", "ready", "draining", "reconnecting", "disposed"]


def _fresh(error: HandshakeError) -> HandshakeError:
    """A new exception equal to a stored one (raising a stored object again would chain every
    raise's traceback onto it)."""
    if isinstance(error, AuthenticationError):
        return AuthenticationError(error.detail)
    return HandshakeError(error.reason, error.detail)


def _describe_registry(registry: Registry) -> dict[str, Any]:
    manifest = registry.manifest()
    return {"services": manifest, "contract": contract_hash(manifest)}


def describer(registry: Registry) -> Callable[[], dict[str, Any]]:
    """What a controller answers its workers' ``describe`` (its callback services in
    ``registry``): one callable for every session of every executor sharing the registry."""
    return functools.partial(_describe_registry, registry)


class _Stage(enum.Enum):
    NEW = "new"  # not yet ready
    INSTALLING = "installing"  # describe in flight
    INSTALLED = "installed"
    RETIRED = "retired"


class _Session:
    """One logical session of a :class:`RemoteExecutor`: its transport's state listener
    (:meth:`RemoteExecutor._session_state`) and its RPC's callbacks, in one slotted object: an
    idle session has no task of the executor's (only its RPC's) and no closures. It lives as
    long as its transport."""

    __slots__ = ("early", "executor", "rpc", "settled", "stage", "stall_watched", "transport")

    def __init__(self, executor: RemoteExecutor, transport: SessionTransport) -> None:
        self.executor = executor
        self.transport = transport
        self.rpc: ExecutorRpc
        self.stage = _Stage.NEW
        self.early: list[Any] | None = None  # the newest announcement before it is installed
        self.stall_watched = False  # lost its socket: in the StallWatch
        self.settled = 0  # times it was ready or retired while watched

    def __call__(self, state: TransportState) -> None:
        self.executor._session_state(self, state)

    def inventory(self, args: list[Any]) -> None:
        if self.stage is _Stage.INSTALLED:
            self.executor._on_inventory(self.rpc, args)
        else:
            self.early = args

    def peer_draining(self) -> None:
        self.executor._peer_draining(self.transport)

    def stall_due(self) -> None:  # the StallWatch's
        self.executor._stall_due(self)


class RemoteExecutor(Endpoint):
    """The controller's handle on one worker; use ``async with connect(config) as executor``.

    Args:
        config: the controller's configuration (dial or listen).
        services: controller-side services the worker may call back (optional).
        limits: overrides ``config.limits``.
        hooks: per-call hooks (:mod:`garcon_link.rpc.hooks`) told about every call made through
            this executor's facades and every call back from the worker it serves.
    """

    # A fleet holds one per executor: slots keep each small, however many attributes it has.
    __slots__ = (
        "__weakref__",
        "_availability",
        "_callbacks",
        "_changed",
        "_contract_cache",
        "_describe",
        "_described",
        "_draining",
        "_info",
        "_inventory_seq",
        "_lines",
        "_manifest_version",
        "_observer",
        "_on_change",
        "_registry",
        "_rpc",
        "_services",
        "_stall_watch",
        "_totals",
        "_wrong_scheme",
        "calls",
        "errors",
        "executor_id",
        "inventory_dropped",
        "inventory_updates",
        "last_error",
        "since",
    )

    def __init__(
        self,
        config: LinkConfig,
        *,
        services: ServiceMap | None = None,
        limits: Limits | None = None,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        super().__init__(config, limits=limits)
        registry = registry_from(services or {})
        self._init_member(config.executor_id, registry, hooks, None, describer(registry))
        assert self._own_link is not None
        self._own_link.on_refusal(self._refused)
        self._own_link.on_dial_failed(self._dial_failed)

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
        stall_watch: StallWatch | None = None,
        describe: Callable[[], dict[str, Any]] | None = None,
        *,
        dials: bool = True,
    ) -> RemoteExecutor:
        """An executor of a fleet: sessions are routed to it by the fleet, which owns the link
        and the task group; :meth:`aclose` only marks it disposed. ``stall_watch`` is shared by
        the fleet's members (one task, and one budget of stalled-call lines); so is ``describe``
        (:func:`describer` of ``registry``), as they share the registry. ``dials=False``: the
        link only listens (a keyring listener), so it never reports a refusal or a failed dial
        and the member does not listen for them."""
        self = cls.__new__(cls)
        self.limits = limits
        self._own_link = None
        self.link = link
        self._tg = tg
        self._init_member(
            executor_id, registry, hooks, stall_watch, describe or describer(registry)
        )
        self._on_change = on_change
        if dials:
            link.on_refusal(self._refused)
            link.on_dial_failed(self._dial_failed)
        return self

    def _init_member(
        self,
        executor_id: str,
        registry: Registry,
        hooks: Sequence[CallHook],
        stall_watch: StallWatch | None,
        describe: Callable[[], dict[str, Any]],
    ) -> None:
        self.executor_id = executor_id
        # The outcome point of every call through this executor (counters and hooks), shared
        # by all its sessions (so the counters survive session replacement).
        self._observer = CallObserver(hooks, self.limits, executor_id)
        self._totals = SessionTotals()
        self._registry = registry
        self._availability: Availability = "offline"
        self._wrong_scheme = False  # the last dial failed on a server of the other scheme
        self.since = time.time()
        """Wall-clock time of the last availability change (for tables and events)."""
        self.calls = 0
        """Calls and streams started through this executor's facades."""
        self.errors = 0
        """Of those, how many raised a :class:`~garcon_link.CallError` (a drain's refusal,
        ``NotDispatched("DRAINING")``, is not an error)."""
        # on_availability_changed()'s subscribers (allocated with the first) and the fleet's
        self._callbacks: list[Callable[[Availability], None]] | None = None
        self._on_change: Callable[[RemoteExecutor, Availability], None] | None = None
        self._describe = describe  # what the worker's describe of this controller answers
        self._rpc: ExecutorRpc | None = None
        self._info: ExecutorInfo | None = None
        self._services: Mapping[str, Any] = {}  # the worker's manifest (the current session's)
        self._manifest_version = 0  # incremented whenever _services is learned (facades.py)
        # facades.py and offers(): the current manifest's comparisons, shared by every executor
        # with the same manifest (described.py)
        self._contract_cache: dict[tuple[str, type], Any] = {}
        self._described: Described | None = None
        self._inventory_seq = -1  # the latest inventory announcement applied on this session
        self.inventory_updates = 0
        """Manifests the worker announced on a running session and this executor applied."""
        self.inventory_dropped = 0
        """Announced manifests dropped: malformed or over ``Limits.max_manifest_bytes``."""
        self._lines: ContractLog | None = None  # made by the first line (_contract_lines)
        self._changed: anyio.Event | None = None  # made by the first waiter (_wait_changed)
        self.last_error: str | None = None
        self._draining = False
        # Calls stuck on a session without a socket: one line per executor per log_interval.
        self._stall_watch = stall_watch or StallWatch(self.limits)

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
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(callback)
        return functools.partial(self._unsubscribe, callback)

    def _unsubscribe(self, callback: Callable[[Availability], None]) -> None:
        if self._callbacks is not None and callback in self._callbacks:
            self._callbacks.remove(callback)

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
        self._wake()
        if self._on_change is not None:
            self._call_back(functools.partial(self._on_change, self), value)
        for callback in list(self._callbacks or ()):
            self._call_back(callback, value)

    def _call_back(self, callback: Callable[[Availability], None], value: Availability) -> None:
        try:
            callback(value)
        except Exception:
            log.exception(
                "availability callback failed", extra=log_fields(executor=self.executor_id)
            )

    async def wait_ready(
        self, timeout: float | None = None, *, refused_dials: int | None = None
    ) -> None:
        """Wait until the executor is ``ready`` (a ``draining`` one is not: the wait goes on
        until a new session, such as that of the restarted worker, is installed).

        Args:
            timeout: seconds to wait (``None``: no limit).
            refused_dials: give up once this many dials in a row found nothing at the dialed
                address (connection refused, or the host name did not resolve) or what a
                redial meets again (an HTTP client error, a TLS certificate that does not
                verify) instead of waiting out ``timeout``, or once one met a server of the
                other scheme
                (:class:`~garcon_link.errors.WrongScheme`); ``None`` (the default) waits for a
                worker that is starting. A listening executor never dials, so this never ends
                its wait.

        Raises:
            TimeoutError: not ready within ``timeout``; the message carries the last link error
                and the last dial error.
            NotDispatched: the executor was disposed (``DISPOSED``), or ``refused_dials`` dials
                in a row found nothing (``UNREACHABLE``; the message names the address and the
                operating system's reason).
            AuthenticationError: the other end refused our key (wrong secret, or an executor id
                it does not serve), at once rather than at the timeout; the message says what
                to fix. The link keeps redialing: a later ``wait_ready`` succeeds once fixed.
            HandshakeError: likewise for a protocol version or role mismatch.

        A worker that drains refuses a new session (4010): with ``refused_dials`` the wait
        ends at once with ``NotDispatched("DRAINING")``; without, it goes on (a restarted
        worker admits the session) and a ``TimeoutError`` says the worker is draining.
        """
        if refused_dials is not None and refused_dials < 1:
            raise ValueError(f"refused_dials must be at least 1, got {refused_dials!r}")
        with anyio.move_on_after(timeout):
            while self._availability != "ready":
                if self._availability == "disposed":
                    raise NotDispatched("DISPOSED", "the executor was closed")
                refusal = self._refusal()
                if refusal is not None and refusal.reason is HandshakeFailure.DRAINING:
                    # What every redial meets until a restart (once gone: unreachable, below).
                    if refused_dials is not None and self.refused_for_drain():
                        raise NotDispatched("DRAINING", self._refused_draining())
                elif refusal is not None:
                    # Fail fast: a redial will not heal this (the link keeps dialing anyway).
                    raise _fresh(refusal)
                unreachable = self._unreachable(refused_dials)
                if unreachable is not None:
                    raise unreachable
                await self._wait_changed()
            return
        raise TimeoutError(
            f"executor {self.executor_id!r} not ready within {timeout:g}s: {self._why_not_ready()}"
        )

    def _unreachable(self, refused_dials: int | None) -> NotDispatched | None:
        """``NotDispatched("UNREACHABLE")`` once ``refused_dials`` dials in a row found nothing."""
        if refused_dials is None:
            return None
        in_a_row = self.link.statistics().dials_refused_in_a_row
        # A server of the other scheme answers every redial the same way: one such dial is final.
        if in_a_row < refused_dials and not (in_a_row and self._wrong_scheme):
            return None
        count = "" if self._wrong_scheme else f" ({in_a_row} dials in a row)"
        return NotDispatched("UNREACHABLE", f"{self.link.last_dial_error}{count}")

    def _dial_failed(self, error: LinkError) -> None:
        self._wrong_scheme = isinstance(error, WrongScheme)
        if self.last_error == self._refused_draining() and not self.refused_for_drain():
            self.last_error = None  # the worker that drained has gone (unreachable, not draining)
        self._wake()

    def _refused(self, refusal: HandshakeError) -> None:
        """The link's ``on_refusal`` listener: a drain refusal (4010) becomes
        :attr:`last_error`, as the executor stays ``offline`` for it."""
        if refusal.reason is HandshakeFailure.DRAINING:
            self.last_error = self._refused_draining()
        self._wake()

    def _why_not_ready(self) -> str:
        """The causes known so far: a drain, the refused session's, the link's, the last
        dial's."""
        causes: list[str] = []
        if self._draining:
            causes.append("the executor is closing (draining): it will not be ready again")
        elif self.refused_for_drain():
            causes.append(self._refused_draining())
        elif self._availability == "draining":
            causes.append(
                "the worker is draining (it was told to stop and refuses new calls): ready "
                "again once it has restarted"
            )
        if self.last_error and self.last_error not in causes:
            causes.append(self.last_error)
        dial = self.link.last_dial_error
        if dial is not None:
            causes.append(f"last dial: {dial}")
        elif not causes and self.link.last_error:
            causes.append(self.link.last_error)
        return "; ".join(causes) or "no session yet"

    def _refusal(self) -> HandshakeError | None:
        return self.link.refusal

    def refused_for_drain(self) -> bool:
        """The worker refused our new session because it drains (4010), and no dial since
        found nothing there (the drain refusal stands until a handshake completes; a worker
        that has gone since is unreachable, not draining). Internal: a gateway caller's
        executor handles say why through a draining gateway (api/_relay_executor.py)."""
        refusal = self._refusal()
        return (
            refusal is not None
            and refusal.reason is HandshakeFailure.DRAINING
            and self.link.statistics().dials_refused_in_a_row == 0
        )

    def _refused_draining(self) -> str:
        """What a worker's drain refusal of our new session (4010) means, in one sentence."""
        return (
            f"the worker of executor {self.executor_id!r} is draining: it was told to stop and "
            "refuses new sessions (close 4010); ready again once it has restarted"
        )

    def _wake(self) -> None:
        """Wake every waiter on ``_changed`` (availability, a refusal or a failed dial)."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def _wait_changed(self) -> None:
        """Until the next :meth:`_wake` (the event is made by the first waiter)."""
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def ready_rpc(self) -> ExecutorRpc | None:
        """The current session if a call may be sent on it at once -- ``ready``, and this
        controller not draining -- else ``None``: what :meth:`rpc_for_call` returns without
        waiting, for one method call. Internal, on every call's path: a gateway caller's
        executor handles (api/_relay_executor.py) and the gateway's direct path
        (api/_forwarding.py). The session's ``observer`` is this executor's :attr:`observer`."""
        rpc = self._rpc
        if rpc is None or self._availability != "ready" or self._draining:
            return None
        return rpc

    async def rpc_for_call(self, dispatch_deadline: float) -> ExecutorRpc:
        """The session a call goes on now: the current one if ``ready``; while
        ``reconnecting``, the next one within ``dispatch_deadline`` seconds. Internal: the
        facades, keyed calls and the gateway's forward call it for every call.

        Raises:
            NotDispatched: the executor is not ready (its availability's code, or ``DRAINING``
                while this controller drains), or did not become ready in time.
        """
        if self._availability == "reconnecting" and dispatch_deadline > 0 and not self._draining:
            with anyio.move_on_after(dispatch_deadline):
                while self._availability == "reconnecting":
                    await self._wait_changed()
        if self._draining and self._availability != "disposed":
            raise NotDispatched("DRAINING", "the executor is closing: new calls are refused")
        rpc = self._rpc
        state = self._availability
        if state == "ready" and rpc is not None:
            return rpc
        if state == "disposed":
            raise NotDispatched("DISPOSED", "the executor was closed")
        if state == "draining":
            raise NotDispatched("DRAINING", "the worker is draining: new calls are refused")
        if state == "reconnecting":
            raise NotDispatched("RECONNECTING", "the executor is reconnecting")
        if self.refused_for_drain():
            raise NotDispatched("DRAINING", self._refused_draining())
        raise NotDispatched("OFFLINE", self.last_error or "the executor is offline")

    # -- sessions

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        session = _Session(self, transport)
        rpc = session.rpc = ExecutorRpc(
            transport,
            self._registry,
            self.limits,
            describe=self._describe,
            peer="worker",
            observer=self._observer,
            on_peer_draining=session.peer_draining,
        )
        rpc.on_inventory(session.inventory)
        self._totals.sessions += 1
        assert self._tg is not None
        self._tg.start_soon(rpc.run)
        transport.add_listener(session)
        session(transport.state)

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of this executor's calls, sessions and link (:class:`ExecutorStatistics`)."""
        return self._totals.snapshot(
            self.executor_id, self._observer, self.link.statistics(), self._rpc
        )

    def _session_state(self, session: _Session, state: TransportState) -> None:
        """Follow one session's transport (its state listener, :class:`_Session`): install it
        once first ready, make its states the executor's while it is the installed one, count
        it and go ``offline`` when it is retired."""
        rpc = session.rpc
        if session.stall_watched and state in (TransportState.READY, TransportState.RETIRED):
            session.stall_watched = False  # its StallWatch entry is void
            session.settled += 1
        if state is TransportState.RETIRED:
            if session.stage is not _Stage.RETIRED:
                session.stage = _Stage.RETIRED
                self._totals.ended(session.transport)  # once (self._rpc is no longer it)
            if self._rpc is rpc:
                self._rpc = None
                self._set_availability("offline")
        elif session.stage is _Stage.NEW:
            if state is TransportState.READY and self._tg is not None:
                session.stage = _Stage.INSTALLING
                self._tg.start_soon(self._install, session)
        elif session.stage is _Stage.INSTALLED and self._rpc is rpc:
            if state is TransportState.READY:
                self._set_availability("draining" if rpc.peer_draining else "ready")
            elif state in (TransportState.DETACHED, TransportState.REPLAYING):
                self._set_availability("reconnecting")
                self._watch_stall(session)

    async def _install(self, session: _Session) -> None:
        # An announcement may arrive while describe is answered: the session keeps the newest
        # (they come in order), applied once installed if it is newer than what describe said.
        transport, rpc = session.transport, session.rpc
        try:
            manifest = await rpc.describe_peer(timeout=self.limits.call_timeout)
            info, shared = executor_info(manifest, transport.session_id, self.limits)
        except (CallError, KeyError, TypeError, ValueError) as exc:
            self._refuse_session(transport, f"describe failed: {peer_text(exc)}")
            return
        if self._described is not None and shared is not self._described:
            self._contract_lines().changed(self._described, shared, transport.session_id)
        self._learn(info, shared)
        # describe says which announcement its manifest includes (-1: an older worker)
        sequence = manifest.get("inventory")
        self._inventory_seq = sequence if type(sequence) is int else -1
        rpc.peer_instance_id = info.instance_id
        rpc.peer_worker_instance_id = info.worker_instance_id
        rpc.peer_state_id = info.state_id
        self._rpc = rpc
        if session.stage is _Stage.INSTALLING:
            session.stage = _Stage.INSTALLED
        early, session.early = session.early, None
        if early is not None:
            self._on_inventory(rpc, early)
        self.last_error = None
        self._session_state(session, transport.state)

    def _peer_draining(self, transport: SessionTransport) -> None:
        """The worker's goodbye arrived on ``transport`` (once per session): ``draining``, if
        that session is the installed one and ready. Otherwise :meth:`_install` or its listener
        reads ``peer_draining`` when the session is (again) ready."""
        rpc = self._rpc
        if (
            rpc is not None
            and rpc.transport is transport
            and transport.state is TransportState.READY
        ):
            self._set_availability("draining")

    def _learn(self, info: ExecutorInfo, shared: Described) -> None:
        """Make ``info`` (and its manifest, ``shared``) the executor's: facades compare again
        (once per distinct manifest: the comparisons are ``shared``'s)."""
        self._info = info
        self._described = shared  # (the table refers to it weakly: held while it is the current)
        self._services = shared.services
        self._contract_cache = shared.refusals
        self._manifest_version += 1

    def _on_inventory(self, rpc: ExecutorRpc, args: list[Any]) -> None:
        """The worker announced a new manifest on a running session (``[seq, services]``)."""
        if self._rpc is not rpc or self._info is None:
            return  # not the installed session (or not yet): its describe is what counts
        problem = None
        encoded = b""
        if len(args) != 2 or type(args[0]) is not int:
            problem = "an announcement is [sequence, services]"
        elif args[0] <= self._inventory_seq:
            return  # an older announcement than one applied (they are sent in order)
        else:
            try:
                encoded = manifest_bytes(args[1], self.limits.max_manifest_bytes)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            self.inventory_dropped += 1
            self._contract_lines().dropped(problem)
            return
        self._inventory_seq = args[0]
        shared = described(dict(args[1]), encoded)
        self.inventory_updates += 1
        if self._described is not None and shared is not self._described:
            self._contract_lines().changed(self._described, shared, None)
        self._learn(
            dataclasses.replace(
                self._info,
                services=shared.services,
                contract=shared.contract,
                versions=shared.versions,
            ),
            shared,
        )

    def _contract_lines(self) -> ContractLog:
        """This executor's lines about the manifests the worker sends (made once needed: most
        executors never write one)."""
        if self._lines is None:
            self._lines = ContractLog(self.executor_id, self.limits)
        return self._lines

    def _watch_stall(self, session: _Session) -> None:
        """Put a session that lost its socket in the stall watch (once until it is ready again)."""
        if session.stall_watched or self._tg is None:
            return
        session.stall_watched = True
        self._stall_watch.watch(self._tg, session)

    def _stall_due(self, session: _Session) -> None:
        """Log a WARNING if calls still wait for replies ``Limits.stalled_call_report`` seconds
        after the session lost its socket (and it was not ready since), rather than only when
        its grace ends (a dead worker otherwise keeps its callers waiting without a word)."""
        session.stall_watched = False
        rpc = session.rpc
        pending = rpc.statistics().pending_calls
        if pending == 0 or self._rpc is not rpc:
            return
        after = self._stall_watch.after
        dial = self.link.last_dial_error
        where = f"last dial: {dial}" if dial is not None else "no new socket yet"
        left = max(0.0, self.limits.detached_grace - after)
        self._stall_watch.log.log(
            self.executor_id,
            "STALLED",
            "executor %s: %d call(s) waiting for replies; the worker has been unreachable for "
            "%.1fs (%s); they end OutcomeUnknown unless it is back within %.1fs "
            "(detached_grace)",
            self.executor_id,
            pending,
            after,
            where,
            left,
            extra=log_fields(executor=self.executor_id, session=session.transport.session_id),
        )

    def _refuse_session(self, transport: SessionTransport, why: str) -> None:
        """Retire a fresh session that will not be installed, and say why.

        Left connected, it would hold the link (a healthy socket is never redialed) while every
        call fails: retiring it closes the socket with 4005, so both sides drop it and the
        dialing side dials again per its backoff -- each new session is described afresh. The
        cause stays visible meanwhile in :attr:`last_error`, in ``wait_ready``'s timeout and in
        the ``NotDispatched("OFFLINE")`` of every call; availability stays ``offline``.
        """
        why = peer_message(why, CAUSE_CHARS)  # names from the worker's manifest
        self.last_error = why
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
        """The current session's description (executor id, instance id, services, contract,
        each service's contract version), as the worker last described or announced it."""
        await self.rpc_for_call(0)
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

    def manifest(self) -> Mapping[str, Any]:
        """The worker's services manifest, as its current (or last) session described it (the
        dynamic facades look their methods up in it, the gateway shows its callers their
        granted part).

        Raises:
            NotDispatched: no session was ever installed, so the manifest is not known yet.
        """
        if self._info is None:
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

    @property
    def observer(self) -> CallObserver:
        """The outcome point of every call through this executor: its counters and hooks.
        Internal, read by the facades (once per facade or stream) and the gateway's relay."""
        return self._observer

    @property
    def manifest_version(self) -> int:
        """How many times the worker's manifest was learned (0: never); the facades compare
        their interface again when it moves (read on every facade call)."""
        return self._manifest_version

    def refusals(self, service: str, interface: type, view: Mapping[str, Any]) -> Any:
        """The methods of ``view`` (``service`` as ``interface`` has it) that cannot be called
        on the current manifest, and why (:func:`~garcon_link.api.facades.contract_refusals`):
        compared once per manifest and interface, shared by every executor with the same
        manifest. Internal: the facades ask it when :attr:`manifest_version` moved."""
        key = (service, interface)
        refusals = self._contract_cache.get(key)
        if refusals is None:
            refusals = contract_refusals(service, view, self.manifest())
            self._contract_cache[key] = refusals
        return refusals

    # -- capabilities (routing by what the worker offers)

    @property
    def versions(self) -> Mapping[str, str]:
        """Each service of the worker's manifest (as last described or announced) with its
        contract version; empty before a session was installed."""
        return self._info.versions if self._info is not None else {}

    @property
    def types(self) -> Mapping[str, Any]:
        """Each service's type descriptions, as the worker last described them (the gateway
        shows its callers those of their granted services); empty before a session was
        installed."""
        return self._info.types if self._info is not None else {}

    @property
    def pending_calls(self) -> int:
        """Calls and streams of this controller awaiting the worker's reply (0 offline)."""
        rpc = self._rpc
        return rpc.statistics().pending_calls if rpc is not None else 0

    @property
    def routable(self) -> bool:
        """Whether new calls may be routed here: ``ready`` (a worker that said goodbye is
        ``draining``), and this controller is not draining its own calls."""
        return self._availability == "ready" and not self._draining

    def offers(
        self, service: str, method: str | None = None, *, interface: type | None = None
    ) -> bool:
        """Whether the worker's manifest (as last described or announced) has ``service``
        (and ``method``); with ``interface``, whether that method (or, without ``method``,
        every method of ``interface``) is compatible or additive to the interface's view
        (:func:`~garcon_link.rpc.contract.compare_method`).

        Raises:
            TypeError, ConfigError: ``interface`` is not a servable interface class.
        """
        methods = self._services.get(service) if self._info is not None else None
        if not isinstance(methods, Mapping):
            return False
        if interface is None:
            return method is None or isinstance(methods.get(method), Mapping)
        spec = service_spec(interface_class(interface))
        # Compared once per distinct manifest and interface, as facades compare theirs.
        refusals = self.refusals(service, spec.interface, spec.manifest())
        wanted = spec.methods if method is None else (method,)
        return all(name in spec.methods and name not in refusals for name in wanted)


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
