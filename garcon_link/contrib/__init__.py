"""Optional adapters to observability libraries, each behind its own extra.

* :mod:`garcon_link.contrib.prometheus` (``pip install garcon-link[prometheus]``): a call hook
  counting calls and timing them, and a collector over the endpoints' statistics snapshots.
* :mod:`garcon_link.contrib.otel` (``pip install garcon-link[otel]``): a call hook making one
  OpenTelemetry span per call on both sides, the trace context carried in the call's metadata.

Nothing here is imported by ``import garcon_link``: the core never depends on these libraries.
"""
