"""The caller's side of one session: our outgoing calls, notifications and streams.

Theory of operation (the rules are in the module docstring of :mod:`.rpc`): :class:`Caller`
gives each call an id (increasing in the order calls *arrive*: a call sent in parts is renumbered
when its turn to send comes), keeps it in the pending table until its reply, timeout, cancel or
the session's retirement ends it, and matches the peer's ``result``/``error``/``stream_item``/
``stream_end`` to it. Each pending call ends exactly once (:meth:`Caller._finish`). A timed-out
call sends ``cancel`` and waits up to ``cancel_grace`` for the peer's answer. A
:class:`RemoteStream` consumes its items against the credit it grants, and is reclaimed (its slot
freed, ``cancel`` sent) if it is dropped without ``aclose()``. The pending calls and the
forwards' timers are :mod:`.pending`, the streams :mod:`.streams`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import cbor2

from ..core.wire import decode_item
from ..endpoint.transport import SessionTransport
from ..errors import (
    CallError,
    MalformedFrame,
    NotDispatched,
    OutcomeUnknown,
    PayloadTooLarge,
    Rejected,
    RemoteError,
    SessionFailed,
    StaleResource,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields
from ..net.backend import on_asyncio
from .chunks import ChunkSender
from .envelopes import (
    Cancel,
    End,
    Error,
    Item,
    Notify,
    Result,
    byte_string_at,
    encode_call,
    encode_relayed_call,
    encode_relayed_notify,
    plain_scalar,
    renumbered_call_head,
)
from .errorbody import (
    INTERRUPTED,
    NOT_STARTED,
    encode_request,
    error_from_body,
    local_exception,
)
from .interface import MethodKind, MethodSpec
from .observer import CallObserver
from .outbox import CANCEL_KIND, Outbox
from .pending import Forward, _Deadlines, _Pending
from .resources import ResourceRef
from .splice import SPLICE_BYTES, Spliced, encode_envelope, holds_large
from .streams import RELAYED_STREAM, RemoteStream, _RelayedStream
from .towire import to_wire
from .values import from_wire

__all__ = ["RELAYED", "RELAYED_STREAM", "Caller", "Expected", "Forward", "RemoteStream"]

_NOTIFY_VALUES = range(3, 5)  # a notification's args and kwargs

log = logging.getLogger("garcon_link.rpc")  # the name users configure (README)


RELAYED = MethodSpec(
    name="(relayed)", kind=MethodKind.UNARY, signature=inspect.Signature(), hints={}, result=Any
)
"""The spec of a relayed call (:meth:`Caller.call_relayed`): its reply is taken as it decoded."""


class Caller:
    """Our calls on one session: ids, the pending table, timeouts, cancels, streams' credit.

    Args:
        transport: the session.
        limits: budgets and windows.
        observer: the endpoint's counters (``pending_peak``).
        chunks: the session's sender of bodies in parts (requests go through it).
        outbox: where ``cancel`` and ``credit`` go without a task.
        settled: called whenever a call ends (the session's :meth:`~.rpc.ExecutorRpc.wait_idle`).
        peer_log: the session's limiter for what the peer makes us log.
        peer: what to call the peer in messages.
    """

    def __init__(
        self,
        transport: SessionTransport,
        limits: Limits,
        observer: CallObserver,
        chunks: ChunkSender,
        outbox: Outbox,
        settled: Callable[[], None],
        peer_log: PeerLogLimiter,
        peer: str,
    ) -> None:
        self.transport = transport
        self.limits = limits
        self.observer = observer
        self.peer = peer
        self._chunks = chunks
        self._outbox = outbox
        self._note_settled = settled
        self._peer_log = peer_log
        self._retired: CallError | None = None
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        # Whether a forwarded call (forward()) or a relayed one (call_relayed()) was ever
        # issued here: only then are results looked at before they are decoded (on_raw_result).
        self.forwards = False
        self.flow_violations = 0
        self.malformed_replies = 0
        self.peer_instance_id: bytes | None = None
        # The worker's runtime: what worker-scoped references carry.
        self.peer_worker_instance_id: bytes | None = None
        # The running asyncio loop (asyncio's calls wait on a future and a timer, not on a cancel
        # scope and an event), None on another backend; False until the first call looks.
        self._loop: asyncio.AbstractEventLoop | bool | None = False
        # The forwards' deadlines (forward()), made with the first forward; the deadlines of
        # calls waiting on asyncio, made with the first one.
        self._deadlines: _Deadlines | None = None
        self._call_deadlines: _Deadlines | None = None

    @property
    def pending(self) -> int:
        """Calls awaiting a reply, plus abandoned ones whose ``cancel`` is still queued."""
        return len(self._pending) + self._outbox.owed_cancels

    def retire(self, why: str, *, sent: str | None = None) -> None:
        """Fail every pending call honestly (module docstring of :mod:`.rpc`); later calls are
        ``NotDispatched("OFFLINE")``. ``sent``, if given, is ``why`` as said of a call whose
        request was sent. Idempotent."""
        if self._retired is not None:
            return
        self._retired = NotDispatched("OFFLINE", why)
        offered = self.transport.offered
        for pending in list(self._pending.values()):
            if pending.ordinal is not None and pending.ordinal <= offered:
                error: CallError = OutcomeUnknown(
                    "CONTINUITY_LOST", f"the request was sent; {sent or why}"
                )
            else:
                error = NotDispatched("CONTINUITY_LOST", f"the request never left; {why}")
            self._finish(pending, error=error)
        self._pending.clear()
        if self._deadlines is not None:
            self._deadlines.clear()
        if self._call_deadlines is not None:
            self._call_deadlines.clear()

    def _check_open(self) -> None:
        if self._retired is not None:
            raise NotDispatched("OFFLINE", self._retired.message)
        if self.transport.failure is not None:
            raise NotDispatched("OFFLINE", str(self.transport.failure))

    def _prepare(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        credit: tuple[int, int],
        key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[_Pending | None, bytes | Spliced]:
        if self._retired is not None or self.transport.failure is not None:
            self._check_open()
        try:
            pos, kw = spec.bind(args, kwargs)
            wire_args = to_wire(pos, with_defaults=spec.args_with_defaults)
            wire_kwargs = to_wire(kw, with_defaults=spec.args_with_defaults) if kw else {}
        except TypeError as exc:  # not a call of this method, or values that cannot be sent
            raise NotDispatched("INVALID_ARGUMENTS", f"{service}.{spec.name}: {exc}") from exc
        try:
            spec.check_arguments(pos, kw)
        except TypeError as exc:
            # The worker's own check would refuse these values: the same verdict, given
            # before sending (as a contract refusal is).
            raise Rejected("INVALID_ARGUMENTS", f"{service}.{spec.name}: {exc}") from exc
        if self.peer_instance_id is not None:
            self._check_resources(pos, kw)
        if spec.kind is MethodKind.ONEWAY:
            notify = Notify(service, spec.name, wire_args, wire_kwargs, metadata)
            if not (
                holds_large(wire_args, SPLICE_BYTES, 2) or holds_large(wire_kwargs, SPLICE_BYTES, 2)
            ):
                return None, encode_request(notify)
            try:
                return None, encode_envelope(notify.wire(), _NOTIFY_VALUES, SPLICE_BYTES, 2)
            except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
                raise NotDispatched(
                    "INVALID_ARGUMENTS", f"cannot encode the request: {exc}"
                ) from exc
        if len(self._pending) + self._outbox.owed_cancels >= self.limits.max_pending_calls:
            raise NotDispatched(
                "OVERLOADED",
                f"{self.limits.max_pending_calls} calls already pending on this session",
            )
        call_id = self._next_id
        self._next_id += 1
        try:
            body = encode_call(
                call_id,
                service,
                spec.name,
                wire_args,
                wire_kwargs,
                *credit,
                key,
                metadata,
                splice=SPLICE_BYTES,
            )
        except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
            raise NotDispatched("INVALID_ARGUMENTS", f"cannot encode the request: {exc}") from exc
        return _Pending(call_id, spec, None), body

    def _renumber(self, pending: _Pending, body: bytes) -> tuple[bytes, int]:
        """A fresh id for ``body`` (a ``call`` sent in parts, about to be issued): the head that
        replaces its first bytes and how many it replaces; ``pending`` moves to the new id.
        Calls issued while it waited for its turn have overtaken it, and the peer requires ids
        to increase in the order calls arrive (:mod:`garcon_link.rpc.chunks`)."""
        old, new = pending.id, self._next_id
        self._next_id += 1
        if self._pending.get(old) is pending:
            del self._pending[old]
            self._pending[new] = pending
        pending.id = new
        return renumbered_call_head(body, old, new)

    def _check_resources(self, args: list[Any], kwargs: Mapping[str, Any]) -> None:
        instance = self.peer_instance_id
        if instance is None:
            return
        valid = (instance, self.peer_worker_instance_id)
        for value in args:
            if isinstance(value, ResourceRef) and value.instance_id not in valid:
                raise StaleResource(message=f"{value!r} belongs to a replaced session")
        if kwargs:
            for value in kwargs.values():
                if isinstance(value, ResourceRef) and value.instance_id not in valid:
                    raise StaleResource(message=f"{value!r} belongs to a replaced session")

    async def _send_request(
        self, body: bytes | Spliced, renumber: Callable[[bytes], tuple[bytes, int]] | None = None
    ) -> int:
        """Issue a request envelope; a refusal before an ordinal is assigned is NOT_DISPATCHED."""
        try:
            return await self._chunks.send(body, renumber)
        except PayloadTooLarge as exc:
            raise NotDispatched("PAYLOAD_TOO_LARGE", str(exc)) from exc
        except SessionFailed as exc:
            raise NotDispatched("OFFLINE", str(exc)) from exc

    def _issue_nowait(self, pending: _Pending, body: bytes | Spliced) -> bool:
        """Issue a small call at once if the session admits it without waiting; ``False``
        (nothing issued, nothing registered) otherwise."""
        try:
            ordinal = self._chunks.send_nowait(body)
        except PayloadTooLarge as exc:
            raise NotDispatched("PAYLOAD_TOO_LARGE", str(exc)) from exc
        except SessionFailed as exc:
            raise NotDispatched("OFFLINE", str(exc)) from exc
        if ordinal is None:
            return False
        pending.ordinal = ordinal
        self._pending[pending.id] = pending
        if len(self._pending) > self.observer.pending_peak:
            self.observer.pending_peak = len(self._pending)
        return True

    async def _issue(self, pending: _Pending, body: bytes | Spliced) -> None:
        self._pending[pending.id] = pending
        if len(self._pending) > self.observer.pending_peak:
            self.observer.pending_peak = len(self._pending)
        renumber = None
        if len(body) > self._chunks.chunk:

            def renumber(body: bytes) -> tuple[bytes, int]:
                return self._renumber(pending, body)

        try:
            pending.ordinal = await self._send_request(body, renumber)
        except NotDispatched:
            self._pending.pop(pending.id, None)
            self._note_settled()
            raise

    async def call(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        timeout: float | None,
        idempotency_key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Any:
        """Call ``service.method`` and return its converted result.

        ``idempotency_key`` (normalised bytes, see
        :func:`garcon_link.rpc.idempotency.normalize_key`) is sent with the call; the worker runs
        the call at most once per key. ``metadata`` (already validated: :class:`CallObserver`) is
        sent with it.

        This is one attempt on this session; the caller's outcome point (counting, hooks) is
        the endpoint's :meth:`CallObserver.call` around it.

        Raises:
            NotDispatched, Rejected, StaleResource, OutcomeUnknown, RemoteError: per the outcome;
                or an allow-listed remote exception type (see :func:`register_exception`).
        """
        if spec.kind is MethodKind.ONEWAY:
            await self.notify(service, spec, args, kwargs, metadata)
            return None
        pending, body = self._prepare(
            service, spec, args, kwargs, (0, 0), idempotency_key, metadata
        )
        assert pending is not None
        return await self._complete(pending, body, timeout)

    async def call_relayed(
        self,
        service: str,
        method: str,
        arguments: bytes,
        *,
        timeout: float | None,
        idempotency_key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Any:
        """Call ``service.method`` with arguments already encoded (``arguments``: the ``args``
        array and ``kwargs`` map back to back, as
        :func:`~garcon_link.core.wire.argument_items` frames them), and return the reply's
        value as decoded CBOR data, unconverted: a relay's call, which knows no interface.
        Outcomes as :meth:`call`, the :class:`CallError` itself (no remote exception is
        re-created).
        """
        pending, body = self._prepare_relayed(
            RELAYED, service, method, arguments, idempotency_key, metadata, (0, 0)
        )
        self.forwards = True
        return await self._complete(pending, body, timeout, local=False)

    def _prepare_relayed(
        self,
        spec: MethodSpec,
        service: str,
        method: str,
        arguments: bytes,
        key: bytes | None,
        metadata: Mapping[str, str] | bytes | None,
        credit: tuple[int, int],
    ) -> tuple[_Pending, bytes]:
        if self._retired is not None or self.transport.failure is not None:
            self._check_open()
        if len(self._pending) + self._outbox.owed_cancels >= self.limits.max_pending_calls:
            raise NotDispatched(
                "OVERLOADED",
                f"{self.limits.max_pending_calls} calls already pending on this session",
            )
        call_id = self._next_id
        self._next_id += 1
        try:
            body = encode_relayed_call(call_id, service, method, arguments, key, metadata, credit)
        except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
            raise NotDispatched("INVALID_ARGUMENTS", f"cannot encode the request: {exc}") from exc
        return _Pending(call_id, spec, None), body

    async def notify_relayed(
        self, service: str, method: str, arguments: bytes, metadata: Mapping[str, str] | None
    ) -> None:
        """Send a one-way notification whose arguments are already encoded (as
        :meth:`call_relayed`); returns once it is queued on the session."""
        self._check_open()
        try:
            body = encode_relayed_notify(service, method, arguments, metadata)
        except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
            raise NotDispatched("INVALID_ARGUMENTS", f"cannot encode the request: {exc}") from exc
        await self._send_request(body)

    def stream_relayed(
        self,
        service: str,
        method: str,
        arguments: bytes,
        metadata: Mapping[str, str] | None,
        window_items: int | None = None,
        window_now: Callable[[], int] | None = None,
    ) -> RemoteStream:
        """Open a remote stream whose arguments are already encoded (as :meth:`call_relayed`);
        its items are the decoded CBOR data, unconverted, and it ends with the
        :class:`CallError` itself (no remote exception is re-created). ``window_items``: the
        credit in items granted the producer (default ``Limits.stream_window_items``);
        ``window_now``: asked at each grant instead, the window as it is then."""
        return _RelayedStream(self, service, method, arguments, metadata, window_items, window_now)

    def forward(
        self,
        service: str,
        method: str,
        arguments: bytes,
        key: bytes | None,
        metadata: Mapping[str, str] | bytes | None,
        timeout: float,
        on_end: Callable[[Forward], None],
    ) -> Forward | None:
        """Issue a relayed call (as :meth:`call_relayed`; ``metadata`` may be a checked map's
        encoding, sent as it is) without a task: ``on_end`` is told
        its outcome (:class:`Forward`), from the dispatch of its reply or from a timer. ``None``
        when it cannot be issued at once (not on asyncio, or the session must wait for
        capacity): nothing was sent or registered; :meth:`call_relayed` is then the way.

        Raises:
            NotDispatched: as :meth:`call_relayed` before anything is sent.
        """
        loop = self._loop
        if loop is False:
            loop = self._loop = asyncio.get_running_loop() if on_asyncio() else None
        if loop is None:
            return None
        assert isinstance(loop, asyncio.AbstractEventLoop)
        pending, body = self._prepare_relayed(
            RELAYED, service, method, arguments, key, metadata, (0, 0)
        )
        if not self._issue_nowait(pending, body):
            return None
        self.forwards = True
        deadlines = self._deadlines
        if deadlines is None:
            deadlines = self._deadlines = _Deadlines(loop, self._pending)
        forward = pending.forward = Forward(self, pending, loop, timeout, on_end, deadlines)
        return forward

    def on_raw_result(self, payload: bytes) -> bool:
        """A ``result`` envelope (``payload``) for a call of :meth:`forward`: its value's
        bytes, as received, end the call (``True``). ``False`` for any other, and for a value
        that does not decode as one item of plain data (it is then decoded as usual, so an
        unreadable one fails the call ``MALFORMED_REPLY`` and is counted, as for any call,
        instead of being passed on for a gateway's caller to find unreadable).

        For a unary call of :meth:`call_relayed` whose value is one byte string of definite
        length filling the rest of the envelope (a gateway's outcome), that string ends it, as
        decoding would have read it (``True``); ``False`` for any other value."""
        first = payload[2] if len(payload) > 2 else 0xFF
        if first < 24:
            call_id, start = first, 3
        elif 24 <= first <= 27:
            start = 3 + (1 << (first - 24))
            call_id = int.from_bytes(payload[3:start], "big")
        else:
            return False
        pending = self._pending.get(call_id)
        if pending is None or len(payload) <= start:
            return False
        if pending.forward is None:
            if pending.spec is not RELAYED or pending.stream is not None:
                return False
            value = byte_string_at(payload, start)
            if value is None:
                return False
            del self._pending[call_id]
            self._finish(pending, value=value)
            return True
        encoded = payload[start:]
        if not plain_scalar(encoded):
            try:
                # A relay passes the value on inside an outcome, ``[1, value]``: one level
                # deeper.
                decode_item(encoded, self.limits.max_frame_bytes, depth=1)
            except MalformedFrame:
                return False
        del self._pending[call_id]
        pending.forward.encoded = encoded
        self._finish(pending)
        return True

    async def _complete(
        self, pending: _Pending, body: bytes | Spliced, timeout: float | None, *, local: bool = True
    ) -> Any:
        """Issue ``pending``'s request and wait for its outcome (:meth:`call`); ``local``:
        raise an allow-listed remote exception as itself, else the :class:`CallError`."""
        loop = self._loop
        if loop is False:
            loop = self._loop = asyncio.get_running_loop() if on_asyncio() else None
        if loop is not None and self._issue_nowait(pending, body):
            assert isinstance(loop, asyncio.AbstractEventLoop)
            # Issued at once on asyncio (every call's path, so here and not in a coroutine of
            # its own): wait on a future its reply resolves, and on a deadline resolving it
            # (the call is then still pending: the timeout path). The same outcomes as the
            # cancel scope below, without one.
            waiter = pending.waiter = loop.create_future()
            timer = None
            if timeout is not None and timeout != math.inf:
                # On the session's one queue of call deadlines (calls of one timeout come in
                # deadline order), else on a timer of its own.
                deadlines = self._call_deadlines
                if deadlines is None:
                    deadlines = self._call_deadlines = _Deadlines(loop, self._pending)
                if not deadlines.add(pending, loop.time() + timeout):
                    timer = loop.call_later(timeout, _expire, waiter)
            try:
                await waiter
            except BaseException:
                if not pending.ended:
                    self._abandon(pending)
                raise
            finally:
                pending.armed = False
                if timer is not None:
                    timer.cancel()
            if not pending.ended:
                await self._cancel_after_timeout(pending, timeout)
            return self._outcome(pending, local)
        # A bare cancel scope with a deadline: what fail_after does, without its generator-based
        # context manager.
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                await self._issue(pending, body)
                await pending.wait()
        except BaseException:
            if not pending.ended:
                self._abandon(pending)
            raise
        if scope.cancelled_caught and not pending.ended:
            if pending.ordinal is None:
                self._abandon(pending)
                raise NotDispatched("TIMEOUT", f"not issued within {timeout}s")
            await self._cancel_after_timeout(pending, timeout)
        return self._outcome(pending, local)

    @staticmethod
    def _outcome(pending: _Pending, local: bool = True) -> Any:
        if pending.error is not None:
            raise local_exception(pending.error) if local else pending.error
        return pending.value

    async def notify(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Send a one-way notification (returns once it is queued on the session)."""
        _, body = self._prepare(service, spec, args, kwargs, (0, 0), None, metadata)
        await self._send_request(body)

    def stream(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
    ) -> RemoteStream:
        """Open a remote stream; the request is sent on first iteration."""
        return RemoteStream(self, service, spec, args, kwargs, metadata)

    def _abandon(self, pending: _Pending) -> None:
        """The caller gave up: forget the call and tell the peer to cancel it (best effort)."""
        self._pending.pop(pending.id, None)
        self._note_settled()
        if pending.ordinal is not None:
            self._send_cancel(pending.id)

    async def _cancel_after_timeout(self, pending: _Pending, timeout: float | None) -> None:
        """Send ``cancel`` for a timed-out call and wait up to ``cancel_grace`` for the peer's
        answer, the call still pending so that its answer is matched (module docstring).

        Returns with ``pending`` finished by the answer (a receipt mapped to a ``TIMEOUT``
        error); raises ``OutcomeUnknown("TIMEOUT")`` if none came.
        """
        self._send_cancel(pending.id)
        try:
            with anyio.move_on_after(self.limits.cancel_grace):
                await pending.wait()
        finally:
            if not pending.ended:
                self._pending.pop(pending.id, None)  # a later answer is dropped
                self._note_settled()
        if not pending.ended:
            raise OutcomeUnknown("TIMEOUT", f"no reply within {timeout}s; cancel sent")
        error = pending.error
        not_started = isinstance(error, NotDispatched) and error.code == "CANCELLED"
        if pending.receipt == NOT_STARTED or not_started:  # (an old peer: the same, unmarked)
            pending.error = NotDispatched(
                "TIMEOUT", f"no reply within {timeout}s; cancelled before it started"
            )
        elif pending.receipt == INTERRUPTED:
            pending.error = OutcomeUnknown(
                "TIMEOUT",
                f"no reply within {timeout}s; cancelled while running (it may have had effects)",
            )

    def _send_cancel(self, call_id: int) -> None:
        # A deferred cancel keeps counting as a pending call (see _prepare) until handed over.
        self._outbox.send_soon(CANCEL_KIND, encode_request(Cancel(call_id)))

    def _reclaim_stream(self, pending: _Pending) -> None:
        """A stream's iterator was dropped without ``aclose()``: free its slot, cancel it.

        Runs as a plain event-loop callback (scheduled by the iterator's finalizer), so it only
        queues: the drain task writes the ``cancel``.
        """
        if self._pending.get(pending.id) is not pending:
            return  # it ended, was closed, or the session was retired meanwhile
        log.debug(
            "stream %d was dropped without aclose(); cancelling it",
            pending.id,
            extra=log_fields(session=self.transport.session_id),
        )
        self._pending.pop(pending.id, None)
        self._note_settled()
        if pending.ordinal is not None:
            self._outbox.defer(CANCEL_KIND, encode_request(Cancel(pending.id)))

    def _finish(
        self, pending: _Pending, *, value: Any = None, error: CallError | None = None
    ) -> None:
        pending.value = value
        pending.error = error
        if pending.stream is not None:
            pending.stream.deliver_end(error)
        pending.end()
        self._note_settled()

    # ------------------------------------------------------------------ inbound dispatch
    # -- requests written by hand (ExecutorRpc's test seam)

    def take_id(self) -> int:
        """The next id of our calls, taken for a request written by hand."""
        call_id = self._next_id
        self._next_id += 1
        return call_id

    def expect(self, call_id: int, spec: MethodSpec) -> Expected:
        """Match the peer's replies to ``call_id`` as those of a call of ``spec`` from now on."""
        pending = self._pending[call_id] = _Pending(call_id, spec, None)
        return Expected(self, pending)

    # -- the peer's replies to our calls

    def fail_call(self, call_id: int, code: str, why: str) -> None:
        """What the peer sent about our call ``call_id`` (if still pending) is unreadable."""
        pending = self._pending.get(call_id)
        if pending is not None:
            self.fail_unreadable(pending, code, why)

    def fail_unreadable(self, pending: _Pending, code: str, why: str) -> None:
        """Fail ``pending`` as ``UNKNOWN``: what the peer sent about it cannot be read, so it
        may have run, be running or have failed. ``cancel`` in case it still runs."""
        self.malformed_replies += 1
        self._pending.pop(pending.id, None)
        self._send_cancel(pending.id)
        self._finish(pending, error=OutcomeUnknown(code, why))

    def on_result(self, envelope: Result) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None or pending.stream is not None:
            return  # late reply to a retired, timed-out or cancelled call: dropped
        del self._pending[pending.id]
        try:
            value = from_wire(envelope.value, pending.spec.result)
        except Exception as exc:
            # FAILED, not UNKNOWN: the call certainly ran to completion (module docstring).
            self._finish(
                pending,
                error=RemoteError("INVALID_RESULT", f"result does not match the interface: {exc}"),
            )
            return
        self._finish(pending, value=value)

    def on_error(self, envelope: Error) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None:
            return
        error = error_from_body(envelope.body)
        if isinstance(error, OutcomeUnknown) and error.code == "MALFORMED_ERROR":
            self.fail_unreadable(pending, error.code, error.message)
            return
        del self._pending[pending.id]
        pending.receipt = envelope.body.get("cancel")  # a map: _error_from_body checked it
        self._finish(pending, error=error)

    def on_item(self, envelope: Item, size: int) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None or pending.stream is None:
            return
        stream = pending.stream
        # Byte credit is counted in encoded envelope bytes, exactly what the producer charges
        # per item (``_produce``), after encoding it: so the last item may overdraw the bytes,
        # never the items, and nothing may follow it until more credit is granted.
        if stream.credit_items <= 0 or stream.credit_bytes <= 0:
            self.flow_violations += 1
            self._peer_log.log(
                self.transport.label,
                "flow",
                "session %s: stream %d got an item beyond its credit; ending it",
                self.transport.label,
                pending.id,
                extra=log_fields(session=self.transport.session_id),
            )
            self._end_stream(
                pending,
                "FLOW_CONTROL_VIOLATION",
                f"the {self.peer} violated flow control: it sent a stream item beyond the "
                "credit granted; the stream was cancelled (items already received stand)",
            )
            return
        stream.credit_items -= 1
        stream.credit_bytes -= size
        try:
            value = from_wire(envelope.value, pending.spec.result)
        except Exception as exc:
            self._end_stream(
                pending, "INVALID_RESULT", f"stream item does not match the interface: {exc}"
            )
            return
        stream.deliver_item(value, size)

    def _end_stream(self, pending: _Pending, code: str, message: str) -> None:
        """End a stream we can no longer trust: cancel it on the peer; ``UNKNOWN`` for the
        consumer, after the items already buffered (module docstring)."""
        del self._pending[pending.id]
        self._send_cancel(pending.id)
        self._finish(pending, error=OutcomeUnknown(code, message))

    def on_end(self, envelope: End) -> None:
        pending = self._pending.get(envelope.id)
        if pending is None or pending.stream is None:
            return
        del self._pending[pending.id]
        self._finish(pending)


class Expected:
    """The reply to a request written by hand (:meth:`~.rpc.ExecutorRpc.expect_reply`)."""

    __slots__ = ("_caller", "_pending")

    def __init__(self, caller: Caller, pending: _Pending) -> None:
        self._caller = caller
        self._pending = pending

    async def wait(self) -> Any:
        """The reply's value (converted to the spec's result type).

        Raises:
            CallError: the reply's error as received (no remote exception is re-created), or
                the outcome of the session's retirement.
        """
        pending = self._pending
        await pending.wait()
        if pending.error is not None:
            raise pending.error
        return pending.value

    def close(self) -> None:
        """Stop matching replies (idempotent): a later reply is dropped as for a forgotten
        call."""
        pending = self._pending
        if self._caller._pending.get(pending.id) is pending:
            del self._caller._pending[pending.id]
            self._caller._note_settled()


def _expire(waiter: asyncio.Future[None]) -> None:
    """A call's deadline passed: stop its wait (it is still pending: the caller times it out)."""
    if not waiter.done():
        waiter.set_result(None)
