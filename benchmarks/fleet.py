"""garcon_link at fleet scale: many workers dialing one listening controller process.

``python -m benchmarks --only fleet`` (``--quick``: 50 workers). Reported in a table of its own
("garcon_link fleet"), each figure next to its target.

Processes
---------
The runner starts the **controller** child (``python -m benchmarks.fleet controller``), which
writes a keyring of ``workers`` keys into a temporary directory, enters ``gl.Fleet`` listening on
127.0.0.1 with that keyring (default :class:`~garcon_link.Limits`), and then starts ``processes``
**worker** children itself (``python -m benchmarks.fleet workers``), each running its share of
the workers as ``gl.Worker`` endpoints (default limits) that dial the controller; each serves
``ident.whoami()`` (its own id). Every process raises its ``RLIMIT_NOFILE`` soft limit to the hard
one. The controller prints progress on stderr and one ``RESULT {json}`` line on stdout.

What the controller measures, in order
--------------------------------------
1. **cold start**: from starting the worker children to every executor ``ready`` (the children's
   interpreter start-up included), from the fleet's ``ready`` events;
2. **RSS** (``VmRSS``) idle with all executors ready, after a settle and ``gc.collect()``. The
   runner first runs a controller with ``rss_low`` workers (100) and then the full one; the
   per-executor figure is the slope ``(RSS(1,000) - RSS(100)) / 900``;
3. **idle latency**: ``idle_calls`` sequential ``whoami`` calls, round robin over the executors of
   the first worker child (the one the storm spares);
4. **map**: ``maps`` times ``fleet.map()`` of ``whoami`` over every executor (default
   concurrency, 64); the figure is the median duration, every reply checked;
5. **reconnect storm**: every worker child but the first aborts all of its sockets at once
   (``link.disconnect()``: no close frame, as a network loss); the sessions stay and resume. The
   controller samples its listener's counters every :data:`SAMPLE_S` (the histogram of TCP
   connections arriving = the redials, and of handshakes completed), and meanwhile calls the
   spared executors sequentially as in 3. Figures: time from the cut until every cut executor is
   ``ready`` again (a ``ready`` event after the cut), the p99 of the spared executors' calls
   during that time against their idle p99, and the listener's handshake throughput (its best
   :data:`RATE_WINDOW_S` window, and the average over the storm).

The storm's three children and the controller share this machine's CPUs; in production the
storming executors run elsewhere. ``--storm-nice`` models that: from the cut on, the cut children
run at ``nice 19`` (every thread), so they get only the CPU the controller and the spared child
leave, and the controller's ``max_unauthenticated_sockets`` is raised to the fleet's size: a
starved child connects but answers its upgrade late, and past the default cap the listener would
evict it (redials that executors on machines of their own would not cause). The runner runs the
full controller with it too and reports both figures (see benchmarks/README.md for which one the
target is judged on). Should the storm still take more connections than resumes, the controller
says that the model did not hold.

Garbage collection: every phase records each collection (``gc.callbacks``): per generation the
passes, their pauses (total, longest) and what they collected, with ``gc.get_count()`` and the
objects the GC tracks before and after (the result's ``gc``). After the idle phase the
controller and the first worker child count the GC-tracked objects per idle session (with N
sessions less with none, by type, and the tasks by coroutine; ``gc_tracked_controller``,
``gc_tracked_worker``). ``--gc-freeze`` calls ``gc.freeze()`` in every process once the fleet is
up (after those counts): the runner runs the full controller a second time with it and reports
it beside the default. Diagnosis: ``GL_FLEET_BENCH_GCWHO=1`` groups the controller's tracked
objects per session by what refers to them; ``GL_FLEET_BENCH_GARBAGE=1`` (``per-resume``) saves
each round's cyclic garbage and prints it per resume, by type and by frame;
``GL_FLEET_BENCH_KEPT=1`` (``per-resume``) freezes everything before each round and prints the
GC-tracked objects the round kept, per resume, by type and by what refers to them. Every storm
prints the GC-tracked objects it kept per resume and its GC passes per generation
(``storm_tracked_per_resume``, ``storm_gc_passes``).

Loop turns: ``GL_FLEET_BENCH_TURNS=1`` traces the controller's storm turn by turn (the CPU of
every turn and of every ready handle in it, filed by category: budgeted handshake and teardown
steps, handshake work outside them, accept, socket reads of new and of established sockets,
pumps, heartbeats, the lost sockets' ends, GC) and prints what ran in all turns, in the turns
over 0.5 ms, and in the turns that overlapped the spared calls at or over their p99 (see
``_turn_trace``; the storm runs slower under it). ``--turn-budget-ms`` sets the controller's
``Limits.handshake_seconds_per_turn``.

CPU per resume
--------------
``python -m benchmarks.fleet per-resume --workers 200 --rounds 5`` (not part of the runner): a
listening controller and one worker child of ``--workers`` workers, all of whose sockets are cut
``--rounds`` times. Per round and side, the CPU seconds from the cut until all are ``ready``
again, less the idle rate, divided by the resumes; the median of the rounds is printed.

Instructions instead of CPU time (not disturbed by other load): run it under cachegrind, the
worker child too, once with ``--rounds 1`` and once with ``--rounds 4``; the difference of the
``I refs`` over ``3 * workers`` is the count per resume, each side::

    W="valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/tmp/w.%p"
    GL_FLEET_BENCH_WORKER_WRAP="$W" valgrind --tool=cachegrind --cache-sim=no \
        --cachegrind-out-file=/tmp/c.%p python -m benchmarks.fleet per-resume --workers 50 \
        --rounds 1
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import gc
import itertools
import json
import logging
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

import anyio
import anyio.abc

import garcon_link as gl
from garcon_link.services import builtin_services
from garcon_link.settings.secrets import read_secret_file, write_secret_file

from . import eventloop, harness
from .report import describe_histogram

KiB = 1024
NAMES = ("fleet",)
DESCRIPTIONS = {
    "fleet": "garcon_link fleet: 1,000 workers in child processes dial one controller process",
}

COLD_START_TARGET_S = 10.0
RSS_PER_EXECUTOR_TARGET_KIB = 100.0
MAP_TARGET_S = 1.0
STORM_P99_FACTOR_TARGET = 5.0

SAMPLE_S = 0.01
"""Period of the listener-counter sampler during the storm."""
RATE_WINDOW_S = 0.25
"""Window of the peak handshake rate."""
HISTOGRAM_BUCKETS = 30
"""At most this many buckets (of 0.1 s, 0.2 s, 0.5 s, 1 s, 2 s, 5 s... as the spread needs)."""
SETTLE_S = 2.0
"""Pause before reading the idle RSS (late receipts, heartbeats settle)."""
RESUME_TAIL_S = 0.2
"""``per-resume``: CPU still counted after the last resume (late receipts, replays' ends)."""
PER_RESUME_PAUSE_S = 1.0
"""``per-resume``: pause between rounds; the workers' ``backoff_reset_after`` is half of it."""
TOP_TYPES = 40
"""Types listed in the GC-tracked objects per session."""


class Ident(Protocol):
    async def whoami(self) -> str: ...


class _IdentImpl:
    def __init__(self, executor_id: str) -> None:
        self.executor_id = executor_id

    async def whoami(self) -> str:
        return self.executor_id


@dataclass(frozen=True)
class FleetSettings:
    workers: int = 1000
    processes: int = 4
    rss_low: int = 100
    idle_calls: int = 1000
    maps: int = 10
    limit_s: float = 120.0

    @classmethod
    def from_runner(cls, settings: harness.Settings, quick: bool) -> FleetSettings:
        if quick:
            return cls(workers=50, processes=2, rss_low=10, idle_calls=100, maps=3, limit_s=30.0)
        return cls(limit_s=settings.limit_s)


def executor_id(index: int) -> str:
    return f"fleet-{index:04d}"


def raise_nofile() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def read_rss() -> int:
    """``VmRSS`` of this process in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise harness.MeasurementError("/proc/self/status has no VmRSS")


def histogram(offsets: list[float]) -> list[list[float]]:
    """``[[bucket start s, count], ...]`` from 0 to the last offset, in at most
    :data:`HISTOGRAM_BUCKETS` buckets of a round width."""
    if not offsets:
        return []
    widths = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
    bucket = next((w for w in widths if max(offsets) / w < HISTOGRAM_BUCKETS), 120.0)
    buckets = int(max(offsets) // bucket) + 1
    counts = [0] * buckets
    for offset in offsets:
        counts[max(0, int(offset // bucket))] += 1
    return [[round(i * bucket, 3), count] for i, count in enumerate(counts)]


def _p(values: list[float], q: float) -> float:
    return harness.percentile(sorted(values), q)


def tracked_by_type() -> collections.Counter[str]:
    """Objects the garbage collector tracks now, by type name, after a full collection; and
    (asyncio) the tasks, as ``task <coroutine's qualname>``."""
    gc.collect()
    counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    try:
        import asyncio

        tasks = asyncio.all_tasks()
    except RuntimeError:  # not asyncio
        return counts
    for task in tasks:
        coro: Any = task.get_coro()
        name = "?"
        while coro is not None:  # the outermost coroutine that is not anyio's wrapper
            code = getattr(coro, "cr_code", None)
            if code is not None and "anyio" not in code.co_filename:
                name = code.co_qualname
                break
            coro = getattr(coro, "cr_await", None)
        counts["task " + name] += 1
    return counts


def tracked_per_session(
    base: collections.Counter[str], now: collections.Counter[str], sessions: int
) -> dict[str, Any]:
    """GC-tracked objects per session between ``base`` (no session) and ``now`` (``sessions``),
    in all and for the :data:`TOP_TYPES` types that grew most."""
    grown = now.copy()
    grown.subtract(base)
    per = max(sessions, 1)
    return {
        "sessions": sessions,
        "tracked_before": _objects(base),
        "tracked_after": _objects(now),
        "per_session": (_objects(now) - _objects(base)) / per,
        "types_per_session": {
            name: round(count / per, 2)
            for name, count in itertools.islice(
                ((k, v) for k, v in grown.most_common() if not k.startswith("task ")), TOP_TYPES
            )
        },
        "tasks_per_session": {
            name[5:]: round(count / per, 2)
            for name, count in grown.most_common()
            if name.startswith("task ") and count >= per / 2
        },
    }


def tracked_owners() -> collections.Counter[str]:
    """Diagnosis (``GL_FLEET_BENCH_GCWHO``): GC-tracked objects by type and by what refers to
    them (a bound method by its function, a function by its name, anything else by the types
    of its referrers, looking through dicts and cells to their own referrers)."""
    gc.collect()
    objects = gc.get_objects()
    referrers: dict[int, list[Any]] = {}
    for o in objects:
        for r in gc.get_referents(o):
            referrers.setdefault(id(r), []).append(o)

    def owner(o: Any, depth: int = 0) -> str:
        names = []
        for r in referrers.get(id(o), [])[:3]:
            kind = type(r).__qualname__
            if kind in ("dict", "cell", "list", "tuple") and depth < 2:
                kind = f"{kind}<{owner(r, depth + 1)}"
            elif kind == "function":
                kind = f"function {r.__qualname__}"
            elif kind == "coroutine":
                kind = f"coroutine {r.cr_code.co_qualname}"
            names.append(kind)
        return "|".join(sorted(names)) or "-"

    counts: collections.Counter[str] = collections.Counter()
    for o in objects:
        kind = type(o).__qualname__
        if kind == "method":
            counts[f"method {getattr(o.__func__, '__qualname__', '?')}"] += 1
        elif kind == "function":
            counts[f"function {o.__qualname__}"] += 1
        elif kind == "coroutine":
            counts[f"coroutine {o.cr_code.co_qualname}"] += 1
        else:
            counts[f"{kind} < {owner(o)}"] += 1
    return counts


def _objects(counts: collections.Counter[str]) -> int:
    return sum(v for k, v in counts.items() if not k.startswith("task "))


class GcLog:
    """Every garbage collection (``gc.callbacks``) in the phases run under :meth:`phase`: its
    generation, its pause (wall time, preemption included; and the thread's CPU time, which
    other processes' load does not inflate) and what it collected."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float, float, int]] = []
        self.spans: list[tuple[int, float, float]] = []  # generation, start, end (perf_counter)
        self._started = (0.0, 0.0)
        self.phases: dict[str, dict[str, Any]] = {}

    def _callback(self, event: str, info: dict[str, int]) -> None:
        if event == "start":
            self._started = (time.perf_counter(), time.thread_time())
        else:
            wall, cpu = self._started
            self.spans.append((info["generation"], wall, time.perf_counter()))
            self.passes.append(
                (
                    info["generation"],
                    time.perf_counter() - wall,
                    time.thread_time() - cpu,
                    info["collected"],
                )
            )

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = {"count": list(gc.get_count()), "tracked": len(gc.get_objects())}
        self.passes, self.spans = [], []
        gc.callbacks.append(self._callback)
        try:
            yield
        finally:
            gc.callbacks.remove(self._callback)
            after = {"count": list(gc.get_count()), "tracked": len(gc.get_objects())}
            by_generation: dict[str, Any] = {}
            for generation in (0, 1, 2):
                mine = [(d, u, c) for g, d, u, c in self.passes if g == generation]
                if mine:
                    by_generation[str(generation)] = {
                        "count": len(mine),
                        "total_ms": sum(d for d, _, _ in mine) * 1000,
                        "longest_ms": max(d for d, _, _ in mine) * 1000,
                        "cpu_total_ms": sum(u for _, u, _ in mine) * 1000,
                        "cpu_longest_ms": max(u for _, u, _ in mine) * 1000,
                        "collected": sum(c for _, _, c in mine),
                    }
            self.phases[name] = {"before": before, "after": after, "passes": by_generation}
            _progress(f"{name}: {describe_gc(self.phases[name])}")


def describe_gc(phase: dict[str, Any]) -> str:
    """One line of a :class:`GcLog` phase."""
    passes = phase["passes"]
    parts = [
        f"gen {g}: {p['count']} passes, {p['total_ms']:.1f} ms, longest {p['longest_ms']:.1f} "
        f"ms (CPU {p['cpu_total_ms']:.1f}, longest {p['cpu_longest_ms']:.1f}), "
        f"{p['collected']} collected"
        for g, p in sorted(passes.items())
    ] or ["no collection"]
    before, after = phase["before"], phase["after"]
    return (
        "; ".join(parts) + f" (tracked {before['tracked']:,} -> {after['tracked']:,}, "
        f"counts {before['count']} -> {after['count']})"
    )


# ------------------------------------------------------------------------ worker child


async def _workers_main(
    url: str,
    keyring: Path,
    first: int,
    count: int,
    backoff_reset_after: float | None = None,
    gc_freeze: bool = False,
    builtin: bool = False,
) -> None:
    """Run ``count`` workers; on a ``cut`` line on stdin abort all their sockets; on a ``gc``
    line print ``GC {json}`` (the GC-tracked objects per worker) on stdout, then with
    ``gc_freeze`` call ``gc.freeze()``; exit on EOF.

    ``backoff_reset_after`` (``per-resume``): a shorter :class:`~garcon_link.Limits` field, so
    that every round's first redial is immediate, as the storm's is. ``builtin``: each worker
    serves the built-in process and file services too (rooted in a temporary directory), so
    that its manifest is theirs (``--builtin``: the controller's memory per manifest)."""
    raise_nofile()
    tracked_base = tracked_by_type()
    root = tempfile.mkdtemp(prefix="gl-fleet-bench-root-") if builtin else None
    limits = (
        gl.Limits()
        if backoff_reset_after is None
        else gl.Limits(backoff_reset_after=backoff_reset_after)
    )

    async def run_worker(
        name: str, *, task_status: anyio.abc.TaskStatus[gl.Worker] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        config = gl.LinkConfig(
            executor_id=name,
            role=gl.Role.WORKER,
            secret=read_secret_file(keyring / f"{name}.secret"),
            dial=url,
        )
        ident = {"ident": gl.Service(_IdentImpl(name), Ident)}
        services: Any = ident
        if root is not None:
            factory = builtin_services(["process", "files"], root=root)

            @contextlib.asynccontextmanager
            async def services(scope: Any) -> Any:
                async with factory(scope) as builtins:
                    yield {**builtins, **ident}

        async with gl.Worker(config, services, limits=limits) as worker:
            task_status.started(worker)
            await anyio.sleep_forever()

    # Each worker in a task of its own, as each would be in a process of its own: entered one
    # inside the other (an exit stack), every cancel scope of the last would have the hundreds
    # of the others as ancestors, and anyio walks that chain at every scope's exit.
    async with anyio.create_task_group() as tg:
        workers: list[gl.Worker] = []
        for index in range(first, first + count):
            workers.append(await tg.start(run_worker, executor_id(index)))
        print("started", flush=True)
        lines = anyio.wrap_file(sys.stdin)
        profile_prefix = os.environ.get("GL_FLEET_BENCH_PROFILE")
        profile: Any = None
        while line := await lines.readline():
            if line.split()[:1] == ["cut"]:
                if line.split()[1:] == ["idle"]:
                    _run_when_idle()
                if profile_prefix and profile is None:
                    import cProfile

                    profile = cProfile.Profile()
                    profile.enable()
                for worker in workers:
                    await worker.link.disconnect()
                print("cut", flush=True)
            elif line.strip() == "gc":
                measured = tracked_per_session(tracked_base, tracked_by_type(), count)
                print("GC " + json.dumps(measured), flush=True)
                if gc_freeze:
                    gc.freeze()
            elif line.strip() == "dump" and profile is not None:
                profile.disable()
                _add_stats(profile, f"{profile_prefix}.worker.prof")
                profile = None
        os._exit(0)  # stdin closed: the controller is done (no graceful close to wait for)


def _threads(pid: int | str = "self") -> list[int]:
    """The thread ids of process ``pid``."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _run_when_idle() -> None:
    """``--storm-nice``, in a cut child: every thread of this process to ``nice 19``, so that it
    runs on what CPU the controller and the spared child leave (as if on other machines)."""
    for tid in _threads():
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


# -------------------------------------------------------------------- controller child


class _Tracker:
    """Follows the fleet's events: which executors are ready, and when each became so."""

    def __init__(self) -> None:
        self.ready: set[str] = set()
        self.ready_at: dict[str, float] = {}
        self.lost = 0
        self.changed = anyio.Event()

    async def follow(self, fleet: gl.Fleet) -> None:
        async for event in fleet.events():
            if event.kind == "lost":
                self.lost += event.lost
            elif event.kind == "ready":
                self.ready.add(event.executor_id)
                self.ready_at[event.executor_id] = time.perf_counter()
            elif event.kind in ("reconnecting", "offline", "disposed", "forgotten"):
                self.ready.discard(event.executor_id)
            self.changed.set()

    async def until(self, check: Callable[[], bool], seconds: float, what: str) -> None:
        with anyio.move_on_after(seconds):
            while not check():
                self.changed = anyio.Event()
                await self.changed.wait()
            return
        raise harness.MeasurementError(f"{what}: not within {seconds:g} s")


async def _sequential_calls(
    fleet: gl.Fleet,
    ids: list[str],
    stop: Callable[[int], bool],
    starts: list[float] | None = None,
) -> tuple[list[float], int]:
    """Call ``whoami`` round robin over ``ids`` until ``stop(n)``; latencies in ms, errors
    (and each answered call's start, ``perf_counter``, appended to ``starts``)."""
    facades = [fleet.executor(i).service("ident", Ident) for i in ids]
    latencies: list[float] = []
    errors = 0
    n = 0
    while not stop(n):
        facade, expected = facades[n % len(ids)], ids[n % len(ids)]
        started = time.perf_counter()
        try:
            reply = await facade.whoami()
        except gl.CallError:
            errors += 1
        else:
            latencies.append((time.perf_counter() - started) * 1000)
            if starts is not None:
                starts.append(started)
            if reply != expected:
                raise harness.MeasurementError(f"{expected} answered {reply!r}")
        n += 1
    return latencies, errors


def _progress(message: str) -> None:
    print(f"[fleet] {message}", file=sys.stderr, flush=True)


async def _controller_main(args: argparse.Namespace) -> dict[str, Any]:
    nofile = raise_nofile()
    n, processes = args.workers, args.processes
    ids = [executor_id(i) for i in range(n)]
    shares = [len(part) for part in _split(n, processes)]
    with tempfile.TemporaryDirectory(prefix="gl-fleet-bench-") as tmp:
        keyring = Path(tmp) / "keys"
        keyring.mkdir(mode=0o700)
        for name in ids:
            write_secret_file(keyring / f"{name}.secret")
        # --storm-nice: the niced children answer their upgrade late when starved, and past
        # max_unauthenticated_sockets the listener would evict them (redials that executors on
        # machines of their own would not cause): the model lets all of them wait.
        limits = gl.Limits()
        if args.turn_budget_ms is not None:
            seconds = args.turn_budget_ms / 1000
            limits = dataclasses.replace(limits, handshake_seconds_per_turn=seconds)
        if args.busy_share is not None:
            limits = dataclasses.replace(limits, handshake_busy_share=args.busy_share)
        if args.storm_nice:
            cap = max(n, limits.max_unauthenticated_sockets)
            limits = dataclasses.replace(limits, max_unauthenticated_sockets=cap)
        config = gl.FleetConfig(
            listen=("127.0.0.1", 0), keyring=keyring, max_executors=n, limits=limits
        )
        tracker = _Tracker()
        result: dict[str, Any] = {
            "workers": n,
            "processes": processes,
            "nofile_soft": nofile,
            "storm_nice": args.storm_nice,
        }
        async with (
            gl.Fleet(config, events_buffer=8 * n + 64) as fleet,
            anyio.create_task_group() as tg,
            AsyncExitStack() as children,
        ):
            tg.start_soon(tracker.follow, fleet)
            for _ in range(3):  # the follower subscribes before any worker starts
                await anyio.sleep(0)
            gc.collect()
            result["rss_listening_bytes"] = read_rss()
            tracked_base = tracked_by_type()
            if os.environ.get("GL_FLEET_BENCH_GCWHO"):
                owners_base = tracked_owners()
            gc_log = GcLog()

            # 1. cold start
            started = time.perf_counter()
            procs: list[anyio.abc.Process] = []
            first = 0
            for share in shares:
                command = [
                    sys.executable,
                    "-m",
                    "benchmarks.fleet",
                    "workers",
                    "--url",
                    fleet.url,
                    "--keyring",
                    str(keyring),
                    "--first",
                    str(first),
                    "--count",
                    str(share),
                    "--loop",
                    args.loop,
                    *(["--gc-freeze"] if args.gc_freeze else []),
                    *(["--builtin"] if args.builtin else []),
                ]
                first += share
                proc = await anyio.open_process(command, stderr=None)
                children.push_async_callback(_stop, proc)
                procs.append(proc)
            with gc_log.phase("cold start"):
                await tracker.until(lambda: len(tracker.ready) == n, args.limit, "cold start")
            cold = time.perf_counter() - started
            stats = fleet.statistics()
            result.update(
                cold_start_s=cold,
                cold_connections=stats.connections,
                cold_handshakes=stats.handshakes_completed,
                cold_evicted_unauthenticated=stats.evicted_unauthenticated,
            )
            _progress(
                f"{n} workers in {processes} processes: all ready in {cold:.2f} s "
                f"({stats.connections} connections, {stats.handshakes_completed} handshakes)"
            )

            # 2. idle RSS (and the controller's CPU time while idle: heartbeats, timers)
            cpu = time.process_time()
            with _profiled("idle"), gc_log.phase("idle"):
                await anyio.sleep(SETTLE_S)
            result["idle_cpu_percent"] = (time.process_time() - cpu) / SETTLE_S * 100
            gc.collect()
            result["rss_idle_bytes"] = read_rss()
            _progress(
                f"idle RSS {result['rss_idle_bytes'] / 2**20:.1f} MiB, idle CPU "
                f"{result['idle_cpu_percent']:.0f} %"
            )
            if os.environ.get("GL_FLEET_BENCH_GCWHO"):
                grown = tracked_owners()
                grown.subtract(owners_base)
                for name, count in grown.most_common(120):
                    _progress(f"  {count / n:6.2f} {name[:200]}")
            # GC-tracked objects per idle session, here and in the first worker child
            result["gc_tracked_controller"] = tracked_per_session(
                tracked_base, tracked_by_type(), n
            )
            result["gc_tracked_worker"] = await _child_gc(procs[0], args.limit)
            for side in ("controller", "worker"):
                measured = result[f"gc_tracked_{side}"]
                _progress(
                    f"GC-tracked objects per idle session, {side}: "
                    f"{measured['per_session']:.1f} ({measured['sessions']} sessions); "
                    + ", ".join(f"{k} {v}" for k, v in measured["types_per_session"].items())
                    + "; tasks: "
                    + ", ".join(f"{k} {v}" for k, v in measured["tasks_per_session"].items())
                )
            if args.gc_freeze:
                gc.freeze()
                result["gc_frozen"] = gc.get_freeze_count()
                _progress(f"gc.freeze(): {result['gc_frozen']:,} objects frozen")
            result["gc"] = gc_log.phases
            if args.rss_only:
                tg.cancel_scope.cancel()
                return result

            # 3. idle latency over the first child's executors (spared by the storm)
            spared = ids[: shares[0]]
            cut = set(ids[shares[0] :])
            with gc_log.phase("idle calls"):
                idle, idle_errors = await _sequential_calls(
                    fleet, spared, lambda i: i >= args.idle_calls
                )
            result.update(
                idle_p50_ms=_p(idle, 50), idle_p99_ms=_p(idle, 99), idle_errors=idle_errors
            )
            _progress(f"idle call p50 {_p(idle, 50):.2f} ms, p99 {_p(idle, 99):.2f} ms")

            # 4. map to every executor
            async def whoami(executor: gl.RemoteExecutor) -> str:
                return await executor.service("ident", Ident).whoami()

            maps: list[float] = []
            for _ in range(args.maps):
                t = time.perf_counter()
                with _profiled("map"), gc_log.phase(f"map {len(maps) + 1}"):
                    replies = await fleet.map(whoami, ids)
                maps.append(time.perf_counter() - t)
                wrong = [i for i, reply in replies.items() if reply != i]
                if wrong:
                    raise harness.MeasurementError(f"map: {len(wrong)} wrong replies: {wrong[:3]}")
            result.update(map_s=maps, map_p50_s=statistics.median(maps))
            _progress(f"map to {n}: p50 {statistics.median(maps) * 1000:.0f} ms")

            # 5. reconnect storm
            before = fleet.statistics()
            samples: list[tuple[float, int, int]] = []
            sampling = anyio.Event()

            async def sample() -> None:
                while not sampling.is_set():
                    s = fleet.statistics()
                    samples.append((time.perf_counter(), s.connections, s.handshakes_completed))
                    await anyio.sleep(SAMPLE_S)

            def all_back() -> bool:
                return all(tracker.ready_at.get(i, 0.0) > storm_start for i in cut) and len(
                    tracker.ready
                ) == len(ids)

            storm_calls: list[float] = []
            storm_starts: list[float] = []
            storm_errors = 0
            done = anyio.Event()

            async def call_spared() -> None:
                nonlocal storm_errors
                latencies, storm_errors = await _sequential_calls(
                    fleet, spared, lambda _: done.is_set(), storm_starts
                )
                storm_calls.extend(latencies)

            with (
                _profiled("storm"),
                _loop_lag("storm"),
                _turn_trace("storm", (storm_starts, storm_calls)),
                gc_log.phase("storm"),
            ):
                async with anyio.create_task_group() as storm:
                    storm.start_soon(sample)
                    cpu_before = _cpu_seconds(procs)
                    storm_start = time.perf_counter()
                    samples.append((storm_start, before.connections, before.handshakes_completed))
                    for proc in procs[1:]:
                        assert proc.stdin is not None
                        await proc.stdin.send(b"cut idle\n" if args.storm_nice else b"cut\n")
                    storm.start_soon(call_spared)
                    await tracker.until(all_back, args.limit, "every cut executor ready again")
                    storm_end = time.perf_counter()
                    cpu_after = _cpu_seconds(procs)
                    done.set()
                    sampling.set()
            after = fleet.statistics()
            samples.append((time.perf_counter(), after.connections, after.handshakes_completed))
            recovered = storm_end - storm_start
            offsets = sorted(tracker.ready_at[i] - storm_start for i in cut)
            arrivals: list[float] = []
            for (t0, c0, _), (_, c1, _) in itertools.pairwise(samples):
                arrivals.extend([t0 - storm_start] * (c1 - c0))
            handshakes = after.handshakes_completed - before.handshakes_completed
            # The best window; a storm shorter than one window is one window.
            (start_t, _, start_h), (end_t, _, end_h) = samples[0], samples[-1]
            peak = (end_h - start_h) / max(end_t - start_t, 1e-6)
            for i, (t0, _, h0) in enumerate(samples):
                for t1, _, h1 in samples[i + 1 :]:
                    if t1 - t0 >= RATE_WINDOW_S:
                        peak = max(peak, (h1 - h0) / (t1 - t0))
                        break
            first_arrival = min(arrivals, default=0.0)
            # Which of the spared calls an older-generation GC pass (1 or 2) of this process
            # fell in (wall time); young passes are too many and short to single out.
            spans = [(a, b) for g, a, b in gc_log.spans if g >= 1]
            in_gc = [
                any(a < t + ms / 1000 and b > t for a, b in spans)
                for t, ms in zip(storm_starts, storm_calls, strict=True)
            ]
            tail = _p(storm_calls, 99) if storm_calls else 0.0
            without = [ms for ms, hit in zip(storm_calls, in_gc, strict=True) if not hit]
            result.update(
                storm_calls_in_gc=sum(in_gc),
                storm_tail_calls=sum(1 for ms in storm_calls if ms >= tail),
                storm_tail_calls_in_gc=sum(
                    1 for ms, hit in zip(storm_calls, in_gc, strict=True) if hit and ms >= tail
                ),
                storm_p99_without_gc_ms=_p(without, 99) if without else None,
            )
            slow = 3 * result["idle_p99_ms"]
            slow_offsets = [
                t - storm_start
                for t, ms in zip(storm_starts, storm_calls, strict=True)
                if ms > slow
            ]
            result.update(
                storm_cut=len(cut),
                storm_recovered_s=recovered,
                storm_connections=after.connections - before.connections,
                storm_handshakes=handshakes,
                storm_resumed=after.resumed - before.resumed,
                storm_fresh_sessions=after.fresh_sessions - before.fresh_sessions,
                storm_evicted_unauthenticated=(
                    after.evicted_unauthenticated - before.evicted_unauthenticated
                ),
                storm_accepts_paused=after.accepts_paused - before.accepts_paused,
                storm_handshakes_failed={
                    k: v - before.handshakes_failed.get(k, 0)
                    for k, v in after.handshakes_failed.items()
                    if v > before.handshakes_failed.get(k, 0)
                },
                storm_handshakes_abandoned=after.handshakes_abandoned - before.handshakes_abandoned,
                storm_calls=len(storm_calls),
                storm_call_errors=storm_errors,
                storm_p50_ms=_p(storm_calls, 50) if storm_calls else None,
                storm_p99_ms=_p(storm_calls, 99) if storm_calls else None,
                storm_p999_ms=_p(storm_calls, 99.9) if storm_calls else None,
                storm_max_ms=max(storm_calls) if storm_calls else None,
                storm_ready_p50_s=_p(offsets, 50),
                storm_ready_p99_s=_p(offsets, 99),
                redial_histogram=histogram(arrivals),
                ready_histogram=histogram(offsets),
                slow_call_histogram=histogram(slow_offsets),
                handshakes_per_s_peak=peak,
                handshakes_per_s_mean=handshakes / max(recovered - first_arrival, 1e-6),
                events_lost=tracker.lost,
                storm_cpu_s={
                    "controller": cpu_after[0] - cpu_before[0],
                    "spared child": cpu_after[1] - cpu_before[1],
                    "cut children": sum(cpu_after[2:]) - sum(cpu_before[2:]),
                },
            )
            gc_storm = gc_log.phases["storm"]
            result["storm_tracked_per_resume"] = (
                gc_storm["after"]["tracked"] - gc_storm["before"]["tracked"]
            ) / max(result["storm_resumed"], 1)
            result["storm_gc_passes"] = [
                gc_storm["passes"].get(str(g), {}).get("count", 0) for g in (0, 1, 2)
            ]
            _progress(
                f"storm: GC-tracked objects kept per resume "
                f"{result['storm_tracked_per_resume']:.1f}"
                f", GC passes per generation {result['storm_gc_passes']}"
            )
            _progress(
                f"storm: {len(cut)} cut, all ready again in {recovered:.2f} s "
                f"({result['storm_connections']} connections, {handshakes} handshakes, "
                f"{result['storm_resumed']} resumed); spared p99 "
                f"{result['storm_p99_ms']} ms over {len(storm_calls)} calls; handshakes/s "
                f"peak {peak:.0f}; CPU s during it: "
                + ", ".join(f"{k} {v:.2f}" for k, v in result["storm_cpu_s"].items())
            )
            _progress(
                "storm: redials "
                + describe_histogram(result["redial_histogram"])
                + "; ready again "
                + describe_histogram(result["ready_histogram"])
                + f"; spared calls slower than {slow:.1f} ms (3x idle p99), by start "
                + describe_histogram(result["slow_call_histogram"])
            )
            _progress(
                f"storm: {result['storm_calls_in_gc']} of {len(storm_calls)} spared calls had a "
                "generation-1 or -2 GC pass of the controller inside them; of the "
                f"{result['storm_tail_calls']} at or above the p99, "
                f"{result['storm_tail_calls_in_gc']}; the p99 of the others "
                f"{result['storm_p99_without_gc_ms'] or 0:.2f} ms"
            )
            if args.storm_nice and result["storm_connections"] > 1.1 * len(cut):
                # Starved (other load on the machine): redials and evictions, not this model.
                _progress(
                    f"--storm-nice: {result['storm_connections']} connections for {len(cut)} "
                    "resumes: the niced children were starved, the figure does not model the "
                    "storm (an idle machine is needed)"
                )
            for proc in procs:
                proc.kill()
            tg.cancel_scope.cancel()
    return result


async def _child_gc(proc: anyio.abc.Process, limit: float) -> dict[str, Any]:
    """Ask a worker child for its GC-tracked objects per worker (its ``GC`` line)."""
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdin.send(b"gc\n")
    buffer = b""
    with anyio.fail_after(limit):
        while True:
            buffer += await proc.stdout.receive()
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"GC "):
                    measured: dict[str, Any] = json.loads(line[3:])
                    return measured


async def _per_resume_main(args: argparse.Namespace) -> dict[str, Any]:
    """CPU time per resume, each side: ``args.workers`` workers in one child, all cut at once
    ``args.rounds`` times. Per round, the CPU seconds (user + system, ``/proc``) of the
    controller and of the worker child from the cut until every executor is ``ready`` again
    plus :data:`RESUME_TAIL_S` (late receipts), less their idle rate over that time, divided by
    the resumes. With ``GL_FLEET_BENCH_PROFILE=P``: cProfile of the rounds, ``P.resume.prof``
    (controller) and ``P.worker.prof``."""
    raise_nofile()
    n = args.workers
    ids = [executor_id(i) for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="gl-fleet-bench-") as tmp:
        keyring = Path(tmp) / "keys"
        keyring.mkdir(mode=0o700)
        for name in ids:
            write_secret_file(keyring / f"{name}.secret")
        config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=keyring, max_executors=n)
        tracker = _Tracker()
        async with (
            gl.Fleet(config, events_buffer=8 * n + 64) as fleet,
            anyio.create_task_group() as tg,
            AsyncExitStack() as children,
        ):
            tg.start_soon(tracker.follow, fleet)
            for _ in range(3):
                await anyio.sleep(0)
            wrap = shlex.split(os.environ.get("GL_FLEET_BENCH_WORKER_WRAP", ""))
            command = [
                *wrap,
                *(sys.executable, "-m", "benchmarks.fleet", "workers", "--url", fleet.url),
                *("--keyring", str(keyring), "--first", "0", "--count", str(n)),
                *("--loop", args.loop, "--backoff-reset-after", str(PER_RESUME_PAUSE_S / 2)),
            ]
            proc = await anyio.open_process(command, stderr=None)
            children.push_async_callback(_stop, proc)
            assert proc.stdin is not None
            await tracker.until(lambda: len(tracker.ready) == n, args.limit, "cold start")
            await anyio.sleep(SETTLE_S)
            idle_before = _cpu_seconds([proc])
            t0 = time.perf_counter()
            await anyio.sleep(SETTLE_S)
            idle_after = _cpu_seconds([proc])
            idle_s = time.perf_counter() - t0
            idle_rate = [(b - a) / idle_s for a, b in zip(idle_before, idle_after, strict=True)]
            rounds: list[dict[str, float]] = []
            for _ in range(args.rounds):
                if os.environ.get("GL_FLEET_BENCH_GARBAGE"):
                    gc.collect()
                    gc.set_debug(gc.DEBUG_SAVEALL)
                kept = os.environ.get("GL_FLEET_BENCH_KEPT")
                if kept:
                    gc.collect()
                    gc.freeze()
                before = fleet.statistics()
                with _profiled("resume"):
                    cpu_before = _cpu_seconds([proc])
                    start = time.perf_counter()
                    await proc.stdin.send(b"cut\n")

                    def all_back(start: float = start) -> bool:
                        return len(tracker.ready) == n and all(
                            tracker.ready_at.get(i, 0.0) > start for i in ids
                        )

                    await tracker.until(all_back, args.limit, "every executor ready again")
                    recovered = time.perf_counter() - start
                    await anyio.sleep(RESUME_TAIL_S)
                    cpu_after = _cpu_seconds([proc])
                    window = time.perf_counter() - start
                await proc.stdin.send(b"dump\n")
                if kept:
                    _report_kept(n)
                if os.environ.get("GL_FLEET_BENCH_GARBAGE"):
                    _report_garbage(n)
                after = fleet.statistics()
                resumed = after.resumed - before.resumed
                if resumed != n:
                    raise harness.MeasurementError(f"{resumed} resumed of {n} cut")
                spent = [
                    b - a - rate * window
                    for a, b, rate in zip(cpu_before, cpu_after, idle_rate, strict=True)
                ]
                rounds.append(
                    {
                        "recovered_s": recovered,
                        "connections": after.connections - before.connections,
                        "controller_ms_per_resume": spent[0] / n * 1000,
                        "worker_ms_per_resume": spent[1] / n * 1000,
                    }
                )
                _progress(
                    f"round {len(rounds)}: {n} resumed in {recovered:.2f} s "
                    f"({rounds[-1]['connections']} connections); CPU per resume: controller "
                    f"{rounds[-1]['controller_ms_per_resume']:.2f} ms, worker "
                    f"{rounds[-1]['worker_ms_per_resume']:.2f} ms"
                )
                await anyio.sleep(PER_RESUME_PAUSE_S)
            await proc.stdin.aclose()  # the child exits on its own (a wrapper writes its counts)
            with anyio.move_on_after(args.limit):
                await proc.wait()
            tg.cancel_scope.cancel()
    result: dict[str, Any] = {
        "workers": n,
        "rounds": rounds,
        "idle_cpu_percent": {"controller": idle_rate[0] * 100, "worker": idle_rate[1] * 100},
    }
    for key in ("controller_ms_per_resume", "worker_ms_per_resume", "recovered_s"):
        result[key] = statistics.median(r[key] for r in rounds)
    _progress(
        f"CPU per resume, median of {len(rounds)} rounds of {n}: controller "
        f"{result['controller_ms_per_resume']:.2f} ms, worker "
        f"{result['worker_ms_per_resume']:.2f} ms (idle CPU: controller "
        f"{idle_rate[0] * 100:.1f} %, worker {idle_rate[1] * 100:.1f} %)"
    )
    return result


def _report_kept(resumes: int) -> None:
    """With ``GL_FLEET_BENCH_KEPT`` set (``per-resume``; diagnosis): the GC-tracked objects the
    round kept (everything before it frozen, the round's garbage collected), per resume, by
    type and what refers to them (:func:`tracked_owners`), on stderr."""
    counts = tracked_owners()
    total = sum(counts.values())
    _progress(f"kept per resume: {total / resumes:.1f} GC-tracked objects")
    for name, count in counts.most_common(150):
        if count >= resumes / 2:
            _progress(f"  {count / resumes:6.2f}  {name[:200]}")
    gc.unfreeze()


def _report_garbage(resumes: int) -> None:
    """With ``GL_FLEET_BENCH_GARBAGE`` set (``per-resume``; diagnosis): the cyclic garbage of
    the round (``gc.DEBUG_SAVEALL``), by type, per resume, on stderr."""
    gc.collect()
    gc.set_debug(0)
    counts = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    frames = collections.Counter(
        f"{o.f_code.co_qualname}" for o in gc.garbage if type(o).__name__ == "frame"
    )
    gc.garbage.clear()
    _progress(
        f"cyclic garbage per resume: {sum(counts.values()) / resumes:.1f}; "
        + ", ".join(f"{k} {v / resumes:.2f}" for k, v in counts.most_common(30))
        + "; frames: "
        + ", ".join(f"{k} {v / resumes:.2f}" for k, v in frames.most_common(30))
    )


@contextlib.contextmanager
def _profiled(phase: str) -> Iterator[None]:
    """cProfile this phase into ``$GL_FLEET_BENCH_PROFILE.<phase>.prof`` (diagnosis only)."""
    prefix = os.environ.get("GL_FLEET_BENCH_PROFILE")
    if not prefix:
        yield
        return
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        _add_stats(profile, f"{prefix}.{phase}.prof")


def _add_stats(profile: Any, path: str) -> None:
    """Write ``profile`` to ``path``, added to what is there (several repetitions)."""
    if os.path.exists(path):
        profile.dump_stats(path + ".new")
        import pstats

        stats = pstats.Stats(path)
        stats.add(path + ".new")
        stats.dump_stats(path)
        os.unlink(path + ".new")
    else:
        profile.dump_stats(path)


@contextlib.contextmanager
def _loop_lag(phase: str) -> Iterator[None]:
    """With ``GL_FLEET_BENCH_LOOPLAG`` set (asyncio only; diagnosis): time every loop turn and
    every callback of this phase, and print on stderr how long the turns were and which tasks'
    steps took the most time."""
    if not os.environ.get("GL_FLEET_BENCH_LOOPLAG"):
        yield
        return
    import asyncio
    import asyncio.base_events
    import asyncio.events

    turns: list[tuple[float, int]] = []
    by_name: dict[str, list[float]] = {}
    base = asyncio.base_events.BaseEventLoop
    run_once, handle_run = base._run_once, asyncio.events.Handle._run  # type: ignore[attr-defined]
    perf = time.perf_counter

    waits: list[float] = []  # time in the selector, per turn
    this_turn: list[tuple[str, float]] = []
    long_turns: list[str] = []
    start = perf()
    cpu = time.thread_time
    off_cpu: list[float] = []  # time outside the selector and off the CPU, per turn

    def timed_run_once(loop: Any) -> None:
        selector = loop._selector
        if not hasattr(selector, "_gl_timed"):
            select = selector.select

            def timed_select(timeout: float | None = None) -> Any:
                t = perf()
                try:
                    return select(timeout)
                finally:
                    waits.append(perf() - t)

            selector.select = timed_select
            selector._gl_timed = True
        t, c = perf(), cpu()
        n = len(loop._ready)
        before = len(waits)
        run_once(loop)
        waited = waits[-1] if len(waits) > before else 0.0
        wall = perf() - t - waited
        turns.append((wall, n))
        off_cpu.append(max(0.0, wall - (cpu() - c)))
        if wall > 0.01:
            ranked = sorted(this_turn, key=lambda nd: -nd[1])[:3]
            long_turns.append(
                f"  at {t - start:.3f} s: {wall * 1000:.1f} ms ({off_cpu[-1] * 1000:.1f} off the "
                f"CPU), {len(this_turn)} steps; "
                + "; ".join(f"{d * 1000:.1f} ms {name}" for name, d in ranked)
            )
        this_turn.clear()

    def name_of(handle: Any) -> str:
        cb = handle._callback
        owner = getattr(cb, "__self__", None)
        if isinstance(owner, asyncio.Task):
            coro: Any = owner.get_coro()
            frames: list[str] = []
            while coro is not None and len(frames) < 8:
                code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
                if code is not None:
                    frames.append(code.co_qualname)
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
            tail = " .. " + frames[-1] if len(frames) > 2 else ""
            return "task " + " > ".join(frames[:2]) + tail
        return getattr(cb, "__qualname__", repr(cb))[:80]

    def timed_handle_run(handle: Any) -> None:
        name = name_of(handle)
        t = perf()
        handle_run(handle)
        by_name.setdefault(name, []).append(perf() - t)
        this_turn.append((name, by_name[name][-1]))

    collections: list[tuple[int, float]] = []
    gc_started = [0.0]

    def gc_timer(event: str, info: dict[str, int]) -> None:
        if event == "start":
            gc_started[0] = perf()
        else:
            collections.append((info["generation"], perf() - gc_started[0]))

    gc.callbacks.append(gc_timer)
    base._run_once = timed_run_once  # type: ignore[attr-defined]
    asyncio.events.Handle._run = timed_handle_run  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        base._run_once = run_once  # type: ignore[attr-defined]
        gc.callbacks.remove(gc_timer)
        for generation in (0, 1, 2):
            times = [d for g, d in collections if g == generation]
            if times:
                _progress(
                    f"{phase}: gc generation {generation}: {len(times)} collections, "
                    f"{sum(times) * 1000:.1f} ms, longest {max(times) * 1000:.1f} ms"
                )
        asyncio.events.Handle._run = handle_run  # type: ignore[method-assign]
        lengths = sorted(d for d, _ in turns)
        total = sum(lengths)
        _progress(
            f"{phase}: {sum(waits):.2f} s waiting in the selector, {sum(off_cpu):.2f} s of the "
            f"turns' work off the CPU (preempted); off-CPU per turn p99 "
            f"{_p(off_cpu, 99) * 1000:.2f} ms, max {max(off_cpu) * 1000:.2f} ms"
        )
        on_cpu = [wall - off for (wall, _), off in zip(turns, off_cpu, strict=True)]
        _progress(
            f"{phase}: on-CPU work per turn p50 {_p(on_cpu, 50) * 1000:.2f} ms, p99 "
            f"{_p(on_cpu, 99) * 1000:.2f} ms, p99.9 {_p(on_cpu, 99.9) * 1000:.2f} ms, max "
            f"{max(on_cpu) * 1000:.2f} ms; turns over 5 ms on the CPU: "
            f"{sum(1 for w in on_cpu if w > 0.005)}"
        )
        _progress(
            f"{phase}: {len(turns)} loop turns, {total:.2f} s working in them; turn p50 "
            f"{_p(lengths, 50) * 1000:.2f} ms, p99 {_p(lengths, 99) * 1000:.2f} ms, max "
            f"{lengths[-1] * 1000:.2f} ms; ready handles per turn p50 "
            f"{_p([float(n) for _, n in turns], 50):.0f}, max {max(n for _, n in turns)}"
        )
        for line in long_turns[:60]:
            _progress(line)
        ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
        for name, durations in ranked[:25]:
            _progress(
                f"  {sum(durations) * 1000:8.1f} ms {len(durations):6d} steps, max "
                f"{max(durations) * 1000:6.2f} ms: {name}"
            )


_TURN_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (category, substrings of a ready handle's name: the callback's qualified name, or for a
    # task step the chain of coroutines it resumes, outermost first), first match wins
    ("spared calls (the benchmark's caller)", ("call_spared", "Caller._complete")),
    ("benchmark bookkeeping", ("_Tracker.follow", "_controller_main", ".sample")),
    ("budget lines' own callback", ("TurnBudget._next_turn", "TurnBudget._measure")),
    ("teardown step (budgeted)", ("receive_message > TurnBudget.step",)),
    ("handshake step (budgeted)", ("TurnBudget.step",)),
    ("accept", ("_accept_loop", "_add_reader", "wait_readable.<locals>.cb")),
    ("lost socket: connection_lost", ("_call_connection_lost",)),
    ("heartbeat", ("Heartbeat.run", "_Beating")),
    ("session writer", ("Outbound.writer",)),
    ("receipt timers", ("_receipt_timer_fired",)),
    ("session reader", ("Inbound.reader", "_read_messages", "Inbound.take_nowait")),
    ("attachment's end (after the teardown step)", ("_handle > Attachments.run",)),
    ("handshake, unbudgeted", ("_accept >", "_authenticate", "_upgrade", "start of _handle")),
    ("attachment's end (task group exit)", ("TaskGroup.__aexit__",)),
    ("task bookkeeping (task_done, cancel delivery)", ("task_done", "_deliver_cancellation")),
)
_AGED = ("heartbeat", "session writer", "session reader")
"""Categories split by task age: a task of the phase's start (old) or a new one."""
_DETAILED = ("handshake, unbudgeted", "attachment's end", "other")
"""Categories split further by where the task was suspended (its innermost coroutine)."""


@contextlib.contextmanager
def _turn_trace(phase: str, calls: tuple[list[float], list[float]]) -> Iterator[None]:
    """With ``GL_FLEET_BENCH_TURNS`` set (asyncio only; diagnosis): trace every loop turn of this
    phase with :class:`benchmarks.turns.TurnTracer`, each ready handle's CPU filed under a
    category (the handshake line's budgeted steps, what of a handshake runs outside them,
    accept, socket reads of new and of established sockets, the sessions' pumps, heartbeats, the
    lost sockets' ends, GC...: ``_TURN_CATEGORIES``), and print on stderr: the turns' lengths on
    the CPU and their GC passes; what ran in all turns, in the turns longer than 0.5 ms, and in
    the turns that overlapped the spared calls at or over their p99 (``calls``: their starts,
    ``perf_counter``, and latencies in ms, filled by the time the phase ends), by category. A new
    socket is one the loop did not watch when the phase began, a new task one that did not exist
    then (a resumed session's pumps are new, a spared one's old). The tracer keeps its turns in
    flat arrays (no GC passes of its own); its CPU cost per handle is about that of a small
    handle (the storm runs slower under it).
    """
    if not os.environ.get("GL_FLEET_BENCH_TURNS"):
        yield
        return
    import asyncio

    from .turns import TurnTracer

    selector: Any = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    old_transports = {
        id(getattr(key.data[0]._callback, "__self__", None))
        for key in selector.get_map().values()
        if key.data[0] is not None
    }
    old_tasks = {id(t) for t in asyncio.all_tasks()}

    def category(handle: Any) -> str:
        cb = handle._callback
        owner = getattr(cb, "__self__", None)
        if isinstance(owner, asyncio.Task):
            coro: Any = owner.get_coro()
            name, inner, depth = "", "", 0
            while coro is not None and depth < 16:
                code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
                if code is not None:
                    inner = code.co_qualname
                    name = name + " > " + inner if name else inner
                awaited = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                if awaited is None and inner == "TaskHandle._run_coro" and depth == 0:
                    started = getattr(coro.cr_frame.f_locals.get("self"), "_coro", None)
                    inner = "start of " + getattr(started, "__qualname__", "?")
                    name = inner
                coro, depth = awaited, depth + 1
            age = " [old task]" if id(owner) in old_tasks else " [new task]"
        else:
            name = inner = getattr(cb, "__qualname__", repr(cb))
            age = ""
            if name.endswith("_read_ready"):
                old = id(owner) in old_transports
                return "socket read, " + ("established socket" if old else "new socket")
        for label, needles in _TURN_CATEGORIES:
            if any(n in name for n in needles):
                if label.startswith(_AGED):
                    return label + age
                return label + (": " + inner[:70] if label.startswith(_DETAILED) else "")
        return "other: " + inner[:70]

    tracer = TurnTracer(category)
    tracer.install()
    try:
        yield
    finally:
        tracer.uninstall()
        _report_turns(phase, tracer.turns(), calls)


def _report_turns(phase: str, traced: list[Any], calls: tuple[list[float], list[float]]) -> None:
    if not traced:
        return
    # (start, end, CPU seconds, {category: CPU seconds}) per turn
    turns = [
        (
            t.start_ns / 1e9,
            t.end_ns / 1e9,
            t.cpu_ns / 1e9,
            {name: ns / 1e9 for name, ns in t.cpu_by_category.items()},
        )
        for t in traced
    ]
    on_cpu = [c for _, _, c, _ in turns]
    long = [turn for turn in turns if turn[2] > 0.0005]
    passes = [sum(t.gc_passes[g] for t in traced) for g in (0, 1, 2)]
    long_passes = [sum(t.gc_passes[g] for t in traced if t.cpu_ns > 500_000) for g in (0, 1, 2)]
    _progress(
        f"{phase} turns: {len(turns)}, on the CPU p50 {_p(on_cpu, 50) * 1000:.2f} ms, p90 "
        f"{_p(on_cpu, 90) * 1000:.2f}, p99 {_p(on_cpu, 99) * 1000:.2f}, max "
        f"{max(on_cpu) * 1000:.2f} ms; {len(long)} turns over 0.5 ms hold "
        f"{sum(c for _, _, c, _ in long):.3f} of {sum(on_cpu):.3f} CPU-s; GC passes per "
        f"generation {passes[0]}/{passes[1]}/{passes[2]} ({long_passes[0]}/{long_passes[1]}/"
        f"{long_passes[2]} in the turns over 0.5 ms)"
    )

    def table(title: str, chosen: list[tuple[float, float, float, dict[str, float]]]) -> None:
        totals: dict[str, float] = {}
        present: dict[str, int] = {}
        for _, _, _, cats in chosen:
            for label, s in cats.items():
                totals[label] = totals.get(label, 0.0) + s
                present[label] = present.get(label, 0) + 1
        whole = sum(totals.values()) or 1.0
        _progress(f"{phase} {title} ({len(chosen)} turns), CPU by category:")
        for label, s in sorted(totals.items(), key=lambda kv: -kv[1])[:24]:
            _progress(
                f"  {s * 1000:8.1f} ms {s / whole * 100:5.1f} %  in {present[label]:5d} turns, "
                f"{s / present[label] * 1e6:6.0f} us per turn: {label}"
            )

    table("all turns", turns)
    table("turns over 0.5 ms on the CPU", long)
    starts, latencies = calls
    if latencies:
        threshold = _p(latencies, 99)
        slow = [
            (s, s + ms / 1000) for s, ms in zip(starts, latencies, strict=True) if ms >= threshold
        ]
        # (turns are in order and do not overlap: those from the last one starting before a
        # call's start to the last one starting before its end)
        turn_starts = [start for start, _, _, _ in turns]
        chosen: set[int] = set()
        for a, b in slow:
            first = max(0, bisect.bisect_right(turn_starts, a) - 1)
            chosen.update(range(first, bisect.bisect_left(turn_starts, b)))
        overlapping = [turns[i] for i in sorted(chosen)]
        _progress(
            f"{phase}: the {len(slow)} spared calls at or over the p99 ({threshold:.2f} ms) "
            f"overlapped {len(overlapping)} turns, "
            f"{sum(c for _, _, c, _ in overlapping) * 1000:.1f} ms on the CPU"
        )
        table("turns overlapping the p99 spared calls", overlapping)


def _cpu_seconds(procs: list[anyio.abc.Process]) -> list[float]:
    """CPU seconds (user + system) so far of this process, then of each child in ``procs``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = [time.process_time()]
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            out.append((int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):
            out.append(0.0)
    return out


def _split(n: int, parts: int) -> list[range]:
    """``range(n)`` in ``parts`` consecutive pieces, as equal as can be."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(range(start, end))
        start = end
    return out


async def _stop(process: anyio.abc.Process) -> None:
    if process.returncode is None:
        process.kill()
    with anyio.CancelScope(shield=True):
        await process.wait()


# ------------------------------------------------------------------------------ runner


def _controller(
    settings: FleetSettings,
    workers: int,
    processes: int,
    loop: str,
    rss_only: bool,
    gc_freeze: bool = False,
    storm_nice: bool = False,
) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(harness.ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "benchmarks.fleet",
        "controller",
        "--workers",
        str(workers),
        "--processes",
        str(processes),
        "--idle-calls",
        str(settings.idle_calls),
        "--maps",
        str(settings.maps),
        "--limit",
        str(settings.limit_s),
        "--loop",
        loop,
        *(["--rss-only"] if rss_only else []),
        *(["--gc-freeze"] if gc_freeze else []),
        *(["--storm-nice"] if storm_nice else []),
    ]
    try:
        completed = subprocess.run(
            command,
            cwd=harness.ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=None,  # progress lines, and the children's warnings, go straight through
            text=True,
            timeout=4 * settings.limit_s + 60,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise harness.MeasurementError("the fleet controller child timed out") from exc
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise harness.MeasurementError(
        f"the fleet controller child exited with code {completed.returncode} and no result",
        completed.stdout[-2000:],
    )


def _figure(
    key: str, label: str, unit: str, value: float, target: float | None, values: list[float]
) -> dict[str, Any]:
    return {
        "key": key,
        "label": label,
        "unit": unit,
        "summary": harness.summarize(values or [value]) | {"median": value},
        "target": target,
        "met": None if target is None else value <= target,
    }


def _measure(settings: FleetSettings, loop: str, log: TextIO) -> dict[str, Any]:
    low_processes = max(1, settings.processes * settings.rss_low // settings.workers)
    low = _controller(settings, settings.rss_low, low_processes, loop, rss_only=True)
    full = _controller(settings, settings.workers, settings.processes, loop, rss_only=False)
    # The same with gc.freeze() once the fleet is up (an operator's choice), beside the default.
    frozen = _controller(
        settings, settings.workers, settings.processes, loop, rss_only=False, gc_freeze=True
    )
    # The storming executors as if on other machines (their children at nice 19 from the cut on):
    # the controller's own share of the inflation, beside the figure with all of them on its CPUs.
    modelled = _controller(
        settings, settings.workers, settings.processes, loop, rss_only=False, storm_nice=True
    )
    n, n0 = full["workers"], low["workers"]
    slope_kib = (full["rss_idle_bytes"] - low["rss_idle_bytes"]) / (n - n0) / KiB
    factor = full["storm_p99_ms"] / full["idle_p99_ms"] if full["storm_p99_ms"] else None
    inf = float("inf")
    figures = [
        _figure(
            "cold_start_s",
            f"{n:,} workers in {settings.processes} processes: all ready from a cold start "
            "(children's start-up included)",
            "s",
            full["cold_start_s"],
            COLD_START_TARGET_S,
            [],
        ),
        _figure(
            "rss_per_executor_kib",
            f"controller RSS per idle executor (slope between {n0:,} and {n:,}: "
            f"{low['rss_idle_bytes'] / 2**20:.1f} -> {full['rss_idle_bytes'] / 2**20:.1f} MiB)",
            "KiB",
            slope_kib,
            RSS_PER_EXECUTOR_TARGET_KIB,
            [],
        ),
        _figure(
            "map_p50_s",
            f"fleet.map() of one call to all {n:,} (concurrency 64), median of {settings.maps}",
            "s",
            full["map_p50_s"],
            MAP_TARGET_S,
            full["map_s"],
        ),
        _figure(
            "idle_p99_ms",
            f"idle sequential call to one of the {n // settings.processes} spared executors, p99 "
            f"(p50 {full['idle_p50_ms']:.2f} ms)",
            "ms",
            full["idle_p99_ms"],
            None,
            [],
        ),
        _figure(
            "storm_recovered_s",
            f"reconnect storm: {full['storm_cut']:,} sockets aborted at once, until all ready "
            f"again ({full['storm_resumed']:,} resumed, {full['storm_connections']:,} "
            "connections)",
            "s",
            full["storm_recovered_s"],
            None,
            [],
        ),
        _figure(
            "storm_p99_factor",
            f"spared executors' call p99 during the storm / idle p99 "
            f"({full['storm_p99_ms']:.2f} ms over {full['storm_calls']} calls)",
            "x",
            factor if factor is not None else float("inf"),
            STORM_P99_FACTOR_TARGET,
            [],
        ),
        _figure(
            "storm_gc_pause_ms",
            f"the controller's GC pauses during the storm, in all ({describe_passes(full)})",
            "ms",
            storm_gc_ms(full),
            None,
            [],
        ),
        _figure(
            "storm_p99_factor_storm_nice",
            f"the same with the storming children at nice 19 from the cut (another run: "
            f"{modelled['storm_p99_ms']:.2f} ms / idle p99 {modelled['idle_p99_ms']:.2f} ms; all "
            f"ready in {modelled['storm_recovered_s']:.2f} s, {modelled['storm_connections']:,} "
            "connections)",
            "x",
            modelled["storm_p99_ms"] / modelled["idle_p99_ms"] if modelled["storm_p99_ms"] else inf,
            STORM_P99_FACTOR_TARGET,
            [],
        ),
        _figure(
            "storm_p99_factor_gc_freeze",
            f"the same with gc.freeze() once the fleet is up (another run: "
            f"{frozen['storm_p99_ms']:.2f} ms / idle p99 {frozen['idle_p99_ms']:.2f} ms)",
            "x",
            frozen["storm_p99_ms"] / frozen["idle_p99_ms"] if frozen["storm_p99_ms"] else inf,
            STORM_P99_FACTOR_TARGET,
            [],
        ),
        _figure(
            "storm_gc_pause_ms_gc_freeze",
            f"its GC pauses during the storm, in all ({describe_passes(frozen)})",
            "ms",
            storm_gc_ms(frozen),
            None,
            [],
        ),
        _figure(
            "handshakes_per_s_peak",
            f"listener handshake throughput, best {RATE_WINDOW_S:g} s window of the storm "
            f"(mean over the storm {full['handshakes_per_s_mean']:.0f}/s; higher is better)",
            "/s",
            full["handshakes_per_s_peak"],
            None,
            [],
        ),
    ]
    print(
        "[fleet] redials (connections arriving) after the cut: "
        + describe_histogram(full["redial_histogram"]),
        file=log,
        flush=True,
    )
    return {"figures": figures, "runs": [low, full, frozen, modelled]}


def storm_gc_ms(result: dict[str, Any]) -> float:
    """All the controller's GC pauses during the storm, in ms."""
    return float(sum(p["total_ms"] for p in result["gc"]["storm"]["passes"].values()))


def describe_passes(result: dict[str, Any]) -> str:
    """The storm's passes per generation: ``gen 2: 1 pass, longest 253 ms; ...``."""
    passes = result["gc"]["storm"]["passes"]
    return "; ".join(
        f"gen {g}: {p['count']} passes, longest {p['longest_ms']:.0f} ms"
        for g, p in sorted(passes.items())
    )


def run_entry(name: str, settings: FleetSettings, loop: str, log: TextIO) -> dict[str, Any]:
    """Measure the fleet; never raises but for KeyboardInterrupt/SystemExit."""
    return harness.run_measurement(
        name, DESCRIPTIONS[name], asdict(settings), lambda: _measure(settings, loop, log), log
    )


def run(
    names: list[str],
    settings: harness.Settings,
    quick: bool,
    loop_choice: str,
    log: TextIO = sys.stderr,
) -> list[dict[str, Any]]:
    """Measure the named entries of this module; the results as written to JSON."""
    loop = eventloop.resolve(loop_choice)
    mine = FleetSettings.from_runner(settings, quick)
    return [run_entry(name, mine, loop, log) for name in NAMES if name in names]


# ---------------------------------------------------------------------------- children


def main(argv: list[str] | None = None) -> None:
    from .servers._common import run_asyncio

    parser = argparse.ArgumentParser(description="Children of the fleet benchmark.")
    parser.add_argument("mode", choices=("controller", "workers", "per-resume"))
    parser.add_argument("--loop", choices=eventloop.CHOICES, default="asyncio")
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--idle-calls", type=int, default=1000)
    parser.add_argument("--maps", type=int, default=10)
    parser.add_argument("--limit", type=float, default=120.0)
    parser.add_argument("--rss-only", action="store_true")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in every process once the fleet is up (after the idle RSS)",
    )
    parser.add_argument(
        "--storm-nice",
        action="store_true",
        help="the cut children run at nice 19 from the cut on: the CPU the controller and the "
        "spared child leave (as if the storming executors ran on other machines)",
    )
    parser.add_argument(
        "--turn-budget-ms",
        type=float,
        default=None,
        help="the controller's Limits.handshake_seconds_per_turn, in ms (default: the Limits')",
    )
    parser.add_argument(
        "--busy-share",
        type=float,
        default=None,
        help="the controller's Limits.handshake_busy_share (default: the Limits')",
    )
    parser.add_argument("--url", default="")
    parser.add_argument("--keyring", type=Path)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5, help="per-resume: cuts of all workers")
    parser.add_argument("--backoff-reset-after", type=float, default=None)
    parser.add_argument(
        "--builtin", action="store_true", help="workers serve the built-in services too"
    )
    args = parser.parse_args(argv)
    log_dir = os.environ.get("GL_FLEET_BENCH_LOG_DIR")  # for diagnosis: the library's log lines
    if log_dir:
        logging.basicConfig(
            filename=os.path.join(log_dir, f"{args.mode}-{args.first}-{os.getpid()}.log"),
            level=logging.INFO,
            format="%(relativeCreated)d %(name)s %(levelname)s %(message)s",
        )
    if args.mode == "workers":

        async def workers() -> None:
            await _workers_main(
                args.url,
                args.keyring,
                args.first,
                args.count,
                args.backoff_reset_after,
                args.gc_freeze,
                args.builtin,
            )

        run_asyncio(workers, args.loop)
        return
    box: list[dict[str, Any]] = []

    async def controller() -> None:
        with anyio.fail_after(4 * args.limit):
            if args.mode == "per-resume":
                box.append(await _per_resume_main(args))
            else:
                box.append(await _controller_main(args))

    run_asyncio(controller, args.loop)
    print("RESULT " + json.dumps(box[0]), flush=True)


if __name__ == "__main__":
    main()
