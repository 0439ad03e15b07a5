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
outcome as data), and the direct path of a unary one without a handler task
(:meth:`Gateway._relay_now`), are in :mod:`._relaying`; a caller's watch of the executors it
may see is in :mod:`._watches`.

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
(:meth:`Gateway._stream_window`: 1 item each for a share of 8 of 64, the whole window again
once the other callers have gone idle), so a caller's streams queue at most its share times
that many items there, about as many as its calls would (streams past a
share that shrank under them take no item until their turn: ``_wait_turn``); ``FORBIDDEN``
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
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..core.wire import Role, encode_canonical
from ..endpoint.link import LinkStatistics, WebSocketLink
from ..endpoint.transport import SessionTransport, TransportState
from ..errors import CallError, NotDispatched, OutcomeUnknown, Rejected
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_text
from ..net.backend import on_asyncio
from ..rpc.envelopes import Call
from ..rpc.hooks import CallHook, call_metadata
from ..rpc.idempotency import key_problem
from ..rpc.interface import MethodKind
from ..rpc.manifest import contract_hash
from ..rpc.observer import CallObserver, Observed
from ..rpc.rpc import ExecutorRpc, Incoming, RemoteStream, current_rpc
from ..settings.callers import GatewayConfig
from ..settings.grants import MAX_GRANTS, Grant, allows, sees
from ..settings.keyring import Keyring, executor_id_problem
from ._framing import read_relay_call, relay_arguments
from ._relay_wire import MAX_WATCH_ENTRIES, RELAY_SERVICE, GatewayRelay, encode_outcome
from ._relaying import (
    _MAX_HEAD_ID,
    _MAX_TIMEOUT_INT,
    CallerSnapshot,
    _Bindings,
    _ignore_cancel,
    _Relay,
    _Relayed,
    _relayed_spec,
    _result_envelope,
)
from ._watches import _Watch
from .controller import RemoteExecutor
from .facades import counts_as_error
from .fleet import Fleet, FleetEvent
from .registration import Service, registry_from

__all__ = ["CallerSnapshot", "Gateway", "gateway"]

log = logging.getLogger("garcon_link.gateway")  # the name users configure (README)

MAX_NAME_CHARS = 256
"""The longest service or method name a relayed request may carry."""
MAX_ACTIVE_EXECUTORS = 4096
"""Executors whose callers the gateway remembers (:meth:`Gateway.share_of`) before it forgets
those where every caller went idle."""
MAX_VERDICTS = 4096
"""Grant verdicts, by (caller, executor, service), the gateway remembers
(:meth:`Gateway._allowed`); one more clears them all."""
_DESCRIBE_SLACK = 64 * 1024
"""Bytes of a ``describe`` answer kept for what is neither manifest nor types (its envelope,
the executor id, availability and versions)."""


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
        self._grants: tuple[Grant, ...] = callers.grants
        self._keyring = Keyring(callers.keyring, kind="caller")
        self._max_callers = callers.max_callers
        self._link = WebSocketLink(
            role=Role.WORKER,
            keys=self._caller_key,
            hosted=True,
            names=("gateway", "caller"),
            limits=dataclasses.replace(self.limits, max_controllers=callers.max_callers),
            retention=self.fleet._retention,
        )
        self.fleet._host(self._link)
        self._registry = registry_from({RELAY_SERVICE: Service(_Relay(self), GatewayRelay)})
        # id(transport) -> its caller, itself, its RPC
        self._sessions: dict[int, tuple[str, SessionTransport, ExecutorRpc]] = {}
        self._draining = False
        self._stats: dict[str, CallerSnapshot] = {}
        self._bindings: dict[str, _Bindings] = {}  # by caller
        # (caller, executor) -> calls and streams in flight (only those above zero).
        self._in_flight: dict[tuple[str, str], int] = {}
        # executor -> {caller: when its last call or stream there began or ended}: the callers
        # active on it (_take_share); a caller's entry goes once it is idle past the window.
        self._active: dict[str, dict[str, float]] = {}
        # (caller, executor) -> its relayed streams there, in the order they opened (_wait_turn).
        self._streams: dict[tuple[str, str], dict[object, None]] = {}
        # executor -> set (and replaced) when a call or stream there ends (_wait_turn).
        self._ended: dict[str, anyio.Event] = {}
        # caller -> (FORBIDDEN allowance left, when it was last counted): _failed().
        self._forbidden: dict[str, tuple[float, float]] = {}
        # caller -> the same, for the OVERLOADED answers of the gateway's shares.
        self._overloaded: dict[str, tuple[float, float]] = {}
        self._share = max(1, int(self.limits.max_pending_calls * self.limits.gateway_caller_share))
        # (caller, executor, service) -> whether a grant allows it, for the grants in
        # ``_verdicts_of`` (replacing ``grants`` forgets them); only well-formed names enter.
        self._verdicts: dict[tuple[str, str, str], bool] = {}
        self._verdicts_of: tuple[Grant, ...] = self.grants
        self._changed = anyio.Event()
        # id(transport) -> the watch of that caller session (one each)
        self._watches: dict[int, _Watch] = {}
        self.fleet._tap(self._fleet_event)
        self._tg: anyio.abc.TaskGroup | None = None
        # The loop's clock, looked up once (anyio.current_time looks up the backend per call).
        self._now: Callable[[], float] = anyio.current_time
        self._closed = False
        # What callers make the gateway log: one line per caller and reason per log_interval.
        self._log = PeerLogLimiter(
            log, interval=self.limits.log_interval, max_lines=self.limits.max_log_lines
        )

    def _caller_key(self, caller_id: str) -> bytes | None:
        secret = self._keyring.secret_for(caller_id)
        return secret.reveal() if secret is not None else None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Gateway:
        # The callers' link and the task group that serves its sessions come first: the
        # fleet's listener hands callers to them from its first socket on.
        if on_asyncio():
            self._now = asyncio.get_running_loop().time
        self._link.on_session(self._on_session)
        await self._link.__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
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
        for watch in self._watches.values():
            watch.end()  # a watch never ends by itself: the drain ends it
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
            self._changed.set()
            self._changed = anyio.Event()

    @property
    def grants(self) -> tuple[Grant, ...]:
        """The grants in force. Replacing them applies to the next relayed request, and every
        caller's watch is told at once of the executors it may now see or no longer see."""
        return self._grants

    @grants.setter
    def grants(self, grants: Sequence[Grant]) -> None:
        grants = tuple(grants)
        if not all(isinstance(grant, Grant) for grant in grants):
            raise TypeError("Gateway.grants takes gl.Grant objects only")
        if len(grants) > MAX_GRANTS:
            raise ValueError(f"{len(grants)} grants, more than {MAX_GRANTS}: merge some")
        self._grants = grants
        for watch in self._watches.values():
            for executor_id in sorted(watch.shown):
                if not sees(self._grants, watch.caller, executor_id):
                    watch.note(executor_id, "forgotten")
            for executor_id, member in self.fleet._each_member():
                if executor_id not in watch.shown and sees(self._grants, watch.caller, executor_id):
                    watch.note(executor_id, "joined")
                    if member.availability != "offline":
                        watch.note(executor_id, member.availability)

    def _fleet_event(self, event: FleetEvent) -> None:
        """Pass one of the fleet's events to every watch whose caller may see its executor."""
        if event.kind == "lost" or not self._watches:
            return
        for watch in self._watches.values():
            if sees(self._grants, watch.caller, event.executor_id):
                watch.note(event.executor_id, event.kind)

    def _snapshot(self, caller: str) -> list[dict[str, Any]]:
        """Every executor ``caller`` may see, as :meth:`_entry` shows it."""
        grants = self._grants
        return [
            self._entry(caller, executor_id, member)
            for executor_id, member in self.fleet._each_member()
            if sees(grants, caller, executor_id)
        ]

    def _watch_entries(self, watch: _Watch) -> list[dict[str, Any]]:
        """Take up to :data:`~garcon_link.api._relay_wire.MAX_WATCH_ENTRIES` executors' pending
        events from ``watch``, each with its executor's state now (the latest state wins)."""
        entries: list[dict[str, Any]] = []
        pending = watch.pending
        while pending and len(entries) < MAX_WATCH_ENTRIES:
            executor_id = next(iter(pending))
            kinds, dropped = pending.pop(executor_id)
            member = self.fleet._member(executor_id)
            if member is None or not sees(self._grants, watch.caller, executor_id):
                entry: dict[str, Any] = {"executor_id": executor_id, "gone": True}
            else:
                entry = self._entry(watch.caller, executor_id, member)
            entry["events"] = list(kinds)
            if dropped:
                entry["lost"] = dropped
            entries.append(entry)
        return entries

    # ------------------------------------------------------------------ callers

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        caller = result.peer.executor  # the id the caller proved with its key
        instance = os.urandom(16)

        def describe() -> dict[str, Any]:
            manifest = self._registry.manifest()
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
        self._stats_of(caller).sessions += 1
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
            rpc.serve_directly(functools.partial(self._relay_now, caller, rpc))
            rpc.serve_raw_calls(functools.partial(self._relay_raw, caller, rpc))
        assert self._tg is not None
        self._tg.start_soon(self._serve, caller, transport, rpc)

    async def _serve(self, caller: str, transport: SessionTransport, rpc: ExecutorRpc) -> None:
        try:
            await rpc.run()
        finally:
            self._sessions.pop(id(transport), None)
            stats = self._stats.get(caller)
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

    def _caller(self) -> str:
        """The caller whose relay call the current handler serves."""
        entry = self._sessions.get(id(current_rpc().transport))
        if entry is None:  # its session ended while the call was being admitted
            raise Rejected("FORBIDDEN", "the caller's session is gone")
        return entry[0]

    def _stats_of(self, caller: str) -> CallerSnapshot:
        stats = self._stats.get(caller)
        if stats is None:
            if len(self._stats) >= 2 * self._max_callers:
                for old_id, old in list(self._stats.items()):
                    if old.sessions <= 0:
                        del self._stats[old_id]
                        break
            stats = self._stats[caller] = CallerSnapshot(caller)
        return stats

    async def _failed(self, caller: str, exc: CallError, *, counted: bool = True) -> None:
        """Count a relayed request's failure; a ``FORBIDDEN`` one past the caller's allowance
        (``gateway_forbidden_rate`` per second, bursts of ``gateway_forbidden_burst``) is answered
        only after a pause, up to ``gateway_forbidden_delay``: a caller that keeps asking for
        what it may not have holds its own handler slots (``max_incoming_calls``) and slows
        itself down, not the gateway. The answer is the same, only later. An ``OVERLOADED``
        one (a caller past its share of an executor, asking again at once) is paced alike, on
        an allowance of its own."""
        stats = self._stats_of(caller)
        if counted:
            stats.errors += 1
        if exc.code == "FORBIDDEN":
            stats.forbidden += 1
            await self._pace(self._forbidden, caller)
        elif exc.code == "OVERLOADED":
            stats.overloaded += 1
            await self._pace(self._overloaded, caller)

    async def _pace(self, buckets: dict[str, tuple[float, float]], caller: str) -> None:
        """Take one refusal from ``caller``'s allowance in ``buckets``; past it, pause."""
        now = anyio.current_time()
        limits = self.limits
        rate, burst = limits.gateway_forbidden_rate, limits.gateway_forbidden_burst
        tokens, since = buckets.get(caller, (burst, now))
        tokens = min(burst, tokens + (now - since) * rate) - 1
        if len(buckets) >= 2 * self._max_callers and caller not in buckets:
            buckets.pop(next(iter(buckets)))
        buckets[caller] = (max(tokens, -rate * limits.gateway_forbidden_delay), now)
        if tokens < 0:
            await anyio.sleep(min(-tokens / rate, limits.gateway_forbidden_delay))

    def callers(self) -> dict[str, CallerSnapshot]:
        """Every caller with a session now or lately, by id (copies), with what each holds now:
        its calls and streams in flight against its budget, its open streams and watches."""
        budget = self.limits.max_incoming_calls
        out = {
            k: dataclasses.replace(v, in_flight=0, budget=max(v.sessions, 0) * budget)
            for k, v in self._stats.items()
        }
        for (caller, _executor), held in self._in_flight.items():
            snap = out.get(caller)
            if snap is not None:
                snap.in_flight += held
        return out

    def caller_sessions(self) -> dict[str, int]:
        """How many live sessions each caller holds now."""
        out: dict[str, int] = {}
        for caller, transport, _ in self._sessions.values():
            if transport.state is not TransportState.RETIRED:
                out[caller] = out.get(caller, 0) + 1
        return out

    # ------------------------------------------------------------------ the relay

    def _check_visible(self, caller: str, executor: str) -> None:
        problem = executor_id_problem(executor)
        if problem is not None:
            raise Rejected("INVALID_ARGUMENTS", f"executor id {peer_text(executor)}: {problem}")
        if not sees(self.grants, caller, executor):
            raise Rejected(
                "FORBIDDEN", f"caller {caller!r} has no grant for executor {peer_text(executor)}"
            )

    def _entry(
        self, caller: str, executor: str, member: RemoteExecutor | None, *, manifest: bool = False
    ) -> dict[str, Any]:
        """What a caller is shown of one executor: its granted services only."""
        if member is None:
            return {"executor_id": executor, "availability": "offline", "services": {}}
        grants = [g for g in self.grants if g.names(caller, executor)]
        versions = {
            name: version
            for name, version in member.versions.items()
            if any(g.covers(name) for g in grants)
        }
        entry: dict[str, Any] = {
            "executor_id": executor,
            "availability": member.availability,
            "since": member.since,
            "services": versions,
        }
        if manifest and member.versions:
            services = member._manifest()
            granted = {name: services[name] for name in versions if name in services}
            entry["manifest"] = granted
            entry["types"] = self._granted_types(member, granted)
        return entry

    def _granted_types(self, member: RemoteExecutor, granted: Mapping[str, Any]) -> dict[str, Any]:
        """The executor's type descriptions of the ``granted`` services only (as the gateway's
        fleet checked them when the executor described itself), within what one ``describe``
        answer carries: a frame less a whole manifest. Each is at most the fleet's
        ``type_description_bytes``, so only when that many of them could be over the budget are
        they measured, and one past it is replaced by a note (they are documentation)."""
        info = member._info
        if info is None:
            return {}
        kept = {name: info.types[name] for name in granted if name in info.types}
        budget = self.limits.max_frame_bytes - self.limits.max_manifest_bytes - _DESCRIBE_SLACK
        if len(kept) * member.limits.type_description_bytes <= budget:
            return kept
        for name, description in kept.items():
            size = len(encode_canonical(description))
            if size <= budget:
                budget -= size
            else:
                kept[name] = {"note": "dropped: over what one describe answer of a gateway holds"}
        return kept

    def _admit(
        self, caller: str, executor: str, service: str, method: str, payload: bytes
    ) -> bytes:
        """The grant and the framing of one relayed request (:mod:`._relaying`, steps 1 and 3):
        its ``args`` and ``kwargs`` items, or the refusal."""
        if len(method) > MAX_NAME_CHARS:
            raise Rejected(
                "INVALID_ARGUMENTS", f"service and method names are at most {MAX_NAME_CHARS} long"
            )
        verdict = (
            self._verdicts.get((caller, executor, service))
            if self._grants is self._verdicts_of
            else None
        )
        if verdict is None:
            verdict = self._allowed(caller, executor, service)
        if not verdict:
            raise Rejected(
                "FORBIDDEN",
                f"caller {caller!r} has no grant for {peer_text(service)} on executor "
                f"{peer_text(executor)}; nothing was forwarded",
            )
        # Framed, and refused if a worker's decoder would refuse them (text that is not UTF-8,
        # a bignum past its bound or around other than bytes, an array as a map key), so that
        # every call forwarded is one the worker reads; the bytes forwarded as they came.
        return relay_arguments(payload, self.limits.max_frame_bytes)

    def _allowed(self, caller: str, executor: str, service: str) -> bool:
        """Whether a grant allows ``caller`` to call ``service`` on ``executor``, remembered
        (at most :data:`MAX_VERDICTS`) so that a call repeated costs one lookup.

        Raises:
            Rejected: ``INVALID_ARGUMENTS``: a malformed executor id or too long a name.
        """
        grants = self.grants
        if grants is not self._verdicts_of:
            self._verdicts.clear()
            self._verdicts_of = grants
        key = (caller, executor, service)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            return verdict
        problem = executor_id_problem(executor)
        if problem is not None:
            raise Rejected("INVALID_ARGUMENTS", f"executor id {peer_text(executor)}: {problem}")
        if len(service) > MAX_NAME_CHARS:
            raise Rejected(
                "INVALID_ARGUMENTS", f"service and method names are at most {MAX_NAME_CHARS} long"
            )
        if len(self._verdicts) >= MAX_VERDICTS:
            self._verdicts.clear()
        verdict = self._verdicts[key] = allows(grants, caller, executor, service)
        return verdict

    def _connected(self, executor: str) -> RemoteExecutor:
        member = self.fleet._member(executor)
        if member is None:
            raise NotDispatched(
                "OFFLINE", f"executor {peer_text(executor)} is not connected to the gateway"
            )
        return member

    async def _open_stream(
        self, caller: str, executor: str, service: str, method: str, payload: bytes
    ) -> tuple[tuple[str, str], RemoteExecutor, RemoteStream, Observed | None]:
        """A relayed stream, admitted, within its caller's share (given back by the caller of this
        once the stream ends), granting the executor ``gateway_stream_window_items``, and its
        executor and its hooks' handle: the caller of this ends it
        (:func:`~garcon_link.api._relaying._stream_ended`)."""
        arguments = self._admit(caller, executor, service, method, payload)
        member = self._connected(executor)
        share = self._take_share(caller, executor)
        try:
            rpc = await member._rpc_for_call(self.limits.dispatch_deadline)
        except BaseException:
            self._give_share(share)
            raise
        metadata: Mapping[str, str] = call_metadata()
        observer = member._observer
        # As a forwarded call's: a tracing hook's client span is the child of the relay
        # stream's server span, and its context replaces the caller's in the metadata sent.
        observed = observer.stream_started(
            service, _relayed_spec(method, MethodKind.STREAM), metadata or None
        )
        if observed is not None:
            metadata = observed.info.metadata
            try:
                observer.check_metadata(metadata)
            except CallError as exc:
                self._give_share(share)
                observer.client_ended(observed, exc.outcome, exc.code, False)
                raise
        member.calls += 1
        window_now = functools.partial(self._stream_window, caller, executor)
        stream = rpc.stream_relayed(
            service, method, arguments, dict(metadata) or None, window_now(), window_now
        )
        return share, member, stream, observed

    async def _forward(
        self,
        caller: str,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> Any:
        arguments = self._admit(caller, executor, service, method, payload)
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise Rejected("INVALID_ARGUMENTS", "timeout must be a positive number of seconds")
        if key is not None and (why := key_problem(key)) is not None:
            raise Rejected("INVALID_ARGUMENTS", why)
        member = self._connected(executor)
        share = self._take_share(caller, executor)
        try:
            return await self._forward_to(
                caller, member, executor, service, method, arguments, key, timeout
            )
        finally:
            self._give_share(share)

    def _relay_now(
        self, caller: str, rpc: ExecutorRpc, envelope: Call, metadata: Mapping[str, str]
    ) -> bool:
        """A unary relay call without a handler task (``Dispatcher.direct``; docs/design.md
        #gateway): checked (grant, framing, bounds, share, binding) and forwarded on the
        executor's session from the dispatch of the caller's message, and answered from the
        dispatch of the executor's reply, whose value's bytes pass through undecoded. ``False``
        (nothing counted, nothing sent) for what the relay service's handler does instead: any
        other call, an unusual shape, an executor not ready this instant, a session that must
        wait for capacity."""
        if (
            envelope.id > _MAX_HEAD_ID  # its reply, written by hand, needs the id in one head
            or envelope.method != "call"
            or envelope.service != RELAY_SERVICE
            or envelope.key is not None
            or envelope.kwargs
            or type(envelope.args) is not list
            or len(envelope.args) != 6
        ):
            return False
        executor, service, method, payload, key, timeout = envelope.args
        if (
            type(executor) is not str
            or type(service) is not str
            or type(method) is not str
            or type(payload) is not bytes
            or (key is not None and type(key) is not bytes)
        ):
            return False
        return self._relay_call(
            caller, rpc, envelope.id, executor, service, method, payload, key, timeout, metadata
        )

    def _relay_raw(self, caller: str, rpc: ExecutorRpc, data: bytes) -> bool:
        """:meth:`_relay_now` for a relay call read from its envelope's bytes, undecoded
        (:meth:`ExecutorRpc.serve_raw_calls`; :func:`~garcon_link.api._framing.read_relay_call`):
        one of the usual shape, its metadata (if any) forwarded as the bytes it came as, that
        the session admits now. ``False`` (nothing counted, nothing sent, the call id not taken)
        for any other: it goes the usual way."""
        limits = rpc.limits
        read = read_relay_call(data, limits.max_metadata_entries, limits.max_metadata_bytes)
        if read is None:
            return False
        (call_id, executor, service, method, payload, key, timeout), metadata = read
        if not rpc.admits_raw_call(call_id):
            return False
        if not self._relay_call(
            caller, rpc, call_id, executor, service, method, payload, key, timeout, metadata
        ):
            return False
        rpc.took_raw_call(call_id)
        return True

    def _relay_call(
        self,
        caller: str,
        rpc: ExecutorRpc,
        call_id: int,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: object,
        metadata: Mapping[str, str] | bytes | None,
    ) -> bool:
        """:meth:`_relay_now` once the relay call's arguments are read (``timeout`` as the
        caller sent it, unchecked; ``metadata`` checked, as a map or its encoding)."""
        if not (
            timeout is None
            or type(timeout) is float
            or (type(timeout) is int and abs(timeout) <= _MAX_TIMEOUT_INT)
        ):
            return False
        try:
            arguments = self._admit(caller, executor, service, method, payload)
            if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
                raise Rejected("INVALID_ARGUMENTS", "timeout must be a positive number of seconds")
            if key is not None and (why := key_problem(key)) is not None:
                raise Rejected("INVALID_ARGUMENTS", why)
            member = self.fleet._members.get(executor) or self._connected(executor)
        except CallError as exc:
            self._counted(caller, payload)
            self._answer_error(caller, rpc, call_id, rpc.hold(call_id, _ignore_cancel), exc)
            return True
        target = member._rpc
        if (
            member._availability != "ready"
            or target is None
            or member._draining
            or member._observer.hooks
        ):
            return False
        try:
            share = self._take_share(caller, executor)
        except CallError as exc:
            self._counted(caller, payload)
            self._answer_error(caller, rpc, call_id, rpc.hold(call_id, _ignore_cancel), exc)
            return True
        seconds = self.limits.call_timeout if timeout is None else float(timeout)
        runtime, state = target.transport.peer_runtime, target.peer_state_id
        slot = (executor, service, method, key) if key is not None else None
        relayed = _Relayed(self, caller, rpc, call_id, member, share, slot, runtime, state, seconds)
        try:
            if slot is not None:
                self._bindings_of(caller).check(slot, runtime, state)
            forward = target.forward(
                service,
                method,
                arguments,
                key,
                metadata if isinstance(metadata, bytes) else dict(metadata) if metadata else None,
                seconds,
                relayed.ended,
            )
        except OutcomeUnknown as exc:  # a binding's verdict: not forwarded, not counted
            self._give_share(share)
            self._counted(caller, payload)
            self._answer_error(caller, rpc, call_id, rpc.hold(call_id, _ignore_cancel), exc)
            return True
        except CallError as exc:  # refused by the executor's session before sending
            self._counted(caller, payload)
            member.calls += 1
            relayed.incoming = rpc.hold(call_id, relayed.cancelled)
            relayed.failed(exc)
            return True
        if forward is None:
            self._give_share(share)
            return False
        stats = self._stats.get(caller) or self._stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        member.calls += 1
        relayed.forward = forward
        relayed.incoming = rpc.hold(call_id, relayed.cancelled)
        return True

    def _counted(self, caller: str, payload: bytes) -> None:
        stats = self._stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)

    def _answer_error(
        self, caller: str, rpc: ExecutorRpc, call_id: int, incoming: Incoming, exc: CallError
    ) -> None:
        """Answer a held relay call with ``exc`` as its outcome, counted (and paced) as
        :meth:`_failed` does: a ``FORBIDDEN`` or ``OVERLOADED`` one from a task that keeps the
        slot while it waits its turn."""
        body = _result_envelope(call_id, encode_outcome(error=exc))
        if exc.code != "FORBIDDEN" and exc.code != "OVERLOADED":
            self._stats_of(caller).errors += 1
            rpc.reply_held(call_id, incoming, body)
            return

        async def paced() -> None:
            await self._failed(caller, exc)
            rpc.reply_held(call_id, incoming, body)

        assert self._tg is not None
        self._tg.start_soon(paced)

    def _take_share(self, caller: str, executor: str) -> tuple[str, str]:
        """Count one more call or stream of ``caller`` in flight to ``executor``, within its
        share of the gateway's session to that executor (:meth:`share_of`), so one caller
        cannot fill it, nor queue much of its work there ahead of another caller's call."""
        share = (caller, executor)
        held = self._in_flight.get(share, 0)
        now = self._now()
        active = self._active.get(executor)
        if active is None:
            if len(self._active) >= MAX_ACTIVE_EXECUTORS:
                self._forget_idle(now)
            active = self._active[executor] = {}
        active[caller] = now
        limit = self._share
        if len(active) > 1:
            self._forget_idle_callers(executor, active, now)
            limit = self._limit(len(active))
        if held >= limit:
            raise NotDispatched(
                "OVERLOADED",
                f"caller {caller!r} has {held} calls in flight to executor "
                f"{peer_text(executor)}, its share of the gateway's session to it now ({limit}: "
                f"gateway_caller_share of max_pending_calls while it is the only caller active "
                f"there, else gateway_contended_window split between the callers active "
                f"there); nothing was forwarded",
            )
        self._in_flight[share] = held + 1
        return share

    def _give_share(self, share: tuple[str, str]) -> None:
        held = self._in_flight.get(share, 0) - 1
        if held > 0:
            self._in_flight[share] = held
        else:
            self._in_flight.pop(share, None)
        active = self._active.get(share[1])
        if active is not None:
            active[share[0]] = self._now()
        ended = self._ended.pop(share[1], None)
        if ended is not None:
            ended.set()

    def _stream_window(self, caller: str, executor: str) -> int:
        """The credit, in items, a relayed stream of ``caller``'s to ``executor`` keeps granted
        it, asked at each grant: ``gateway_stream_window_items`` scaled by the caller's share
        there now (:meth:`share_of`) over its whole share, at least 1. Alone, a stream keeps
        the whole window; beside other callers, a caller's streams together hold about as many
        items on the executor's session ahead of another caller's reply as its share holds
        calls (8 streams of 1 item by default, not of 8), and the window grows back once the
        others have gone idle."""
        share = self.share_of(caller, executor)
        return max(1, self.limits.gateway_stream_window_items * share // self._share)

    def _limit_now(self, executor: str) -> int:
        """A caller's share of ``executor`` now, counting every caller remembered active there
        (idle ones included until :meth:`_take_share` or :meth:`_wait_turn` forgets them)."""
        active = self._active.get(executor)
        return self._limit(len(active)) if active else self._share

    async def _wait_turn(self, share: tuple[str, str], token: object) -> None:
        """Hold a relayed stream (no item taken from the executor, so no credit granted it)
        while its caller is past its share of the executor and this stream is not among the
        first of its streams there, in opening order, that the share covers: when another
        caller arrives, a caller's streams opened while it was alone go on a share's worth at a
        time. Rechecked as each call or stream there ends, and every ``gateway_active_window``
        (the other callers may have gone idle)."""
        executor = share[1]
        while True:
            now = anyio.current_time()
            active = self._active.get(executor)
            if active is not None:
                self._forget_idle_callers(executor, active, now)
            limit = self._limit(len(active)) if active else self._share
            if self._in_flight.get(share, 0) <= limit:
                return
            streams = self._streams.get(share, {})
            for rank, other in enumerate(streams):
                if other is token:
                    return
                if rank + 1 >= limit:
                    break
            ended = self._ended.get(executor)
            if ended is None:
                ended = self._ended[executor] = anyio.Event()
            with anyio.move_on_after(self.limits.gateway_active_window):
                await ended.wait()

    def _limit(self, active: int) -> int:
        """One caller's share of an executor's session while ``active`` callers are active
        there (:meth:`share_of`)."""
        if active <= 1:
            return self._share
        return min(self._share, max(1, self.limits.gateway_contended_window // active))

    def _idle(self, caller: str, executor: str, seen: float, now: float) -> bool:
        return (
            now - seen > self.limits.gateway_active_window
            and (caller, executor) not in self._in_flight
        )

    def _forget_idle_callers(self, executor: str, active: dict[str, float], now: float) -> None:
        for caller, seen in list(active.items()):
            if self._idle(caller, executor, seen, now):
                del active[caller]

    def _forget_idle(self, now: float) -> None:
        """Drop the executors where every caller went idle (``_active`` stays bounded: the
        executors are the fleet's members, and their idle entries go here)."""
        for executor, active in list(self._active.items()):
            self._forget_idle_callers(executor, active, now)
            if not active:
                del self._active[executor]

    def share_of(self, caller: str, executor: str) -> int:
        """How many calls and streams ``caller`` may have in flight to ``executor`` now: its
        whole share (``gateway_caller_share`` of ``max_pending_calls``) while no other caller is
        active there (one with a call or stream in flight there, or one ended within
        ``gateway_active_window``); else ``gateway_contended_window`` divided by the number of
        callers active there, itself included, at least one. Past it, its next call there is
        ``NotDispatched("OVERLOADED")``, never forwarded."""
        now = anyio.current_time()
        active = self._active.get(executor, {})
        others = sum(
            1
            for c, seen in active.items()
            if c != caller and not self._idle(c, executor, seen, now)
        )
        return self._limit(1 + others)

    async def _forward_to(
        self,
        caller: str,
        member: RemoteExecutor,
        executor: str,
        service: str,
        method: str,
        arguments: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> Any:
        rpc = await member._rpc_for_call(self.limits.dispatch_deadline)
        timeout = self.limits.call_timeout if timeout is None else timeout
        runtime, state = rpc.transport.peer_runtime, rpc.peer_state_id
        slot = (executor, service, method, key) if key is not None else None
        if slot is not None:
            self._bindings_of(caller).check(slot, runtime, state)
        metadata: Mapping[str, str] = call_metadata()
        member.calls += 1

        async def attempt(sent: Mapping[str, str] | None) -> Any:
            return await rpc.call_relayed(
                service,
                method,
                arguments,
                timeout=timeout,
                idempotency_key=key,
                metadata=dict(sent) if sent else None,
            )

        try:
            # The executor's outcome point: its counters, and the gateway's hooks (a tracing
            # hook's client span is the child of the relay call's server span, and its context
            # replaces the caller's in the metadata forwarded).
            value = await member._observer.call(
                service, _relayed_spec(method, MethodKind.UNARY), dict(metadata) or None, attempt
            )
        except CallError as exc:
            if counts_as_error(exc):
                member.errors += 1
            if slot is not None:
                bindings = self._bindings_of(caller)
                if isinstance(exc, OutcomeUnknown):
                    bindings.bind(slot, runtime, state, anyio.current_time() + 2 * timeout)
                else:
                    bindings.release(slot)
            raise
        if slot is not None:
            self._bindings_of(caller).release(slot)
        return value

    def _bindings_of(self, caller: str) -> _Bindings:
        bindings = self._bindings.get(caller)
        if bindings is None:
            if len(self._bindings) >= 2 * self._max_callers:
                self._bindings.pop(next(iter(self._bindings)))
            bindings = self._bindings[caller] = _Bindings(self.limits.max_incoming_calls)
        return bindings


def gateway(
    config: GatewayConfig, *, limits: Limits | None = None, hooks: Sequence[CallHook] = ()
) -> Gateway:
    """A gateway: ``async with gl.gateway(config) as gw: ...`` (:class:`Gateway`)."""
    return Gateway(config, limits=limits, hooks=hooks)
