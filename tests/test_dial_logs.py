"""What a dialing end tells its operator while a peer is down or refuses it: the dial failures
are rate-limited per target and kind, and a certificate that will not verify says why and is not
redialed into a timeout."""

from __future__ import annotations

import logging
import socket
import ssl

import anyio
import pytest
import trustme
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


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(cert: trustme.LeafCert) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    return ctx


@pytest.mark.parametrize(
    ("names", "trusted", "words"),
    [
        (("localhost", "127.0.0.1"), False, "unable to get local issuer certificate"),
        (("elsewhere.example",), True, "IP address mismatch"),
    ],
    ids=["untrusted-ca", "another-host"],
)
async def test_a_certificate_that_does_not_verify_says_why_and_counts_as_refused(
    ca: trustme.CA, names: tuple[str, ...], trusted: bool, words: str
) -> None:
    """A redial meets the same certificate: the dial is refused (what
    ``wait_ready(refused_dials=...)`` and ``garcon-link call`` give up on, well before their
    timeout) and the error says what the TLS library found wrong."""
    listen_role, dial_role = roles("controller-dials")
    limits = small_limits()
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if trusted:
        ca.configure_trust(client_ctx)
    listener = make_link(
        listen_role,
        limits,
        listen=("127.0.0.1", 0),
        ssl_context=server_context(ca.issue_cert(*names)),
    )
    with anyio.fail_after(DEADLINE):
        async with listener:
            dialer = make_link(dial_role, limits, dial=listener.url, ssl_context=client_ctx)
            async with dialer:
                await wait_until(lambda: dialer.statistics().dials_refused_in_a_row >= 3)
                error = dialer.last_dial_error
    assert error is not None and error.startswith(f"{listener.url}: the TLS certificate of ")
    assert words in error and "CERTIFICATE_VERIFY_FAILED" in error, error
    assert "[tls] ca" in error, error
