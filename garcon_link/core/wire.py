"""Wire codec: session packets and strict single-item CBOR (sans-IO, no clock, no anyio).

Theory of operation
-------------------
After authentication every WebSocket message is a CBOR sequence (RFC 8742) of one or more session
packets. There are exactly two packet shapes::

    message   [0, ordinal, body]     ordinal >= 1, body a byte string (an encoded RPC envelope)
    receipt   [1, through]           through >= 0: every ordinal <= through was accepted

The grammar is tiny and hot (every frame of every call passes through it), so it is encoded and
decoded by hand instead of through cbor2: the bytes are ordinary deterministic CBOR (shortest
integer heads, definite lengths), any CBOR implementation can produce and read them, and the
decoder here accepts *only* that form. Anything else -- other major types, indefinite lengths,
non-shortest heads, ordinal 0, a float, trailing garbage, an empty message -- raises
:class:`~garcon_link.errors.MalformedFrame`. Size is checked before any decoding starts.

Packets are decoded *incrementally* (:func:`iter_packets`): one packet at a time, so the reader
acts on each as it is decoded and nothing proportional to the packet count is built up front. A
message may hold at most ``max_packets`` packets (``Limits.max_packets_per_message``): the
smallest packet is 3 bytes, so without that bound one 16 MiB message would be five million
packets -- hundreds of MiB of objects and seconds of work for the reader. The decoder stops at
packet ``max_packets + 1``, before decoding it; the writer never coalesces more packets than
that into one message, so only a hostile or broken peer reaches it.

Handshake frames and RPC envelopes hold exactly one CBOR item decoded by cbor2
(:func:`decode_item`); every cbor2 failure, recursion blow-up or trailing byte is mapped to
:class:`MalformedFrame` here, at the boundary. Encodings that are MACed use ``canonical=True``.

Integers from a peer are bounded *while decoding*, before anything else looks at them:

- a CBOR head holds at most 64 bits, so only the bignum tags (2 and 3) make larger integers;
- ``decode_item(..., bignums=False)`` (the handshake, whose grammar has no integer beyond
  ``2**64-1``) refuses both tags outright: every integer it returns is in ``-2**64 .. 2**64-1``;
- otherwise (RPC envelopes, whose application values may be any integer) a bignum's magnitude
  is at most :data:`MAX_BIGNUM_BYTES` bytes (8,192 bits, 2,467 decimal digits), checked before
  the integer is built. Python refuses ``str()`` of an integer over 4,300 digits, so an
  unbounded bignum would make every log line or error message that mentions it raise.

Error messages and log lines render peer values with :func:`garcon_link.logs.peer_text`.
"""

from __future__ import annotations

import enum
import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NewType

import cbor2

from ..errors import FrameTooLarge, MalformedFrame

__all__ = [
    "MAX_BIGNUM_BYTES",
    "MAX_ORDINAL",
    "VIEW_BYTES",
    "CloseCode",
    "PEER_RETIRED_CODES",
    "Role",
    "Gathered",
    "Message",
    "Ordinal",
    "Packet",
    "Receipt",
    "array_prefix",
    "argument_items",
    "decode_item",
    "decode_packets",
    "encode_canonical",
    "encode_head",
    "encode_message",
    "encode_receipt",
    "iter_packets",
    "message_head",
    "peer_retired_detail",
]

Ordinal = NewType("Ordinal", int)
"""Position of a message in one direction of a logical session; the first is 1."""

MAX_ORDINAL = (1 << 64) - 1

MAX_BIGNUM_BYTES = 1024
"""Largest magnitude of a bignum (CBOR tags 2/3) :func:`decode_item` accepts: 8,192 bits."""

VIEW_BYTES = 64 * 1024
"""A message body at least this long that is at least half of its WebSocket message is decoded
as a view of the message (:func:`iter_packets`), not copied out of it: the message is immutable
``bytes``, and the view pins little more than the body itself."""

_TAG_MESSAGE = 0
_TAG_RECEIPT = 1


class CloseCode(enum.IntEnum):
    """WebSocket close codes used by the link (RFC 6455 §7.4 and the 4000-4999 private range)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    PROTOCOL = 1002
    UNSUPPORTED_DATA = 1003
    MESSAGE_TOO_BIG = 1009
    TRY_AGAIN_LATER = 1013
    AUTH_FAILED = 4001
    VERSION_MISMATCH = 4002
    IDENTITY_MISMATCH = 4003
    SUPERSEDED = 4004
    SESSION_RETIRED = 4005
    REPLAY_STALLED = 4006
    HEARTBEAT_TIMEOUT = 4007
    PROTOCOL_ERROR = 4008
    TAKEN_OVER = 4009
    """Another runtime of the same executor took over this one's session: two
    processes claim one executor id, an operator error; the receiving side stops dialing."""
    DRAINING = 4010
    """The worker drains (it was told to stop): it admits no new session, only resumes of the
    sessions it holds. A restarted worker admits the peer again."""


def peer_retired_detail(code: int, reason: str = "") -> str:
    """How a session retired by the peer's close (one of :data:`PEER_RETIRED_CODES`) is
    detailed in its :class:`~garcon_link.errors.SessionFailed`; ``reason``: the close's."""
    return f"peer closed with {code}" + (f" ({reason})" if reason else "")


PEER_RETIRED_CODES = frozenset(
    {
        int(CloseCode.GOING_AWAY),
        int(CloseCode.SESSION_RETIRED),
        int(CloseCode.REPLAY_STALLED),
        int(CloseCode.PROTOCOL_ERROR),
        int(CloseCode.TAKEN_OVER),
        int(CloseCode.DRAINING),
    }
)
"""Close codes a peer sends when *it* has retired the logical session: no resume is possible.
1001 is a deliberate shutdown (``aclose``), which retires the session on that side too, so waiting
out the detached grace would only delay honest outcomes. 4010 on an attached socket is a draining
dialer refusing the fresh session the listener had just admitted: that session never starts."""


class Role(enum.StrEnum):
    """Which end of the link a process is; independent of who dials and who listens."""

    CONTROLLER = "controller"
    WORKER = "worker"

    @property
    def peer(self) -> Role:
        """The role the other end must have."""
        return Role.WORKER if self is Role.CONTROLLER else Role.CONTROLLER


@dataclass(frozen=True, slots=True)
class Message:
    """A session message packet: ``[0, ordinal, body]``; ``body`` is a view of the received
    message when it is large (:data:`VIEW_BYTES`)."""

    ordinal: Ordinal
    body: bytes | memoryview


@dataclass(frozen=True, slots=True)
class Receipt:
    """A cumulative receipt packet: ``[1, through]``."""

    through: int


Packet = Message | Receipt


class Gathered:
    """A message body given as the buffers it is the concatenation of (a part's head and the
    views of the value it carries): :func:`encode_message` joins them straight into the frame,
    so a large body is copied once on its way to the session's retention, not once into the
    body and again into the frame. ``len()`` is the body's length in bytes.

    The buffers must not change until the body is issued (they are read then, not before).
    """

    __slots__ = ("pieces", "size")

    def __init__(self, pieces: Iterable[bytes | bytearray | memoryview]) -> None:
        self.pieces: tuple[bytes | bytearray | memoryview, ...] = tuple(pieces)
        self.size: int = sum(
            piece.nbytes if type(piece) is memoryview else len(piece) for piece in self.pieces
        )

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)


def encode_head(major: int, value: int) -> bytes:
    """Shortest-form CBOR head for ``major`` type and unsigned ``value`` (< 2**64), as
    ``cbor2.dumps`` writes it: the session packets here, the RPC layer's parts and renumbered
    call heads."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value < 0x100:
        return bytes((mt | 24, value))
    if value < 0x10000:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value < 0x100000000:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    return bytes((mt | 27,)) + value.to_bytes(8, "big")


_SMALL_UINT_HEADS = tuple(encode_head(0, value) for value in range(0x100))
_SMALL_BYTES_HEADS = tuple(encode_head(2, value) for value in range(0x100))


def message_head(ordinal: int, size: int) -> bytes:
    """The bytes of ``[0, ordinal, body]`` that come before a body of ``size`` bytes (so the
    frame's length is ``len(message_head(ordinal, size)) + size``).

    Raises:
        ValueError: the ordinal is out of range (a programming error, not peer input).
    """
    if ordinal < 0x100:
        if ordinal < 1:
            raise ValueError(f"ordinal out of range: {ordinal}")
        head = b"\x83\x00" + _SMALL_UINT_HEADS[ordinal]
    elif ordinal < 0x10000:
        head = b"\x83\x00\x19" + ordinal.to_bytes(2, "big")
    elif ordinal <= MAX_ORDINAL:
        head = b"\x83\x00" + encode_head(0, ordinal)
    else:
        raise ValueError(f"ordinal out of range: {ordinal}")
    if size < 0x100:
        return head + _SMALL_BYTES_HEADS[size]
    return head + encode_head(2, size)


def encode_message(ordinal: int, body: bytes | memoryview | Gathered) -> bytes:
    """Encode ``[0, ordinal, body]``.

    Args:
        ordinal: 1 .. 2**64-1.
        body: the payload (joined into the frame if :class:`Gathered`); empty is allowed.

    Raises:
        ValueError: the ordinal is out of range (a programming error, not peer input).
    """
    head = message_head(ordinal, len(body))
    if isinstance(body, Gathered):
        return b"".join((head, *body.pieces))
    return head + body


def encode_receipt(through: int) -> bytes:
    """Encode ``[1, through]`` (``through`` in 0 .. 2**64-1)."""
    if not 0 <= through <= MAX_ORDINAL:
        raise ValueError(f"receipt out of range: {through}")
    return b"\x82\x01" + encode_head(0, through)


def _read_head(
    data: bytes, pos: int, major: int, what: str, *, shortest: bool = True
) -> tuple[int, int]:
    """Read a head of ``major`` type at ``pos`` (shortest form only, unless ``shortest`` is
    false); return (value, next position)."""
    end = len(data)
    if pos >= end:
        raise MalformedFrame(f"truncated {what}")
    initial = data[pos]
    if initial >> 5 != major:
        raise MalformedFrame(f"{what}: expected CBOR major type {major}, got byte 0x{initial:02x}")
    info = initial & 0x1F
    pos += 1
    if info < 24:
        return info, pos
    if info > 27:
        raise MalformedFrame(f"{what}: indefinite or reserved length (0x{initial:02x})")
    width = 1 << (info - 24)
    if pos + width > end:
        raise MalformedFrame(f"truncated {what}")
    value = int.from_bytes(data[pos : pos + width], "big")
    # Deterministic encoding: the head must be the shortest one that holds the value.
    if shortest and value < (24 if width == 1 else 1 << (4 * width)):
        raise MalformedFrame(f"{what}: non-shortest integer head")
    return value, pos + width


def array_prefix(data: bytes) -> tuple[int, int, int] | None:
    """``(length, first, second)`` of a definite CBOR array whose first two items are unsigned
    integers, read from its first bytes alone; ``None`` for anything else. Never raises.

    For naming what a value that does not decode as a whole was about (an RPC envelope's
    ``[kind, id``). Any head width is accepted: this reads, it does not validate.
    """
    try:
        length, pos = _read_head(data, 0, 4, "array", shortest=False)
        first, pos = _read_head(data, pos, 0, "first item", shortest=False)
        second, _ = _read_head(data, pos, 0, "second item", shortest=False)
    except MalformedFrame:
        return None
    return length, first, second


_MAX_FRAMED_DEPTH = 64


def _item_end(data: bytes, pos: int) -> int:
    """The position after the one CBOR item that starts at ``pos``, read from its heads alone.

    Strings are skipped by their length, never copied or decoded; containers are walked by
    their counts. Refused (:class:`MalformedFrame`): truncation, indefinite lengths, reserved
    heads, a ``break`` out of place, simple values but false/true/null, tags but the bignums (2
    and 3), nesting deeper than 64. The walk costs one step per head, so at most ``len(data)``
    steps whatever the heads declare. It frames, it does not validate: what the items hold is
    the receiver's to check.
    """
    end = len(data)
    todo = 1  # items still to read at this level
    outer: list[int] = []  # the counts left at the levels above
    while True:
        while todo == 0:
            if not outer:
                return pos
            todo = outer.pop()
        todo -= 1
        if pos >= end:
            raise MalformedFrame("truncated CBOR item")
        initial = data[pos]
        major, info = initial >> 5, initial & 0x1F
        pos += 1
        if info < 24:
            value = info
        elif info <= 27:
            width = 1 << (info - 24)
            if pos + width > end:
                raise MalformedFrame("truncated CBOR head")
            value = int.from_bytes(data[pos : pos + width], "big")
            pos += width
        else:
            raise MalformedFrame(f"indefinite or reserved CBOR head 0x{initial:02x}")
        if major == 2 or major == 3:
            pos += value
            if pos > end:
                raise MalformedFrame("truncated CBOR string")
        elif major == 4 or major == 5:
            count = value * 2 if major == 5 else value
            if count:
                if len(outer) >= _MAX_FRAMED_DEPTH:
                    raise MalformedFrame(f"CBOR item nested deeper than {_MAX_FRAMED_DEPTH} levels")
                outer.append(todo)
                todo = count
        elif major == 6:
            if value not in (2, 3):
                raise MalformedFrame(f"CBOR semantic tag {value} is not allowed")
            todo += 1  # the tagged item
        elif major == 7 and info < 24 and value not in (20, 21, 22):
            raise MalformedFrame(f"CBOR simple value {value} is not allowed")
        elif major == 7 and info == 24:
            raise MalformedFrame("CBOR simple value is not allowed")


def argument_items(payload: bytes) -> bytes:
    """The encoded ``args`` array and ``kwargs`` map of ``payload`` (the CBOR array
    ``[args, kwargs]``), checked for framing only (:func:`_item_end`): the bytes a relay
    splices into a ``call`` envelope without decoding the values.

    Raises:
        MalformedFrame: not a definite two-item array of an array and a map, exactly.
    """
    if len(payload) < 3 or payload[0] != 0x82:
        raise MalformedFrame("the arguments are not a two-item CBOR array")
    if payload[1] >> 5 != 4:
        raise MalformedFrame("the positional arguments are not a CBOR array")
    middle = _item_end(payload, 1)
    if middle >= len(payload) or payload[middle] >> 5 != 5:
        raise MalformedFrame("the keyword arguments are not a CBOR map")
    if _item_end(payload, middle) != len(payload):
        raise MalformedFrame("trailing bytes after the arguments")
    return payload[1:]


def iter_packets(
    data: bytes, max_frame_bytes: int, max_packets: int, *, start: int = 0, counted: int = 0
) -> Iterator[Packet]:
    """Decode one WebSocket message into its session packets, one at a time.

    The size and emptiness checks run at once (before the first packet is asked for); each
    packet is decoded only when the caller asks for it, so a caller that stops at the first bad
    packet never decodes the rest, and nothing proportional to the packet count is held here.
    A body of at least :data:`VIEW_BYTES` that is at least half of ``data`` comes as a
    ``memoryview`` of ``data`` (when ``data`` is ``bytes``), any other as ``bytes``.

    Args:
        data: the whole message.
        max_frame_bytes: the frame limit; checked before anything is decoded.
        max_packets: the most packets one message may hold (``Limits.max_packets_per_message``).
        start: where the packets to decode start: ``data[:start]`` holds ``counted`` packets
            the caller decoded itself (:meth:`~garcon_link.core.session.MessageSession.receive`
            reads the common ones inline); they count towards ``max_packets``.

    Returns:
        An iterator over the packets in order (at least one, unless ``start`` > 0, or it
        raises).

    Raises:
        FrameTooLarge: ``len(data) > max_frame_bytes`` (raised by this call).
        MalformedFrame: an empty message (raised by this call); while iterating: anything that
            is not a well-formed packet, or a packet beyond the first ``max_packets``.
    """
    size = len(data)
    if size > max_frame_bytes:
        raise FrameTooLarge(size, max_frame_bytes)
    if size == 0:
        raise MalformedFrame("empty message: a message holds at least one packet")
    return _packets(data, max_packets, start, counted)


def _packets(data: bytes, max_packets: int, pos: int, count: int) -> Iterator[Packet]:
    size = len(data)
    while pos < size:
        if count == max_packets:
            raise MalformedFrame(f"more than {max_packets} packets in one message")
        count += 1
        first = data[pos]
        if first == 0x83:
            if data[pos + 1 : pos + 2] != b"\x00":
                raise MalformedFrame("3-element packet must be a message ([0, ordinal, body])")
            ordinal, pos = _read_head(data, pos + 2, 0, "message ordinal")
            if ordinal == 0:
                raise MalformedFrame("message ordinal 0 (ordinals start at 1)")
            length, pos = _read_head(data, pos, 2, "message body")
            if pos + length > size:
                raise MalformedFrame("message body runs past the end of the frame")
            end = pos + length
            if length >= VIEW_BYTES and 2 * length >= size and type(data) is bytes:
                yield Message(Ordinal(ordinal), memoryview(data)[pos:end])
            else:
                yield Message(Ordinal(ordinal), data[pos:end])
            pos = end
        elif first == 0x82:
            if data[pos + 1 : pos + 2] != b"\x01":
                raise MalformedFrame("2-element packet must be a receipt ([1, through])")
            through, pos = _read_head(data, pos + 2, 0, "receipt")
            yield Receipt(through)
        else:
            raise MalformedFrame(f"not a session packet (leading byte 0x{first:02x})")


def decode_packets(
    data: bytes, max_frame_bytes: int, max_packets: int | None = None
) -> list[Packet]:
    """Decode one whole WebSocket message into a list of its session packets.

    A convenience for tests and tools that inspect what was written; the session decodes with
    :func:`iter_packets` and acts on each packet as it comes.

    Args:
        data: the whole message.
        max_frame_bytes: the frame limit; checked before anything is decoded.
        max_packets: the most packets the message may hold; ``None``: as many as it has (the
            caller trusts the bytes, e.g. its own writes).

    Returns:
        The packets in order; never empty.

    Raises:
        FrameTooLarge: ``len(data) > max_frame_bytes``.
        MalformedFrame: anything that is not a non-empty sequence of well-formed packets, or
            more than ``max_packets`` of them.
    """
    limit = len(data) if max_packets is None else max_packets
    return list(iter_packets(data, max_frame_bytes, limit))


def encode_canonical(value: Any) -> bytes:
    """Deterministic CBOR (RFC 8949 §4.2) of ``value``, as used wherever bytes are MACed."""
    return cbor2.dumps(value, canonical=True)


def decode_item(
    data: bytes,
    max_bytes: int,
    *,
    plain: bool = True,
    bignums: bool = True,
    splice: tuple[int, Callable[[Any], Any]] | None = None,
    depth: int = 0,
) -> Any:
    """Decode exactly one CBOR item with cbor2, mapping every failure to :class:`MalformedFrame`.

    Handshake and envelope values are plain CBOR data: maps, arrays, text and byte strings,
    integers, floats, booleans and null. With ``plain`` every semantic tag but the bignums is
    refused *while decoding* -- the ones cbor2 knows (dates, decimal fractions, bigfloats,
    regular expressions, MIME messages, sets, shared and string references, ...) before cbor2
    builds anything from them, the unknown ones by the tag hook -- and a walk of the result then
    refuses what else is not plain data (undefined, simple values, array map keys), so nothing
    but plain data (and no cycle) leaves this function. Bignums (tags 2 and 3) are integers:
    bounded to :data:`MAX_BIGNUM_BYTES` bytes of magnitude before the integer is built, or
    refused with ``bignums=False``. cbor2 itself caps nesting depth and reads declared lengths
    in chunks.

    Args:
        data: the whole frame.
        max_bytes: size limit, checked before decoding.
        plain: refuse non-plain tags while decoding and verify the result holds only plain data
            types (costs one walk of the value). ``False`` lets cbor2 decode the tags it knows
            (for tests of the decoder itself).
        bignums: accept bignum tags (bounded); ``False`` refuses them, so every integer returned
            is in ``-2**64 .. 2**64-1`` (what a CBOR head can hold).
        splice: ``(tag, resolve)``: an item under this one private tag is replaced by
            ``resolve(the CBORTag)``, which raises ``ValueError`` for one it does not know
            (refused like any tag). The receiver's placeholders for byte strings it filled
            part by part (:mod:`garcon_link.rpc.splice`); ``resolve`` returns plain data.
        depth: the level at which the item will sit inside the value its reader decodes (a
            relayed result checked alone, that its caller reads inside an outcome): the plain
            walk's nesting limit counts from there.

    Raises:
        FrameTooLarge: ``len(data) > max_bytes``.
        MalformedFrame: not CBOR, a tag, a bignum over the bound (or any, without ``bignums``),
            a non-plain value, or trailing bytes after the item.
    """
    if len(data) > max_bytes:
        raise FrameTooLarge(len(data), max_bytes)
    if not data:
        raise MalformedFrame("empty frame")
    stream = io.BytesIO(data)
    decoders = (
        (_PLAIN_DECODERS if plain else _BIGNUM_DECODERS)
        if bignums
        else (_PLAIN_NO_BIGNUM_DECODERS if plain else _NO_BIGNUM_DECODERS)
    )
    try:
        hook = _refuse_tag if splice is None else _splice_hook(*splice)
        decoder = cbor2.CBORDecoder(stream, tag_hook=hook, semantic_decoders=decoders)
        value = decoder.decode()
    except MalformedFrame:
        raise
    except MemoryError as exc:  # a huge declared length that slipped past the size check
        raise MalformedFrame("CBOR item declares more data than the frame holds") from exc
    except Exception as exc:  # cbor2's errors, RecursionError, ValueError...: all the peer's
        # A refusal from one of our tag decoders reaches us wrapped by cbor2: keep its words.
        cause = exc.__cause__
        if isinstance(cause, MalformedFrame):
            raise MalformedFrame(str(cause)) from exc
        raise MalformedFrame(f"not a valid CBOR item: {type(exc).__name__}: {exc}") from exc
    if stream.tell() != len(data):
        raise MalformedFrame(f"{len(data) - stream.tell()} trailing byte(s) after the CBOR item")
    if plain:
        _check_plain(value, depth)
    return value


_PLAIN_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})
_PLAIN_KEYS = frozenset({str, int, bool})
_MAX_PLAIN_DEPTH = 64


def _check_plain(value: Any, depth: int, seen: set[int] | None = None) -> None:
    """Walk ``value``; each container may appear once (a tree, not a DAG or a cycle).

    With the shared-reference tags (28/29) refused while decoding a DAG cannot arise here; the
    check stays as a second line against a decoder change (a few hundred bytes can describe a
    DAG with 2**60 paths, and refusing any container seen twice keeps the walk linear in the
    number of containers actually decoded). Scalars are checked inline (exact types: cbor2
    makes no subclasses of them), containers recursively. ``seen`` (the containers walked so
    far) is ``None`` at the top and made when the first nested container is reached: a
    container of scalars only, the common envelope, needs no set.
    """
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return
    if kind is list:
        items: Any = value
    elif kind is dict:
        for key in value:
            if type(key) not in _PLAIN_KEYS:
                raise MalformedFrame(f"map key of type {type(key).__name__} is not allowed")
        items = value.values()
    else:
        raise MalformedFrame(f"CBOR value of type {kind.__name__} is not plain data")
    if depth >= _MAX_PLAIN_DEPTH:
        raise MalformedFrame(f"CBOR item nested deeper than {_MAX_PLAIN_DEPTH} levels")
    if seen is not None:
        if id(value) in seen:
            raise MalformedFrame("CBOR item shares a container (shared reference or cycle)")
        seen.add(id(value))
    for item in items:
        if type(item) not in _PLAIN_SCALARS:
            if seen is None:
                seen = {id(value)}
            _check_plain(item, depth + 1, seen)


def _refuse_tag(decoder: Any, tag: Any) -> Any:
    raise MalformedFrame(f"CBOR semantic tag {tag.tag} is not allowed")


def _splice_hook(number: int, resolve: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def hook(tag: Any, immutable: Any = False) -> Any:  # cbor2 6: (CBORTag, immutable)
        if tag.tag == number:
            try:
                return resolve(tag)
            except ValueError:
                pass
        raise MalformedFrame(f"CBOR semantic tag {tag.tag} is not allowed")

    return hook


def _refuse_known_tag(tag: int) -> Any:
    if tag in (2, 3):
        text = f"bignum (CBOR tag {tag}) is not allowed: integers here fit 64 bits"
    else:
        text = f"CBOR semantic tag {tag} is not allowed"

    def refuse(value: Any, immutable: bool = False) -> Any:
        raise MalformedFrame(text)

    return refuse


def _bignum(tag: int) -> Any:
    """Decoder of tag 2 (``tag == 2``, ``n``) or 3 (``-1 - n``); magnitude size checked first."""

    def decode(value: Any, immutable: bool = False) -> int:
        if type(value) is not bytes:
            raise MalformedFrame(f"bignum tag {tag} must hold a byte string")
        if len(value) > MAX_BIGNUM_BYTES:
            raise MalformedFrame(
                f"bignum of {len(value)} bytes (tag {tag}); at most {MAX_BIGNUM_BYTES} allowed"
            )
        magnitude = int.from_bytes(value, "big")
        return magnitude if tag == 2 else -1 - magnitude

    return decode


# Every semantic tag cbor2 decodes itself (cbor2 6.x); the others reach the tag hook. A tag that
# a later cbor2 adds decodes to a type the plain walk refuses, so this list is an economy (no
# work on tags plain data never holds), not the only line of defence.
_CBOR2_KNOWN_TAGS = (
    0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261, 1004, 43000,
    55799,
)  # fmt: skip
_BIGNUM_DECODERS: dict[int, Any] = {2: _bignum(2), 3: _bignum(3)}
_NO_BIGNUM_DECODERS: dict[int, Any] = {2: _refuse_known_tag(2), 3: _refuse_known_tag(3)}
_PLAIN_DECODERS: dict[int, Any] = {
    **{tag: _refuse_known_tag(tag) for tag in _CBOR2_KNOWN_TAGS},
    **_BIGNUM_DECODERS,
}
_PLAIN_NO_BIGNUM_DECODERS: dict[int, Any] = {
    tag: _refuse_known_tag(tag) for tag in _CBOR2_KNOWN_TAGS
}
