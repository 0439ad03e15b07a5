"""Hostile part sequences at the receiver of bulk transfers (garcon_link.rpc.chunks.Transfers),
sans-IO: a peer interleaving transfers in any order, repeating, reusing and skipping ids,
sending parts past the limit, empty parts, finals and aborts with nothing in progress, parts of
a transfer that has ended, and fields of every wrong type.

Whatever the sequence, only :class:`PartViolation` is raised, what is held stays within its
bounds after every part (at most ``transfers + 1`` partial bodies, each charged at most the
limit), and a well-formed transfer interleaved with the hostile ones still yields its exact body.
"""

from __future__ import annotations

from typing import Any

from cbor_strategies import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from garcon_link.rpc.chunks import ABORT, FINAL, MIN_CHARGE, MORE, PartViolation, Transfers

LIMIT = 8 * MIN_CHARGE
TRANSFERS = 3

# Sizes at each boundary: empty, tiny (charged MIN_CHARGE), at and just past the limit.
_sizes = st.sampled_from([0, 1, MIN_CHARGE - 1, MIN_CHARGE, LIMIT - 1, LIMIT, LIMIT + 1])
_ids = st.one_of(
    st.none(),
    st.integers(1, 8),  # in progress, ended, reused, new
    st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64]),
    st.sampled_from([1.0, "1", b"\x01", [1], {1: 1}, True]),
)
_flags = st.one_of(
    st.sampled_from([MORE, MORE, MORE, FINAL, ABORT]),
    st.sampled_from([3, -1, 2**64, None, 1.0, "0", False]),
)
_chunks = st.one_of(
    _sizes.map(lambda n: b"\x42" * n),
    _sizes.map(lambda n: memoryview(b"\x42" * n)),
    st.sampled_from([None, "text", bytearray(b"x"), 7, [b"x"]]),
)
_parts = st.lists(st.tuples(_ids, _flags, _chunks), max_size=60)


def _check_bounds(t: Transfers) -> None:
    assert t.in_progress <= TRANSFERS + 1
    assert t.buffered <= (TRANSFERS + 1) * LIMIT


@given(parts=_parts, good_at=st.integers(0, 60))
@fuzz_settings(400)
def test_any_part_sequence_is_refused_part_by_part_within_bounds(
    parts: list[tuple[Any, Any, Any]], good_at: int
) -> None:
    t = Transfers(LIMIT, transfers=TRANSFERS)
    # A well-formed transfer with an id above any the hostile sequence uses, its parts spread
    # through it: its body arrives whole and exact whatever surrounds it (unless the hostile
    # parts hold every slot when it begins: then it is refused, as one more is).
    good_id, good = 1_000, [(MORE, b"a" * 100), (MORE, b"b" * 100), (FINAL, b"c")]
    schedule: list[tuple[Any, Any, Any]] = list(parts)
    for n, (flags, chunk) in enumerate(good):
        schedule.insert(min(good_at + n, len(schedule)), (good_id, flags, chunk))
    delivered: list[bytes] = []
    refused_good = False
    for transfer, flags, chunk in schedule:
        try:
            out = t.feed(transfer, flags, chunk)
        except PartViolation:
            if transfer == good_id and type(transfer) is int:
                refused_good = True
            out = None
        _check_bounds(t)
        if out is not None and out[2] is not None:
            assert len(out[2]) <= LIMIT
            if transfer == good_id and type(transfer) is int:
                delivered.append(out[2])
    if not refused_good:
        assert delivered == [b"a" * 100 + b"b" * 100 + b"c"]
    t.reset()
    assert t.buffered == 0 and t.in_progress == 0


def test_counts_just_over_each_limit_are_refused() -> None:
    t = Transfers(LIMIT, transfers=TRANSFERS)
    # TRANSFERS transfers at once are held; one more is refused, and its rest discarded.
    for transfer in range(1, TRANSFERS + 1):
        t.feed(transfer, MORE, b"x")
    try:
        t.feed(TRANSFERS + 1, MORE, b"x")
        raise AssertionError("one transfer more than allowed was begun")
    except PartViolation:
        pass
    assert t.feed(TRANSFERS + 1, MORE, b"x") is None  # discarded unread
    assert t.feed(TRANSFERS + 1, FINAL, b"x") is None
    # A transfer's charge at the limit is held; one byte more is refused.
    at = Transfers(LIMIT, transfers=TRANSFERS)
    at.feed(1, MORE, b"x" * (LIMIT - MIN_CHARGE))
    assert at.feed(1, FINAL, b"x" * MIN_CHARGE) is not None
    over = Transfers(LIMIT, transfers=TRANSFERS)
    over.feed(1, MORE, b"x" * (LIMIT - MIN_CHARGE))
    try:
        over.feed(1, FINAL, b"x" * (MIN_CHARGE + 1))
        raise AssertionError("a transfer past the limit was completed")
    except PartViolation:
        pass
    assert over.buffered == 0
    # Tiny parts are charged MIN_CHARGE each: LIMIT // MIN_CHARGE of them, then refused.
    tiny = Transfers(LIMIT, transfers=TRANSFERS)
    for _ in range(LIMIT // MIN_CHARGE):
        tiny.feed(1, MORE, b"x")
    try:
        tiny.feed(1, MORE, b"x")
        raise AssertionError("tiny parts past the charge were held")
    except PartViolation:
        pass
    assert tiny.buffered == 0
