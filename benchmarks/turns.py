"""Per-loop-turn tracer for a benchmark process: which work makes an asyncio loop turn long.

A diagnostic for the benchmarks only (``python -m benchmarks.fairness trace``), never loaded by
the library: it patches asyncio's ``Handle._run`` (process-wide) and the running loop's
``_run_once``, so it needs the plain asyncio loop (not uvloop), and it costs time of its own
(two ``setitimer`` calls per turn and a sample every :data:`SAMPLE_S` inside one; its figures are
for finding *what* is long, not for the benchmark's own latencies).

How a turn is split
-------------------
A turn is the span from the start of its first callback to the end of its last (the wait in
``epoll`` is not part of it). While a turn runs, an interval timer (``SIGALRM``) samples the
Python stack of the main thread; each sample is charged the time since the previous sample (or
the start of the callback), so a long C call (a ``memcpy``, ``munmap``, a ``bytes.translate``)
is charged to the Python frame that made it, once it returns. A sample's stack is put in a
category by its innermost frame that matches :data:`RULES` (masking, unmasking, socket read and
write, part assembly, retention, the handler, ...); what no rule matches is named by its
innermost frame. Garbage-collector passes are timed by ``gc.callbacks`` and charged to ``gc``.
What is left of a callback after its last sample is charged to that sample's category (or, in a
callback shorter than a sample, to the callback: its task's coroutine or its function).

Every turn longer than ``threshold_ms`` is written as one JSON line (its start on
``time.perf_counter_ns``, which is ``CLOCK_MONOTONIC``: comparable across the processes of one
machine), with its busy time, the CPU time of the thread in it (less than the busy time when the
process was preempted: on a machine of few cores, a write that wakes the peer process can hand
it our core), callbacks, time per category and its three costliest innermost
frames; :meth:`TurnTracer.mark` writes a marker line (the benchmark marks the span of the bulk
phase). :func:`report` reads the files of both processes and prints, for the marked spans only,
the histogram of long turns by what dominated them.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, TextIO

__all__ = ["RULES", "SAMPLE_S", "TurnTracer", "report"]

SAMPLE_S = 100e-6
"""Seconds between two stack samples inside a turn."""

RULES: tuple[tuple[str, str, str], ...] = (
    # (file name ending, function name or "*", category); innermost matching frame wins.
    ("garcon_link/net/_frames.py", "_masked_frame", "masking"),
    ("garcon_link/net/_frames.py", "build", "masking"),
    ("garcon_link/net/_frames.py", "parse", "unmasking"),
    ("garcon_link/net/_frames.py", "parse_at", "unmasking"),
    ("wsproto/frame_protocol.py", "process", "unmasking"),
    ("wsproto/frame_protocol.py", "*", "ws frame parsing"),
    ("wsproto/utilities.py", "*", "ws frame parsing"),
    ("wsproto/connection.py", "*", "ws frame parsing"),
    ("wsproto/__init__.py", "*", "ws frame parsing"),
    ("asyncio/selector_events.py", "write", "socket write"),
    ("asyncio/selector_events.py", "_write_ready", "socket write"),
    ("asyncio/selector_events.py", "_write_send", "socket write"),
    ("asyncio/selector_events.py", "_read_ready__get_buffer", "socket read"),
    ("asyncio/selector_events.py", "_read_ready__data_received", "socket read"),
    ("garcon_link/net/_asyncio_stream.py", "buffer_updated", "socket read"),
    ("garcon_link/net/_asyncio_stream.py", "receive", "socket read"),
    ("garcon_link/net/_asyncio_stream.py", "send", "socket write"),
    ("garcon_link/net/_asyncio_stream.py", "send_nowait", "socket write"),
    ("garcon_link/rpc/splice.py", "take", "part assembly"),
    ("garcon_link/rpc/splice.py", "_finish_value", "part assembly"),
    ("garcon_link/rpc/splice.py", "encode_envelope", "encoding"),
    ("garcon_link/rpc/chunks.py", "feed", "part assembly"),
    ("garcon_link/rpc/chunks.py", "_encode_part", "part cutting"),
    ("garcon_link/rpc/chunks.py", "*", "part sending"),
    ("garcon_link/core/wire.py", "*", "decoding/encoding"),
    ("cbor2/", "*", "decoding/encoding"),
    ("garcon_link/endpoint/_delivery.py", "release", "retention"),
    ("garcon_link/endpoint/_delivery.py", "*", "transport"),
    ("garcon_link/endpoint/_inbound.py", "_buffer_payload", "retention"),
    ("garcon_link/endpoint/_inbound.py", "*", "transport"),
    ("garcon_link/endpoint/_outbound.py", "*", "transport"),
    ("garcon_link/endpoint/_watches.py", "*", "transport"),
    ("garcon_link/endpoint/transport.py", "*", "transport"),
    ("garcon_link/net/", "*", "ws link"),
    ("garcon_link/rpc/handlers.py", "*", "handler"),
    ("benchmarks/fairness.py", "_same", "benchmark check"),
    ("benchmarks/fairness.py", "*", "benchmark"),
)


_RULED: dict[CodeType, str | None] = {}
"""The category of each code object seen (``None``: no rule matches it)."""


def _rule(code: CodeType) -> str | None:
    path = code.co_filename.replace(os.sep, "/")
    for ending, function, category in RULES:
        if ending in path and function in ("*", code.co_name):
            return category
    return None


def _category(frame: FrameType | None) -> tuple[str, str]:
    """The category of a stack (innermost matching rule) and its innermost frame's name."""
    leaf = ""
    while frame is not None:
        code = frame.f_code
        if not leaf:
            leaf = f"{code.co_filename.rsplit(os.sep, 1)[-1]}:{frame.f_lineno} {code.co_name}"
        try:
            category = _RULED[code]
        except KeyError:
            category = _RULED[code] = _rule(code)
        if category is not None:
            return category, leaf
        frame = frame.f_back
    return f"other: {leaf}", leaf


def _describe(handle: asyncio.Handle) -> str:
    callback: Any = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro: Any = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return f"callback {getattr(callback, '__qualname__', type(callback).__name__)}"


class TurnTracer:
    """Times every turn of one asyncio loop and writes the long ones (module docstring)."""

    def __init__(self, path: str | Path, role: str, threshold_ms: float | None = None) -> None:
        if threshold_ms is None:
            threshold_ms = float(os.environ.get("GARCON_BENCH_TURN_MS", "0.3"))
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._role = role
        self._threshold = int(threshold_ms * 1e6)
        self._clock = time.perf_counter_ns
        self._in_turn = False
        self._sampling = False
        self._first = 0
        self._last = 0
        self._handles = 0
        self._sampled: str | None = None
        self._cats: defaultdict[str, int] = defaultdict(int)
        self._leaves: defaultdict[str, int] = defaultdict(int)
        self._gc_start = 0
        self._cpu = 0
        self._handle: asyncio.Handle | None = None
        self.turns = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Trace ``loop`` (a plain asyncio loop, running in this thread)."""
        run_once: Callable[[], None] = loop._run_once  # type: ignore[attr-defined]
        original_run = asyncio.events.Handle._run
        tracer = self
        clock = self._clock
        cpu = time.thread_time_ns

        def traced_run(handle: asyncio.Handle) -> None:
            start = clock()
            if not tracer._handles:
                tracer._first = start
                tracer._cpu = cpu()
                signal.setitimer(signal.ITIMER_REAL, SAMPLE_S, SAMPLE_S)
            tracer._handles += 1
            tracer._handle = handle
            tracer._last = start
            tracer._sampled = None
            tracer._in_turn = True
            try:
                original_run(handle)
            finally:
                end = clock()
                rest = end - tracer._last
                tracer._cats[tracer._sampled or _describe(handle)] += rest
                tracer._last = end

        def traced_run_once() -> None:
            tracer._handles = 0
            tracer._cats.clear()
            tracer._leaves.clear()
            try:
                run_once()
            finally:
                tracer._in_turn = False
                if tracer._handles:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    tracer._turn_done()

        asyncio.events.Handle._run = traced_run  # type: ignore[method-assign,assignment]
        loop._run_once = traced_run_once  # type: ignore[attr-defined]
        signal.signal(signal.SIGALRM, self._sample)
        gc.callbacks.append(self._gc)

    def _sample(self, signum: int, frame: FrameType | None) -> None:
        if not self._in_turn or self._sampling:
            return
        self._sampling = True
        now = self._clock()
        try:
            category, leaf = _category(frame)
        finally:
            self._sampling = False
        spent = now - self._last
        self._cats[category] += spent
        self._leaves[leaf] += spent
        self._sampled = category
        self._last = now

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self._in_turn:
            return
        now = self._clock()
        if phase == "start":
            self._gc_start = now
            return
        # The time before the pass goes to the frame that was running; the pass to "gc".
        self._cats[f"gc (generation {info.get('generation')})"] += now - self._gc_start
        before = self._sampled or (_describe(self._handle) if self._handle else "before gc")
        self._cats[before] += self._gc_start - self._last
        self._last = now

    def _turn_done(self) -> None:
        self.turns += 1
        end = self._last
        busy = end - self._first
        if busy < self._threshold:
            return
        cpu = time.thread_time_ns() - self._cpu
        leaves = sorted(self._leaves.items(), key=lambda item: -item[1])[:3]
        record = {
            "role": self._role,
            "t0": self._first,
            "busy_us": busy // 1000,
            "cpu_us": cpu // 1000,
            "handles": self._handles,
            "cats": {key: value // 1000 for key, value in self._cats.items() if value >= 1000},
            "leaves": [[leaf, spent // 1000] for leaf, spent in leaves],
        }
        os.write(self._fd, json.dumps(record).encode() + b"\n")

    def mark(self, what: str, start_ns: int, end_ns: int) -> None:
        """Write a marker: the span ``[start_ns, end_ns]`` (``perf_counter_ns``) is ``what``."""
        record = {"role": self._role, "mark": what, "start": start_ns, "end": end_ns}
        os.write(self._fd, json.dumps(record).encode() + b"\n")


BUCKETS_MS = (0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 50.0)


def _bucket(ms: float) -> str:
    for low, high in itertools.pairwise(BUCKETS_MS):
        if ms < high:
            return f"{low:g}-{high:g} ms"
    return f">= {BUCKETS_MS[-1]:g} ms"


def _read(paths: Iterable[Path]) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8") as lines:
            records.extend(json.loads(line) for line in lines if line.strip())
    return records


def report(paths: Iterable[Path], out: TextIO = sys.stdout, mark: str = "bulk") -> dict[str, Any]:
    """Print (and return) the long turns that started inside the ``mark`` spans, per process:
    how many, by length, by dominant category, time per category, costliest frames."""
    records = _read(paths)
    spans = [(r["start"], r["end"]) for r in records if r.get("mark") == mark]
    seconds = sum(end - start for start, end in spans) / 1e9
    summary: dict[str, Any] = {"seconds": seconds}
    print(
        f"long loop turns (> threshold) during {len(spans)} '{mark}' span(s), {seconds:.1f} s",
        file=out,
    )
    for role in sorted({r["role"] for r in records}):
        turns = [
            r
            for r in records
            if r["role"] == role
            and "busy_us" in r
            and any(start <= r["t0"] <= end for start, end in spans)
        ]
        by_length = Counter(_bucket(t["busy_us"] / 1000) for t in turns)
        by_cpu = Counter(_bucket(t["cpu_us"] / 1000) for t in turns if t.get("cpu_us", 0) >= 300)
        dominant: Counter[str] = Counter()
        dominant_cpu: Counter[str] = Counter()
        spent: Counter[str] = Counter()
        leaves: Counter[str] = Counter()
        for turn in turns:
            cats = turn["cats"]
            if cats:
                dominant[max(cats, key=cats.get)] += 1
                if turn.get("cpu_us", 0) >= 300:
                    dominant_cpu[max(cats, key=cats.get)] += 1
            spent.update(cats)
            leaves.update(dict(turn["leaves"]))
        total_ms = sum(t["busy_us"] for t in turns) / 1000
        cpu_ms = sum(t.get("cpu_us", 0) for t in turns) / 1000
        print(
            f"\n[{role}] {len(turns)} turns > threshold, {total_ms:.0f} ms in them, of which "
            f"{cpu_ms:.0f} ms on the CPU (the rest: the process was not running)",
            file=out,
        )
        print(
            "  by length: "
            + ", ".join(
                f"{name}: {by_length[name]}" for name in sorted(by_length, key=_bucket_order)
            ),
            file=out,
        )
        print(
            "  on the CPU > 0.3 ms: "
            + ", ".join(f"{name}: {by_cpu[name]}" for name in sorted(by_cpu, key=_bucket_order)),
            file=out,
        )
        print("  by what dominated them (turns):", file=out)
        for name, count in dominant.most_common(12):
            print(f"    {count:6d}  {name}", file=out)
        print("  of those > 0.3 ms on the CPU, by what dominated them (turns):", file=out)
        for name, count in dominant_cpu.most_common(8):
            print(f"    {count:6d}  {name}", file=out)
        print("  time in them by category (ms):", file=out)
        for name, us in spent.most_common(14):
            print(f"    {us / 1000:8.1f}  {name}", file=out)
        print("  costliest innermost frames (ms):", file=out)
        for name, us in leaves.most_common(8):
            print(f"    {us / 1000:8.1f}  {name}", file=out)
        longest = sorted(turns, key=lambda t: -t["busy_us"])[:3]
        for turn in longest:
            top = sorted(turn["cats"].items(), key=lambda item: -item[1])[:4]
            print(
                f"  longest {turn['busy_us'] / 1000:.1f} ms ({turn['handles']} callbacks): "
                + ", ".join(f"{name} {us / 1000:.1f}" for name, us in top),
                file=out,
            )
        summary[role] = {
            "turns": len(turns),
            "by_length": dict(by_length),
            "by_cpu": dict(by_cpu),
            "dominant": dict(dominant),
            "dominant_on_cpu": dict(dominant_cpu),
            "ms_by_category": {name: us / 1000 for name, us in spent.items()},
        }
    return summary


def _bucket_order(name: str) -> float:
    head = name.lstrip(">= ").split("-")[0].split()[0]
    return float(head) + (1000 if name.startswith(">=") else 0)
