"""The gateway's unary relay: what a relayed call returns and counts, whichever way the gateway
forwards it (from the dispatch of the caller's message, or from the relay service's handler).

tests/test_gateway.py covers the outcomes across two hops, grants, keys, streams and drains;
these tests pin the values and counters of relayed unary calls: every result exactly as the
executor's worker returned it (small ones pass the gateway undecoded, large ones arrive there in
parts), every error with its code, and the counters of both hops.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import cbor2
import pytest
from faultutil import wait_for
from rpcutil import raw_call
from test_gateway import DEADLINE, LIMITS, caller, device_config, running_gateway

import garcon_link as gl
from garcon_link.api.relay import RELAY_SERVICE, decode_outcome
from garcon_link.rpc.rpc import Forward

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class Echo(Protocol):
    async def echo(self, value: Any) -> Any: ...

    async def fail(self, text: str) -> str: ...

    async def hold(self, seconds: float) -> str: ...


class EchoService:
    def __init__(self) -> None:
        self.calls = 0
        self.started = anyio.Event()

    async def echo(self, value: Any) -> Any:
        self.calls += 1
        return value

    async def fail(self, text: str) -> str:
        self.calls += 1
        raise ValueError(text)

    async def hold(self, seconds: float) -> str:
        self.calls += 1
        self.started.set()
        await anyio.sleep(seconds)
        return "held"


@asynccontextmanager
async def echo_device(tmp_path: Path, url: str) -> AsyncIterator[EchoService]:
    service = EchoService()
    config = device_config(tmp_path, "box-1", url)
    # The grants of running_gateway let web-* call service "ident" on box-*.
    async with gl.Worker(config, {"ident": gl.Service(service, Echo)}):
        yield service


VALUES: list[Any] = [
    None,
    0,
    -(2**63),
    2**64 - 1,
    1.5,
    True,
    "",
    "été" * 100,
    b"",
    b"\x00" * 23,
    [1, [2, [3, []]], {"k": None}],
    {"a": b"bytes", "b": [1.25, False], "c": {"d": "e"}},
    b"x" * (LIMITS.bulk_chunk_bytes * 2 + 7),  # sent in parts on both hops
    "y" * (LIMITS.bulk_chunk_bytes + 1),
]


async def test_relayed_results_arrive_exactly_as_returned_and_are_counted(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            service = await stack.enter_async_context(echo_device(tmp_path, gw.url))
            web = await stack.enter_async_context(caller(tmp_path, "web-1", gw.url))
            member = web.executor("box-1")
            await member.wait_ready(10)
            echo = member.service("ident", Echo)
            for value in VALUES:
                assert await echo.echo(value) == value
            # Many at once: each reply goes to its own call.
            results: dict[int, Any] = {}

            async def one(index: int) -> None:
                results[index] = await echo.echo([index, "v" * index])

            async with anyio.create_task_group() as tg:
                for index in range(64):
                    tg.start_soon(one, index)
            assert results == {i: [i, "v" * i] for i in range(64)}
            with pytest.raises(gl.RemoteError) as failed:
                await echo.fail("boom")
            assert failed.value.code == "HANDLER_FAILED" and "boom" in failed.value.message
            calls = len(VALUES) + 64 + 1
            assert service.calls == calls
            stats = gw.callers()["web-1"]
            assert (stats.calls, stats.errors, stats.forbidden) == (calls, 1, 0)
            assert stats.bytes > LIMITS.bulk_chunk_bytes * 3
            forwarded = gw.fleet.executors()["box-1"]
            assert (forwarded.calls, forwarded.errors) == (calls, 1)
            assert (member.calls, member.errors) == (calls, 1)


async def test_a_relayed_call_leaves_no_cycle_behind(tmp_path: Path) -> None:
    """What the gateway holds for a relayed call (its forward, the pending call, the relay
    call answered from the reply) is freed by reference counting once the call ends, not left
    for the cycle collector, whose passes grow with the calls in flight: with the collector
    off, the forwards of 40 calls do not pile up (one may wait in the session's queue of
    deadlines until the next forward drops it)."""
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            await stack.enter_async_context(echo_device(tmp_path, gw.url))
            web = await stack.enter_async_context(caller(tmp_path, "web-1", gw.url))
            member = web.executor("box-1")
            await member.wait_ready(10)
            echo = member.service("ident", Echo)
            assert await echo.echo(-1) == -1
            gc.collect()
            gc.disable()
            try:
                for index in range(40):
                    assert await echo.echo(index) == index
                alive = sum(1 for item in gc.get_objects() if type(item) is Forward)
            finally:
                gc.enable()
            assert alive <= 2
            assert gw.callers()["web-1"].calls == 41


async def test_a_relayed_timeout_and_cancel_reach_the_executor(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            service = await stack.enter_async_context(echo_device(tmp_path, gw.url))
            web = await stack.enter_async_context(caller(tmp_path, "web-1", gw.url))
            await web.executor("box-1").wait_ready(10)
            # The caller's own watch of the fleet is a relay stream open all along.
            watching = web.gateway.pending_calls
            echo = web.executor("box-1").service("ident", Echo)
            quick = gl.with_options(echo, timeout=0.2)
            with pytest.raises(gl.OutcomeUnknown) as timed_out:
                await quick.hold(30)
            assert timed_out.value.code == "TIMEOUT"  # cancelled while running, on the worker
            # The caller gives up: its cancel goes through the gateway to the worker, whose
            # handler slot is freed (the next call is served at once).
            service.started = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(echo.hold, 30)
                await service.started.wait()
                tg.cancel_scope.cancel()
            assert await echo.echo("after") == "after"
            stats = gw.callers()["web-1"]
            assert stats.calls == 3 and stats.errors == 1
            # Nothing of the relay is left in flight on either hop.
            await wait_for(
                lambda: (
                    web.gateway.pending_calls == watching
                    and gw.fleet.executors()["box-1"].pending == 0
                ),
                10,
                "no relayed call left pending",
            )


async def test_a_relay_call_of_the_wrong_shape_is_refused_not_forwarded(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            service = await stack.enter_async_context(echo_device(tmp_path, gw.url))
            web = await stack.enter_async_context(caller(tmp_path, "web-1", gw.url))
            await web.executor("box-1").wait_ready(10)
            rpc = web.gateway.current_rpc
            assert rpc is not None
            payload = cbor2.dumps([["x"], {}])
            # Not a timeout at all: the relay call itself is refused.
            odd: tuple[Any, ...] = (10**400, "5", [1])
            for timeout in odd:
                arguments = ["box-1", "ident", "echo", payload, None, timeout]
                with pytest.raises(gl.Rejected) as refused:
                    await raw_call(rpc, RELAY_SERVICE, "call", arguments)
                assert refused.value.code == "INVALID_ARGUMENTS", timeout
            # A number that is no timeout: refused by the relay, the refusal as its outcome.
            numbers: tuple[Any, ...] = (-1, 0, 0.0, float("nan"), float("inf"))
            for timeout in numbers:
                arguments = ["box-1", "ident", "echo", payload, None, timeout]
                reply = await raw_call(rpc, RELAY_SERVICE, "call", arguments)
                _, error = decode_outcome(reply, LIMITS.max_frame_bytes)
                assert isinstance(error, gl.Rejected), timeout
                assert error.code == "INVALID_ARGUMENTS" and "timeout" in error.message
            assert service.calls == 0
            # The same call with a sound timeout goes through.
            reply = await raw_call(
                rpc, RELAY_SERVICE, "call", ["box-1", "ident", "echo", payload, None, 5]
            )
            assert decode_outcome(reply, LIMITS.max_frame_bytes) == ("x", None)
            assert service.calls == 1
