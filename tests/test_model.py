"""Exhaustive small-scope model checking of the session, resume and takeover protocol.

The explorer (``tests/model``) walks every interleaving of two processes, their session slots
and the sockets between them, over the library's real sans-IO objects, and checks the
invariants in every state and that every state of the healed network can still reach "all
delivered and confirmed" -- and, in a second world (tests/model/controllers.py), two
controllers on one listening worker. Here: the CI bounds must be clean, and each known failure
mode, planted in the real code, must be found -- at a bound where the unplanted code is clean,
so each of these tests can fail.
"""

from __future__ import annotations

import pytest
from model import CI, Bounds, explore
from model.__main__ import main
from model.controllers import CONTROLLERS_CI, ControllerBounds
from model.mutations import MUTATIONS, Mutation, mutated

from garcon_link.core import admission
from garcon_link.core.session import MessageSession


def report(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """Print ``text`` in pytest's output even while output is captured."""
    with capsys.disabled():
        print(f"\n{text}")


def verbose(request: pytest.FixtureRequest) -> bool:
    return int(request.config.getoption("verbose")) > 0


def test_the_ci_bound_has_no_counterexample(capsys: pytest.CaptureFixture[str]) -> None:
    result = explore(CI)
    report(capsys, result.summary())
    assert result.counterexample is None, result.counterexample.render()
    # The exploration really happened at the size the guarantees page states (a model that silently
    # stopped exploring would pass the line above).
    assert result.states > 20_000, result.summary()
    assert result.healed_states > 5_000, result.summary()


@pytest.mark.parametrize("bounds", CONTROLLERS_CI, ids=["sends-and-a-cut", "a-cut-and-a-restart"])
def test_two_controllers_on_one_worker_have_no_counterexample(
    bounds: ControllerBounds, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two controllers, each with its session to one listening worker, cuts and restarts
    interleaved: every invariant per session, and neither disturbs the other's."""
    result = explore(bounds)
    report(capsys, result.summary())
    assert result.counterexample is None, result.counterexample.render()
    assert result.states > 1_000, result.summary()
    assert result.healed_states > 1_000, result.summary()


def test_the_two_controller_world_reaches_an_eviction_and_a_takeover() -> None:
    """The restart bound really explores what it is for: a restarted controller without a
    controller_id takes a detached session's place, one with a controller_id takes its own
    session over."""
    from model.controllers import ControllersWorld

    world = ControllersWorld(ControllerBounds(sends=0, cuts=0, restarts=2, dials=2))
    steps = [
        ("restart", "b"),
        ("notice", "w2"),
        ("dial", "b"),
        ("admit", "b"),
        ("restart", "a"),
        ("notice", "w1"),
        ("dial", "a"),
        ("admit", "a"),
    ]
    said: list[str] = []
    for step in steps:
        assert step in world.actions(), (step, said)
        said.append(world.apply(step))
        world.check()
    assert "the worker (w3): Fresh; w2 (b's, detached) evicted" in said[3], said
    assert "the worker (w1): Fresh" in said[7] and "a: Fresh" in said[7], said
    assert world.sides["w1"].taken_over  # a's first runtime, taken over


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.label.replace(" ", "-"))
def test_a_seeded_bug_is_found(
    mutation: Mutation, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    clean = explore(mutation.bounds)
    assert clean.counterexample is None, clean.counterexample.render()
    original = getattr(mutation.owner, mutation.name)
    with mutated(mutation):
        assert getattr(mutation.owner, mutation.name) is not original
        found = explore(mutation.bounds)
    assert getattr(mutation.owner, mutation.name) is original
    assert found.counterexample is not None, f"{mutation.label}: {found.summary()}"
    trace = found.counterexample.render()
    if verbose(request):  # the trace (pytest -v); a failing assertion below shows it too
        report(capsys, f"{mutation.label} ({mutation.why}):\n{trace}")
    lines = trace.splitlines()
    assert lines[0].startswith("COUNTEREXAMPLE"), trace
    assert lines[1].strip().startswith("1. "), trace
    assert any(word in trace for word in ("VIOLATION", "STUCK", "LOOPS")), trace


def test_a_mutation_that_no_longer_matches_the_code_fails_loudly() -> None:
    stale = Mutation("stale", "", admission, "decide", "no such fragment", "x", Bounds())
    with pytest.raises(AssertionError, match="exactly once"), mutated(stale):
        pass
    assert admission.decide.__module__ == "garcon_link.core.admission"


def test_copying_states_by_clone_deepcopy_or_replay_explores_the_same_graph() -> None:
    bounds = Bounds(sends=1, cuts=1, restarts=0, expiries=0, dials=1)
    results = [explore(bounds, copy_mode=mode) for mode in ("clone", "deepcopy", "replay")]
    assert len({(r.states, r.healed_states, r.transitions) for r in results}) == 1
    assert results[0].states > 100
    assert all(r.counterexample is None for r in results)


def test_the_session_copy_is_independent_of_the_original() -> None:
    from model.network import clone_session

    from garcon_link.core.session import RetentionPool
    from garcon_link.limits import Limits

    pool = RetentionPool(100)
    original = MessageSession(Limits(), pool)
    original.attach(0)
    original.send(b"one")
    twin_pool = RetentionPool(100)
    twin_pool.used = pool.used
    twin = clone_session(original, twin_pool)
    twin.send(b"two")
    twin.data_to_send()
    assert (original.issued, original.offered, original.frames_queued) == (1, 0, 1)
    assert (twin.issued, twin.offered, twin.frames_queued) == (2, 2, 0)
    assert pool.used < twin_pool.used


def test_the_command_line_prints_the_states_and_the_bounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--sends", "1", "--cuts", "0", "--restarts", "0", "--expiries", "0", "--dials", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "distinct states" in out
    assert "sends/side=1 cuts=0 restarts=0 expiries=0 dials=1" in out
    assert "no counterexample" in out
