"""Process faults: a real worker or controller process is SIGKILLed mid-call and mid-stream.

The worker is ``garcon-link worker`` in a child process (:class:`garcon_link.testing.WorkerProcess`)
serving :class:`faultutil.LedgerService`, which journals every handler start, cancellation and
stream close to a file with unbuffered writes, so what a killed worker did is still known. The
killed controller is ``garcon-link call`` in a child process. What each test proves:

* worker killed mid-call, restarted after the controller's grace expired: the pending call fails
  ``OutcomeUnknown`` (it ran once, per the journal); calls while reconnecting and while offline
  fail ``NotDispatched`` and never run; availability goes ``ready -> reconnecting -> offline ->
  ready`` (exactly one ``offline``); the restarted worker gets a fresh session behind the same
  facade; an old resource reference raises ``StaleResource``; the controller was never restarted.
* worker killed mid-stream, restarted at once (the fresh handshake replaces the session before the
  grace expires): the stream delivered a gap-free prefix, then ``OutcomeUnknown``; a new stream on
  the new worker completes.
* controller killed mid-call / mid-stream: the worker keeps running (same process); a new
  controller gets a fresh session at once; the worker cancels the orphaned handler (or closes the
  orphaned generator), and an old resource reference is ``StaleResource``.
* worker SIGTERMed with 64 calls in flight (graceful drain): every call either returns its real
  result -- and the journal shows that handler ran to its end -- or, when it outlives the drain
  time, fails ``OutcomeUnknown`` (its handler was cancelled); a new call during the drain is
  ``NotDispatched("DRAINING")`` and never runs; the worker exits 0.

Every wait is bounded; nothing is asserted on a sleep. Runs on both anyio backends.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from faultutil import (
    EXECUTOR_ID,
    JOURNAL_ENV,
    TESTS_DIR,
    Ledger,
    checksum,
    controller_config,
    journal_count,
    kill_and_reap,
    read_journal,
    wait_for,
    write_configs,
)

import garcon_link as gl
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.testing import WorkerProcess, free_tcp_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 30.0  # no test may take longer (that would be a hang, not a result)

LIMITS: dict[str, Any] = {
    "heartbeat_interval": 0.05,
    "heartbeat_timeout": 0.5,
    "detached_grace": 1.0,
    "handshake_timeout": 2.0,
    "takeover_probe_timeout": 0.3,
    "connect_timeout": 1.0,
    "backoff_base": 0.01,
    "backoff_max": 0.1,
    "close_timeout": 0.3,
    "scope_cleanup_timeout": 0.5,
    "call_timeout": 20.0,
}
SERVICE = "ledger=faultutil:LedgerService"


@asynccontextmanager
async def worker_process(
    tmp_path: Path, args: tuple[str, ...] = ()
) -> AsyncIterator[tuple[WorkerProcess, Path, Path]]:
    """A started worker child; yields it, its journal and the controller config for the CLI."""
    worker_toml, controller_toml = write_configs(tmp_path, port=free_tcp_port(), limits=LIMITS)
    journal = tmp_path / "journal"
    async with WorkerProcess(
        worker_toml, [SERVICE], cwd=TESTS_DIR, env={JOURNAL_ENV: str(journal)}, args=args
    ) as worker:
        await worker.start()
        yield worker, journal, controller_toml


def _field(line: str, key: str) -> str:
    for part in line.split():
        name, _, value = part.partition("=")
        if name == key:
            return value
    raise AssertionError(f"no {key}= in {line!r}")


async def _settle(executor: gl.RemoteExecutor, state: str) -> None:
    await wait_for(lambda: executor.availability == state, 10, f"availability {state!r}")


async def _drain(
    stream: AsyncIterator[int], items: list[int], at: int, action: Callable[[], Awaitable[None]]
) -> gl.CallError | None:
    """Consume ``stream`` into ``items``, running ``action`` after the ``at``-th item."""
    try:
        async for item in stream:
            items.append(item)
            if len(items) == at:
                await action()
    except gl.CallError as exc:
        return exc
    return None


# ---------------------------------------------------------------------------------- worker dies


async def test_worker_killed_mid_call_outcome_unknown_offline_then_fresh_session(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(DEADLINE):
        async with worker_process(tmp_path) as (worker, journal, _):
            limits = gl.Limits(**LIMITS)
            async with gl.connect(controller_config(limits, worker.url)) as executor:
                history: list[str] = []
                executor.on_availability_changed(history.append)
                await executor.wait_ready(10)
                link = executor.link
                assert isinstance(link, WebSocketLink)  # its own: not a fleet member
                runtime = link.runtime_id
                ledger = executor.service("ledger", Ledger)
                assert await ledger.pid() == worker.pid
                first = await executor.info()
                ref = await ledger.open_job("build")
                assert await ledger.job_name(ref) == "build"

                outcome: list[BaseException] = []

                async def pending_call() -> None:
                    try:
                        await ledger.hold("held")
                    except gl.CallError as exc:
                        outcome.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(pending_call)
                    await wait_for(
                        lambda: journal_count(journal, "start", "held") == 1,
                        10,
                        "the held call to start on the worker",
                    )
                    worker.kill()
                    assert await worker.wait() < 0  # killed by a signal, not exited

                    # Reconnecting (the socket is gone, the session waits out its grace).
                    await _settle(executor, "reconnecting")
                    with pytest.raises(gl.NotDispatched):
                        await ledger.apply("while-reconnecting", b"x")
                    # The grace expires: the session is retired, the pending call is unknown.
                    await _settle(executor, "offline")
                with pytest.raises(gl.NotDispatched) as offline:
                    await ledger.apply("while-offline", b"x")
                assert offline.value.code == "OFFLINE"
                assert len(outcome) == 1 and isinstance(outcome[0], gl.OutcomeUnknown), outcome
                assert outcome[0].outcome is gl.Outcome.UNKNOWN

                await worker.restart()
                await executor.wait_ready(10)
                assert history == ["ready", "reconnecting", "offline", "ready"]

                # A fresh session behind the same facade; the controller was not restarted.
                assert link.runtime_id == runtime
                assert await ledger.pid() == worker.pid
                second = await executor.info()
                assert second.session_id != first.session_id
                assert second.instance_id != first.instance_id
                assert await ledger.apply("after", b"data") == checksum("after", b"data")
                with pytest.raises(gl.StaleResource):
                    await ledger.job_name(ref)

            # Ran exactly once / never, per the journal that survived the kill.
            assert journal_count(journal, "start", "held") == 1
            assert journal_count(journal, "start", "while-reconnecting") == 0
            assert journal_count(journal, "start", "while-offline") == 0
            assert journal_count(journal, "start", "after") == 1


async def test_worker_killed_mid_stream_prefix_then_replaced_session(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with worker_process(tmp_path) as (worker, journal, _):
            # A long grace: the restarted worker's fresh handshake retires the old session.
            limits = gl.Limits(**{**LIMITS, "detached_grace": 20.0})
            async with gl.connect(controller_config(limits, worker.url)) as executor:
                history: list[str] = []
                executor.on_availability_changed(history.append)
                await executor.wait_ready(10)
                ledger = executor.service("ledger", Ledger)
                items: list[int] = []

                async def kill_and_restart() -> None:
                    worker.kill()
                    await worker.wait()
                    await worker.restart()

                error = await _drain(
                    ledger.numbers("stream", 1_000_000, 0.001), items, 50, kill_and_restart
                )
                assert isinstance(error, gl.OutcomeUnknown), error
                assert items == list(range(len(items))) and len(items) >= 50
                await executor.wait_ready(10)
                assert history == ["ready", "reconnecting", "offline", "ready"]
                fresh = [i async for i in ledger.numbers("stream-2", 500)]
                assert fresh == list(range(500))
            assert journal_count(journal, "start", "stream") == 1
            assert journal_count(journal, "start", "stream-2") == 1


# ---------------------------------------------------------------------------------- controller dies


async def _cli_call(controller_toml: Path, target: str, args: str) -> anyio.abc.Process:
    return await anyio.open_process(
        [sys.executable, "-m", "garcon_link.cli", "call", str(controller_toml), target, args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.parametrize("what", ["call", "stream"])
async def test_controller_killed_worker_survives_and_serves_a_new_controller(
    tmp_path: Path, what: str
) -> None:
    with anyio.fail_after(DEADLINE):
        async with worker_process(tmp_path) as (worker, journal, controller_toml):
            token = f"orphan-{what}"
            if what == "call":
                process = await _cli_call(controller_toml, "ledger.hold", f'["{token}"]')
            else:
                process = await _cli_call(
                    controller_toml, "ledger.numbers", f'["{token}", 10000000, 0.001]'
                )
            try:
                await wait_for(
                    lambda: journal_count(journal, "start", token) == 1,
                    10,
                    f"the killed controller's {what} to start on the worker",
                )
                if what == "stream":
                    # The CLI prints one JSON line per item: see some arrive, in order.
                    assert process.stdout is not None
                    seen = b""
                    with anyio.fail_after(10):
                        while seen.count(b"\n") < 20:
                            seen += await process.stdout.receive()
                    numbers = [int(x) for x in seen.split(b"\n")[:-1]]
                    assert numbers == list(range(len(numbers)))
                old_ready = await worker.wait_line("executor-ready", count=1)
            finally:
                await kill_and_reap(process)
            assert process.returncode is not None and process.returncode < 0

            limits = gl.Limits(**LIMITS)
            async with gl.connect(controller_config(limits, worker.url)) as executor:
                history: list[str] = []
                executor.on_availability_changed(history.append)
                await executor.wait_ready(10)
                ledger = executor.service("ledger", Ledger)
                # The worker's orphaned handler is cancelled (its generator closed) when the new
                # controller's fresh session replaces the dead one.
                ended = "cancelled" if what == "call" else "closed"
                await wait_for(
                    lambda: journal_count(journal, ended, token) == 1,
                    10,
                    f"the worker to end the orphaned {what}",
                )
                assert await ledger.count_of(token) == 1  # ran once, never again
                assert await ledger.apply("new", b"z") == checksum("new", b"z")
                # The surviving worker was not restarted.
                assert await ledger.pid() == worker.pid and worker.starts == 1 and worker.running
                new_ready = await worker.wait_line("executor-ready", count=2)
                assert _field(new_ready, "session") != _field(old_ready, "session")
                info = await executor.info()
                assert info.instance_id.hex() == _field(new_ready, "instance")
                # A reference minted in the dead controller's session is stale.
                old = gl.ResourceRef(
                    "job", EXECUTOR_ID, bytes.fromhex(_field(old_ready, "instance")), "job-0"
                )
                with pytest.raises(gl.StaleResource):
                    await ledger.job_name(old)
                assert history == ["ready"]


# ---------------------------------------------------------------------------------- drain


DRAIN = 2.0  # the worker's --drain: the quick calls finish within it, the slow ones cannot


async def test_sigterm_drains_64_calls_in_flight(tmp_path: Path) -> None:
    quick, slow = 1.0, 60.0  # seconds each handler sleeps; every other call is slow
    tokens = {f"drain-{i}": quick if i % 2 else slow for i in range(64)}
    outcomes: dict[str, str | BaseException] = {}
    with anyio.fail_after(DEADLINE):
        async with worker_process(tmp_path, ("--drain", str(DRAIN))) as (worker, journal, _):
            limits = gl.Limits(**LIMITS)
            async with gl.connect(controller_config(limits, worker.url)) as executor:
                await executor.wait_ready(10)
                ledger = executor.service("ledger", Ledger)

                async def call(token: str) -> None:
                    try:
                        outcomes[token] = await ledger.apply(token, token.encode(), tokens[token])
                    except gl.CallError as exc:
                        outcomes[token] = exc

                def events(kind: str) -> set[str]:
                    return {t for e, t in read_journal(journal) if e == kind}

                async with anyio.create_task_group() as tg:
                    for token in tokens:
                        tg.start_soon(call, token)
                    await wait_for(lambda: len(events("start")) == 64, 10, "64 handlers started")
                    worker.terminate()
                    line = await worker.wait_line("executor-draining")
                    assert _field(line, "reason") == "SIGTERM"
                    assert 32 <= int(_field(line, "running")) <= 64  # the slow ones at least
                    with pytest.raises(gl.NotDispatched) as refused:
                        await ledger.apply("during-drain", b"x")
                    assert refused.value.code == "DRAINING"
                assert await worker.wait(10) == 0
                assert (
                    worker.lines[-1] == f"executor-stopping executor={EXECUTOR_ID} reason=SIGTERM"
                )

    journal_events = read_journal(journal)
    done, cancelled = events("done"), events("cancelled")
    starts = [t for e, t in journal_events if e == "start"]
    assert sorted(starts) == sorted(tokens)  # each ran exactly once; "during-drain" never
    assert len(outcomes) == 64
    for token, outcome in outcomes.items():
        if isinstance(outcome, str):
            # A success is real: the handler ran to its end and this is its checksum.
            assert token in done, f"{token} reported success but never finished"
            assert outcome == checksum(token, token.encode())
        else:
            assert isinstance(outcome, gl.OutcomeUnknown), (token, outcome)
            assert token not in done and token in cancelled, token
    assert {t for t, o in outcomes.items() if isinstance(o, str)} == {
        t for t, hold in tokens.items() if hold == quick
    }  # the quick ones all finished within the drain; the slow ones could not


# ---------------------------------------------------------------------------------- the helper


async def test_worker_process_helper_reports_failures_clearly(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        worker_toml, _ = write_configs(tmp_path, port=0, limits=LIMITS)
        # A worker that cannot start: start() says why, with the child's stderr.
        async with WorkerProcess(worker_toml, ["x=no_such_module:X"], cwd=TESTS_DIR) as broken:
            with pytest.raises(RuntimeError, match="no_such_module"):
                await broken.start()
            assert not broken.running and broken.returncode == 2
        # Port 0: a restarted worker would come back elsewhere, which restart() refuses.
        async with WorkerProcess(worker_toml, [SERVICE], cwd=TESTS_DIR) as worker:
            with pytest.raises(RuntimeError, match="has not been started"):
                _ = worker.url
            url = await worker.start()
            running = worker.running  # a local: mypy would keep the property's narrowing
            assert url.startswith("ws://127.0.0.1:") and running
            with pytest.raises(RuntimeError, match="still running"):
                await worker.start()
            with pytest.raises(RuntimeError, match="fixed port"):
                await worker.restart()
            assert not worker.running and worker.starts == 2
        assert worker.returncode is not None
