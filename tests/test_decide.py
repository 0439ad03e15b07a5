"""The admission decision (:func:`garcon_link.core.admission.decide`), without sockets.

A decision table, written out row by row as DESIGN §6 and §12 state the rules, is checked against
every combination of the function's inputs: each combination must match exactly the first row
whose conditions it meets, and every row must be reached by some combination (no dead rows). The
inputs:

* ``closing`` -- the link is shutting down;
* ``session`` -- the slot holds no live session, the session the handshake settled on, or another;
* ``attached`` -- a socket carries the slot's session (only with a session);
* ``runtime`` -- the handshake's peer runtime is the one the slot's session belongs to, or another;
* ``resume`` -- the handshake's resume rule held (both advertised the same session);
* ``taken_over`` -- the peer's runtime is one whose session another runtime took over;
* ``probe`` -- not probed, the attached socket answered the probe, or it did not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest

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
    probe: bool | None

    def slot(self) -> SlotView:
        if self.session == "none":
            return SlotView(closing=self.closing)
        return SlotView(
            closing=self.closing,
            session=OFFERED if self.session == "offered" else OTHER_SESSION,
            peer_runtime=RUNTIME if self.runtime == "same" else OTHER_RUNTIME,
            attached=self.attached,
        )

    def offer(self) -> Offer:
        return Offer(
            resume=self.resume, session=OFFERED, runtime=RUNTIME, taken_over=self.taken_over
        )


def all_cases() -> list[Case]:
    cases = []
    for closing, session, attached, runtime, resume, taken_over, probe in itertools.product(
        (False, True),
        ("none", "offered", "other"),
        (False, True),
        ("same", "other"),
        (False, True),
        (False, True),
        (None, True, False),
    ):
        if session == "none" and (attached or runtime == "other"):
            continue  # without a session there is no socket and no runtime to compare
        cases.append(Case(closing, session, attached, runtime, resume, taken_over, probe))
    return cases


ANY = object()
CLOSED = Refuse(FailureReason.CLOSED, "shutting down")
TAKEN = Refuse(HandshakeFailure.TAKEN_OVER, "another process with this executor id took over")
CHANGED = Refuse(HandshakeFailure.SUPERSEDED, "session changed during the handshake; retry")
HEALTHY = Refuse(HandshakeFailure.SUPERSEDED, "another peer holds a healthy session")

# (closing, taken_over, resume, session, attached, runtime, probe) -> decision; first match wins.
TABLE: list[tuple[tuple[Any, ...], Decision]] = [
    # Shutting down refuses everything, before anything else is looked at.
    ((True, ANY, ANY, ANY, ANY, ANY, ANY), CLOSED),
    # A runtime that was taken over never gets back in (two processes claim one id: 4009).
    ((False, True, ANY, ANY, ANY, ANY, ANY), TAKEN),
    # Resume: only the very session the slot holds; the attached socket, if any, steps aside.
    ((False, False, True, "none", ANY, ANY, ANY), CHANGED),
    ((False, False, True, "other", ANY, ANY, ANY), CHANGED),
    ((False, False, True, "offered", False, ANY, ANY), Resume(supersede_attached=False)),
    ((False, False, True, "offered", True, ANY, ANY), Resume(supersede_attached=True)),
    # Fresh with nothing held.
    ((False, False, False, "none", ANY, ANY, ANY), Fresh(retire_current=False, taken_over=False)),
    # Fresh from the same runtime (it lost its state): replace, no probe, no takeover.
    ((False, False, False, ANY, ANY, "same", ANY), Fresh(retire_current=True, taken_over=False)),
    # Fresh from another runtime while a socket is attached: the takeover rule.
    ((False, False, False, ANY, True, "other", None), Probe()),
    ((False, False, False, ANY, True, "other", True), HEALTHY),
    ((False, False, False, ANY, True, "other", False), Fresh(retire_current=True, taken_over=True)),
    # Fresh from another runtime, nothing attached (a restarted peer): replace; the old
    # runtime is remembered as taken over.
    ((False, False, False, ANY, False, "other", ANY), Fresh(retire_current=True, taken_over=True)),
]


def expected(case: Case) -> tuple[int, Decision]:
    values = (
        case.closing,
        case.taken_over,
        case.resume,
        case.session,
        case.attached,
        case.runtime,
        case.probe,
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
    # 2 closing x (1 without a session + 2 sessions x 2 attached x 2 runtimes) x 2 x 2 x 3.
    assert len(CASES) == 2 * (1 + 2 * 2 * 2) * 2 * 2 * 3


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
    assert HEALTHY.reason.close_code == CHANGED.reason.close_code == 4004
    assert CLOSED.reason.close_code == 1001
