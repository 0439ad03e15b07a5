"""The heartbeat on asyncio loop timers (``endpoint._heartbeat``), driven on a stand-in socket.

Its steps run as loop callbacks, outside any task: a ping the socket cannot take at once must be
tried again by timer (a callback cannot start an anyio task), and a socket found dead when a
ping is tried ends the socket's scope instead of being retried for ever.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from garcon_link.endpoint._heartbeat import Heartbeat
from garcon_link.limits import Limits
from garcon_link.net.budgets import LinkStatistics
from garcon_link.net.websocket import SocketGone

INTERVAL = 0.02


class _Socket:
    """What the heartbeat reads of a socket; ``ping_nowait`` refuses its first ``busy_for``
    tries (a write in progress), then writes, or raises once ``dead``."""

    def __init__(self, busy_for: int) -> None:
        self.reading = True
        self.busy = False
        self.last_inbound = 0.0
        self.busy_for = busy_for
        self.tries = 0
        self.pings = 0
        self.dead = False

    def ping_nowait(self) -> bool:
        self.tries += 1
        if self.dead:
            raise SocketGone("socket is closed")
        if self.tries <= self.busy_for:
            return False
        self.pings += 1
        return True


def _heartbeat() -> Heartbeat:
    limits = Limits(heartbeat_interval=INTERVAL, heartbeat_timeout=60.0)
    return Heartbeat(limits, LinkStatistics(), dialer=True, tag="test", key_for=None)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_ping_the_socket_cannot_take_at_once_is_tried_again_and_the_beat_goes_on(
    anyio_backend: str,
) -> None:
    sock = _Socket(busy_for=3)
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:
        sock.last_inbound = loop.time()
        beating = _heartbeat().start(None, sock, scope)  # type: ignore[arg-type]
        try:
            with anyio.fail_after(5):
                while sock.pings < 3:  # the first ping after its retries, then two more beats
                    await anyio.sleep(INTERVAL / 4)  # (nothing heard: each interval pings)
        finally:
            beating.stop()
    assert not scope.cancel_called
    # Three refused tries before the first ping went out, each tried again by timer.
    assert sock.tries >= 3 + 3


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_dead_socket_found_by_a_ping_ends_the_socket(anyio_backend: str) -> None:
    sock = _Socket(busy_for=0)
    sock.dead = True
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:
        sock.last_inbound = loop.time()
        beating = _heartbeat().start(None, sock, scope)  # type: ignore[arg-type]
        with anyio.fail_after(5):
            await anyio.sleep_forever()  # until the heartbeat cancels the socket's scope
    beating.stop()
    assert scope.cancel_called and sock.tries == 1
