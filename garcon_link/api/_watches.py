"""A caller's watch of the gateway's executors: what one caller session was shown, and what
it has not been sent yet.

A caller's **watch** (``watch()``, one per caller session, served by
:meth:`~garcon_link.api._relaying._Relay.watch`): the gateway's fleet tells the gateway of each
event as it is published (:meth:`~garcon_link.api.fleet.Fleet._tap`); each watch whose caller a
grant lets see that executor notes it (:class:`_Watch`: at most one pending entry per executor, its
last :data:`~garcon_link.api._relay_wire.MAX_WATCH_EVENTS` events), and the watch's stream sends the
pending entries, each with its executor's state at send time, whenever the caller's credit lets it
send a message. Replacing :attr:`~garcon_link.api.gateway.Gateway.grants` re-filters every watch;
the drain ends them.
"""

from __future__ import annotations

import anyio

from ._relay_wire import MAX_WATCH_EVENTS
from .fleet import EventKind


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
