"""The gateway's reading of relay calls without decoding them (``garcon_link.api._framing``):
its quick scan of the arguments vouches only for arguments the full check (framing, then the
worker's decode) also passes, with the same bytes to splice, and whatever it does not vouch for
gets the full check's verdict; a relay call read from its envelope's bytes reads as the usual
decode reads it, and any other envelope is left to that decode. Differential: the same inputs
through both."""

from __future__ import annotations

from typing import Protocol

import cbor2
import pytest
from cbor_strategies import any_item, cbor_values, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from garcon_link.api._framing import (
    MAX_KEPT_NAMES,
    MAX_SCAN_DEPTH,
    RelayCall,
    RelayCallReader,
    _vouch,
    read_relay_call,
    relay_arguments,
    relay_call,
)
from garcon_link.api._relay_wire import _call_arguments, _payload
from garcon_link.core.wire import argument_items, decode_item
from garcon_link.errors import MalformedFrame, Rejected
from garcon_link.rpc.envelopes import BadEnvelope, Call, encode_call, metadata_problem
from garcon_link.rpc.envelopes import decode as decode_envelope
from garcon_link.rpc.interface import service_spec, to_wire

MAX_BYTES = 1 << 20


def _full(payload: bytes) -> bytes | None:
    """The full check's verdict: the bytes to splice, or None (refused)."""
    try:
        arguments = argument_items(payload)
        decode_item(payload, MAX_BYTES)
    except MalformedFrame:
        return None
    return arguments


def _check(payload: bytes) -> None:
    expected = _full(payload)
    if _vouch(payload):
        assert expected == payload[1:]
    if expected is None:
        with pytest.raises(Rejected) as info:
            relay_arguments(payload, MAX_BYTES)
        assert info.value.code == "INVALID_ARGUMENTS"
    else:
        assert relay_arguments(payload, MAX_BYTES) == expected


@fuzz_settings(600)
@given(first=any_item, second=any_item, extra=st.one_of(st.just(b""), any_item))
def test_the_scan_vouches_only_for_what_the_full_check_passes(
    first: bytes, second: bytes, extra: bytes
) -> None:
    _check(b"\x82" + first + second + extra)


@fuzz_settings(600)
@given(item=any_item, cut=st.integers(0, 2))
def test_one_argument_gets_the_full_checks_verdict(item: bytes, cut: int) -> None:
    """``[[item], {}]``, the shape whose one scalar argument its head vouches for."""
    _check(b"\x82\x81" + (item[: len(item) - cut] if cut < len(item) else item) + b"\xa0")


@pytest.mark.parametrize(
    "item",
    [b"\xf7", b"\xf8\x20", b"\xe0", b"\x61\xff", b"\x62a", b"\x5f\x41a\xff", b"\xc2\x41\x01"],
)
def test_one_argument_a_worker_might_not_read_gets_the_full_check(item: bytes) -> None:
    _check(b"\x82\x81" + item + b"\xa0")


@fuzz_settings(300)
@given(
    args=st.lists(cbor_values, max_size=4),
    kwargs=st.dictionaries(st.text(max_size=8), cbor_values, max_size=4),
)
def test_well_formed_arguments_pass_either_way(
    args: list[object], kwargs: dict[str, object]
) -> None:
    try:
        payload = cbor2.dumps([args, kwargs])
    except (cbor2.CBOREncodeError, ValueError, TypeError):
        return
    _check(payload)


@fuzz_settings(300)
@given(data=st.binary(max_size=48))
def test_any_bytes_get_the_full_checks_verdict(data: bytes) -> None:
    _check(data)


@pytest.mark.parametrize(
    "payload",
    [
        cbor2.dumps([[b"x" * 32], {}]),
        cbor2.dumps([["text", 1, -2, 1.5, None, True, False], {"k": [1, {"n": 2}], 3: "v"}]),
        cbor2.dumps([[[[]]], {}]),
    ],
)
def test_plain_arguments_are_vouched_for(payload: bytes) -> None:
    assert _vouch(payload)
    assert relay_arguments(payload, MAX_BYTES) == payload[1:]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x82\x81\x62\xff\xfe\xa0", "do not decode"),  # text that is not UTF-8
        (cbor2.dumps([[], {(1, 2): 1}]), "do not decode"),  # an array as a map key
        (cbor2.dumps([[b"k"], {b"k": 1}]), "do not decode"),  # a byte string as a map key
        (b"\x82\x81\xc2\x59\x04\x01" + b"\x01" * 1025 + b"\xa0", "do not decode"),  # bignum
        (b"\x82\x9f\xff\xa0", "do not frame"),  # indefinite length
        (cbor2.dumps([{}, {}]), "do not frame"),
        (cbor2.dumps([[1], {}, 3]), "do not frame"),
        (cbor2.dumps([[1], {}]) + b"\x00", "do not frame"),
        (b"\x82\x81\x58\x20\x00\xa0", "do not frame"),  # a string past the end
    ],
)
def test_what_a_worker_would_not_read_is_refused(payload: bytes, reason: str) -> None:
    assert not _vouch(payload)
    with pytest.raises(Rejected) as info:
        relay_arguments(payload, MAX_BYTES)
    assert info.value.code == "INVALID_ARGUMENTS" and reason in info.value.message


def test_deep_nesting_and_large_payloads_get_the_full_check() -> None:
    deep: object = []
    for _ in range(MAX_SCAN_DEPTH + 1):
        deep = [deep]
    payload = cbor2.dumps([[deep], {}])
    assert not _vouch(payload)
    assert relay_arguments(payload, MAX_BYTES) == payload[1:]  # the full check passes it
    big = cbor2.dumps([[b"x" * 64], {}])
    with pytest.raises(Rejected, match="do not decode"):
        relay_arguments(big, len(big) - 1)  # past the frame limit: as the decoder refuses it


def _relay_envelope(
    call_id: int = 7, args: list[object] | None = None, kwargs: dict[str, object] | None = None
) -> bytes:
    payload = cbor2.dumps([[b"x" * 32], {}])
    call_args = ["box-1", "ident", "echo", payload, None, 30.0] if args is None else args
    return encode_call(call_id, "gateway", "call", call_args, kwargs or {}, 0, 0, None, None)


def _as_decoded(data: bytes) -> RelayCall | None:
    """What the usual decode reads of ``data``, in :func:`relay_call`'s terms, if it decodes."""
    try:
        envelope = decode_envelope(decode_item(data, MAX_BYTES))
    except (MalformedFrame, BadEnvelope):
        return None
    if not isinstance(envelope, Call) or type(envelope.args) is not list:
        return None
    if len(envelope.args) != 6:
        return None
    executor, service, method, payload, key, timeout = envelope.args
    return (envelope.id, executor, service, method, payload, key, timeout)


@pytest.mark.parametrize(
    "args",
    [
        ["box-1", "ident", "echo", b"\x82\x80\xa0", None, None],
        ["box-1", "s", "m", b"\x82\x80\xa0", b"k" * 16, 2.5],
        ["ünï", "s", "m", b"", None, 30],
        ["box-1", "s", "m", b"\x82\x80\xa0", None, 2**40],
        ["e" * 23, "s" * 24, "m" * 300, b"p" * 70_000, b"k" * 128, 0.5],
    ],
)
@pytest.mark.parametrize("call_id", [1, 23, 24, 255, 256, 2**16, 2**32, 2**64 - 1])
def test_a_relay_call_is_read_as_the_decoder_reads_it(args: list[object], call_id: int) -> None:
    data = _relay_envelope(call_id, args)
    assert relay_call(data) == _as_decoded(data)
    assert relay_call(data) is not None


@pytest.mark.parametrize(
    "data",
    [
        _relay_envelope(kwargs={"a": 1}),  # kwargs
        _relay_envelope(args=["box-1", "s", "m", b"", None]),  # five arguments
        _relay_envelope(args=["box-1", "s", "m", "text", None, None]),  # payload not bytes
        _relay_envelope(args=["box-1", "s", "m", b"", None, -1]),  # a negative timeout
        _relay_envelope(args=["box-1", "s", "m", b"", None, "1"]),
        encode_call(7, "gateway", "call", ["b", "s", "m", b"", None, None], {}, 0, 0, b"k", None),
        encode_call(
            7, "gateway", "call", ["b", "s", "m", b"", None, None], {}, 0, 0, None, {"a": "b"}
        ),
        encode_call(7, "gateway", "stream", ["b", "s", "m", b"", None, None], {}, 0, 0, None, None),
        encode_call(7, "other", "call", ["b", "s", "m", b"", None, None], {}, 0, 0, None, None),
        _relay_envelope() + b"\x00",
        _relay_envelope()[:-1],
        _relay_envelope().replace(b"box-1", b"box\xff1"),  # not UTF-8
    ],
)
def test_any_other_envelope_is_left_to_the_decoder(data: bytes) -> None:
    assert relay_call(data) is None


@fuzz_settings(600)
@given(data=st.data())
def test_a_mutated_relay_call_is_read_only_as_the_decoder_reads_it(data: st.DataObject) -> None:
    envelope = bytearray(_relay_envelope(data.draw(st.sampled_from([5, 300, 70_000]))))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(envelope) - 1))
        action = data.draw(st.sampled_from(["set", "cut", "insert"]))
        if action == "set":
            envelope[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del envelope[at]
        else:
            envelope.insert(at, data.draw(st.integers(0, 255)))
    raw = bytes(envelope)
    read = relay_call(raw)
    if read is not None:
        assert read == _as_decoded(raw)


@fuzz_settings(300)
@given(data=st.data())
def test_a_session_s_reader_reads_each_call_as_the_decoder_does(data: st.DataObject) -> None:
    """A reader keeps the names of the last call it read: a run of calls to the same names,
    to others that share a prefix with them, and mutated ones, each reads exactly as the
    decode does, whatever came before it."""
    reader = RelayCallReader(METADATA_ENTRIES, METADATA_BYTES)
    names = st.sampled_from(["box-1", "box-10", "box-", "b", "ünï", "e" * 30, "e" * 600])
    for _ in range(data.draw(st.integers(1, 6))):
        executor, service, method = data.draw(names), data.draw(names), data.draw(names)
        args: list[object] = [executor, service, method, b"\x82\x80\xa0", None, 30]
        envelope = bytearray(_relay_envelope(data.draw(st.integers(1, 2**32)), args))
        for _ in range(data.draw(st.integers(0, 2))):
            at = data.draw(st.integers(0, len(envelope) - 1))
            envelope[at] = data.draw(st.integers(0, 255))
        raw = bytes(envelope)
        read = reader.read(raw)
        assert read == read_relay_call(raw, METADATA_ENTRIES, METADATA_BYTES)
        if read is not None:
            assert read == (_as_decoded(raw), None)
        assert len(reader.names) <= MAX_KEPT_NAMES


def test_a_reader_reads_a_repeated_call_from_the_names_it_kept() -> None:
    reader = RelayCallReader(METADATA_ENTRIES, METADATA_BYTES)
    first = _relay_envelope(7)
    assert reader.read(first) == (_as_decoded(first), None)
    kept = reader.names
    assert kept.endswith(cbor2.dumps("box-1") + cbor2.dumps("ident") + cbor2.dumps("echo"))
    again = _relay_envelope(8)
    assert reader.read(again) == (_as_decoded(again), None)
    assert reader.names is kept  # compared, not read again
    other = _relay_envelope(9, ["box-10", "ident", "echo", b"\x82\x80\xa0", None, None])
    assert reader.read(other) == (_as_decoded(other), None)
    assert reader.names.endswith(cbor2.dumps("box-10") + cbor2.dumps("ident") + b"\x64echo")


METADATA_ENTRIES, METADATA_BYTES = 4, 64


def _with_metadata(metadata: object, key: bytes | None = None) -> bytes:
    """A relay envelope with ``metadata`` (encoded as given: a map, or a map's bytes)."""
    args = ["box-1", "ident", "echo", b"\x82\x80\xa0", None, 30.0]
    base = encode_call(7, "gateway", "call", args, {}, 0, 0, None, None)
    tail = metadata if isinstance(metadata, bytes) else cbor2.dumps(metadata)
    return b"\x8a" + base[1:] + cbor2.dumps(key) + tail


def _metadata_verdict(data: bytes) -> object:
    """What the usual decode and the dispatcher's check make of ``data``'s metadata: the map,
    or ``"refused"``."""
    envelope = decode_envelope(decode_item(data, MAX_BYTES))
    assert isinstance(envelope, Call)
    if envelope.key is not None:
        return "refused"
    problem = metadata_problem(envelope.metadata, METADATA_ENTRIES, METADATA_BYTES)
    return "refused" if problem is not None else envelope.metadata


@pytest.mark.parametrize(
    "metadata",
    [
        {"traceparent": "00-0af7651916cd43dd-01"},
        {"a": "", "b.c_d-9": "ünï", "x" * 30: "y" * 10, "z": "w"},
        {},
    ],
)
def test_a_relay_call_s_metadata_is_read_as_the_dispatcher_reads_it(
    metadata: dict[str, str],
) -> None:
    data = _with_metadata(metadata)
    read = read_relay_call(data, METADATA_ENTRIES, METADATA_BYTES)
    assert read is not None
    call, encoded = read
    assert call == _as_decoded(data)
    assert (cbor2.loads(encoded) if encoded is not None else {}) == _metadata_verdict(data)
    assert relay_call(data) is None if metadata else relay_call(data) == call


@pytest.mark.parametrize(
    "data",
    [
        _with_metadata({f"k{i}": "v" for i in range(METADATA_ENTRIES + 1)}),  # too many
        _with_metadata({"a": "v" * METADATA_BYTES}),  # too large
        _with_metadata({"Upper": "v"}),  # not a metadata key
        _with_metadata({"": "v"}),
        _with_metadata({"k" * 65: "v"}),
        _with_metadata({"a": 1}),  # not text
        _with_metadata({1: "v"}),
        _with_metadata(["a", "b"]),  # not a map
        _with_metadata(b"\xa2\x61a\x61b\x61a\x61c"),  # a key twice
        _with_metadata(b"\xa1\x61a\x62\xff\xfe"),  # not UTF-8
        _with_metadata({"a": "b"}, key=b"k" * 16),  # an envelope key
    ],
)
def test_metadata_the_dispatcher_refuses_is_left_to_it(data: bytes) -> None:
    assert read_relay_call(data, METADATA_ENTRIES, METADATA_BYTES) is None


@fuzz_settings(600)
@given(data=st.data())
def test_a_mutated_relay_call_with_metadata_is_read_only_as_the_dispatcher_reads_it(
    data: st.DataObject,
) -> None:
    envelope = bytearray(_with_metadata({"trace": "t-1", "b": "ü"}))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(envelope) - 1))
        action = data.draw(st.sampled_from(["set", "cut", "insert"]))
        if action == "set":
            envelope[at] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del envelope[at]
        else:
            envelope.insert(at, data.draw(st.integers(0, 255)))
    raw = bytes(envelope)
    read = read_relay_call(raw, METADATA_ENTRIES, METADATA_BYTES)
    if read is not None:
        call, encoded = read
        assert call == _as_decoded(raw)
        verdict = _metadata_verdict(raw)
        assert verdict != "refused"
        assert (cbor2.loads(encoded) if encoded is not None else {}) == verdict


@pytest.mark.parametrize(
    "args",
    [
        ("box-1", "ident", "echo", b"\x82\x81\x41x\xa0", None, None),
        ("ünï" * 10, "s" * 30, "m" * 300, b"p" * 70_000, b"k" * 128, 0.5),
        ("e", "s", "m", b"", b"", 30.0),
    ],
)
def test_a_caller_frames_a_relay_call_s_arguments_as_cbor2_does(
    args: tuple[str, str, str, bytes, bytes | None, float | None],
) -> None:
    """The wire stays as it was: the caller's hand-framed relay arguments and payload are the
    bytes cbor2 writes for them."""
    assert _call_arguments(*args) == cbor2.dumps(list(args)) + b"\xa0"
    assert relay_call(encode_call(7, "gateway", "call", list(args), {}, 0, 0, None, None)) == (
        7,
        *args,
    )


class _Echo(Protocol):
    async def echo(self, data: bytes, *, times: int = 1, tag: str | None = None) -> bytes: ...


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((b"x" * 32,), {}), ((b"x",), {"times": 3}), ((b"",), {"times": 2, "tag": "ü"})],
)
def test_a_caller_encodes_a_relayed_payload_as_cbor2_does(
    args: tuple[object, ...], kwargs: dict[str, object]
) -> None:
    spec = service_spec(_Echo).methods["echo"]
    pos, kw = spec.bind(args, kwargs)
    full = spec.args_with_defaults
    expected = cbor2.dumps([to_wire(pos, with_defaults=full), to_wire(kw, with_defaults=full)])
    assert _payload("echo", spec, args, kwargs) == expected
