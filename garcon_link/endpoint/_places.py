"""A listening worker's ``max_controllers`` places (docs/design.md#many-controllers).

Theory of operation
-------------------
A listening worker holds one slot per controller, and at most ``Limits.max_controllers`` of its
slots hold a *place* (a session, a socket or an admission). :class:`Places` keeps that bound on
the link's slot table:

- :meth:`Places.new_slot`: a slot for a controller the worker holds none for. Slots that hold no
  place (refused or retired controllers) are dropped first, oldest first, once there are
  ``max_controllers`` slots: what they remember (runtimes taken over) is kept while there is
  room.
- :meth:`Places.of`: what admission reads of the other slots
  (:func:`~garcon_link.core.admission.places`): whether every place is held and whether one of
  them is a detached session that may be evicted. Never full on other links.
- :meth:`Places.evict`: when :func:`~garcon_link.core.admission.decide` says so, the session
  detached the longest (:func:`~garcon_link.core.admission.evictee`) is retired (``EVICTED``) so
  that the newcomer takes its place. Its controller, if it comes back, finds no session to
  resume: a fresh one, and the outcome rule for what it had pending.

Refusals and evictions name who holds the places and who takes them (``names``: a worker's
controllers, or a gateway's callers link's own words).
"""

from __future__ import annotations

import logging

from ..core.admission import SlotKey, evictee, places
from ..errors import FailureReason
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_host, peer_text
from ..net.ws import LinkStatistics, WebSocket
from ._slots import _Slot


class Places:
    """The ``max_controllers`` places among a link's slots.

    Args:
        slots: the link's slot table (this object adds, drops and reads its slots).
        limits: the link's bounds (``max_controllers``).
        stats: the link's counters (``controllers_evicted``).
        per_controller: whether the link is a listening worker (one slot per controller);
            otherwise there are no places to fill.
        names: who holds the places and who takes them (``("worker", "controller")``).
        tag: the link's log prefix.
        peer_log: the rate limiter of authenticated peers' log lines.
    """

    def __init__(
        self,
        slots: dict[SlotKey, _Slot],
        limits: Limits,
        stats: LinkStatistics,
        *,
        per_controller: bool,
        names: tuple[str, str],
        tag: str,
        peer_log: PeerLogLimiter,
    ) -> None:
        self._slots = slots
        self._limits = limits
        self._stats = stats
        self._per_controller = per_controller
        self._names = names
        self._tag = tag
        self._peer_log = peer_log

    def new_slot(self, key: SlotKey) -> _Slot:
        """A listening worker's slot for a controller it holds none for (see the module)."""
        slots = self._slots
        if len(slots) >= self._limits.max_controllers:
            for old_key, old in list(slots.items()):
                if len(slots) < self._limits.max_controllers:
                    break
                if not old.holds_place:
                    del slots[old_key]
        slot = slots[key] = _Slot(key[0], key[1])
        return slot

    def of(self, slot: _Slot) -> tuple[bool, bool]:
        """:attr:`SlotView.full` and :attr:`SlotView.evictable` for ``slot`` of a listening
        worker (:func:`~garcon_link.core.admission.places`); never full on other links."""
        if not self._per_controller:
            return False, False
        others = ((s.holds_place, s.evictable) for s in self._slots.values() if s is not slot)
        return places(others, self._limits.max_controllers)

    def full_detail(self) -> str:
        """The detail of a ``CONTROLLERS_FULL`` refusal."""
        holder, taker = self._names
        return (
            f"this {holder} holds sessions for max_{taker}s="
            f"{self._limits.max_controllers} {taker}s; retry later"
        )

    def evict(self, slot: _Slot, sock: WebSocket) -> None:
        """Retire the other controllers' session detached the longest, so that ``slot`` takes
        its place (:data:`~garcon_link.core.admission.EVICT`)."""
        candidates = [
            (key, s.detached)
            for key, s in self._slots.items()
            if s is not slot and s.evictable and s.holds_place
        ]
        key = evictee(candidates)
        assert key is not None, "decide() said evict without an evictable session"
        victim = self._slots[key]
        transport = victim.live
        assert transport is not None
        taker = self._names[1]
        limit = self._limits.max_controllers
        transport.retire(
            FailureReason.EVICTED,
            f"max_{taker}s={limit} places held; {taker} "
            f"{peer_text(slot.label)} took this detached session's place",
        )
        self._stats.controllers_evicted += 1
        self._peer_log.log(
            peer_host(sock.peer),
            "EVICTED",
            "%s %s: %s %s admitted in the place of %s %s, detached (%d of max_%ss=%d places held)",
            self._tag,
            sock.peer,
            taker,
            peer_text(slot.label),
            taker,
            peer_text(victim.label),
            limit,
            taker,
            limit,
            extra=log_fields(peer=sock.peer, controller=victim.label),
            level=logging.WARNING,
        )
