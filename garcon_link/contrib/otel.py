"""OpenTelemetry tracing for garcon_link: one span per call on both sides, one trace across them.

Needs the ``otel`` extra (``opentelemetry-api``; an SDK to export anything);
``import garcon_link`` never imports it.

:class:`OpenTelemetryHook` is a :class:`~garcon_link.rpc.hooks.CallHook`; register the same kind of
hook on both ends (``gl.connect(config, hooks=[OpenTelemetryHook()])`` on the controller,
``gl.Worker(..., hooks=[OpenTelemetryHook()])`` on the worker):

* **Client side** (``call_started`` runs in the caller's task before the request is encoded): a
  ``CLIENT`` span starts as a child of the caller's current span, and its context is injected into
  :attr:`~garcon_link.rpc.hooks.CallInfo.metadata` with the global propagator (W3C ``traceparent``,
  plus ``tracestate`` and ``baggage`` when there are any), so it travels with the call.
* **Server side** (``call_started`` runs inside the handler's task, before the handler): the
  context is extracted from the caller's metadata and a ``SERVER`` span starts as its child and
  is *attached* as the current context, so spans the handler makes are its children; it is
  detached in ``call_ended`` (same task), then the span ends.

The span is named ``<service>/<method>`` and carries ``rpc.system="garcon_link"``,
``rpc.service``, ``rpc.method``, ``garcon_link.executor`` (when known), ``garcon_link.call_kind``,
and at the end ``garcon_link.outcome`` (:attr:`~garcon_link.rpc.hooks.CallEnd.label`) and
``garcon_link.code`` (the outcome's code, when there is one). Every outcome but ``ok`` sets the
span's status to ``ERROR`` (described by its code).

Metadata is bounded (``Limits.max_metadata_entries``, ``max_metadata_bytes``), and a call whose
metadata is over the bounds is refused before it is sent; so this hook never adds more than
``max_metadata_bytes`` bytes (default 512; ``traceparent`` alone is 55): entries past the budget
(a large ``baggage``, typically) are left out and that is logged once. Keys the library would
refuse (anything but ``[a-z0-9._-]``) are left out too. A hook never changes a call's outcome.
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import __version__
from ..rpc.hooks import CallEnd, CallInfo

__all__ = ["OpenTelemetryHook"]

log = logging.getLogger(__name__)

_KEY = re.compile(r"[a-z0-9._-]{1,64}")


class OpenTelemetryHook:
    """A call hook making one span per call (see the module docstring).

    Args:
        tracer_provider: where spans go (default: the global tracer provider).
        propagator: how the context is written into and read from the call's metadata
            (default: the global propagator, W3C trace context and baggage).
        max_metadata_bytes: the most this hook adds to a call's metadata (keys and values,
            UTF-8); entries that would pass it are left out.
    """

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        propagator: TextMapPropagator | None = None,
        max_metadata_bytes: int = 512,
    ) -> None:
        self._tracer = trace.get_tracer("garcon_link", __version__, tracer_provider)
        self._propagator = propagator
        self._max_metadata_bytes = max_metadata_bytes
        self._warned = False

    def call_started(self, call: CallInfo) -> object:
        """Start the call's span (client: and inject its context; server: and attach it)."""
        attributes: dict[str, str] = {
            "rpc.system": "garcon_link",
            "rpc.service": call.service,
            "rpc.method": call.method,
            "garcon_link.call_kind": call.kind,
        }
        if call.executor is not None:
            attributes["garcon_link.executor"] = call.executor
        name = f"{call.service}/{call.method}"
        if call.side == "client":
            span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
            carrier: dict[str, str] = {}
            self._inject(carrier, trace.set_span_in_context(span))
            if isinstance(call.metadata, MutableMapping):
                self._add(call.metadata, carrier)
            return (span, None)
        parent = self._extract(dict(call.metadata))
        span = self._tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return (span, token)

    def call_ended(self, call: CallInfo, state: object, end: CallEnd) -> None:
        """Record the outcome on the span, detach its context (server side) and end it."""
        if not isinstance(state, tuple) or len(state) != 2:
            return
        span, token = state
        if not isinstance(span, trace.Span):
            return
        try:
            span.set_attribute("garcon_link.outcome", end.label)
            if end.code is not None:
                span.set_attribute("garcon_link.code", end.code)
            if end.label != "ok":
                span.set_status(Status(StatusCode.ERROR, end.code or end.label))
        finally:
            try:
                if token is not None:
                    otel_context.detach(token)
            finally:
                span.end()

    # -- propagation

    def _inject(self, carrier: dict[str, str], ctx: otel_context.Context) -> None:
        if self._propagator is not None:
            self._propagator.inject(carrier, context=ctx)
        else:
            propagate.inject(carrier, context=ctx)

    def _extract(self, carrier: dict[str, str]) -> otel_context.Context:
        if self._propagator is not None:
            return self._propagator.extract(carrier)
        return propagate.extract(carrier)

    def _add(self, metadata: MutableMapping[str, str], carrier: dict[str, Any]) -> None:
        budget = self._max_metadata_bytes
        left_out: list[str] = []
        for key, value in carrier.items():
            if not isinstance(value, str) or not _KEY.fullmatch(key):
                left_out.append(key)
                continue
            size = len(key.encode()) + len(value.encode())
            if size > budget:
                left_out.append(key)
                continue
            metadata[key] = value
            budget -= size
        if left_out and not self._warned:
            self._warned = True
            log.warning(
                "trace context entries left out of a call's metadata (over %d bytes or not a "
                "valid key): %s",
                self._max_metadata_bytes,
                ", ".join(sorted(left_out)),
            )
