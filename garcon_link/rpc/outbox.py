"""The session's outbox for small envelopes sent without a task: refusals, and our own
``cancel``/``credit``, written at once when retention has room, else queued for one drain task,
started when something is queued and ended when the queue is empty (an idle session has none).

Theory of operation (the bounds are in the module docstring of :mod:`.rpc`): a refusal or a
control envelope that meets full retention waits in one queue, written in order by
:meth:`Outbox._drain` as the peer's receipts free capacity. At ``max_queued_refusals`` queued
refusals the transport's reader is held (:meth:`Outbox.hold_reader`) until the backlog halves;
refusals past the bound within the message being handed over are kept as bare call ids
(:class:`CallIds`) and all answered ``OVERLOADED``. A queued ``cancel`` keeps counting as a
pending call (``owed_cancels``) until it is handed over. Once retired, nothing more is queued.
"""

from __future__ import annotations

import asyncio
from collections import deque

import anyio
import anyio.abc

from ..endpoint.transport import SessionTransport
from ..errors import NotDispatched, PayloadTooLarge, SessionFailed
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields
from .errorbody import error_envelope

__all__ = ["CANCEL_KIND", "CONTROL_KIND", "REFUSAL_KIND", "CallIds", "Outbox"]

# What waits in Outbox's queue: (kind, body) with one of these kinds.
REFUSAL_KIND, CANCEL_KIND, CONTROL_KIND = range(3)


class CallIds:
    """Strictly increasing call ids, stored as LEB128 deltas: about as many bytes per id as it
    took on the wire. Holds the refusals queued past ``max_queued_refusals`` (see the module
    docstring), which all share one error."""

    __slots__ = ("_count", "_data", "_head", "_last_in", "_last_out")

    def __init__(self) -> None:
        self._data = bytearray()
        self._head = 0
        self._count = 0
        self._last_in = 0
        self._last_out = 0

    def __len__(self) -> int:
        return self._count

    def append(self, call_id: int) -> None:
        delta = call_id - self._last_in
        if delta <= 0:  # never: call ids are checked to increase when they are received
            raise ValueError(f"call id {call_id} does not increase")
        self._last_in = call_id
        while True:
            byte = delta & 0x7F
            delta >>= 7
            if delta:
                self._data.append(byte | 0x80)
            else:
                self._data.append(byte)
                break
        self._count += 1

    def popleft(self) -> int:
        if not self._count:
            raise IndexError("no call id queued")
        delta = shift = 0
        while True:
            byte = self._data[self._head]
            self._head += 1
            delta |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        self._count -= 1
        self._last_out += delta
        if not self._count:
            self._data.clear()
            self._head = 0
        elif self._head > 4096 and self._head * 2 > len(self._data):
            del self._data[: self._head]
            self._head = 0
        return self._last_out

    def clear(self) -> None:
        self._data.clear()
        self._head = self._count = 0
        self._last_out = self._last_in


def _running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop of this thread, or ``None`` (another backend, or none)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Outbox:
    """Small envelopes handed to the session without waiting, bounded (module docstring).

    Args:
        transport: the session.
        limits: ``max_queued_refusals``.
        peer_log: the session's limiter for what the peer makes us log.
    """

    __slots__ = (
        "_deferred",
        "_draining",
        "_hold",
        "_overflow",
        "_peer_log",
        "_retired",
        "_tg",
        "limits",
        "owed_cancels",
        "queued_controls",
        "queued_refusals",
        "reader_holds",
        "transport",
    )

    def __init__(
        self,
        transport: SessionTransport,
        limits: Limits,
        peer_log: PeerLogLimiter,
    ) -> None:
        self.transport = transport
        self.limits = limits
        self._peer_log = peer_log
        self._retired = False
        # (kind, body) -- refusals, cancels of our abandoned calls, credit grants -- and, past
        # max_queued_refusals, bare call ids refused OVERLOADED.
        self._deferred: deque[tuple[int, bytes]] = deque()
        self._overflow = CallIds()
        self.queued_refusals = 0  # REFUSAL_KIND entries in _deferred, plus len(_overflow)
        self.owed_cancels = 0  # CANCEL_KIND entries in _deferred: they count as pending calls
        self.queued_controls = 0  # CANCEL_KIND and CONTROL_KIND entries in _deferred
        self._tg: anyio.abc.TaskGroup | None = None
        self._draining = False  # the drain task runs
        self._hold: anyio.Event | None = None  # set when the reader may read on
        self.reader_holds = 0

    @property
    def reader_held(self) -> bool:
        return self._hold is not None

    @property
    def refusals_full(self) -> bool:
        """Whether a new refusal goes past ``max_queued_refusals`` (it is then kept as an id)."""
        return self.queued_refusals >= self.limits.max_queued_refusals

    def retire(self) -> None:
        """Nothing queued can be sent any more: drop it all and let the reader go (idempotent)."""
        self._retired = True
        self._tg = None
        self._deferred.clear()
        self._overflow.clear()
        self.queued_refusals = self.owed_cancels = self.queued_controls = 0
        self.release_hold()

    def send_soon(self, kind: int, body: bytes) -> None:
        """Hand a small envelope to the session without waiting: at once if retention has room
        and nothing is queued before it, else queued for the drain task (no task per send)."""
        if self._retired or self.transport.failure is not None:
            return
        if not self._deferred and not self._overflow:
            try:
                if self.transport.try_send(body) is not None:
                    return
            except (SessionFailed, PayloadTooLarge):
                return
        self.defer(kind, body)

    def defer(self, kind: int, body: bytes) -> None:
        if self._retired:
            return
        self._deferred.append((kind, body))
        if kind == REFUSAL_KIND:
            self.queued_refusals += 1
        else:
            self.queued_controls += 1
            if kind == CANCEL_KIND:
                self.owed_cancels += 1
        self._start_drain()

    def attach(self, tg: anyio.abc.TaskGroup) -> None:
        """Run the drain task in ``tg`` (the session's), whenever something is queued."""
        self._tg = tg
        self._start_drain()

    def _start_drain(self) -> None:
        if not self._draining and self._tg is not None and (self._deferred or self._overflow):
            self._draining = True
            loop = _running_asyncio_loop()
            if loop is not None and asyncio.current_task(loop) is None:
                # A loop callback (a call's timer, a dropped stream's reclaim): anyio starts a
                # task only from a task, so one of asyncio's own hands the drain to the group.
                loop.create_task(self._start_from_task())
            else:
                self._tg.start_soon(self._drain)

    async def _start_from_task(self) -> None:
        tg = self._tg
        try:
            if tg is None or self._retired:
                raise RuntimeError("the session has ended")
            tg.start_soon(self._drain)
        except RuntimeError:  # retired meanwhile, or its task group has ended: nothing to send
            self._draining = False

    async def _drain(self) -> None:
        """The one task that writes what met full retention, in order, as capacity frees; it
        ends when nothing is left (the next :meth:`defer` starts another)."""
        try:
            while not self._retired:
                if self._deferred:
                    kind, body = self._deferred.popleft()
                elif self._overflow:
                    kind, body = REFUSAL_KIND, self._overloaded(self._overflow.popleft())
                else:
                    return
                if not await self._send(kind, body):
                    return
        finally:
            self._draining = False

    async def _send(self, kind: int, body: bytes) -> bool:
        """Write one queued envelope; whether the session still takes more."""
        try:
            await self.transport.send(body)
        except PayloadTooLarge:
            pass  # never for these small envelopes; nothing else to do with one
        except SessionFailed:
            return False
        finally:
            # Only now is its slot free: a refusal or cancel counts until handed over.
            if kind == REFUSAL_KIND:
                if self.queued_refusals:
                    self.queued_refusals -= 1
                if self.queued_refusals <= self.limits.max_queued_refusals // 2:
                    self.release_hold()
            elif self.queued_controls:  # not reset by a retirement meanwhile
                self.queued_controls -= 1
                if kind == CANCEL_KIND and self.owed_cancels:
                    self.owed_cancels -= 1
        return True

    def hold_reader(self) -> anyio.Event | None:
        """Asked by the transport's reader after each message: an event to wait for while the
        refusal backlog is full (back-pressure on the peer), else ``None``."""
        if self._hold is None and self.queued_refusals >= self.limits.max_queued_refusals:
            self._hold = anyio.Event()
            self.reader_holds += 1
            self._peer_log.log(
                self.transport.label,
                "reader held",
                "session %s: %d refusals wait for the peer's receipts; reading paused",
                self.transport.label,
                self.queued_refusals,
                extra=log_fields(session=self.transport.session_id),
            )
        return self._hold

    def release_hold(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.set()

    def overflow(self, call_id: int) -> None:
        """Keep a refusal past ``max_queued_refusals`` as its call id only (``OVERLOADED``)."""
        if self._retired or self.transport.failure is not None:
            return
        self._overflow.append(call_id)
        self.queued_refusals += 1
        self._start_drain()

    def _overloaded(self, call_id: int) -> bytes:
        """The refusal of a call kept past ``max_queued_refusals`` (see :meth:`overflow`)."""
        return error_envelope(
            call_id,
            NotDispatched(
                "OVERLOADED",
                f"{self.limits.max_queued_refusals} refusals were waiting for the peer's receipts",
            ),
        )
