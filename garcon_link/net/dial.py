"""Dialing: the TCP connection to a dial target, and the client's TLS and WebSocket upgrade.

:func:`connect` opens the connection within ``connect_timeout`` (a refusal by every address, or
a name that does not resolve, is :class:`~garcon_link.errors.Unreachable`); :func:`client_upgrade`
wraps TLS for ``wss://`` and upgrades the stream to a
:class:`~garcon_link.net.websocket.WebSocket`. Both are imported from :mod:`garcon_link.net.ws`
too (docs/design.md#link).
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from typing import Any

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, RejectConnection, Request

from ..errors import LinkError, Unreachable, WrongScheme
from ..limits import Limits
from ..logs import peer_message, peer_text
from . import _asyncio_stream
from .addresses import DialTarget
from .budgets import LinkStatistics
from .websocket import _READ_CHUNK, BROKEN, GONE, WebSocket

_SPEAKS_TLS = "answered with TLS, not plain text (a wss:// server); dial wss://"


_VERIFY_CHARS = 200
"""The most characters shown of the TLS library's reason a certificate did not verify."""

_HTTP = b"HTTP/"
_TRANSIENT_REFUSALS = frozenset({408, 425, 429})
"""Client-error answers that a later dial may not meet (timeout, too early, rate limited)."""


def _refused_upgrade(peer: str, path: str, status: int) -> LinkError:
    """A refused upgrade's error: a client error (a 404 for a path nothing serves, a 403) is
    the same answer on every redial, so it is :class:`Unreachable` -- a dial that found no
    endpoint -- and waits for a worker end early; a server error (a proxy's 502 while the
    worker behind it restarts) or a rate limit is worth redialing."""
    if 400 <= status < 500 and status not in _TRANSIENT_REFUSALS:
        return Unreachable(
            f"{peer} answered the WebSocket upgrade of {peer_text(path, 200)} with HTTP "
            f"{status}: no garcon-link endpoint there (check the URL's path, or another "
            "program on that port?)"
        )
    return LinkError(f"{peer} refused the upgrade: HTTP {status}")


def _asks_for_tls(headers: Any) -> bool:
    return any(k.lower() == b"upgrade" and b"tls/" in v.lower() for k, v in headers)


__all__ = ["client_upgrade", "connect"]


async def connect(target: DialTarget, limits: Limits) -> anyio.abc.ByteStream:
    """Open the TCP connection to ``target`` within ``connect_timeout``.

    Raises:
        Unreachable: every address refused the connection, or the host name did not resolve.
        LinkError: timed out or failed otherwise (the OS's reason, one line).
    """
    host, port = target.host, target.port
    try:
        with anyio.fail_after(limits.connect_timeout):
            if _asyncio_stream.on_asyncio():
                return await _asyncio_stream.connect(host, port)
            return await anyio.connect_tcp(host, port)
    except TimeoutError as exc:
        raise LinkError(f"connect to {host}:{port} timed out") from exc
    except OSError as exc:
        if isinstance(exc, socket.gaierror):
            raise Unreachable(
                f"cannot resolve {host}: {exc.strerror or exc} (dialing {host}:{port})"
            ) from exc
        # The errno's own words: asyncio's strerror is "Connect call failed (address)".
        why = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
        if _refused(exc):
            refused = os.strerror(errno.ECONNREFUSED)
            raise Unreachable(f"cannot connect to {host}:{port}: {refused}") from exc
        raise LinkError(f"cannot connect to {host}:{port}: {why}") from exc


def _refused(exc: BaseException) -> bool:
    """Whether a failed connect was refused by every address it tried (anyio reports several
    attempts as one ``OSError`` caused by a group of them)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(_refused(inner) for inner in cause.exceptions)
    return cause is not None and _refused(cause)


async def client_upgrade(
    stream: anyio.abc.ByteStream,
    target: DialTarget,
    *,
    ssl_context: ssl.SSLContext | None,
    limits: Limits,
    stats: LinkStatistics,
) -> WebSocket:
    """Wrap TLS (for ``wss://``) and perform the WebSocket upgrade on a connected stream.

    The caller bounds the time (the handshake deadline) and owns ``stream``: it closes it on
    any exception, cancellation included.

    Raises:
        Unreachable: the answer is not HTTP, or an HTTP client error such as a 404 (a redial
            meets the same: :func:`_refused_upgrade`), or the server's TLS certificate does not
            verify (the message says why: self-signed, another host's, expired...);
            :class:`WrongScheme` for the other scheme.
        LinkError: TLS failed, the connection was lost, the upgrade was refused otherwise or
            the response was not a valid upgrade.
    """
    peer = f"{target.host}:{target.port}"
    try:
        if ssl_context is not None:
            stream = await TLSStream.wrap(
                stream,
                server_side=False,
                hostname=target.host,
                ssl_context=ssl_context,
                standard_compatible=False,
            )
        ws = WSConnection(ConnectionType.CLIENT)
        sock = WebSocket(stream, ws, peer=peer, limits=limits, stats=stats)
        host = f"[{target.host}]" if ":" in target.host else target.host
        await sock._write(ws.send(Request(host=f"{host}:{target.port}", target=target.target)))
        head = b""  # the answer's first bytes, until there are enough to tell it is HTTP
        while True:
            data = await stream.receive(_READ_CHUNK)
            if ssl_context is None and data[:1] in (b"\x15", b"\x16") and data[1:2] == b"\x03":
                raise WrongScheme(f"{target.url}: {peer} {_SPEAKS_TLS}")  # a TLS record
            if len(head) < 5:
                head += data[: 5 - len(head)]
                if not _HTTP.startswith(head[:5]):
                    # Another protocol answers there (an SSH or database banner, say), and a
                    # redial meets it again.
                    raise Unreachable(
                        f"{peer} did not answer the WebSocket upgrade in HTTP (it sent "
                        f"{peer_text(repr(data[:24]), 60)}): not a garcon-link endpoint "
                        "(another program on that port?)"
                    )
            try:
                ws.receive_data(data)
                # Lazily: frames that arrived in the same read as the 101 (the peer's hello,
                # typically) must stay queued in wsproto for receive_message, not be consumed.
                for event in ws.events():
                    if isinstance(event, AcceptConnection):
                        sock.last_inbound = anyio.current_time()
                        return sock
                    if isinstance(event, RejectConnection):
                        if event.status_code == 426 and _asks_for_tls(event.headers):
                            raise WrongScheme(f"{target.url}: {peer} {_SPEAKS_TLS}")
                        raise _refused_upgrade(peer, target.target, event.status_code)
            except BROKEN as exc:
                # Bytes that are not an HTTP response: another protocol listens there, and a
                # redial meets it again.
                raise Unreachable(
                    f"{peer} did not answer the WebSocket upgrade in HTTP "
                    f"({peer_text(exc)}): not a garcon-link endpoint (another program on that "
                    "port?)"
                ) from exc
    except ssl.SSLCertVerificationError as exc:
        # The server's certificate is not trusted, names another host, or has expired: every
        # redial meets the same certificate, so, like a client error answered to the upgrade,
        # this is a dial that found no endpoint of ours.
        why = peer_message(getattr(exc, "verify_message", None) or str(exc), _VERIFY_CHARS)
        raise Unreachable(
            f"{target.url}: the TLS certificate of {peer} does not verify: {why} "
            "(CERTIFICATE_VERIFY_FAILED); trust the CA that signed it "
            "(the client's ssl context, [tls] ca) and dial a host name or address the "
            "certificate names"
        ) from exc
    except ssl.SSLError as exc:
        if exc.reason == "WRONG_VERSION_NUMBER":  # where a TLS record was due
            raise WrongScheme(
                f"{target.url}: {peer} answered in plain text, not TLS (a ws:// server?); "
                "dial ws:// or its TLS port"
            ) from exc
        raise LinkError(f"TLS handshake with {peer} failed: {exc.reason or exc}") from exc
    except GONE as exc:
        raise LinkError(f"connection to {peer} lost during upgrade: {exc}") from exc
