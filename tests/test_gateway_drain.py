"""A gateway's drain, on its callers' side (docs/guides/gateway.md#operating-the-gateway): the
contract a draining worker keeps with its controllers, kept by the gateway with its callers.

In one process over loopback, a gateway, an executor and callers. What the tests prove, on facts
the executor's service records and the gateway's counters (never on a sleep):

* a caller the gateway does not yet serve is refused at the handshake (4010), at once: it never
  has a session, its calls fail ``NotDispatched("DRAINING")`` at once saying the *gateway*
  drains, and the gateway counts the refusal;
* a caller the gateway serves and whose socket drops mid-drain resumes its session, and its
  relayed call in flight gets the executor's real result;
* the drain then ends in time, and the gateway closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Protocol

import anyio
import pytest
from faultutil import wait_for
from test_gateway import (
    DEADLINE,
    caller,
    caller_config,
    device_config,
    running_gateway,
)

import garcon_link as gl

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

GRANTS = (gl.Grant(callers=("web-*",), executors=("box-*",)),)


class Gate(Protocol):
    async def wait(self) -> str: ...


class GateService:
    """A call that runs until the test releases it."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.release = anyio.Event()
        self.runs = 0

    async def wait(self) -> str:
        self.runs += 1
        self.started.set()
        await self.release.wait()
        return "released"


@asynccontextmanager
async def gate_device(tmp_path: Path, url: str) -> AsyncIterator[GateService]:
    service = GateService()
    config = device_config(tmp_path, "box-1", url)
    async with gl.Worker(config, {"gate": service}):
        yield service


async def test_a_draining_gateway_refuses_new_callers_and_admits_resumes(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path, GRANTS) as gw, AsyncExitStack() as stack:
            service = await stack.enter_async_context(gate_device(tmp_path, gw.url))
            web = await stack.enter_async_context(caller(tmp_path, "web-1", gw.url))
            await web.executor("box-1").wait_ready(10)
            held: list[object] = []
            drained: list[bool] = []

            async def hold() -> None:
                try:
                    held.append(await web.executor("box-1").service("gate", Gate).wait())
                except gl.CallError as exc:
                    held.append(exc)

            async def drain() -> None:
                drained.append(await gw.drain(DEADLINE))

            async with anyio.create_task_group() as tg:
                tg.start_soon(hold)
                await service.started.wait()
                tg.start_soon(drain)
                await wait_for(lambda: web.gateway.availability == "draining", 5, "the goodbye")
                with pytest.raises(gl.NotDispatched) as told:
                    await web.executor("box-1").service("gate", Gate).wait()
                assert told.value.code == "DRAINING"
                assert "the gateway is draining" in told.value.message

                # A caller the gateway does not serve yet: refused at the handshake, at once.
                fresh = gl.connect_gateway(caller_config(tmp_path, "web-2", gw.url))
                async with fresh:
                    with anyio.fail_after(5), pytest.raises(gl.NotDispatched) as refused:
                        await fresh.gateway.wait_ready(refused_dials=1)
                    assert refused.value.code == "DRAINING", refused.value
                    assert "4010" in refused.value.message
                    assert fresh.gateway.availability == "offline"  # it never had a session
                    with pytest.raises(gl.NotDispatched) as call_refused:
                        await fresh.executor("box-1").service("gate", Gate).wait()
                    assert call_refused.value.code == "DRAINING"
                    assert "the gateway is draining" in call_refused.value.message
                    assert fresh.executor("box-1").errors == 0  # a drain refusal is no error
                    # Waiting for an executor goes on (for a restarted gateway) and says why.
                    with pytest.raises(TimeoutError, match="the gateway is draining"):
                        await fresh.executor("box-1").wait_ready(0.05)
                    link = fresh.gateway.link.statistics()
                    assert link.fresh_sessions == 0 and link.handshakes_completed == 0
                assert gw.caller_link_statistics().sessions_refused_draining >= 1
                assert "web-2" not in gw.caller_sessions()

                # The served caller's socket drops mid-drain: its resume is admitted.
                resumed = gw.caller_link_statistics().resumed
                await web.gateway.link.disconnect()
                await wait_for(
                    lambda: gw.caller_link_statistics().resumed > resumed, 5, "the resume"
                )
                await wait_for(lambda: web.gateway.availability == "draining", 5, "draining")
                assert drained == []  # the drain waits for the relayed call
                service.release.set()
            assert held == ["released"]  # the real result, after the resume
            assert drained == [True]
            assert service.runs == 1
