"""A wired pair of sans-IO MessageSessions with an in-memory, fault-injecting network.

Each side has an outbound *wire*: a FIFO of WebSocket messages in flight to the other side. A
test moves bytes explicitly (:meth:`SessionPair.flush` writes, :meth:`SessionPair.deliver`
reads), so every split point is reachable, and injects faults between the two:

- :meth:`~SessionPair.drop` loses in-flight messages (only meaningful together with a cut: a live
  socket never loses data, so delivering past a drop is a gap);
- :meth:`~SessionPair.duplicate` makes the head message arrive twice, and
  :meth:`~SessionPair.redeliver` makes the last delivered one arrive again;
- :meth:`~SessionPair.reorder` permutes the packets inside one in-flight message;
- :meth:`~SessionPair.cut` loses everything in flight and detaches both sides;
- :meth:`~SessionPair.reattach` does what the real handshake does: each side attaches with the
  other side's ``accepted`` as ``peer_received``.

Each side's consumer records every body its session delivered, in order (:attr:`Side.received`);
:attr:`Side.sent` records every body whose ``send`` was admitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from garcon_link.core.session import MessageSession, Received, SessionState
from garcon_link.core.wire import Message, Packet, decode_packets, encode_message, encode_receipt
from garcon_link.limits import Limits

__all__ = ["Side", "SessionPair", "encode_packets"]


def encode_packets(packets: Sequence[Packet]) -> bytes:
    """Encode decoded packets back into one WebSocket message (a CBOR sequence)."""
    parts = []
    for packet in packets:
        if isinstance(packet, Message):
            parts.append(encode_message(packet.ordinal, packet.body))
        else:
            parts.append(encode_receipt(packet.through))
    return b"".join(parts)


@dataclass
class Side:
    """One endpoint: its session, what its consumer received and what it sent."""

    name: str
    session: MessageSession
    sent: list[bytes] = field(default_factory=list)
    received: list[bytes] = field(default_factory=list)
    wire: deque[bytes] = field(default_factory=deque)
    """WebSocket messages written by this side, not yet read by the other."""
    written: int = 0
    """WebSocket messages written by this side in total."""
    last_delivered: bytes | None = None
    """The last message of this side the peer read on the current socket."""
    events: list[Received] = field(default_factory=list)
    """What each message this side's session received did, in order."""


class SessionPair:
    """Two wired sessions, ``a`` and ``b``. Sides are named ``"a"`` and ``"b"`` in every method.

    Args:
        limits: bounds for both sessions.
        attached: attach both at construction (a fresh handshake: ``peer_received`` 0).
        coalesce: pack as many ready packets as fit the frame limit and the packet bound into
            one WebSocket message (as the transport does); ``False`` writes one packet per
            message.
    """

    def __init__(
        self, limits: Limits | None = None, *, attached: bool = True, coalesce: bool = True
    ) -> None:
        self.limits = limits or Limits()
        self.coalesce = coalesce
        self.a = Side("a", MessageSession(self.limits))
        self.b = Side("b", MessageSession(self.limits))
        if attached:
            self.reattach()

    # -- plumbing -------------------------------------------------------------------------------

    def side(self, name: str) -> Side:
        """The side called ``name``."""
        if name == "a":
            return self.a
        if name == "b":
            return self.b
        raise ValueError(f"no side {name!r}")

    def peer(self, name: str) -> Side:
        """The side opposite ``name``."""
        return self.b if name == "a" else self.a

    def send(self, name: str, body: bytes) -> int:
        """Send ``body`` from side ``name``; record it when admitted. Errors propagate."""
        side = self.side(name)
        ordinal = side.session.send(body)
        side.sent.append(body)
        return ordinal

    def flush(self, name: str) -> int:
        """Write what side ``name`` has to send onto its wire; return the packet count."""
        side = self.side(name)
        packets = side.session.data_to_send()
        if not packets:
            return 0
        if not self.coalesce:
            side.wire.extend(packets)
            side.written += len(packets)
            return len(packets)
        limit = self.limits.max_frame_bytes
        max_packets = self.limits.max_packets_per_message  # as the transport's writer
        message = bytearray()
        count = 0
        for packet in packets:
            if message and (len(message) + len(packet) > limit or count == max_packets):
                side.wire.append(bytes(message))
                side.written += 1
                message = bytearray()
                count = 0
            message += packet
            count += 1
        side.wire.append(bytes(message))
        side.written += 1
        return len(packets)

    def deliver(self, name: str, count: int | None = None) -> list[bytes]:
        """Deliver up to ``count`` (default: all) messages in flight from side ``name``.

        Returns:
            The bodies the receiving side's session delivered (also recorded on the receiver).
        """
        sender, receiver = self.side(name), self.peer(name)
        delivered: list[bytes] = []
        n = len(sender.wire) if count is None else min(count, len(sender.wire))
        for _ in range(n):
            data = sender.wire.popleft()
            sender.last_delivered = data
            event = receiver.session.receive(data)
            receiver.events.append(event)
            bodies = [bytes(body) for body in event.bodies]
            receiver.received.extend(bodies)
            delivered.extend(bodies)
        return delivered

    def inject(self, name: str, data: bytes) -> list[bytes]:
        """Have side ``name``'s peer receive raw ``data`` as if side ``name`` had written it."""
        receiver = self.peer(name)
        event = receiver.session.receive(data)
        receiver.events.append(event)
        bodies = [bytes(body) for body in event.bodies]
        receiver.received.extend(bodies)
        return bodies

    # -- faults ---------------------------------------------------------------------------------

    def drop(self, name: str, count: int | None = None) -> int:
        """Lose the newest ``count`` (default: all) messages in flight from side ``name``."""
        wire = self.side(name).wire
        n = len(wire) if count is None else min(count, len(wire))
        for _ in range(n):
            wire.pop()
        return n

    def duplicate(self, name: str, index: int = 0) -> None:
        """Make in-flight message ``index`` from side ``name`` arrive twice in a row."""
        wire = self.side(name).wire
        wire.insert(index, wire[index])

    def redeliver(self, name: str) -> list[bytes]:
        """Deliver the last message side ``name``'s peer read on this socket once more (if any)."""
        data = self.side(name).last_delivered
        return [] if data is None else self.inject(name, data)

    def reorder(
        self, name: str, permute: Callable[[list[Packet]], list[Packet]], index: int = 0
    ) -> None:
        """Re-encode in-flight message ``index`` from side ``name`` with its packets permuted."""
        wire = self.side(name).wire
        packets = decode_packets(wire[index], self.limits.max_frame_bytes)
        wire[index] = encode_packets(permute(packets))

    def cut(self, now: float = 0.0) -> None:
        """The socket drops: everything in flight is lost and both sides detach at ``now``."""
        for side in (self.a, self.b):
            side.wire.clear()
            side.last_delivered = None
        self.a.session.detach(now)
        self.b.session.detach(now)

    def reattach(self) -> None:
        """A resuming handshake: each side attaches with the other's ``accepted``."""
        a_received, b_received = self.a.session.accepted, self.b.session.accepted
        self.a.session.attach(b_received)
        self.b.session.attach(a_received)

    @property
    def attached(self) -> bool:
        """Whether both sessions are attached."""
        return (
            self.a.session.state is SessionState.ATTACHED
            and self.b.session.state is SessionState.ATTACHED
        )

    def exchange(self, max_rounds: int = 100) -> int:
        """Flush and deliver in both directions until nothing moves; return the rounds used.

        Raises:
            AssertionError: still not quiet after ``max_rounds`` (a liveness bug).
        """
        for rounds in range(1, max_rounds + 1):
            moved = self.flush("a") + self.flush("b")
            moved += len(self.a.wire) + len(self.b.wire)
            self.deliver("a")
            self.deliver("b")
            if moved == 0:
                return rounds
        raise AssertionError(f"pair still busy after {max_rounds} rounds")
