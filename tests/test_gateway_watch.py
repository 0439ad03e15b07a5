"""A gateway pushes executor changes to its callers (docs/guides/gateway.md#what-a-caller-sees).

In one process over loopback, with the helpers of tests/test_gateway.py. What the tests prove:

* a change reaches a caller's ``executors()`` and ``events()`` without waiting for its refresh
  interval (set to an hour here), and its events are the in-process fleet's, kind for kind and
  in order, for the same story;
* a caller never learns of an executor no grant lets it see, and replacing the grants tells
  each watch at once of what it may now see or no longer see;
* a caller that does not read its watch gets, once it reads again, one entry per executor with
  at most ``MAX_WATCH_EVENTS`` events and the count of those dropped: the gateway's backlog for
  it is bounded whatever the executors do meanwhile;
* a caller session holds one watch at most;
* a gateway without ``watch`` (an older one), or one that refuses it, is polled every refresh
  interval instead;
* what a gateway's watch sends is checked, and a message that does not read ends the watch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest
from faultutil import wait_for
from test_gateway import DEADLINE, LIMITS, caller_config, device, enroll, running_gateway

import garcon_link as gl
from garcon_link.api._relay_wire import MAX_WATCH_EVENTS
from garcon_link.api.relay import RELAY_SERVICE, GatewayRelay

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

HOUR = 3600.0
PUSH_WAIT = 5.0
"""Seconds a pushed change may take to arrive at most (the refresh interval is an hour)."""


@asynccontextmanager
async def pushed_caller(tmp_path: Path, caller_id: str, url: str) -> AsyncIterator[gl.GatewayFleet]:
    """A caller whose refresh interval is an hour: only a push can show it a change."""
    config = caller_config(tmp_path, caller_id, url)
    async with gl.connect_gateway(config, refresh_interval=HOUR) as fleet:
        await fleet.gateway.wait_ready(10)
        yield fleet


@asynccontextmanager
async def following(events: AsyncIterator[gl.FleetEvent]) -> AsyncIterator[list[tuple[str, str]]]:
    """``(kind, executor_id)`` of each event of ``events``, collected while the block runs."""
    seen: list[tuple[str, str]] = []
    subscribed = anyio.Event()

    async def follow() -> None:
        iterator = events.__aiter__()
        pending = iterator.__anext__()  # subscribes at its first step
        subscribed.set()
        event = await pending
        while True:
            seen.append((event.kind, event.executor_id))
            event = await iterator.__anext__()

    async with anyio.create_task_group() as tg:
        tg.start_soon(follow)
        await subscribed.wait()
        await anyio.sleep(0)
        yield seen
        tg.cancel_scope.cancel()


@asynccontextmanager
async def raw_watch(
    tmp_path: Path, caller_id: str, url: str, limits: gl.Limits = LIMITS
) -> AsyncIterator[tuple[GatewayRelay, AsyncIterator[dict[str, Any]]]]:
    """A caller session of its own (no GatewayFleet) and its watch, snapshot read."""
    config = caller_config(tmp_path, caller_id, url)
    async with gl.RemoteExecutor(config.link_config(), limits=limits) as session:
        await session.wait_ready(10)
        relay = session.service(RELAY_SERVICE, GatewayRelay)
        stream = relay.watch()
        first = await stream.__anext__()
        assert first["snapshot"] is True and first["last"] is True
        yield relay, stream


async def test_a_change_is_pushed_without_waiting_for_the_refresh_interval(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            web = await stack.enter_async_context(pushed_caller(tmp_path, "web-1", gw.url))
            seen = await stack.enter_async_context(following(web.events()))
            async with device(tmp_path, "box-1", gw.url):
                await wait_for(lambda: ("ready", "box-1") in seen, PUSH_WAIT, "box-1 ready, pushed")
                assert web.executors()["box-1"].availability == "ready"
                assert seen[:2] == [("joined", "box-1"), ("ready", "box-1")]
            await wait_for(
                lambda: web.executors()["box-1"].availability == "offline",
                PUSH_WAIT,
                "box-1 offline, pushed",
            )


async def test_a_caller_sees_the_events_an_in_process_fleet_sees(tmp_path: Path) -> None:
    """One story -- two executors join, both leave, one comes back and leaves -- watched by
    the gateway's own fleet (``gl.Fleet.events``) and by a caller that may see both: the same
    kinds, in the same order."""
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            ops = await stack.enter_async_context(pushed_caller(tmp_path, "ops", gw.url))
            direct = await stack.enter_async_context(following(gw.fleet.events()))
            through = await stack.enter_async_context(following(ops.events()))

            async def step(expected_last: tuple[str, str]) -> None:
                await wait_for(lambda: direct[-1:] == [expected_last], 10, str(expected_last))

            async with device(tmp_path, "box-1", gw.url):
                await step(("ready", "box-1"))
                async with device(tmp_path, "box-2", gw.url):
                    await step(("ready", "box-2"))
                await step(("offline", "box-2"))
            await step(("offline", "box-1"))
            async with device(tmp_path, "box-1", gw.url):
                await step(("ready", "box-1"))
            await step(("offline", "box-1"))
            await wait_for(lambda: through == direct, PUSH_WAIT, f"{through} == {direct}")
            assert {kind for kind, _ in direct} >= {"joined", "ready", "offline"}


async def test_an_ungranted_executor_never_reaches_a_caller(tmp_path: Path) -> None:
    """``web-1`` may see ``box-*`` only: ``db-1`` joining and leaving is in neither its watch
    nor its events; granting it ``db-*`` shows ``db-1`` at once, taking the grant back hides it."""
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            web = await stack.enter_async_context(pushed_caller(tmp_path, "web-1", gw.url))
            seen = await stack.enter_async_context(following(web.events()))
            _, stream = await stack.enter_async_context(raw_watch(tmp_path, "web-2", gw.url))
            async with device(tmp_path, "db-1", gw.url):
                await gw.fleet.executor("db-1").wait_ready(10)
                async with device(tmp_path, "box-1", gw.url):
                    # The raw watch: the first message naming box-1 names nothing else.
                    with anyio.fail_after(PUSH_WAIT):
                        message = await stream.__anext__()
                    assert {e["executor_id"] for e in message["entries"]} == {"box-1"}
                    await wait_for(lambda: ("ready", "box-1") in seen, PUSH_WAIT, "box-1")
                    assert "db-1" not in web.executors()

                    original = gw.grants
                    with pytest.raises(TypeError, match=r"gl\.Grant"):
                        gw.grants = ("db-*",)  # type: ignore[assignment]
                    with pytest.raises(ValueError, match="more than 1024"):
                        gw.grants = original * 1025
                    assert gw.grants == original
                    gw.grants = (*original, gl.Grant(callers=("web-*",), executors=("db-*",)))
                    await wait_for(lambda: "db-1" in web.executors(), PUSH_WAIT, "db-1 shown")
                    assert web.executors()["db-1"].availability == "ready"
                    assert seen[-2:] == [("joined", "db-1"), ("ready", "db-1")]
                    gw.grants = original
                    await wait_for(lambda: "db-1" not in web.executors(), PUSH_WAIT, "db-1 hidden")
                    assert seen[-1] == ("forgotten", "db-1")
                await wait_for(lambda: ("offline", "box-1") in seen, PUSH_WAIT, "box-1 offline")
            await wait_for(
                lambda: gw.fleet.executors()["db-1"].availability == "offline", 10, "db-1 gone"
            )
            # db-1 left after its grant was taken back. A later change the caller may see
            # arrives after anything the gateway would have pushed of db-1's.
            async with device(tmp_path, "box-2", gw.url):
                await wait_for(lambda: ("ready", "box-2") in seen, PUSH_WAIT, "box-2 ready")
            assert [e for e in seen if e[1] == "db-1"] == [
                ("joined", "db-1"),
                ("ready", "db-1"),
                ("forgotten", "db-1"),
            ]


async def test_a_slow_caller_gets_one_entry_per_executor(tmp_path: Path) -> None:
    """A caller that stops reading its watch (credit of one message) while an executor comes
    and goes six times gets, when it reads again, at most two messages: the one its credit
    allowed, then one entry for that executor with its latest state, at most
    ``MAX_WATCH_EVENTS`` events and the count of those dropped."""
    slow = LIMITS.replace(stream_window_items=1)
    flaps = 6
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path) as gw, AsyncExitStack() as stack:
            direct = await stack.enter_async_context(following(gw.fleet.events()))
            _, stream = await stack.enter_async_context(
                raw_watch(tmp_path, "web-1", gw.url, limits=slow)
            )
            for _ in range(flaps):
                async with device(tmp_path, "box-1", gw.url):
                    await wait_for(lambda: direct[-1:] == [("ready", "box-1")], 10, "ready")
                await wait_for(lambda: direct[-1:] == [("offline", "box-1")], 10, "offline")
            happened = len(direct)
            assert happened > MAX_WATCH_EVENTS + 2

            received: list[dict[str, Any]] = []
            events = lost = 0
            with anyio.fail_after(PUSH_WAIT):
                while events + lost < happened:
                    message = await stream.__anext__()
                    received.append(message)
                    for entry in message["entries"]:
                        assert entry["executor_id"] == "box-1"
                        assert len(entry["events"]) <= MAX_WATCH_EVENTS
                        events += len(entry["events"])
                        lost += entry.get("lost", 0)
            assert events + lost == happened
            assert len(received) <= 2
            assert lost > 0
            assert received[-1]["entries"][-1]["availability"] == "offline"
            assert received[-1]["entries"][-1]["events"][-1] == "offline"


async def test_a_caller_session_holds_one_watch(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with (
            running_gateway(tmp_path) as gw,
            raw_watch(tmp_path, "web-1", gw.url) as (relay, first),
        ):
            for _ in range(3):
                second = relay.watch()
                with pytest.raises(gl.Rejected) as refused:
                    await second.__anext__()
                assert refused.value.code == "ALREADY_WATCHING"
            await first.aclose()  # type: ignore[attr-defined]

            async def reopened() -> bool:
                again = relay.watch()
                try:
                    message = await again.__anext__()
                except gl.Rejected:
                    return False
                finally:
                    await again.aclose()  # type: ignore[attr-defined]
                return bool(message["snapshot"])

            with anyio.fail_after(PUSH_WAIT):
                while not await reopened():
                    await anyio.sleep(0.01)


class OldGatewayRelay(Protocol):
    """A gateway's relay before ``watch``: what an older gateway serves."""

    async def describe(self, executor: str, wait: float) -> dict[str, Any]: ...

    async def executors(self) -> list[dict[str, Any]]: ...


class OldRelay:
    def __init__(self) -> None:
        self.shown: list[dict[str, Any]] = []
        self.asked = 0

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        return {"executor_id": executor, "availability": "offline", "services": {}}

    async def executors(self) -> list[dict[str, Any]]:
        self.asked += 1
        return list(self.shown)


@asynccontextmanager
async def fake_gateway(
    tmp_path: Path, relay: object, interface: type = GatewayRelay, limits: gl.Limits = LIMITS
) -> AsyncIterator[gl.CallerConfig]:
    """A worker playing a gateway (``relay`` served as the relay service, of ``interface``) to
    caller web-1's key; yields that caller's config, with ``limits``."""
    secret = enroll(tmp_path / "callers", "web-1")
    config = gl.LinkConfig(
        executor_id="web-1",
        role=gl.Role.WORKER,
        secret=secret,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    async with gl.Worker(config, {RELAY_SERVICE: gl.Service(relay, interface)}) as worker:
        yield gl.CallerConfig(caller_id="web-1", secret=secret, dial=worker.url, limits=limits)


async def test_a_gateway_without_watch_is_polled(tmp_path: Path) -> None:
    """An older gateway, played by a worker serving the relay without ``watch`` to the caller's
    key: the caller polls it every ``Limits.gateway_refresh_interval``, and its events are the
    snapshots' changes."""
    relay = OldRelay()
    polled = LIMITS.replace(gateway_refresh_interval=0.05)
    with anyio.fail_after(DEADLINE):
        async with (
            fake_gateway(tmp_path, relay, OldGatewayRelay, polled) as caller,
            gl.connect_gateway(caller) as fleet,
            following(fleet.events()) as seen,
        ):
            relay.shown = [{"executor_id": "box-1", "availability": "ready", "services": {}}]
            await wait_for(lambda: "box-1" in fleet.executors(), 5, "box-1 polled")
            asked = relay.asked
            await wait_for(lambda: relay.asked >= asked + 2, 5, "polled again")
            relay.shown = []
            await wait_for(lambda: "box-1" not in fleet.executors(), 5, "box-1 gone")
            # The view changes first; the follower takes the event in a task of its own.
            await wait_for(lambda: len(seen) >= 3, 5, "the forgotten event")
            assert seen == [("joined", "box-1"), ("ready", "box-1"), ("forgotten", "box-1")]


class UnrulyRelay:
    """A gateway's relay whose watch sends what a gateway must not: entries that do not read,
    too many events, unknown kinds, and then a message of too many entries."""

    def __init__(self) -> None:
        self.watches = 0

    async def call(
        self,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> bytes:
        raise NotImplementedError

    async def stream(
        self, executor: str, service: str, method: str, payload: bytes
    ) -> AsyncIterator[bytes]:
        nothing: tuple[bytes, ...] = ()
        for item in nothing:  # an async generator that yields nothing
            yield item

    async def notify(self, executor: str, service: str, method: str, payload: bytes) -> None:
        raise NotImplementedError

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        raise NotImplementedError

    async def executors(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        self.watches += 1
        ready = {"availability": "ready", "services": {}}
        yield {"snapshot": True, "last": True, "entries": [{"executor_id": "box-1", **ready}]}
        if self.watches > 1:
            await anyio.sleep_forever()
        yield {
            "entries": [
                "not an entry",
                {"executor_id": "../x", **ready, "events": ["joined"]},
                {"executor_id": "box-2", **ready, "events": ["ready"] * (MAX_WATCH_EVENTS + 1)},
                {"executor_id": "box-3", **ready, "events": ["exploded"], "lost": 2**40},
                {"executor_id": "box-4", **ready, "events": ["joined", "ready"], "lost": 3},
            ]
        }
        yield {"entries": [{"executor_id": "box-5", **ready}] * 257}
        await anyio.sleep_forever()


async def test_a_watch_message_that_does_not_read_is_refused(tmp_path: Path) -> None:
    """What a gateway's watch sends is checked: an entry that names no executor is skipped,
    events that are too many or of no known kind are replaced by what the state shows, a
    ``lost`` count out of bounds is ignored (one in bounds is a ``lost`` event), and a message
    of more than MAX_WATCH_ENTRIES entries ends the watch: the caller opens another, whose
    snapshot replaces its view."""
    relay = UnrulyRelay()
    with anyio.fail_after(DEADLINE):
        async with (
            fake_gateway(tmp_path, relay) as caller,
            gl.connect_gateway(caller, refresh_interval=0.05) as fleet,
            following(fleet.events()) as seen,
        ):
            await wait_for(lambda: ("forgotten", "box-4") in seen, 5, "the second snapshot")
            assert relay.watches == 2
            assert seen == [
                ("joined", "box-1"),
                ("ready", "box-1"),
                ("joined", "box-2"),
                ("ready", "box-2"),
                ("joined", "box-3"),
                ("ready", "box-3"),
                ("lost", "box-4"),
                ("joined", "box-4"),
                ("ready", "box-4"),
                ("forgotten", "box-2"),
                ("forgotten", "box-3"),
                ("forgotten", "box-4"),
            ]
            assert list(fleet.executors()) == ["box-1"]


class RefusingRelay(UnrulyRelay):
    """A relay whose manifest names ``watch`` but whose handler refuses it, as a gateway that
    removed the method would."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def executors(self) -> list[dict[str, Any]]:
        self.asked += 1
        return [{"executor_id": "box-1", "availability": "ready", "services": {}}]

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        self.watches += 1
        if self.watches > 0:  # always: the generator refuses at its first step
            raise gl.Rejected("UNSUPPORTED", "no watch here")
        yield {}


async def test_a_refused_watch_means_polling_that_session(tmp_path: Path) -> None:
    relay = RefusingRelay()
    with anyio.fail_after(DEADLINE):
        async with (
            fake_gateway(tmp_path, relay) as caller,
            gl.connect_gateway(caller, refresh_interval=0.05) as fleet,
        ):
            await wait_for(lambda: relay.asked >= 3, 5, "polled three times")
            assert relay.watches == 1
            assert list(fleet.executors()) == ["box-1"]


class ScriptedRelay(UnrulyRelay):
    """A relay whose watch shows box-1 ready, then, once ``go`` is set, box-1 offline and
    box-2 joined; its snapshot (``executors``) already shows box-1 offline."""

    def __init__(self) -> None:
        super().__init__()
        self.go = anyio.Event()

    async def executors(self) -> list[dict[str, Any]]:
        return [{"executor_id": "box-1", "availability": "offline", "services": {}}]

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        entry = {"executor_id": "box-1", "availability": "ready", "services": {}}
        yield {"snapshot": True, "last": True, "entries": [entry]}
        await self.go.wait()
        offline = {**entry, "availability": "offline", "events": ["offline"]}
        joined = {"executor_id": "box-2", "availability": "offline", "events": ["joined"]}
        yield {"entries": [offline, joined]}
        await anyio.sleep_forever()


async def test_a_refresh_while_watching_repeats_no_event(tmp_path: Path) -> None:
    """A refresh asked for by hand while the watch is open publishes nothing the watch also
    delivers: each change is one event, pushed."""
    relay = ScriptedRelay()
    with anyio.fail_after(DEADLINE):
        async with (
            fake_gateway(tmp_path, relay) as caller,
            gl.connect_gateway(caller, refresh_interval=HOUR) as fleet,
            following(fleet.events()) as seen,
        ):
            await wait_for(lambda: ("ready", "box-1") in seen, 5, "the snapshot")
            await fleet.refresh()
            relay.go.set()
            await wait_for(lambda: ("joined", "box-2") in seen, 5, "the pushed change")
            assert seen == [
                ("joined", "box-1"),
                ("ready", "box-1"),
                ("offline", "box-1"),
                ("joined", "box-2"),
            ]
