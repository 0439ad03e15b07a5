"""What a :class:`~garcon_link.endpoint.transport.SessionTransport` meets, apart from the transport.

The socket it is attached to (:class:`MessageSocket`, and :data:`SOCKET_GONE`, what a dead one
raises), the consumer it hands payloads to (:class:`PayloadConsumer`), its states and its
statistics snapshot, and the pre-readiness buffer (:class:`PreReadinessBuffer`, sans-IO): what one
attachment accepts before the peer's replay fence, bounded. All are imported from
:mod:`garcon_link.endpoint.transport` too (docs/design.md#transport).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import anyio

from ..core.session import SessionStatistics
from ..limits import Limits

__all__ = [
    "SOCKET_GONE",
    "MessageSocket",
    "PayloadConsumer",
    "PreReadinessBuffer",
    "TransportState",
    "TransportStatistics",
]


class TransportState(enum.Enum):
    DETACHED = "detached"
    REPLAYING = "replaying"
    READY = "ready"
    RETIRED = "retired"


class MessageSocket(Protocol):
    """What the transport needs of an authenticated socket (implemented by the link)."""

    async def send_message(self, data: bytes) -> None:
        """Write one binary WebSocket message, awaiting drain.

        Raises:
            anyio.BrokenResourceError: (or a subclass, or ``ClosedResourceError``) the socket is
                dead; the transport ends the attachment, the session stays.
        """

    async def receive_message(self) -> bytes | None:
        """Return the next whole binary message, or ``None`` once the socket has closed.

        Raises:
            ProtocolError: the peer broke the WebSocket protocol (a text frame, a message over
                the frame limit, bad framing); the transport retires the session.
        """

    def retired_by_peer(self) -> str | None:
        """After ``receive_message`` returned ``None``: why, if the peer's close said that it
        retired the logical session (e.g. ``"peer closed with 1001"``); else ``None``."""

    def writable_now(self) -> bool:
        """Whether :meth:`send_message_nowait` may be called now (``False`` if never)."""

    def send_message_nowait(self, data: bytes) -> None:
        """Write one binary message without waiting; only after :meth:`writable_now`.

        Raises:
            anyio.BrokenResourceError: as :meth:`send_message`.
        """


class PayloadConsumer(Protocol):
    """A consumer that takes payloads straight from the socket reader
    (:meth:`~garcon_link.endpoint.transport.SessionTransport.consume`); the RPC layer's dispatch
    implements it.

    Every method runs in the socket reader's task, in its turn, and must not block or raise.
    An exception from :meth:`deliver` is logged and that payload dropped; one from
    :meth:`batch_end` is logged; the reader goes on. :meth:`wants_yield` and :meth:`hold` are
    not guarded: what they raise leaves the reader. The transport takes the four bound methods
    once, when :meth:`~garcon_link.endpoint.transport.SessionTransport.consume` is called, not
    again per message.
    """

    def deliver(self, payload: bytes | memoryview) -> None:
        """Take one payload, in session order, as the session accepts it: a large one as a
        view of the received message (:data:`~garcon_link.core.wire.VIEW_BYTES`; the message
        is immutable ``bytes``), any other as ``bytes``."""

    def wants_yield(self) -> bool:
        """Asked after each message that delivered payloads: whether they woke a lone task that
        should run before the reader reads on (lower latency for a request/reply at a time)."""

    def hold(self) -> anyio.Event | None:
        """Asked after each message that delivered payloads: an event when the consumer is over
        one of its bounds (the RPC layer's refusal backlog), ``None`` otherwise.

        The reader then reads nothing more until the event is set -- back-pressure on the peer,
        like a full delivery queue (and, like it, time the peer's frames wait unread is not the
        peer's inactivity).
        """

    def batch_end(self) -> None:
        """Called once the payloads of one message were delivered (or one payload that went
        through the queue): what the consumer deferred until it had seen the whole message (the
        RPC layer starts handlers there, so a ``cancel`` in the same message finds its call not
        yet started)."""


@dataclass(frozen=True, slots=True)
class TransportStatistics:
    """Snapshot of a transport: its session plus the transport's own counters."""

    state: TransportState
    session: SessionStatistics
    attachments: int
    buffered_payloads: int
    buffered_bytes: int
    queued_payloads: int
    messages_written: int
    messages_read: int
    messages_read_directly: int
    """Of ``messages_read``, those handled in the socket's callback (asyncio: a whole small
    frame that arrived while the reader waited), a loop turn before the reader would have."""
    capacity_wakeups: int
    """Tasks woken to re-check retention (a sender waiting for room, a wait for receipts):
    a receipt that frees room wakes the first waiting sender only, and a receipt wait only
    once what it waits for holds (or at retirement, which wakes every waiter)."""
    writer_wakeups: int
    """Times the socket writer task resumed from a wait: woken for frames or a receipt to
    write, or at a receipt poll tick (each a task switch, whether it found work or not)."""
    receipt_timer_fires: int
    """Times the receipt timer (asyncio) found a receipt due: it sent a lone receipt that had
    waited ``receipt_delay``, handed one to the writer, or re-armed itself for a younger one.
    (A timer that finds the receipt already carried by a frame does nothing and is not
    counted.)"""
    receipt_polls_started: int
    """Times the socket writer began polling for lone receipts (where no loop timer sends
    them: trio), waking every ``receipt_delay`` instead of being woken for each receipt."""
    receipt_polls_stopped: int
    """Times the writer stopped polling: after a few ticks with no receipt due, or when its
    attachment ended. ``receipt_polls_started - receipt_polls_stopped`` is 1 while it polls."""
    receipt_poll_writes: int
    """Lone receipts the writer wrote at a poll tick, once they had waited ``receipt_delay``
    with no frame to ride with."""


class PreReadinessBuffer:
    """Inbound payloads accepted before the peer's replay fence, on one attachment (sans-IO).

    Bounded by ``Limits.max_inbound_buffer_payloads`` and ``max_inbound_buffer_bytes``: an
    honest peer replays before its fence at most what it retains, and it retains nothing this
    side accepted (acknowledged by a receipt, or by the resume position of the next handshake).
    So what an attachment leaves here when it ends before its fence must not stay beside the
    next attachment's replay: :meth:`attach` hands it over first.
    """

    __slots__ = ("_bodies", "_limits", "_size")

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._bodies: deque[bytes | memoryview] = deque()
        self._size = 0

    def __len__(self) -> int:
        return len(self._bodies)

    @property
    def size(self) -> int:
        """Bytes of the payloads held."""
        return self._size

    def hold(self, body: bytes | memoryview) -> str | None:
        """Hold ``body``, or return why it would pass the bound (then nothing is held)."""
        limits = self._limits
        if (
            len(self._bodies) >= limits.max_inbound_buffer_payloads
            or self._size + len(body) > limits.max_inbound_buffer_bytes
        ):
            return f"{len(self._bodies)} payloads / {self._size} bytes before the fence"
        self._bodies.append(body)
        self._size += len(body)
        return None

    def release(self) -> list[bytes | memoryview]:
        """Everything held, in order; the buffer is empty afterwards (the fence, retirement)."""
        bodies = list(self._bodies)
        self._bodies.clear()
        self._size = 0
        return bodies

    def attach(self) -> list[bytes | memoryview]:
        """A new attachment begins: what an earlier one left (it ended before its fence), in
        order, to hand over before anything of the new attachment is read."""
        return self.release()


SOCKET_GONE: tuple[type[Exception], ...] = (anyio.BrokenResourceError, anyio.ClosedResourceError)
"""What a :class:`MessageSocket` write raises once the socket is dead (its contract): the
attachment ends and the session waits, detached, for the next socket."""
