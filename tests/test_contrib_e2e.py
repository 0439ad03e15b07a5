"""End-to-end tests of garcon_link.contrib: the hooks registered on real endpoints over loopback.

A worker (``gl.Worker(..., hooks=[...])``) listens and a controller (``gl.connect(...,
hooks=[...])``) dials it, each end with hooks of its own, exporting to its own in-memory exporter
or registry as two processes would. What is asserted: the worker's span is the child of the
controller's (the trace context travelled in the call's metadata), the handler runs with that span
current and sees the metadata, and a Prometheus scrape of each end shows the call by outcome. The
example under ``examples/observability`` runs the same across two real processes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import garcon_link as gl
from garcon_link.contrib.otel import OpenTelemetryHook
from garcon_link.contrib.prometheus import PrometheusHook, StatisticsCollector
from garcon_link.rpc.hooks import CallHook, call_metadata

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10
SECRET = gl.Secret(b"t" * 32)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "observability" / "run.py"


class Traced(Protocol):
    async def whoami(self) -> list[str]: ...

    async def add(self, a: int, b: int) -> int: ...


class TracedImpl:
    async def whoami(self) -> list[str]:
        """The handler's view: the current span (trace id, span id) and the caller's metadata."""
        context = trace.get_current_span().get_span_context()
        return [
            format(context.trace_id, "032x"),
            format(context.span_id, "016x"),
            call_metadata().get("traceparent", ""),
        ]

    async def add(self, a: int, b: int) -> int:
        return a + b


@asynccontextmanager
async def pair(
    worker_hooks: list[CallHook], controller_hooks: list[CallHook]
) -> AsyncIterator[gl.RemoteExecutor]:
    worker_cfg = gl.LinkConfig(
        executor_id="box", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    async with gl.Worker(worker_cfg, {"traced": TracedImpl()}, hooks=worker_hooks) as worker:
        controller_cfg = gl.LinkConfig(
            executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, dial=worker.link.url
        )
        async with gl.connect(controller_cfg, hooks=controller_hooks) as executor:
            await executor.wait_ready(5)
            yield executor


def tracing() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def finished(exporter: InMemorySpanExporter, count: int) -> list[Any]:
    """The exporter's spans but the link's own (``$link/...``, the session's manifest request)
    once ``count`` ended (the server's may end just after the reply)."""
    while True:
        spans = [s for s in exporter.get_finished_spans() if not s.name.startswith("$")]
        if len(spans) >= count:
            return spans
        await anyio.sleep(0.005)


async def test_the_worker_span_is_a_child_of_the_controller_span() -> None:
    controller_provider, controller_spans = tracing()
    worker_provider, worker_spans = tracing()
    tracer = controller_provider.get_tracer("test")
    with anyio.fail_after(DEADLINE):
        async with pair(
            [OpenTelemetryHook(tracer_provider=worker_provider)],
            [OpenTelemetryHook(tracer_provider=controller_provider)],
        ) as executor:
            traced = executor.service("traced", Traced)
            with tracer.start_as_current_span("job") as job:
                trace_id, span_id, traceparent = await traced.whoami()
            (server,) = await finished(worker_spans, 1)
            client, parent = await finished(controller_spans, 2)
    assert parent.name == "job" and client.kind is SpanKind.CLIENT
    assert server.kind is SpanKind.SERVER and server.name == client.name == "traced/whoami"
    assert client.parent.span_id == job.get_span_context().span_id
    assert server.parent is not None and server.parent.is_remote
    assert server.parent.span_id == client.context.span_id
    assert server.context.trace_id == client.context.trace_id == int(trace_id, 16)
    # The handler ran with the worker's span current, and saw the traceparent the client sent.
    assert int(span_id, 16) == server.context.span_id
    assert traceparent.startswith(f"00-{trace_id}-{client.context.span_id:016x}-")
    for span in (client, server):
        assert span.attributes["rpc.system"] == "garcon_link"
        assert span.attributes["garcon_link.executor"] == "box"
        assert span.attributes["garcon_link.outcome"] == "ok"
        assert span.status.status_code is StatusCode.UNSET


async def test_a_rejected_call_is_an_error_span_on_the_client() -> None:
    provider, spans = tracing()
    with anyio.fail_after(DEADLINE):
        async with pair([], [OpenTelemetryHook(tracer_provider=provider)]) as executor:
            traced = executor.service("traced")
            with pytest.raises(gl.Rejected):
                await traced.add("x", 1)
            (client,) = await finished(spans, 1)
    assert client.status.status_code is StatusCode.ERROR
    assert client.attributes["garcon_link.outcome"] == "rejected"
    assert client.attributes["garcon_link.code"] == "INVALID_ARGUMENTS"


def scrape(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_a_prometheus_scrape_shows_the_calls_on_both_ends() -> None:
    controller_registry, worker_registry = CollectorRegistry(), CollectorRegistry()
    with anyio.fail_after(DEADLINE):
        async with pair(
            [PrometheusHook(registry=worker_registry)],
            [PrometheusHook(registry=controller_registry)],
        ) as executor:
            collector = StatisticsCollector(registry=controller_registry)
            collector.add("link", executor.link.statistics, executor="box")
            traced = executor.service("traced", Traced)
            assert await traced.add(1, 2) == 3
            assert await traced.add(2, 2) == 4
            with pytest.raises(gl.Rejected):
                await executor.service("traced").add("x", 1)
            ok = {"executor": "box", "service": "traced", "method": "add", "outcome": "ok"}
            server_ok = frozenset({**ok, "side": "server"}.items())
            while scrape(worker_registry).get(("garcon_link_calls_total", server_ok)) != 2:
                await anyio.sleep(0.005)  # the handler's end is recorded just after its reply
            controller = scrape(controller_registry)
    client_ok = frozenset({**ok, "side": "client"}.items())
    rejected = frozenset({**ok, "side": "client", "outcome": "rejected"}.items())
    assert controller["garcon_link_calls_total", client_ok] == 2
    assert controller["garcon_link_calls_total", rejected] == 1
    assert controller["garcon_link_call_duration_seconds_count", client_ok] == 2
    box = frozenset({("executor", "box")})
    assert controller["garcon_link_link_fresh_sessions_total", box] == 1


@pytest.mark.slow
def test_the_observability_example_prints_one_trace_across_two_processes() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "garcon_link_calls_total{" in out and 'outcome="ok"' in out
    assert "SERVER calc/add" in out and "CLIENT calc/add" in out
    assert "calls.client={('ok', None): 1} sessions=1" in out  # executor.statistics()
    assert "observability: ok" in out
