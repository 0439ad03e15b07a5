"""What a refused or failed unauthenticated socket is told, and how its failures are logged.

:func:`upgrade_refusal` is the listener's check of an HTTP upgrade request (a pure function: why
it is answered ``400``, or ``None``); :func:`one_line` bounds a reason built from a library's
message about peer bytes; :func:`unauthenticated_log` is the rate limiter of a link's
unauthenticated failures. All are imported from :mod:`garcon_link.net.ws` too
(docs/design.md#link).
"""

from __future__ import annotations

import logging
import re

import h11

from ..limits import Limits
from ..logs import PeerLogLimiter

__all__ = ["one_line", "unauthenticated_log", "upgrade_refusal"]

log = logging.getLogger("garcon_link.ws")  # the name users configure (README)

_REASON_CHARS = 200
"""Longest reason (log line, refusal body) built from a library's message about peer bytes."""


# obs-fold (RFC 9112 §5.2): a header line that starts with a space or a tab continues the previous
# one. h11 accepts and unfolds it; we refuse it, as a request smuggling vector.
_OBS_FOLD = re.compile(rb"\n[ \t]")


def upgrade_refusal(request: h11.Request, head: bytes, *, max_headers: int) -> str | None:
    """Why an HTTP upgrade request is refused (answered ``400``), or ``None`` if it may proceed.

    Only a plain WebSocket upgrade is let through to wsproto's checks (which then want the
    ``Upgrade``, ``Connection``, ``Sec-WebSocket-*`` and ``Host`` headers): anything that a proxy in
    front of us could read differently, or that carries a body, is refused rather than guessed at.

    Args:
        request: the request as h11 parsed it.
        head: the request's bytes up to and including the blank line that ends its headers.
        max_headers: ``Limits.max_upgrade_headers``.

    Returns:
        A one-line reason, or ``None``.
    """
    if request.method != b"GET":
        return "an upgrade request must be a GET"
    if request.http_version != b"1.1":
        return "an upgrade request must be HTTP/1.1"
    if not request.target.startswith(b"/"):
        return "the request target must be a path (origin-form)"
    if len(request.headers) > max_headers:
        return f"more than {max_headers} header fields"
    for name, value in request.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return "an upgrade request must not have a body"
    if _OBS_FOLD.search(head):
        return "obsolete line folding in the header fields"
    return None


def one_line(text: str) -> str:
    """``text`` on one line, at most :data:`_REASON_CHARS` characters (for logs and replies)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _REASON_CHARS else flat[: _REASON_CHARS - 3] + "..."


def unauthenticated_log(limits: Limits) -> PeerLogLimiter:
    """The rate limiter of a link's unauthenticated failures (refused upgrades and handshakes,
    TLS failures, deadlines, evictions): INFO lines, at most one per peer host and reason per
    ``log_interval``, and one WARNING summary per interval on ``garcon_link.ws``."""
    return PeerLogLimiter(
        log,
        level=logging.INFO,
        interval=limits.log_interval,
        max_lines=limits.max_log_lines,
        summary="unauthenticated connections failed",
    )
