"""What the gateway counts of each caller, and the pacing of the refusals it answers them.

Each caller with a session now or lately has one :class:`CallerSnapshot` of counters (at most
``max_callers`` with a session plus as many without: one more forgets the first without a
session), which :meth:`~garcon_link.api.gateway.Gateway.callers` copies out. A caller's
``FORBIDDEN`` answers past its allowance (``gateway_forbidden_rate`` per second after a burst of
``gateway_forbidden_burst``) are paused, each at most ``gateway_forbidden_delay``, and so are its
``OVERLOADED`` ones, on an allowance of their own (:meth:`CallerBook.failed`): a caller flooding
what it may not call slows itself, not the gateway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import anyio

from ..errors import CallError
from ..limits import Limits

__all__ = ["CallerBook", "CallerSnapshot"]


@dataclass(slots=True)
class CallerSnapshot:
    """One caller as :meth:`~garcon_link.api.gateway.Gateway.callers` saw it (a statistics snapshot:
    ``StatisticsCollector.add("gateway_callers", gw.callers, label="caller")`` exports it, the
    caller label capped as the executor label is).

    Attributes:
        caller_id: its id (its key file's name).
        sessions: its sessions now (one per caller process).
        calls: relayed calls it made.
        errors: of those, how many ended with an error on either hop (``FORBIDDEN`` included).
        forbidden: of those, how many no grant allowed.
        overloaded: of those, how many ended ``OVERLOADED``, never run: past the caller's share
            of an executor (:meth:`~garcon_link.api.gateway.Gateway.share_of`; not forwarded), or
            refused by the executor. Those its own sessions refused past ``budget`` are not
            relayed calls: its side counts them.
        bytes: argument bytes it sent through the relay.
        in_flight: its relayed calls and streams in flight to executors now (each within its
            share of that executor).
        budget: how many relayed calls and streams its sessions may have in flight at once now
            (``max_incoming_calls`` per session); past it, the next is ``OVERLOADED``.
        streams: its relayed streams open now (counted in ``in_flight`` and ``budget``).
        stream_items: items its relayed streams passed on to it.
        watches: its watches open now (at most one per session).
    """

    caller_id: str
    sessions: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    calls: int = 0
    errors: int = 0
    forbidden: int = 0
    overloaded: int = 0
    bytes: int = 0
    in_flight: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    budget: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    streams: int = dataclasses.field(default=0, metadata={"metric": "gauge"})
    stream_items: int = 0
    watches: int = dataclasses.field(default=0, metadata={"metric": "gauge"})


class CallerBook:
    """Every caller's counters (module docstring); one per gateway.

    Attributes:
        stats: each caller's counters, by id (the per-call path reads it directly).
    """

    __slots__ = ("_forbidden", "_limits", "_max_callers", "_overloaded", "stats")

    def __init__(self, limits: Limits, max_callers: int) -> None:
        self._limits = limits
        self._max_callers = max_callers
        self.stats: dict[str, CallerSnapshot] = {}
        # caller -> (FORBIDDEN allowance left, when it was last counted): failed().
        self._forbidden: dict[str, tuple[float, float]] = {}
        # caller -> the same, for the OVERLOADED answers of the gateway's shares.
        self._overloaded: dict[str, tuple[float, float]] = {}

    def snapshots(self, in_flight: Mapping[str, int]) -> dict[str, CallerSnapshot]:
        """Copies of every caller's counters, with ``in_flight`` (each caller's calls and
        streams in flight now) and its budget now."""
        budget = self._limits.max_incoming_calls
        out = {
            k: dataclasses.replace(v, in_flight=0, budget=max(v.sessions, 0) * budget)
            for k, v in self.stats.items()
        }
        for caller, held in in_flight.items():
            snap = out.get(caller)
            if snap is not None:
                snap.in_flight += held
        return out

    def stats_of(self, caller: str) -> CallerSnapshot:
        """``caller``'s counters, made (and the oldest without a session forgotten) if new."""
        stats = self.stats.get(caller)
        if stats is None:
            if len(self.stats) >= 2 * self._max_callers:
                for old_id, old in list(self.stats.items()):
                    if old.sessions <= 0:
                        del self.stats[old_id]
                        break
            stats = self.stats[caller] = CallerSnapshot(caller)
        return stats

    async def failed(self, caller: str, exc: CallError, *, counted: bool = True) -> None:
        """Count a relayed request's failure; a ``FORBIDDEN`` one past the caller's allowance
        (``gateway_forbidden_rate`` per second, bursts of ``gateway_forbidden_burst``) is answered
        only after a pause, up to ``gateway_forbidden_delay``: a caller that keeps asking for
        what it may not have holds its own handler slots (``max_incoming_calls``) and slows
        itself down, not the gateway. The answer is the same, only later. An ``OVERLOADED``
        one (a caller past its share of an executor, asking again at once) is paced alike, on
        an allowance of its own."""
        stats = self.stats_of(caller)
        if counted:
            stats.errors += 1
        if exc.code == "FORBIDDEN":
            stats.forbidden += 1
            await self._pace(self._forbidden, caller)
        elif exc.code == "OVERLOADED":
            stats.overloaded += 1
            await self._pace(self._overloaded, caller)

    async def _pace(self, buckets: dict[str, tuple[float, float]], caller: str) -> None:
        """Take one refusal from ``caller``'s allowance in ``buckets``; past it, pause."""
        now = anyio.current_time()
        limits = self._limits
        rate, burst = limits.gateway_forbidden_rate, limits.gateway_forbidden_burst
        tokens, since = buckets.get(caller, (burst, now))
        tokens = min(burst, tokens + (now - since) * rate) - 1
        if len(buckets) >= 2 * self._max_callers and caller not in buckets:
            buckets.pop(next(iter(buckets)))
        buckets[caller] = (max(tokens, -rate * limits.gateway_forbidden_delay), now)
        if tokens < 0:
            await anyio.sleep(min(-tokens / rate, limits.gateway_forbidden_delay))

    def counted(self, caller: str, payload: bytes) -> None:
        """One more relayed request of ``caller``, of ``payload``'s argument bytes."""
        stats = self.stats_of(caller)
        stats.calls += 1
        stats.bytes += len(payload)
