"""Several controllers on one worker (docs/guides/many-callers.md), over real loopback sockets.

A listening worker holds one logical session per controller: eight controller processes
(tests/controller_child.py) and the CLI (``garcon-link call`` and ``describe``) are served at once
(calls, streams, and a process one of them starts is listed by every other: the process service
is worker-scoped); past ``Limits.max_controllers`` a controller is refused (1013) while every
place has a live socket, and admitted in the place of a crashed or cut-off controller's detached
session otherwise (``EVICTED``: its controller, back, gets honest outcomes); the same
``controller_id`` from a new process is the takeover rule of one executor id (4004 while the
holder answers, newest wins once it does not); ``Worker.statistics()`` counts every controller.

A controller meant to crash is a child process killed with SIGKILL: its sockets, its tasks and
its memory end at once, as a real crash ends them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from faultutil import TESTS_DIR, kill_and_reap, wait_for
from rpcutil import Calc, CalcImpl

import garcon_link as gl
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.services import builtin_services
from garcon_link.testing import FaultProxy

pytestmark = pytest.mark.anyio

CLI = (sys.executable, "-m", "garcon_link.cli")
LIMITS = gl.Limits(
    heartbeat_interval=0.05,
    heartbeat_timeout=0.5,
    detached_grace=1.0,
    backoff_base=0.01,
    backoff_max=0.05,
    scope_cleanup_timeout=0.5,
    call_timeout=10.0,
)
SECRET = gl.Secret(b"m" * 32)


def _worker_config(limits: gl.Limits = LIMITS) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=limits,
    )


def _controller_config(url: str, controller_id: str | None = None) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id="box",
        role=gl.Role.CONTROLLER,
        secret=SECRET,
        dial=url,
        limits=LIMITS,
        controller_id=controller_id,
    )


def _services(root: Path, impl: CalcImpl) -> Any:
    """``calc`` (per session) beside the built-in, worker-scoped ``process`` service."""
    builtin = builtin_services(["process"], root)

    @contextlib.asynccontextmanager
    async def factory(scope: gl.ServiceScope) -> AsyncIterator[Mapping[str, object]]:
        async with builtin(scope) as services:
            yield {**services, "calc": impl}

    return factory


@contextlib.asynccontextmanager
async def _controllers(url: str, count: int) -> AsyncIterator[list[gl.RemoteExecutor]]:
    async with contextlib.AsyncExitStack() as stack:
        executors = [
            await stack.enter_async_context(gl.connect(_controller_config(url)))
            for _ in range(count)
        ]
        yield executors


def _runtime(executor: gl.RemoteExecutor) -> str:
    """The name a listening worker knows a controller without a controller_id by."""
    link = executor.link
    assert isinstance(link, WebSocketLink)
    return link.runtime_id.hex()


async def _hosted(
    config: gl.LinkConfig,
    stop: anyio.Event,
    *,
    task_status: anyio.abc.TaskStatus[gl.RemoteExecutor] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """A controller entered and left in a task of its own (so any one of several can leave
    first): started at once, closed when ``stop`` is set."""
    async with gl.connect(config) as executor:
        task_status.started(executor)
        await stop.wait()


class Child:
    """One controller child process and its line protocol (tests/controller_child.py)."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process = process
        self._out = BufferedByteReceiveStream(process.stdout)
        self.runtime = ""

    async def line(self) -> str:
        with anyio.fail_after(20):
            return (await self._out.receive_until(b"\n", 1 << 20)).decode()

    async def ready(self) -> None:
        first = await self.line()
        assert first.startswith("READY "), first
        self.runtime = first.split()[1]

    async def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        await self.process.stdin.send(command.encode() + b"\n")
        answer: dict[str, Any] = json.loads(await self.line())
        assert "error" not in answer, answer
        return answer


@contextlib.asynccontextmanager
async def _children(
    directory: Path, url: str, count: int, backend: str, controller_id: str = ""
) -> AsyncIterator[list[Child]]:
    """``count`` controller processes (with ``controller_id``, if any), each ready (started at
    once, so they connect side by side); killed and reaped on the way out."""
    secret = directory / "child.secret"
    secret.write_bytes(SECRET.reveal())
    async with contextlib.AsyncExitStack() as stack:
        children = []
        for _ in range(count):
            command = [sys.executable, str(TESTS_DIR / "controller_child.py"), url, str(secret)]
            command += [backend, controller_id]
            process = await anyio.open_process(command, stderr=subprocess.DEVNULL)
            stack.push_async_callback(kill_and_reap, process)
            children.append(Child(process))
        for child in children:
            await child.ready()
        yield children


def _cli_config(directory: Path, url: str) -> Path:
    (directory / "link.secret").write_bytes(SECRET.reveal())
    (directory / "link.secret").chmod(0o600)
    config = directory / "controller.toml"
    config.write_text(
        f'executor_id = "box"\nrole = "controller"\nsecret_file = "link.secret"\n\n'
        f'[connection]\ndial = "{url}"\n',
        encoding="utf-8",
    )
    return config


async def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    """``garcon-link ARGS`` as a user runs it: its own process, so its own controller."""
    with anyio.fail_after(30):
        return await anyio.run_process([*CLI, *args], check=False, stdin=subprocess.DEVNULL)


@pytest.mark.slow  # ten child processes: about 5 s per backend
async def test_a_worker_serves_eight_controller_processes_and_the_cli_at_once(
    anyio_backend: str, tmp_path: Path
) -> None:
    """The acceptance of several controllers: 8 controller processes and the CLI (``call`` and
    ``describe``, two more processes) use one worker at once -- calls, streams, and a process
    one controller starts is listed by every other (the process service is the worker's)."""
    impl = CalcImpl()
    root = tmp_path / "root"
    root.mkdir()
    # Ten processes on a loaded machine stall now and then: a socket lost meanwhile resumes its
    # session (a long grace), so each child keeps the one session the test counts.
    limits = LIMITS.replace(heartbeat_timeout=2.0, detached_grace=30.0)
    with anyio.fail_after(60):
        async with (
            gl.Worker(_worker_config(limits), _services(root, impl)) as worker,
            _children(tmp_path, worker.url, 8, anyio_backend) as children,
        ):
            assert sorted(worker.controllers()) == sorted(c.runtime for c in children)
            config = str(_cli_config(tmp_path, worker.url))
            results: dict[int, dict[str, Any]] = {}
            cli: dict[str, subprocess.CompletedProcess[bytes]] = {}

            async def use(i: int, child: Child) -> None:
                results[i] = await child.ask(f"use {i}")
                await child.ask(f"start shared-{i}")

            async def run_cli(name: str, *args: str) -> None:
                cli[name] = await _cli(*args)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run_cli, "call", "call", config, "calc.add", "[2, 3]")
                tg.start_soon(run_cli, "describe", "describe", config)
                for i, child in enumerate(children):
                    tg.start_soon(use, i, child)
            assert results == {i: {"add": i + 100, "count": list(range(3 + i))} for i in range(8)}
            assert (cli["call"].returncode, cli["call"].stdout) == (0, b"5\n"), cli["call"]
            assert cli["describe"].returncode == 0, cli["describe"]
            assert b"calc.add" in cli["describe"].stdout, cli["describe"].stdout

            # Every process started by one controller is in every controller's list.
            started = sorted(f"shared-{i}" for i in range(8))
            for child in children:
                assert (await child.ask("list"))["ids"] == started

            stats = worker.link.statistics()
            # 8 children (one session each, asked below) and at least one per CLI run: a CLI
            # run whose first dial times out on a loaded machine dials again, a new session.
            assert stats.fresh_sessions >= 10
            assert stats.takeovers_refused == stats.admissions_busy == 0
            assert stats.controllers_refused == stats.controllers_evicted == 0
            # The CLI runs closed their sessions (1001); the children's are the ones they
            # began with: nothing replaced, nothing resumed.
            assert sorted(worker.controllers()) == sorted(c.runtime for c in children)
            for child in children:
                assert await child.ask("stats") == {"sessions": 1}


async def test_the_controller_past_max_controllers_is_refused_until_a_place_frees(
    anyio_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="garcon_link.link")
    impl = CalcImpl()
    with anyio.fail_after(30):
        async with (
            gl.Worker(_worker_config(LIMITS.replace(max_controllers=2)), {"calc": impl}) as w,
            anyio.create_task_group() as tg,
        ):
            stops = [anyio.Event() for _ in range(3)]
            first, second, third = [
                await tg.start(_hosted, _controller_config(w.url), stop) for stop in stops
            ]
            await first.wait_ready(timeout=10)
            await second.wait_ready(timeout=10)
            with pytest.raises(TimeoutError, match="max_controllers=2"):
                await third.wait_ready(timeout=0.5)
            assert w.link.statistics().controllers_refused >= 1
            assert len(w.controllers()) == 2
            # The worker says so, rate-limited (one line per peer and reason and
            # log_interval, however often the third redials).
            refusals = [r for r in caplog.records if "refused controller" in r.getMessage()]
            assert len(refusals) == 1 and refusals[0].levelno == logging.WARNING
            assert "max_controllers=2" in refusals[0].getMessage()
            assert getattr(refusals[0], "gl_close_code", None) == 1013
            # One of the two leaves (1001: its session ends at once); the third redials
            # and is admitted.
            stops[0].set()
            await third.wait_ready(timeout=10)
            assert await third.service("calc", Calc).add(1, 2) == 3
            assert len(w.controllers()) == 2
            for stop in stops:
                stop.set()


async def test_a_crashed_controller_gives_its_place_to_a_live_one(
    anyio_backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With every place held, a newcomer takes the place of the session detached the longest
    (its socket gone) instead of waiting out that session's grace (30 s here: the test would
    time out long before it); with every place's socket live, it is refused."""
    caplog.set_level(logging.INFO, logger="garcon_link.link")
    impl = CalcImpl()
    limits = LIMITS.replace(max_controllers=2, detached_grace=30.0)
    with anyio.fail_after(40):
        async with (
            gl.Worker(_worker_config(limits), {"calc": impl}) as w,
            _children(tmp_path, w.url, 2, anyio_backend) as (crashed, live),
            anyio.create_task_group() as tg,
        ):
            assert sorted(w.controllers()) == sorted([crashed.runtime, live.runtime])
            crashed_session = w.link.controllers()[crashed.runtime]
            # Killed: no close frame, so the worker keeps its session, detached, for the grace.
            await kill_and_reap(crashed.process)
            await wait_for(lambda: not crashed_session.attached, 10, "the socket is gone")
            assert crashed.runtime in w.controllers()  # held, detached
            stops = [anyio.Event() for _ in range(2)]
            newcomer = await tg.start(_hosted, _controller_config(w.url), stops[0])
            await newcomer.wait_ready(timeout=10)
            assert await newcomer.service("calc", Calc).add(1, 2) == 3
            assert w.link.statistics().controllers_evicted == 1
            failure = crashed_session.failure
            assert failure is not None and failure.reason is gl.errors.FailureReason.EVICTED
            assert len(w.controllers()) == 2 and crashed.runtime not in w.controllers()
            evictions = [r for r in caplog.records if "in the place of" in r.getMessage()]
            assert len(evictions) == 1 and evictions[0].levelno == logging.WARNING
            assert getattr(evictions[0], "gl_controller", None) == crashed.runtime
            # Both places now have a socket: the next one is refused (1013), nobody evicted.
            fourth = await tg.start(_hosted, _controller_config(w.url), stops[1])
            with pytest.raises(TimeoutError, match="max_controllers=2"):
                await fourth.wait_ready(timeout=0.5)
            assert w.link.statistics().controllers_evicted == 1
            assert (await live.ask("use 1"))["add"] == 101
            assert await newcomer.service("calc", Calc).add(2, 2) == 4
            for stop in stops:
                stop.set()


async def test_an_evicted_controller_that_returns_gets_honest_outcomes(
    anyio_backend: str,
) -> None:
    """A controller cut off (not crashed) loses its detached session to a newcomer; when it gets
    through again it is served on a fresh session, and the call it had running is
    OutcomeUnknown (written, maybe executed), never re-sent nor reported done."""
    impl = CalcImpl()
    limits = LIMITS.replace(max_controllers=2, detached_grace=30.0)
    with anyio.fail_after(30):
        async with (
            gl.Worker(_worker_config(limits), {"calc": impl}) as w,
            FaultProxy("127.0.0.1", w.link.listen_address[1]) as proxy,
            anyio.create_task_group() as tg,
        ):
            stops = [anyio.Event() for _ in range(3)]
            cut_off = await tg.start(_hosted, _controller_config(proxy.url()), stops[0])
            live = await tg.start(_hosted, _controller_config(w.url), stops[1])
            await cut_off.wait_ready(timeout=10)
            await live.wait_ready(timeout=10)
            outcome: list[BaseException] = []

            async def held_call() -> None:
                try:
                    await cut_off.service("calc", Calc).hold("evicted")
                except gl.CallError as exc:
                    outcome.append(exc)

            tg.start_soon(held_call)
            await impl.probe.wait("started:evicted")
            held = w.link.controllers()[_runtime(cut_off)]
            proxy.refuse()
            proxy.cut()
            await wait_for(lambda: not held.attached, 10, "the worker sees the cut")
            newcomer = await tg.start(_hosted, _controller_config(w.url), stops[2])
            await newcomer.wait_ready(timeout=10)
            failure = held.failure
            assert failure is not None and failure.reason is gl.errors.FailureReason.EVICTED
            await impl.probe.wait("cancelled:evicted")  # the session's handler ends with it
            stops[2].set()  # the newcomer leaves: a place frees up
            await wait_for(lambda: len(w.controllers()) == 1, 10, "the newcomer left")
            proxy.heal()
            await wait_for(lambda: bool(outcome), 10, "the held call's outcome")
            assert isinstance(outcome[0], gl.OutcomeUnknown), outcome
            await cut_off.wait_ready(timeout=10)  # its fresh session installed
            assert await cut_off.service("calc", Calc).add(3, 4) == 7
            assert cut_off.statistics().sessions == 2  # a fresh one, not a resume
            assert impl.counts["evicted"] == 1  # never re-sent
            for stop in stops:
                stop.set()


async def test_the_same_controller_id_takes_over_once_its_holder_stops_answering(
    anyio_backend: str, tmp_path: Path
) -> None:
    impl = CalcImpl()
    # A grace longer than the test: the old session ends by the takeover, not by expiring.
    limits = LIMITS.replace(detached_grace=30.0)
    with anyio.fail_after(40):
        async with (
            gl.Worker(_worker_config(limits), {"calc": impl}) as w,
            _children(tmp_path, w.url, 1, anyio_backend, "scheduler") as (first,),
            anyio.create_task_group() as tg,
        ):
            stops = [anyio.Event() for _ in range(2)]
            other, newer = [
                await tg.start(_hosted, _controller_config(w.url, name), stop)
                for name, stop in zip(("other", "scheduler"), stops, strict=True)
            ]
            await other.wait_ready(timeout=10)  # another controller_id: admitted at once
            # The holder answers the probe: the newcomer is refused (4004), again and again,
            # and the holder's session stays.
            with pytest.raises(TimeoutError, match="4004"):
                await newer.wait_ready(timeout=0.5)
            assert w.link.statistics().takeovers_refused >= 1
            assert sorted(w.controllers()) == ["other", "scheduler"]
            held = w.link.controllers()["scheduler"]
            # The holder's process dies (SIGKILL: no close frame, nothing retired): the newest
            # process with that controller_id takes the place over.
            await kill_and_reap(first.process)
            await newer.wait_ready(timeout=10)
            assert await newer.service("calc", Calc).add(2, 2) == 4
            assert sorted(w.controllers()) == ["other", "scheduler"]
            assert w.link.controllers()["scheduler"] is not held
            failure = held.failure
            assert failure is not None and failure.reason is gl.errors.FailureReason.REPLACED
            assert await other.service("calc", Calc).add(1, 1) == 2
            assert w.link.statistics().controllers_evicted == 0
            for stop in stops:
                stop.set()


async def test_the_worker_statistics_count_every_controller(anyio_backend: str) -> None:
    """Worker.statistics() sums the levels over every controller's session and breaks them
    down by controller (not only the newest session's)."""
    impl = CalcImpl()
    with anyio.fail_after(30):
        async with (
            gl.Worker(_worker_config(), {"calc": impl}) as w,
            _controllers(w.url, 3) as executors,
            anyio.create_task_group() as tg,
        ):
            for executor in executors:
                await executor.wait_ready(timeout=10)
            labels = list(w.controllers())
            assert len(labels) == 3
            # The two older controllers each hold a call in their handler; the newest none.
            for i, executor in enumerate(executors[:2]):
                tg.start_soon(executor.service("calc", Calc).hold, f"held-{i}")
                await impl.probe.wait(f"started:held-{i}")
            stats = w.statistics()
            assert stats.incoming_calls == 2
            assert stats.rpc is not None and stats.rpc.incoming_calls <= 1  # the newest's
            assert list(stats.controllers) == labels
            runtimes = [_runtime(e) for e in executors]
            assert {label: c.incoming_calls for label, c in stats.controllers.items()} == dict(
                zip(runtimes, [1, 1, 0], strict=True)
            )
            assert all(c.attached for c in stats.controllers.values())
            assert stats.controllers_omitted == 0
            assert stats.fresh_sessions == 3 and stats.sessions == 3
            impl._release("held-0")
            impl._release("held-1")
        ended = w.statistics()
        assert ended.incoming_calls == 0 and not ended.controllers
        assert ended.incoming_calls_peak == 1  # the most running at once on one session
        assert ended.calls.server[("ok", None)] == 2


async def test_the_per_controller_breakdown_is_capped(anyio_backend: str) -> None:
    impl = CalcImpl()
    with anyio.fail_after(30):
        async with (
            gl.Worker(_worker_config(), {"calc": impl}) as w,
            _controllers(w.url, 3) as executors,
        ):
            for executor in executors:
                await executor.wait_ready(timeout=10)
            labels = list(w.controllers())
            full = w.statistics()
            assert list(full.controllers) == labels and full.controllers_omitted == 0
            capped = w.statistics(max_rows=2)
            assert list(capped.controllers) == labels[:2]  # the oldest
            assert capped.controllers_omitted == 1
            assert capped.fresh_sessions == 3  # the sums still cover every session
            none = w.statistics(max_rows=0)
            assert not none.controllers and none.controllers_omitted == 3
            with pytest.raises(ValueError, match="max_rows"):
                w.statistics(max_rows=-1)


async def test_a_dialing_worker_dials_several_controllers(anyio_backend: str) -> None:
    impl = CalcImpl()

    def listening() -> gl.LinkConfig:
        return gl.LinkConfig(
            executor_id="box",
            role=gl.Role.CONTROLLER,
            secret=SECRET,
            listen=("127.0.0.1", 0),
            limits=LIMITS,
        )

    with anyio.fail_after(30):
        async with gl.connect(listening()) as a, gl.connect(listening()) as b:
            urls = (a.link.url, b.link.url)
            config = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.WORKER,
                secret=SECRET,
                dial=urls[0],
                also_dial=urls[1:],
                limits=LIMITS,
            )
            assert config.dial_urls == urls
            async with gl.Worker(config, {"calc": impl}) as worker:
                await a.wait_ready(timeout=10)
                await b.wait_ready(timeout=10)
                assert await a.service("calc", Calc).add(1, 2) == 3
                assert [x async for x in b.service("calc", Calc).count(4)] == [0, 1, 2, 3]
                assert sorted(worker.controllers()) == sorted(urls)
                # The statistics cover both links: their sessions, handshakes and bytes.
                stats = worker.statistics()
                assert sorted(stats.controllers) == sorted(urls)
                assert stats.fresh_sessions == 2
                assert stats.link.fresh_sessions == 1  # the first link's own snapshot
                assert stats.bytes_received > stats.link.bytes_received > 0
                # One worker process: both controllers see the same worker instance.
                info_a, info_b = await a.info(), await b.info()
                assert info_a.worker_instance_id == info_b.worker_instance_id


def test_a_worker_config_may_dial_a_list_of_controllers(tmp_path: Path) -> None:
    (tmp_path / "link.secret").write_bytes(SECRET.reveal())
    (tmp_path / "link.secret").chmod(0o600)
    path = tmp_path / "worker.toml"
    body = 'executor_id = "box"\nrole = "{role}"\nsecret_file = "link.secret"\n\n[connection]\n'
    urls = '["ws://127.0.0.1:1/executor", "ws://127.0.0.1:2/executor"]'
    path.write_text(body.format(role="worker") + f"dial = {urls}\n", encoding="utf-8")
    config = gl.load_config(path)
    assert config.dial_urls == ("ws://127.0.0.1:1/executor", "ws://127.0.0.1:2/executor")
    path.write_text(body.format(role="controller") + f"dial = {urls}\n", encoding="utf-8")
    with pytest.raises(gl.ConfigError, match="only a dialing worker dials several"):
        gl.load_config(path)
    twice = '["ws://127.0.0.1:1/executor", "ws://127.0.0.1:1/executor"]'
    path.write_text(body.format(role="worker") + f"dial = {twice}\n", encoding="utf-8")
    with pytest.raises(gl.ConfigError, match="listed twice"):
        gl.load_config(path)
    path.write_text(body.format(role="worker") + "dial = []\n", encoding="utf-8")
    with pytest.raises(gl.ConfigError, match="non-empty list"):
        gl.load_config(path)


async def test_a_controller_at_its_budget_does_not_hold_another_back(anyio_backend: str) -> None:
    """Each controller's calls are admitted against its own session's budget: one that holds
    ``max_incoming_calls`` running calls is refused ``OVERLOADED`` for more, while another
    controller's call runs at once."""
    impl = CalcImpl()
    limits = LIMITS.replace(max_incoming_calls=4)
    with anyio.fail_after(30):
        async with (
            gl.Worker(_worker_config(limits), {"calc": impl}) as w,
            anyio.create_task_group() as tg,
        ):
            stops = [anyio.Event() for _ in range(2)]
            greedy, other = [
                await tg.start(_hosted, _controller_config(w.url), stop) for stop in stops
            ]
            await greedy.wait_ready(timeout=10)
            await other.wait_ready(timeout=10)
            calc = greedy.service("calc", Calc)
            async with anyio.create_task_group() as held:
                for i in range(4):
                    held.start_soon(calc.hold, f"k{i}")
                for i in range(4):
                    await impl.probe.wait(f"started:k{i}")
                with pytest.raises(gl.NotDispatched) as refused:
                    await calc.add(1, 1)
                assert refused.value.code == "OVERLOADED"
                assert await other.service("calc", Calc).add(2, 3) == 5
                assert [x async for x in other.service("calc", Calc).count(3)] == [0, 1, 2]
                for i in range(4):
                    impl._release(f"k{i}")
            for stop in stops:
                stop.set()
