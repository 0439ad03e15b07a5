"""A leaner TCP byte stream for the asyncio backend (trio keeps anyio's own streams).

Why it exists
-------------
anyio's asyncio ``SocketStream`` pauses the transport's reading after every ``receive`` and
resumes it on the next (two ``epoll_ctl`` system calls per read), and ends every ``send`` that
did not have to wait with a shielded cancel scope and an extra event-loop iteration. For a
stream of small messages -- one RPC call is two of them per side -- that was about a quarter of
the CPU time of a call (measured in-process: 350 -> 260 µs of CPU per sequential call, both
sides together). :class:`AsyncioByteStream` keeps the same contract with neither cost:

* **reading stays enabled** while fewer than ``READ_HIGH_WATER`` bytes wait unread, and is paused
  above it (resumed once the reader has taken them below ``READ_LOW_WATER``): memory stays
  bounded and a peer we do not read is pushed back by TCP;
* **``send`` returns once the kernel holds the bytes** (write buffer limit 0, as anyio's), and
  waits -- the back-pressure the link's stall detection relies on -- only when it does not;
* **a large write goes a slice per loop turn**: an item over ``WRITE_SLICE`` bytes is written
  ``WRITE_SLICE`` bytes at a time, the next slice in a later loop turn once the kernel took the
  previous one (a 256 KiB frame in one ``send`` system call held the loop 0.3-0.5 ms on
  loopback); a :class:`~._frames.MaskedFrame` is masked a slice at a time as it goes. Until the
  last slice is written the stream is not :meth:`~AsyncioByteStream.writable_now` and a further
  ``send`` waits for it, so frames never interleave;
* ``send`` yields to the event loop only when it must wait for the kernel to take the bytes;
  ``receive`` always yields once (a checkpoint, as anyio's and trio's streams do): when bytes
  are already waiting it yields *before* taking them, so a peer that keeps our buffers full
  cannot make its reader monopolise the loop -- every read lets the other tasks run (returning
  buffered bytes at once would let a flood of tiny frames from a few sockets starve everything
  else). The yield is one loop iteration, taken only when data was already
  waiting, i.e. under load, where fairness is the point.

Errors are anyio's: ``EndOfStream`` after the peer's EOF, ``BrokenResourceError`` after a
connection error, ``ClosedResourceError`` after our own :meth:`aclose`. Connecting and
accepting map to ``OSError`` as :func:`anyio.connect_tcp` and anyio's listeners do.

At the file-descriptor limit
----------------------------
``accept`` fails with ``EMFILE`` (or ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) while the process has no
descriptor to give the next connection. The accept loop (:func:`serve_accepted`, and
``garcon_link.ws``'s loop over anyio's listeners on trio) then pauses for
:data:`ACCEPT_ERROR_PAUSE` and tries again: new connections wait in the kernel's listen backlog
(and past it are refused by the kernel), established sockets go on being served, and the
first connection to arrive once descriptors are free is accepted. :class:`AcceptFailures` logs
one warning per :data:`ACCEPT_LOG_INTERVAL` with the count of failures since the last one --
never a line per socket or per retry.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, cast

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from ._frames import MaskedFrame

__all__ = ["AcceptFailures", "AsyncioByteStream", "connect", "on_asyncio", "serve_accepted"]

log = logging.getLogger("garcon_link._asyncio_stream")  # the name users configure (README)

READ_HIGH_WATER = 256 * 1024
"""Unread bytes above which the transport stops reading from the socket."""
READ_LOW_WATER = 64 * 1024
"""... and below which it reads again."""
ACCEPT_ERROR_PAUSE = 0.1
"""Seconds to wait after a failed ``accept`` (e.g. out of file descriptors) before the next."""
ACCEPT_LOG_INTERVAL = 10.0
"""Seconds between two warnings about failed ``accept`` s (:class:`AcceptFailures`)."""


class AcceptFailures:
    """Rate-limited reporting of failed ``accept`` s on one listening socket.

    The first failure is logged at once; later ones at most once per :data:`ACCEPT_LOG_INTERVAL`
    (read at each failure), each line with the number of failures since the previous line. A
    listener at the file-descriptor limit fails every retry: a line per retry, or per waiting
    socket, would flood the log.
    """

    def __init__(self, where: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.where = where
        self.total = 0
        self._clock = clock
        self._unreported = 0
        self._last: float | None = None

    def failed(self, exc: BaseException) -> None:
        self.total += 1
        self._unreported += 1
        now = self._clock()
        if self._last is not None and now - self._last < ACCEPT_LOG_INTERVAL:
            return
        self._last = now
        count, self._unreported = self._unreported, 0
        log.warning(
            "accept on %s failed: %s (%d failure(s) since the last report; new connections "
            "wait, established ones are served; retrying every %gs)",
            self.where,
            exc,
            count,
            ACCEPT_ERROR_PAUSE,
        )


def on_asyncio() -> bool:
    """Whether the calling task runs on an asyncio event loop (anyio's asyncio backend)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return asyncio.current_task() is not None


WRITE_SLICE = 64 * 1024
"""The most bytes one loop turn writes of a large item (the module docstring)."""

RECEIVE_BUFFER = 256 * 1024
"""Bytes one socket read may take at most: the size of the buffer reads land in (asyncio's own
read size)."""

_threads = threading.local()


def _receive_buffer() -> memoryview:
    """This thread's receive buffer: every connection served by this thread's event loop
    reads into it, each read copied out before the next (:meth:`_Protocol.buffer_updated`)."""
    view: memoryview | None = getattr(_threads, "receive_buffer", None)
    if view is None:
        view = _threads.receive_buffer = memoryview(bytearray(RECEIVE_BUFFER))
    return view


class _Protocol(asyncio.BufferedProtocol):
    """Buffers what the transport delivers and wakes the one reader / the one writer.

    Reads land in one buffer per thread, reused (:func:`_receive_buffer`), and what each read
    took is copied out as ``bytes`` at once. asyncio's plain protocols get a fresh ``bytes`` of
    the full read size per read instead, shrunk to what arrived; while the C allocator serves a
    block that large by ``mmap`` (as it does in a process that never freed one) that is three
    system calls per read (``mmap``, ``mremap``, ``munmap``) and fresh pages to fault in. The
    transport calls :meth:`get_buffer` and :meth:`buffer_updated` in one callback, with nothing
    in between that could read into the buffer again; a buffer per thread keeps event loops in
    other threads out of it.
    """

    def __init__(self) -> None:
        self._buffer = _receive_buffer()
        self.transport: asyncio.Transport | None = None
        # What was read and not taken yet; the rest of a read taken in part is a view of it
        # (no copy of the rest per receive).
        self.chunks: deque[bytes | memoryview] = deque()
        self.buffered = 0
        self.reading_paused = False
        self.at_eof = False
        self.lost = False
        self.error: BaseException | None = None
        self.read_waiter: asyncio.Future[None] | None = None
        self.drain_waiter: asyncio.Future[None] | None = None
        self.writing_paused = False
        # Called (soon) when the transport's buffer drained: the next slice of a large item.
        self.drained: Callable[[], None] | None = None
        # Offered what the transport delivers while the reader waits on an empty buffer, before
        # it is buffered; returns True if it took the bytes (AsyncioByteStream.set_direct).
        self.direct: Callable[[bytes], bool] | None = None

    # -- transport callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports implement the interface without subclassing it)
        self.transport = cast("asyncio.Transport", transport)
        # No user-space write buffering: ``send`` returns when the kernel has the bytes, else
        # waits for it to take them (anyio's SocketStream does the same).
        self.transport.set_write_buffer_limits(0)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if type(data) is not bytes:
            data = bytes(data)  # a loop that calls this instead delivered a bytearray
        direct = self.direct
        if direct is not None and not self.chunks:
            waiter = self.read_waiter
            if waiter is not None and not waiter.done() and direct(data):
                return
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered >= READ_HIGH_WATER and not self.reading_paused:
            assert self.transport is not None
            self.transport.pause_reading()
            self.reading_paused = True
        self._wake_reader()

    def eof_received(self) -> bool:
        self.at_eof = True
        self._wake_reader()
        return True  # keep the transport open for writing (our close frame, say)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if exc is not None:
            self.error = exc
        self._wake_reader()
        self.resume_writing()

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        drained = self.drained
        if drained is not None:
            self.drained = None
            drained()
        waiter = self.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- helpers

    def _wake_reader(self) -> None:
        waiter = self.read_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncioByteStream(anyio.abc.ByteStream):
    """An anyio byte stream over an asyncio TCP transport (see the module docstring)."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        # (asyncio.get_running_loop() costs a getpid() system call per use on Python 3.11)
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._receiving = False
        self._sending = False
        # A large item being written a slice per loop turn, and how much of it is written.
        self._rest: bytes | bytearray | MaskedFrame | None = None
        self._rest_at = 0
        self._rest_waiters: list[asyncio.Future[None]] = []  # send_eof's, woken at its end

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this stream runs on."""
        return self._loop

    @property
    def buffered(self) -> int:
        """Bytes read from the socket and not yet returned by :meth:`receive`."""
        return self._protocol.buffered

    @property
    def reading_paused(self) -> bool:
        """Whether reading from the socket is paused: :data:`READ_HIGH_WATER` bytes or more
        are buffered."""
        return self._protocol.reading_paused

    def set_direct(self, take: Callable[[bytes], bool] | None) -> None:
        """Offer ``take`` the bytes that arrive while a :meth:`receive` waits on an empty
        buffer, in the protocol's callback, before they are buffered: if it returns ``True``
        they were consumed (that ``receive`` goes on waiting), else they are buffered and the
        ``receive`` returns them as usual. ``None`` stops it."""
        self._protocol.direct = take

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        sock: socket.socket = self._transport.get_extra_info("socket")
        peer = self._transport.get_extra_info("peername")
        attributes: dict[Any, Callable[[], Any]] = {
            SocketAttribute.raw_socket: lambda: sock,
            SocketAttribute.family: lambda: sock.family,
            SocketAttribute.local_address: lambda: sock.getsockname()[:2],
        }
        if peer is not None:
            attributes[SocketAttribute.remote_address] = lambda: tuple(peer[:2])
        return attributes

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be a positive integer")
        if self._receiving:
            raise anyio.BusyResourceError("reading from")
        protocol = self._protocol
        self._receiving = True
        try:
            if protocol.chunks:
                # A checkpoint before taking what is waiting (nothing is taken if cancelled).
                await asyncio.sleep(0)
                if self._closed:
                    raise anyio.ClosedResourceError
            while not protocol.chunks:
                if self._closed:
                    raise anyio.ClosedResourceError
                if protocol.error is not None:
                    raise anyio.BrokenResourceError from protocol.error
                if protocol.at_eof or protocol.lost:
                    raise anyio.EndOfStream
                waiter = protocol.read_waiter = self._loop.create_future()
                try:
                    await waiter
                finally:
                    protocol.read_waiter = None
            chunk: bytes | memoryview = protocol.chunks.popleft()
            if len(chunk) > max_bytes:
                view = memoryview(chunk)
                protocol.chunks.appendleft(view[max_bytes:])
                chunk = view[:max_bytes]
            elif protocol.chunks and len(chunk) + len(protocol.chunks[0]) <= max_bytes:
                # Several small reads queued up while we were busy: hand them over at once.
                parts = [chunk]
                size = len(chunk)
                while protocol.chunks and size + len(protocol.chunks[0]) <= max_bytes:
                    part = protocol.chunks.popleft()
                    parts.append(part)
                    size += len(part)
                chunk = b"".join(parts)
            protocol.buffered -= len(chunk)
            if protocol.reading_paused and protocol.buffered <= READ_LOW_WATER:
                protocol.reading_paused = False
                if not self._transport.is_closing():
                    self._transport.resume_reading()
            return chunk if type(chunk) is bytes else bytes(chunk)
        finally:
            self._receiving = False

    async def send(self, item: bytes) -> None:
        """Write ``item`` (bytes-like, or a :class:`~._frames.MaskedFrame`); returns once the
        kernel took all of it (a large item: every slice)."""
        if self._sending:
            raise anyio.BusyResourceError("writing to")
        protocol = self._protocol
        self._sending = True
        try:
            self._check_writable()
            while self._rest is not None:  # a large item of send_nowait's still going out
                waiter = protocol.drain_waiter = self._loop.create_future()
                try:
                    await waiter
                finally:
                    protocol.drain_waiter = None
                self._check_writable()
            self._write(item)
            while protocol.writing_paused or self._rest is not None:
                waiter = protocol.drain_waiter = self._loop.create_future()
                try:
                    await waiter
                finally:
                    protocol.drain_waiter = None
                self._check_writable()
        finally:
            self._sending = False

    def writable_now(self) -> bool:
        """Whether :meth:`send_nowait` would write now: open, no send in progress, not paused."""
        protocol = self._protocol
        return not (  # unwritable() is None, inline: this runs before every direct write
            self._sending
            or protocol.writing_paused
            or self._rest is not None
            or self._closed
            or protocol.error is not None
            or protocol.lost
            or self._transport.is_closing()
        )

    def send_nowait(self, item: bytes | bytearray | MaskedFrame) -> None:
        """Write without waiting; only when :meth:`writable_now` (what the kernel does not take
        yet stays in the transport's buffer, and the next :meth:`send` waits for it to drain).

        Raises:
            anyio.BrokenResourceError: the connection is gone.
            RuntimeError: not :meth:`writable_now` (a caller bug).
        """
        if not self.writable_now():
            self._check_writable()
            raise RuntimeError("send_nowait() while a send is in progress or writing is paused")
        if len(item) > WRITE_SLICE:
            self._write(item)
            return
        try:  # _write, inline
            self._transport.write(item)  # type: ignore[arg-type]  # (small: never a MaskedFrame)
        except RuntimeError as exc:  # the transport was closed under us
            raise anyio.BrokenResourceError from exc

    def _write(self, item: bytes | bytearray | MaskedFrame) -> None:
        if len(item) > WRITE_SLICE:
            self._rest = item
            self._rest_at = 0
            try:
                self._write_slice(first=True)
            except RuntimeError as exc:  # the transport was closed under us
                self._rest_done()
                raise anyio.BrokenResourceError from exc
            return
        try:
            self._transport.write(item)  # type: ignore[arg-type]  # (small: never a MaskedFrame)
        except RuntimeError as exc:  # the transport was closed under us
            raise anyio.BrokenResourceError from exc

    def _write_slice(self, first: bool = False) -> None:
        """Write the next ``WRITE_SLICE`` bytes of the large item under way; the next slice
        goes in a later loop turn, once the transport's buffer is empty. ``first``: called by
        :meth:`_write`, which maps the transport's ``RuntimeError``."""
        item = self._rest
        if item is None:
            return
        protocol = self._protocol
        if self._closed or protocol.lost or self._transport.is_closing():
            self._rest_done()  # a broken stream: a waiting send() raises
            return
        if protocol.writing_paused:  # the kernel has not taken the last slice yet
            protocol.drained = self._write_soon
            return
        start = self._rest_at
        stop = min(start + WRITE_SLICE, len(item))
        data = item.slice(start, stop) if isinstance(item, MaskedFrame) else item[start:stop]
        try:
            self._transport.write(data)
        except RuntimeError:  # the transport was closed under us
            if first:
                raise
            self._rest_done()
            return
        self._rest_at = stop
        if stop == len(item):
            self._rest_done()
        elif self._protocol.writing_paused:  # (set by the write above)
            protocol.drained = self._write_soon
        else:
            self._loop.call_soon(self._write_slice)

    def _write_soon(self) -> None:
        self._loop.call_soon(self._write_slice)

    def _rest_done(self) -> None:
        """The large item is written (or can no longer be): a waiting send() goes on."""
        self._rest = None
        self._protocol.drained = None
        waiter = self._protocol.drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        waiters, self._rest_waiters = self._rest_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def unwritable(self) -> Exception | None:
        """Why nothing can be written any more (the exception to raise), or ``None``: a stream
        that is only busy or paused now is not unwritable."""
        if self._closed:
            return anyio.ClosedResourceError()
        if self._protocol.error is not None:
            error = anyio.BrokenResourceError()
            error.__cause__ = self._protocol.error
            return error
        if self._protocol.lost or self._transport.is_closing():
            return anyio.BrokenResourceError("the connection is closed")
        return None

    def _check_writable(self) -> None:
        error = self.unwritable()
        if error is not None:
            raise error

    async def send_eof(self) -> None:
        if self._rest is not None:  # the end of the stream goes after a large item's rest
            waiter = self._loop.create_future()
            self._rest_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._rest_waiters:
                    self._rest_waiters.remove(waiter)
        try:
            self._transport.write_eof()
        except OSError:
            pass

    async def aclose(self) -> None:
        """Close at once (abort), like anyio's ``SocketStream.aclose``: unsent bytes are dropped."""
        self.abort()
        await anyio.lowlevel.checkpoint()

    def abort(self) -> None:
        """:meth:`aclose` without its checkpoint: for a ``finally`` that must not wait, and costs
        no cancel scope (``anyio.aclose_forcefully`` makes and cancels one)."""
        if not self._closed:
            self._closed = True
            self._rest_done()  # (the rest is dropped with the connection)
            self._transport.abort()
            # Unread bytes are of no use now: free them at once, not when the garbage collector
            # gets to a reference cycle that may still hold this stream (a closed flood of
            # sockets would otherwise keep up to READ_HIGH_WATER each).
            self._protocol.chunks.clear()
            self._protocol.buffered = 0
            self._protocol._wake_reader()
            self._protocol.resume_writing()


async def connect(host: str, port: int) -> AsyncioByteStream:
    """Connect to ``host:port``, trying the resolved addresses in turn; TCP_NODELAY set.

    No happy eyeballs: on Python 3.11, cancelling asyncio's staggered connection race (a
    shutdown while dialing) can leak the socket it was connecting.

    Raises:
        socket.gaierror: the name did not resolve.
        ConnectionRefusedError: every address refused the connection.
        OSError: otherwise, the first failure that was not a refusal.
    """
    loop = asyncio.get_running_loop()
    try:
        # An address literal resolves without a lookup: no executor thread for it.
        addresses = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST
        )
    except (socket.gaierror, UnicodeError):
        addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failures: list[OSError] = []
    for family, kind, proto, _name, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            transport, protocol = await loop.create_connection(_Protocol, sock=sock)
        except OSError as exc:
            sock.close()
            failures.append(exc)
            continue
        except BaseException:
            sock.close()
            raise
        _set_nodelay(transport.get_extra_info("socket"))
        return AsyncioByteStream(transport, protocol)
    if not failures:
        raise OSError(f"{host} resolved to no address")
    # asyncio would fold several failures into one message without an errno; keep the one
    # that says the most: a refusal only if every address refused.
    others = [exc for exc in failures if not isinstance(exc, ConnectionRefusedError)]
    raise (others or failures)[0]


def _set_nodelay(sock: socket.socket) -> None:
    # asyncio's own transports set it already; other loops may not. Small messages must not
    # wait for Nagle's algorithm.
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def serve_accepted(
    listener: anyio.abc.Listener[Any],
    handler: Callable[[AsyncioByteStream], Coroutine[Any, Any, None]],
    room: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Accept on every socket of ``listener`` and run ``handler(stream)`` for each connection;
    each accept first awaits ``room()`` (the listener's cap: connections wait in the kernel's
    backlog meanwhile).

    ``listener`` (from :func:`anyio.create_tcp_listener`) only binds; accepted connections get an
    :class:`AsyncioByteStream`. A failed ``accept`` (out of file descriptors, a connection reset
    before it was taken) is retried after :data:`ACCEPT_ERROR_PAUSE`, never fatal, and reported
    by :class:`AcceptFailures` (rate-limited). Runs until cancelled; the handlers end with it
    (:class:`_Handlers`): when it ends it cancels them and waits for every one. A handler's
    exception ends the accept loops and is raised from here once the others have ended.
    """
    subs = getattr(listener, "listeners", None) or [listener]  # a MultiListener, or one
    handlers = _Handlers(handler)
    try:
        async with anyio.create_task_group() as accept_group:
            handlers.failed = accept_group.cancel_scope
            for sub in subs:
                raw = sub.extra(SocketAttribute.raw_socket)
                accept_group.start_soon(_accept_loop, raw, handlers.start, room)
    finally:
        await handlers.end()


class _Handlers:
    """The accepted connections' handlers: each one a plain asyncio task running in a cancel
    scope of its own, which :meth:`end` cancels. An anyio task-group task would cost, for the
    connection's whole life, a task handle, its event (three objects), a completion closure
    with its cells and a second coroutine: some ten GC-tracked objects per connection more,
    kept for as long as the socket is attached -- a resume storm's garbage-collector passes
    grow with what each new connection keeps."""

    __slots__ = ("_context", "_done_callback", "_failure", "_handler", "_scopes", "failed")

    def __init__(self, handler: Callable[[AsyncioByteStream], Coroutine[Any, Any, None]]) -> None:
        self._handler = handler
        self._scopes: dict[asyncio.Task[None], anyio.CancelScope] = {}
        self._failure: BaseException | None = None
        # One context for every completion callback (add_done_callback copies the current
        # one per call otherwise).
        self._context = contextvars.copy_context()
        self._done_callback = self._done  # (one bound method for every task)
        self.failed: anyio.CancelScope | None = None
        """Cancelled when a handler raises (the accept loops' scope)."""

    def start(self, stream: AsyncioByteStream) -> None:
        scope = anyio.CancelScope()
        task = asyncio.get_running_loop().create_task(_in_scope(self._handler(stream), scope))
        self._scopes[task] = scope
        task.add_done_callback(self._done_callback, context=self._context)

    def _done(self, task: asyncio.Task[None]) -> None:
        del self._scopes[task]
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._failure is None:
            self._failure = exc
            if self.failed is not None:
                self.failed.cancel()

    async def end(self) -> None:
        """Cancel every handler, wait until all have ended, raise the first one's exception."""
        with anyio.CancelScope(shield=True):
            while self._scopes:
                for scope in self._scopes.values():
                    scope.cancel()
                await asyncio.wait(list(self._scopes))
        if self._failure is not None:
            raise self._failure


async def _in_scope(coro: Coroutine[Any, Any, None], scope: anyio.CancelScope) -> None:
    with scope:
        await coro


def _accept(raw: socket.socket) -> socket.socket:
    """One non-blocking ``accept`` (a seam for tests)."""
    client, _ = raw.accept()
    return client


async def _accept_loop(
    raw: socket.socket,
    start: Callable[[AsyncioByteStream], None],
    room: Callable[[], Awaitable[None]] | None,
) -> None:
    # Readiness, then a synchronous accept: loop.sock_accept() on Python 3.11 can accept a
    # connection for a future that was just cancelled, and then leaks the socket.
    loop = asyncio.get_running_loop()
    failures = AcceptFailures(str(raw.getsockname()))
    while True:
        await anyio.wait_readable(raw)
        if room is not None:  # (after the wait: the room is looked at right before accept)
            await room()
        try:
            client = _accept(raw)
        except (BlockingIOError, InterruptedError):
            continue  # another accept took it, or a spurious wake-up
        except OSError as exc:
            failures.failed(exc)
            await anyio.sleep(ACCEPT_ERROR_PAUSE)
            continue
        try:
            client.setblocking(False)
            _set_nodelay(client)
            transport, protocol = await loop.connect_accepted_socket(_Protocol, client)
        except OSError as exc:
            log.debug("accepted connection unusable: %s", exc)
            client.close()
            continue
        except BaseException:
            client.close()
            raise
        start(AsyncioByteStream(transport, protocol))
