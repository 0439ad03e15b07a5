"""A stream called on the peer, as the caller iterates it: :class:`RemoteStream`.

The request is sent on the first ``__anext__``; each item taken grants the producer credit
again (half a window at a time). A stream dropped without ``aclose()`` (``break`` out of
``async for``, or lost to the collector) is reclaimed: a finalizer that holds no reference to the
iterator schedules :meth:`~garcon_link.rpc.caller.Caller._reclaim_stream` on the loop, which
frees its pending slot and sends ``cancel``. A relayed stream (:class:`_RelayedStream`, the
gateway's) is sent with its arguments already encoded.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio

from ..net.backend import loop_scheduler
from .envelopes import Credit
from .errorbody import encode_request, local_exception
from .interface import MethodKind, MethodSpec
from .outbox import CONTROL_KIND
from .pending import _Caller, _Pending, _StreamState
from .splice import Spliced

log = logging.getLogger("garcon_link.rpc")  # the name users configure (README)


RELAYED_STREAM = MethodSpec(
    name="(relayed)", kind=MethodKind.STREAM, signature=inspect.Signature(), hints={}, result=Any
)


def _reclaim_when_dropped(stream: RemoteStream, caller: _Caller, pending: _Pending) -> Any:
    """Reclaim ``pending`` if ``stream`` is collected while the call still runs.

    The finalizer holds no reference to ``stream`` (that would keep it alive) and only a weak
    one to ``caller``; all it does is schedule :func:`_reclaim`, since it may run inside the
    garbage collector, where touching the session (a dict in mid-iteration, a half-written
    frame) is not safe. It must never raise: an exception there is "unraisable".
    """
    schedule = loop_scheduler()
    finalizer = weakref.finalize(stream, _schedule_reclaim, schedule, weakref.ref(caller), pending)
    finalizer.atexit = False  # at interpreter exit there is no loop to run it on
    return finalizer


def _schedule_reclaim(
    schedule: Callable[..., object], caller: weakref.ref[_Caller], pending: _Pending
) -> None:
    try:
        schedule(_reclaim, caller, pending)
    except Exception:  # the loop is closed: the session (and its slot) is gone with it
        pass


def _reclaim(caller_ref: weakref.ref[_Caller], pending: _Pending) -> None:
    # A plain loop callback: an exception here would reach the loop (trio: a TrioInternalError).
    caller = caller_ref()
    if caller is None:
        return
    try:
        caller._reclaim_stream(pending)
    except Exception:
        log.exception("reclaiming a dropped stream failed")


class RemoteStream(AsyncIterator[Any]):
    """A remote async iterator with credit-based flow control.

    The request is sent on the first ``__anext__``. ``aclose()`` cancels the generator on the
    peer; so does dropping the iterator without it (``break`` out of ``async for``): once it is
    collected its pending slot is freed and ``cancel`` is sent (see the module docstring). If the
    session is retired mid-stream, iteration raises :class:`OutcomeUnknown` (items already
    delivered stand); so does a flow-control violation by the producer
    (``FLOW_CONTROL_VIOLATION``).
    """

    def __init__(
        self,
        caller: _Caller,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
        window_items: int | None = None,
        window_now: Callable[[], int] | None = None,
    ) -> None:
        self._caller = caller
        self._metadata = metadata
        self._service = service
        self._spec = spec
        self._args = args
        self._kwargs = kwargs
        self._pending: _Pending | None = None
        limits = caller.limits
        # The credit, in items, granted the producer: the limits' unless the opener chose.
        self._window = limits.stream_window_items if window_items is None else window_items
        # The window as it is now, asked at each grant, where it may change over the stream's
        # life (a gateway's relayed stream follows its caller's share); else ``_window``.
        self._window_now = window_now
        self._state = _StreamState(self._window, limits.stream_window_bytes)
        self._consumed = 0
        self._consumed_bytes = 0
        self._closed = False
        self._finalizer: Any = None

    def __aiter__(self) -> RemoteStream:
        return self

    _local = True  # a stream's error is raised as local_exception() makes it

    def _request(self) -> tuple[_Pending, bytes | Spliced]:
        limits = self._caller.limits
        pending, body = self._caller._prepare(
            self._service,
            self._spec,
            self._args,
            self._kwargs,
            (self._window, limits.stream_window_bytes),
            None,
            self._metadata,
        )
        assert pending is not None
        return pending, body

    async def _start(self) -> None:
        pending, body = self._request()
        pending.stream = self._state
        self._pending = pending
        self._finalizer = _reclaim_when_dropped(self, self._caller, pending)
        try:
            await self._caller._issue(pending, body)
        except BaseException:
            self._caller._abandon(pending)  # e.g. cancelled while waiting for retention capacity
            raise

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self._pending is None:
            try:
                await self._start()
            except BaseException:
                # Not issued (offline, too large, cancelled): nothing will ever arrive, so a
                # later iteration must not wait for it.
                self._close()
                raise
        state = self._state
        while not state.items:
            if state.ended:
                self._close()
                if state.error is not None:
                    raise local_exception(state.error) if self._local else state.error
                raise StopAsyncIteration
            state.arrived = anyio.Event()
            await state.arrived.wait()
        value, size = state.items.popleft()
        self._grant(size)
        return value

    def _grant(self, size: int) -> None:
        self._consumed += 1
        self._consumed_bytes += size
        limits = self._caller.limits
        state = self._state
        if state.ended or self._pending is None:
            return
        bytes_due = self._consumed_bytes >= limits.stream_window_bytes // 2
        if self._consumed < max(1, self._window // 2) and not bytes_due:
            return
        items = self._consumed
        if self._window_now is not None:
            # Topped up to the window as it is now: what the producer may still send and what
            # waits here unread count against it, so a smaller window grants less (down to
            # nothing, never taking back what was granted) and a larger one more.
            window = self._window = self._window_now()
            items = max(0, window - state.credit_items - len(state.items))
            if items < max(1, window // 2) and not bytes_due:
                return
        nbytes = max(self._consumed_bytes, 1)
        # What the producer may send grows with the grant at once (the consumer's view can only
        # be ahead of the producer's, never behind: no false violation).
        state.credit_items += items
        state.credit_bytes += nbytes
        self._caller._outbox.send_soon(
            CONTROL_KIND, encode_request(Credit(self._pending.id, items, nbytes))
        )
        self._consumed = 0
        self._consumed_bytes = 0

    def _close(self) -> None:
        self._closed = True
        self._state.items.clear()
        if self._finalizer is not None:
            self._finalizer.detach()  # nothing left to reclaim

    async def aclose(self) -> None:
        """Stop the stream; cancels the generator on the peer if it is still running."""
        if self._closed:
            return
        if self._pending is not None and not self._state.ended:
            self._caller._abandon(self._pending)
        self._close()


class _RelayedStream(RemoteStream):
    """A stream whose arguments are already encoded
    (:meth:`~garcon_link.rpc.caller.Caller.stream_relayed`)."""

    _local = False

    def __init__(
        self,
        caller: _Caller,
        service: str,
        method: str,
        arguments: bytes,
        metadata: Mapping[str, str] | None,
        window_items: int | None,
        window_now: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(
            caller, service, RELAYED_STREAM, (), {}, metadata, window_items, window_now
        )
        self._method = method
        self._arguments = arguments

    def _request(self) -> tuple[_Pending, bytes | Spliced]:
        limits = self._caller.limits
        return self._caller._prepare_relayed(
            RELAYED_STREAM,
            self._service,
            self._method,
            self._arguments,
            None,
            self._metadata,
            (self._window, limits.stream_window_bytes),
        )
