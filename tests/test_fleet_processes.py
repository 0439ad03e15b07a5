"""Fleet acceptance: 51 workers in three child processes dial one listening controller.

Every worker has its own key in the controller's keyring and serves ``ident`` (its own id, and
``apply(token)`` that appends to a per-executor ledger file: what actually ran). Five of them dial
through a :class:`~garcon_link.testing.FaultProxy`. The test proves, per executor:

* every facade call reaches the right executor (the worker answers with its own id);
* cutting the five proxied sockets while calls are in flight resumes exactly those five sessions
  (same session ids; the others' sockets and sessions are untouched), and every call made during
  the cuts ran exactly once (ledger);
* SIGKILL of the child that runs one worker takes only that executor out (the others keep
  serving); killing and restarting the child that runs 25 gives exactly those 25 fresh sessions;
* deleting one key file takes only that executor out.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
import pytest
from faultutil import TESTS_DIR, wait_for

import garcon_link as gl
from garcon_link.settings.secrets import write_secret_file
from garcon_link.testing import FaultProxy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

DEADLINE = 90.0
N_BIG = 25  # workers in each of the two big children
N_PROXIED = 5
LIMITS = gl.Limits(
    heartbeat_interval=0.2,
    heartbeat_timeout=2.0,
    detached_grace=5.0,
    backoff_base=0.02,
    backoff_max=0.2,
    connect_timeout=2.0,
    call_timeout=20.0,
    dispatch_deadline=15.0,
    key_recheck_interval=0.2,
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # child processes dominate; one backend keeps make test short


class Ident(Protocol):
    async def whoami(self) -> str: ...

    async def apply(self, token: str) -> str: ...


@asynccontextmanager
async def children(
    keyring: Path, groups: list[list[tuple[str, str]]]
) -> AsyncIterator[list[anyio.abc.Process]]:
    async with AsyncExitStack() as stack:
        processes = []
        for group in groups:
            command = [
                sys.executable,
                str(TESTS_DIR / "fleet_workers.py"),
                str(keyring),
                *(f"{i}={u}" for i, u in group),
            ]
            process = await stack.enter_async_context(
                await anyio.open_process(command, stderr=subprocess.DEVNULL)
            )
            stack.push_async_callback(stop, process)
            processes.append(process)
        for process in processes:
            assert process.stdout is not None
            line = await process.stdout.receive()
            assert line.startswith(b"started"), line
        yield processes


async def stop(process: anyio.abc.Process) -> None:
    if process.returncode is None:
        process.kill()
    with anyio.CancelScope(shield=True):
        await process.wait()


def ledger(tmp_path: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in tmp_path.glob("ledger-*"):
        counts.update(path.read_text().splitlines())
    return counts


async def test_fifty_one_workers_in_three_processes(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    ids = [f"dev-{i:02d}" for i in range(2 * N_BIG + 1)]
    for executor_id in ids:
        write_secret_file(keyring / f"{executor_id}.secret")
    config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=keyring, limits=LIMITS)
    with anyio.fail_after(DEADLINE):
        async with gl.fleet(config) as fleet, AsyncExitStack() as stack:
            proxies = {}
            for executor_id in ids[:N_PROXIED]:
                proxy = FaultProxy("127.0.0.1", fleet.listen_address[1])
                proxies[executor_id] = await stack.enter_async_context(proxy)
            url = {i: (proxies[i].url() if i in proxies else fleet.url) for i in ids}
            groups = [
                [(i, url[i]) for i in ids[:N_BIG]],
                [(i, url[i]) for i in ids[N_BIG:-1]],
                [(ids[-1], url[ids[-1]])],
            ]
            processes = await stack.enter_async_context(children(keyring, groups))
            for executor_id in ids:
                await fleet.executor(executor_id).wait_ready(30)

            # Every call reaches the executor it names.
            answers = await fleet.map(lambda ex: ex.service("ident", Ident).whoami())
            assert answers == {i: i for i in ids}

            # Cuts on five sockets, with calls in flight on every executor.
            before = {i: s.session for i, s in fleet.executors().items()}
            reconnecting: set[str] = set()
            for executor_id in ids:

                def note(a: str, i: str = executor_id) -> None:
                    if a == "reconnecting":
                        reconnecting.add(i)

                fleet.executor(executor_id).on_availability_changed(note)

            async def calls(executor: gl.RemoteExecutor) -> list[str]:
                ident = executor.service("ident", Ident)
                return [await ident.apply(f"t{n}") for n in range(10)]

            async with anyio.create_task_group() as tg:
                results: dict[str, object] = {}

                async def run() -> None:
                    results.update(await fleet.map(calls))

                tg.start_soon(run)
                # Cut once calls are flowing on the proxied executors (in flight, not before).
                resumed = fleet.statistics().resumed
                await wait_for(
                    lambda: all(fleet.executor(i).calls >= 3 for i in proxies),
                    10,
                    "calls under way on the proxied executors",
                )
                for proxy in proxies.values():
                    proxy.cut()
            assert results == {i: [f"{i}:t{n}" for n in range(10)] for i in ids}, results
            counts = ledger(tmp_path)
            assert all(counts[f"{i} t{n}"] == 1 for i in ids for n in range(10)), counts
            assert reconnecting <= set(proxies), reconnecting - set(proxies)
            assert fleet.statistics().resumed - resumed >= N_PROXIED
            assert all(p.statistics().cuts >= 1 for p in proxies.values())
            after = {i: s.session for i, s in fleet.executors().items()}
            assert after == before  # the cut ones resumed; nobody got a fresh session

            # SIGKILL of the child that runs one worker: only that executor goes.
            lone = fleet.executor(ids[-1])
            processes[-1].send_signal(signal.SIGKILL)
            await wait_for(lambda: lone.availability != "ready", 10, "the killed one to go")
            with pytest.raises(gl.NotDispatched):
                await gl.with_options(lone.service("ident", Ident), dispatch_deadline=0).whoami()
            answers = await fleet.map(lambda ex: ex.service("ident", Ident).whoami(), ids[:-1])
            assert answers == {i: i for i in ids[:-1]}

            # Kill the child running 25 workers and start it again: those 25 get fresh
            # sessions (a new process is a new runtime), the other 25 keep theirs.
            before = {i: s.session for i, s in fleet.executors().items()}
            processes[0].send_signal(signal.SIGKILL)
            await processes[0].wait()
            await stack.enter_async_context(children(keyring, [groups[0]]))
            for executor_id in ids[:N_BIG]:

                def on_a_fresh_session(i: str = executor_id) -> bool:
                    return (
                        fleet.executors()[i].session not in (None, before[i])
                        and fleet.executor(i).availability == "ready"
                    )

                await wait_for(
                    on_a_fresh_session,
                    30,
                    f"{executor_id} back on a fresh session",
                )
            after = {i: s.session for i, s in fleet.executors().items()}
            assert all(after[i] == before[i] for i in ids[N_BIG:-1])
            answers = await fleet.map(lambda ex: ex.service("ident", Ident).whoami(), ids[:-1])
            assert answers == {i: i for i in ids[:-1]}

            # Deleting one key: only that executor goes.
            revoked = fleet.executor(ids[N_BIG])
            (keyring / f"{ids[N_BIG]}.secret").unlink()
            await wait_for(lambda: revoked.availability == "offline", 10, "the revoked one")
            others = [i for i in ids[:-1] if i != ids[N_BIG]]
            answers = await fleet.map(lambda ex: ex.service("ident", Ident).whoami(), others)
            assert answers == {i: i for i in others}
            assert all(fleet.executors()[i].availability == "ready" for i in others)
