"""``garcon-link fleet``: a fleet controller shown live, as a table redrawn in place or one line per
event."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import Any

import anyio

from ..api.fleet import Fleet, FleetEvent, fleet
from ..logs import peer_message
from ..settings.config import LinkConfig
from ..settings.fleet import FleetConfig
from ._exits import EXIT_OK
from ._lifecycle import StopSignals
from ._output import _emit, _load_any, _print_json, _setup_logging

_TABLE_COLUMNS = (
    "executor",
    "availability",
    "session",
    "since",
    "calls",
    "errors",
    "services",
)
_SERVICES_SHOWN = 4
"""The most services one row names, each with its contract version (the rest are counted)."""
_REDRAW_INTERVAL = 1.0  # seconds between redraws of the terminal table (the "since" column)


def fleet_table(controller: Fleet, now: float | None = None) -> list[str]:
    """The lines of ``garcon-link fleet``'s table: a header, then one row per executor."""
    now = time.time() if now is None else now
    rows = [_TABLE_COLUMNS]
    for executor_id, snap in sorted(controller.executors().items()):
        rows.append(
            (
                executor_id,
                f"{snap.availability} ({snap.reason})" if snap.reason else snap.availability,
                snap.session or "-",
                _ago(now - snap.since),
                str(snap.calls),
                str(snap.errors),
                _services(snap.services),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TABLE_COLUMNS))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _services(versions: Mapping[str, str]) -> str:
    """``calc@0123456789ab files@...`` (names and versions from the worker, shown bounded)."""
    names = sorted(versions)
    shown = " ".join(
        f"{peer_message(name, 32)}@{versions[name]}" for name in names[:_SERVICES_SHOWN]
    )
    more = f" +{len(names) - _SERVICES_SHOWN}" if len(names) > _SERVICES_SHOWN else ""
    return (shown + more) or "-"


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def _event_json(event: FleetEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"event": event.kind, "executor": event.executor_id, "at": event.at}
    if event.kind == "lost":
        out["lost"] = event.lost
    return out


async def _run_fleet(config: LinkConfig | FleetConfig, *, as_json: bool, redraw: bool) -> None:
    # The worker's and the gateway's signal handling, without a drain: a signal after the
    # first, while the fleet closes, is ignored rather than fatal.
    with StopSignals() as signals:
        await _serve(config, signals, as_json=as_json, redraw=redraw)


async def _serve(
    config: LinkConfig | FleetConfig, signals: StopSignals, *, as_json: bool, redraw: bool
) -> None:
    async with fleet(config) as controller, anyio.create_task_group() as tg:
        listens = _fleet_listens(config)
        where = controller.url if listens else "dialing only"
        if as_json:
            _print_json({"event": "listening", "url": where})
        elif not redraw:
            _emit(
                f"fleet-listening url={where}"
                if listens
                else f"fleet-dialing executors={','.join(_dialed(config))}"
            )
        title = f"fleet on {where}" if listens else f"fleet dialing {', '.join(_dialed(config))}"
        changed = anyio.Event()

        async def follow() -> None:
            nonlocal changed
            async for event in controller.events():
                if as_json:
                    _print_json(_event_json(event))
                elif not redraw:
                    extra = f" lost={event.lost}" if event.kind == "lost" else ""
                    _emit(f"executor={event.executor_id or '-'} event={event.kind}{extra}")
                changed.set()

        async def draw() -> None:
            nonlocal changed
            while True:
                lines = fleet_table(controller)
                sys.stdout.write("\x1b[H\x1b[J" + f"{title}\n" + "\n".join(lines) + "\n")
                sys.stdout.flush()
                changed = anyio.Event()
                with anyio.move_on_after(_REDRAW_INTERVAL):
                    await changed.wait()
                    await anyio.sleep(0.1)  # batch a burst of events into one redraw

        tg.start_soon(follow)
        if redraw:
            tg.start_soon(draw)
        await signals.next()
        tg.cancel_scope.cancel()


def _fleet_listens(config: LinkConfig | FleetConfig) -> bool:
    return config.listen is not None


def _dialed(config: LinkConfig | FleetConfig) -> list[str]:
    """The executor ids a fleet that does not listen dials."""
    if isinstance(config, LinkConfig):
        return [config.executor_id]
    return [entry.executor_id for entry in config.dial]


def _cmd_fleet(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=False, json_lines=ns.log_json)
    config = _load_any(ns.config, "fleet", "garcon-link fleet fleet.toml")
    redraw = not ns.json and sys.stdout.isatty()
    anyio.run(lambda: _run_fleet(config, as_json=ns.json, redraw=redraw))
    return EXIT_OK
