"""WebSocket sockets: upgrade, framing, frame budgets, listen and dial (docs/design.md#link).

Why one module of about 1,000 lines: the server's HTTP upgrade (h11), the client's, and the
framing and budgets of an open socket are the three halves of one wsproto connection object's life
and share its error mapping (one place where h11, wsproto, ssl and OS errors become ours).

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
   one is evicted, so a slowloris flood cannot starve a legitimate peer. Upgrade plus the
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
Exceptions of wsproto, h11, ssl and the OS never leave this module: they are classified in one
place -- :data:`GONE` (the socket is gone) and :data:`BROKEN` (the peer's bytes broke HTTP or
WebSocket framing) -- and surface as :class:`SocketGone` (an ``anyio.BrokenResourceError``, what
the transport expects from a dead socket), ``MalformedFrame``/``FrameTooLarge`` or ``LinkError``.
Any *other* exception raised while serving one peer is handed to the listener's ``on_error``
callback: that peer's failure, never the listener's. Log records carry causes as text, never
exception objects.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import http
import logging
import math
import os
import re
import socket
import ssl
import urllib.parse
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import anyio.abc
import h11
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSStream
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from ..core.wire import PEER_RETIRED_CODES, CloseCode
from ..errors import (
    FrameTooLarge,
    HandshakeFailure,
    LinkError,
    MalformedFrame,
    Unreachable,
    WrongScheme,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_host, peer_text
from . import _asyncio_stream
from ._frames import FastFrames
from .addresses import EXECUTOR_PATH, DialTarget

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
    "describe_close",
    "one_line",
    "unauthenticated_log",
    "upgrade_refusal",
]

log = logging.getLogger("garcon_link.ws")  # the name users configure (README)

_READ_CHUNK = 65536

_SPEAKS_TLS = "answered with TLS, not plain text (a wss:// server); dial wss://"
_TLS_BODY = b"426 this address speaks TLS: dial wss://\n"
_TLS_REQUIRED = (
    b"HTTP/1.1 426 Upgrade Required\r\nupgrade: TLS/1.2, HTTP/1.1\r\nconnection: close\r\n"
    b"content-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(_TLS_BODY), _TLS_BODY)
)
"""What a TLS listener answers, in plain text, to a plain-text HTTP request (RFC 2817's 426)."""


def _asks_for_tls(headers: Any) -> bool:
    return any(k.lower() == b"upgrade" and b"tls/" in v.lower() for k, v in headers)


_THROTTLE_QUANTUM = 0.01
"""A socket over its frame budget is read again once it earned this many seconds of frames (so its
reader wakes at most ~100 times a second, each time for a bounded batch)."""
_REASON_CHARS = 200
"""Longest reason (log line, refusal body) built from a library's message about peer bytes."""

# The one classification of lower-library exceptions (STYLE 16), used by every receive and send:
# the byte stream or the WebSocket is gone (anyio's and the OS's errors -- ssl.SSLError is an
# OSError -- and wsproto's refusal to send or receive on a closed connection) ...
GONE: tuple[type[Exception], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.BusyResourceError,
    OSError,
    LocalProtocolError,
)
# ... or the peer's bytes broke HTTP or WebSocket framing (wsproto wraps h11's errors; UnicodeError:
# wsproto decodes the Host header as IDNA and lets a bad one escape).
BROKEN: tuple[type[Exception], ...] = (RemoteProtocolError, h11.ProtocolError, UnicodeError)

# obs-fold (RFC 9112 §5.2): a header line that starts with a space or a tab continues the previous
# one. h11 accepts and unfolds it; we refuse it, as a request smuggling vector.
_OBS_FOLD = re.compile(rb"\n[ \t]")


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
    """How many handshake steps a listener runs per event-loop turn, beside the turn's other work.

    A step is the work between two reads of an unauthenticated socket: answering its upgrade
    request, answering its hello, checking its proof and admitting it (a resume's decision
    included). Each step waits in line (:meth:`step`); once per turn the first ``per_turn``
    waiters are let through, and they run in the next turn, together with whatever else is ready
    then (authenticated sockets' reads, calls completing): a storm of reconnecting sockets
    delays established sessions by at most ``per_turn`` steps' work per turn, not by the whole
    storm's. The waiters are the listener's unauthenticated sockets, one step each, so
    ``Limits.max_unauthenticated_sockets`` bounds the line (past it the oldest unauthenticated
    socket is evicted, and leaves its place).

    A step never waits longer than ``max_wait`` seconds: once the first in line has waited that
    long, every step that has is let through at the next turn. In a process starved of CPU the
    turns grow long, and ``per_turn`` steps a turn would otherwise let handshakes outlast their
    deadline (the dialers would give up and redial, and the storm would last longer); the
    listener passes ``handshake_timeout / 10``.

    On asyncio only; elsewhere :meth:`step` returns at once.
    """

    def __init__(self, per_turn: int, stats: LinkStatistics, max_wait: float = math.inf) -> None:
        self._per_turn = per_turn
        self._max_wait = max_wait
        self._stats = stats
        # (the loop time it was asked at, its future), oldest first
        self._waiters: collections.deque[tuple[float, asyncio.Future[None]]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None  # a _next_turn is scheduled on it

    async def step(self) -> None:
        """Return when this step may run (a later turn). Cancellable while waiting: the place
        in line is given up."""
        if not _asyncio_stream.on_asyncio():
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append((loop.time(), waiter))
        if len(self._waiters) > self._per_turn:
            self._stats.handshake_steps_deferred += 1
        self._stats.handshake_steps_waiting = len(self._waiters)
        if self._loop is None:
            self._loop = loop
            loop.call_soon(self._next_turn)
        try:
            await waiter
        finally:
            if not waiter.done():  # cancelled while waiting: _next_turn skips it
                waiter.cancel()

    def _next_turn(self) -> None:
        """Once per turn while steps wait: let the first ``per_turn`` through (they run in the
        next turn)."""
        loop, self._loop = self._loop, None
        waiters, granted = self._waiters, 0
        overdue = loop.time() - self._max_wait if loop is not None else -math.inf
        while waiters and (granted < self._per_turn or waiters[0][0] <= overdue):
            _, waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                granted += 1
        self._stats.handshake_steps_waiting = len(waiters)
        if waiters and loop is not None:
            self._loop = loop
            loop.call_soon(self._next_turn)


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


class SocketGone(anyio.BrokenResourceError):
    """The socket is closed or broken (not a protocol violation).

    A :class:`anyio.BrokenResourceError`, which is what the transport's ``MessageSocket``
    contract says a write to a dead socket raises: the transport then ends the attachment.
    """


class _TooFragmented(FrameTooLarge):
    """Internal: a message spans more frames than ``Limits.max_message_fragments`` (1009, like a
    message over the size limit: both bound what assembling one message may cost)."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit, limit)

    def __str__(self) -> str:
        return f"message spans more than {self.limit} frames"


@dataclass
class LinkStatistics:
    """Counters of one link (a snapshot copy is returned by :meth:`WebSocketLink.statistics`)."""

    connections: int = 0
    upgrades_refused: dict[int, int] = field(default_factory=dict)
    handshakes_completed: int = 0
    handshakes_failed: dict[str, int] = field(default_factory=dict)
    evicted_unauthenticated: int = 0
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
    did not resolve, or the server spoke the other scheme (TLS to a ``ws://`` dial, plain text
    to a ``wss://`` one) (:class:`~garcon_link.errors.Unreachable`)."""
    handshake_steps_deferred: int = 0
    """Handshake steps (an upgrade request, a hello, a proof) a listener put off by a turn or
    more because ``handshake_steps_per_turn`` others were ahead."""
    handshake_steps_waiting: int = field(default=0, metadata={"metric": "gauge"})
    """Handshake steps waiting in line now (at most one per unauthenticated socket)."""
    dials_refused_in_a_row: int = field(default=0, metadata={"metric": "gauge"})
    """Such dials since the last one that connected to a server of its scheme (0 once one
    does): how long nothing has listened at the dialed address, in attempts."""

    def count_handshake_failure(self, reason: HandshakeFailure) -> None:
        self.handshakes_failed[reason.name] = self.handshakes_failed.get(reason.name, 0) + 1


class WebSocket:
    """One WebSocket over one byte stream: the link's single send path and message assembly."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        ws: WSConnection,
        *,
        peer: str,
        limits: Limits,
        stats: LinkStatistics | None = None,
    ) -> None:
        self.stream = stream
        self.ws = ws
        self.peer = peer
        self.limits = limits
        self._stats = stats if stats is not None else LinkStatistics()
        # Handshake bounds until authenticated() lifts them to the session's.
        self.max_message = limits.max_handshake_frame_bytes
        # The clock of the message path: on asyncio the loop's own (anyio.current_time() looks
        # up the backend, and on Python 3.11 each lookup costs a getpid() system call).
        self._clock: Callable[[], float] = (
            asyncio.get_running_loop().time if _asyncio_stream.on_asyncio() else anyio.current_time
        )
        self.last_inbound = self._clock()
        self._budget = FrameBudget.full(0.0, limits.max_handshake_frames, self.last_inbound)
        self._fragments = 0  # frames of the message being assembled
        self.reading = False  # a receive_message() is in progress (see there)
        self.peer_close: tuple[int, str] | None = None
        self.local_close: tuple[int, str] | None = None
        # fast_acquire: an uncontended acquire does not yield to the event loop (the common case:
        # only the writer sends; pongs and pings rarely contend), saving two loop iterations per
        # message.
        self._lock = anyio.Lock(fast_acquire=True)
        # A stream that takes bytes synchronously (send_message_nowait), else None.
        self._nowait: _asyncio_stream.AsyncioByteStream | None = (
            stream if isinstance(stream, _asyncio_stream.AsyncioByteStream) else None
        )
        self._parts: list[bytes] = []
        self._size = 0
        self._probe: anyio.Event | None = None
        self.held_proof: bytes | None = None
        self.turns: TurnBudget | None = None
        """The listener's budget of handshake steps per loop turn (None when dialing): the
        handshake asks it before each step."""
        self._closed = False
        # Whole small binary frames without wsproto's per-frame work, once authenticated.
        self._fast: FastFrames | None = None
        # What followed the last whole frame taken from a read by _fast, not yet parsed:
        # (the read, the offset where it begins); it goes before anything read later.
        self._rest: tuple[bytes, int] | None = None
        # take_messages_directly: the consumer, and the task whose receive_message it stands in
        # for.
        self._direct: Callable[[bytes], bool] | None = None
        self._direct_task: asyncio.Task[Any] | None = None

    # -- send path: check state, write under the lock, await drain, map errors

    def authenticated(self) -> None:
        """The peer is admitted: from now on the session's bounds apply (message size, frame
        rate) instead of the handshake's."""
        self.max_message = self.limits.max_frame_bytes
        self._fast = FastFrames.of(self.ws)
        self._budget = FrameBudget.full(
            self.limits.frame_rate, self.limits.frame_burst, self._clock()
        )

    async def _write(self, data: bytes | bytearray) -> None:
        try:
            # A large masked frame is a bytearray, never changed once built; anyio's streams
            # (typed ``bytes``) hand any bytes-like object to the socket or the transport.
            await self.stream.send(cast("bytes", data))
        except GONE as e:
            raise self._gone(e) from e
        self._stats.bytes_sent += len(data)

    def _gone(self, cause: BaseException) -> SocketGone:
        """The socket is dead from now on; the error that says so, naming ``cause``."""
        self._closed = True
        return SocketGone(str(cause) or type(cause).__name__)

    async def _send_event(self, event: Any) -> None:
        async with self._lock:
            if self._closed or self.ws.state is not ConnectionState.OPEN:
                raise SocketGone("socket is closed")
            try:
                data = self.ws.send(event)
            except GONE as exc:
                raise self._gone(exc) from exc
            await self._write(data)

    async def send_message(self, data: bytes) -> None:
        fast = self._fast
        if fast is None:
            await self._send_event(BytesMessage(data=data))
            return
        async with self._lock:
            if self._closed or self.ws.state is not ConnectionState.OPEN:
                raise SocketGone("socket is closed")
            frame = fast.build(data)
            if frame is None:
                try:
                    frame = self.ws.send(BytesMessage(data=data))
                except GONE as exc:
                    raise self._gone(exc) from exc
            await self._write(frame)

    def writable_now(self) -> bool:
        """Whether :meth:`send_message_nowait` can write a message now without waiting (open,
        no write in progress, a stream that takes bytes synchronously and is not paused)."""
        stream = self._nowait
        return (
            stream is not None
            and not self._closed
            and not self._lock.locked()
            and self.ws.state is ConnectionState.OPEN
            and stream.writable_now()
        )

    def send_message_nowait(self, data: bytes) -> None:
        """Write one binary message synchronously; only when :meth:`writable_now`.

        Raises:
            anyio.BrokenResourceError: the socket is dead (as :meth:`send_message`).
        """
        stream = self._nowait
        assert stream is not None and not self._lock.locked()
        try:
            fast = self._fast
            frame = None if fast is None else fast.build(data)
            stream.send_nowait(
                frame if frame is not None else self.ws.send(BytesMessage(data=data))
            )
        except GONE as e:
            raise self._gone(e) from e

    def retired_by_peer(self) -> str | None:
        """Why the peer's close retired the session (a 1001/4005/4006/4008 close), else None."""
        if self.peer_close is not None and self.peer_close[0] in PEER_RETIRED_CODES:
            code, reason = self.peer_close
            return f"peer closed with {code}" + (f" ({reason})" if reason else "")
        return None

    @property
    def busy(self) -> bool:
        """A write is in progress (then a ping would only queue behind it)."""
        return self._lock.locked()

    async def ping(self) -> None:
        await self._send_event(Ping())

    async def probe(self, timeout: float) -> bool:
        """True if any inbound frame arrives within ``timeout`` after a ping.

        Also True while nobody reads the socket (the reader is held up by a slow consumer): a
        pong could not be seen then, so there is no evidence against the peer.
        """
        if not self.reading:
            return True
        event = anyio.Event()
        self._probe = event
        with anyio.move_on_after(timeout):
            try:
                await self.ping()
            except SocketGone:
                return False
            await event.wait()
            return True
        return False

    # -- receive path

    def take_messages_directly(self, take: Callable[[bytes], bool] | None) -> bool:
        """Offer ``take`` each message that arrives whole while the calling task waits in
        :meth:`receive_message` with nothing buffered, in the socket's callback (asyncio only):
        ``take`` runs as the calling task (``asyncio.current_task()`` is that task), and
        returns ``True`` if it took the message (the ``receive_message`` goes on waiting) or
        ``False`` (the message is buffered and that ``receive_message`` returns it). Only a
        single binary frame of a small message, once authenticated and within the frame budget,
        is offered; everything else goes the ``receive_message`` way. ``take`` must not await
        and should not raise. ``None`` stops it. Returns ``False`` (nothing changed) if the
        socket cannot do this (not on an asyncio stream)."""
        stream = self._nowait
        if stream is None:
            return False
        if take is None:
            stream.set_direct(None)
            self._direct = self._direct_task = None
            return True
        self._direct = take
        self._direct_task = asyncio.current_task(stream.loop)
        stream.set_direct(self._message_nowait)
        return True

    def _message_nowait(self, data: bytes) -> bool:
        """The stream's direct consumer: ``data`` as one whole message to ``_direct``."""
        fast = self._fast
        take = self._direct
        task = self._direct_task
        if (
            fast is None
            or take is None
            or task is None
            or not self.reading
            or self._closed
            or self._parts
            or self._rest is not None
            or self._budget.tokens < 0
            or self._probe is not None
        ):
            return False
        payload = fast.parse(data, self.max_message)
        if payload is None:
            return False
        loop = task.get_loop()
        if asyncio.current_task(loop) is not None:
            return False  # (not from a task: a protocol callback only)
        _enter_task(loop, task)
        try:
            taken = take(payload)
        finally:
            _leave_task(loop, task)
        if taken:
            self._stats.bytes_received += len(data)
            now = self.last_inbound = self._clock()
            self._count_frame(now)
            self._fragments = 0
        return taken

    async def receive_message(self) -> bytes | None:
        """The next binary message, or ``None`` once closed.

        Silence (for the heartbeat) is measured only while this runs, from the moment it was
        entered: time the caller spends elsewhere -- held up by a slow consumer -- is not the
        peer's silence (what the peer sent meanwhile is waiting, unread, in our buffers).

        Raises:
            FrameTooLarge: a message grew past ``max_message`` (nothing beyond it was buffered).
            MalformedFrame: a text frame or broken WebSocket framing.
        """
        now = self._clock()
        self.last_inbound = max(self.last_inbound, now)
        self.reading = True
        try:
            return await self._receive_message(now)
        finally:
            self.reading = False

    async def _receive_message(self, now: float) -> bytes | None:
        while True:
            if self._budget.tokens < 0:
                # Over the frame budget (only an authenticated socket gets here: an
                # unauthenticated one is closed by _count_frame): read this peer again once it
                # has earned a batch of frames.
                now = self._clock()
                delay = self._budget.delay(now)
                if delay == math.inf:  # (a caller reading on after that refusal)
                    raise MalformedFrame("the frame allowance is spent")
                self._stats.throttled_reads += 1
                await anyio.sleep(delay)
                now = self._clock()
                # Time we chose not to read is not the peer's silence.
                self.last_inbound = max(self.last_inbound, now)
            # wsproto parses frames lazily, one per event: leaving this loop early (a message,
            # or the budget spent) leaves the rest unparsed in its buffer for the next pass.
            # (When it holds nothing, there is nothing to ask it.)
            fast = self._fast
            events = () if fast is not None and fast.idle() else self.ws.events()
            for event in events:
                if isinstance(event, BytesMessage):
                    size = self._size + len(event.data)
                    if size > self.max_message:
                        self._reset_message()
                        self.local_close = (CloseCode.MESSAGE_TOO_BIG, "message too big")
                        raise FrameTooLarge(size, self.max_message)
                    if event.frame_finished:
                        self._count_frame(now)
                        if not event.message_finished:
                            self._count_fragment()
                    if event.message_finished and not self._parts:
                        self._fragments = 0
                        return bytes(event.data)
                    if event.data:
                        self._parts.append(bytes(event.data))
                        self._size = size
                    if event.message_finished:
                        data = b"".join(self._parts)
                        self._reset_message()
                        return data
                elif isinstance(event, Ping):
                    self._count_frame(now)
                    try:
                        await self._send_event(event.response())
                    except SocketGone:
                        return None
                elif isinstance(event, Pong):
                    self._count_frame(now)
                elif isinstance(event, CloseConnection):
                    if self.ws.state is ConnectionState.OPEN:
                        # wsproto reports broken framing (reserved bits or opcodes, an unmasked
                        # client frame, ...) as a *synthetic* close event without changing
                        # state; a real close from the peer moves it to REMOTE_CLOSING.
                        self.local_close = (event.code, event.reason or "bad WebSocket framing")
                        raise MalformedFrame(f"bad WebSocket framing: {event.reason}")
                    self.peer_close = (event.code, event.reason or "")
                    if self.ws.state is ConnectionState.REMOTE_CLOSING:
                        async with self._lock:
                            try:
                                await self._write(self.ws.send(event.response()))
                            except GONE:
                                pass
                    self._closed = True
                    return None
                elif isinstance(event, TextMessage):
                    self.local_close = (CloseCode.UNSUPPORTED_DATA, "text frames are not allowed")
                    raise MalformedFrame("text frame received; every message must be binary")
                if self._budget.tokens < 0:
                    break  # wait (above) before parsing another frame
            else:
                if self._closed:
                    return None
                rest = self._rest
                if rest is not None:
                    # The frames after the last one taken from an earlier read, first.
                    self._rest = None
                    data, start = rest
                else:
                    # A receive is a checkpoint (anyio's contract, kept by the asyncio stream
                    # too): a peer that keeps our buffers full still lets the other tasks run
                    # between reads.
                    try:
                        data = await self.stream.receive(_READ_CHUNK)
                    except GONE as exc:
                        if not isinstance(exc, anyio.EndOfStream):
                            log.debug(
                                "%s: read failed: %s",
                                self.peer,
                                repr(exc),
                                extra=log_fields(peer=self.peer),
                            )
                        self._closed = True
                        return None
                    start = 0
                    self._stats.bytes_received += len(data)
                    now = self.last_inbound = self._clock()
                    if self._probe is not None:
                        self._probe.set()
                        self._probe = None
                if fast is not None:
                    taken = fast.parse_at(data, start, self.max_message)
                    if taken is not None:
                        payload, end = taken
                        if end < len(data):
                            self._rest = (data, end)
                        self._count_frame(now)
                        self._fragments = 0
                        return payload
                try:
                    self.ws.receive_data(data[start:] if start else data)
                except BROKEN as exc:
                    self.local_close = (CloseCode.PROTOCOL, "bad WebSocket framing")
                    raise MalformedFrame(f"bad WebSocket framing: {exc}") from exc
                except GONE:
                    self._closed = True  # wsproto: the connection is already closed
                    return None

    def _count_frame(self, now: float) -> None:
        """Spend one frame of the budget; before authentication, running out ends the socket.

        Raises:
            MalformedFrame: more than ``max_handshake_frames`` frames before authentication.
        """
        if not self._budget.spend(now) and self._budget.rate <= 0:
            self._stats.handshake_frames_exceeded += 1
            self.local_close = (CloseCode.PROTOCOL_ERROR, "too many frames before authentication")
            raise MalformedFrame(
                f"more than {self.limits.max_handshake_frames} frames before authentication"
            )

    def _count_fragment(self) -> None:
        """One more non-final frame of the message being assembled.

        Raises:
            FrameTooLarge: the message needs more than ``max_message_fragments`` frames (1009);
                refused as soon as that is certain, before its final frame.
        """
        self._fragments += 1
        limit = self.limits.max_message_fragments
        if self._fragments >= limit:
            self._reset_message()
            self.local_close = (CloseCode.MESSAGE_TOO_BIG, f"message of over {limit} fragments")
            raise _TooFragmented(limit)

    def _reset_message(self) -> None:
        self._parts.clear()
        self._size = 0
        self._fragments = 0

    async def close(self, code: int, reason: str, *, drain: bool = True) -> None:
        """Send a close frame, wait briefly for the peer's answer, close the byte stream.

        Everything is bounded by ``close_timeout``. Waiting for the peer's close frame (or EOF)
        keeps our close frame from being lost to a TCP reset when the peer is still writing, so
        the peer learns the real cause. ``drain=False`` skips the wait: for callers that may race
        a reader on this socket, and after a heartbeat timeout (the peer is presumed gone).
        """
        sent = False
        with anyio.move_on_after(self.limits.close_timeout, shield=True):
            async with self._lock:
                if not self._closed and self.ws.state is ConnectionState.OPEN:
                    try:
                        await self._write(self.ws.send(CloseConnection(code=code, reason=reason)))
                        sent = True
                    except GONE:
                        pass
            if sent and drain and code != CloseCode.HEARTBEAT_TIMEOUT:
                await self._await_peer_close()
        self._closed = True
        await close_stream(self.stream)

    async def _await_peer_close(self) -> None:
        """Read (and discard) until the peer's close frame or EOF; the caller bounds the time.

        Discarded frames still spend the frame budget. Once it has run out (a peer that floods
        instead of closing) the bytes are no longer parsed, only read and dropped: not reading
        them would make our close turn into a TCP reset, which can destroy the close frame
        before the peer reads it, and the peer would never learn why.
        """
        parsing = True
        rest = self._rest
        self._rest = None
        while self.ws.state is not ConnectionState.CLOSED:
            try:
                if rest is not None:  # what a read left unparsed comes first
                    data = rest[0][rest[1] :]
                    rest = None
                else:
                    data = await self.stream.receive(_READ_CHUNK)
                if not parsing:
                    continue
                self.ws.receive_data(data)
                now = self._clock()
                for _event in self.ws.events():
                    if not self._budget.spend(now):
                        parsing = False
                        break
            except (*GONE, *BROKEN):
                return

    async def abort(self) -> None:
        self._closed = True
        await close_stream(self.stream)


def close_code(sock: WebSocket) -> int | None:
    """The close code :func:`describe_close` reports (ours first), or None for a lost connection."""
    if sock.local_close:
        return int(sock.local_close[0])
    if sock.peer_close:
        return int(sock.peer_close[0])
    return None


def describe_close(sock: WebSocket) -> str:
    if sock.local_close:
        return f"closed by us code={int(sock.local_close[0])} cause={sock.local_close[1]!r}"
    if sock.peer_close:
        return f"closed by peer code={sock.peer_close[0]} cause={sock.peer_close[1]!r}"
    return "connection lost"


# ---------------------------------------------------------------------------------- dialing


async def close_stream(stream: anyio.abc.ByteStream) -> None:
    """Close ``stream`` at once (unsent bytes dropped) and never wait: asyncio's stream is
    aborted in place, any other goes through ``anyio.aclose_forcefully`` (a TLS stream's close
    would otherwise wait for the peer). Every socket a resume replaces ends here, so the
    asyncio path costs no cancel scope and no checkpoint."""
    if isinstance(stream, _asyncio_stream.AsyncioByteStream):
        stream.abort()
    else:
        await anyio.aclose_forcefully(stream)


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
        LinkError: TLS failed, the connection was lost, the upgrade was refused or the response
            was not a valid upgrade.
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
        while True:
            data = await stream.receive(_READ_CHUNK)
            if ssl_context is None and data[:1] in (b"\x15", b"\x16") and data[1:2] == b"\x03":
                raise WrongScheme(f"{target.url}: {peer} {_SPEAKS_TLS}")  # a TLS record
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
                        raise LinkError(f"{peer} refused the upgrade: HTTP {event.status_code}")
            except BROKEN as exc:
                raise LinkError(f"bad upgrade response from {peer}: {peer_text(exc)}") from exc
    except ssl.SSLError as exc:
        if exc.reason == "WRONG_VERSION_NUMBER":  # where a TLS record was due
            raise WrongScheme(
                f"{target.url}: {peer} answered in plain text, not TLS (a ws:// server?); "
                "dial ws:// or its TLS port"
            ) from exc
        raise LinkError(f"TLS handshake with {peer} failed: {exc.reason or exc}") from exc
    except GONE as exc:
        raise LinkError(f"connection to {peer} lost during upgrade: {exc}") from exc


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
) -> None:
    """``listener.serve`` (trio), except that a failed ``accept`` (out of file descriptors)
    pauses and retries, reported rate-limited, instead of ending the listener (as
    :func:`garcon_link.net._asyncio_stream.serve_accepted` does on asyncio)."""
    subs: list[anyio.abc.SocketListener] = getattr(listener, "listeners", None) or [listener]

    async def accept_loop(sub: anyio.abc.SocketListener) -> None:
        failures = _asyncio_stream.AcceptFailures(str(sub.extra(SocketAttribute.local_address)))
        while True:
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

    Owns the unauthenticated-socket cap (oldest evicted), the handshake deadline around upgrade
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
        self._unauthenticated: dict[int, anyio.CancelScope] = {}
        self.turns = TurnBudget(
            limits.handshake_steps_per_turn, stats, max_wait=limits.handshake_timeout / 10
        )
        """The budget of handshake steps per event-loop turn (see :class:`TurnBudget`)."""
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

        async def handle(stream: anyio.abc.ByteStream) -> None:
            await self._handle(stream, authenticate)

        async with listener:
            if _asyncio_stream.on_asyncio():
                await _asyncio_stream.serve_accepted(listener, handle, tg)
            else:
                await _serve_anyio(listener, handle, tg)

    async def _handle(self, stream: anyio.abc.ByteStream, authenticate: Authenticate) -> None:
        self._stats.connections += 1
        try:
            remote = stream.extra(SocketAttribute.remote_address)
            peer = f"{remote[0]}:{remote[1]}" if isinstance(remote, tuple) else str(remote)
        except Exception:
            peer = "?"
        key = id(stream)
        try:
            with anyio.CancelScope() as scope:
                self._unauthenticated[key] = scope
                if len(self._unauthenticated) > self.limits.max_unauthenticated_sockets:
                    oldest = next(iter(self._unauthenticated))
                    self._stats.evicted_unauthenticated += 1
                    self.peer_log.log(
                        peer_host(peer),
                        "evicted",
                        "%s %s: evicting the oldest unauthenticated socket",
                        self._tag,
                        peer,
                        extra=log_fields(peer=peer),
                    )
                    self._unauthenticated.pop(oldest).cancel()
                try:
                    admitted = await self._accept(stream, peer, authenticate)
                finally:
                    self._unauthenticated.pop(key, None)
            if scope.cancelled_caught or admitted is None:
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
