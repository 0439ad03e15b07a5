"""A call in the caller's pending table, and the ways it ends.

A :class:`_Pending` call ends once (:meth:`~garcon_link.rpc.caller.Caller._finish`): a waiting
task is woken, or, for a relayed call the gateway forwards without a task
(:meth:`~garcon_link.rpc.caller.Caller.forward`), its :class:`Forward` is told by callback. A
forward's timeout and cancel are loop timers, not a task: the forwards of one session share one
timer over a queue in deadline order (:class:`_Deadlines`), and one whose deadline comes before
the last queued keeps a timer of its own. A stream call's items and the credit it has granted
are its :class:`_StreamState`, held by the pending call, not by the iterator.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio

from ..errors import CallError, NotDispatched, OutcomeUnknown
from ..limits import Limits
from .errorbody import INTERRUPTED, NOT_STARTED
from .interface import MethodSpec
from .outbox import Outbox
from .splice import Spliced


class _Pending:
    __slots__ = (
        "armed",
        "ended",
        "error",
        "forward",
        "id",
        "ordinal",
        "receipt",
        "spec",
        "stream",
        "value",
        "waiter",
    )

    def __init__(self, call_id: int, spec: MethodSpec, stream: _StreamState | None) -> None:
        self.id = call_id
        self.spec = spec
        self.stream = stream
        self.ordinal: int | None = None
        self.ended = False  # set once, by Caller._finish
        # Whoever waits for the end: an asyncio future (asyncio) or an anyio.Event, made only
        # when someone waits (most calls on asyncio make a future and nothing else).
        self.waiter: asyncio.Future[None] | anyio.Event | None = None
        self.value: Any = None
        self.error: CallError | None = None
        self.receipt: str | None = None  # the ``cancel`` field of the error that ended it
        self.forward: Forward | None = None  # a forwarded call ends by callback, not a wait
        # Whether its deadline waits in the caller's queue (_Deadlines) on its asyncio waiter.
        self.armed = False

    def _expire(self) -> None:
        """Its deadline passed (:class:`_Deadlines`): stop the wait (it is still pending: the
        caller times it out)."""
        self.armed = False
        waiter = self.waiter
        if isinstance(waiter, asyncio.Future) and not waiter.done():
            waiter.set_result(None)

    def end(self) -> None:
        self.ended = True
        forward = self.forward
        if forward is not None:
            # Let go of it (it holds this call): the two are then freed by their counts, not
            # left for the cycle collector, whose passes grow with every forward in flight.
            self.forward = None
            forward.ended()
            return
        waiter = self.waiter
        if waiter is None:
            return
        if isinstance(waiter, anyio.Event):
            waiter.set()
        elif not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until :meth:`end` (a checkpoint, like ``anyio.Event.wait``)."""
        if self.ended:
            await anyio.lowlevel.checkpoint()
            return
        event = self.waiter = anyio.Event()
        await event.wait()


class _StreamState:
    """What a stream call has received and the credit it has granted (consumer side).

    Held by the pending call, *not* by the :class:`~garcon_link.rpc.streams.RemoteStream` the
    application iterates, so the session never keeps that iterator alive (see
    :func:`~garcon_link.rpc.streams._reclaim_when_dropped`).
    ``credit_items``/``credit_bytes`` are what the producer may still send: the initial window
    plus every grant, minus every item received.
    """

    __slots__ = ("arrived", "credit_bytes", "credit_items", "ended", "error", "items")

    def __init__(self, credit_items: int, credit_bytes: int) -> None:
        self.items: deque[tuple[Any, int]] = deque()
        self.arrived = anyio.Event()
        self.ended = False
        self.error: CallError | None = None
        self.credit_items = credit_items
        self.credit_bytes = credit_bytes

    def deliver_item(self, value: Any, size: int) -> None:
        self.items.append((value, size))
        self.arrived.set()

    def deliver_end(self, error: CallError | None) -> None:
        self.ended = True
        self.error = error
        self.arrived.set()


class _Caller(Protocol):
    """What a :class:`Forward`, a :class:`~garcon_link.rpc.streams.RemoteStream` and the reclaim
    of a dropped stream use of their :class:`~garcon_link.rpc.caller.Caller` (which imports this
    module, so it is named here by what it offers)."""

    limits: Limits
    _pending: dict[int, _Pending]
    _outbox: Outbox

    def _prepare(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        credit: tuple[int, int],
        key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> tuple[_Pending | None, bytes | Spliced]: ...

    def _prepare_relayed(
        self,
        spec: MethodSpec,
        service: str,
        method: str,
        arguments: bytes,
        key: bytes | None,
        metadata: Mapping[str, str] | None,
        credit: tuple[int, int],
    ) -> tuple[_Pending, bytes]: ...

    async def _issue(self, pending: _Pending, body: bytes | Spliced) -> None: ...

    def _abandon(self, pending: _Pending) -> None: ...

    def _send_cancel(self, call_id: int) -> None: ...

    def _reclaim_stream(self, pending: _Pending) -> None: ...

    def _finish(
        self, pending: _Pending, *, value: Any = None, error: CallError | None = None
    ) -> None: ...


class Forward:
    """A relayed call issued by :meth:`~garcon_link.rpc.caller.Caller.forward`, ended by callback.

    Its end is told once to ``on_end``: :attr:`encoded` (the result's value as received, when it
    came whole), else :attr:`value` (decoded, when it came in parts) or :attr:`error` with
    :attr:`receipt` (the ``cancel`` field of the error that ended it). Past ``timeout`` it is
    cancelled and, as :meth:`~garcon_link.rpc.caller.Caller.call` does, its end is the peer's answer
    to the cancel within ``cancel_grace`` (a receipt mapped to a ``TIMEOUT``), else
    ``OutcomeUnknown("TIMEOUT")``. :meth:`cancel` (the relay's caller cancelled) sends the
    ``cancel`` and ends it with the peer's answer, its receipt kept, or, past ``cancel_grace``,
    ``OutcomeUnknown("CANCELLED")``. :meth:`abandon` forgets it: nothing is told.
    """

    __slots__ = (
        "_caller",
        "_cancelled",
        "_loop",
        "_timed_out",
        "_timeout",
        "_timer",
        "armed",
        "encoded",
        "error",
        "on_end",
        "pending",
        "receipt",
        "value",
    )

    def __init__(
        self,
        caller: _Caller,
        pending: _Pending,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        on_end: Callable[[Forward], None],
        deadlines: _Deadlines | None = None,
    ) -> None:
        self._caller = caller
        self.pending = pending
        self._loop = loop
        self._timeout = timeout
        self.on_end = on_end
        self._timed_out = False
        self._cancelled = False
        self.encoded: bytes | None = None
        self.value: Any = None
        self.error: CallError | None = None
        self.receipt: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        # While it waits on ``deadlines`` (the usual case), it has no timer of its own.
        self.armed = deadlines is not None and deadlines.add(self, deadlines.now() + timeout)
        if not self.armed:
            self._timer = loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        self.armed = False
        if self.pending.ended or self._cancelled:
            return
        self._timed_out = True
        self._caller._send_cancel(self.pending.id)
        self._timer = self._loop.call_later(self._caller.limits.cancel_grace, self._give_up)

    def cancel(self) -> None:
        """Cancel it on the peer; its end is the peer's answer (class docstring)."""
        if self.pending.ended or self._cancelled or self._timed_out:
            return
        self._cancelled = True
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
        self._caller._send_cancel(self.pending.id)
        self._timer = self._loop.call_later(self._caller.limits.cancel_grace, self._give_up)

    def _give_up(self) -> None:
        """No answer to the ``cancel`` within ``cancel_grace``: a later one is dropped."""
        self._timer = None
        pending, caller = self.pending, self._caller
        if pending.ended:
            return
        caller._pending.pop(pending.id, None)
        if self._cancelled:
            self.receipt = INTERRUPTED
            error: CallError = OutcomeUnknown(
                "CANCELLED", "cancelled while running; it may have had effects"
            )
        else:
            error = OutcomeUnknown("TIMEOUT", f"no reply within {self._timeout}s; cancel sent")
            self._timed_out = False  # the error is final, not a receipt to map
        caller._finish(pending, error=error)

    def abandon(self) -> None:
        """Forget it and cancel it on the peer (best effort); ``on_end`` is not told."""
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = self.pending
        if not pending.ended:
            pending.forward = None
            self._caller._abandon(pending)

    def ended(self) -> None:
        """The pending call ended (:meth:`_Pending.end`): tell ``on_end``."""
        self.armed = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending = self.pending
        self.value, self.error = pending.value, pending.error
        receipt = self.receipt if self.receipt is not None else pending.receipt
        self.receipt = receipt
        error = self.error
        if self._cancelled:
            pass  # the receipt is the relay's caller's
        elif self._timed_out and error is not None:
            timeout = self._timeout
            not_started = isinstance(error, NotDispatched) and error.code == "CANCELLED"
            if receipt == NOT_STARTED or not_started:
                self.error = NotDispatched(
                    "TIMEOUT", f"no reply within {timeout}s; cancelled before it started"
                )
            elif receipt == INTERRUPTED:
                self.error = OutcomeUnknown(
                    "TIMEOUT",
                    f"no reply within {timeout}s; cancelled while running "
                    "(it may have had effects)",
                )
            self.receipt = None  # the timeout is the forward's own: its caller needs no receipt
        else:
            self.receipt = None
        self.on_end(self)


class _Deadline(Protocol):
    """What waits on :class:`_Deadlines`: a :class:`Forward`, or a :class:`_Pending` call
    waiting on asyncio."""

    armed: bool

    def _expire(self) -> None: ...


class _Deadlines:
    """The deadlines of one session's forwards (or of its calls waiting on asyncio), with one
    loop timer for all of them (a timer per call costs a heap push and a cancel on every call).

    Entries come in the order of their deadlines as long as their timeouts are alike (a
    facade's or the relay's default timeout): each is appended, and the timer is armed for the
    first one still waiting. One whose deadline is earlier than the last one's is refused
    (:meth:`add` returns ``False``) and keeps a timer of its own. An entry that ends, is
    cancelled or abandoned only clears its ``armed`` flag; the entries it leaves are dropped
    from the front as new ones come, and the whole queue is compacted once it holds more than
    twice the session's pending calls (plus :attr:`SLACK`), so it stays within a small multiple
    of ``max_pending_calls`` whatever the order in which entries end.
    """

    SLACK = 64

    __slots__ = ("_loop", "_pending", "_queue", "_timer", "_when", "now")

    def __init__(self, loop: asyncio.AbstractEventLoop, pending: Mapping[int, _Pending]) -> None:
        self._loop = loop
        self.now = loop_clock(loop)  # the loop's clock, read for each entry's deadline
        self._pending = pending
        self._queue: deque[tuple[float, _Deadline]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._when = 0.0  # when the timer fires

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, entry: _Deadline, deadline: float) -> bool:
        """Queue ``entry`` (and set its ``armed``); ``False`` (not queued) if ``deadline``
        comes before the last queued one's."""
        queue = self._queue
        while queue and not queue[0][1].armed:
            queue.popleft()
        if queue and deadline < queue[-1][0]:
            return False
        if len(queue) > 2 * len(self._pending) + self.SLACK:
            self._queue = queue = deque(entry for entry in queue if entry[1].armed)
        queue.append((deadline, entry))
        entry.armed = True
        first = queue[0][0]
        timer = self._timer
        if timer is None or first < self._when:
            # (the timer may be set for entries since dropped, later than the first now)
            if timer is not None:
                timer.cancel()
            self._when = first
            self._timer = self._loop.call_at(first, self._fire)
        return True

    def _fire(self) -> None:
        self._timer = None
        queue = self._queue
        now = self._loop.time()
        while queue:
            deadline, entry = queue[0]
            if not entry.armed:
                queue.popleft()
            elif deadline <= now:
                queue.popleft()
                entry._expire()
            else:
                self._when = deadline
                self._timer = self._loop.call_at(deadline, self._fire)
                return

    def clear(self) -> None:
        """Forget every deadline (the session retired: its calls have ended)."""
        self._queue.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def loop_clock(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """``loop.time``, or the function it calls: ``time.monotonic`` itself when ``loop`` keeps
    asyncio's own clock (a builtin, where the method is a Python frame on every call's path)."""
    if type(loop).time is asyncio.BaseEventLoop.time:
        return time.monotonic
    return loop.time
