"""Chaos soak: concurrent calls and streams through a FaultProxy that cuts, stalls and slows.

A worker (in this process, so its ledger and statistics can be read) listens on loopback; the
controller dials it through a :class:`garcon_link.testing.FaultProxy`. Several callers make
unary calls (each with a unique token, a random payload and sometimes a short hold on the
worker) and several consumers read numbered streams (sometimes slowly, sometimes stopping early),
while a fault schedule drawn from a seeded RNG cuts connections (``cut``, ``cut_after`` with a
random byte budget and direction), half-opens them (``blackhole`` then ``heal``: both peers stay
connected and nothing moves, until the heartbeat closes the socket), now and then partitions
them for longer than ``detached_grace`` (the session is retired: pending calls become
``OutcomeUnknown``/``NotDispatched`` and a fresh session replaces it), delays and throttles
them, and refuses reconnections for a moment. The seed is printed (set ``GARCON_SOAK_SEED`` to
replay a schedule; the interleaving with the sockets is not deterministic, the schedule is).

Invariants asserted at the end (after healing and waiting for quiescence):

* every call either returned the right checksum and ran exactly once (ledger count 1), or raised
  ``NotDispatched``/``Rejected`` and ran zero times, or raised ``OutcomeUnknown`` and ran zero or
  one time -- never twice; nothing ran that no caller asked for;
* every stream delivered a gap-free, duplicate-free prefix ``0, 1, 2, ...`` and, if it completed,
  all ``n`` items; its generator started at most once;
* sampled during the run, neither side's retained frames/bytes, pre-readiness buffer or delivery
  queue ever exceeded its ``Limits``;
* this process's RSS stayed under a ceiling and grew by a bounded amount after warm-up (plus
  1 KiB per call for the test's own records and the worker's ledger, which grow by design);
* the link kept working: enough calls succeeded, and after the faults stop every call succeeds.

**Keyed mode** (docs/design.md#idempotency): every unary call carries an idempotency key (its token)
with ``retry_unknown=True``, and ``call_timeout`` outlasts the longest partition; at least two
partitions happen (at a third and two thirds of the run). The invariant
for calls becomes: every call executed exactly once and returned its real result -- through cuts,
half-open sockets and partitions that retire the session while the worker lives.

The CI version runs about 60 s with at least 100 cuts (the keyed mode 30 s and 50 cuts);
``--soak-minutes N`` runs N minutes each (the cut floor scales). ``make test`` leaves it out
(marker ``soak``); ``.ci/run`` runs it under each interpreter. It runs on asyncio only, to keep
that CI time at 90 s per interpreter; both backends are covered by the functional tests of the
link and the RPC layer.
"""

from __future__ import annotations

import faulthandler
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.abc
import pytest
from faultutil import (
    Ledger,
    LedgerService,
    checksum,
    controller_config,
    rss_bytes,
    wait_for,
    worker_config,
)

import garcon_link as gl
from garcon_link.core.handshake import HandshakeResult
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.endpoint.transport import SessionTransport
from garcon_link.testing import FaultProxy

pytestmark = [
    pytest.mark.soak,
    pytest.mark.anyio,
    pytest.mark.parametrize("anyio_backend", ["asyncio"]),
    # No pytest-timeout: the duration is an option. The test bounds itself (anyio.fail_after)
    # and a faulthandler watchdog ends the process if even that cannot fire.
    pytest.mark.timeout(0),
]

CI_SECONDS = 60.0
KEYED_CI_SECONDS = 30.0
CUTS_PER_MINUTE = 100
MiB = 1024 * 1024

LIMITS = gl.Limits(
    heartbeat_interval=0.05,
    heartbeat_timeout=0.4,
    detached_grace=3.0,
    replay_inactivity=2.0,
    backoff_base=0.01,
    backoff_max=0.1,
    backoff_reset_after=1.0,
    handshake_timeout=2.0,
    connect_timeout=1.0,
    takeover_probe_timeout=0.3,
    close_timeout=0.3,
    scope_cleanup_timeout=0.5,
    # Small retention and windows, so that back-pressure is exercised, not just replay.
    max_retained_frames=128,
    max_retained_bytes=1 * MiB,
    max_inbound_buffer_payloads=128,
    max_inbound_buffer_bytes=1 * MiB,
    max_frame_bytes=512 * 1024,
    delivery_queue=64,
    stream_window_items=32,
    stream_window_bytes=256 * 1024,
    call_timeout=10.0,
    dispatch_deadline=1.0,
)
# Keyed calls retry until their deadline: it must outlast a partition (grace + 1.5 s) plus the
# reconnection, or a call could honestly end unknown and the strict invariant would not apply.
KEYED_LIMITS = LIMITS.replace(call_timeout=30.0)

UNARY_CALLERS = 6
STREAM_CONSUMERS = 3
PAYLOAD_SIZES = (0, 16, 1_000, 20_000, 100_000)
RSS_CEILING = 1024 * MiB  # absolute: the whole test process
RSS_GROWTH = 150 * MiB  # after warm-up, plus the bookkeeping allowance below
BOOKKEEPING = 1024  # bytes per call or stream: the test's records and the worker's ledger


# ---------------------------------------------------------------------------------- records


@dataclass(slots=True)
class CallRecord:
    token: str
    outcome: str  # ok | not_dispatched | rejected | unknown | wrong: ... | unexpected: ...


@dataclass(slots=True)
class StreamRecord:
    """One stream, checked as it is consumed (items are not kept: a long soak reads millions)."""

    token: str
    n: int
    received: int = 0  # items delivered
    anomaly: str | None = None  # the first item that broke "0, 1, 2, ..." (a gap or duplicate)
    completed: bool = False
    stopped_early: bool = False
    outcome: str = "ok"  # ok | not_dispatched | rejected | unknown | unexpected: ...

    def take(self, item: int) -> None:
        if item != self.received and self.anomaly is None:
            self.anomaly = f"item #{self.received} was {item}"
        self.received += 1


@dataclass
class Observed:
    calls: list[CallRecord] = field(default_factory=list)
    streams: list[StreamRecord] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    schedule: list[str] = field(default_factory=list)  # the last faults, for failure messages
    violations: list[str] = field(default_factory=list)
    max_retained: dict[str, tuple[int, int]] = field(default_factory=dict)
    rss: list[int] = field(default_factory=list)


def classify(exc: BaseException) -> str:
    if isinstance(exc, gl.NotDispatched):
        return "not_dispatched"
    if isinstance(exc, gl.Rejected):
        return "rejected"
    if isinstance(exc, gl.OutcomeUnknown):
        return "unknown"
    return f"unexpected: {exc!r}"


# ---------------------------------------------------------------------------------- actors


async def unary_caller(
    index: int,
    ledger: Ledger,
    rng: random.Random,
    stop: anyio.Event,
    seen: Observed,
    keyed: bool = False,
) -> None:
    serial = 0
    while not stop.is_set():
        burst = rng.randint(1, 4)

        async def one(token: str, payload: bytes, hold: float) -> None:
            facade = (
                gl.with_options(ledger, idempotency_key=token, retry_unknown=True)
                if keyed
                else ledger
            )
            try:
                result = await facade.apply(token, payload, hold)
            except gl.CallError as exc:
                outcome = classify(exc)
            else:
                expected = checksum(token, payload)
                outcome = "ok" if result == expected else f"wrong: {result!r} != {expected!r}"
            seen.calls.append(CallRecord(token, outcome))

        async with anyio.create_task_group() as tg:
            for _ in range(burst):
                serial += 1
                size = rng.choice(PAYLOAD_SIZES)
                payload = rng.randbytes(size)
                hold = rng.choice((0.0, 0.0, 0.0, 0.01, 0.05))
                tg.start_soon(one, f"u{index}-{serial}", payload, hold)
        if seen.calls and seen.calls[-1].outcome == "not_dispatched":
            with anyio.move_on_after(0.02):  # do not spin while the executor is away
                await stop.wait()


async def stream_consumer(
    index: int, ledger: Ledger, rng: random.Random, stop: anyio.Event, seen: Observed
) -> None:
    serial = 0
    while not stop.is_set():
        serial += 1
        token = f"s{index}-{serial}"
        n = rng.randint(20, 1500)
        pause = rng.choice((0.0, 0.0, 0.001, 0.002))
        slow = rng.random() < 0.3
        stop_at = rng.randint(1, n) if rng.random() < 0.15 else None
        record = StreamRecord(token, n)
        stream = ledger.numbers(token, n, pause)
        try:
            async for item in stream:
                record.take(item)
                if slow and rng.random() < 0.1:
                    await anyio.sleep(0.005)
                if stop_at is not None and record.received >= stop_at:
                    record.stopped_early = True
                    break
            else:
                record.completed = True
        except gl.CallError as exc:
            record.outcome = classify(exc)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await stream.aclose()  # type: ignore[attr-defined]
        seen.streams.append(record)
        if record.outcome == "not_dispatched":
            with anyio.move_on_after(0.02):
                await stop.wait()


async def fault_schedule(
    proxy: FaultProxy,
    rng: random.Random,
    until: float,
    min_cuts: int,
    seen: Observed,
    partitions: int = 0,
) -> None:
    """Draw faults from ``rng`` until ``until`` (anyio clock), then cut until ``min_cuts``
    connections were cut; heal at the end. With ``partitions``, that many partitions happen at
    evenly spaced times whatever the draw (a short run may otherwise draw none)."""

    def note(text: str) -> None:
        seen.schedule.append(f"{anyio.current_time() - start:7.2f}s {text}")
        del seen.schedule[:-40]

    async def pause(low: float, high: float) -> None:
        await anyio.sleep(rng.uniform(low, high))

    async def connected() -> None:
        # A cut only counts when there is a connection to cut: wait (bounded) for the redial.
        with anyio.move_on_after(1.0):
            while proxy.statistics().connections_active == 0:
                await anyio.sleep(0.01)

    start = anyio.current_time()
    forced = [start + (until - start) * (i + 1) / (partitions + 1) for i in range(partitions)]
    try:
        while anyio.current_time() < until:
            if forced and anyio.current_time() >= forced[0]:
                forced.pop(0)
                kind = "partition"
            else:
                kind = rng.choices(
                    (
                        "cut",
                        "cut_after",
                        "half_open",
                        "partition",
                        "delay",
                        "throttle",
                        "refuse",
                        "calm",
                    ),
                    weights=(50, 20, 10, 1.5, 6, 6, 5, 3),
                )[0]
            seen.faults[kind] += 1
            if kind == "cut":
                await connected()
                note("cut")
                proxy.cut()
                await pause(0.05, 0.25)
            elif kind == "cut_after":
                budget = rng.choice((0, 10, 1_000, 50_000, 300_000))
                direction: Literal["up", "down", "both"] = rng.choice(("up", "down", "both"))
                await connected()
                note(f"cut_after {budget} {direction}")
                proxy.cut_after(budget, direction)
                await pause(0.1, 0.4)
            elif kind == "half_open":
                note("blackhole")
                proxy.blackhole()
                await pause(0.2, 1.2)
                note("heal")
                proxy.heal()
                await pause(0.05, 0.2)
            elif kind == "partition":
                # Longer than detached_grace: the session is retired, a fresh one replaces it.
                note("blackhole (partition)")
                proxy.blackhole()
                await pause(LIMITS.detached_grace + 0.5, LIMITS.detached_grace + 1.5)
                note("heal")
                proxy.heal()
            elif kind == "delay":
                seconds = rng.uniform(0.005, 0.1)
                note(f"delay {seconds:.3f}")
                proxy.delay(seconds)
                await pause(0.3, 1.0)
                proxy.delay(0)
            elif kind == "throttle":
                rate = rng.uniform(50_000, 1_000_000)
                note(f"throttle {rate:.0f} B/s")
                proxy.throttle(rate)
                await pause(0.3, 1.0)
                proxy.throttle(None)
            elif kind == "refuse":
                note("refuse + cut")
                proxy.refuse()
                proxy.cut()
                await pause(0.1, 0.6)
                proxy.refuse(False)
            else:
                await pause(0.1, 0.5)
        # Top up: a seed that drew many long faults still makes the floor of cuts (bounded).
        while proxy.statistics().cuts < min_cuts and anyio.current_time() < until + 30:
            await connected()
            note("cut (top-up)")
            proxy.cut()
            await pause(0.05, 0.15)
    finally:
        note("heal (end)")
        proxy.heal()


async def sampler(
    executor: gl.RemoteExecutor, worker: gl.Worker, stop: anyio.Event, seen: Observed
) -> None:
    """Every 20 ms: both sides' buffers against their Limits; RSS every 100 ms."""
    limits = LIMITS
    tick = 0
    while not stop.is_set():
        for side, link in (("controller", executor.link), ("worker", worker.link)):
            transport = link.transport
            if transport is None:
                continue
            stats = transport.statistics()
            frames, size = stats.session.retained_frames, stats.session.retained_bytes
            old = seen.max_retained.get(side, (0, 0))
            seen.max_retained[side] = (max(old[0], frames), max(old[1], size))
            if frames > limits.max_retained_frames or size > limits.max_retained_bytes:
                seen.violations.append(f"{side} retained {frames} frames / {size} bytes")
            if (
                stats.buffered_payloads > limits.max_inbound_buffer_payloads
                or stats.buffered_bytes > limits.max_inbound_buffer_bytes
            ):
                seen.violations.append(
                    f"{side} buffered {stats.buffered_payloads} / {stats.buffered_bytes} bytes"
                )
            # The delivery queue, plus the payloads of the one inbound message being handed
            # over (each a retained frame of the peer, so at most max_retained_frames).
            queue_bound = limits.delivery_queue + limits.max_retained_frames + 1
            if stats.queued_payloads > queue_bound:
                seen.violations.append(f"{side} queued {stats.queued_payloads} payloads")
        if tick % 5 == 0:
            seen.rss.append(rss_bytes())
        tick += 1
        with anyio.move_on_after(0.02):
            await stop.wait()


# ---------------------------------------------------------------------------------- the test


def check_invariants(service: LedgerService, seen: Observed, keyed: bool = False) -> list[str]:
    """Every broken invariant, as text (empty when all hold)."""
    problems: list[str] = []
    asked: set[str] = set()
    for call in seen.calls:
        asked.add(call.token)
        ran = service.ledger[call.token]
        if keyed and (call.outcome != "ok" or ran != 1):
            problems.append(f"keyed call {call.token}: {call.outcome}, ran {ran} times")
        elif call.outcome == "ok":
            if ran != 1:
                problems.append(f"call {call.token} returned but ran {ran} times")
        elif call.outcome in ("not_dispatched", "rejected"):
            if ran != 0:
                problems.append(f"call {call.token} {call.outcome} but ran {ran} times")
        elif call.outcome == "unknown":
            if ran > 1:
                problems.append(f"call {call.token} unknown and ran {ran} times")
        else:
            problems.append(f"call {call.token}: {call.outcome}")
    for s in seen.streams:
        asked.add(s.token)
        ran = service.ledger[s.token]
        if s.anomaly is not None:
            problems.append(f"stream {s.token}: not a gap-free, duplicate-free prefix: {s.anomaly}")
        if s.completed and s.received != s.n:
            problems.append(f"stream {s.token} completed with {s.received} of {s.n} items")
        if s.outcome.startswith("unexpected"):
            problems.append(f"stream {s.token}: {s.outcome}")
        if ran > 1:
            problems.append(f"stream {s.token} started {ran} times")
        if (s.completed or s.received) and ran != 1:
            problems.append(f"stream {s.token} delivered items but started {ran} times")
        if s.outcome in ("not_dispatched", "rejected") and ran != 0:
            problems.append(f"stream {s.token} {s.outcome} but started {ran} times")
    phantom = sorted(set(service.ledger) - asked - {"final"})
    phantom = [t for t in phantom if not t.startswith("final-")]
    if phantom:
        problems.append(f"ran without a caller: {phantom[:10]}")
    return problems


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "keyed"])
async def test_chaos_soak(request: pytest.FixtureRequest, keyed: bool) -> None:
    minutes = request.config.getoption("--soak-minutes")
    ci_seconds = KEYED_CI_SECONDS if keyed else CI_SECONDS
    duration = ci_seconds if minutes is None else float(minutes) * 60
    min_cuts = int(CUTS_PER_MINUTE * duration / 60)
    seed = int(os.environ.get("GARCON_SOAK_SEED") or random.SystemRandom().randrange(1 << 32))
    mode = "keyed" if keyed else "plain"
    print(f"\nchaos soak ({mode}): seed={seed} duration={duration:.0f}s (GARCON_SOAK_SEED replays)")
    budget = duration + 120  # the run, then draining the callers (bounded by call_timeout)
    faulthandler.dump_traceback_later(budget + 60, exit=True)
    try:
        with anyio.fail_after(budget):
            report = await soak(seed, duration, min_cuts, keyed)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(report)


async def soak(seed: int, duration: float, min_cuts: int, keyed: bool = False) -> str:
    limits = KEYED_LIMITS if keyed else LIMITS
    master = random.Random(seed)
    service = LedgerService()
    seen = Observed()
    stop_callers = anyio.Event()
    stop_sampler = anyio.Event()
    sessions: list[tuple[str, SessionTransport]] = []
    async with gl.Worker(worker_config(limits), {"ledger": service}) as worker:
        port = worker.link.listen_address[1]
        async with FaultProxy("127.0.0.1", port) as proxy:
            config = controller_config(limits, proxy.url())
            async with gl.connect(config) as executor:
                controller_link = executor.link
                assert isinstance(controller_link, WebSocketLink)  # its own: not a fleet member
                for side, link in (("controller", controller_link), ("worker", worker.link)):

                    def record(
                        transport: SessionTransport, _result: HandshakeResult, side: str = side
                    ) -> None:
                        sessions.append((side, transport))

                    link.on_session(record)
                history: list[str] = []
                executor.on_availability_changed(history.append)
                await executor.wait_ready(10)
                ledger = executor.service("ledger", Ledger)
                rss_start = rss_bytes()
                started = anyio.current_time()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sampler, executor, worker, stop_sampler, seen)
                    async with anyio.create_task_group() as actors:
                        for i in range(UNARY_CALLERS):
                            rng = random.Random(master.getrandbits(64))
                            actors.start_soon(
                                unary_caller, i, ledger, rng, stop_callers, seen, keyed
                            )
                        for i in range(STREAM_CONSUMERS):
                            rng = random.Random(master.getrandbits(64))
                            actors.start_soon(stream_consumer, i, ledger, rng, stop_callers, seen)
                        faults = random.Random(master.getrandbits(64))
                        await fault_schedule(
                            proxy,
                            faults,
                            started + duration,
                            min_cuts,
                            seen,
                            partitions=2 if keyed else 0,
                        )
                        stop_callers.set()  # callers finish their current call and stop
                    ran_for = anyio.current_time() - started

                    # Quiescence: healed, ready, every frame acknowledged, no handler running.
                    await executor.wait_ready(15)
                    final = [f"final-{i}" for i in range(20)]
                    for token in final:
                        assert await ledger.apply(token, b"end") == checksum(token, b"end")

                    def quiet() -> bool:
                        t1, t2 = executor.link.transport, worker.link.transport
                        return (
                            t1 is not None
                            and t2 is not None
                            and t1.statistics().session.retained_frames == 0
                            and t2.statistics().session.retained_frames == 0
                            and service.running == 0
                        )

                    await wait_for(quiet, 10, "retention to drain and handlers to finish")
                    stop_sampler.set()
                proxy_stats = proxy.statistics()
                link_stats = executor.link.statistics()
                worker_stats = worker.link.statistics()
    problems = check_invariants(service, seen, keyed)
    problems += seen.violations[:20]
    # Why sessions were retired. Expected under these faults: the grace expired (partition),
    # the session was replaced or retired by the peer as a consequence, the replay stalled
    # (a throttled replay), or the end of the test. Anything else (gap, receipt beyond what was
    # written, malformed packet, refused resume, inbound overflow) is a bug.
    retired = Counter(
        f"{side}:{t.failure.reason.name}" for side, t in sessions if t.failure is not None
    )
    expected_reasons = {"GRACE_EXPIRED", "REPLACED", "PEER_RETIRED", "CLOSED", "REPLAY_STALLED"}
    problems += [
        f"a session was retired for {key} ({n}x)"
        for key, n in retired.items()
        if key.split(":")[1] not in expected_reasons
    ]
    outcomes = Counter(c.outcome.split(":")[0] for c in seen.calls)
    stream_outcomes = Counter(
        "completed" if s.completed else "stopped" if s.stopped_early else s.outcome
        for s in seen.streams
    )
    rss_warm = seen.rss[len(seen.rss) // 10] if seen.rss else rss_start
    rss_peak = max(seen.rss, default=rss_start)
    report = "\n".join(
        [
            f"chaos soak ({'keyed' if keyed else 'plain'}) seed={seed}: ran {ran_for:.1f}s",
            f"  faults drawn: {dict(seen.faults)}",
            f"  proxy: {proxy_stats.cuts} cuts, {proxy_stats.connections_accepted} connections "
            f"({proxy_stats.connections_refused} refused), "
            f"{proxy_stats.bytes_up} B up / {proxy_stats.bytes_down} B down",
            f"  controller link: {link_stats.dial_attempts} dials, {link_stats.resumed} resumed, "
            f"{link_stats.fresh_sessions} fresh sessions, "
            f"{link_stats.heartbeat_timeouts} heartbeat timeouts",
            f"  worker link: {worker_stats.resumed} resumed, {worker_stats.fresh_sessions} fresh, "
            f"{worker_stats.heartbeat_timeouts} heartbeat timeouts",
            f"  availability transitions: {Counter(history)}",
            f"  sessions retired: {dict(retired)}",
            f"  calls: {len(seen.calls)} {dict(outcomes)}",
            f"  streams: {len(seen.streams)} {dict(stream_outcomes)}, "
            f"{sum(s.received for s in seen.streams)} items",
            f"  max retained (frames, bytes): {seen.max_retained} "
            f"(limits {LIMITS.max_retained_frames}, {LIMITS.max_retained_bytes})",
            f"  RSS: start {rss_start / MiB:.0f} MiB, after warm-up {rss_warm / MiB:.0f} MiB, "
            f"peak {rss_peak / MiB:.0f} MiB",
        ]
    )
    context = report + "\n  last faults:\n    " + "\n    ".join(seen.schedule)
    assert not problems, "invariants broken:\n  " + "\n  ".join(problems[:30]) + "\n" + context
    assert proxy_stats.cuts >= min_cuts, f"only {proxy_stats.cuts} cuts\n{context}"
    assert outcomes["ok"] >= len(seen.calls) // 2, f"too few calls succeeded\n{context}"
    floor = max(1, int(10 * duration / 60))
    assert stream_outcomes["completed"] >= floor, f"too few streams completed\n{context}"
    bookkeeping = BOOKKEEPING * (len(seen.calls) + len(seen.streams))
    ceiling = RSS_CEILING + bookkeeping
    assert rss_peak < ceiling, f"RSS peaked at {rss_peak / MiB:.0f} MiB\n{context}"
    assert rss_peak - rss_warm < RSS_GROWTH + bookkeeping, f"RSS grew after warm-up\n{context}"
    return report
