"""A granted caller flooding the gateway is held to its budget, and to a smaller one while
another caller is active on the same executor.

One caller's streams through the gateway to one executor count against its share of the
gateway's session to that executor (``gateway_caller_share`` of ``max_pending_calls``, here 2):
past it a stream is refused ``NotDispatched("OVERLOADED")`` at the gateway and never reaches
the worker (its ledger proves it), a stream that ends gives its place back, and another caller
is served meanwhile. While another caller has a call or stream there, each caller's share is
``gateway_contended_window`` split between them: the worker's ledger shows the flooder's calls
running at once held to it, the whole share returns once the other caller left, a caller's
streams opened while it was alone are fed only a share's worth at a time (the rest stand still
at the worker), a caller refused for want of a grant does not count, and a relayed stream's
credit to the executor follows its caller's share (its producer stops sooner beside another
caller, and goes on with the whole window once that caller has gone idle). No timing is
asserted; the gateway's helpers are those of tests/test_gateway.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest
from faultutil import wait_for
from test_gateway import (
    DEADLINE,
    LIMITS,
    Ident,
    caller,
    caller_config,
    device,
    enroll,
    one_device_two_callers,
    running_gateway,
)

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


class Pool(Protocol):
    async def work(self, tag: str) -> int: ...

    def produce(self, tag: str) -> AsyncIterator[int]: ...


class PoolService:
    """The worker's ledger of calls by tag: how many run now, and the most of ``greedy``'s
    that ran at once among those that began while one of ``other``'s ran (``peak_contended``).
    A call of a tag whose gate is closed waits for it to open."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.done: dict[str, int] = {}
        self.gates: dict[str, anyio.Event] = {"greedy": anyio.Event(), "other": anyio.Event()}
        self.contended = 0  # greedy calls running that began while another caller's ran
        self.peak_contended = 0
        self.produced: dict[str, int] = {}

    async def work(self, tag: str) -> int:
        self.running[tag] = self.running.get(tag, 0) + 1
        counted = tag == "greedy" and self.running.get("other", 0) > 0
        if counted:
            self.contended += 1
            self.peak_contended = max(self.peak_contended, self.contended)
        try:
            await self.gates[tag].wait()
        finally:
            self.running[tag] -= 1
            if counted:
                self.contended -= 1
        self.done[tag] = self.done.get(tag, 0) + 1
        return self.done[tag]

    async def produce(self, tag: str) -> AsyncIterator[int]:
        """Items 0, 1, 2, ... for as long as they are taken; ``produced[tag]`` counts them."""
        for index in range(1_000_000):
            self.produced[tag] = index + 1
            yield index


@asynccontextmanager
async def pool_and_two_callers(
    tmp_path: Path, limits: gl.Limits
) -> AsyncIterator[tuple[gl.Gateway, PoolService, gl.GatewayFleet, gl.GatewayFleet]]:
    """A gateway with ``limits``, device ``box-1`` serving a :class:`PoolService` as
    ``ident``, and callers ``web-1`` and ``web-2``, both ready for it."""
    pool = PoolService()
    async with running_gateway(tmp_path, limits=limits) as gw, AsyncExitStack() as stack:
        config = gl.LinkConfig(
            executor_id="box-1",
            role=gl.Role.WORKER,
            secret=enroll(tmp_path / "keys", "box-1"),
            dial=gw.url,
            limits=LIMITS,
        )
        await stack.enter_async_context(gl.Worker(config, {"ident": pool}))
        first = await stack.enter_async_context(caller(tmp_path, "web-1", gw.url))
        second = await stack.enter_async_context(caller(tmp_path, "web-2", gw.url))
        await first.executor("box-1").wait_ready(10)
        await second.executor("box-1").wait_ready(10)
        yield gw, pool, first, second


async def test_a_callers_share_shrinks_while_another_caller_is_active(tmp_path: Path) -> None:
    """Alone, a caller keeps its whole share of an executor's session (here 8); while another
    caller has a call there, each gets gateway_contended_window (4) divided by the two of
    them: the worker's ledger shows at most 2 of the flooder's calls running at once among
    those that began then, while the flooder is still served; once the other caller's call
    ended and gateway_active_window (0.05 s) passed, the whole share returns."""
    limits = LIMITS.replace(
        max_pending_calls=16,
        gateway_caller_share=0.5,
        gateway_contended_window=4,
        gateway_active_window=0.05,
        gateway_forbidden_delay=0.05,
    )
    whole, contended = 8, 2
    with anyio.fail_after(DEADLINE):
        async with pool_and_two_callers(tmp_path, limits) as (gw, pool, greedy, other):
            mine = greedy.executor("box-1").service("ident", Pool)
            theirs = other.executor("box-1").service("ident", Pool)
            refused: list[gl.CallError] = []

            async def lane() -> None:
                for _ in range(10_000):
                    try:
                        await mine.work("greedy")
                    except gl.NotDispatched as exc:
                        refused.append(exc)

            async with anyio.create_task_group() as tg:
                for _ in range(whole + 4):
                    tg.start_soon(lane)
                # Alone: the whole share runs at the worker, the rest is refused.
                await wait_for(lambda: pool.running.get("greedy") == whole, 10, "the whole share")
                await wait_for(lambda: len(refused) >= 4, 10, "the excess refused")
                assert {e.code for e in refused} == {"OVERLOADED"}
                assert gw.share_of("web-1", "box-1") == whole
                # Another caller arrives: its call is forwarded, and the flooder's share shrinks.
                tg.start_soon(theirs.work, "other")
                await wait_for(lambda: pool.running.get("other") == 1, 10, "the other's call")
                assert gw.share_of("web-1", "box-1") == contended
                assert gw.share_of("web-2", "box-1") == contended
                pool.gates["greedy"].set()  # the flooder's calls end at once from now on
                before = pool.done.get("greedy", 0)
                await wait_for(
                    lambda: pool.done.get("greedy", 0) >= before + whole + 50,
                    10,
                    "the flooder still served",
                )
                assert pool.running["other"] == 1
                assert 1 <= pool.peak_contended <= contended, pool.peak_contended
                # The other caller leaves: the flooder's whole share returns.
                pool.gates["greedy"] = anyio.Event()
                pool.gates["other"].set()
                await wait_for(
                    lambda: pool.running.get("greedy") == whole, 10, "the whole share back"
                )
                assert gw.share_of("web-1", "box-1") == whole
                pool.gates["greedy"].set()
                tg.cancel_scope.cancel()


async def test_a_refused_caller_does_not_count_as_active(tmp_path: Path) -> None:
    """A caller whose call or stream no grant allows is refused before it takes a share: it
    does not shrink the shares of the callers granted that executor."""
    limits = LIMITS.replace(max_pending_calls=16, gateway_contended_window=4)
    with anyio.fail_after(DEADLINE):
        async with one_device_two_callers(tmp_path, limits) as (gw, _service, granted, _):
            stack = AsyncExitStack()
            async with stack:
                stranger = await stack.enter_async_context(caller(tmp_path, "x-1", gw.url))
                ident = stranger.executor("box-1").service("ident", Ident)
                with pytest.raises(gl.Rejected) as refused:
                    await ident.count(3).__anext__()
                assert refused.value.code == "FORBIDDEN"
                with pytest.raises(gl.Rejected):
                    await ident.whoami()
            assert await granted.executor("box-1").service("ident", Ident).whoami() == "box-1"
            assert gw.share_of("web-1", "box-1") == 4  # a quarter of 16: the whole share


async def test_streams_opened_alone_go_on_a_share_at_a_time_once_another_caller_comes(
    tmp_path: Path,
) -> None:
    """A caller's streams opened while it was alone (its whole share, 4) stay open when another
    caller arrives, but only the first its new share covers (2) are fed: the others take no
    item from the executor, whose producers stop (the worker's counts stand still while the
    first two streams run on by hundreds of items), until the other caller has gone idle."""
    window = 2
    limits = LIMITS.replace(
        max_pending_calls=16,
        gateway_contended_window=4,
        gateway_active_window=0.05,
        gateway_stream_window_items=window,
    )
    with anyio.fail_after(DEADLINE):
        async with pool_and_two_callers(tmp_path, limits) as (gw, pool, greedy, other):
            mine = greedy.executor("box-1").service("ident", Pool)
            tags = [f"s{index}" for index in range(4)]
            streams = [mine.produce(tag) for tag in tags]
            for stream in streams:
                assert await stream.__anext__() == 0
            assert gw.share_of("web-1", "box-1") == 4
            async with anyio.create_task_group() as tg:
                tg.start_soon(other.executor("box-1").service("ident", Pool).work, "other")
                await wait_for(lambda: pool.running.get("other") == 1, 10, "the other's call")
                assert gw.share_of("web-1", "box-1") == 2
                taken = dict.fromkeys(tags, 1)

                async def drain(index: int) -> None:
                    async for _ in streams[index]:
                        taken[tags[index]] += 1

                for index in range(4):
                    tg.start_soon(drain, index)
                # The first two streams are fed; the last two stop.
                await wait_for(
                    lambda: min(taken["s0"], taken["s1"]) >= 200, 10, "the first two fed"
                )
                held = {tag: pool.produced[tag] for tag in ("s2", "s3")}
                await wait_for(
                    lambda: min(taken["s0"], taken["s1"]) >= 400, 10, "the first two still fed"
                )
                assert {tag: pool.produced[tag] for tag in ("s2", "s3")} == held
                # The other caller leaves: every stream is fed again.
                pool.gates["other"].set()
                await wait_for(
                    lambda: min(taken["s2"], taken["s3"]) >= 200, 10, "all four fed again"
                )
                tg.cancel_scope.cancel()


async def test_a_relayed_streams_credit_to_the_executor_follows_its_callers_share(
    tmp_path: Path,
) -> None:
    """While another caller has a call in flight on the executor, a stream a caller opens there
    keeps granted the executor gateway_stream_window_items (8) scaled by the caller's share now
    over its whole share (2 of 8): 2 items, so its producer stops within a few items of what the
    caller took (its own credit to the gateway is 1 item). Once the other caller has gone idle,
    the same stream's next grant tops it up to the whole window of 8. The bound holds at every
    instant; the pause only gives a runaway producer time to show."""
    limits = LIMITS.replace(
        max_pending_calls=16,
        gateway_caller_share=0.5,
        gateway_contended_window=4,
        gateway_active_window=0.05,
        gateway_stream_window_items=8,
    )
    slow = LIMITS.replace(stream_window_items=1, stream_window_bytes=1 << 20)
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path, limits=limits) as gw, AsyncExitStack() as stack:
            _, service = await stack.enter_async_context(device(tmp_path, "box-1", gw.url))
            config = caller_config(tmp_path, "web-1", gw.url)
            greedy = await stack.enter_async_context(gl.connect_gateway(config, limits=slow))
            other = await stack.enter_async_context(caller(tmp_path, "web-2", gw.url))
            await greedy.executor("box-1").wait_ready(10)
            await other.executor("box-1").wait_ready(10)
            mine = greedy.executor("box-1").service("ident", Ident)
            stream = mine.count(100_000)
            async with anyio.create_task_group() as tg:
                tg.start_soon(other.executor("box-1").service("ident", Ident).hold, 30.0)
                await service.started.wait()
                assert gw.share_of("web-1", "box-1") == 2
                assert await stream.__anext__() == 0
                await anyio.sleep(0.3)
                # Taken 1, the caller's credit 1, the gateway's credit to the executor 2 (at
                # most twice that): 6; a window of 8 would let it produce 8 or more.
                assert service.produced <= 1 + 1 + 2 * 2, service.produced
                tg.cancel_scope.cancel()  # the other caller's call ends
            await wait_for(
                lambda: gw.share_of("web-1", "box-1") == 8, 10, "the other caller gone idle"
            )
            assert await stream.__anext__() == 1
            await wait_for(lambda: service.produced >= 2 + 8, 5, "the whole window again")
            await stream.aclose()  # type: ignore[attr-defined]
