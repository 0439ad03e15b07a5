"""WebSocketLink: authenticated WebSocket sockets for one endpoint (DESIGN §3, §6).

Theory of operation
-------------------
A link is one endpoint of one *logical session at a time*: a worker's listener, or a controller's
dialer (either role may do either). It turns TCP (optionally TLS) connections into authenticated
sockets and hands each to the current :class:`~garcon_link.transport.SessionTransport`:

1. **Upgrade.** The listener parses the HTTP/1.1 upgrade request with an h11 connection of its
   own and refuses (``400``, with a one-line reason) anything but a plain ``GET`` upgrade in
   origin-form over HTTP/1.1: a request body (``Content-Length`` other than 0, any
   ``Transfer-Encoding``), obs-fold header lines, or more than ``max_upgrade_headers`` header
   fields (:func:`upgrade_refusal`, a pure function); wsproto then checks the WebSocket headers
   (``400``). It answers ``404`` for any path but ``/executor`` and ``503`` while draining or when
   ``max_authenticated_sockets`` are busy. Bytes pipelined after the request (a hello sent without
   waiting for the ``101``) are kept and fed to the WebSocket; on the dialing side wsproto keeps
   frames that came with the ``101``. No extension (no permessage-deflate) is ever negotiated.
   Unauthenticated sockets are capped separately (``max_unauthenticated_sockets``): past the cap
   the oldest one is evicted, so a slowloris flood cannot starve a legitimate peer.
2. **Handshake.** Both sides send ``hello`` at once (:mod:`garcon_link.handshake`). The dialer
   sends its ``proof`` as soon as it has the listener's hello; the *accepting* side verifies that
   proof and sends its own only once it has admitted the peer (step 3). A peer refused by the
   takeover rule therefore never completes a handshake -- it creates no session on its retries --
   and a listener never hands out a proof that could be reflected. Upgrade plus handshake must
   finish within ``handshake_timeout`` (else 4008); handshake frames are capped at
   ``max_handshake_frame_bytes`` before buffering, and an unauthenticated socket may send at most
   ``max_handshake_frames`` frames of any kind (data, ping, pong): the next one closes it with
   4008 at once. A refusal closes with the reason's close code.
3. **Resume or fresh.** Resume iff runtimes cross-match and session ids match; the peer's
   ``received`` positions the replay. Otherwise the current session is retired (``REPLACED``) and a
   fresh transport is created; session listeners run before its first packet is processed.
   *Takeover rule*: a fresh handshake from another runtime while a socket is attached is refused
   (4004) unless that socket fails a ping probe within ``takeover_probe_timeout``.
4. **Attached.** The transport pumps the socket; a heartbeat task pings every
   ``heartbeat_interval`` and closes the socket (resumably, 4007) after ``heartbeat_timeout`` with
   no inbound frame of any kind *while the socket is being read*: time the reader is held up by a
   slow consumer is back-pressure, not the peer's silence (nor evidence for a takeover probe).
   Messages are capped at ``max_frame_bytes`` and ``max_message_fragments`` frames while they are
   assembled (1009). A text frame is a protocol error (1003; the session is retired). Write
   back-pressure awaits the socket's drain and is never a continuity failure. A close from the
   peer with 1001 (shutdown), 4005, 4006 or 4008 means the peer retired the session: it is
   retired here at once, not after the grace.
5. **Dialing.** One dial loop per link: connect (``connect_timeout``), upgrade, handshake, run;
   between attempts the delay comes from :func:`backoff` -- first retry immediate, then full-jitter
   exponential capped at ``backoff_max``, reset after a socket stayed up ``backoff_reset_after``.

Sharing the event loop with hostile peers
-----------------------------------------
A frame can cost far more to parse than it costs to send (an empty continuation frame is 6
bytes), so frames, not only bytes, are budgeted, per socket (:class:`FrameBudget`): before
authentication a fixed allowance (``max_handshake_frames``, no refill), after it a token bucket
(``frame_rate`` per second, ``frame_burst`` at once) that *throttles* -- the socket is read again
once it has earned a batch -- and never closes an authenticated peer. ``max_handshake_frames``
must be below ``frame_burst``: an unauthenticated socket always gets the smaller share. Every
read is a checkpoint (anyio's contract, kept by :mod:`garcon_link._asyncio_stream`), so between
two reads of one socket every other task runs; wsproto parses lazily, so frames left unparsed
when a message completes or the budget runs out cost nothing until the next pass. A socket we
close is drained for its close frame while its budget lasts, then only read and dropped (so the
close frame is not lost to a TCP reset) until ``close_timeout``.

Failures
--------
Every closed socket is logged with its cause. Exceptions of wsproto, h11, ssl and the OS never
leave this module: they end the socket they belong to and are logged; they are classified in one
place (``_GONE``: the socket is gone; ``_BROKEN``: the peer's bytes broke HTTP or WebSocket
framing). Any *other* exception raised while serving one peer -- a bug, here or below, that the
peer's bytes reached -- is that peer's failure, never the process's (``_peer_failed``): the
socket is closed (4008 while it can still say so; the session it carried is retired), the
traceback is logged and counted (``unexpected_errors``), and the listener keeps listening and the
dial loop keeps dialing. Cancellation is not an ``Exception`` and passes. Other log records carry
causes as text, never exception objects: a handler that keeps records (a test's capture, a memory
handler) would otherwise keep every refused socket's frames and buffers alive with them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http
import logging
import math
import os
import random
import re
import ssl
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

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

from . import _asyncio_stream
from .config import is_loopback_host
from .errors import (
    ConfigError,
    FailureReason,
    FrameTooLarge,
    HandshakeError,
    HandshakeFailure,
    LinkError,
    MalformedFrame,
    SessionFailed,
)
from .handshake import Handshake, HandshakeResult, ResumeOffer, derive_key
from .limits import Limits
from .transport import SessionTransport, TransportState
from .wire import CloseCode, Role

__all__ = [
    "EXECUTOR_PATH",
    "FrameBudget",
    "LinkStatistics",
    "WebSocketLink",
    "backoff",
    "is_loopback_host",
    "upgrade_refusal",
]

log = logging.getLogger(__name__)

EXECUTOR_PATH = "/executor"
_READ_CHUNK = 65536
_THROTTLE_QUANTUM = 0.01
"""A socket over its frame budget is read again once it earned this many seconds of frames (so its
reader wakes at most ~100 times a second, each time for a bounded batch)."""
_REASON_CHARS = 200
"""Longest reason (log line, refusal body) built from a library's message about peer bytes."""

# The one classification of lower-library exceptions (STYLE 16), used by every receive and send:
# the byte stream or the WebSocket is gone (anyio's and the OS's errors -- ssl.SSLError is an
# OSError -- and wsproto's refusal to send or receive on a closed connection) ...
_GONE: tuple[type[Exception], ...] = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.BusyResourceError,
    OSError,
    LocalProtocolError,
)
# ... or the peer's bytes broke HTTP or WebSocket framing (wsproto wraps h11's errors; UnicodeError:
# wsproto decodes the Host header as IDNA and lets a bad one escape).
_BROKEN: tuple[type[Exception], ...] = (RemoteProtocolError, h11.ProtocolError, UnicodeError)

# obs-fold (RFC 9112 §5.2): a header line that starts with a space or a tab continues the previous
# one. h11 accepts and unfolds it; we refuse it, as a request smuggling vector.
_OBS_FOLD = re.compile(rb"\n[ \t]")
_UNEXPECTED = "unexpected error"
"""The close reason a peer gets for a socket ended by an unexpected error (details are logged)."""

# Close codes a peer sends when *it* has retired the logical session: no resume is possible.
# 1001 is a deliberate shutdown (``aclose``), which retires the session on that side too, so
# waiting out the detached grace would only delay honest outcomes.
_PEER_RETIRED_CODES = {
    int(CloseCode.GOING_AWAY),
    int(CloseCode.SESSION_RETIRED),
    int(CloseCode.REPLAY_STALLED),
    int(CloseCode.PROTOCOL_ERROR),
}


def backoff(limits: Limits, rng: random.Random | None = None) -> Iterator[float]:
    """Dial retry delays: ``0`` first, then full-jitter exponential, capped.

    The n-th non-immediate delay is uniform in ``[0, min(backoff_max, backoff_base * 2**n))``
    (AWS "full jitter"). Infinite; the caller starts a new generator to reset it.

    Args:
        limits: supplies ``backoff_base`` and ``backoff_max``.
        rng: source of jitter (inject a seeded one in tests).
    """
    rng = rng or random.Random()
    yield 0.0
    ceiling = limits.backoff_base
    while True:
        yield rng.uniform(0.0, ceiling)
        ceiling = min(limits.backoff_max, ceiling * 2)


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


def _one_line(text: str) -> str:
    """``text`` on one line, at most :data:`_REASON_CHARS` characters (for logs and replies)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _REASON_CHARS else flat[: _REASON_CHARS - 3] + "..."


class _SocketGone(anyio.BrokenResourceError):
    """Internal: the socket is closed or broken (not a protocol violation).

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


class _WebSocket:
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
        self._closed = False

    # -- send path: check state, write under the lock, await drain, map errors

    def authenticated(self) -> None:
        """The peer is admitted: from now on the session's bounds apply (message size, frame
        rate) instead of the handshake's."""
        self.max_message = self.limits.max_frame_bytes
        self._budget = FrameBudget.full(
            self.limits.frame_rate, self.limits.frame_burst, self._clock()
        )

    async def _write(self, data: bytes) -> None:
        try:
            await self.stream.send(data)
        except _GONE as e:
            raise self._gone(e) from e

    def _gone(self, cause: BaseException) -> _SocketGone:
        """The socket is dead from now on; the error that says so, naming ``cause``."""
        self._closed = True
        return _SocketGone(str(cause) or type(cause).__name__)

    async def _send_event(self, event: Any) -> None:
        async with self._lock:
            if self._closed or self.ws.state is not ConnectionState.OPEN:
                raise _SocketGone("socket is closed")
            try:
                data = self.ws.send(event)
            except _GONE as exc:
                raise self._gone(exc) from exc
            await self._write(data)

    async def send_message(self, data: bytes) -> None:
        await self._send_event(BytesMessage(data=data))

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
            stream.send_nowait(self.ws.send(BytesMessage(data=data)))
        except _GONE as e:
            raise self._gone(e) from e

    def retired_by_peer(self) -> str | None:
        """Why the peer's close retired the session (a 1001/4005/4006/4008 close), else None."""
        if self.peer_close is not None and self.peer_close[0] in _PEER_RETIRED_CODES:
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
            except _SocketGone:
                return False
            await event.wait()
            return True
        return False

    # -- receive path

    async def receive_message(self) -> bytes | None:
        """The next binary message, or ``None`` once closed.

        Silence (for the heartbeat) is measured only while this runs, from the moment it was
        entered: time the caller spends elsewhere -- held up by a slow consumer -- is not the
        peer's silence (what the peer sent meanwhile is waiting, unread, in our buffers).

        Raises:
            FrameTooLarge: a message grew past ``max_message`` (nothing beyond it was buffered).
            MalformedFrame: a text frame or broken WebSocket framing.
        """
        self.last_inbound = max(self.last_inbound, self._clock())
        self.reading = True
        try:
            return await self._receive_message()
        finally:
            self.reading = False

    async def _receive_message(self) -> bytes | None:
        now = self._clock()
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
            for event in self.ws.events():
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
                    except _SocketGone:
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
                            except _GONE:
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
                # A receive is a checkpoint (anyio's contract, kept by the asyncio stream too): a
                # peer that keeps our buffers full still lets the other tasks run between reads.
                try:
                    data = await self.stream.receive(_READ_CHUNK)
                except _GONE as exc:
                    if not isinstance(exc, anyio.EndOfStream):
                        log.debug("%s: read failed: %s", self.peer, repr(exc))
                    self._closed = True
                    return None
                now = self.last_inbound = self._clock()
                if self._probe is not None:
                    self._probe.set()
                    self._probe = None
                try:
                    self.ws.receive_data(data)
                except _BROKEN as exc:
                    self.local_close = (CloseCode.PROTOCOL, "bad WebSocket framing")
                    raise MalformedFrame(f"bad WebSocket framing: {exc}") from exc
                except _GONE:
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
                    except _GONE:
                        pass
            if sent and drain and code != CloseCode.HEARTBEAT_TIMEOUT:
                await self._await_peer_close()
        self._closed = True
        await anyio.aclose_forcefully(self.stream)

    async def _await_peer_close(self) -> None:
        """Read (and discard) until the peer's close frame or EOF; the caller bounds the time.

        Discarded frames still spend the frame budget. Once it has run out (a peer that floods
        instead of closing) the bytes are no longer parsed, only read and dropped: not reading
        them would make our close turn into a TCP reset, which can destroy the close frame
        before the peer reads it, and the peer would never learn why.
        """
        parsing = True
        while self.ws.state is not ConnectionState.CLOSED:
            try:
                data = await self.stream.receive(_READ_CHUNK)
                if not parsing:
                    continue
                self.ws.receive_data(data)
                now = self._clock()
                for _event in self.ws.events():
                    if not self._budget.spend(now):
                        parsing = False
                        break
            except (*_GONE, *_BROKEN):
                return

    async def abort(self) -> None:
        self._closed = True
        await anyio.aclose_forcefully(self.stream)


def _describe_close(sock: _WebSocket) -> str:
    if sock.local_close:
        return f"closed by us code={int(sock.local_close[0])} cause={sock.local_close[1]!r}"
    if sock.peer_close:
        return f"closed by peer code={sock.peer_close[0]} cause={sock.peer_close[1]!r}"
    return "connection lost"


SessionListener = Callable[[SessionTransport, HandshakeResult], None]


class WebSocketLink:
    """One endpoint: a listener on ``/executor`` or a dialer, carrying one logical session.

    Use as an async context manager; the link runs its listener or dial loop in the background
    until :meth:`aclose` (idempotent).

    Args:
        role: this endpoint's role.
        executor_id: the worker's configured name (both sides must agree).
        secret: the shared secret (>= 32 bytes); only a derived key is kept.
        limits: bounds.
        listen: ``(host, port)`` to listen on (port 0 picks a free port), or
        dial: ``ws://host:port/executor`` or ``wss://...`` to dial.
        ssl_context: server context (listen) or client context (dial, ``wss://`` only).
        allow_insecure_development: permit plain text off loopback.
    """

    def __init__(
        self,
        *,
        role: Role,
        executor_id: str,
        secret: bytes,
        limits: Limits | None = None,
        listen: tuple[str, int] | None = None,
        dial: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        allow_insecure_development: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        if (listen is None) == (dial is None):
            raise ConfigError("a link needs exactly one of listen=(host, port) or dial=URL")
        self.role = Role(role)
        self.executor_id = executor_id
        self.limits = limits or Limits()
        try:
            self._key = derive_key(secret)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.runtime_id = os.urandom(16)
        self._rng = rng or random.Random()
        self._listen = listen
        self._dial = _parse_dial_url(dial) if dial is not None else None
        self._ssl = ssl_context
        if self._dial is not None:
            scheme, host, _port = self._dial
            if scheme == "wss" and self._ssl is None:
                self._ssl = ssl.create_default_context()
            if scheme == "ws":
                self._ssl = None
            insecure = scheme == "ws"
        else:
            assert listen is not None
            host = listen[0]
            insecure = ssl_context is None
        if insecure and not is_loopback_host(host) and not allow_insecure_development:
            raise ConfigError(
                f"plain-text ws:// to or on non-loopback address {host!r} is refused; use TLS "
                "(wss://, or a TLS terminator) or set allow_insecure_development"
            )
        self._tg: anyio.abc.TaskGroup | None = None
        self._transport: SessionTransport | None = None
        self._attached: _WebSocket | None = None
        self._attach_lock = anyio.Lock()
        self._listeners: list[SessionListener] = []
        self._unauthenticated: dict[int, anyio.CancelScope] = {}
        self._authenticated = 0
        self._closing = False
        self._closed = anyio.Event()
        self._listen_address: tuple[str, int] | None = None
        self._stats = LinkStatistics()
        self.last_error: str | None = None
        self._tag = f"{self.role.value}[{self.runtime_id.hex()[:6]}]"

    # ------------------------------------------------------------------ public surface

    @property
    def transport(self) -> SessionTransport | None:
        """The current logical session (``None`` before the first handshake or after retire)."""
        t = self._transport
        return t if t is not None and t.state is not TransportState.RETIRED else None

    @property
    def listen_address(self) -> tuple[str, int]:
        if self._listen_address is None:
            raise RuntimeError("the link is not listening")
        return self._listen_address

    @property
    def url(self) -> str:
        """The URL a peer dials (listener) or that this link dials."""
        if self._dial is not None:
            scheme, host, port = self._dial
        else:
            scheme = "ws" if self._ssl is None else "wss"
            host, port = self.listen_address
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{port}{EXECUTOR_PATH}"

    def on_session(self, listener: SessionListener) -> Callable[[], None]:
        """Call ``listener(transport, handshake_result)`` for each new logical session.

        Runs synchronously before the session's first packet is processed, so a consumer can be
        installed with nothing missed. Returns an unsubscribe callable.
        """
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def statistics(self) -> LinkStatistics:
        s = self._stats
        return dataclasses.replace(
            s,
            upgrades_refused=dict(s.upgrades_refused),
            handshakes_failed=dict(s.handshakes_failed),
        )

    async def __aenter__(self) -> WebSocketLink:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            if self._listen is not None:
                await tg.start(self._serve)
            else:
                tg.start_soon(self._dial_loop)
        except BaseException:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            await self._tg.__aexit__(None, None, None)

    async def disconnect(self) -> None:
        """Drop the attached socket abruptly (as a network loss would); keep the session."""
        sock = self._attached
        if sock is not None:
            sock.local_close = (0, "disconnect() requested")
            await sock.abort()

    async def aclose(self) -> None:
        """Retire the session, stop listening or dialing, close every socket (idempotent).

        The peer is told with close code 1001, so it retires the session at once instead of
        waiting out its detached grace.
        """
        await self._shutdown(graceful=True)

    async def abort(self) -> None:
        """Stop as a killed process would: sockets dropped without a close frame (idempotent).

        The peer sees a lost connection, waits (``reconnecting``) and retires the session when
        its grace expires. Meant for tests and demonstrations of crash behaviour.
        """
        await self._shutdown(graceful=False)

    async def _shutdown(self, *, graceful: bool) -> None:
        if self._closing:
            return
        self._closing = True
        sock = self._attached
        if sock is not None and not graceful:
            sock.local_close = (0, "abort() requested")
            await sock.abort()
        transport = self._transport
        if transport is not None:
            transport.retire(FailureReason.CLOSED, "link closed")
        if sock is not None and graceful:
            # drain=False: the socket's reader may still be running.
            await sock.close(CloseCode.GOING_AWAY, "shutting down", drain=False)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        self._closed.set()

    # ------------------------------------------------------------------ listener

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        assert self._listen is not None and self._tg is not None
        host, port = self._listen
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            raise LinkError(f"cannot listen on {host}:{port}: {exc}") from exc
        address = listener.extra(SocketAttribute.local_address)
        self._listen_address = (str(address[0]), int(address[1]))
        log.info("%s listening on %s", self._tag, self.url)
        task_status.started()
        async with listener:
            if _asyncio_stream.on_asyncio():
                await _asyncio_stream.serve_accepted(listener, self._handle_incoming, self._tg)
            else:
                await listener.serve(self._handle_incoming, task_group=self._tg)

    async def _handle_incoming(self, stream: anyio.abc.ByteStream) -> None:
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
                    log.info("%s ✕ %s evicting oldest unauthenticated socket", self._tag, peer)
                    self._unauthenticated.pop(oldest).cancel()
                try:
                    result = await self._accept(stream, peer)
                finally:
                    self._unauthenticated.pop(key, None)
            if scope.cancelled_caught or result is None:
                return
            sock, handshake = result
            self._authenticated += 1
            try:
                await self._attach_and_run(sock, handshake)
            finally:
                self._authenticated -= 1
        except Exception as exc:
            self._peer_failed(peer, exc)  # never the listener's failure
        finally:
            # Every exit, shutdown (cancellation) included, closes the socket: a dropped stream
            # would stay open until garbage collection and the peer would hang.
            await anyio.aclose_forcefully(stream)

    async def _accept(
        self, stream: anyio.abc.ByteStream, peer: str
    ) -> tuple[_WebSocket, HandshakeResult] | None:
        byte_stream: anyio.abc.ByteStream = stream
        sock: _WebSocket | None = None
        with anyio.move_on_after(self.limits.handshake_timeout) as deadline:
            if self._ssl is not None:
                try:
                    byte_stream = await TLSStream.wrap(
                        stream, server_side=True, ssl_context=self._ssl, standard_compatible=False
                    )
                except _GONE as e:
                    log.info("%s ✕ %s TLS handshake failed: %s", self._tag, peer, str(e))
                    return None
            ws = WSConnection(ConnectionType.SERVER)
            sock = _WebSocket(byte_stream, ws, peer=peer, limits=self.limits, stats=self._stats)
            if not await self._server_upgrade(sock):
                return None
            # The accepting side holds its proof until it has admitted the peer (_run_socket):
            # a peer refused by the takeover rule then never completes a handshake, so it
            # creates no session (and no service scope) on each retry.
            return await self._authenticate(sock, hold_proof=True)
        if deadline.cancelled_caught:
            self._count_handshake_failure(HandshakeFailure.TIMEOUT)
            log.info("%s ✕ %s handshake deadline expired", self._tag, peer)
            if sock is not None and sock.ws.state is ConnectionState.OPEN:
                # Upgraded but not authenticated in time: say so (4008) before closing.
                reason = HandshakeFailure.TIMEOUT
                sock.local_close = (reason.close_code, reason.description)
                await sock.close(reason.close_code, reason.description)
        return None

    async def _server_upgrade(self, sock: _WebSocket) -> bool:
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
            except _GONE:
                return False
            received += data
            try:
                parser.receive_data(data)
                event = parser.next_event()
            except _BROKEN as exc:
                await self._refuse_upgrade(sock, 400, f"bad upgrade request: {exc}")
                return False
            if isinstance(event, h11.Request):
                break
            if event is not h11.NEED_DATA:
                return False  # (h11 yields nothing else before a request; defensive)
        pipelined = parser.trailing_data[0]  # everything after the request's head
        why = upgrade_refusal(
            event,
            bytes(received[: len(received) - len(pipelined)]),
            max_headers=self.limits.max_upgrade_headers,
        )
        if why is not None:
            await self._refuse_upgrade(sock, 400, why)
            return False
        ws = sock.ws
        try:
            # wsproto's own checks (Upgrade, Connection, Sec-WebSocket-Key/-Version, Host).
            ws.initiate_upgrade_connection(list(event.headers), event.target)
            request = next((e for e in ws.events() if isinstance(e, Request)), None)
        except _BROKEN as exc:
            await self._refuse_upgrade(sock, 400, f"bad upgrade request: {exc}")
            return False
        if request is None:
            await self._refuse_upgrade(sock, 400, "not a WebSocket upgrade")
            return False
        path = urllib.parse.urlsplit(request.target).path
        if path != EXECUTOR_PATH:
            await self._refuse_upgrade(sock, 404, f"path {path!r} is not {EXECUTOR_PATH}")
            return False
        if self._closing or self._authenticated >= self.limits.max_authenticated_sockets:
            await self._refuse_upgrade(sock, 503, "draining or full")
            return False
        try:
            await sock._write(ws.send(AcceptConnection()))
            ws.receive_data(pipelined)  # parsed (and counted) by the first receive_message
        except _SocketGone:
            return False
        sock.last_inbound = anyio.current_time()
        return True

    async def _refuse_upgrade(self, sock: _WebSocket, status: int, why: str) -> None:
        """Answer an HTTP status with a one-line reason, then drop the connection.

        The response is written by hand: the request may have been too broken for any HTTP
        library to answer it in protocol.
        """
        why = _one_line(why)
        self._stats.upgrades_refused[status] = self._stats.upgrades_refused.get(status, 0) + 1
        log.info("%s ✕ %s HTTP %d: %s", self._tag, sock.peer, status, why)
        body = f"{status} {why}\n".encode()
        data = (
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: text/plain\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        ).encode() + body
        with anyio.move_on_after(self.limits.close_timeout):
            try:
                await sock._write(data)
            except _SocketGone:
                pass
        await sock.abort()

    # ------------------------------------------------------------------ dialer

    async def _dial_loop(self) -> None:
        assert self._dial is not None
        delays = backoff(self.limits, self._rng)
        while not self._closing:
            self._stats.dial_attempts += 1
            up_since: float | None = None
            try:
                result = await self._dial_once()
                if result is not None:
                    up_since = anyio.current_time()
                    await self._attach_and_run(*result)
            except LinkError as exc:
                self.last_error = str(exc)
                log.warning("%s dial %s failed: %s", self._tag, self.url, self.last_error)
            except Exception as exc:
                self._peer_failed(self.url, exc)  # never the dial loop's failure: dial again
            if up_since is not None and (
                anyio.current_time() - up_since >= self.limits.backoff_reset_after
            ):
                delays = backoff(self.limits, self._rng)
            delay = next(delays)
            if delay:
                log.debug("%s next dial in %.2fs", self._tag, delay)
                await anyio.sleep(delay)
            else:
                await anyio.lowlevel.checkpoint()

    async def _dial_once(self) -> tuple[_WebSocket, HandshakeResult] | None:
        assert self._dial is not None
        _scheme, host, port = self._dial
        try:
            with anyio.fail_after(self.limits.connect_timeout):
                stream: anyio.abc.ByteStream = (
                    await _asyncio_stream.connect(host, port)
                    if _asyncio_stream.on_asyncio()
                    else await anyio.connect_tcp(host, port)
                )
        except TimeoutError as exc:
            raise LinkError(f"connect to {host}:{port} timed out") from exc
        except OSError as exc:
            raise LinkError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        peer = f"{host}:{port}"
        try:
            return await self._upgrade_and_authenticate(stream, host, port, peer)
        except BaseException:
            # Shutdown (cancellation) included: never drop a connected stream unclosed.
            await anyio.aclose_forcefully(stream)
            raise

    async def _upgrade_and_authenticate(
        self, stream: anyio.abc.ByteStream, host: str, port: int, peer: str
    ) -> tuple[_WebSocket, HandshakeResult] | None:
        with anyio.move_on_after(self.limits.handshake_timeout) as deadline:
            try:
                if self._ssl is not None:
                    stream = await TLSStream.wrap(
                        stream,
                        server_side=False,
                        hostname=host,
                        ssl_context=self._ssl,
                        standard_compatible=False,
                    )
                ws = WSConnection(ConnectionType.CLIENT)
                sock = _WebSocket(stream, ws, peer=peer, limits=self.limits, stats=self._stats)
                await self._client_upgrade(sock, host, port)
                return await self._authenticate(sock)
            except ssl.SSLError as exc:
                await anyio.aclose_forcefully(stream)
                raise LinkError(f"TLS handshake with {peer} failed: {exc.reason or exc}") from exc
            except _GONE as exc:
                await anyio.aclose_forcefully(stream)
                raise LinkError(f"connection to {peer} lost during upgrade: {exc}") from exc
        await anyio.aclose_forcefully(stream)
        if deadline.cancelled_caught:
            self._count_handshake_failure(HandshakeFailure.TIMEOUT)
            raise LinkError(f"upgrade and handshake with {peer} exceeded the deadline")
        return None

    async def _client_upgrade(self, sock: _WebSocket, host: str, port: int) -> None:
        ws = sock.ws
        host_header = f"[{host}]" if ":" in host else host
        await sock._write(ws.send(Request(host=f"{host_header}:{port}", target=EXECUTOR_PATH)))
        while True:
            data = await sock.stream.receive(_READ_CHUNK)
            try:
                ws.receive_data(data)
                # Lazily: frames that arrived in the same read as the 101 (the peer's hello,
                # typically) must stay queued in wsproto for receive_message, not be consumed.
                for event in ws.events():
                    if isinstance(event, AcceptConnection):
                        sock.last_inbound = anyio.current_time()
                        return
                    if isinstance(event, RejectConnection):
                        raise LinkError(
                            f"{sock.peer} refused the upgrade: HTTP {event.status_code}"
                        )
            except _BROKEN as exc:
                raise LinkError(f"bad upgrade response from {sock.peer}: {exc}") from exc

    # ------------------------------------------------------------------ handshake & attach

    def _peer_failed(self, peer: str, exc: Exception) -> str:
        """The one mapping of an exception nobody expected while serving one peer.

        Such an exception is a bug (here or in a library below) that the peer's bytes reached:
        it is that peer's failure, never the listener's, the dial loop's or the process's. The
        caller ends that socket (4008 when it can still say so); this logs the traceback, counts
        it and returns a one-line cause. Cancellation is not an :class:`Exception` and passes.
        """
        try:
            detail = str(exc)
        except Exception:  # even describing it must not fail
            detail = ""
        why = _one_line(f"unexpected {type(exc).__name__}" + (f": {detail}" if detail else ""))
        self._stats.unexpected_errors += 1
        self.last_error = why
        log.warning(
            "%s peer %s failed with an unexpected error: %s", self._tag, peer, why, exc_info=exc
        )
        return why

    def _count_handshake_failure(self, reason: HandshakeFailure) -> None:
        counts = self._stats.handshakes_failed
        counts[reason.name] = counts.get(reason.name, 0) + 1

    def _resume_offer(self) -> ResumeOffer | None:
        t = self.transport
        if t is None:
            return None
        return ResumeOffer(
            session_id=t.session_id, peer_runtime=t.peer_runtime, received=t.accepted
        )

    async def _authenticate(
        self, sock: _WebSocket, *, hold_proof: bool = False
    ) -> tuple[_WebSocket, HandshakeResult] | None:
        """Exchange hello and proof (the caller bounds this by the handshake deadline).

        With ``hold_proof`` our proof is kept in ``sock.held_proof`` instead of being sent; the
        caller sends it once the peer is admitted. Only one side may hold (the accepting one):
        the dialer sends its proof as soon as it has the listener's hello, so nothing deadlocks.
        """
        hs = Handshake(
            role=self.role,
            executor_id=self.executor_id,
            key=self._key,
            runtime=self.runtime_id,
            nonce=os.urandom(32),
            resume=self._resume_offer(),
            max_frame_bytes=self.limits.max_handshake_frame_bytes,
        )
        try:
            await sock.send_message(hs.hello_frame())
            log.debug("%s → %s hello", self._tag, sock.peer)
            while hs.result is None:
                try:
                    frame = await sock.receive_message()
                except FrameTooLarge as exc:
                    raise HandshakeError(HandshakeFailure.OVERSIZE, str(exc)) from exc
                except MalformedFrame as exc:
                    raise HandshakeError(HandshakeFailure.MALFORMED, str(exc)) from exc
                if frame is None:
                    why = _describe_close(sock)
                    self.last_error = f"peer closed during handshake ({why})"
                    log.info("%s ✕ %s handshake ended: %s", self._tag, sock.peer, why)
                    await sock.abort()
                    return None
                reply = hs.receive(frame)
                if reply is not None and hold_proof:
                    sock.held_proof = reply
                elif reply is not None:
                    await sock.send_message(reply)
                    log.debug("%s → %s proof", self._tag, sock.peer)
        except HandshakeError as exc:
            self._count_handshake_failure(exc.reason)
            self.last_error = str(exc)
            log.warning("%s ✕ %s handshake refused: %s", self._tag, sock.peer, self.last_error)
            await sock.close(exc.close_code, exc.reason.description)
            return None
        except _SocketGone:
            await sock.abort()
            return None
        except Exception as exc:
            self._peer_failed(sock.peer, exc)
            sock.local_close = (CloseCode.PROTOCOL_ERROR, _UNEXPECTED)
            await sock.close(CloseCode.PROTOCOL_ERROR, _UNEXPECTED)
            return None
        self._stats.handshakes_completed += 1
        return sock, hs.result

    async def _attach_and_run(self, sock: _WebSocket, result: HandshakeResult) -> None:
        try:
            await self._run_socket(sock, result)
        finally:
            await sock.abort()  # a no-op after a close; closes the socket on cancellation

    async def _run_socket(self, sock: _WebSocket, result: HandshakeResult) -> None:
        decision = await self._decide(sock, result)
        if decision is None:
            return
        transport, peer_received = decision
        proof, sock.held_proof = sock.held_proof, None
        if proof is not None:
            try:
                await sock.send_message(proof)
            except _SocketGone:
                return  # the transport waits, detached, for the next socket (or its grace)
            log.debug("%s → %s proof (admitted)", self._tag, sock.peer)
        sock.authenticated()
        self._attached = sock
        log.info(
            "%s ⇄ %s attached session=%s resumed=%s",
            self._tag,
            sock.peer,
            transport.session_id.hex()[:12],
            result.resume,
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat, sock, tg.cancel_scope)
                try:
                    await transport.run(sock, peer_received)
                except SessionFailed:
                    pass  # stored as transport.failure; the close below reports it
                except Exception as exc:
                    # That peer's failure, not the link's. What the session holds may be
                    # inconsistent after it, so it is retired (a broken machine stays broken).
                    why = self._peer_failed(sock.peer, exc)
                    transport.retire(FailureReason.MALFORMED_PACKET, why)
                tg.cancel_scope.cancel()
        finally:
            if self._attached is sock:
                self._attached = None
        # The cause: ours if we ended it (4007, 1009, 4004...), the session's failure if it was
        # retired, else a plain end -- not 1001, which a peer still reading would take for a
        # shutdown and retire the session.
        if sock.local_close is None and sock.peer_close is None:
            failure = transport.failure
            sock.local_close = (
                (failure.close_code, str(failure))
                if failure is not None
                else (int(CloseCode.NORMAL), "socket ended")
            )
        log.info("%s ✕ %s %s", self._tag, sock.peer, _describe_close(sock))
        code, cause = sock.local_close or (0, "")
        await sock.close(int(code) or CloseCode.NORMAL, cause or "socket ended")

    async def _decide(
        self, sock: _WebSocket, result: HandshakeResult
    ) -> tuple[SessionTransport, int] | None:
        """Apply the resume-or-fresh decision and the takeover rule (serialised)."""
        assert self._tg is not None
        async with self._attach_lock:
            if self._closing:
                await sock.close(CloseCode.GOING_AWAY, "shutting down")
                return None
            current = self.transport
            if result.resume:
                if current is None or current.session_id != result.session_id:
                    await self._refuse(sock, "session changed during the handshake; retry")
                    return None
                if current.attached:
                    old = self._attached
                    if old is not None:
                        old.local_close = (CloseCode.SUPERSEDED, "superseded by a resumed socket")
                    current.detach_socket()
                    await current.wait_detached()
                self._stats.resumed += 1
                return current, result.peer.received
            if (
                current is not None
                and current.attached
                and current.peer_runtime != result.peer.runtime
            ):
                old = self._attached
                if old is not None and await old.probe(self.limits.takeover_probe_timeout):
                    self._stats.takeovers_refused += 1
                    await self._refuse(sock, "another peer holds a healthy session")
                    return None
                log.info("%s attached socket failed the takeover probe", self._tag)
            if current is not None:
                current.retire(FailureReason.REPLACED, "a fresh session replaced it")
                if current.attached:
                    await current.wait_detached()
            transport = SessionTransport(
                result.session_id, result.peer.runtime, self.limits, self._tg
            )
            self._transport = transport
            self._stats.fresh_sessions += 1
            for listener in list(self._listeners):
                listener(transport, result)
            return transport, 0

    async def _refuse(self, sock: _WebSocket, why: str) -> None:
        log.info("%s ✕ %s refused: %s", self._tag, sock.peer, why)
        sock.local_close = (CloseCode.SUPERSEDED, why)
        await sock.close(CloseCode.SUPERSEDED, why)

    async def _heartbeat(self, sock: _WebSocket, scope: anyio.CancelScope) -> None:
        interval = self.limits.heartbeat_interval
        timeout = self.limits.heartbeat_timeout
        next_ping = anyio.current_time() + interval
        while True:
            now = anyio.current_time()
            if sock.reading:
                silent = now - sock.last_inbound
                if silent >= timeout:
                    self._stats.heartbeat_timeouts += 1
                    sock.local_close = (
                        CloseCode.HEARTBEAT_TIMEOUT,
                        f"no inbound frame for {silent:.1f}s (resumable)",
                    )
                    scope.cancel()
                    return
                deadline = sock.last_inbound + timeout
            else:
                # The reader is held up by our own slow consumer (back-pressure): the peer's
                # frames wait unread, so its silence cannot be judged; the clock restarts when
                # the reader is back (see _WebSocket.receive_message).
                deadline = now + timeout
            if now >= next_ping:
                next_ping = now + interval
                if not sock.busy:
                    # Bounded: a peer that stopped reading must not stall the silence check.
                    with anyio.move_on_after(max(0.0, deadline - now)):
                        try:
                            await sock.ping()
                        except _SocketGone:
                            scope.cancel()
                            return
            await anyio.sleep_until(min(next_ping, deadline))


def _parse_dial_url(url: str) -> tuple[str, str, int]:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid dial URL {url!r}: {exc}") from exc
    if parts.scheme not in ("ws", "wss"):
        raise ConfigError(f"dial URL {url!r} must use ws:// or wss://")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(f"dial URL {url!r} must not carry userinfo, a query or a fragment")
    if parts.path != EXECUTOR_PATH:
        raise ConfigError(f"dial URL {url!r} must have the path {EXECUTOR_PATH}")
    if not parts.hostname:
        raise ConfigError(f"dial URL {url!r} has no host")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "wss" else 80)
