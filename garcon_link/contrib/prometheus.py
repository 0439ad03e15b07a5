"""Prometheus metrics for garcon_link: a per-call hook and a collector over statistics snapshots.

Needs the ``prometheus`` extra (``prometheus_client``); ``import garcon_link`` never imports it.

:class:`PrometheusHook` is a :class:`~garcon_link.rpc.hooks.CallHook` (register it with
``gl.connect(config, hooks=[hook])``, ``gl.Worker(..., hooks=[hook])``, ...). For every call that
ended it counts ``garcon_link_calls_total`` and observes ``garcon_link_call_duration_seconds`` (a
histogram), both labelled:

* ``side``: ``client`` (the caller) or ``server`` (the handler's side);
* ``executor``: the executor id (``""`` when the endpoint does not know it);
* ``service``, ``method``: what was called;
* ``outcome``: :attr:`~garcon_link.rpc.hooks.CallEnd.label`: ``ok``, ``cancelled``, or an
  :class:`~garcon_link.errors.Outcome` value (``not_dispatched``, ``rejected``, ``unknown``,
  ``failed``).

**Bounded cardinality.** Label values come from names a peer or a careless caller chooses, so each
dimension is capped: at most ``max_executors`` distinct executor values, ``max_services`` services
and ``max_methods`` distinct (service, method) pairs; values past a cap, and values longer than
``max_label_length`` characters, are counted under ``"other"`` (first come, first kept). The
label sets are therefore at most ``2 x (max_executors + 1) x (max_methods + max_services + 1) x 6``
(sides x executors x service-method pairs x outcomes) whatever the peers send; the histogram has
one series per bucket for each.

:class:`StatisticsCollector` is a ``prometheus_client`` collector over statistics *snapshots*:
any callable returning a dataclass instance (``executor.link.statistics``, ``fleet.statistics``,
``executor.statistics``) or a mapping of executor id to one (``fleet.executors``). It reads the
snapshot's fields generically (:func:`dataclasses.fields`) at scrape time, so a snapshot that
gains a field gains a metric with no change here. Each field becomes
``<namespace>_<subsystem>_<field>``:

* a number: a counter, or a gauge when the field is a level rather than a running count (its
  ``metadata["metric"]`` says ``"gauge"``, or its name has a word among ``now``, ``peak``,
  ``current``, ``pending``, ``incoming``, ``retained``, ``running``, ``queued``, ``attached``,
  ``live``, ``since``, ``size``), floats and bools as gauges;
* a mapping of keys to numbers (``handshakes_failed`` by reason): one sample per key, labelled
  ``key`` (at most ``max_keys`` keys, the rest summed under ``"other"``);
* a nested dataclass: its fields, named ``<field>_<subfield>``;
* anything else (text, ``None``): skipped.

A source that raises is skipped for that scrape (logged once).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeGuard

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..rpc.hooks import CallEnd, CallInfo

__all__ = ["DEFAULT_BUCKETS", "OTHER", "PrometheusHook", "StatisticsCollector"]

log = logging.getLogger(__name__)

OTHER = "other"
"""The label value that every value past a cardinality cap is counted under."""

DEFAULT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Latency buckets (seconds): a loopback call is well under a millisecond, a long one a minute."""

LABELS = ("side", "executor", "service", "method", "outcome")

_GAUGE_WORDS = frozenset(
    {
        "now",
        "peak",
        "current",
        "pending",
        "incoming",
        "retained",
        "running",
        "queued",
        "attached",
        "live",
        "since",
        "size",
    }
)
_METRIC_NAME = re.compile(r"[^a-zA-Z0-9_]")


class _Fold:
    """First ``cap`` distinct values kept as themselves; later or overlong ones become OTHER."""

    __slots__ = ("_cap", "_max_length", "_seen")

    def __init__(self, cap: int, max_length: int) -> None:
        if cap < 0:
            raise ValueError("a label cap must be >= 0")
        self._cap = cap
        self._max_length = max_length
        self._seen: set[object] = set()

    def __call__(self, key: object, value: str) -> str:
        if key in self._seen:
            return value
        if len(value) > self._max_length or len(self._seen) >= self._cap:
            return OTHER
        self._seen.add(key)
        return value


class PrometheusHook:
    """A call hook counting calls and timing them (see the module docstring for the metrics).

    Args:
        registry: where the two metrics are registered (default: prometheus_client's global
            registry). One hook per registry and namespace: a second raises ``ValueError``
            (duplicated timeseries); share the hook between endpoints instead.
        namespace: the metric name prefix.
        buckets: the latency histogram's upper bounds, in seconds.
        max_executors: distinct ``executor`` label values kept (the rest: ``"other"``).
        max_services: distinct ``service`` label values kept.
        max_methods: distinct (service, method) pairs kept.
        max_label_length: longer names are counted as ``"other"``.
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = REGISTRY,
        namespace: str = "garcon_link",
        buckets: Iterable[float] = DEFAULT_BUCKETS,
        max_executors: int = 64,
        max_services: int = 32,
        max_methods: int = 128,
        max_label_length: int = 64,
    ) -> None:
        self.calls = Counter(
            "calls",
            "Remote calls that ended, by side, executor, service, method and outcome.",
            LABELS,
            namespace=namespace,
            registry=registry,
        )
        self.duration = Histogram(
            "call_duration_seconds",
            "Seconds from a call's start to its end (client: the caller's wait; server: the "
            "handler's run).",
            LABELS,
            namespace=namespace,
            registry=registry,
            buckets=tuple(buckets),
        )
        self._executors = _Fold(max_executors, max_label_length)
        self._services = _Fold(max_services, max_label_length)
        self._methods = _Fold(max_methods, max_label_length)

    def labels(self, call: CallInfo, end: CallEnd) -> tuple[str, str, str, str, str]:
        """The (bounded) label values this hook records ``call`` under."""
        executor = call.executor or ""
        service = self._services(call.service, call.service)
        method = OTHER if service == OTHER else self._methods((service, call.method), call.method)
        return (call.side, self._executors(executor, executor), service, method, end.label)

    def call_started(self, call: CallInfo) -> None:
        """Nothing to do at the start: everything is recorded when the call ends."""

    def call_ended(self, call: CallInfo, state: object, end: CallEnd) -> None:
        """Count the call and observe its duration."""
        labels = self.labels(call, end)
        self.calls.labels(*labels).inc()
        self.duration.labels(*labels).observe(end.duration)


Source = Callable[[], Any]


@dataclasses.dataclass(slots=True)
class _Watched:
    subsystem: str
    source: Source
    executor: str | None
    failed: bool = False
    label: str = "executor"


@dataclasses.dataclass(slots=True)
class _Family:
    kind: str  # "counter" | "gauge"
    documentation: str
    samples: list[tuple[dict[str, str], float]] = dataclasses.field(default_factory=list)


class StatisticsCollector(Collector):
    """A ``prometheus_client`` collector over statistics snapshots (see the module docstring).

    Register it with ``registry.register(collector)`` (or pass ``registry=``) and add sources
    with :meth:`add`.

    Args:
        registry: registered there at once when given.
        namespace: the metric name prefix.
        max_executors: distinct ``executor`` label values per scrape (the rest: ``"other"``,
            summed).
        max_keys: distinct ``key`` label values per mapping field (the rest summed as
            ``"other"``).
    """

    def __init__(
        self,
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "garcon_link",
        max_executors: int = 256,
        max_keys: int = 64,
    ) -> None:
        self._namespace = namespace
        self._max_executors = max_executors
        self._max_keys = max_keys
        self._sources: list[_Watched] = []
        if registry is not None:
            registry.register(self)

    def add(
        self,
        subsystem: str,
        source: Source,
        *,
        executor: str | None = None,
        label: str = "executor",
    ) -> Callable[[], None]:
        """Read ``source()`` at every scrape; returns a callable that removes it.

        Args:
            subsystem: the metric name's middle part (``link``, ``executor``, ``fleet``...).
            source: returns a dataclass snapshot, or a mapping of executor id to one (each
                labelled with its executor).
            executor: the ``executor`` label of a single snapshot (``None``: no label).
            label: the label's name: ``"executor"``, or ``"caller"`` for a gateway's callers
                (``collector.add("gateway_callers", gw.callers, label="caller")``); each label
                name has its own cap of ``max_executors`` values per scrape.
        """
        if not subsystem or _METRIC_NAME.search(subsystem):
            raise ValueError(f"subsystem must be [a-zA-Z0-9_]+, not {subsystem!r}")
        if label not in ("executor", "caller"):
            raise ValueError(f"label must be 'executor' or 'caller', not {label!r}")
        watched = _Watched(subsystem, source, executor, label=label)
        self._sources.append(watched)

        def remove() -> None:
            if watched in self._sources:
                self._sources.remove(watched)

        return remove

    def describe(self) -> list[Any]:
        """Nothing up front: the metrics follow the snapshots' fields (read at scrape time)."""
        return []

    def collect(self) -> Iterator[Any]:
        """Read every source once and yield one metric family per field."""
        families: dict[str, _Family] = {}
        folds = {
            "executor": _Fold(self._max_executors, 256),
            "caller": _Fold(self._max_executors, 256),
        }
        for watched in list(self._sources):
            try:
                snapshot = watched.source()
            except Exception as exc:
                if not watched.failed:
                    watched.failed = True
                    log.warning("statistics source %r failed: %s", watched.subsystem, exc)
                continue
            prefix = f"{self._namespace}_{watched.subsystem}"
            items: list[tuple[str | None, Any]]
            if isinstance(snapshot, Mapping):
                items = [(str(k), v) for k, v in snapshot.items()]
            else:
                items = [(watched.executor, snapshot)]
            fold = folds[watched.label]
            for executor, value in items:
                labels = {} if executor is None else {watched.label: fold(executor, executor)}
                self._add_fields(families, prefix, value, labels)
        for name, family in families.items():
            yield _build(name, family)

    def _add_fields(
        self, families: dict[str, _Family], prefix: str, snapshot: object, labels: dict[str, str]
    ) -> None:
        if not dataclasses.is_dataclass(snapshot) or isinstance(snapshot, type):
            return
        for f in dataclasses.fields(snapshot):
            value = getattr(snapshot, f.name, None)
            name = f"{prefix}_{f.name}"
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                self._add_fields(families, name, value, labels)
            elif isinstance(value, Mapping):
                counted = [(_key_label(k), v) for k, v in value.items() if _is_number(v)]
                if not counted:
                    continue
                kind = _kind(f, counted[0][1])
                family = families.setdefault(name, _Family(kind, _doc(name, f)))
                keys = _Fold(self._max_keys, 128)
                for key, number in counted:
                    family.samples.append(({**labels, "key": keys(key, key)}, float(number)))
            elif _is_number(value):
                family = families.setdefault(name, _Family(_kind(f, value), _doc(name, f)))
                family.samples.append((labels, float(value)))


def _key_label(key: object) -> str:
    """A mapping key as a label value: a tuple key (``CallStatistics``' ``(label, code)``) is
    its non-empty parts joined by ``:``, e.g. ``not_dispatched:OVERLOADED``."""
    if isinstance(key, tuple):
        return ":".join(str(part) for part in key if part is not None)
    return str(key)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float)


def _kind(f: dataclasses.Field[Any], value: object) -> str:
    declared = f.metadata.get("metric")
    if declared in ("counter", "gauge"):
        return str(declared)
    if isinstance(value, bool | float) or _GAUGE_WORDS.intersection(f.name.split("_")):
        return "gauge"
    return "counter"


def _doc(name: str, f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("doc") or f"garcon_link statistics field {name}")


def _build(name: str, family: _Family) -> CounterMetricFamily | GaugeMetricFamily:
    """One metric family; samples that share labels (folded into "other") are summed."""
    labelnames = sorted({k for labels, _ in family.samples for k in labels})
    summed: dict[tuple[str, ...], float] = {}
    for labels, value in family.samples:
        key = tuple(labels.get(k, "") for k in labelnames)
        summed[key] = summed.get(key, 0.0) + value
    metric: CounterMetricFamily | GaugeMetricFamily
    if family.kind == "counter":
        metric = CounterMetricFamily(name, family.documentation, labels=labelnames)
    else:
        metric = GaugeMetricFamily(name, family.documentation, labels=labelnames)
    for values, value in summed.items():
        metric.add_metric(list(values), value)
    return metric
