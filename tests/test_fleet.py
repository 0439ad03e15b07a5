"""One controller, many executors (docs/design.md#fleets), in one process over loopback.

A listening :class:`garcon_link.Fleet` with a keyring in ``tmp_path`` and in-process workers, each
dialing it with its own id and key and serving ``ident.whoami`` (which returns the worker's own
id, so a call that reached the wrong executor is caught). What the tests prove:

* every facade call reaches the executor it names; ``map`` fans out and reports per executor;
* enrolling is adding a file and revoking is deleting it, with no restart: a revoked executor's
  attached session is retired within ``key_recheck_interval`` and its call in flight gets an
  honest outcome, while the others keep serving;
* an unknown id, a revoked id, an id with path characters and a wrong key are refused with the
  same close code and reason, and the listener's hello echoes the claimed id (nothing of its own
  identity leaves before authentication);
* ``max_executors`` refuses the next executor (1013, a reason naming the bound) and allocates
  nothing for it;
* the same id twice: the newcomer is refused (4004) while the first answers; once the first's
  socket stops answering the newcomer takes over, and the first gets 4009 and stops dialing;
* ``forget_after`` drops an executor that joined by connecting and stayed offline;
* ``events()`` is bounded and says how many events a slow consumer lost;
* a draining executor (its worker said goodbye) shows ``draining`` in the snapshot, the table
  and the events, takes no new work from ``map``, and its drain is not counted as an error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Protocol

import anyio
import cbor2
import pytest
from faultutil import Raw, wait_for

import garcon_link as gl
from garcon_link.api import described, facades
from garcon_link.api.fleet import _accepting_work
from garcon_link.cli._fleet import fleet_table
from garcon_link.core.handshake import Handshake, Hello, derive_key
from garcon_link.rpc.contract import Compatibility, compare_method
from garcon_link.settings.secrets import read_secret_file, write_secret_file
from garcon_link.testing import FaultProxy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 30.0
LIMITS = gl.Limits(
    handshake_timeout=2.0,
    heartbeat_interval=0.1,
    heartbeat_timeout=1.0,
    detached_grace=2.0,
    close_timeout=0.3,
    backoff_base=0.01,
    backoff_max=0.1,
    connect_timeout=1.0,
    takeover_probe_timeout=0.3,
    call_timeout=5.0,
    key_recheck_interval=0.1,
)


class Ident(Protocol):
    async def whoami(self) -> str: ...

    async def hold(self, seconds: float) -> str: ...

    async def gated(self) -> str: ...


class IdentService:
    def __init__(self, executor_id: str) -> None:
        self.executor_id = executor_id
        self.held = 0
        self.asked = 0
        self.started = anyio.Event()
        self.gate = anyio.Event()

    async def whoami(self) -> str:
        self.asked += 1
        return self.executor_id

    async def gated(self) -> str:
        """Returns once the test opens the gate."""
        self.started.set()
        await self.gate.wait()
        return self.executor_id

    async def hold(self, seconds: float) -> str:
        self.held += 1
        await anyio.sleep(seconds)
        return self.executor_id


def enroll(keyring: Path, executor_id: str) -> gl.Secret:
    keyring.mkdir(mode=0o700, exist_ok=True)
    return read_secret_file(write_secret_file(keyring / f"{executor_id}.secret"))


def worker_config(executor_id: str, secret: gl.Secret, url: str) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id=executor_id, role=gl.Role.WORKER, secret=secret, dial=url, limits=LIMITS
    )


@asynccontextmanager
async def listening_fleet(keyring: Path, **options: object) -> AsyncIterator[gl.Fleet]:
    keyring.mkdir(mode=0o700, exist_ok=True)
    config = gl.FleetConfig(
        listen=("127.0.0.1", 0),
        keyring=keyring,
        limits=LIMITS,
        **options,  # type: ignore[arg-type]
    )
    async with gl.fleet(config) as fleet:
        yield fleet


@asynccontextmanager
async def worker(executor_id: str, secret: gl.Secret, url: str) -> AsyncIterator[gl.Worker]:
    service = IdentService(executor_id)
    async with gl.Worker(worker_config(executor_id, secret, url), {"ident": service}) as w:
        yield w


async def test_each_call_reaches_the_executor_it_names(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    ids = [f"box-{i}" for i in range(8)]
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet, AsyncExitStack() as stack:
            for executor_id in ids:
                secret = enroll(keyring, executor_id)
                await stack.enter_async_context(worker(executor_id, secret, fleet.url))
            for executor_id in ids:
                await fleet.executor(executor_id).wait_ready(10)
            for executor_id in reversed(ids):
                ident = fleet.executor(executor_id).service("ident", Ident)
                assert await ident.whoami() == executor_id
            results = await fleet.map(lambda ex: ex.service("ident", Ident).whoami(), concurrency=3)
            assert results == {i: i for i in ids}
            snapshot = fleet.executors()
            assert set(snapshot) == set(ids)
            assert all(s.availability == "ready" and s.session for s in snapshot.values())
            assert all(s.calls == 2 and s.errors == 0 for s in snapshot.values())


async def test_map_reports_a_failure_per_executor_and_raises_nothing(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet:
            secret = enroll(keyring, "up")
            async with worker("up", secret, fleet.url):
                await fleet.executor("up").wait_ready(10)
                fleet.executor("never-connects")
                results = await fleet.map(
                    lambda ex: gl.with_options(
                        ex.service("ident", Ident), dispatch_deadline=0
                    ).whoami()
                )
            assert results["up"] == "up"
            failure = results["never-connects"]
            assert isinstance(failure, gl.NotDispatched) and failure.code == "OFFLINE"
            assert fleet.executors()["never-connects"].errors == 1


async def test_calls_stalled_on_lost_sockets_are_reported_per_executor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Four executors lose their sockets at once (redials refused), three with a call pending:
    after ``stalled_call_report`` each of the three is reported once (one watch serves all the
    members), the idle one is not; healed, every call completes."""
    caplog.set_level(logging.WARNING, logger="garcon_link.remote")
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    stalled, ids = ["s0", "s1", "s2"], ["s0", "s1", "s2", "idle"]
    limits = LIMITS.replace(detached_grace=600.0, stalled_call_report=0.05)
    config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=keyring, limits=limits)
    with anyio.fail_after(DEADLINE):
        async with gl.fleet(config) as fleet, AsyncExitStack() as stack:
            services, proxies = {}, {}
            for executor_id in ids:
                secret = enroll(keyring, executor_id)
                proxy = FaultProxy("127.0.0.1", fleet.listen_address[1])
                proxies[executor_id] = await stack.enter_async_context(proxy)
                services[executor_id] = IdentService(executor_id)
                await stack.enter_async_context(
                    gl.Worker(
                        worker_config(executor_id, secret, proxy.url()),
                        {"ident": services[executor_id]},
                    )
                )
            for executor_id in ids:
                await fleet.executor(executor_id).wait_ready(10)
            async with anyio.create_task_group() as tg:
                for executor_id in stalled:
                    tg.start_soon(fleet.executor(executor_id).service("ident", Ident).gated)
                    await services[executor_id].started.wait()
                for proxy in proxies.values():
                    proxy.refuse()
                    proxy.cut()
                await wait_for(
                    lambda: all(
                        f"executor {i}: 1 call(s) waiting for replies" in caplog.text
                        for i in stalled
                    ),
                    10,
                    "a stall line for each executor with a call pending",
                )
                for proxy in proxies.values():
                    proxy.heal()
                for executor_id in stalled:
                    services[executor_id].gate.set()
    lines = [r.getMessage() for r in caplog.records if "waiting for replies" in r.getMessage()]
    assert sorted(line.split(":")[0] for line in lines) == [f"executor {i}" for i in stalled]


async def test_revoking_a_key_takes_only_that_executor_out(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet:
            kept, revoked = enroll(keyring, "kept"), enroll(keyring, "revoked")
            async with worker("kept", kept, fleet.url), worker("revoked", revoked, fleet.url):
                for executor_id in ("kept", "revoked"):
                    await fleet.executor(executor_id).wait_ready(10)
                target = fleet.executor("revoked")
                pending: list[BaseException] = []

                async def call_in_flight() -> None:
                    try:
                        await target.service("ident", Ident).hold(30)
                    except gl.CallError as exc:
                        pending.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(call_in_flight)
                    await wait_for(lambda: target.calls == 1, 5, "the call to be sent")
                    (keyring / "revoked.secret").unlink()
                    await wait_for(lambda: pending, 10, "the revoked executor's call to end")
                (outcome,) = pending
                assert isinstance(outcome, gl.OutcomeUnknown), outcome
                assert target.availability == "offline"
                stats = fleet.executors()
                assert stats["kept"].availability == "ready"
                assert await fleet.executor("kept").service("ident", Ident).whoami() == "kept"
                # Its worker keeps trying and is refused, as an unknown id is.
                with pytest.raises(TimeoutError):
                    await target.wait_ready(0.5)
                # Enrolling again is adding the file again: no restart.
                (keyring / "revoked.secret").write_text(revoked.reveal().hex() + "\n")
                (keyring / "revoked.secret").chmod(0o600)
                await target.wait_ready(10)
                assert await target.service("ident", Ident).whoami() == "revoked"


async def refusal(port: int, executor_id: str, secret: bytes) -> tuple[int | None, str | None, str]:
    """A dialer's attempt with ``executor_id`` and ``secret``: the close code and reason it
    got, and the executor id the listener's hello named."""
    hs = Handshake(
        role=gl.Role.WORKER,
        executor_id=executor_id,
        key=derive_key(secret),
        runtime=os.urandom(16),
        nonce=os.urandom(32),
        resume=None,
    )
    async with Raw.connect(port) as raw:
        assert await raw.upgrade()
        await raw.send_message(hs.hello_frame())
        hello = await raw.next_message()
        assert hello is not None
        proof = hs.receive(hello)
        assert proof is not None
        named = hs.peer_hello.executor if hs.peer_hello is not None else ""
        await raw.send_message(proof)
        await raw.outcome(5)
        return raw.close_code, raw.close_reason, named


async def test_unknown_revoked_and_wrong_key_are_indistinguishable(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet:
            port = fleet.listen_address[1]
            good = enroll(keyring, "enrolled").reveal()
            enroll(keyring, "gone")
            (keyring / "gone.secret").unlink()
            attempts = {
                "wrong key": await refusal(port, "enrolled", os.urandom(32)),
                "unknown id": await refusal(port, "stranger", good),
                "revoked id": await refusal(port, "gone", good),
                "path characters": await refusal(port, "../keys/enrolled", good),
                "long id": await refusal(port, "x" * 200, good),
            }
            outcomes = {(code, reason) for code, reason, _named in attempts.values()}
            assert outcomes == {(4001, "proof did not verify")}, attempts
            # The listener's hello echoed each claim: it said nothing of its own.
            assert [named for *_, named in attempts.values()] == [
                "enrolled",
                "stranger",
                "gone",
                "../keys/enrolled",
                "x" * 200,
            ]
            assert fleet.executors() == {}


async def listener_hello(port: int, executor_id: str) -> bytes:
    """The hello a listener answers to a dialer claiming ``executor_id`` without its key."""
    hs = Handshake(
        role=gl.Role.WORKER,
        executor_id=executor_id,
        key=derive_key(os.urandom(32)),
        runtime=os.urandom(16),
        nonce=os.urandom(32),
        resume=None,
    )
    async with Raw.connect(port) as raw:
        assert await raw.upgrade()
        await raw.send_message(hs.hello_frame())
        hello = await raw.next_message()
        assert hello is not None
        return hello


async def test_an_online_executor_and_an_unknown_id_get_the_same_hello(tmp_path: Path) -> None:
    """Without the key, claiming an enrolled, connected executor tells nothing of it: no session,
    no worker runtime, no message count -- the same hello as for an id nobody enrolled."""
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet:
            secret = enroll(keyring, "online")
            async with worker("online", secret, fleet.url):
                executor = fleet.executor("online")
                await executor.wait_ready(10)
                assert await executor.service("ident", Ident).whoami() == "online"
                port = fleet.listen_address[1]
                online = await listener_hello(port, "online")
                unknown = await listener_hello(port, "absent")  # same length
                assert len(online) == len(unknown)
                a, b = (Hello.from_wire(cbor2.loads(frame)) for frame in (online, unknown))
                assert a.session is a.peer_runtime is None and a.received == 0
                assert dataclasses.replace(a, executor="absent", nonce=b.nonce) == b
                assert fleet.executors()["online"].availability == "ready"


async def test_max_executors_refuses_the_next_one_and_allocates_nothing(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring, max_executors=2) as fleet:
            secrets = {i: enroll(keyring, i) for i in ("a", "b", "c")}
            async with worker("a", secrets["a"], fleet.url), worker("b", secrets["b"], fleet.url):
                await fleet.executor("a").wait_ready(10)
                await fleet.executor("b").wait_ready(10)
                async with worker("c", secrets["c"], fleet.url) as third:
                    await wait_for(
                        lambda: (
                            third.link.last_error is not None and "1013" in third.link.last_error
                        ),
                        10,
                        "the third executor to be refused",
                    )
                    assert "max_executors=2" in (third.link.last_error or "")
                assert set(fleet.executors()) == {"a", "b"}


async def test_the_same_id_twice_refuses_the_newcomer_then_supersedes_the_silent_one(
    tmp_path: Path,
) -> None:
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet:
            secret = enroll(keyring, "twin")
            proxy = FaultProxy("127.0.0.1", fleet.listen_address[1])
            async with proxy, worker("twin", secret, proxy.url()) as first:
                executor = fleet.executor("twin")
                await executor.wait_ready(10)
                async with worker("twin", secret, fleet.url) as second:
                    # The first answers its probe: the newcomer is refused, and backs off.
                    await wait_for(
                        lambda: fleet.statistics().takeovers_refused >= 2,
                        10,
                        "the newcomer to be refused twice",
                    )
                    # (locals: mypy would keep the narrowing of ``taken_over`` below)
                    first_taken, second_taken = first.taken_over, second.taken_over
                    assert first_taken is None and second_taken is None
                    # The first goes silent (half-open): the newcomer takes over.
                    proxy.blackhole()
                    await wait_for(
                        lambda: second.sessions == 1 and executor.availability == "ready",
                        10,
                        "the newcomer to take over",
                    )
                    assert await executor.service("ident", Ident).whoami() == "twin"
                    # The first's path comes back: it hears 4009 and stops dialing.
                    proxy.heal()
                    with anyio.fail_after(10):
                        await first.wait_stopped()
                    assert first.taken_over is not None
                    assert second.taken_over is None
                    assert await executor.service("ident", Ident).whoami() == "twin"


FLOOD_SOCKETS = 13
VICTIM_WAIT = 2.0  # seconds: a victim executor is admitted (joins or resumes) within this


async def flood_as(port: int, executor_id: str, secret: bytes, stop: anyio.Event) -> Counter[str]:
    """Hold :data:`FLOOD_SOCKETS` sockets that complete the handshake as ``executor_id`` (its
    key is known), one after another on each, until ``stop``; how each attempt ended."""
    tally: Counter[str] = Counter()

    async def one_socket_at_a_time() -> None:
        while not stop.is_set():
            async with Raw.connect(port) as raw:
                if not await raw.upgrade():
                    tally[f"http {raw.http_status}"] += 1
                    await anyio.sleep(0.001)  # a full cap is tried again at once
                    continue
                try:
                    await raw.authenticate(
                        gl.Role.WORKER, fence=False, secret=secret, executor_id=executor_id
                    )
                except ConnectionError:
                    tally[f"close {raw.close_code}"] += 1
                    # Again soon: the flood is of queued admissions, not of CPU (the attacker
                    # shares this test's event loop).
                    await anyio.sleep(0.05)
                    continue
                tally["admitted"] += 1
                with anyio.move_on_after(1.0):
                    await stop.wait()

    async with anyio.create_task_group() as tg:
        for _ in range(FLOOD_SOCKETS):
            tg.start_soon(one_socket_at_a_time)
    return tally


async def test_one_executors_key_cannot_lock_the_others_out(tmp_path: Path) -> None:
    """Sockets holding one executor's key (device-1's) complete handshakes as fast as they can
    while device-1's attached socket is silent (each takeover needs a probe that fails only
    after ``takeover_probe_timeout``). At most one of them is being admitted at a time, under
    the handshake deadline, the others are refused at once (4004), and none of them fills the
    authenticated-socket cap: another executor joins, and a third resumes its session after a
    cut, within :data:`VICTIM_WAIT` seconds, never answered 503."""
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    limits = LIMITS.replace(takeover_probe_timeout=1.0, heartbeat_timeout=10.0)
    config = gl.FleetConfig(
        listen=("127.0.0.1", 0), keyring=keyring, limits=limits, max_executors=4
    )
    secrets = {i: enroll(keyring, i) for i in ("device-1", "resumer", "newcomer")}
    stop = anyio.Event()
    tallies: list[Counter[str]] = []
    with anyio.fail_after(DEADLINE):
        async with gl.fleet(config) as fleet, AsyncExitStack() as stack:
            port = fleet.listen_address[1]
            await stack.enter_async_context(worker("resumer", secrets["resumer"], fleet.url))
            resumer = fleet.executor("resumer")
            await resumer.wait_ready(10)
            session = fleet.executors()["resumer"].session
            # device-1's key holder: one attached socket that never answers again.
            silent = await stack.enter_async_context(Raw.connect(port))
            assert await silent.upgrade()
            await silent.authenticate(
                gl.Role.WORKER, secret=secrets["device-1"].reveal(), executor_id="device-1"
            )
            key = secrets["device-1"].reveal()

            async def attack() -> None:
                tallies.append(await flood_as(port, "device-1", key, stop))

            async with anyio.create_task_group() as tg:
                tg.start_soon(attack)
                await wait_for(
                    lambda: fleet.statistics().handshakes_completed >= 2 + FLOOD_SOCKETS,
                    10,
                    "the flood to complete its handshakes",
                )
                start = anyio.current_time()
                resumed = fleet.statistics().resumed
                await resumer.link.disconnect()
                async with worker("newcomer", secrets["newcomer"], fleet.url):
                    await wait_for(
                        lambda: (
                            fleet.statistics().resumed > resumed and resumer.availability == "ready"
                        ),
                        VICTIM_WAIT,
                        "the cut executor to resume",
                    )
                    await fleet.executor("newcomer").wait_ready(VICTIM_WAIT)
                    took = anyio.current_time() - start
                    stop.set()
            (tally,) = tallies
            stats = fleet.statistics()
            print(f"victims admitted in {took:.2f}s; flood: {dict(tally)}")
            assert fleet.executors()["resumer"].session == session
            assert await resumer.service("ident", Ident).whoami() == "resumer"
            assert stats.upgrades_refused.get(503, 0) == 0, (stats.upgrades_refused, tally)
            assert stats.admissions_busy > 0 and tally["close 4004"] > 0, (stats, tally)
            assert took < VICTIM_WAIT


async def test_forget_after_drops_an_executor_that_stayed_offline(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring, forget_after=0.2) as fleet:
            seen: list[gl.FleetEvent] = []

            async def follow() -> None:
                async for event in fleet.events():
                    seen.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(follow)
                secret = enroll(keyring, "passing")
                async with worker("passing", secret, fleet.url):
                    await wait_for(lambda: "passing" in fleet.executors(), 10, "it to join")
                    await wait_for(
                        lambda: fleet.executors()["passing"].availability == "ready",
                        10,
                        "it to be ready",
                    )
                await wait_for(lambda: "passing" not in fleet.executors(), 10, "it forgotten")
                await wait_for(lambda: seen and seen[-1].kind == "forgotten", 5, "the event")
                tg.cancel_scope.cancel()
            kinds = [e.kind for e in seen if e.executor_id == "passing"]
            assert kinds[0] == "joined" and "ready" in kinds and kinds[-1] == "forgotten"


async def test_a_slow_event_consumer_is_told_how_many_events_it_lost(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=keyring, limits=LIMITS)
    secrets = {i: enroll(keyring, i) for i in ("a", "b", "c")}
    got: list[gl.FleetEvent] = []
    go = anyio.Event()
    with anyio.fail_after(DEADLINE):
        async with gl.Fleet(config, events_buffer=2) as fleet:

            async def slow_consumer() -> None:
                async for event in fleet.events():
                    got.append(event)
                    if len(got) == 1:
                        await go.wait()  # events pile up meanwhile

            async with anyio.create_task_group() as tg, AsyncExitStack() as stack:
                tg.start_soon(slow_consumer)
                # The first event proves the subscription; then the consumer stops reading.
                while not got:
                    await stack.enter_async_context(worker("a", secrets["a"], fleet.url))
                    await fleet.executor("a").wait_ready(10)
                    await wait_for(lambda: got, 5, "the first event")
                for executor_id in ("b", "c"):  # with "ready a": 5 events, 3 more than kept
                    await stack.enter_async_context(
                        worker(executor_id, secrets[executor_id], fleet.url)
                    )

                    # (Not fleet.executor(): an executor named first does not "join".)
                    def joined(i: str = executor_id) -> bool:
                        return (
                            fleet.executors().get(i) is not None
                            and fleet.executors()[i].availability == "ready"
                        )

                    await wait_for(
                        joined,
                        10,
                        f"{executor_id} to join",
                    )
                go.set()
                await wait_for(lambda: len(got) >= 4, 5, "the buffered events")
                tg.cancel_scope.cancel()
                await stack.aclose()
    kinds = [e.kind for e in got]
    assert kinds[1] == "lost" and got[1].lost == 3, got  # ready a, joined b, ready b
    assert kinds[2:] == ["joined", "ready"] and got[-1].executor_id == "c", got


async def test_a_fleet_of_one_from_a_link_config(tmp_path: Path) -> None:
    secret = gl.generate_secret()
    with anyio.fail_after(DEADLINE):
        listen = gl.LinkConfig(
            executor_id="solo",
            role=gl.Role.CONTROLLER,
            secret=secret,
            listen=("127.0.0.1", 0),
            limits=LIMITS,
        )
        async with gl.fleet(listen) as fleet, worker("solo", secret, fleet.url):
            executor = fleet.executor("solo")
            await executor.wait_ready(10)
            assert await executor.service("ident", Ident).whoami() == "solo"
            with pytest.raises(ValueError, match="not one this fleet serves"):
                fleet.executor("other")


# ------------------------------------------------------------------ routing by capability


class Calc(Protocol):
    async def add(self, a: int, b: int) -> int: ...


class CalcV2(Calc, Protocol):
    async def mul(self, a: int, b: int) -> int: ...


class CalcV1Impl:
    async def add(self, a: int, b: int) -> int:
        return a + b


class CalcV2Impl(CalcV1Impl):
    async def mul(self, a: int, b: int) -> int:
        return a * b


class CalcTextImpl:
    async def add(self, a: int, b: int) -> str:
        return str(a + b)


@dataclasses.dataclass
class Box:
    w: int
    h: int


class AreaImpl:
    async def area(self, box: Box) -> int:
        return box.w * box.h


class AreaPlusImpl(AreaImpl):
    async def perimeter(self, box: Box) -> int:
        return 2 * (box.w + box.h)


async def test_executors_describing_the_same_manifest_share_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller holds one decoded copy of each distinct manifest and type descriptions
    however many executors described them, and compares an interface with each distinct
    manifest once: the facades and ``offers`` of an executor reuse the comparison another
    executor with the same manifest made, and the changes logged when two executors' manifest
    changes the same way are compared once."""

    class Area(Protocol):  # a class per run: no comparison with it is cached yet
        async def area(self, box: Box) -> int: ...

    compared: list[str] = []

    def counting(expected: object, offered: object) -> tuple[Compatibility, str]:
        compared.append("compared")
        return compare_method(expected, offered)

    monkeypatch.setattr(facades, "compare_method", counting)
    logged: list[str] = []

    def counting_logged(expected: object, offered: object) -> tuple[Compatibility, str]:
        logged.append("compared")
        return compare_method(expected, offered)

    monkeypatch.setattr(described, "compare_method", counting_logged)
    extra = f"extra{os.urandom(4).hex()}"  # a manifest no earlier run held
    keyring = tmp_path / "keys"
    serves = {"a": AreaImpl, "b": AreaImpl, "c": AreaPlusImpl}
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet, AsyncExitStack() as stack:
            workers = {}
            for executor_id, impl in serves.items():
                config = worker_config(executor_id, enroll(keyring, executor_id), fleet.url)
                workers[executor_id] = await stack.enter_async_context(
                    gl.Worker(config, {"area": impl()})
                )
            infos = {}
            for executor_id in serves:
                await fleet.executor(executor_id).wait_ready(10)
                infos[executor_id] = await fleet.executor(executor_id).info()
            a, b, c = infos["a"], infos["b"], infos["c"]
            assert a.services is b.services and a.versions is b.versions
            assert a.types is b.types and "Box" in str(a.types)
            assert a.contract == b.contract != c.contract
            assert c.services is not a.services and "perimeter" in c.services["area"]
            for executor_id in serves:
                executor = fleet.executor(executor_id)
                for _ in range(3):
                    assert await executor.service("area", Area).area(Box(2, 3)) == 6
                    assert executor.offers("area", "area", interface=Area)
            assert len(compared) == 2  # area.area, once per distinct manifest

            for executor_id in ("a", "b"):
                workers[executor_id].add_service(extra, AreaImpl())
            for executor_id in ("a", "b"):
                while extra not in fleet.executor(executor_id).versions:
                    await anyio.sleep(0.005)
            assert logged == ["compared"]  # the new extra.area, for both executors


async def test_map_and_pick_route_by_what_each_manifest_offers(tmp_path: Path) -> None:
    """Only ready executors whose manifest has what the call needs are chosen; ``pick`` takes
    the least loaded (pending calls) and equals take turns; an executor that gains a service
    while running becomes a candidate without a new session."""
    keyring = tmp_path / "keys"
    serves: dict[str, dict[str, object]] = {
        "plain": {},
        "v1": {"calc": CalcV1Impl()},
        "v2": {"calc": CalcV2Impl()},
        "text": {"calc": CalcTextImpl()},
    }
    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet, AsyncExitStack() as stack:
            workers: dict[str, gl.Worker] = {}
            for executor_id, services in serves.items():
                config = worker_config(executor_id, enroll(keyring, executor_id), fleet.url)
                ident = IdentService(executor_id)
                workers[executor_id] = await stack.enter_async_context(
                    gl.Worker(config, {"ident": ident, **services})
                )
            for executor_id in serves:
                await fleet.executor(executor_id).wait_ready(10)
            fleet.executor("offline")  # known, never connects: never chosen

            assert {fleet.pick("calc", "mul").executor_id for _ in range(6)} == {"v2"}
            assert {fleet.pick("calc").executor_id for _ in range(9)} == {"v1", "v2", "text"}
            assert {fleet.pick("calc", "add", interface=Calc).executor_id for _ in range(6)} == {
                "v1",
                "v2",
            }  # "text" returns str: incompatible with Calc's add
            assert fleet.pick("calc", interface=CalcV2).executor_id == "v2"
            with pytest.raises(gl.NotDispatched) as none:
                fleet.pick("files")
            assert none.value.code == "NO_EXECUTOR"
            assert "no ready executor offers files (4 ready)" in none.value.message

            def add(ex: gl.RemoteExecutor) -> Awaitable[int]:
                return ex.service("calc", Calc).add(2, 3)

            results = await fleet.map(add, where="calc.add")
            refused = results.pop("text")  # it has calc.add, with another contract
            assert isinstance(refused, gl.Rejected) and refused.code == "CONTRACT_CHANGED"
            assert results == {"v1": 5, "v2": 5}

            # the least loaded: a call held on v1 and two on v2 leave "text" the only idle one
            async with anyio.create_task_group() as tg:
                for executor_id, count in (("v1", 1), ("v2", 2)):
                    held = fleet.executor(executor_id).service("ident", Ident)
                    for _ in range(count):
                        tg.start_soon(held.hold, 30.0)  # until cancelled below
                while fleet.executors()["v2"].pending < 2 or fleet.executors()["v1"].pending < 1:
                    await anyio.sleep(0.005)
                assert {fleet.pick("calc").executor_id for _ in range(4)} == {"text"}
                assert fleet.pick("calc", interface=Calc).executor_id == "v1"
                tg.cancel_scope.cancel()

            # a service added while running: routable at once, on the same session
            workers["plain"].add_service("calc", CalcV2Impl())
            while "calc" not in fleet.executors()["plain"].services:
                await anyio.sleep(0.005)
            snapshot = fleet.executors()
            assert snapshot["plain"].services["calc"] == snapshot["v2"].services["calc"]
            assert snapshot["v1"].services["calc"] != snapshot["v2"].services["calc"]
            assert {fleet.pick("calc", "mul").executor_id for _ in range(6)} == {"v2", "plain"}
            where = await fleet.map(
                lambda ex: ex.service("calc", CalcV2).mul(2, 3),
                where=lambda ex: ex.offers("calc", "mul", interface=CalcV2),
            )
            assert where == {"plain": 6, "v2": 6}

            await stack.aclose()  # every worker stops: nothing is ready
            while any(ex.availability == "ready" for ex in map(fleet.executor, serves)):
                await anyio.sleep(0.005)
            with pytest.raises(gl.NotDispatched, match="NO_EXECUTOR"):
                fleet.pick("calc")
            assert await fleet.map(add, where="calc") == {}


async def test_a_draining_executor_takes_no_new_work_and_is_not_an_error(tmp_path: Path) -> None:
    keyring = tmp_path / "keys"
    staying, leaving = enroll(keyring, "staying"), enroll(keyring, "leaving")
    service = IdentService("leaving")
    events: list[tuple[str, str]] = []
    draining, stop, closed = anyio.Event(), anyio.Event(), anyio.Event()
    held: list[str] = []

    def whoami(executor: gl.RemoteExecutor) -> Awaitable[str]:
        return executor.service("ident", Ident).whoami()

    async def follow(fleet: gl.Fleet) -> None:
        async for event in fleet.events():
            events.append((event.kind, event.executor_id))
            if event.kind == "draining":
                draining.set()

    async def leaving_worker(url: str) -> None:
        # A worker is closed by the task that entered it.
        try:
            config = worker_config("leaving", leaving, url)
            async with gl.Worker(config, {"ident": service}) as w:
                await stop.wait()
                await w.aclose(drain=DEADLINE)
        finally:
            closed.set()

    with anyio.fail_after(DEADLINE):
        async with listening_fleet(keyring) as fleet, anyio.create_task_group() as tg:
            tg.start_soon(follow, fleet)
            async with worker("staying", staying, fleet.url):
                tg.start_soon(leaving_worker, fleet.url)
                for executor_id in ("staying", "leaving"):
                    await fleet.executor(executor_id).wait_ready(10)

                async def held_call() -> None:
                    held.append(await fleet.executor("leaving").service("ident", Ident).gated())

                tg.start_soon(held_call)
                await service.started.wait()
                stop.set()  # the worker drains, its call in flight keeps it open
                await draining.wait()

                snapshot = fleet.executors()
                assert snapshot["leaving"].availability == "draining"
                assert not _accepting_work(snapshot["leaving"])
                assert _accepting_work(snapshot["staying"])
                rows = [line.split()[:2] for line in fleet_table(fleet)]
                assert ["leaving", "draining"] in rows and ["staying", "ready"] in rows

                assert await fleet.map(whoami) == {"staying": "staying"}  # left out
                named = await fleet.map(whoami, ids=["leaving", "staying"])
                assert named["staying"] == "staying"
                refused = named["leaving"]
                assert isinstance(refused, gl.NotDispatched) and refused.code == "DRAINING"
                with pytest.raises(gl.NotDispatched) as direct:
                    await whoami(fleet.executor("leaving"))
                assert direct.value.code == "DRAINING"
                assert service.asked == 0  # nothing new reached the draining worker

                service.gate.set()
                await closed.wait()
                assert held == ["leaving"]  # the call sent before the goodbye finished
                await wait_for(
                    lambda: fleet.executors()["leaving"].availability == "offline",
                    10,
                    "the drained worker to go offline",
                )
                snapshot = fleet.executors()
                assert (snapshot["leaving"].calls, snapshot["leaving"].errors) == (2, 0)
            tg.cancel_scope.cancel()
    mine = [kind for kind, executor_id in events if executor_id == "leaving"]
    assert mine[-2:] == ["draining", "offline"], events
