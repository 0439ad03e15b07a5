"""observability: one call traced across two processes, and what Prometheus scrapes on each end.

Run: ``python examples/observability/run.py`` (needs the ``prometheus`` and ``otel`` extras and
``opentelemetry-sdk``).

1. A worker runs in a child process (this script with ``--worker``), with an
   :class:`~garcon_link.contrib.otel.OpenTelemetryHook` and a
   :class:`~garcon_link.contrib.prometheus.PrometheusHook`, its spans kept by the SDK's in-memory
   exporter;
2. a controller here, with the same two hooks, calls ``calc.add(2, 3)`` inside a span of its own;
3. the worker is told to stop (its stdin closes) and prints its spans and its scrape;
4. the script prints the one trace, both processes' spans in one tree, and both scrapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.streams.text import TextReceiveStream
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

import garcon_link as gl
from garcon_link.contrib.otel import OpenTelemetryHook
from garcon_link.contrib.prometheus import PrometheusHook, StatisticsCollector
from garcon_link.settings.secrets import read_secret_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import say, workspace  # noqa: E402


class Calc(Protocol):
    async def add(self, a: int, b: int) -> int: ...


class CalcImpl:
    async def add(self, a: int, b: int) -> int:
        # A span made by the handler is a child of the worker's span (the current one here).
        with trace.get_tracer("calc").start_as_current_span("add numbers"):
            return a + b


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider, exporter


def as_record(span: ReadableSpan, process: str) -> dict[str, Any]:
    assert span.context is not None and span.start_time is not None and span.end_time is not None
    return {
        "process": process,
        "name": span.name,
        "kind": span.kind.name,
        "trace": f"{span.context.trace_id:032x}",
        "span": f"{span.context.span_id:016x}",
        "parent": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "remote_parent": bool(span.parent is not None and span.parent.is_remote),
        "ms": (span.end_time - span.start_time) / 1e6,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


KEEP = (
    "# TYPE garcon_link_calls_total",
    "garcon_link_calls_total",
    "# TYPE garcon_link_call_duration_seconds histogram",
    'garcon_link_call_duration_seconds_bucket{executor="calc-1",le="0.001"',
    'garcon_link_call_duration_seconds_bucket{executor="calc-1",le="0.005"',
    "garcon_link_call_duration_seconds_count",
    "garcon_link_link_fresh_sessions_total",
    "garcon_link_link_handshakes_completed_total",
    "garcon_link_link_resumed_total",
)


def metric_lines(registry: CollectorRegistry) -> list[str]:
    """Part of the scrape (what a Prometheus server reads from /metrics), for a short printout:
    the call counter, two histogram buckets and the count, three of the link's counters."""
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if line.startswith(KEEP)]


# --------------------------------------------------------------------------- worker (child)


async def worker(secret_file: str) -> None:
    _, exporter = tracing()
    registry = CollectorRegistry()
    hooks = [OpenTelemetryHook(), PrometheusHook(registry=registry)]
    config = gl.LinkConfig(
        executor_id="calc-1",
        role=gl.Role.WORKER,
        secret=read_secret_file(secret_file),
        listen=("127.0.0.1", 0),
    )
    async with gl.Worker(config, {"calc": CalcImpl()}, hooks=hooks) as served:
        print(f"listening {served.link.url}", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until the controller closes our stdin
    for span in exporter.get_finished_spans():
        print("span " + json.dumps(as_record(span, "worker")), flush=True)
    for line in metric_lines(registry):
        print(f"metric {line}", flush=True)


# --------------------------------------------------------------------------- controller


def tree(records: list[dict[str, Any]]) -> list[str]:
    children: dict[str | None, list[dict[str, Any]]] = {}
    for record in records:
        children.setdefault(record["parent"], []).append(record)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for r in sorted(children.get(parent, []), key=lambda r: r["process"] != "controller"):
            attributes = " ".join(
                f"{k}={v}"
                for k, v in r["attributes"].items()
                if k in ("rpc.service", "rpc.method", "garcon_link.executor", "garcon_link.outcome")
            )
            via = " (parent from traceparent metadata)" if r["remote_parent"] else ""
            lines.append(
                f"{'  ' * depth}[{r['process']}] {r['kind']} {r['name']}  span={r['span']}"
                f" {r['ms']:.2f} ms status={r['status']} {attributes}{via}".rstrip()
            )
            walk(r["span"], depth + 1)

    walk(None, 0)
    return lines


async def main(root: Path) -> None:
    secret_file = root / "link.secret"
    provider, exporter = tracing()
    registry = CollectorRegistry()
    command = [sys.executable, str(HERE / "run.py"), "--worker", str(secret_file)]
    async with await anyio.open_process(command) as process:
        assert process.stdout is not None and process.stdin is not None
        lines = TextReceiveStream(process.stdout)
        pending = ""
        worker_out: list[str] = []
        with anyio.fail_after(30):
            async for chunk in lines:
                pending += chunk
                if "\n" in pending:
                    break
        url = pending.split("\n", 1)[0].removeprefix("listening ")
        say(f"worker (child process {process.pid}) listening on {url}")
        config = gl.LinkConfig(
            executor_id="calc-1",
            role=gl.Role.CONTROLLER,
            secret=read_secret_file(secret_file),
            dial=url,
        )
        hooks = [OpenTelemetryHook(), PrometheusHook(registry=registry)]
        async with gl.connect(config, hooks=hooks) as executor:
            # The link's counters too, read from its statistics snapshot at each scrape.
            collector = StatisticsCollector(registry=registry)
            collector.add("link", executor.link.statistics, executor="calc-1")
            await executor.wait_ready(10)
            calc = executor.service("calc", Calc)
            with provider.get_tracer("example").start_as_current_span("controller job"):
                result = await calc.add(2, 3)
            say(f"await calc.add(2, 3) -> {result}")
            stats = executor.statistics()
            say("executor.statistics() (some of its fields):")
            say(f"  calls.client={dict(stats.calls.client)} sessions={stats.sessions}")
            say(
                f"  pending_calls={stats.pending_calls} (peak {stats.pending_calls_peak})"
                f" retained_bytes={stats.retained_bytes} (peak {stats.retained_bytes_peak})"
            )
            say(
                f"  resumes={stats.resumes} fresh_sessions={stats.fresh_sessions}"
                f" bytes_sent={stats.bytes_sent} bytes_received={stats.bytes_received}"
            )
        await process.stdin.aclose()
        with anyio.fail_after(30):
            async for chunk in lines:
                pending += chunk
        worker_out = pending.split("\n", 1)[1].splitlines()
        await process.wait()
    records = [as_record(span, "controller") for span in exporter.get_finished_spans()]
    records += [json.loads(line[5:]) for line in worker_out if line.startswith("span ")]
    # The link's own calls (``$link/describe``: the manifest asked for at each fresh session) are
    # traces of their own; this printout follows the one call made above.
    records = [r for r in records if not r["name"].startswith("$")]
    traces = {r["trace"] for r in records}
    say()
    say(f"one trace across both processes: {len(traces) == 1} (trace id {records[0]['trace']})")
    for line in tree(records):
        say(f"  {line}")
    say()
    say("controller scrape:")
    for line in metric_lines(registry):
        say(f"  {line}")
    say("worker scrape:")
    for line in worker_out:
        if line.startswith("metric "):
            say(f"  {line[7:]}")
    server = [r for r in records if r["kind"] == "SERVER" and r["name"] == "calc/add"]
    client = [r for r in records if r["kind"] == "CLIENT" and r["name"] == "calc/add"]
    if len(traces) != 1 or len(server) != 1 or len(client) != 1 or result != 5:
        raise SystemExit("observability: unexpected spans or result")
    if server[0]["parent"] != client[0]["span"]:
        raise SystemExit("observability: the worker span is not the child of the controller's")
    say("observability: ok")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        anyio.run(worker, sys.argv[2])
    else:
        with workspace(HERE) as root:
            anyio.run(main, root)
