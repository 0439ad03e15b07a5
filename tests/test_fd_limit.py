"""A listener at its process's file-descriptor limit.

A listening worker runs in a child process (``fd_limit_child.py``) whose ``RLIMIT_NOFILE`` is 64,
on asyncio (the lean accept loop of ``_asyncio_stream``) and on trio (the loop over anyio's
listeners in ``ws``). With one controller attached, the test opens more raw TCP sockets to it
than fit. Then, per backend:

* the process stays alive and the established executor's calls keep succeeding;
* the failed accepts are reported rate-limited: a log line says how many failures it covers,
  and there are fewer lines than failures (one per interval, not one per socket or retry);
* once the excess sockets close, a new connection is accepted and answered again.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Protocol

import anyio
import anyio.abc
import anyio.streams.buffered
import pytest
from faultutil import TESTS_DIR

import garcon_link as gl

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

NOFILE = 64
EXCESS = 100  # raw sockets opened: more than NOFILE descriptors can hold
SECRET = bytes(range(32))
REPORT = re.compile(rb"LOG garcon_link\.\S+ accept on .* failed: .*\((\d+) failure\(s\) since")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the test's own side; the child runs each backend


class Echo(Protocol):
    async def echo(self, text: str) -> str: ...


class Child:
    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None and process.stderr is not None
        self.stdout = anyio.streams.buffered.BufferedByteReceiveStream(process.stdout)
        self.stderr = anyio.streams.buffered.BufferedByteReceiveStream(process.stderr)
        self.log: list[bytes] = []

    async def line(self) -> bytes:
        return await self.stdout.receive_until(b"\n", 1024)

    async def connections(self) -> int:
        assert self.process.stdin is not None
        await self.process.stdin.send(b"stats\n")
        reply = await self.line()
        assert reply.startswith(b"STATS "), reply
        return int(reply.split()[1])

    async def read_log(self) -> None:
        while True:
            try:
                self.log.append(await self.stderr.receive_until(b"\n", 65536))
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return

    def reports(self) -> list[int]:
        """The failure count of each rate-limited accept report so far."""
        return [int(m.group(1)) for line in self.log if (m := REPORT.search(line))]


@asynccontextmanager
async def child(backend: str) -> AsyncIterator[tuple[Child, int]]:
    command = [sys.executable, str(TESTS_DIR / "fd_limit_child.py"), backend, str(NOFILE)]
    process = await anyio.open_process([*command, SECRET.hex()], stderr=subprocess.PIPE)
    async with process, anyio.create_task_group() as tg:
        handle = Child(process)
        tg.start_soon(handle.read_log)
        try:
            with anyio.fail_after(20):
                ready = await handle.line()
            assert ready.startswith(b"READY "), (ready, handle.log)
            yield handle, int(ready.split()[1])
        finally:
            process.kill()
            with anyio.CancelScope(shield=True):
                await process.wait()
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_at_the_fd_limit_new_sockets_wait_and_established_ones_are_served(
    backend: str,
) -> None:
    if backend == "trio":
        pytest.importorskip("trio")
    async with child(backend) as (proc, port):
        config = gl.LinkConfig(
            executor_id="fd",
            role=gl.Role.CONTROLLER,
            secret=gl.Secret(SECRET),
            dial=f"ws://127.0.0.1:{port}/executor",
        )
        async with gl.connect(config) as executor, AsyncExitStack() as excess:
            await executor.wait_ready(timeout=10)
            echo = executor.service("echo", Echo)
            assert await echo.echo("before") == "before"

            for _ in range(EXCESS):
                excess.push_async_callback((await anyio.connect_tcp("127.0.0.1", port)).aclose)
            # At the limit: keep calling the established executor until two rate-limited
            # reports came (the second covers every failure of an interval).
            calls = 0
            with anyio.fail_after(20):
                while len(proc.reports()) < 2:
                    assert await echo.echo(f"call {calls}") == f"call {calls}"
                    calls += 1
                    await anyio.sleep(0.01)
            assert proc.process.returncode is None
            reports = proc.reports()
            assert reports[0] == 1  # the first failure is reported at once
            assert max(reports[1:]) > 1, reports  # later lines each cover many failures
            failures = sum(reports)
            assert len(reports) < failures, (reports, proc.log)
            accepted_at_limit = await proc.connections()
            assert accepted_at_limit < 1 + EXCESS  # some sockets could not be accepted

        # The excess (and the controller) closed: descriptors are free, accepting resumes.
        with anyio.fail_after(20):
            while await proc.connections() < 1 + EXCESS:  # the backlog drains
                await anyio.sleep(0.05)
            stream = await anyio.connect_tcp("127.0.0.1", port)
            async with stream:
                await stream.send(b"GET /elsewhere HTTP/1.1\r\nHost: localhost\r\n\r\n")
                answer = await stream.receive()
        assert answer.startswith(b"HTTP/1.1 4"), answer
        assert proc.process.returncode is None
        assert not [line for line in proc.log if b"Traceback" in line], proc.log
