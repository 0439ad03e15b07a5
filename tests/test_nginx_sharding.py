"""Sharding a fleet across controller endpoints behind a real nginx (DESIGN §12, "Beyond one
process"; issue 15 item 3 in part).

Two listening fleet controllers (in this process, each with its own port and the same keyring)
sit behind nginx, which terminates ``wss://`` and picks the upstream with
``hash $arg_executor consistent;``. Twelve workers dial
``wss://localhost:PORT/executor?executor=<id>`` -- the routing hint of their dial URL. What the
test proves:

* every executor lands on exactly one controller, the same one its id hashes to, and both
  controllers get some;
* ``nginx -s reload`` cuts every socket; each executor resumes the *same* session on the *same*
  controller (resumes never cross controllers);
* closing one controller takes out only its own executors: the other's keep their sessions and
  keep answering.

Skipped without nginx outside CI, like tests/test_nginx.py (``.ci/run`` installs it).
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
import pytest
from faultutil import wait_for
from test_nginx import LIMITS, nginx_in_front_of

import garcon_link as gl
from garcon_link.config import read_secret_file, write_secret_file
from garcon_link.testing import free_tcp_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

DEADLINE = 60.0
IDS = [f"shard-box-{i}" for i in range(12)]


class Ident(Protocol):
    async def whoami(self) -> str: ...


class IdentService:
    def __init__(self, executor_id: str) -> None:
        self.executor_id = executor_id

    async def whoami(self) -> str:
        return self.executor_id


async def controller(
    keyring: Path,
    stop: anyio.Event,
    done: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[gl.Fleet] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """A listening fleet controller in a task of its own, until ``stop`` (as a process would
    run: closing it is ending its task, not a call from inside other scopes)."""
    config = gl.FleetConfig(listen=("127.0.0.1", free_tcp_port()), keyring=keyring, limits=LIMITS)
    async with gl.fleet(config) as fleet:
        task_status.started(fleet)
        await stop.wait()
    done.set()


def placement(fleets: list[gl.Fleet]) -> dict[str, tuple[int, str | None]]:
    """executor id -> (index of the controller where it is ready, its session)."""
    out: dict[str, tuple[int, str | None]] = {}
    for index, fleet in enumerate(fleets):
        for executor_id, snap in fleet.executors().items():
            if snap.availability == "ready":
                assert executor_id not in out, f"{executor_id} is ready on two controllers"
                out[executor_id] = (index, snap.session)
    return out


async def test_executors_stay_on_their_shard_across_reloads(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    secrets = {i: read_secret_file(write_secret_file(keyring / f"{i}.secret")) for i in IDS}
    nginx_dir = tmp_path / "nginx"
    nginx_dir.mkdir()
    stops = [anyio.Event(), anyio.Event()]
    done = [anyio.Event(), anyio.Event()]
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            first = await tg.start(controller, keyring, stops[0], done[0])
            second = await tg.start(controller, keyring, stops[1], done[1])
            fleets = [first, second]
            async with (
                nginx_in_front_of(
                    nginx_dir,
                    first.listen_address[1],
                    second.listen_address[1],
                    balance="hash $arg_executor consistent;",
                ) as nginx,
                AsyncExitStack() as workers,
            ):
                for executor_id in IDS:
                    config = gl.LinkConfig(
                        executor_id=executor_id,
                        role=gl.Role.WORKER,
                        secret=secrets[executor_id],
                        dial=f"wss://localhost:{nginx.port}/executor?executor={executor_id}",
                        tls=gl.TlsConfig(ca=nginx_dir / "ca.pem"),
                        limits=LIMITS,
                    )
                    await workers.enter_async_context(
                        gl.Worker(config, {"ident": IdentService(executor_id)})
                    )
                await wait_for(lambda: len(placement(fleets)) == len(IDS), 20, "all ready")
                before = placement(fleets)
                shards = {index for index, _ in before.values()}
                assert shards == {0, 1}, f"one controller got every executor: {before}"
                for executor_id, (index, _) in before.items():
                    ident = fleets[index].executor(executor_id).service("ident", Ident)
                    assert await ident.whoami() == executor_id

                # A reload cuts every socket: each executor resumes where it was.
                resumed = [f.statistics().resumed for f in fleets]
                await nginx.reload()
                await wait_for(
                    lambda: (
                        sum(f.statistics().resumed for f in fleets) - sum(resumed) >= len(IDS)
                        and placement(fleets) == before
                    ),
                    20,
                    "every executor to resume on its own controller",
                )
                assert placement(fleets) == before  # same controller, same session

                # Closing one controller affects only its shard.
                gone = [i for i, (index, _) in before.items() if index == 0]
                kept = [i for i, (index, _) in before.items() if index == 1]
                stops[0].set()  # the first controller's task ends: its fleet closes
                with anyio.fail_after(10):
                    await done[0].wait()
                for executor_id in kept:
                    ident = second.executor(executor_id).service("ident", Ident)
                    assert await ident.whoami() == executor_id
                after = {i: p for i, p in placement([second]).items() if i in kept}
                assert after == {i: (0, before[i][1]) for i in kept}
                assert gone, "the closed controller served nobody"
            stops[1].set()
