"""Bulk transfers in parts: large envelope bodies split so small messages interleave.

Theory of operation
-------------------
A session delivers its messages in order, so one 16 MiB message (a call's arguments, a result,
a stream item, a notification) holds every message issued after it until the whole of it has
crossed the socket: a small call behind it waits for the transfer (head-of-line blocking). Here
an envelope body longer than ``Limits.bulk_chunk_bytes`` is sent as a sequence of ``part``
envelopes instead (as many equal parts as whole chunks fit in it, at least two: each part is
less than 1.5 chunks, and no short tail waits a round trip for the window), each an ordinary
session message (so replay after a cut and the cumulative receipts are exact per part, and
nothing below the RPC layer changes)::

    part   [8, flags, chunk]              flags: 0 more, 1 final, 2 abort (chunk empty)
           [8, flags, transfer, chunk]    transfer: 1..2**63-1, per direction of a session

The receiver concatenates the chunks and, at the final part, dispatches the body exactly as if
it had arrived whole. A body at or below the threshold is sent as one whole envelope, so a peer
that does not know ``part`` meets it only when a body exceeds the threshold (it drops it as an
unknown kind and the call ends at its timeout).

Rules:

* **Transfers interleave part by part.** Each side sends, once per session when the peer's first
  part arrives, the internal notification ``$link.parts`` with one argument, its
  ``Limits.bulk_transfers``: it reads parts with a transfer id, and holds that many transfers
  with ids at once. Once the peer's has arrived (a round trip into the first transfer),
  :class:`ChunkSender` numbers its transfers (1, 2, ... per direction) and runs up to the
  smaller of its own ``bulk_transfers`` and the peer's count at once (a notice without a count:
  :data:`PEER_TRANSFERS`), taking turns part by part (while another transfer sends, each
  waits for a part of another's after its own), so two bulk producers in one session both make
  progress and neither waits for the other's whole body; a further one waits for a slot. Until
  then -- and always with a peer that does not know the notification (it drops it and logs it
  once) -- it sends one transfer at a time, in call order, its parts without an id: every
  such part continues the one transfer without an id in progress. The receiver
  (:class:`Transfers`) holds that one and up to its ``bulk_transfers`` with ids, each in its own
  :class:`Reassembler`, so it holds at most ``bulk_transfers + 1`` partial bodies. The receiver's
  bound is the one that matters (it refuses one more); the sender's own is what it chooses to
  run at once, and it honours the smaller.
* **A transfer is at least two parts, and its body is never a part.** Only a body longer than a
  chunk is sent in parts, and it is cut into at least two (:meth:`ChunkSender.send`), so a final
  part with no transfer in progress is never sent by a sender that keeps to these rules. A
  reassembled body is dispatched through a path that refuses ``part`` envelopes: parts do not
  nest, so one message is unwrapped at most once and costs at most one body, whatever it holds.
* **Pacing.** Before each further part the sender waits until the session's unconfirmed outbound
  bytes are below ``Limits.bulk_window_bytes``, so at most about a window of bulk is ahead of a
  small message anywhere in the pipe (our retention, the kernel's buffers, the peer's reader).
  Small messages never wait for it. *Bulk yields to interactive traffic:* while small messages
  are being sent alongside (one went out through the same sender within ``INTERACTIVE_S``), the
  parts shrink to at most ``INTERACTIVE_PART_BYTES`` and the window to one such part -- one
  part in flight at a time -- so a small call waits behind at most about one small part each
  way instead of a window's worth of chunks; a transfer alone keeps equal chunks and the whole
  window (and its throughput). A transfer's parts may so differ in size: the receiver only
  concatenates them. The session marks a receipt urgent once
  ``Limits.receipt_bytes`` were accepted since the last one
  (:attr:`~garcon_link.core.session.MessageSession.receipt_urgent`), so the window drains at the
  speed of the link, not of ``receipt_delay``. The sender also yields to the event loop
  before each further part, so one loop turn encodes and writes at most one part (a window's
  worth of parts is never issued in one turn), and large ``bytes`` values are copied into parts
  a part at a time (:mod:`garcon_link.rpc.splice`).
* **Same size limit.** A body that would have been refused as one message
  (:class:`~garcon_link.errors.PayloadTooLarge`: its frame would exceed ``max_frame_bytes``) is
  refused the same way before any part is sent. The receiver refuses a transfer whose chunks add
  up to more than ``max_frame_bytes``.
* **Abort.** A send interrupted after its first part and before its final one (the caller's
  timeout or cancellation) sends an ``abort`` part without waiting, so the receiver frees its
  buffer; the interrupted body was never delivered (for a call: ``NotDispatched``, as its
  ordinal is that of the final part, never assigned). If retention has no room for the abort at
  that moment it is owed: the next part of any transfer is preceded by it (a transfer waiting
  for a slot is woken to write it), so the receiver never sees the parts of two bodies without
  an id run together, and an aborted transfer keeps its slot until its abort is written.
* **Hostile parts** (:class:`Transfers`, :class:`Reassembler`): a transfer id that is not an
  integer 1..:data:`MAX_TRANSFER_ID` (any other CBOR type, a bignum, a nested item), an id
  that is neither in progress nor above every id seen (unknown or reused), a transfer begun
  while ``bulk_transfers`` are in progress, a malformed part, an abort or a final part with no
  transfer in progress, an empty non-final part, a transfer beyond ``max_frame_bytes``, one
  whose body is itself a part (told by its first two bytes, as :func:`encode_part` writes
  them, before the body is joined; the RPC layer refuses a part in any other encoding once
  decoded), and, with splicing, a byte string declared longer than the transfer may still hold
  or a transfer that ends inside one (:class:`~garcon_link.rpc.splice.Splicer`) is a
  violation: the partial body is dropped (memory freed at once), the rest of that transfer, up
  to its final or abort part, is discarded unread, and the RPC layer logs it and counts it
  (``RpcStatistics.part_violations``); the session stays. Each part costs O(its size) and the
  buffer of each transfer is bounded by ``max_frame_bytes``, each part counting at least
  :data:`MIN_CHARGE` bytes (so tiny parts cannot multiply what is held by their per-object
  overhead: at most about 1.25 times the limit per transfer, ``bulk_transfers + 1`` transfers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

import anyio
import anyio.lowlevel

from ..core.session import encoded_message_size
from ..core.wire import Gathered, encode_head
from ..errors import PayloadTooLarge
from .envelopes import PART, encode_part
from .splice import Spliced, SpliceOverrun, Splicer

__all__ = [
    "ABORT",
    "FINAL",
    "MORE",
    "PART",
    "ChunkSender",
    "PartViolation",
    "Reassembler",
    "encode_part",
    "parse_part",
]

MORE, FINAL, ABORT = 0, 1, 2
"""A part's flags: more follow, the last one, the transfer is abandoned."""

INTERACTIVE_S = 0.05
"""A transfer goes in parts of at most :data:`INTERACTIVE_PART_BYTES`, one in flight at a time,
instead of equal chunks paced by ``bulk_window_bytes``, while a small message went out through
the same :class:`ChunkSender` less than this long ago (seconds)."""

INTERACTIVE_PART_BYTES = 64 * 1024
"""The largest part a transfer sends while small messages go alongside (``INTERACTIVE_S``; a
``bulk_chunk_bytes`` no larger than this keeps its equal chunks): what a small call may wait
behind each way. With 8 MiB echoes beside sequential small calls (``python -m benchmarks
--only fairness``, 2 cores) the small calls' p99 was 2.5-3.2x their idle p99 with it and
4.8-6.3x with 256 KiB parts, and the echoes' own rate meanwhile 104-110 MB/s against about
300 (benchmarks/README.md, "Bulk fairness")."""

_PART_HEADS = (bytes((0x83, PART)), bytes((0x84, PART)))
"""How a part's bytes begin, without and with a transfer id (encode_part, parse_part)."""

PEER_TRANSFERS = 4
"""How many transfers with an id a peer whose ``$link.parts`` gives no count holds at once (the
default of ``Limits.bulk_transfers``); the sender runs at most the smaller of this and its own."""

MAX_TRANSFER_ID = 2**63 - 1
"""The highest transfer id (ids begin at 1 and increase per direction of a session)."""

MIN_CHARGE = 1024
"""What a part costs against the transfer limit at least: each part held also costs a few hundred
bytes of objects, so a peer sending tiny parts cannot make a transfer hold many times its limit
(Limits guarantees our own parts are at least this big, but for the last)."""


def parse_part(payload: bytes | memoryview) -> tuple[int, memoryview] | None:
    """``(flags, chunk)`` of a part encoded as :func:`encode_part` writes it, the chunk a view
    of ``payload`` (not a copy); ``None`` for anything else (the caller then decodes it as any
    envelope). Never raises."""
    if len(payload) < 4 or payload[0] != 0x83 or payload[1] != PART or payload[2] > ABORT:
        return None
    head = payload[3]
    if head & 0xE0 != 0x40:
        return None
    info = head & 0x1F
    if info < 24:
        start, size = 4, info
    elif 24 <= info <= 27:
        width = 1 << (info - 24)
        start = 4 + width
        size = int.from_bytes(payload[4:start], "big")
    else:
        return None
    if start + size != len(payload):
        return None
    return payload[2], memoryview(payload)[start:]


def _uint(payload: bytes | memoryview, at: int, major: int) -> tuple[int, int] | None:
    """``(value, end)`` of a definite CBOR head of ``major`` at ``payload[at]``, else ``None``."""
    if at >= len(payload) or payload[at] >> 5 != major:
        return None
    info = payload[at] & 0x1F
    if info < 24:
        return info, at + 1
    if info > 27:
        return None
    end = at + 1 + (1 << (info - 24))
    if end > len(payload):
        return None
    return int.from_bytes(payload[at + 1 : end], "big"), end


def parse_transfer_part(payload: bytes | memoryview) -> tuple[int, int, memoryview] | None:
    """``(flags, transfer, chunk)`` of a part with a transfer id as :func:`encode_part` writes
    it, the chunk a view of ``payload``; ``None`` for anything else (decoded as any envelope,
    then checked by :class:`Transfers`). Never raises."""
    if len(payload) < 5 or payload[0] != 0x84 or payload[1] != PART or payload[2] > ABORT:
        return None
    transfer = _uint(payload, 3, 0)
    if transfer is None:
        return None
    size = _uint(payload, transfer[1], 2)
    if size is None or size[1] + size[0] != len(payload):
        return None
    return payload[2], transfer[0], memoryview(payload)[size[1] :]


class PartViolation(Exception):
    """A part the receiver refuses (see the module docstring); the transfer is discarded."""


class Reassembler:
    """The receiving side of one direction's transfers (sans-IO, no clock, no I/O).

    Args:
        limit: the most bytes one reassembled body may hold (``max_frame_bytes``).
        splice: fill large byte strings part by part (:class:`~garcon_link.rpc.splice.Splicer`):
            :meth:`feed` then returns the rest of the body, to be decoded with
            :attr:`splicer`'s placeholders resolved.
    """

    __slots__ = (
        "_charged",
        "_chunks",
        "_discarding",
        "_first",
        "_limit",
        "_size",
        "_splice",
        "_splicer",
        "aborted",
        "body_size",
        "claimed",
        "completed",
        "parts",
        "splicer",
    )

    def __init__(self, limit: int, *, splice: bool = False) -> None:
        self._limit = limit
        self._splice = splice
        self._chunks: list[bytes | memoryview] = []
        self._first = b""  # the transfer's first bytes as sent (at most 64)
        self._splicer: Splicer | None = None
        self._size = 0
        self._charged = 0
        self._discarding = False
        self.parts = 0
        self.completed = 0
        self.aborted = 0
        self.body_size = 0
        """The length of the last body completed, as sent (spliced values included)."""
        self.splicer: Splicer | None = None
        """The last body's splicer when it holds values filled part by part, else ``None``."""
        self.claimed: int | None = None
        """The RPC layer's note of the call id the transfer in progress claimed."""

    @property
    def in_progress(self) -> bool:
        """Whether a transfer was begun and not yet completed, aborted or discarded."""
        return bool(self._first)

    @property
    def buffered(self) -> int:
        """Bytes of the partial body held now (0 between transfers)."""
        return self._size

    def feed(self, flags: object, chunk: object) -> bytes | None:
        """Take one part; return the whole body at its final part, else ``None`` (with
        splicing, the body without its spliced values: see :attr:`splicer`).

        Raises:
            PartViolation: the part is refused; the partial body is dropped and the rest of the
                transfer (to its final or abort part) is discarded.
        """
        self.parts += 1
        if (
            type(flags) is not int
            or not MORE <= flags <= ABORT
            or (type(chunk) is not bytes and type(chunk) is not memoryview)
        ):
            raise self._violation("a part is [8, 0..2, bytes]")
        if self._discarding:
            if flags != MORE:
                self._discarding = False
            return None
        if flags == ABORT:
            if chunk or not self._first:
                raise self._violation("an abort part is empty and ends a transfer in progress")
            self.aborted += 1
            self.reset()
            return None
        if flags == MORE and not chunk:
            raise self._violation("an empty part that is not the last")
        if flags == FINAL and not self._first:
            raise self._violation("a final part with no transfer in progress (a one-part transfer)")
        received = self._size
        self._size += len(chunk)
        self._charged += max(len(chunk), MIN_CHARGE)
        if self._charged > self._limit:
            raise self._violation(f"a transfer exceeds {self._limit} bytes ({self.parts} parts)")
        if len(self._first) < 64:
            self._first += bytes(chunk[: 64 - len(self._first)])
        if self._splice:
            if self._splicer is None:
                self._splicer = Splicer(self._limit)
            try:
                self._chunks += self._splicer.take(chunk, received)
            except SpliceOverrun as exc:
                if flags != MORE:
                    self.reset()  # the transfer ended here: nothing of it is left to discard
                raise self._violation(str(exc)) from None
        else:
            self._chunks.append(chunk)
        if flags == MORE:
            return None
        # Parts do not nest: a body that is a part is refused before it is joined (the first
        # chunk of a transfer is not empty, but it may be a single byte).
        if self._first[:2] in _PART_HEADS:
            self.reset()  # the transfer ended here: nothing of it is left to discard
            raise self._violation("a body sent in parts is itself a part")
        splicer = self._splicer
        if splicer is not None and not splicer.complete:
            self.reset()
            raise self._violation("a transfer ends inside a byte string")
        body = b"".join(self._chunks)
        self.completed += 1
        self.body_size = self._size
        self.splicer = splicer if splicer is not None and splicer.values else None
        self.reset()
        return body

    def first_chunk(self) -> bytes | None:
        """The first bytes (at most 64) of the transfer in progress (its envelope's head)."""
        return self._first or None

    def reset(self) -> None:
        """Drop the partial body (a retired session, an abort)."""
        self._chunks = []
        self._first = b""
        self._splicer = None
        self._size = self._charged = 0

    def _violation(self, why: str) -> PartViolation:
        # The rest of a transfer begun before this part is discarded up to its last part.
        self._discarding = bool(self._first) or self._discarding
        self.reset()
        return PartViolation(why)


class Transfers:
    """The receiving side of one direction's transfers: the one without an id in progress (a
    peer that does not send ids) and up to ``transfers`` with ids, each reassembled by its own
    :class:`Reassembler` (sans-IO, no clock, no I/O).

    A transfer id is an integer 1..:data:`MAX_TRANSFER_ID`; a part naming an id above every id
    seen so far begins that transfer, one naming an id in progress continues it. A part naming
    any other id (ended, refused or never begun: unknown or reused), an id of another type or
    size, or beginning a transfer while ``transfers`` are in progress is a
    :class:`PartViolation`; so is every violation of :class:`Reassembler` within a transfer.
    After a violation the rest of that transfer is discarded unread (ids remembered for it:
    at most ``transfers``).

    Args:
        limit, splice: as :class:`Reassembler`'s, per transfer.
        transfers: ``Limits.bulk_transfers``, the transfers with ids held at once.
    """

    __slots__ = (
        "_discarding",
        "_highest",
        "_limit",
        "_most",
        "_open",
        "_splice",
        "aborted",
        "completed",
        "legacy",
        "parts",
    )

    def __init__(self, limit: int, *, transfers: int, splice: bool = False) -> None:
        self._limit = limit
        self._most = transfers
        self._splice = splice
        self.legacy = Reassembler(limit, splice=splice)
        """The transfer without an id."""
        self._open: dict[int, Reassembler] = {}
        self._discarding: dict[int, None] = {}  # ids whose rest is dropped, oldest first
        self._highest = 0
        self.parts = 0
        self.completed = 0
        self.aborted = 0

    @property
    def buffered(self) -> int:
        """Bytes of partial bodies held now, all transfers together."""
        return self.legacy.buffered + sum(r.buffered for r in self._open.values())

    @property
    def in_progress(self) -> int:
        """How many transfers (with an id or not) were begun and not yet ended."""
        return len(self._open) + self.legacy.in_progress

    def feed(
        self, transfer: object, flags: object, chunk: object
    ) -> tuple[Reassembler, bool, bytes | None] | None:
        """Take one part (``transfer`` ``None``: the transfer without an id).

        Returns:
            ``None`` for a part discarded unread (the rest of a refused transfer), else the
            transfer's reassembler, whether this part began it, and the whole body at its final
            part (as :meth:`Reassembler.feed`).

        Raises:
            PartViolation: the part is refused (the class docstring).
        """
        self.parts += 1
        if transfer is None:
            reassembler = self.legacy
            starting = not reassembler.in_progress
            aborted = reassembler.aborted
            body = reassembler.feed(flags, chunk)
            self.aborted += reassembler.aborted - aborted
            if body is not None:
                self.completed += 1
            return reassembler, starting, body
        if type(transfer) is not int or not 0 < transfer <= MAX_TRANSFER_ID:
            raise PartViolation(f"a transfer id is an integer 1..{MAX_TRANSFER_ID}")
        known = self._open.get(transfer)
        starting = known is None
        if known is not None:
            reassembler = known
        else:
            if transfer in self._discarding:
                if flags != MORE:
                    del self._discarding[transfer]
                return None
            if transfer <= self._highest:
                raise PartViolation(f"a part of transfer {transfer}, unknown or ended")
            self._highest = transfer
            if len(self._open) >= self._most:
                if flags == MORE:
                    self._discard(transfer)
                raise PartViolation(f"more than {self._most} transfers at once")
            reassembler = Reassembler(self._limit, splice=self._splice)
        try:
            body = reassembler.feed(flags, chunk)
        except PartViolation:
            self._open.pop(transfer, None)
            if flags == MORE:
                self._discard(transfer)
            raise
        if reassembler.aborted:
            self.aborted += 1
            del self._open[transfer]
        elif body is not None:
            self.completed += 1
            self._open.pop(transfer, None)
        elif starting:
            self._open[transfer] = reassembler
        return reassembler, starting, body

    def _discard(self, transfer: int) -> None:
        if len(self._discarding) >= self._most:
            del self._discarding[next(iter(self._discarding))]
        self._discarding[transfer] = None

    def reset(self) -> None:
        """Drop every partial body (a retired session)."""
        self.legacy.reset()
        for reassembler in self._open.values():
            reassembler.reset()
        self._open.clear()


def _pieces(body: bytes | Spliced) -> tuple[bytes | bytearray | memoryview, ...]:
    return body.pieces if isinstance(body, Spliced) else (body,)


def _encode_part(flags: int, transfer: int | None, pieces: list[memoryview]) -> Gathered:
    """``encode_part(flags, b"".join(pieces), transfer)`` as the buffers it joins: the session
    joins them straight into the message's frame (one copy of the pieces, not two)."""
    size = sum(piece.nbytes for piece in pieces)
    if transfer is None:
        head = bytes((0x83, PART, flags)) + encode_head(2, size)
    else:
        head = bytes((0x84, PART, flags)) + encode_head(0, transfer) + encode_head(2, size)
    return Gathered((head, *pieces))


class _Transport(Protocol):
    async def send(self, body: bytes | Gathered) -> int: ...

    def send_nowait(self, body: bytes | Gathered) -> int | None: ...

    def try_send(self, body: bytes | Gathered) -> int | None: ...

    async def wait_retained_below(self, size: int) -> bool: ...

    @property
    def issued(self) -> int: ...


class ChunkSender:
    """The sending side: :meth:`send` issues a body whole or in paced parts.

    Transfers take turns part by part (a FIFO lock held for one part): with :attr:`interleave`
    (the peer reads transfer ids) up to :attr:`most` are in progress at once, each part naming
    its transfer, so two bulk producers each send a part in turn; without it one
    transfer at a time, its parts without an id.

    Args:
        transport: the session (a :class:`~garcon_link.endpoint.transport.SessionTransport`).
        chunk: ``Limits.bulk_chunk_bytes``; bodies longer than this are sent in parts.
        window: ``Limits.bulk_window_bytes``.
        limit: ``Limits.max_frame_bytes`` (the size limit of a whole body's frame).
        transfers: ``Limits.bulk_transfers``, the most transfers with ids run at once.
        clock: seconds, for the interactive pacing (``INTERACTIVE_S``); tests inject one.
    """

    def __init__(
        self,
        transport: _Transport,
        chunk: int,
        window: int,
        limit: int,
        *,
        transfers: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transport = transport
        self._own = transfers
        self._clock = clock
        # A part holds less than two chunks (see send) and its frame (with the envelope's and
        # the message's heads, at most 32 bytes) fits the frame limit.
        self.chunk = min(chunk, (limit - 64) // 2)
        if self.chunk < MIN_CHARGE:
            self.chunk = limit  # frames too small to split usefully: every body goes whole
        self._window = window
        self._limit = limit
        # The most a part holds while small messages go alongside, and what it is paced by:
        # a chunk no larger than INTERACTIVE_PART_BYTES is cut and paced as ever.
        self._interactive_part = min(self.chunk, INTERACTIVE_PART_BYTES)
        self._interactive_most = (
            INTERACTIVE_PART_BYTES if self.chunk > INTERACTIVE_PART_BYTES else limit
        )
        self._small_at = -math.inf  # clock() when the last small body was sent
        self._turn = anyio.Lock(fast_acquire=True)  # held while one part is issued
        self._active = 0  # transfers begun and not ended (an owed abort's included)
        self._slot: anyio.Event | None = None  # set when _active drops or an abort is owed
        self._owed: list[bytes] = []  # abort parts not yet issued
        self._sending = 0  # transfers whose send() is between its first and its last part
        self._last: object = None  # the transfer that issued the last part
        self._progress: anyio.Event | None = None  # set when a part is issued or a send ends
        self._transfers = 0  # the last transfer id used
        self.interleave = False
        """Whether the peer reads transfer ids (it said so: ``$link.parts``)."""
        self.most = 1
        """Transfers run at once: 1 until the peer reads ids, then the smaller of ours and its."""
        self.parts_sent = 0
        self.aborts_sent = 0
        self.on_abort: Callable[[], None] | None = None

    def read_ids(self, transfers: int = PEER_TRANSFERS) -> None:
        """The peer reads transfer ids and holds ``transfers`` (at least 1) at once (it said
        so): further transfers are numbered and interleave, at most the smaller of its count
        and ours at once, beside a transfer without an id still in progress."""
        if not self.interleave:
            self.interleave = True
            self.most = max(1, min(self._own, transfers))
            self._wake()  # a transfer waiting for a slot may begin now

    @property
    def active(self) -> int:
        """Transfers in progress (aborted ones whose abort part is still owed included)."""
        return self._active

    def send_nowait(self, body: bytes | Spliced) -> int | None:
        """Issue a body sent whole (at most :attr:`chunk` bytes) if the session admits it without
        waiting: its ordinal, or ``None`` (nothing issued) for a larger body, a spliced one (sent
        in parts by :meth:`send`) or a full session.

        Raises:
            PayloadTooLarge, SessionFailed: as :meth:`send`.
        """
        if type(body) is not bytes or len(body) > self.chunk:
            return None
        ordinal = self._transport.send_nowait(body)
        if ordinal is not None:
            self._small_at = self._clock()
        return ordinal

    async def send(
        self,
        body: bytes | Spliced,
        renumber: Callable[[bytes], tuple[bytes, int]] | None = None,
    ) -> int:
        """Issue ``body``; returns the ordinal of its last message (the final part).

        ``body`` may be :class:`~garcon_link.rpc.splice.Spliced` (large values not copied into
        it): each part then copies only its own bytes from the pieces.

        ``renumber`` (a call's body) is asked, once this send's turn has come and just before
        its first part is issued, for a new head and the length of ``body``'s head it replaces
        (the body is not copied for it), to give the call a fresh id: calls issued meanwhile (small
        ones, not waiting for the turn) have higher ids, and the receiver requires a call's id,
        read from its first part, to increase (:meth:`garcon_link.rpc.rpc.ExecutorRpc._on_part`).

        Raises:
            PayloadTooLarge: ``body`` would exceed the frame limit as one message; nothing sent.
            SessionFailed: the session is retired.
        """
        if len(body) <= self.chunk:
            self._small_at = self._clock()
            return await self._transport.send(
                Gathered(body.pieces) if isinstance(body, Spliced) else body
            )
        size = encoded_message_size(self._transport.issued + 1, len(body))
        if size > self._limit:
            raise PayloadTooLarge(size, self._limit)
        pieces = [memoryview(piece) for piece in _pieces(body)]
        turn = self._turn
        ordinal = 0
        transfer: int | None = None
        begun = False
        me = object()
        try:
            while True:
                async with turn:
                    if self._owed:
                        await self._issue_owed()
                    if self._active < self.most:
                        self._active += 1
                        self._sending += 1
                        begun = True
                        # The first part is paced too (a transfer right behind another one),
                        # before the renumbering: nothing may run between a fresh id and its
                        # first part.
                        most = await self._paced()
                        if renumber is not None:
                            # A call's head (array head, kind, id) is within its first bytes,
                            # which are encoded bytes in front of any spliced value.
                            head, skip = renumber(bytes(pieces[0][:16]))
                            pieces[0] = pieces[0][skip:]
                            pieces.insert(0, memoryview(head))
                        if self.interleave:
                            self._transfers += 1
                            transfer = self._transfers
                        end = sum(len(piece) for piece in pieces)
                        # Equal parts, as many as whole chunks fit (at least two): no short
                        # tail part that would wait a round trip for the window (a 1 MiB body
                        # goes as four parts, at once). Never one part (the receiver refuses a
                        # final part that begins no transfer): end >= len(body) > self.chunk
                        # >= 2 (a fresh id's head is no shorter than the one it replaces), so
                        # step = ceil(end / count) < end.
                        count = max(2, end // self.chunk)
                        step = -(-end // count)
                        size = min(most, step)  # (never the whole body: step < end)
                        ordinal, index, offset = await self._part(
                            transfer, pieces, 0, size, end, 0, 0
                        )
                        start = size
                        self._last = me
                        if self._progress is not None:
                            self._issued_by(me)  # wakes a transfer waiting for its turn
                        break
                slot = self._slot = self._slot or anyio.Event()
                await slot.wait()
            while start < end:
                # One part per loop turn at most, even when the window has room for several:
                # what a small call waits for is one part's work, not a window's. Other
                # transfers take turns with it: while another one sends, each waits for a part
                # of another's after its own (on any backend's scheduling order).
                await anyio.lowlevel.checkpoint()
                while self._sending > 1 and self._last is me:
                    progress = self._progress = self._progress or anyio.Event()
                    await progress.wait()
                async with turn:
                    if self._owed:
                        await self._issue_owed()
                    size = min(await self._paced(), step)
                    ordinal, index, offset = await self._part(
                        transfer, pieces, start, size, end, index, offset
                    )
                    start += size
                    self._last = me
                    if self._progress is not None:
                        self._issued_by(me)
        except BaseException:
            if begun:
                self._sending -= 1
                self._issued_by(None)
            if ordinal:  # parts were issued, the final one was not
                self._abort(transfer)
            elif begun:
                self._end()
            raise
        self._sending -= 1
        self._issued_by(None)
        self._end()
        return ordinal

    def _issued_by(self, transfer: object) -> None:
        """A part of ``transfer``'s was issued (``None``: a send ended): the turn passes."""
        self._last = transfer
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    async def _part(
        self,
        transfer: int | None,
        pieces: list[memoryview],
        start: int,
        step: int,
        end: int,
        index: int,
        offset: int,
    ) -> tuple[int, int, int]:
        """Issue the part of ``pieces`` at ``start`` (``pieces[index][offset:]``): its ordinal
        and where the next part begins."""
        flags = FINAL if start + step >= end else MORE
        want = min(step, end - start)
        taken: list[memoryview] = []
        while want:
            piece = pieces[index]
            size = min(want, len(piece) - offset)
            taken.append(piece[offset : offset + size])
            want -= size
            offset += size
            if offset == len(piece):
                index, offset = index + 1, 0
        ordinal = await self._transport.send(_encode_part(flags, transfer, taken))
        self.parts_sent += 1
        return ordinal, index, offset

    async def _paced(self) -> int:
        """Wait until the next part may go; the most it may hold. Alone: once less than the
        window is unconfirmed, a whole chunk (``send`` cuts equal ones); while small messages
        are being sent alongside: once less than one such part is, ``INTERACTIVE_PART_BYTES``
        (see the module docstring)."""
        if self._clock() - self._small_at < INTERACTIVE_S:
            await self._transport.wait_retained_below(min(self._window, self._interactive_part))
            return self._interactive_most
        await self._transport.wait_retained_below(self._window)
        return self._limit

    def _end(self) -> None:
        """A transfer ended (its final or abort part issued, or nothing of it sent)."""
        self._active -= 1
        self._wake()

    def _wake(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.set()

    async def _issue_owed(self) -> None:
        """Issue the abort parts owed (before any further part; each frees its transfer)."""
        while self._owed:
            await self._transport.send(self._owed[0])
            del self._owed[0]
            self.aborts_sent += 1
            self._end()

    def _abort(self, transfer: int | None) -> None:
        part = encode_part(ABORT, b"", transfer)
        try:
            sent = self._transport.try_send(part) is not None
        except Exception:  # a retired session: nothing to free on the peer
            self._end()
            return
        if sent:
            self.aborts_sent += 1
            self._end()
        else:
            # Owed: the next turn issues it first, and a transfer waiting for a slot is woken
            # to take that turn.
            self._owed.append(part)
            self._wake()
