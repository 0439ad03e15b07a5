"""A granted caller flooding the gateway with streams is held to its budget.

One caller's streams through the gateway to one executor count against its share of the
gateway's session to that executor (``gateway_caller_share`` of ``max_pending_calls``, here 2):
past it a stream is refused ``NotDispatched("OVERLOADED")`` at the gateway and never reaches
the worker (its ledger proves it), a stream that ends gives its place back, and another caller
is served meanwhile. No timing is asserted; the gateway's helpers are those of
tests/test_gateway.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from faultutil import wait_for
from test_gateway import DEADLINE, LIMITS, Ident, one_device_two_callers

import garcon_link as gl

SHARE = 2

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_a_caller_opening_streams_is_held_to_its_budget(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        limits = LIMITS.replace(max_pending_calls=SHARE * 4)
        async with one_device_two_callers(tmp_path, limits) as (_gw, service, greedy, other):
            ident = greedy.executor("box-1").service("ident", Ident)
            held: list[Any] = []
            for _ in range(SHARE):
                stream = ident.count(100_000)
                assert await stream.__anext__() == 0  # open, and forwarded
                held.append(stream)
            for _ in range(3):
                excess = ident.count(100_000)
                with pytest.raises(gl.NotDispatched) as refused:
                    await excess.__anext__()
                assert refused.value.code == "OVERLOADED"
                assert "its share" in refused.value.message
            assert service.ledger.count("count") == SHARE  # none forwarded
            # Another caller has a budget of its own.
            theirs = other.executor("box-1").service("ident", Ident)
            mine = theirs.count(3)
            assert [item async for item in mine] == [0, 1, 2]
            assert await theirs.whoami() == "box-1"
            # A stream that ends gives its place back (once the gateway has seen it end).
            await held.pop().aclose()

            async def reopened() -> bool:
                stream = ident.count(100_000)
                try:
                    assert await stream.__anext__() == 0
                except gl.NotDispatched:
                    return False
                held.append(stream)
                return True

            opened = False
            for _ in range(100):
                opened = await reopened()
                if opened:
                    break
                await anyio.sleep(0.02)
            assert opened, "the place of the closed stream was not given back"
            await wait_for(
                lambda: service.ledger.count("count") == SHARE + 2,
                5,
                "the reopened stream forwarded",
            )
            for stream in held:
                await stream.aclose()
