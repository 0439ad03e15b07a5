"""A peer that never reads, at the heartbeat on loop timers (``endpoint._heartbeat``).

When the peer stops reading, our send buffer fills and the socket cannot take a ping; the
heartbeat tries it again by timer until the ping's ``within`` has passed (the silence deadline).
Each socket stuck so must cost a bounded number of wake-ups per ping, not one per
``PING_RETRY_S`` for the whole of ``within``: a thousand such sockets (a peer's or a broken
network's) at 100 wake-ups a second each keep a core busy until their deadlines.

Driven on a stand-in socket as tests/test_heartbeat_timers.py does: what the heartbeat reads of
a socket, whose ``ping_nowait`` never succeeds (the buffer stays full) and whose peer is silent.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from garcon_link.endpoint._heartbeat import Heartbeat
from garcon_link.limits import Limits
from garcon_link.net.budgets import LinkStatistics

INTERVAL = 0.4
TIMEOUT = 1.2  # a ping due at 0.4 s is tried until the deadline at 1.2 s (as 5 s and 15 s)
RETRY_BOUND = 20  # tries of one ping, its first included: a backoff needs about log2(100) + few


class _Full:
    """A socket whose send buffer stays full: every ``ping_nowait`` is refused (nothing
    written), and its peer sends nothing."""

    def __init__(self) -> None:
        self.reading = True
        self.busy = False
        self.last_inbound = 0.0
        self.tries = 0

    def ping_nowait(self) -> bool:
        self.tries += 1
        return False


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.timeout(10)
async def test_a_socket_that_cannot_take_a_ping_costs_few_wake_ups(anyio_backend: str) -> None:
    sock = _Full()
    limits = Limits(heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT)
    heartbeat = Heartbeat(limits, LinkStatistics(), dialer=True, tag="test", key_for=None)
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:
        sock.last_inbound = loop.time()
        beating = heartbeat.start(None, sock, scope)  # type: ignore[arg-type]
        try:
            with anyio.fail_after(5):
                await anyio.sleep_forever()  # until the silence deadline ends the socket
        finally:
            beating.stop()
    assert scope.cancel_called  # the deadline still ends a socket that cannot take a ping
    assert 1 <= sock.tries <= RETRY_BOUND, f"{sock.tries} tries of one ping"
