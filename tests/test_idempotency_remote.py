"""End-to-end tests of idempotency keys (docs/design.md#idempotency) over real loopback sockets.

What ran is counted on the worker by the handler itself (``CalcImpl.counts``, or the
``LedgerService`` journal that survives a SIGKILL); a keyed call is held mid-execution by a gate
the test opens, never by a sleep. Every wait is bounded by ``anyio.fail_after`` or
:func:`faultutil.wait_for`. Both directions (worker listens / controller listens) and both anyio
backends, except the SIGKILL test, whose worker is a child process that listens.

Exactly one execution and the real result, across:

* a cut socket mid-call (the session resumes);
* the worker retiring its session while the handler runs (its grace expires behind a
  black-holed proxy), the handler finishing with no session or still running at the retry;
* a controller restart (a new ``gl.connect`` calls with the same key);
* and, when the worker process is SIGKILLed and restarted, an honest ``OutcomeUnknown`` that
  says the guarantee ended with the worker process -- and the handler never ran again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from faultutil import TESTS_DIR, Ledger, controller_config, journal_count, wait_for
from keyedworker import PROCESS_LIMITS, worker_process
from rpcutil import (
    LIMITS,
    SECRET,
    Calc,
    CalcImpl,
    Direction,
    SinkImpl,
    both_directions,
    open_pair,
    raw_call,
)

import garcon_link as gl
from garcon_link.rpc.rpc import CALL

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 20


def keyed(calc: Calc, key: str, *, retry: bool = True, timeout: float = 15.0) -> Calc:
    return gl.with_options(calc, idempotency_key=key, retry_unknown=retry, timeout=timeout)


class Outcome:
    """Where a call run in the background puts its value or its CallError."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: gl.CallError | None = None
        self.done = anyio.Event()

    async def run(self, call: Any) -> None:
        try:
            self.value = await call
        except gl.CallError as exc:
            self.error = exc
        finally:
            self.done.set()


# ---------------------------------------------------------------------------------- options


async def test_with_options_checks_keys_and_retry_unknown_up_front() -> None:
    config = gl.LinkConfig(
        executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    calc = gl.connect(config).service("calc", Calc)
    with pytest.raises(TypeError, match="str or bytes"):
        gl.with_options(calc, idempotency_key=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 to 128 bytes"):
        gl.with_options(calc, idempotency_key="k" * 129)
    with pytest.raises(ValueError, match="1 to 128 bytes"):
        gl.with_options(calc, idempotency_key="")
    with pytest.raises(ValueError, match="needs an idempotency_key"):
        gl.with_options(calc, retry_unknown=True)
    with pytest.raises(TypeError, match="must be a bool"):
        gl.with_options(calc, idempotency_key="k", retry_unknown=1)  # type: ignore[arg-type]
    keyed_calc = gl.with_options(calc, idempotency_key="k", retry_unknown=True)
    # Options compose: a later with_options keeps the key; removing it needs retry off too.
    assert gl.with_options(keyed_calc, timeout=5) is not keyed_calc
    with pytest.raises(ValueError, match="needs an idempotency_key"):
        gl.with_options(keyed_calc, idempotency_key=None)
    gl.with_options(keyed_calc, idempotency_key=None, retry_unknown=False)
    # Keys apply to unary calls: a stream or a one-way call with one fails when called.
    with pytest.raises(TypeError, match="stream: idempotency keys apply to unary calls only"):
        keyed_calc.count(3)
    with pytest.raises(TypeError, match="oneway method: idempotency keys apply to unary"):
        await keyed_calc.note("x")


# ---------------------------------------------------------------------------------- basics


@both_directions
async def test_a_repeat_replays_the_recorded_outcome_and_other_arguments_conflict(
    direction: Direction,
) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = keyed(pair.calc(), "op-1", retry=False)
            assert await calc.record(3) == 6
            assert await calc.record(3) == 6
            assert await gl.with_options(pair.calc(), idempotency_key=b"op-1").record(3) == 6
            assert impl.counts[3] == 1
            with pytest.raises(gl.Rejected) as conflict:
                await calc.record(4)
            assert conflict.value.code == "IDEMPOTENCY_CONFLICT"
            assert "'op-1'" in conflict.value.message and "calc.record" in conflict.value.message
            assert impl.counts[4] == 0
            # An error is recorded too, and never retried (RemoteError), nor run again.
            failing = keyed(pair.calc(), "op-2")
            for _ in range(2):
                with pytest.raises(gl.RemoteError, match="boom"):
                    await failing.fail("boom")
            # The same key on another method is another operation.
            assert await keyed(pair.calc(), "op-1").add(1, 2) == 3
            assert pair.worker is not None
            stats = pair.worker.idempotency_statistics()
            assert (stats.executions, stats.replays, stats.conflicts) == (3, 3, 1)


def _record_call_keyed(key: object) -> Callable[[int], list[Any]]:
    """A raw ``calc.record(1)`` call envelope carrying ``key`` as its idempotency key."""
    return lambda call_id: [CALL, call_id, "calc", "record", [1], {}, 0, 0, key]


@both_directions
async def test_malformed_keys_and_keyed_streams_are_refused_not_run(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"calc": impl}, controller_services={"sink": SinkImpl()}
        ) as pair:
            rpc = pair.rpc
            for bad in (42, "text-key", b"", b"k" * 129, [b"k"]):
                with pytest.raises(gl.Rejected) as refused:
                    await raw_call(
                        rpc,
                        "calc",
                        "record",
                        envelope=_record_call_keyed(bad),
                    )
                assert refused.value.code == "INVALID_ARGUMENTS", bad
            with pytest.raises(gl.Rejected, match="unary calls only") as stream:
                await raw_call(
                    rpc,
                    "calc",
                    "count",
                    envelope=lambda i: [CALL, i, "calc", "count", [3], {}, 8, 4096, b"k"],
                )
            assert stream.value.code == "INVALID_ARGUMENTS"
            assert impl.counts[1] == 0 and impl.counts["count"] == 0
            # A well-formed keyed call still works on the same session.
            assert (
                await raw_call(
                    rpc,
                    "calc",
                    "record",
                    envelope=lambda i: [CALL, i, "calc", "record", [1], {}, 0, 0, b"k"],
                )
                == 2
            )
            assert impl.counts[1] == 1
            # The controller keeps no table: a worker's keyed callback is refused, not run.
            assert pair.worker is not None and pair.worker.current_rpc is not None
            with pytest.raises(gl.Rejected) as unsupported:
                await raw_call(
                    pair.worker.current_rpc,
                    "sink",
                    "push",
                    envelope=lambda i: [CALL, i, "sink", "push", ["x"], {}, 0, 0, b"k"],
                )
            assert unsupported.value.code == "OPERATION_UNSUPPORTED"


# ---------------------------------------------------------------------------------- continuity


@both_directions
async def test_a_cut_mid_call_resumes_with_one_execution(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = keyed(pair.calc(), "cut-1")
            outcome = Outcome()
            async with anyio.create_task_group() as tg:
                tg.start_soon(outcome.run, calc.record(5, True))
                await impl.probe.wait("record:5")
                await pair.disconnect()
                impl.gate.set()
            assert outcome.error is None and outcome.value == 10
            assert impl.counts[5] == 1


@both_directions
@pytest.mark.parametrize("finish", ["before-retry", "during-retry"])
async def test_a_worker_side_session_retirement_keeps_the_call_to_one_execution(
    direction: Direction, finish: str
) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction,
            {"calc": impl},
            proxy=True,
            limits=LIMITS.replace(detached_grace=10.0),  # the controller keeps its session
            worker_limits=LIMITS.replace(detached_grace=0.3),  # the worker retires its own
        ) as pair:
            worker, proxy = pair.worker, pair.proxy
            assert worker is not None and proxy is not None
            calc = keyed(pair.calc(), "retire-1")
            outcome = Outcome()
            async with anyio.create_task_group() as tg:
                tg.start_soon(outcome.run, calc.record(7, True))
                await impl.probe.wait("record:7")
                proxy.blackhole()
                # The worker's grace expires: its session is retired while the handler runs.
                await wait_for(lambda: worker.current_rpc is None, 10, "the worker to retire")
                assert worker.idempotency_statistics().running == 1
                if finish == "before-retry":
                    impl.gate.set()  # finishes with no session to reply on: recorded
                    await wait_for(
                        lambda: worker.idempotency_statistics().running == 0, 10, "the record"
                    )
                proxy.heal()
                if finish == "during-retry":
                    # The retry, on a fresh session, waits for the same execution.
                    await wait_for(
                        lambda: worker.idempotency_statistics().waits == 1, 10, "the retry"
                    )
                    impl.gate.set()
                await outcome.done.wait()
            assert outcome.error is None, outcome.error
            assert outcome.value == 14
            assert impl.counts[7] == 1
            assert worker.sessions == 2  # the call crossed into a fresh logical session
            assert "offline" in pair.history
            stats = worker.idempotency_statistics()
            assert stats.executions == 1
            assert (stats.replays, stats.waits) == ((1, 0) if finish == "before-retry" else (0, 1))


@both_directions
async def test_a_restarted_controller_gets_the_one_execution_s_result(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            first = Outcome()
            async with anyio.create_task_group() as tg:
                tg.start_soon(first.run, keyed(pair.calc(), "ctl-1", retry=False).record(9, True))
                await impl.probe.wait("record:9")
                await pair.stop_controller()
            assert isinstance(first.error, gl.OutcomeUnknown), first.error
            await pair.start_controller()
            await pair.executor.wait_ready(5)
            second = Outcome()
            assert pair.worker is not None
            worker = pair.worker
            async with anyio.create_task_group() as tg:
                tg.start_soon(second.run, keyed(pair.calc(), "ctl-1").record(9, True))
                await wait_for(lambda: worker.idempotency_statistics().waits == 1, 10, "a wait")
                impl.gate.set()
            assert second.error is None and second.value == 18
            assert impl.counts[9] == 1


# ---------------------------------------------------------------------------------- worker killed


async def test_a_killed_worker_ends_the_guarantee_with_an_honest_outcome_unknown(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(30):
        async with worker_process(tmp_path) as (worker, journal):
            limits = gl.Limits(**PROCESS_LIMITS)
            async with gl.connect(controller_config(limits, worker.url)) as executor:
                await executor.wait_ready(10)
                ledger = gl.with_options(
                    executor.service("ledger", Ledger),
                    idempotency_key="deploy-1",
                    retry_unknown=True,
                    timeout=20,
                )
                outcome = Outcome()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(outcome.run, ledger.hold("held"))
                    await wait_for(
                        lambda: journal_count(journal, "start", "held") == 1, 10, "the call"
                    )
                    worker.kill()
                    assert await worker.wait() < 0
                    await worker.restart()
                    await outcome.done.wait()
                error = outcome.error
                assert isinstance(error, gl.OutcomeUnknown), (outcome.value, error)
                assert error.code == "WORKER_RESTARTED"
                assert "the idempotency guarantee ended with that worker process" in str(error)
                assert isinstance(error.__cause__, gl.OutcomeUnknown)  # the lost attempt
                # The restarted worker never ran it: its table did not know the key, and the
                # caller did not retry.
                await executor.wait_ready(10)
                assert await executor.service("ledger", Ledger).count_of("held") == 0
            assert journal_count(journal, "start", "held") == 1


# ---------------------------------------------------------------------------------- state directory


async def test_a_worker_restarted_on_its_state_directory_keeps_its_keyed_calls(
    tmp_path: Path,
) -> None:
    """SIGKILL a worker with ``--state-dir`` holding one finished and one running keyed call,
    restart it on the same directory: the finished call's retry returns its recorded result
    without running; the running one is ``OutcomeUnknown("WORKER_RESTARTED")`` and never runs
    again (the journal, appended by the handlers, is the ledger of what ran)."""
    state_dir = tmp_path / "state"
    with anyio.fail_after(40):
        async with worker_process(tmp_path, state_dir=state_dir) as (worker, journal):
            limits = gl.Limits(**PROCESS_LIMITS)
            async with gl.connect(controller_config(limits, worker.url)) as executor:
                await executor.wait_ready(10)
                plain = executor.service("ledger", Ledger)
                done = gl.with_options(plain, idempotency_key="deploy-done", timeout=10)
                held = gl.with_options(plain, idempotency_key="deploy-held", timeout=20)
                result = await done.apply("finished", b"payload")
                outcome = Outcome()
                async with anyio.create_task_group() as tg:
                    # retry_unknown: the caller retries on the restarted process (the same
                    # state directory), which answers from its table.
                    retried = gl.with_options(held, retry_unknown=True)
                    tg.start_soon(outcome.run, retried.hold("held"))
                    await wait_for(
                        lambda: journal_count(journal, "start", "held") == 1, 10, "the call"
                    )
                    worker.kill()
                    assert await worker.wait() < 0
                    await worker.restart()
                    await outcome.done.wait()
                assert isinstance(outcome.error, gl.OutcomeUnknown), outcome.value
                assert outcome.error.code == "WORKER_RESTARTED"
                assert "it is not run again" in outcome.error.message  # the worker's answer
                await executor.wait_ready(10)
                # A retry of each, with its key, on the restarted worker process.
                assert await done.apply("finished", b"payload") == result
                with pytest.raises(gl.OutcomeUnknown) as info:
                    await held.hold("held")
                assert info.value.code == "WORKER_RESTARTED"
                assert "it is not run again" in info.value.message
                # retry_unknown gives the same honest answer, without retrying it.
                with pytest.raises(gl.OutcomeUnknown, match="not run again"):
                    await gl.with_options(
                        plain, idempotency_key="deploy-held", retry_unknown=True, timeout=10
                    ).hold("held")
                assert await plain.count_of("finished") == 0  # this process ran nothing
                assert await plain.count_of("held") == 0
    assert journal_count(journal, "start", "finished") == 1
    assert journal_count(journal, "start", "held") == 1


async def test_a_second_worker_on_the_same_state_directory_exits_at_once(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with anyio.fail_after(30):
        async with worker_process(tmp_path, state_dir=state_dir) as (worker, _):
            second = await anyio.run_process(
                [
                    sys.executable,
                    "-m",
                    "garcon_link",
                    "worker",
                    str(tmp_path / "worker.toml"),
                    "--state-dir",
                    str(state_dir),
                ],
                cwd=TESTS_DIR,
                check=False,
            )
            assert second.returncode == 2
            lines = second.stderr.decode().strip().splitlines()
            assert len(lines) == 1, lines
            assert f"is in use by another worker (pid {worker.pid}" in lines[0]
            assert second.stdout == b""  # never listened
