"""Shared helpers for the link and transport tests: real link pairs, recorders and a raw client.

* :func:`small_limits` -- ``Limits`` with every time bound shrunk so that reconnection, grace,
  heartbeats and replay deadlines play out in tenths of a second.
* :class:`Endpoint` -- a :class:`~garcon_link.endpoint.link.WebSocketLink` plus a recorder: every
  logical session the link announces gets a consumer task that records each delivered payload, in
  order. Its :class:`Gate` stalls and releases those consumers (a slow consumer, on cue).
* :func:`link_pair` -- a listener and a dialer (either role may dial), optionally with a
  :class:`~garcon_link.testing.FaultProxy` between them; :func:`start_link` runs one more link in
  a task of its own (to stop and restart peers in any order).
* :class:`RawClient` -- a hand-written WebSocket client (wsproto + anyio) that can do everything a
  misbehaving peer might: wrong paths, garbage, text frames, forged proofs, never reading, ...
* :func:`wait_until` -- wait for a condition under a bounded deadline (tests never assert on
  sleeps; they poll a condition and fail with a description if it does not come true in time).
"""

from __future__ import annotations

import contextlib
import os
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Event,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from garcon_link.core.handshake import Handshake, HandshakeResult, ResumeOffer, derive_key
from garcon_link.core.wire import Message, Role, decode_packets, encode_receipt
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.endpoint.transport import SessionTransport, TransportState
from garcon_link.limits import Limits
from garcon_link.testing import FaultProxy

SECRET = b"s" * 32
EXECUTOR = "box"
CONTROLLER = "ctl"
"""The ``controller_id`` of every controller-role link and raw controller handshake here: a
listening worker holds one session per controller, so the tests of one session (takeover,
restart, refusals) are one controller's, as they are for a controller listening for a worker."""
DIRECTIONS = ["controller-dials", "worker-dials"]
"""Who dials whom: every end-to-end test runs in both directions."""

_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


def small_limits(**changes: Any) -> Limits:
    """Limits with time bounds small enough for tests; ``changes`` override any field."""
    base: dict[str, Any] = {
        "heartbeat_interval": 0.05,
        "heartbeat_timeout": 0.4,
        "detached_grace": 1.0,
        "replay_inactivity": 0.4,
        "handshake_timeout": 0.5,
        "takeover_probe_timeout": 0.3,
        "connect_timeout": 1.0,
        "backoff_base": 0.01,
        "backoff_max": 0.05,
        "backoff_reset_after": 0.5,
        "close_timeout": 0.3,
    }
    base.update(changes)
    return Limits(**base)


def roles(direction: str) -> tuple[Role, Role]:
    """``(listener role, dialer role)`` for a direction of :data:`DIRECTIONS`."""
    if direction == "controller-dials":
        return Role.WORKER, Role.CONTROLLER
    if direction == "worker-dials":
        return Role.CONTROLLER, Role.WORKER
    raise ValueError(direction)


def body(i: int, tag: str = "m") -> bytes:
    return f"{tag}{i:05d}".encode()


async def wait_until(
    predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition"
) -> float:
    """Poll ``predicate`` until it is true; return the seconds it took.

    Raises:
        AssertionError: still false after ``timeout`` seconds.
    """
    start = anyio.current_time()
    try:
        with anyio.fail_after(timeout):
            while not predicate():
                await anyio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None
    return anyio.current_time() - start


# ---------------------------------------------------------------------------------------------
# real links


class Gate:
    """Lets a test stall a consumer (``close``) and release it (``open``)."""

    def __init__(self) -> None:
        self._open = anyio.Event()
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = anyio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        await self._open.wait()


@dataclass
class SessionRecord:
    """One logical session as seen by one endpoint, and what its consumer received."""

    transport: SessionTransport
    result: HandshakeResult
    received: list[bytes] = field(default_factory=list)
    states: list[TransportState] = field(default_factory=list)
    ended: bool = False
    gate: Gate = field(default_factory=Gate)

    @property
    def session_id(self) -> bytes:
        return self.transport.session_id

    @property
    def ready(self) -> bool:
        return self.transport.state is TransportState.READY

    async def consume(self) -> None:
        async with self.transport.payloads() as stream:
            while True:
                await self.gate.wait()
                try:
                    payload = await stream.receive()
                except anyio.EndOfStream:
                    break
                self.received.append(payload)
        self.ended = True


class Endpoint:
    """A link plus a recorder of the logical sessions it announces (see ``on_session``)."""

    def __init__(self, link: WebSocketLink, tg: anyio.abc.TaskGroup) -> None:
        self.link = link
        self.sessions: list[SessionRecord] = []
        self.gate = Gate()  # shared by every session's consumer: close() stalls them all
        self._tg = tg
        link.on_session(self._on_session)

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        record = SessionRecord(transport, result, gate=self.gate)
        transport.add_listener(record.states.append)
        self.sessions.append(record)
        self._tg.start_soon(record.consume)

    @property
    def current(self) -> SessionRecord:
        assert self.sessions, "no session yet"
        return self.sessions[-1]

    async def wait_ready(self, count: int = 1, timeout: float = 5.0) -> SessionRecord:
        """Wait until the ``count``-th session of this endpoint is READY; return it."""
        await wait_until(
            lambda: len(self.sessions) >= count and self.sessions[count - 1].ready,
            timeout,
            f"session #{count} of {self.link.role.value} to be ready",
        )
        return self.sessions[count - 1]

    async def wait_received(self, n: int, record: SessionRecord | None = None) -> None:
        rec = record or self.current
        await wait_until(
            lambda: len(rec.received) >= n,
            5.0,
            f"{n} payloads at {self.link.role.value} (have {len(rec.received)})",
        )


@dataclass
class LinkPair:
    listener: Endpoint
    dialer: Endpoint
    proxy: FaultProxy | None
    tg: anyio.abc.TaskGroup
    stack: AsyncExitStack

    def endpoint(self, role: Role) -> Endpoint:
        return self.listener if self.listener.link.role is role else self.dialer

    @property
    def worker(self) -> Endpoint:
        return self.endpoint(Role.WORKER)

    @property
    def controller(self) -> Endpoint:
        return self.endpoint(Role.CONTROLLER)

    async def wait_ready(self, count: int = 1) -> tuple[SessionRecord, SessionRecord]:
        """Wait until both ends hold their ``count``-th session READY, with the same id."""
        a = await self.listener.wait_ready(count)
        b = await self.dialer.wait_ready(count)
        assert a.session_id == b.session_id
        return a, b


def make_link(
    role: Role,
    limits: Limits,
    *,
    listen: tuple[str, int] | None = None,
    dial: str | None = None,
    secret: bytes = SECRET,
    ssl_context: ssl.SSLContext | None = None,
) -> WebSocketLink:
    return WebSocketLink(
        role=role,
        executor_id=EXECUTOR,
        secret=secret,
        limits=limits,
        listen=listen,
        dial=dial,
        ssl_context=ssl_context,
        controller_id=CONTROLLER if role is Role.CONTROLLER else None,
    )


@asynccontextmanager
async def link_pair(
    direction: str,
    limits: Limits | None = None,
    *,
    proxy: bool = False,
    dialer_limits: Limits | None = None,
) -> AsyncIterator[LinkPair]:
    """A listener and a dialer for ``direction``; with ``proxy`` the dialer goes through a
    :class:`FaultProxy`. Each endpoint records its sessions (:class:`Endpoint`)."""
    limits = limits or small_limits()
    listen_role, dial_role = roles(direction)
    async with AsyncExitStack() as stack:
        tg = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tg.cancel_scope.cancel)
        listener = Endpoint(make_link(listen_role, limits, listen=("127.0.0.1", 0)), tg)
        await stack.enter_async_context(listener.link)
        url = listener.link.url
        fault_proxy = None
        if proxy:
            fault_proxy = FaultProxy("127.0.0.1", listener.link.listen_address[1])
            await stack.enter_async_context(fault_proxy)
            url = fault_proxy.url()
        dialer = Endpoint(make_link(dial_role, dialer_limits or limits, dial=url), tg)
        await stack.enter_async_context(dialer.link)
        yield LinkPair(listener, dialer, fault_proxy, tg, stack)


@asynccontextmanager
async def endpoint(tg: anyio.abc.TaskGroup, link: WebSocketLink) -> AsyncIterator[Endpoint]:
    """Run one more link (e.g. a restarted peer) recording into ``tg``."""
    ep = Endpoint(link, tg)
    async with link:
        yield ep


class RunningLink:
    """A link run by its own task, so that links can start and stop in any order (a link's
    context holds a task group, so links entered in one task must exit in reverse order)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._stop = anyio.Event()
        self._done = anyio.Event()

    @property
    def link(self) -> WebSocketLink:
        return self.endpoint.link

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            async with self.link:
                task_status.started()
                await self._stop.wait()
        finally:
            self._done.set()

    async def stop(self) -> None:
        self._stop.set()
        await self._done.wait()


async def start_link(tg: anyio.abc.TaskGroup, link: WebSocketLink) -> RunningLink:
    """Start ``link`` (recording into ``tg``) in a task of its own; stop it with ``.stop()``."""
    running = RunningLink(Endpoint(link, tg))
    await tg.start(running._run)
    return running


async def send_all(transport: SessionTransport, bodies: list[bytes]) -> None:
    for b in bodies:
        await transport.send(b)


# ---------------------------------------------------------------------------------------------
# raw client


class RawClient:
    """A hand-written WebSocket client that does only what the test tells it to."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.close_code: int | None = None
        self.close_reason: str | None = None
        self.pings = 0
        self.eof = False
        self._write_lock = anyio.Lock()
        self._pending: list[Event] = []

    @classmethod
    @asynccontextmanager
    async def connect(
        cls, address: tuple[str, int], ssl_context: ssl.SSLContext | None = None
    ) -> AsyncIterator[RawClient]:
        stream: anyio.abc.ByteStream = await anyio.connect_tcp(*address)
        try:
            if ssl_context is not None:
                stream = await TLSStream.wrap(
                    stream, hostname="localhost", ssl_context=ssl_context, standard_compatible=False
                )
            yield cls(stream)
        finally:
            await anyio.aclose_forcefully(stream)

    # -- raw bytes

    async def write(self, data: bytes) -> None:
        async with self._write_lock:  # a reader task may answer pings meanwhile
            await self.stream.send(data)

    async def read_until_eof(self, limit: int = 1 << 20) -> bytes:
        data = bytearray()
        with contextlib.suppress(*_CLOSED):
            while len(data) <= limit:
                data += await self.stream.receive()
        self.eof = True
        return bytes(data)

    # -- WebSocket

    async def upgrade(self, path: str = "/executor") -> AcceptConnection | RejectConnection:
        await self.write(self.ws.send(Request(host="localhost", target=path)))
        while True:
            events = await self._events()
            for i, event in enumerate(events):
                if isinstance(event, AcceptConnection | RejectConnection):
                    # Frames that came in the same read (the peer's hello) are kept for later.
                    self._pending.extend(events[i + 1 :])
                    return event

    async def _events(self) -> list[Event]:
        chunk = await self.stream.receive()
        self.ws.receive_data(chunk)
        return list(self.ws.events())

    async def send_bytes(self, data: bytes) -> None:
        await self.write(self.ws.send(BytesMessage(data=data)))

    async def send_text(self, text: str) -> None:
        await self.write(self.ws.send(TextMessage(data=text)))

    async def next_event(self, *, answer_pings: bool = True) -> Event | None:
        """The next data or close event; pings are answered (or just counted). None at EOF."""
        pending = self._pending  # events of a chunk not handed out yet survive across calls
        while True:
            while pending:
                event = pending.pop(0)
                if isinstance(event, Ping):
                    self.pings += 1
                    if answer_pings and self.ws.state is ConnectionState.OPEN:
                        with contextlib.suppress(*_CLOSED):  # best effort: it may be gone
                            await self.write(self.ws.send(event.response()))
                    continue
                if isinstance(event, CloseConnection):
                    self.close_code, self.close_reason = event.code, event.reason
                    return event
                if isinstance(event, BytesMessage | TextMessage | RejectData):
                    return event
            try:
                pending.extend(await self._events())
            except _CLOSED:
                self.eof = True
                return None

    async def next_message(self) -> bytes:
        """The next whole binary message (pings answered)."""
        parts = []
        while True:
            event = await self.next_event()
            assert isinstance(event, BytesMessage), f"expected a message, got {event!r}"
            parts.append(bytes(event.data))
            if event.message_finished:
                return b"".join(parts)

    async def read_bodies(self, n: int) -> list[bytes]:
        """Read messages until ``n`` session message packets came; return their bodies."""
        bodies: list[bytes] = []
        while len(bodies) < n:
            for packet in decode_packets(await self.next_message(), 1 << 30):
                if isinstance(packet, Message):
                    bodies.append(bytes(packet.body))
        return bodies

    async def wait_closed(self, *, answer_pings: bool = True) -> int | None:
        """Read until the peer closes; the close code, or None if the TCP stream just ended."""
        while True:
            event = await self.next_event(answer_pings=answer_pings)
            if event is None:
                return self.close_code
            if isinstance(event, CloseConnection):
                return event.code

    def handshake(
        self,
        role: Role,
        *,
        secret: bytes = SECRET,
        resume: ResumeOffer | None = None,
        runtime: bytes | None = None,
    ) -> Handshake:
        return Handshake(
            role=role,
            executor_id=EXECUTOR,
            key=derive_key(secret),
            runtime=runtime or os.urandom(16),
            nonce=os.urandom(32),
            resume=resume,
            controller=CONTROLLER if role is Role.CONTROLLER else None,
        )

    async def authenticate(self, hs: Handshake) -> HandshakeResult:
        """Run a complete, honest handshake with ``hs``; return its result."""
        await self.send_bytes(hs.hello_frame())
        while hs.result is None:
            reply = hs.receive(await self.next_message())
            if reply is not None:
                await self.send_bytes(reply)
        return hs.result

    async def authenticate_refused(self, hs: Handshake) -> int | None:
        """Send hello and proof as an honest peer that the listener will *not* admit.

        The accepting side holds its proof until it admits a peer, so a refused peer never
        receives it: return the close code it gets instead.
        """
        await self.send_bytes(hs.hello_frame())
        reply = hs.receive(await self.next_message())
        assert reply is not None, "the listener's hello should be answered with our proof"
        await self.send_bytes(reply)
        return await self.wait_closed()

    async def send_fence(self, through: int = 0) -> None:
        await self.send_bytes(encode_receipt(through))
