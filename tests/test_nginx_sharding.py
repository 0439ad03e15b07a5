"""Sharding a fleet across controller *processes* behind a real nginx
(docs/design.md#fleets).

Two fleet controller child processes (tests/shard_controller.py: each listens on its own port
with the same keyring and answers ``state`` and ``call ID`` lines on stdin) sit behind nginx,
which terminates ``wss://`` and picks the upstream with ``hash $arg_executor consistent;``.
Twelve workers (in this process) dial ``wss://localhost:PORT/executor?executor=<id>`` -- the
routing hint of their dial URL; their ids are picked, once the ports are known, so that six hash
to each process. What the test proves:

* every executor is ready on exactly one controller process, the one its id hashes to (computed
  here independently, by :func:`nginx_chash`: round-robin fails the test), and each answers
  calls through ``fleet.executor(id)`` of its process;
* ``nginx -s reload`` cuts every socket; each executor resumes the *same* session on the *same*
  process (resumes never cross processes);
* SIGKILL of one controller process affects only its shard: the survivor's executors keep their
  sessions (their workers see no new session, no resume) and keep answering through it. The
  killed shard's executors lose their sessions: nginx's hash still picks the dead upstream, the
  connect is refused (``connect() failed`` in nginx's error log) and, by nginx's default
  ``proxy_next_upstream error timeout``, nginx passes the socket to the next upstream, the
  survivor (and marks the dead one down for its ``fail_timeout``, 10 s by default). There each
  starts a *fresh* session (a new session id; the survivor counts exactly that many fresh
  sessions and no resume; each such worker counts a new session, so it knows its old one and
  what it held are gone) -- never a resume across processes -- and answers calls again.

Skipped without nginx outside CI, like tests/test_nginx.py (``.ci/run`` installs it). asyncio
only: the child processes dominate the run time.
"""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from faultutil import TESTS_DIR, kill_and_reap
from test_nginx import LIMITS, _require_nginx, nginx_in_front_of

import garcon_link as gl
from garcon_link.settings.secrets import read_secret_file, write_secret_file

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

DEADLINE = 60.0
PER_SHARD = 6
Placement = dict[str, tuple[int, str | None]]
T = TypeVar("T")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # child processes dominate; one backend keeps make test short


class Shard:
    """One controller child process and its line protocol (tests/shard_controller.py)."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._out = BufferedByteReceiveStream(process.stdout)
        self.port = 0

    async def line(self) -> str:
        with anyio.fail_after(10):
            return (await self._out.receive_until(b"\n", 1 << 20)).decode()

    async def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        await self.process.stdin.send(command.encode() + b"\n")
        answer: dict[str, Any] = json.loads(await self.line())
        return answer

    async def ready(self) -> dict[str, str | None]:
        """executor id -> session, of the executors ready on this controller."""
        state = await self.ask("state")
        return {i: s for i, (a, s) in state["executors"].items() if a == "ready"}

    async def call(self, executor_id: str) -> None:
        assert await self.ask(f"call {executor_id}") == {"answer": executor_id}


@asynccontextmanager
async def shards(keyring: Path, count: int) -> AsyncIterator[list[Shard]]:
    async with AsyncExitStack() as stack:
        out = []
        for _ in range(count):
            command = [sys.executable, str(TESTS_DIR / "shard_controller.py"), str(keyring)]
            process = await anyio.open_process(command, stderr=subprocess.DEVNULL)
            stack.push_async_callback(kill_and_reap, process)
            out.append(Shard(process))
        for shard in out:
            first = await shard.line()
            assert first.startswith("READY "), first
            shard.port = int(first.split()[1])
        yield out


async def placement(shards: list[Shard]) -> Placement:
    """executor id -> (index of the controller process where it is ready, its session)."""
    out: Placement = {}
    for index, shard in enumerate(shards):
        for executor_id, session in (await shard.ready()).items():
            assert executor_id not in out, f"{executor_id} is ready on two controllers"
            out[executor_id] = (index, session)
    return out


def nginx_chash(ports: list[int], key: str) -> int:
    """The index of the upstream that nginx's ``hash KEY consistent`` picks for ``key`` (ketama,
    as ngx_http_upstream_hash.c builds it): 160 points per ``server 127.0.0.1:PORT``, point
    ``n`` being crc32(host NUL port, point ``n - 1`` as 4 little-endian bytes); the key's crc32
    goes to the first point at or above it, wrapping around."""
    points = []
    for index, port in enumerate(ports):
        base, previous = f"127.0.0.1\0{port}".encode(), 0
        for _ in range(160):
            previous = zlib.crc32(base + previous.to_bytes(4, "little"))
            points.append((previous, index))
    points.sort()
    hashes = [h for h, _ in points]
    return points[bisect.bisect_left(hashes, zlib.crc32(key.encode())) % len(points)][1]


def pick_ids(ports: list[int], per_shard: int) -> list[str]:
    """``per_shard`` executor ids that :func:`nginx_chash` sends to each of ``ports``."""
    by_shard: list[list[str]] = [[] for _ in ports]
    for n in range(10_000):  # bounded; a fair ring fills both within a few dozen ids
        executor_id = f"shard-box-{n}"
        shard = by_shard[nginx_chash(ports, executor_id)]
        if len(shard) < per_shard:
            shard.append(executor_id)
        if all(len(s) == per_shard for s in by_shard):
            return [i for s in by_shard for i in s]
    raise AssertionError(f"the hash ring of {ports} starves a port")


async def total_resumed(shards: list[Shard]) -> int:
    return sum([(await shard.ask("state"))["resumed"] for shard in shards])


async def poll(
    read: Callable[[], Awaitable[T]], done: Callable[[T], bool], what: str, timeout: float = 20
) -> T:
    """Read every 20 ms until ``done`` holds for what was read; fail after ``timeout`` s."""
    seen: T | None = None
    try:
        with anyio.fail_after(timeout):
            while True:
                value = await read()
                if done(value):
                    return value
                seen = value
                await anyio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}; last seen {seen}") from None


async def poll_placement(shards: list[Shard], until: Placement | int, what: str) -> Placement:
    """Poll until the placement equals ``until`` (or holds ``until`` executors)."""
    return await poll(lambda: placement(shards), lambda p: p == until or len(p) == until, what)


async def test_executors_stay_on_their_shard_process(tmp_path: Path) -> None:
    _require_nginx()
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    nginx_dir = tmp_path / "nginx"
    nginx_dir.mkdir()
    with anyio.fail_after(DEADLINE):
        async with (
            shards(keyring, 2) as controllers,
            nginx_in_front_of(
                nginx_dir,
                *(c.port for c in controllers),
                balance="hash $arg_executor consistent;",
            ) as nginx,
            AsyncExitStack() as stack,
        ):
            # Six ids per shard by the hash model (a random pair of ports could otherwise hash
            # all twelve to one process); their keys are written now, before any dial.
            ports = [c.port for c in controllers]
            ids = pick_ids(ports, PER_SHARD)
            secrets = {i: read_secret_file(write_secret_file(keyring / f"{i}.secret")) for i in ids}
            workers: dict[str, gl.Worker] = {}
            for executor_id in ids:
                config = gl.LinkConfig(
                    executor_id=executor_id,
                    role=gl.Role.WORKER,
                    secret=secrets[executor_id],
                    dial=f"wss://localhost:{nginx.port}/executor?executor={executor_id}",
                    tls=gl.TlsConfig(ca=nginx_dir / "ca.pem"),
                    limits=LIMITS,
                )
                workers[executor_id] = await stack.enter_async_context(
                    gl.Worker(config, {"ident": IdentService(executor_id)})
                )
            before = await poll_placement(controllers, len(ids), "all ready")
            assert {i: index for i, (index, _) in before.items()} == {
                i: nginx_chash(ports, i) for i in ids
            }, "an executor is not on the controller its id hashes to"
            assert {index for index, _ in before.values()} == {0, 1}, (
                f"one controller got every executor: {before}"
            )
            for executor_id, (index, _) in before.items():
                await controllers[index].call(executor_id)

            # A reload cuts every socket: each executor resumes where it was.
            resumed = await total_resumed(controllers)
            await nginx.reload()
            await poll(
                lambda: total_resumed(controllers),
                lambda now: now - resumed >= len(ids),
                "every executor to resume",
            )
            assert await poll_placement(controllers, before, "resume on own controller") == before

            # SIGKILL of one controller process affects only its shard.
            gone = sorted(i for i, (index, _) in before.items() if index == 0)
            kept = sorted(i for i, (index, _) in before.items() if index == 1)
            link_before = {i: workers[i].link.statistics() for i in ids}
            sessions_before = {i: workers[i].statistics().sessions for i in ids}
            survivor, killed = controllers[1], controllers[0]
            survivor_before = await survivor.ask("state")
            killed.process.kill()
            with anyio.fail_after(10):
                await killed.process.wait()
            for executor_id in kept:
                await survivor.call(executor_id)
            # The killed shard's executors come back on the survivor, each with a new session.
            after = await poll_placement([survivor], len(ids), "the killed shard on the survivor")
            for executor_id in kept:
                assert after[executor_id] == (0, before[executor_id][1])  # same session
            for executor_id in gone:
                assert after[executor_id][1] != before[executor_id][1], f"{executor_id} resumed"
                await survivor.call(executor_id)
            survivor_after = await survivor.ask("state")
            assert survivor_after["resumed"] == survivor_before["resumed"]  # no resume crossed
            assert survivor_after["fresh"] - survivor_before["fresh"] == len(gone)
            for executor_id in ids:
                link = workers[executor_id].link.statistics()
                moved = executor_id in gone
                assert link.resumed == link_before[executor_id].resumed
                assert link.fresh_sessions == link_before[executor_id].fresh_sessions + moved
                assert workers[executor_id].statistics().sessions == (
                    sessions_before[executor_id] + moved
                )
            assert gone, "the killed controller served nobody"
            log = (nginx_dir / "error.log").read_text()
            assert "connect() failed" in log, "nginx never tried the dead upstream"


class IdentService:
    def __init__(self, executor_id: str) -> None:
        self.executor_id = executor_id

    async def whoami(self) -> str:
        return self.executor_id
