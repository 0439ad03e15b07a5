"""Bulk transfers in parts (garcon_link.rpc.chunks, docs/design.md#bulk-transfers).

The sans-IO :class:`Reassembler` on its own, then live pairs on both backends and in both
directions: bodies over ``bulk_chunk_bytes`` (arguments, results, stream items, notifications)
round-trip byte-exact; small calls issued during a transfer run before it ends (the worker's
ledger); a cut in the middle resumes and delivers exactly once; a timeout in the middle is
``NotDispatched`` and frees the receiver's buffer (statistics); hostile parts are dropped with
bounded memory. No timing assertions: every wait is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import pytest
from rpcutil import LIMITS, Direction, both_directions, next_call_id, open_pair, raw_send

import garcon_link as gl
from garcon_link.core.wire import Gathered
from garcon_link.rpc.chunks import (
    ABORT,
    FINAL,
    INTERACTIVE_PART_BYTES,
    INTERACTIVE_S,
    MAX_TRANSFER_ID,
    MIN_CHARGE,
    MORE,
    PART,
    ChunkSender,
    PartViolation,
    Reassembler,
    Transfers,
    encode_part,
    parse_part,
    parse_transfer_part,
)
from garcon_link.rpc.rpc import CALL, NOTIFY, current_rpc

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 20
CHUNK = 16 * 1024
BULK = LIMITS.replace(bulk_chunk_bytes=CHUNK, bulk_window_bytes=4 * CHUNK, receipt_bytes=CHUNK)
TRANSFERS = BULK.bulk_transfers


# ---------------------------------------------------------------------------------- reassembler


def test_parts_reassemble_in_order() -> None:
    r = Reassembler(100 * MIN_CHARGE)
    assert r.feed(MORE, b"ab") is None
    assert r.in_progress and r.buffered == 2 and r.first_chunk() == b"ab"
    assert r.feed(MORE, b"cd") is None
    assert r.feed(FINAL, b"e") == b"abcde"
    assert (r.in_progress, r.buffered, r.completed, r.parts) == (False, 0, 1, 3)
    assert r.feed(MORE, b"x") is None
    assert r.feed(FINAL, b"") == b"x"  # an empty final part ends the body


def test_abort_frees_the_buffer() -> None:
    r = Reassembler(100 * MIN_CHARGE)
    r.feed(MORE, b"abc")
    assert r.feed(ABORT, b"") is None
    assert (r.in_progress, r.buffered, r.aborted) == (False, 0, 1)
    assert r.feed(MORE, b"y") is None  # the next transfer starts afresh
    assert r.feed(FINAL, b"z") == b"yz"


@pytest.mark.parametrize(
    ("flags", "chunk"),
    [(3, b"x"), (-1, b"x"), ("0", b"x"), (True, b"x"), (MORE, "text"), (MORE, None), (MORE, b"")],
)
def test_malformed_parts_are_violations(flags: Any, chunk: Any) -> None:
    r = Reassembler(100 * MIN_CHARGE)
    with pytest.raises(PartViolation):
        r.feed(flags, chunk)
    assert r.buffered == 0
    assert r.feed(MORE, b"o") is None  # nothing was in progress: nothing to discard
    assert r.feed(FINAL, b"k") == b"ok"


def test_abort_without_a_transfer_and_nonempty_abort_are_violations() -> None:
    r = Reassembler(100 * MIN_CHARGE)
    with pytest.raises(PartViolation):
        r.feed(ABORT, b"")
    r.feed(MORE, b"a")
    with pytest.raises(PartViolation):
        r.feed(ABORT, b"junk")
    assert r.buffered == 0


def test_oversize_transfer_is_dropped_and_the_rest_discarded() -> None:
    r = Reassembler(2 * MIN_CHARGE)
    r.feed(MORE, b"a" * MIN_CHARGE)
    with pytest.raises(PartViolation, match=f"exceeds {2 * MIN_CHARGE}"):
        r.feed(MORE, b"b" * (MIN_CHARGE + 1))
    assert (r.buffered, r.in_progress) == (0, False)
    # The rest of that transfer is discarded unread, up to and including its last part.
    assert r.feed(MORE, b"more") is None
    assert r.buffered == 0
    assert r.feed(FINAL, b"end") is None
    assert r.feed(MORE, b"ne") is None
    assert r.feed(FINAL, b"xt") == b"next"


def test_a_final_part_with_no_transfer_in_progress_is_a_violation() -> None:
    """A transfer is at least two parts: a lone final part is refused, whatever its chunk, and
    is not taken for the end of anything (the next transfer is whole)."""
    r = Reassembler(100 * MIN_CHARGE)
    for chunk in (b"x", b"", encode_part(FINAL, b"inner")):
        with pytest.raises(PartViolation, match="no transfer in progress"):
            r.feed(FINAL, chunk)
        assert (r.in_progress, r.buffered, r.completed) == (False, 0, 0)
    assert r.feed(MORE, b"a") is None
    assert r.feed(FINAL, b"b") == b"ab"


@pytest.mark.parametrize("cut", [1, 2, 3, 10])
def test_a_body_that_is_itself_a_part_is_a_violation(cut: int) -> None:
    """Parts do not nest: a transfer whose body is a part is refused at its final part, before
    the body is joined, wherever the first chunk ends (a single byte of the head too)."""
    r = Reassembler(100 * MIN_CHARGE)
    body = encode_part(FINAL, b"inner body")
    r.feed(MORE, body[:cut])
    with pytest.raises(PartViolation, match="itself a part"):
        r.feed(FINAL, body[cut:])
    assert (r.in_progress, r.buffered, r.completed) == (False, 0, 0)
    # The transfer had ended: nothing of it is discarded, the next one is whole.
    assert r.feed(MORE, b"\x83") is None
    assert r.feed(FINAL, b"\x01") == b"\x83\x01"  # begins like an envelope, not a part


def test_tiny_parts_count_at_least_min_charge() -> None:
    """A peer sending 1-byte parts cannot make a transfer hold ~250 bytes of objects per byte
    of its limit: each part counts MIN_CHARGE bytes."""
    r = Reassembler(10 * MIN_CHARGE)
    for _ in range(10):
        assert r.feed(MORE, b"x") is None
    with pytest.raises(PartViolation, match="11 parts"):
        r.feed(MORE, b"x")
    assert r.buffered == 0
    # Parts of at least MIN_CHARGE bytes are charged what they hold: a limit-sized body passes.
    r = Reassembler(3 * MIN_CHARGE)
    r.feed(MORE, b"a" * MIN_CHARGE)
    r.feed(MORE, b"b" * MIN_CHARGE)
    assert r.feed(FINAL, b"c" * MIN_CHARGE) == b"a" * MIN_CHARGE + b"b" * MIN_CHARGE + b"c" * 1024


def test_encode_part_is_cbor() -> None:
    import cbor2

    for size in (0, 23, 24, 255, 256, 65535, 65536):
        chunk = os.urandom(size)
        assert encode_part(MORE, chunk) == cbor2.dumps([PART, MORE, chunk])
        assert encode_part(FINAL, memoryview(chunk)) == cbor2.dumps([PART, FINAL, chunk])


def test_parse_part_reads_what_encode_part_writes_without_a_copy() -> None:
    import cbor2

    for size in (0, 23, 24, 255, 256, 65535, 65536):
        chunk = os.urandom(size)
        for flags in (MORE, FINAL, ABORT):
            parsed = parse_part(encode_part(flags, chunk))
            assert parsed is not None
            assert (parsed[0], bytes(parsed[1])) == (flags, chunk)
            assert type(parsed[1]) is memoryview
    # Anything else is left to the generic decoder (which accepts or refuses it).
    ok = encode_part(MORE, b"abc")
    for other in (
        b"",
        ok[:3],
        ok + b"x",  # trailing bytes
        ok[:-1],  # short
        b"\x83\x08\x03\x43abc",  # flags out of range
        b"\x83\x08\x00\x63abc",  # text, not bytes
        b"\x83\x08\x00\x58\x03abc",  # a longer head than needed: decoded generically
        cbor2.dumps([PART, MORE, "abc"]),
        cbor2.dumps([PART, MORE]),
    ):
        parsed = parse_part(other)
        assert parsed is None or other == b"\x83\x08\x00\x58\x03abc", other
    assert parse_part(b"\x83\x08\x00\x58\x03abc") is not None  # a valid, longer head


def test_limits_validate_the_chunk_size() -> None:
    with pytest.raises(gl.ConfigError, match="bulk_chunk_bytes"):
        gl.Limits(bulk_chunk_bytes=100)
    assert gl.Limits().bulk_chunk_bytes == 256 * 1024


# ---------------------------------------------------------------------------------- live pairs


class _PacedTransport:
    """Records how each part was paced; retention always drains at once."""

    def __init__(self) -> None:
        self.issued = 0
        self.waits: list[int] = []
        self.sizes: list[int] = []

    async def send(self, body: bytes | Gathered) -> int:
        self.issued += 1
        self.sizes.append(len(body))
        return self.issued

    def try_send(self, body: bytes | Gathered) -> int | None:
        self.issued += 1
        return self.issued

    def send_nowait(self, body: bytes | Gathered) -> int | None:
        return None  # (ChunkSender.send_nowait only: these tests go through send)

    async def wait_retained_below(self, size: int) -> bool:
        self.waits.append(size)
        return True


@pytest.mark.anyio
async def test_a_transfer_yields_to_small_messages_sent_alongside() -> None:
    """Alone, a transfer keeps the whole window; within INTERACTIVE_S of a small message sent
    through the same sender, each part waits until less than one chunk is unconfirmed."""
    now = [100.0]
    transport = _PacedTransport()
    chunk, window = 64 * 1024, 256 * 1024
    sender = ChunkSender(
        transport, chunk, window, 16 * 1024 * 1024, transfers=TRANSFERS, clock=lambda: now[0]
    )
    body = os.urandom(4 * chunk + 100)

    await sender.send(body)
    assert transport.waits == [window] * 4  # four equal parts, each paced by the window

    transport.waits.clear()
    await sender.send(b"small")
    now[0] += INTERACTIVE_S / 2
    await sender.send(body)
    assert transport.waits == [chunk] * 4

    transport.waits.clear()
    now[0] += INTERACTIVE_S
    await sender.send(body)
    assert transport.waits == [window] * 4


@pytest.mark.anyio
async def test_beside_small_messages_a_large_chunk_is_cut_to_interactive_parts() -> None:
    """With a chunk over INTERACTIVE_PART_BYTES, a transfer within INTERACTIVE_S of a small
    message goes in parts of at most that size, each waiting until less than one is
    unconfirmed; alone, in equal chunks paced by the window. The parts still reassemble."""
    now = [100.0]
    transport = _RecordingTransport()
    chunk, window = 4 * INTERACTIVE_PART_BYTES, 16 * INTERACTIVE_PART_BYTES
    sender = ChunkSender(
        transport, chunk, window, 64 * 1024 * 1024, transfers=TRANSFERS, clock=lambda: now[0]
    )
    body = os.urandom(3 * chunk + 100)

    await sender.send(body)
    assert transport.waits == [window] * 3
    assert max(transport.sizes) > 3 * INTERACTIVE_PART_BYTES  # three equal chunks

    transport.waits.clear()
    transport.sizes.clear()
    transport.bodies.clear()
    await sender.send(b"small")
    transport.bodies.clear()
    now[0] += INTERACTIVE_S / 2
    await sender.send(body)
    parts = [parse_part(part) for part in transport.bodies]
    assert len(parts) == 13  # 12 parts of INTERACTIVE_PART_BYTES, then the rest
    assert transport.waits == [INTERACTIVE_PART_BYTES] * 13
    receiver = Reassembler(64 * 1024 * 1024)
    for part in parts[:-1]:
        assert part is not None and part[0] == MORE and len(part[1]) == INTERACTIVE_PART_BYTES
        assert receiver.feed(*part) is None
    assert parts[-1] is not None and parts[-1][0] == FINAL
    assert receiver.feed(*parts[-1]) == body


class _RecordingTransport(_PacedTransport):
    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    async def send(self, body: bytes | Gathered) -> int:
        self.bodies.append(bytes(body))  # joined when issued, as the session joins it
        return await super().send(body)


@pytest.mark.parametrize("extra", [1, 2, 3, 1000, 64 * 1024 - 1, 64 * 1024, 5 * 64 * 1024])
async def test_the_sender_sends_at_least_two_parts_that_reassemble(extra: int) -> None:
    """Every body over a chunk goes as at least two parts (the receiver refuses a transfer of
    one), from one byte over the chunk up; the receiver gets it back whole."""
    transport = _RecordingTransport()
    chunk = 64 * 1024
    sender = ChunkSender(
        transport, chunk, 4 * chunk, 16 * 1024 * 1024, transfers=TRANSFERS, clock=lambda: 0.0
    )
    body = os.urandom(chunk + extra)
    await sender.send(body)
    assert len(transport.bodies) >= 2
    receiver = Reassembler(16 * 1024 * 1024)
    *parts, last = [parse_part(part) for part in transport.bodies]
    for part in parts:
        assert part is not None and part[0] == MORE
        assert receiver.feed(*part) is None
    assert last is not None and last[0] == FINAL
    assert receiver.feed(*last) == body


# ---------------------------------------------------------------------------------- transfer ids


def test_transfers_with_ids_interleave_part_by_part() -> None:
    t = Transfers(100 * MIN_CHARGE, transfers=TRANSFERS)
    fed = t.feed(1, MORE, b"a1")
    assert fed is not None and fed[1:] == (True, None)
    assert t.feed(2, MORE, b"b1") is not None
    assert t.feed(None, MORE, b"c1") is not None  # the transfer without an id, alongside
    assert (t.in_progress, t.buffered) == (3, 6)
    assert t.feed(1, MORE, b"a2") is not None
    fed = t.feed(2, FINAL, b"b2")
    assert fed is not None and fed[1:] == (False, b"b1b2")
    fed = t.feed(1, FINAL, b"a3")
    assert fed is not None and fed[2] == b"a1a2a3"
    fed = t.feed(None, FINAL, b"c2")
    assert fed is not None and fed[2] == b"c1c2"
    assert (t.in_progress, t.buffered, t.completed, t.parts) == (0, 0, 3, 7)
    assert t.feed(3, MORE, b"x") is not None
    assert t.feed(3, ABORT, b"") is not None
    assert (t.in_progress, t.buffered, t.aborted) == (0, 0, 1)


@pytest.mark.parametrize(
    "transfer",
    [
        0,
        -1,
        MAX_TRANSFER_ID + 1,
        2**64 - 1,
        2**200,
        b"\x01",
        "1",
        [1],
        {1: 1},
        1.5,
        True,
        [[[[1]]]],
    ],
)
def test_a_transfer_id_of_another_type_or_size_is_a_violation(transfer: Any) -> None:
    t = Transfers(100 * MIN_CHARGE, transfers=TRANSFERS)
    with pytest.raises(PartViolation, match="transfer id"):
        t.feed(transfer, MORE, b"x")
    assert (t.in_progress, t.buffered) == (0, 0)
    assert t.feed(1, MORE, b"x") is not None  # nothing of it stays


def test_unknown_reused_and_too_many_transfers_are_violations() -> None:
    t = Transfers(100 * MIN_CHARGE, transfers=TRANSFERS)
    assert t.feed(5, MORE, b"x") is not None
    assert t.feed(5, FINAL, b"y") is not None
    for reused in (5, 4, 1):  # ended, or never begun below the highest id seen
        with pytest.raises(PartViolation, match="unknown or ended"):
            t.feed(reused, MORE, b"x")
    with pytest.raises(PartViolation, match="no transfer in progress"):
        t.feed(6, FINAL, b"x")  # a final part begins no transfer
    with pytest.raises(PartViolation, match="ends a transfer in progress"):
        t.feed(7, ABORT, b"")
    opened = range(10, 10 + TRANSFERS)
    for transfer in opened:
        assert t.feed(transfer, MORE, b"x") is not None
    with pytest.raises(PartViolation, match="transfers at once"):
        t.feed(20, MORE, b"x")
    assert t.feed(20, MORE, b"x") is None  # the rest of the refused one: discarded unread
    assert t.feed(20, FINAL, b"x") is None
    with pytest.raises(PartViolation, match="unknown or ended"):
        t.feed(20, MORE, b"x")  # ended with its final part
    assert t.in_progress == TRANSFERS
    for transfer in opened:
        assert t.feed(transfer, ABORT, b"") is not None
    assert (t.in_progress, t.buffered, t.aborted) == (0, 0, TRANSFERS)


def test_a_violation_inside_a_transfer_discards_only_its_rest() -> None:
    t = Transfers(4 * MIN_CHARGE, transfers=TRANSFERS)
    assert t.feed(1, MORE, b"a") is not None
    assert t.feed(2, MORE, b"b") is not None
    with pytest.raises(PartViolation, match="exceeds"):
        t.feed(1, MORE, b"x" * 4 * MIN_CHARGE)
    assert t.feed(1, MORE, b"x") is None  # discarded to its end
    assert t.feed(1, FINAL, b"x") is None
    fed = t.feed(2, FINAL, b"c")
    assert fed is not None and fed[2] == b"bc"
    assert (t.in_progress, t.buffered) == (0, 0)


def test_parse_transfer_part_reads_what_encode_part_writes() -> None:
    for transfer in (1, 23, 24, 255, 256, 65536, 2**32, MAX_TRANSFER_ID):
        for chunk in (b"", b"abc", bytes(300)):
            encoded = encode_part(MORE, chunk, transfer)
            parsed = parse_transfer_part(encoded)
            assert parsed is not None and parsed[:2] == (MORE, transfer)
            assert parsed[2] == chunk and parsed[2].obj is encoded  # a view: no copy
            assert parse_part(encoded) is None
            assert parse_transfer_part(encode_part(MORE, chunk)) is None
    ok = encode_part(FINAL, b"abc", 300)
    for bad in (ok[:-1], ok + b"x", ok[:3], b"\x84\x08\x03" + ok[3:], b"\x84\x08\x00\x20\x43abc"):
        assert parse_transfer_part(bad) is None


def _parts(bodies: list[bytes]) -> list[tuple[int, int | None]]:
    """``(flags, transfer)`` of each part the sender issued."""
    parts: list[tuple[int, int | None]] = []
    for body in bodies:
        numbered = parse_transfer_part(body)
        if numbered is not None:
            parts.append((numbered[0], numbered[1]))
        else:
            plain = parse_part(body)
            assert plain is not None
            parts.append((plain[0], None))
    return parts


@pytest.mark.parametrize("interleave", [True, False])
async def test_two_transfers_take_turns_part_by_part(interleave: bool) -> None:
    """With transfer ids two sends alternate part by part; without (a peer that does not read
    them), the second waits for the first to end and its parts carry no id."""
    transport = _RecordingTransport()
    chunk = 16 * 1024
    sender = ChunkSender(
        transport, chunk, 4 * chunk, 16 * 1024 * 1024, transfers=TRANSFERS, clock=lambda: 0.0
    )
    if interleave:
        sender.read_ids(TRANSFERS)
    bodies = [os.urandom(8 * chunk), os.urandom(8 * chunk + 1)]
    async with anyio.create_task_group() as tg:
        for body in bodies:
            tg.start_soon(sender.send, body)
    parts = _parts(transport.bodies)
    ids = [transfer for _, transfer in parts]
    if interleave:
        assert ids == [1, 2] * 8
    else:
        assert ids == [None] * 16
        assert [flags for flags, _ in parts] == ([MORE] * 7 + [FINAL]) * 2
    receiver = Transfers(16 * 1024 * 1024, transfers=TRANSFERS)
    done = []
    for body, (_, transfer) in zip(transport.bodies, parts, strict=True):
        fed = receiver.feed(transfer, *_flags_chunk(body))
        assert fed is not None
        if fed[2] is not None:
            done.append(fed[2])
    assert sorted(done) == sorted(bodies)
    assert sender.active == 0


def _flags_chunk(body: bytes) -> tuple[int, memoryview]:
    numbered = parse_transfer_part(body)
    if numbered is not None:
        return numbered[0], numbered[2]
    plain = parse_part(body)
    assert plain is not None
    return plain


@pytest.mark.parametrize(("ours", "theirs"), [(4, 2), (2, 4), (3, 3)])
async def test_the_sender_runs_the_smaller_of_its_and_the_peers_transfers(
    ours: int, theirs: int
) -> None:
    """A sender whose peer said it holds ``theirs`` transfers at once runs at most
    ``min(ours, theirs)``: a receiver bounded by ``theirs`` refuses none of them."""
    transport = _RecordingTransport()
    chunk = 16 * 1024
    sender = ChunkSender(
        transport, chunk, 4 * chunk, 16 * 1024 * 1024, transfers=ours, clock=lambda: 0.0
    )
    sender.read_ids(theirs)
    assert sender.most == min(ours, theirs)
    peak = 0

    async def send(n: int) -> None:
        await sender.send(os.urandom(4 * chunk + n))

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, sender.active)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        async with anyio.create_task_group() as senders:
            for n in range(6):
                senders.start_soon(send, n)
        tg.cancel_scope.cancel()
    assert peak == min(ours, theirs)
    receiver = Transfers(16 * 1024 * 1024, transfers=theirs)
    most = 0
    for body in transport.bodies:
        numbered = parse_transfer_part(body)
        assert numbered is not None
        assert receiver.feed(numbered[1], numbered[0], numbered[2]) is not None
        most = max(most, receiver.in_progress)
    assert (receiver.completed, most) == (6, min(ours, theirs))


async def test_more_transfers_than_the_bound_wait_for_a_slot() -> None:
    transport = _RecordingTransport()
    chunk = 16 * 1024
    sender = ChunkSender(
        transport, chunk, 4 * chunk, 16 * 1024 * 1024, transfers=TRANSFERS, clock=lambda: 0.0
    )
    sender.read_ids(TRANSFERS)
    count = TRANSFERS + 2
    async with anyio.create_task_group() as tg:
        for n in range(count):
            tg.start_soon(sender.send, os.urandom(4 * chunk + n))
    receiver = Transfers(
        16 * 1024 * 1024, transfers=TRANSFERS
    )  # refuses a transfer beyond the bound: none here
    ids = []
    for body in transport.bodies:
        numbered = parse_transfer_part(body)
        assert numbered is not None
        ids.append(numbered[1])
        assert receiver.feed(numbered[1], numbered[0], numbered[2]) is not None
        assert receiver.in_progress <= TRANSFERS
    assert sorted(set(ids)) == list(range(1, count + 1))
    assert receiver.completed == count


class _FullTransport(_RecordingTransport):
    """Retention that has no room for an abort part sent without waiting."""

    def try_send(self, body: bytes | Gathered) -> int | None:
        return None


async def test_an_owed_abort_frees_its_slot_when_issued() -> None:
    transport = _FullTransport()
    chunk = 16 * 1024
    sender = ChunkSender(
        transport, chunk, 4 * chunk, 16 * 1024 * 1024, transfers=TRANSFERS, clock=lambda: 0.0
    )
    sender.read_ids(TRANSFERS)
    async with anyio.create_task_group() as tg:
        for _ in range(TRANSFERS):
            tg.start_soon(sender.send, os.urandom(4 * chunk))
        while sender.active < TRANSFERS:  # each began: issued its first part
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert sender.active == TRANSFERS  # every abort owed: every slot taken
    await sender.send(os.urandom(4 * chunk))  # issues the owed aborts, then goes
    assert sender.active == 0 and sender.aborts_sent == TRANSFERS
    receiver = Transfers(16 * 1024 * 1024, transfers=TRANSFERS)
    for body in transport.bodies:
        numbered = parse_transfer_part(body)
        assert numbered is not None
        assert receiver.feed(numbered[1], numbered[0], numbered[2]) is not None
    assert (receiver.aborted, receiver.completed, receiver.in_progress) == (TRANSFERS, 1, 0)


class Bulk(Protocol):
    async def echo(self, data: bytes) -> bytes: ...
    async def small(self, n: int) -> int: ...
    async def big(self, data: bytes) -> int: ...
    def blobs(self, n: int, size: int) -> AsyncIterator[bytes]: ...
    @gl.oneway
    async def put(self, data: bytes) -> None: ...


class BulkImpl:
    def __init__(self) -> None:
        self.ledger: list[str] = []
        self.put_done = anyio.Event()
        self.received: list[bytes] = []

    async def echo(self, data: bytes) -> bytes:
        self.ledger.append("echo")
        return data

    async def small(self, n: int) -> int:
        self.ledger.append(f"small:{n}")
        return n

    async def big(self, data: bytes) -> int:
        self.ledger.append("big")
        self.received.append(data)
        return len(data)

    async def blobs(self, n: int, size: int) -> AsyncIterator[bytes]:
        for i in range(n):
            yield bytes([i]) * size

    async def put(self, data: bytes) -> None:
        self.received.append(data)
        self.put_done.set()


async def _until(predicate: Any) -> None:
    while not predicate():
        await anyio.sleep(0.001)


@both_directions
async def test_large_bodies_round_trip_byte_exact(direction: Direction) -> None:
    impl = BulkImpl()
    payload = os.urandom(5 * CHUNK + 123)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            assert await bulk.echo(payload) == payload  # arguments and result in parts
            items = [item async for item in bulk.blobs(3, 3 * CHUNK)]
            assert items == [bytes([i]) * (3 * CHUNK) for i in range(3)]
            await bulk.put(payload)
            await impl.put_done.wait()
            assert impl.received == [payload]
            assert await bulk.echo(b"tiny") == b"tiny"  # small bodies: one message, as before
            ours = pair.rpc.statistics()
            theirs = pair.worker_rpc.statistics()
            # echo's arguments and the notification went out in 5 parts each (as many equal
            # parts as whole chunks fit)...
            assert ours.parts_sent == 10
            # ... the echo's result (5) and three stream items (3 each) came back in parts.
            assert (ours.parts_received, ours.transfers_received) == (14, 4)
            assert (theirs.parts_received, theirs.transfers_received) == (10, 2)
            assert theirs.part_buffered == ours.part_buffered == 0
            assert theirs.part_violations == ours.part_violations == 0


@both_directions
async def test_small_calls_overtake_a_large_transfer(direction: Direction) -> None:
    impl = BulkImpl()
    payload = os.urandom(64 * CHUNK)  # 64 parts, a window of 4
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            async with anyio.create_task_group() as tg:
                tg.start_soon(bulk.big, payload)
                await _until(lambda: rpc.statistics().parts_sent >= 1)
                for n in range(3):
                    assert await bulk.small(n) == n
            # The worker ran the small calls (issued after the first part) before the big one.
            assert impl.ledger == ["small:0", "small:1", "small:2", "big"]
            assert impl.received == [payload]


@both_directions
async def test_a_cut_mid_transfer_resumes_and_delivers_once(direction: Direction) -> None:
    impl = BulkImpl()
    payload = os.urandom(32 * CHUNK)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            result: list[int] = []

            async def big() -> None:
                result.append(await bulk.big(payload))

            async with anyio.create_task_group() as tg:
                tg.start_soon(big)
                await _until(lambda: rpc.statistics().parts_sent >= 3)
                await pair.executor.link.disconnect()
            assert result == [len(payload)]
            assert impl.received == [payload]  # exactly once, byte-exact
            assert impl.ledger == ["big"]
            assert pair.worker_rpc.statistics().part_buffered == 0


@both_directions
async def test_a_timeout_mid_transfer_is_not_dispatched_and_frees_the_buffer(
    direction: Direction,
) -> None:
    impl = BulkImpl()
    payload = os.urandom(64 * CHUNK)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK, proxy=True) as pair:
            assert pair.proxy is not None
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            worker_rpc = pair.worker_rpc
            async with anyio.create_task_group() as tg:

                async def heal_once_stalled() -> None:
                    await _until(lambda: rpc.statistics().parts_sent >= 2)
                    assert pair.proxy is not None
                    pair.proxy.blackhole()  # receipts stop: the sender waits on its window

                tg.start_soon(heal_once_stalled)
                with pytest.raises(gl.NotDispatched) as info:
                    await gl.with_options(bulk, timeout=0.5).big(payload)
            assert info.value.code == "TIMEOUT"
            pair.proxy.heal()
            await pair.wait_attached_again()
            # The abort part reaches the worker (replayed after the reconnect) and frees it.
            await _until(lambda: worker_rpc.statistics().transfers_aborted == 1)
            stats = worker_rpc.statistics()
            assert (stats.part_buffered, stats.transfers_received) == (0, 0)
            assert impl.ledger == []
            await pair.executor.wait_ready(5)
            assert pair.worker_rpc is worker_rpc  # the same session, resumed
            assert await bulk.small(7) == 7
            assert await bulk.echo(payload[: 3 * CHUNK]) == payload[: 3 * CHUNK]


# ---------------------------------------------------------------------------------- hostile


@both_directions
async def test_hostile_parts_are_dropped_and_the_session_stays(direction: Direction) -> None:
    impl = BulkImpl()
    limits = BULK.replace(max_frame_bytes=256 * 1024)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=limits) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            worker_rpc = pair.worker_rpc
            junk = os.urandom(60 * 1024)
            # Beyond the size limit in parts: dropped at the part that crosses it, the rest of
            # that transfer discarded unread; memory never above the limit.
            for _ in range(6):
                await raw_send(rpc, encode_part(MORE, junk))
            await raw_send(rpc, encode_part(FINAL, junk))
            # Malformed parts, an abort with nothing in progress.
            for bad in ([PART, 9, b"x"], [PART, MORE, "text"], [PART, ABORT, b""], [PART, 0]):
                await raw_send(rpc, bad)
            assert await bulk.small(1) == 1  # in order after all of the above
            stats = worker_rpc.statistics()
            # the oversize transfer (once), three malformed parts and the lone abort; the
            # two-element part is a malformed envelope (dropped as any other).
            assert stats.part_violations == 4
            assert stats.part_buffered == 0
            assert stats.transfers_received == 0
            assert impl.ledger == ["small:1"]


@both_directions
async def test_parts_do_not_nest(direction: Direction) -> None:
    """A call wrapped in a final part is never run: neither sent as one message (a transfer of
    one part) nor as the body of a transfer in two parts, in the usual encoding (refused before
    the body is joined) or another one (refused once decoded)."""
    import cbor2

    impl = BulkImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            assert await bulk.small(1) == 1
            worker_rpc = pair.worker_rpc

            def wrapped() -> bytes:
                return cbor2.dumps([CALL, next_call_id(rpc), "bulk", "small", [2], {}, 0, 0])

            await raw_send(rpc, encode_part(FINAL, wrapped()))
            # The chunk as an indefinite-length byte string: decoded generically.
            await raw_send(rpc, b"\x83\x08\x01\x5f" + cbor2.dumps(wrapped()) + b"\xff")
            body = encode_part(FINAL, wrapped())
            await raw_send(rpc, encode_part(MORE, body[:1]))
            await raw_send(rpc, encode_part(FINAL, body[1:]))
            # [8, 1, <call>] with a two-byte array head: the reassembler cannot tell it is a
            # part, the decoder can.
            call = wrapped()
            body = b"\x98\x03" + cbor2.dumps(PART) + cbor2.dumps(FINAL) + cbor2.dumps(call)
            await raw_send(rpc, encode_part(MORE, body[:5]))
            await raw_send(rpc, encode_part(FINAL, body[5:]))
            assert await bulk.small(3) == 3
            assert impl.ledger == ["small:1", "small:3"]
            stats = worker_rpc.statistics()
            assert (stats.parts_received, stats.part_violations) == (6, 4)
            assert stats.transfers_received == 1  # the last one was joined, then refused
            assert stats.part_buffered == 0


@both_directions
async def test_a_call_in_parts_cannot_reuse_an_id(direction: Direction) -> None:
    import cbor2

    impl = BulkImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            assert await bulk.small(1) == 1
            used = next_call_id(rpc) - 1  # the id small(1) used
            body = cbor2.dumps([CALL, used, "bulk", "big", [b"x" * (2 * CHUNK)], {}, 0, 0])
            await raw_send(rpc, encode_part(MORE, body[:CHUNK]))
            await raw_send(rpc, encode_part(FINAL, body[CHUNK:]))
            assert await bulk.small(2) == 2
            assert impl.ledger == ["small:1", "small:2"]  # the reused id never ran
            assert pair.worker_rpc.statistics().transfers_received == 1


@both_directions
async def test_calls_waiting_for_their_turn_to_send_parts_are_not_taken_for_id_reuse(
    direction: Direction,
) -> None:
    """Three large calls at once take turns; small calls issued while the later ones wait get
    higher ids and arrive first. Each large call is given a fresh id when its turn comes, so
    the worker, which requires ids to increase in arrival order, runs every one of them."""
    impl = BulkImpl()
    payloads = [os.urandom(8 * CHUNK + n) for n in range(3)]
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            sizes: list[int] = []

            async def big(payload: bytes) -> None:
                sizes.append(await bulk.big(payload))

            async with anyio.create_task_group() as tg:
                for payload in payloads:
                    tg.start_soon(big, payload)
                await _until(lambda: rpc.statistics().parts_sent >= 1)
                n = 0
                while len(sizes) < len(payloads):
                    assert await bulk.small(n) == n
                    n += 1
            assert sorted(sizes) == sorted(len(p) for p in payloads)
            assert sorted(impl.received) == sorted(payloads)
            assert pair.worker_rpc.statistics().transfers_received == 3


@both_directions
async def test_retirement_drops_a_partial_transfer(direction: Direction) -> None:
    impl = BulkImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            assert await bulk.small(1) == 1
            worker_rpc = pair.worker_rpc
            await raw_send(pair.rpc, encode_part(MORE, b"z" * CHUNK))
            await _until(lambda: worker_rpc.statistics().part_buffered == CHUNK)
            await pair.stop_controller()  # a graceful close retires the session on both ends
            await _until(lambda: worker_rpc.retired)
            assert worker_rpc.statistics().part_buffered == 0


def _nested(body: bytes, levels: int) -> bytes:
    """``body`` as the chunk of a final part, that part as the chunk of another, ``levels`` deep."""
    for _ in range(levels):
        body = encode_part(FINAL, body)
    return body


@pytest.mark.parametrize("hostile", ["controller", "worker"])
async def test_nested_parts_cost_no_more_than_a_flat_message(hostile: str) -> None:
    """One message ``[8, 1, <[8, 1, <...>]>]`` 32 levels deep costs what one message of that size
    costs (traced allocations, peak), in either role: each level is refused, never unwrapped."""
    impl = BulkImpl()
    size, levels = 1024 * 1024, 32
    nested = _nested(os.urandom(size), levels)
    flat = encode_part(FINAL, os.urandom(len(nested) - 8))
    assert abs(len(flat) - len(nested)) < 16
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            sender, receiver = pair.rpc, pair.worker_rpc
            if hostile == "worker":
                sender, receiver = receiver, sender
            peaks = []
            for message in (flat, nested):
                tracemalloc.start()
                try:
                    await raw_send(sender, message)
                    # In order behind the hostile message, both ways: once small(1) returned,
                    # the receiver has dispatched it.
                    assert await bulk.small(1) == 1
                    peaks.append(tracemalloc.get_traced_memory()[1])
                finally:
                    tracemalloc.stop()
            assert peaks[1] - peaks[0] < size // 2, peaks
            stats = receiver.statistics()
            # Each is a final part with no transfer in progress: refused, nothing reassembled.
            assert (stats.parts_received, stats.part_violations) == (2, 2)
            assert (stats.transfers_received, stats.part_buffered) == (0, 0)
            assert impl.ledger == ["small:1", "small:1"]


class _Witness(BulkImpl):
    """Records, as each large call begins, how many parts the serving side had received."""

    def __init__(self) -> None:
        super().__init__()
        self.parts_at_start: list[int] = []

    async def big(self, data: bytes) -> int:
        self.parts_at_start.append(current_rpc().statistics().parts_received)
        return await super().big(data)


@both_directions
@pytest.mark.parametrize("warm", [True, False])
async def test_two_large_calls_in_one_session_make_progress_together(
    direction: Direction, warm: bool
) -> None:
    """Two 64-part calls at once: their parts alternate, so when the first one is whole the
    other is nearly whole too (without transfer ids it would not have begun). On a fresh
    session the first transfer goes without an id until the peer's ``$link.parts`` arrives
    (a round trip into it); the second begins then, with one."""
    impl = _Witness()
    payloads = [os.urandom(64 * CHUNK), os.urandom(64 * CHUNK + 1)]
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            if warm:  # parts both ways: each side has read the other's $link.parts
                assert await bulk.echo(payloads[0][: 2 * CHUNK]) == payloads[0][: 2 * CHUNK]
                impl.received.clear()
            async with anyio.create_task_group() as tg:
                for payload in payloads:
                    tg.start_soon(bulk.big, payload)
            assert sorted(impl.received) == sorted(payloads)
            stats = pair.worker_rpc.statistics()
            assert (stats.transfers_received - warm, stats.part_violations) == (2, 0)
            assert (stats.transfers_in_progress, stats.part_buffered) == (0, 0)
            # The first call began after its 64th part and at least 60 of the other's (32
            # when the other waited for the peer's $link.parts).
            before = 2 if warm else 0
            assert impl.parts_at_start[0] - before >= (124 if warm else 96), impl.parts_at_start
            assert pair.rpc.statistics().transfers_sending == 0


@both_directions
async def test_two_large_results_in_one_session_make_progress_together(
    direction: Direction,
) -> None:
    """The same the other way: two 64-part results at once alternate, so when the first
    echo returns the caller holds most of the other result's parts too."""
    impl = BulkImpl()
    payloads = [os.urandom(64 * CHUNK), os.urandom(64 * CHUNK + 1)]
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc = pair.rpc
            assert await bulk.echo(payloads[0][: 2 * CHUNK]) == payloads[0][: 2 * CHUNK]
            before = rpc.statistics().parts_received
            seen: list[int] = []

            async def echo(payload: bytes) -> None:
                assert await bulk.echo(payload) == payload
                seen.append(rpc.statistics().parts_received - before)

            async with anyio.create_task_group() as tg:
                for payload in payloads:
                    tg.start_soon(echo, payload)
            assert seen[0] >= 120, seen
            stats = rpc.statistics()
            assert (stats.part_violations, stats.transfers_in_progress) == (0, 0)


class _Together(BulkImpl):
    """Echoes after the first hold their results until ``count`` echoes have begun, so the
    results go out together."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self._count = count
        self._begun = 0
        self._all = anyio.Event()

    async def echo(self, data: bytes) -> bytes:
        self._begun += 1
        if self._begun == self._count:
            self._all.set()
        elif self._begun > 1:
            await self._all.wait()
        return data


@both_directions
@pytest.mark.parametrize("smaller", ["worker", "controller"])
async def test_each_side_sends_no_more_transfers_than_the_peer_holds(
    direction: Direction, smaller: str
) -> None:
    """One side holds one transfer at a time (``bulk_transfers=1``), the other four: the
    ``$link.parts`` each sends carries its count, so three large echoes at once (arguments one
    way, results the other, released together) are never refused by either side."""
    one = BULK.replace(bulk_transfers=1)
    limits, worker_limits = (BULK, one) if smaller == "worker" else (one, BULK)
    impl = _Together(4)  # the warm-up echo, then the three
    payloads = [os.urandom(8 * CHUNK + n) for n in range(3)]
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"bulk": impl}, limits=limits, worker_limits=worker_limits
        ) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            # Parts both ways first: each side has read the other's $link.parts.
            assert await bulk.echo(payloads[0][: 2 * CHUNK]) == payloads[0][: 2 * CHUNK]
            results: list[bytes] = []

            async def echo(payload: bytes) -> None:
                results.append(await bulk.echo(payload))

            async with anyio.create_task_group() as tg:
                for payload in payloads:
                    tg.start_soon(echo, payload)
            assert sorted(results) == sorted(payloads)
            for stats in (pair.rpc.statistics(), pair.worker_rpc.statistics()):
                assert (stats.part_violations, stats.transfers_received) == (0, 4)


@both_directions
async def test_a_parts_notice_with_a_bad_count_is_dropped(direction: Direction) -> None:
    """A ``$link.parts`` whose count is not an integer >= 1 is dropped and counted; the side
    that got it keeps sending one transfer at a time, and the session serves on."""
    impl = BulkImpl()
    bad_counts: list[Any] = [0, -1, "4", True, 1.5, None, [4]]
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            for bad in bad_counts:
                await raw_send(pair.rpc, [NOTIFY, "$link", "parts", [bad], {}])
            assert await bulk.small(0) == 0  # in order behind the notices
            stats = pair.worker_rpc.statistics()
            assert (stats.malformed_envelopes, stats.notifications_dropped) == (
                len(bad_counts),
                0,
            )
            payload = os.urandom(8 * CHUNK)
            assert await bulk.echo(payload) == payload
            assert pair.worker_rpc.statistics().part_violations == 0


# Every CBOR major type and some sizes as a transfer id: each a part violation, nothing held.
_BAD_IDS = [
    0,
    MAX_TRANSFER_ID + 1,
    2**64 - 1,
    -1,
    b"\x01",
    "1",
    [1],
    {1: 1},
    1.5,
    True,
    [[[[[[[[1]]]]]]]],
]


@both_directions
async def test_hostile_transfer_ids_are_violations_and_the_session_stays(
    direction: Direction,
) -> None:
    import cbor2

    impl = BulkImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"bulk": impl}, limits=BULK) as pair:
            bulk = pair.executor.service("bulk", Bulk)
            rpc, worker_rpc = pair.rpc, pair.worker_rpc
            assert await bulk.small(0) == 0
            for bad in _BAD_IDS:
                await raw_send(rpc, [PART, MORE, bad, b"x"])
            await raw_send(rpc, [PART, MORE, cbor2.CBORTag(2, b"\x01" * 20), b"x"])  # a bignum
            # A null id is no id: a four-element part of the wrong shape (malformed).
            await raw_send(rpc, [PART, MORE, None, b"x"])
            stats = worker_rpc.statistics()
            base = len(_BAD_IDS) + 1
            # Ids out of turn: reused after an abort, below the highest seen, a final or an
            # abort part that begins nothing; one transfer more than the bound (its rest is
            # discarded unread).
            await raw_send(rpc, encode_part(MORE, b"y" * CHUNK, 1000))
            await raw_send(rpc, encode_part(ABORT, b"", 1000))
            await raw_send(rpc, encode_part(MORE, b"y", 1000))
            await raw_send(rpc, encode_part(MORE, b"y", 999))
            await raw_send(rpc, encode_part(FINAL, b"y", 1001))
            await raw_send(rpc, encode_part(ABORT, b"", 1002))
            for transfer in range(2000, 2000 + TRANSFERS + 1):
                await raw_send(rpc, encode_part(MORE, b"z" * CHUNK, transfer))
            await raw_send(rpc, encode_part(MORE, b"z", 2000 + TRANSFERS))  # discarded
            assert await bulk.small(1) == 1  # in order behind all of the above
            stats = worker_rpc.statistics()
            assert stats.part_violations == base + 5
            assert stats.malformed_envelopes == 1
            assert stats.transfers_in_progress == TRANSFERS
            assert stats.part_buffered == TRANSFERS * CHUNK
            for transfer in range(2000, 2000 + TRANSFERS):
                await raw_send(rpc, encode_part(ABORT, b"", transfer))
            assert await bulk.small(2) == 2
            stats = worker_rpc.statistics()
            assert (stats.transfers_in_progress, stats.part_buffered) == (0, 0)
            assert (stats.transfers_aborted, stats.transfers_received) == (1 + TRANSFERS, 0)
            assert impl.ledger == ["small:0", "small:1", "small:2"]
