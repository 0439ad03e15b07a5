"""The gateway: a fleet many programs share, each with its own key and grants.

Theory of operation (docs/design.md#gateway; user guide docs/guides/gateway.md)
------------------------------------------------------------------------------
A :class:`Gateway` is a :class:`~garcon_link.Fleet` (executors dial its listener or are dialed)
whose listener also admits **callers**. Both kinds of peer dial the same ``/executor``: a hello
from a *worker* is an executor's, handled by the fleet's link; a hello from a *controller* is a
caller's, handed to a second, hosted link (``WebSocketLink.host``) that plays the worker to its
callers. That link authenticates each caller by the key ``<callers keyring>/<caller_id>.secret``
(the caller claims its id where a controller claims an executor id), re-reads it every
``key_recheck_interval`` (a deleted key retires that caller's session), and holds at most
``max_callers`` caller sessions (one per caller process; the next is refused with 1013).

Each caller session serves one service, :data:`~garcon_link.api.relay.RELAY_SERVICE`
(:class:`~garcon_link.api.relay.GatewayRelay`): the gateway is a worker to its callers, and the
relay is an ordinary service routing by executor id. That reuses, unchanged, everything a
worker's session has -- resumable sessions, ``max_incoming_calls`` per session as the caller's
budget of calls in flight, metadata, hooks, drain -- and needs no new message kind.

A relayed call's steps (grant, executor, arguments framed and checked but not converted, the
outcome as data) are in :mod:`._relaying`; their forward to the executor, and the direct path of
a unary one without a handler task (:meth:`~._forwarding.Forwarder.relay_now`), in
:mod:`._forwarding`. The gateway's other parts, each one job: the grants and the admission of a
relayed request (:mod:`._admission`), the callers' shares of each executor (:mod:`._shares`),
each caller's counters and the pacing of its refusals (:mod:`._caller_stats`), what callers are
shown of the fleet and their watches (:mod:`._watches`). The gateway itself runs the callers'
sessions and their relay service, and drains.

Bounds: ``max_callers`` sessions; per caller session the worker-side budgets
(``max_incoming_calls`` relayed calls at once, refusal queues, frame rates); per caller and
executor, a share of the gateway's session to that executor (``gateway_caller_share`` of
``max_pending_calls`` calls and streams in flight while it is the only caller active there,
else ``gateway_contended_window`` split evenly between the callers active there, a caller
being active until ``gateway_active_window`` after its last call there ended:
:meth:`Gateway.share_of`; past it ``NotDispatched("OVERLOADED")``, not forwarded), so one
caller cannot fill an executor's session for the others nor queue more than a few calls ahead
of theirs; ``gateway_stream_window_items`` of credit granted the executor per relayed stream,
scaled by its caller's share now over its whole share at each grant
(:meth:`~._shares.Shares.stream_window`: 1 item each for a share of 8 of 64, the whole window again
once the other callers have gone idle), so a caller's streams queue at most its share times
that many items there, about as many as its calls would (streams past a
share that shrank under them take no item until their turn: ``Shares.wait_turn``); ``FORBIDDEN``
answers past a caller's allowance (``gateway_forbidden_rate`` per second after a burst of
``gateway_forbidden_burst``, each paused at most ``gateway_forbidden_delay``; all
:class:`~garcon_link.Limits` fields) wait their turn, so a caller
flooding what it may not call slows itself, not the gateway, and so do ``OVERLOADED`` ones, on
an allowance of their own; the retention budget of the fleet
(``max_total_retained_bytes``) shared by both hops' sessions; per-caller counters for at most
``max_callers`` callers with a session plus as many without.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..core.wire import Role
from ..endpoint.link import LinkStatistics, WebSocketLink
from ..endpoint.transport import SessionTransport, TransportState
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_text
from ..net.backend import on_asyncio
from ..rpc.hooks import CallHook
from ..rpc.manifest import contract_hash
from ..rpc.observer import CallObserver
from ..rpc.pending import loop_clock
from ..rpc.rpc import ExecutorRpc
from ..settings.callers import GatewayConfig
from ..settings.grants import MAX_GRANTS, Grant
from ..settings.keyring import Keyring
from ._admission import Admission
from ._caller_stats import CallerBook, CallerSnapshot
from ._forwarding import Forwarder
from ._framing import RelayCallReader
from ._relay_wire import RELAY_SERVICE, GatewayRelay
from ._relaying import (
    _Relay,
)
from ._shares import Shares
from ._watches import Shown
from .fleet import Fleet, FleetEvent
from .registration import Service, registry_from

__all__ = ["CallerSnapshot", "Gateway", "gateway"]

log = logging.getLogger("garcon_link.gateway")  # the name users configure (README)

P = ParamSpec("P")


def _weak_method(method: Callable[P, object]) -> Callable[P, None]:
    """``method`` (a bound method of the gateway) called through a weak reference to the
    gateway, for what the gateway hands its fleet and its callers' link to keep: the gateway
    holds them, so their holding it would make a reference cycle, and a dropped gateway would
    wait for the cycle collector instead of being freed at once (the transport's parts call
    their owner the same way: ``weak_method`` in ``endpoint/_shared.py``). They call it only
    while the gateway runs; once it is gone the call does nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def _caller_keys(keyring: Keyring) -> Callable[[str], bytes | None]:
    """The callers' link's key lookup: a caller's key, read from ``keyring`` at each handshake
    (a function of the keyring alone, so the link holds no reference to the gateway)."""

    def key(caller_id: str) -> bytes | None:
        secret = keyring.secret_for(caller_id)
        return secret.reveal() if secret is not None else None

    return key


class Gateway:
    """A fleet that admits callers; use ``async with gl.gateway(config) as gw``.

    Bounds between callers (module docstring): per caller and executor, calls and streams in
    flight up to :meth:`share_of` -- ``gateway_caller_share`` of ``max_pending_calls`` for a
    caller alone there, an even split of ``gateway_contended_window`` between the callers
    active there otherwise -- and ``gateway_stream_window_items`` of executor credit per
    relayed stream, scaled by its caller's share as it changes; past a share,
    ``NotDispatched("OVERLOADED")``, never forwarded.

    Args:
        config: a :class:`~garcon_link.GatewayConfig` (``gl.load_gateway_config``).
        limits: overrides the config's limits.
        hooks: per-call hooks: told about every relay call a caller makes (server side) and
            every call forwarded to an executor (client side), so a tracing hook chains caller,
            gateway and worker spans in one trace.

    Attributes:
        fleet: the :class:`~garcon_link.Fleet` of executors (its ``executors()``, ``events()``
            and ``map()`` serve the gateway's own process as any fleet does).
        grants: the grants in force.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        limits: Limits | None = None,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        if not isinstance(config, GatewayConfig):
            raise TypeError(f"gateway() needs a GatewayConfig, got {type(config).__name__}")
        self.config = config
        self.limits = limits or config.limits
        self.fleet = Fleet(config.fleet, limits=self.limits, hooks=hooks)
        # The relay calls' outcome point on the callers' side (server hooks: a tracing hook's
        # span per relay call, the parent of the forwarded call's client span).
        self._observer = CallObserver(hooks, self.limits)
        callers = config.callers
        # The grants, and whether each allows a caller to call a service of an executor.
        self._admission = Admission(callers.grants, self.limits)
        self._max_callers = callers.max_callers
        self._link = WebSocketLink(
            role=Role.WORKER,
            keys=_caller_keys(Keyring(callers.keyring, kind="caller")),
            hosted=True,
            names=("gateway", "caller"),
            limits=dataclasses.replace(self.limits, max_controllers=callers.max_callers),
            retention=self.fleet.retention,
        )
        self.fleet.host(self._link)
        # id(transport) -> its caller, itself, its RPC
        self._sessions: dict[int, tuple[str, SessionTransport, ExecutorRpc]] = {}
        self._draining = False
        # Each caller's counters, and the pacing of its refusals.
        self._book = CallerBook(self.limits, callers.max_callers)
        # Each caller's share of each executor's session: calls and streams in flight.
        self._shares = Shares(self.limits)
        # What callers are shown of the fleet, and every caller session's watch.
        self._shown = Shown(self.fleet, self._admission, self.limits)
        # The forward of the callers' relayed calls and streams to the executors.
        self._forwarder = Forwarder(
            self.fleet, self.limits, self._admission, self._shares, self._book, self._max_callers
        )
        # The fleet and the callers' link reach the gateway weakly (_weak_method): it holds them.
        self.fleet.tap(_weak_method(self._fleet_event))
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        # What callers make the gateway log: one line per caller and reason per log_interval.
        self._log = PeerLogLimiter(
            log, interval=self.limits.log_interval, max_lines=self.limits.max_log_lines
        )
        # The relay service every caller session serves, given the parts it reads.
        relay = _Relay(
            self.fleet,
            self._admission,
            self._shares,
            self._book,
            self._shown,
            self._forwarder,
            self._sessions,
            self._log,
        )
        self._registry = registry_from({RELAY_SERVICE: Service(relay, GatewayRelay)})

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Gateway:
        # The callers' link and the task group that serves its sessions come first: the
        # fleet's listener hands callers to them from its first socket on.
        if on_asyncio():
            self._shares.now = loop_clock(asyncio.get_running_loop())
        self._link.on_session(_weak_method(self._on_session))
        await self._link.__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = self._forwarder.tg = tg
        try:
            await self.fleet.__aenter__()
            tg.start_soon(self._watch_fleet)
        except BaseException:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            await self._link.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self, *, drain: float = 0.0) -> None:
        """Close the fleet and every caller session (pending calls fail honestly). Idempotent.

        Args:
            drain: seconds to drain first: every caller session refuses new relayed calls
                (``NotDispatched("DRAINING")``, never forwarded; its caller is told, as a
                worker's controller is) while the calls already relayed finish and their replies
                are acknowledged; what still runs when the time is up ends as on any close.
        """
        if self._closed:
            return
        if drain > 0:
            await self.drain(drain)
        self._closed = True
        try:
            await self.fleet.aclose()
        finally:
            try:
                if self._tg is not None:
                    self._tg.cancel_scope.cancel()
                    await self._tg.__aexit__(None, None, None)
            finally:
                await self._link.__aexit__(None, None, None)

    async def drain(self, seconds: float) -> bool:
        """Stop admitting relayed calls, and wait up to ``seconds`` for those already relayed to
        finish and be acknowledged (``aclose(drain=...)`` does this first; callable from any
        task). New calls are ``NotDispatched("DRAINING")`` from now on, never forwarded, and
        each caller is told (its gateway session's availability becomes ``draining``). No new
        caller session begins: a fresh caller handshake is refused with 4010 (the caller's calls
        fail ``NotDispatched("DRAINING")`` at once), while a caller whose socket drops resumes
        its session and gets its relayed calls' real outcomes.

        Returns:
            Whether everything finished in time.
        """
        self._draining = True
        # No new caller session: fresh handshakes refused (4010), resumes admitted, so a caller
        # whose socket drops mid-drain still gets its relayed calls' real outcomes.
        self._link.drain()
        self._shown.end_watches()  # a watch never ends by itself: the drain ends it
        rpcs = [rpc for _, _, rpc in self._sessions.values()]
        for rpc in rpcs:
            rpc.start_drain()
        deadline = anyio.current_time() + seconds
        for rpc in rpcs:
            remaining = deadline - anyio.current_time()
            if remaining <= 0 or not await rpc.drained(remaining):
                log.warning("gateway: drain time (%.1fs) is up", seconds)
                return False
        return True

    def caller_link_statistics(self) -> LinkStatistics:
        """The counters of the link that admits callers: handshakes, resumes, refusals
        (``controllers_refused`` past ``max_callers``, ``sessions_refused_draining`` during a
        drain). The executors' are ``fleet.statistics()``."""
        return self._link.statistics()

    @property
    def url(self) -> str:
        """The URL executors and callers dial."""
        return self.fleet.url

    @property
    def listen_address(self) -> tuple[str, int]:
        return self.fleet.listen_address

    async def _watch_fleet(self) -> None:
        async for _event in self.fleet.events():
            self._shown.fleet_changed()

    @property
    def grants(self) -> tuple[Grant, ...]:
        """The grants in force. Replacing them applies to the next relayed request, and every
        caller's watch is told at once of the executors it may now see or no longer see."""
        return self._admission.grants

    @grants.setter
    def grants(self, grants: Sequence[Grant]) -> None:
        grants = tuple(grants)
        if not all(isinstance(grant, Grant) for grant in grants):
            raise TypeError("Gateway.grants takes gl.Grant objects only")
        if len(grants) > MAX_GRANTS:
            raise ValueError(f"{len(grants)} grants, more than {MAX_GRANTS}: merge some")
        self._admission.grants = grants
        self._shown.regranted()

    def _fleet_event(self, event: FleetEvent) -> None:
        self._shown.fleet_event(event)

    # ------------------------------------------------------------------ callers

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        caller = result.peer.executor  # the id the caller proved with its key
        instance = os.urandom(16)
        registry = self._registry  # the session keeps describe(): it holds no gateway

        def describe() -> dict[str, Any]:
            manifest = registry.manifest()
            return {
                "executor_id": caller,
                "instance_id": instance,
                "services": manifest,
                "contract": contract_hash(manifest),
            }

        rpc = ExecutorRpc(
            transport,
            self._registry,
            self.limits,
            describe=describe,
            peer="caller",
            observer=self._observer,
        )
        if self._draining:
            rpc.start_drain()  # one admitted as the drain began admits no call either
        self._sessions[id(transport)] = (caller, transport, rpc)
        self._book.stats_of(caller).sessions += 1
        # A caller with a key can open sessions as fast as handshakes are admitted: its lines
        # go through the per-caller limiter.
        self._log.log(
            caller,
            "session began",
            "gateway: caller %s session %s began",
            peer_text(caller),
            transport.session_id.hex()[:12],
            extra=log_fields(session=transport.session_id, caller=caller),
            level=logging.INFO,
        )
        if on_asyncio() and not self._observer.hooks:
            rpc.serve_directly(functools.partial(self._forwarder.relay_now, caller, rpc))
            reader = RelayCallReader(
                self.limits.max_metadata_entries, self.limits.max_metadata_bytes
            )
            rpc.serve_raw_calls(functools.partial(self._forwarder.relay_raw, caller, rpc, reader))
        assert self._tg is not None
        self._tg.start_soon(self._serve, caller, transport, rpc)

    async def _serve(self, caller: str, transport: SessionTransport, rpc: ExecutorRpc) -> None:
        try:
            await rpc.run()
        finally:
            self._sessions.pop(id(transport), None)
            stats = self._book.stats.get(caller)
            if stats is not None:
                stats.sessions -= 1
            cause = transport.failure
            self._log.log(
                caller,
                "session ended",
                "gateway: caller %s session %s ended%s",
                peer_text(caller),
                transport.session_id.hex()[:12],
                f": {cause}" if cause is not None else "",
                extra=log_fields(session=transport.session_id, caller=caller),
                level=logging.INFO,
            )

    def callers(self) -> dict[str, CallerSnapshot]:
        """Every caller with a session now or lately, by id (copies), with what each holds now:
        its calls and streams in flight against its budget, its open streams and watches."""
        return self._book.snapshots(self._shares.in_flight())

    def caller_sessions(self) -> dict[str, int]:
        """How many live sessions each caller holds now."""
        out: dict[str, int] = {}
        for caller, transport, _ in self._sessions.values():
            if transport.state is not TransportState.RETIRED:
                out[caller] = out.get(caller, 0) + 1
        return out

    def share_of(self, caller: str, executor: str) -> int:
        """How many calls and streams ``caller`` may have in flight to ``executor`` now: its
        whole share (``gateway_caller_share`` of ``max_pending_calls``) while no other caller is
        active there (one with a call or stream in flight there, or one ended within
        ``gateway_active_window``); else ``gateway_contended_window`` divided by the number of
        callers active there, itself included, at least one. Past it, its next call there is
        ``NotDispatched("OVERLOADED")``, never forwarded."""
        return self._shares.share_of(caller, executor)


def gateway(
    config: GatewayConfig, *, limits: Limits | None = None, hooks: Sequence[CallHook] = ()
) -> Gateway:
    """A gateway: ``async with gl.gateway(config) as gw: ...`` (:class:`Gateway`)."""
    return Gateway(config, limits=limits, hooks=hooks)
