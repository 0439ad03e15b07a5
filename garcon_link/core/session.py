"""MessageSession: ordinals, cumulative receipts, retained frames and dedup (sans-IO, single-use).

Theory of operation
-------------------
One :class:`MessageSession` is one *logical session* seen from one side. It outlives
the sockets it is attached to: a socket drop detaches it, a resuming handshake re-attaches it to
the next socket, and nothing in flight is lost or delivered twice. It reads no clock and does no
I/O: the adapter (``transport.py``) passes inbound WebSocket messages to :meth:`receive`, writes
what :meth:`data_to_send` returns, and passes the time in as ``now``.

Each direction is a sequence of *message* packets numbered by ordinals 1, 2, 3, ...; the reader
acknowledges with cumulative *receipts* ``[1, through]``. Four counters describe one
side; the invariants hold after every public call::

    confirmed <= offered <= issued      (outbound)
    accepted                            (inbound; never decreases)

``issued``
    The highest ordinal assigned by :meth:`send`.
``offered``
    The highest ordinal ever handed out by :meth:`data_to_send`, i.e. written to *some* socket.
    Frames sent while detached are issued but not offered. Never decreases. A receipt may only
    acknowledge what was offered (``through > offered`` is terminal), and the RPC layer uses it to
    tell "never written" (``NOT_DISPATCHED``) from "may have executed" (``UNKNOWN``).
``confirmed``
    The highest ordinal covered by a receipt (or by the peer's resume position at attach).
``accepted``
    The highest inbound ordinal delivered to the caller; the next one delivered is ``accepted+1``.

*Retained* frames are exactly the encoded frames with ordinal in ``(confirmed, issued]``, kept in
order until a receipt covers them, bounded by ``Limits.max_retained_frames`` and
``Limits.max_retained_bytes`` (encoded bytes). A second queue holds the retained frames still to
be handed out on the current socket (a suffix of the retained ones), so :meth:`data_to_send` costs
O(frames returned) rather than O(retained).

States (:class:`SessionState`)::

    DETACHED --attach()--> ATTACHED --detach(now)--> DETACHED      (grace deadline = now + grace)
        |                      |
        +------ fail() --------+-----> FAILED   (terminal, sticky; every state can fail)

A new session starts DETACHED with no grace deadline (it has never been attached, so the grace
rule does not apply yet; the handshake deadline bounds that wait). Sending is allowed while
detached: frames are retained and replayed on the next attach.

Rules implemented (docs/design.md#session)
------------------------------------------
- **Admission before assignment.** :meth:`send` checks the encoded size against the frame limit
  (:class:`~garcon_link.errors.PayloadTooLarge`) and then retention (count and bytes,
  :class:`~garcon_link.errors.RetentionFull`) before it assigns an ordinal, so a refused send
  changes nothing and the next send gets the next ordinal. Full retention is back-pressure, never
  a failure. A lone frame within the frame limit is always admitted when retention is empty, so
  the caller can never deadlock (``Limits`` guarantees ``max_frame_bytes <= max_retained_bytes``).
- **Inbound order.** ``ordinal == accepted+1`` is delivered; ``<= accepted`` is a duplicate and
  suppressed; ``> accepted+1`` is a gap and terminal (``GAP``).
- **Receipts.** ``through > offered`` is terminal (``RECEIPT_BEYOND_OFFERED``); ``through <=
  confirmed`` is stale and ignored; otherwise ``confirmed = through`` and the covered prefix is
  evicted. Receipts are coalesced: one receipt becomes due after a batch that advanced
  ``accepted``, however many messages the batch held; :meth:`data_to_send` emits at most one.
  When to flush is the adapter's decision; :attr:`MessageSession.receipt_urgent` tells it a due
  receipt must not wait for outgoing frames to ride with: the replay fence, or
  ``Limits.receipt_interval`` messages accepted since the last receipt ("at most every 64"), or
  ``Limits.receipt_bytes`` of their bodies (a bulk transfer's pacing waits for receipts).
- **Atomic batches, decoded incrementally.** :meth:`receive` decodes the WebSocket message one
  packet at a time (the next message in order inline, anything else with
  :func:`~garcon_link.core.wire.iter_packets`) and checks each packet as it is decoded, against
  local copies of the counters; it applies the batch only if every packet is acceptable: a message
  that is malformed, has a gap or a receipt beyond ``offered`` anywhere delivers nothing. The only
  thing held while checking is the list of bodies to deliver (the packet objects are dropped as they
  are checked), and the first bad packet stops the decoding.
- **Events, not counters.** :meth:`receive` returns a :class:`Received` saying what the message
  did -- the bodies, its packet count, whether it passed the replay fence (the first receipt on
  this attachment), advanced ``confirmed``, made a receipt due, left a due receipt urgent -- so
  the adapter obeys it instead of comparing counters around the call. One object per call,
  whatever the number of packets. :meth:`attach` likewise returns an :class:`Attached`.
- **Packets per message.** A message holds at most ``Limits.max_packets_per_message`` packets;
  one more is ``MALFORMED_PACKET`` (terminal), refused before it is decoded. So one message
  costs at most that many packets of work and of memory whatever its size (without the bound a
  16 MiB message of 3-byte receipts was 5.6 million packet objects: ~300 MiB and ~10 s of
  work). A flood of receipts inside one message is bounded by the same count, and each costs
  O(1) without allocation (only the highest ``through`` is kept; eviction happens once, at
  commit). The transport's writer never coalesces more packets than the bound into a message.
- **Resume.** :meth:`attach` validates ``confirmed <= peer_received <= offered`` (else terminal
  ``RESUME_REFUSED``), evicts through ``peer_received``, queues every retained frame after it in
  order, then one trailing receipt ``[1, accepted]`` - always, even when ``accepted`` is 0 or
  unchanged. The trailing receipt is the peer's *replay fence* (the first receipt on
  an attachment), so it is emitted after the replayed frames.
- **Grace.** While detached after an attachment, :meth:`poll` fails the session
  (``GRACE_EXPIRED``) once ``now >= grace_deadline``.
- **Terminal failure** (:meth:`fail`) keeps the first cause, clears every retained and queued
  frame and the receipt state; every later :meth:`send`, :meth:`receive` and :meth:`attach`
  raises the same :class:`~garcon_link.errors.SessionFailed` object. A session is never reused.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import (
    FailureReason,
    MalformedFrame,
    PayloadTooLarge,
    RetentionFull,
    SessionFailed,
)
from ..limits import Limits
from .wire import (
    VIEW_BYTES,
    Gathered,
    Message,
    Ordinal,
    encode_receipt,
    iter_packets,
    message_head,
)

__all__ = [
    "Attached",
    "MessageSession",
    "Received",
    "RetentionPool",
    "SessionState",
    "SessionStatistics",
    "encoded_message_size",
]

_log = logging.getLogger("garcon_link.session")  # the name users configure (README)


class SessionState(enum.Enum):
    """Where a :class:`MessageSession` is in its life (see the module docstring)."""

    DETACHED = "detached"
    """No socket. Sends are retained; inbound data is a programming error."""
    ATTACHED = "attached"
    """Bound to one socket: frames are handed out and inbound packets accepted."""
    FAILED = "failed"
    """Terminally retired; every operation raises the stored cause."""


# Members read on every message: an ``Enum`` member read through its class costs a lookup
# through the enum's metaclass (CPython 3.11), a module global one dictionary read.
_ATTACHED = SessionState.ATTACHED


@dataclass(frozen=True, slots=True)
class SessionStatistics:
    """A snapshot of one session's counters (see :meth:`MessageSession.statistics`).

    Attributes:
        state: the state at the time of the snapshot.
        issued: highest outbound ordinal assigned.
        offered: highest outbound ordinal handed out to a socket.
        confirmed: highest outbound ordinal acknowledged by the peer.
        accepted: highest inbound ordinal delivered.
        retained_frames: outbound frames awaiting a receipt (``issued - confirmed``; 0 once
            failed).
        retained_bytes: encoded bytes of those frames.
        replays: attachments that re-sent at least one previously offered frame.
        replayed_frames: previously offered frames re-sent by those attachments.
        receipts_sent: receipts handed out by ``data_to_send``.
        receipts_received: receipt packets received (stale ones included).
        duplicates_suppressed: inbound message packets dropped as already accepted.
        delivered: inbound bodies returned by ``receive``.
        packets_received: packets of the inbound messages ``receive`` accepted (messages and
            receipts, duplicates and stale receipts included).
        retained_frames_peak: the most frames retained at once since the session began.
        retained_bytes_peak: the most bytes retained at once since the session began.
    """

    state: SessionState
    issued: int
    offered: int
    confirmed: int
    accepted: int
    retained_frames: int
    retained_bytes: int
    replays: int
    replayed_frames: int
    receipts_sent: int
    receipts_received: int
    duplicates_suppressed: int
    delivered: int
    packets_received: int
    retained_frames_peak: int = 0
    retained_bytes_peak: int = 0


class Received(NamedTuple):
    """What one :meth:`MessageSession.receive` call did: the adapter asks this instead of
    comparing counters around the call. A named tuple: one is made per message, and a tuple is
    made in one step where a frozen dataclass sets each field through ``object.__setattr__``.

    Attributes:
        bodies: the newly accepted bodies, in order (``[]`` for a batch of duplicates and
            receipts); the caller owns the list.
        packets: packets the message held (messages and receipts, duplicates and stale receipts
            included): how much work it was.
        fence: it held the first receipt on this attachment (the peer's replay fence), stale
            or not.
        confirmed_advanced: a receipt confirmed more of our frames (retention was freed).
        receipt_became_due: a receipt is due now and was not before the call.
        receipt_urgent: :attr:`MessageSession.receipt_urgent` after the call.
    """

    bodies: list[bytes | memoryview]
    packets: int
    fence: bool
    confirmed_advanced: bool
    receipt_became_due: bool
    receipt_urgent: bool

    @property
    def progress(self) -> bool:
        """A new inbound ordinal was accepted or more of our frames were confirmed (what
        counts as replay progress; duplicates and stale receipts do not)."""
        return bool(self.bodies) or self.confirmed_advanced


@dataclass(frozen=True, slots=True)
class Attached:
    """What one :meth:`MessageSession.attach` call did.

    Attributes:
        confirmed_advanced: the peer's resume position confirmed frames whose receipts were
            lost (retention was freed, as by a receipt).
        replayed: previously offered frames queued again for the new socket.
    """

    confirmed_advanced: bool
    replayed: int


def _head_size(value: int) -> int:
    """Length of the shortest CBOR head holding ``value`` (mirrors the wire codec)."""
    if value < 24:
        return 1
    if value < 0x100:
        return 2
    if value < 0x10000:
        return 3
    if value < 0x100000000:
        return 5
    return 9


def encoded_message_size(ordinal: int, body_size: int) -> int:
    """Exact ``len(encode_message(ordinal, body))`` for a body of ``body_size`` bytes.

    Lets :meth:`MessageSession.send` check admission before it allocates the frame.
    """
    return 2 + _head_size(ordinal) + _head_size(body_size) + body_size


class RetentionPool:
    """A retention budget shared by many sessions (``Limits.max_total_retained_bytes``).

    Each :class:`MessageSession` given the pool counts its retained bytes into :attr:`used` and
    admits a frame only while the pool has room -- except a session's *lone* frame, which is
    always admitted (so no caller can deadlock): :attr:`used` may exceed :attr:`limit` by at most
    one frame per session. A full pool is back-pressure on the senders, never a failure: it
    drains as peers acknowledge.

    Attributes:
        limit: the budget in encoded bytes.
        used: encoded bytes retained by all sessions of the pool now.
    """

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a retention pool needs a positive limit")
        self.limit = limit
        self.used = 0


class MessageSession:
    """One side of a resumable logical session: ordinals, receipts, retention, dedup.

    Single-use and not thread-safe; the adapter serialises calls. Never reads a clock.

    Args:
        limits: the bounds used: ``max_frame_bytes`` (outbound frame and inbound message size),
            ``max_packets_per_message`` (inbound), ``max_retained_frames``,
            ``max_retained_bytes``, ``receipt_interval`` and ``detached_grace``.
    """

    __slots__ = (
        "_accepted",
        "_confirmed",
        "_delivered",
        "_duplicates",
        "_failure",
        "_fenced",
        "_grace_deadline",
        "_issued",
        "_limits",
        "_offered",
        "_packets_received",
        "_pool",
        "_receipt_bytes",
        "_receipt_due",
        "_receipt_forced",
        "_receipt_through",
        "_receipts_received",
        "_receipts_sent",
        "_replayed_frames",
        "_replays",
        "_retained",
        "_retained_bytes",
        "_retained_bytes_peak",
        "_retained_frames_peak",
        "_state",
        "_to_send",
    )

    def __init__(self, limits: Limits, pool: RetentionPool | None = None) -> None:
        self._limits = limits
        self._pool = pool
        self._state = SessionState.DETACHED
        self._failure: SessionFailed | None = None
        self._grace_deadline: float | None = None
        self._fenced = False  # a receipt arrived on the current attachment
        self._issued = 0
        self._offered = 0
        self._confirmed = 0
        self._accepted = 0
        # Retained frames, ordinals (confirmed, issued] in order; and the suffix of them still to
        # be handed out on the current socket. Both hold the same bytes objects (no copies).
        self._retained: deque[tuple[int, bytes]] = deque()
        self._retained_bytes = 0
        self._retained_frames_peak = self._retained_bytes_peak = 0
        self._to_send: deque[tuple[int, bytes]] = deque()
        self._receipt_due = False
        self._receipt_forced = False
        self._receipt_through = 0
        self._receipt_bytes = 0  # body bytes accepted since the last receipt
        self._replays = 0
        self._replayed_frames = 0
        self._receipts_sent = 0
        self._receipts_received = 0
        self._duplicates = 0
        self._delivered = 0
        self._packets_received = 0

    # -- read-only state ------------------------------------------------------------------------

    @property
    def state(self) -> SessionState:
        """The current :class:`SessionState`."""
        return self._state

    @property
    def issued(self) -> int:
        """Highest outbound ordinal assigned by :meth:`send` (0 before the first send)."""
        return self._issued

    @property
    def offered(self) -> int:
        """Highest outbound ordinal handed out by :meth:`data_to_send` (0 if none yet)."""
        return self._offered

    @property
    def confirmed(self) -> int:
        """Highest outbound ordinal acknowledged by the peer (0 if none yet)."""
        return self._confirmed

    @property
    def accepted(self) -> int:
        """Highest inbound ordinal delivered (0 if none yet); this side's resume position."""
        return self._accepted

    @property
    def failure(self) -> SessionFailed | None:
        """The stored terminal cause, or ``None`` while the session is alive."""
        return self._failure

    @property
    def grace_deadline(self) -> float | None:
        """When a detached session expires; ``None`` unless detached after an attachment."""
        return self._grace_deadline

    @property
    def receipt_due(self) -> bool:
        """Whether the next :meth:`data_to_send` will end with a receipt."""
        return self._receipt_due

    @property
    def receipt_urgent(self) -> bool:
        """Whether a due receipt should be written now rather than wait for outgoing frames.

        Urgent when it is the trailing receipt of an attachment (the peer's replay fence), when
        ``receipt_interval`` messages were accepted since the last receipt, or when their bodies
        add up to ``receipt_bytes`` (a bulk transfer's sender paces itself on our receipts:
        :mod:`garcon_link.rpc.chunks`). A receipt that is due
        but not urgent may be held briefly by the adapter so it shares a WebSocket message with
        the next outgoing frames instead of costing one of its own.
        """
        return self._receipt_due and (
            self._receipt_forced
            or self._accepted - self._receipt_through >= self._limits.receipt_interval
            or self._receipt_bytes >= self._limits.receipt_bytes
        )

    @property
    def retained_bytes(self) -> int:
        """Encoded bytes of the retained frames (issued, not yet confirmed)."""
        return self._retained_bytes

    @property
    def frames_queued(self) -> int:
        """Message frames waiting to be handed out on the current socket."""
        return len(self._to_send)

    @property
    def receipts_received(self) -> int:
        """Receipt packets received so far, stale ones included (never decreases)."""
        return self._receipts_received

    @property
    def packets_received(self) -> int:
        """Packets of the inbound messages :meth:`receive` accepted so far (never decreases)."""
        return self._packets_received

    # -- outbound -------------------------------------------------------------------------------

    def _admits(self, frame_size: int) -> bool:
        if not self._retained:
            return True  # a lone frame is always admitted: the caller can never deadlock
        limits = self._limits
        pool = self._pool
        return (
            len(self._retained) < limits.max_retained_frames
            and self._retained_bytes + frame_size <= limits.max_retained_bytes
            and (pool is None or pool.used + frame_size <= pool.limit)
        )

    def has_capacity(self, size: int) -> bool:
        """Whether :meth:`send` would admit a body of ``size`` bytes right now.

        Only retention is considered, not the frame limit (a body over the frame limit is refused
        whatever the retention). An empty retention admits any size.

        Args:
            size: the body length in bytes (>= 0).

        Returns:
            ``False`` once the session has failed.
        """
        if self._failure is not None:
            return False
        return self._admits(encoded_message_size(self._issued + 1, size))

    def send(self, body: bytes | Gathered) -> Ordinal:
        """Assign the next ordinal to ``body`` and retain its encoded frame until acknowledged.

        Works in both DETACHED (the frame waits for the next attach) and ATTACHED (queued for the
        next :meth:`data_to_send`) states. A refused send changes nothing, so the next admitted
        send gets the ordinal this one would have had.

        Args:
            body: the payload (a :class:`~garcon_link.core.wire.Gathered` one is joined straight
                into the frame); empty is allowed.

        Returns:
            The assigned ordinal, ``issued`` after the call (the first is 1).

        Raises:
            SessionFailed: the session has failed (the stored object).
            PayloadTooLarge: the encoded frame exceeds ``limits.max_frame_bytes``.
            RetentionFull: retention would exceed its frame or byte bound; retry after a receipt.
                Never raised while retention is empty.
        """
        if self._failure is not None:
            raise self._failure
        ordinal = self._issued + 1
        head = message_head(ordinal, len(body))
        size = len(head) + len(body)
        limit = self._limits.max_frame_bytes
        if size > limit:
            raise PayloadTooLarge(size, limit)
        retained = self._retained
        pool = self._pool
        if retained and not (  # _admits, inline: a lone frame is always admitted
            len(retained) < self._limits.max_retained_frames
            and self._retained_bytes + size <= self._limits.max_retained_bytes
            and (pool is None or pool.used + size <= pool.limit)
        ):
            raise RetentionFull(
                f"retention is full ({len(retained)} frames, {self._retained_bytes} bytes)"
            )
        frame = b"".join((head, *body.pieces)) if isinstance(body, Gathered) else head + body
        self._issued = ordinal
        item = (ordinal, frame)
        retained.append(item)
        retained_bytes = self._retained_bytes = self._retained_bytes + size
        if retained_bytes > self._retained_bytes_peak:
            self._retained_bytes_peak = retained_bytes
        if len(retained) > self._retained_frames_peak:
            self._retained_frames_peak = len(retained)
        if pool is not None:
            pool.used += size
        if self._state is _ATTACHED:
            self._to_send.append(item)
        return ordinal  # type: ignore[return-value]  # an Ordinal: the NewType costs a call

    def data_to_send(self) -> list[bytes]:
        """Hand out the packets to write to the current socket now, in order.

        The queued message frames (new ones, or the replay after :meth:`attach`) come first, then
        at most one receipt ``[1, accepted]`` if one is due. ``offered`` becomes the highest
        ordinal handed out. Costs O(packets returned).

        Returns:
            Encoded packets (each a complete CBOR item); ``[]`` when nothing is due or the
            session is DETACHED or FAILED. The adapter may concatenate several into one
            WebSocket message as long as it stays within the frame limit.
        """
        if self._state is not _ATTACHED:
            return []
        queue = self._to_send
        out = [frame for _, frame in queue]
        if queue:
            self._offered = max(self._offered, queue[-1][0])
            queue.clear()
        if self._receipt_due:
            self._receipt_due = False
            self._receipt_forced = False
            self._receipt_through = self._accepted
            self._receipt_bytes = 0
            self._receipts_sent += 1
            out.append(encode_receipt(self._accepted))
        return out

    # -- inbound --------------------------------------------------------------------------------

    def receive(self, data: bytes) -> Received:
        """Process one whole inbound WebSocket message; report what it did.

        Packets are decoded one at a time and each is checked as it comes; none takes effect
        before the whole message was checked, so a message that fails delivers nothing, and
        decoding stops at the first bad packet. Duplicates (``ordinal <= accepted``) and stale
        receipts are dropped silently. A batch that advances ``accepted`` makes one receipt due.
        The first receipt after :meth:`attach`, stale or not, is the replay fence.

        Args:
            data: the WebSocket message payload (a CBOR sequence of session packets).

        Returns:
            A :class:`Received`: the newly accepted bodies in order (``[]`` for a batch of
            duplicates and receipts), the packet count, and whether the fence passed, the
            confirmed position advanced, a receipt became due, and a due receipt is urgent.

        Raises:
            SessionFailed: the session had failed, or this message failed it: a malformed or
                over-size message, or one of more than ``max_packets_per_message`` packets
                (``MALFORMED_PACKET``, chained ``from`` the decode error), a gap (``GAP``) or a
                receipt beyond ``offered`` (``RECEIPT_BEYOND_OFFERED``).
            RuntimeError: the session is DETACHED (a programming error of the adapter).
        """
        if self._failure is not None:
            raise self._failure
        if self._state is not _ATTACHED:
            raise RuntimeError("MessageSession.receive() while detached")
        limits = self._limits
        # Check each packet as it is decoded, against local copies, then commit: all or nothing.
        accepted = self._accepted
        through_max = self._confirmed
        offered = self._offered
        bodies: list[bytes | memoryview] = []
        size = 0
        count = 0
        duplicates = 0
        receipts = 0
        max_packets = limits.max_packets_per_message
        total = len(data)
        pos = 0
        if 0 < total <= limits.max_frame_bytes:
            # The packets of a batch are mostly the next message after another, each with its
            # ordinal and length in the shortest head, and a receipt within ``offered`` in the
            # shortest head: those are read here, inline (a packet object, a generator step and
            # two calls less each). At the first packet that is anything else -- a duplicate, a
            # gap, a receipt beyond ``offered``, a large body, or bytes that are no packet --
            # iter_packets takes over from where this stopped, and judges it.
            append = bodies.append
            while pos < total and count < max_packets:
                if data[pos] == 0x82:  # a receipt, [1, through], at most ``offered``
                    at = pos + 2
                    if at >= total or data[pos + 1] != 1:
                        break
                    initial = data[at]
                    if initial < 24:
                        through = initial
                        at += 1
                    elif initial < 28:
                        width = 1 << (initial - 24)
                        end = at + 1 + width
                        if end > total:
                            break
                        through = int.from_bytes(data[at + 1 : end], "big")
                        if through < (24 if width == 1 else 1 << (4 * width)):
                            break
                        at = end
                    else:
                        break
                    if through > offered:
                        break
                    if through > through_max:
                        through_max = through
                    receipts += 1
                    count += 1
                    pos = at
                    continue
                if data[pos] != 0x83 or pos + 3 >= total or data[pos + 1]:
                    break
                at = pos + 2
                initial = data[at]
                if initial < 24:
                    ordinal = initial
                    at += 1
                elif initial < 28:
                    width = 1 << (initial - 24)
                    end = at + 1 + width
                    if end > total:
                        break
                    ordinal = int.from_bytes(data[at + 1 : end], "big")
                    if ordinal < (24 if width == 1 else 1 << (4 * width)):
                        break
                    at = end
                else:
                    break
                if ordinal != accepted + 1 or at >= total:
                    break
                initial = data[at]
                if 0x40 <= initial < 0x58:
                    length = initial - 0x40
                    at += 1
                elif 0x58 <= initial < 0x5C:
                    width = 1 << (initial - 0x58)
                    end = at + 1 + width
                    if end > total:
                        break
                    length = int.from_bytes(data[at + 1 : end], "big")
                    if length < (24 if width == 1 else 1 << (4 * width)):
                        break
                    at = end
                else:
                    break
                end = at + length
                if end > total or length >= VIEW_BYTES:
                    break
                accepted = ordinal
                append(data[at:end])
                size += length
                count += 1
                pos = end
        try:
            for packet in (
                iter_packets(data, limits.max_frame_bytes, max_packets, start=pos, counted=count)
                if pos < total or not total
                else ()
            ):
                count += 1
                if isinstance(packet, Message):
                    ordinal = packet.ordinal
                    if ordinal == accepted + 1:
                        accepted = ordinal
                        bodies.append(packet.body)
                        size += len(packet.body)
                    elif ordinal <= accepted:
                        duplicates += 1
                    else:
                        raise self.fail(
                            FailureReason.GAP, f"expected ordinal {accepted + 1}, got {ordinal}"
                        )
                else:  # Receipt
                    receipts += 1
                    through = packet.through
                    if through > offered:
                        raise self.fail(
                            FailureReason.RECEIPT_BEYOND_OFFERED,
                            f"receipt through {through}, only {offered} offered",
                        )
                    if through > through_max:
                        through_max = through
        except MalformedFrame as exc:
            raise self.fail(FailureReason.MALFORMED_PACKET, str(exc)) from exc

        self._packets_received += count
        if duplicates:
            self._duplicates += duplicates
        fence = False
        if receipts:
            self._receipts_received += receipts
            if not self._fenced:
                self._fenced = fence = True  # fence: first receipt on this attachment
        confirmed_advanced = through_max > self._confirmed
        if confirmed_advanced:
            self._confirm(through_max)
        if bodies:
            self._accepted = accepted
            self._delivered += len(bodies)
            receipt_bytes = self._receipt_bytes = self._receipt_bytes + size
            became_due = not self._receipt_due
            self._receipt_due = True
            urgent = (  # receipt_urgent, inline
                self._receipt_forced
                or accepted - self._receipt_through >= limits.receipt_interval
                or receipt_bytes >= limits.receipt_bytes
            )
            return Received(bodies, count, fence, confirmed_advanced, became_due, urgent)
        return Received(bodies, count, fence, confirmed_advanced, False, self.receipt_urgent)

    def _confirm(self, through: int) -> None:
        """Record that the peer holds every ordinal ``<= through``; evict those frames."""
        self._confirmed = through
        retained = self._retained
        before = self._retained_bytes
        while retained and retained[0][0] <= through:
            _, frame = retained.popleft()
            self._retained_bytes -= len(frame)
        if self._pool is not None:
            self._pool.used -= before - self._retained_bytes
        queue = self._to_send
        while queue and queue[0][0] <= through:
            queue.popleft()

    # -- attachment -----------------------------------------------------------------------------

    def attach(self, peer_received: int) -> Attached:
        """Bind to a new socket, resuming from the peer's receive position.

        Evicts everything through ``peer_received``, queues every retained frame after it for
        replay, in order, and forces a trailing receipt ``[1, accepted]`` after them (even when
        ``accepted`` is 0): the peer's replay fence. Clears the grace deadline.

        Args:
            peer_received: the ``accepted`` the peer advertised in its handshake; must satisfy
                ``confirmed <= peer_received <= offered`` (both ends inclusive; 0 for a fresh
                session).

        Returns:
            An :class:`Attached`: whether ``peer_received`` confirmed more of our frames, and
            how many previously offered frames are queued again.

        Raises:
            SessionFailed: the session had failed, or ``peer_received`` is outside the
                replayable range (``RESUME_REFUSED``; the session is failed).
            RuntimeError: already ATTACHED (detach first).
        """
        if self._failure is not None:
            raise self._failure
        if self._state is _ATTACHED:
            raise RuntimeError("MessageSession.attach() while already attached")
        if not self._confirmed <= peer_received <= self._offered:
            raise self.fail(
                FailureReason.RESUME_REFUSED,
                f"peer received {peer_received}, replayable range is "
                f"[{self._confirmed}, {self._offered}]",
            )
        confirmed_advanced = peer_received > self._confirmed
        if confirmed_advanced:
            self._confirm(peer_received)
        self._state = SessionState.ATTACHED
        self._grace_deadline = None
        self._fenced = False
        self._to_send = deque(self._retained)
        replayed = self._offered - peer_received  # retained frames already written before
        if replayed:
            self._replays += 1
            self._replayed_frames += replayed
            _log.debug("replaying %d frame(s) after ordinal %d", replayed, peer_received)
        self._receipt_due = True  # the trailing receipt: the peer's replay fence
        self._receipt_forced = True
        return Attached(confirmed_advanced, replayed)

    def detach(self, now: float) -> None:
        """The socket is gone: stop handing out frames and start the grace period.

        Retained frames stay for the next :meth:`attach`; queued-but-unwritten frames and a due
        receipt are dropped from the queue (attach re-queues every retained frame and a receipt).
        A no-op when already DETACHED or FAILED.

        Args:
            now: the current time; ``grace_deadline`` becomes ``now + limits.detached_grace``.
        """
        if self._state is not _ATTACHED:
            return
        self._state = SessionState.DETACHED
        self._grace_deadline = now + self._limits.detached_grace
        self._to_send.clear()
        self._receipt_due = False

    def poll(self, now: float) -> SessionFailed | None:
        """Apply the grace deadline at time ``now``. Never raises.

        Args:
            now: the current time; expiry happens at ``now >= grace_deadline`` (inclusive).

        Returns:
            The stored failure (possibly just caused by ``GRACE_EXPIRED``), or ``None``.
        """
        deadline = self._grace_deadline
        if self._state is SessionState.DETACHED and deadline is not None and now >= deadline:
            self.fail(
                FailureReason.GRACE_EXPIRED,
                f"no socket for {self._limits.detached_grace:g}s",
            )
        return self._failure

    def next_deadline(self) -> float | None:
        """When :meth:`poll` should next be called: the grace deadline while detached, else None."""
        return self._grace_deadline if self._state is SessionState.DETACHED else None

    # -- failure --------------------------------------------------------------------------------

    def fail(self, reason: FailureReason, detail: str = "") -> SessionFailed:
        """Retire the session for good. Idempotent: the first cause is kept and returned.

        Clears every retained and queued frame and the receipt state; ``issued``, ``offered``,
        ``confirmed`` and ``accepted`` keep their last values for diagnostics.

        Args:
            reason: why (also gives the close code to send the peer).
            detail: human-readable specifics for logs.

        Returns:
            The stored :class:`SessionFailed` (the same object for every call).
        """
        if self._failure is not None:
            return self._failure
        failure = SessionFailed(reason, detail)
        self._failure = failure
        self._state = SessionState.FAILED
        self._grace_deadline = None
        self._retained.clear()
        if self._pool is not None:
            self._pool.used -= self._retained_bytes
        self._retained_bytes = 0
        self._to_send.clear()
        self._receipt_due = False
        self._receipt_forced = False
        self._receipt_bytes = 0
        _log.debug("session failed: %s", failure)
        return failure

    def statistics(self) -> SessionStatistics:
        """Return a snapshot of the counters (a new frozen object on each call)."""
        return SessionStatistics(
            state=self._state,
            issued=self._issued,
            offered=self._offered,
            confirmed=self._confirmed,
            accepted=self._accepted,
            retained_frames=len(self._retained),
            retained_bytes=self._retained_bytes,
            replays=self._replays,
            replayed_frames=self._replayed_frames,
            receipts_sent=self._receipts_sent,
            receipts_received=self._receipts_received,
            duplicates_suppressed=self._duplicates,
            delivered=self._delivered,
            packets_received=self._packets_received,
            retained_frames_peak=self._retained_frames_peak,
            retained_bytes_peak=self._retained_bytes_peak,
        )

    def __repr__(self) -> str:
        return (
            f"<MessageSession {self._state.value} issued={self._issued} offered={self._offered} "
            f"confirmed={self._confirmed} accepted={self._accepted} "
            f"retained={len(self._retained)}/{self._retained_bytes}B>"
        )
