"""``garcon-link gateway``: a gateway shown live: its executors' table and its callers' table
(redrawn in place on a terminal), or one line per event; drained on a signal and spoken of to
systemd as ``garcon-link worker`` is (:mod:`._lifecycle`)."""

from __future__ import annotations

import argparse
import sys

import anyio

from ..api.gateway import Gateway, gateway
from ..api.systemd import SystemdNotifier
from ..logs import peer_message
from ..settings.callers import GatewayConfig, load_gateway_config
from ._exits import EXIT_OK
from ._fleet import _REDRAW_INTERVAL, _event_json, fleet_table
from ._lifecycle import DEFAULT_DRAIN, StopSignals, event_line, run_until_signal
from ._output import _emit, _given, _print_json, _setup_logging

_CALLER_COLUMNS = (
    "caller",
    "sessions",
    "calls",
    "errors",
    "forbidden",
    "bytes",
    "streams",
    "watches",
)


def callers_table(gw: Gateway) -> list[str]:
    """The lines of the callers' table: a header, then one row per caller; ``streams`` is its
    open relayed streams against its budget of calls and streams in flight (``3/128``)."""
    rows = [_CALLER_COLUMNS]
    for caller_id, snap in sorted(gw.callers().items()):
        rows.append(
            (
                peer_message(caller_id, 64),
                str(snap.sessions),
                str(snap.calls),
                str(snap.errors),
                str(snap.forbidden),
                str(snap.bytes),
                f"{snap.streams}/{snap.budget}",
                str(snap.watches),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_CALLER_COLUMNS))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


async def _run_gateway(
    config: GatewayConfig, *, as_json: bool, redraw: bool, drain: float = DEFAULT_DRAIN
) -> None:
    """Serve until SIGINT/SIGTERM; then drain for up to ``drain`` seconds (new relayed calls
    refused ``DRAINING``, a second signal ends the drain), print ``gateway-stopping`` and close.
    Speaks systemd's notify protocol when ``NOTIFY_SOCKET`` is set
    (:mod:`garcon_link.api.systemd`)."""
    notifier = SystemdNotifier.from_environ()
    try:
        with StopSignals() as signals:
            async with gateway(config) as gw:
                await _serve(gw, signals, notifier, as_json=as_json, redraw=redraw, drain=drain)
    finally:
        notifier.close()


async def _serve(
    gw: Gateway,
    signals: StopSignals,
    notifier: SystemdNotifier,
    *,
    as_json: bool,
    redraw: bool,
    drain: float,
) -> None:
    if as_json:
        _print_json({"event": "listening", "url": gw.url})
    elif not redraw:
        _emit(f"gateway-listening url={gw.url}")
    notifier.ready(f"gateway: listening on {gw.url}")

    def emit(name: str, values: dict[str, object]) -> None:
        if as_json:
            _print_json({"event": name, **values})
        else:
            _emit(event_line(name, values))

    def running() -> int:
        # Relayed calls and streams waiting for their executors' replies.
        return sum(snap.pending for snap in gw.fleet.executors().values())

    async with anyio.create_task_group() as tg:
        changed = anyio.Event()
        drawing = anyio.CancelScope()

        async def follow() -> None:
            nonlocal changed
            async for event in gw.fleet.events():
                if as_json:
                    _print_json(_event_json(event))
                elif not redraw:
                    extra = f" lost={event.lost}" if event.kind == "lost" else ""
                    _emit(f"executor={event.executor_id or '-'} event={event.kind}{extra}")
                changed.set()

        async def draw() -> None:
            nonlocal changed
            with drawing:
                while True:
                    lines = [
                        f"gateway on {gw.url}",
                        *fleet_table(gw.fleet),
                        "",
                        *callers_table(gw),
                    ]
                    sys.stdout.write("\x1b[H\x1b[J" + "\n".join(lines) + "\n")
                    sys.stdout.flush()
                    changed = anyio.Event()
                    with anyio.move_on_after(_REDRAW_INTERVAL):
                        await changed.wait()
                        await anyio.sleep(0.1)  # batch a burst of events into one redraw

        tg.start_soon(follow)
        if redraw:
            tg.start_soon(draw)
        await run_until_signal(
            signals,
            notifier,
            what="gateway",
            status="gateway",
            drain=drain,
            drain_for=gw.drain,
            running=running,
            on_signal=drawing.cancel,  # the table stays as last drawn; the lines follow it
            emit=emit,
        )
        tg.cancel_scope.cancel()


def _cmd_gateway(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=False, json_lines=ns.log_json)
    config = load_gateway_config(_given(ns.config, "garcon-link gateway gateway.toml"))
    if not config.callers.grants:
        print(
            f"warning: {config.callers.source or 'the configuration'} has no [[callers.grant]]: "
            "every caller's call will be refused (FORBIDDEN); add a grant, e.g. "
            'callers = ["web-*"], executors = ["device-*"]',
            file=sys.stderr,
            flush=True,
        )
    redraw = not ns.json and sys.stdout.isatty()
    anyio.run(lambda: _run_gateway(config, as_json=ns.json, redraw=redraw, drain=ns.drain))
    return EXIT_OK
