"""The gateway's forward of a caller's relayed call or stream to its executor.

A relayed request admitted (:mod:`._admission`: granted, its arguments framed) is forwarded on
the executor's session within its caller's share of it (:mod:`._shares`), its idempotency key
bound to the worker process it may have run on (:class:`_Bindings`), its outcome counted at the
executor's outcome point (its counters and the gateway's hooks) and returned as data
(:mod:`._relaying`, step 4). :class:`Forwarder` does it for the relay service's handlers
(:meth:`Forwarder.forward`, :meth:`Forwarder.open_stream`) and, on asyncio without hooks, for a
unary relay call in the dispatch of the caller's message, without a handler task
(:meth:`Forwarder.relay_now`, :meth:`Forwarder.relay_raw`): the forward is issued at once and the
call held in its session's incoming table (:class:`_Relayed`); the executor's reply completes
it from the dispatch of *that* session's message, a whole result's value passed on as the bytes
it arrived as. What cannot be done in one step (an executor reconnecting, a session waiting for
capacity, hooks, trio) is left to the handler, with the same outcomes.

A keyed call's **binding**: a retry with the same key is forwarded only to the worker process
(or one on the same state directory) whose table of keys knows the key; to another it is
``OutcomeUnknown("WORKER_RESTARTED")``, never run again (docs/design.md#gateway).
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.abc

from ..core.wire import encode_head
from ..errors import CallError, NotDispatched, OutcomeUnknown, Rejected
from ..limits import Limits
from ..logs import peer_text
from ..rpc.envelopes import Call
from ..rpc.errorbody import error_envelope
from ..rpc.hooks import call_metadata
from ..rpc.idempotency import key_problem
from ..rpc.interface import MethodKind, MethodSpec
from ..rpc.observer import CallObserver, Observed, end_of
from ..rpc.rpc import ExecutorRpc, Forward, Incoming, RemoteStream
from ._admission import Admission
from ._caller_stats import CallerBook
from ._framing import RelayCallReader, read_relay_call
from ._relay_wire import RELAY_SERVICE, encode_outcome
from ._shares import Shares
from .controller import RemoteExecutor
from .facades import counts_as_error
from .fleet import Fleet

__all__ = ["Forwarder"]


class Forwarder:
    """The forward of the callers' relayed calls and streams (module docstring); one per
    gateway, sharing its parts.

    Attributes:
        shares: the callers' shares of each executor.
        tg: the gateway's task group while it runs (a paced refusal's answer waits in it).
    """

    __slots__ = (
        "_admission",
        "_bindings",
        "_book",
        "_limits",
        "_max_callers",
        "_members",
        "shares",
        "tg",
    )

    def __init__(
        self,
        fleet: Fleet,
        limits: Limits,
        admission: Admission,
        shares: Shares,
        book: CallerBook,
        max_callers: int,
    ) -> None:
        self._members = fleet.members  # the fleet's live mapping (Fleet.members)
        self._limits = limits
        self._admission = admission
        self.shares = shares
        self._book = book
        self._max_callers = max_callers
        self._bindings: dict[str, _Bindings] = {}  # by caller
        self.tg: anyio.abc.TaskGroup | None = None

    def connected(self, executor: str) -> RemoteExecutor:
        member = self._members.get(executor)
        if member is None:
            raise NotDispatched(
                "OFFLINE", f"executor {peer_text(executor)} is not connected to the gateway"
            )
        return member

    async def open_stream(
        self, caller: str, executor: str, service: str, method: str, payload: bytes
    ) -> tuple[tuple[str, str], RemoteExecutor, RemoteStream, Observed | None]:
        """A relayed stream, admitted, within its caller's share (given back by the caller of this
        once the stream ends), granting the executor ``gateway_stream_window_items``, and its
        executor and its hooks' handle: the caller of this ends it
        (:func:`~garcon_link.api._relaying._stream_ended`)."""
        arguments = self._admission.admit(caller, executor, service, method, payload)
        member = self.connected(executor)
        share = self.shares.take(caller, executor)
        try:
            rpc = await member.rpc_for_call(self._limits.dispatch_deadline)
        except BaseException:
            self.shares.give(share)
            raise
        metadata: Mapping[str, str] = call_metadata()
        observer = rpc.observer  # the member's own
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
                self.shares.give(share)
                observer.client_ended(observed, exc.outcome, exc.code, False)
                raise
        member.calls += 1
        window_now = functools.partial(self.shares.stream_window, caller, executor)
        stream = rpc.stream_relayed(
            service, method, arguments, dict(metadata) or None, window_now(), window_now
        )
        return share, member, stream, observed

    async def forward(
        self,
        caller: str,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> Any:
        arguments = self._admission.admit(caller, executor, service, method, payload)
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise Rejected("INVALID_ARGUMENTS", "timeout must be a positive number of seconds")
        if key is not None and (why := key_problem(key)) is not None:
            raise Rejected("INVALID_ARGUMENTS", why)
        member = self.connected(executor)
        share = self.shares.take(caller, executor)
        try:
            return await self._forward_to(
                caller, member, executor, service, method, arguments, key, timeout
            )
        finally:
            self.shares.give(share)

    def relay_now(
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

    def relay_raw(
        self, caller: str, rpc: ExecutorRpc, reader: RelayCallReader, data: bytes
    ) -> bool:
        """:meth:`relay_now` for a relay call read from its envelope's bytes, undecoded
        (:meth:`ExecutorRpc.serve_raw_calls`; ``reader``: the session's, with its bounds on
        metadata, :class:`~garcon_link.api._framing.RelayCallReader`): one of the usual shape,
        its metadata (if any) forwarded as the bytes it came as, that the session admits now.
        ``False`` (nothing counted, nothing sent, the call id not taken) for any other: it goes
        the usual way."""
        read = read_relay_call(data, reader.max_entries, reader.max_bytes, reader)
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
        """:meth:`relay_now` once the relay call's arguments are read (``timeout`` as the
        caller sent it, unchecked; ``metadata`` checked, as a map or its encoding)."""
        if not (
            timeout is None
            or type(timeout) is float
            or (type(timeout) is int and abs(timeout) <= _MAX_TIMEOUT_INT)
        ):
            return False
        try:
            arguments = self._admission.admit(caller, executor, service, method, payload)
            if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
                raise Rejected("INVALID_ARGUMENTS", "timeout must be a positive number of seconds")
            if key is not None and (why := key_problem(key)) is not None:
                raise Rejected("INVALID_ARGUMENTS", why)
            member = self._members.get(executor) or self.connected(executor)
        except CallError as exc:
            self._book.counted(caller, payload)
            self.answer_error(caller, rpc, call_id, rpc.hold(call_id, _ignore_cancel), exc)
            return True
        target = member.ready_rpc()
        if target is None or target.observer.hooks:
            return False
        observer = target.observer  # the member's own outcome point
        try:
            share = self.shares.take(caller, executor)
        except CallError as exc:
            self._book.counted(caller, payload)
            self.answer_error(caller, rpc, call_id, rpc.hold(call_id, _ignore_cancel), exc)
            return True
        seconds = self._limits.call_timeout if timeout is None else float(timeout)
        if metadata is not None and not isinstance(metadata, bytes):
            metadata = dict(metadata) or None  # (the decoded call's: a copy of its own)
        relayed = _Relayed(self, caller, rpc, call_id, member, observer, share)
        try:
            if key is not None:
                runtime, state = target.transport.peer_runtime, target.peer_state_id
                slot = (executor, service, method, key)
                relayed.keyed = (slot, runtime, state, seconds)
                self.bindings_of(caller).check(slot, runtime, state)
            forward = target.forward(
                service,
                method,
                arguments,
                key,
                metadata,
                seconds,
                relayed.ended,
            )
        except OutcomeUnknown as exc:  # a binding's verdict: not forwarded, not counted
            self.shares.give(share)
            self._book.counted(caller, payload)
            self.answer_error(caller, rpc, call_id, rpc.hold(call_id, _ignore_cancel), exc)
            return True
        except CallError as exc:  # refused by the executor's session before sending
            self._book.counted(caller, payload)
            member.calls += 1
            relayed.incoming = rpc.hold(call_id, relayed.cancelled)
            relayed.failed(exc)
            return True
        if forward is None:
            self.shares.give(share)
            return False
        stats = self._book.stats.get(caller) or self._book.stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
        member.calls += 1
        relayed.forward = forward
        relayed.incoming = rpc.hold(call_id, relayed.cancelled)
        return True

    def answer_error(
        self, caller: str, rpc: ExecutorRpc, call_id: int, incoming: Incoming, exc: CallError
    ) -> None:
        """Answer a held relay call with ``exc`` as its outcome, counted (and paced) as
        :meth:`~._caller_stats.CallerBook.failed` does: a ``FORBIDDEN`` or ``OVERLOADED`` one
        from a task that keeps the slot while it waits its turn."""
        body = _result_envelope(call_id, encode_outcome(error=exc))
        if exc.code != "FORBIDDEN" and exc.code != "OVERLOADED":
            self._book.stats_of(caller).errors += 1
            rpc.reply_held(call_id, incoming, body)
            return

        async def paced() -> None:
            await self._book.failed(caller, exc)
            rpc.reply_held(call_id, incoming, body)

        assert self.tg is not None
        self.tg.start_soon(paced)

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
        rpc = await member.rpc_for_call(self._limits.dispatch_deadline)
        timeout = self._limits.call_timeout if timeout is None else timeout
        runtime, state = rpc.transport.peer_runtime, rpc.peer_state_id
        slot = (executor, service, method, key) if key is not None else None
        if slot is not None:
            self.bindings_of(caller).check(slot, runtime, state)
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
            value = await rpc.observer.call(
                service, _relayed_spec(method, MethodKind.UNARY), dict(metadata) or None, attempt
            )
        except CallError as exc:
            if counts_as_error(exc):
                member.errors += 1
            if slot is not None:
                bindings = self.bindings_of(caller)
                if isinstance(exc, OutcomeUnknown):
                    bindings.bind(slot, runtime, state, anyio.current_time() + 2 * timeout)
                else:
                    bindings.release(slot)
            raise
        if slot is not None:
            self.bindings_of(caller).release(slot)
        return value

    def bindings_of(self, caller: str) -> _Bindings:
        bindings = self._bindings.get(caller)
        if bindings is None:
            if len(self._bindings) >= 2 * self._max_callers:
                self._bindings.pop(next(iter(self._bindings)))
            bindings = self._bindings[caller] = _Bindings(self._limits.max_incoming_calls)
        return bindings


class _Relayed:
    """One relay call answered without a handler task
    (:meth:`Forwarder.relay_now`): what its forward's end (:meth:`ended`),
    its caller's cancel and its session's retirement (:meth:`cancelled`) do -- the counters, the
    share, the binding of its key, the reply."""

    __slots__ = (
        "call_id",
        "caller",
        "forward",
        "forwarder",
        "incoming",
        "keyed",
        "member",
        "observer",
        "rpc",
        "share",
        "was_cancelled",
    )

    def __init__(
        self,
        forwarder: Forwarder,
        caller: str,
        rpc: ExecutorRpc,
        call_id: int,
        member: RemoteExecutor,
        observer: CallObserver,
        share: tuple[str, str],
    ) -> None:
        self.forwarder = forwarder
        self.caller = caller
        self.rpc = rpc
        self.call_id = call_id
        self.member = member
        self.observer = observer  # the member's
        self.share: tuple[str, str] | None = share
        # A keyed call's binding: its slot, the worker process and state directory it went
        # to, its timeout (set before it is forwarded).
        self.keyed: tuple[tuple[str, str, str, bytes], bytes, bytes | None, float] | None = None
        self.forward: Forward | None = None
        self.incoming: Incoming | None = None
        self.was_cancelled = False

    def _settle(self, error: CallError | None) -> None:
        """The forward's counters, share and binding, once it ended."""
        if self.share is not None:
            self.forwarder.shares.give(self.share)
            self.share = None
        if error is None:
            self.observer.client_ended(None, None, None, False)
        else:
            self.observer.client_ended(None, error.outcome, error.code, False)
            if counts_as_error(error):
                self.member.errors += 1
        if self.keyed is not None:
            slot, runtime, state, timeout = self.keyed
            bindings = self.forwarder.bindings_of(self.caller)
            if isinstance(error, OutcomeUnknown):
                bindings.bind(slot, runtime, state, anyio.current_time() + 2 * timeout)
            else:
                bindings.release(slot)

    def ended(self, forward: Forward) -> None:
        """The forwarded call ended (from the dispatch of its reply, or a timer)."""
        self.forward = None  # (it holds this object's method: a cycle the collector would free)
        error = forward.error
        incoming = self.incoming
        assert incoming is not None
        call_id = self.call_id
        if error is None:
            # _settle's work for a success, here: every relayed call's path
            share = self.share
            if share is not None:
                self.forwarder.shares.give(share)
                self.share = None
            self.observer.client_ended(None, None, None, False)
            if self.keyed is not None:
                self.forwarder.bindings_of(self.caller).release(self.keyed[0])
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
            return
        self._settle(error)
        if self.was_cancelled and forward.receipt is not None:
            # The caller cancelled the relay call: the executor's answer to the cancel, its
            # receipt included, is the relay call's.
            body = error_envelope(call_id, error, cancel=forward.receipt)
            self.rpc.reply_held(call_id, incoming, body, error, True)
        else:
            self.forwarder.answer_error(self.caller, self.rpc, call_id, incoming, error)

    def failed(self, error: CallError) -> None:
        """The executor's session refused the forward before it was sent."""
        self._settle(error)
        assert self.incoming is not None
        self.forwarder.answer_error(self.caller, self.rpc, self.call_id, self.incoming, error)

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
                self.forwarder.shares.give(self.share)
                self.share = None
            self.observer.client_ended(None, error.outcome, error.code, True)
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
        member.observer.client_ended(observed, None, None, False)
        return
    outcome, code, cancelled = end_of(exc)
    if isinstance(exc, CallError) and counts_as_error(exc):
        member.errors += 1
    member.observer.client_ended(observed, outcome, code, cancelled)


@functools.lru_cache(maxsize=256)
def _relayed_spec(method: str, kind: MethodKind) -> MethodSpec:
    """What the gateway's hooks are told a forwarded call, stream or notification is:
    ``method``, of ``kind``, untyped (the specs of the 256 used last are kept: a spec costs a
    signature walk)."""
    return MethodSpec(name=method, kind=kind, signature=_NO_SIGNATURE, hints={}, result=Any)


_NO_SIGNATURE = inspect.Signature()
