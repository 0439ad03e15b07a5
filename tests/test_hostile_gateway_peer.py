"""A hostile gateway, as its caller sees it (garcon_link.api.relay): what the caller keeps of
each executor the gateway shows is bounded as a controller bounds a worker's description.

The gateway here is a plain worker serving the relay service ``gateway`` under the caller's id
and key (what a caller dials is indistinguishable from it), whose interface lacks ``watch``, so
the caller polls it (:meth:`GatewayFleet.refresh`) and the test chooses each snapshot. Each
snapshot shows one more executor with an entry as large as a frame allows: a malformed manifest
and a map of contract versions of many services. The caller keeps a handle for every executor it
was shown (up to ``MAX_VIEW``), so what it keeps of each must be bounded: at most
``max_manifest_bytes`` of manifest (one that does not fit is kept as a note of why) and of
versions. A second such gateway serves ``watch`` and sends changes of every shape in each field
the caller reads: the caller's fleet goes on running and applies the well-formed change after
them. Last, its ``describe`` and ``executors`` answers are fuzzed: values of every CBOR major
type and entries with hostile fields end in a ``CallError`` or a view within the bounds, and the
fleet goes on (nothing found beyond the two fixed here in 6,000 examples).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.from_thread
import pytest
from cbor_strategies import cbor_values, fuzz_settings, huge_names
from hypothesis import given
from hypothesis import strategies as st

import garcon_link as gl
from garcon_link.api.relay import RELAY_SERVICE, GatewayRelay
from garcon_link.testing import free_tcp_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LIMITS = gl.Limits(max_manifest_bytes=32 * 1024)
SECRET = gl.Secret(b"hostile-gateway-test-secret-0123456789")
ENTRY_BYTES = 512 * 1024  # one executor's entry: 16 times max_manifest_bytes
EXECUTORS = 6  # shown one per snapshot, each entry about 2.5 MB as decoded objects
RETAINED_BOUND = 1024 * 1024  # kept for three executors whose entries are 2.5 MB each


class OldRelay(Protocol):
    """The relay service without ``watch`` (an older gateway): its callers poll."""

    async def describe(self, executor: str, wait: float) -> dict[str, Any]: ...

    async def executors(self) -> list[dict[str, Any]]: ...


class HostileRelay:
    def __init__(self) -> None:
        self.shown = 0

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        return _entry(executor)

    async def executors(self) -> list[dict[str, Any]]:
        self.shown += 1
        return [_entry(f"box-{self.shown}")]


def _entry(executor: str) -> dict[str, Any]:
    versions = {f"s{i}": "v" * 12 for i in range(ENTRY_BYTES // 32)}
    methods = {f"m{i}": {"kind": "unary", "signature": "() -> int"} for i in range(12_000)}
    return {
        "executor_id": executor,
        "availability": "ready",
        "services": versions,
        # Well formed, but over max_manifest_bytes (one no controller installs); the others
        # are malformed as well.
        "manifest": {"s": methods} if int(executor[4:]) % 2 else {"s": "x" * ENTRY_BYTES},
    }


@asynccontextmanager
async def _gateway_fleet(port: int) -> AsyncIterator[gl.GatewayFleet]:
    config = gl.CallerConfig(
        caller_id="web-1", secret=SECRET, dial=f"ws://127.0.0.1:{port}/executor", limits=LIMITS
    )
    async with gl.connect_gateway(config, refresh_interval=3600) as fleet:
        await fleet.gateway.wait_ready(10)
        yield fleet


async def test_what_a_caller_keeps_of_each_executor_a_gateway_shows_is_bounded() -> None:
    port = free_tcp_port()
    worker_config = gl.LinkConfig(
        executor_id="web-1", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", port)
    )
    relay = HostileRelay()
    with anyio.fail_after(40):
        async with (
            gl.Worker(worker_config, {RELAY_SERVICE: gl.Service(relay, OldRelay)}),
            _gateway_fleet(port) as fleet,
        ):
            await fleet.refresh()  # one snapshot before measuring: the session's own
            gc.collect()
            tracemalloc.start()
            try:
                kept = []
                for _ in range(2):
                    for _ in range(EXECUTORS // 2):
                        await fleet.refresh()
                    gc.collect()
                    kept.append(tracemalloc.get_traced_memory()[0])
            finally:
                tracemalloc.stop()
            # The last reply may be held until the next (one frame): what grows with the
            # executors shown is what is kept of each.
            grown = kept[1] - kept[0]
            assert grown < RETAINED_BOUND, f"{grown} bytes kept for {EXECUTORS // 2} executors"
            # Shown as far as it is within the bounds, and refused honestly when used.
            (last,) = fleet.executors()  # the last snapshot's one executor
            # Odd: well formed, and too large; even: not a map of methods.
            why = "over max_manifest_bytes" if int(last[4:]) % 2 else "not a name and a map"
            shown = fleet.executors()[last]
            assert shown.availability == "ready" and shown.services == {}
            box = fleet.executor(last)
            with pytest.raises(gl.OutcomeUnknown, match=why):
                await box.info()
            assert not box.offers("s")
            with pytest.raises(gl.NotDispatched, match=why) as refused:
                await box.service("s").m0()
            assert refused.value.code == "OFFLINE"


# ------------------------------------------------------------------------------ a hostile watch

# Change entries of every shape in each field a caller reads, each in its own watch message;
# then a well-formed one the test waits for.
HOSTILE_CHANGES: list[Any] = [
    {"executor_id": "box-1", "events": [[1]]},
    {"executor_id": "box-1", "events": [{"a": 1}]},
    {"executor_id": "box-1", "events": [b"ready", 1.5, None, True, -1, 2**63 - 1]},
    {"executor_id": "box-1", "events": "ready"},
    {"executor_id": "box-1", "events": ["ready"] * 10_000},
    {"executor_id": "box-1", "lost": [1]},
    {"executor_id": "box-1", "lost": 2**63 - 1},
    {"executor_id": "box-1", "availability": ["ready"]},
    {"executor_id": "box-1", "availability": {"ready": 1}},
    {"executor_id": "box-1", "services": {"s": [1], 7: "v", "t": {"x": 1}}},
    {"executor_id": "box-1", "manifest": {"s": {"m": [1]}}, "types": [1]},
    {"executor_id": "box-2", "gone": True, "events": [[1]]},
    {"executor_id": ["box-1"]},
    {"executor_id": "x" * 100_000},
    [1, 2],
    "entry",
]


class WatchingRelay:
    """A gateway whose ``watch`` sends a snapshot, then each hostile change, then box-3."""

    async def call(self, *args: Any) -> bytes:
        return b""

    async def stream(self, *args: Any) -> AsyncIterator[bytes]:
        nothing: tuple[bytes, ...] = ()
        for item in nothing:
            yield item

    async def notify(self, *args: Any) -> None:
        return None

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        return {"executor_id": executor, "availability": "offline"}

    async def executors(self) -> list[dict[str, Any]]:
        return []

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        ready = {"availability": "ready", "services": {}}
        yield {"snapshot": True, "last": True, "entries": [{"executor_id": "box-1", **ready}]}
        for change in HOSTILE_CHANGES:
            yield {"entries": [change]}
        yield {"entries": [{"executor_id": "box-3", **ready, "events": ["joined", "ready"]}]}
        await anyio.sleep_forever()


async def test_a_hostile_watch_leaves_the_callers_fleet_running() -> None:
    port = free_tcp_port()
    worker_config = gl.LinkConfig(
        executor_id="web-1", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", port)
    )
    with anyio.fail_after(20):
        async with (
            gl.Worker(worker_config, {RELAY_SERVICE: gl.Service(WatchingRelay(), GatewayRelay)}),
            _gateway_fleet(port) as fleet,
        ):
            while "box-3" not in fleet.executors():
                await anyio.sleep(0.01)
            view = fleet.executors()
            assert view["box-3"].availability == "ready"
            assert view["box-1"].availability == "ready"
            assert all(len(executor_id) <= 200 for executor_id in view)


# ------------------------------------------------------------------------------ fuzzing its answers


class AnsweringRelay(WatchingRelay):
    """A gateway without ``watch`` (served as :class:`OldRelay`) whose ``describe`` and
    ``executors`` answer whatever the test put in ``answer``."""

    def __init__(self) -> None:
        self.answer: Any = None

    async def describe(self, executor: str, wait: float) -> Any:
        return self.answer

    async def executors(self) -> Any:
        return self.answer


@asynccontextmanager
async def _answering(relay: AnsweringRelay) -> AsyncIterator[gl.GatewayFleet]:
    port = free_tcp_port()
    worker_config = gl.LinkConfig(
        executor_id="web-1", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", port)
    )
    async with (
        gl.Worker(worker_config, {RELAY_SERVICE: gl.Service(relay, OldRelay)}),
        _gateway_fleet(port) as fleet,
    ):
        yield fleet


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def answering(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[anyio.from_thread.BlockingPortal, AnsweringRelay, gl.GatewayFleet]]:
    relay = AnsweringRelay()
    with (
        anyio.from_thread.start_blocking_portal(request.param) as portal,
        portal.wrap_async_context_manager(_answering(relay)) as fleet,
    ):
        yield portal, relay, fleet


_ids = st.one_of(st.sampled_from(["box-1", "box-2"]), cbor_values, huge_names)
_entries = st.fixed_dictionaries(
    {"executor_id": _ids},
    optional={
        "availability": st.one_of(st.sampled_from(["ready", "offline", "gone"]), cbor_values),
        "services": st.one_of(
            st.dictionaries(st.one_of(st.text(max_size=3), huge_names), cbor_values, max_size=4),
            cbor_values,
        ),
        "manifest": st.one_of(
            st.dictionaries(
                st.text(max_size=3),
                st.dictionaries(st.text(max_size=3), cbor_values, max_size=3),
                max_size=3,
            ),
            cbor_values,
        ),
        "types": cbor_values,
    },
)
_answers = st.one_of(_entries, st.lists(st.one_of(_entries, cbor_values), max_size=4), cbor_values)


@given(answers=st.lists(_answers, min_size=1, max_size=4))
@fuzz_settings(150)
def test_any_answer_of_a_gateway_is_a_call_error_or_a_bounded_view(
    answering: tuple[anyio.from_thread.BlockingPortal, AnsweringRelay, gl.GatewayFleet],
    answers: list[Any],
) -> None:
    portal, relay, fleet = answering
    box = portal.call(fleet.executor, "box-1")
    for answer in answers:
        relay.answer = answer
        for step in (fleet.refresh, box.info):
            try:
                portal.call(step)
            except gl.CallError:
                pass
        view = fleet.executors()
        assert all(len(executor_id) <= 200 for executor_id in view)
        assert all(isinstance(v, str) for s in view.values() for v in s.services.values())
    # The fleet still runs: a well-formed answer is applied.
    relay.answer = [{"executor_id": "box-2", "availability": "ready", "services": {"s": "v"}}]
    portal.call(fleet.refresh)
    assert fleet.executors()["box-2"].services == {"s": "v"}
