"""Fleet: one controller, many executors (docs/design.md#fleets).

Theory of operation
-------------------
A :class:`Fleet` is a controller endpoint for many executors at once. It owns

* at most one **listening** link (``[connection] listen`` with ``[executors] keyring``): workers
  dial it; each authenticates with its own key, read from the keyring at each handshake, and the
  link keeps one session slot per executor id (:mod:`garcon_link.endpoint.link`), up to
  ``max_executors``;
* one **dialing** link per ``[[executors.dial]]`` entry (a listening worker, its own secret).

For each executor id it keeps one stable :class:`~garcon_link.RemoteExecutor`, created by
:meth:`Fleet.executor` before the executor ever connects, or when an enrolled executor first
authenticates. New logical sessions are routed by the executor id the handshake authenticated; a
member behaves exactly as the single executor of :func:`~garcon_link.connect` (availability,
``wait_ready``, stable facades, session replacement, honest outcomes), independently of the
others. Availability changes become :class:`FleetEvent` s on every :meth:`Fleet.events` stream.

A draining executor (its worker said goodbye: availability ``draining``,
:mod:`garcon_link.api.controller`) takes no new work: :meth:`Fleet.map` leaves it out, and
whatever chooses executors for new work asks :func:`_accepting_work`. Its drain refusals are
not counted in its ``errors``.

Bounds
------
* Slots: ``max_executors`` (the link refuses the next executor with 1013 and a reason naming the
  bound, before any session state is allocated); members created by connections are as many.
* ``forget_after``: an executor that joined by connecting (never named by :meth:`Fleet.executor`)
  and stayed ``offline`` that long leaves the registry: its slot is freed and a ``forgotten``
  event is emitted. Executors named by the program stay, as the objects it holds stay valid.
* :meth:`Fleet.events`: each subscriber has a buffer of ``events_buffer`` events; a slow
  consumer loses the oldest ones and is told how many by a ``lost`` event.
* :meth:`Fleet.map`: at most ``concurrency`` calls in flight.

Routing by capability
---------------------
:meth:`Fleet.map` with ``where=`` and :meth:`Fleet.pick` choose only *routable* executors
(:attr:`RemoteExecutor.routable`: ``ready``, not draining) whose manifest, as the worker last
described or announced it (:mod:`garcon_link.api.controller`), offers what the call needs;
``pick`` takes the one with the fewest pending calls, turning among equals.
* Retention: every session of the fleet draws on one budget, ``max_total_retained_bytes``
  (:class:`~garcon_link.core.session.RetentionPool`); when it is spent, senders wait for receipts
  (back-pressure), and no session is failed for it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..core.session import RetentionPool
from ..core.wire import Role
from ..endpoint.link import ExecutorLink, LinkStatistics, WebSocketLink
from ..endpoint.transport import SessionTransport
from ..errors import CallError, ConfigError, NotDispatched
from ..limits import Limits
from ..rpc.hooks import CallHook
from ..rpc.rpc import Registry
from ..settings.config import LinkConfig
from ..settings.fleet import FleetConfig
from ..settings.keyring import Keyring, executor_id_problem
from ._stalls import StallWatch
from .controller import Availability, RemoteExecutor, describer
from .endpoint import link_from_config
from .registration import ServiceMap, registry_from

__all__ = ["ExecutorSnapshot", "Fleet", "FleetEvent", "fleet"]

log = logging.getLogger("garcon_link.fleet")  # the name users configure (README)

T = TypeVar("T")
Where = str | Callable[[RemoteExecutor], bool]
"""What :meth:`Fleet.map` (``where=``) routes to: ``"service"``, ``"service.method"``, or a
predicate on an executor."""
EventKind = Literal[
    "joined", "ready", "draining", "reconnecting", "offline", "disposed", "forgotten", "lost"
]
DEFAULT_EVENTS_BUFFER = 1024


@dataclass(frozen=True, slots=True)
class ExecutorSnapshot:
    """One executor as :meth:`Fleet.executors` saw it.

    Attributes:
        executor_id: its id.
        availability: ``offline``, ``ready``, ``draining`` (its worker said goodbye: no new
            work goes to it), ``reconnecting`` or ``disposed``.
        session: the first 12 hex digits of its current logical session id, or None.
        since: wall-clock time (``time.time()``) of its last availability change.
        calls: calls and streams started through its facades.
        errors: of those, how many raised a :class:`~garcon_link.CallError` (a drain's
            refusal, ``NotDispatched("DRAINING")``, is not an error).
        services: each service of its manifest with its contract version (empty before its
            first session; :func:`~garcon_link.rpc.contract.service_version`).
        pending: its calls awaiting a reply now.
        reason: why an ``offline`` executor has no session, when its worker said so:
            ``"draining"`` -- the worker refused a new session because it drains (close 4010;
            until it has restarted, or a dial finds nothing there); None otherwise. Its
            ``last_error`` says it in a sentence.
    """

    executor_id: str
    availability: Availability
    session: str | None
    since: float
    calls: int
    errors: int
    services: Mapping[str, str] = field(default_factory=dict)
    pending: int = 0
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """A change in the fleet.

    Attributes:
        kind: ``joined`` (its first session in this fleet), ``ready``, ``draining``,
            ``reconnecting``, ``offline``, ``disposed``, ``forgotten``; or ``lost``: this
            subscriber missed ``lost`` events.
        executor_id: the executor (for ``lost``, "" when this subscriber fell behind; through a
            gateway, the executor whose events the gateway dropped while the caller was behind).
        at: wall-clock time of the event.
        lost: for ``lost``, how many events were dropped.
    """

    kind: EventKind
    executor_id: str
    at: float
    lost: int = 0


def _accepting_work(executor: ExecutorSnapshot | RemoteExecutor) -> bool:
    """Whether new work may go to ``executor`` now: it is ``ready`` (not ``draining``,
    ``reconnecting``, ``offline`` or ``disposed``). What chooses an executor for new work asks
    this."""
    return executor.availability == "ready"


def _offline_reason(member: RemoteExecutor) -> str | None:
    """:attr:`ExecutorSnapshot.reason` of ``member``."""
    if member.availability == "offline" and member.refused_for_drain():
        return "draining"
    return None


def _leaving(executor: ExecutorSnapshot | RemoteExecutor) -> bool:
    """Whether ``executor`` said goodbye (``draining``): a fan-out over the whole fleet leaves
    it out rather than report it (an ``offline`` one is reported: that is a fault)."""
    return executor.availability == "draining"


class _Subscriber:
    def __init__(self, capacity: int) -> None:
        self.queue: collections.deque[FleetEvent] = collections.deque(maxlen=capacity)
        self.lost = 0
        self.wakeup = anyio.Event()

    def push(self, event: FleetEvent) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.lost += 1  # the deque drops the oldest
        self.queue.append(event)
        self.wakeup.set()


class _EventFeed:
    """A fleet's events, fanned out to every :meth:`follow` in progress: one queue of at most
    ``capacity`` events per follower, the oldest dropped (and counted in a ``lost`` event)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._subscribers: list[_Subscriber] = []
        self._taps: list[Callable[[FleetEvent], None]] = []
        self._closed = False

    def tap(self, listener: Callable[[FleetEvent], None]) -> None:
        """Call ``listener`` with every event as it is published, before any follower sees it
        (a gateway's watches: it must be quick and must not raise)."""
        self._taps.append(listener)

    def publish(self, kind: EventKind, executor_id: str, lost: int = 0) -> None:
        event = FleetEvent(kind, executor_id, time.time(), lost=lost)
        for listener in self._taps:
            listener(event)
        for subscriber in list(self._subscribers):
            subscriber.push(event)

    def close(self) -> None:
        """End every :meth:`follow` (now, or when it next waits) and any later one."""
        self._closed = True
        for subscriber in self._subscribers:
            subscriber.wakeup.set()

    async def follow(self) -> AsyncIterator[FleetEvent]:
        subscriber = _Subscriber(self._capacity)
        self._subscribers.append(subscriber)
        try:
            while not self._closed:
                if subscriber.lost:
                    lost, subscriber.lost = subscriber.lost, 0
                    yield FleetEvent("lost", "", time.time(), lost=lost)
                    continue
                if subscriber.queue:
                    yield subscriber.queue.popleft()
                    continue
                subscriber.wakeup = anyio.Event()
                await subscriber.wakeup.wait()
        finally:
            self._subscribers.remove(subscriber)


class Fleet:
    """A controller for many executors; use ``async with gl.fleet(config) as fleet``.

    Args:
        config: a :class:`~garcon_link.FleetConfig` (keyring listener and/or dial entries), or
            a controller :class:`~garcon_link.LinkConfig` (a fleet of one).
        services: controller-side services every worker may call back (optional).
        limits: overrides the config's limits.
        events_buffer: events kept per :meth:`events` subscriber before the oldest are dropped.
        hooks: per-call hooks (:mod:`garcon_link.rpc.hooks`) given to every member executor.
    """

    def __init__(
        self,
        config: FleetConfig | LinkConfig,
        *,
        services: ServiceMap | None = None,
        limits: Limits | None = None,
        events_buffer: int = DEFAULT_EVENTS_BUFFER,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        if isinstance(config, LinkConfig) and config.role is not Role.CONTROLLER:
            raise ConfigError(
                f"fleet() needs a controller configuration, got role {config.role.value!r}"
            )
        if events_buffer < 1:
            raise ValueError("events_buffer must be at least 1")
        self.config = config
        self._hooks = tuple(hooks)
        self.limits = limits or config.limits
        self._registry: Registry = registry_from(services or {})
        self._describe = describer(self._registry)  # one for every member's sessions
        self._on_member_change = self._availability_changed  # one bound method for all members
        self._members: dict[str, RemoteExecutor] = {}
        self._pinned: set[str] = set()
        self._joined: set[str] = set()  # ids that had a session (bounded like the members)
        self._offline_at: dict[str, float] = {}
        self._events = _EventFeed(events_buffer)
        self._links: list[WebSocketLink] = []
        self._entered: list[WebSocketLink] = []
        self._listening: WebSocketLink | None = None
        self._link_of: dict[str, WebSocketLink] = {}  # dial entries and a fleet of one
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._turn = 0  # pick(): which of equally loaded executors goes first
        self._stall_watch = StallWatch(self.limits)  # one task and one budget for all members
        self._build_links()

    def _build_links(self) -> None:
        config = self.config
        # One retention budget for every session of the fleet.
        self._retention = RetentionPool(self.limits.max_total_retained_bytes)
        if isinstance(config, LinkConfig):
            link = link_from_config(config, self.limits, self._retention)
            self._links.append(link)
            self._link_of[config.executor_id] = link
            if config.listen is not None:
                self._listening = link
            return
        if config.listen is not None:
            assert config.keyring is not None
            keyring = Keyring(config.keyring)

            def keys(executor_id: str) -> bytes | None:
                secret = keyring.secret_for(executor_id)
                return secret.reveal() if secret is not None else None

            self._listening = WebSocketLink(
                role=Role.CONTROLLER,
                keys=keys,
                max_executors=config.max_executors,
                limits=self.limits,
                listen=config.listen,
                ssl_context=config.ssl_context(),
                allow_insecure_development=config.allow_insecure_development,
                retention=self._retention,
                controller_id=config.controller_id,
            )
            self._links.append(self._listening)
        for entry in config.dial:
            link = link_from_config(config.dial_config(entry), self.limits, self._retention)
            self._links.append(link)
            self._link_of[entry.executor_id] = link

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Fleet:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            for link in self._links:
                link.on_session(self._route)
                await link.__aenter__()
                self._entered.append(link)
            for executor_id in self._link_of:
                self.executor(executor_id)  # dialed executors exist from the start
            forget_after = getattr(self.config, "forget_after", None)
            if self._listening is not None and forget_after is not None:
                tg.start_soon(self._forget_loop, float(forget_after))
        except BaseException:
            await self._close_links()
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Dispose every executor (pending calls fail honestly) and close every link."""
        if self._closed:
            return
        self._closed = True
        self._events.close()
        for member in list(self._members.values()):
            await member.aclose()
        await self._close_links()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)

    async def _close_links(self) -> None:
        # Task groups (the links' and ours) are left in the reverse order they were entered.
        for link in reversed(self._entered):
            await link.__aexit__(None, None, None)  # closes the link, shielded
        self._entered.clear()

    @property
    def url(self) -> str:
        """The URL workers dial (a listening fleet only)."""
        if self._listening is None:
            raise RuntimeError("this fleet does not listen")
        return self._listening.url

    @property
    def listen_address(self) -> tuple[str, int]:
        if self._listening is None:
            raise RuntimeError("this fleet does not listen")
        return self._listening.listen_address

    def statistics(self) -> LinkStatistics:
        """The listening link's counters (handshakes, refusals, takeovers...); a dial-only
        fleet sums its links'."""
        if self._listening is not None:
            return self._listening.statistics()
        total = LinkStatistics()
        for link in self._links:
            s = link.statistics()
            for name in (
                "connections",
                "handshakes_completed",
                "resumed",
                "fresh_sessions",
                "takeovers_refused",
                "heartbeat_timeouts",
                "dial_attempts",
                "dials_refused",
            ):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    # ------------------------------------------------------------------ members

    def executor(self, executor_id: str) -> RemoteExecutor:
        """The stable handle of ``executor_id``; it exists before the executor first connects.

        Raises:
            ValueError: the id cannot name an executor of this fleet (not one of its dial
                entries, and -- listening with a keyring -- not a valid key file name).
            RuntimeError: the fleet is not entered, or closed.
        """
        member = self._members.get(executor_id)
        if member is None:
            self._check_reachable(executor_id)
            member = self._add(executor_id)
        self._pinned.add(executor_id)
        return member

    # -- what a gateway needs of its fleet (internal: api/gateway.py and its parts)

    @property
    def members(self) -> Mapping[str, RemoteExecutor]:
        """Every executor the fleet knows, by id: the fleet's own live mapping, the same object
        for the fleet's whole life (a reader may keep it, and must not change it). Reading it
        never creates a member, unlike :meth:`executor`. Internal: a gateway routes a caller's
        call by a peer-chosen id, and shows its callers the fleet, through it
        (api/_forwarding.py, api/_relaying.py, api/_watches.py)."""
        return self._members

    @property
    def retention(self) -> RetentionPool:
        """The retention budget (``max_total_retained_bytes``) every session of the fleet
        draws on. Internal: a gateway's callers' link draws on it too (api/gateway.py)."""
        return self._retention

    def host(self, guest: WebSocketLink) -> None:
        """Let ``guest`` (a hosted worker-role link: a gateway's callers) share the listener
        (:meth:`WebSocketLink.host`). Before the fleet is entered. Internal: api/gateway.py.

        Raises:
            ConfigError: the fleet does not listen.
        """
        if self._listening is None:
            raise ConfigError("a gateway's fleet must listen: its callers dial it")
        self._listening.host(guest)

    def tap(self, listener: Callable[[FleetEvent], None]) -> None:
        """Call ``listener`` with every event as it is published, before any :meth:`events`
        subscriber sees it; it must be quick and must not raise, and the fleet holds it for its
        whole life. Internal: a gateway's watches (api/gateway.py, which hands it a method of
        its own through a weak reference, so that the fleet it holds holds it back only
        weakly)."""
        self._events.tap(listener)

    def _check_reachable(self, executor_id: str) -> None:
        if self._tg is None or self._closed:
            raise RuntimeError("the fleet is not running: use `async with gl.fleet(config)`")
        if executor_id in self._link_of:
            return
        if self._listening is not None and isinstance(self.config, FleetConfig):
            problem = executor_id_problem(executor_id)
            if problem is None:
                return
            raise ValueError(f"executor id {executor_id!r}: {problem}")
        raise ValueError(
            f"executor {executor_id!r} is not one this fleet serves "
            f"(it serves {sorted(self._link_of)})"
        )

    def _add(self, executor_id: str) -> RemoteExecutor:
        assert self._tg is not None
        link = self._link_of.get(executor_id) or self._listening
        assert link is not None
        member = RemoteExecutor._fleet_member(
            executor_id,
            ExecutorLink(link, executor_id),
            self._registry,
            self.limits,
            self._tg,
            self._on_member_change,
            self._hooks,
            self._stall_watch,
            self._describe,
            # the keyring listener never dials: no refusal or dial failure to hear of
            dials=not (link is self._listening and isinstance(self.config, FleetConfig)),
        )
        self._members[executor_id] = member
        self._offline_at[executor_id] = anyio.current_time()
        return member

    def _route(self, transport: SessionTransport, result: HandshakeResult) -> None:
        executor_id = result.peer.executor
        member = self._members.get(executor_id)
        if member is None:
            if self._closed:
                return
            member = self._add(executor_id)
        if executor_id not in self._joined:
            self._joined.add(executor_id)
            self._publish("joined", executor_id)
        member._on_session(transport, result)

    def _availability_changed(self, member: RemoteExecutor, value: Availability) -> None:
        if value == "offline":
            self._offline_at[member.executor_id] = anyio.current_time()
        self._publish(value, member.executor_id)

    def executors(self) -> dict[str, ExecutorSnapshot]:
        """A snapshot of every executor the fleet knows, by id."""
        out = {}
        for executor_id, member in self._members.items():
            transport = member.link.transport
            out[executor_id] = ExecutorSnapshot(
                executor_id=executor_id,
                availability=member.availability,
                session=transport.session_id.hex()[:12] if transport is not None else None,
                since=member.since,
                calls=member.calls,
                errors=member.errors,
                services=dict(member.versions),
                pending=member.pending_calls,
                reason=_offline_reason(member),
            )
        return out

    async def _forget_loop(self, forget_after: float) -> None:
        assert self._listening is not None
        period = min(max(forget_after / 4, 0.01), 1.0)
        while True:
            await anyio.sleep(period)
            now = anyio.current_time()
            for executor_id, member in list(self._members.items()):
                if (
                    executor_id in self._pinned
                    or member.availability != "offline"
                    or now - self._offline_at.get(executor_id, now) < forget_after
                ):
                    continue
                if self._listening.forget(executor_id):
                    del self._members[executor_id]
                    self._joined.discard(executor_id)
                    self._offline_at.pop(executor_id, None)
                    await member.aclose()
                    self._publish("forgotten", executor_id)

    # ------------------------------------------------------------------ events

    def _publish(self, kind: EventKind, executor_id: str) -> None:
        self._events.publish(kind, executor_id)

    def events(self) -> AsyncIterator[FleetEvent]:
        """Every change from now on, in order, until the fleet closes.

        Bounded: a consumer that falls more than ``events_buffer`` events behind loses the
        oldest, and gets one ``lost`` event saying how many before the next ones.
        """
        return self._events.follow()

    # ------------------------------------------------------------------ fan-out

    def _capable(self, where: Where) -> list[RemoteExecutor]:
        """The routable executors ``where`` admits (module docstring), in id order."""
        if isinstance(where, str):
            service, _, method = where.partition(".")
            admits: Callable[[RemoteExecutor], bool] = lambda member: member.offers(  # noqa: E731
                service, method or None
            )
        else:
            admits = where
        return [
            member
            for _, member in sorted(self._members.items())
            if member.routable and admits(member)
        ]

    def pick(
        self, service: str, method: str | None = None, *, interface: type | None = None
    ) -> RemoteExecutor:
        """The least loaded routable executor that offers ``service`` (and ``method``).

        Args:
            service: the service the call needs.
            method: the method it needs (default: any method of the service).
            interface: also require that method (every method of ``interface`` without
                ``method``) to be compatible with, or additive to, ``interface``
                (:meth:`RemoteExecutor.offers`).

        Returns:
            Of the ``ready``, non-draining executors whose manifest has it, the one with the
            fewest pending calls (equals take turns).

        Raises:
            NotDispatched: code ``NO_EXECUTOR``: none qualifies now (the message says how many
                are ready).
        """
        candidates = self._capable(
            lambda member: member.offers(service, method, interface=interface)
        )
        if not candidates:
            ready = sum(1 for m in self._members.values() if m.routable)
            wanted = service if method is None else f"{service}.{method}"
            raise NotDispatched(
                "NO_EXECUTOR",
                f"no ready executor offers {wanted}"
                + (" compatibly with the interface" if interface is not None else "")
                + f" ({ready} ready)",
            )
        self._turn += 1
        start = self._turn % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda member: member.pending_calls)

    async def map(
        self,
        fn: Callable[[RemoteExecutor], Awaitable[T]],
        ids: Iterable[str] | None = None,
        *,
        concurrency: int = 64,
        where: Where | None = None,
    ) -> dict[str, T | CallError]:
        """Call ``fn(executor)`` for each executor, at most ``concurrency`` at once.

        Args:
            fn: what to do with one executor (typically one facade call).
            ids: which executors (default: every executor the fleet knows now, but those
                ``draining``, which are left out of the result).
            concurrency: the most calls in flight.
            where: only the routable (``ready``, non-draining) executors among those that
                offer what the call needs: ``"service"`` or ``"service.method"`` (their
                manifest has it), or a predicate on a :class:`RemoteExecutor` (e.g.
                ``lambda ex: ex.offers("calc", "mul", interface=CalcV2)``).

        Returns:
            ``{id: value}`` or, for an executor whose call failed, ``{id: CallError}``: one
            failure raises nothing. An executor named in ``ids`` that is ``draining`` (when its
            turn comes) gets ``NotDispatched("DRAINING")`` without ``fn`` being called. Any
            other exception from ``fn`` is a bug in it and propagates.
        """
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        targets = (
            [self.executor(i) for i in ids]
            if ids is not None
            else [m for m in self._members.values() if not _leaving(m)]
        )
        if where is not None:
            capable = {id(member) for member in self._capable(where)}
            targets = [member for member in targets if id(member) in capable]
        results: dict[str, T | CallError] = {}
        limiter = anyio.CapacityLimiter(concurrency)

        async def one(member: RemoteExecutor) -> None:
            async with limiter:
                if _leaving(member):
                    results[member.executor_id] = NotDispatched(
                        "DRAINING", "the worker is draining: new calls are refused"
                    )
                    return
                try:
                    results[member.executor_id] = await fn(member)
                except CallError as exc:
                    results[member.executor_id] = exc

        async with anyio.create_task_group() as tg:
            for member in targets:
                tg.start_soon(one, member)
        return {member.executor_id: results[member.executor_id] for member in targets}


def fleet(
    config: FleetConfig | LinkConfig,
    *,
    services: ServiceMap | None = None,
    limits: Limits | None = None,
    hooks: Sequence[CallHook] = (),
    controller_id: str | None = None,
) -> Fleet:
    """A controller for many executors: ``async with gl.fleet(config) as fleet: ...``.

    ``config`` is a :class:`~garcon_link.FleetConfig` (``gl.load_fleet_config``) or a controller
    :class:`~garcon_link.LinkConfig` (a fleet of one executor). ``controller_id`` replaces the
    config's (docs/guides/many-callers.md): the name every worker knows this controller by.
    """
    if controller_id is not None:
        config = dataclasses.replace(config, controller_id=controller_id)
    return Fleet(config, services=services, limits=limits, hooks=hooks)
