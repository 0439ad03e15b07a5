"""The transport's outbound side: senders, writes, the socket writer and receipts.

One :class:`Outbound` per transport. What it does (the rules are the transport's: see
:mod:`garcon_link.endpoint.transport`):

* **Capacity**: :meth:`Outbound.send` waits while retention is full; waiting senders are
  admitted in the order they called, each woken alone (the first when receipts free room, the
  next as it leaves with room left). Receipt waits (:meth:`Outbound.wait_acknowledged`,
  :meth:`Outbound.wait_retained_below`) are woken once their condition holds.
* **Writes**: a lone frame on a quiet socket is written at once by the task that issued it
  (:meth:`Outbound._write_now`); frames issued while one inbound message is handed to a direct
  consumer are held and written as one message per transport at the end of that hand-over
  (:func:`hold_writes`, :func:`write_held`); everything else is written by the writer task
  (:meth:`Outbound.writer`), coalesced.
* **Receipts**: the reader reports what it accepted (:meth:`Outbound.receipt_urgent`,
  :meth:`Outbound.receipt_waits`); a lone receipt waits at most ``receipt_delay`` for a frame to
  ride with -- on asyncio under one loop timer per attachment, elsewhere polled by the writer.

It reads the socket, the run's scope, the replay fence and when the due receipt came due from
:class:`~garcon_link.endpoint._shared.Shared`, and writes nothing there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable

import anyio

from ..core.session import SessionState
from ..core.wire import Gathered, Ordinal
from ..errors import RetentionFull
from ..logs import log_fields
from ..net.backend import on_asyncio
from ._shared import Shared, log
from .transport_types import SOCKET_GONE, MessageSocket

__all__ = ["Outbound", "held_writes", "hold_writes", "write_held"]

_INLINE_MARGIN = 64  # room for the encoded frame's head and a receipt beside a written body

_POLL_QUIET_TICKS = 2  # receipt_delay ticks with nothing due before the writer stops polling
# (the writer polls only where no loop timer looks after lone receipts: see receipt_waits)


class _HeldWrites(threading.local):
    """The outbound sides holding frames issued while one inbound message is handed to a direct
    consumer (``batch``: ``None`` outside such a hand-over), per thread: each event loop's
    dispatch is synchronous, so the hand-over in progress on this thread is the one issuing."""

    batch: list[Outbound] | None = None


held_writes = _HeldWrites()


def hold_writes() -> list[Outbound]:
    """A hand-over to a direct consumer begins: the frames issued until :func:`write_held` are
    held (no hand-over starts inside another: nothing in one reads)."""
    batch: list[Outbound] = []
    held_writes.batch = batch
    return batch


def write_held(batch: list[Outbound]) -> None:
    """The hand-over :func:`hold_writes` began has ended: each outbound side that held frames
    writes them, as one message."""
    held_writes.batch = None
    for outbound in batch:
        outbound.write_held(batch)


class _Waiter:
    """One task waiting on the transport, with an event of its own (woken alone)."""

    __slots__ = ("done", "event", "size")

    def __init__(self, size: int = 0, done: Callable[[], bool] | None = None) -> None:
        self.event = anyio.Event()
        self.size = size  # a sender's body size
        self.done = done  # a receipt wait's condition; None for a sender

    async def wait(self) -> None:
        event = self.event
        if event.is_set():
            event = self.event = anyio.Event()
        await event.wait()


class Outbound:
    """The outbound side of one transport.

    Args:
        shared: the state the transport's parts share.
        coalesce_limit: the most bytes merged into one written message.
        quiet: seconds since the previous frame after which a frame is written at once.
    """

    def __init__(self, shared: Shared, *, coalesce_limit: int, quiet: float) -> None:
        limits = shared.limits
        self._shared = shared
        self._session = shared.session
        self._coalesce_limit = coalesce_limit
        self._quiet = quiet
        self._max_packets = limits.max_packets_per_message  # what the peer accepts per message
        self._receipt_delay = limits.receipt_delay
        self._wakeup = anyio.Event()
        self._last_write_now = 0.0
        # The batch of held writes this side is in (_write_now): it holds frames while that is
        # the hand-over's batch in progress; what it holds, in bytes with heads.
        self._held_in: list[Outbound] | None = None
        self._held_bytes = 0
        # Senders waiting for retention capacity, in arrival order: only the first may retry,
        # and a newcomer queues behind them, so bodies are issued in the order send() was
        # called (call ids must reach the peer increasing, whatever order waiters wake in).
        # Each has an event of its own: freed room wakes the first only, which wakes the next
        # as it leaves (see capacity_freed).
        self._senders: deque[_Waiter] = deque()
        # Tasks waiting for receipts (wait_acknowledged, wait_retained_below), each woken
        # once its condition holds.
        self._receipt_waiters: list[_Waiter] = []
        self._receipt_poll = False  # the writer checks for lone receipts on its own
        # On asyncio (while attached): the loop whose timer sends lone receipts instead of the
        # writer's poll, and that timer while armed (see receipt_waits).
        self._receipt_loop: asyncio.AbstractEventLoop | None = None
        self._receipt_timer: asyncio.TimerHandle | None = None
        self.messages_written = 0
        self.capacity_wakeups = 0
        self.writer_wakeups = 0
        self.receipt_timer_fires = 0
        self.receipt_polls_started = 0
        self.receipt_polls_stopped = 0
        self.receipt_poll_writes = 0

    # ------------------------------------------------------------------ the owner's calls

    def attached(self) -> None:
        """A socket attaches: the writer has the replay to send."""
        self._wakeup.set()
        self._receipt_loop = asyncio.get_running_loop() if on_asyncio() else None

    def detached(self) -> None:
        """The socket is gone (the next attachment's replay ends with a receipt)."""
        self._receipt_loop = None
        self._cancel_receipt_timer()

    def retire(self) -> None:
        """Every waiter leaves (a sender raises, a receipt wait returns ``False``); the writer
        ends."""
        for waiter in (*self._senders, *self._receipt_waiters):
            self._wake(waiter)
        self._wakeup.set()
        self._cancel_receipt_timer()

    def wake(self) -> None:
        """Wake the writer: it has something to send."""
        self._wakeup.set()

    # ------------------------------------------------------------------ senders

    async def send(self, body: bytes | Gathered) -> Ordinal:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.send`."""
        ordinal = self.send_nowait(body, False)
        if ordinal is not None:
            return ordinal
        session = self._session
        me = _Waiter(len(body))
        senders = self._senders
        senders.append(me)
        try:
            while True:
                if senders[0] is me:
                    try:
                        ordinal = session.send(body)
                        break
                    except RetentionFull:
                        pass
                else:
                    failure = session.failure
                    if failure is not None:  # retirement wakes every waiter
                        raise failure
                # The first in line is woken when receipts free room, the next one when the
                # first leaves with room left for its body.
                await me.wait()
        finally:
            first = senders[0] is me
            senders.remove(me)
            if first and senders and session.has_capacity(senders[0].size):
                self._wake(senders[0])
        if not self._write_now(len(body)):
            self._wakeup.set()
        return ordinal

    def send_nowait(self, body: bytes | Gathered, ahead: bool) -> Ordinal | None:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.send_nowait`, or with
        ``ahead`` :meth:`~garcon_link.endpoint.transport.SessionTransport.try_send` (ahead of
        the senders waiting for capacity)."""
        if self._senders and not ahead:
            return None
        try:
            ordinal = self._session.send(body)
        except RetentionFull:
            return None
        if not self._write_now(len(body)):
            self._wakeup.set()
        return ordinal

    async def wait_acknowledged(self) -> bool:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.wait_acknowledged`."""
        session = self._session
        target = session.issued
        return await self._wait_for_receipts(lambda: session.confirmed >= target)

    async def wait_retained_below(self, size: int) -> bool:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.wait_retained_below`."""
        session = self._session
        return await self._wait_for_receipts(lambda: session.retained_bytes < size)

    async def _wait_for_receipts(self, done: Callable[[], bool]) -> bool:
        if done():
            return True
        me = _Waiter(done=done)
        self._receipt_waiters.append(me)
        try:
            while not done():
                if self._session.failure is not None:
                    return False
                # Woken by capacity_freed once done() holds, or by retirement.
                await me.wait()
        finally:
            self._receipt_waiters.remove(me)
        return True

    def _wake(self, waiter: _Waiter) -> None:
        if not waiter.event.is_set():
            waiter.event.set()
            self.capacity_wakeups += 1

    def capacity_freed(self) -> None:
        """Receipts (or a resume position) confirmed frames: wake the first waiting sender (one
        task, however many wait) and the receipt waits whose condition now holds."""
        if self._senders:
            self._wake(self._senders[0])
        for waiter in self._receipt_waiters:
            if waiter.done is not None and waiter.done():
                self._wake(waiter)

    # ------------------------------------------------------------------ writes from the issuer

    def _write_now(self, size: int) -> bool:
        """Write the frame of ``size`` body bytes just queued, with a due receipt, from this task
        -- or hold it, to be written at the end of the inbound hand-over in progress.

        During a direct consumer's hand-over of one inbound message (any transport's, on this
        thread), a side with nothing else queued starts holding the frames it is given (else
        the writer has frames to send already: this one joins them); while it holds, what it
        has queued is what it held, and :func:`write_held` writes it as one message at the end
        of the hand-over. That message stays within the bounds of one -- the coalescing limit
        and the frame limit (with heads and a receipt), ``max_packets_per_message`` (with a
        receipt) -- or the side stops holding and its writer sends everything queued, split at
        those bounds.

        Outside a hand-over, only when the previous frame issued outside one was issued at least
        ``quiet`` seconds ago (frames issued in a burst are left to the writer, which coalesces
        them), it is the only frame queued, the replay fence has passed and the socket takes it
        without waiting. Returns ``False`` (the writer must send it) otherwise.
        """
        batch = held_writes.batch
        fence_passed = self._shared.fence_passed
        if batch is not None and fence_passed:
            held = size + _INLINE_MARGIN
            if self._held_in is batch:
                held += self._held_bytes
                if held <= self._coalesce_limit and self._session.frames_queued < self._max_packets:
                    self._held_bytes = held
                    return True
            elif self._session.frames_queued == 1 and held <= self._coalesce_limit:
                self._held_in = batch
                self._held_bytes = held
                batch.append(self)
                return True
            self._held_in = None
            return False
        now = time.monotonic()
        quiet = now - self._last_write_now >= self._quiet
        self._last_write_now = now
        return (
            quiet
            and fence_passed
            and self._session.frames_queued == 1
            and size + _INLINE_MARGIN <= self._coalesce_limit
            and self.write_queued_now()
        )

    def write_held(self, batch: list[Outbound]) -> None:
        """The hand-over of ``batch`` ended: write what this side held in it as one message
        (if it still holds: else it gave its frames to its writer)."""
        if self._held_in is batch:
            self._held_in = None
            if not self.write_queued_now():
                self._wakeup.set()

    def write_receipt_now(self) -> bool:
        """Write a due receipt at once from this task if nothing else is queued and the socket
        takes it without waiting; ``False`` (nothing taken) otherwise."""
        return self._session.frames_queued == 0 and self.write_queued_now()

    def write_queued_now(self) -> bool:
        """Hand what the session has to send to the socket synchronously, if it takes it."""
        shared = self._shared
        sock = shared.sock
        scope = shared.scope
        if (
            sock is None
            or scope is None
            or scope.cancel_called  # being detached: the replay on the next socket sends it
            or not sock.writable_now()
        ):
            return False
        packets = self._session.data_to_send()
        if not packets:
            return True
        try:
            sock.send_message_nowait(packets[0] if len(packets) == 1 else b"".join(packets))
        except SOCKET_GONE as exc:
            # As in the writer: the attachment ends; what was taken stays retained and is
            # replayed on the next socket (a lost receipt is re-sent as the resume position).
            log.debug(
                "session %s: write failed, detaching: %s",
                shared.label,
                exc,
                extra=log_fields(session=shared.session_id),
            )
            scope.cancel()
        else:
            self.messages_written += 1
        return True

    # ------------------------------------------------------------------ the writer

    async def writer(
        self, sock: MessageSocket, pumps: anyio.CancelScope, writing: anyio.CancelScope
    ) -> None:
        """The writer task of one attachment: ends when ``writing`` is cancelled; a dead socket
        ends the attachment (``pumps``, the scope of its pumps, is cancelled)."""
        try:
            with writing:
                await self._write_packets(sock)
        except SOCKET_GONE as exc:
            # The socket died under a write: end this attachment (the reader may still be
            # waiting for bytes that will never come); the session waits for the next socket.
            log.debug(
                "session %s: write failed, detaching: %s",
                self._shared.label,
                exc,
                extra=log_fields(session=self._shared.session_id),
            )
            pumps.cancel()

    async def _write_packets(self, sock: MessageSocket) -> None:
        """The writer: sends what is queued, coalesced, and looks after lone receipts.

        A receipt that is due but not urgent may wait up to ``receipt_delay`` for frames to ride
        with (a reply, usually, which the task issuing it often writes itself). While receipts
        keep coming due, the writer *polls*: it wakes every ``receipt_delay`` and sends a lone
        receipt that has waited that long by then (a younger one waits out its delay: a frame
        may still carry it), so the reader need not wake it for each one (``_receipt_poll``); after
        ``_POLL_QUIET_TICKS`` ticks with nothing due it stops and waits to be woken again. On
        asyncio it does not poll: the receipt timer (:meth:`receipt_waits`) sends lone
        receipts, and wakes the writer only for one the socket cannot take at once.
        """
        shared = self._shared
        session = self._session
        # Coalescing amortises per-message cost for *small* packets; merging megabytes gains
        # nothing and multiplies peak memory (the join, wsproto's masking copy and the socket
        # buffer each hold the whole message), so a larger packet goes out on its own.
        limit = self._coalesce_limit
        max_packets = self._max_packets
        delay = self._receipt_delay
        timed = self._receipt_loop is not None  # a loop timer sends lone receipts: no polling
        quiet_ticks = 0
        ticked = False  # the last wait ended by the poll timer, not by a wake-up
        written = False  # a message was written on this attachment
        try:
            while True:
                # A fresh event first (if this one was used): anything issued after this point
                # wakes us again.
                if self._wakeup.is_set():
                    self._wakeup = anyio.Event()
                lone_receipt = (
                    session.receipt_due and not session.frames_queued and not session.receipt_urgent
                )
                if lone_receipt and timed:
                    if shared.receipt_due_at + delay > time.monotonic():
                        # Young: the timer sends it unless a frame carries it first.
                        self.receipt_waits()
                        await self._wait_for_wakeup(None)
                        continue
                elif lone_receipt and not self._receipt_poll:
                    # Woken by the reader for it: start polling, give frames a chance to come.
                    self._receipt_poll = True
                    self.receipt_polls_started += 1
                    quiet_ticks = 0
                    ticked = await self._wait_for_wakeup(delay)
                    continue
                if lone_receipt and ticked:
                    # A poll tick: send the receipt only once it has waited receipt_delay (a
                    # frame issued meanwhile carries it). Else every tick that fell between a
                    # reply and the caller's next call sent one alone -- a sixth of the calls
                    # of a sequential caller, each a wake-up and a message for the peer.
                    wait = shared.receipt_due_at + delay - time.monotonic()
                    if wait > 0:
                        ticked = await self._wait_for_wakeup(wait)
                        continue
                packets = session.data_to_send()
                if not packets:
                    if session.state is not SessionState.ATTACHED:
                        return
                    if not ticked and not timed:
                        # Woken for nothing: the reader woke us for a receipt that a frame
                        # written meanwhile carried. Poll from now on instead.
                        if not self._receipt_poll:
                            self._receipt_poll = True
                            self.receipt_polls_started += 1
                        quiet_ticks = 0
                    elif self._receipt_poll:
                        quiet_ticks += 1
                        if quiet_ticks > _POLL_QUIET_TICKS:
                            self._receipt_poll = False
                            self.receipt_polls_stopped += 1
                    ticked = await self._wait_for_wakeup(delay if self._receipt_poll else None)
                    continue
                if lone_receipt:
                    quiet_ticks = 0
                    if ticked:
                        self.receipt_poll_writes += 1
                ticked = False
                # Coalesce every packet ready now into as few messages as the frame limit allows.
                batch: list[bytes] = []
                size = 0
                for packet in packets:
                    if batch and (size + len(packet) > limit or len(batch) == max_packets):
                        await sock.send_message(b"".join(batch))
                        self.messages_written += 1
                        batch, size = [], 0
                    batch.append(packet)
                    size += len(packet)
                await sock.send_message(batch[0] if len(batch) == 1 else b"".join(batch))
                self.messages_written += 1
                if not written:
                    # The attachment's first frames (the replay fence) are out -- and with
                    # them, on a listener, its proof: the peer can replay from now on, so the
                    # replay's inactivity clock starts here, not at the attach.
                    written = True
                    replay = shared.replay
                    if not replay.done:
                        replay.restart(anyio.current_time())
        finally:
            if self._receipt_poll:
                self._receipt_poll = False
                self.receipt_polls_stopped += 1

    async def _wait_for_wakeup(self, timeout: float | None) -> bool:
        """Wait until the writer is woken, or ``timeout`` seconds (``None``: no limit) pass;
        ``True`` if the time ran out (a poll tick)."""
        if timeout is None:
            await self._wakeup.wait()
            self.writer_wakeups += 1
            return False
        with anyio.move_on_after(timeout) as tick:
            await self._wakeup.wait()
        self.writer_wakeups += 1
        return tick.cancelled_caught

    # ------------------------------------------------------------------ receipts

    def receipt_urgent(self) -> None:
        """The reader accepted a message that made a receipt urgent (the fence, or
        ``receipt_interval`` messages unconfirmed): it goes out at once if the socket takes it,
        else by the writer as soon as the reader yields."""
        if not self.write_receipt_now():
            self._wakeup.set()

    def receipt_waits(self) -> None:
        """A receipt is due after an inbound message: see that it goes out within
        ``receipt_delay`` unless a frame carries it first. (An urgent one went out or to the
        writer already: :meth:`receipt_urgent`.) On asyncio a loop timer looks after it --
        armed once, however many receipts come due and ride with frames meanwhile -- and the
        writer is not woken; otherwise the writer is woken for it and polls (see there)."""
        loop = self._receipt_loop
        if loop is not None:
            if self._receipt_timer is None:
                wait = self._shared.receipt_due_at + self._receipt_delay - time.monotonic()
                self._receipt_timer = loop.call_later(max(wait, 0.0), self._receipt_timer_fired)
        elif not self._receipt_poll:
            self._wakeup.set()

    def _receipt_timer_fired(self) -> None:
        """The receipt timer (asyncio, in the loop's callback): a receipt still due once it has
        waited ``receipt_delay`` is written at once if the socket takes it and nothing else is
        queued, else by the writer, which is woken for it; a younger one (the one the timer was
        armed for went out with a frame) gets a timer of its own; none due, nothing to do."""
        self._receipt_timer = None
        if not self._session.receipt_due or self._receipt_loop is None:
            return
        self.receipt_timer_fires += 1
        if self._shared.receipt_due_at + self._receipt_delay > time.monotonic():
            self.receipt_waits()
        elif not self.write_receipt_now():
            self._wakeup.set()

    def _cancel_receipt_timer(self) -> None:
        timer, self._receipt_timer = self._receipt_timer, None
        if timer is not None:
            timer.cancel()
