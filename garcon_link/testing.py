"""A TCP fault-injection proxy for tests: cut, stall, slow down or refuse a connection on cue.

:class:`FaultProxy` sits between a dialer and a listener. The dialer connects to the proxy, the
proxy connects to the target and copies bytes both ways; the test then injects faults with
synchronous calls that take effect at once::

    async with FaultProxy("127.0.0.1", worker_port) as proxy:
        async with connect(proxy.url("/executor")) as link:   # the code under test
            proxy.cut_after(4096, "down")   # the next 4 KiB towards the dialer, then a cut
            ...
            proxy.blackhole()               # both peers stay connected, nothing moves
            ...
            proxy.heal()
            await proxy.wait_connections(2, timeout=5)   # the dialer reconnected

The proxy knows nothing about what it carries (it never parses a byte), so it works for any
TCP protocol. It only ever binds to ``listen_host`` and connects to ``target_host``: the
addresses it is given, meant to be loopback. It is a test tool, not a production relay.

Theory of operation
-------------------
One accept loop per bound socket; every accepted connection is a *pair* (dialer side, target
side) handled by one task that connects to the target and runs two forwarding tasks, "up"
(dialer -> target) and "down" (target -> dialer), in its own task group. A forwarding task reads
at most :data:`CHUNK_SIZE` bytes, holds the chunk while a fault says so, then writes it. The
fault settings live on the proxy, not on the pairs, so a change applies to every current and
future connection; waiters sleep on an :class:`anyio.Event` that is replaced on every change,
so nothing polls.

- A cut cancels the pair's cancel scope; the pair task then closes both sockets. A peer sees
  end-of-stream, or a reset when the kernel still held bytes from it that nobody read.
- ``cut_after`` lets exactly the budgeted bytes through, half-closes the receiving side so they
  are delivered before the end-of-stream, closes the other side at once, and gives the receiving
  side up to :data:`CUT_LINGER` seconds to finish before it is closed too.
- A blackhole stops *reading* (a chunk already read is held), so the kernel buffers fill and the
  writers see the backpressure of a stalled peer. Nothing is dropped: once healed, what was sent
  meanwhile is delivered, as TCP would after a partition heals. A connection accepted during a
  blackhole is not connected to the target until the blackhole is lifted.
- An end-of-stream from one peer is passed on as a half-close; the pair ends once both
  directions have ended. Errors on either socket (reset, broken pipe, refused target) end that
  pair only; nothing is raised into the task group that runs the proxy.

Process faults
--------------
:class:`WorkerProcess` runs ``garcon-link worker`` in a child process so that a test can SIGKILL
a real worker in the middle of a call and start it again on the same port::

    async with WorkerProcess("worker.toml", ["calc=mymodule:Calc"]) as worker:
        url = await worker.start()          # waits for the ``executor-listening`` line
        ...
        worker.kill()                       # SIGKILL: no close frame, no cleanup
        await worker.restart()              # a new process (a new runtime) on the same URL

The child reads its secret from the config's secret file (never from its environment or command
line); its standard input is a pipe the parent never writes, with ``--stop-on-stdin-eof``, so a
worker outlives neither its :class:`WorkerProcess` nor the test process.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self, cast

import anyio
import anyio.abc
from anyio.abc import SocketAttribute, SocketListener, SocketStream

__all__ = [
    "CHUNK_SIZE",
    "CUT_LINGER",
    "FaultProxy",
    "ProxyStatistics",
    "WorkerProcess",
    "free_tcp_port",
]

logger = logging.getLogger(__name__)

CHUNK_SIZE = 64 * 1024
"""Largest chunk one forwarding task reads, holds and writes at a time (bytes)."""

CUT_LINGER = 1.0
"""Seconds the receiving side of a ``cut_after`` gets to take its last bytes before it is closed."""

THROTTLE_QUANTUM = 0.02
"""While throttled, a read asks for at most this many seconds' worth of bytes, to pace smoothly."""

ACCEPT_RETRY_DELAY = 0.05
"""Pause after a failed ``accept()`` (e.g. out of file descriptors) before trying again (s)."""

Direction = Literal["up", "down", "both"]
_DIRECTIONS: frozenset[str] = frozenset({"up", "down", "both"})
_GLYPH = {"up": "upstream", "down": "downstream"}  # named in log lines (plain words)


@dataclass(frozen=True, slots=True)
class ProxyStatistics:
    """A snapshot of a :class:`FaultProxy`'s counters (see :meth:`FaultProxy.statistics`).

    Attributes:
        connections_accepted: TCP connections accepted since start, refused ones included.
        connections_active: accepted connections not yet closed (refused ones excluded;
            connections still waiting out a blackhole included).
        cuts: connections closed by :meth:`FaultProxy.cut` or a :meth:`FaultProxy.cut_after`.
        bytes_up: bytes forwarded from dialers to the target.
        bytes_down: bytes forwarded from the target to dialers.
        connections_refused: accepted connections closed at once because of
            :meth:`FaultProxy.refuse`.
    """

    connections_accepted: int
    connections_active: int
    cuts: int
    bytes_up: int
    bytes_down: int
    connections_refused: int = 0


class _Pair:
    """One proxied connection: the dialer's socket, the target's, and the scopes that end them."""

    __slots__ = ("cause", "client", "cut", "id", "linger", "linger_scope", "scope", "server")

    def __init__(self, pair_id: int, client: SocketStream) -> None:
        self.id = pair_id
        self.client = client
        self.server: SocketStream | None = None
        self.scope = anyio.CancelScope()  # connect + both forwarding tasks
        self.linger_scope = anyio.CancelScope()  # the grace period after a cut_after
        self.cut = False
        self.cause = ""  # why forwarding stopped; empty until known
        # After a cut_after: (the side that must get its last bytes, the side to close at once).
        self.linger: tuple[SocketStream, SocketStream] | None = None

    def end(self, cause: str) -> None:
        """Stop forwarding; the first cause given is the one logged."""
        self.cause = self.cause or cause
        self.scope.cancel()


class FaultProxy:
    """A TCP proxy to ``target_host:target_port`` whose faults a test switches on and off.

    Use it as ``async with FaultProxy(...) as proxy:``; it serves in its own task group until the
    block ends or :meth:`aclose` is called. Fault controls are plain (synchronous) methods, may be
    called before the proxy is started, and apply to current and future connections alike.

    Args:
        target_host: where to connect for each accepted connection (meant to be loopback).
        target_port: the target's port.
        listen_host: the address to bind; dialers connect here (default ``127.0.0.1``).
        listen_port: the port to bind; 0 (the default) picks a free one, see :attr:`port`.
        connect_timeout: seconds allowed to connect to the target; on failure or timeout the
            dialer's connection is closed.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        connect_timeout: float = 5.0,
    ) -> None:
        if not 0 < target_port < 65536:
            raise ValueError(f"target_port must be in 1..65535, got {target_port!r}")
        if not 0 <= listen_port < 65536:
            raise ValueError(f"listen_port must be in 0..65535, got {listen_port!r}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0, got {connect_timeout!r}")
        self._target_host = target_host
        self._target_port = target_port
        self._listen_host = listen_host
        self._listen_port = listen_port
        self._connect_timeout = connect_timeout
        # Fault settings (read by the forwarding tasks at every step).
        self._blackholed = False
        self._delay = 0.0
        self._rate: float | None = None
        self._refusing = False
        self._cut_budget: int | None = None
        self._cut_direction: Direction = "both"
        # Counters.
        self._accepted = 0
        self._refused = 0
        self._cuts = 0
        self._bytes_up = 0
        self._bytes_down = 0
        self._pairs: set[_Pair] = set()
        # Runtime, created on entry (anyio primitives need a running event loop).
        self._listener: anyio.abc.Listener[SocketStream] | None = None
        self._listeners: list[SocketListener] = []
        self._bound_port = 0
        self._task_group: anyio.abc.TaskGroup | None = None
        self._serve_scope: anyio.CancelScope | None = None
        self._changed: anyio.Event | None = None
        self._accepted_event: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._entered = False
        self._closing = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a FaultProxy can be started only once")
        self._entered = True
        multi = await anyio.create_tcp_listener(
            local_host=self._listen_host, local_port=self._listen_port
        )
        self._listener = multi
        # create_tcp_listener only ever builds SocketListeners (typed as plain Listeners).
        self._listeners = [cast("SocketListener", listener) for listener in multi.listeners]
        self._bound_port = multi.extra(SocketAttribute.local_port)
        self._changed = anyio.Event()
        self._accepted_event = anyio.Event()
        self._stopped = anyio.Event()
        self._serve_scope = anyio.CancelScope()
        task_group = anyio.create_task_group()
        await task_group.__aenter__()
        self._task_group = task_group
        try:
            await task_group.start(self._serve)
        except BaseException as exc:
            self._begin_close()
            await task_group.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        logger.debug(
            "fault proxy %s:%d listening, forwarding to %s:%d",
            self._listen_host,
            self._bound_port,
            self._target_host,
            self._target_port,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._begin_close()
        task_group, self._task_group = self._task_group, None
        if task_group is None:
            return None
        return await task_group.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Stop accepting, close every connection (both sides) and the listening socket.

        Idempotent; returns once everything is closed. The proxy cannot be restarted.
        """
        self._begin_close()
        if self._stopped is not None:
            await self._stopped.wait()

    def _begin_close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._serve_scope is not None:
            self._serve_scope.cancel()

    # -- addresses -------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The address dialers should connect to (the ``listen_host`` given)."""
        return self._listen_host

    @property
    def port(self) -> int:
        """The bound port (the one picked by the OS when ``listen_port`` was 0).

        Raises:
            RuntimeError: the proxy has not been started yet.
        """
        if not self._entered:
            raise RuntimeError("the proxy is not started: use `async with FaultProxy(...)`")
        return self._bound_port

    def url(self, path: str = "/executor", scheme: str = "ws") -> str:
        """The URL a dialer uses to reach the target through the proxy.

        Args:
            path: appended after the port; a leading ``/`` is added if missing.
            scheme: the URL scheme (``ws``, ``wss``, ``http``, ...).

        Returns:
            For example ``ws://127.0.0.1:41234/executor``; an IPv6 host is bracketed.
        """
        host = f"[{self.host}]" if ":" in self.host else self.host
        if not path.startswith("/"):
            path = "/" + path
        return f"{scheme}://{host}:{self.port}{path}"

    # -- faults ----------------------------------------------------------------------------------

    def cut(self) -> None:
        """Close both sides of every current connection now; new connections are still accepted.

        A connection still waiting for the target (or out a blackhole) is cut too. A
        ``cut_after`` still armed stays armed.
        """
        for pair in list(self._pairs):
            if pair.cut:
                pair.linger_scope.cancel()  # already cut by cut_after: stop its grace period
            else:
                self._cut_pair(pair, "cut()")

    def cut_after(self, n_bytes: int, direction: Direction = "both") -> None:
        """Arm a one-shot cut: forward exactly ``n_bytes`` more bytes, then cut that connection.

        The budget is shared by all current and future connections and counted in
        ``direction`` only (``"both"`` counts both directions together). The connection that
        forwards the last budgeted byte is cut right after it: the side that received the bytes
        gets them followed by end-of-stream, the other side is closed at once. With
        ``n_bytes == 0`` the next chunk to be forwarded is dropped and its connection cut. Arming
        again replaces the pending budget; :meth:`heal` disarms it.

        Raises:
            ValueError: ``n_bytes`` is negative or ``direction`` is not up/down/both.
        """
        if n_bytes < 0:
            raise ValueError(f"n_bytes must be >= 0, got {n_bytes!r}")
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be 'up', 'down' or 'both', got {direction!r}")
        self._cut_budget = n_bytes
        self._cut_direction = direction
        self._notify()

    def blackhole(self) -> None:
        """Stop forwarding both ways but keep every connection open, as a stalled peer would.

        Nothing more is read, so the kernel buffers fill and writers feel backpressure; a chunk
        already read is held. Connections accepted meanwhile are not connected to the target
        until :meth:`heal`. Nothing is dropped: after healing, held data is delivered in order.
        """
        self._blackholed = True
        self._notify()

    def delay(self, seconds: float) -> None:
        """Hold each chunk ``seconds`` after it is read before writing it (0 removes the delay).

        Order is kept in each direction. Since a direction forwards one chunk at a time, this
        also caps a direction's throughput at :data:`CHUNK_SIZE` bytes per ``seconds``.

        Raises:
            ValueError: ``seconds`` is negative or not finite.
        """
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        self._delay = float(seconds)
        self._notify()

    def throttle(self, bytes_per_second: float | None) -> None:
        """Limit each direction of each connection to ``bytes_per_second`` (``None``: no limit).

        Chunks are paced: after a chunk of ``k`` bytes the next one waits ``k / rate`` seconds.

        Raises:
            ValueError: ``bytes_per_second`` is not a positive finite number.
        """
        if bytes_per_second is not None and not (
            bytes_per_second > 0 and math.isfinite(bytes_per_second)
        ):
            raise ValueError(f"bytes_per_second must be > 0 or None, got {bytes_per_second!r}")
        self._rate = None if bytes_per_second is None else float(bytes_per_second)
        self._notify()

    def refuse(self, on: bool = True) -> None:
        """Refuse new connections (accept, then close at once), e.g. to play "worker down".

        Current connections are not affected; ``refuse(False)`` or :meth:`heal` ends it.
        """
        self._refusing = on
        self._notify()

    def heal(self) -> None:
        """Clear blackhole, delay, throttle, refusal and any armed ``cut_after``; forward again."""
        self._blackholed = False
        self._delay = 0.0
        self._rate = None
        self._refusing = False
        self._cut_budget = None
        self._notify()

    # -- observation -----------------------------------------------------------------------------

    def statistics(self) -> ProxyStatistics:
        """Return a snapshot of the counters."""
        return ProxyStatistics(
            connections_accepted=self._accepted,
            connections_active=len(self._pairs),
            cuts=self._cuts,
            bytes_up=self._bytes_up,
            bytes_down=self._bytes_down,
            connections_refused=self._refused,
        )

    async def wait_connections(self, n: int, timeout: float) -> None:
        """Wait until at least ``n`` connections have been accepted since start (refused included).

        Raises:
            TimeoutError: fewer than ``n`` after ``timeout`` seconds.
            RuntimeError: the proxy has not been started yet.
        """
        if self._accepted_event is None:
            raise RuntimeError("the proxy is not started: use `async with FaultProxy(...)`")
        with anyio.fail_after(timeout):
            while self._accepted < n:
                await self._accepted_event.wait()

    # -- serving ---------------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake every task waiting on a fault setting; they re-read the settings."""
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        assert self._serve_scope is not None
        assert self._stopped is not None
        try:
            with self._serve_scope:
                async with anyio.create_task_group() as connections:
                    for listener in self._listeners:
                        connections.start_soon(self._accept_loop, listener, connections)
                    task_status.started()
        except Exception:  # a bug in this module: log it rather than break the user's test
            logger.exception("fault proxy :%d stopped by an unexpected error", self._bound_port)
        finally:
            with anyio.CancelScope(shield=True):
                if self._listener is not None:
                    await self._listener.aclose()
                self._stopped.set()
            logger.debug("fault proxy :%d closed", self._bound_port)

    async def _accept_loop(
        self, listener: SocketListener, connections: anyio.abc.TaskGroup
    ) -> None:
        while True:
            try:
                client = await listener.accept()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:
                logger.warning("fault proxy :%d accept failed: %s", self._bound_port, exc)
                await anyio.sleep(ACCEPT_RETRY_DELAY)
                continue
            connections.start_soon(self._handle, client)

    async def _handle(self, client: SocketStream) -> None:
        self._accepted += 1
        pair_id = self._accepted
        assert self._accepted_event is not None
        self._accepted_event.set()
        self._accepted_event = anyio.Event()
        if self._refusing:
            self._refused += 1
            logger.debug("fault proxy :%d #%d refused", self._bound_port, pair_id)
            await _close_quietly(client)
            return
        pair = _Pair(pair_id, client)
        self._pairs.add(pair)
        try:
            with pair.scope:
                early = await _stop_reading_ahead(client)
                await self._wait_not_blackholed()
                with anyio.fail_after(self._connect_timeout):
                    pair.server = await anyio.connect_tcp(self._target_host, self._target_port)
                logger.debug("fault proxy :%d #%d connected", self._bound_port, pair_id)
                async with anyio.create_task_group() as pumps:
                    pumps.start_soon(self._pump, pair, client, pair.server, "up", early)
                    pumps.start_soon(self._pump, pair, pair.server, client, "down")
            if pair.linger is not None:
                receiver, sender = pair.linger
                await _close_quietly(sender)
                with pair.linger_scope:
                    pair.linger_scope.deadline = anyio.current_time() + CUT_LINGER
                    await _finish_after_cut(receiver)
        except Exception as exc:  # the target refused or timed out; sockets errors end the pair
            pair.cause = pair.cause or (f"{type(exc).__name__} {exc}".strip())
        finally:
            self._pairs.discard(pair)
            await _close_quietly(client)
            if pair.server is not None:
                await _close_quietly(pair.server)
            cause = pair.cause or ("proxy closed" if self._closing else "closed by both peers")
            logger.debug("fault proxy :%d #%d closed: %s", self._bound_port, pair_id, cause)

    def _cut_pair(
        self, pair: _Pair, cause: str, linger: tuple[SocketStream, SocketStream] | None = None
    ) -> None:
        pair.cut = True
        pair.linger = linger
        self._cuts += 1
        pair.end(cause)

    async def _pump(
        self,
        pair: _Pair,
        source: SocketStream,
        sink: SocketStream,
        direction: Literal["up", "down"],
        early: bytes = b"",
    ) -> None:
        glyph = _GLYPH[direction]
        next_free = 0.0  # throttle: earliest time the next chunk may be written
        try:
            while True:  # ends at end-of-stream, on an error, or when the pair is cancelled
                if early:
                    chunk, early = early, b""
                else:
                    await self._wait_not_blackholed()
                    chunk = await source.receive(self._read_size())
                sent_at = await self._hold(anyio.current_time(), next_free)
                if self._rate is not None:
                    next_free = sent_at + len(chunk) / self._rate
                chunk, cut_now = self._spend_cut_budget(chunk, direction)
                if chunk:
                    if direction == "up":
                        self._bytes_up += len(chunk)
                    else:
                        self._bytes_down += len(chunk)
                    await sink.send(chunk)
                if cut_now:
                    self._cut_pair(pair, f"cut_after ({glyph})", linger=(sink, source))
                    return
        except anyio.EndOfStream:
            # A half-close passes through; the pair ends when both directions have ended.
            with contextlib.suppress(Exception):
                await sink.send_eof()
        except Exception as exc:  # reset, broken pipe, closed socket: end this pair only
            pair.end(f"{glyph} {type(exc).__name__}")

    def _read_size(self) -> int:
        rate = self._rate
        if rate is None:
            return CHUNK_SIZE
        return max(1, min(CHUNK_SIZE, int(rate * THROTTLE_QUANTUM)))

    async def _wait_not_blackholed(self) -> None:
        while self._blackholed:  # each pass waits for a settings change
            assert self._changed is not None
            await self._changed.wait()

    async def _hold(self, received_at: float, next_free: float) -> float:
        """Wait until a chunk read at ``received_at`` may be written; return the time it may."""
        while True:  # each pass waits for a settings change or the computed deadline
            assert self._changed is not None
            changed = self._changed
            now = anyio.current_time()
            if self._blackholed:
                await changed.wait()
                continue
            due = received_at + self._delay
            if self._rate is not None:
                due = max(due, next_free)
            if now >= due:
                return now
            with anyio.move_on_after(due - now):
                await changed.wait()

    def _spend_cut_budget(self, chunk: bytes, direction: str) -> tuple[bytes, bool]:
        """Charge ``chunk`` to an armed ``cut_after``: the part to forward, and whether to cut."""
        budget = self._cut_budget
        if budget is None or self._cut_direction not in ("both", direction):
            return chunk, False
        if len(chunk) < budget:
            self._cut_budget = budget - len(chunk)
            return chunk, False
        self._cut_budget = None
        return chunk[:budget], True


async def _stop_reading_ahead(stream: SocketStream) -> bytes:
    """Make a freshly accepted stream stop reading ahead; return any bytes that got through.

    anyio's asyncio backend keeps reading an accepted socket into memory, without bound, until
    the first ``receive()`` (which pauses it again on the way out). A blackholed connection never
    calls ``receive()``, so without this a dialer could push any amount into the proxy and never
    feel backpressure. A ``receive()`` cancelled before it starts pauses reading and consumes
    nothing on either backend; should it still return data, the caller forwards it first.
    """
    with anyio.CancelScope() as scope:
        scope.cancel()
        return await stream.receive(CHUNK_SIZE)
    return b""


async def _finish_after_cut(receiver: SocketStream) -> None:
    """Half-close ``receiver`` after its last bytes, then drain it until its peer closes.

    Draining keeps unread bytes out of our receive buffer, so the final close is a clean FIN
    that cannot overtake (and discard) the bytes already forwarded.
    """
    with contextlib.suppress(Exception):
        await receiver.send_eof()
        while True:  # bounded by the caller's CUT_LINGER deadline
            await receiver.receive(CHUNK_SIZE)


async def _close_quietly(stream: SocketStream) -> None:
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await stream.aclose()


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago.

    The port is found by binding port 0 and closing the socket, so another process may take it
    before the caller binds it: use it for things that cannot pick their own port (a "dead"
    target to point a proxy at, a config file), not where binding port 0 works.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# ------------------------------------------------------------------------------- WorkerProcess

WORKER_STARTUP_TIMEOUT = 30.0
"""Default seconds a :class:`WorkerProcess` waits for the ``executor-listening`` line."""

_MAX_LINES = 10_000  # stdout lines kept per run (a worker prints a handful per session)
_MAX_LINE_BYTES = 64 * 1024  # a longer line is cut (the rest is dropped up to the newline)
_STDERR_TAIL = 50  # stderr lines kept for error messages


def _field(line: str, key: str) -> str | None:
    for part in line.split():
        name, sep, value = part.partition("=")
        if sep and name == key:
            return value
    return None


class _Run:
    """The output of one child process of a :class:`WorkerProcess`."""

    __slots__ = ("lines", "open_streams", "stderr")

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stderr: deque[str] = deque(maxlen=_STDERR_TAIL)
        self.open_streams = 2  # stdout and stderr; 0 once the child's output has ended


class WorkerProcess:
    """``garcon-link worker CONFIG --service ...`` in a child process a test can kill and restart.

    Use it as ``async with WorkerProcess(...) as worker:``; leaving the block kills and reaps the
    child. The config should listen on a fixed port (e.g. from :func:`free_tcp_port`) for a
    restarted worker to come back on the same URL; with port 0 :meth:`restart` fails because the
    URL changed.

    Args:
        config: the worker's TOML configuration (its ``secret_file`` must be mode 0600).
        services: ``NAME=module:attr`` arguments, each passed as ``--service``.
        cwd: the child's working directory (its modules are importable from there).
        env: variables added to the child's environment (never put a secret here).
        verbose: ``-v`` count passed to the worker (its log goes to stderr).
        startup_timeout: seconds :meth:`start` waits for ``executor-listening``.
        python: the interpreter that runs ``garcon_link.cli`` (default: this one).
        args: more ``garcon-link worker`` arguments (e.g. ``("--drain", "2")``).

    Attributes:
        starts: how many processes :meth:`start` launched so far.
    """

    def __init__(
        self,
        config: str | os.PathLike[str],
        services: Iterable[str] = (),
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        verbose: int = 0,
        startup_timeout: float = WORKER_STARTUP_TIMEOUT,
        python: str | None = None,
        args: Iterable[str] = (),
    ) -> None:
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0, got {startup_timeout!r}")
        self._config = Path(config)
        self._services = tuple(services)
        self._cwd = None if cwd is None else Path(cwd)
        self._env = dict(env or {})
        self._verbose = max(0, int(verbose))
        self._startup_timeout = startup_timeout
        self._python = python or sys.executable
        self._args = tuple(args)
        self._process: anyio.abc.Process | None = None
        self._readers: anyio.abc.TaskGroup | None = None
        self._run = _Run()
        self._changed: anyio.Event | None = None
        self._url: str | None = None
        self._entered = False
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._entered:
            raise RuntimeError("a WorkerProcess can be entered only once")
        self._entered = True
        self._changed = anyio.Event()
        readers = anyio.create_task_group()
        await readers.__aenter__()
        self._readers = readers
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        readers, self._readers = self._readers, None
        try:
            await self.aclose()
        finally:
            if readers is not None:
                readers.cancel_scope.cancel()
                await readers.__aexit__(exc_type, exc, tb)
        return None

    async def aclose(self) -> None:
        """Kill the child (if it runs) and reap it. Idempotent; :meth:`start` may follow."""
        process = self._process
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            self.kill()
            with anyio.move_on_after(10):
                await process.wait()
            if process.returncode is None:  # it closed its output but did not exit
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                with anyio.move_on_after(10):
                    await process.wait()
            with contextlib.suppress(Exception):
                await process.aclose()

    # -- observation -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The URL the worker listens on (known once :meth:`start` returned).

        Raises:
            RuntimeError: the worker was never started.
        """
        if self._url is None:
            raise RuntimeError("the worker has not been started")
        return self._url

    @property
    def pid(self) -> int:
        """The current (or last) child's process id.

        Raises:
            RuntimeError: the worker was never started.
        """
        if self._process is None:
            raise RuntimeError("the worker has not been started")
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The last child's exit status once reaped (``-9`` after :meth:`kill`), else ``None``."""
        return None if self._process is None else self._process.returncode

    @property
    def running(self) -> bool:
        """A child was started and has not been reaped yet."""
        return self._process is not None and self._process.returncode is None

    @property
    def lines(self) -> list[str]:
        """The stdout lines of the current (or last) child, in order (a copy)."""
        return list(self._run.lines)

    @property
    def stderr_tail(self) -> list[str]:
        """The last stderr lines of the current (or last) child."""
        return list(self._run.stderr)

    # -- control ---------------------------------------------------------------------------------

    async def start(self) -> str:
        """Launch the worker and wait for its ``executor-listening`` line.

        Returns:
            The URL from that line, e.g. ``ws://127.0.0.1:41234/executor``.

        Raises:
            RuntimeError: not entered, a child is still running, the child exited first, or a
                restarted worker came back on another URL.
            TimeoutError: no ``executor-listening`` line within ``startup_timeout``.
        """
        if self._readers is None or self._changed is None:
            raise RuntimeError("use `async with WorkerProcess(...)` before start()")
        if self.running:
            raise RuntimeError("the worker is still running; kill() or restart() it first")
        if self._process is not None:
            await self.aclose()
        command = [self._python, "-m", "garcon_link.cli", "worker", str(self._config)]
        for spec in self._services:
            command += ["--service", spec]
        if self._verbose:
            command.append("-" + "v" * self._verbose)
        command += self._args
        command.append("--stop-on-stdin-eof")
        env = dict(os.environ)
        env.update(self._env)
        process = await anyio.open_process(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self._cwd,
            env=env,
        )
        self._process = process
        self.starts += 1
        run = self._run = _Run()
        assert process.stdout is not None and process.stderr is not None
        self._readers.start_soon(self._read_lines, run, process.stdout, run.lines.append, True)
        self._readers.start_soon(self._read_lines, run, process.stderr, run.stderr.append, False)
        try:
            line = await self.wait_line("executor-listening", timeout=self._startup_timeout)
        except BaseException:
            await self.aclose()
            raise
        url = _field(line, "url")
        if url is None:
            await self.aclose()
            raise RuntimeError(f"no url= in the worker's line {line!r}")
        if self._url is not None and url != self._url:
            await self.aclose()
            raise RuntimeError(
                f"the restarted worker listens on {url}, not {self._url}: give the config a "
                "fixed port"
            )
        self._url = url
        logger.debug("worker process %d listening on %s", process.pid, url)
        return url

    def kill(self) -> None:
        """Send SIGKILL to the running child (no-op if none): no close frame, no cleanup.

        A child whose output already ended has exited by itself and is not signalled: sending
        a signal would make ``subprocess`` reap it behind the event loop's child watcher, which
        would then report exit status 255 instead of the real one.
        """
        process = self._process
        if process is None or process.returncode is not None or self._run.open_streams == 0:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()

    def terminate(self) -> None:
        """Send SIGTERM to the running child (no-op if none, as :meth:`kill`): a graceful stop,
        which drains running calls for ``--drain`` seconds (default 10) before it exits 0."""
        process = self._process
        if process is None or process.returncode is not None or self._run.open_streams == 0:
            return
        with contextlib.suppress(ProcessLookupError):
            process.terminate()

    async def wait(self, timeout: float = 10.0) -> int:
        """Wait for the child to exit and return its status (negative: killed by that signal).

        Raises:
            RuntimeError: the worker was never started.
            TimeoutError: it is still running after ``timeout`` seconds.
        """
        if self._process is None:
            raise RuntimeError("the worker has not been started")
        with anyio.fail_after(timeout):
            return await self._process.wait()

    async def restart(self) -> str:
        """SIGKILL the child if it runs, reap it, and start a new one on the same URL.

        Returns:
            The URL (the child's, which does not change across restarts).
        """
        await self.aclose()
        return await self.start()

    async def wait_line(self, prefix: str, *, count: int = 1, timeout: float = 10.0) -> str:
        """Wait until the current child printed ``count`` stdout lines starting with ``prefix``.

        Returns:
            The ``count``-th such line.

        Raises:
            RuntimeError: the child exited (its output ended) first; the message carries the end
                of its stderr.
            TimeoutError: not within ``timeout`` seconds.
        """
        assert self._changed is not None
        run = self._run
        with anyio.fail_after(timeout):
            while True:  # each pass waits for a new line or the end of the child's output
                matches = [line for line in run.lines if line.startswith(prefix)]
                if len(matches) >= count:
                    return matches[count - 1]
                if run.open_streams == 0:
                    tail = " | ".join(run.stderr) or "no stderr output"
                    raise RuntimeError(
                        f"the worker (pid {self.pid}) ended before printing {prefix!r} "
                        f"x{count}: {tail}"
                    )
                await self._changed.wait()

    # -- output ----------------------------------------------------------------------------------

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def _read_lines(
        self,
        run: _Run,
        stream: anyio.abc.ByteReceiveStream,
        sink: Callable[[str], None],
        bounded: bool,
    ) -> None:
        pending = bytearray()
        kept = 0
        try:
            while True:  # ends at end-of-stream (the child exited) or when closed
                try:
                    chunk = await stream.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                    break
                pending += chunk
                *complete, rest = pending.split(b"\n")
                pending = bytearray(rest[:_MAX_LINE_BYTES])
                for raw in complete:
                    if not bounded or kept < _MAX_LINES:
                        sink(raw[:_MAX_LINE_BYTES].decode(errors="replace").rstrip("\r"))
                        kept += 1
                if complete:
                    self._notify()
            if pending:
                sink(pending.decode(errors="replace"))
        finally:
            run.open_streams -= 1
            self._notify()
