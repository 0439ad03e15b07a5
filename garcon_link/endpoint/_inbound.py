"""The transport's inbound side: the socket reader (one :class:`Inbound`).

What it does (the rules are the transport's: see :mod:`garcon_link.endpoint.transport`):

* **Reading**: :meth:`Inbound.reader` reads the socket's messages and gives each to the session;
  what the session reports it obeys -- the fence passed (``Shared.fence_passed``), receipts due or
  urgent and frames confirmed (told to the outbound side), replay progress (the replay watch in
  ``Shared.replay``; its end told to the watches). On asyncio the socket may hand a message to
  :meth:`Inbound.take_nowait` in its callback instead, when the reader would not wait over it.
* **Pre-readiness buffer**: payloads accepted before the fence are held, and released in order
  when it passes; a new attachment first hands over what an earlier one left.
* **Hand-over**: what the session accepted goes to :class:`~garcon_link.endpoint._delivery.Delivery`
  at once, in the reader's turn; the reader waits for it (a full queue, a consumer's hold)
  before it reads on, and yields to other tasks after a bounded amount of work.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio

from ..core.session import Received
from ..errors import FailureReason, ProtocolError, SessionFailed
from ..net.backend import checkpointer
from ._delivery import Delivery
from ._outbound import Outbound
from ._shared import Shared
from ._watches import Watches
from .transport_types import MessageSocket, PreReadinessBuffer, TransportState

__all__ = ["Inbound"]


class Inbound:
    """The inbound side of one transport.

    Args:
        shared: the state the transport's parts share.
        delivery: the hand-over to the consumer.
        outbound: the outbound side (told what the reader accepted).
        watches: the watches (told of the replay's end).
        retire: the owner's ``retire(reason, detail)``, held weakly (see
            :func:`~garcon_link.endpoint._shared.weak_method`).
        set_state: the owner's state change (the reader announces ``READY``), likewise.
        yield_every_bytes: the inbound bytes after which the reader yields.
    """

    def __init__(
        self,
        shared: Shared,
        delivery: Delivery,
        outbound: Outbound,
        watches: Watches,
        *,
        retire: Callable[[FailureReason, str], None],
        set_state: Callable[[TransportState], None],
        yield_every_bytes: int,
    ) -> None:
        self._shared = shared
        self._session = shared.session
        self._delivery = delivery
        self._watches = watches
        self._retire = retire
        self._set_state = set_state
        self._yield_every_bytes = yield_every_bytes
        # What the reader calls for each message on the other parts, bound once.
        self._release = delivery.release
        self._wait_delivered = delivery.wait_delivered
        self._capacity_freed = outbound.capacity_freed
        self._receipt_urgent = outbound.receipt_urgent
        self._receipt_waits = outbound.receipt_waits
        self._buffer = PreReadinessBuffer(shared.limits)
        # The socket's callback hands messages to take_nowait while the reader waits (see
        # there): a hold that stops the reader from reading on, and an error to raise in run().
        self._direct_held: anyio.Event | None = None
        self._direct_error: Exception | None = None
        self.messages_read = 0
        self.messages_read_directly = 0

    # ------------------------------------------------------------------ observation

    @property
    def buffered_payloads(self) -> int:
        """Pre-readiness payloads held (not yet released: the fence has not passed)."""
        return len(self._buffer)

    @property
    def buffered_bytes(self) -> int:
        return self._buffer.size

    # ------------------------------------------------------------------ the owner's calls

    def detached(self) -> None:
        """The socket is gone: a hold the socket's callback took no longer applies."""
        self._direct_held = None

    def take_error(self) -> Exception | None:
        """What the socket's callback raised (:meth:`take_nowait`), to raise in ``run`` as the
        reader's own; ``None`` if nothing."""
        error, self._direct_error = self._direct_error, None
        return error

    def release_held(self) -> list[bytes | memoryview]:
        """The session is retired: the pre-readiness payloads held, in order (for the last
        hand-over); the buffer is empty afterwards."""
        return self._buffer.release()

    # ------------------------------------------------------------------ the reader

    async def reader(self, sock: MessageSocket) -> None:
        """The reader task of one attachment: reads ``sock`` until it ends."""
        checkpoint = checkpointer()
        # What earlier attachments accepted and did not deliver was acknowledged, so the peer's
        # replay may fill a whole window beside it: hand it over and read nothing until it is
        # queued, so the pre-readiness buffer holds only this attachment's replay.
        carried = self._buffer.attach()
        if carried:
            self._release(carried, buffered=True)
        await self._wait_delivered()
        # While this task waits for the next message with nothing buffered, the socket may hand
        # a small one to take_nowait in its callback instead (asyncio: one loop turn less).
        take_directly: Callable[[Callable[[bytes], bool] | None], bool] | None = getattr(
            sock, "take_messages_directly", None
        )
        if take_directly is not None and not take_directly(self.take_nowait):
            take_directly = None
        try:
            await self._read_messages(sock, checkpoint)
        finally:
            if take_directly is not None:
                take_directly(None)

    async def _read_messages(
        self, sock: MessageSocket, checkpoint: Callable[[], Awaitable[None]]
    ) -> None:
        shared = self._shared
        session = self._session
        packet_budget = shared.limits.max_packets_per_message
        yield_every_bytes = self._yield_every_bytes
        delivery = self._delivery
        unyielded_packets = 0  # handled since this task last yielded on purpose
        unyielded_bytes = 0
        while True:
            try:
                data = await sock.receive_message()
            except ProtocolError as exc:
                # A text frame, an over-size message or broken framing: the peer broke the
                # protocol, which is terminal for the session like a malformed packet (the link
                # closes the socket with the specific code it recorded, e.g. 1003 or 1009).
                self._retire(FailureReason.MALFORMED_PACKET, str(exc))
                return
            if data is None:
                retired_by_peer = sock.retired_by_peer()
                if retired_by_peer is not None:
                    # The peer closed because *it* retired the session (or shut down): retire
                    # here too, before detaching, so observers see one transition (to RETIRED).
                    self._retire(FailureReason.PEER_RETIRED, retired_by_peer)
                return
            held = self._direct_held
            if held is not None:
                # A message taken in the socket's callback asked the reader to read nothing
                # more until the consumer releases it: this one waits until then.
                self._direct_held = None
                await delivery.wait_for_consumer(held)
            received = self._accept(data)
            if received is None:
                return
            unyielded_packets += received.packets
            unyielded_bytes += len(data)
            bodies = received.bodies
            if not shared.fence_passed:
                for body in bodies:
                    if not self._buffer_payload(body):
                        return
                if received.fence:
                    # The first receipt on this attachment. Drain, then announce readiness.
                    shared.fence_passed = True
                    self._release(self._buffer.release(), buffered=True)
            else:
                self._release(bodies)
            if session.receipt_due:
                # *After* the release: the tasks the payloads woke (a handler, a caller) run
                # first and usually queue a frame, which the receipt then rides with.
                self._receipt_waits()
            fence_passed = shared.fence_passed
            if fence_passed:
                await self._wait_delivered()
            if received.fence:
                self._set_state(TransportState.READY)
            wants_yield = delivery.wants_yield
            if bodies and fence_passed and wants_yield is not None and wants_yield():
                # The consumer says these payloads woke a lone task (a handler, a waiting
                # caller): let it run before this reader re-arms its read, which is not on the
                # peer's round trip. (Never under load: it would split the batches the writer
                # coalesces.) After READY: what the task does next sees the session ready.
                await checkpoint()
            hold = delivery.hold
            if bodies and fence_passed and hold is not None:
                held = hold()
                if held is not None:
                    await delivery.wait_for_consumer(held)
            replay = shared.replay
            if not replay.done and replay.observe(
                received.progress,
                fence_passed=fence_passed,
                confirmed=session.confirmed,
                now=anyio.current_time(),
            ):
                self._watches.replay_finished()
            if unyielded_packets >= packet_budget or unyielded_bytes >= yield_every_bytes:
                # Everything this message carried was handed over: let the other tasks run
                # before the next message, which the socket may return without yielding.
                unyielded_packets = unyielded_bytes = 0
                await checkpoint()

    def _accept(self, data: bytes) -> Received | None:
        """The session's reading of one message, and the receipts it makes due or urgent;
        ``None`` if it retired the session."""
        self.messages_read += 1
        try:
            received = self._session.receive(data)
        except SessionFailed as failure:
            self._retire(failure.reason, failure.detail)
            return None
        if received.receipt_became_due:
            self._shared.receipt_due_at = time.monotonic()
        if received.confirmed_advanced:
            self._capacity_freed()
        if received.receipt_urgent:
            # Before the hand-over, which may be long (a direct consumer dispatching a
            # replay of thousands of payloads in this task): confirming what was accepted
            # frees the peer's retention -- at once if the socket takes it, else by the
            # writer as soon as this task yields.
            self._receipt_urgent()
        return received

    def take_nowait(self, data: bytes) -> bool:
        """One message, taken in the socket's callback as the waiting reader (asyncio): what
        the reader would do with it, when that needs no wait -- the replay fence has passed,
        the consumer is direct (``Delivery.consume``) and nothing awaits delivery or a hold. The
        reader's yield to the task a payload woke is not needed here: that task runs before
        the loop polls the socket again. ``False`` (nothing done): the reader reads it."""
        shared = self._shared
        scope = shared.scope
        delivery = self._delivery
        if (
            delivery.consumer is None
            or not shared.fence_passed
            or scope is None
            or scope.cancel_called
            or self._direct_held is not None
            or self._direct_error is not None
            or ((delivery.pending or delivery.in_flight) and delivery.undelivered())
        ):
            return False
        self.messages_read_directly += 1
        try:
            received = self._accept(data)
            if received is None:
                return True
            bodies = received.bodies
            if bodies:
                self._release(bodies)
            session = self._session
            if session.receipt_due:
                self._receipt_waits()  # after the release, as in the reader
            if received.fence:
                self._set_state(TransportState.READY)
            hold = delivery.hold
            if bodies and hold is not None:
                self._direct_held = hold()
            replay = shared.replay
            if not replay.done and replay.observe(
                received.progress,
                fence_passed=True,
                confirmed=session.confirmed,
                now=anyio.current_time(),
            ):
                self._watches.replay_finished()
        except Exception as exc:
            # Raised by run(), as if the reader had raised it; the socket is let go.
            self._direct_error = exc
            scope.cancel()
        return True

    def _buffer_payload(self, body: bytes | memoryview) -> bool:
        # Only this attachment's payloads count: what earlier ones left was queued before this
        # attachment read anything (see reader).
        overflow = self._buffer.hold(body)
        if overflow is not None:
            self._retire(FailureReason.INBOUND_OVERFLOW, overflow)
            return False
        return True
