"""A ledgered chaos run through a gateway: 3 callers, 20 executors, random cuts on both hops.

Every executor's worker keeps a ledger of what it executed; every caller and every executor
reaches the gateway through a :class:`~garcon_link.testing.FaultProxy` that a chaos task cuts at
random (a seeded generator). The callers make keyed calls (``retry_unknown``), unkeyed calls and
streams meanwhile. Once the run is over, the ledgers decide:

* every keyed call returned, and ran exactly once (its tag is in its executor's ledger once);
* every unkeyed call's outcome is honest: a value means it ran once; ``NotDispatched`` means it
  never ran; ``OutcomeUnknown`` means at most once; nothing else happens;
* every stream delivered a prefix of its items, in order, none lost or duplicated -- all of them
  if it ended without an error.

The short version runs in a few seconds; ``--soak-minutes N`` runs it for N minutes.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Protocol

import anyio
import pytest
from test_gateway import LIMITS, enroll, running_gateway

import garcon_link as gl
from garcon_link.testing import FaultProxy

pytestmark = [pytest.mark.anyio, pytest.mark.soak, pytest.mark.timeout(600)]

EXECUTORS = [f"box-{i:02d}" for i in range(20)]
CALLERS = ["web-1", "web-2", "web-3"]
CHAOS_LIMITS = LIMITS.replace(detached_grace=10.0, call_timeout=20.0)


class Ledgered(Protocol):
    async def record(self, tag: str) -> int: ...

    def count(self, tag: str, n: int) -> AsyncIterator[int]: ...


class LedgeredService:
    def __init__(self) -> None:
        self.ledger: list[str] = []

    async def record(self, tag: str) -> int:
        self.ledger.append(tag)
        await anyio.sleep(0.001)
        return len(self.ledger)

    async def count(self, tag: str, n: int) -> AsyncIterator[int]:
        self.ledger.append(tag)
        for i in range(n):
            yield i


async def test_chaos_on_both_hops_keeps_every_outcome_honest(
    tmp_path: Path, request: pytest.FixtureRequest, anyio_backend: str
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("one backend is enough for the chaos run (the protocol is the same)")
    minutes = request.config.getoption("--soak-minutes")
    duration = 60.0 * minutes if minutes else 3.0
    rng = random.Random(26)
    services = {executor_id: LedgeredService() for executor_id in EXECUTORS}
    outcomes: list[tuple[str, str, str, object]] = []  # (kind, executor, tag, outcome)
    streams: list[tuple[list[int], int, BaseException | None]] = []
    with anyio.fail_after(duration + 120):
        async with (
            running_gateway(
                tmp_path, grants=(gl.Grant(callers=("web-*",), executors=("box-*",)),)
            ) as gw,
            AsyncExitStack() as stack,
        ):
            proxies: list[FaultProxy] = []
            port = gw.listen_address[1]
            for executor_id in EXECUTORS:
                proxy = await stack.enter_async_context(FaultProxy("127.0.0.1", port))
                proxies.append(proxy)
                config = gl.LinkConfig(
                    executor_id=executor_id,
                    role=gl.Role.WORKER,
                    secret=enroll(tmp_path / "keys", executor_id),
                    dial=proxy.url(),
                    limits=CHAOS_LIMITS,
                )
                await stack.enter_async_context(
                    gl.Worker(config, {"ledger": services[executor_id]})
                )
            fleets = []
            for caller_id in CALLERS:
                proxy = await stack.enter_async_context(FaultProxy("127.0.0.1", port))
                proxies.append(proxy)
                caller_config = gl.CallerConfig(
                    caller_id=caller_id,
                    secret=enroll(tmp_path / "callers", caller_id),
                    dial=proxy.url(),
                    limits=CHAOS_LIMITS,
                )
                fleets.append(await stack.enter_async_context(gl.connect_gateway(caller_config)))
            for fleet in fleets:
                for executor_id in EXECUTORS:
                    await fleet.executor(executor_id).wait_ready(30)
            deadline = anyio.current_time() + duration

            async def chaos() -> None:
                while anyio.current_time() < deadline:
                    await anyio.sleep(rng.uniform(0.02, 0.15))
                    rng.choice(proxies).cut()

            async def work(fleet: gl.GatewayFleet, number: int) -> None:
                n = 0
                while anyio.current_time() < deadline:
                    n += 1
                    executor_id = rng.choice(EXECUTORS)
                    tag = f"{fleet.caller_id}/{number}/{n}"
                    facade = fleet.executor(executor_id).service("ledger", Ledgered)
                    choice = rng.random()
                    if choice < 0.45:
                        keyed = gl.with_options(facade, idempotency_key=tag, retry_unknown=True)
                        try:
                            outcomes.append(("keyed", executor_id, tag, await keyed.record(tag)))
                        except gl.CallError as exc:
                            outcomes.append(("keyed", executor_id, tag, exc))
                    elif choice < 0.9:
                        try:
                            outcomes.append(("plain", executor_id, tag, await facade.record(tag)))
                        except gl.CallError as exc:
                            outcomes.append(("plain", executor_id, tag, exc))
                    else:
                        items: list[int] = []
                        error: BaseException | None = None
                        try:
                            async for i in facade.count(tag, 300):
                                items.append(i)
                        except gl.CallError as exc:
                            error = exc
                        streams.append((items, 300, error))

            async with anyio.create_task_group() as tg:
                tg.start_soon(chaos)
                for number, fleet in enumerate(fleets):
                    for lane in range(4):
                        tg.start_soon(work, fleet, number * 4 + lane)
            caller_cuts = sum(p.statistics().cuts for p in proxies[len(EXECUTORS) :])
            executor_cuts = sum(p.statistics().cuts for p in proxies[: len(EXECUTORS)])
            for proxy in proxies:
                proxy.heal()
    # The chaos reached both hops.
    assert caller_cuts >= 2 and executor_cuts >= 2, (caller_cuts, executor_cuts)

    counts: dict[tuple[str, str], int] = {}
    for executor_id, service in services.items():
        for tag in service.ledger:
            counts[(executor_id, tag)] = counts.get((executor_id, tag), 0) + 1
    keyed = [o for o in outcomes if o[0] == "keyed"]
    plain = [o for o in outcomes if o[0] == "plain"]
    assert len(keyed) > 20 and len(plain) > 20, (len(keyed), len(plain))
    for _, executor_id, tag, outcome in keyed:
        assert not isinstance(outcome, BaseException), (tag, outcome)
        assert counts.get((executor_id, tag)) == 1, (tag, counts.get((executor_id, tag)))
    for _, executor_id, tag, outcome in plain:
        ran = counts.get((executor_id, tag), 0)
        if isinstance(outcome, gl.NotDispatched):
            assert ran == 0, (tag, outcome)
        elif isinstance(outcome, gl.OutcomeUnknown):
            assert ran <= 1, (tag, outcome)
        else:
            assert not isinstance(outcome, BaseException), (tag, outcome)
            assert ran == 1, (tag, ran)
    for items, n, error in streams:
        assert items == list(range(len(items))), items[:10]
        if error is None:
            assert len(items) == n
        else:
            assert isinstance(error, gl.NotDispatched | gl.OutcomeUnknown), error
