"""The gateway's relay, measured against a direct fleet: what the second hop costs.

``python -m benchmarks.relay`` (``--quick``: fewer calls and executors). It prints one JSON
object and a short table; it is not part of ``python -m benchmarks`` (yet).

Processes
---------
* **direct**: this process runs a listening :class:`gl.Fleet`; a **workers** child
  (``python -m benchmarks.relay workers``) runs the executors as ``gl.Worker`` endpoints dialing
  it. Calls go this process -> worker child.
* **gateway**: a **gateway** child (``garcon-link gateway CONFIG``) listens; the workers child
  dials it, and this process is a caller (``gl.connect_gateway``). Calls go this process ->
  gateway child -> worker child.

Both use default :class:`gl.Limits`, loopback and the same service (``ident.echo(bytes) ->
bytes``). What is measured, in each arrangement:

1. **p50/p99 latency** of ``calls`` sequential 32-byte echo calls to one executor;
2. **calls/s with 64 in flight**: 64 tasks calling one executor for ``seconds``;
3. **map** (``--executors`` executors, ``--callers`` callers): each caller runs ``fleet.map`` of
   one echo over every executor, all callers at once; the figure is the wall time of one round
   (the median of ``maps`` rounds). Direct, the callers are ``--callers`` tasks sharing the one
   fleet.
4. **floods** (gateway only): a flooding caller, in a process of its own, keeps 128 tasks busy
   against executor 0 while a granted caller here makes ``calls`` sequential calls to it: their
   p99 against the same caller's idle p99 in the window just before, ``--flood-pairs`` idle and
   flood windows in turn, the median and worst factor reported (target: a median of at most
   5x). Three floods: a caller enrolled but granted nothing (each call refused ``FORBIDDEN``),
   a granted caller's echo calls, a granted caller's streams (:func:`_flooded`). Each runs with
   the flooder at nice 19 (a flooder on another machine: the judged figure) and not niced
   (``*_plain``: its CPU taken from the gateway's and the worker's), ``--flood-nice``.

5. **the hop's floor** (:mod:`benchmarks.relayfloor`): the raw wsproto echo of
   ``python -m benchmarks --only wsproto`` direct, through a byte-forwarding proxy child and
   through a wsproto-level relay child, p50 and calls/s with 64 in flight measured as above.
   ``floor_bytes_*`` (proxy over direct) is what a third process costs anything on this
   machine; ``*_over_floor`` is the gateway's ratio to direct divided by that.
   ``--floor-only`` measures only this; ``--floor-instructions`` counts instead the proxies'
   instructions per sequential call forwarded (callgrind), to set beside the gateway's
   ``--instructions``.

Targets: the hop adds at most 1.5x to the p50 and keeps at least 0.7x of the direct
calls/s.

``--instructions`` (needs valgrind) measures instead instructions per call, a figure the
machine's load does not move, of three processes, each counted on its own run (one slowed by
callgrind batches its peers' work less, so only one is slowed at a time): the gateway child, a
caller child through it, and a direct fleet's caller child (the fleet listening in it), one
executor each time (:func:`_instructions`). The counted child runs under callgrind with
instrumentation off; after a warm-up, the counters are zeroed, switched on around
``--instructions-calls`` sequential calls, off and dumped, then the same around as many calls
made 64 at a time. The caller child runs each phase when told on its stdin
(:func:`_caller_main`). The gateway's ``receipt_delay`` is raised to 2 s
(``--instructions-receipt-delay``) so that its receipt timer's work (at most once per
``receipt_delay`` while receipts are due) does not grow with valgrind's wall time. Each phase
also reports the counted process's writer wake-ups per call. ``--instructions-metadata``: every
call carries metadata (a client hook adds it, as a tracing hook does). ``--callgrind-dir DIR``
keeps the dumps there (``gateway.sequential``, ``caller.in_flight_64``, ...) for
``callgrind_annotate``.

``--cpu`` measures each process's CPU time per call (``/proc``) instead, ``--cpu-calls`` calls
made 64 at a time by a caller child, through a gateway child and then direct to a fleet, none
under callgrind (:func:`_cpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, cast

import anyio

import garcon_link as gl
from garcon_link.settings.secrets import read_secret_file, write_secret_file

from . import relayfloor

P50_FACTOR_TARGET = 1.5
THROUGHPUT_RATIO_TARGET = 0.7
FLOOD_P99_FACTOR_TARGET = 5.0
PAYLOAD = b"x" * 32


class Ident(Protocol):
    async def echo(self, data: bytes) -> bytes: ...

    def ticks(self, n: int) -> AsyncIterator[int]: ...


class _IdentImpl:
    async def echo(self, data: bytes) -> bytes:
        return data

    async def ticks(self, n: int) -> AsyncIterator[int]:
        for index in range(n):
            yield index


def executor_id(index: int) -> str:
    return f"relay-{index:04d}"


# ------------------------------------------------------------------------ workers child


async def _workers_main(url: str, keyring: Path, count: int) -> None:
    async with AsyncExitStack() as stack:
        for index in range(count):
            name = executor_id(index)
            config = gl.LinkConfig(
                executor_id=name,
                role=gl.Role.WORKER,
                secret=read_secret_file(keyring / f"{name}.secret"),
                dial=url,
            )
            await stack.enter_async_context(
                gl.Worker(config, {"ident": gl.Service(_IdentImpl(), Ident)})
            )
        print("started", flush=True)
        lines = anyio.wrap_file(sys.stdin)
        while await lines.readline():
            pass
        os._exit(0)


# ------------------------------------------------------------------------ flooder child


async def _flooder_main(url: str, secret: Path, caller_id: str, kind: str, nice: bool) -> None:
    """A caller flooding the gateway from a process of its own (:func:`_flooded`), told on its
    stdin when: ``pause`` (its lanes finish the call or leave the stream they are in and wait;
    it answers ``paused`` once none is in flight), ``resume`` (it answers ``resumed``); when
    stdin closes it prints its counts as one JSON line. ``nice``: this process at nice 19, so it
    runs on what CPU the gateway, the worker and the measuring caller leave (as if on another
    machine). ``busy``: no calls, one lane keeps a thread spinning instead (a control: what a
    busy process costs the others on this machine without a call to the gateway)."""
    if nice:
        os.nice(19)  # threads started from here on inherit it
    config = gl.CallerConfig(caller_id=caller_id, secret=read_secret_file(secret), dial=url)
    counts = {"ok": 0, "refused": 0, "items": 0}
    running = anyio.Event()
    running.set()
    busy = 0
    idle = anyio.Event()
    async with gl.connect_gateway(config) as fleet:
        await fleet.gateway.wait_ready(60)
        if kind != "ungranted":
            await fleet.executor(executor_id(0)).wait_ready(60)
        target = fleet.executor(executor_id(0)).service("ident", Ident)

        async def lane() -> None:
            nonlocal busy
            while True:  # until the task group is cancelled
                await running.wait()
                busy += 1
                try:
                    if kind == "busy":
                        await anyio.to_thread.run_sync(_spin)
                    elif kind == "streams":
                        async with contextlib.aclosing(cast("Any", target.ticks(1000))) as ticks:
                            async for _ in ticks:
                                counts["items"] += 1
                                if not running.is_set():
                                    break
                    else:
                        await target.echo(PAYLOAD)
                    counts["ok"] += 1
                except (gl.Rejected, gl.NotDispatched):
                    counts["refused"] += 1
                finally:
                    busy -= 1
                    if not busy:
                        idle.set()

        async with anyio.create_task_group() as tg:
            for _ in range(1 if kind == "busy" else FLOOD_LANES):
                tg.start_soon(lane)
            print("started", flush=True)
            lines = anyio.wrap_file(sys.stdin)
            while line := await lines.readline():
                if line.strip() == "pause" and running.is_set():
                    running = anyio.Event()
                    idle = anyio.Event()
                    if busy:
                        await idle.wait()
                    print("paused", flush=True)
                elif line.strip() == "resume":
                    running.set()
                    print("resumed", flush=True)
            tg.cancel_scope.cancel()
    print(json.dumps(counts), flush=True)
    os._exit(0)


def _spin() -> None:
    """About 5 ms of pure Python work (the ``busy`` control's thread)."""
    end = time.perf_counter() + 0.005
    while time.perf_counter() < end:
        pass


# ------------------------------------------------------------------------ gateway child


async def _gateway_main(config_path: Path, profile: Path | None) -> None:
    """The gateway in a child of its own (``--profile-gateway``): ``garcon-link gateway``'s
    work without its table, under cProfile, the profile written when stdin closes."""
    import cProfile

    config = gl.load_gateway_config(config_path)
    # CPU time, not wall time: a send that wakes a peer may lose the core to it (2 cores,
    # three busy processes), which is scheduling, not the gateway's cost.
    profiler = cProfile.Profile(time.process_time) if profile is not None else None
    async with gl.gateway(config) as gw:
        print(json.dumps({"event": "listening", "url": gw.url}), flush=True)
        if profiler is not None:
            profiler.enable()
        lines = anyio.wrap_file(sys.stdin)
        while line := await lines.readline():
            if line.strip() == "wakeups":  # asked by --instructions, between its phases
                print(json.dumps({"writer_wakeups": _writer_wakeups()}), flush=True)
        if profiler is not None and profile is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        os._exit(0)


# ------------------------------------------------------------------------ caller child


class _TraceHook:
    """A client hook adding one metadata entry to every call, as a tracing hook does
    (``--instructions-metadata``)."""

    def call_started(self, call: gl.CallInfo) -> object:
        assert isinstance(call.metadata, MutableMapping)  # a client hook's: writable
        call.metadata["traceparent"] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        return None

    def call_ended(self, call: gl.CallInfo, state: object, end: gl.CallEnd) -> None:
        pass


async def _caller_main(mode: str, where: str, metadata: bool) -> None:
    """A caller in a child of its own, so that ``--instructions`` counts its work under
    callgrind as it does the gateway's: ``mode`` ``gateway`` (``where``: the gateway's URL and
    the caller's secret file, joined by a space) or ``direct`` (``where``: the executors'
    keyring; this child listens as a fleet and prints its URL first). Once executor 0 is
    ready it prints ``ready``, then runs each phase named on stdin (``sequential N``,
    ``in_flight N``: N calls, 64 at a time; ``warm N``) and answers each with a JSON line of
    its writer wake-ups so far. ``metadata``: every call carries metadata (:class:`_TraceHook`)."""
    hooks: list[gl.CallHook] = [_TraceHook()] if metadata else []
    async with AsyncExitStack() as stack:
        if mode == "gateway":
            url, secret = where.split(" ", 1)
            config = gl.CallerConfig(
                caller_id="bench-0", secret=read_secret_file(Path(secret)), dial=url
            )
            fleet: Any = await stack.enter_async_context(gl.connect_gateway(config, hooks=hooks))
            await fleet.gateway.wait_ready(300)
        else:
            fleet_config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=Path(where))
            fleet = await stack.enter_async_context(gl.fleet(fleet_config, hooks=hooks))
            print(json.dumps({"url": fleet.url}), flush=True)
        target = fleet.executor(executor_id(0))
        await target.wait_ready(300)
        ident = target.service("ident", Ident)

        async def lane(count: int) -> None:
            for _ in range(count):
                await ident.echo(PAYLOAD)

        print("ready", flush=True)
        lines = anyio.wrap_file(sys.stdin)
        while line := await lines.readline():
            phase, _, text = line.strip().partition(" ")
            count = int(text or 0)
            if phase == "in_flight":
                async with anyio.create_task_group() as tg:
                    for _ in range(INSTRUCTIONS_LANES):
                        tg.start_soon(lane, max(1, count // INSTRUCTIONS_LANES))
            elif phase != "wakeups":
                await lane(count)
            print(json.dumps({"writer_wakeups": _writer_wakeups()}), flush=True)
        os._exit(0)


# ------------------------------------------------------------------------ measuring


def _writer_wakeups() -> int:
    """The socket writer wake-ups of every session transport alive in this process."""
    import gc

    from garcon_link.endpoint.transport import SessionTransport

    return sum(
        o.statistics().writer_wakeups for o in gc.get_objects() if isinstance(o, SessionTransport)
    )


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _latency(call: Callable[[], Awaitable[Any]], n: int) -> dict[str, float]:
    for _ in range(min(50, n)):
        await call()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append((time.perf_counter() - start) * 1e6)
    return {"p50_us": _p(samples, 0.5), "p99_us": _p(samples, 0.99)}


async def _throughput(call: Callable[[], Awaitable[Any]], seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def lane() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await call()
            done += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(64):
            tg.start_soon(lane)
    return done / (time.perf_counter() - start)


async def _maps(fleets: list[Any], rounds: int) -> float:
    async def one(fleet: Any) -> None:
        results = await fleet.map(lambda ex: ex.service("ident", Ident).echo(PAYLOAD))
        failed = [k for k, v in results.items() if isinstance(v, BaseException)]
        if failed:
            raise RuntimeError(f"{len(failed)} map calls failed, e.g. {results[failed[0]]}")

    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for fleet in fleets:
                tg.start_soon(one, fleet)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _started(process: anyio.abc.Process, what: str) -> bytes:
    """Wait (at most 120 s) for a child's ``started`` line and return what it wrote so far; one
    that exits first is an error naming it."""
    assert process.stdout is not None
    buffer = b""
    try:
        with anyio.fail_after(120):
            while b"started" not in buffer:
                buffer += await process.stdout.receive()
    except anyio.EndOfStream:
        code = await process.wait()
        raise RuntimeError(f"{what} exited (status {code}) before it started") from None
    return buffer


@asynccontextmanager
async def _workers(url: str, keyring: Path, count: int) -> AsyncIterator[anyio.abc.Process]:
    command = [sys.executable, "-m", "benchmarks.relay", "workers", url, str(keyring), str(count)]
    process = await anyio.open_process(command, stdin=subprocess.PIPE, stderr=None)
    try:
        await _started(process, "the workers' process")
        yield process
    finally:
        process.kill()
        await process.wait()
        await process.aclose()


async def _measure(
    executor: Callable[[str], Any],
    fleets: list[Any],
    args: argparse.Namespace,
    gateway: int | None = None,
) -> dict[str, float]:
    """The figures of one arrangement; ``gateway``: the gateway child's pid, whose CPU time
    per call with 64 in flight is reported too (``gateway_cpu_us_per_call_64``)."""
    first = executor(executor_id(0))
    await first.wait_ready(60)
    for index in range(args.executors):
        await executor(executor_id(index)).wait_ready(120)
    ident = first.service("ident", Ident)

    async def call() -> Any:
        return await ident.echo(PAYLOAD)

    out = await _latency(call, args.calls)
    used, start = relayfloor.cpu_seconds(gateway), time.perf_counter()
    out["calls_per_s_64"] = await _throughput(call, args.seconds)
    if gateway is not None:
        calls = out["calls_per_s_64"] * (time.perf_counter() - start)
        out["gateway_cpu_us_per_call_64"] = (relayfloor.cpu_seconds(gateway) - used) * 1e6 / calls
    out["map_s"] = await _maps(fleets, args.maps)
    return out


FLOOD_KINDS = ("ungranted", "calls", "streams", "busy")
"""The flood phases (:func:`_flooded`): the first three run by default, in this order; ``busy``
(a control, not judged) on request."""
DEFAULT_FLOODS = "ungranted,calls,streams"


def flood_kinds(text: str) -> list[str]:
    """``--floods``: flood phases, comma-separated; ``none`` (or ``0``, or nothing): none.

    Raises:
        ValueError: a phase that is not one of :data:`FLOOD_KINDS`.
    """
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    if kinds in ([], ["none"], ["0"]):
        return []
    unknown = [kind for kind in kinds if kind not in FLOOD_KINDS]
    if unknown:
        raise ValueError(
            f"--floods: unknown phase {', '.join(map(repr, unknown))}: choose from "
            f"{', '.join(FLOOD_KINDS)} (comma-separated), or none"
        )
    return kinds


FLOOD_LANES = 128
"""Tasks a flooding caller keeps busy: twice its share of the gateway's session to one
executor (``gateway_caller_share`` of ``max_pending_calls`` = 64 by default), so part of its
flood is refused."""


FLOOD_PAIRS = 4
"""Idle and flood windows each flood phase alternates (``--flood-pairs``): one idle p99 of a
few thousand calls moves by several times between runs on a busy machine, so each flood
window is set against the idle window just before it, and the median and worst of those
factors are reported."""


async def _flooded(
    fleet: gl.GatewayFleet,
    url: str,
    root: Path,
    caller_id: str,
    kind: str,
    args: argparse.Namespace,
    nice: bool,
) -> dict[str, float]:
    """A flooding caller (a child process, :func:`_flooder_main`) keeps :data:`FLOOD_LANES`
    tasks busy against executor 0 while a granted caller here makes sequential calls to it,
    ``args.flood_pairs`` times, each time after a window of as many calls with the flooder
    paused: each flood window's p99 over the idle one's just before it; the median and the
    worst of those factors, and the median p99s in microseconds. ``kind``: ``ungranted`` (a
    caller granted nothing: each call refused ``FORBIDDEN``), ``calls`` (a granted caller's
    echo calls, each lane calling again as soon as the last ended, refused or not),
    ``streams`` (a granted caller's streams of 1,000 items, each lane opening the next as soon
    as the last ended). ``nice``: the flooder at nice 19 (a flooder on another machine)."""
    ident = fleet.executor(executor_id(0)).service("ident", Ident)
    secret = root / "callers" / f"{caller_id}.secret"
    command = [sys.executable, "-m", "benchmarks.relay", "flood", url, str(secret), caller_id, kind]
    if nice:
        command.append("--nice")
    process = await anyio.open_process(command, stdin=subprocess.PIPE, stderr=None)
    idle_p99: list[float] = []
    flood_p99: list[float] = []
    try:
        assert process.stdin is not None and process.stdout is not None
        stdin, stdout = process.stdin, process.stdout
        buffer = await _started(process, f"the {kind} flooder")

        async def told(request: bytes, answer: bytes) -> None:
            nonlocal buffer
            await stdin.send(request + b"\n")
            with anyio.fail_after(120):
                while answer not in buffer:
                    buffer += await stdout.receive()
            buffer = buffer[buffer.index(answer) + len(answer) :]

        for _ in range(args.flood_pairs):
            await told(b"pause", b"paused")
            await anyio.sleep(0.1)
            idle_p99.append((await _latency(lambda: ident.echo(PAYLOAD), args.calls))["p99_us"])
            await told(b"resume", b"resumed")
            await anyio.sleep(0.3)
            flood_p99.append((await _latency(lambda: ident.echo(PAYLOAD), args.calls))["p99_us"])
        await stdin.aclose()
        with anyio.fail_after(60):
            while b"}" not in buffer:
                buffer += await stdout.receive()
        counts = json.loads(buffer[buffer.index(b"{") :].split(b"\n")[0])
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await process.aclose()
    prefix = "flood" if kind == "ungranted" else f"flood_{kind}"
    suffix = "" if nice else "_plain"
    factors = [during / idle for idle, during in zip(idle_p99, flood_p99, strict=True)]
    return {
        f"{prefix}_idle_p99_us{suffix}": statistics.median(idle_p99),
        f"{prefix}_p99_us{suffix}": statistics.median(flood_p99),
        f"{prefix}_p99_factor{suffix}": statistics.median(factors),
        f"{prefix}_p99_factor_worst{suffix}": max(factors),
        f"{prefix}_ok{suffix}": float(counts["ok"]),
        f"{prefix}_refused{suffix}": float(counts["refused"]),
        f"{prefix}_items{suffix}": float(counts["items"]),
    }


def _flood_nice(args: argparse.Namespace) -> list[bool]:
    """``--flood-nice``: the flooder at nice 19 (the modelled flooder, on another machine: what
    the target is judged on), at the default priority (four busy processes on this machine's
    cores, the flooder's CPU taken from the others), or both, niced first."""
    return {"both": [True, False], "on": [True], "off": [False]}[args.flood_nice]


async def _direct(root: Path, args: argparse.Namespace) -> dict[str, float]:
    config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=root / "keys")
    async with gl.fleet(config) as fleet, _workers(fleet.url, root / "keys", args.executors):
        return await _measure(fleet.executor, [fleet] * args.callers, args)


def _gateway_config(root: Path, extra: str = "") -> Path:
    """The gateway child's config in ``root``: executors and callers from the keyrings there,
    every ``bench-*`` caller granted every executor, then ``extra`` (TOML tables)."""
    config = root / "gateway.toml"
    config.write_text(
        'role = "gateway"\n[connection]\nlisten = "127.0.0.1:0"\n[executors]\nkeyring = "keys"\n'
        '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["bench-*"]\n'
        'executors = ["*"]\n' + extra,
        encoding="utf-8",
    )
    return config


async def _through_gateway(root: Path, args: argparse.Namespace) -> dict[str, float]:
    config = _gateway_config(root)
    if args.profile_gateway is None:
        command = [sys.executable, "-m", "garcon_link.cli", "gateway", str(config), "--json"]
    else:
        command = [sys.executable, "-m", "benchmarks.relay", "gateway", str(config)]
        command.append(str(args.profile_gateway.resolve()))
    gateway = await anyio.open_process(command, stdin=subprocess.PIPE, stderr=None, cwd=root)
    try:
        assert gateway.stdout is not None
        buffer = b""
        with anyio.fail_after(60):
            while b"\n" not in buffer:
                buffer += await gateway.stdout.receive()
        url = json.loads(buffer.split(b"\n")[0])["url"]
        async with _workers(url, root / "keys", args.executors), AsyncExitStack() as stack:
            fleets = []
            for number in range(args.callers):
                caller = gl.CallerConfig(
                    caller_id=f"bench-{number}",
                    secret=read_secret_file(root / "callers" / f"bench-{number}.secret"),
                    dial=url,
                )
                fleets.append(await stack.enter_async_context(gl.connect_gateway(caller)))
            await fleets[0].gateway.wait_ready(60)
            if args.floods_only:
                await fleets[0].executor(executor_id(0)).wait_ready(60)
                out: dict[str, float] = {}
            else:
                out = await _measure(fleets[0].executor, fleets, args, gateway.pid)
            for kind in args.floods:
                flooder = "intruder" if kind == "ungranted" else "bench-greedy"
                for nice in _flood_nice(args):
                    out.update(await _flooded(fleets[0], url, root, flooder, kind, args, nice))
            return out
    finally:
        if args.profile_gateway is not None and gateway.stdin is not None:
            await gateway.stdin.aclose()  # the child writes its profile and exits
            with anyio.move_on_after(30):
                await gateway.wait()
        if gateway.returncode is None:
            gateway.kill()
        await gateway.wait()
        await gateway.aclose()


INSTRUCTIONS_LANES = 64
INSTRUCTIONS_RECEIPT_DELAY = 2.0


async def _callgrind(pid: int, *switches: str) -> None:
    for switch in switches:
        await anyio.run_process(["callgrind_control", *switch.split(), str(pid)], check=False)


def _dump_totals(directory: Path, prefix: str, seen: set[Path]) -> tuple[int, Path]:
    """The instructions of the one dump of ``prefix`` written since ``seen`` was taken, and
    its path."""
    fresh = sorted(set(directory.glob(f"{prefix}.*")) - seen)
    if len(fresh) != 1:
        raise RuntimeError(f"expected one new callgrind dump in {directory}, found {fresh}")
    text = fresh[0].read_text(errors="replace")
    match = re.search(r"^totals:\s+(\d+)", text, re.M) or re.search(
        r"^summary:\s+(\d+)", text, re.M
    )
    if match is None:
        raise RuntimeError(f"no totals in {fresh[0]}")
    return int(match.group(1)), fresh[0]


class _Child:
    """A child process under callgrind (instrumentation off until switched on) and the lines
    it writes."""

    def __init__(self, name: str, process: anyio.abc.Process) -> None:
        self.name = name
        self.process = process
        self._buffer = b""

    @classmethod
    async def start(
        cls, name: str, argv: list[str], dumps: Path, root: Path, *, counted: bool = True
    ) -> _Child:
        """``counted``: under callgrind; else a plain child."""
        command = [sys.executable, "-m", "benchmarks.relay", *argv]
        if counted:
            valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
            command = [*valgrind, f"--callgrind-out-file={dumps / name}.%p", *command]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        process = await anyio.open_process(
            command, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=root, env=env
        )
        return cls(name, process)

    async def line(self, needle: bytes, timeout: float = 300) -> bytes:
        """The next line holding ``needle`` (lines before it are skipped)."""
        assert self.process.stdout is not None
        with anyio.fail_after(timeout):
            while True:
                line, sep, rest = self._buffer.partition(b"\n")
                if sep:
                    self._buffer = rest
                    if needle in line:
                        return line
                    continue
                try:
                    self._buffer += await self.process.stdout.receive()
                except anyio.EndOfStream:
                    raise RuntimeError(f"the {self.name} child exited early") from None

    async def ask(self, request: str) -> dict[str, Any]:
        """Write ``request`` and read the JSON line that answers it."""
        assert self.process.stdin is not None
        await self.process.stdin.send(request.encode() + b"\n")
        answer: dict[str, Any] = json.loads(await self.line(b"writer_wakeups", 600))
        return answer

    async def aclose(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await self.process.wait()
        await self.process.aclose()


async def _count_phases(
    counted: _Child, caller: _Child, dumps: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """The phases of ``--instructions`` run by ``caller``: ``counted``'s instructions per call
    (``{phase}_{name}_instructions_per_call``) and writer wake-ups per call."""
    calls = args.instructions_calls
    per_lane = max(1, calls // INSTRUCTIONS_LANES)
    out: dict[str, Any] = {}
    await caller.ask("warm 50")  # instrumentation off
    for name, count in (("sequential", calls), ("in_flight_64", per_lane * INSTRUCTIONS_LANES)):
        seen = set(dumps.glob(f"{counted.name}.*"))
        before = (await counted.ask("wakeups"))["writer_wakeups"]
        await _callgrind(counted.process.pid, "-z", "-i on")
        woke = await caller.ask(f"{name.removesuffix('_64')} {count}")
        await _callgrind(counted.process.pid, "-i off", "-d")
        total, dump = _dump_totals(dumps, counted.name, seen)
        out[f"{name}_{counted.name}_instructions_per_call"] = total / count
        after = woke if counted is caller else await counted.ask("wakeups")
        out[f"{name}_{counted.name}_writer_wakeups_per_call"] = (
            after["writer_wakeups"] - before
        ) / count
        if args.callgrind_dir is not None:
            args.callgrind_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(dump, args.callgrind_dir / f"{counted.name}.{name}")
    return out


async def _instructions(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Instructions per relayed call of the gateway child, then of a caller child through it,
    then of a direct fleet's caller child (callgrind; see the module docstring), sequential and
    64 in flight, each over ``args.instructions_calls`` calls. One process is counted at a
    time: one slowed by callgrind batches its peers' work less, and a count taken with two of
    them would depend on that."""
    config = _gateway_config(root, f"[limits]\nreceipt_delay = {args.instructions_receipt_delay}\n")
    dumps = root / "callgrind"
    dumps.mkdir()
    metadata = ["--metadata"] if args.instructions_metadata else []
    out: dict[str, Any] = {"calls": args.instructions_calls, "lanes": INSTRUCTIONS_LANES}
    secret = root / "callers" / "bench-0.secret"
    for counted in ("gateway", "caller"):
        children: list[_Child] = []
        try:
            gateway = await _Child.start(
                "gateway", ["gateway", str(config)], dumps, root, counted=counted == "gateway"
            )
            children.append(gateway)
            url = json.loads(await gateway.line(b"url"))["url"]
            async with _workers(url, root / "keys", 1):
                argv = ["caller", "gateway", f"{url} {secret}", *metadata]
                caller = await _Child.start(
                    "caller", argv, dumps, root, counted=counted == "caller"
                )
                children.append(caller)
                await caller.line(b"ready")
                measured = gateway if counted == "gateway" else caller
                out.update(await _count_phases(measured, caller, dumps, args))
        finally:
            for child in children:
                await child.aclose()
    direct = await _Child.start(
        "direct", ["caller", "direct", str(root / "keys"), *metadata], dumps, root
    )
    try:
        url = json.loads(await direct.line(b"url"))["url"]
        async with _workers(url, root / "keys", 1):
            await direct.line(b"ready")
            out.update(await _count_phases(direct, direct, dumps, args))
    finally:
        await direct.aclose()
    return out


async def _cpu(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """CPU time per call of each process (``/proc``), ``args.cpu_calls`` calls made 64 at a
    time by a caller child: through a gateway child (caller, gateway, worker), then direct to
    a fleet (caller, worker); none under callgrind. Load moves it less than wall time, but
    more than instructions (caches, frequency)."""
    config = _gateway_config(root)
    calls = max(1, args.cpu_calls // INSTRUCTIONS_LANES) * INSTRUCTIONS_LANES
    out: dict[str, Any] = {"calls": calls, "lanes": INSTRUCTIONS_LANES}
    secret = root / "callers" / "bench-0.secret"
    for arrangement in ("gateway", "direct"):
        children: list[_Child] = []
        try:
            if arrangement == "gateway":
                argv = ["gateway", str(config)]
                children.append(await _Child.start("gateway", argv, root, root, counted=False))
                url = json.loads(await children[0].line(b"url"))["url"]
                argv = ["caller", "gateway", f"{url} {secret}"]
                caller = await _Child.start("caller", argv, root, root, counted=False)
            else:
                argv = ["caller", "direct", str(root / "keys")]
                caller = await _Child.start("caller", argv, root, root, counted=False)
                url = json.loads(await caller.line(b"url"))["url"]
            children.append(caller)
            async with _workers(url, root / "keys", 1) as workers:
                await caller.line(b"ready")
                await caller.ask("warm 2000")
                pids = {child.name: child.process.pid for child in children}
                pids["worker"] = workers.pid
                before = {name: relayfloor.cpu_seconds(pid) for name, pid in pids.items()}
                start = time.perf_counter()
                await caller.ask(f"in_flight {calls}")
                wall = time.perf_counter() - start
                for name, pid in pids.items():
                    used = relayfloor.cpu_seconds(pid) - before[name]
                    out[f"{arrangement}_{name}_cpu_us_per_call"] = used * 1e6 / calls
                out[f"{arrangement}_calls_per_s_64"] = calls / wall
        finally:
            for child in children:
                await child.aclose()
    return out


def cpu_bounds(used: Mapping[str, float], cores: int) -> tuple[float, float]:
    """The calls/s that CPU per call (µs, per process) allows: on ``cores`` cores (the busiest
    process, or the whole work shared out, whichever bounds), and with a core per process
    (the busiest one alone). Scheduling and wake-ups are left out: measured figures fall
    below both."""
    busiest, total = max(used.values()), sum(used.values())
    return 1e6 / max(busiest, total / cores), 1e6 / busiest


def _keys(root: Path, args: argparse.Namespace) -> None:
    for directory in ("keys", "callers"):
        (root / directory).mkdir(mode=0o700)
    for index in range(args.executors):
        write_secret_file(root / "keys" / f"{executor_id(index)}.secret")
    for number in range(args.callers):
        write_secret_file(root / "callers" / f"bench-{number}.secret")
    write_secret_file(root / "callers" / "intruder.secret")  # enrolled, granted nothing
    write_secret_file(root / "callers" / "bench-greedy.secret")  # granted, floods


async def _main(args: argparse.Namespace) -> Any:
    with tempfile.TemporaryDirectory(prefix="garcon-link-relay-") as tmp:
        root = Path(tmp)
        _keys(root, args)
        if args.instructions:
            return await _instructions(root, args)
        if args.cpu:
            return await _cpu(root, args)
        if args.floods_only:
            return await _through_gateway(root, args)
        if args.floor_only:
            return await relayfloor.measure(
                PAYLOAD, _latency, _throughput, args.calls, args.seconds
            )
        direct = await _direct(root, args)
        relayed = await _through_gateway(root, args)
        floor = await relayfloor.measure(PAYLOAD, _latency, _throughput, args.calls, args.seconds)
    ratios = {
        "p50_factor": relayed["p50_us"] / direct["p50_us"],
        "calls_per_s_ratio": relayed["calls_per_s_64"] / direct["calls_per_s_64"],
        "map_factor": relayed["map_s"] / direct["map_s"],
    }
    # The hop's own floor: a byte-forwarding proxy between the raw wsproto echo's ends
    # (benchmarks/relayfloor.py), and the gateway's ratios over it.
    for kind in relayfloor.KINDS:
        ratios[f"floor_{kind}_p50_factor"] = floor[f"{kind}_p50_factor"]
        ratios[f"floor_{kind}_calls_per_s_ratio"] = floor[f"{kind}_calls_per_s_ratio"]
    ratios["p50_factor_over_floor"] = ratios["p50_factor"] / floor["bytes_p50_factor"]
    ratios["calls_per_s_ratio_over_floor"] = (
        ratios["calls_per_s_ratio"] / floor["bytes_calls_per_s_ratio"]
    )
    floods = _judged_floods(relayed, args)
    ratios.update({name: relayed[name] for name in floods})
    ratios.update({f"{name}_worst": relayed[f"{name}_worst"] for name in floods})
    return {
        "settings": vars(args),
        "direct": direct,
        "gateway": relayed,
        "floor": floor,
        "ratios": ratios,
        "targets": {
            "p50_factor_at_most": P50_FACTOR_TARGET,
            "calls_per_s_ratio_at_least": THROUGHPUT_RATIO_TARGET,
            "flood_p99_factor_at_most": FLOOD_P99_FACTOR_TARGET,
        },
        "met": ratios["p50_factor"] <= P50_FACTOR_TARGET
        and ratios["calls_per_s_ratio"] >= THROUGHPUT_RATIO_TARGET,
        # None: no flood phase ran (--floods none).
        "flood_met": max(ratios[name] for name in floods) <= FLOOD_P99_FACTOR_TARGET
        if floods
        else None,
    }


def _judged_floods(figures: Mapping[str, float], args: argparse.Namespace) -> list[str]:
    """The flood factors the target is judged on: the niced flooder's (``--flood-nice`` on or
    both), else the plain one's."""
    suffix = "" if args.flood_nice != "off" else "_plain"
    return [
        f"{'flood' if kind == 'ungranted' else f'flood_{kind}'}_p99_factor{suffix}"
        for kind in args.floods
        if kind != "busy"
    ]


_FLOOD_LABELS = {
    "ungranted": ("flood", "ungranted flood", "refused FORBIDDEN"),
    "calls": ("flood_calls", "granted call flood", "refused"),
    "streams": ("flood_streams", "granted stream flood", "refused"),
    "busy": ("flood_busy", "control, a busy process and no calls", "refused"),
}


def _print_floods(figures: Mapping[str, float], args: argparse.Namespace) -> None:
    """One line per flood phase and flooder priority run, on stderr."""
    for kind in args.floods:
        prefix, label, refused = _FLOOD_LABELS[kind]
        for nice in _flood_nice(args):
            suffix, how = ("", "flooder at nice 19") if nice else ("_plain", "flooder not niced")
            factor = figures[f"{prefix}_p99_factor{suffix}"]
            worst = figures[f"{prefix}_p99_factor_worst{suffix}"]
            judged = (
                " (judged)"
                if f"{prefix}_p99_factor{suffix}" in _judged_floods(figures, args)
                else ""
            )
            work = (
                f"{figures[f'{prefix}_items{suffix}']:.0f} items"
                if kind == "streams"
                else f"{figures[f'{prefix}_ok{suffix}'] * 5:.0f} ms spun"
                if kind == "busy"
                else f"{figures[f'{prefix}_ok{suffix}']:.0f} served"
            )
            print(
                f"{label}, {how}{judged}: p99 {figures[f'{prefix}_idle_p99_us{suffix}']:.0f} -> "
                f"{figures[f'{prefix}_p99_us{suffix}']:.0f} us (medians of {args.flood_pairs}); "
                f"factor median {factor:.2f}x, worst {worst:.2f}x; {work}, "
                f"{figures[f'{prefix}_refused{suffix}']:.0f} {refused}",
                file=sys.stderr,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.relay", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    workers = sub.add_parser("workers")
    workers.add_argument("url")
    workers.add_argument("keyring", type=Path)
    workers.add_argument("count", type=int)
    flood = sub.add_parser("flood")
    flood.add_argument("url")
    flood.add_argument("secret", type=Path)
    flood.add_argument("caller_id")
    flood.add_argument("kind", choices=FLOOD_KINDS)
    flood.add_argument("--nice", action="store_true")
    gateway = sub.add_parser("gateway")
    gateway.add_argument("config", type=Path)
    gateway.add_argument("profile", type=Path, nargs="?")
    caller = sub.add_parser("caller")
    caller.add_argument("mode", choices=("gateway", "direct"))
    caller.add_argument("where")
    caller.add_argument("--metadata", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--executors", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--maps", type=int, default=5)
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--floods-only",
        action="store_true",
        help="only the flood phases (gateway, one executor); prints their figures",
    )
    parser.add_argument(
        "--floor-only",
        action="store_true",
        help="only the hop's floor (the raw wsproto echo direct, through a byte-forwarding "
        "proxy and through a wsproto-level relay); prints its figures",
    )
    parser.add_argument(
        "--floor-instructions",
        action="store_true",
        help="only count the floor proxies' instructions per sequential call forwarded "
        "(valgrind; --instructions-calls sets N: the difference of N and 3N calls)",
    )
    parser.add_argument(
        "--floods",
        default=DEFAULT_FLOODS,
        help="which flood phases, comma-separated (of ungranted, calls, streams, and busy: a "
        f"control, a busy process making no call); none: none (default {DEFAULT_FLOODS})",
    )
    parser.add_argument(
        "--flood-nice",
        choices=("both", "on", "off"),
        default="both",
        help="the flooder at nice 19 (on: a flooder on another machine, what the 5x target is "
        "judged on), at the default priority (off: its CPU taken from the gateway's on this "
        "machine), or both (default)",
    )
    parser.add_argument(
        "--flood-pairs",
        type=int,
        default=FLOOD_PAIRS,
        metavar="N",
        help=f"idle and flood windows each flood phase alternates (default {FLOOD_PAIRS})",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="only count the gateway's instructions per relayed call under callgrind (needs "
        "valgrind; one executor, one caller): sequential, then 64 in flight",
    )
    parser.add_argument(
        "--instructions-calls",
        type=int,
        default=640,
        metavar="N",
        help="with --instructions: calls counted in each of the two phases (default 640)",
    )
    parser.add_argument(
        "--instructions-receipt-delay",
        type=float,
        default=INSTRUCTIONS_RECEIPT_DELAY,
        metavar="SECONDS",
        help="with --instructions: the gateway's receipt_delay (default "
        f"{INSTRUCTIONS_RECEIPT_DELAY:g}; the library's own is 0.005)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="only measure CPU time per call of each process (/proc), 64 calls in flight, "
        "through a gateway and direct (one executor, one caller)",
    )
    parser.add_argument(
        "--cpu-calls",
        type=int,
        default=64_000,
        metavar="N",
        help="with --cpu: calls measured in each arrangement (default 64,000)",
    )
    parser.add_argument(
        "--instructions-metadata",
        action="store_true",
        help="with --instructions: every call carries metadata, added by a client hook (as a "
        "tracing hook adds its context)",
    )
    parser.add_argument(
        "--callgrind-dir",
        type=Path,
        metavar="DIR",
        help="with --instructions: keep the two callgrind dumps in DIR",
    )
    parser.add_argument(
        "--profile-gateway",
        type=Path,
        metavar="PATH",
        help="run the gateway child under cProfile (not the CLI) and write its stats to PATH; "
        "CPU-time profiling slows the gateway several times over, and the flood phases with it",
    )
    args = parser.parse_args(argv)
    if args.command == "workers":
        anyio.run(_workers_main, args.url, args.keyring, args.count)
        return 0
    if args.command == "flood":
        anyio.run(_flooder_main, args.url, args.secret, args.caller_id, args.kind, args.nice)
        return 0
    if args.command == "gateway":
        anyio.run(_gateway_main, args.config, args.profile)
        return 0
    if args.command == "caller":
        anyio.run(_caller_main, args.mode, args.where, args.metadata)
        return 0
    try:
        args.floods = flood_kinds(args.floods)
    except ValueError as exc:
        parser.error(str(exc))
    if args.quick:
        args.executors, args.calls, args.seconds, args.maps = 20, 300, 1.0, 2
    if args.cpu:
        args.executors, args.callers = 1, 1
        doc = anyio.run(_main, args)
        cores = os.cpu_count() or 1
        for arrangement in ("gateway", "direct"):
            used = {
                key.split("_")[1]: value
                for key, value in doc.items()
                if key.startswith(f"{arrangement}_") and key.endswith("_cpu_us_per_call")
            }
            doc[f"{arrangement}_bound_here"], doc[f"{arrangement}_bound_core_each"] = cpu_bounds(
                used, cores
            )
            print(
                f"{arrangement}: {doc[f'{arrangement}_calls_per_s_64']:.0f} calls/s; CPU per "
                f"call {', '.join(f'{k} {v:.1f} us' for k, v in used.items())}, total "
                f"{sum(used.values()):.1f} us; CPU-bound calls/s on {cores} cores "
                f"{doc[f'{arrangement}_bound_here']:.0f}, with a core per process "
                f"{doc[f'{arrangement}_bound_core_each']:.0f}",
                file=sys.stderr,
            )
        for bound in ("bound_here", "bound_core_each"):
            doc[f"{bound}_ratio"] = doc[f"gateway_{bound}"] / doc[f"direct_{bound}"]
        print(
            f"gateway/direct calls/s: measured "
            f"{doc['gateway_calls_per_s_64'] / doc['direct_calls_per_s_64']:.2f}x; as the CPU "
            f"per call bounds it on {cores} cores {doc['bound_here_ratio']:.2f}x, with a core "
            f"per process {doc['bound_core_each_ratio']:.2f}x",
            file=sys.stderr,
        )
        print(json.dumps(doc, indent=2))
        return 0
    if args.instructions:
        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            parser.error("--instructions needs valgrind (callgrind_control)")
        if args.instructions_calls < 1:
            parser.error("--instructions-calls must be at least 1")
        args.executors, args.callers = 1, 1
        doc = anyio.run(_main, args)
        print(json.dumps(doc, indent=2))
        for phase, label in (("sequential", "sequential"), ("in_flight_64", "64 in flight")):
            print(
                f"instructions per call, {label}: gateway "
                f"{doc[f'{phase}_gateway_instructions_per_call'] / 1000:.0f}k, caller through "
                f"it {doc[f'{phase}_caller_instructions_per_call'] / 1000:.0f}k, caller of a "
                f"direct fleet {doc[f'{phase}_direct_instructions_per_call'] / 1000:.0f}k; "
                f"writer wake-ups per call, gateway / caller / direct: "
                f"{doc[f'{phase}_gateway_writer_wakeups_per_call']:.3f} / "
                f"{doc[f'{phase}_caller_writer_wakeups_per_call']:.3f} / "
                f"{doc[f'{phase}_direct_writer_wakeups_per_call']:.3f}",
                file=sys.stderr,
            )
        return 0
    if args.flood_pairs < 1:
        parser.error("--flood-pairs must be at least 1")
    if args.floods_only:
        args.executors = 1
        figures = anyio.run(_main, args)
        print(json.dumps(figures, indent=2))
        _print_floods(figures, args)
        return 0
    if args.floor_instructions:
        if shutil.which("valgrind") is None:
            parser.error("--floor-instructions needs valgrind")
        if args.instructions_calls < 1:
            parser.error("--instructions-calls must be at least 1")
        counts = anyio.run(relayfloor.instructions, PAYLOAD, args.instructions_calls)
        print(json.dumps(counts, indent=2))
        print(
            "instructions per sequential call forwarded: byte proxy "
            f"{counts['bytes_instructions_per_call'] / 1000:.0f}k, wsproto relay "
            f"{counts['ws_instructions_per_call'] / 1000:.0f}k",
            file=sys.stderr,
        )
        return 0
    if args.floor_only:
        args.executors, args.callers = 1, 1
        floor = anyio.run(_main, args)
        print(json.dumps(floor, indent=2))
        print(
            f"floor p50 {floor['direct_p50_us']:.0f} us direct, {floor['bytes_p50_us']:.0f} us "
            f"through the byte proxy ({floor['bytes_p50_factor']:.2f}x), "
            f"{floor['ws_p50_us']:.0f} us through the wsproto relay "
            f"({floor['ws_p50_factor']:.2f}x); calls/s with 64 in flight "
            f"{floor['direct_calls_per_s_64']:.0f}, {floor['bytes_calls_per_s_64']:.0f} "
            f"({floor['bytes_calls_per_s_ratio']:.2f}x), {floor['ws_calls_per_s_64']:.0f} "
            f"({floor['ws_calls_per_s_ratio']:.2f}x)",
            file=sys.stderr,
        )
        return 0
    doc = anyio.run(_main, args)
    text = json.dumps(doc, indent=2, default=str)
    if args.output is not None:
        args.output.write_text(text + "\n", encoding="utf-8")
    print(text)
    d, g, r = doc["direct"], doc["gateway"], doc["ratios"]
    print(f"{'':<22}{'direct':>12}{'gateway':>12}{'ratio':>9}", file=sys.stderr)
    print(
        f"{'p50 (us)':<22}{d['p50_us']:>12.0f}{g['p50_us']:>12.0f}{r['p50_factor']:>9.2f}",
        file=sys.stderr,
    )
    print(
        f"{'calls/s, 64 in flight':<22}{d['calls_per_s_64']:>12.0f}{g['calls_per_s_64']:>12.0f}"
        f"{r['calls_per_s_ratio']:>9.2f}",
        file=sys.stderr,
    )
    print(
        f"{'map, all callers (s)':<22}{d['map_s']:>12.3f}{g['map_s']:>12.3f}"
        f"{r['map_factor']:>9.2f}",
        file=sys.stderr,
    )
    f = doc["floor"]
    for kind, label in (("bytes", "byte proxy"), ("ws", "wsproto relay")):
        print(
            f"{'floor p50 (us), ' + label:<34}{f['direct_p50_us']:>8.0f}{f[kind + '_p50_us']:>8.0f}"
            f"{f[kind + '_p50_factor']:>7.2f}x; calls/s {f['direct_calls_per_s_64']:>6.0f}"
            f"{f[kind + '_calls_per_s_64']:>7.0f}{f[kind + '_calls_per_s_ratio']:>7.2f}x",
            file=sys.stderr,
        )
    print(
        f"CPU per call forwarded, 64 in flight: byte proxy "
        f"{f['bytes_proxy_cpu_us_per_call_64']:.1f} us, wsproto relay "
        f"{f['ws_proxy_cpu_us_per_call_64']:.1f} us, gateway "
        f"{g['gateway_cpu_us_per_call_64']:.1f} us",
        file=sys.stderr,
    )
    print(
        f"hop: floor (byte proxy) {r['floor_bytes_p50_factor']:.2f}x p50, "
        f"{r['floor_bytes_calls_per_s_ratio']:.2f}x calls/s; ours {r['p50_factor']:.2f}x, "
        f"{r['calls_per_s_ratio']:.2f}x; ours over the floor hop {r['p50_factor_over_floor']:.2f}x"
        f" p50, {r['calls_per_s_ratio_over_floor']:.2f}x calls/s",
        file=sys.stderr,
    )
    _print_floods(g, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
