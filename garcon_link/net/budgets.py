"""Budgets of sockets and the link's counters: frames a socket may send, handshake steps per turn.

:class:`FrameBudget` is the token bucket of one socket's inbound frames (pure: the caller passes
``now``); :class:`TurnBudget` lets a listener run a bounded number of handshake steps per
event-loop turn; :class:`LinkStatistics` holds the counters of one link, which the budgets,
:class:`~garcon_link.net.websocket.WebSocket`, the listener and the endpoint count into. All are
imported from :mod:`garcon_link.net.ws` too (docs/design.md#link).
"""

from __future__ import annotations

import asyncio
import collections
import math
from dataclasses import dataclass, field

from ..errors import HandshakeFailure
from . import _asyncio_stream

__all__ = ["FrameBudget", "LinkStatistics", "TurnBudget"]

_THROTTLE_QUANTUM = 0.01
"""A socket over its frame budget is read again once it earned this many seconds of frames (so its
reader wakes at most ~100 times a second, each time for a bounded batch)."""


@dataclass(slots=True)
class FrameBudget:
    """A token bucket of the frames one socket may send us (pure: the caller passes ``now``).

    It holds at most ``burst`` tokens and earns ``rate`` tokens per second; every inbound frame --
    a data frame or fragment, a ping, a pong, a close -- spends one. ``rate == 0`` makes it a
    fixed allowance that never refills. The link gives an unauthenticated socket such an allowance
    (``Limits.max_handshake_frames``: the handshake needs two frames) and an authenticated one a
    refilling bucket (``Limits.frame_rate``, ``Limits.frame_burst``), so before authentication a
    socket can cost the event loop only a handful of frames' work, and after it a bounded rate.

    Attributes:
        rate: tokens earned per second (``>= 0``).
        burst: capacity, and the balance of a new bucket.
        tokens: the balance; negative while the socket owes frames.
        stamp: the ``now`` of the last refill.
    """

    rate: float
    burst: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> FrameBudget:
        """A bucket holding ``burst`` tokens at ``now``."""
        return cls(rate=rate, burst=burst, tokens=burst, stamp=now)

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def spend(self, now: float, frames: int = 1) -> bool:
        """Spend ``frames`` tokens at ``now``; whether the balance is still ``>= 0``."""
        self._refill(now)
        self.tokens -= frames
        return self.tokens >= 0

    def delay(self, now: float, quantum: float = _THROTTLE_QUANTUM) -> float:
        """Seconds to wait before the next frame is processed: 0 while the balance is not
        negative; else until it has earned back its debt plus ``quantum`` seconds of frames (at
        most ``burst``), so that a throttled reader wakes for a batch, not for every frame;
        ``math.inf`` when in debt with ``rate == 0`` (the allowance is spent for good)."""
        self._refill(now)
        if self.tokens >= 0:
            return 0.0
        if self.rate <= 0:
            return math.inf
        target = min(self.burst, max(1.0, self.rate * quantum))
        return (target - self.tokens) / self.rate


class TurnBudget:
    """How many handshake steps a listener runs per event-loop turn, beside the turn's other work.

    A step is the work between two reads of an unauthenticated socket: answering its upgrade
    request, answering its hello, checking its proof and admitting it (a resume's decision
    included). Each step waits in line (:meth:`step`); once per turn the first ``per_turn``
    waiters are let through, and they run in the next turn, together with whatever else is ready
    then (authenticated sockets' reads, calls completing): a storm of reconnecting sockets
    delays established sessions by at most ``per_turn`` steps' work per turn, not by the whole
    storm's. The waiters are the listener's unauthenticated sockets, one step each, so
    ``Limits.max_unauthenticated_sockets`` bounds the line (past it the oldest unauthenticated
    socket is evicted, and leaves its place).

    A step never waits longer than ``max_wait`` seconds: once the first in line has waited that
    long, every step that has is let through at the next turn. In a process starved of CPU the
    turns grow long, and ``per_turn`` steps a turn would otherwise let handshakes outlast their
    deadline (the dialers would give up and redial, and the storm would last longer); the
    listener passes ``handshake_timeout / 10``.

    On asyncio only; elsewhere :meth:`step` returns at once.
    """

    def __init__(self, per_turn: int, stats: LinkStatistics, max_wait: float = math.inf) -> None:
        self._per_turn = per_turn
        self._max_wait = max_wait
        self._stats = stats
        # (the loop time it was asked at, its future), oldest first
        self._waiters: collections.deque[tuple[float, asyncio.Future[None]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # a _next_turn is scheduled on it

    async def step(self) -> None:
        """Return when this step may run (a later turn). Cancellable while waiting: the place
        in line is given up."""
        if not _asyncio_stream.on_asyncio():
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append((loop.time(), waiter))
        if len(self._waiters) > self._per_turn:
            self._stats.handshake_steps_deferred += 1
        self._stats.handshake_steps_waiting = len(self._waiters)
        if self._loop is None:
            self._loop = loop
            loop.call_soon(self._next_turn)
        try:
            await waiter
        finally:
            if not waiter.done():  # cancelled while waiting: _next_turn skips it
                waiter.cancel()

    def _next_turn(self) -> None:
        """Once per turn while steps wait: let the first ``per_turn`` through (they run in the
        next turn)."""
        loop, self._loop = self._loop, None
        waiters, granted = self._waiters, 0
        overdue = loop.time() - self._max_wait if loop is not None else -math.inf
        while waiters and (granted < self._per_turn or waiters[0][0] <= overdue):
            _, waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                granted += 1
        self._stats.handshake_steps_waiting = len(waiters)
        if waiters and loop is not None:
            self._loop = loop
            loop.call_soon(self._next_turn)


@dataclass
class LinkStatistics:
    """Counters of one link (a snapshot copy is returned by :meth:`WebSocketLink.statistics`)."""

    connections: int = 0
    upgrades_refused: dict[int, int] = field(default_factory=dict)
    handshakes_completed: int = 0
    handshakes_failed: dict[str, int] = field(default_factory=dict)
    evicted_unauthenticated: int = 0
    resumed: int = 0
    fresh_sessions: int = 0
    takeovers_refused: int = 0
    heartbeat_timeouts: int = 0
    dial_attempts: int = 0
    handshake_frames_exceeded: int = 0
    """Unauthenticated sockets closed for sending more than ``max_handshake_frames`` frames."""
    throttled_reads: int = 0
    """Times an authenticated socket's reader waited for its frame budget (``frame_rate``)."""
    unexpected_errors: int = 0
    """Sockets ended by an exception nobody expected (a bug, contained to that one peer)."""
    executors_refused: int = 0
    """Authenticated executors refused because ``max_executors`` slots were taken."""
    controllers_refused: int = 0
    """Authenticated controllers a listening worker refused (1013) because others held
    ``max_controllers`` sessions, each with a socket."""
    controllers_evicted: int = 0
    """Detached controllers' sessions a listening worker retired (``EVICTED``) to admit a new
    controller while ``max_controllers`` places were held."""
    admissions_busy: int = 0
    """Authenticated sockets refused (4004) because another socket of the same executor was
    being admitted at that moment."""
    closes_not_drained: int = 0
    """Detached sockets closed without waiting for the peer's close frame, because
    ``max_authenticated_sockets`` others were already waiting for theirs."""
    taken_over: int = 0
    """Sessions this link gave up because another runtime of the same executor took over (4009)."""
    bytes_sent: int = 0
    """Bytes written to this link's sockets (WebSocket framing included)."""
    bytes_received: int = 0
    """Bytes read from this link's sockets by their message reader (handshakes included)."""
    tls_handshakes_failed: int = 0
    """Incoming connections whose TLS handshake failed (listening with TLS)."""
    handshakes_abandoned: int = 0
    """Sockets the peer closed before the handshake completed."""
    dials_refused: int = 0
    """Dials that found nothing: the connection was refused by every address, the host name
    did not resolve, or the server spoke the other scheme (TLS to a ``ws://`` dial, plain text
    to a ``wss://`` one) (:class:`~garcon_link.errors.Unreachable`)."""
    handshake_steps_deferred: int = 0
    """Handshake steps (an upgrade request, a hello, a proof) a listener put off by a turn or
    more because ``handshake_steps_per_turn`` others were ahead."""
    handshake_steps_waiting: int = field(default=0, metadata={"metric": "gauge"})
    """Handshake steps waiting in line now (at most one per unauthenticated socket)."""
    dials_refused_in_a_row: int = field(default=0, metadata={"metric": "gauge"})
    """Such dials since the last one that connected to a server of its scheme (0 once one
    does): how long nothing has listened at the dialed address, in attempts."""

    def count_handshake_failure(self, reason: HandshakeFailure) -> None:
        self.handshakes_failed[reason.name] = self.handshakes_failed.get(reason.name, 0) + 1
