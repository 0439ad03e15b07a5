"""Keyed calls with and without a state directory: what journaling to SQLite costs.

``python -m benchmarks.durable`` (``--quick``: smaller counts; ``--json PATH`` writes the
figures). Target: with a state directory, at least 0.5x the calls/s of the in-memory table.

One run measures both variants alternately, ``repetitions`` times each, on the same machine
and disk: a worker and a controller in this process on loopback (one event loop, as for both
variants), the worker serving ``echo(data: bytes) -> bytes``; every call has a fresh
idempotency key, so each one is journaled (running) before it runs and recorded before its
reply -- two writes per call with a state directory, group-committed by the writer thread.

- **p50**: ``calls`` sequential keyed calls of 32 bytes after a warm-up; the median latency
  (one call at a time: no group commit, each call waits for two fsyncs).
- **calls/s**: 64 tasks each making sequential keyed calls for ``seconds``; calls finished per
  second (64 in flight: the writer commits whatever queued during the previous fsync at once).

The state directory is a fresh temporary directory on the default temporary file system (its
fsync is what a state directory there would pay); ``--dir`` picks another parent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from itertools import count
from pathlib import Path
from typing import Any, Protocol

import anyio

import garcon_link as gl

_SECRET = gl.Secret(b"garcon-link-benchmark-secret-000")
_EXECUTOR = "bench-durable"
IN_FLIGHT = 64
PAYLOAD = b"x" * 32


class Echo(Protocol):
    async def echo(self, data: bytes) -> bytes: ...


class _EchoImpl:
    async def echo(self, data: bytes) -> bytes:
        return data


def _worker_config() -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id=_EXECUTOR, role=gl.Role.WORKER, secret=_SECRET, listen=("127.0.0.1", 0)
    )


def _controller_config(port: int) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id=_EXECUTOR,
        role=gl.Role.CONTROLLER,
        secret=_SECRET,
        dial=f"ws://127.0.0.1:{port}/executor",
    )


_keys = count()


def _keyed(echo: Echo) -> Echo:
    return gl.with_options(echo, idempotency_key=f"k{next(_keys)}")


async def _once(state_dir: Path | None, calls: int, seconds: float) -> dict[str, Any]:
    services = {"echo": gl.Service(_EchoImpl(), Echo)}
    async with gl.Worker(_worker_config(), services, state_dir=state_dir) as worker:
        async with gl.connect(_controller_config(worker.link.listen_address[1])) as executor:
            await executor.wait_ready(10)
            echo = executor.service("echo", Echo)
            for _ in range(50):  # warm-up
                await _keyed(echo).echo(PAYLOAD)
            latencies = []
            for _ in range(calls):
                started = time.perf_counter()
                await _keyed(echo).echo(PAYLOAD)
                latencies.append(time.perf_counter() - started)
            done = 0
            deadline = time.perf_counter() + seconds

            async def caller() -> None:
                nonlocal done
                while time.perf_counter() < deadline:
                    await _keyed(echo).echo(PAYLOAD)
                    done += 1

            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(IN_FLIGHT):
                    tg.start_soon(caller)
            elapsed = time.perf_counter() - started
        state = worker.state_statistics()
    return {
        "p50_us": statistics.median(latencies) * 1e6,
        "calls_per_s": done / elapsed,
        "transactions": None if state is None else state.transactions,
        "largest_group": None if state is None else state.largest_group,
    }


async def _measure(
    parent: str | None, repetitions: int, calls: int, seconds: float
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"memory": [], "state-dir": []}
    for _ in range(repetitions):
        runs["memory"].append(await _once(None, calls, seconds))
        with tempfile.TemporaryDirectory(dir=parent) as directory:
            runs["state-dir"].append(await _once(Path(directory) / "state", calls, seconds))
    figures = {
        name: {
            "p50_us": statistics.median(r["p50_us"] for r in results),
            "calls_per_s": statistics.median(r["calls_per_s"] for r in results),
        }
        for name, results in runs.items()
    }
    ratio = figures["state-dir"]["calls_per_s"] / figures["memory"]["calls_per_s"]
    return {"figures": figures, "ratio_calls_per_s": ratio, "target_ratio": 0.5, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition, 200 calls, 1 s")
    parser.add_argument("--dir", help="parent of the temporary state directories")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    repetitions, calls, seconds = (1, 200, 1.0) if args.quick else (3, 1000, 3.0)
    result = anyio.run(_measure, args.dir, repetitions, calls, seconds)
    result["settings"] = {"repetitions": repetitions, "calls": calls, "seconds": seconds}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    figures = result["figures"]
    print("| variant | keyed call p50 | calls/s, 64 in flight |")
    print("| --- | ---: | ---: |")
    for name, figure in figures.items():
        print(f"| {name} | {figure['p50_us']:.0f} us | {figure['calls_per_s']:.0f} |")
    ratio = result["ratio_calls_per_s"]
    verdict = "meets" if ratio >= 0.5 else "misses"
    print(f"state-dir / memory calls/s: {ratio:.2f} ({verdict} the 0.5 target)", file=sys.stderr)


if __name__ == "__main__":
    main()
