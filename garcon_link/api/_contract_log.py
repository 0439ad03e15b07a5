"""What a controller logs about the manifests its worker sends: an announced manifest dropped,
and the contract changed from one manifest to the next (docs/design.md#version-skew).

One :class:`ContractLog` per executor that writes such a line (made with its first): the lines
are the peer's doing, so they go through one rate limiter per executor, each reason its own key
-- an additive change logged a moment ago never hides an incompatible one -- and what the
worker named is bounded (:data:`CAUSE_CHARS`, :data:`CHANGES_SHOWN`,
:data:`~garcon_link.api.described.CHANGES_COMPARED`). It holds the executor's id and bounds,
never the executor.
"""

from __future__ import annotations

import logging

from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_message
from ..rpc.contract import Compatibility
from .described import CHANGES_COMPARED, Described, contract_changes

__all__ = ["CAUSE_CHARS", "CHANGES_SHOWN", "ContractLog"]

log = logging.getLogger("garcon_link.remote")  # the executors' logger (api/controller.py)

CAUSE_CHARS = 1000
"""The longest cause of a refused session, or list of contract changes in one log line."""
CHANGES_SHOWN = 8
"""The most changed methods one log line names (the rest are counted)."""


class ContractLog:
    """One executor's lines about its worker's manifests, rate-limited together (one line per
    reason per ``Limits.log_interval``, at most ``Limits.max_log_lines`` per interval)."""

    __slots__ = ("_peer_log", "executor_id")

    def __init__(self, executor_id: str, limits: Limits) -> None:
        self.executor_id = executor_id
        self._peer_log = PeerLogLimiter(
            log, interval=limits.log_interval, max_lines=limits.max_log_lines
        )

    def dropped(self, problem: str) -> None:
        """An announced manifest was dropped: ``problem`` says why."""
        self._peer_log.log(
            self.executor_id,
            "inventory",
            "executor %s: dropping an announced manifest: %s",
            self.executor_id,
            problem,
            extra=log_fields(executor=self.executor_id),
        )

    def changed(self, before: Described, after: Described, session: bytes | None) -> None:
        """One line naming what changed from ``before`` to ``after`` (bounded): INFO when every
        change compared is additive and none was left uncompared, else WARNING; nothing when
        only the spelling changed."""
        changed, uncompared = contract_changes(before, after)
        if not changed and not uncompared:
            return  # the same contracts spelled differently
        additive = all(c[1] is Compatibility.ADDITIVE for c in changed)
        # Each verdict is its own limiter key: an additive change logged a moment ago never
        # hides an incompatible one (nor an unverified one).
        kind = "incompatible" if not additive else "unverified" if uncompared else "additive"
        verdict = (
            "calls of incompatible or removed methods fail"
            if not additive
            else f"additive as far as compared ({CHANGES_COMPARED})"
            if uncompared
            else "additive"
        )
        shown = "; ".join(
            f"{name}: {compatibility.value} ({difference})"
            for name, compatibility, difference in changed[:CHANGES_SHOWN]
        )
        hidden = len(changed) - min(len(changed), CHANGES_SHOWN) + uncompared
        more = f"; and {hidden} more" if hidden else ""
        self._peer_log.log(
            self.executor_id,
            f"contract changed: {kind}",
            "executor %s: the worker's contract changed (%s): %s%s",
            self.executor_id,
            verdict,
            peer_message(shown, CAUSE_CHARS),
            more,
            extra=log_fields(executor=self.executor_id, session=session),
            level=logging.INFO if additive and not uncompared else logging.WARNING,
        )
