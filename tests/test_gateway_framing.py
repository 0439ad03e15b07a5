"""The gateway's check of a relayed request's arguments (``garcon_link.api._framing``): its
quick scan vouches only for arguments the full check (framing, then the worker's decode) also
passes, with the same bytes to splice; whatever it does not vouch for gets the full check's
verdict. Differential: the same inputs through both."""

from __future__ import annotations

import cbor2
import pytest
from cbor_strategies import any_item, cbor_values, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from garcon_link.api._framing import MAX_SCAN_DEPTH, _vouch, relay_arguments
from garcon_link.core.wire import argument_items, decode_item
from garcon_link.errors import MalformedFrame, Rejected

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
