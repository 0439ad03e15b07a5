"""WebSocket sockets: upgrade, framing, frame budgets, listen and dial (docs/design.md#link).

This module is the listener (:class:`WebSocketListener`) and the one place every name of the
sockets is imported from; the rest is in modules of its own, one job each, which it re-exports:
the socket budgets and the link's counters (:mod:`garcon_link.net.budgets`), what a refused or
failed unauthenticated socket is told and logged (:mod:`garcon_link.net.refusals`), the
:class:`WebSocket` with the one error mapping where h11, wsproto, ssl and OS errors become ours
(:mod:`garcon_link.net.websocket`), and dialing (:mod:`garcon_link.net.dial`). They log on this
module's logger, ``garcon_link.ws``.

Theory of operation
-------------------
This module turns TCP (optionally TLS) connections into :class:`WebSocket` objects -- binary
messages in, binary messages out -- and knows nothing of handshakes, sessions or executors. The
session endpoint (:mod:`garcon_link.endpoint.link`) authenticates what it gets from here and
attaches it to a logical session; a :class:`WebSocket` satisfies the transport's ``MessageSocket``
protocol.

1. **Upgrade (listening).** :class:`WebSocketListener` parses the HTTP/1.1 upgrade request with an
   h11 connection of its own and refuses (``400``, with a one-line reason) anything but a plain
   ``GET`` upgrade in origin-form over HTTP/1.1: a request body (``Content-Length`` other than 0,
   any ``Transfer-Encoding``), obs-fold header lines, or more than ``max_upgrade_headers`` header
   fields (:func:`upgrade_refusal`, a pure function); wsproto then checks the WebSocket headers
   (``400``). It answers ``404`` for any path but ``/executor`` and ``503`` while draining or when
   ``max_authenticated_sockets`` are busy. Bytes pipelined after the request (a hello sent without
   waiting for the ``101``) are kept and fed to the WebSocket; on the dialing side wsproto keeps
   frames that came with the ``101``. No extension (no permessage-deflate) is ever negotiated.
   Unauthenticated sockets are capped (``max_unauthenticated_sockets``): past the cap the oldest
   one waiting for its peer is evicted, so a slowloris flood cannot starve a legitimate peer;
   one whose next step waits in the handshake line (:class:`TurnBudget`) is not, and while every
   one does the listener stops accepting (the kernel's backlog holds the rest). Upgrade plus the
   caller's authentication must finish within ``handshake_timeout`` (else 4008).
2. **Dialing.** :func:`connect` opens the TCP connection (``connect_timeout``) and
   :func:`client_upgrade` wraps TLS and performs the upgrade; both raise only
   :class:`~garcon_link.errors.LinkError`. The dial URL is parsed once, by
   :func:`~garcon_link.net.addresses.check_dial_url` (a
   :class:`~garcon_link.net.addresses.DialTarget`); it may carry the executor id as a routing
   hint (``?executor=<id>``) for a load balancer in front of several controller processes.
3. **Messages.** Messages are capped at ``max_frame_bytes`` (``max_handshake_frame_bytes`` before
   :meth:`WebSocket.authenticated`) and ``max_message_fragments`` frames while they are assembled
   (1009). A text frame is a protocol error (1003). Write back-pressure awaits the socket's drain.
   Once authenticated, a read that is exactly one whole small binary frame, and a whole small
   message written, skip wsproto's per-frame objects (:mod:`._frames`, only while wsproto holds
   no state the frame depends on); every other frame goes through wsproto.

Sharing the event loop with hostile peers
-----------------------------------------
A frame can cost far more to parse than it costs to send (an empty continuation frame is 6
bytes), so frames, not only bytes, are budgeted, per socket (:class:`FrameBudget`): before
authentication a fixed allowance (``max_handshake_frames``, no refill), after it a token bucket
(``frame_rate`` per second, ``frame_burst`` at once) that *throttles* -- the socket is read again
once it has earned a batch -- and never closes an authenticated peer. ``max_handshake_frames``
must be below ``frame_burst``: an unauthenticated socket always gets the smaller share. Every
read is a checkpoint (anyio's contract, kept by :mod:`garcon_link.net._asyncio_stream`), so between
two reads of one socket every other task runs; wsproto parses lazily, so frames left unparsed
when a message completes or the budget runs out cost nothing until the next pass. A socket we
close is drained for its close frame while its budget lasts, then only read and dropped (so the
close frame is not lost to a TCP reset) until ``close_timeout``.

Failures
--------
Exceptions of wsproto, h11, ssl and the OS never leave these modules: they are classified in one
place -- :data:`GONE` (the socket is gone) and :data:`BROKEN` (the peer's bytes broke HTTP or
WebSocket framing) -- and surface as :class:`SocketGone` (an ``anyio.BrokenResourceError``, what
the transport expects from a dead socket), ``MalformedFrame``/``FrameTooLarge`` or ``LinkError``.
Any *other* exception raised while serving one peer is handed to the listener's ``on_error``
callback: that peer's failure, never the listener's. Log records carry causes as text, never
exception objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import logging
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import h11
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSStream
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, Request

from ..errors import HandshakeFailure, LinkError
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_host, peer_text
from . import _asyncio_stream
from .addresses import EXECUTOR_PATH
from .budgets import FrameBudget, LinkStatistics, TurnBudget
from .dial import client_upgrade, connect
from .refusals import one_line, unauthenticated_log, upgrade_refusal
from .websocket import (
    _READ_CHUNK,
    BROKEN,
    GONE,
    SocketGone,
    WebSocket,
    close_code,
    close_stream,
    describe_close,
)

_FULL = object()  # WebSocketListener._evictable: at the cap, and none to evict

_TLS_BODY = b"426 this address speaks TLS: dial wss://\n"
_TLS_REQUIRED = (
    b"HTTP/1.1 426 Upgrade Required\r\nupgrade: TLS/1.2, HTTP/1.1\r\nconnection: close\r\n"
    b"content-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(_TLS_BODY), _TLS_BODY)
)
"""What a TLS listener answers, in plain text, to a plain-text HTTP request (RFC 2817's 426)."""

__all__ = [
    "BROKEN",
    "GONE",
    "FrameBudget",
    "LinkStatistics",
    "SocketGone",
    "TurnBudget",
    "WebSocket",
    "WebSocketListener",
    "client_upgrade",
    "connect",
    "close_code",
    "close_stream",
    "describe_close",
    "one_line",
    "unauthenticated_log",
    "upgrade_refusal",
]

log = logging.getLogger("garcon_link.ws")  # the name users configure (README)


# ---------------------------------------------------------------------------------- listening

Admitted = Callable[[], Awaitable[None]]
"""What an authenticated socket runs (outside the unauthenticated cap and deadline)."""
Authenticate = Callable[[WebSocket], Awaitable[Admitted | None]]
"""The endpoint's handshake on an upgraded socket: ``None`` when the peer was refused (it closed
the socket), else the coroutine function that serves the admitted peer."""


async def _serve_anyio(
    listener: anyio.abc.Listener[Any],
    handler: Callable[[anyio.abc.ByteStream], Coroutine[Any, Any, None]],
    tg: anyio.abc.TaskGroup,
    room: Callable[[], Awaitable[None]],
) -> None:
    """``listener.serve`` (trio), except that a failed ``accept`` (out of file descriptors)
    pauses and retries, reported rate-limited, instead of ending the listener, and that each
    accept first awaits ``room()`` (as :func:`garcon_link.net._asyncio_stream.serve_accepted`
    does on asyncio)."""
    subs: list[anyio.abc.SocketListener] = getattr(listener, "listeners", None) or [listener]

    async def accept_loop(sub: anyio.abc.SocketListener) -> None:
        failures = _asyncio_stream.AcceptFailures(str(sub.extra(SocketAttribute.local_address)))
        while True:
            await room()
            try:
                stream = await sub.accept()
            except (OSError, anyio.BrokenResourceError) as exc:  # trio's OSError, wrapped
                cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
                failures.failed(cause)
                await anyio.sleep(_asyncio_stream.ACCEPT_ERROR_PAUSE)
                continue
            tg.start_soon(handler, stream)

    async with anyio.create_task_group() as accept_group:
        for sub in subs:
            accept_group.start_soon(accept_loop, sub)


class WebSocketListener:
    """Accepts connections on ``/executor`` and hands each upgraded socket to ``authenticate``.

    Owns the unauthenticated-socket cap (the oldest waiting for its peer evicted; accepting
    paused while every one waits in the handshake line), the handshake deadline around upgrade
    plus authentication, the ``503`` answer while draining or full, and closing every stream it
    accepted.

    Args:
        limits: bounds.
        stats: the link's counters (shared with the endpoint).
        ssl_context: server TLS context, or ``None`` for plain text.
        tag: log prefix.
        on_error: called with ``(peer, exception)`` for an exception nobody expected while serving
            one peer; it logs and counts it (the peer's failure, never the listener's).
        max_authenticated: authenticated sockets at once (default ``max_authenticated_sockets``;
            a listener serving many executors needs one per executor).
        occupied: how many sockets count against ``max_authenticated`` now (default: every
            socket from the end of its authentication until it is closed); the endpoint counts
            the sockets attached to its sessions.
        peer_log: the rate limiter of unauthenticated failures' log lines (default: a new
            :func:`unauthenticated_log`; the link shares its own with the handshake).
    """

    def __init__(
        self,
        *,
        limits: Limits,
        stats: LinkStatistics,
        ssl_context: ssl.SSLContext | None,
        tag: str,
        on_error: Callable[[str, Exception], object],
        max_authenticated: int | None = None,
        occupied: Callable[[], int] | None = None,
        peer_log: PeerLogLimiter | None = None,
    ) -> None:
        self.limits = limits
        self._occupied = occupied
        self.peer_log = peer_log if peer_log is not None else unauthenticated_log(limits)
        """Where every unauthenticated failure is counted and, rate-limited, logged."""
        self._max_authenticated = (
            limits.max_authenticated_sockets if max_authenticated is None else max_authenticated
        )
        self._stats = stats
        self._ssl = ssl_context
        self._tag = tag
        self._on_error = on_error
        # each unauthenticated socket's handler (its task on asyncio), oldest first
        self._unauthenticated: dict[object, anyio.CancelScope] = {}
        self._room_wanted: anyio.Event | None = None  # set when room is made (_room)
        # the handshake line is held below seven eighths of the cap: held nearer to it, the
        # sockets it keeps open would fill the cap, and newcomers evict the ones waiting for
        # their peers (each a redial)
        self._hold_below = max(2, limits.max_unauthenticated_sockets * 7 // 8)
        self.turns = TurnBudget(
            limits.handshake_steps_per_turn,
            stats,
            max_wait=limits.handshake_timeout / 10,
            seconds_per_turn=limits.handshake_seconds_per_turn,
            busy_share=limits.handshake_busy_share,
            left=self._room_made,
            may_hold=self._below_cap,
        )
        """The budget of handshake steps per event-loop turn (see :class:`TurnBudget`)."""
        self.teardowns = TurnBudget(
            limits.handshake_steps_per_turn,
            stats,
            max_wait=limits.handshake_timeout,
            seconds_per_turn=limits.handshake_seconds_per_turn,
            counters=("teardowns_deferred", "teardowns_waiting"),
        )
        """The budget of lost authenticated sockets' teardowns per event-loop turn, a line apart
        from the handshakes' (a burst of lost sockets does not stand ahead of their resumes)."""
        self._authenticated = 0
        self.closing = False
        self.address: tuple[str, int] | None = None

    def count_also(self, extra: int, occupied: Callable[[], int]) -> None:
        """Admit ``extra`` more authenticated sockets, counted from now on by ``occupied``
        (a link hosting another link's sockets on this listener counts both)."""
        self._max_authenticated += extra
        self._occupied = occupied

    async def serve(
        self,
        host: str,
        port: int,
        authenticate: Authenticate,
        tg: anyio.abc.TaskGroup,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen until cancelled; ``task_status.started()`` once bound (see :attr:`address`).

        Raises:
            LinkError: the address cannot be bound.
        """
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            raise LinkError(f"cannot listen on {host}:{port}: {exc}") from exc
        bound = listener.extra(SocketAttribute.local_address)
        self.address = (str(bound[0]), int(bound[1]))
        task_status.started()

        # (a partial, not a closure: one coroutine per connection, not two)
        handle = functools.partial(self._handle, authenticate=authenticate)
        async with listener:
            if _asyncio_stream.on_asyncio():
                await _asyncio_stream.serve_accepted(listener, handle, self._room)
            else:
                await _serve_anyio(listener, handle, tg, self._room)

    async def _room(self) -> None:
        """Return once a connection may be accepted: at once unless ``max_unauthenticated_sockets``
        are open and every one waits in the handshake line, which would leave none to evict;
        then the connections wait in the kernel's backlog until one of these authenticates,
        ends or leaves the line (:meth:`_room_made`)."""
        if self._evictable() is not _FULL:
            return
        self._stats.accepts_paused += 1
        while self._evictable() is _FULL:
            if self._room_wanted is None:  # (one event for every accept loop waiting)
                self._room_wanted = anyio.Event()
            await self._room_wanted.wait()

    def _below_cap(self) -> bool:
        """Whether fewer than seven eighths of ``max_unauthenticated_sockets`` are open (the
        handshake line is held to ``handshake_busy_share`` only then)."""
        return len(self._unauthenticated) < self._hold_below

    def _room_made(self) -> None:
        """An unauthenticated socket left, or one of them left the handshake line: the accept
        loops waiting in :meth:`_room` look again."""
        if self._room_wanted is not None:
            self._room_wanted.set()
            self._room_wanted = None

    def _evictable(self, newest: object = None) -> object:
        """The oldest unauthenticated socket's key (not ``newest``) that does not wait in the
        handshake line, ``None`` below the cap, or :data:`_FULL` when there is none to evict."""
        if len(self._unauthenticated) < self.limits.max_unauthenticated_sockets + (
            newest is not None
        ):
            return None
        waits = self.turns.waits
        for key in self._unauthenticated:
            if key is not newest and not waits(key):
                return key
        return _FULL

    async def _handle(self, stream: anyio.abc.ByteStream, authenticate: Authenticate) -> None:
        self._stats.connections += 1
        try:
            remote = stream.extra(SocketAttribute.remote_address)
            peer = f"{remote[0]}:{remote[1]}" if isinstance(remote, tuple) else str(remote)
        except Exception:
            peer = "?"
        # (the task is what the handshake line knows a waiting step by)
        key: object = asyncio.current_task() if _asyncio_stream.on_asyncio() else stream
        try:
            with anyio.CancelScope() as scope:
                self._unauthenticated[key] = scope
                victim = self._evictable(newest=key)
                if victim is not None:
                    # Past the cap: the oldest socket that is not waiting for its next step
                    # here (a peer slow to send, or sending nothing); if every one waits,
                    # this new one goes, before any work was spent on it.
                    self._stats.evicted_unauthenticated += 1
                    self.peer_log.log(
                        peer_host(peer),
                        "evicted",
                        "%s %s: %s",
                        self._tag,
                        peer,
                        "closed: every unauthenticated socket waits in the handshake line"
                        if victim is _FULL
                        else "evicting the oldest unauthenticated socket",
                        extra=log_fields(peer=peer),
                    )
                    self._unauthenticated.pop(key if victim is _FULL else victim).cancel()
                try:
                    admitted = await self._accept(stream, peer, authenticate)
                finally:
                    self._unauthenticated.pop(key, None)
                    self._room_made()
            evicted = scope.cancelled_caught
            del scope  # (not kept, with its sets, for the authenticated socket's life)
            if evicted or admitted is None:
                return
            self._authenticated += 1
            try:
                await admitted()
            finally:
                self._authenticated -= 1
        except Exception as exc:
            self._on_error(peer, exc)  # never the listener's failure
        finally:
            # Every exit, shutdown (cancellation) included, closes the socket: a dropped stream
            # would stay open until garbage collection and the peer would hang.
            await close_stream(stream)

    async def _accept(
        self, stream: anyio.abc.ByteStream, peer: str, authenticate: Authenticate
    ) -> Admitted | None:
        byte_stream: anyio.abc.ByteStream = stream
        sock: WebSocket | None = None
        with anyio.move_on_after(self.limits.handshake_timeout) as deadline:
            if self._ssl is not None:
                try:
                    byte_stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=self._ssl, standard_compatible=False
                    )
                except GONE as e:
                    self._stats.tls_handshakes_failed += 1
                    if isinstance(e, ssl.SSLError) and e.reason == "HTTP_REQUEST":
                        with contextlib.suppress(*GONE):  # a ws:// dialer: tell it to use wss://
                            await stream.send(_TLS_REQUIRED)
                    self.peer_log.log(
                        peer_host(peer),
                        "TLS",
                        "%s %s: TLS handshake failed: %s",
                        self._tag,
                        peer,
                        peer_text(e),
                        extra=log_fields(peer=peer),
                    )
                    return None
            ws = WSConnection(ConnectionType.SERVER)
            sock = WebSocket(byte_stream, ws, peer=peer, limits=self.limits, stats=self._stats)
            sock.turns = self.turns
            sock.teardowns = self.teardowns
            if not await self._upgrade(sock):
                return None
            return await authenticate(sock)
        if deadline.cancelled_caught:
            self._stats.count_handshake_failure(HandshakeFailure.TIMEOUT)
            self.peer_log.log(
                peer_host(peer),
                HandshakeFailure.TIMEOUT.name,
                "%s %s: handshake deadline expired",
                self._tag,
                peer,
                extra=log_fields(peer=peer),
            )
            if sock is not None and sock.ws.state is ConnectionState.OPEN:
                # Upgraded but not authenticated in time: say so (4008) before closing.
                reason = HandshakeFailure.TIMEOUT
                sock.local_close = (reason.close_code, reason.description)
                await sock.close(reason.close_code, reason.description)
        return None

    async def _upgrade(self, sock: WebSocket) -> bool:
        """Read the HTTP upgrade request; accept it on /executor or answer with an HTTP status.

        The request is parsed by an h11 connection of our own, not the one inside wsproto, for
        two reasons: what is refused is decided here, by :func:`upgrade_refusal`, before wsproto
        sees the headers; and bytes the client pipelined after the request (its hello, sent
        without waiting for the ``101``) are kept and handed to the WebSocket once it is open --
        wsproto's server side would drop them.
        """
        parser = h11.Connection(h11.SERVER)
        received = bytearray()  # at most one read past h11's 16 KiB bound on an incomplete head
        while True:
            try:
                data = await sock.stream.receive(_READ_CHUNK)
            except GONE:
                return False
            # Parsing what was read (h11's head scan) is a step of the handshake line; so is
            # wsproto's check of the head and the answer, below: two steps of the upgrade.
            await self.turns.step()
            received += data
            try:
                parser.receive_data(data)
                event = parser.next_event()
            except BROKEN as exc:
                await self._refuse(sock, 400, f"bad upgrade request: {peer_text(exc)}")
                return False
            if isinstance(event, h11.Request):
                break
            if event is not h11.NEED_DATA:
                return False  # (h11 yields nothing else before a request; defensive)
        await self.turns.step()
        pipelined = parser.trailing_data[0]  # everything after the request's head
        head = bytes(received[: len(received) - len(pipelined)])
        why = upgrade_refusal(event, head, max_headers=self.limits.max_upgrade_headers)
        if why is not None:
            await self._refuse(sock, 400, why)
            return False
        ws = sock.ws
        try:
            # wsproto's own checks (Upgrade, Connection, Sec-WebSocket-Key/-Version, Host), on
            # the head as received (initiate_upgrade_connection would build a request from the
            # parsed headers, serialize it and parse it again).
            ws.receive_data(head)
            request = next((e for e in ws.events() if isinstance(e, Request)), None)
        except BROKEN as exc:
            await self._refuse(sock, 400, f"bad upgrade request: {peer_text(exc)}")
            return False
        if request is None:
            await self._refuse(sock, 400, "not a WebSocket upgrade")
            return False
        path = urllib.parse.urlsplit(request.target).path
        if path != EXECUTOR_PATH:
            await self._refuse(sock, 404, f"path {peer_text(path)} is not {EXECUTOR_PATH}")
            return False
        busy = self._occupied() if self._occupied is not None else self._authenticated
        if self.closing or busy >= self._max_authenticated:
            await self._refuse(sock, 503, "draining or full")
            return False
        try:
            await sock._write(ws.send(AcceptConnection()))
            ws.receive_data(pipelined)  # parsed (and counted) by the first receive_message
        except SocketGone:
            return False
        sock.last_inbound = anyio.current_time()
        return True

    async def _refuse(self, sock: WebSocket, status: int, why: str) -> None:
        """Answer an HTTP status with a one-line reason, then drop the connection.

        The response is written by hand: the request may have been too broken for any HTTP
        library to answer it in protocol.
        """
        why = one_line(why)
        self._stats.upgrades_refused[status] = self._stats.upgrades_refused.get(status, 0) + 1
        self.peer_log.log(
            peer_host(sock.peer),
            f"HTTP {status}",
            "%s %s: upgrade refused with HTTP %d: %s",
            self._tag,
            sock.peer,
            status,
            why,
            extra=log_fields(peer=sock.peer),
        )
        body = f"{status} {why}\n".encode()
        data = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: text/plain\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode() + body
        with anyio.move_on_after(self.limits.close_timeout):
            try:
                await sock._write(data)
            except SocketGone:
                pass
        await sock.abort()
