"""What the gateway shows its callers of its fleet: an executor's entry, a caller's snapshot,
and each caller session's watch (what it was shown, and what it has not been sent yet).

A caller's **watch** (``watch()``, one per caller session, served by
:meth:`~garcon_link.api._relaying._Relay.watch`): the gateway's fleet tells the gateway of each
event as it is published (:meth:`~garcon_link.api.fleet.Fleet.tap`); each watch whose caller a
grant lets see that executor notes it (:class:`_Watch`: at most one pending entry per executor, its
last :data:`~garcon_link.api._relay_wire.MAX_WATCH_EVENTS` events), and the watch's stream sends the
pending entries, each with its executor's state at send time, whenever the caller's credit lets it
send a message. Replacing :attr:`~garcon_link.api.gateway.Gateway.grants` re-filters every watch;
the drain ends them.

What a caller is **shown** of one executor (:meth:`Shown.entry`: in a snapshot, a watch entry
or a ``describe`` answer) is its granted services only: their contract versions and, in a
``describe``, their manifest and type descriptions, within what one answer holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from ..core.wire import encode_canonical
from ..limits import Limits
from ..settings.grants import sees
from ._admission import Admission
from ._relay_wire import MAX_WATCH_ENTRIES, MAX_WATCH_EVENTS
from .controller import RemoteExecutor
from .fleet import EventKind, Fleet, FleetEvent

_DESCRIBE_SLACK = 64 * 1024
"""Bytes of a ``describe`` answer kept for what is neither manifest nor types (its envelope,
the executor id, availability and versions)."""


class _Watch:
    """One caller session's watch (:meth:`~garcon_link.api._relaying._Relay.watch`): the executors
    it was shown, and the events not yet sent, by executor in the order of their first one,
    each executor's at most :data:`~garcon_link.api._relay_wire.MAX_WATCH_EVENTS` (the older
    ones dropped and counted). Its size is bounded by the executors the caller may see."""

    __slots__ = ("caller", "ended", "pending", "shown", "wakeup")

    def __init__(self, caller: str) -> None:
        self.caller = caller
        self.shown: set[str] = set()
        self.pending: dict[str, tuple[list[EventKind], int]] = {}
        self.wakeup = anyio.Event()
        self.ended = False

    def note(self, executor: str, kind: EventKind) -> None:
        kinds, dropped = self.pending.get(executor) or ([], 0)
        if len(kinds) >= MAX_WATCH_EVENTS:
            del kinds[0]
            dropped += 1
        kinds.append(kind)
        self.pending[executor] = (kinds, dropped)
        if kind == "forgotten":
            self.shown.discard(executor)
        else:
            self.shown.add(executor)
        self.wakeup.set()

    def end(self) -> None:
        self.ended = True
        self.wakeup.set()


class Shown:
    """What the gateway shows its callers of its fleet, under the grants in force: an
    executor's entry, a caller's snapshot, and every caller session's watch (module
    docstring); one per gateway.

    Attributes:
        watches: by ``id`` of a caller session's transport, its watch (one each).
        changed: set, and replaced, when the fleet's events tell of a change (a ``describe``
            waiting for its executor to be ready waits on it).
    """

    __slots__ = ("_admission", "_limits", "_members", "changed", "watches")

    def __init__(self, fleet: Fleet, admission: Admission, limits: Limits) -> None:
        self._members = fleet.members  # the fleet's live mapping (Fleet.members)
        self._admission = admission
        self._limits = limits
        self.watches: dict[int, _Watch] = {}
        self.changed = anyio.Event()

    def fleet_changed(self) -> None:
        """One of the fleet's events was delivered: wake what waits on :attr:`changed`."""
        self.changed.set()
        self.changed = anyio.Event()

    def regranted(self) -> None:
        """The grants were replaced: tell every watch of the executors its caller may now see
        (``joined``, and their availability) or no longer sees (``forgotten``)."""
        for watch in self.watches.values():
            for executor_id in sorted(watch.shown):
                if not sees(self._admission.grants, watch.caller, executor_id):
                    watch.note(executor_id, "forgotten")
            for executor_id, member in sorted(self._members.items()):
                if executor_id not in watch.shown and sees(
                    self._admission.grants, watch.caller, executor_id
                ):
                    watch.note(executor_id, "joined")
                    if member.availability != "offline":
                        watch.note(executor_id, member.availability)

    def fleet_event(self, event: FleetEvent) -> None:
        """Pass one of the fleet's events to every watch whose caller may see its executor."""
        if event.kind == "lost" or not self.watches:
            return
        for watch in self.watches.values():
            if sees(self._admission.grants, watch.caller, event.executor_id):
                watch.note(event.executor_id, event.kind)

    def end_watches(self) -> None:
        """End every watch (the drain: a watch never ends by itself)."""
        for watch in self.watches.values():
            watch.end()

    def snapshot(self, caller: str) -> list[dict[str, Any]]:
        """Every executor ``caller`` may see, as :meth:`entry` shows it."""
        grants = self._admission.grants
        return [
            self.entry(caller, executor_id, member)
            for executor_id, member in sorted(self._members.items())
            if sees(grants, caller, executor_id)
        ]

    def watch_entries(self, watch: _Watch) -> list[dict[str, Any]]:
        """Take up to :data:`~garcon_link.api._relay_wire.MAX_WATCH_ENTRIES` executors' pending
        events from ``watch``, each with its executor's state now (the latest state wins)."""
        entries: list[dict[str, Any]] = []
        pending = watch.pending
        while pending and len(entries) < MAX_WATCH_ENTRIES:
            executor_id = next(iter(pending))
            kinds, dropped = pending.pop(executor_id)
            member = self._members.get(executor_id)
            if member is None or not sees(self._admission.grants, watch.caller, executor_id):
                entry: dict[str, Any] = {"executor_id": executor_id, "gone": True}
            else:
                entry = self.entry(watch.caller, executor_id, member)
            entry["events"] = list(kinds)
            if dropped:
                entry["lost"] = dropped
            entries.append(entry)
        return entries

    def entry(
        self, caller: str, executor: str, member: RemoteExecutor | None, *, manifest: bool = False
    ) -> dict[str, Any]:
        """What a caller is shown of one executor: its granted services only."""
        if member is None:
            return {"executor_id": executor, "availability": "offline", "services": {}}
        grants = [g for g in self._admission.grants if g.names(caller, executor)]
        versions = {
            name: version
            for name, version in member.versions.items()
            if any(g.covers(name) for g in grants)
        }
        entry: dict[str, Any] = {
            "executor_id": executor,
            "availability": member.availability,
            "since": member.since,
            "services": versions,
        }
        if manifest and member.versions:
            services = member.manifest()
            granted = {name: services[name] for name in versions if name in services}
            entry["manifest"] = granted
            entry["types"] = self._granted_types(member, granted)
        return entry

    def _granted_types(self, member: RemoteExecutor, granted: Mapping[str, Any]) -> dict[str, Any]:
        """The executor's type descriptions of the ``granted`` services only (as the gateway's
        fleet checked them when the executor described itself), within what one ``describe``
        answer carries: a frame less a whole manifest. Each is at most the fleet's
        ``type_description_bytes``, so only when that many of them could be over the budget are
        they measured, and one past it is replaced by a note (they are documentation)."""
        types = member.types
        kept = {name: types[name] for name in granted if name in types}
        budget = self._limits.max_frame_bytes - self._limits.max_manifest_bytes - _DESCRIBE_SLACK
        if len(kept) * member.limits.type_description_bytes <= budget:
            return kept
        for name, description in kept.items():
            size = len(encode_canonical(description))
            if size <= budget:
                budget -= size
            else:
                kept[name] = {"note": "dropped: over what one describe answer of a gateway holds"}
        return kept
