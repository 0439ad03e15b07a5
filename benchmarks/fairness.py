"""garcon_link bulk fairness: small calls while a large transfer runs in the same session.

``python -m benchmarks --only fairness`` (``--quick``: smaller counts). Reported with the other
garcon_link-only figures, against its target (p99 during the transfer <= 5x idle p99).

A worker in a child process (``python -m benchmarks.fairness worker``, the READY protocol of
``benchmarks/servers``) serves ``echo(data: bytes) -> bytes``; the controller in the runner dials
it directly, both ends with the default :class:`~garcon_link.Limits`. Per repetition, one new
session:

1. **idle**: ``small_calls`` sequential echo calls of 32 bytes (after a warm-up); their p99;
2. **during bulk**: one task makes ``transfers`` sequential echo calls of ``transfer_bytes``
   each (256 MiB of arguments in all by default: 32 x 8 MiB, as a 16 MiB argument's frame is
   just over the default ``max_frame_bytes``), every echo checked (``COMPARE_SLICE`` bytes per
   loop turn; an echo of ``KEEP_BYTES`` or more kept until the end); meanwhile another task makes
   sequential 32-byte echo calls until the bulk task ends. Their p99 against the idle p99 is the
   figure; the bulk rate (argument bytes per second, each echoed back) is reported beside it.

``fairness-1mib`` echoes the same bytes as 1 MiB values; ``fairness-256mib`` as one value of
256 MiB, with ``max_frame_bytes`` (and the retention and inbound budgets) of both ends raised
to let it through.

Before chunking, every small call issued behind an 8 MiB body waited for the
whole of it, both ways; see ``benchmarks/README.md`` for the figures before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TextIO

import anyio
import anyio.lowlevel

import garcon_link as gl

from . import eventloop, harness, turns
from .resume import _figure

MiB = 1024 * 1024
_SECRET = gl.Secret(b"garcon-link-benchmark-secret-000")
_EXECUTOR = "bench-fairness"

NAMES = ("fairness", "fairness-1mib", "fairness-256mib")
DESCRIPTIONS = {
    "fairness": "garcon_link small-call p99 while 256 MiB is echoed in the same session",
    "fairness-1mib": "the same with the 256 MiB echoed as 256 values of 1 MiB",
    "fairness-256mib": "the same with the 256 MiB echoed as one value (frame limits raised)",
}
P99_FACTOR_TARGET = 5.0
"""Target: small-call p99 during a bulk transfer <= 5x its idle p99."""


class Echo(Protocol):
    async def echo(self, data: bytes) -> bytes: ...


class _EchoImpl:
    async def echo(self, data: bytes) -> bytes:
        return data


@dataclass(frozen=True)
class FairnessSettings:
    repetitions: int = 5
    small_bytes: int = 32
    warmup: int = 200
    small_calls: int = 2000
    transfers: int = 32
    transfer_bytes: int = 8 * MiB
    limit_s: float = 120.0
    server_start_s: float = 30.0
    frame_mib: int = 0
    """``max_frame_bytes`` (and the retention and inbound budgets with it) of both ends, in MiB;
    0: the default ``Limits``."""

    @classmethod
    def from_runner(cls, settings: harness.Settings, quick: bool) -> FairnessSettings:
        if quick:
            return cls(
                repetitions=1,
                warmup=20,
                small_calls=200,
                transfers=4,
                transfer_bytes=2 * MiB,
                limit_s=settings.limit_s,
                server_start_s=settings.server_start_s,
            )
        return cls(
            repetitions=settings.repetitions,
            small_bytes=settings.small_bytes,
            limit_s=settings.limit_s,
            server_start_s=settings.server_start_s,
        )


def _limits(frame_mib: int) -> gl.Limits:
    if not frame_mib:
        return gl.Limits()
    size = frame_mib * MiB
    return gl.Limits(max_frame_bytes=size, max_retained_bytes=size, max_inbound_buffer_bytes=size)


def _config(port_or_url: int | str, frame_mib: int = 0) -> gl.LinkConfig:
    if isinstance(port_or_url, int):
        return gl.LinkConfig(
            executor_id=_EXECUTOR,
            role=gl.Role.WORKER,
            secret=_SECRET,
            listen=("127.0.0.1", port_or_url),
            limits=_limits(frame_mib),
        )
    return gl.LinkConfig(
        executor_id=_EXECUTOR,
        role=gl.Role.CONTROLLER,
        secret=_SECRET,
        dial=port_or_url,
        limits=_limits(frame_mib),
    )


def _p99_ms(values: list[int]) -> float:
    return harness.percentile(sorted(values), 99) / 1e6


COMPARE_SLICE = 4 * MiB
"""The benchmark checks a bulk echo this many bytes per loop turn: comparing 256 MiB at once
holds the controller's loop for tens of milliseconds (its own work, not garcon_link's)."""


KEEP_BYTES = 32 * MiB
"""The benchmark drops the bulk echoes it received of at least this size only once the small
calls are done: freeing one is an ``munmap`` of the whole value in one call (glibc maps blocks
of over 32 MiB at most on their own), 15-20 ms for 256 MiB here -- the benchmark's own work
ahead of the small calls, as its check would be. Smaller ones are dropped as they are checked
(their memory is reused by the next one)."""


async def _same(value: bytes, expected: bytes) -> bool:
    """``value == expected``, a slice per loop turn (``COMPARE_SLICE``)."""
    if len(value) != len(expected):
        return False
    if len(value) <= COMPARE_SLICE:
        return value == expected
    want = memoryview(expected)
    for start in range(0, len(value), COMPARE_SLICE):
        # startswith at an offset: a memcmp of the slice, no copy (a memoryview comparison
        # goes item by item).
        if not value.startswith(want[start : start + COMPARE_SLICE], start):
            return False
        await anyio.lowlevel.checkpoint()
    return True


async def _small_call(echo: Echo, payload: bytes, latencies: list[int]) -> None:
    clock = time.perf_counter_ns
    start = clock()
    if await echo.echo(payload) != payload:
        raise harness.MeasurementError("a small echo came back different")
    latencies.append(clock() - start)


async def _once(port: int, settings: FairnessSettings, trace: Path | None = None) -> dict[str, Any]:
    if trace is not None:
        tracer = turns.TurnTracer(sample=True, path=trace, role="controller")
        tracer.install(asyncio.get_running_loop())
    rng = random.Random(7)
    small = rng.randbytes(settings.small_bytes)
    # Random bytes (nothing gains by compressing them), a MiB of them repeated for larger values.
    tile = rng.randbytes(min(settings.transfer_bytes, MiB))
    big = (
        tile * (settings.transfer_bytes // len(tile)) + tile[: settings.transfer_bytes % len(tile)]
    )
    config = _config(f"ws://127.0.0.1:{port}/executor", settings.frame_mib)
    async with gl.connect(config) as executor:
        await executor.wait_ready(timeout=10)
        echo = executor.service("echo", Echo)
        for _ in range(settings.warmup):
            await echo.echo(small)
        if not await _same(await echo.echo(big), big):  # warm-up of the bulk path
            raise harness.MeasurementError("a bulk echo came back different")
        idle: list[int] = []
        for _ in range(settings.small_calls):
            await _small_call(echo, small, idle)
        during: list[int] = []
        done = anyio.Event()
        bulk_s = 0.0
        kept: list[bytes] = []

        async def bulk() -> None:
            nonlocal bulk_s
            start = time.perf_counter()
            try:
                for _ in range(settings.transfers):
                    result = await echo.echo(big)
                    if not await _same(result, big):
                        raise harness.MeasurementError("a bulk echo came back different")
                    if len(result) >= KEEP_BYTES:
                        kept.append(result)  # freed after the measurement (KEEP_BYTES)
                    del result
            finally:
                bulk_s = time.perf_counter() - start
                done.set()

        span_start = time.perf_counter_ns()
        async with anyio.create_task_group() as tg:
            tg.start_soon(bulk)
            while not done.is_set():
                await _small_call(echo, small, during)
        if trace is not None:
            tracer.mark("bulk", span_start, time.perf_counter_ns())
        kept.clear()
    total = settings.transfers * settings.transfer_bytes
    idle_p99 = _p99_ms(idle)
    during_p99 = _p99_ms(during)
    return {
        "idle_p50_ms": harness.percentile(sorted(idle), 50) / 1e6,
        "idle_p99_ms": idle_p99,
        "during_p50_ms": harness.percentile(sorted(during), 50) / 1e6,
        "during_p99_ms": during_p99,
        "during_max_ms": max(during) / 1e6,
        "during_calls": len(during),
        "p99_factor": during_p99 / idle_p99,
        "bulk_bytes": total,
        "bulk_s": bulk_s,
        "bulk_mb_per_s": total / bulk_s / 1e6,
    }


def _worker_process(
    loop: str, settings: FairnessSettings, trace: Path | None = None
) -> harness.ServerProcess:
    max_seconds = settings.repetitions * settings.limit_s + 60
    server = harness.ServerProcess("ours", loop, settings.server_start_s, max_seconds)
    server.module = "fairness-worker"
    server.command = [
        sys.executable,
        "-m",
        "benchmarks.fairness",
        "worker",
        "--frame-mib",
        str(settings.frame_mib),
        *(("--trace-turns", str(trace)) if trace is not None else ()),
        *server.command[server.command.index("--port") :],
    ]
    return server


def _measure(
    settings: FairnessSettings,
    loop: str,
    log: TextIO,
    name: str = "fairness",
    trace: Path | None = None,
) -> dict[str, Any]:
    """The benchmark's repetitions; with ``trace`` (a directory), each process's long loop
    turns are written to ``controller.jsonl`` and ``worker.jsonl`` in it (:mod:`.turns`)."""
    runs: list[dict[str, Any]] = []
    traced = {role: trace / f"{role}.jsonl" for role in ("controller", "worker")} if trace else {}
    with _worker_process(loop, settings, traced.get("worker")) as server:
        for repetition in range(1, settings.repetitions + 1):

            async def main() -> dict[str, Any]:
                with anyio.fail_after(settings.limit_s):
                    return await _once(server.port, settings, traced.get("controller"))

            run = anyio.run(
                main, backend="asyncio", backend_options={"loop_factory": eventloop.factory(loop)}
            )
            run["repetition"] = repetition
            runs.append(run)
            print(
                f"[{name}] {repetition}/{settings.repetitions}: small-call p99 idle "
                f"{run['idle_p99_ms']:.3f} ms, during bulk {run['during_p99_ms']:.3f} ms "
                f"({run['p99_factor']:.1f}x, {run['during_calls']} calls, max "
                f"{run['during_max_ms']:.1f} ms); bulk {run['bulk_mb_per_s']:.0f} MB/s",
                file=log,
                flush=True,
            )
        server_cpu = server.cpu_seconds()

    def summary(key: str) -> dict[str, Any]:
        return harness.summarize([run[key] for run in runs])

    mib = settings.transfers * settings.transfer_bytes // MiB
    each = f"{settings.transfer_bytes / MiB:g}"
    key = name.replace("-", "_")
    figures = [
        _figure(
            f"{key}_p99_factor",
            f"small-call p99 while {mib} MiB is echoed in the same session ({settings.transfers}"
            f" x {each} MiB) / idle p99",
            "x",
            summary("p99_factor"),
            P99_FACTOR_TARGET,
        ),
        _figure(
            f"{key}_idle_p99_ms",
            "of which idle small-call p99",
            "ms",
            summary("idle_p99_ms"),
            None,
        ),
        _figure(
            f"{key}_during_p99_ms",
            "small-call p99 during the transfer",
            "ms",
            summary("during_p99_ms"),
            None,
        ),
        _figure(
            f"{key}_during_max_ms",
            "longest small call during the transfer",
            "ms",
            summary("during_max_ms"),
            None,
        ),
        _figure(
            f"{key}_bulk_mb_per_s",
            "bulk rate during it (argument bytes, each echoed back; higher is better)",
            "MB/s",
            summary("bulk_mb_per_s"),
            None,
        ),
    ]
    return {"figures": figures, "runs": runs, "server_cpu_seconds": server_cpu}


def _variants(mine: FairnessSettings, quick: bool) -> dict[str, FairnessSettings]:
    return {
        "fairness": mine,
        # The same bytes in values an eighth the size: what is left ahead of a small call is
        # then bounded by the pacing (parts), not by the whole-value copies of 8 MiB bodies.
        "fairness-1mib": replace(
            mine,
            transfers=mine.transfers * mine.transfer_bytes // MiB,
            transfer_bytes=MiB,
        )
        if not quick
        else replace(mine, transfers=mine.transfers * 4, transfer_bytes=mine.transfer_bytes // 4),
        # The same bytes as one value: a transfer of a thousand parts, with every limit raised
        # to let one 256 MiB value through.
        "fairness-256mib": replace(
            mine,
            transfers=1,
            transfer_bytes=mine.transfers * mine.transfer_bytes,
            frame_mib=mine.transfers * mine.transfer_bytes // MiB + 16,
        ),
    }


def run(
    names: list[str],
    settings: harness.Settings,
    quick: bool,
    loop_choice: str,
    log: TextIO = sys.stderr,
) -> list[dict[str, Any]]:
    """Measure the named entries of this module; the results as written to JSON."""
    loop = eventloop.resolve(loop_choice)
    variants = _variants(FairnessSettings.from_runner(settings, quick), quick)
    results = []
    try:
        for name, chosen in variants.items():
            if name in names:
                results.append(
                    harness.run_measurement(
                        name,
                        DESCRIPTIONS[name],
                        asdict(chosen),
                        functools.partial(_measure, chosen, loop, log, name),
                        log,
                    )
                )
        return results
    finally:
        harness.stop_all_servers()


def main(argv: list[str] | None = None) -> None:
    from .servers._common import announce, run_asyncio, start_watchdog

    parser = argparse.ArgumentParser(
        description="The worker child of the fairness benchmark (worker), or a run of it with "
        "every long loop turn of both processes traced (trace: benchmarks/turns.py)."
    )
    parser.add_argument("mode", choices=("worker", "trace"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=eventloop.CHOICES, default="asyncio")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--frame-mib", type=int, default=0)
    parser.add_argument("--trace-turns", type=Path, help="worker: the file of its long turns")
    parser.add_argument("--variant", choices=NAMES, default="fairness", help="trace: which")
    parser.add_argument("--repetitions", type=int, default=1, help="trace: how many")
    parser.add_argument("--out", type=Path, default=Path("results/turns"), help="trace: where")
    args = parser.parse_args(argv)
    if args.mode == "trace":
        _trace(args.variant, args.repetitions, args.out)
        return
    start_watchdog(args.max_seconds)

    async def worker() -> None:
        if args.trace_turns is not None:
            turns.TurnTracer(sample=True, path=args.trace_turns, role="worker").install(
                asyncio.get_running_loop()
            )
        services = {"echo": gl.Service(_EchoImpl(), Echo)}
        async with gl.Worker(_config(args.port, args.frame_mib), services) as endpoint:
            announce(endpoint.link.listen_address[1])
            await anyio.sleep_forever()

    run_asyncio(worker, args.loop)


def _trace(variant: str, repetitions: int, out: Path) -> None:
    """Run ``variant`` traced (plain asyncio loop) and print the long turns of its bulk phase."""
    settings = _variants(replace(FairnessSettings(), repetitions=repetitions), False)[variant]
    out.mkdir(parents=True, exist_ok=True)
    for role in ("controller", "worker"):
        (out / f"{role}.jsonl").unlink(missing_ok=True)
    try:
        _measure(settings, "asyncio", sys.stderr, variant, out)
    finally:
        harness.stop_all_servers()
    summary = turns.report([out / "controller.jsonl", out / "worker.jsonl"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
