"""The RPC envelopes: one frozen struct per kind, encoded and decoded here only.

An envelope is a CBOR array inside a session message body, tagged by a small integer (the wire
format; see :mod:`garcon_link.rpc.rpc` for what each kind means)::

    call         [0, id, service, method, args, kwargs, credit_items, credit_bytes]
                 [0, id, service, method, args, kwargs, credit_items, credit_bytes, key]
                 [0, id, service, method, args, kwargs, credit_items, credit_bytes, key, metadata]
    result       [1, id, value]
    error        [2, id, {outcome, code, message, remote_type?, traceback?, details?, cancel?}]
    cancel       [3, id]
    notify       [4, service, method, args, kwargs]
                 [4, service, method, args, kwargs, metadata]
    stream_item  [5, id, value]
    stream_end   [6, id]
    credit       [7, id, items, bytes]
    part         [8, flags, chunk]          flags: 0 more, 1 final, 2 abort
                 [8, flags, transfer, chunk]

A ``part`` carries a slice of a body longer than ``Limits.bulk_chunk_bytes`` (any of the kinds
above, encoded); the receiver concatenates the chunks of one transfer and decodes the whole at
its final part. ``transfer`` (an unsigned integer) names the transfer a part belongs to, so
several transfers in one direction interleave; it is sent only to a peer that said it reads it
(the internal notification ``$link.parts``), and a part without it continues the one transfer
without an id in progress (:mod:`garcon_link.rpc.chunks`, which sends and checks parts). Only
such bodies are sent in parts: every other envelope is encoded whole.

*Call metadata* is optional on the wire: a map of text
to text (:func:`garcon_link.rpc.hooks.call_metadata`) as the tenth element of ``call`` (``key`` is
then ``null`` for an unkeyed call) and the sixth of ``notify``, sent only when non-empty, so a call
without metadata has no tenth element. A peer that does not know metadata drops such an envelope
as malformed (the caller's call then ends at its timeout).

:func:`decode` checks only the *shape* (the arity and that an id is an integer): an envelope of
the wrong shape raises :class:`BadEnvelope`, naming the call id when it has one (so the receiver
can fail the call of ours it names). The *contents* of a well-shaped ``call`` (argument types,
credit, key, metadata) are the receiver's to check, as they are refused with a reply rather than
dropped; :func:`metadata_problem` is that check for metadata. Nothing here allocates more than
the decoded item already holds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, overload

import cbor2
import msgspec

from ..core.wire import array_prefix, encode_head
from ..logs import peer_text
from .splice import Spliced, encode_envelope, holds_large

__all__ = [
    "CALL",
    "CANCEL",
    "CREDIT",
    "END",
    "ERROR",
    "ITEM",
    "NOTIFY",
    "PART",
    "RESULT",
    "BadEnvelope",
    "Call",
    "Cancel",
    "Credit",
    "End",
    "Envelope",
    "Error",
    "Item",
    "Notify",
    "Part",
    "Result",
    "Whole",
    "decode",
    "encode",
    "encode_call",
    "encode_relayed_call",
    "encode_relayed_notify",
    "encode_item",
    "encode_part",
    "encode_reply",
    "encode_result",
    "renumbered_call_head",
    "envelope_head",
    "metadata_problem",
]

CALL, RESULT, ERROR, CANCEL, NOTIFY, ITEM, END, CREDIT, PART = range(9)
REPLY_KINDS = frozenset((RESULT, ERROR, ITEM, END))
"""Kinds that name one of *our* calls."""
MAX_ARITY = 10
"""The longest envelope (a ``call`` with key and metadata)."""

_METADATA_KEY = re.compile(r"[a-z0-9._-]{1,64}")


class Call(msgspec.Struct, frozen=True):
    id: int
    service: Any
    method: Any
    args: Any
    kwargs: Any
    credit_items: Any
    credit_bytes: Any
    key: Any = None
    metadata: Any = None

    def wire(self) -> list[Any]:
        envelope = [
            CALL,
            self.id,
            self.service,
            self.method,
            self.args,
            self.kwargs,
            self.credit_items,
            self.credit_bytes,
        ]
        if self.metadata:
            envelope += (self.key, self.metadata)
        elif self.key is not None:
            envelope.append(self.key)
        return envelope


class Result(msgspec.Struct, frozen=True):
    id: int
    value: Any

    def wire(self) -> list[Any]:
        return [RESULT, self.id, self.value]


class Error(msgspec.Struct, frozen=True):
    id: int
    body: Any  # a map when well formed; errorbody.error_from_body reads it strictly

    def wire(self) -> list[Any]:
        return [ERROR, self.id, self.body]


class Cancel(msgspec.Struct, frozen=True):
    id: int

    def wire(self) -> list[Any]:
        return [CANCEL, self.id]


class Notify(msgspec.Struct, frozen=True):
    service: Any
    method: Any
    args: Any
    kwargs: Any
    metadata: Any = None

    def wire(self) -> list[Any]:
        envelope = [NOTIFY, self.service, self.method, self.args, self.kwargs]
        if self.metadata:
            envelope.append(self.metadata)
        return envelope


class Item(msgspec.Struct, frozen=True):
    id: int
    value: Any

    def wire(self) -> list[Any]:
        return [ITEM, self.id, self.value]


class End(msgspec.Struct, frozen=True):
    id: int

    def wire(self) -> list[Any]:
        return [END, self.id]


class Credit(msgspec.Struct, frozen=True):
    id: int
    items: int
    bytes: int

    def wire(self) -> list[Any]:
        return [CREDIT, self.id, self.items, self.bytes]


class Part(msgspec.Struct, frozen=True):
    flags: Any  # checked by chunks.Transfers (as are the chunk's type and size, and transfer)
    chunk: Any
    transfer: Any = None  # None: a part of the transfer without an id

    def wire(self) -> list[Any]:
        if self.transfer is None:
            return [PART, self.flags, self.chunk]
        return [PART, self.flags, self.transfer, self.chunk]


Whole = Call | Result | Error | Cancel | Notify | Item | End | Credit
"""Every kind but ``part``: what a body sent in parts is, once reassembled (parts do not nest)."""
Envelope = Whole | Part


class BadEnvelope(Exception):
    """An envelope of the wrong shape; ``call_id`` is the id it names, if any."""

    def __init__(self, kind: int | None, message: str, call_id: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.call_id = call_id


def encode(envelope: Envelope) -> bytes:
    """The envelope's CBOR bytes.

    Raises:
        TypeError, ValueError, cbor2.CBOREncodeError: a value that does not encode.
    """
    return cbor2.dumps(envelope.wire())


# The hot paths (a call, its result, a stream item, a part, a recorded reply) skip building the
# envelope on the sending side; each is the exact bytes of ``encode`` of its envelope
# (tests/test_envelopes.py checks it for ids at every CBOR head width).
# The kinds are ``msgspec.Struct``\ s, not frozen dataclasses: as immutable and slotted, but built
# in C -- on an idle machine an ``Item`` in 85 ns instead of 424 ns and a ``Call`` in 175 ns
# instead of 1,377 ns, which the receiving side pays for every envelope.


@overload
def encode_call(
    call_id: int,
    service: str,
    method: str,
    args: Any,
    kwargs: Any,
    credit_items: int,
    credit_bytes: int,
    key: bytes | None,
    metadata: Mapping[str, str] | None,
) -> bytes: ...
@overload
def encode_call(
    call_id: int,
    service: str,
    method: str,
    args: Any,
    kwargs: Any,
    credit_items: int,
    credit_bytes: int,
    key: bytes | None,
    metadata: Mapping[str, str] | None,
    *,
    splice: int,
) -> bytes | Spliced: ...
def encode_call(
    call_id: int,
    service: str,
    method: str,
    args: Any,
    kwargs: Any,
    credit_items: int,
    credit_bytes: int,
    key: bytes | None,
    metadata: Mapping[str, str] | None,
    *,
    splice: int = 0,
) -> bytes | Spliced:
    """``encode(Call(...))`` without building the ``Call``; with ``splice``, byte strings of
    at least that many bytes among the arguments are spliced in, not copied
    (:func:`~garcon_link.rpc.splice.encode_envelope`)."""
    if splice and (holds_large(args, splice, 2) or (kwargs and holds_large(kwargs, splice, 2))):
        envelope = [CALL, call_id, service, method, args, kwargs, credit_items, credit_bytes]
        if metadata:
            envelope += (key, metadata)
        elif key is not None:
            envelope.append(key)
        return encode_envelope(envelope, _CALL_VALUES, splice, 2)
    # Framed by hand around the values (cbor2 pays more for each array it encodes than for
    # the values in it): the same bytes as cbor2.dumps of the envelope, as each element of
    # an array is encoded as it would be alone.
    names = _NAMES.get((service, method)) or _names(service, method)
    if metadata:
        arity, tail = b"\x8a\x00", cbor2.dumps(key) + cbor2.dumps(metadata)
    elif key is not None:
        arity, tail = b"\x89\x00", cbor2.dumps(key)
    else:
        arity, tail = b"\x88\x00", b""
    return b"".join(
        (
            arity,
            cbor2.dumps(call_id),
            names,
            b"\x81" + cbor2.dumps(args[0])
            if type(args) is list and len(args) == 1
            else cbor2.dumps(args),
            b"\xa0" if type(kwargs) is dict and not kwargs else cbor2.dumps(kwargs),
            b"\x00\x00"
            if credit_items == 0 and credit_bytes == 0
            else cbor2.dumps(credit_items) + cbor2.dumps(credit_bytes),
            tail,
        )
    )


_NAMES: dict[tuple[str, str], bytes] = {}
"""The encoded service and method names of the calls made so far (at most ``_MAX_NAMES``)."""
_MAX_NAMES = 1024


def _names(service: str, method: str) -> bytes:
    """``service`` and ``method`` encoded back to back, kept in ``_NAMES`` (emptied when
    full): the calls' side of a miss, the hit being one ``dict.get`` where they are used."""
    names = cbor2.dumps(service) + cbor2.dumps(method)
    if len(_NAMES) >= _MAX_NAMES:
        _NAMES.clear()
    _NAMES[service, method] = names
    return names


def encode_relayed_call(
    call_id: int,
    service: str,
    method: str,
    arguments: bytes,
    key: bytes | None,
    metadata: Mapping[str, str] | bytes | None,
    credit: tuple[int, int] = (0, 0),
) -> bytes:
    """``encode_call(...)`` of a call whose ``args`` and ``kwargs`` are already encoded:
    ``arguments`` is their two CBOR items back to back, framed by
    :func:`~garcon_link.core.wire.argument_items` (a relay forwards them without decoding).
    ``metadata``: a map, or one map's encoding (a relay's, checked as it arrived)."""
    # Written by hand (what cbor2.dumps of the call would write, heads in shortest form): it
    # is on every relayed call's path, and only the key and metadata need an encoder.
    names = _NAMES.get((service, method)) or _names(service, method)
    if metadata:
        encoded = metadata if type(metadata) is bytes else cbor2.dumps(metadata)
        arity, tail = b"\x8a\x00", cbor2.dumps(key) + encoded
    elif key is not None:
        arity, tail = b"\x89\x00", cbor2.dumps(key)
    else:
        arity, tail = b"\x88\x00", b""
    return b"".join(
        (
            arity,
            encode_head(0, call_id),
            names,
            arguments,
            b"\x00\x00"
            if credit == (0, 0)
            else encode_head(0, credit[0]) + encode_head(0, credit[1]),
            tail,
        )
    )


def encode_relayed_notify(
    service: str, method: str, arguments: bytes, metadata: Mapping[str, str] | None
) -> bytes:
    """``encode(Notify(...))`` with ``args`` and ``kwargs`` already encoded (as
    :func:`encode_relayed_call`)."""
    head = cbor2.dumps([NOTIFY, service, method])  # 0x83 and three items
    tail = cbor2.dumps(metadata) if metadata else b""
    return b"".join((bytes((0x85 if not metadata else 0x86,)), head[1:], arguments, tail))


@overload
def encode_result(call_id: int, value: Any) -> bytes: ...
@overload
def encode_result(call_id: int, value: Any, *, splice: int) -> bytes | Spliced: ...
def encode_result(call_id: int, value: Any, *, splice: int = 0) -> bytes | Spliced:
    """``encode(Result(call_id, value))`` without building the ``Result`` (``splice``: as for
    :func:`encode_call`)."""
    if splice and holds_large(value, splice, 1):
        return encode_envelope([RESULT, call_id, value], _VALUE, splice)
    return b"".join((b"\x83\x01", cbor2.dumps(call_id), cbor2.dumps(value)))  # as encode_call


@overload
def encode_item(call_id: int, value: Any) -> bytes: ...
@overload
def encode_item(call_id: int, value: Any, *, splice: int) -> bytes | Spliced: ...
def encode_item(call_id: int, value: Any, *, splice: int = 0) -> bytes | Spliced:
    """``encode(Item(call_id, value))`` without building the ``Item`` (``splice``: as for
    :func:`encode_call`)."""
    if splice and holds_large(value, splice, 1):
        return encode_envelope([ITEM, call_id, value], _VALUE, splice)
    return b"".join((b"\x83\x05", cbor2.dumps(call_id), cbor2.dumps(value)))  # as encode_call


_CALL_VALUES = range(4, 6)  # a call's args and kwargs
_VALUE = range(2, 3)  # a result's or an item's value


def encode_part(flags: int, chunk: bytes | memoryview, transfer: int | None = None) -> bytes:
    """``encode(Part(flags, chunk, transfer))`` in one copy of ``chunk`` (``flags`` is 0..23, as
    :mod:`garcon_link.rpc.chunks` sends them; ``transfer`` an unsigned integer or ``None``)."""
    if transfer is None:
        return b"".join((bytes((0x83, PART, flags)), encode_head(2, len(chunk)), chunk))
    head = bytes((0x84, PART, flags)) + encode_head(0, transfer) + encode_head(2, len(chunk))
    return b"".join((head, chunk))


def encode_reply(kind: int, call_id: int, body: bytes) -> bytes:
    """``[kind, call_id, <body>]`` with ``body`` already CBOR (a recorded ``result`` or ``error``
    replayed): ``encode(Result(call_id, cbor2.loads(body)))`` for ``kind`` RESULT, and so for
    ERROR. ``call_id`` is any integer a peer's ``call`` named."""
    return b"\x83" + cbor2.dumps(kind) + cbor2.dumps(call_id) + body


def renumbered_call_head(body: bytes, old_id: int, new_id: int) -> tuple[bytes, int]:
    """The bytes that replace the start of ``body`` (an encoded ``call`` naming ``old_id``, an
    unsigned id as :func:`encode_call` writes it) so that it names ``new_id``, and how many bytes
    they replace: a one-byte array head (at most ``MAX_ARITY`` items), the kind, then the id."""
    assert body[0] & 0xE0 == 0x80 and body[1] == CALL
    return body[:2] + encode_head(0, new_id), 2 + len(encode_head(0, old_id))


def decode(item: object) -> Envelope:
    """The typed envelope for a decoded CBOR item (shape checks only; module docstring).

    Raises:
        BadEnvelope: not ``[kind, ...]``, an unknown kind, or the wrong arity or id type.
    """
    if type(item) is not list or not item or type(item[0]) is not int:
        raise BadEnvelope(None, "not [kind, ...]")
    kind, n = item[0], len(item)
    named = item[1] if n > 1 and type(item[1]) is int else None
    # The kinds of the hot paths first (a stream item, a result, a call), then the rest.
    if named is not None:
        if n == 3:
            if kind == ITEM:
                return Item(named, item[2])
            if kind == RESULT:
                return Result(named, item[2])
        elif kind == CALL and 8 <= n <= MAX_ARITY:
            return Call(named, *item[2:])
    match kind:
        case 1 if n == 3 and named is not None:
            return Result(named, item[2])
        case 5 if n == 3 and named is not None:
            return Item(named, item[2])
        case 0 if 8 <= n <= MAX_ARITY and named is not None:
            return Call(named, *item[2:])
        case 2 if n == 3 and named is not None:
            return Error(named, item[2])
        case 6 if n == 2 and named is not None:
            return End(named)
        case 7 if n == 4 and type(item[2]) is int and type(item[3]) is int and named is not None:
            return Credit(named, item[2], item[3])
        case 3 if n == 2 and named is not None:
            return Cancel(named)
        case 4 if n == 5 or n == 6:
            return Notify(*item[1:])
        case 8 if n == 3:
            return Part(item[1], item[2])
        case 8 if n == 4 and item[2] is not None:  # None is no id: a three-element part
            return Part(item[1], item[3], item[2])
    if not CALL <= kind <= PART:
        raise BadEnvelope(kind, f"unknown kind {peer_text(kind)}")
    raise BadEnvelope(kind, f"kind {kind} with {n} elements is malformed", named)


def envelope_head(payload: bytes) -> tuple[int, int] | None:
    """``(kind, id)`` read from the first bytes of an envelope that did not decode as a whole.

    Only the exact prefix every envelope naming a call starts with is accepted: a definite array
    head of 2 to ``MAX_ARITY`` items, a kind of 0..7 and an unsigned integer id. This lets an
    undecodable *reply* (e.g. a result whose value holds a tag) fail the call it names at once
    instead of leaving it to its timeout.
    """
    prefix = array_prefix(payload)
    if prefix is None:
        return None
    length, kind, call_id = prefix
    if not 2 <= length <= MAX_ARITY or kind > CREDIT:
        return None
    return kind, call_id


def byte_string_at(data: bytes, start: int) -> bytes | None:
    """The byte string whose head is at ``start`` and whose end is ``data``'s, as decoding it
    would read it; ``None`` for anything else (another item, an indefinite length, bytes
    before or after): decode that."""
    initial = data[start]
    if 0x40 <= initial < 0x58:
        begin, size = start + 1, initial - 0x40
    elif 0x58 <= initial <= 0x5B:
        begin = start + 1 + (1 << (initial - 0x58))
        size = int.from_bytes(data[start + 1 : begin], "big")
    else:
        return None
    return data[begin:] if begin + size == len(data) else None


_SCALAR_SIZES = {0xF4: 1, 0xF5: 1, 0xF6: 1, 0xF9: 3, 0xFA: 5, 0xFB: 9}
"""false, true, null and the three floats: their encoded sizes."""


def plain_scalar(data: bytes) -> bool:
    """Whether ``data`` is, exactly, one item that every decoder of ours reads as plain data
    without building a container: an integer (a head of at most 64 bits), a definite byte
    string, definite UTF-8 text, a float, false, true or null. ``False`` says nothing either
    way (a container, a tag, anything else): decode it."""
    end = len(data)
    if not end:
        return False
    initial = data[0]
    major, info = initial >> 5, initial & 0x1F
    if major == 7:
        return _SCALAR_SIZES.get(initial) == end
    if info < 24:
        begin, value = 1, info
    elif info < 28:
        begin = 1 + (1 << (info - 24))
        value = int.from_bytes(data[1:begin], "big")
    else:
        return False
    if major < 2:
        return begin == end
    if major == 2:
        return begin + value == end
    if major == 3 and begin + value == end:
        try:
            data[begin:].decode()
        except UnicodeDecodeError:
            return False
        return True
    return False


def metadata_problem(metadata: object, max_entries: int, max_bytes: int) -> str | None:
    """Why ``metadata`` is not acceptable call metadata, or ``None`` (:mod:`garcon_link.rpc.hooks`).

    A map of at most ``max_entries`` entries, keys 1-64 characters of ``[a-z0-9._-]``, text
    values (that encode as UTF-8: no lone surrogate), and at most ``max_bytes`` of keys and
    values together (UTF-8). The entry count is checked before anything is iterated, so a peer's
    oversized map costs no more than its size.
    """
    if not isinstance(metadata, Mapping):
        return f"metadata must be a map, not {type(metadata).__name__}"
    if len(metadata) > max_entries:
        return f"metadata has {len(metadata)} entries (at most {max_entries})"
    size = 0
    for key, value in metadata.items():
        if type(key) is not str:
            return f"metadata key is a {type(key).__name__}, not text"
        if not _METADATA_KEY.fullmatch(key):
            return f"metadata key {peer_text(key)} is not 1-64 characters of [a-z0-9._-]"
        if type(value) is not str:
            return f"metadata value of {peer_text(key)} is a {type(value).__name__}, not text"
        try:
            size += len(key) + len(value.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no UTF-8 text, so no CBOR text either
            return f"metadata value of {peer_text(key)} is not UTF-8 text (a lone surrogate)"
        if size > max_bytes:
            return f"metadata exceeds {max_bytes} bytes"
    return None
