"""Shared helpers of the fault tests (soak, process faults, nginx, hostile input).

* :class:`Ledger` / :class:`LedgerService` -- a service whose every call and stream is keyed by a
  unique *token* and counted on the worker the moment its handler starts, so a test can tell, per
  call, whether it ran 0, 1 or (a bug) 2 times. Results are checksums of the arguments
  (:func:`checksum`), so a corrupted, misrouted or replayed reply is caught too. With
  ``GARCON_TEST_JOURNAL`` set, the service also appends one line per event to that file with an
  unbuffered ``write``, so what a SIGKILLed worker did survives it (:func:`read_journal`).
* :func:`write_configs` -- a secret file (mode 0600) plus worker and controller TOML files, for
  child processes; :func:`in_process_configs` builds the same two configs in code.
* :class:`Raw` -- a hostile WebSocket client over anyio: it can send bytes that wsproto would
  never produce (hand-made frame headers with huge declared lengths, text frames, floods), and it
  can complete the *real* handshake (:class:`garcon_link.core.handshake.Handshake`) to attack the
  authenticated layers. :meth:`Raw.outcome` reports how the server ended the connection: a close
  code, an HTTP status or a bare end-of-stream, each within a bounded wait.
* :func:`raw_listener`, :func:`accept_upgrade` -- a hostile *listener*, to attack a dialer.
* :func:`rss_bytes`, :class:`PeakRss`, :func:`percentile`, :func:`wait_for` -- measurement and
  bounded polling; :func:`kill_and_reap` -- the end of a child process, bounded.

Everything here runs on loopback only; every loop is bounded in count or time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import struct
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc
import cbor2
from anyio.abc import SocketAttribute
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

import garcon_link as gl
from garcon_link.core.handshake import Handshake, HandshakeResult, derive_key
from garcon_link.core.wire import (
    Message,
    decode_packets,
    encode_canonical,
    encode_message,
    encode_receipt,
)

EXECUTOR_ID = "fault-box"
CONTROLLER_ID = "legit"
"""The ``controller_id`` of the controllers here and of a raw peer's controller handshake: one
controller, whose session a raw peer with the key tries to take over or abuse (a worker holds a
session per controller, so a raw peer with another id would be a controller of its own)."""
SECRET_TEXT = "5a" * 32  # 32 bytes as 64 hex digits (what `garcon-link keygen` writes)
SECRET = gl.Secret(bytes.fromhex(SECRET_TEXT))
JOURNAL_ENV = "GARCON_TEST_JOURNAL"
TESTS_DIR = Path(__file__).resolve().parent

_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


# ---------------------------------------------------------------------------------- the service


def checksum(token: str, payload: bytes) -> str:
    """What :meth:`Ledger.apply` returns for ``(token, payload)``."""
    return hashlib.blake2b(token.encode() + b"\0" + payload, digest_size=16).hexdigest()


class Ledger(Protocol):
    """The worker's service, as a controller sees it."""

    async def apply(self, token: str, payload: bytes, hold: float = 0.0) -> str: ...
    def numbers(self, token: str, n: int, pause: float = 0.0) -> AsyncIterator[int]: ...
    async def hold(self, token: str) -> str: ...
    async def open_job(self, name: str) -> gl.ResourceRef: ...
    async def job_name(self, ref: gl.ResourceRef) -> str: ...
    async def count_of(self, token: str) -> int: ...
    async def pid(self) -> int: ...


class LedgerService:
    """Implementation of :class:`Ledger`: counts each token when its handler starts.

    ``ledger[token]`` is how many times a handler for ``token`` started; ``events`` lists
    ``"<event> <token>"`` strings (``start``, ``done``, ``cancelled``, ``closed``) in order
    (``apply`` journals ``done`` just before it returns its result). With
    ``GARCON_TEST_JOURNAL`` in the environment the events are also appended to that file.
    """

    def __init__(self) -> None:
        self.ledger: Counter[str] = Counter()
        self.events: list[str] = []
        self.jobs: dict[str, str] = {}
        self.running = 0
        path = os.environ.get(JOURNAL_ENV)
        self._journal = (
            os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600) if path else None
        )

    def _event(self, what: str, token: str) -> None:
        line = f"{what} {token}"
        self.events.append(line)
        if self._journal is not None:
            os.write(self._journal, (line + "\n").encode())

    def _start(self, token: str) -> None:
        self.ledger[token] += 1
        self._event("start", token)

    async def apply(self, token: str, payload: bytes, hold: float = 0.0) -> str:
        self._start(token)
        self.running += 1
        try:
            if hold > 0:
                await anyio.sleep(hold)
            self._event("done", token)
            return checksum(token, payload)
        except anyio.get_cancelled_exc_class():
            self._event("cancelled", token)
            raise
        finally:
            self.running -= 1

    async def numbers(self, token: str, n: int, pause: float = 0.0) -> AsyncIterator[int]:
        self._start(token)
        self.running += 1
        try:
            for i in range(n):
                yield i
                if pause > 0:
                    await anyio.sleep(pause)
            self._event("done", token)
        finally:
            self.running -= 1
            self._event("closed", token)

    async def hold(self, token: str) -> str:
        self._start(token)
        self.running += 1
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self._event("cancelled", token)
            raise
        finally:
            self.running -= 1
        return token  # pragma: no cover - never reached

    async def open_job(self, name: str) -> gl.ResourceRef:
        ref = gl.current_scope().resource("job", f"job-{len(self.jobs)}")
        self.jobs[ref.id] = name
        return ref

    async def job_name(self, ref: gl.ResourceRef) -> str:
        return self.jobs[gl.current_scope().check(ref, "job")]

    async def count_of(self, token: str) -> int:
        return self.ledger[token]

    async def pid(self) -> int:
        return os.getpid()


def read_journal(path: Path) -> list[tuple[str, str]]:
    """The ``(event, token)`` pairs a journal file holds (empty if it does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [tuple(line.split(" ", 1)) for line in text.splitlines() if " " in line]  # type: ignore[misc]


def journal_count(path: Path, event: str, token: str) -> int:
    return sum(1 for e, t in read_journal(path) if e == event and t == token)


# ---------------------------------------------------------------------------------- configs


def limits_toml(limits: dict[str, Any]) -> str:
    return "\n".join(f"{key} = {value!r}" for key, value in limits.items())


def write_configs(
    directory: Path, *, port: int, limits: dict[str, Any], dial_url: str | None = None
) -> tuple[Path, Path]:
    """Write ``link.secret`` (0600), ``worker.toml`` (listening on ``port``) and
    ``controller.toml`` (dialing ``dial_url``, default the worker) into ``directory``."""
    secret = directory / "link.secret"
    secret.write_text(SECRET_TEXT + "\n")
    secret.chmod(0o600)
    table = limits_toml(limits)
    worker = directory / "worker.toml"
    worker.write_text(
        f'executor_id = "{EXECUTOR_ID}"\nrole = "worker"\nsecret_file = "link.secret"\n\n'
        f'[connection]\nlisten = "127.0.0.1:{port}"\n\n[limits]\n{table}\n'
    )
    controller = directory / "controller.toml"
    url = dial_url or f"ws://127.0.0.1:{port}/executor"
    controller.write_text(
        f'executor_id = "{EXECUTOR_ID}"\nrole = "controller"\nsecret_file = "link.secret"\n\n'
        f'[connection]\ndial = "{url}"\n\n[limits]\n{table}\n'
    )
    return worker, controller


def worker_config(limits: gl.Limits, port: int = 0) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id=EXECUTOR_ID,
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", port),
        limits=limits,
    )


def controller_config(limits: gl.Limits, url: str, **extra: Any) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id=EXECUTOR_ID,
        role=gl.Role.CONTROLLER,
        secret=SECRET,
        dial=url,
        limits=limits,
        **{"controller_id": CONTROLLER_ID, **extra},
    )


# ---------------------------------------------------------------------------------- measuring


def rss_bytes() -> int:
    """This process's resident set size now (VmRSS), or its peak if /proc is unavailable."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_kib(pid: int | str, key: str) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1])
    return None


class PeakRss:
    """Peak resident-set growth of a process (this one by default) over a ``with`` block.

    On entry the kernel's high-water mark (VmHWM) is reset by writing ``5`` to
    ``/proc/PID/clear_refs`` (Linux >= 4.0) and the current RSS is the baseline; :attr:`growth`
    is then the *exact* peak above that baseline, however short the spike -- no sampling. Where the
    reset is not possible (no /proc, not permitted) :attr:`exact` is False and :attr:`growth` falls
    back to the current RSS above the baseline, which can miss a transient spike.
    """

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self.baseline = 0
        self.exact = False

    def __enter__(self) -> PeakRss:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.exact = True
        except OSError:
            self.exact = False
        self.baseline = (_status_kib(self.pid, "VmRSS:") or 0) * 1024
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    @property
    def peak(self) -> int:
        """The peak RSS in bytes since entry (or the current RSS if not :attr:`exact`)."""
        key = "VmHWM:" if self.exact else "VmRSS:"
        return (_status_kib(self.pid, key) or 0) * 1024

    @property
    def growth(self) -> int:
        """Bytes the peak rose above the RSS at entry."""
        return max(0, self.peak - self.baseline)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``samples`` by the nearest-rank method."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))
    return ordered[rank]


async def kill_and_reap(process: anyio.abc.Process, timeout: float = 10.0) -> None:
    """SIGKILL ``process`` if it still runs, wait for it (at most ``timeout`` s) and close its
    streams; shielded, so it also cleans up after a cancelled test; safe to call twice."""
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            process.kill()
        with anyio.move_on_after(timeout):
            await process.wait()
        await process.aclose()


async def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``predicate`` every 10 ms until true; fail the test after ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            while not predicate():
                await anyio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


@dataclass
class LatencyProbe:
    """A legitimate peer's calls during an attack: latency of each, and every failure."""

    latencies: list[float]
    failures: list[str]
    started: list[float] = field(default_factory=list)  # start time of each latency's call

    @classmethod
    def new(cls) -> LatencyProbe:
        return cls([], [])

    def window(self, start: float, end: float) -> list[float]:
        """Latencies of the calls that started in ``[start, end)`` (each counted once it ended,
        so wait until a call that started after ``end`` has finished to see them all)."""
        pairs = zip(self.started, self.latencies, strict=True)
        return [latency for began, latency in pairs if start <= began < end]

    async def run(self, ledger: Ledger, stop: anyio.Event, *, interval: float = 0.01) -> None:
        """Call ``ledger.apply`` every ``interval`` until ``stop`` (bounded by the caller)."""
        i = 0
        while not stop.is_set():
            i += 1
            token = f"probe-{os.getpid()}-{id(self)}-{i}"
            start = anyio.current_time()
            try:
                result = await ledger.apply(token, b"ping")
            except gl.CallError as exc:
                self.failures.append(f"{token}: {exc!r}")
            else:
                if result != checksum(token, b"ping"):
                    self.failures.append(f"{token}: wrong result {result!r}")
            self.started.append(start)
            self.latencies.append(anyio.current_time() - start)
            with anyio.move_on_after(interval):
                await stop.wait()


# ---------------------------------------------------------------------------------- raw peer


def ws_frame(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    declared: int | None = None,
    mask: bool = True,
    rsv: int = 0,
) -> bytes:
    """One hand-made WebSocket frame (RFC 6455 §5.2), masked as a client must.

    ``declared`` puts another length in the header than ``len(payload)`` (e.g. 2**62 with no
    payload at all): a peer must refuse it from the header alone.
    """
    length = len(payload) if declared is None else declared
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    mask_bit = 0x80 if mask else 0
    if length < 126:
        head += bytes([mask_bit | length])
    elif length < 1 << 16:
        head += bytes([mask_bit | 126]) + struct.pack("!H", length)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", length)
    if not mask:
        return head + payload
    key = os.urandom(4)
    masked = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return head + key + masked


OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING = 0x1, 0x2, 0x8, 0x9
OP_CONTINUATION, OP_PONG = 0x0, 0xA


def handshake(
    role: gl.Role = gl.Role.CONTROLLER,
    *,
    secret: bytes | None = None,
    executor_id: str = EXECUTOR_ID,
) -> Handshake:
    """A fresh (non-resuming) client handshake, honest unless told otherwise."""
    return Handshake(
        role=role,
        executor_id=executor_id,
        key=derive_key(SECRET.reveal() if secret is None else secret),
        runtime=os.urandom(16),
        nonce=os.urandom(32),
        resume=None,
        controller=CONTROLLER_ID if role is gl.Role.CONTROLLER else None,
    )


def hello_with(**changes: Any) -> bytes:
    """A canonical hello frame with ``changes`` applied to its map (keys may be added)."""
    wire = handshake().local_hello.to_wire()
    wire.pop("controller")  # the version-1 hello's keys only, unless changes add it
    wire.update(changes)
    return encode_canonical(wire)


def dag_bomb(depth: int) -> bytes:
    """CBOR of ``depth`` nested pairs that share their child (tags 28/29): ~6 bytes per level
    on the wire, 2**depth leaves for anything that walks the decoded value."""
    value: list[Any] = []
    for _ in range(depth):
        value = [value, value]
    return cbor2.dumps(value, value_sharing=True)


def upgrade_request(path: str = "/executor", host: str = "127.0.0.1") -> bytes:
    """A valid HTTP/1.1 WebSocket upgrade request, as bytes."""
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


@dataclass(frozen=True)
class Outcome:
    """How a server ended a hostile connection."""

    kind: str  # "close" (a WebSocket close frame), "http" (a status line), "eof", "open"
    code: int | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.code}" if self.code is not None else self.kind


class Raw:
    """A hostile client on one TCP connection (see the module docstring)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.upgraded = False
        self.http_status: int | None = None
        self.close_code: int | None = None
        self.close_reason: str | None = None
        self.received: list[bytes] = []  # bodies of session message packets
        self._inbox: list[bytes] = []  # whole binary messages not yet consumed
        self._parts: list[bytes] = []
        self._eof = False
        self._lock = anyio.Lock()
        self._ordinal = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, port: int) -> AsyncIterator[Raw]:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        try:
            yield cls(stream)
        finally:
            await anyio.aclose_forcefully(stream)

    # -- bytes out

    async def write(self, data: bytes) -> bool:
        """Write raw bytes; False if the server already closed the connection."""
        try:
            async with self._lock:
                await self.stream.send(data)
        except _CLOSED:
            return False
        return True

    async def send_message(self, data: bytes) -> bool:
        return await self.write(self.ws.send(BytesMessage(data=data)))

    async def send_text(self, text: str) -> bool:
        return await self.write(self.ws.send(TextMessage(data=text)))

    # -- bytes in

    async def _pump(self) -> bool:
        """Read one chunk and process it; False at end-of-stream."""
        if self._eof:
            return False
        try:
            data = await self.stream.receive()
        except _CLOSED:
            self._eof = True
            return False
        try:
            self.ws.receive_data(data)
            events = list(self.ws.events())
        except RemoteProtocolError:
            self._eof = True
            return False
        for event in events:
            if isinstance(event, AcceptConnection):
                self.upgraded = True
            elif isinstance(event, RejectConnection):
                self.http_status = event.status_code
            elif isinstance(event, CloseConnection):
                self.close_code = event.code
                self.close_reason = event.reason
            elif isinstance(event, Ping):
                with contextlib.suppress(Exception):
                    await self.write(self.ws.send(event.response()))
            elif isinstance(event, BytesMessage):
                self._parts.append(bytes(event.data))
                if event.message_finished:
                    self._inbox.append(b"".join(self._parts))
                    self._parts.clear()
        return True

    async def upgrade(self, path: str = "/executor") -> bool:
        """Send a proper upgrade request; True once accepted (else :attr:`http_status`)."""
        await self.write(self.ws.send(Request(host="127.0.0.1", target=path)))
        while not self.upgraded and self.http_status is None:
            if not await self._pump():
                break
        return self.upgraded

    async def upgrade_pipelined(self, data: bytes, path: str = "/executor") -> bool:
        """As :meth:`upgrade`, but ``data`` (hand-made frames, e.g. our hello) goes in the same
        write as the request, before any answer: a client that does not wait for the ``101``."""
        await self.write(self.ws.send(Request(host="127.0.0.1", target=path)) + data)
        while not self.upgraded and self.http_status is None:
            if not await self._pump():
                break
        return self.upgraded

    async def next_message(self) -> bytes | None:
        """The next whole binary message from the server, or None once it closed."""
        while not self._inbox:
            if self.close_code is not None or not await self._pump():
                return None
        return self._inbox.pop(0)

    async def outcome(self, timeout: float) -> Outcome:
        """Read (discarding data) until the server closes; how it did, within ``timeout``."""
        with anyio.move_on_after(timeout):
            while self.close_code is None and self.http_status is None:
                if not await self._pump():
                    break
                self._inbox.clear()
            if self.close_code is not None:
                return Outcome("close", self.close_code)
            if self.http_status is not None:
                return Outcome("http", self.http_status)
            return Outcome("eof")
        return Outcome("open")

    async def raw_http_outcome(self, timeout: float) -> Outcome:
        """For a connection whose request was hand-written: the HTTP status, or eof/open."""
        data = b""
        with anyio.move_on_after(timeout):
            with contextlib.suppress(*_CLOSED):
                while b"\r\n" not in data and len(data) < 65536:
                    data += await self.stream.receive()
            if data.startswith(b"HTTP/1.1 "):
                return Outcome("http", int(data[9:12]))
            return Outcome("eof")
        return Outcome("open")

    # -- the real handshake, then session packets

    async def authenticate(
        self,
        role: gl.Role = gl.Role.CONTROLLER,
        *,
        fence: bool = True,
        secret: bytes | None = None,
        executor_id: str = EXECUTOR_ID,
    ) -> HandshakeResult:
        """Run the handshake (hello, proof) and, with ``fence``, send receipt 0.

        With a wrong ``secret``, ``executor_id`` or ``role`` this is an impostor's attempt; the
        server's refusal surfaces as :class:`ConnectionError` (see :attr:`close_code`).
        """
        hs = handshake(role, secret=secret, executor_id=executor_id)
        await self.send_message(hs.hello_frame())
        while hs.result is None:
            frame = await self.next_message()
            if frame is None:
                raise ConnectionError(f"closed during the handshake (code {self.close_code})")
            reply = hs.receive(frame)
            if reply is not None:
                await self.send_message(reply)
        if fence:
            await self.send_message(encode_receipt(0))
        return hs.result

    async def send_envelope(self, envelope: Any) -> None:
        """Send one RPC envelope (CBOR-encoded unless already bytes) as the next message."""
        body = envelope if isinstance(envelope, bytes) else cbor2.dumps(envelope)
        self._ordinal += 1
        await self.send_message(encode_message(self._ordinal, body))

    async def replies(self, want: Callable[[Any], bool], timeout: float) -> Any:
        """The first envelope received (now or later, acknowledging packets as they come) that
        satisfies ``want``; it is removed from :attr:`received`."""
        with anyio.fail_after(timeout):
            while True:  # each pass reads one more message, bounded by the deadline
                for body in self.received:
                    envelope = cbor2.loads(body)
                    if want(envelope):
                        self.received.remove(body)
                        return envelope
                data = await self.next_message()
                if data is None:
                    raise ConnectionError(f"the session closed (code {self.close_code})")
                accepted = None
                for packet in decode_packets(data, 1 << 30):
                    if isinstance(packet, Message):
                        self.received.append(bytes(packet.body))
                        accepted = packet.ordinal
                if accepted is not None:
                    await self.send_message(encode_receipt(accepted))


# ---------------------------------------------------------------------------------- raw listener


@contextlib.asynccontextmanager
async def raw_listener(
    handler: Callable[[anyio.abc.SocketStream], Awaitable[None]],
) -> AsyncIterator[int]:
    """Listen on 127.0.0.1 (a free port) and run ``handler`` for each connection: a hostile
    *listener*, for attacking a dialer. Yields the port; the handlers are cancelled on exit."""

    async def handle(stream: anyio.abc.SocketStream) -> None:
        try:
            await handler(stream)
        finally:
            await anyio.aclose_forcefully(stream)  # however the handler ended

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield listener.extra(SocketAttribute.local_port)
        tg.cancel_scope.cancel()


async def accept_upgrade(stream: anyio.abc.SocketStream, *messages: bytes) -> WSConnection:
    """Read a client's upgrade request and accept it; ``messages`` (binary WebSocket messages)
    are written in the same write as the ``101``, as a listener that does not wait may do.

    Raises:
        anyio.EndOfStream: (or another stream error) the client went away first.
    """
    ws = WSConnection(ConnectionType.SERVER)
    while True:
        ws.receive_data(await stream.receive())
        for event in ws.events():
            if isinstance(event, Request):
                data = ws.send(AcceptConnection())
                for message in messages:
                    data += ws.send(BytesMessage(data=message))
                await stream.send(data)
                return ws
