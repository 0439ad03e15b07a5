"""The transport's hand-over: accepted payloads to the consumer, in order (one :class:`Delivery`).

The reader (:mod:`._inbound`) hands what the session accepted over *synchronously*
(:meth:`Delivery.release`), so a socket that ends (cancelling the reader) while the consumer is
slow never loses a payload the session has already accepted -- and acknowledged. Two ways on:

* **the queue**: one bounded memory stream read by one consumer
  (:meth:`Delivery.payloads`). Payloads go straight into it while it has room and nothing is
  ahead of them; otherwise they wait in a small pending queue that one delivery task per
  transport (:meth:`Delivery._deliver`) moves into it, in order. The reader waits for that
  (:meth:`Delivery.wait_delivered`): back-pressure on the peer, never on the session.
* **a direct consumer** (:meth:`Delivery.consume`, a
  :class:`~garcon_link.endpoint.transport_types.PayloadConsumer`): each payload is handed to it
  in the reader's turn -- no queue, no task switch -- and the frames issued during the hand-over
  of one message are held and written together at its end
  (:func:`~garcon_link.endpoint._outbound.hold_writes`). It back-pressures the peer by asking
  the reader to pause between messages (``hold``; :meth:`Delivery.wait_for_consumer`).

Either wait is our consumer's time, not the peer's: the replay inactivity clock is paused
meanwhile (the watches' ``pause`` and ``resume``). At retirement what is pending goes to the
queue if it has room, then the queue is closed (:meth:`Delivery.retire`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..logs import log_fields
from ._outbound import held_writes, hold_writes, write_held
from ._shared import Shared, log
from ._watches import Watches
from .transport_types import PayloadConsumer

__all__ = ["Delivery"]


class Delivery:
    """The hand-over of one transport's accepted payloads to its consumer.

    The reader reads, for each message, ``consumer`` (the direct consumer's ``deliver`` while
    :meth:`consume` runs, else ``None``), ``wants_yield`` and ``hold`` (its other two methods,
    likewise), and ``pending`` and ``in_flight`` (payloads on their way into the queue: released
    and not yet in it, and the one the delivery task is putting in).

    Args:
        shared: the state the transport's parts share.
        watches: the watches (the waits for our consumer pause the replay clock).
        task_group: where the delivery task runs; normally the link's.
    """

    def __init__(self, shared: Shared, watches: Watches, task_group: anyio.abc.TaskGroup) -> None:
        self._shared = shared
        self._session = shared.session
        self._watches = watches
        self._tg = task_group
        self._deliver_send: MemoryObjectSendStream[bytes]
        self._deliver_recv: MemoryObjectReceiveStream[bytes]
        self._deliver_send, self._deliver_recv = anyio.create_memory_object_stream[bytes](
            shared.limits.delivery_queue
        )
        # Released payloads not yet in the delivery queue, and the delivery task that moves
        # them there (see release).
        self.pending: deque[tuple[bytes, bool]] = deque()  # (payload, pre-readiness)
        self._pending_buffered = 0  # ... of which came from the pre-readiness buffer
        self._pending_buffered_bytes = 0
        self.in_flight = False
        self._delivering = False
        self._consumer_gone = False
        # A PayloadConsumer's bound methods while consume() runs, else None (all four together).
        self.consumer: Callable[[bytes | memoryview], None] | None = None
        self.wants_yield: Callable[[], bool] | None = None
        self.hold: Callable[[], anyio.Event | None] | None = None
        self._batch_end: Callable[[], None] | None = None
        self._retired = anyio.Event()
        self._pending_added = anyio.Event()
        self._delivery_progress = anyio.Event()

    # ------------------------------------------------------------------ observation

    @property
    def buffered_payloads(self) -> int:
        """Pre-readiness payloads released and not yet taken by the delivery task."""
        return self._pending_buffered

    @property
    def buffered_bytes(self) -> int:
        return self._pending_buffered_bytes

    @property
    def queued_payloads(self) -> int:
        """Other released payloads on their way to the consumer through the queue."""
        return (
            self._deliver_send.statistics().current_buffer_used
            + len(self.pending)
            - self._pending_buffered
            + self.in_flight
        )

    # ------------------------------------------------------------------ the owner's calls

    def retire(self, held: Sequence[bytes | memoryview]) -> None:
        """The session is retired: what was released and not yet queued, then ``held`` (the
        pre-readiness payloads never released), go to the queue if it has room; then the queue
        is closed (the consumer sees them, then the end)."""
        if self.pending or held:
            # Accepted and not yet queued for the consumer: hand them over if there is room.
            self._drain_nowait(held)
        self._deliver_send.close()
        self._pending_added.set()  # the delivery task ends
        self._delivery_progress.set()
        self._retired.set()

    def _drain_nowait(self, held: Sequence[bytes | memoryview]) -> None:
        # After the released ones.
        self.pending.extend((body if type(body) is bytes else bytes(body), True) for body in held)
        while self.pending:
            body, _ = self.pending[0]
            try:
                self._deliver_send.send_nowait(body)
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                log.warning(
                    "session %s: dropped %d accepted payload(s) at retirement",
                    self._shared.label,
                    len(self.pending),
                    extra=log_fields(session=self._shared.session_id),
                )
                break
            self.pending.popleft()
        self._clear_pending()

    # ------------------------------------------------------------------ consumer side

    def payloads(self) -> MemoryObjectReceiveStream[bytes]:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.payloads`."""
        return self._deliver_recv

    async def consume(self, consumer: PayloadConsumer) -> None:
        """:meth:`~garcon_link.endpoint.transport.SessionTransport.consume`."""
        deliver = consumer.deliver
        batch_end = consumer.batch_end
        with self._deliver_recv:
            # Drain the queue path until nothing is left on its way through it.
            if not await self._drain_queue(deliver, batch_end, until_idle=True):
                return
            self.consumer = deliver
            self.wants_yield = consumer.wants_yield
            self.hold = consumer.hold
            self._batch_end = batch_end
            try:
                await self._retired.wait()
            finally:
                self.consumer = None
                self.wants_yield = None
                self.hold = None
                self._batch_end = None
            # What retirement handed over (pre-readiness payloads) went to the queue.
            await self._drain_queue(deliver, batch_end, until_idle=False)

    async def _drain_queue(
        self,
        deliver: Callable[[bytes | memoryview], None],
        batch_end: Callable[[], None],
        *,
        until_idle: bool,
    ) -> bool:
        """Hand what the delivery queue holds to ``deliver``, each payload a batch of its own;
        with ``until_idle`` also wait for what is still on its way into it (pending, in flight).
        ``False`` once the queue ended."""
        receive = self._deliver_recv
        while True:
            try:
                body = receive.receive_nowait()
            except anyio.WouldBlock:
                if not (until_idle and (self.pending or self.in_flight)):
                    return True
                try:
                    body = await receive.receive()
                except anyio.EndOfStream:
                    return False
            except anyio.EndOfStream:
                return False
            self._hand_over(deliver, body)
            self._end_batch(batch_end)

    def _end_batch(self, batch_end: Callable[[], None]) -> None:
        try:
            batch_end()
        except Exception:
            log.exception(
                "session %s: the payload consumer failed at the end of a message",
                self._shared.label,
                extra=log_fields(session=self._shared.session_id),
            )

    def _consumer_failed(self) -> None:
        """Log the exception the payload consumer just raised (called in its ``except``; the
        payload is dropped, the session goes on)."""
        log.exception(
            "session %s: the payload consumer failed; payload dropped",
            self._shared.label,
            extra=log_fields(session=self._shared.session_id),
        )

    def _hand_over(
        self, deliver: Callable[[bytes | memoryview], None], body: bytes | memoryview
    ) -> None:
        try:
            deliver(body)
        except Exception:
            self._consumer_failed()

    # ------------------------------------------------------------------ the reader's calls

    def release(self, bodies: Sequence[bytes | memoryview], *, buffered: bool = False) -> None:
        """Hand ``bodies`` (accepted, in order) on: to the direct consumer now, or towards the
        queue; ``buffered``: they come from the pre-readiness buffer."""
        if self._consumer_gone:
            return
        consumer = self.consumer
        if consumer is not None:
            if len(bodies) > 1 and held_writes.batch is None:
                self._hand_over_holding(consumer, bodies)
                return
            for body in bodies:  # _hand_over of each, inline: this runs for every message
                try:
                    consumer(body)
                except Exception:
                    self._consumer_failed()
            if self._batch_end is not None:
                self._end_batch(self._batch_end)
            return
        send_nowait = self._deliver_send.send_nowait
        for body in bodies:
            if type(body) is memoryview:
                body = body.tobytes()  # the queue's readers are given bytes
            if not self.pending and not self.in_flight:
                # Fast path: nothing is ahead of it, so hand it straight to the queue if there
                # is room. send_nowait either queues it or raises, so nothing can be lost here.
                # A closed or broken queue falls through too: _deliver reports and cleans up.
                try:
                    send_nowait(body)
                    continue
                except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
            self.pending.append((body, buffered))
            if buffered:
                self._pending_buffered += 1
                self._pending_buffered_bytes += len(body)
        if not self.pending:
            return
        self._pending_added.set()
        if not self._delivering:
            self._delivering = True
            self._tg.start_soon(self._deliver)

    def _hand_over_holding(
        self, consumer: Callable[[bytes | memoryview], None], bodies: Sequence[bytes | memoryview]
    ) -> None:
        """Hand ``bodies`` (one inbound message's) to the direct consumer, holding the frames
        issued meanwhile (:func:`~garcon_link.endpoint._outbound.hold_writes`) and writing them
        at the end: one message per transport that got some. (A single payload is handed over
        without: nothing to merge.)"""
        batch = hold_writes()
        try:
            for body in bodies:  # _hand_over of each, inline: this runs for every message
                try:
                    consumer(body)
                except Exception:
                    self._consumer_failed()
            if self._batch_end is not None:
                self._end_batch(self._batch_end)
        finally:
            write_held(batch)

    def undelivered(self) -> bool:
        """Released payloads are not yet in the queue (and still can be)."""
        return bool(self.pending or self.in_flight) and not (
            self._session.failure or self._consumer_gone
        )

    async def wait_delivered(self) -> None:
        """Wait until every released payload is in the delivery queue.

        Time spent here is our consumer's, not the peer's: the replay inactivity clock is paused
        meanwhile and restarts when the wait ends.
        """
        if not self.undelivered():
            return
        waiting = self._watches.pause()
        try:
            while self.undelivered():
                progress = self._delivery_progress = anyio.Event()
                await progress.wait()
        finally:
            self._watches.resume(waiting)

    async def wait_for_consumer(self, released: anyio.Event) -> None:
        """Read nothing until the direct consumer's ``released`` is set (see :meth:`consume`);
        like :meth:`wait_delivered`, the replay inactivity clock is paused meanwhile."""
        waiting = self._watches.pause()
        try:
            await released.wait()
        finally:
            self._watches.resume(waiting)

    # ------------------------------------------------------------------ the delivery task

    async def _deliver(self) -> None:
        """The delivery task: runs until retirement (or until the consumer goes away)."""
        try:
            while self._session.failure is None:
                if not self.pending:
                    added = self._pending_added = anyio.Event()
                    await added.wait()
                    continue
                body, buffered = self.pending.popleft()
                if buffered:
                    self._pending_buffered -= 1
                    self._pending_buffered_bytes -= len(body)
                self.in_flight = True
                try:
                    await self._deliver_send.send(body)
                finally:
                    self.in_flight = False
                    self._delivery_progress.set()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # Retired (the queue is closed) or the consumer closed its end: nobody to deliver to.
            if self._session.failure is None:
                log.warning(
                    "session %s: the consumer closed the payload stream",
                    self._shared.label,
                    extra=log_fields(session=self._shared.session_id),
                )
            self._consumer_gone = True
            self._clear_pending()
            self._delivery_progress.set()

    def _clear_pending(self) -> None:
        self.pending.clear()
        self._pending_buffered = 0
        self._pending_buffered_bytes = 0
