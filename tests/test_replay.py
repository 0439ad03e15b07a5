"""The replay of one attachment (:class:`garcon_link.core.replay.ReplayWatch`), without sockets
or a clock (docs/design.md#transport)."""

from __future__ import annotations

import itertools

import pytest

from garcon_link.core.replay import ReplayWatch

INACTIVITY = 10.0
TARGET = 5


@pytest.mark.parametrize(
    ("progress", "fence_passed", "confirmed"),
    list(itertools.product((False, True), (False, True), (TARGET - 1, TARGET, TARGET + 1))),
)
def test_one_message_finishes_the_replay_only_past_the_fence_and_the_target(
    progress: bool, fence_passed: bool, confirmed: int
) -> None:
    watch = ReplayWatch(TARGET, 100.0, INACTIVITY)
    finished = watch.observe(progress, fence_passed=fence_passed, confirmed=confirmed, now=103.0)
    assert finished == (fence_passed and confirmed >= TARGET)
    assert watch.done == finished
    # Progress restarts the inactivity clock; anything else leaves it where it was.
    assert watch.deadline == (103.0 if progress else 100.0) + INACTIVITY


def test_finished_once_then_inert() -> None:
    watch = ReplayWatch(TARGET, 0.0, INACTIVITY)
    assert watch.observe(True, fence_passed=True, confirmed=TARGET, now=1.0)
    assert not watch.observe(True, fence_passed=True, confirmed=TARGET, now=2.0)
    assert watch.done and watch.deadline == 1.0 + INACTIVITY


def test_a_fresh_attachment_with_nothing_issued_finishes_at_the_fence() -> None:
    watch = ReplayWatch(0, 0.0, INACTIVITY)
    assert not watch.observe(False, fence_passed=False, confirmed=0, now=1.0)
    assert watch.observe(False, fence_passed=True, confirmed=0, now=2.0)  # a stale fence


def test_no_progress_keeps_the_deadline_restart_moves_it() -> None:
    watch = ReplayWatch(TARGET, 0.0, INACTIVITY)
    for now in (1.0, 5.0, 9.0):  # heartbeats, duplicates, stale receipts
        assert not watch.observe(False, fence_passed=True, confirmed=2, now=now)
    assert watch.deadline == INACTIVITY
    watch.restart(30.0)  # our consumer held the reader until then
    assert watch.deadline == 30.0 + INACTIVITY
    assert not watch.done


def test_stop_ends_the_watch() -> None:
    watch = ReplayWatch(TARGET, 0.0, INACTIVITY)
    watch.stop()
    assert watch.done
    assert not watch.observe(True, fence_passed=True, confirmed=TARGET, now=1.0)
