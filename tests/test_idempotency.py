"""Tests of garcon_link.rpc.idempotency: keys, the worker's table, its runner, the caller's retry.

The table is pure: every test here drives it with an explicit ``now`` (an injected clock), never
a sleep. The runner (:class:`KeyedExecutions`) is tested with a task group as its spawner and a
fake clock. What ran is counted by the handler itself (a ledger), never inferred from timing.
End-to-end tests over loopback are in ``tests/test_idempotency_remote.py``.
"""

from __future__ import annotations

from typing import Any

import anyio
import cbor2
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import garcon_link as gl
from garcon_link.api.keyed import retry_delays
from garcon_link.rpc import rpc
from garcon_link.rpc.envelopes import ERROR, RESULT, encode_reply
from garcon_link.rpc.idempotency import (
    ENTRY_OVERHEAD,
    MAX_KEY_BYTES,
    STAND_IN_RESERVE,
    Await,
    Conflict,
    Entry,
    EntryState,
    Execute,
    Full,
    IdempotencyTable,
    KeyedExecutions,
    Replay,
    arguments_digest,
    normalize_key,
)

D1 = arguments_digest([1, 2], {})
D2 = arguments_digest([1, 3], {})


def key(n: int) -> tuple[str, str, bytes]:
    return ("calc", "add", f"k{n}".encode())


def base(k: tuple[str, str, bytes]) -> int:
    return ENTRY_OVERHEAD + len(k[0]) + len(k[1]) + len(k[2]) + 32


def executed(decision: object) -> Entry:
    assert isinstance(decision, Execute), decision
    return decision.entry


# ---------------------------------------------------------------------------------- keys


def test_keys_are_str_or_bytes_of_1_to_128_bytes() -> None:
    assert normalize_key("build-42") == b"build-42"
    assert normalize_key(b"\x00\xff") == b"\x00\xff"
    assert normalize_key("é" * 64) == ("é" * 64).encode()  # 128 bytes of UTF-8
    assert normalize_key(b"x" * MAX_KEY_BYTES) == b"x" * 128
    with pytest.raises(ValueError, match="1 to 128 bytes"):
        normalize_key("é" * 65)  # 65 characters, 130 bytes
    with pytest.raises(ValueError, match="got 0"):
        normalize_key("")
    for bad in (42, None, bytearray(b"x"), ["k"]):
        with pytest.raises(TypeError, match="str or bytes"):
            normalize_key(bad)


def test_the_digest_covers_args_and_kwargs_canonically() -> None:
    assert arguments_digest([1], {"a": 1, "b": 2}) == arguments_digest([1], {"b": 2, "a": 1})
    assert arguments_digest([1], {}) != arguments_digest([], {"a": 1})
    assert arguments_digest([1, 2], {}) != arguments_digest([2, 1], {})


def test_a_recorded_reply_is_replayed_as_a_well_formed_envelope() -> None:
    assert (RESULT, ERROR) == (rpc.RESULT, rpc.ERROR)
    body = cbor2.dumps({"x": [1, 2]})
    assert cbor2.loads(encode_reply(RESULT, 1234567, body)) == [RESULT, 1234567, {"x": [1, 2]}]


def test_retry_delays_double_up_to_the_cap() -> None:
    delays = retry_delays(0.05, 1.0)
    assert [next(delays) for _ in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


# ---------------------------------------------------------------------------------- the table


def test_execute_then_await_then_replay_then_conflict() -> None:
    table = IdempotencyTable(10, 1 << 20, 60.0)
    entry = executed(table.begin(key(1), D1, now=0.0))
    assert entry.state is EntryState.RUNNING
    assert table.begin(key(1), D1, now=1.0) == Await(entry)
    assert table.begin(key(1), D2, now=1.0) == Conflict(entry)
    recorded = table.finish(entry, (RESULT, cbor2.dumps(3)), now=2.0)
    assert recorded == (RESULT, cbor2.dumps(3))
    assert table.begin(key(1), D1, now=3.0) == Replay(entry)
    assert table.begin(key(1), D2, now=3.0) == Conflict(entry)  # finished: still a conflict
    # The same key on another method (or service) is another entry.
    other = ("calc", "mul", b"k1")
    assert isinstance(table.begin(other, D1, now=3.0), Execute)
    stats = table.statistics()
    assert (stats.executions, stats.waits, stats.replays, stats.conflicts) == (2, 1, 1, 2)
    assert (stats.entries, stats.running) == (2, 1)


def test_finished_entries_are_evicted_oldest_finished_first_never_running_ones() -> None:
    table = IdempotencyTable(3, 1 << 20, 60.0)
    a = executed(table.begin(key(1), D1, 0.0))
    b = executed(table.begin(key(2), D1, 1.0))
    c = executed(table.begin(key(3), D1, 2.0))
    # Full of running entries: a new key is refused, nothing is evicted.
    assert isinstance(table.begin(key(4), D1, 3.0), Full)
    assert table.statistics().refusals == 1
    # Finish in the order c, a (b keeps running): c finished first, so c goes first.
    table.finish(c, (RESULT, b"\x01"), 4.0)
    table.finish(a, (RESULT, b"\x01"), 5.0)
    executed(table.begin(key(4), D1, 6.0))
    assert table.get(key(3)) is None and table.get(key(1)) is a
    executed(table.begin(key(5), D1, 7.0))
    assert table.get(key(1)) is None and table.get(key(2)) is b  # b runs: kept
    assert isinstance(table.begin(key(6), D1, 8.0), Full)
    assert len(table) == 3 and table.statistics().evictions == 2
    # An evicted key runs again.
    assert isinstance(table.begin(key(3), D1, 9.0), Full)  # (still full of running ones)
    table.finish(b, (RESULT, b"\x01"), 9.5)
    assert isinstance(table.begin(key(3), D1, 10.0), Execute)


def test_bytes_bound_evicts_finished_entries_and_keeps_a_stand_in_when_a_reply_cannot_fit() -> None:
    k1, k2 = key(1), key(2)
    room = base(k1) + STAND_IN_RESERVE
    table = IdempotencyTable(100, 2 * room + 100, 60.0)
    a = executed(table.begin(k1, D1, 0.0))
    b = executed(table.begin(k2, D1, 0.0))
    assert table.statistics().bytes == 2 * room
    # A reply of 300 bytes needs 44 more than a's reservation: it fits in the last 100.
    table.finish(a, (RESULT, b"\x00" * 300), 1.0)
    assert table.statistics().bytes == room + base(k1) + 300 <= table.max_bytes
    # b's reply is larger than what is left and nothing finished can be evicted except a,
    # which goes first; then it fits.
    table.finish(b, (RESULT, b"\x00" * 350), 2.0)
    assert table.get(k1) is None and table.statistics().evictions == 1
    assert b.reply == (RESULT, b"\x00" * 350)
    # A reply larger than the whole bound: the stand-in says it ran, and is never re-run.
    c = executed(table.begin(key(3), D1, 3.0))
    recorded = table.finish(c, (RESULT, b"\x00" * 10_000), 4.0)
    assert recorded[0] == ERROR
    body = cbor2.loads(recorded[1])
    assert body["outcome"] == "failed" and body["code"] == "RESULT_NOT_KEPT"
    assert "10000 bytes" in body["message"]
    assert isinstance(table.begin(key(3), D1, 5.0), Replay)
    assert table.statistics().not_kept == 1
    assert table.statistics().bytes <= table.max_bytes


def test_age_forgets_finished_entries_after_max_age_and_the_key_runs_again() -> None:
    table = IdempotencyTable(100, 1 << 20, 10.0)
    a = executed(table.begin(key(1), D1, 0.0))
    b = executed(table.begin(key(2), D1, 0.0))
    table.finish(a, (RESULT, b"\x01"), 1.0)
    assert isinstance(table.begin(key(1), D1, 10.9), Replay)
    assert isinstance(table.begin(key(1), D1, 11.0), Execute)  # 10 s after it finished
    # A running entry is never aged out, however old.
    assert table.begin(key(2), D1, 1_000.0) == Await(b)


def test_abandon_forgets_an_unstarted_entry_and_finish_checks_its_entry() -> None:
    table = IdempotencyTable(100, 1 << 20, 10.0)
    a = executed(table.begin(key(1), D1, 0.0))
    table.abandon(a)
    assert len(table) == 0 and table.statistics().bytes == 0
    with pytest.raises(ValueError, match="not a running entry"):
        table.finish(a, (RESULT, b"\x01"), 1.0)
    b = executed(table.begin(key(1), D1, 1.0))
    table.finish(b, (RESULT, b"\x01"), 1.0)
    with pytest.raises(ValueError, match="not a running entry"):
        table.finish(b, (RESULT, b"\x01"), 1.0)
    with pytest.raises(ValueError, match="not a running entry"):
        table.abandon(b)


class TableMachine(RuleBasedStateMachine):
    """Any interleaving of begin/finish/abandon and time: the bounds always hold, running entries
    are never lost, and no finished entry outlives max_age."""

    def __init__(self) -> None:
        super().__init__()
        self.table = IdempotencyTable(max_entries=5, max_bytes=3_000, max_age=10.0)
        self.now = 0.0
        self.running: list[Entry] = []

    @rule(n=st.integers(0, 12), same=st.booleans())
    def begin(self, n: int, same: bool) -> None:
        decision = self.table.begin(key(n), D1 if same else D2, self.now)
        if isinstance(decision, Execute):
            self.running.append(decision.entry)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), size=st.integers(0, 4_000))
    def finish(self, i: int, size: int) -> None:
        entry = self.running.pop(i % len(self.running))
        self.table.finish(entry, (RESULT, b"\x00" * size), self.now)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def abandon(self, i: int) -> None:
        self.table.abandon(self.running.pop(i % len(self.running)))

    @rule(dt=st.floats(0, 6))
    def advance(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def bounded(self) -> None:
        table = self.table
        entries = table.entries()
        assert len(entries) <= table.max_entries
        assert table.statistics().bytes == sum(e.size for e in entries) <= table.max_bytes

    @invariant()
    def running_entries_are_kept(self) -> None:
        for entry in self.running:
            assert self.table.get(entry.key) is entry
            assert entry.state is EntryState.RUNNING

    @invariant()
    def nothing_outlives_max_age(self) -> None:
        self.table.expire(self.now)
        for entry in self.table.entries():
            if entry.finished_at is not None:
                assert self.now - entry.finished_at < self.table.max_age


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


# ---------------------------------------------------------------------------------- the runner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def limits(**changes: Any) -> gl.Limits:
    return gl.Limits().replace(**changes)


@pytest.mark.anyio
async def test_waiters_on_a_running_entry_get_the_one_execution_s_reply() -> None:
    clock = Clock()
    ran: list[int] = []
    release = anyio.Event()

    async def handler() -> tuple[int, bytes]:
        ran.append(1)
        await release.wait()
        return RESULT, cbor2.dumps("done")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            keyed = KeyedExecutions(limits(), tg.start_soon, clock=clock)
            first = keyed.admit(key(1), D1)
            assert isinstance(first, Execute)
            keyed.start(first.entry, handler)
            replies: list[tuple[int, bytes]] = []

            async def waiter() -> None:
                decision = keyed.admit(key(1), D1)
                assert isinstance(decision, Await | Replay)
                replies.append(await keyed.wait(decision.entry))

            for _ in range(3):
                tg.start_soon(waiter)
            while len(ran) < 1 or keyed.statistics().waits < 3:
                await anyio.lowlevel.checkpoint()
            assert replies == []
            release.set()
        assert replies == [(RESULT, cbor2.dumps("done"))] * 3
        assert ran == [1]
        # Finished: a repeat is answered from the record at once, not run.
        clock.now = 100.0
        again = keyed.admit(key(1), D1)
        assert isinstance(again, Replay)
        assert await keyed.wait(again.entry) == (RESULT, cbor2.dumps("done"))
        assert ran == [1]


@pytest.mark.anyio
async def test_cancel_before_start_forgets_the_key_and_while_running_records_unknown() -> None:
    ran: list[str] = []

    async def handler() -> tuple[int, bytes]:
        ran.append("started")
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            keyed = KeyedExecutions(limits(), tg.start_soon, clock=Clock())
            early = keyed.admit(key(1), D1)
            assert isinstance(early, Execute)
            keyed.start(early.entry, handler)
            keyed.cancel(early.entry)  # before its task ran
            kind, body = await keyed.wait(early.entry)
            assert (kind, cbor2.loads(body)["code"]) == (ERROR, "CANCELLED")
            assert cbor2.loads(body)["outcome"] == "not_dispatched"
            assert ran == [] and keyed.table.get(key(1)) is None

            late = keyed.admit(key(1), D1)
            assert isinstance(late, Execute)  # forgotten: it runs this time
            keyed.start(late.entry, handler)
            while not ran:
                await anyio.lowlevel.checkpoint()
            keyed.cancel(late.entry)
            kind, body = await keyed.wait(late.entry)
            assert cbor2.loads(body)["outcome"] == "unknown"
            assert cbor2.loads(body)["code"] == "CANCELLED_WHILE_RUNNING"
            assert isinstance(keyed.admit(key(1), D1), Replay)  # recorded: never run again
            assert ran == ["started"]
