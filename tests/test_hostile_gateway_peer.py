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
fleet goes on (nothing found beyond the two fixed here in 6,000 examples). Its ``watch`` stream is
fuzzed too: messages of every CBOR major type, entries with every field of every type, nested,
huge and many; after them a well-formed change is applied, on that watch or on the next one
(a message that does not read ends a watch, and the caller opens another). What the caller
ignores it says, once per ``log_interval`` and reason; an exception no check foresaw (a bug
planted in the caller) is logged at ERROR with its traceback, and the fleet goes on. A snapshot
of another shape is a protocol error that leaves the view as it was; and the caller's parts hold
no owner, so a fleet dropped while a handle is kept is freed at once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import tracemalloc
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import anyio.from_thread
import pytest
from anyio.streams.memory import MemoryObjectSendStream
from cbor_strategies import cbor_values, fuzz_settings, huge_names
from hypothesis import given
from hypothesis import strategies as st

import garcon_link as gl
from garcon_link.api import _relay_view
from garcon_link.api import relay as relay_module
from garcon_link.api._relay_wire import MAX_WATCH_ENTRIES
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
async def _fake_gateway(relay: object, interface: type) -> AsyncIterator[gl.GatewayFleet]:
    """A caller's fleet through a fake gateway: a plain worker serving ``relay`` as the relay
    service, typed as ``interface``."""
    port = free_tcp_port()
    worker_config = gl.LinkConfig(
        executor_id="web-1", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", port)
    )
    async with (
        gl.Worker(worker_config, {RELAY_SERVICE: gl.Service(relay, interface)}),
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
        portal.wrap_async_context_manager(_fake_gateway(relay, OldRelay)) as fleet,
    ):
        yield portal, relay, fleet


_ids = st.one_of(st.sampled_from(["box-1", "box-2"]), cbor_values, huge_names)


def _entry_fields(availabilities: list[str]) -> dict[str, st.SearchStrategy[Any]]:
    """The optional fields of an executor entry a gateway sends, each well formed or any CBOR
    value (an availability from ``availabilities``)."""
    return {
        "availability": st.one_of(st.sampled_from(availabilities), cbor_values),
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
    }


_entries = st.fixed_dictionaries(
    {"executor_id": _ids}, optional=_entry_fields(["ready", "offline", "gone"])
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


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param({"executor_id": "box-2", "availability": "ready"}, id="a-map"),
        pytest.param(None, id="null"),
        pytest.param("box-2", id="text"),
        pytest.param([{"executor_id": "box-2"}, "box-3"], id="a-list-of-other-than-maps"),
    ],
)
async def test_a_snapshot_that_is_not_a_list_of_maps_is_a_protocol_error_not_an_empty_view(
    answer: Any,
) -> None:
    """A gateway's ``executors`` answer of another shape (an older or buggy gateway: a worker
    does not check its own results) raises a ``CallError`` saying what it was -- the relay
    facade's check against ``GatewayRelay.executors`` -- and the view the caller had is kept,
    not emptied; the next answer that reads is applied."""
    relay = AnsweringRelay()
    relay.answer = [{"executor_id": "box-1", "availability": "ready", "services": {"s": "v"}}]
    with anyio.fail_after(20):
        async with _fake_gateway(relay, OldRelay) as fleet:
            assert list(await fleet.refresh()) == ["box-1"]
            relay.answer = answer
            with pytest.raises(gl.RemoteError) as raised:
                await fleet.refresh()
            assert raised.value.code == "INVALID_RESULT"
            assert "expected `" in raised.value.message, raised.value.message
            view = fleet.executors()
            assert list(view) == ["box-1"] and view["box-1"].availability == "ready"
            relay.answer = [{"executor_id": "box-2", "availability": "ready", "services": {}}]
            assert list(await fleet.refresh()) == ["box-2"]


async def test_an_executor_handle_does_not_keep_its_fleet_alive() -> None:
    """The caller's parts hold no owner: a handle holds the gateway session it calls through,
    not the fleet, and the fleet's view holds no fleet either, so a fleet dropped while a handle
    is kept is freed at once, without the cycle collector."""
    relay = AnsweringRelay()
    relay.answer = [{"executor_id": "box-1", "availability": "ready", "services": {}}]
    with anyio.fail_after(20):
        async with _fake_gateway(relay, OldRelay) as fleet:
            await fleet.refresh()
            handle = fleet.executor("box-1")
            dropped = weakref.ref(fleet)
    gc.collect()
    gc.disable()
    try:
        del fleet
        assert dropped() is None, "a reference cycle holds the dropped fleet"
    finally:
        gc.enable()
    assert handle.executor_id == "box-1" and handle.gateway.availability == "disposed"


# ------------------------------------------------------------------------------ fuzzing its watch


class AnyWatch(Protocol):
    """The relay service with ``watch`` (its contract as a caller's), beside what a caller calls
    of it."""

    async def describe(self, executor: str, wait: float) -> dict[str, Any]: ...

    async def executors(self) -> list[dict[str, Any]]: ...

    def watch(self) -> AsyncIterator[dict[str, Any]]: ...


class FeedingRelay:
    """A gateway whose ``watch`` sends a snapshot of the marks so far, then what the test sends
    it (:meth:`send`, to the watch opened last); a watch opened again (the caller ended the last
    one) starts with a new snapshot. A mark is in the snapshot of every watch opened after it,
    and sent on the watch open then: it reaches the caller either way."""

    def __init__(self) -> None:
        self.marks: list[dict[str, Any]] = []
        self.watches = 0
        self._current: MemoryObjectSendStream[Any] | None = None

    async def describe(self, executor: str, wait: float) -> Any:
        return {"executor_id": executor, "availability": "offline"}

    async def executors(self) -> Any:
        return []

    def send(self, message: Any) -> None:
        """Send ``message`` on the watch opened last (lost if it has ended: the caller opens
        another, whose snapshot holds the marks)."""
        if self._current is not None:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._current.send_nowait(message)

    async def mark(self, fleet: gl.GatewayFleet) -> str:
        """Send a well-formed change of a new executor; its id, once the caller's view shows
        it."""
        mark = f"mark-{len(self.marks)}"
        entry = {"executor_id": mark, "availability": "ready", "services": {"s": "v"}}
        self.marks.append(entry)
        self.send({"entries": [{**entry, "events": ["joined", "ready"]}]})
        with anyio.fail_after(10):
            while mark not in fleet.executors():
                await anyio.sleep(0.005)
        return mark

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        self.watches += 1
        send, receive = anyio.create_memory_object_stream[Any](math.inf)
        self._current = send  # with the snapshot below, in one step of the event loop
        # In messages of at most MAX_WATCH_ENTRIES, as a gateway sends a long snapshot.
        size = MAX_WATCH_ENTRIES
        parts = [self.marks[i : i + size] for i in range(0, len(self.marks), size)] or [[]]
        with send, receive:
            for i, entries in enumerate(parts):
                yield {"snapshot": True, "last": i == len(parts) - 1, "entries": entries}
            async for message in receive:
                yield message


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def fed(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[anyio.from_thread.BlockingPortal, FeedingRelay, gl.GatewayFleet]]:
    relay = FeedingRelay()
    with (
        pytest.MonkeyPatch.context() as patch,
        anyio.from_thread.start_blocking_portal(request.param) as portal,
        portal.wrap_async_context_manager(_fake_gateway(relay, AnyWatch)) as fleet,
    ):
        patch.setattr(_relay_view, "WATCH_RETRY", 0.01)  # a watch ended is opened again at once
        yield portal, relay, fleet


_kinds = st.one_of(
    st.lists(
        st.one_of(st.sampled_from(["joined", "ready", "lost", "gone"]), cbor_values), max_size=10
    ),
    st.integers(0, 10_000).map(lambda n: ["ready"] * n),
    cbor_values,
)
_watch_entries = st.fixed_dictionaries(
    {"executor_id": _ids},
    optional={
        **_entry_fields(["ready", "draining", "gone"]),
        "events": _kinds,
        "lost": st.one_of(st.integers(), cbor_values),
        "gone": st.one_of(st.booleans(), cbor_values),
    },
)
_entry_lists = st.lists(st.one_of(_watch_entries, cbor_values), max_size=5)
_watch_messages = st.one_of(
    st.fixed_dictionaries(
        {"entries": _entry_lists},
        optional={
            "snapshot": st.one_of(st.booleans(), cbor_values),
            "last": st.one_of(st.booleans(), cbor_values),
        },
    ),
    st.fixed_dictionaries({"entries": cbor_values}),
    st.integers(0, 300).map(lambda n: {"entries": [{"executor_id": "box-1"}] * n}),
    cbor_values,
)


@given(messages=st.lists(_watch_messages, min_size=1, max_size=4))
@fuzz_settings(150)
def test_any_watch_message_of_a_gateway_leaves_the_fleet_running(
    fed: tuple[anyio.from_thread.BlockingPortal, FeedingRelay, gl.GatewayFleet],
    messages: list[Any],
) -> None:
    portal, relay, fleet = fed
    for message in messages:
        portal.call(relay.send, message)
    # The fleet still runs: a well-formed change after them is applied (on this watch, or in the
    # snapshot of the next one, if a message ended this one).
    mark = portal.call(relay.mark, fleet)
    view = fleet.executors()
    assert view[mark].availability == "ready" and view[mark].services == {"s": "v"}
    assert all(len(executor_id) <= 200 for executor_id in view)
    assert all(isinstance(v, str) for s in view.values() for v in s.services.values())


async def test_a_malformed_watch_is_said_once_and_a_bug_of_ours_is_seen(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the caller ignores of a gateway's watch, it says, once per ``log_interval`` and
    reason; an exception no check foresaw (here a bug planted in the caller's own code) is
    logged at ERROR with its traceback, and the fleet goes on with a new watch."""
    caplog.set_level(logging.WARNING, logger="garcon_link.gateway")
    monkeypatch.setattr(_relay_view, "WATCH_RETRY", 0.01)
    apply = relay_module.GatewayExecutor._apply

    def planted(executor: relay_module.GatewayExecutor, entry: Any) -> None:
        if executor.executor_id == "bug-1":
            raise RuntimeError("a bug of ours")
        apply(executor, entry)

    monkeypatch.setattr(relay_module.GatewayExecutor, "_apply", planted)
    relay = FeedingRelay()
    with anyio.fail_after(30):
        async with _fake_gateway(relay, AnyWatch) as fleet:
            for _ in range(2):
                relay.send(
                    {"entries": [["not a map"], {"executor_id": 7}, {"executor_id": "box-1"}]}
                )
                relay.send({"entries": [{"executor_id": "box-1", "events": [[1]]}]})
                await relay.mark(fleet)
                relay.send({"entries": "not a list"})  # ends the watch
                await relay.mark(fleet)
                relay.send({"entries": [{"executor_id": "bug-1"}]})  # ends it too
                await relay.mark(fleet)
            assert relay.watches == 5  # the first, and one after each watch that ended
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "garcon_link.gateway"]
    said = [message.split(" (")[0] for _, message in lines]
    assert sorted(said) == [
        "caller web-1: keeping the view of the gateway's executors failed",
        "caller web-1: the gateway sent an entry that names no executor",
        "caller web-1: the gateway's view of its executors does not read",
        "caller web-1: the gateway's watch gave executor 'box-1' events that are not a list of "
        "at most 8 known kinds",
    ], lines
    (bug,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "RuntimeError: a bug of ours" in bug.getMessage()
    assert bug.exc_info is not None and isinstance(bug.exc_info[1], RuntimeError)
