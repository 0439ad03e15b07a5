"""``garcon-link demo``: the library's promises, shown on loopback against a real worker process.

Theory of operation
-------------------
The demo writes a fresh secret (mode 0600) and two TOML configs into a temporary directory, starts
``garcon-link worker`` as a **child process** serving :class:`DemoService`, and runs a controller
in this process that dials it. Small :class:`~garcon_link.Limits` (:data:`DEMO_LIMITS`) keep every
reconnect and expiry under a few seconds. Then, narrating each step with timings:

1. **calls** -- results come back correct; a raising handler arrives as ``RemoteError``;
2. **a stream** -- every item, in order;
3. **a socket cut mid-stream** (``executor.link.disconnect()``) -- the same logical session
   resumes: expected N, received N, no duplicates, nothing missing, same session id, and the
   worker announced no new session;
4. **a worker kill** (SIGKILL) while a call is executing -- that call fails ``OutcomeUnknown``
   (never retried); calls while the worker is gone fail ``NotDispatched`` at once; the worker is
   restarted on the same port and the *same facade object* works on a fresh session (new session
   and instance ids, cross-checked against the worker's ``executor-ready`` line);
5. **a graceful stop** (SIGTERM) while a call is executing -- the worker drains: it prints
   ``executor-draining``, a new call fails ``NotDispatched("DRAINING")`` at once (it never ran),
   the executing call finishes with its real result, then the worker exits 0 and the executor
   goes ``offline``;
6. a summary table (step, promise, observed, ok).

The exit code is 0 only if every promise was observed. Every wait is bounded; the child process
is killed on every exit path (``finally`` in the async code, and again by pid in
:func:`run_demo`, which also covers Ctrl-C).

The module is importable by the worker child (``--service demo=garcon_link.demo:DemoService``)
and has no side effects on import.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.text import TextReceiveStream

from .api.controller import Availability, RemoteExecutor, connect
from .api.options import with_options
from .errors import CallError, NotDispatched, OutcomeUnknown, RemoteError
from .settings.config import load_config
from .settings.secrets import write_secret_file

__all__ = ["DEMO_LIMITS", "DemoApi", "DemoService", "run_demo"]

DEMO_LIMITS: dict[str, float] = {
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 2.0,
    "detached_grace": 2.0,
    "replay_inactivity": 5.0,
    "connect_timeout": 2.0,
    "backoff_base": 0.05,
    "backoff_max": 0.25,
    "backoff_reset_after": 1.0,
    "scope_cleanup_timeout": 1.0,
}
"""Small time bounds so a cut resumes in milliseconds and a lost worker is retired in 2 s."""

EXECUTOR_ID = "demo-worker"
_STARTUP_TIMEOUT = 15.0
_STEP_TIMEOUT = 10.0
_SERVICE_ARG = "demo=garcon_link.demo:DemoService"
_DRAIN_HOLD = 1.5  # seconds the call executing at SIGTERM still takes (the drain waits for it)

# Pids of live worker children, killed again by run_demo() whatever happened.
_children: set[int] = set()


# --------------------------------------------------------------------------- the service


class DemoApi(Protocol):
    """The contract the controller uses (the worker serves :class:`DemoService`)."""

    async def add(self, a: int, b: int) -> int: ...

    async def echo(self, text: str) -> str: ...

    async def fail(self, message: str) -> None: ...

    def count(self, n: int) -> AsyncIterator[int]: ...

    async def hold(self, seconds: float) -> str: ...

    async def holding(self) -> int: ...


class DemoService:
    """What the demo's worker serves: arithmetic, an echo, a failure, a stream and a slow call."""

    def __init__(self) -> None:
        self._holding = 0

    async def add(self, a: int, b: int) -> int:
        return a + b

    async def echo(self, text: str) -> str:
        return text

    async def fail(self, message: str) -> None:
        raise ValueError(message)

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
            if i % 64 == 63:
                await anyio.lowlevel.checkpoint()

    async def hold(self, seconds: float) -> str:
        """Stay busy for ``seconds`` (the demo kills the worker meanwhile)."""
        self._holding += 1
        try:
            await anyio.sleep(seconds)
        finally:
            self._holding -= 1
        return "done"

    async def holding(self) -> int:
        """How many ``hold`` calls are executing right now."""
        return self._holding


# --------------------------------------------------------------------------- narration


def _say(text: str = "") -> None:
    print(text, flush=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _short(ident: bytes) -> str:
    return ident.hex()[:12]


@dataclass
class _Result:
    step: str
    promise: str
    observed: str = "not run"
    ok: bool = False


@dataclass
class _Availability:
    """Availability transitions with their times (perf_counter)."""

    history: list[tuple[float, Availability]] = field(default_factory=list)
    # Created by the first waiter (an anyio.Event needs a running event loop).
    changed: anyio.Event | None = None

    def __call__(self, value: Availability) -> None:
        self.history.append((time.perf_counter(), value))
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    def since(self, t0: float) -> list[Availability]:
        return [value for t, value in self.history if t >= t0]

    async def wait_for(self, executor: RemoteExecutor, value: Availability) -> float:
        with anyio.fail_after(_STEP_TIMEOUT):
            while executor.availability != value:
                if self.changed is None:
                    self.changed = anyio.Event()
                await self.changed.wait()
        return time.perf_counter()


# --------------------------------------------------------------------------- the worker child


class _WorkerProcess:
    """``garcon-link worker`` in a child process; its stdout lines are collected as they come."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.lines: list[str] = []
        self.errors: collections.deque[str] = collections.deque(maxlen=20)
        self._process: anyio.abc.Process | None = None
        self._new_line: anyio.Event | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def start(self, tg: anyio.abc.TaskGroup) -> str:
        """Start the worker and return the URL it listens on."""
        command = [
            sys.executable,
            "-m",
            "garcon_link.cli",
            "worker",
            str(self.config),
            "--service",
            _SERVICE_ARG,
            "--stop-on-stdin-eof",
        ]
        # No secret in the environment or the command line: the child reads its secret file.
        # Its stdin is a pipe we never write: if this process dies, the worker sees EOF and stops.
        self._process = await anyio.open_process(command, stdin=subprocess.PIPE)
        _children.add(self._process.pid)
        assert self._process.stdout is not None and self._process.stderr is not None
        tg.start_soon(self._collect, self._process.stdout, self.lines)
        tg.start_soon(self._collect, self._process.stderr, self.errors)
        line = await self.wait_line("executor-listening", 0, _STARTUP_TIMEOUT)
        return _field(line, "url")

    async def _collect(
        self, stream: anyio.abc.ByteReceiveStream, sink: list[str] | collections.deque[str]
    ) -> None:
        pending = ""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for chunk in TextReceiveStream(stream, errors="replace"):
                pending += chunk
                *complete, pending = pending.split("\n")
                for line in complete:
                    sink.append(line.rstrip("\r"))
                if self._new_line is not None:
                    self._new_line.set()
                    self._new_line = None

    async def wait_line(self, prefix: str, start: int, timeout: float) -> str:
        """The first stdout line from index ``start`` on that starts with ``prefix``."""
        with anyio.fail_after(timeout):
            while True:
                for line in self.lines[start:]:
                    if line.startswith(prefix):
                        return line
                if self._process is not None and self._process.returncode is not None:
                    raise RuntimeError(
                        f"the worker exited with code {self._process.returncode}: "
                        + (self.errors[-1] if self.errors else "no output")
                    )
                if self._new_line is None:
                    self._new_line = anyio.Event()
                with anyio.move_on_after(0.2):
                    await self._new_line.wait()

    def kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

    def terminate(self) -> None:
        """SIGTERM: the worker drains (``--drain``, 10 s by default), then exits 0."""
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()

    async def wait_exit(self, timeout: float) -> int:
        assert self._process is not None
        with anyio.fail_after(timeout):
            return await self._process.wait()

    async def stop(self) -> None:
        """Kill (if still running) and reap the child; safe to call twice."""
        process = self._process
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            with anyio.move_on_after(5):
                await process.wait()
            await process.aclose()
        _children.discard(process.pid)


def _field(line: str, key: str) -> str:
    for part in line.split():
        name, _, value = part.partition("=")
        if name == key:
            return value
    raise RuntimeError(f"no {key}= in {line!r}")


def _worker_toml(listen: str) -> str:
    limits = "\n".join(f"{k} = {v}" for k, v in DEMO_LIMITS.items())
    return (
        f'executor_id = "{EXECUTOR_ID}"\nrole = "worker"\nsecret_file = "link.secret"\n\n'
        f'[connection]\nlisten = "{listen}"\n\n[limits]\n{limits}\n'
    )


def _controller_toml(url: str) -> str:
    limits = "\n".join(f"{k} = {v}" for k, v in DEMO_LIMITS.items())
    return (
        f'executor_id = "{EXECUTOR_ID}"\nrole = "controller"\nsecret_file = "link.secret"\n\n'
        f'[connection]\ndial = "{url}"\n\n[limits]\n{limits}\n'
    )


# --------------------------------------------------------------------------- the steps

_LABEL = 36  # width of the "what was done" column of the narration


def _row(label: str, result: str, timing: str = "", detail: str = "") -> None:
    """One aligned narration line, plus an optional wrapped detail line under the result."""
    _say(f"   {label:<{_LABEL}} -> {result}" + (f"  ({timing})" if timing else ""))
    if detail:
        for line in textwrap.wrap(detail, width=96 - _LABEL):
            _say(" " * (_LABEL + 7) + line)


async def _hold_in_task(
    tg: anyio.abc.TaskGroup, demo: DemoApi, seconds: float
) -> tuple[list[BaseException | str], anyio.Event]:
    """Start ``demo.hold(seconds)`` in a task of ``tg`` and return once the worker executes it:
    the list its outcome goes to, and the event set when it ends."""
    outcome: list[BaseException | str] = []
    finished = anyio.Event()

    async def pending_call() -> None:
        try:
            outcome.append(await demo.hold(seconds))
        except Exception as exc:
            outcome.append(exc)
        finally:
            finished.set()

    tg.start_soon(pending_call)
    with anyio.fail_after(_STEP_TIMEOUT):
        while True:  # the worker's count is polled: a remote call, not an event here
            if await demo.holding() >= 1:
                break
            await anyio.sleep(0.01)
    _row(f"start demo.hold({seconds:g}) in a task", "executing on the worker (pending here)")
    return outcome, finished


def _note(text: str) -> None:
    _say(f"   {text}")


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, CallError):
        return f"{type(exc).__name__} [{exc.outcome.value}:{exc.code}]"
    return f"{type(exc).__name__}: {exc}"


def _detail(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return f"{exc.message} (remote {exc.remote_type})"
    return exc.message if isinstance(exc, CallError) else ""


class _Demo:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.results = [
            _Result("1 calls", "correct results; a raising handler -> RemoteError"),
            _Result("2 stream", "every item, in order"),
            _Result("3 socket cut", "same session resumes, nothing lost or doubled"),
            _Result("4a worker killed", "the executing call -> OutcomeUnknown"),
            _Result("4b worker gone", "calls fail at once: NotDispatched"),
            _Result("4c worker restarted", "same facade works on a fresh session"),
            _Result("5a SIGTERM, drain", "the executing call finishes with its result"),
            _Result("5b SIGTERM, new call", "refused at once: NotDispatched DRAINING"),
        ]
        self.worker: _WorkerProcess | None = None
        self.availability = _Availability()
        self.elapsed = 0.0

    async def run(self) -> None:
        t_start = time.perf_counter()
        _say("garcon-link demo: a worker in a child process, a controller here, on loopback")
        _say()
        _say("0. setup")
        secret = write_secret_file(self.workdir / "link.secret")
        worker_toml = anyio.Path(self.workdir / "worker.toml")
        await worker_toml.write_text(_worker_toml("127.0.0.1:0"), encoding="utf-8")
        _note(f"fresh secret {secret} (mode 0600), configs beside it")
        try:
            async with anyio.create_task_group() as tg:
                try:
                    await self._run(tg, worker_toml)
                finally:
                    if self.worker is not None:
                        await self.worker.stop()
                    tg.cancel_scope.cancel()
        finally:
            self.elapsed = time.perf_counter() - t_start

    async def _run(self, tg: anyio.abc.TaskGroup, worker_toml: anyio.Path) -> None:
        t0 = time.perf_counter()
        self.worker = _WorkerProcess(Path(worker_toml))
        url = await self.worker.start(tg)
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        _row(f"start `garcon-link worker` (pid {self.worker.pid})", "listening", _ms_since(t0))
        _note(f"  worker says: {self.worker.lines[0]}")
        controller_toml = anyio.Path(self.workdir / "controller.toml")
        await controller_toml.write_text(_controller_toml(url), encoding="utf-8")
        config = load_config(controller_toml)

        t0 = time.perf_counter()
        async with connect(config) as executor:
            executor.on_availability_changed(self.availability)
            await executor.wait_ready(timeout=_STARTUP_TIMEOUT)
            info = await executor.info()
            _row("controller: connect + wait_ready", "ready", _ms_since(t0))
            announced = await self.worker.wait_line("executor-ready", 0, _STEP_TIMEOUT)
            _note(f"  worker says: {_abbreviate(announced)}")
            _note(f"  session {_short(info.session_id)}  instance {_short(info.instance_id)}")
            demo = executor.service("demo", DemoApi)
            steps: list[Callable[[], Awaitable[None]]] = [
                lambda: self._calls(demo),
                lambda: self._stream(demo),
                lambda: self._cut(executor, demo),
                lambda: self._kill_and_restart(tg, executor, demo, worker_toml, port),
                lambda: self._drain(tg, executor, demo),
            ]
            for step in steps:
                try:
                    with anyio.fail_after(3 * _STEP_TIMEOUT):
                        await step()
                except Exception as exc:
                    _note(f"!! the step failed: {type(exc).__name__}: {exc}")
                    if self.worker.errors:
                        _note("!! the worker's stderr ends with:")
                        for line in self.worker.errors:
                            _note(f"   {line}")
                    break

    # -- 1

    async def _calls(self, demo: DemoApi) -> None:
        result = self.results[0]
        _say()
        _say("1. calls (demo = executor.service('demo', DemoApi), a typed facade)")
        t0 = time.perf_counter()
        total = await demo.add(2, 3)
        _row("await demo.add(2, 3)", repr(total), _ms_since(t0))
        t0 = time.perf_counter()
        text = await demo.echo("héllo, wörker")
        _row("await demo.echo('héllo, wörker')", repr(text), _ms_since(t0))
        n = 200
        t0 = time.perf_counter()
        correct = 0
        for i in range(n):
            correct += await demo.add(i, i) == 2 * i
        elapsed = time.perf_counter() - t0
        _row(
            f"{n} sequential demo.add calls",
            f"{correct}/{n} correct",
            f"{_ms(elapsed)}, {elapsed / n * 1e6:.0f} us/call",
        )
        raised: RemoteError | None = None
        t0 = time.perf_counter()
        try:
            await demo.fail("boom")
        except RemoteError as exc:
            raised = exc
        if raised is not None:
            _row("await demo.fail('boom')", _outcome(raised), _ms_since(t0), _detail(raised))
        else:
            _row("await demo.fail('boom')", "returned (expected RemoteError)", _ms_since(t0))
        result.ok = total == 5 and text == "héllo, wörker" and correct == n and raised is not None
        result.observed = f"{correct + (total == 5) + (text == 'héllo, wörker')}/{n + 2} correct"
        result.observed += ", RemoteError" if raised is not None else ", no RemoteError"

    # -- 2

    async def _stream(self, demo: DemoApi) -> None:
        result = self.results[1]
        _say()
        _say("2. a stream (an async generator on the worker, credit flow control)")
        n = 1000
        t0 = time.perf_counter()
        items = [i async for i in demo.count(n)]
        in_order = items == list(range(n))
        order = "in order" if in_order else "OUT OF ORDER"
        _row(f"async for i in demo.count({n})", f"{len(items)} items, {order}", _ms_since(t0))
        result.observed = f"{len(items)}/{n} items, {order}"
        result.ok = in_order

    # -- 3

    async def _cut(self, executor: RemoteExecutor, demo: DemoApi) -> None:
        result = self.results[2]
        assert self.worker is not None
        _say()
        _say("3. a socket cut in the middle of a stream")
        n, cut_at = 2000, 1000
        transport = executor.link.transport
        assert transport is not None
        session_before = transport.session_id
        stats_before = executor.link.statistics()
        worker_lines_before = len(self.worker.lines)
        received: list[int] = []
        t_cut = 0.0
        t0 = time.perf_counter()
        async for i in demo.count(n):
            received.append(i)
            if len(received) == cut_at:
                t_cut = time.perf_counter()
                await executor.link.disconnect()
                _row(
                    f"after item {cut_at} of demo.count({n})",
                    "executor.link.disconnect() (socket aborted)",
                )
        elapsed = time.perf_counter() - t0
        if executor.availability != "ready":
            await self.availability.wait_for(executor, "ready")
        path = " -> ".join(["ready", *self.availability.since(t_cut)])
        resumed_at = next(
            (t for t, v in self.availability.history if t >= t_cut and v == "ready"), None
        )
        back = f"back after {_ms(resumed_at - t_cut)}" if resumed_at is not None else ""
        _row("availability", path, back)

        counts = collections.Counter(received)
        duplicates = sum(c - 1 for c in counts.values() if c > 1)
        missing = len(set(range(n)) - set(counts))
        in_order = received == sorted(received)
        after = executor.link.transport
        session_after = after.session_id if after is not None else b""
        stats_after = executor.link.statistics()
        resumes = stats_after.resumed - stats_before.resumed
        fresh = stats_after.fresh_sessions - stats_before.fresh_sessions
        announced = [
            line
            for line in self.worker.lines[worker_lines_before:]
            if line.startswith("executor-ready")
        ]
        same = session_after == session_before
        _row(
            "the stream, end to end",
            f"expected {n}, received {len(received)}, duplicates {duplicates}, missing {missing}",
            _ms(elapsed),
        )
        _row("item order", "in order" if in_order else "OUT OF ORDER")
        _row(
            "logical session",
            f"{_short(session_before)} -> {_short(session_after)} "
            f"({'unchanged' if same else 'CHANGED'})",
        )
        _row(
            "link statistics / worker output",
            f"{resumes} resume, {fresh} fresh sessions; {len(announced)} new executor-ready",
        )
        result.observed = (
            f"{len(received)}/{n}, dup {duplicates}, missing {missing}, "
            f"{'same session' if same else 'NEW SESSION'}"
        )
        result.ok = (
            len(received) == n
            and duplicates == 0
            and missing == 0
            and in_order
            and same
            and resumes >= 1
            and fresh == 0
            and not announced
        )

    # -- 4

    async def _kill_and_restart(
        self,
        tg: anyio.abc.TaskGroup,
        executor: RemoteExecutor,
        demo: DemoApi,
        worker_toml: anyio.Path,
        port: int,
    ) -> None:
        killed, gone, restarted = self.results[3], self.results[4], self.results[5]
        assert self.worker is not None
        _say()
        _say("4. the worker is killed while a call is executing, then restarted")
        info_before = await executor.info()
        outcome, finished = await _hold_in_task(tg, demo, 30)

        old_pid = self.worker.pid
        t_kill = time.perf_counter()
        self.worker.kill()
        _row(f"SIGKILL the worker (pid {old_pid})", "killed")
        t_noticed = await self.availability.wait_for(executor, "reconnecting")
        _row("availability", "ready -> reconnecting", f"{_ms(t_noticed - t_kill)} after the kill")

        fast = True
        codes: list[str] = []
        for state in ("reconnecting", "offline"):
            if state == "offline":
                with anyio.fail_after(_STEP_TIMEOUT):
                    await finished.wait()
                got = outcome[0] if outcome else "nothing"
                t_done = time.perf_counter()
                if isinstance(got, BaseException):
                    shown, detail = _outcome(got), _detail(got)
                else:
                    shown, detail = f"returned {got!r} (expected OutcomeUnknown)", ""
                grace = f"detached grace {DEMO_LIMITS['detached_grace']:g} s"
                _row(
                    "the pending demo.hold(30)",
                    shown,
                    f"{_ms(t_done - t_kill)} after the kill; {grace}",
                    detail,
                )
                killed.ok = isinstance(got, OutcomeUnknown)
                killed.observed = f"{shown.split(' ')[0]} after {_ms(t_done - t_kill)}"
                await self.availability.wait_for(executor, "offline")
                _row("availability", "reconnecting -> offline (session retired)")
            t0 = time.perf_counter()
            try:
                value: Any = await demo.add(1, 1)
            except NotDispatched as exc:
                value = exc
            elapsed = time.perf_counter() - t0
            fast = fast and elapsed < 0.5 and isinstance(value, NotDispatched)
            if isinstance(value, NotDispatched):
                codes.append(value.code)
                _row(f"demo.add(1, 1) while {state}", _outcome(value), _ms(elapsed), value.message)
            else:
                _row(f"demo.add(1, 1) while {state}", f"returned {value!r}", _ms(elapsed))
        gone.ok = fast and len(codes) == 2
        gone.observed = f"{', '.join(codes) or 'no NotDispatched'} (each < 0.5 s)"

        await worker_toml.write_text(_worker_toml(f"127.0.0.1:{port}"), encoding="utf-8")
        self.worker = _WorkerProcess(Path(worker_toml))
        t0 = time.perf_counter()
        await self.worker.start(tg)
        _row(f"restart the worker (pid {self.worker.pid})", f"listening on the same port {port}")
        await self.availability.wait_for(executor, "ready")
        _row("availability", "offline -> ready", f"{_ms_since(t0)} after the restart")
        t0 = time.perf_counter()
        value = await with_options(demo, timeout=_STEP_TIMEOUT).add(2, 3)
        _row("the same facade: demo.add(2, 3)", repr(value), _ms_since(t0))
        info = await executor.info()
        announced = await self.worker.wait_line("executor-ready", 0, _STEP_TIMEOUT)
        worker_session = _field(announced, "session")
        new_session = info.session_id != info_before.session_id
        new_instance = info.instance_id != info_before.instance_id
        agrees = worker_session == info.session_id.hex()
        _row(
            "logical session",
            f"{_short(info_before.session_id)} -> {_short(info.session_id)} "
            f"({'new' if new_session else 'UNCHANGED'})",
        )
        _row(
            "worker instance (service scope)",
            f"{_short(info_before.instance_id)} -> {_short(info.instance_id)} "
            f"({'new' if new_instance else 'UNCHANGED'})",
        )
        _row(
            "the worker's executor-ready line",
            f"session={worker_session[:12]} ({'matches' if agrees else 'DOES NOT MATCH'})",
        )
        restarted.ok = value == 5 and new_session and new_instance and agrees
        restarted.observed = (
            f"add -> {value!r}, {'new' if new_session else 'SAME'} session, "
            f"{'new' if new_instance else 'SAME'} instance"
        )

    # -- 5

    async def _drain(
        self, tg: anyio.abc.TaskGroup, executor: RemoteExecutor, demo: DemoApi
    ) -> None:
        finished, refused = self.results[6], self.results[7]
        worker = self.worker
        assert worker is not None
        _say()
        _say("5. the worker is stopped gracefully (SIGTERM) while a call is executing")
        outcome, done = await _hold_in_task(tg, demo, _DRAIN_HOLD)
        lines_before = len(worker.lines)
        t_term = time.perf_counter()
        worker.terminate()
        draining = await worker.wait_line("executor-draining", lines_before, _STEP_TIMEOUT)
        _row(f"SIGTERM the worker (pid {worker.pid})", "draining", _ms_since(t_term))
        _note(f"  worker says: {draining}")
        await self.availability.wait_for(executor, "draining")  # held open by the pending call
        _row("availability", "ready -> draining (the worker's goodbye)", _ms_since(t_term))

        t0 = time.perf_counter()
        try:
            value: Any = await demo.add(1, 1)
        except NotDispatched as exc:
            value = exc
        elapsed = time.perf_counter() - t0
        if isinstance(value, NotDispatched):
            _row("demo.add(1, 1) while draining", _outcome(value), _ms(elapsed), value.message)
            refused.observed = f"{value.code} after {_ms(elapsed)}"
            refused.ok = value.code == "DRAINING" and elapsed < 0.5
        else:
            _row("demo.add(1, 1) while draining", f"returned {value!r}", _ms(elapsed))
            refused.observed = f"returned {value!r}"

        with anyio.fail_after(_STEP_TIMEOUT):
            await done.wait()
        got = outcome[0] if outcome else "nothing"
        shown = _outcome(got) if isinstance(got, BaseException) else repr(got)
        _row(
            f"the pending demo.hold({_DRAIN_HOLD:g})",
            shown,
            f"{_ms_since(t_term)} after the SIGTERM",
            _detail(got) if isinstance(got, BaseException) else "",
        )
        stopping = await worker.wait_line("executor-stopping", lines_before, _STEP_TIMEOUT)
        code = await worker.wait_exit(_STEP_TIMEOUT)
        _row("the worker", f"exit {code}", detail=stopping)
        await self.availability.wait_for(executor, "offline")
        _row("availability", "draining -> offline (the worker closed the session: 1001)")
        finished.ok = got == "done" and code == 0
        finished.observed = f"hold -> {shown}, worker exit {code}"

    # -- 6

    def summary(self) -> bool:
        _say()
        _say("6. summary")
        rows = [("step", "promise", "observed", "ok")]
        rows += [(r.step, r.promise, r.observed, "yes" if r.ok else "NO") for r in self.results]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        for index, row in enumerate(rows):
            cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            _say(("   " + "  ".join(cells)).rstrip())
            if index == 0:
                _say("   " + "  ".join("-" * width for width in widths))
        kept = sum(r.ok for r in self.results)
        broken = [r.step.split(" ")[0] for r in self.results if not r.ok]
        verdict = f"; broken: step {', '.join(broken)}" if broken else ""
        _say()
        _say(f"   {kept}/{len(self.results)} promises kept ({_ms(self.elapsed)}){verdict}")
        return kept == len(self.results)


def _ms_since(t0: float) -> str:
    return _ms(time.perf_counter() - t0)


def _abbreviate(line: str) -> str:
    """Shorten the hex values of a diagnostic line for display."""
    parts = []
    for part in line.split():
        key, eq, value = part.partition("=")
        if eq and len(value) > 16 and all(c in "0123456789abcdef" for c in value):
            value = value[:12] + "..."
        parts.append(f"{key}{eq}{value}")
    return " ".join(parts)


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _kill_children() -> None:
    for pid in list(_children):
        with contextlib.suppress(OSError):
            os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))
        _children.discard(pid)


def run_demo(*, verbose: int = 0) -> int:
    """Run the demo; return 0 if every step behaved as promised, 1 otherwise (130 on Ctrl-C).

    Args:
        verbose: unused here (the CLI configures logging); kept for callers that pass it.
    """
    del verbose
    ok = False
    try:
        with tempfile.TemporaryDirectory(prefix="garcon-link-demo-") as tmp:
            demo = _Demo(Path(tmp))
            try:
                anyio.run(demo.run)
            except KeyboardInterrupt:
                _say("\ninterrupted: the worker child was killed")
                return 130
            except BaseException as exc:
                leaf = _leaf(exc)
                if isinstance(leaf, KeyboardInterrupt):
                    _say("\ninterrupted: the worker child was killed")
                    return 130
                if not isinstance(leaf, Exception):
                    raise
                _say(f"\ndemo failed: {type(leaf).__name__}: {leaf}")
            ok = demo.summary()
    finally:
        _kill_children()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_demo())
