"""Tests of garcon_link.rpc.envelopes: round trips, the decoder's shape checks, and that every
encoder writes exactly the canonical CBOR of its envelope (no sockets)."""

from __future__ import annotations

import itertools
from typing import Any

import cbor2
import pytest
from cbor_strategies import any_item
from hypothesis import given, settings
from hypothesis import strategies as st

from garcon_link.core.wire import argument_items, decode_item
from garcon_link.errors import MalformedFrame
from garcon_link.rpc.envelopes import (
    CALL,
    CANCEL,
    CREDIT,
    END,
    ERROR,
    ITEM,
    MAX_ARITY,
    NOTIFY,
    PART,
    RESULT,
    BadEnvelope,
    Call,
    Cancel,
    Credit,
    End,
    Envelope,
    Error,
    Item,
    Notify,
    Part,
    Result,
    byte_string_at,
    decode,
    encode,
    encode_call,
    encode_item,
    encode_part,
    encode_relayed_call,
    encode_relayed_notify,
    encode_reply,
    encode_result,
    envelope_head,
    metadata_problem,
    plain_scalar,
    renumbered_call_head,
)

# An id at each edge of every CBOR head width (1, 2, 3, 5 and 9 bytes).
IDS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
# Bodies: empty and large ones of each type an argument or value is commonly.
VALUES: list[Any] = [
    None,
    b"",
    "",
    [],
    {},
    b"x" * 70_000,
    "y" * 300,
    list(range(1000)),
    {"a": 1, "b": [True, None]},
    -(2**63),
]
METADATA: list[dict[str, str] | None] = [None, {}, {"a": "1"}, {"z": "", "trace.id": "t" * 64}]
KEYS: list[bytes | None] = [None, b"k", b"\x00" * 128]


def canonical(wire: list[Any]) -> bytes:
    """The canonical CBOR of ``wire``, checked to be what plain ``cbor2.dumps`` writes too (the
    values in these tables have one encoding: maps are written in canonical key order)."""
    data = cbor2.dumps(wire, canonical=True)
    assert data == cbor2.dumps(wire)
    return data


EVERY_KIND: list[Envelope] = [
    Call(7, "svc", "m", [1], {"k": 2}, 16, 1 << 20),
    Call(7, "svc", "m", [], {}, 0, 0, b"key"),
    Call(7, "svc", "m", [], {}, 0, 0, None, {"a": "b"}),
    Call(7, "svc", "m", [], {}, 0, 0, b"key", {"a": "b"}),
    Result(8, {"x": 1}),
    Error(9, {"code": "X", "message": "m", "outcome": "failed"}),
    Cancel(10),
    Notify("svc", "m", [1], {}),
    Notify("svc", "m", [1], {}, {"a": "b"}),
    Item(11, b"data"),
    End(12),
    Credit(13, 4, 4096),
    Part(1, b"chunk"),
]


@pytest.mark.parametrize("envelope", EVERY_KIND, ids=lambda e: type(e).__name__)
def test_every_kind_round_trips(envelope: Envelope) -> None:
    data = encode(envelope)
    assert data == canonical(envelope.wire())
    assert decode(cbor2.loads(data)) == envelope


def test_encode_call_writes_the_canonical_call() -> None:
    for call_id, value, key, metadata in itertools.product(IDS, VALUES, KEYS, METADATA):
        fields = (call_id, "svc", "method", [value], {"v": value}, 1, 2**32, key, metadata)
        envelope = Call(*fields)
        data = encode_call(*fields)
        assert data == canonical(envelope.wire()) == encode(envelope)
        assert decode(cbor2.loads(data)) == (
            envelope if metadata else Call(*fields[:8])  # empty metadata is not sent
        )


def test_the_result_and_item_fast_paths_write_the_canonical_envelope() -> None:
    for call_id, value in itertools.product(IDS, VALUES):
        assert encode_result(call_id, value) == canonical([RESULT, call_id, value])
        assert encode_result(call_id, value) == encode(Result(call_id, value))
        assert encode_item(call_id, value) == canonical([ITEM, call_id, value])
        assert encode_item(call_id, value) == encode(Item(call_id, value))


@pytest.mark.parametrize("size", [0, 1, 23, 24, 255, 256, 65535, 65536, 70_000])
def test_encode_part_writes_the_canonical_part(size: int) -> None:
    chunk = bytes(range(256)) * (size // 256) + bytes(size % 256)
    for flags in (0, 1, 2):
        expected = canonical([PART, flags, chunk])
        assert encode_part(flags, chunk) == expected == encode(Part(flags, chunk))
        assert encode_part(flags, memoryview(chunk)) == expected
        for transfer in IDS:  # a transfer id at every head width
            expected = canonical([PART, flags, transfer, chunk])
            assert encode_part(flags, chunk, transfer) == expected
            assert expected == encode(Part(flags, chunk, transfer))


def test_encode_reply_writes_the_canonical_reply() -> None:
    # A recorded reply names the id of a peer's call: any integer, even one no caller of ours
    # would pick (negative, or beyond 64 bits).
    for call_id, value in itertools.product([*IDS, -1, -25, 2**64], VALUES):
        body = cbor2.dumps(value)
        assert encode_reply(RESULT, call_id, body) == canonical([RESULT, call_id, value])
        assert encode_reply(ERROR, call_id, body) == canonical([ERROR, call_id, value])


def test_a_renumbered_call_is_the_call_encoded_with_its_new_id() -> None:
    for old, new, metadata in itertools.product(IDS, IDS, METADATA):
        fields: tuple[Any, ...] = ("svc", "m", [b"x" * 300], {}, 1, 2, b"k", metadata)
        body = encode_call(old, *fields)
        head, replaced = renumbered_call_head(body, old, new)
        assert head + body[replaced:] == encode_call(new, *fields)


@pytest.mark.parametrize(
    ("item", "kind", "call_id"),
    [
        (None, None, None),
        (b"\x80", None, None),
        ([], None, None),
        ({"0": 1}, None, None),
        (["0", 1], None, None),
        ([True, 1, 2], None, None),  # a bool is not a kind
        ([9, 1], 9, None),
        ([-1, 1], -1, None),
        ([CALL, 1, "s", "m", [], {}, 0], CALL, 1),  # too short
        ([CALL, 1, "s", "m", [], {}, 0, 0, None, {}, "extra"], CALL, 1),  # too long
        ([CALL, "1", "s", "m", [], {}, 0, 0], CALL, None),  # id not an integer
        ([RESULT, 5], RESULT, 5),
        ([RESULT, 5, 1, 2], RESULT, 5),
        ([RESULT, 5.0, 1], RESULT, None),
        ([RESULT, True, 1], RESULT, None),
        ([ERROR, 6], ERROR, 6),
        ([CANCEL, 7, 0], CANCEL, 7),
        ([CANCEL, None], CANCEL, None),
        ([NOTIFY, "s", "m", []], NOTIFY, None),
        ([NOTIFY, "s", "m", [], {}, {}, 0], NOTIFY, None),
        ([ITEM, 8], ITEM, 8),
        ([ITEM, b"8", 0], ITEM, None),
        ([END, 9, 0], END, 9),
        ([CREDIT, 10, 1], CREDIT, 10),
        ([CREDIT, 10, 1, "2"], CREDIT, 10),
        ([CREDIT, 10, 1.0, 2], CREDIT, 10),
        ([PART, "f"], PART, None),
        ([PART, 1], PART, 1),  # an integer second element is reported whatever the kind
        ([PART, 1, 2, b"", b""], PART, 1),
    ],
)
def test_the_decoder_refuses_a_malformed_envelope(
    item: object, kind: int | None, call_id: int | None
) -> None:
    with pytest.raises(BadEnvelope) as caught:
        decode(item)
    assert (caught.value.kind, caught.value.call_id) == (kind, call_id)


def test_the_decoder_leaves_contents_to_the_receiver() -> None:
    # Only the shape is checked: a call's fields may be anything, a part's flags too.
    call = decode([CALL, 1, 2, 3, 4, 5, "six", None, 8.0, []])
    assert call == Call(1, 2, 3, 4, 5, "six", None, 8.0, [])
    assert decode([PART, "f", 0]) == Part("f", 0)
    assert decode([PART, "f", [1], 0]) == Part("f", 0, [1])  # a transfer id of any type too
    assert decode([NOTIFY, 1, 2, 3, 4]) == Notify(1, 2, 3, 4)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (encode_result(2**64 - 1, b"\xff"), (RESULT, 2**64 - 1)),
        (encode(Error(300, {})), (ERROR, 300)),
        (encode(End(0)), (END, 0)),
        (encode(Credit(1, 2, 3)), (CREDIT, 1)),
        (encode_call(5, "s", "m", [], {}, 0, 0, b"k", {"a": "b"}), (CALL, 5)),
        (encode_part(1, b"x"), None),  # a part names no call
        (cbor2.dumps([RESULT]), None),  # too short
        (cbor2.dumps([CALL, *range(MAX_ARITY)]), None),  # too long
        (cbor2.dumps([RESULT, -1, 0]), None),  # not an unsigned id
        (cbor2.dumps({"a": 1}), None),
        (b"", None),
        (b"\x83", None),
    ],
)
def test_envelope_head_reads_only_the_prefix_of_an_envelope_naming_a_call(
    payload: bytes, expected: tuple[int, int] | None
) -> None:
    assert envelope_head(payload) == expected


@pytest.mark.parametrize(
    ("metadata", "problem"),
    [
        ({}, None),
        ({"a": "b", "x.y_z-0": ""}, None),
        ([], "must be a map"),
        ({"a": "1", "b": "2", "c": "3"}, "3 entries"),
        ({1: "x"}, "key is a int"),
        ({"A": "x"}, "is not 1-64 characters"),
        ({"a" * 65: "x"}, "is not 1-64 characters"),
        ({"a": 1}, "is a int, not text"),
        ({"a": "x" * 40}, "exceeds 32 bytes"),
    ],
)
def test_metadata_problem(metadata: object, problem: str | None) -> None:
    found = metadata_problem(metadata, max_entries=2, max_bytes=32)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


# -- relayed calls: arguments framed, not decoded (a gateway's forward) ---------------------------

_plain = st.recursive(
    st.one_of(
        st.integers(-(2**64) + 1, 2**64 - 1),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.floats(allow_nan=False),
        st.booleans(),
        st.none(),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=200)
@given(
    args=st.lists(_plain, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=6), _plain, max_size=3),
    call_id=st.sampled_from([1, 23, 24, 255, 256, 65536, 2**32, 2**64 - 1]),
    key=st.one_of(st.none(), st.binary(min_size=1, max_size=8)),
    metadata=st.one_of(st.none(), st.just({"trace": "t"})),
    credit=st.sampled_from([(0, 0), (256, 1 << 20)]),
    service=st.sampled_from(["svc", "", "s" * 30, "s\u00e9rvice", "\u670d\u52a1" * 50]),
)
def test_a_relayed_call_is_byte_for_byte_the_call_it_relays(
    args: list[Any],
    kwargs: dict[str, Any],
    call_id: int,
    key: bytes | None,
    metadata: dict[str, str] | None,
    credit: tuple[int, int],
    service: str,
) -> None:
    payload = cbor2.dumps([args, kwargs])
    arguments = argument_items(payload)
    assert arguments == payload[1:]
    relayed = encode_relayed_call(call_id, service, "m", arguments, key, metadata, credit)
    assert relayed == encode_call(call_id, service, "m", args, kwargs, *credit, key, metadata)
    notify = encode_relayed_notify("svc", "m", arguments, metadata)
    assert notify == encode(Notify("svc", "m", args, kwargs, metadata))


@settings(max_examples=300)
@given(data=st.binary(max_size=64))
def test_framing_refuses_anything_else_with_malformed_frame_only(data: bytes) -> None:
    try:
        arguments = argument_items(data)
    except MalformedFrame:
        return
    # Whatever passes is an array then a map, and nothing after them.
    assert data[0] == 0x82 and arguments == data[1:]


@settings(max_examples=300)
@given(first=any_item, second=any_item, extra=st.one_of(st.just(b""), any_item))
def test_hostile_arguments_cannot_change_what_the_relay_writes(
    first: bytes, second: bytes, extra: bytes
) -> None:
    """Whatever a caller puts in its arguments, a relayed call that passes the framing decodes
    (if it decodes at all) as a call with exactly the id, names, credit, key and metadata the
    relay wrote: the arguments cannot spill into the fields after them."""
    payload = b"\x82" + first + second + extra
    try:
        arguments = argument_items(payload)
    except MalformedFrame:
        return
    body = encode_relayed_call(7, "svc", "m", arguments, b"k", {"a": "b"}, (3, 4))
    try:
        envelope = decode(decode_item(body, 1 << 20))
    except (MalformedFrame, BadEnvelope):
        return  # refused by the worker, as any call that does not decode
    assert isinstance(envelope, Call)
    assert (envelope.id, envelope.service, envelope.method) == (7, "svc", "m")
    assert (envelope.credit_items, envelope.credit_bytes) == (3, 4)
    assert (envelope.key, envelope.metadata) == (b"k", {"a": "b"})


def _decodes(data: bytes) -> tuple[bool, object]:
    try:
        return True, decode_item(data, 1 << 20, depth=1)
    except MalformedFrame:
        return False, None


@settings(max_examples=600, deadline=None)
@given(item=any_item, cut=st.integers(0, 3), extra=st.sampled_from([b"", b"\x00", b"\xff"]))
def test_a_plain_scalar_or_byte_string_read_from_its_bytes_decodes_the_same(
    item: bytes, cut: int, extra: bytes
) -> None:
    """What ``plain_scalar`` vouches for decodes, and ``byte_string_at`` reads what the decode
    reads (any item, cut short or with a byte after it)."""
    data = (item[: len(item) - cut] if cut < len(item) else item) + extra
    if not data:
        return
    decodes, value = _decodes(data)
    if plain_scalar(data):
        assert decodes
    taken = byte_string_at(b"\x83\x01\x07" + data, 3)
    if taken is not None:
        assert decodes and value == taken


@pytest.mark.parametrize(
    "data",
    [
        b"\x00",
        b"\x1b" + b"\xff" * 8,
        b"\x38\x10",
        b"\xf4",
        b"\xf6",
        b"\xf9\x7e\x00",
        b"\xfb" + b"\x00" * 8,
        b"\x43abc",
        b"\x59\x00\x01x",
        b"\x62\xc3\xa9",
        b"\x60",
    ],
)
def test_plain_scalars_are_vouched_for(data: bytes) -> None:
    assert plain_scalar(data) and _decodes(data)[0]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x00",
        b"\x1c",
        b"\x5f\x41a\xff",
        b"\x62\xc3",
        b"\x61\xff",
        b"\xf7",
        b"\xf8\x20",
        b"\x80",
        b"\xa0",
        b"\xc2\x41\x01",
        b"\x43ab",
    ],
)
def test_anything_else_is_left_to_the_decoder(data: bytes) -> None:
    assert not plain_scalar(data)
