"""Budgets of sockets and the link's counters: frames a socket may send, handshake steps per turn.

:class:`FrameBudget` is the token bucket of one socket's inbound frames (pure: the caller passes
``now``); :class:`TurnBudget` lets a listener run a bounded amount of handshake steps, and of
lost sockets' teardowns, per event-loop turn; :class:`LinkStatistics` holds the counters of one
link, which the budgets, :class:`~garcon_link.net.websocket.WebSocket`, the listener and the
endpoint count into. All are imported from :mod:`garcon_link.net.ws` too (docs/design.md#link).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable
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
    """How many steps of one kind a listener runs per event-loop turn, beside the turn's other
    work: handshake steps, or the teardowns of lost sockets (a line each).

    A handshake step is the work between two reads of an unauthenticated socket: answering its
    upgrade request, answering its hello, checking its proof and admitting it (a resume's
    decision included). A teardown is what follows an authenticated socket's end: its reader's
    last read, the session's detach, the heartbeat's end and the close. Each step waits in line
    (:meth:`step`); once per turn the first ones are let through, and they run in the next turn,
    together with whatever else is ready then (authenticated sockets' reads, calls completing):
    a storm of reconnecting sockets -- or of lost ones -- delays established sessions by a
    bounded amount of work per turn, not by the whole storm's.

    They are let through at the end of a turn (a zero-delay loop timer: on asyncio's loop it
    runs after the turn's socket callbacks), so the tasks those callbacks woke -- an established
    session's reader with a reply, a caller whose reply came -- run ahead of the steps in the
    next turn: a call waits for the steps of the turns it crosses but its last.

    How many go through per turn: at most ``per_turn``, and fewer when they take long: the
    budget measures the time from the first granted step's start to the end of the turn's
    granted steps (a callback of its own, which runs right after them), keeps an estimate of
    one step's cost (the mean of the last measurement and the previous estimate), and lets
    through ``seconds_per_turn / cost`` steps, at least one. (A step that awaits something
    before its work is done finishes in a later turn, unmeasured: the budget bounds the part
    that runs at once.) The clock is the thread's CPU time, so that time this process spent
    preempted by others is not taken for the steps' cost; it is a parameter, for tests.

    The handshake line holds the listener's unauthenticated sockets, one step each, so
    ``Limits.max_unauthenticated_sockets`` bounds it (past it the oldest unauthenticated socket
    is evicted, and leaves its place); the teardown line holds at most one step per
    authenticated socket.

    A step never waits longer than ``max_wait`` seconds: once the first in line has waited that
    long, every step that has is let through at the next turn. In a process starved of CPU the
    turns grow long, and a few steps a turn would otherwise let handshakes outlast their
    deadline (the dialers would give up and redial, and the storm would last longer); the
    listener passes ``handshake_timeout / 10`` for handshakes. Overdue steps all go at once, so
    the teardown line, where a long wait costs less (a session looks attached to a lost socket
    a little longer; a resume of its executor or a failed write ends the wait at once), gets
    ``handshake_timeout``: a burst of lost sockets is not let through whole after a tenth of it.

    A line may also be held to a share of the loop's time (``busy_share`` below 1): while
    steps wait, the next ones go through only once the thread has spent at most that fraction of
    the time since the last ones went through on the CPU -- the steps, what they started (a
    resumed session's first reads and writes) and everything else the loop ran. Past it the line
    pauses until the share is back. Established sessions' work comes first: a storm of
    reconnects gets the share of the loop their traffic leaves, up to ``busy_share``, so while
    it lasts their calls find the loop idle that much of the time; the storm lasts longer. A
    process starved by others spends little CPU time, and its line is not held. ``max_wait``
    still bounds each step's wait, and the line is held only while ``may_hold()`` says so. The
    listener never evicts a socket whose step waits in this line (:meth:`waits`), and while
    every unauthenticated socket waits in it, it stops accepting; it holds the line only below
    seven eighths of its cap of unauthenticated sockets: at the cap a newcomer evicts a socket
    waiting for its peer, a redial that would feed the storm, so near it the line moves at full
    speed.

    Counted in ``stats`` under ``counters``: (steps put off by a turn or more, steps waiting
    now).

    On asyncio only; elsewhere :meth:`step` returns at once.
    """

    def __init__(
        self,
        per_turn: int,
        stats: LinkStatistics,
        max_wait: float = math.inf,
        *,
        seconds_per_turn: float = math.inf,
        busy_share: float = 1.0,
        left: Callable[[], object] | None = None,
        may_hold: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.thread_time,
        counters: tuple[str, str] = ("handshake_steps_deferred", "handshake_steps_waiting"),
    ) -> None:
        self._per_turn = per_turn
        self._max_wait = max_wait
        self._seconds = seconds_per_turn
        self._share = busy_share
        self._left = left  # called when a step leaves the line (let through or cancelled)
        self._may_hold = may_hold
        self._held: asyncio.TimerHandle | None = None  # the held line's wake-up
        self._clock = clock
        self._stats = stats
        self._deferred, self._waiting = counters
        # (the loop time it was asked at, its future), oldest first
        self._waiters: collections.deque[tuple[float, asyncio.Future[None]]] = collections.deque()
        self._tasks: set[object] = set()  # the tasks waiting in line
        self._loop: asyncio.AbstractEventLoop | None = None  # a _next_turn is scheduled on it
        self._cost = 0.0  # estimated seconds of one step (0: none measured yet)
        self._granted = 0  # steps let through at the last _next_turn
        self._started: float | None = None  # when the first of them began to run
        # (thread CPU time, loop time) when the last steps went through while others waited
        self._last_grant: tuple[float, float] | None = None

    @property
    def allowance(self) -> int:
        """Steps let through at the next turn (``max_wait`` aside): ``per_turn``, or fewer by
        the estimated cost of a step (at least one)."""
        if self._cost <= 0.0 or math.isinf(self._seconds):
            return self._per_turn
        return max(1, min(self._per_turn, int(self._seconds / self._cost)))

    async def step(self) -> None:
        """Return when this step may run (a later turn). Cancellable while waiting: the place
        in line is given up."""
        if not _asyncio_stream.on_asyncio():
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append((loop.time(), waiter))
        if len(self._waiters) > self.allowance:
            setattr(self._stats, self._deferred, getattr(self._stats, self._deferred) + 1)
        setattr(self._stats, self._waiting, len(self._waiters))
        if self._loop is None:
            self._loop = loop
            loop.call_later(0.0, self._next_turn)
        elif self._held is not None and self._may_hold is not None and not self._may_hold():
            self._held.cancel()  # no longer to be held: the line moves at the next turn
            self._held = None
            loop.call_later(0.0, self._next_turn)
        task = asyncio.current_task(loop)
        self._tasks.add(task)
        try:
            await waiter
        finally:
            self._tasks.discard(task)
            if self._left is not None:
                self._left()
            if not waiter.done():  # cancelled while waiting: _next_turn skips it
                waiter.cancel()
        if self._started is None:
            self._started = self._clock()

    def waits(self, task: object) -> bool:
        """Whether ``task`` waits in this line now (in :meth:`step`, not yet let through)."""
        return task in self._tasks

    def _measure(self) -> None:
        """Right after the steps let through (scheduled behind their wake-ups): their cost."""
        if self._started is not None and self._granted:
            measured = (self._clock() - self._started) / self._granted
            self._cost = measured if self._cost <= 0.0 else (self._cost + measured) / 2
        self._started = None

    def _next_turn(self) -> None:
        """Once per turn while steps wait, at the turn's end: let the next ones through (they
        run in the next turn, behind what this turn's socket callbacks woke)."""
        loop, self._loop, self._held = self._loop, None, None
        waiters, granted, allowance = self._waiters, 0, self.allowance
        now = loop.time() if loop is not None else 0.0
        overdue = now - self._max_wait if loop is not None else -math.inf
        if (
            loop is not None
            and waiters
            and waiters[0][0] > overdue
            and (self._may_hold is None or self._may_hold())
        ):
            pause = self._pause(now)
            if pause > 0.0:
                self._loop = loop
                wake = min(pause, waiters[0][0] - overdue)
                self._held = loop.call_later(wake, self._next_turn)
                return
        while waiters and (granted < allowance or waiters[0][0] <= overdue):
            _, waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                granted += 1
        self._granted = granted
        setattr(self._stats, self._waiting, len(waiters))
        if loop is None:
            return
        if granted:
            loop.call_soon(self._measure)
        if waiters:
            self._loop = loop
            loop.call_later(0.0, self._next_turn)
            if self._share < 1.0:
                self._last_grant = (self._clock(), now)
        else:
            self._last_grant = None

    def _pause(self, now: float) -> float:
        """Seconds the line must still wait for the thread's busy share since the last steps
        went through to come down to ``busy_share`` (0: none)."""
        if self._last_grant is None:
            return 0.0
        cpu, then = self._last_grant
        used = self._clock() - cpu
        return used / self._share - (now - then)


@dataclass
class LinkStatistics:
    """Counters of one link (a snapshot copy is returned by :meth:`WebSocketLink.statistics`)."""

    connections: int = 0
    upgrades_refused: dict[int, int] = field(default_factory=dict)
    handshakes_completed: int = 0
    handshakes_failed: dict[str, int] = field(default_factory=dict)
    evicted_unauthenticated: int = 0
    accepts_paused: int = 0
    """Times the listener stopped accepting connections because ``max_unauthenticated_sockets``
    were open and every one of them waited in the handshake line (none to evict)."""
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
    sessions_refused_draining: int = 0
    """Fresh sessions refused (4010) while the link drained (a worker told to stop); resumes
    are admitted and not counted here."""
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
    did not resolve, the server spoke the other scheme (TLS to a ``ws://`` dial, plain text
    to a ``wss://`` one), or it answered the upgrade with an HTTP client error (a 404: nothing
    at that path) or not in HTTP at all (:class:`~garcon_link.errors.Unreachable`)."""
    handshake_steps_deferred: int = 0
    """Handshake steps (an upgrade request, a hello, a proof) a listener put off by a turn or
    more because ``handshake_steps_per_turn`` others were ahead."""
    handshake_steps_waiting: int = field(default=0, metadata={"metric": "gauge"})
    """Handshake steps waiting in line now (at most one per unauthenticated socket)."""
    teardowns_deferred: int = 0
    """Teardowns of lost authenticated sockets a listener put off by a turn or more because
    others were ahead (see ``handshake_steps_per_turn``)."""
    teardowns_waiting: int = field(default=0, metadata={"metric": "gauge"})
    """Teardowns waiting in line now (at most one per authenticated socket)."""
    dials_refused_in_a_row: int = field(default=0, metadata={"metric": "gauge"})
    """Such dials since the last one that connected to a server of its scheme (0 once one
    does): how long nothing has listened at the dialed address, in attempts."""

    def count_handshake_failure(self, reason: HandshakeFailure) -> None:
        self.handshakes_failed[reason.name] = self.handshakes_failed.get(reason.name, 0) + 1
