"""One WebSocket over one byte stream: framing, the frame budget, closing (docs/design.md#link).

:class:`WebSocket` is the link's single send path and message assembly over a wsproto connection
that the listener (:mod:`garcon_link.net.ws`) or a dial (:mod:`garcon_link.net.dial`) upgraded;
:data:`GONE` and :data:`BROKEN` are the one classification of lower-library exceptions, used by
every receive and send. :func:`close_code` and :func:`describe_close` say how a socket closed,
:func:`close_stream` closes a byte stream without waiting. All are imported from
:mod:`garcon_link.net.ws` too.
"""

from __future__ import annotations

import asyncio
import logging
import math
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Callable, Iterator
from typing import Any, cast

import anyio
import anyio.abc
import h11
from wsproto import WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from ..core.wire import PEER_RETIRED_CODES, CloseCode, peer_retired_detail
from ..errors import FrameTooLarge, MalformedFrame
from ..limits import Limits
from ..logs import log_fields
from . import _asyncio_stream
from ._frames import FastFrames, MaskedFrame
from .budgets import FrameBudget, LinkStatistics, TurnBudget

__all__ = [
    "BROKEN",
    "GONE",
    "SocketGone",
    "WebSocket",
    "close_code",
    "close_stream",
    "describe_close",
]

log = logging.getLogger("garcon_link.ws")  # the name users configure (README)

_READ_CHUNK = 65536
_OPEN = ConnectionState.OPEN  # read per message: a module global, not an enum class lookup
_JOIN_HELD = 65536
"""A held frame is joined to a write of up to this many bytes (copied once); in front of a
larger one it is written just before it."""

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


class _Upgraded:
    """What stands for wsproto's handshake once a socket is admitted: wsproto's
    ``H11Handshake`` keeps its h11 connection, the upgrade request and their buffers (a dozen
    GC-tracked objects per socket) for the socket's life, though an open ``WSConnection`` only
    asks it for events, and it has none left. Every socket's ``ws.handshake`` becomes this one
    object (:meth:`WebSocket.authenticated`)."""

    __slots__ = ()
    _events: tuple[()] = ()  # what FastFrames.idle() reads
    state = ConnectionState.OPEN

    def events(self) -> Iterator[Any]:
        return iter(())


_UPGRADED = _Upgraded()


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
        fast_frames: bool = True,
    ) -> None:
        """``fast_frames=False`` reads and writes every frame through wsproto (a test seam: the
        two paths must agree frame for frame; see :mod:`._frames`)."""
        self.stream = stream
        self._fast_frames = fast_frames
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
        # A whole frame to write in front of the next write (hold_message_nowait).
        self._held_out: bytes | None = None
        self.turns: TurnBudget | None = None
        """The listener's budget of handshake steps per loop turn (None when dialing): the
        handshake asks it before each step."""
        self._admitted = False  # authenticated() was called
        self.teardowns: TurnBudget | None = None
        """The listener's budget of teardowns per loop turn (None when dialing): once
        authenticated, :meth:`receive_message` asks it before it says the socket ended."""
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

    @property
    def assembling(self) -> tuple[int, int]:
        """(bytes, frames) of the message being assembled from fragments now: at most
        :attr:`max_message` bytes and fewer than ``max_message_fragments`` frames."""
        return self._size, self._fragments

    @property
    def frames_allowed(self) -> float:
        """The balance of this socket's frame budget: frames it may still send before it is
        throttled (authenticated) or closed (before that, a fixed allowance); one frame past
        the budget shows as -1."""
        return self._budget.tokens

    @property
    def dialed(self) -> bool:
        """This side dialed (the WebSocket client): what the peer says of our executor's
        standing (a takeover, a refusal that will not heal) is for a dialer to act on; a
        listener hears it from a peer it may not have authenticated."""
        return bool(self.ws.client)

    # -- send path: check state, write under the lock, await drain, map errors

    def authenticated(self) -> None:
        """The peer is admitted: from now on the session's bounds apply (message size, frame
        rate) instead of the handshake's."""
        self.max_message = self.limits.max_frame_bytes
        self._admitted = True
        ws = self.ws
        if ws.connection is not None and not getattr(ws.handshake, "_events", True):
            # Upgraded, its handshake's events all taken: nothing reads the handshake again.
            ws.handshake = cast("Any", _UPGRADED)
        if self._fast_frames:
            self._fast = FastFrames.of(ws, deferred=self._nowait is not None)
        self._budget = FrameBudget.full(
            self.limits.frame_rate, self.limits.frame_burst, self._clock()
        )

    async def _write(self, data: bytes | bytearray | MaskedFrame) -> None:
        held = self._held_out
        if held is not None:
            self._held_out = None
            if len(data) <= _JOIN_HELD:
                data = held + data
            else:
                await self._write(held)
        try:
            # A large masked frame is a bytearray, never changed once built, or on an asyncio
            # stream a MaskedFrame (masked as written); anyio's streams (typed ``bytes``) hand
            # any bytes-like object to the socket or the transport.
            await self.stream.send(cast("bytes", data))
        except GONE as e:
            raise self._gone(e) from e
        self._stats.bytes_sent += len(data)

    def hold_message_nowait(self, data: bytes) -> bool:
        """Frame one binary message now and write it in front of the next write, in one
        system call with it; if nothing was written two loop turns later, on its own then.
        ``False`` (nothing done; send it) unless on an asyncio stream and open.

        The listener holds its proof this way: the session's first frames (the replay fence,
        which every attachment writes at once) follow it in the next turn."""
        stream = self._nowait
        if (
            stream is None
            or self._closed
            or self._held_out is not None
            or self.ws.state is not _OPEN
        ):
            return False
        try:
            self._held_out = self.ws.send(BytesMessage(data=data))
        except GONE:
            return False
        loop = stream.loop
        loop.call_soon(loop.call_soon, self._flush_held)
        return True

    def _flush_held(self) -> None:
        """The held frame, on its own, if no write took it along (a loop callback)."""
        held = self._held_out
        if held is None:
            return
        stream = self._nowait
        assert stream is not None
        if self._closed:
            self._held_out = None
            return
        if self._lock.locked() or not stream.writable_now():
            # A write under way (it did not start with it) or back-pressure: next turn.
            stream.loop.call_soon(self._flush_held)
            return
        self._held_out = None
        try:
            stream.send_nowait(held)
        except GONE as e:
            self._gone(e)
            return
        self._stats.bytes_sent += len(held)

    def _gone(self, cause: BaseException) -> SocketGone:
        """The socket is dead from now on; the error that says so, naming ``cause``."""
        self._closed = True
        return SocketGone(str(cause) or type(cause).__name__)

    async def _send_event(self, event: Any) -> None:
        async with self._lock:
            if self._closed or self.ws.state is not _OPEN:
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
            if self._closed or self.ws.state is not _OPEN:
                raise SocketGone("socket is closed")
            frame = fast.frame(data)
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
            and self.ws.state is _OPEN
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
            frame = None if fast is None else fast.frame(data)
            if frame is None:
                frame = self.ws.send(BytesMessage(data=data))
            held, self._held_out = self._held_out, None
            if held is not None:
                self._stats.bytes_sent += len(held)
                stream.send_nowait(held + frame)
            else:
                stream.send_nowait(frame)
        except GONE as e:
            raise self._gone(e) from e

    def retired_by_peer(self) -> str | None:
        """Why the peer's close retired the session (a 1001/4005/4006/4008 close), else None."""
        if self.peer_close is not None and self.peer_close[0] in PEER_RETIRED_CODES:
            return peer_retired_detail(*self.peer_close)
        return None

    @property
    def busy(self) -> bool:
        """A write is in progress (then a ping would only queue behind it)."""
        return self._lock.locked()

    async def ping(self) -> None:
        await self._send_event(Ping())

    def ping_nowait(self) -> bool:
        """Write a ping synchronously if :meth:`writable_now`; ``False`` (nothing written:
        :meth:`ping` it, or try again) if the socket is only busy or paused now.

        Raises:
            SocketGone: the socket is dead (as :meth:`ping` would raise), so a caller that
                only ever pings without waiting still learns it.
        """
        stream = self._nowait
        if stream is None:
            return False
        if self._closed or self.ws.state is not _OPEN:
            raise SocketGone("socket is closed")
        if not self.writable_now():
            gone = stream.unwritable()
            if gone is not None:
                raise self._gone(gone)
            return False
        try:
            data = self.ws.send(Ping())
            held, self._held_out = self._held_out, None
            if held is not None:
                data = held + data
            stream.send_nowait(data)
        except GONE as e:
            raise self._gone(e) from e
        self._stats.bytes_sent += len(data)
        return True

    async def probe(self, timeout: float) -> bool:
        """True if any inbound frame arrives within ``timeout`` after a ping.

        Also True while nobody reads the socket (the reader is held up by a slow consumer): a
        pong could not be seen then, so there is no evidence against the peer. False once the
        socket ended (its teardown may still wait its turn).
        """
        if self._closed:
            return False
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
            message = await self._receive_message(now)
        finally:
            self.reading = False
        if message is None and self._admitted and self.teardowns is not None:
            # The end of an authenticated socket: what it leads to (the session's detach, the
            # close) waits its turn behind the other lost sockets', beside everyone's traffic.
            await self.teardowns.step()
        return message

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
                    if self.ws.state is _OPEN:
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
                    if not self._admitted and self.turns is not None:
                        # Listening, unauthenticated: parsing what was read is a step of the
                        # listener's handshake line (what a whole frame leads to is another).
                        await self.turns.step()
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
                if not self._closed and self.ws.state is _OPEN:
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


async def close_stream(stream: anyio.abc.ByteStream) -> None:
    """Close ``stream`` at once (unsent bytes dropped) and never wait: asyncio's stream is
    aborted in place, any other goes through ``anyio.aclose_forcefully`` (a TLS stream's close
    would otherwise wait for the peer). Every socket a resume replaces ends here, so the
    asyncio path costs no cancel scope and no checkpoint."""
    if isinstance(stream, _asyncio_stream.AsyncioByteStream):
        stream.abort()
    else:
        await anyio.aclose_forcefully(stream)
