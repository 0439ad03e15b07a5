"""The gateway's relay of one caller's call, stream or notification to an executor.

The relay service (docs/design.md#gateway; the gateway as a whole: :mod:`.gateway`)
---------------------------------------------------------------------------------
Each caller session serves one service, :data:`~garcon_link.api.relay.RELAY_SERVICE`,
by :class:`_Relay`; one object serves every caller session of a
:class:`~garcon_link.api.gateway.Gateway`, which keeps what the relay reads and counts (the
callers' sessions, grants, shares, bindings and statistics: :class:`_Host`).

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
(:meth:`~garcon_link.api.gateway.Gateway._relay_now`): the steps above are taken in the dispatch of
the caller's message -- read from its bytes, not decoded, when it has the usual shape
(:meth:`~garcon_link.api.gateway.Gateway._relay_raw`,
:func:`~garcon_link.api._framing.read_relay_call`)
--, the forward is issued at once (:meth:`~garcon_link.rpc.caller.Caller.forward`)
and the call held in its session's incoming table (:class:`_Relayed`); the executor's reply
completes it from the dispatch of *that* session's message, a whole result's value passed on as the
bytes it arrived as. What cannot be done in one step (an executor reconnecting, a session waiting
for capacity, hooks, trio) goes through the relay service's handler, :meth:`_Relay.call`, with the
same outcomes.

Also here, as the relay counts into them: :class:`CallerSnapshot` (one caller's counters,
exported by :mod:`.gateway`), a keyed call's bindings to a worker process (:class:`_Bindings`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from ..core.wire import encode_head
from ..errors import CallError, OutcomeUnknown, Rejected
from ..logs import PeerLogLimiter, log_fields, peer_text
from ..rpc.errorbody import error_envelope
from ..rpc.hooks import call_metadata
from ..rpc.interface import MethodKind, MethodSpec
from ..rpc.observer import Observed, end_of
from ..rpc.rpc import ExecutorRpc, Forward, Incoming, RemoteStream, current_rpc
from ._relay_wire import MAX_DESCRIBE_WAIT, MAX_WATCH_ENTRIES, encode_outcome
from ._watches import _Watch
from .controller import RemoteExecutor
from .facades import counts_as_error
from .fleet import Fleet


@dataclass(slots=True)
class CallerSnapshot:
    """One caller as :meth:`~garcon_link.api.gateway.Gateway.callers` saw it (a statistics snapshot:
    ``StatisticsCollector.add("gateway_callers", gw.callers, label="caller")`` exports it, the
    caller label capped as the executor label is).

    Attributes:
        caller_id: its id (its key file's name).
        sessions: its sessions now (one per caller process).
        calls: relayed calls it made.
        errors: of those, how many ended with an error on either hop (``FORBIDDEN`` included).
        forbidden: of those, how many no grant allowed.
        overloaded: of those, how many ended ``OVERLOADED``, never run: past the caller's share
            of an executor (:meth:`~garcon_link.api.gateway.Gateway.share_of`; not forwarded), or
            refused by the executor. Those its own sessions refused past ``budget`` are not
            relayed calls: its side counts them.
        bytes: argument bytes it sent through the relay.
        in_flight: its relayed calls and streams in flight to executors now (each within its
            share of that executor).
        budget: how many relayed calls and streams its sessions may have in flight at once now
            (``max_incoming_calls`` per session); past it, the next is ``OVERLOADED``.
        streams: its relayed streams open now (counted in ``in_flight`` and ``budget``).
        stream_items: items its relayed streams passed on to it.
        watches: its watches open now (at most one per session).
    """

    caller_id: str
    sessions: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    calls: int = 0
    errors: int = 0
    forbidden: int = 0
    overloaded: int = 0
    bytes: int = 0
    in_flight: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    budget: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    streams: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    stream_items: int = 0
    watches: int = dataclasses.field(default=0, metadata={"metric": "gauge"})


class _Host(Protocol):
    """What :class:`_Relay` and :class:`_Relayed` use of their
    :class:`~garcon_link.api.gateway.Gateway` (which imports this module, so it is named here by
    what it offers)."""

    fleet: Fleet
    _changed: anyio.Event
    _in_flight: dict[tuple[str, str], int]
    _streams: dict[tuple[str, str], dict[object, None]]
    _watches: dict[int, _Watch]
    _log: PeerLogLimiter

    def _caller(self) -> str: ...

    def _stats_of(self, caller: str) -> CallerSnapshot: ...

    async def _failed(self, caller: str, exc: CallError, *, counted: bool = True) -> None: ...

    def _check_visible(self, caller: str, executor: str) -> None: ...

    def _entry(
        self, caller: str, executor: str, member: RemoteExecutor | None, *, manifest: bool = False
    ) -> dict[str, Any]: ...

    def _snapshot(self, caller: str) -> list[dict[str, Any]]: ...

    def _watch_entries(self, watch: _Watch) -> list[dict[str, Any]]: ...

    def _admit(
        self, caller: str, executor: str, service: str, method: str, payload: bytes
    ) -> bytes: ...

    def _connected(self, executor: str) -> RemoteExecutor: ...

    async def _open_stream(
        self, caller: str, executor: str, service: str, method: str, payload: bytes
    ) -> tuple[tuple[str, str], RemoteExecutor, RemoteStream, Observed | None]: ...

    async def _forward(
        self,
        caller: str,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> Any: ...

    def _answer_error(
        self, caller: str, rpc: ExecutorRpc, call_id: int, incoming: Incoming, exc: CallError
    ) -> None: ...

    def _give_share(self, share: tuple[str, str]) -> None: ...

    def _limit_now(self, executor: str) -> int: ...

    async def _wait_turn(self, share: tuple[str, str], token: object) -> None: ...

    def _bindings_of(self, caller: str) -> _Bindings: ...


class _Relay:
    """The relay service (module docstring); one object serves every caller session."""

    def __init__(self, gateway: _Host) -> None:
        self._gateway = gateway

    async def call(
        self,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> bytes:
        gateway = self._gateway
        caller = gateway._caller()
        stats = gateway._stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        try:
            value = await gateway._forward(caller, executor, service, method, payload, key, timeout)
        except CallError as exc:
            await gateway._failed(caller, exc)
            return encode_outcome(error=exc)
        return encode_outcome(value)

    async def stream(
        self, executor: str, service: str, method: str, payload: bytes
    ) -> AsyncIterator[bytes]:
        gateway = self._gateway
        caller = gateway._caller()
        stats = gateway._stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        inner: RemoteStream | None = None
        share: tuple[str, str] | None = None
        member: RemoteExecutor | None = None
        observed: Observed | None = None
        token = object()
        try:
            share, member, inner, observed = await gateway._open_stream(
                caller, executor, service, method, payload
            )
            streams = gateway._streams.setdefault(share, {})
            streams[token] = None
            stats.streams += 1
            # This generator is pulled only when the caller's credit allows one more item, and
            # the inner stream grants the executor credit only as items are taken from it: a
            # stream past its caller's share waits here, and its producer with it.
            async for value in inner:
                stats.stream_items += 1
                yield encode_outcome(value)
                if gateway._in_flight.get(share, 0) > gateway._limit_now(executor):
                    await gateway._wait_turn(share, token)
        except CallError as exc:
            if member is not None:
                _stream_ended(member, observed, exc)
            await gateway._failed(caller, exc)
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
                opened = gateway._streams.get(share)
                if opened is not None:
                    opened.pop(token, None)
                    if not opened:
                        del gateway._streams[share]
                gateway._give_share(share)
            if inner is not None:
                await inner.aclose()

    async def notify(self, executor: str, service: str, method: str, payload: bytes) -> None:
        gateway = self._gateway
        caller = gateway._caller()
        stats = gateway._stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        try:
            arguments = gateway._admit(caller, executor, service, method, payload)
            member = gateway._connected(executor)
            rpc = await member._rpc_for_call(0)
            member.calls += 1  # as a direct facade counts a one-way call

            async def send(sent: Mapping[str, str] | None) -> None:
                await rpc.notify_relayed(service, method, arguments, dict(sent) if sent else None)

            # As a forwarded call's: the executor's counters and the gateway's hooks.
            await member._observer.call(
                service, _relayed_spec(method, MethodKind.ONEWAY), call_metadata() or None, send
            )
        except CallError as exc:  # a notification has no reply: counted and logged
            await gateway._failed(caller, exc)
            gateway._log.log(
                caller,
                "notification dropped",  # the limiter's reason: our words, not the code
                "gateway: caller %s: notification to %s dropped: %s",
                peer_text(caller),
                peer_text(executor),
                exc,
                extra=log_fields(caller=caller, executor=executor),
            )

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        gateway = self._gateway
        caller = gateway._caller()
        try:
            gateway._check_visible(caller, executor)
        except Rejected as exc:
            await gateway._failed(caller, exc, counted=False)
            raise
        wait = min(max(wait, 0.0), MAX_DESCRIBE_WAIT) if math.isfinite(wait) else 0.0
        deadline = anyio.current_time() + wait
        while True:
            member = gateway.fleet._member(executor)
            changed = gateway._changed
            if member is not None and member.availability == "ready":
                break
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            with anyio.move_on_after(remaining):
                await changed.wait()
        return gateway._entry(caller, executor, member, manifest=True)

    async def executors(self) -> list[dict[str, Any]]:
        gateway = self._gateway
        caller = gateway._caller()
        return gateway._snapshot(caller)

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        gateway = self._gateway
        caller = gateway._caller()
        session = id(current_rpc().transport)
        if session in gateway._watches:
            raise Rejected(
                "ALREADY_WATCHING", "this caller session has a watch open already (one each)"
            )
        watch = _Watch(caller)
        gateway._watches[session] = watch
        stats = gateway._stats_of(caller)
        stats.watches += 1
        try:
            # Registered and snapshotted with no await between: every later change is pending.
            snapshot = gateway._snapshot(caller)
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
                    yield {"entries": gateway._watch_entries(watch)}
                    continue
                watch.wakeup = anyio.Event()
                await watch.wakeup.wait()
        finally:
            stats.watches -= 1
            if gateway._watches.get(session) is watch:
                del gateway._watches[session]


class _Relayed:
    """One relay call answered without a handler task
    (:meth:`~garcon_link.api.gateway.Gateway._relay_now`): what its forward's end (:meth:`ended`),
    its caller's cancel and its session's retirement (:meth:`cancelled`) do -- the counters, the
    share, the binding of its key, the reply."""

    __slots__ = (
        "call_id",
        "caller",
        "forward",
        "gateway",
        "incoming",
        "member",
        "rpc",
        "runtime",
        "share",
        "slot",
        "state",
        "timeout",
        "was_cancelled",
    )

    def __init__(
        self,
        gateway: _Host,
        caller: str,
        rpc: ExecutorRpc,
        call_id: int,
        member: RemoteExecutor,
        share: tuple[str, str],
        slot: tuple[str, str, str, bytes] | None,
        runtime: bytes,
        state: bytes | None,
        timeout: float,
    ) -> None:
        self.gateway = gateway
        self.caller = caller
        self.rpc = rpc
        self.call_id = call_id
        self.member = member
        self.share: tuple[str, str] | None = share
        self.slot = slot
        self.runtime = runtime
        self.state = state
        self.timeout = timeout
        self.forward: Forward | None = None
        self.incoming: Incoming | None = None
        self.was_cancelled = False

    def _settle(self, error: CallError | None) -> None:
        """The forward's counters, share and binding, once it ended."""
        gateway, member, slot = self.gateway, self.member, self.slot
        if self.share is not None:
            gateway._give_share(self.share)
            self.share = None
        if error is None:
            member._observer.client_ended(None, None, None, False)
        else:
            member._observer.client_ended(None, error.outcome, error.code, False)
            if counts_as_error(error):
                member.errors += 1
        if slot is not None:
            bindings = gateway._bindings_of(self.caller)
            if isinstance(error, OutcomeUnknown):
                bindings.bind(
                    slot, self.runtime, self.state, anyio.current_time() + 2 * self.timeout
                )
            else:
                bindings.release(slot)

    def ended(self, forward: Forward) -> None:
        """The forwarded call ended (from the dispatch of its reply, or a timer)."""
        error = forward.error
        self._settle(error)
        incoming = self.incoming
        assert incoming is not None
        call_id = self.call_id
        if error is None:
            encoded = forward.encoded
            if encoded is not None:
                body = b"".join(
                    (
                        b"\x83\x01",
                        encode_head(0, call_id),
                        encode_head(2, len(encoded) + 2),
                        b"\x82\x01",
                        encoded,
                    )
                )
            else:
                body = _result_envelope(call_id, encode_outcome(forward.value))
            self.rpc.reply_held(call_id, incoming, body)
        elif self.was_cancelled and forward.receipt is not None:
            # The caller cancelled the relay call: the executor's answer to the cancel, its
            # receipt included, is the relay call's.
            body = error_envelope(call_id, error, cancel=forward.receipt)
            self.rpc.reply_held(call_id, incoming, body, error, True)
        else:
            self.gateway._answer_error(self.caller, self.rpc, call_id, incoming, error)

    def failed(self, error: CallError) -> None:
        """The executor's session refused the forward before it was sent."""
        self._settle(error)
        assert self.incoming is not None
        self.gateway._answer_error(self.caller, self.rpc, self.call_id, self.incoming, error)

    def cancelled(self, retired: bool) -> None:
        """The caller cancelled the relay call (its cancel goes on to the executor), or its
        session retired (the forward is abandoned, as a handler's would be)."""
        forward = self.forward
        if not retired:
            self.was_cancelled = True
            if forward is not None:
                forward.cancel()
            return
        error = OutcomeUnknown("CANCELLED", "the caller's session ended")
        if forward is not None and not forward.pending.ended:
            forward.abandon()
            if self.share is not None:
                self.gateway._give_share(self.share)
                self.share = None
            self.member._observer.client_ended(None, error.outcome, error.code, True)
        assert self.incoming is not None
        self.rpc.release_held(self.call_id, self.incoming, error, True)


_MAX_HEAD_ID = 2**64 - 1
"""The largest call id a CBOR head holds: the direct path writes its replies by hand
(:func:`_result_envelope`); a caller's call with a larger id goes through the relay service's
handler, whose reply cbor2 encodes (a bignum)."""

_MAX_TIMEOUT_INT = 2**53
"""The largest integer timeout the direct path takes (it converts exactly to a float); a larger
one goes through the relay service's handler, whose argument check refuses it."""


def _ignore_cancel(retired: bool) -> None:
    """A held relay call answered without a forward: a cancel changes nothing (its answer says
    it was not forwarded); a retirement frees its slot when the answer finds no session."""


def _result_envelope(call_id: int, outcome: bytes) -> bytes:
    """``encode_result(call_id, outcome)`` for the byte string ``outcome``."""
    return b"".join((b"\x83\x01", encode_head(0, call_id), encode_head(2, len(outcome)), outcome))


class _Bindings:
    """One caller's keyed calls that may have run on an executor's worker process: a retry
    with the same key is forwarded only to that process (or one on the same state directory),
    whose table of keys knows the key; to another it is ``OutcomeUnknown("WORKER_RESTARTED")``,
    never run again (docs/design.md#gateway). At most ``capacity`` bindings, each kept until
    twice its call's timeout has passed (the caller's retries stop at its timeout): a caller
    that makes more keyed calls end unknown than that at once loses its oldest bindings."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._held: collections.OrderedDict[
            tuple[str, str, str, bytes], tuple[bytes, bytes | None, float]
        ] = collections.OrderedDict()

    def check(self, slot: tuple[str, str, str, bytes], runtime: bytes, state: bytes | None) -> None:
        held = self._held.get(slot)
        if held is None:
            return
        bound, bound_state, expires = held
        if expires < anyio.current_time():
            del self._held[slot]
            return
        if runtime == bound or (bound_state is not None and bound_state == state):
            return
        raise OutcomeUnknown(
            "WORKER_RESTARTED",
            f"an attempt with this key may have executed on worker process {bound.hex()[:12]} "
            f"of executor {peer_text(slot[0])}, which is gone (now {runtime.hex()[:12]}): its "
            "table of keys went with it, so the gateway did not forward the call again",
        )

    def bind(
        self,
        slot: tuple[str, str, str, bytes],
        runtime: bytes,
        state: bytes | None,
        expires: float,
    ) -> None:
        if slot not in self._held and len(self._held) >= self.capacity:
            self._held.popitem(last=False)
        self._held.setdefault(slot, (runtime, state, expires))

    def release(self, slot: tuple[str, str, str, bytes]) -> None:
        self._held.pop(slot, None)


def _stream_ended(
    member: RemoteExecutor, observed: Observed | None, exc: BaseException | None
) -> None:
    """A relayed stream's end at its executor's outcome point (counters and hooks)."""
    if exc is None:
        member._observer.client_ended(observed, None, None, False)
        return
    outcome, code, cancelled = end_of(exc)
    if isinstance(exc, CallError) and counts_as_error(exc):
        member.errors += 1
    member._observer.client_ended(observed, outcome, code, cancelled)


@functools.lru_cache(maxsize=256)
def _relayed_spec(method: str, kind: MethodKind) -> MethodSpec:
    """What the gateway's hooks are told a forwarded call, stream or notification is:
    ``method``, of ``kind``, untyped (the specs of the 256 used last are kept: a spec costs a
    signature walk)."""
    return MethodSpec(name=method, kind=kind, signature=_NO_SIGNATURE, hints={}, result=Any)


_NO_SIGNATURE = inspect.Signature()
