"""Large byte strings spliced into envelopes part by part, never copied whole in one loop turn.

Theory of operation
-------------------
A body sent in parts (:mod:`garcon_link.rpc.chunks`) would otherwise cost whole-value copies in
one loop turn on each side: ``cbor2.dumps`` copies an 8 MiB argument into the encoded envelope
before the first part leaves, and the receiver joins the parts into one buffer and decodes it,
copying the value once more. Each is milliseconds of page faults and ``memcpy`` during which no
small call on the session is served. Here both ends work a part at a time instead; the bytes on
the wire are exactly those of the whole envelope, so a peer that joins and decodes reads them
unchanged.

* **Sending** (:func:`encode_envelope`): ``bytes`` values (not ``bytearray``: another task
  could change one while its parts go out) of at least ``threshold`` bytes among an envelope's
  values -- the arguments and keyword arguments of a call or a notification (and the elements
  of a list or the values of a map among them), a result or a stream item (and the same one
  level inside it); at most :data:`MAX_SCAN` elements of each container are looked at -- are
  replaced by a marker before encoding. The encoder writes each one's CBOR head and a
  per-process random marker; the result is a :class:`Spliced` body: the encoded pieces around
  each value and the value itself, never joined. :class:`~garcon_link.rpc.chunks.ChunkSender`
  cuts parts from it as from one buffer, so each part copies at most its own bytes. Values
  elsewhere, or smaller, are encoded whole.
* **Receiving** (:class:`Splicer`): the reassembler hands each part's chunk to a flat scan of
  the CBOR heads it holds (an item is a head, then its bytes for a string; arrays, maps and
  tags are heads followed by their items, so no nesting is tracked). A byte string of at least
  :data:`SPLICE_BYTES` is not kept in the body: its declared length is checked against what the
  transfer may still hold, a zero-filled ``bytes`` object of that length is allocated (``calloc``:
  no page touched yet) and each part's share is written into it through an
  :class:`io.BytesIO` that owns it alone, so the value is filled a part at a time and handed
  over without a copy (``getvalue`` of a buffer written to its exact end returns the object
  itself in CPython). The body keeps a placeholder instead: a private tag around
  ``[index, nonce]``, the nonce a random number of this splicer's that never leaves the
  process, so a peer cannot forge a placeholder (a tag of the same number with any other
  content is refused like every other tag). At the final part only the small rest of the body
  is joined and decoded; :func:`garcon_link.core.wire.decode_item` resolves each placeholder to
  its value.
* **Bounded.** The scan reads at most :data:`MAX_HEADS` heads per transfer and stops at an
  indefinite length; the rest of such a body is kept verbatim and decoded as a whole, as an
  unspliced body is, so a body of many small items costs the scan no more than a bounded amount
  of Python work.
  Declared lengths are checked before anything is allocated: a transfer still holds at most
  ``max_frame_bytes`` in all.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Sequence
from typing import Any

import cbor2

__all__ = [
    "MAX_HEADS",
    "MAX_SCAN",
    "SPLICE_BYTES",
    "SPLICE_TAG",
    "Spliced",
    "SpliceOverrun",
    "Splicer",
    "encode_envelope",
    "holds_large",
]

SPLICE_BYTES = 64 * 1024
"""A received byte string at least this long is filled part by part (:class:`Splicer`)."""

MAX_SCAN = 64
"""The most elements of one list or map :func:`encode_envelope` looks at for large values."""

MAX_HEADS = 1024
"""The most CBOR heads :class:`Splicer` reads in one transfer; the rest is kept verbatim."""

SPLICE_TAG = 0x676C6E6B
"""The private tag of a placeholder in a received body (never sent; see the module docstring)."""

_MARKER = os.urandom(16)
"""What the encoder writes where a spliced value goes (random per process; checked by count)."""


class _Big:
    """A large value standing in an envelope while it is encoded."""

    __slots__ = ("value",)

    def __init__(self, value: bytes) -> None:
        self.value = value


class Spliced:
    """An encoded envelope body as pieces, never joined: the encoded bytes around each large
    value and the value itself. ``len()`` is the length of the whole."""

    __slots__ = ("_size", "pieces")

    def __init__(self, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
        self.pieces = tuple(pieces)
        self._size = sum(len(piece) for piece in self.pieces)

    def __len__(self) -> int:
        return self._size

    def joined(self) -> bytes:
        """The whole body in one buffer (a copy: for tests and whole sends)."""
        return b"".join(self.pieces)


def _swap(value: Any, threshold: int, found: list[bytes], depth: int) -> Any:
    """``value`` with its large byte strings (down to ``depth`` containers) replaced by
    :class:`_Big` markers, appended to ``found`` in encoding order; containers on the way are
    copied, never changed. Every call's arguments pass here: scalars cost one type check."""
    kind = type(value)
    if kind is bytes:  # not bytearray: a caller's task could change it while parts go out
        if len(value) >= threshold:
            found.append(value)
            return _Big(value)
        return value
    if kind is not list and kind is not dict:
        return value
    if not depth or len(value) > MAX_SCAN:
        return value
    copy: Any = None
    deeper = depth - 1
    items = enumerate(value) if kind is list else value.items()
    for key, item in items:
        inner = type(item)
        if inner is bytes:
            if len(item) < threshold:
                continue
        elif not deeper or (inner is not list and inner is not dict):
            continue
        new = _swap(item, threshold, found, deeper)
        if new is not item:
            if copy is None:
                copy = list(value) if kind is list else dict(value)
            copy[key] = new
    return value if copy is None else copy


def holds_large(value: Any, threshold: int, depth: int) -> bool:
    """Whether :func:`encode_envelope` would splice something out of ``value`` (the same walk,
    nothing built): the check every call, result and item pays, so it stays one loop."""
    kind = type(value)
    if kind is bytes:
        return len(value) >= threshold
    if (kind is not list and kind is not dict) or not depth or len(value) > MAX_SCAN:
        return False
    for item in value if kind is list else value.values():
        inner = type(item)
        if inner is bytes:
            if len(item) >= threshold:
                return True
        elif (
            (inner is list or inner is dict)
            and depth > 1
            and holds_large(item, threshold, depth - 1)
        ):
            return True
    return False


def _write_marker(encoder: Any, big: Any) -> None:
    if type(big) is not _Big:
        raise TypeError(f"cannot encode a value of type {type(big).__name__}")
    encoder.encode_length(2, len(big.value))
    encoder.write(_MARKER)


def encode_envelope(
    envelope: list[Any], values: range, threshold: int, depth: int = 1
) -> bytes | Spliced:
    """``cbor2.dumps(envelope)``, as a :class:`Spliced` body when the values at ``values`` (indexes
    into ``envelope``) hold byte strings of at least ``threshold`` bytes (module docstring),
    else as bytes. ``depth``: how many containers deep, from such a value, byte strings are
    looked for (2 for a call's argument list and keyword map: their values and one level
    into each). ``threshold`` 0: always bytes.

    Raises:
        TypeError, ValueError, cbor2.CBOREncodeError: a value that does not encode.
    """
    if threshold:
        found: list[bytes] = []
        swapped: list[Any] | None = None
        for index in values:
            if index < len(envelope):
                value = envelope[index]
                new = _swap(value, threshold, found, depth)
                if new is not value:
                    if swapped is None:
                        swapped = list(envelope)
                    swapped[index] = new
        if swapped is not None:
            skeleton = cbor2.dumps(swapped, default=_write_marker)
            pieces: list[bytes | bytearray | memoryview] = []
            view = memoryview(skeleton)
            start = 0
            for big in found:
                at = skeleton.find(_MARKER, start)
                if at < 0:
                    break
                pieces += (view[start:at], big)
                start = at + len(_MARKER)
            else:
                if skeleton.find(_MARKER, start) < 0:
                    pieces.append(view[start:])
                    return Spliced(pieces)
            # The marker occurred in the data itself (random 16 bytes: never in practice).
    return cbor2.dumps(envelope)


class SpliceOverrun(Exception):
    """A byte string declared longer than the transfer may still hold."""


_SCAN, _KEEP, _FILL, _OPAQUE = range(4)


class Splicer:
    """The receiving side's flat scan of one transfer's body (module docstring).

    :meth:`take` splits each chunk into what the body keeps (returned, views of the chunk) and
    what goes into large values; :meth:`finish` returns the values at the final part.

    Args:
        room: how many bytes the whole body may hold (checked against declared lengths).
    """

    __slots__ = (
        "_carry",
        "_fill",
        "_heads",
        "_mode",
        "_remaining",
        "_room",
        "nonce",
        "values",
    )

    def __init__(self, room: int) -> None:
        self._room = room
        self._mode = _SCAN
        self._remaining = 0  # bytes left of the string kept or filled
        self._carry = b""  # the start of a head cut by the end of a chunk
        self._fill: io.BytesIO | None = None
        self._heads = 0
        self.nonce = secrets.randbits(63)
        self.values: list[bytes] = []

    def take(self, chunk: bytes | memoryview, received: int) -> list[bytes | memoryview]:
        """The pieces of ``chunk`` the body keeps, in order (placeholders for what went into
        large values). ``received``: body bytes of the transfer before this chunk.

        Raises:
            SpliceOverrun: a string declared longer than the transfer may still hold.
        """
        view = memoryview(chunk)
        end = len(view)
        keep: list[bytes | memoryview] = []
        pos = 0
        while pos < end:
            mode = self._mode
            if mode == _OPAQUE:
                keep.append(view[pos:])
                break
            if mode in (_KEEP, _FILL):
                size = min(self._remaining, end - pos)
                if mode == _KEEP:
                    keep.append(view[pos : pos + size])
                else:
                    assert self._fill is not None
                    self._fill.write(view[pos : pos + size])
                self._remaining -= size
                pos += size
                if not self._remaining:
                    if mode == _FILL:
                        self._finish_value()
                    self._mode = _SCAN
                continue
            # _SCAN: one head, perhaps begun in the previous chunk.
            start = pos
            head = self._carry + bytes(view[pos : pos + 9 - len(self._carry)])
            initial = head[0]
            info = initial & 0x1F
            width = 0 if info < 24 else 1 << (info - 24) if info < 28 else -1
            self._heads += 1
            if width < 0 or self._heads > MAX_HEADS:
                # An indefinite length, a reserved head (cbor2 refuses it later) or a long
                # scan: the rest of the body is kept as it comes.
                keep.append(view[pos:] if not self._carry else self._carry + bytes(view[pos:]))
                self._carry = b""
                self._mode = _OPAQUE
                break
            if len(head) < 1 + width:  # the head goes on in the next chunk
                self._carry = head
                break
            used = 1 + width - len(self._carry)
            carried, self._carry = self._carry, b""
            value = info if not width else int.from_bytes(head[1 : 1 + width], "big")
            pos += used
            major = initial >> 5
            if major == 2 and value >= SPLICE_BYTES:
                if received + pos + value > self._room:
                    raise SpliceOverrun(f"a byte string of {value} bytes exceeds the transfer")
                # The object is filled in place: the BytesIO is its only owner until
                # getvalue() hands it over (no copy once written to its end).
                self._fill = io.BytesIO(bytes(value))
                self._remaining = value
                self._mode = _FILL
                keep.append(self._placeholder(len(self.values)))
                self.values.append(b"")  # its slot, filled at its end
                continue
            keep.append(carried + bytes(view[start:pos]) if carried else view[start:pos])
            if major in (2, 3) and value:
                self._remaining = value
                self._mode = _KEEP
        return keep

    def _placeholder(self, index: int) -> bytes:
        return cbor2.dumps(cbor2.CBORTag(SPLICE_TAG, [index, self.nonce]))

    def _finish_value(self) -> None:
        fill, self._fill = self._fill, None
        assert fill is not None
        self.values[-1] = fill.getvalue()

    @property
    def complete(self) -> bool:
        """Whether no value is being filled (a body ending inside one is truncated)."""
        return self._mode != _FILL and not self._carry

    def resolve(self, tag: cbor2.CBORTag) -> bytes:
        """The value a placeholder stands for (``decode_item``'s splice hook).

        Raises:
            ValueError: not one of this splicer's placeholders.
        """
        content = tag.value
        if (
            type(content) in (list, tuple)  # cbor2 decodes a tag's array as a tuple
            and len(content) == 2
            and type(content[0]) is int
            and type(content[1]) is int
            and content[1] == self.nonce
            and 0 <= content[0] < len(self.values)
        ):
            return self.values[content[0]]
        raise ValueError("not a placeholder")
