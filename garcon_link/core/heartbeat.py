"""The heartbeat policy of one attached socket as a pure step: given the time and what the socket
shows, say what to do next (sans-IO; the link's heartbeat task asks and obeys).

Theory of operation
-------------------
The link runs one heartbeat task per attached socket. Each turn it reads the clock and the
socket (is a read in progress, when did the last inbound frame arrive, is a write in progress)
and calls :func:`heartbeat_step`, which returns one action, a frozen dataclass dispatched on type:

* :class:`RecheckKey` -- the key re-check is due (only with a keyring, ``next_key_check`` given):
  re-read the executor's key; if it still holds, call the step again with the same ``now``.
* :class:`Timeout` -- no inbound frame for ``heartbeat_timeout`` while the socket was being read:
  close it (resumably, 4007).
* :class:`Ping` -- ping the peer, bounded by :attr:`Ping.within`, then sleep until
  :attr:`Ping.wake`.
* :class:`SleepUntil` -- nothing to do before :attr:`SleepUntil.wake`.

:class:`Ping` and :class:`SleepUntil` carry the next ping time, which the caller keeps and passes
back in.

Rules, in the order they are applied:

1. **Key re-check** every ``key_recheck_interval`` when the link serves a keyring.
2. **Silence** is judged only while the socket is being read: time the reader is held up by our
   own slow consumer is back-pressure, not the peer's silence. Then the deadline is
   ``last_inbound + heartbeat_timeout``; otherwise it is a full timeout from ``now``.
3. **Pings** when one is due: a side that heard from its peer within ``quiet`` does not ping (a
   ping would prove nothing new) and next looks at ``last_inbound + quiet``; the dialer's quiet
   is ``heartbeat_interval``, the listener's one and a half intervals (kept short of the
   timeout), so on an idle socket the dialer's pings and their pongs satisfy both sides' silence
   checks and the listener only answers. No ping is queued behind a write in progress. A ping
   waits at most until the silence deadline (a peer that stopped reading must not stall the
   check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from ..limits import Limits

__all__ = [
    "HeartbeatAction",
    "Ping",
    "RecheckKey",
    "SleepUntil",
    "Timeout",
    "heartbeat_step",
    "quiet_period",
]


@dataclass(frozen=True, slots=True)
class RecheckKey:
    """Re-read the executor's key now; then step again with the same ``now``.

    Attributes:
        next_key_check: when the re-check after this one is due.
    """

    next_key_check: float


@dataclass(frozen=True, slots=True)
class Timeout:
    """The peer was silent for ``heartbeat_timeout`` while being read: close the socket.

    Attributes:
        silent: seconds since the last inbound frame (``>= heartbeat_timeout``).
    """

    silent: float


@dataclass(frozen=True, slots=True)
class Ping:
    """Ping the peer, waiting at most ``within`` seconds for the write; then sleep until
    ``wake``.

    Attributes:
        next_ping: when the next ping is due.
        within: how long the ping's write may take (``>= 0``: until the silence deadline).
        wake: when to step again.
    """

    next_ping: float
    within: float
    wake: float


@dataclass(frozen=True, slots=True)
class SleepUntil:
    """Nothing to do before ``wake``.

    Attributes:
        next_ping: when the next ping is due.
        wake: when to step again.
    """

    next_ping: float
    wake: float


HeartbeatAction: TypeAlias = RecheckKey | Timeout | Ping | SleepUntil


def quiet_period(limits: Limits, *, dialer: bool) -> float:
    """How long a side hears nothing from its peer before it pings.

    Args:
        limits: gives ``heartbeat_interval`` and ``heartbeat_timeout``.
        dialer: whether this side dialed the socket.

    Returns:
        ``heartbeat_interval`` for the dialer; for the listener one and a half intervals, or
        halfway between the interval and the timeout when that is shorter (so the listener
        still pings before its own timeout).
    """
    interval = limits.heartbeat_interval
    if dialer:
        return interval
    return min(1.5 * interval, (interval + limits.heartbeat_timeout) / 2)


def heartbeat_step(
    now: float,
    *,
    reading: bool,
    last_inbound: float,
    busy: bool,
    next_ping: float,
    next_key_check: float | None,
    quiet: float,
    limits: Limits,
) -> HeartbeatAction:
    """Decide the heartbeat's next action (see the module docstring for the rules).

    Args:
        now: the current time.
        reading: a read of the socket is in progress (the peer's silence can be judged).
        last_inbound: when the last inbound frame arrived.
        busy: a write of the socket is in progress (a ping would queue behind it).
        next_ping: when a ping is due (``now >= next_ping``: due now).
        next_key_check: when the key re-check is due; ``None`` without a keyring.
        quiet: this side's :func:`quiet_period`.
        limits: gives ``heartbeat_interval``, ``heartbeat_timeout`` and
            ``key_recheck_interval``.

    Returns:
        One action. :class:`Ping` and :class:`SleepUntil` wake at the earliest of the next
        ping, the silence deadline and (with a keyring) the next key re-check.
    """
    if next_key_check is not None and now >= next_key_check:
        return RecheckKey(now + limits.key_recheck_interval)
    timeout = limits.heartbeat_timeout
    if reading:
        silent = now - last_inbound
        if silent >= timeout:
            return Timeout(silent)
        deadline = last_inbound + timeout
    else:
        deadline = now + timeout
    ping = False
    if now >= next_ping:
        next_ping = now + limits.heartbeat_interval
        if reading and now - last_inbound < quiet:
            next_ping = last_inbound + quiet
        elif not busy:
            ping = True
    wake = min(next_ping, deadline)
    if next_key_check is not None:
        wake = min(wake, next_key_check)
    if ping:
        return Ping(next_ping, max(0.0, deadline - now), wake)
    return SleepUntil(next_ping, wake)
