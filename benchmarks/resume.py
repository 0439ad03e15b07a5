"""garcon_link-only measurements: resume latency after a cut, and RSS with retention full.

Neither has a counterpart among the floors and peers, so they are reported in a table of their
own ("garcon_link resume and memory"), each figure next to its target.

``resume``
    A worker in a child process (``python -m benchmarks.resume worker``, the same READY protocol
    as ``benchmarks/servers``) and a controller in the runner, connected through a
    :class:`~garcon_link.testing.FaultProxy` that also runs in the runner, on the controller's
    event loop. For each N in ``frames``: connect, wait until nothing is retained, blackhole the
    proxy, send N one-way notifications of 32 bytes (retained: no receipt can come back), then
    ``cut()`` and ``heal()`` the proxy. The figure is the time from the cut until the
    controller's transport is ``READY`` again on a new socket (past its replay fence) *and*
    every retained frame is confirmed (``retained_frames == 0``); the time to the fence alone is
    recorded too. The controller redials at once: the first retry after a cut is immediate by
    design (``backoff``), and the time bounds are shrunk on both ends (:data:`RESUME_LIMITS`).
    The worker's receipts keep the default ``receipt_delay`` (5 ms), which the last, lone
    receipt of a replay may wait. Every repetition uses a new proxy and a new controller; one
    untimed warm-up comes first.

``retention-rss``
    The controller alone in a child process (``python -m benchmarks.resume rss``) with the
    default :class:`~garcon_link.Limits` (retention budget ``max_retained_bytes``, 32 MiB),
    connected to the worker child through a FaultProxy that it runs itself. After a warm-up it
    reads its own ``VmRSS`` (``/proc/self/status``), blackholes the proxy (the worker is
    unreachable; the session stays attached and ``READY``), then sends 64 KiB one-way
    notifications until a send blocks for :data:`BLOCK_S` (retention full), and reads
    ``VmRSS`` and ``VmHWM`` again. Reported: the RSS with retention full and its growth over the
    pre-fill baseline, against the budget. The proxy's memory (at most a held 64 KiB chunk per
    direction) is counted against us.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TextIO

import anyio

import garcon_link as gl
from garcon_link.endpoint.transport import SessionTransport, TransportState
from garcon_link.testing import FaultProxy

from . import eventloop, harness

MiB = 1024 * 1024
_SECRET = gl.Secret(b"garcon-link-benchmark-secret-000")
_EXECUTOR = "bench-resume"

NAMES = ("resume", "retention-rss")
"""The entries of this module, as ``--only`` names them (kind ``ours``)."""

DESCRIPTIONS = {
    "resume": "garcon_link resume latency after a cut, 0/100/4,096 retained frames",
    "retention-rss": "garcon_link controller RSS with the worker unreachable, retention full",
}

RESUME_TARGET_MS = 50.0
"""Target: resume with 4,096 retained frames within 50 ms on loopback."""
RESUME_TARGET_FRAMES = 4096
RSS_ALLOWANCE_MIB = 30.0
"""Target: RSS with retention full within the retention budget + 30 MiB."""

RESUME_LIMITS = gl.Limits(
    heartbeat_interval=0.2,
    heartbeat_timeout=5.0,
    backoff_base=0.001,
    backoff_max=0.01,
    connect_timeout=2.0,
)
"""Both ends of ``resume``: immediate redials, short heartbeats (still long enough that the
blackhole while N frames are sent does not time the socket out); every other bound default."""

QUIET_S = 0.05
"""Pause between connecting (everything confirmed) and the blackhole of a ``resume`` run."""

BLOCK_S = 0.5
"""A notification that does not return within this long is blocked: retention is full."""


class Sink(Protocol):
    @gl.oneway
    async def drop(self, seq: int, data: bytes) -> None: ...


class _SinkImpl:
    @gl.oneway
    async def drop(self, seq: int, data: bytes) -> None:
        """Nothing to do: what is measured is the session's receipts."""


@dataclass(frozen=True)
class ResumeSettings:
    """How much to measure (from the runner's settings and ``--quick``)."""

    repetitions: int = 5
    frames: tuple[int, ...] = (0, 100, RESUME_TARGET_FRAMES)
    notification_bytes: int = 32
    rss_payload_bytes: int = 64 * 1024
    limit_s: float = 120.0
    server_start_s: float = 30.0

    @classmethod
    def from_runner(cls, settings: harness.Settings, quick: bool) -> ResumeSettings:
        return cls(
            repetitions=settings.repetitions,
            frames=(0, 64, 512) if quick else cls.frames,
            notification_bytes=settings.small_bytes,
            limit_s=settings.limit_s,
            server_start_s=settings.server_start_s,
        )


# ------------------------------------------------------------------------------ helpers


def _payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _config(port_or_url: int | str) -> gl.LinkConfig:
    if isinstance(port_or_url, int):
        return gl.LinkConfig(
            executor_id=_EXECUTOR,
            role=gl.Role.WORKER,
            secret=_SECRET,
            listen=("127.0.0.1", port_or_url),
        )
    return gl.LinkConfig(
        executor_id=_EXECUTOR, role=gl.Role.CONTROLLER, secret=_SECRET, dial=port_or_url
    )


async def _until(check: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll ``check`` once per event-loop iteration, for at most ``seconds``."""
    with anyio.move_on_after(seconds):
        while not check():
            await anyio.sleep(0)
        return
    raise harness.MeasurementError(f"{what}: not within {seconds:g} s")


def _transport(executor: gl.RemoteExecutor) -> SessionTransport:
    transport = executor.link.transport
    if transport is None:
        raise harness.MeasurementError("the controller has no session")
    return transport


@asynccontextmanager
async def _controller(
    port: int, limits: gl.Limits
) -> AsyncIterator[tuple[FaultProxy, Sink, SessionTransport]]:
    """A controller connected to the worker on ``port`` through a new FaultProxy."""
    async with FaultProxy("127.0.0.1", port) as proxy:
        config = _config(proxy.url("/executor"))
        async with gl.connect(config, limits=limits) as executor:
            await executor.wait_ready(timeout=10)
            yield proxy, executor.service("sink", Sink), _transport(executor)


def read_memory() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes (from ``/proc/self/status``)."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError as exc:
        raise harness.MeasurementError(f"cannot read /proc/self/status: {exc}") from exc
    if len(found) != 2:
        raise harness.MeasurementError("/proc/self/status has no VmRSS/VmHWM")
    return found


# -------------------------------------------------------------------- the worker child


async def serve(port: int, on_ready: Callable[[int], None]) -> None:
    """Serve the no-op ``sink`` with :data:`RESUME_LIMITS` on 127.0.0.1:``port``."""
    services = {"sink": gl.Service(_SinkImpl(), Sink)}
    async with gl.Worker(_config(port), services, limits=RESUME_LIMITS) as worker:
        on_ready(worker.link.listen_address[1])
        await anyio.sleep_forever()


def _worker_process(
    loop: str, settings: ResumeSettings, max_seconds: float
) -> harness.ServerProcess:
    """A :class:`harness.ServerProcess` running ``python -m benchmarks.resume worker``."""
    server = harness.ServerProcess("ours", loop, settings.server_start_s, max_seconds)
    server.module = "resume-worker"
    server.command = [
        sys.executable,
        "-m",
        "benchmarks.resume",
        "worker",
        *server.command[server.command.index("--port") :],
    ]
    return server


# ------------------------------------------------------------------- resume after a cut


async def _resume_once(port: int, frames: int, settings: ResumeSettings) -> dict[str, Any]:
    """One cut with ``frames`` retained: times from the cut to the fence and to confirmation."""
    payload = _payload(settings.notification_bytes, 3)
    limit = settings.limit_s
    async with _controller(port, RESUME_LIMITS) as (proxy, sink, transport):
        await _until(
            lambda: transport.statistics().session.retained_frames == 0,
            limit,
            "settling before the cut",
        )
        await anyio.sleep(QUIET_S)  # both ends idle: no earlier work in the figure
        proxy.blackhole()
        for seq in range(frames):
            await sink.drop(seq, payload)
        before = transport.statistics()
        if before.state is not TransportState.READY:
            raise harness.MeasurementError(
                f"the socket ended before the cut ({before.state.value})"
            )
        if before.session.retained_frames < frames:
            raise harness.MeasurementError(
                f"{before.session.retained_frames} frames retained, expected {frames}"
            )
        session_id = transport.session_id
        clock = time.perf_counter_ns
        changes: list[tuple[TransportState, int]] = []
        unsubscribe = transport.add_listener(lambda state: changes.append((state, clock())))
        try:
            start = clock()
            proxy.cut()
            proxy.heal()

            def resumed() -> bool:
                stats = transport.statistics()
                if stats.state is TransportState.RETIRED:
                    raise harness.MeasurementError(f"session retired: {transport.failure}")
                return (
                    stats.attachments > before.attachments
                    and stats.state is TransportState.READY
                    and stats.session.retained_frames == 0
                )

            await _until(resumed, limit, f"resume with {frames} retained frames")
            end = clock()
        finally:
            unsubscribe()
        after = transport.statistics()
        first = dict(reversed(changes))  # the first time of each state
        if transport.session_id != session_id or TransportState.READY not in first:
            raise harness.MeasurementError("a new session started instead of a resume")

        def since_cut(state: TransportState) -> float | None:
            return (first[state] - start) / 1e6 if state in first else None

        return {
            "frames": frames,
            "retained_frames_at_cut": before.session.retained_frames,
            "retained_bytes_at_cut": before.session.retained_bytes,
            "resume_ms": (end - start) / 1e6,
            "fence_ms": since_cut(TransportState.READY),
            "detached_ms": since_cut(TransportState.DETACHED),
            "reattached_ms": since_cut(TransportState.REPLAYING),
            "replayed_frames": after.session.replayed_frames - before.session.replayed_frames,
            "attachments": after.attachments - before.attachments,
        }


async def _resume_all(port: int, settings: ResumeSettings, log: TextIO) -> list[dict[str, Any]]:
    await _resume_once(port, max(settings.frames), settings)  # warm-up, not recorded
    runs: list[dict[str, Any]] = []
    for repetition in range(1, settings.repetitions + 1):
        for frames in settings.frames:
            run = await _resume_once(port, frames, settings)
            run["repetition"] = repetition
            runs.append(run)
            print(
                f"[resume] {repetition}/{settings.repetitions}: {frames} frames: "
                f"resumed in {run['resume_ms']:.2f} ms (socket ended "
                f"{run['detached_ms']:.2f}, new socket {run['reattached_ms']:.2f}, fence "
                f"{run['fence_ms']:.2f} ms; {run['replayed_frames']} replayed)",
                file=log,
                flush=True,
            )
    return runs


def _measure_resume(settings: ResumeSettings, loop: str, log: TextIO) -> dict[str, Any]:
    max_seconds = 4 * settings.limit_s + 60
    figures: list[dict[str, Any]] = []
    with _worker_process(loop, settings, max_seconds) as server:

        async def main() -> list[dict[str, Any]]:
            with anyio.fail_after(settings.limit_s * 2):
                return await _resume_all(server.port, settings, log)

        runs = anyio.run(
            main, backend="asyncio", backend_options={"loop_factory": eventloop.factory(loop)}
        )
        server_cpu = server.cpu_seconds()
    for frames in settings.frames:
        mine = [run for run in runs if run["frames"] == frames]
        resume = harness.summarize([run["resume_ms"] for run in mine])
        fence = harness.summarize([run["fence_ms"] for run in mine])
        target = RESUME_TARGET_MS if frames == RESUME_TARGET_FRAMES else None
        figures.append(
            _figure(
                f"resume_{frames}_frames_ms",
                f"resume after a cut, {frames:,} retained frames (to fence passed and "
                "all confirmed)",
                "ms",
                resume,
                target,
            )
        )
        figures.append(
            _figure(
                f"fence_{frames}_frames_ms",
                f"of which to the replay fence ({frames:,} retained frames)",
                "ms",
                fence,
                None,
            )
        )
    return {"figures": figures, "runs": runs, "server_cpu_seconds": server_cpu}


# ------------------------------------------------------------------ RSS, retention full


async def _rss_child(port: int, payload_bytes: int, limit_s: float) -> dict[str, Any]:
    """In the controller child: fill retention while the worker is unreachable."""
    limits = gl.Limits()
    payload = _payload(payload_bytes, 4)
    async with _controller(port, limits) as (proxy, sink, transport):
        for seq in range(16):  # warm-up: the same path, everything confirmed
            await sink.drop(seq, payload)
        await _until(
            lambda: transport.statistics().session.retained_frames == 0,
            limit_s,
            "warm-up confirmations",
        )
        gc.collect()
        baseline = read_memory()
        proxy.blackhole()
        most = 2 * limits.max_retained_bytes // payload_bytes + 64
        sent = 0
        blocked = False
        started = time.perf_counter()
        while sent < most:
            with anyio.move_on_after(BLOCK_S) as scope:
                await sink.drop(sent, payload)
            if scope.cancelled_caught:
                blocked = True
                break
            sent += 1
        fill_s = time.perf_counter() - started - (BLOCK_S if blocked else 0.0)
        full = read_memory()
        stats = transport.statistics()
        if not blocked:
            raise harness.MeasurementError(f"{sent} notifications sent and none blocked")
        if stats.state is not TransportState.READY:
            raise harness.MeasurementError(f"the socket ended while filling ({stats.state})")
        proxy.cut()  # no close handshake to wait for behind the blackhole
    return {
        "budget_bytes": limits.max_retained_bytes,
        "payload_bytes": payload_bytes,
        "notifications": sent,
        "fill_seconds": fill_s,
        "retained_frames": stats.session.retained_frames,
        "retained_bytes": stats.session.retained_bytes,
        "rss_baseline_bytes": baseline["VmRSS"],
        "hwm_baseline_bytes": baseline["VmHWM"],
        "rss_full_bytes": full["VmRSS"],
        "hwm_full_bytes": full["VmHWM"],
    }


def _rss_once(port: int, loop: str, settings: ResumeSettings) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(harness.ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "benchmarks.resume",
        "rss",
        "--port",
        str(port),
        "--loop",
        loop,
        "--max-seconds",
        f"{settings.limit_s:.0f}",
        "--payload-bytes",
        str(settings.rss_payload_bytes),
    ]
    try:
        completed = subprocess.run(
            command,
            cwd=harness.ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=settings.limit_s + 10,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise harness.MeasurementError(
            f"the RSS child took longer than {settings.limit_s:.0f} s"
        ) from exc
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    lines = completed.stderr.strip().splitlines() or ["(nothing on stderr)"]
    raise harness.MeasurementError(
        f"the RSS child exited with code {completed.returncode}: {lines[-1]}",
        completed.stderr[-2000:],
    )


def _measure_rss(settings: ResumeSettings, loop: str, log: TextIO) -> dict[str, Any]:
    max_seconds = settings.repetitions * (settings.limit_s + 10) + 60
    runs: list[dict[str, Any]] = []
    with _worker_process(loop, settings, max_seconds) as server:
        for repetition in range(1, settings.repetitions + 1):
            run = _rss_once(server.port, loop, settings)
            run["repetition"] = repetition
            run["rss_baseline_mib"] = run["rss_baseline_bytes"] / MiB
            run["rss_full_mib"] = run["rss_full_bytes"] / MiB
            run["hwm_full_mib"] = run["hwm_full_bytes"] / MiB
            run["rss_growth_mib"] = (run["hwm_full_bytes"] - run["rss_baseline_bytes"]) / MiB
            run["retained_mib"] = run["retained_bytes"] / MiB
            runs.append(run)
            print(
                f"[retention-rss] {repetition}/{settings.repetitions}: "
                f"{run['notifications']} x {run['payload_bytes']:,} B retained "
                f"({run['retained_mib']:.1f} MiB) in {run['fill_seconds']:.2f} s; "
                f"RSS {run['rss_baseline_mib']:.1f} -> {run['rss_full_mib']:.1f} MiB, "
                f"peak {run['hwm_full_mib']:.1f} MiB (+{run['rss_growth_mib']:.1f})",
                file=log,
                flush=True,
            )
        server_cpu = server.cpu_seconds()
    budget_mib = runs[0]["budget_bytes"] / MiB
    target = budget_mib + RSS_ALLOWANCE_MIB

    def summary(key: str) -> dict[str, Any]:
        return harness.summarize([run[key] for run in runs])

    kib = settings.rss_payload_bytes // 1024
    figures = [
        _figure(
            "retention_peak_rss_mib",
            f"controller peak RSS (VmHWM), worker unreachable, retention full "
            f"({budget_mib:g} MiB budget, {kib} KiB notifications)",
            "MiB",
            summary("hwm_full_mib"),
            target,
        ),
        _figure(
            "retention_rss_growth_mib",
            "of which growth over the pre-fill RSS (peak minus baseline)",
            "MiB",
            summary("rss_growth_mib"),
            target,
        ),
        _figure(
            "retention_baseline_rss_mib",
            "pre-fill RSS (interpreter, libraries, one idle session, the proxy)",
            "MiB",
            summary("rss_baseline_mib"),
            None,
        ),
        _figure(
            "retention_retained_mib",
            "encoded bytes retained when full",
            "MiB",
            summary("retained_mib"),
            None,
        ),
    ]
    return {"figures": figures, "runs": runs, "server_cpu_seconds": server_cpu}


# ------------------------------------------------------------------------------- runner


def _figure(
    key: str, label: str, unit: str, summary: dict[str, Any], target: float | None
) -> dict[str, Any]:
    """One row of the report: a figure (lower is better) and its target, if it has one."""
    return {
        "key": key,
        "label": label,
        "unit": unit,
        "summary": summary,
        "target": target,
        "met": None if target is None else summary["median"] <= target,
    }


MEASURE = {"resume": _measure_resume, "retention-rss": _measure_rss}


def run_entry(name: str, settings: ResumeSettings, loop: str, log: TextIO) -> dict[str, Any]:
    """Measure one entry of this module; never raises but for KeyboardInterrupt/SystemExit."""
    return harness.run_measurement(
        name, DESCRIPTIONS[name], asdict(settings), lambda: MEASURE[name](settings, loop, log), log
    )


def run(
    names: list[str],
    settings: harness.Settings,
    quick: bool,
    loop_choice: str,
    log: TextIO = sys.stderr,
) -> list[dict[str, Any]]:
    """Measure the named entries (in :data:`NAMES` order); the results as written to JSON."""
    loop = eventloop.resolve(loop_choice)
    mine = ResumeSettings.from_runner(settings, quick)
    try:
        return [run_entry(name, mine, loop, log) for name in NAMES if name in names]
    finally:
        harness.stop_all_servers()


# --------------------------------------------------------------------------- children


def _watch_parent(max_seconds: float) -> None:
    """Exit when the runner is gone (the parent changes) or after ``max_seconds``."""
    parent = os.getppid()
    deadline = time.monotonic() + max_seconds

    def watch() -> None:
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(2)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    from .servers._common import announce, run_asyncio, start_watchdog

    parser = argparse.ArgumentParser(description="Children of the resume and RSS measurements.")
    parser.add_argument("mode", choices=("worker", "rss"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=eventloop.CHOICES, default="asyncio")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--payload-bytes", type=int, default=64 * 1024)
    args = parser.parse_args(argv)
    if args.mode == "worker":
        start_watchdog(args.max_seconds)

        async def worker() -> None:
            await serve(args.port, announce)

        run_asyncio(worker, args.loop)
        return
    _watch_parent(args.max_seconds)
    box: list[dict[str, Any]] = []

    async def controller() -> None:
        box.append(await _rss_child(args.port, args.payload_bytes, args.max_seconds))

    run_asyncio(controller, args.loop)
    print("RESULT " + json.dumps(box[0]), flush=True)


if __name__ == "__main__":
    main()
