"""Large byte strings spliced part by part (garcon_link.rpc.splice).

Sending: an envelope's large ``bytes`` values are never copied into an encoded body; the pieces
are exactly ``cbor2.dumps`` of the envelope, and each part copies only its own bytes (measured
with tracemalloc around every part the sender issues). Receiving: the reassembler fills each
large value a part at a time and decodes only the rest, holding one copy of the value instead
of three; any cut of the body into parts (inside heads too) decodes to the same envelope; hostile
bodies (overlong declared lengths, a transfer ending inside a value, forged placeholders, many
small items, indefinite lengths) are refused or decoded whole, never trusted.
"""

from __future__ import annotations

import itertools
import os
import random
import tracemalloc
from typing import Any

import anyio
import anyio.lowlevel
import cbor2
import pytest

from garcon_link.core.wire import Gathered, decode_item
from garcon_link.errors import MalformedFrame
from garcon_link.rpc.chunks import FINAL, MORE, ChunkSender, PartViolation, Reassembler, parse_part
from garcon_link.rpc.envelopes import encode_call, encode_item, encode_result
from garcon_link.rpc.splice import (
    MAX_HEADS,
    MAX_SCAN,
    SPLICE_BYTES,
    SPLICE_TAG,
    Spliced,
    encode_envelope,
    holds_large,
)

MiB = 1024 * 1024
LIMIT = 16 * MiB


def _call(args: Any, kwargs: Any, splice: int = SPLICE_BYTES) -> bytes | Spliced:
    return encode_call(7, "svc", "m", args, kwargs, 64, MiB, None, None, splice=splice)


def _whole(body: bytes | Spliced) -> bytes:
    return body.joined() if isinstance(body, Spliced) else body


# ------------------------------------------------------------------------------------ sending


def test_spliced_bodies_are_exactly_the_encoded_envelope() -> None:
    big, other = os.urandom(SPLICE_BYTES), os.urandom(3 * SPLICE_BYTES + 5)
    cases = [
        ([big], {}),
        ([1, big, "x", other], {"k": big}),
        ([[b"small", big], {"nested": other}], {}),
        ([], {"a": other, "b": b"tiny"}),
    ]
    for args, kwargs in cases:
        body = _call(args, kwargs)
        assert isinstance(body, Spliced)
        assert body.joined() == _call(args, kwargs, splice=0)
        assert len(body) == len(body.joined())
        # The values themselves are pieces: never copied.
        assert any(piece is big or piece is other for piece in body.pieces)
    result = encode_result(3, [big, other], splice=SPLICE_BYTES)
    assert _whole(result) == encode_result(3, [big, other]) and isinstance(result, Spliced)
    item = encode_item(3, big, splice=SPLICE_BYTES)
    assert _whole(item) == encode_item(3, big) and isinstance(item, Spliced)


def test_only_large_bytes_within_reach_are_spliced() -> None:
    big = os.urandom(SPLICE_BYTES)
    not_spliced: list[tuple[list[Any], dict[str, Any]]] = [
        ([os.urandom(SPLICE_BYTES - 1)], {}),  # below the threshold
        ([bytearray(big)], {}),  # mutable: encoded whole
        ([[[big]]], {}),  # deeper than one container within an argument
        ([[0] * MAX_SCAN + [big]], {}),  # past the elements looked at
    ]
    for args, kwargs in not_spliced:
        body = _call(args, kwargs)
        assert type(body) is bytes
        assert body == _call(args, kwargs, splice=0)
    args = [big]
    _call(args, {})
    assert args == [big]  # the caller's containers are never changed


def test_the_quick_check_agrees_with_the_walk() -> None:
    """holds_large (every call pays it) says yes exactly when encode_envelope splices."""
    big = os.urandom(SPLICE_BYTES)
    values: list[Any] = [
        big,
        b"small",
        [big],
        [[big]],
        [[[big]]],
        {"k": [big]},
        {"k": {"j": big}},
        [0] * MAX_SCAN + [big],
        [[0] * MAX_SCAN + [big]],
        [bytearray(big)],
        [1, "x", None, [2.5, {"a": b"b"}]],
    ]
    for value in values:
        for depth in (1, 2):
            spliced = encode_envelope([1, 2, value], range(2, 3), SPLICE_BYTES, depth)
            assert holds_large(value, SPLICE_BYTES, depth) is isinstance(spliced, Spliced), (
                value if len(repr(value)) < 200 else type(value),
                depth,
            )


class _RecordingTransport:
    """Records each part and the most memory allocated since the previous one was issued."""

    def __init__(self) -> None:
        self.issued = 0
        self.bodies: list[bytes] = []
        self.peaks: list[int] = []
        self._base = 0

    async def send(self, body: bytes | Gathered) -> int:
        self.peaks.append(tracemalloc.get_traced_memory()[1] - self._base)
        self.issued += 1
        self.bodies.append(bytes(body))  # joined when issued, as the session joins it
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]
        return self.issued

    def try_send(self, body: bytes | Gathered) -> int | None:
        self.issued += 1
        return self.issued

    def send_nowait(self, body: bytes | Gathered) -> int | None:
        return None  # (ChunkSender.send_nowait only: these tests go through send)

    async def wait_retained_below(self, size: int) -> bool:
        return True


@pytest.mark.anyio
async def test_a_large_value_is_sent_a_part_at_a_time() -> None:
    """Encoding an 8 MiB argument allocates no more than its envelope's small pieces, and no
    part costs more than about its own size: the value is never copied whole in one go."""
    chunk = 256 * 1024
    value = os.urandom(8 * MiB)
    transport = _RecordingTransport()
    sender = ChunkSender(transport, chunk, 4 * chunk, LIMIT, transfers=4, clock=lambda: 0.0)
    _call([value], {})  # once before: first-use caches of the splice path are not the call's
    tracemalloc.start()
    try:
        body = _call([value], {})
        encoded_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        await sender.send(body, lambda head: (head[:2] + b"\x08", 3))
    finally:
        tracemalloc.stop()
    assert encoded_peak < 64 * 1024  # not 8 MiB
    assert len(transport.bodies) == 32
    # Each part: small objects only. The part is handed over as views of the value, joined
    # once by the session straight into the message's frame (not built here and copied again).
    assert max(transport.peaks[1:]) < 64 * 1024
    receiver = Reassembler(LIMIT)
    for part in transport.bodies:
        parsed = parse_part(part)
        assert parsed is not None
        body_bytes = receiver.feed(*parsed)
    expected = _whole(_call([value], {}, splice=0))
    assert body_bytes == b"\x88\x00\x08" + expected[3:]  # renumbered from 7 to 8


# ---------------------------------------------------------------------------------- receiving


def _parts(body: bytes, cuts: list[int]) -> list[tuple[int, bytes]]:
    edges = [0, *sorted(set(cuts)), len(body)]
    pieces = [body[a:b] for a, b in itertools.pairwise(edges) if b > a]
    return [(MORE, piece) for piece in pieces[:-1]] + [(FINAL, pieces[-1])]


def _receive(reassembler: Reassembler, parts: list[tuple[int, bytes]]) -> Any:
    body = None
    for flags, chunk in parts:
        body = reassembler.feed(flags, chunk)
    assert body is not None
    splicer = reassembler.splicer
    splice = None if splicer is None else (SPLICE_TAG, splicer.resolve)
    return decode_item(body, LIMIT, splice=splice)


def test_any_cut_of_a_body_decodes_to_the_same_envelope() -> None:
    rng = random.Random(5)
    big, other = rng.randbytes(SPLICE_BYTES + 3), rng.randbytes(2 * SPLICE_BYTES)
    envelope = [0, 300, "svc", "m", [big, "text" * 40, [1, 2.5, None]], {"o": other}, 64, MiB]
    body = cbor2.dumps(envelope)
    for trial in range(60):
        if trial < 30:  # cuts in the first bytes: inside heads and small items
            cuts = [*rng.sample(range(1, 40), 3), rng.randrange(1, len(body))]
        else:
            cuts = [rng.randrange(1, len(body)) for _ in range(rng.randrange(1, 12))]
        reassembler = Reassembler(LIMIT, splice=True)
        assert _receive(reassembler, _parts(body, cuts)) == envelope
        assert reassembler.body_size == len(body)
        assert reassembler.splicer is not None and len(reassembler.splicer.values) == 2


def test_a_received_value_is_held_once() -> None:
    """Joining the parts and decoding held the value three times (parts, joined body, decoded
    value); filled part by part it is held once, beside the parts."""
    value = os.urandom(8 * MiB)
    body = cbor2.dumps([1, 9, value])
    parts = _parts(body, list(range(256 * 1024, len(body), 256 * 1024)))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        decoded = _receive(Reassembler(LIMIT, splice=True), parts)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert decoded == [1, 9, value]
    assert peak < len(value) + MiB


def test_a_declared_length_beyond_the_transfer_is_refused() -> None:
    reassembler = Reassembler(4 * SPLICE_BYTES, splice=True)
    head = b"\x83\x01\x05\x5a" + (8 * SPLICE_BYTES).to_bytes(4, "big")
    with pytest.raises(PartViolation, match="exceeds the transfer"):
        reassembler.feed(MORE, head + bytes(100))
    assert reassembler.feed(MORE, bytes(100)) is None  # the rest of it is discarded
    assert reassembler.feed(FINAL, b"x") is None
    assert not reassembler.in_progress and reassembler.buffered == 0


def test_a_transfer_ending_inside_a_value_is_refused() -> None:
    body = cbor2.dumps([1, 5, bytes(2 * SPLICE_BYTES)])
    reassembler = Reassembler(LIMIT, splice=True)
    reassembler.feed(MORE, body[:1000])
    with pytest.raises(PartViolation, match="ends inside a byte string"):
        reassembler.feed(FINAL, body[1000:-10])
    assert reassembler.feed(MORE, b"\x82") is None  # a new transfer starts afresh
    assert reassembler.feed(FINAL, b"\x01\x02") == b"\x82\x01\x02"


def test_a_forged_placeholder_is_refused() -> None:
    for guess in (0, 1, 2**62):
        forged = cbor2.CBORTag(SPLICE_TAG, [0, guess])
        body = cbor2.dumps([1, 5, [bytes(SPLICE_BYTES), forged]])
        with pytest.raises(MalformedFrame, match=f"tag {SPLICE_TAG}"):
            _receive(Reassembler(LIMIT, splice=True), _parts(body, [10]))


def test_many_small_items_or_indefinite_lengths_are_decoded_whole() -> None:
    big = bytes(range(256)) * (SPLICE_BYTES // 256)
    many = [0, 1, [list(range(MAX_HEADS + 10)), big]]
    reassembler = Reassembler(LIMIT, splice=True)
    assert _receive(reassembler, _parts(cbor2.dumps(many), [7, 5000])) == many
    assert reassembler.splicer is None  # the scan stopped before the value: kept verbatim
    # [1, 5, (_ big)] with an indefinite-length array around the value.
    indefinite = b"\x83\x01\x05\x9f" + cbor2.dumps(big) + b"\xff"
    reassembler = Reassembler(LIMIT, splice=True)
    assert _receive(reassembler, _parts(indefinite, [3, 9])) == [1, 5, [big]]
    assert reassembler.splicer is None


def test_encode_envelope_without_threshold_is_plain_cbor() -> None:
    envelope = [1, 2, os.urandom(SPLICE_BYTES)]
    assert encode_envelope(envelope, range(2, 3), 0) == cbor2.dumps(envelope)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # trio shuffles a batch: no turn order
async def test_one_part_per_loop_turn() -> None:
    """With room in the window for every part, the sender still issues one part per loop turn:
    a ticker task that counts loop turns (asyncio runs ready tasks in order) sees a different
    count at every part."""
    turns = 0
    stop = anyio.Event()

    async def ticker() -> None:
        nonlocal turns
        for _ in range(10_000):
            if stop.is_set():
                return
            turns += 1
            await anyio.lowlevel.checkpoint()

    seen: list[int] = []

    class Transport(_RecordingTransport):
        async def send(self, body: bytes | Gathered) -> int:
            seen.append(turns)
            self.issued += 1
            return self.issued

    chunk = 64 * 1024
    sender = ChunkSender(Transport(), chunk, 64 * chunk, LIMIT, transfers=4, clock=lambda: 0.0)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            await sender.send(_call([os.urandom(16 * chunk)], {}))
            stop.set()
    assert len(seen) == 16
    assert len(set(seen)) == len(seen), seen
