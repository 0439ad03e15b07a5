"""Calls stalled on a session that lost its socket: when to look for them.

A controller's session without a socket (detached, or replaying) may hold calls that wait for
replies. Its executor is told ``Limits.stalled_call_report`` seconds after the socket was lost,
if the session was neither ready again nor retired since (:meth:`Watched.stall_due`), so that a
dead worker does not keep its callers waiting without a word until the grace ends.
"""

from __future__ import annotations

import collections
import logging
from typing import Protocol

import anyio
import anyio.abc

from ..limits import Limits
from ..logs import PeerLogLimiter

__all__ = ["StallWatch", "Watched"]

log = logging.getLogger("garcon_link.remote")  # the executors' logger (api/controller.py)


class Watched(Protocol):
    """A session the watch holds: ``settled`` counts the times it was ready or retired since it
    was watched (a change voids the entry)."""

    settled: int

    def stall_due(self) -> None:
        """Its time is up, and it was neither ready nor retired since it lost its socket."""
        ...


class StallWatch:
    """When to look for calls stalled on a session that lost its socket
    (:meth:`Watched.stall_due`): one entry per detached session in a deque, in the
    order they detached (each is due ``Limits.stalled_call_report`` later), and one task that
    runs while it is not empty, for every executor sharing the watch (a fleet's members). Its
    warnings are rate-limited together: one line per executor per ``log_interval``, at most
    ``max_log_lines`` per interval."""

    __slots__ = ("_due", "_running", "after", "log")

    def __init__(self, limits: Limits) -> None:
        self.after = limits.stalled_call_report
        self.log = PeerLogLimiter(log, interval=limits.log_interval, max_lines=limits.max_log_lines)
        self._due: collections.deque[tuple[float, Watched, int]] = collections.deque()
        self._running = False

    def watch(self, tg: anyio.abc.TaskGroup, session: Watched) -> None:
        self._due.append((anyio.current_time() + self.after, session, session.settled))
        if not self._running:
            self._running = True
            tg.start_soon(self._run)

    async def _run(self) -> None:
        try:
            while self._due:
                due, session, settled = self._due[0]
                wait = due - anyio.current_time()
                if wait > 0:
                    await anyio.sleep(wait)
                    continue
                self._due.popleft()
                if session.settled == settled:  # neither ready nor retired since
                    session.stall_due()
        finally:
            self._running = False
