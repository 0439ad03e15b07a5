"""The gateway's relay of one caller's call, stream or notification to an executor.

The relay service (docs/design.md#gateway; the gateway as a whole: :mod:`.gateway`)
---------------------------------------------------------------------------------
Each caller session serves one service, :data:`~garcon_link.api.relay.RELAY_SERVICE`,
by :class:`_Relay`; one object serves every caller session of a
:class:`~garcon_link.api.gateway.Gateway`, and is given the gateway's parts it reads and counts
into (the callers' sessions, the grants' admission, the shares, the callers' counters, what
callers are shown, the forward), never the gateway itself.

A relayed call (``call(executor, service, method, payload, key, timeout)``):

1. **Grant.** :func:`~garcon_link.settings.grants.allows` for (caller, executor, service);
   refused ``Rejected("FORBIDDEN")`` otherwise: nothing is forwarded, and the executor is not
   even looked up (an unknown and an ungranted executor are refused alike).
2. **Executor.** The fleet's member for that id, without creating one (a caller cannot grow the
   registry); absent or not ready: ``NotDispatched`` (``OFFLINE``, ``RECONNECTING``,
   ``DRAINING``), nothing forwarded.
3. **Arguments.** ``payload`` (the CBOR array ``[args, kwargs]``) is *framed* and checked to
   decode as the worker would decode it, nothing converted
   (:func:`~garcon_link.api._framing.relay_arguments`: one walk of the heads), and its
   two items are spliced into a ``call`` envelope on the executor's session
   (:meth:`~garcon_link.rpc.caller.Caller.call_relayed`) with the caller's metadata and
   idempotency key. Badly framed, or not decodable: ``Rejected("INVALID_ARGUMENTS")``, not
   forwarded.
4. **Outcome.** Whatever ended the forwarded call -- its result, or its error with outcome and
   code (``NotDispatched`` if it never left the gateway, ``OutcomeUnknown`` if its answer was
   lost, ``Rejected``/``RemoteError`` as the worker sent them) -- is the relay call's *result*
   (:func:`~garcon_link.api.relay.encode_outcome`), so it crosses the second hop unchanged. The
   relay call itself fails only as any call on the caller's session fails.

On asyncio, with no hooks installed, a unary relay call runs no handler task
(:meth:`~garcon_link.api._forwarding.Forwarder.relay_now`): the steps above are taken in the
dispatch of the caller's message -- read from its bytes, not decoded, when it has the usual shape
(:meth:`~garcon_link.api._forwarding.Forwarder.relay_raw`,
:class:`~garcon_link.api._framing.RelayCallReader`) --, the forward is issued at once
(:meth:`~garcon_link.rpc.caller.Caller.forward`) and the call held in its session's incoming
table (:class:`~garcon_link.api._forwarding._Relayed`); the executor's reply completes it from
the dispatch of *that* session's message. What cannot be done in one step (an executor
reconnecting, a session waiting for capacity, hooks, trio) goes through the relay service's
handler, :meth:`_Relay.call`, with the same outcomes. The forward itself, on either path, and a
keyed call's binding to a worker process are in :mod:`._forwarding`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio

from ..endpoint.transport import SessionTransport
from ..errors import CallError, Rejected
from ..logs import PeerLogLimiter, log_fields, peer_text
from ..rpc.hooks import call_metadata
from ..rpc.interface import MethodKind
from ..rpc.observer import Observed
from ..rpc.rpc import ExecutorRpc, RemoteStream, current_rpc
from ._admission import Admission
from ._caller_stats import CallerBook
from ._forwarding import Forwarder, _relayed_spec, _stream_ended
from ._relay_wire import MAX_DESCRIBE_WAIT, MAX_WATCH_ENTRIES, encode_outcome
from ._shares import Shares
from ._watches import Shown, _Watch
from .controller import RemoteExecutor
from .fleet import Fleet


class _Relay:
    """The relay service (module docstring); one object serves every caller session of a
    gateway, given the gateway's parts it reads (it holds no gateway).

    Args:
        fleet: the gateway's fleet.
        admission: the grants, and the admission of a relayed request.
        shares: the callers' shares of each executor.
        book: each caller's counters, and the pacing of its refusals.
        shown: what callers are shown of the fleet, and their watches.
        forwarder: the forward of relayed calls and streams.
        sessions: by ``id`` of a caller session's transport, its caller, transport and RPC
            (the gateway's, kept current as sessions begin and end).
        log: the limiter of what callers make the gateway log.
    """

    def __init__(
        self,
        fleet: Fleet,
        admission: Admission,
        shares: Shares,
        book: CallerBook,
        shown: Shown,
        forwarder: Forwarder,
        sessions: Mapping[int, tuple[str, SessionTransport, ExecutorRpc]],
        log: PeerLogLimiter,
    ) -> None:
        self._fleet = fleet
        self._admission = admission
        self._shares = shares
        self._book = book
        self._shown = shown
        self._forwarder = forwarder
        self._sessions = sessions
        self._log = log

    def _caller(self) -> str:
        """The caller whose relay call the current handler serves."""
        entry = self._sessions.get(id(current_rpc().transport))
        if entry is None:  # its session ended while the call was being admitted
            raise Rejected("FORBIDDEN", "the caller's session is gone")
        return entry[0]

    async def call(
        self,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> bytes:
        caller = self._caller()
        stats = self._book.stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        try:
            value = await self._forwarder.forward(
                caller, executor, service, method, payload, key, timeout
            )
        except CallError as exc:
            await self._book.failed(caller, exc)
            return encode_outcome(error=exc)
        return encode_outcome(value)

    async def stream(
        self, executor: str, service: str, method: str, payload: bytes
    ) -> AsyncIterator[bytes]:
        caller = self._caller()
        stats = self._book.stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        inner: RemoteStream | None = None
        share: tuple[str, str] | None = None
        member: RemoteExecutor | None = None
        observed: Observed | None = None
        token = object()
        try:
            share, member, inner, observed = await self._forwarder.open_stream(
                caller, executor, service, method, payload
            )
            shares = self._shares
            shares.stream_opened(share, token)
            stats.streams += 1
            # This generator is pulled only when the caller's credit allows one more item, and
            # the inner stream grants the executor credit only as items are taken from it: a
            # stream past its caller's share waits here, and its producer with it.
            async for value in inner:
                stats.stream_items += 1
                yield encode_outcome(value)
                if shares.past(share):
                    await shares.wait_turn(share, token)
        except CallError as exc:
            if member is not None:
                _stream_ended(member, observed, exc)
            await self._book.failed(caller, exc)
            yield encode_outcome(error=exc)
        except BaseException as exc:  # the caller left early, or the gateway is closing
            if member is not None:
                _stream_ended(member, observed, exc)
            raise
        else:
            if member is not None:
                _stream_ended(member, observed, None)
        finally:
            if share is not None:
                stats.streams -= 1
                self._shares.stream_closed(share, token)
                self._shares.give(share)
            if inner is not None:
                await inner.aclose()

    async def notify(self, executor: str, service: str, method: str, payload: bytes) -> None:
        caller = self._caller()
        stats = self._book.stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        try:
            arguments = self._admission.admit(caller, executor, service, method, payload)
            member = self._forwarder.connected(executor)
            rpc = await member.rpc_for_call(0)
            member.calls += 1  # as a direct facade counts a one-way call

            async def send(sent: Mapping[str, str] | None) -> None:
                await rpc.notify_relayed(service, method, arguments, dict(sent) if sent else None)

            # As a forwarded call's: the executor's counters and the gateway's hooks.
            await rpc.observer.call(
                service, _relayed_spec(method, MethodKind.ONEWAY), call_metadata() or None, send
            )
        except CallError as exc:  # a notification has no reply: counted and logged
            await self._book.failed(caller, exc)
            self._log.log(
                caller,
                "notification dropped",  # the limiter's reason: our words, not the code
                "gateway: caller %s: notification to %s dropped: %s",
                peer_text(caller),
                peer_text(executor),
                exc,
                extra=log_fields(caller=caller, executor=executor),
            )

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        caller = self._caller()
        try:
            self._admission.check_visible(caller, executor)
        except Rejected as exc:
            await self._book.failed(caller, exc, counted=False)
            raise
        wait = min(max(wait, 0.0), MAX_DESCRIBE_WAIT) if math.isfinite(wait) else 0.0
        deadline = anyio.current_time() + wait
        while True:
            member = self._fleet.members.get(executor)
            changed = self._shown.changed
            if member is not None and member.availability == "ready":
                break
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            with anyio.move_on_after(remaining):
                await changed.wait()
        return self._shown.entry(caller, executor, member, manifest=True)

    async def executors(self) -> list[dict[str, Any]]:
        caller = self._caller()
        return self._shown.snapshot(caller)

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        caller = self._caller()
        session = id(current_rpc().transport)
        if session in self._shown.watches:
            raise Rejected(
                "ALREADY_WATCHING", "this caller session has a watch open already (one each)"
            )
        watch = _Watch(caller)
        self._shown.watches[session] = watch
        stats = self._book.stats_of(caller)
        stats.watches += 1
        try:
            # Registered and snapshotted with no await between: every later change is pending.
            snapshot = self._shown.snapshot(caller)
            watch.shown.update(entry["executor_id"] for entry in snapshot)
            for start in range(0, max(len(snapshot), 1), MAX_WATCH_ENTRIES):
                yield {
                    "snapshot": True,
                    "last": start + MAX_WATCH_ENTRIES >= len(snapshot),
                    "entries": snapshot[start : start + MAX_WATCH_ENTRIES],
                }
            # Pulled only when the caller's credit allows one more message: while it does not,
            # changes wait in ``watch.pending``, at most one entry per executor.
            while not watch.ended:
                if watch.pending:
                    yield {"entries": self._shown.watch_entries(watch)}
                    continue
                watch.wakeup = anyio.Event()
                await watch.wakeup.wait()
        finally:
            stats.watches -= 1
            if self._shown.watches.get(session) is watch:
                del self._shown.watches[session]
