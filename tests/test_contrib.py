"""Tests of garcon_link.contrib: the Prometheus and OpenTelemetry adapters, with the real libraries.

The hooks are driven directly with :class:`CallInfo` / :class:`CallEnd` values (the RPC layer's
side of the contract is tested in ``test_contrib_e2e.py``); metrics are read back through a
private ``CollectorRegistry`` and ``generate_latest`` (what a scrape returns), spans through the
SDK's in-memory exporter.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import garcon_link as gl
from garcon_link.api.endpoint import ExecutorStatistics
from garcon_link.contrib.otel import OpenTelemetryHook
from garcon_link.contrib.prometheus import OTHER, PrometheusHook, StatisticsCollector
from garcon_link.net.ws import LinkStatistics
from garcon_link.rpc.hooks import CallEnd, CallInfo
from garcon_link.rpc.rpc import CallStatistics

OK = CallEnd(outcome=None, code=None, duration=0.002)


def info(side: Any = "client", service: str = "calc", method: str = "add", **kw: Any) -> CallInfo:
    kw.setdefault("kind", "unary")
    kw.setdefault("executor", "gpu-1")
    kw.setdefault("metadata", {})
    return CallInfo(side=side, service=service, method=method, **kw)


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What a scrape says: (sample name, sorted labels) -> value, parsed from the text format."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


# ------------------------------------------------------------------------------ imports


def test_importing_garcon_link_imports_neither_library() -> None:
    code = (
        "import sys, garcon_link, garcon_link.contrib; "
        "bad = [m for m in sys.modules if m.startswith(('prometheus_client', 'opentelemetry'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------ Prometheus hook


def test_prometheus_hook_counts_and_times_calls_by_outcome() -> None:
    registry = CollectorRegistry()
    hook = PrometheusHook(registry=registry)
    call = info()
    hook.call_started(call)  # returns no state: call_ended gets None
    hook.call_ended(call, None, OK)
    hook.call_ended(call, None, CallEnd(gl.Outcome.REJECTED, "INVALID_ARGUMENTS", 0.0001))
    server = info(side="server", method="count", kind="stream")
    hook.call_ended(server, None, CallEnd(gl.Outcome.UNKNOWN, None, 0.3, cancelled=True))
    got = samples(registry)
    base = {"executor": "gpu-1", "service": "calc"}
    ok = labels(side="client", method="add", outcome="ok", **base)
    rejected = labels(side="client", method="add", outcome="rejected", **base)
    cancelled = labels(side="server", method="count", outcome="cancelled", **base)
    assert got["garcon_link_calls_total", ok] == 1
    assert got["garcon_link_calls_total", rejected] == 1
    assert got["garcon_link_calls_total", cancelled] == 1
    assert got["garcon_link_call_duration_seconds_count", ok] == 1
    assert got["garcon_link_call_duration_seconds_sum", ok] == pytest.approx(0.002)
    ok_le = labels(side="client", method="add", outcome="ok", le="0.001", **base)
    assert got["garcon_link_call_duration_seconds_bucket", ok_le] == 0
    ok_le = labels(side="client", method="add", outcome="ok", le="0.0025", **base)
    assert got["garcon_link_call_duration_seconds_bucket", ok_le] == 1
    assert got["garcon_link_call_duration_seconds_sum", cancelled] == pytest.approx(0.3)


def test_prometheus_hook_folds_label_values_past_the_caps() -> None:
    registry = CollectorRegistry()
    hook = PrometheusHook(
        registry=registry, max_executors=2, max_services=2, max_methods=3, max_label_length=10
    )
    # A hostile or careless peer: a thousand executor ids, services and methods.
    for i in range(1000):
        hook.call_ended(info(executor=f"e{i}", service=f"s{i % 500}", method=f"m{i}"), None, OK)
    hook.call_ended(info(executor="e0", service="s0", method="x" * 11), None, OK)
    got = samples(registry)
    series = [key for key in got if key[0] == "garcon_link_calls_total"]
    executors = {dict(k[1])["executor"] for k in series}
    services = {dict(k[1])["service"] for k in series}
    methods = {(dict(k[1])["service"], dict(k[1])["method"]) for k in series}
    assert executors == {"e0", "e1", OTHER}
    assert services == {"s0", "s1", OTHER}
    # (s0, m0), (s1, m1) and (s0, m500) kept (three pairs); later pairs of s0 and s1 folded.
    kept = {("s0", "m0"), ("s1", "m1"), ("s0", "m500")}
    assert methods == kept | {("s0", OTHER), ("s1", OTHER), (OTHER, OTHER)}
    # Every call is counted somewhere, none dropped.
    assert sum(value for key, value in got.items() if key[0] == "garcon_link_calls_total") == 1001


def test_prometheus_hook_without_an_executor_labels_it_empty() -> None:
    registry = CollectorRegistry()
    hook = PrometheusHook(registry=registry)
    hook.call_ended(info(executor=None), None, OK)
    got = samples(registry)
    key = labels(side="client", executor="", service="calc", method="add", outcome="ok")
    assert got["garcon_link_calls_total", key] == 1


# ------------------------------------------------------------------------------ collector


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    frames_now: int
    bytes_peak: int


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """A stand-in for the fuller executor.statistics() snapshot: nested, mapped, declared."""

    calls_by_outcome: dict[str, int]
    pending_calls: int
    resumes: int
    retention: Retention
    uptime: float
    note: str | None
    ratio: int = dataclasses.field(default=3, metadata={"metric": "gauge", "doc": "a ratio"})


def test_collector_reads_link_statistics_fields_generically() -> None:
    registry = CollectorRegistry()
    collector = StatisticsCollector(registry=registry)
    stats = LinkStatistics(resumed=2, fresh_sessions=1, handshakes_failed={"AUTH_FAILED": 3})
    stats.upgrades_refused[404] = 5
    collector.add("link", lambda: stats, executor="gpu-1")
    got = samples(registry)
    one = labels(executor="gpu-1")
    assert got["garcon_link_link_resumed_total", one] == 2
    assert got["garcon_link_link_fresh_sessions_total", one] == 1
    assert got["garcon_link_link_dial_attempts_total", one] == 0
    assert got["garcon_link_link_handshakes_failed_total", (*one, ("key", "AUTH_FAILED"))] == 3
    assert got["garcon_link_link_upgrades_refused_total", (*one, ("key", "404"))] == 5
    # Every int field of the snapshot is there: a new field needs no change in the collector.
    names = {name for name, _ in got}
    for f in dataclasses.fields(LinkStatistics):
        assert any(name.startswith(f"garcon_link_link_{f.name}") for name in names) or (
            f.name in ("upgrades_refused", "handshakes_failed")
        )


def test_collector_types_nests_and_maps_a_snapshot_and_a_mapping_of_them() -> None:
    registry = CollectorRegistry()
    collector = StatisticsCollector(registry=registry)
    snap = Snapshot({"ok": 7, "rejected": 1}, 2, 4, Retention(3, 9000), 1.5, "text")
    other = dataclasses.replace(snap, pending_calls=5)
    remove = collector.add("executor", lambda: {"a": snap, "b": other})
    text = generate_latest(registry).decode()
    got = samples(registry)
    assert "# TYPE garcon_link_executor_pending_calls gauge" in text
    assert "# TYPE garcon_link_executor_resumes_total counter" in text
    assert "# TYPE garcon_link_executor_retention_frames_now gauge" in text
    assert "# TYPE garcon_link_executor_ratio gauge" in text
    assert "# HELP garcon_link_executor_ratio a ratio" in text
    assert got["garcon_link_executor_pending_calls", labels(executor="a")] == 2
    assert got["garcon_link_executor_pending_calls", labels(executor="b")] == 5
    assert got["garcon_link_executor_calls_by_outcome_total", labels(executor="a", key="ok")] == 7
    assert got["garcon_link_executor_retention_bytes_peak", labels(executor="b")] == 9000
    assert got["garcon_link_executor_uptime", labels(executor="a")] == 1.5
    assert not any("note" in name for name, _ in got)
    remove()
    assert samples(registry) == {}


def test_collector_labels_a_gateways_callers_capped() -> None:
    registry = CollectorRegistry()
    collector = StatisticsCollector(registry=registry, max_executors=2)
    callers = {
        f"web-{i}": gl.CallerSnapshot(
            f"web-{i}", sessions=1, calls=10 * i, forbidden=i, budget=256, streams=i, watches=1
        )
        for i in range(1, 5)
    }
    collector.add("gateway_callers", lambda: callers, label="caller")
    text = generate_latest(registry).decode()
    got = samples(registry)
    for gauge in ("sessions", "in_flight", "budget", "streams", "watches"):
        assert f"# TYPE garcon_link_gateway_callers_{gauge} gauge" in text
    assert "# TYPE garcon_link_gateway_callers_stream_items_total counter" in text
    assert got["garcon_link_gateway_callers_calls_total", labels(caller="web-1")] == 10
    assert got["garcon_link_gateway_callers_calls_total", labels(caller="web-2")] == 20
    assert got["garcon_link_gateway_callers_streams", labels(caller="web-2")] == 2
    assert got["garcon_link_gateway_callers_budget", labels(caller="web-1")] == 256
    # Past the cap, the rest are summed under "other".
    assert got["garcon_link_gateway_callers_calls_total", labels(caller=OTHER)] == 70
    assert got["garcon_link_gateway_callers_streams", labels(caller=OTHER)] == 7
    with pytest.raises(ValueError, match="label"):
        collector.add("x", dict, label="tenant")


def test_collector_reads_an_executor_statistics_snapshot_with_outcome_keys() -> None:
    registry = CollectorRegistry()
    collector = StatisticsCollector(registry=registry)
    calls = CallStatistics(client={("ok", None): 4, ("not_dispatched", "OVERLOADED"): 2}, server={})
    fields: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(ExecutorStatistics)}
    fields.update(
        executor_id="gpu-1",
        calls=calls,
        handshakes_failed={},
        link=LinkStatistics(),
        transport=None,
        rpc=None,
    )
    collector.add("executor", lambda: ExecutorStatistics(**fields), executor="gpu-1")
    got = samples(registry)
    one = labels(executor="gpu-1")
    assert got["garcon_link_executor_calls_client_total", (*one, ("key", "ok"))] == 4
    key = ("key", "not_dispatched:OVERLOADED")
    assert got["garcon_link_executor_calls_client_total", (*one, key)] == 2


def test_collector_reads_a_fleet_executors_table() -> None:
    registry = CollectorRegistry()
    collector = StatisticsCollector(registry=registry)
    table = {
        "gpu-1": gl.ExecutorSnapshot("gpu-1", "ready", "0a1b2c3d4e5f", 1700000000.5, 12, 2),
        "gpu-2": gl.ExecutorSnapshot("gpu-2", "offline", None, 1700000001.0, 0, 0),
    }
    collector.add("member", lambda: table)
    text = generate_latest(registry).decode()
    got = samples(registry)
    assert got["garcon_link_member_calls_total", labels(executor="gpu-1")] == 12
    assert got["garcon_link_member_errors_total", labels(executor="gpu-1")] == 2
    assert got["garcon_link_member_since", labels(executor="gpu-2")] == 1700000001.0
    assert "# TYPE garcon_link_member_since gauge" in text
    # Text fields (availability, session) are not numbers: no metric, no unbounded label.
    assert "availability" not in text and "0a1b2c3d4e5f" not in text


def test_collector_caps_executors_and_keys_and_survives_a_failing_source() -> None:
    registry = CollectorRegistry()
    collector = StatisticsCollector(registry=registry, max_executors=2, max_keys=2)
    snap = Snapshot({f"k{i}": 1 for i in range(10)}, 1, 0, Retention(0, 0), 0.0, None)
    collector.add("executor", lambda: {f"e{i}": snap for i in range(100)})

    def broken() -> object:
        raise RuntimeError("gone")

    collector.add("broken", broken)
    got = samples(registry)
    pending = {k[1]: v for k, v in got.items() if k[0] == "garcon_link_executor_pending_calls"}
    assert pending == {
        labels(executor="e0"): 1,
        labels(executor="e1"): 1,
        labels(executor=OTHER): 98,
    }
    keys = {
        dict(k[1])["key"]: v
        for k, v in got.items()
        if k[0] == "garcon_link_executor_calls_by_outcome_total" and ("executor", "e0") in k[1]
    }
    assert keys == {"k0": 1, "k1": 1, OTHER: 8}
    with pytest.raises(ValueError, match="subsystem"):
        collector.add("bad name", broken)


# ------------------------------------------------------------------------------ OpenTelemetry


@pytest.fixture
def spans() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_otel_client_span_context_reaches_the_server_span(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    hook = OpenTelemetryHook(tracer_provider=provider)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("caller") as caller:
        client = info()
        client_state = hook.call_started(client)
    assert set(client.metadata) == {"traceparent"}
    # What the worker sees: the metadata that was sent (read-only there).
    server = info(side="server", metadata=dict(client.metadata))
    server_state = hook.call_started(server)
    inside = trace.get_current_span()  # the handler's view: the server span is current
    hook.call_ended(server, server_state, OK)
    assert trace.get_current_span() is not inside  # detached again
    hook.call_ended(client, client_state, OK)
    by_kind = {s.kind: s for s in exporter.get_finished_spans()}
    client_span, server_span = by_kind[SpanKind.CLIENT], by_kind[SpanKind.SERVER]
    assert inside.get_span_context() == server_span.context
    assert client_span.parent is not None
    assert client_span.parent.span_id == caller.get_span_context().span_id
    assert server_span.parent is not None
    assert server_span.parent.span_id == client_span.context.span_id
    assert server_span.context.trace_id == client_span.context.trace_id
    assert client_span.name == server_span.name == "calc/add"
    assert dict(server_span.attributes or {}) == {
        "rpc.system": "garcon_link",
        "rpc.service": "calc",
        "rpc.method": "add",
        "garcon_link.call_kind": "unary",
        "garcon_link.executor": "gpu-1",
        "garcon_link.outcome": "ok",
    }
    assert client_span.status.status_code is StatusCode.UNSET


def test_otel_marks_non_ok_outcomes_as_errors(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    hook = OpenTelemetryHook(tracer_provider=provider)
    client = info(executor=None)
    hook.call_ended(
        client,
        hook.call_started(client),
        CallEnd(gl.Outcome.NOT_DISPATCHED, "OVERLOADED", 0.001),
    )
    server = info(side="server")
    hook.call_ended(server, hook.call_started(server), CallEnd(None, None, 0.1, cancelled=True))
    client_span, server_span = exporter.get_finished_spans()
    assert client_span.status.status_code is StatusCode.ERROR
    assert client_span.status.description == "OVERLOADED"
    assert client_span.attributes is not None
    assert client_span.attributes["garcon_link.outcome"] == "not_dispatched"
    assert client_span.attributes["garcon_link.code"] == "OVERLOADED"
    assert "garcon_link.executor" not in client_span.attributes
    assert server_span.status.status_code is StatusCode.ERROR
    assert server_span.status.description == "cancelled"
    # No metadata from the caller: the server span starts a trace of its own.
    assert server_span.parent is None


def test_otel_keeps_its_metadata_within_its_budget(
    spans: tuple[TracerProvider, InMemorySpanExporter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from opentelemetry import baggage
    from opentelemetry import context as otel_context

    provider, _ = spans
    hook = OpenTelemetryHook(tracer_provider=provider, max_metadata_bytes=100)
    token = otel_context.attach(baggage.set_baggage("user", "x" * 500))
    try:
        client = info()
        state = hook.call_started(client)
        again = info()
        hook.call_ended(again, hook.call_started(again), OK)
    finally:
        otel_context.detach(token)
    hook.call_ended(client, state, OK)
    assert set(client.metadata) == {"traceparent"}  # baggage (over the budget) left out
    assert sum(len(k) + len(v) for k, v in client.metadata.items()) <= 100
    warnings = [r for r in caplog.records if r.name == "garcon_link.contrib.otel"]
    assert len(warnings) == 1 and "baggage" in warnings[0].getMessage()
