"""garcon_link on uvloop (the ``fast`` extra): a controller and a worker over a real socket.

Both ends run in one ``anyio.run(..., backend_options={"use_uvloop": True})``, as a user's
program would: calls, concurrent calls, a stream cut in the middle that resumes on the same
session, a remote error and a one-way notification answered by one from the worker. Skips with
a reason when uvloop is not installed (``pip install 'garcon-link[fast]'``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Protocol

import anyio
import pytest

import garcon_link as gl

uvloop = pytest.importorskip(
    "uvloop", reason="uvloop is not installed (pip install 'garcon-link[fast]')"
)

SECRET = gl.Secret(b"u" * 32)
EXECUTOR = "on-uvloop"
STREAM_ITEMS = 2000
CUT_AT = 500


class Api(Protocol):
    async def echo(self, data: bytes) -> bytes: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    async def fail(self, message: str) -> None: ...
    @gl.oneway
    async def ping(self, data: bytes) -> None: ...


class Sink(Protocol):
    @gl.oneway
    async def pong(self, data: bytes) -> None: ...


class ApiImpl:
    async def echo(self, data: bytes) -> bytes:
        return data

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def fail(self, message: str) -> None:
        raise ValueError(message)

    @gl.oneway
    async def ping(self, data: bytes) -> None:
        await gl.peer("sink", Sink).pong(data[::-1])


class SinkImpl:
    def __init__(self) -> None:
        self.received: list[bytes] = []
        self.arrived = anyio.Event()

    @gl.oneway
    async def pong(self, data: bytes) -> None:
        self.received.append(data)
        self.arrived.set()


LIMITS = gl.Limits(
    heartbeat_interval=0.5,
    heartbeat_timeout=2.0,
    connect_timeout=2.0,
    backoff_base=0.01,
    backoff_max=0.1,
)


async def controller_and_worker_on_uvloop() -> dict[str, object]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, uvloop.Loop), type(loop)
    observed: dict[str, object] = {}
    worker_config = gl.LinkConfig(
        executor_id=EXECUTOR,
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    with anyio.fail_after(30):
        async with gl.Worker(worker_config, {"api": gl.Service(ApiImpl(), Api)}) as worker:
            port = worker.link.listen_address[1]
            controller_config = gl.LinkConfig(
                executor_id=EXECUTOR,
                role=gl.Role.CONTROLLER,
                secret=SECRET,
                dial=f"ws://127.0.0.1:{port}/executor",
                limits=LIMITS,
            )
            sink = SinkImpl()
            services = {"sink": gl.Service(sink, Sink)}
            async with gl.connect(controller_config, services=services) as executor:
                await executor.wait_ready(timeout=10)
                api = executor.service("api", Api)

                big = os.urandom(256 * 1024)
                observed["echo_big"] = await api.echo(big) == big
                small = [os.urandom(32) for _ in range(64)]
                replies: list[bytes] = [b""] * len(small)

                async def one(index: int) -> None:
                    replies[index] = await api.echo(small[index])

                async with anyio.create_task_group() as tg:
                    for index in range(len(small)):
                        tg.start_soon(one, index)
                observed["concurrent_echo"] = replies == small

                transport = executor.link.transport
                assert transport is not None
                session_before = transport.session_id
                stats_before = executor.link.statistics()
                items: list[int] = []
                async for item in api.count(STREAM_ITEMS):
                    items.append(item)
                    if len(items) == CUT_AT:
                        await executor.link.disconnect()  # socket aborted, session kept
                observed["stream"] = items == list(range(STREAM_ITEMS))
                await executor.wait_ready(timeout=10)
                stats_after = executor.link.statistics()
                after = executor.link.transport
                observed["same_session"] = after is not None and after.session_id == session_before
                observed["resumed"] = stats_after.resumed - stats_before.resumed
                observed["fresh_sessions"] = (
                    stats_after.fresh_sessions - stats_before.fresh_sessions
                )

                with pytest.raises(gl.RemoteError) as caught:
                    await api.fail("on uvloop")
                observed["remote_error"] = "on uvloop" in str(caught.value)

                await api.ping(b"abc")
                await sink.arrived.wait()
                observed["pong"] = sink.received
    return observed


def test_controller_and_worker_run_on_uvloop() -> None:
    observed = anyio.run(
        controller_and_worker_on_uvloop, backend="asyncio", backend_options={"use_uvloop": True}
    )
    assert observed == {
        "echo_big": True,
        "concurrent_echo": True,
        "stream": True,
        "same_session": True,
        "resumed": 1,
        "fresh_sessions": 0,
        "remote_error": True,
        "pong": [b"cba"],
    }
