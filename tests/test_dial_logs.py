"""What a dialing end tells its operator while a peer is down or refuses it: the dial failures
are rate-limited per target and kind, and a certificate that will not verify says why and is not
redialed into a timeout."""

from __future__ import annotations

import logging
import socket

import anyio
import pytest
from linkutil import make_link, roles, small_limits, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10.0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def dial_failed_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "garcon_link.link" and r.levelno == logging.WARNING and "dial " in r.msg
    ]


async def test_a_peer_that_stays_down_gives_one_dial_warning_per_log_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every failed dial is counted, but while the target refuses for the same reason only the
    first of a ``log_interval`` is logged (the limiter's next line would say how many it left
    out)."""
    caplog.set_level(logging.WARNING, logger="garcon_link.link")
    _, dial_role = roles("controller-dials")
    link = make_link(
        dial_role,
        small_limits(log_interval=3600.0),
        dial=f"ws://127.0.0.1:{closed_port()}/executor",
    )
    with anyio.fail_after(DEADLINE):
        async with link:
            await wait_until(lambda: link.statistics().dials_refused >= 5, what="five dials")
    lines = dial_failed_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "Connection refused" in lines[0].getMessage()
    assert getattr(lines[0], "gl_peer", "").startswith("127.0.0.1:")
