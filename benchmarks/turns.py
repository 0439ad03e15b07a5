"""Per-loop-turn tracer for a benchmark process: which work makes an asyncio loop turn long.

A diagnostic for the benchmarks only, never loaded by the library; ``python -m benchmarks.fairness
trace`` and ``GL_FLEET_BENCH_TURNS=1`` (the fleet's storm) use it. It patches asyncio's
``Handle._run`` (process-wide) and the traced loop's ``_run_once``, so it needs the plain asyncio
loop (not uvloop), and it costs time of its own (its figures are for finding *what* is long, not
for the benchmark's own latencies).

How a turn is split
-------------------
A turn is one ``_run_once`` that ran at least one handle: its span on ``perf_counter_ns``
(``CLOCK_MONOTONIC``: comparable across the processes of one machine) and the CPU time of the
thread in it (less than the span when the process was preempted, and without the wait in
``epoll``). Its CPU time is charged to categories:

- each ready handle's CPU goes to the category ``classify(handle)`` gives (default
  :func:`describe`: the task's coroutine or the callback's name);
- with ``sample=True``, an interval timer (``SIGALRM``, every :data:`SAMPLE_S` of a turn) samples
  the Python stack instead, and the CPU since the previous sample goes to the category of the
  stack's innermost frame that matches :data:`RULES` (a long C call is charged to the Python frame
  that made it, once it returns); what no rule matches is named by its innermost frame, and what is
  left of a handle after its last sample goes to that sample's category (or, in a handle shorter
  than a sample, to the handle's own);
- garbage-collector passes (``gc.callbacks``) go to ``GC``, and the turn counts its passes per
  generation.

Every turn is kept in flat arrays (no GC-tracked object per turn, so that the tracer adds no GC
passes of its own; categories are kept as indices, at most ``width`` of them, the rest are
``other``): :meth:`TurnTracer.turns` gives them after the fact. With a ``path``, every turn
longer than ``threshold_ms`` is also written as one JSON line as it ends (its start, busy time,
CPU, handles, GC passes, microseconds per category and, when sampling, its three costliest
innermost frames), and :meth:`TurnTracer.mark` writes a marker line; :func:`report` reads the
files of several processes and prints, for the marked spans only, the long turns by what
dominated them. The fleet benchmark reports from :meth:`TurnTracer.turns` in its own process.
"""

from __future__ import annotations

import array
import asyncio
import asyncio.events
import gc
import itertools
import json
import os
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, TextIO

__all__ = ["RULES", "SAMPLE_S", "Turn", "TurnTracer", "describe", "report"]

SAMPLE_S = 100e-6
"""Seconds between two stack samples inside a turn (``sample=True``)."""

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


def describe(handle: asyncio.Handle) -> str:
    """A ready handle's default category: ``task <its coroutine>`` or ``callback <name>``."""
    callback: Any = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro: Any = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return f"callback {getattr(callback, '__qualname__', type(callback).__name__)}"


@dataclass(frozen=True, slots=True)
class Turn:
    """One traced loop turn (module docstring)."""

    start_ns: int
    end_ns: int
    cpu_ns: int
    handles: int
    gc_passes: tuple[int, int, int]
    """GC passes in the turn, per generation."""
    cpu_by_category: dict[str, int]
    """CPU nanoseconds per category."""


class TurnTracer:
    """Times every turn of one asyncio loop and charges its CPU to categories (module docstring).

    ``classify`` names a ready handle's category; ``sample`` charges by stack samples instead;
    ``path`` (with ``role``) writes the turns over ``threshold_ms`` as JSON lines. Use it as
    ``install(loop)`` ... ``uninstall()``, or as a context manager around code running in the
    loop.
    """

    def __init__(
        self,
        classify: Callable[[asyncio.Handle], str] = describe,
        *,
        sample: bool = False,
        path: str | Path | None = None,
        role: str = "",
        threshold_ms: float | None = None,
        width: int = 96,
    ) -> None:
        if threshold_ms is None:
            threshold_ms = float(os.environ.get("GARCON_BENCH_TURN_MS", "0.3"))
        self._classify = classify
        self._sample_on = sample
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if path else -1
        self._role = role
        self._threshold = int(threshold_ms * 1e6)
        self._width = width
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        # Per turn, in flat arrays: span, CPU, handles, GC passes per generation.
        self._starts, self._ends = array.array("q"), array.array("q")
        self._cpus, self._handle_counts = array.array("q"), array.array("l")
        self._gcs = array.array("l")  # three per turn
        self._cells, self._spent = array.array("q"), array.array("q")  # (turn*width+cat, ns)
        # The running turn.
        self._current = [0] * width
        self._touched: list[int] = []
        self._gc_now = [0, 0, 0]
        self._leaves: defaultdict[str, int] = defaultdict(int)
        self._handles = 0
        self._first = 0
        self._cpu0 = 0
        self._mark = 0  # thread CPU at the last charge
        self._handle_cat = 0  # the running handle's own category
        self._sampled = -1  # the category of the last sample in the running handle (-1: none)
        self._in_turn = False
        self._sampling = False
        self._loop: Any = None
        self._handle_run: Callable[[asyncio.Handle], None] | None = None
        self.turn_count = 0

    # -------------------------------------------------------------------- install

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Trace ``loop`` (a plain asyncio loop, running in this thread; default: the running
        loop)."""
        loop = loop or asyncio.get_running_loop()
        self._loop = loop
        run_once: Callable[[], None] = loop._run_once  # type: ignore[attr-defined]
        handle_run = self._handle_run = asyncio.events.Handle._run
        tracer = self
        cpu = time.thread_time_ns
        clock = time.perf_counter_ns

        def traced_run(handle: asyncio.Handle) -> None:
            now = cpu()
            if not tracer._handles:
                tracer._first = clock()
                tracer._cpu0 = now
                if tracer._sample_on:
                    signal.setitimer(signal.ITIMER_REAL, SAMPLE_S, SAMPLE_S)
            tracer._handles += 1
            tracer._mark = now
            tracer._handle_cat = tracer._slot(tracer._classify(handle))
            tracer._sampled = -1
            tracer._in_turn = True
            try:
                handle_run(handle)
            finally:
                tracer._in_turn = False
                tracer._charge(tracer._sampled if tracer._sampled >= 0 else tracer._handle_cat)

        def traced_run_once() -> None:
            tracer._handles = 0
            try:
                run_once()
            finally:
                if tracer._handles:
                    if tracer._sample_on:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    tracer._turn_done(clock(), cpu())

        asyncio.events.Handle._run = traced_run  # type: ignore[method-assign,assignment]
        loop._run_once = traced_run_once  # type: ignore[attr-defined]
        if self._sample_on:
            signal.signal(signal.SIGALRM, self._on_sample)
        gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        """Stop tracing (the turns stay readable)."""
        if self._loop is None:
            return
        del self._loop._run_once  # the instance attribute: the class's method shows again
        asyncio.events.Handle._run = self._handle_run  # type: ignore[method-assign,assignment]
        gc.callbacks.remove(self._on_gc)
        if self._sample_on:
            signal.setitimer(signal.ITIMER_REAL, 0)
        self._loop = None

    def __enter__(self) -> TurnTracer:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -------------------------------------------------------------------- charging

    def _slot(self, label: str) -> int:
        i = self._index.get(label)
        if i is None:
            if len(self._names) >= self._width - 1:
                label = "other"
                i = self._index.get(label)
            if i is None:
                i = self._index[label] = len(self._names)
                self._names.append(label)
        return i

    def _charge(self, i: int) -> None:
        now = time.thread_time_ns()
        if self._current[i] == 0:
            self._touched.append(i)
        self._current[i] += (now - self._mark) or 1
        self._mark = now

    def _on_sample(self, signum: int, frame: FrameType | None) -> None:
        if not self._in_turn or self._sampling:
            return
        self._sampling = True
        try:
            category, leaf = _category(frame)
            before = self._mark
            i = self._slot(category)
            self._charge(i)
            self._leaves[leaf] += self._mark - before
            self._sampled = i
        finally:
            self._sampling = False

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self._in_turn:
            return
        if phase == "start":
            # What ran before the pass goes to the handle (or its last sample); the pass to GC.
            self._charge(self._sampled if self._sampled >= 0 else self._handle_cat)
            return
        self._charge(self._slot("GC"))
        generation = info.get("generation", 0)
        if 0 <= generation <= 2:
            self._gc_now[generation] += 1

    def _turn_done(self, end: int, cpu_end: int) -> None:
        turn = len(self._starts)
        self.turn_count += 1
        self._starts.append(self._first)
        self._ends.append(end)
        self._cpus.append(cpu_end - self._cpu0)
        self._handle_counts.append(self._handles)
        self._gcs.extend(self._gc_now)
        cats: dict[str, int] | None = None
        if self._fd >= 0 and end - self._first >= self._threshold:
            cats = {}
        for i in self._touched:
            self._cells.append(turn * self._width + i)
            self._spent.append(self._current[i])
            if cats is not None:
                cats[self._names[i]] = self._current[i]
            self._current[i] = 0
        self._touched.clear()
        if cats is not None:
            self._write(end, cpu_end, cats)
        self._gc_now[:] = (0, 0, 0)
        self._leaves.clear()

    def _write(self, end: int, cpu_end: int, cats: dict[str, int]) -> None:
        leaves = sorted(self._leaves.items(), key=lambda item: -item[1])[:3]
        record = {
            "role": self._role,
            "t0": self._first,
            "busy_us": (end - self._first) // 1000,
            "cpu_us": (cpu_end - self._cpu0) // 1000,
            "handles": self._handles,
            "gc": list(self._gc_now),
            "cats": {key: value // 1000 for key, value in cats.items() if value >= 1000},
            "leaves": [[leaf, spent // 1000] for leaf, spent in leaves],
        }
        os.write(self._fd, json.dumps(record).encode() + b"\n")

    # -------------------------------------------------------------------- results

    def mark(self, what: str, start_ns: int, end_ns: int) -> None:
        """Write a marker: the span ``[start_ns, end_ns]`` (``perf_counter_ns``) is ``what``."""
        if self._fd >= 0:
            record = {"role": self._role, "mark": what, "start": start_ns, "end": end_ns}
            os.write(self._fd, json.dumps(record).encode() + b"\n")

    def turns(self) -> list[Turn]:
        """Every turn traced so far, in order."""
        by_turn: dict[int, dict[str, int]] = {}
        for cell, ns in zip(self._cells, self._spent, strict=True):
            turn, i = divmod(cell, self._width)
            by_turn.setdefault(turn, {})[self._names[i]] = ns
        gcs = self._gcs
        return [
            Turn(
                self._starts[i],
                self._ends[i],
                self._cpus[i],
                self._handle_counts[i],
                (gcs[3 * i], gcs[3 * i + 1], gcs[3 * i + 2]),
                by_turn.get(i, {}),
            )
            for i in range(len(self._starts))
        ]


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
        print("  CPU in them by category (ms):", file=out)
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
