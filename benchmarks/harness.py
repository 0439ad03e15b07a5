"""Measurement, statistics and child-process management of the benchmark runner.

Each entry (see ``systems.py``) runs as follows: its server starts in a child process
(``python -m benchmarks.servers.<name> --port 0``, which prints ``READY <port>``), then each
repetition measures, each on fresh connections,

* latency: sequential round trips of a small payload, p50 and p99 after a warm-up;
* throughput: calls per second with ``concurrency`` calls in flight (one shared connection
  and as many tasks for asyncio clients, one connection per thread for synchronous ones);
* bulk: sequential round trips of a 1 MiB payload, in MB/s (10**6 bytes of argument per
  second of round trips; the echo moves twice that over the socket);

and the server is stopped.  A figure is the median of the repetitions, reported with their
minimum and maximum.  Every loop is bounded in count and time; no server outlives the run.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib.metadata
import math
import os
import platform
import queue
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any, TextIO

from . import eventloop
from .systems import Entry

ROOT = Path(__file__).resolve().parent.parent
"""The directory holding the ``benchmarks`` package: the children's working directory."""

PACKAGES = (
    "garcon-link",
    "anyio",
    "wsproto",
    "h11",
    "websockets",
    "rpyc",
    "Pyro5",
    "serpent",
    "grpcio",
    "uvloop",
)
"""Distributions whose versions are recorded with the results."""


@dataclass(frozen=True)
class Settings:
    """How much to measure.  The defaults are the full run (``make bench``)."""

    repetitions: int = 5
    small_bytes: int = 32
    latency_warmup: int = 500
    latency_calls: int = 5000
    concurrency: int = 64
    throughput_warmup_s: float = 1.0
    throughput_s: float = 5.0
    bulk_bytes: int = 1 << 20
    bulk_warmup: int = 2
    bulk_min_calls: int = 5
    bulk_max_calls: int = 10_000
    bulk_s: float = 2.0
    limit_s: float = 120.0
    """Upper bound of any one measurement (or of stopping one); past it the entry fails."""
    server_start_s: float = 30.0

    def quick(self) -> Settings:
        """Tiny counts that only show the harness works (the smoke test)."""
        return replace(
            self,
            repetitions=1,
            latency_warmup=20,
            latency_calls=200,
            throughput_warmup_s=0.2,
            throughput_s=1.0,
            bulk_warmup=1,
            bulk_min_calls=3,
            bulk_s=0.2,
            limit_s=30.0,
            server_start_s=20.0,
        )


class MeasurementError(RuntimeError):
    """A measurement went wrong: a wrong echo, a timeout, a server that did not start."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


# --------------------------------------------------------------------------- statistics


def percentile(sorted_values: list[int] | list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of already sorted values."""
    if not sorted_values:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def summarize(values: list[float]) -> dict[str, Any]:
    """The figure of a metric over the repetitions: median, min, max and the values."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


# ------------------------------------------------------------------ machine and CPU steal


@dataclass(frozen=True)
class CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat, in clock ticks of all CPUs together."""

    steal: int
    idle: int
    total: int


def read_cpu_times() -> CpuTimes | None:
    """The machine's CPU steal, idle and total time so far (None without /proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
    ticks = [int(value) for value in fields[1:9]]
    ticks += [0] * (8 - len(ticks))
    return CpuTimes(steal=ticks[7], idle=ticks[3] + ticks[4], total=sum(ticks))


def cpu_between(
    before: CpuTimes | None,
    after: CpuTimes | None,
    own_cpu_seconds: float,
) -> dict[str, Any] | None:
    """What the machine's CPUs did over an interval.

    ``steal_percent``: CPU steal, in percent of all CPU time (the hypervisor's other guests).
    ``other_load_percent``: CPU time used by processes other than the runner and its
    servers (``own_cpu_seconds``), in percent of all CPU time: on a shared machine, the
    neighbours that disturb the figures without showing up as steal.
    """
    if before is None or after is None:
        return None
    steal = after.steal - before.steal
    total = after.total - before.total
    busy = total - (after.idle - before.idle) - steal
    own = own_cpu_seconds * os.sysconf("SC_CLK_TCK")
    return {
        "steal_ticks": steal,
        "total_ticks": total,
        "steal_percent": 100.0 * steal / total if total > 0 else 0.0,
        "other_load_percent": 100.0 * max(0.0, busy - own) / total if total > 0 else 0.0,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024**2, 1)
    except (OSError, ValueError):
        pass
    return None


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that matter here (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def describe_machine() -> dict[str, Any]:
    """What the figures were measured on."""
    usable: int | None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "python_executable": sys.executable,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "packages": package_versions(),
    }


# ---------------------------------------------------------------------- child processes

_LIVE: set[ServerProcess] = set()


class ServerProcess:
    """A benchmark server in a child process, in a session of its own.

    The child exits by itself when its stdin closes (so also when the runner dies) or after
    ``--max-seconds``; :meth:`stop` closes stdin, then signals the child's process group.
    """

    def __init__(self, module: str, loop: str, start_timeout: float, max_seconds: float) -> None:
        self.module = module
        self.command = [
            sys.executable,
            "-m",
            f"benchmarks.servers.{module}",
            "--port",
            "0",
            "--loop",
            loop,
            "--max-seconds",
            f"{max_seconds:.0f}",
        ]
        self._start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self.port = 0

    def start(self) -> int:
        """Start the child and return the port it reported."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self._process = subprocess.Popen(
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        _LIVE.add(self)
        lines: queue.Queue[bytes | None] = queue.Queue()
        stdout = self._process.stdout
        assert stdout is not None

        def read_stdout() -> None:  # also drains anything printed later
            for line in stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read_stdout, name=f"{self.module}-stdout", daemon=True).start()
        deadline = time.monotonic() + self._start_timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                code = self._process.wait()
                raise MeasurementError(
                    f"server {self.module} exited with code {code}: {self.stderr_last_line()}",
                    self.stderr_tail(),
                )
            text = line.decode(errors="replace").strip()
            if text.startswith("READY "):
                self.port = int(text.split()[1])
                return self.port
        raise MeasurementError(
            f"server {self.module} did not report READY within {self._start_timeout:.0f} s: "
            f"{self.stderr_last_line()}",
            self.stderr_tail(),
        )

    def stderr_tail(self, limit: int = 2000) -> str:
        """The end of what the child wrote on stderr."""
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return text[-limit:] or "(nothing on stderr)"

    def stderr_last_line(self) -> str:
        """The last line the child wrote on stderr (for a Python error: the exception)."""
        return self.stderr_tail().splitlines()[-1]

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the child used so far, from /proc (None elsewhere)."""
        if self._process is None or self._process.poll() is not None:
            return None
        try:
            with open(f"/proc/{self._process.pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            return None
        # after the command name: state is field 3, utime 14 and stime 15 (1-based)
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Stop the child and its process group; never leaves one behind."""
        process = self._process
        if process is None:
            return
        try:
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
            try:
                process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, sig)
                    try:
                        process.wait(timeout=wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        finally:
            _LIVE.discard(self)
            if process.stdout is not None:
                with contextlib.suppress(OSError):
                    process.stdout.close()
            if self._stderr is not None:
                self._stderr.close()
                self._stderr = None
            self._process = None

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def stop_all_servers() -> None:
    """Stop every child still running (on error, signal or exit)."""
    for server in list(_LIVE):
        server.stop()


atexit.register(stop_all_servers)


@contextlib.contextmanager
def signals_end_the_run() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into SystemExit so that the children are stopped."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):  # not the main thread, or no SIGHUP
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# ------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class SequentialPlan:
    """Sequential round trips: ``warmup`` untimed, then from ``min_calls`` (and at least
    ``min_s`` seconds) to ``max_calls`` timed ones, all within ``limit_s``."""

    warmup: int
    min_calls: int
    max_calls: int
    min_s: float
    limit_s: float


def _check(reply: bytes, payload: bytes) -> None:
    if reply != payload:
        raise MeasurementError(
            f"wrong echo: sent {len(payload)} bytes, got {len(reply)} bytes back"
            + (" (different)" if len(reply) == len(payload) else "")
        )


class _Deadline:
    def __init__(self, plan: SequentialPlan) -> None:
        now = time.perf_counter_ns()
        self.limit_ns = now + int(plan.limit_s * 1e9)
        self.plan = plan

    def timed_out(self, what: str) -> MeasurementError:
        return MeasurementError(f"{what} took longer than {self.plan.limit_s:.0f} s")


class AsyncDriver:
    """Measures an asyncio client on an event loop of its own (one per entry)."""

    def __init__(self, connect: Callable[[int], Any], loop: str) -> None:
        self._connect = connect
        self._runner = asyncio.Runner(loop_factory=eventloop.factory(loop))

    def close(self) -> None:
        self._runner.close()

    def _run(self, coroutine: Any, limit_s: float, what: str) -> Any:
        try:
            return self._runner.run(asyncio.wait_for(coroutine, limit_s + 5.0))
        except TimeoutError:
            raise MeasurementError(f"{what} took longer than {limit_s:.0f} s") from None

    def sequential(self, port: int, payload: bytes, plan: SequentialPlan) -> list[int]:
        return list(self._run(self._sequential(port, payload, plan), plan.limit_s, "calls"))

    async def _sequential(self, port: int, payload: bytes, plan: SequentialPlan) -> list[int]:
        deadline = _Deadline(plan)
        clock = time.perf_counter_ns
        samples: list[int] = []
        async with self._connect(port) as client:
            call = client.call
            for _ in range(plan.warmup):
                _check(await call(payload), payload)
            min_end = clock() + int(plan.min_s * 1e9)
            while len(samples) < plan.max_calls:
                start = clock()
                reply = await call(payload)
                end = clock()
                samples.append(end - start)
                _check(reply, payload)
                if len(samples) >= plan.min_calls and end >= min_end:
                    break
                if end >= deadline.limit_ns:
                    raise deadline.timed_out("sequential calls")
        return samples

    def throughput(self, port: int, payload: bytes, settings: Settings) -> tuple[int, float]:
        limit = settings.throughput_warmup_s + settings.throughput_s + settings.limit_s
        result = self._run(self._throughput(port, payload, settings), limit, "throughput")
        return int(result[0]), float(result[1])

    async def _throughput(self, port: int, payload: bytes, settings: Settings) -> tuple[int, float]:
        counts = [0] * settings.concurrency
        stopping = False
        async with self._connect(port) as client:
            call = client.call

            async def worker(index: int) -> None:
                while not stopping:
                    _check(await call(payload), payload)
                    counts[index] += 1

            tasks = [asyncio.create_task(worker(i)) for i in range(settings.concurrency)]
            try:
                await self._wait_failing(tasks, settings.throughput_warmup_s)
                calls_before, start = sum(counts), time.perf_counter()
                await self._wait_failing(tasks, settings.throughput_s)
                calls_after, end = sum(counts), time.perf_counter()
                stopping = True
                await asyncio.wait_for(asyncio.gather(*tasks), settings.limit_s)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return calls_after - calls_before, end - start

    @staticmethod
    async def _wait_failing(tasks: list[asyncio.Task[None]], seconds: float) -> None:
        """Let the workers run for ``seconds``; raise at once if one of them fails."""
        done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a worker only ends early by failing
        if done:
            raise MeasurementError("a throughput worker stopped early")


class SyncDriver:
    """Measures a synchronous client: sequential calls in this thread, throughput in threads."""

    def __init__(self, connect: Callable[[int], Any], loop: str) -> None:
        self._connect = connect

    def close(self) -> None:
        pass

    def sequential(self, port: int, payload: bytes, plan: SequentialPlan) -> list[int]:
        deadline = _Deadline(plan)
        clock = time.perf_counter_ns
        samples: list[int] = []
        with self._connect(port) as client:
            call = client.call
            for _ in range(plan.warmup):
                _check(call(payload), payload)
            min_end = clock() + int(plan.min_s * 1e9)
            while len(samples) < plan.max_calls:
                start = clock()
                reply = call(payload)
                end = clock()
                samples.append(end - start)
                _check(reply, payload)
                if len(samples) >= plan.min_calls and end >= min_end:
                    break
                if end >= deadline.limit_ns:
                    raise deadline.timed_out("sequential calls")
        return samples

    def throughput(self, port: int, payload: bytes, settings: Settings) -> tuple[int, float]:
        threads_count = settings.concurrency
        counts = [0] * threads_count
        errors: list[BaseException] = []
        stopping = threading.Event()
        ready = threading.Barrier(threads_count + 1, timeout=settings.limit_s)

        def worker(index: int) -> None:
            try:
                with self._connect(port) as client:
                    call = client.call
                    ready.wait()
                    while not stopping.is_set():
                        _check(call(payload), payload)
                        counts[index] += 1
            except BaseException as exc:
                errors.append(exc)
                ready.abort()
                stopping.set()

        threads = [
            threading.Thread(target=worker, args=(i,), name=f"bench-{i}", daemon=True)
            for i in range(threads_count)
        ]
        for thread in threads:
            thread.start()
        try:
            try:
                ready.wait()
            except threading.BrokenBarrierError:
                raise self._failure(errors, "connecting") from None
            if stopping.wait(settings.throughput_warmup_s):
                raise self._failure(errors, "warm-up")
            calls_before, start = sum(counts), time.perf_counter()
            if stopping.wait(settings.throughput_s):
                raise self._failure(errors, "measurement")
            calls_after, end = sum(counts), time.perf_counter()
        finally:
            stopping.set()
            ready.abort()
            join_deadline = time.monotonic() + settings.limit_s
            for thread in threads:
                thread.join(max(0.0, join_deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            raise MeasurementError(f"client threads still busy after {settings.limit_s:.0f} s")
        if errors:
            raise self._failure(errors, "stopping")
        return calls_after - calls_before, end - start

    @staticmethod
    def _failure(errors: list[BaseException], phase: str) -> MeasurementError:
        first = errors[0] if errors else None
        error = MeasurementError(f"a client thread failed during {phase}: {first!r}")
        error.__cause__ = first
        return error


# ---------------------------------------------------------------------------- entries


def _payload(size: int, seed: int) -> bytes:
    """Incompressible, reproducible bytes (no stack gains from compressing them)."""
    return random.Random(seed).randbytes(size)


def _client_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def describe_error(error: BaseException) -> tuple[str, str]:
    """One line for the report, and the details (traceback or the server's stderr)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, MeasurementError):
        summary = str(error)
        detail = error.detail or "".join(traceback.format_exception(error))
    else:
        summary = f"{type(error).__name__}: {error}"
        detail = "".join(traceback.format_exception(error))
    return " ".join(summary.split()), detail


def run_measurement(
    name: str,
    description: str,
    settings: dict[str, Any],
    measure: Callable[[], dict[str, Any]],
    log: TextIO,
) -> dict[str, Any]:
    """One garcon_link-only entry (``resume.py``, ``fleet.py``): ``measure()`` gives its
    ``figures`` and ``runs``; never raises but for KeyboardInterrupt/SystemExit."""
    result: dict[str, Any] = {
        "name": name,
        "kind": "ours",
        "description": description,
        "status": "ok",
        "note": "",
        "settings": settings,
        "figures": [],
        "runs": [],
    }
    started = time.perf_counter()
    cpu_before = read_cpu_times()
    try:
        result.update(measure())
    except Exception as exc:
        result["status"] = "error"
        result["note"], result["error_detail"] = describe_error(exc)
        print(f"[{name}] error: {result['error_detail']}", file=log, flush=True)
    result["seconds"] = time.perf_counter() - started
    result["cpu"] = cpu_between(cpu_before, read_cpu_times(), 0.0)
    return result


def run_entry(
    entry: Entry, settings: Settings, loop: str, log: TextIO = sys.stderr
) -> dict[str, Any]:
    """Measure one entry; the result says ``ok``, ``not installed``, ``not available`` or
    ``error`` (with a note), never raises but for KeyboardInterrupt/SystemExit."""
    result: dict[str, Any] = {
        "name": entry.name,
        "kind": entry.kind,
        "description": entry.description,
        "settings_note": entry.settings_note,
        "status": "ok",
        "note": "",
        "metrics": {},
        "runs": [],
    }
    skip = entry.skip_reason()
    if skip is not None:
        result["status"], result["note"] = skip
        print(f"[{entry.name}] skipped: {skip[0]} ({skip[1]})", file=log, flush=True)
        return result

    small = _payload(settings.small_bytes, 1)
    bulk = _payload(settings.bulk_bytes, 2)
    latency_plan = SequentialPlan(
        warmup=settings.latency_warmup,
        min_calls=settings.latency_calls,
        max_calls=settings.latency_calls,
        min_s=0.0,
        limit_s=settings.limit_s,
    )
    bulk_plan = SequentialPlan(
        warmup=settings.bulk_warmup,
        min_calls=settings.bulk_min_calls,
        max_calls=settings.bulk_max_calls,
        min_s=settings.bulk_s,
        limit_s=settings.limit_s,
    )
    cpu_before, wall_before = read_cpu_times(), time.perf_counter()
    client_cpu_before = _client_cpu_seconds()
    result["server_cpu_seconds"] = None
    runs: list[dict[str, Any]] = result["runs"]
    try:
        mode, connect = entry.load_client()
        driver_type = AsyncDriver if mode == "async" else SyncDriver
        result["client_mode"] = mode
        max_seconds = 4 * settings.limit_s + settings.repetitions * (
            settings.throughput_warmup_s + settings.throughput_s + settings.limit_s
        )
        with ServerProcess(entry.server, loop, settings.server_start_s, max_seconds) as server:
            driver = driver_type(connect, loop)
            try:
                for repetition in range(1, settings.repetitions + 1):
                    samples = sorted(driver.sequential(server.port, small, latency_plan))
                    calls, seconds = driver.throughput(server.port, small, settings)
                    bulk_samples = driver.sequential(server.port, bulk, bulk_plan)
                    run = {
                        "latency_p50_us": percentile(samples, 50) / 1e3,
                        "latency_p99_us": percentile(samples, 99) / 1e3,
                        "latency_mean_us": statistics.fmean(samples) / 1e3,
                        "latency_calls": len(samples),
                        "throughput_calls_per_s": calls / seconds,
                        "throughput_calls": calls,
                        "throughput_seconds": seconds,
                        "bulk_mb_per_s": len(bulk) * len(bulk_samples) / sum(bulk_samples) * 1e3,
                        "bulk_calls": len(bulk_samples),
                    }
                    runs.append(run)
                    print(
                        f"[{entry.name}] {repetition}/{settings.repetitions}: "
                        f"p50 {run['latency_p50_us']:.1f} us, p99 {run['latency_p99_us']:.1f} us"
                        f" | {run['throughput_calls_per_s']:,.0f} calls/s"
                        f" | {run['bulk_mb_per_s']:.1f} MB/s",
                        file=log,
                        flush=True,
                    )
            finally:
                driver.close()
                result["server_cpu_seconds"] = server.cpu_seconds()
    except Exception as exc:
        result["status"] = "error"
        result["note"], result["error_detail"] = describe_error(exc)
        print(f"[{entry.name}] error: {result['error_detail']}", file=log, flush=True)
    result["client_cpu_seconds"] = _client_cpu_seconds() - client_cpu_before
    result["seconds"] = time.perf_counter() - wall_before
    own = result["client_cpu_seconds"] + (result["server_cpu_seconds"] or 0.0)
    result["cpu"] = cpu_between(cpu_before, read_cpu_times(), own)
    if result["status"] == "ok":
        for metric in (
            "latency_p50_us",
            "latency_p99_us",
            "throughput_calls_per_s",
            "bulk_mb_per_s",
        ):
            result["metrics"][metric] = summarize([run[metric] for run in runs])
    return result


def run(
    entries: list[Entry], settings: Settings, loop_choice: str, log: TextIO = sys.stderr
) -> dict[str, Any]:
    """Measure the entries one after the other; the document written as JSON."""
    loop = eventloop.resolve(loop_choice)
    started = time.time()
    machine = describe_machine()
    wall_before, cpu_before = time.perf_counter(), read_cpu_times()
    client_cpu_before = _client_cpu_seconds()
    results = []
    try:
        for entry in entries:
            results.append(run_entry(entry, settings, loop, log))
    finally:
        stop_all_servers()
    return {
        "schema": 1,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": time.perf_counter() - wall_before,
        "settings": asdict(settings),
        "event_loop": loop,
        "machine": machine,
        "cpu": cpu_between(
            cpu_before,
            read_cpu_times(),
            _client_cpu_seconds()
            - client_cpu_before
            + sum(entry.get("server_cpu_seconds") or 0.0 for entry in results),
        ),
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "entries": results,
    }
