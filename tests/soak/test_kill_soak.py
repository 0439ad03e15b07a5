"""Keyed soak with worker SIGKILLs: a real worker process on a state directory, killed at random
moments and restarted on the same directory, while a controller keeps keyed calls in flight.

The worker is ``garcon-link worker --state-dir DIR`` (a child process,
:func:`keyedworker.worker_process`) serving :class:`keyedworker.KeyedLedgerService`, whose
handlers append ``start``/``done`` lines to a ledger file (``O_APPEND``, synced to disk): what
ran survives every kill. Several callers make keyed calls (``retry_unknown=True``, 1-4 at a time
each, random payloads, some held a moment on the worker); a call that ends ``OutcomeUnknown`` or
``NotDispatched`` is called again with its key once, as an application would. Meanwhile the
worker is SIGKILLed ``KILLS_PER_MINUTE`` times a minute at moments drawn from a seeded RNG and
restarted on the same directory each time. At the end a sample of the finished calls, and every
call that ended unknown, is called once more with its key: a replay across every restart.

The ledger then decides, per key:

* no key ran twice (a *double*);
* a result is the ledger's one execution: the right checksum and the pid of the process whose
  ``start`` and ``done`` lines the ledger holds (a replay names the process that ran it);
* ``OutcomeUnknown("WORKER_RESTARTED")`` only for a key that ran at most once and, when so
  answered, had not started (journaled, or sent to the process that was killed), or had started
  in a process that was then killed and not finished -- or finished within
  ``state_write_timeout`` of the kill (its outcome not yet committed); with a state directory,
  never for a key that also returned a result or ran after that answer;
* ``NotDispatched`` only for an attempt during which the key did not start; nothing ran that no
  caller asked for.

The seed is fixed (:data:`DEFAULT_SEED`) and printed; ``GARCON_SOAK_SEED`` replaces it (the kill
schedule and the calls replay; their interleaving does not). ``GARCON_KILL_SOAK_STATE_DIR=0``
runs the same soak without a state directory, to see it fail: a retried key runs again on the
restarted worker. About 60 s (``--soak-minutes N``: N minutes, the kills scaled); marked ``soak``
(``make test`` leaves it out, ``.ci/run`` and ``make soak`` run it); asyncio only.
"""

from __future__ import annotations

import faulthandler
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from faultutil import controller_config
from keyedworker import (
    KEYED_LEDGER_SERVICE,
    PROCESS_LIMITS,
    KeyedLedger,
    LedgerLine,
    keyed_result,
    read_ledger,
    worker_process,
)

import garcon_link as gl
from garcon_link.testing import WorkerProcess

pytestmark = [
    pytest.mark.soak,
    pytest.mark.anyio,
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),
    # The duration is an option: the test bounds itself (anyio.fail_after), and a faulthandler
    # watchdog ends the process if even that cannot fire.
    pytest.mark.timeout(0),
]

DEFAULT_SEED = 2_028
SEED_ENV = "GARCON_SOAK_SEED"
STATE_ENV = "GARCON_KILL_SOAK_STATE_DIR"
CI_SECONDS = 60.0
KILLS_PER_MINUTE = 9
CALLERS = 8
PAYLOAD_SIZES = (0, 16, 1_000, 20_000)
HOLDS = (0.0, 0.0, 0.005, 0.02, 0.1)  # seconds a handler waits between its start and done lines
# Seconds a caller waits before its next 1-4 calls: about 2,500 calls a minute.
PAUSE = (0.2, 0.6)
# The worker's table of keys holds every key of the run: an evicted key runs again, by design.
KEYS_PER_MINUTE = 10_000
CALL_TIMEOUT = 20.0  # outlasts a kill and restart (the worker starts in about a second)
REPLAY_SAMPLE = 300  # finished calls called again at the end
# An outcome the worker has not committed within this is sent unrecorded: a key that finished
# longer than this before its process was killed has a recorded outcome.
STATE_WRITE_TIMEOUT = 3.0


def worker_limits(duration: float) -> dict[str, Any]:
    """The worker's (and the controller's) limits for a run of ``duration`` seconds."""
    return {
        **PROCESS_LIMITS,
        "state_write_timeout": STATE_WRITE_TIMEOUT,
        "idempotency_max_entries": max(10_000, round(KEYS_PER_MINUTE * duration / 60)),
    }


@dataclass(slots=True)
class Attempt:
    outcome: str  # ok | not_dispatched | rejected | unknown:CODE | unexpected: ...
    began: float  # time.monotonic(), the clock of the ledger's lines
    ended: float
    value: str | None = None


@dataclass(slots=True)
class Call:
    key: str
    payload: bytes
    hold: float
    attempts: list[Attempt] = field(default_factory=list)


@dataclass
class Run:
    durable: bool  # the worker keeps a state directory
    calls: list[Call] = field(default_factory=list)
    killed_at: dict[int, float] = field(default_factory=dict)  # pid -> reaped (time.monotonic)
    statuses: list[int] = field(default_factory=list)
    replayed: int = 0
    replay_began: float = float("inf")  # time.monotonic()


def classify(exc: BaseException) -> str:
    if isinstance(exc, gl.NotDispatched):
        return "not_dispatched"
    if isinstance(exc, gl.Rejected):
        return "rejected"
    if isinstance(exc, gl.OutcomeUnknown):
        return f"unknown:{exc.code}"
    return f"unexpected: {exc!r}"


async def attempt(ledger: KeyedLedger, call: Call) -> Attempt:
    """One keyed call of ``call`` (retry_unknown: the library retries across cuts and, on the
    same state directory, across restarts), timed on the ledger's clock."""
    facade = gl.with_options(
        ledger, idempotency_key=call.key, retry_unknown=True, timeout=CALL_TIMEOUT
    )
    began = time.monotonic()
    try:
        value = await facade.run(call.key, call.payload, call.hold)
    except gl.CallError as exc:
        return Attempt(classify(exc), began, time.monotonic())
    return Attempt("ok", began, time.monotonic(), value)


async def caller(
    index: int, executor: gl.RemoteExecutor, rng: random.Random, stop: anyio.Event, run: Run
) -> None:
    ledger = executor.service("ledger", KeyedLedger)

    async def one(call: Call) -> None:
        call.attempts.append(await attempt(ledger, call))
        if call.attempts[-1].outcome.startswith(("unknown", "not_dispatched")):
            # The application's own retry with the key: a state directory makes it safe.
            with anyio.move_on_after(CALL_TIMEOUT):
                await executor.wait_ready()
            call.attempts.append(await attempt(ledger, call))

    serial = 0
    while not stop.is_set():
        with anyio.move_on_after(rng.uniform(*PAUSE)):
            await stop.wait()
        async with anyio.create_task_group() as tg:
            for _ in range(rng.randint(1, 4)):
                serial += 1
                call = Call(
                    f"k{index}-{serial}",
                    rng.randbytes(rng.choice(PAYLOAD_SIZES)),
                    rng.choice(HOLDS),
                )
                run.calls.append(call)
                tg.start_soon(one, call)


async def killer(
    worker: WorkerProcess, rng: random.Random, started: float, duration: float, kills: int, run: Run
) -> None:
    """SIGKILL the worker ``kills`` times, around evenly spaced moments of the run (each moved by
    up to a third of the spacing), and restart it on its directory at once."""
    spacing = duration / (kills + 1)
    for i in range(kills):
        moment = started + spacing * (i + 1) + rng.uniform(-spacing / 3, spacing / 3)
        await anyio.sleep(max(0.0, moment - anyio.current_time()))
        pid = worker.pid
        worker.kill()
        run.statuses.append(await worker.wait())
        run.killed_at[pid] = time.monotonic()  # after the reap: every line of pid precedes it
        await worker.start()


async def replay(executor: gl.RemoteExecutor, rng: random.Random, run: Run) -> None:
    """Call again, with its key and arguments, a sample of the finished calls and every call
    that ended unknown: each must answer as before, without running."""
    ledger = executor.service("ledger", KeyedLedger)
    finished = [c for c in run.calls if c.attempts and c.attempts[-1].outcome == "ok"]
    unknown = [c for c in run.calls if c.attempts and c.attempts[-1].outcome.startswith("unknown")]
    sample = rng.sample(finished, min(REPLAY_SAMPLE, len(finished))) + unknown
    run.replay_began = time.monotonic()
    slots = anyio.Semaphore(32)

    async def again(call: Call) -> None:
        async with slots:
            call.attempts.append(await attempt(ledger, call))

    async with anyio.create_task_group() as tg:
        for call in sample:
            tg.start_soon(again, call)
    run.replayed = len(sample)


# ---------------------------------------------------------------------------------- the verdict


def unrecorded_reply(call: Call, done: LedgerLine | None) -> bool:
    """Whether ``call``'s first result came back ``STATE_WRITE_TIMEOUT`` or more after its
    execution finished: its outcome may have been sent unrecorded (a commit that slow is given
    up on), and a restart then answers the key ``WORKER_RESTARTED`` -- honest, and documented."""
    for a in call.attempts:
        if a.outcome == "unknown:WORKER_RESTARTED":
            return False  # a result after WORKER_RESTARTED is never explained by this
        if a.outcome == "ok":
            return done is not None and a.ended - done.at >= STATE_WRITE_TIMEOUT
    return False


def restarted_kind(
    call: Call, start: LedgerLine | None, done: LedgerLine | None, answered: float, run: Run
) -> tuple[str, str | None]:
    """Where the execution of ``call``, first answered ``WORKER_RESTARTED`` at ``answered``,
    stood when its process was killed: a label for the report, and a problem if that answer
    was not honest."""
    if start is None or start.at > answered:
        if start is not None and run.durable:
            return "", f"{call.key} ran after it was answered WORKER_RESTARTED"
        return "not started (journaled, or sent to the killed process)", None
    killed = run.killed_at.get(start.pid)
    if killed is None:
        return "", f"{call.key} WORKER_RESTARTED, but it ran in pid {start.pid}, never killed"
    if done is None:
        return "started, not finished", None
    if unrecorded_reply(call, done):
        return "finished, its reply sent unrecorded (a commit slower than the timeout)", None
    if killed - done.at > STATE_WRITE_TIMEOUT:
        return "", (
            f"{call.key} WORKER_RESTARTED, but it finished {killed - done.at:.2f}s before its "
            "process was killed: its outcome was recorded"
        )
    return "finished, outcome not yet recorded", None


def check(run: Run, lines: list[LedgerLine]) -> tuple[list[str], Counter[str]]:
    """Every broken invariant (as text) and the counts the report shows (per key)."""
    problems: list[str] = []
    figures: Counter[str] = Counter()
    by_key: defaultdict[str, list[LedgerLine]] = defaultdict(list)
    for line in lines:
        by_key[line.key].append(line)
    asked = {c.key for c in run.calls}
    phantom = sorted(set(by_key) - asked)
    if phantom:
        problems.append(f"ran without a caller: {phantom[:10]}")
    for call in run.calls:
        starts = [line for line in by_key[call.key] if line.event == "start"]
        dones = [line for line in by_key[call.key] if line.event == "done"]
        outcomes = [a.outcome for a in call.attempts]
        figures["calls"] += 1
        figures[f"final {outcomes[-1] if outcomes else 'none'}"] += 1
        if not call.attempts:
            problems.append(f"{call.key}: never answered")
        figures["executed" if starts else "never executed"] += 1
        if len(starts) > 1:
            figures["doubles"] += 1
            if starts[1].at < run.replay_began:
                figures["doubles before the replay"] += 1
            problems.append(
                f"{call.key} ran {len(starts)} times (pids {[s.pid for s in starts]}): {outcomes}"
            )
            continue
        start = starts[0] if starts else None
        done = dones[0] if dones else None
        if len(dones) > len(starts) or (
            done is not None and start is not None and done.pid != start.pid
        ):
            problems.append(f"{call.key}: ledger lines do not pair: {by_key[call.key]}")
            continue
        restarted = False
        for a in call.attempts:
            if a.outcome == "ok":
                if start is None or done is None:
                    problems.append(f"{call.key} returned {a.value!r} but did not run to its end")
                elif a.value != keyed_result(call.key, call.payload, start.pid):
                    problems.append(
                        f"{call.key} returned {a.value!r}, not the result of its execution in "
                        f"pid {start.pid}"
                    )
                elif done.at > a.ended:
                    problems.append(f"{call.key} returned before its execution finished")
            elif a.outcome == "unknown:WORKER_RESTARTED":
                if not restarted:
                    restarted = True
                    kind, problem = restarted_kind(call, start, done, a.ended, run)
                    if problem is None:
                        figures[f"restarted: {kind}"] += 1
                    else:
                        problems.append(problem)
            elif a.outcome.startswith("unknown"):
                figures[f"other {a.outcome}"] += 1
            elif a.outcome in ("not_dispatched", "rejected"):
                if start is not None and a.began <= start.at <= a.ended:
                    problems.append(f"{call.key}: {a.outcome}, but it started during that attempt")
            else:
                problems.append(f"{call.key}: {a.outcome}")
        if run.durable and restarted and "ok" in outcomes and not unrecorded_reply(call, done):
            # Without a state directory a retry after WORKER_RESTARTED runs the key afresh.
            problems.append(
                f"{call.key} was answered both WORKER_RESTARTED and a result: {outcomes}"
            )
    return problems, figures


def picked(figures: Counter[str], prefix: str) -> dict[str, int]:
    return {k.removeprefix(prefix): v for k, v in figures.items() if k.startswith(prefix)}


# ---------------------------------------------------------------------------------- the test


async def test_keyed_calls_survive_worker_sigkills(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    minutes = request.config.getoption("--soak-minutes")
    duration = CI_SECONDS if minutes is None else float(minutes) * 60
    kills = max(1, round(KILLS_PER_MINUTE * duration / 60))
    seed = int(os.environ.get(SEED_ENV) or DEFAULT_SEED)
    durable = os.environ.get(STATE_ENV, "1") != "0"
    print(
        f"\nkill soak: seed={seed} ({SEED_ENV} replays) duration={duration:.0f}s kills={kills} "
        f"state directory: {'yes' if durable else 'NO'}"
    )
    budget = duration + 2 * CALL_TIMEOUT + 60  # the run, the last calls, the replay
    faulthandler.dump_traceback_later(budget + 60, exit=True)
    try:
        with anyio.fail_after(budget):
            await soak(tmp_path, seed, duration, kills, durable)
    finally:
        faulthandler.cancel_dump_traceback_later()


async def soak(tmp_path: Path, seed: int, duration: float, kills: int, durable: bool) -> None:
    master = random.Random(seed)
    run = Run(durable)
    stop = anyio.Event()
    state_dir = tmp_path / "state" if durable else None
    limits_table = worker_limits(duration)
    limits = gl.Limits(**limits_table)
    async with (
        worker_process(
            tmp_path, state_dir=state_dir, service=KEYED_LEDGER_SERVICE, limits=limits_table
        ) as (worker, ledger_path),
        gl.connect(controller_config(limits, worker.url)) as executor,
    ):
        await executor.wait_ready(10)
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for i in range(CALLERS):
                tg.start_soon(caller, i, executor, random.Random(master.getrandbits(64)), stop, run)
            await killer(
                worker, random.Random(master.getrandbits(64)), started, duration, kills, run
            )
            await anyio.sleep(max(0.0, started + duration - anyio.current_time()))
            stop.set()  # callers finish their calls in flight (bounded by CALL_TIMEOUT)
        ran_for = anyio.current_time() - started
        await executor.wait_ready(10)
        await replay(executor, random.Random(master.getrandbits(64)), run)
    lines = read_ledger(ledger_path)
    problems, figures = check(run, lines)
    attempts = Counter(a.outcome for c in run.calls for a in c.attempts)
    report = "\n".join(
        [
            f"kill soak seed={seed}: ran {ran_for:.1f}s, {len(run.statuses)} SIGKILLs "
            f"(statuses {sorted(set(run.statuses))}), state directory: {durable}",
            f"  calls: {figures['calls']} ({figures['executed']} executed, "
            f"{figures['never executed']} never), {run.replayed} called again at the end",
            f"  attempts: {dict(attempts)}",
            f"  final outcomes: {picked(figures, 'final ')}",
            f"  WORKER_RESTARTED: {picked(figures, 'restarted: ')}",
            f"  doubles: {figures['doubles']} ({figures['doubles before the replay']} before the "
            f"replay); ledger lines: {len(lines)}",
        ]
    )
    print(report)
    # More keys than the table holds would evict the oldest, which then run again.
    assert len(run.calls) < limits.idempotency_max_entries, "too many calls for the table"
    problems.sort(key=lambda text: " ran " in text)  # the doubles last: the rarer kinds first
    assert not problems, f"{len(problems)} invariants broken:\n  " + "\n  ".join(problems[:30])
    assert run.statuses == [-9] * kills, run.statuses
    assert attempts["ok"] >= len(run.calls) // 2, "too few calls succeeded"
    assert len(run.calls) >= 20 * duration / 60, "too few calls"
