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
  controller is admitted at once (``NEW``), never probed;
* ``evictable`` -- with ``full``: one of those other slots holds only a detached session (no
  socket, no admission), whose place a controller without a session takes (``EVICT``);
* ``draining`` -- the worker drains: it admits resumes only (``DRAINING``, 4010).

Which slot a hello meets is :func:`~garcon_link.core.admission.slot_key`'s answer; the second
table (``CONTROLLER_TABLE``) runs it and :func:`decide` together over the controller dimension:
the newcomer's ``controller_id`` and runtime against the held session's, whether that session
has a socket, and the places the other controllers hold.
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
    SlotKey,
    SlotView,
    decide,
    evictee,
    places,
    slot_key,
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
    evictable: bool = False
    draining: bool = False

    def slot(self) -> SlotView:
        if self.session == "none":
            return SlotView(
                closing=self.closing,
                admitting=self.admitting,
                full=self.full,
                evictable=self.evictable,
                draining=self.draining,
            )
        return SlotView(
            closing=self.closing,
            session=OFFERED if self.session == "offered" else OTHER_SESSION,
            peer_runtime=RUNTIME if self.runtime == "same" else OTHER_RUNTIME,
            attached=self.attached,
            admitting=self.admitting,
            full=self.full,
            evictable=self.evictable,
            draining=self.draining,
        )

    def offer(self) -> Offer:
        return Offer(
            resume=self.resume, session=OFFERED, runtime=RUNTIME, taken_over=self.taken_over
        )


def all_cases() -> list[Case]:
    cases = []
    for draining, (
        closing,
        session,
        attached,
        runtime,
        resume,
        taken_over,
        admitting,
        probe,
        full,
        evictable,
    ) in itertools.product(
        (False, True),
        itertools.product(
            (False, True),
            ("none", "offered", "other"),
            (False, True),
            ("same", "other"),
            (False, True),
            (False, True),
            (False, True),
            (None, True, False),
            (False, True),
            (False, True),
        ),
    ):
        if session == "none" and (attached or runtime == "other"):
            continue  # without a session there is no socket and no runtime to compare
        if evictable and not full:
            continue  # a place to evict for is looked for only when the others hold them all
        cases.append(
            Case(
                closing,
                session,
                attached,
                runtime,
                resume,
                taken_over,
                admitting,
                probe,
                full,
                evictable,
                draining,
            )
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
EVICT = Fresh(retire_current=False, taken_over=False, evict_detached=True)
REPLACE = Fresh(retire_current=True, taken_over=False)
DRAINING = Refuse(
    HandshakeFailure.DRAINING,
    "this worker is draining: it admits no new session; retry once it has restarted",
)
TAKEOVER = Fresh(retire_current=True, taken_over=True)

# (closing, taken_over, admitting, resume, session, attached, runtime, probe, full, evictable,
# draining) -> decision; first match wins.
TABLE: list[tuple[tuple[Any, ...], Decision]] = [
    # Shutting down refuses everything, before anything else is looked at.
    ((True, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY), CLOSED),
    # A runtime that was taken over never gets back in (two processes claim one id: 4009).
    ((False, True, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY), TAKEN),
    # One admission per executor at a time: another socket finishing its handshake meanwhile
    # is refused at once (a key holder cannot queue sockets behind the first one).
    ((False, False, True, ANY, ANY, ANY, ANY, ANY, ANY, ANY, ANY), BUSY),
    # Resume: only the very session the slot holds; the attached socket, if any, steps aside.
    ((False, False, False, True, "none", ANY, ANY, ANY, ANY, ANY, ANY), CHANGED),
    ((False, False, False, True, "other", ANY, ANY, ANY, ANY, ANY, ANY), CHANGED),
    ((False, False, False, True, "offered", False, ANY, ANY, ANY, ANY, ANY), Resume(False)),
    ((False, False, False, True, "offered", True, ANY, ANY, ANY, ANY, ANY), Resume(True)),
    # A draining worker admits no new session, whatever the slot holds; resumes (above) go on.
    ((False, False, False, False, ANY, ANY, ANY, ANY, ANY, ANY, True), DRAINING),
    # Fresh with nothing held: admitted; while other controllers hold every place, in the place
    # of one's detached session if there is one (a crashed controller cannot keep a live one
    # out for its grace), else refused (1013).
    ((False, False, False, False, "none", ANY, ANY, ANY, True, True, ANY), EVICT),
    ((False, False, False, False, "none", ANY, ANY, ANY, True, False, ANY), FULL),
    ((False, False, False, False, "none", ANY, ANY, ANY, False, ANY, ANY), NEW),
    # Fresh from the same runtime (it lost its state): replace, no probe, no takeover.
    ((False, False, False, False, ANY, ANY, "same", ANY, ANY, ANY, ANY), REPLACE),
    # Fresh from another runtime while a socket is attached: the takeover rule.
    ((False, False, False, False, ANY, True, "other", None, ANY, ANY, ANY), Probe()),
    ((False, False, False, False, ANY, True, "other", True, ANY, ANY, ANY), HEALTHY),
    ((False, False, False, False, ANY, True, "other", False, ANY, ANY, ANY), TAKEOVER),
    # Fresh from another runtime, nothing attached (a restarted peer): replace; the old
    # runtime is remembered as taken over.
    ((False, False, False, False, ANY, False, "other", ANY, ANY, ANY, ANY), TAKEOVER),
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
        case.evictable,
        case.draining,
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
    # x 3 (not full; full with or without an evictable session) x 2 draining.
    assert len(CASES) == 2 * (1 + 2 * 2 * 2) * 2 * 2 * 2 * 3 * 3 * 2


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
    assert DRAINING == admission.DRAINING and DRAINING.reason.close_code == 4010


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


# ------------------------------------------------------------------ the controller dimension

HELD_ID = "nightly"
ANOTHER_ID = "operator"
MAX_CONTROLLERS = 2


@dataclass(frozen=True)
class ControllerCase:
    """A listening worker with ``MAX_CONTROLLERS`` places: one slot holds a session (of a
    controller with a ``controller_id`` or without one, runtime ``RUNTIME``; its socket attached
    or not), a third controller's slot is empty, live (a socket) or detached; a newcomer sends a
    fresh hello (its ``controller_id``: none, the held one's, another; its runtime: the held
    one's or another)."""

    held: str  # "none" | "id"
    new: str  # "none" | "held's" | "another"
    runtime: str  # "same" | "other"
    attached: bool
    third: str  # "none" | "live" | "detached"
    probe: bool | None

    def decide(self) -> tuple[bool, Decision]:
        """What the link asks: the slot :func:`slot_key` names, and :func:`decide` on it with
        the places the other slots hold (:func:`places`). Returns whether the newcomer met the
        held slot, and the decision."""
        held_key = slot_key(
            "box", HELD_ID if self.held == "id" else None, RUNTIME, per_controller=True
        )
        new_id = {"none": None, "held's": HELD_ID, "another": ANOTHER_ID}[self.new]
        runtime = RUNTIME if self.runtime == "same" else OTHER_RUNTIME
        key = slot_key("box", new_id, runtime, per_controller=True)
        # (holds a place, evictable) of every slot but the newcomer's
        held = (True, not self.attached)
        third = {"none": (False, False), "live": (True, False), "detached": (True, True)}
        others = [third[self.third]] if key == held_key else [held, third[self.third]]
        full, evictable = places(others, MAX_CONTROLLERS)
        if key == held_key:
            view = SlotView(
                session=OTHER_SESSION,
                peer_runtime=RUNTIME,
                attached=self.attached,
                full=full,
                evictable=evictable,
            )
        else:
            view = SlotView(full=full, evictable=evictable)
        offer = Offer(resume=False, session=OFFERED, runtime=runtime)
        return key == held_key, decide(view, offer, probe_healthy=self.probe)


def controller_cases() -> list[ControllerCase]:
    cases = []
    for held, new, runtime, attached, third, probe in itertools.product(
        ("none", "id"),
        ("none", "held's", "another"),
        ("same", "other"),
        (False, True),
        ("none", "live", "detached"),
        (None, True, False),
    ):
        if held == "none" and new == "held's":
            continue  # the held controller sent no id: "the held one's" is "none"
        cases.append(ControllerCase(held, new, runtime, attached, third, probe))
    return cases


# (held, new, runtime, attached, third, probe) -> (meets the held slot, decision); first match
# wins. Written from docs/guides/many-callers.md, not from the code.
CONTROLLER_TABLE: list[tuple[tuple[Any, ...], tuple[bool, Decision]]] = [
    # The same controller_id: the held controller's slot, whatever the runtime. From its own
    # runtime (it lost its state), a replacement; from another, the takeover rule.
    (("id", "held's", "same", ANY, ANY, ANY), (True, REPLACE)),
    (("id", "held's", "other", True, ANY, None), (True, Probe())),
    (("id", "held's", "other", True, ANY, True), (True, HEALTHY)),
    (("id", "held's", "other", True, ANY, False), (True, TAKEOVER)),
    (("id", "held's", "other", False, ANY, ANY), (True, TAKEOVER)),
    # No controller_id on either side: the runtime is the controller. The same runtime meets
    # its own slot (a replacement, never a takeover)...
    (("none", "none", "same", ANY, ANY, ANY), (True, REPLACE)),
    # ... and everything else is another controller: a slot of its own, never a probe nor a
    # takeover of the held session, whatever its socket. Admitted while there is room; with
    # every place held, in the place of a detached session if one has no socket; else 1013.
    ((ANY, ANY, ANY, ANY, "none", ANY), (False, NEW)),
    ((ANY, ANY, ANY, True, "live", ANY), (False, FULL)),
    ((ANY, ANY, ANY, ANY, ANY, ANY), (False, EVICT)),
]


def controller_expected(case: ControllerCase) -> tuple[int, tuple[bool, Decision]]:
    values = (case.held, case.new, case.runtime, case.attached, case.third, case.probe)
    for index, (pattern, outcome) in enumerate(CONTROLLER_TABLE):
        if all(p is ANY or p == v for p, v in zip(pattern, values, strict=True)):
            return index, outcome
    raise AssertionError(f"no row of the controller table covers {case}")


CONTROLLER_CASES = controller_cases()


@pytest.mark.parametrize("case", CONTROLLER_CASES, ids=str)
def test_the_controller_dimension_follows_its_table(case: ControllerCase) -> None:
    assert case.decide() == controller_expected(case)[1]


def test_every_row_of_the_controller_table_is_reached() -> None:
    reached = {controller_expected(case)[0] for case in CONTROLLER_CASES}
    assert reached == set(range(len(CONTROLLER_TABLE))), sorted(
        set(range(len(CONTROLLER_TABLE))) - reached
    )
    # 5 (held, new) pairs x 2 runtimes x 2 attached x 3 thirds x 3 probes
    assert len(CONTROLLER_CASES) == 5 * 2 * 2 * 3 * 3


def test_slot_keys_tell_controllers_apart_only_on_a_listening_worker() -> None:
    keys: set[SlotKey] = {
        slot_key("box", None, RUNTIME, per_controller=True),
        slot_key("box", None, OTHER_RUNTIME, per_controller=True),
        slot_key("box", HELD_ID, RUNTIME, per_controller=True),
        slot_key("box", ANOTHER_ID, RUNTIME, per_controller=True),
        slot_key("other-box", HELD_ID, RUNTIME, per_controller=True),
    }
    assert len(keys) == 5
    # A controller_id names the controller across runtimes (restarts).
    assert slot_key("box", HELD_ID, RUNTIME, per_controller=True) == slot_key(
        "box", HELD_ID, OTHER_RUNTIME, per_controller=True
    )
    # Every other link: one slot per executor.
    assert {
        slot_key("box", c, r, per_controller=False)
        for c in (None, HELD_ID)
        for r in (RUNTIME, OTHER_RUNTIME)
    } == {("box", None)}


def test_the_session_detached_the_longest_gives_its_place_up() -> None:
    assert evictee([]) is None
    assert evictee([("a", 5)]) == "a"
    assert evictee([("a", 5), ("b", 2), ("c", 9)]) == "b"
    assert evictee([("a", 3), ("b", 3)]) == "a"  # the first of equals
    assert admission.EVICT == EVICT and admission.EVICT.evict_detached


def test_places_count_only_the_slots_that_hold_one() -> None:
    # (holds a place, evictable) of the other slots
    assert places([], 1) == (False, False)
    assert places([(True, False)], 2) == (False, False)
    assert places([(True, False), (False, False), (True, False)], 2) == (True, False)
    assert places([(True, False), (True, True)], 2) == (True, True)
    # An evictable session counts only while the places are full.
    assert places([(True, True)], 2) == (False, False)
    assert places([(False, True), (True, False)], 1) == (True, False)
