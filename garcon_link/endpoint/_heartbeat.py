"""The heartbeat of an attached socket, and the re-read of its executor's key
(docs/design.md#heartbeats).

Theory of operation
-------------------
One :class:`Heartbeat` per link. On asyncio an attached socket's heartbeat is loop timers
(:meth:`Heartbeat.start`, no task: a resume storm allocates and wakes less per socket; a ping
the socket cannot take at once is tried again by timer, ``PING_RETRY_S``); elsewhere
:meth:`Heartbeat.run` is one task per attached socket, beside the session's pump. Both follow
the same steps. It obeys the pure :func:`~garcon_link.core.heartbeat.heartbeat_step`: ping
every ``heartbeat_interval``, and close the socket (resumably, 4007) after ``heartbeat_timeout``
with no inbound frame of any kind *while the socket is being read*: time the reader is held up
by a slow consumer is back-pressure, not the peer's silence (nor evidence for a takeover probe).
A dialer's quiet period and a listener's differ (:func:`~garcon_link.core.heartbeat.quiet_period`).

With ``keys``, the heartbeat also re-reads the executor's key every ``key_recheck_interval``
seconds: a deleted key file ends the socket (4001) and retires the session (``REVOKED``), so
revoking needs no restart and no reconnection; a changed key ends the socket only (the next
handshake, with the new key, may resume).

The heartbeat ends the socket by cancelling the socket's scope, after setting the socket's
``local_close`` (the cause the link logs and sends); it reaches its link only through the key
lookup it is given.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable

import anyio

from ..core.heartbeat import Ping, RecheckKey, Timeout, heartbeat_step, quiet_period
from ..core.wire import CloseCode
from ..errors import FailureReason
from ..limits import Limits
from ..logs import log_fields
from ..net.ws import LinkStatistics, SocketGone, WebSocket
from ._slots import _Slot

log = logging.getLogger("garcon_link.link")  # the link's logger: the name users configure (README)


class Heartbeat:
    """The heartbeat of a link's attached sockets.

    Args:
        limits: the link's bounds (intervals, timeouts).
        stats: the link's counters (``heartbeat_timeouts``).
        dialer: whether the link dials (its quiet period).
        tag: the link's log prefix.
        key_for: with ``keys``, the link's lookup of an executor's handshake key (``None``: not
            enrolled) to re-read every ``key_recheck_interval``; ``None``: no re-reads.
    """

    def __init__(
        self,
        limits: Limits,
        stats: LinkStatistics,
        *,
        dialer: bool,
        tag: str,
        key_for: Callable[[str], bytes | None] | None,
    ) -> None:
        self._limits = limits
        self._stats = stats
        self._dialer = dialer
        self._tag = tag
        self._key_for = key_for
        self._timer_context: contextvars.Context | None = None
        """The context every socket's heartbeat timer runs in (asyncio; made at the first
        :meth:`start`): one, not a copy per timer armed."""

    def start(self, slot: _Slot, sock: WebSocket, scope: anyio.CancelScope) -> _Beating:
        """On asyncio: follow :func:`~garcon_link.core.heartbeat.heartbeat_step` for ``sock``
        with loop timers until :meth:`_Beating.stop` (``scope``: the socket's, cancelled to end
        it)."""
        if self._timer_context is None:
            self._timer_context = contextvars.copy_context()
        return _Beating(self, slot, sock, scope, self._timer_context)

    async def run(
        self, slot: _Slot, sock: WebSocket, scope: anyio.CancelScope, beat: anyio.CancelScope
    ) -> None:
        """Obey :func:`~garcon_link.core.heartbeat.heartbeat_step` until the socket ends
        (``scope``: the socket's, cancelled to end it) or ``beat`` is cancelled."""
        with beat:
            await self._beat(slot, sock, scope)

    async def _beat(self, slot: _Slot, sock: WebSocket, scope: anyio.CancelScope) -> None:
        limits = self._limits
        quiet = quiet_period(limits, dialer=self._dialer)
        next_ping = anyio.current_time() + limits.heartbeat_interval
        next_key_check = None
        if self._key_for is not None:
            next_key_check = anyio.current_time() + limits.key_recheck_interval
        now = anyio.current_time()
        while True:
            action = heartbeat_step(
                now,
                reading=sock.reading,
                last_inbound=sock.last_inbound,
                busy=sock.busy,
                next_ping=next_ping,
                next_key_check=next_key_check,
                quiet=quiet,
                limits=limits,
            )
            if isinstance(action, RecheckKey):
                next_key_check = action.next_key_check
                if self._key_revoked(slot, sock):
                    scope.cancel()
                    return
                continue  # the same turn goes on with the same ``now``
            if isinstance(action, Timeout):
                self._timed_out(sock, action)
                scope.cancel()
                return
            next_ping = action.next_ping
            if isinstance(action, Ping):
                with anyio.move_on_after(action.within):
                    try:
                        await sock.ping()
                    except SocketGone:
                        scope.cancel()
                        return
            await anyio.sleep_until(action.wake)
            now = anyio.current_time()

    def _timed_out(self, sock: WebSocket, action: Timeout) -> None:
        self._stats.heartbeat_timeouts += 1
        sock.local_close = (
            CloseCode.HEARTBEAT_TIMEOUT,
            f"no inbound frame for {action.silent:.1f}s (resumable)",
        )

    def _key_revoked(self, slot: _Slot, sock: WebSocket) -> bool:
        """Re-read the attached executor's key: gone retires the session (``REVOKED``), changed
        ends the socket (the next handshake, with the new key, may resume)."""
        assert self._key_for is not None
        key = self._key_for(slot.executor_id)
        if key is not None and key == slot.key:
            return False
        reason = FailureReason.REVOKED
        fields = log_fields(executor=slot.executor_id, peer=sock.peer, close_code=reason.close_code)
        if key is None:
            log.warning(
                "%s executor %r: key revoked; retiring its session",
                self._tag,
                slot.executor_id,
                extra=fields,
            )
            sock.local_close = (reason.close_code, reason.description)
            if slot.transport is not None:
                slot.transport.retire(reason, "its key file is gone")
        else:
            log.info(
                "%s executor %r: key changed; closing its socket",
                self._tag,
                slot.executor_id,
                extra=fields,
            )
            sock.local_close = (reason.close_code, "the executor's key changed")
        return True


PING_RETRY_S = 0.01
"""How soon a heartbeat on loop timers first tries again a ping the socket could not take at once
(a write in progress). Each later try waits twice as long as the one before, up to a quarter of
``heartbeat_interval``, until the ping's ``within`` has passed: a write that ends soon lets the
ping out soon, and a socket whose peer stopped reading costs a few wake-ups per ping (about a
dozen with the default limits), not one every 10 ms until its silence deadline."""


class _Beating:
    """One attached socket's heartbeat as loop timers (asyncio): the steps of
    :meth:`Heartbeat.run`, each at its wake time in a loop callback. A ping is written at once
    when the socket can take it; else it is tried again after :data:`PING_RETRY_S`, then
    at doubling delays (up to a quarter of ``heartbeat_interval``), until the step's ``within``
    has passed (then it is given up, as :meth:`Heartbeat.run` gives up its
    wait), and no other ping is started meanwhile. Nothing here starts a task: a loop callback
    runs outside any task, where anyio cannot start one."""

    __slots__ = (
        "_beat",
        "_context",
        "_done",
        "_loop",
        "_next_key_check",
        "_next_ping",
        "_ping_retry",
        "_ping_until",
        "_quiet",
        "_scope",
        "_slot",
        "_sock",
        "_timer",
    )

    def __init__(
        self,
        beat: Heartbeat,
        slot: _Slot,
        sock: WebSocket,
        scope: anyio.CancelScope,
        context: contextvars.Context,
    ) -> None:
        self._beat = beat
        self._context = context
        self._slot = slot
        self._sock = sock
        self._scope = scope
        limits = beat._limits
        self._quiet = quiet_period(limits, dialer=beat._dialer)
        loop = self._loop = asyncio.get_running_loop()
        now = loop.time()  # (anyio's clock on asyncio)
        self._next_ping = now + limits.heartbeat_interval
        self._next_key_check = (
            now + limits.key_recheck_interval if beat._key_for is not None else None
        )
        self._ping_until = 0.0  # while a ping waits for the socket: when it is given up
        self._ping_retry = PING_RETRY_S  # ... and the delay before its next try
        self._done = False
        # The timers call this object itself (no bound method per timer), in the heartbeat's
        # one context.
        self._timer: asyncio.Handle | None = loop.call_soon(self, context=context)

    def stop(self) -> None:
        """End the heartbeat (the socket ended)."""
        self._done = True
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _end_socket(self) -> None:
        self.stop()
        self._scope.cancel()

    def __call__(self) -> None:
        """One step (the timer's callback)."""
        self._timer = None
        if self._done:
            return
        beat, sock = self._beat, self._sock
        now = self._loop.time()
        try:
            if self._ping_until:
                if sock.ping_nowait() or now >= self._ping_until:
                    self._ping_until = 0.0
                else:
                    self._ping_retry = min(
                        2 * self._ping_retry, beat._limits.heartbeat_interval / 4
                    )
            while True:
                action = heartbeat_step(
                    now,
                    reading=sock.reading,
                    last_inbound=sock.last_inbound,
                    busy=sock.busy,
                    next_ping=self._next_ping,
                    next_key_check=self._next_key_check,
                    quiet=self._quiet,
                    limits=beat._limits,
                )
                if isinstance(action, RecheckKey):
                    self._next_key_check = action.next_key_check
                    if beat._key_revoked(self._slot, sock):
                        self._end_socket()
                        return
                    continue  # the same step goes on with the same ``now``
                if isinstance(action, Timeout):
                    beat._timed_out(sock, action)
                    self._end_socket()
                    return
                self._next_ping = action.next_ping
                if isinstance(action, Ping) and not self._ping_until and not sock.ping_nowait():
                    self._ping_until = now + action.within
                    self._ping_retry = PING_RETRY_S
                wake = action.wake
                if self._ping_until:
                    wake = min(wake, now + self._ping_retry, self._ping_until)
                self._timer = self._loop.call_at(wake, self, context=self._context)
                return
        except SocketGone:
            self._end_socket()
