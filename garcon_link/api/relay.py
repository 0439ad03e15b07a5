"""A gateway's caller: the :class:`~garcon_link.Fleet` surface over one session to a gateway.

Theory of operation (docs/guides/gateway.md; the gateway's side is
:mod:`garcon_link.api.gateway`)
---------------------------------------------------------------------------------------------
A caller (``role = "caller"``, :class:`~garcon_link.settings.callers.CallerConfig`) dials its
gateway as a controller dials a worker: one logical session, authenticated with the caller's own
key, whose "worker" serves one service, :data:`RELAY_SERVICE`, of interface
:class:`GatewayRelay`. :func:`connect_gateway` returns a :class:`GatewayFleet`, whose
:meth:`~GatewayFleet.executor` handles (:class:`GatewayExecutor`) give the typed and dynamic
facades of :class:`~garcon_link.RemoteExecutor`. A facade call of executor ``X`` is checked and
encoded here, against the caller's interface, exactly as a direct call is; the encoded ``[args,
kwargs]`` travel as one byte string in the relay call ``call(X, service, method, payload, key,
timeout)``. The gateway checks the caller's grant, frames the bytes without decoding them and
forwards them to ``X``'s session; it answers with an *outcome* (:func:`encode_outcome`): the
executor's result, or the error that ended the call on either hop, with its outcome and code.
So the caller raises what a direct call would have raised, and the relay call itself fails
only when the caller-gateway hop fails -- then with that hop's honest outcome
(``NotDispatched`` if the request never left, ``OutcomeUnknown`` if it may have been forwarded).

The relay call's own deadline is the call's ``timeout`` plus ``cancel_grace``: the gateway's
verdict on the forwarded call (a ``TIMEOUT`` with its cancel receipt) arrives before the
caller's own timer would cut the first hop.

Executors a caller may not see (no grant names both) are absent from :meth:`~GatewayFleet.
executors`; their calls are refused ``Rejected("FORBIDDEN")`` by the gateway, never forwarded.

What a caller learns of one executor comes from the relay's ``describe``: its availability,
the manifest of its granted services and their type descriptions (the gateway sends no other
service's). The caller interns the manifest, computes its contract hash itself (as a controller
does a worker's: the executor's own hash covers services the caller may not see, and the gateway
does not send it) and checks the type descriptions as a controller checks a worker's
(:func:`~garcon_link.rpc.typedoc.checked_type_descriptions`): :meth:`GatewayExecutor.info`.
A manifest a controller would not install (malformed, or over ``max_manifest_bytes``) is not
kept: the executor's calls are refused ``NotDispatched("OFFLINE")`` saying why, as a
controller's are while it refuses a worker's session; the contract versions the gateway lists
are kept up to the same size. So a caller keeps a bounded amount of each executor it is shown,
whatever a gateway sends.
An older gateway's answer has no ``types`` (none, then); an older caller does not look them up.

The caller's view of the fleet is pushed: once its session is ready the caller opens the relay
stream ``watch()``, one per session. The gateway sends the snapshot of the executors the caller
may see (in messages of at most :data:`~._relay_wire.MAX_WATCH_ENTRIES` entries, the first and
last marked), then, as the gateway's fleet publishes each event of such an executor, an entry
with that executor's state now and its events (``joined``, ``ready``, ``draining``,
``reconnecting``, ``offline``, ``disposed``, ``forgotten``), in the order they happened.
:meth:`GatewayFleet.executors` is that view and :meth:`GatewayFleet.events` those events, so
both are current within one message of a change. The watch is a relayed stream with credit:
while the caller does not take its messages, the gateway keeps one pending entry per executor
(the latest state wins) with its last :data:`~._relay_wire.MAX_WATCH_EVENTS` events, and counts
the older ones, which the caller's followers get as a ``lost`` event naming the executor.
Replacing the gateway's grants re-filters every watch at once (``joined`` for an executor now
seen, ``forgotten`` for one no longer seen); a revoked caller's session, and its watch, end. A
gateway without ``watch`` (an older one: its manifest lacks it, or it refuses the method) is
polled instead: a snapshot every ``refresh_interval`` seconds
(``Limits.gateway_refresh_interval`` unless given), the events being the changes between two
snapshots. What a gateway sends is a peer's word: an entry naming no executor is ignored, events
that are not known kinds are derived from the state, a message that does not read ends the watch
(a new one begins with a snapshot), a snapshot that is not a list of maps is
``RemoteError("INVALID_RESULT")`` and leaves the view as it was; each is said in a rate-limited
WARNING, and an exception no check foresaw is logged at ERROR with its traceback, never the end
of the fleet.

Streams are relayed with credit end to end: the gateway pulls an item from the executor only
when the caller's credit lets it send one, so a slow caller slows the executor's producer and the
gateway holds at most one window of items per stream. Each item is an encoded outcome too, and a
stream that fails on either hop ends with an error item carrying its outcome and code.
One-way methods are relayed as notifications (no reply, no outcome).

The parts: the relay interface, the outcomes and a call's arguments as encoded here are in
:mod:`._relay_wire` (the gateway reads it too); an executor's handle and the calls of its
facades in :mod:`._relay_executor`; the view of the executors, kept current by the watch or by
snapshots, in :mod:`._relay_view`. This module is the face: :class:`GatewayFleet` and
:func:`connect_gateway`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

import anyio
import anyio.abc

from ..errors import CallError
from ..limits import Limits
from ..rpc.hooks import CallHook
from ..settings.callers import CallerConfig
from ..settings.keyring import executor_id_problem
from ._relay_executor import GatewayExecutor
from ._relay_view import RelayView
from ._relay_wire import RELAY_SERVICE, GatewayRelay, decode_outcome, encode_outcome
from .controller import RemoteExecutor
from .fleet import ExecutorSnapshot, FleetEvent, Where

__all__ = [
    "RELAY_SERVICE",
    "GatewayExecutor",
    "GatewayFleet",
    "GatewayRelay",
    "connect_gateway",
    "decode_outcome",
    "encode_outcome",
]

T = TypeVar("T")


class GatewayFleet:
    """What :func:`connect_gateway` returns: :class:`~garcon_link.Fleet`'s surface over a
    gateway (module docstring). Use ``async with gl.connect_gateway(config) as fleet``.

    Args:
        config: the caller's configuration.
        limits: overrides the config's.
        hooks: per-call hooks told about every call made through the executors' facades.
        refresh_interval: seconds between two snapshots of the executors the caller may see,
            from a gateway without ``watch`` (default: the limits' ``gateway_refresh_interval``).
        events_buffer: events kept per :meth:`events` subscriber.
    """

    def __init__(
        self,
        config: CallerConfig,
        *,
        limits: Limits | None = None,
        hooks: Sequence[CallHook] = (),
        refresh_interval: float | None = None,
        events_buffer: int = 1024,
    ) -> None:
        if not isinstance(config, CallerConfig):
            raise TypeError(f"connect_gateway() needs a CallerConfig, got {type(config).__name__}")
        if refresh_interval is not None and not refresh_interval > 0:
            raise ValueError("refresh_interval must be positive")
        self.config = config
        self.limits = limits or config.limits
        self._gateway = RemoteExecutor(config.link_config(), limits=self.limits)
        self._relay = self._gateway.service(RELAY_SERVICE, GatewayRelay)
        self._view = RelayView(
            config.caller_id,
            self._gateway,
            self._relay,
            self.limits,
            hooks,
            self.limits.gateway_refresh_interval if refresh_interval is None else refresh_interval,
            events_buffer,
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False

    @property
    def caller_id(self) -> str:
        return self.config.caller_id

    @property
    def gateway(self) -> RemoteExecutor:
        """The session to the gateway itself (availability, statistics)."""
        return self._gateway

    async def __aenter__(self) -> GatewayFleet:
        await self._gateway.__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._view.run)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the gateway session (pending calls fail honestly). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._view.events.close()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        await self._gateway.aclose()

    # -- members

    def executor(self, executor_id: str) -> GatewayExecutor:
        """The stable handle of ``executor_id`` (through the gateway).

        Raises:
            ValueError: the id cannot name an executor.
            RuntimeError: the fleet is not entered, or closed.
        """
        if self._tg is None or self._closed:
            raise RuntimeError("the gateway fleet is not running: use `async with`")
        member = self._view.members.get(executor_id)
        if member is None:
            problem = executor_id_problem(executor_id)
            if problem is not None:
                raise ValueError(f"executor id {executor_id!r}: {problem}")
            member = self._view.member(executor_id)
        return member

    def executors(self) -> dict[str, ExecutorSnapshot]:
        """The executors this caller may see, as the gateway last reported them (pushed as they
        change; from a gateway without ``watch``, every ``refresh_interval`` and at
        :meth:`refresh`)."""
        return self._view.executors()

    async def refresh(self) -> dict[str, ExecutorSnapshot]:
        """Ask the gateway now; returns :meth:`executors`. While the gateway's ``watch`` is
        open, the view it keeps is the answer (the gateway is not asked): a snapshot applied
        beside the watch would publish again the changes the watch delivers.

        Raises:
            CallError: the gateway session failed, or its answer does not read:
                ``RemoteError("INVALID_RESULT")`` saying what it was (not a list of executors'
                maps); the view is kept as it was.
        """
        return await self._view.refresh()

    # -- events

    def events(self) -> AsyncIterator[FleetEvent]:
        """Every change of the executors this caller may see, as the gateway pushes it (or,
        from a gateway without ``watch``, between two snapshots: module docstring), bounded as
        :meth:`Fleet.events <garcon_link.Fleet.events>` is."""
        return self._view.events.follow()

    # -- fan-out

    async def map(
        self,
        fn: Callable[[GatewayExecutor], Awaitable[T]],
        ids: Iterable[str] | None = None,
        *,
        concurrency: int = 64,
        where: Where | None = None,
    ) -> dict[str, T | CallError]:
        """:meth:`Fleet.map <garcon_link.Fleet.map>` through the gateway: ``fn(executor)`` for
        each executor (default: every one this caller may see, but those ``draining``), at most
        ``concurrency`` at once; ``{id: value | CallError}``."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if ids is not None:
            targets = [self.executor(i) for i in ids]
        else:
            members = self._view.members
            targets = [
                members[i] for i in self._view.visible if members[i].availability != "draining"
            ]
        if where is not None:
            if isinstance(where, str):
                service, _, method = where.partition(".")
                targets = [m for m in targets if m.routable and m.offers(service, method or None)]
            else:
                admits = cast("Callable[[Any], bool]", where)
                targets = [m for m in targets if m.routable and admits(m)]
        results: dict[str, T | CallError] = {}
        limiter = anyio.CapacityLimiter(concurrency)

        async def one(member: GatewayExecutor) -> None:
            async with limiter:
                try:
                    results[member.executor_id] = await fn(member)
                except CallError as exc:
                    results[member.executor_id] = exc

        async with anyio.create_task_group() as tg:
            for member in targets:
                tg.start_soon(one, member)
        return {member.executor_id: results[member.executor_id] for member in targets}


def connect_gateway(
    config: CallerConfig,
    *,
    limits: Limits | None = None,
    hooks: Sequence[CallHook] = (),
    refresh_interval: float | None = None,
) -> GatewayFleet:
    """A caller's fleet through a gateway: ``async with gl.connect_gateway(config) as fleet``.

    ``config`` is a :class:`~garcon_link.CallerConfig` (``gl.load_caller_config``). The result
    has :class:`~garcon_link.Fleet`'s surface (``executor(id)`` with typed and dynamic facades,
    ``executors()``, ``events()``, ``map()``), so code written against an in-process fleet runs
    unchanged; see docs/guides/gateway.md for what each outcome means across the two hops.
    """
    return GatewayFleet(config, limits=limits, hooks=hooks, refresh_interval=refresh_interval)
