"""The wire codec: session packets (hand-rolled CBOR) and strict single-item CBOR (cbor2)."""

from __future__ import annotations

import math
import re
import tracemalloc
from typing import Any

import cbor2
import pytest
from cbor_strategies import cbor_values, fuzz_settings
from helpers import encode_packets
from hypothesis import given, settings
from hypothesis import strategies as st

from garcon_link.core import wire
from garcon_link.core.wire import (
    MAX_BIGNUM_BYTES,
    MAX_ORDINAL,
    Message,
    Ordinal,
    Packet,
    Receipt,
    decode_item,
    decode_packets,
    encode_canonical,
    encode_message,
    encode_receipt,
    iter_packets,
)
from garcon_link.errors import FrameTooLarge, MalformedFrame

BIG = 1 << 20

ordinals = st.integers(min_value=1, max_value=MAX_ORDINAL)
throughs = st.integers(min_value=0, max_value=MAX_ORDINAL)
messages = st.builds(Message, ordinals.map(Ordinal), st.binary(max_size=300))
receipts = st.builds(Receipt, throughs)
packets = st.one_of(messages, receipts)


def head(major: int, value: int, width: int | None = None) -> bytes:
    """A CBOR head; ``width`` forces a (possibly non-shortest) argument width of 1/2/4/8 bytes."""
    if width is None:
        width = 0 if value < 24 else next(w for w in (1, 2, 4, 8) if value < 1 << (8 * w))
    if width == 0:
        return bytes([major << 5 | value])
    info = {1: 24, 2: 25, 4: 26, 8: 27}[width]
    return bytes([major << 5 | info]) + value.to_bytes(width, "big")


# -- session packets: round trips ---------------------------------------------------------------


@given(ordinal=ordinals, body=st.binary(max_size=2000))
def test_message_round_trip_and_matches_canonical_cbor(ordinal: int, body: bytes) -> None:
    data = encode_message(ordinal, body)
    assert data == cbor2.dumps([0, ordinal, body], canonical=True)
    assert decode_packets(data, BIG) == [Message(Ordinal(ordinal), body)]


@given(through=throughs)
def test_receipt_round_trip_and_matches_canonical_cbor(through: int) -> None:
    data = encode_receipt(through)
    assert data == cbor2.dumps([1, through], canonical=True)
    assert decode_packets(data, BIG) == [Receipt(through)]


@pytest.mark.parametrize("size", [0, 23, 24, 255, 256, 65535, 65536])
@pytest.mark.parametrize(
    "ordinal", [1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, MAX_ORDINAL]
)
def test_message_head_boundaries(ordinal: int, size: int) -> None:
    body = b"\xa5" * size
    data = encode_message(ordinal, body)
    assert decode_packets(data, BIG) == [Message(Ordinal(ordinal), body)]


@given(sequence=st.lists(packets, min_size=1, max_size=20))
def test_packet_sequence_round_trip(sequence: list[Packet]) -> None:
    data = encode_packets(sequence)
    assert decode_packets(data, BIG) == sequence
    # the same bytes as an RFC 8742 CBOR sequence written by any CBOR implementation
    expected = b"".join(
        cbor2.dumps([0, p.ordinal, p.body] if isinstance(p, Message) else [1, p.through])
        for p in sequence
    )
    assert data == expected


@pytest.mark.parametrize("ordinal", [0, -1, MAX_ORDINAL + 1])
def test_encode_message_refuses_out_of_range_ordinals(ordinal: int) -> None:
    with pytest.raises(ValueError):
        encode_message(ordinal, b"")


@pytest.mark.parametrize("through", [-1, MAX_ORDINAL + 1])
def test_encode_receipt_refuses_out_of_range(through: int) -> None:
    with pytest.raises(ValueError):
        encode_receipt(through)


def test_empty_body_and_receipt_zero() -> None:
    assert encode_message(1, b"") == b"\x83\x00\x01\x40"
    assert encode_receipt(0) == b"\x82\x01\x00"
    assert decode_packets(b"\x83\x00\x01\x40\x82\x01\x00", 7) == [
        Message(Ordinal(1), b""),
        Receipt(0),
    ]


# -- session packets: malformed -----------------------------------------------------------------

MALFORMED: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("not CBOR", b"\xff"),
    ("text frame bytes", b'[0, 1, "hi"]'),
    ("text body", b"\x83\x00\x01\x62hi"),
    ("ordinal 0", b"\x83\x00\x00\x41x"),
    ("negative ordinal", b"\x83\x00\x20\x41x"),
    ("float ordinal", b"\x83\x00\xf9\x3c\x00\x41x"),
    ("bignum ordinal", b"\x83\x00\xc2\x49\x01" + bytes(8) + b"\x41x"),
    ("negative receipt", b"\x82\x01\x20"),
    ("float receipt", b"\x82\x01\xfb" + bytes(8)),
    ("null receipt", b"\x82\x01\xf6"),
    ("bool tag", b"\x82\xf5\x00"),
    ("two-element message", b"\x82\x00\x01"),
    ("three-element receipt", b"\x83\x01\x00\x00"),
    ("one element", b"\x81\x00"),
    ("four elements", b"\x84\x00\x01\x41x\x00"),
    ("empty array", b"\x80"),
    ("unknown tag 2", b"\x82\x02\x01"),
    ("unknown tag 2 with body", b"\x83\x02\x01\x41x"),
    ("negative tag", b"\x82\x20\x01"),
    ("map", b"\xa2\x00\x00\x01\x01"),
    ("semantic tag around packet", b"\xc0\x82\x01\x00"),
    ("self-describe tag", b"\xd9\xd9\xf7\x82\x01\x00"),
    ("bare integer", b"\x00"),
    ("trailing byte after message", encode_message(1, b"x") + b"\x00"),
    ("trailing break after receipt", encode_receipt(1) + b"\xff"),
    ("truncated body", b"\x83\x00\x01\x45x"),
    ("truncated ordinal head", b"\x83\x00\x1a\x00\x00"),
    ("truncated after array head", b"\x83"),
    ("truncated after tag", b"\x83\x00"),
    ("truncated receipt", b"\x82\x01"),
    ("non-shortest ordinal 1-byte", b"\x83\x00\x18\x17\x41x"),
    ("non-shortest ordinal 2-byte", b"\x83\x00\x19\x00\xff\x41x"),
    ("non-shortest ordinal 4-byte", b"\x83\x00\x1a\x00\x00\xff\xff\x41x"),
    ("non-shortest ordinal 8-byte", b"\x83\x00\x1b\x00\x00\x00\x00\xff\xff\xff\xff\x41x"),
    ("non-shortest receipt", b"\x82\x01\x18\x00"),
    ("non-shortest body length", b"\x83\x00\x01\x58\x01x"),
    ("non-shortest array head", b"\x98\x03\x00\x01\x41x"),
    ("indefinite array", b"\x9f\x00\x01\x41x\xff"),
    ("indefinite body", b"\x83\x00\x01\x5f\x41x\xff"),
    ("reserved additional info", b"\x83\x00\x1c\x41x"),
    ("valid then garbage", encode_receipt(0) + b"\xc0"),
]


@pytest.mark.parametrize(("name", "data"), MALFORMED, ids=[name for name, _ in MALFORMED])
def test_malformed_packets_are_refused(name: str, data: bytes) -> None:
    with pytest.raises(MalformedFrame) as info:
        decode_packets(data, BIG)
    assert not isinstance(info.value, FrameTooLarge)


@pytest.mark.parametrize(
    ("width", "value"), [(1, 24), (1, 255), (2, 256), (2, 65535), (4, 65536), (8, 2**32)]
)
def test_shortest_heads_at_each_width_are_accepted(width: int, value: int) -> None:
    data = b"\x83\x00" + head(0, value, width) + b"\x41x"
    assert decode_packets(data, BIG) == [Message(Ordinal(value), b"x")]
    assert decode_packets(b"\x82\x01" + head(0, value, width), BIG) == [Receipt(value)]


def test_size_is_checked_before_decoding() -> None:
    data = encode_message(1, b"x" * 100)
    assert decode_packets(data, len(data)) == [Message(Ordinal(1), b"x" * 100)]
    with pytest.raises(FrameTooLarge) as info:
        decode_packets(data, len(data) - 1)
    assert (info.value.size, info.value.limit) == (len(data), len(data) - 1)
    # garbage over the limit is reported as over-size: nothing was decoded
    with pytest.raises(FrameTooLarge):
        decode_packets(b"\xff" * 10, 9)


# -- session packets: bounds and incremental decoding ---------------------------------------------


def test_packet_count_is_bounded() -> None:
    three = encode_receipt(0) * 3
    assert decode_packets(three, BIG, 3) == [Receipt(0)] * 3
    with pytest.raises(MalformedFrame, match="more than 2 packets in one message"):
        decode_packets(three, BIG, 2)
    assert decode_packets(three, BIG) == [Receipt(0)] * 3  # no bound: a tool reading its own writes


def test_iter_packets_decodes_one_packet_at_a_time() -> None:
    """The decoder does no work ahead of its caller: the packets after a bad one, or after the
    bound, are never decoded, and the bound is hit before packet ``max + 1`` is decoded."""
    data = encode_message(1, b"a") + encode_receipt(0) + b"\xff" + encode_receipt(0)
    packets = iter_packets(data, BIG, 10)
    assert next(packets) == Message(Ordinal(1), b"a")
    assert next(packets) == Receipt(0)
    with pytest.raises(MalformedFrame, match="0xff"):
        next(packets)
    # Five million 3-byte receipts: refused after the first 4, in microseconds.
    hostile = iter_packets(encode_receipt(0) * 5_000_000, 1 << 24, 4)
    assert [next(hostile) for _ in range(4)] == [Receipt(0)] * 4
    with pytest.raises(MalformedFrame, match="more than 4 packets"):
        next(hostile)


def test_iter_packets_checks_size_and_emptiness_at_once() -> None:
    with pytest.raises(FrameTooLarge):
        iter_packets(b"\xff" * 10, 9, 10)  # raised by the call, before any iteration
    with pytest.raises(MalformedFrame, match="empty"):
        iter_packets(b"", 9, 10)


# -- session packets: fuzz ----------------------------------------------------------------------


def check_packets(data: bytes, limit: int) -> None:
    """Only MalformedFrame may escape; what decodes is exactly the canonical encoding."""
    try:
        decoded = decode_packets(data, limit)
    except MalformedFrame:
        return
    assert decoded
    assert encode_packets(decoded) == data  # the decoder accepts one spelling per value


@settings(max_examples=1000)
@given(data=st.binary(max_size=200), limit=st.sampled_from([8, 64, BIG]))
def test_fuzz_decode_packets_random_bytes(data: bytes, limit: int) -> None:
    check_packets(data, limit)


@st.composite
def mutated_packets(draw: st.DrawFn) -> bytes:
    data = bytearray(encode_packets(draw(st.lists(packets, min_size=1, max_size=4))))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        pos = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif op == "insert":
            data.insert(pos, draw(st.integers(min_value=0, max_value=255)))
        elif op == "delete" and data:
            del data[pos]
        else:
            del data[pos:]
    return bytes(data)


@settings(max_examples=1000)
@given(data=mutated_packets())
def test_fuzz_decode_packets_mutated_valid_input(data: bytes) -> None:
    check_packets(data, BIG)


# -- decode_item --------------------------------------------------------------------------------

plain_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
plain_values = st.recursive(
    plain_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)


@given(value=plain_values)
def test_decode_item_round_trips_plain_values(value: Any) -> None:
    data = encode_canonical(value)
    assert decode_item(data, BIG) == value
    assert decode_item(data, BIG, plain=False) == value


def test_decode_item_limits() -> None:
    data = encode_canonical({"t": "hello"})
    assert decode_item(data, len(data)) == {"t": "hello"}
    with pytest.raises(FrameTooLarge):
        decode_item(data, len(data) - 1)
    with pytest.raises(MalformedFrame):
        decode_item(b"", 10)


def tagged(tag: int, value: Any) -> bytes:
    return cbor2.dumps(cbor2.CBORTag(tag, value))


def nested(depth: int, opener: bytes) -> bytes:
    return opener * depth + b"\x00"


ITEM_MALFORMED: list[tuple[str, bytes]] = [
    ("not CBOR", b"\xff"),
    ("trailing byte", b"\x01\x02"),
    ("two items", encode_canonical({"t": "hello"}) + encode_canonical({"t": "proof"})),
    ("truncated map", b"\xa2\x61t"),
    ("bad utf-8", b"\x62\xff\xfe"),
    ("undefined", b"\xf7"),
    ("simple value", b"\xf8\x20"),
    ("lone break", b"\xff"),
    ("unknown tag", tagged(9999, 1)),
    ("tag 0 datetime string", tagged(0, "2020-01-01T00:00:00Z")),
    ("tag 0 bad datetime", tagged(0, "not a date")),
    ("tag 1 epoch datetime", tagged(1, 0)),
    ("tag 1 huge epoch", tagged(1, 1e300)),
    ("tag 4 decimal fraction", tagged(4, [-2, 12345])),
    ("tag 4 huge exponent", tagged(4, [10**30, 1])),
    ("tag 5 bigfloat huge exponent", tagged(5, [10**30, 1])),
    ("tag 28 and 29 cycle", b"\xd8\x1c\x81\xd8\x1d\x00"),
    ("tag 28 cyclic map", b"\xd8\x1c\xa1\x00\xd8\x1d\x00"),
    ("tag 29 dangling", b"\xd8\x1d\x05"),
    ("tag 30 rational", tagged(30, [1, 3])),
    ("tag 30 zero denominator", tagged(30, [1, 0])),
    ("tag 35 regex", tagged(35, "a+")),
    ("tag 35 invalid regex", tagged(35, "(")),
    ("tag 36 mime", tagged(36, "Content-Type: text/plain\n\nhi")),
    ("tag 37 uuid", tagged(37, bytes(16))),
    ("tag 37 short uuid", tagged(37, b"ab")),
    ("tag 258 set", tagged(258, [1, 2])),
    ("tag 258 unhashable set", tagged(258, [[1]])),
    ("tag 258 nested in map", b"\xa1\x61s" + tagged(258, [])),
    ("tag 260 bad ip", tagged(260, b"abc")),
    ("tag 25 outside namespace", b"\xd8\x19\x00"),
    ("array map key", b"\xa1\x81\x01\x02"),
    ("set map key", b"\xa1\xd9\x01\x02\x80\x01"),
    ("deep arrays", nested(100_000, b"\x81")),
    ("deep maps", nested(100_000, b"\xa1\x00")),
    ("deep tags", nested(100_000, b"\xd8\x37")),
    ("arrays past plain depth", nested(65, b"\x81")),
    ("indefinite deep arrays", nested(100_000, b"\x9f")),
    *[
        (f"huge {kind} ({width}-byte length)", head(major, (1 << (8 * width)) - 1, width))
        for kind, major in (("bytes", 2), ("text", 3), ("array", 4), ("map", 5))
        for width in (1, 2, 4, 8)
    ],
    ("huge bytes with some data", head(2, 2**40) + b"x" * 1000),
]


@pytest.mark.parametrize(("name", "data"), ITEM_MALFORMED, ids=[name for name, _ in ITEM_MALFORMED])
def test_decode_item_refuses(name: str, data: bytes) -> None:
    with pytest.raises(MalformedFrame):
        decode_item(data, BIG)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (nested(60, b"\x81"), None),
        (tagged(2, b"\x01" + bytes(16)), 1 << 128),  # bignums are integers: plain data
        (b"\x9f\x01\x02\xff", [1, 2]),  # indefinite lengths are valid CBOR (not MACed bytes)
        (b"\xf9\x7e\x00", math.nan),
    ],
    ids=["60 nested arrays", "bignum", "indefinite array", "half-float nan"],
)
def test_decode_item_accepts_plain_data(data: bytes, expected: Any) -> None:
    value = decode_item(data, BIG)
    if expected is None:
        for _ in range(60):
            assert isinstance(value, list)
            (value,) = value
        assert value == 0
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(value)
    else:
        assert value == expected


# -- decode_item: integers and tags from a hostile peer -------------------------------------------


def bignum(tag: int, magnitude_bytes: int) -> bytes:
    return tagged(tag, b"\x01" + bytes(magnitude_bytes - 1))


@pytest.mark.parametrize("tag", [2, 3])
def test_decode_item_bounds_bignums_before_building_them(tag: int) -> None:
    """Bignums are application integers in envelopes, but at most MAX_BIGNUM_BYTES of magnitude:
    so str()/repr() of any integer decode_item returns works (Python refuses over 4,300 digits).
    Before the fix any size was built (a 16 MiB frame: a 40-million-digit integer)."""
    value = decode_item(bignum(tag, MAX_BIGNUM_BYTES), BIG)
    assert value.bit_length() == 8 * MAX_BIGNUM_BYTES - 7
    assert len(str(value)) < 4300
    with pytest.raises(MalformedFrame, match=f"bignum of {MAX_BIGNUM_BYTES + 1} bytes"):
        decode_item(bignum(tag, MAX_BIGNUM_BYTES + 1), BIG)
    with pytest.raises(MalformedFrame, match="bignum"):
        decode_item(encode_canonical([1, {"k": 10**5000}]), BIG)
    with pytest.raises(MalformedFrame, match="must hold a byte string"):
        decode_item(tagged(tag, "text"), BIG)


@pytest.mark.parametrize(
    "value",
    [2**64, -(2**64) - 1, 10**5000, -(10**5000)],
    ids=["2**64", "-2**64-1", "+huge", "-huge"],
)
def test_decode_item_without_bignums_refuses_them(value: int) -> None:
    """The handshake's mode: every integer returned fits a CBOR head (64 bits and a sign)."""
    data = encode_canonical({"received": value})
    with pytest.raises(MalformedFrame, match="bignum"):
        decode_item(data, BIG, bignums=False)
    for edge in (2**64 - 1, -(2**64)):
        assert decode_item(encode_canonical(edge), BIG, bignums=False) == edge


KNOWN_TAG_SAMPLES = [
    (0, "2020-01-01T00:00:00Z"),
    (1, 0),
    (4, [-2, 12345]),
    (5, [-(2**62), 3]),
    (25, 0),
    (28, []),
    (29, 0),
    (30, [1, 3]),
    (35, "(a|b)*c"),
    (36, "Content-Type: text/plain\n\nhi"),
    (37, bytes(16)),
    (52, b"\x7f\x00\x00\x01"),
    (54, bytes(16)),
    (100, 0),
    (256, ["x"]),
    (258, [1, 2]),
    (260, b"\x7f\x00\x00\x01"),
    (261, {24: 8}),
    (1004, "2020-01-01"),
    (43000, 0),
    (55799, 0),
]


@pytest.mark.parametrize(
    ("tag", "value"), KNOWN_TAG_SAMPLES, ids=[str(t) for t, _ in KNOWN_TAG_SAMPLES]
)
def test_decode_item_refuses_known_tags_before_cbor2_decodes_them(tag: int, value: Any) -> None:
    """Plain data holds no tag but the bignums: every tag cbor2 knows is refused by our decoder
    table, before cbor2 builds a date, a Decimal, a compiled regex, a parsed MIME message...
    Before the fix they were built first and refused by the walk afterwards: one 7 MB tag-35
    envelope cost 31 s of regex compilation, a 14 MB tag-36 one 7 s of MIME parsing."""
    with pytest.raises(MalformedFrame, match=f"semantic tag {tag} is not allowed"):
        decode_item(tagged(tag, value), BIG)
    with pytest.raises(MalformedFrame, match=f"semantic tag {tag} is not allowed"):
        decode_item(encode_canonical(["x", {"k": [cbor2.CBORTag(tag, value)]}]), BIG)


@pytest.mark.parametrize("error", [KeyError("k"), RuntimeError("x"), AttributeError("a")])
def test_decode_item_maps_any_decoder_exception(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """Whatever the decoder raises on peer bytes leaves as MalformedFrame, chained ``from`` it
    (before, only a list of expected types was mapped and anything else escaped the layer)."""

    class Broken:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def decode(self) -> None:
            raise error

    monkeypatch.setattr(cbor2, "CBORDecoder", Broken)  # the module wire decodes with
    with pytest.raises(MalformedFrame, match=type(error).__name__) as info:
        decode_item(b"\x00", BIG)
    assert info.value.__cause__ is error


def test_decode_item_never_compiles_a_peer_regex(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[object] = []
    real = re.compile

    def spy(pattern: Any, flags: int = 0) -> Any:
        compiled.append(pattern)
        return real(pattern, flags)

    monkeypatch.setattr(re, "compile", spy)
    marker = "(peer-pattern)+" * 10
    with pytest.raises(MalformedFrame):
        decode_item(tagged(35, marker), BIG)
    assert marker not in compiled


def shared_dag(levels: int) -> bytes:
    """An array whose item k is a shareable [ref(k-1), ref(k-1)]: 2**k paths, ~10 bytes each."""
    out = bytearray(head(4, levels))
    out += b"\xd8\x1c\x80"  # shareable 0: []
    for k in range(1, levels):
        reference = b"\xd8\x1d" + head(0, k - 1)
        out += b"\xd8\x1c\x82" + reference + reference
    return bytes(out)


@pytest.mark.parametrize("levels", [2, 16, 60])
def test_decode_item_refuses_shared_reference_dag(levels: int) -> None:
    # 60 levels is ~2**60 paths: the shareable tag is refused while decoding.
    with pytest.raises(MalformedFrame, match="semantic tag 28"):
        decode_item(shared_dag(levels), BIG)


@pytest.mark.parametrize("levels", [2, 16, 60])
def test_plain_walk_refuses_shared_containers(levels: int) -> None:
    # The walk's own line of defence (should a decoder ever build a DAG): 2**60 paths, linear walk.
    node: list[Any] = []
    for _ in range(levels):
        node = [node, node]
    with pytest.raises(MalformedFrame, match="shares a container"):
        wire._check_plain(node, 0, set())


# -- decode_item: fuzz --------------------------------------------------------------------------

INTERESTING_TAGS = [0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 256, 258, 260, 261, 55799, 9999]


@st.composite
def cbor_tokens(draw: st.DrawFn) -> bytes:
    """Byte strings built from CBOR heads, tags and raw bytes: far more structure than binary()."""
    parts = []
    for _ in range(draw(st.integers(min_value=1, max_value=24))):
        kind = draw(st.sampled_from(["head", "head", "tag", "raw", "break", "indefinite"]))
        if kind == "head":
            major = draw(st.integers(min_value=0, max_value=7))
            value = draw(st.integers(min_value=0, max_value=23) | st.integers(0, 2**64 - 1))
            parts.append(head(major, value) if major != 7 or value < 24 else b"\xf9\x3c\x00")
        elif kind == "tag":
            parts.append(head(6, draw(st.sampled_from(INTERESTING_TAGS))))
        elif kind == "raw":
            parts.append(draw(st.binary(min_size=1, max_size=8)))
        elif kind == "break":
            parts.append(b"\xff")
        else:
            parts.append(bytes([draw(st.sampled_from([0x5F, 0x7F, 0x9F, 0xBF]))]))
    return b"".join(parts)


def check_item(data: bytes, plain: bool) -> None:
    try:
        decode_item(data, 4096, plain=plain)
    except MalformedFrame:
        pass


@settings(max_examples=1000)
@given(data=st.binary(max_size=200), plain=st.booleans())
def test_fuzz_decode_item_random_bytes(data: bytes, plain: bool) -> None:
    check_item(data, plain)


@settings(max_examples=1000)
@given(data=cbor_tokens(), plain=st.booleans())
def test_fuzz_decode_item_structured(data: bytes, plain: bool) -> None:
    check_item(data, plain)


def test_a_large_body_is_decoded_as_a_view_of_its_message_not_a_copy() -> None:
    """A body of at least VIEW_BYTES that is most of its message comes as a view of the
    (immutable) message: decoding a 256 KiB part allocates nothing of its size. Smaller bodies,
    bodies sharing a message with more than their size of others, and bodies of a mutable
    message are copied out of it."""
    big = bytes(range(256)) * 1024  # 256 KiB
    data = wire.encode_message(7, big) + wire.encode_receipt(3)
    tracemalloc.start()
    try:
        packets = list(wire.iter_packets(data, 1 << 20, 8))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024  # not 256 KiB
    message = packets[0]
    assert isinstance(message, wire.Message) and type(message.body) is memoryview
    assert message.body == big and message.body.obj is data
    assert packets[1] == wire.Receipt(3)

    edge = big[: wire.VIEW_BYTES]
    small = big[: wire.VIEW_BYTES - 1]
    shared = wire.encode_message(1, edge) + wire.encode_message(2, big)  # edge < half of it
    for message_bytes, expected in [
        (wire.encode_message(1, edge), [memoryview]),
        (wire.encode_message(1, small), [bytes]),
        (shared, [bytes, memoryview]),
        (bytearray(wire.encode_message(1, big)), [bytearray]),  # a copy: the buffer may change
    ]:
        decoded = wire.decode_packets(message_bytes, 1 << 20)  # type: ignore[arg-type]
        assert [type(p.body) for p in decoded if isinstance(p, wire.Message)] == expected


# -- the plain walk against a reference walk -----------------------------------------------------

_REFERENCE_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})
_REFERENCE_KEYS = frozenset({str, int, bool})


def _reference_check_plain(value: Any, depth: int, seen: set[int]) -> None:
    """The plain walk item by item, with no fast path: what ``wire._check_plain`` must match."""
    kind = type(value)
    if kind in _REFERENCE_SCALARS:
        return
    if kind is list:
        items: Any = value
    elif kind is dict:
        for key in value:
            if type(key) not in _REFERENCE_KEYS:
                raise MalformedFrame(f"map key of type {type(key).__name__} is not allowed")
        items = value.values()
    else:
        raise MalformedFrame(f"CBOR value of type {kind.__name__} is not plain data")
    if depth >= 64:
        raise MalformedFrame("CBOR item nested deeper than 64 levels")
    if id(value) in seen:
        raise MalformedFrame("CBOR item shares a container (shared reference or cycle)")
    seen.add(id(value))
    for item in items:
        if type(item) not in _REFERENCE_SCALARS:
            _reference_check_plain(item, depth + 1, seen)


def _plain_verdict(walk: Any, value: Any, depth: int) -> str | None:
    try:
        walk(value, depth)
    except MalformedFrame as exc:
        return str(exc)
    return None


@st.composite
def _shared_values(draw: st.DrawFn) -> Any:
    """Values from ``cbor_values`` some of whose containers hold one another more than once
    (a DAG) or themselves (a cycle): what no decoder here builds, but the walk must refuse."""
    pool: list[Any] = [draw(cbor_values) for _ in range(draw(st.integers(1, 4)))]
    for _ in range(draw(st.integers(0, 4))):
        picks = draw(st.lists(st.integers(0, len(pool) - 1), max_size=4))
        pool.append([pool[i] for i in picks] + draw(st.lists(plain_scalars, max_size=2)))
    if draw(st.booleans()):
        containers = [item for item in pool if type(item) in (list, dict)]
        if containers:
            which = st.integers(0, len(containers) - 1)
            target, other = containers[draw(which)], containers[draw(which)]
            if type(target) is list:
                target.append(other)
            else:
                target["loop"] = other
    return pool[draw(st.integers(0, len(pool) - 1))]


@fuzz_settings(400)
@given(
    value=st.one_of(cbor_values, plain_values, _shared_values()),
    depth=st.sampled_from([0, 1, 62, 63, 64]),
)
def test_plain_walk_refuses_exactly_what_the_reference_walk_refuses(value: Any, depth: int) -> None:
    expected = _plain_verdict(lambda v, d: _reference_check_plain(v, d, set()), value, depth)
    assert _plain_verdict(wire._check_plain, value, depth) == expected
    assert _plain_verdict(lambda v, d: wire._check_plain(v, d, set()), value, depth) == expected
