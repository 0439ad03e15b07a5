"""Us: garcon_link measured exactly like the floors and peers.

``ours-call``
    a facade method call: ``await bench.echo(payload)``.
``ours-stream``
    one item pulled from an open worker stream of ``len(payload)``-byte items (items/s with
    the default credit window; concurrent callers share the one stream).
``ours-notify``
    a one-way notification to the worker whose handler sends a one-way notification back to
    the controller carrying the same payload; ``call`` returns when that one arrives.

The benchmark secret is fixed and public: both processes are on loopback and nothing else
listens for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import anyio

import garcon_link as gl

from .clients import AsyncEcho, Mode

MODE: Mode = "async"
_SECRET = gl.Secret(b"garcon-link-benchmark-secret-000")
_EXECUTOR = "bench"


class Bench(Protocol):
    async def echo(self, data: bytes) -> bytes: ...
    def items(self, data: bytes) -> AsyncIterator[bytes]: ...
    @gl.oneway
    async def ping(self, seq: int, data: bytes) -> None: ...


class Sink(Protocol):
    @gl.oneway
    async def pong(self, seq: int, data: bytes) -> None: ...


class _BenchImpl:
    async def echo(self, data: bytes) -> bytes:
        return data

    async def items(self, data: bytes) -> AsyncIterator[bytes]:
        while True:
            yield data

    @gl.oneway
    async def ping(self, seq: int, data: bytes) -> None:
        await gl.peer("sink", Sink).pong(seq, data)


def unavailable_reason() -> str | None:
    """Why garcon_link cannot be measured, or None once it can."""
    return None


async def serve(port: int, on_ready: Callable[[int], None]) -> None:
    """Serve the benchmark service with garcon_link on 127.0.0.1:``port``."""
    config = gl.LinkConfig(
        executor_id=_EXECUTOR, role=gl.Role.WORKER, secret=_SECRET, listen=("127.0.0.1", port)
    )
    async with gl.Worker(config, {"bench": gl.Service(_BenchImpl(), Bench)}) as worker:
        on_ready(worker.link.listen_address[1])
        await anyio.sleep_forever()


@asynccontextmanager
async def _executor(port: int, sink: object | None = None) -> AsyncIterator[gl.RemoteExecutor]:
    config = gl.LinkConfig(
        executor_id=_EXECUTOR,
        role=gl.Role.CONTROLLER,
        secret=_SECRET,
        dial=f"ws://127.0.0.1:{port}/executor",
    )
    services = {"sink": gl.Service(sink, Sink)} if sink is not None else None
    async with gl.connect(config, services=services) as executor:
        await executor.wait_ready(timeout=10)
        yield executor


class _Call:
    def __init__(self, bench: Bench, executor: gl.RemoteExecutor) -> None:
        self._bench = bench
        self.executor = executor  # read by callprofile.py (messages per call)

    async def call(self, payload: bytes) -> bytes:
        return await self._bench.echo(payload)


@asynccontextmanager
async def _connect_call(port: int) -> AsyncIterator[AsyncEcho]:
    async with _executor(port) as executor:
        yield _Call(executor.service("bench", Bench), executor)


class _Stream:
    def __init__(self, bench: Bench) -> None:
        self._bench = bench
        self._payload: bytes | None = None
        self._iterator: AsyncIterator[bytes] | None = None
        self._lock = anyio.Lock()

    async def call(self, payload: bytes) -> bytes:
        async with self._lock:
            if self._iterator is None or self._payload != payload:
                if self._iterator is not None:
                    await self._iterator.aclose()  # type: ignore[attr-defined]
                self._payload = payload
                self._iterator = self._bench.items(payload)
            return await self._iterator.__anext__()


@asynccontextmanager
async def _connect_stream(port: int) -> AsyncIterator[AsyncEcho]:
    async with _executor(port) as executor:
        yield _Stream(executor.service("bench", Bench))


class _Notify:
    def __init__(self) -> None:
        self._waiters: dict[int, tuple[anyio.Event, list[bytes]]] = {}
        self._seq = 0
        self.bench: Bench | None = None

    async def pong(self, seq: int, data: bytes) -> None:
        waiter = self._waiters.pop(seq, None)
        if waiter is not None:
            waiter[1].append(data)
            waiter[0].set()

    async def call(self, payload: bytes) -> bytes:
        assert self.bench is not None
        self._seq += 1
        seq = self._seq
        done = anyio.Event()
        box: list[bytes] = []
        self._waiters[seq] = (done, box)
        await self.bench.ping(seq, payload)
        await done.wait()
        return box[0]


@asynccontextmanager
async def _connect_notify(port: int) -> AsyncIterator[AsyncEcho]:
    notify = _Notify()
    async with _executor(port, sink=notify) as executor:
        notify.bench = executor.service("bench", Bench)
        yield notify


def connect_call(port: int) -> AbstractAsyncContextManager[AsyncEcho]:
    """A link whose ``call`` is a facade method call ``echo(payload)``."""
    return _connect_call(port)


def connect_stream(port: int) -> AbstractAsyncContextManager[AsyncEcho]:
    """A link whose ``call`` pulls one item from an open worker stream."""
    return _connect_stream(port)


def connect_notify(port: int) -> AbstractAsyncContextManager[AsyncEcho]:
    """A link whose ``call`` sends one notification and awaits the one sent back."""
    return _connect_notify(port)
