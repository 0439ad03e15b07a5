"""Fixtures for the RPC and facade tests: shared interfaces, instrumented services, a live pair.

A *pair* is one :class:`garcon_link.Worker` and one :class:`garcon_link.RemoteExecutor` talking
over real loopback sockets, in one of two directions:

- ``"worker-listens"``: the worker listens, the controller dials it;
- ``"controller-listens"``: the controller listens, the worker dials it.

Optionally a :class:`garcon_link.testing.FaultProxy` sits between the dialer and the listener, so
a test can refuse reconnections or blackhole the socket. :class:`Pair` can stop, start and
restart either end while the other keeps running (a restarted listener binds the same port, a
restarted dialer dials the same URL), and records the executor's availability history from its
very first transition.

The services are instrumented so that tests assert on what happened *on the worker* (how many
times a handler ran, whether it was cancelled, whether a stream's generator was closed) instead
of on timing. Every wait on those facts goes through :meth:`Probe.wait`, bounded by the caller's
``anyio.fail_after``.

:func:`raw_call` sends a hand-written ``call`` envelope over an authenticated session and waits
for the peer's reply; it reaches into ``ExecutorRpc`` internals on purpose (a hostile peer does
not use the facade).
"""

from __future__ import annotations

import contextlib
import enum
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import anyio
import anyio.abc
import cbor2
import pytest

import garcon_link as gl
from garcon_link.api.endpoint import Endpoint
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.rpc.interface import MethodKind, MethodSpec
from garcon_link.rpc.rpc import CALL, ExecutorRpc
from garcon_link.testing import FaultProxy

__all__ = [
    "DIRECTIONS",
    "LIMITS",
    "SECRET",
    "Calc",
    "CalcImpl",
    "Color",
    "Custom",
    "Direction",
    "Pair",
    "Point",
    "Probe",
    "Sink",
    "SinkImpl",
    "both_directions",
    "next_call_id",
    "own_link",
    "open_pair",
    "raw_call",
    "raw_send",
]

SECRET = gl.Secret(b"x" * 32)
LIMITS = gl.Limits(
    heartbeat_interval=0.05,
    heartbeat_timeout=0.5,
    detached_grace=1.0,
    backoff_base=0.01,
    backoff_max=0.05,
    scope_cleanup_timeout=0.5,
    call_timeout=10.0,
)
Direction = Literal["worker-listens", "controller-listens"]
DIRECTIONS: list[Direction] = ["worker-listens", "controller-listens"]
both_directions = pytest.mark.parametrize("direction", DIRECTIONS)


_T = TypeVar("_T")


def own_link(endpoint: Endpoint) -> WebSocketLink:
    """``endpoint.link`` where the test knows it is the endpoint's own link (a worker, or an
    executor outside a fleet), not a fleet member's :class:`ExecutorLink` view."""
    link = endpoint.link
    assert isinstance(link, WebSocketLink)
    return link


# ---------------------------------------------------------------------------------- value types


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass(frozen=True)
class Point:
    x: int
    y: int
    label: str | None = None


@gl.register_exception
class Custom(Exception):
    """A registered exception: re-raised as itself on the caller's side."""


# ---------------------------------------------------------------------------------- interfaces


class Calc(Protocol):
    """The worker's service, as the controller sees it."""

    async def add(self, a: int, b: int) -> int: ...
    async def record(self, token: int, gated: bool = False) -> int: ...
    async def hold(self, key: str) -> str: ...
    async def fail(self, message: str) -> int: ...
    async def fail_custom(self, message: str) -> int: ...
    async def fail_reject(self) -> int: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    def ticks(self, key: str) -> AsyncIterator[int]: ...
    async def open_job(self, name: str) -> gl.ResourceRef: ...
    async def job_name(self, ref: gl.ResourceRef) -> str: ...
    async def relay(self, text: str) -> int: ...
    @gl.oneway
    async def note(self, text: str) -> None: ...
    @gl.oneway
    async def park(self) -> None: ...


class Sink(Protocol):
    """The controller's service, called back by worker handlers."""

    async def push(self, text: str) -> int: ...
    @gl.oneway
    async def event(self, text: str) -> None: ...


# ---------------------------------------------------------------------------------- probes


class Probe:
    """Named one-shot facts (``"started:k"``, ``"cancelled:k"``...) that tests can wait for."""

    def __init__(self) -> None:
        self.facts: list[str] = []
        self._events: dict[str, anyio.Event] = {}

    def _event(self, name: str) -> anyio.Event:
        if name not in self._events:
            self._events[name] = anyio.Event()
        return self._events[name]

    def mark(self, name: str) -> None:
        self.facts.append(name)
        self._event(name).set()

    def __contains__(self, name: str) -> bool:
        return self._event(name).is_set()

    async def wait(self, name: str) -> None:
        await self._event(name).wait()


class CalcImpl:
    """Implementation of :class:`Calc` that records what ran, what was cancelled, what closed."""

    def __init__(self) -> None:
        self.probe = Probe()
        self.counts: Counter[Any] = Counter()
        self.gate = anyio.Event()
        self.notes: list[str] = []
        self.jobs: dict[str, str] = {}
        self.stream_delay = 0.0
        self._releases: dict[str, anyio.Event] = {}

    # test helpers: private, so never exposed (a public plain ``def`` would be refused)
    def _release(self, key: str) -> None:
        self._release_event(key).set()

    def _release_event(self, key: str) -> anyio.Event:
        if key not in self._releases:
            self._releases[key] = anyio.Event()
        return self._releases[key]

    async def add(self, a: int, b: int) -> int:
        self.counts["add"] += 1
        return a + b

    async def record(self, token: int, gated: bool = False) -> int:
        self.counts[token] += 1
        self.probe.mark(f"record:{token}")
        if gated:
            await self.gate.wait()
        return token * 2

    async def hold(self, key: str) -> str:
        self.counts[key] += 1
        self.probe.mark(f"started:{key}")
        try:
            await self._release_event(key).wait()
        except anyio.get_cancelled_exc_class():
            self.probe.mark(f"cancelled:{key}")
            raise
        return key

    async def fail(self, message: str) -> int:
        raise ValueError(message)

    async def fail_custom(self, message: str) -> int:
        raise Custom(message)

    async def fail_reject(self) -> int:
        raise gl.Rejected("NOT_NOW", "the handler refused")

    async def count(self, n: int) -> AsyncIterator[int]:
        self.counts["count"] += 1
        for i in range(n):
            yield i
            if self.stream_delay:
                await anyio.sleep(self.stream_delay)
            else:
                await anyio.lowlevel.checkpoint()

    async def ticks(self, key: str) -> AsyncIterator[int]:
        self.probe.mark(f"stream-started:{key}")
        i = 0
        try:
            while True:
                yield i
                i += 1
                await anyio.lowlevel.checkpoint()
        finally:
            self.probe.mark(f"stream-closed:{key}")

    async def open_job(self, name: str) -> gl.ResourceRef:
        ref = gl.current_scope().resource("job", f"job-{len(self.jobs)}")
        self.jobs[ref.id] = name
        return ref

    async def job_name(self, ref: gl.ResourceRef) -> str:
        return self.jobs[gl.current_scope().check(ref, "job")]

    async def relay(self, text: str) -> int:
        sink = gl.peer("sink", Sink)
        await sink.event(f"before {text}")
        return await sink.push(text)

    async def note(self, text: str) -> None:
        self.notes.append(text)
        self.probe.mark(f"note:{text}")

    async def park(self) -> None:
        self.counts["parked"] += 1
        await self.gate.wait()

    async def _secret(self) -> int:  # never exposed: leading underscore
        self.counts["secret"] += 1
        return 42


class SinkImpl:
    def __init__(self) -> None:
        self.pushed: list[str] = []
        self.events: list[str] = []
        self.probe = Probe()

    async def push(self, text: str) -> int:
        self.pushed.append(text)
        return len(text)

    async def event(self, text: str) -> None:
        self.events.append(text)
        self.probe.mark(f"event:{text}")


# ---------------------------------------------------------------------------------- the pair

Services = Any  # a mapping name -> object/Service, or a per-session scope factory


@dataclass
class Pair:
    """A running worker + executor; see the module docstring."""

    direction: Direction
    limits: gl.Limits
    worker_limits: gl.Limits
    controller_services: dict[str, Any] | None
    use_proxy: bool
    hooks: tuple[Any, ...] = ()
    worker_hooks: tuple[Any, ...] = ()
    executor: gl.RemoteExecutor = field(init=False)
    worker: gl.Worker | None = field(default=None, init=False)
    proxy: FaultProxy | None = field(default=None, init=False)
    history: list[str] = field(default_factory=list, init=False)
    _tg: anyio.abc.TaskGroup | None = field(default=None, init=False)
    _worker_host: _Host | None = field(default=None, init=False)
    _controller_host: _Host | None = field(default=None, init=False)
    _listen_port: int = field(default=0, init=False)

    def restarts(self) -> list[str]:
        """:attr:`history` without its ``reconnecting`` spells (a socket lost, then resumed or
        given up: on a starved machine a worker's stop may be seen as a lost socket first, or a
        heartbeat may time out), consecutive repeats folded: for tests about sessions ending
        and starting."""
        out: list[str] = []
        for state in self.history:
            if state != "reconnecting" and out[-1:] != [state]:
                out.append(state)
        return out

    # -- what a dialer dials

    def _listener_url(self) -> str:
        if self.proxy is not None:
            return self.proxy.url("/executor")
        listener = self.worker if self.direction == "worker-listens" else self.executor
        assert listener is not None
        return listener.link.url

    async def _ensure_proxy(self, port: int) -> None:
        if self.use_proxy and self.proxy is None:
            self.proxy = await _Host().start(self._task_group, FaultProxy("127.0.0.1", port))

    @property
    def _task_group(self) -> anyio.abc.TaskGroup:
        assert self._tg is not None
        return self._tg

    # -- ends

    async def start_worker(self, services: Services) -> gl.Worker:
        assert self.worker is None
        if self.direction == "worker-listens":
            cfg = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.WORKER,
                secret=SECRET,
                listen=("127.0.0.1", self._listen_port),
                limits=self.worker_limits,
            )
        else:
            cfg = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.WORKER,
                secret=SECRET,
                dial=self._listener_url(),
                limits=self.worker_limits,
            )
        host = _Host()
        worker = await host.start(
            self._task_group, gl.Worker(cfg, services, hooks=self.worker_hooks)
        )
        self._worker_host, self.worker = host, worker
        if self.direction == "worker-listens":
            self._listen_port = own_link(worker).listen_address[1]
            await self._ensure_proxy(self._listen_port)
        return worker

    async def stop_worker(self) -> None:
        assert self._worker_host is not None
        host, self._worker_host, self.worker = self._worker_host, None, None
        await host.stop()

    async def crash_worker(self) -> None:
        """Stop the worker as a killed process would: no close frame reaches the controller."""
        assert self.worker is not None
        await own_link(self.worker).abort()
        await self.stop_worker()

    async def restart_worker(self, services: Services) -> gl.Worker:
        await self.stop_worker()
        return await self.start_worker(services)

    async def start_controller(self) -> gl.RemoteExecutor:
        assert self._controller_host is None
        if self.direction == "controller-listens":
            cfg = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.CONTROLLER,
                secret=SECRET,
                listen=("127.0.0.1", self._listen_port),
                limits=self.limits,
            )
        else:
            cfg = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.CONTROLLER,
                secret=SECRET,
                dial=self._listener_url(),
                limits=self.limits,
            )
        executor = gl.connect(cfg, services=self.controller_services, hooks=self.hooks)
        self.history = []
        executor.on_availability_changed(self.history.append)
        host = _Host()
        await host.start(self._task_group, executor)
        self._controller_host, self.executor = host, executor
        if self.direction == "controller-listens":
            self._listen_port = own_link(executor).listen_address[1]
            await self._ensure_proxy(self._listen_port)
        return executor

    async def stop_controller(self) -> None:
        assert self._controller_host is not None
        host, self._controller_host = self._controller_host, None
        await host.stop()

    # -- conveniences

    @property
    def live_worker(self) -> gl.Worker:
        """The running worker (between ``start_worker`` and ``stop_worker``)."""
        assert self.worker is not None, "no running worker"
        return self.worker

    @property
    def worker_rpc(self) -> ExecutorRpc:
        """The running worker's current session."""
        rpc = self.live_worker.current_rpc
        assert rpc is not None, "no current session on the worker"
        return rpc

    @property
    def rpc(self) -> ExecutorRpc:
        rpc = self.executor.current_rpc
        assert rpc is not None, "no current session"
        return rpc

    def calc(self) -> Calc:
        return self.executor.service("calc", Calc)

    async def disconnect(self) -> None:
        """Cut the socket abruptly (resumable) and wait until the session is ready again."""
        await self.executor.link.disconnect()
        await self.wait_attached_again()

    async def wait_attached_again(self) -> None:
        transport = self.executor.link.transport
        while transport is not None and not transport.attached:
            await anyio.sleep(0.005)
        await self.executor.wait_ready()

    async def wait_availability(self, value: str) -> None:
        while self.executor.availability != value:
            await anyio.sleep(0.005)


@contextlib.asynccontextmanager
async def open_pair(
    direction: Direction,
    services: Services,
    *,
    controller_services: dict[str, Any] | None = None,
    limits: gl.Limits = LIMITS,
    worker_limits: gl.Limits | None = None,
    proxy: bool = False,
    ready: bool = True,
    hooks: tuple[Any, ...] = (),
    worker_hooks: tuple[Any, ...] = (),
) -> AsyncIterator[Pair]:
    """Start a pair (listener first) and wait until the executor is ready."""
    pair = Pair(
        direction, limits, worker_limits or limits, controller_services, proxy, hooks, worker_hooks
    )
    async with anyio.create_task_group() as tg:
        pair._tg = tg
        try:
            if direction == "worker-listens":
                await pair.start_worker(services)
                await pair.start_controller()
            else:
                await pair.start_controller()
                await pair.start_worker(services)
            if ready:
                await pair.executor.wait_ready(5)
            yield pair
        finally:
            with anyio.CancelScope(shield=True), anyio.fail_after(10):
                if pair._controller_host is not None:
                    await pair.stop_controller()
                if pair._worker_host is not None:
                    await pair.stop_worker()
            tg.cancel_scope.cancel()  # the proxy, if any


class _Host:
    """Runs one async context manager in its own task, so ends stop in any order."""

    def __init__(self) -> None:
        self._stop = anyio.Event()
        self._done = anyio.Event()

    async def start(self, tg: anyio.abc.TaskGroup, cm: AbstractAsyncContextManager[_T]) -> _T:
        value: _T = await tg.start(self._run, cm)
        return value

    async def _run(self, cm: Any, *, task_status: anyio.abc.TaskStatus[Any]) -> None:
        try:
            async with cm as value:
                task_status.started(value)
                await self._stop.wait()
        finally:
            self._done.set()

    async def stop(self) -> None:
        self._stop.set()
        await self._done.wait()


# ---------------------------------------------------------------------------------- raw envelopes

_ANY_SPEC = MethodSpec(
    name="raw",
    kind=MethodKind.UNARY,
    signature=__import__("inspect").Signature(),
    hints={},
    result=Any,
)


async def raw_send(rpc: ExecutorRpc, envelope: Any) -> None:
    """Send ``envelope`` (any CBOR value, or raw ``bytes`` as the body) on the session."""
    body = envelope if isinstance(envelope, bytes) else cbor2.dumps(envelope)
    await rpc.transport.send(body)


def next_call_id(rpc: ExecutorRpc) -> int:
    """Allocate the next call id the way ExecutorRpc does (ids stay increasing)."""
    return rpc.next_call_id()


async def raw_call(
    rpc: ExecutorRpc,
    service: Any,
    method: Any,
    args: Any = (),
    kwargs: Any = None,
    credit: tuple[Any, Any] = (0, 0),
    *,
    envelope: Callable[[int], list[Any]] | None = None,
) -> Any:
    """Send a hand-written ``call`` and return the reply's value, or raise its error."""
    call_id = next_call_id(rpc)
    expected = rpc.expect_reply(call_id, _ANY_SPEC)
    if envelope is not None:
        message = envelope(call_id)
    else:
        message = [
            CALL,
            call_id,
            service,
            method,
            list(args) if isinstance(args, tuple) else args,
            {} if kwargs is None else kwargs,
            *credit,
        ]
    try:
        await raw_send(rpc, message)
        return await expected.wait()
    finally:
        expected.close()
