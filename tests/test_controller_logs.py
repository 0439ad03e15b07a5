"""What a controller logs about its worker that an operator must not miss."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
from rpcutil import CalcImpl, open_pair

import garcon_link as gl
from garcon_link.rpc.interface import service_spec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10.0


async def manifest_where(executor: gl.RemoteExecutor, holds: Any) -> gl.ExecutorInfo:
    """The executor's description once ``holds(info)``; bounded by the caller's deadline."""
    while not holds(info := await executor.info()):
        await anyio.sleep(0.005)
    return info


async def test_an_incompatible_change_is_logged_after_an_additive_one_within_the_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The contract-change lines are rate-limited per executor and verdict: an additive change
    (INFO) followed at once by an incompatible one still gives the incompatible one's WARNING,
    while a second incompatible change within ``log_interval`` is left out (and counted)."""
    caplog.set_level(logging.INFO, logger="garcon_link.remote")
    calc = service_spec(CalcImpl).manifest()
    text_add = {**calc, "add": {"kind": "unary", "signature": "(a: int, b: int) -> str"}}
    text_relay = {**text_add, "relay": {"kind": "unary", "signature": "(text: int) -> int"}}
    extra = {"extra": {"m": {"kind": "unary", "signature": "(a: int) -> int"}}}
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": CalcImpl()}) as pair:
            worker_rpc, executor = pair.worker_rpc, pair.executor
            await worker_rpc.announce_inventory(1, {"calc": calc, **extra})
            await manifest_where(executor, lambda i: "extra" in i.services)
            await worker_rpc.announce_inventory(2, {"calc": text_add, **extra})
            await manifest_where(
                executor, lambda i: i.services["calc"]["add"]["signature"].endswith("str")
            )
            await worker_rpc.announce_inventory(3, {"calc": text_relay, **extra})
            await manifest_where(
                executor, lambda i: "(text: int)" in i.services["calc"]["relay"]["signature"]
            )
    lines = [r for r in caplog.records if "contract changed" in r.getMessage()]
    assert [(r.levelno, "incompatible" in r.getMessage()) for r in lines] == [
        (logging.INFO, False),
        (logging.WARNING, True),
    ], [r.getMessage() for r in lines]
    assert "extra.m: additive" in lines[0].getMessage()
    assert "calc.add: incompatible" in lines[1].getMessage()
