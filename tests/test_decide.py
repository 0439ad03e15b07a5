"""The admission decision (:func:`garcon_link.core.admission.decide`), without sockets
(docs/design.md#admission).

A decision table, written out row by row as the design states the rules, is checked against
every combination of the function's inputs: each combination must match exactly the first row
whose conditions it meets, and every row must be reached by some combination (no dead rows). The
inputs:

* ``closing`` -- the link is shutting down;
* ``session`` -- the slot holds no live session, the session the handshake settled on, or another;
* ``attached`` -- a socket carries the slot's session (only with a session);
* ``runtime`` -- the handshake's peer runtime is the one the slot's session belongs to, or another;
* ``resume`` -- the handshake's resume rule held (both advertised the same session);
* ``taken_over`` -- the peer's runtime is one whose session another runtime took over;
* ``admitting`` -- another socket of the same executor is being admitted;
* ``probe`` -- not probed, the attached socket answered the probe, or it did not;
* ``full`` -- the controller dimension: other controllers' slots (a listening worker keeps one
  slot per controller) hold every place for a session. Another controller's session, attached or
  not, is in another slot: it never reaches this slot's view but through ``full``, so a second
  controller is admitted at once (``NEW``), never probed (the last test shows it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest

from garcon_link.core import admission
from garcon_link.core.admission import (
    Decision,
    Fresh,
    Offer,
    Probe,
    Refuse,
    Resume,
    SlotView,
    decide,
)
from garcon_link.errors import FailureReason, HandshakeFailure

OFFERED = b"S" * 32
OTHER_SESSION = b"T" * 32
RUNTIME = b"r" * 16
OTHER_RUNTIME = b"q" * 16


@dataclass(frozen=True)
class Case:
    closing: bool
    session: str  # "none" | "offered" | "other"
    attached: bool
    runtime: str  # "same" | "other"
    resume: bool
    taken_over: bool
    admitting: bool
    probe: bool | None
    full: bool = False

    def slot(self) -> SlotView:
        if self.session == "none":
            return SlotView(closing=self.closing, admitting=self.admitting, full=self.full)
        return SlotView(
            closing=self.closing,
            session=OFFERED if self.session == "offered" else OTHER_SESSION,
            peer_runtime=RUNTIME if self.runtime == "same" else OTHER_RUNTIME,
            attached=self.attached,
            admitting=self.admitting,
            full=self.full,
        )

    def offer(self) -> Offer:
        return Offer(
            resume=self.resume, session=OFFERED, runtime=RUNTIME, taken_over=self.taken_over
        )


def all_cases() -> list[Case]:
    cases = []
    for (
        closing,
        session,
        attached,
        runtime,
        resume,
        taken_over,
        admitting,
        probe,
        full,
    ) in itertools.product(
        (False, True),
        ("none", "offered", "other"),
        (False, True),
        ("same", "other"),
        (False, True),
        (False, True),
        (False, True),
        (None, True, False),
        (False, True),
    ):
        if session == "none" and (attached or runtime == "other"):
            continue  # without a session there is no socket and no runtime to compare
        cases.append(
            Case(closing, session, attached, runtime, resume, taken_over, admitting, probe, full)
        )
    return cases


ANY = object()
CLOSED = Refuse(FailureReason.CLOSED, "shutting down")
TAKEN = Refuse(HandshakeFailure.TAKEN_OVER, "another process with this executor id took over")
CHANGED = Refuse(HandshakeFailure.SUPERSEDED, "session changed during the handshake; retry")
HEALTHY = Refuse(HandshakeFailure.SUPERSEDED, "another peer holds a healthy session")
BUSY = Refuse(HandshakeFailure.SUPERSEDED, "another socket of this executor is being admitted")
FULL = Refuse(
    HandshakeFailure.CONTROLLERS_FULL,
    "this worker holds sessions for max_controllers controllers; retry later",
)

NEW = Fresh(retire_current=False, taken_over=False)
REPLACE = Fresh(retire_current=True, taken_over=False)
TAKEOVER = Fresh(retire_current=True, taken_over=True)

# (closing, taken_over, admitting, resume, session, attached, runtime, probe, full) -> decision;
# first match wins.
TABLE: list[tuple[tuple[Any, ...], Decision]] = [
    # Shutting down refuses everything, before anything else is looked at.
    ((True, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY), CLOSED),
    # A runtime that was taken over never gets back in (two processes claim one id: 4009).
    ((False, True, ANY, ANY, ANY, ANY, ANY, ANY, ANY), TAKEN),
    # One admission per executor at a time: another socket finishing its handshake meanwhile
    # is refused at once (a key holder cannot queue sockets behind the first one).
    ((False, False, True, ANY, ANY, ANY, ANY, ANY, ANY), BUSY),
    # Resume: only the very session the slot holds; the attached socket, if any, steps aside.
    ((False, False, False, True, "none", ANY, ANY, ANY, ANY), CHANGED),
    ((False, False, False, True, "other", ANY, ANY, ANY, ANY), CHANGED),
    ((False, False, False, True, "offered", False, ANY, ANY, ANY), Resume(False)),
    ((False, False, False, True, "offered", True, ANY, ANY, ANY), Resume(True)),
    # Fresh with nothing held: admitted, unless other controllers hold every place (1013).
    ((False, False, False, False, "none", ANY, ANY, ANY, True), FULL),
    ((False, False, False, False, "none", ANY, ANY, ANY, False), NEW),
    # Fresh from the same runtime (it lost its state): replace, no probe, no takeover.
    ((False, False, False, False, ANY, ANY, "same", ANY, ANY), REPLACE),
    # Fresh from another runtime while a socket is attached: the takeover rule.
    ((False, False, False, False, ANY, True, "other", None, ANY), Probe()),
    ((False, False, False, False, ANY, True, "other", True, ANY), HEALTHY),
    ((False, False, False, False, ANY, True, "other", False, ANY), TAKEOVER),
    # Fresh from another runtime, nothing attached (a restarted peer): replace; the old
    # runtime is remembered as taken over.
    ((False, False, False, False, ANY, False, "other", ANY, ANY), TAKEOVER),
]


def expected(case: Case) -> tuple[int, Decision]:
    values = (
        case.closing,
        case.taken_over,
        case.admitting,
        case.resume,
        case.session,
        case.attached,
        case.runtime,
        case.probe,
        case.full,
    )
    for index, (pattern, decision) in enumerate(TABLE):
        if all(p is ANY or p == v for p, v in zip(pattern, values, strict=True)):
            return index, decision
    raise AssertionError(f"no row of the table covers {case}")


CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_decide_follows_the_table(case: Case) -> None:
    _row, decision = expected(case)
    assert decide(case.slot(), case.offer(), probe_healthy=case.probe) == decision


def test_every_row_of_the_table_is_reached() -> None:
    reached = {expected(case)[0] for case in CASES}
    assert reached == set(range(len(TABLE))), sorted(set(range(len(TABLE))) - reached)


def test_the_table_covers_every_combination() -> None:
    # 2 closing x (1 without a session + 2 sessions x 2 attached x 2 runtimes) x 2 x 2 x 2 x 3
    # x 2 full.
    assert len(CASES) == 2 * (1 + 2 * 2 * 2) * 2 * 2 * 2 * 3 * 2


@pytest.mark.parametrize("case", [c for c in CASES if c.probe is None], ids=str)
def test_a_probe_is_asked_for_at_most_once(case: Case) -> None:
    """After a probe, decide never asks for another; without one it never returns a
    healthy-peer refusal (that needs evidence)."""
    first = decide(case.slot(), case.offer())
    assert first != HEALTHY
    if isinstance(first, Probe):
        for healthy in (True, False):
            assert not isinstance(decide(case.slot(), case.offer(), probe_healthy=healthy), Probe)


def test_refusals_close_with_the_codes_of_the_contract() -> None:
    assert TAKEN.reason.close_code == 4009
    assert HEALTHY.reason.close_code == CHANGED.reason.close_code == BUSY.reason.close_code == 4004
    assert BUSY == admission.BUSY
    assert CLOSED.reason.close_code == 1001
    assert FULL == admission.FULL and FULL.reason.close_code == 1013


def test_a_second_controller_is_admitted_at_once() -> None:
    """A worker keeps one slot per controller: a new controller's fresh handshake meets an empty
    slot, whatever the other controllers' slots hold, and is admitted without a probe unless
    they hold every place."""
    other_controllers_attached = SlotView()  # this controller's slot: nothing of the others'
    offer = Offer(resume=False, session=OFFERED, runtime=OTHER_RUNTIME)
    assert decide(other_controllers_attached, offer) == NEW
    assert decide(SlotView(full=True), offer) == FULL
    # Full never refuses a controller that holds a session here: it replaces its own.
    held = SlotView(session=OTHER_SESSION, peer_runtime=RUNTIME, full=True)
    assert decide(held, Offer(resume=False, session=OFFERED, runtime=RUNTIME)) == REPLACE
