"""The heartbeat policy (:func:`garcon_link.core.heartbeat.heartbeat_step`), without sockets or a
clock (docs/design.md#link).

A table, written out row by row as the rules read, is checked against every combination of the
step's inputs: each combination must give exactly the action of the first row whose conditions
it meets, and every row must be reached by some combination (no dead rows). The inputs:

* ``keys`` -- no keyring, a key re-check due now, or one due later;
* ``reading`` -- a read of the socket is in progress (silence can be judged);
* ``silence`` -- since the last inbound frame: well within both sides' quiet period, past the
  dialer's but within the listener's, exactly this side's quiet period, past it, or exactly the
  timeout;
* ``ping_due`` -- the next ping is due now (exactly at ``now``) or later;
* ``busy`` -- a write is in progress;
* ``dialer`` -- this side dialed the socket (its quiet period is shorter).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from garcon_link.core.heartbeat import (
    HeartbeatAction,
    Ping,
    RecheckKey,
    SleepUntil,
    Timeout,
    heartbeat_step,
    quiet_period,
)
from garcon_link.limits import Limits

INTERVAL = 1.0
TIMEOUT = 4.0
RECHECK = 3.0
LIMITS = Limits(
    heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, key_recheck_interval=RECHECK
)
NOW = 100.0
SILENCES = ("recent", "between", "at_quiet", "long", "at_timeout")


@dataclass(frozen=True)
class Case:
    keys: str  # "none" | "due" | "later"
    reading: bool
    silence: str  # one of SILENCES
    ping_due: bool
    busy: bool
    dialer: bool

    @property
    def quiet(self) -> float:
        return quiet_period(LIMITS, dialer=self.dialer)

    @property
    def silent(self) -> float:
        return {
            "recent": 0.5,
            "between": 1.2,
            "at_quiet": self.quiet,
            "long": 2.0,
            "at_timeout": TIMEOUT,
        }[self.silence]

    @property
    def last_inbound(self) -> float:
        return NOW - self.silent

    @property
    def next_ping(self) -> float:
        return NOW if self.ping_due else NOW + 0.7

    @property
    def next_key_check(self) -> float | None:
        return {"none": None, "due": NOW, "later": NOW + 2.5}[self.keys]

    @property
    def deadline(self) -> float:
        return self.last_inbound + TIMEOUT if self.reading else NOW + TIMEOUT

    def wake(self, next_ping: float) -> float:
        wake = min(next_ping, self.deadline)
        key = self.next_key_check
        return wake if key is None else min(wake, key)

    def step(self) -> HeartbeatAction:
        return heartbeat_step(
            NOW,
            reading=self.reading,
            last_inbound=self.last_inbound,
            busy=self.busy,
            next_ping=self.next_ping,
            next_key_check=self.next_key_check,
            quiet=self.quiet,
            limits=LIMITS,
        )


def all_cases() -> list[Case]:
    return [
        Case(*values)
        for values in itertools.product(
            ("none", "due", "later"),
            (False, True),
            SILENCES,
            (False, True),
            (False, True),
            (False, True),
        )
    ]


# The outcomes, each as the rule words it.
def recheck_key(case: Case) -> HeartbeatAction:
    return RecheckKey(NOW + RECHECK)


def time_out(case: Case) -> HeartbeatAction:
    return Timeout(case.silent)


def wait(case: Case) -> HeartbeatAction:  # nothing due: keep the ping time
    return SleepUntil(case.next_ping, case.wake(case.next_ping))


def hold_ping(case: Case) -> HeartbeatAction:  # the peer spoke lately: look again after quiet
    next_ping = case.last_inbound + case.quiet
    return SleepUntil(next_ping, case.wake(next_ping))


def skip_ping(case: Case) -> HeartbeatAction:  # a write is in progress: no ping this interval
    next_ping = NOW + INTERVAL
    return SleepUntil(next_ping, case.wake(next_ping))


def ping(case: Case) -> HeartbeatAction:  # bounded by the silence deadline
    next_ping = NOW + INTERVAL
    return Ping(next_ping, case.deadline - NOW, case.wake(next_ping))


ANY = object()
LATER = ("none", "later")  # a set of values: the column matches any of them

# (keys, reading, silence, ping_due, busy, dialer) -> outcome; first match wins.
TABLE: list[tuple[tuple[Any, ...], Callable[[Case], HeartbeatAction]]] = [
    # A due key re-check comes first (the caller steps again with the same now).
    (("due", ANY, ANY, ANY, ANY, ANY), recheck_key),
    # Silence is judged only while reading; the timeout is inclusive.
    ((LATER, True, "at_timeout", ANY, ANY, ANY), time_out),
    # No ping due: sleep until the next ping, the silence deadline or the key re-check.
    ((LATER, ANY, ANY, False, ANY, ANY), wait),
    # A ping due, but the peer spoke within this side's quiet period (the listener's is longer).
    ((LATER, True, "recent", True, ANY, ANY), hold_ping),
    ((LATER, True, "between", True, ANY, False), hold_ping),
    # A ping due, and a write in progress: none queued behind it.
    ((LATER, ANY, ANY, True, True, ANY), skip_ping),
    # A ping due: the peer was quiet for at least the quiet period, or is not being read.
    ((LATER, ANY, ANY, True, False, ANY), ping),
]


def matches(pattern: object, value: object) -> bool:
    if pattern is ANY:
        return True
    if isinstance(pattern, tuple):
        return value in pattern
    return pattern == value


def expected(case: Case) -> tuple[int, HeartbeatAction]:
    values = (case.keys, case.reading, case.silence, case.ping_due, case.busy, case.dialer)
    for index, (pattern, outcome) in enumerate(TABLE):
        if all(matches(p, v) for p, v in zip(pattern, values, strict=True)):
            return index, outcome(case)
    raise AssertionError(f"no row of the table covers {case}")


CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_heartbeat_step_follows_the_table(case: Case) -> None:
    _row, action = expected(case)
    assert case.step() == action


def test_every_row_of_the_table_is_reached() -> None:
    reached = {expected(case)[0] for case in CASES}
    assert reached == set(range(len(TABLE))), sorted(set(range(len(TABLE))) - reached)


def test_the_table_covers_every_combination() -> None:
    assert len(CASES) == 3 * 2 * len(SILENCES) * 2 * 2 * 2


@pytest.mark.parametrize("case", [c for c in CASES if c.keys == "due"], ids=str)
def test_after_a_key_recheck_the_same_turn_goes_on(case: Case) -> None:
    """The caller steps again with the same ``now`` and the new re-check time: the turn then
    gives what a keyring whose re-check is not due would."""
    first = case.step()
    assert isinstance(first, RecheckKey)
    again = heartbeat_step(
        NOW,
        reading=case.reading,
        last_inbound=case.last_inbound,
        busy=case.busy,
        next_ping=case.next_ping,
        next_key_check=first.next_key_check,
        quiet=case.quiet,
        limits=LIMITS,
    )
    assert not isinstance(again, RecheckKey)
    assert type(again) is type(expected(Case(**{**vars(case), "keys": "later"}))[1])


def test_the_wake_time_is_never_in_the_past_unless_a_deadline_is() -> None:
    for case in CASES:
        action = case.step()
        if isinstance(action, Ping | SleepUntil):
            assert action.wake >= min(NOW, case.deadline), case
        if isinstance(action, Ping):
            assert action.within >= 0


def test_quiet_period_dialer_one_interval_listener_shorter_than_its_timeout() -> None:
    assert quiet_period(LIMITS, dialer=True) == INTERVAL
    assert quiet_period(LIMITS, dialer=False) == 1.5 * INTERVAL
    # A timeout close to the interval: the listener pings halfway between the two.
    tight = Limits(heartbeat_interval=1.0, heartbeat_timeout=1.2)
    assert quiet_period(tight, dialer=False) == pytest.approx(1.1)
    assert quiet_period(tight, dialer=True) == 1.0


def test_an_idle_socket_carries_one_ping_per_interval_from_the_dialer_only() -> None:
    """Both sides stepped on a simulated clock; a ping is answered (a pong is an inbound frame
    for the pinging side; the ping itself is one for the other side) at once."""
    now = 0.0
    last_inbound = {True: 0.0, False: 0.0}
    next_ping = {True: INTERVAL, False: INTERVAL}
    wake = {True: 0.0, False: 0.0}
    pings = {True: 0, False: 0}
    while now < 20.0:
        for dialer in (True, False):
            if wake[dialer] > now:
                continue
            action = heartbeat_step(
                now,
                reading=True,
                last_inbound=last_inbound[dialer],
                busy=False,
                next_ping=next_ping[dialer],
                next_key_check=None,
                quiet=quiet_period(LIMITS, dialer=dialer),
                limits=LIMITS,
            )
            assert isinstance(action, Ping | SleepUntil), action
            next_ping[dialer] = action.next_ping
            wake[dialer] = action.wake
            if isinstance(action, Ping):
                pings[dialer] += 1
                last_inbound[dialer] = last_inbound[not dialer] = now
        now = min(wake.values())
    assert pings[False] == 0
    assert 19 <= pings[True] <= 20
