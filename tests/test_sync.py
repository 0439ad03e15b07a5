"""The blocking client (garcon_link.api.sync): calls, streams as iterators, checked sync views,
errors, and use from a thread that already runs an event loop (what a Jupyter cell does).

The worker runs on a loop of its own in a background thread (an anyio blocking portal), the way
a separate worker process would; the tests themselves are plain ``def`` functions, as a script or
a notebook is. What ran on the worker is asserted through the instrumented ``CalcImpl``'s probe
(every wait bounded); nothing is timed except the test timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.from_thread
import pytest
from rpcutil import LIMITS, SECRET, CalcImpl

import garcon_link as gl
from garcon_link.api.sync import SyncStream

pytestmark = pytest.mark.timeout(60)

WAIT = 5.0


class CalcSync(Protocol):
    """The sync view of rpcutil.Calc (a subset: a view may name fewer methods)."""

    def add(self, a: int, b: int) -> int: ...
    def hold(self, key: str) -> str: ...
    def fail(self, message: str) -> int: ...
    def fail_reject(self) -> int: ...
    def count(self, n: int) -> Iterator[int]: ...
    def ticks(self, key: str) -> Iterator[int]: ...
    def relay(self, text: str) -> int: ...
    @gl.oneway
    def note(self, text: str) -> None: ...


class WrongSync(Protocol):
    def add(self, a: str, b: int) -> int: ...  # the worker's takes an int
    def count(self, n: int) -> Iterator[str]: ...  # the worker's yields int


@dataclass
class RunningWorker:
    portal: anyio.from_thread.BlockingPortal
    impl: CalcImpl
    url: str

    def config(self, **overrides: Any) -> gl.LinkConfig:
        fields: dict[str, Any] = {
            "executor_id": "box",
            "role": gl.Role.CONTROLLER,
            "secret": SECRET,
            "dial": self.url,
            "limits": LIMITS,
        }
        return gl.LinkConfig(**{**fields, **overrides})

    def wait_for(self, mark: str) -> None:
        """Block until the worker's probe saw ``mark`` (bounded)."""

        async def wait() -> None:
            with anyio.fail_after(WAIT):
                await self.impl.probe.wait(mark)

        self.portal.call(wait)

    def count(self, key: str) -> int:
        return int(self.impl.counts[key])


@pytest.fixture
def worker() -> Iterator[RunningWorker]:
    with anyio.from_thread.start_blocking_portal() as portal:
        impl = portal.call(CalcImpl)  # its events belong to the worker's loop
        config = gl.LinkConfig(
            executor_id="box",
            role=gl.Role.WORKER,
            secret=SECRET,
            listen=("127.0.0.1", 0),
            limits=LIMITS,
        )
        served = portal.call(lambda: gl.Worker(config, {"calc": impl}))
        with portal.wrap_async_context_manager(served) as running:
            yield RunningWorker(portal, impl, running.link.url)


def _availability(executor: gl.SyncExecutor) -> str:
    """The executor's availability, read afresh (mypy keeps a property's earlier narrowing)."""
    return executor.availability


def test_calls_streams_notes_and_errors(worker: RunningWorker) -> None:
    with gl.connect_sync(worker.config()) as executor:
        executor.wait_ready(WAIT)
        assert executor.availability == "ready"
        assert executor.info().executor_id == "box"
        calc = executor.service("calc", CalcSync)
        assert calc.add(1, 2) == 3
        assert list(calc.count(4)) == [0, 1, 2, 3]
        calc.note("hello")
        worker.wait_for("note:hello")
        with pytest.raises(gl.RemoteError, match="boom"):
            calc.fail("boom")
        with pytest.raises(gl.Rejected) as rejected:
            calc.fail_reject()
        assert rejected.value.code == "NOT_NOW"
        with pytest.raises(gl.NotDispatched, match="missing a required argument: 'b'"):
            calc.add(1)  # type: ignore[call-arg]
        # with_options, both spellings: a short timeout on a call that never returns.
        for quick in (gl.with_options(calc, timeout=0.2), calc.with_options(timeout=0.2)):  # type: ignore[attr-defined]
            with pytest.raises(gl.OutcomeUnknown):
                quick.hold("never")
        assert calc.add(2, 2) == 4  # the facade itself kept its options
    assert _availability(executor) == "disposed"
    with pytest.raises(gl.NotDispatched) as closed:
        calc.add(1, 2)
    assert closed.value.code == "DISPOSED"
    executor.close()  # idempotent


def test_leaving_a_for_loop_early_closes_the_remote_stream(worker: RunningWorker) -> None:
    with gl.connect_sync(worker.config()) as executor:
        executor.wait_ready(WAIT)
        calc = executor.service("calc", CalcSync)
        for i in calc.ticks("loop"):
            if i == 3:
                break
        worker.wait_for("stream-closed:loop")

        kept = calc.ticks("kept")
        assert isinstance(kept, SyncStream)  # a plain iterator that also closes
        assert next(kept) == 0
        kept.close()
        worker.wait_for("stream-closed:kept")
        with pytest.raises(StopIteration):
            next(kept)

        stream = calc.ticks("with")
        assert isinstance(stream, SyncStream)
        with stream as items:
            assert next(items) == 0
        worker.wait_for("stream-closed:with")

        assert calc.add(1, 1) == 2  # the session is healthy after all three


def test_a_sync_view_that_does_not_match_the_worker_is_refused(worker: RunningWorker) -> None:
    with gl.connect_sync(worker.config()) as executor:
        early = executor.service("calc", WrongSync)  # the manifest is not known yet
        executor.wait_ready(WAIT)
        with pytest.raises(gl.ConfigError) as at_call:
            early.add("1", 2)
        with pytest.raises(gl.ConfigError) as at_creation:
            executor.service("calc", WrongSync)
        for error in (at_call.value, at_creation.value):
            text = str(error)
            assert "calc.add: unary (a: int, b: int) -> int  =>  unary (a: str, b: int)" in text
            assert "-> collections.abc.AsyncIterator[str]" in text
        with pytest.raises(gl.ConfigError, match="no service 'nope'"):
            executor.service("nope", CalcSync)
        assert worker.count("add") == 0  # nothing was sent


def test_the_async_interface_is_refused_with_the_sync_view_to_write(worker: RunningWorker) -> None:
    from rpcutil import Calc

    with gl.connect_sync(worker.config()) as executor:
        with pytest.raises(gl.ConfigError) as refused:
            executor.service("calc", Calc)
        text = str(refused.value)
        assert "class CalcSync(Protocol):" in text
        assert "    def add(self, a: int, b: int) -> int: ..." in text
        assert "    def count(self, n: int) -> Iterator[int]: ..." in text
        assert "    @gl.oneway\n    def note(self, text: str) -> None: ..." in text


def test_the_dynamic_facade(worker: RunningWorker) -> None:
    with gl.connect_sync(worker.config()) as executor:
        executor.wait_ready(WAIT)
        calc = executor.service("calc")
        assert "add" in dir(calc)
        assert calc.add(2, 3) == 5
        assert list(calc.count(2)) == [0, 1]
        with pytest.raises(AttributeError, match="no callable method 'mul'"):
            calc.mul(2, 3)
        with pytest.raises(gl.Rejected):
            calc.add("x", 3)  # validated by the worker


def _script_session(config: gl.LinkConfig) -> tuple[int, list[int]]:
    """What a notebook cell does: plain blocking code."""
    with gl.connect_sync(config) as executor:
        executor.wait_ready(WAIT)
        calc = executor.service("calc", CalcSync)
        return calc.add(20, 22), list(calc.count(3))


def test_called_directly_in_a_running_event_loop_thread(worker: RunningWorker) -> None:
    # A Jupyter cell runs in the thread of the kernel's running asyncio loop; so does a plain
    # def called from a coroutine. Supported: the client's loop is its own thread's (the
    # caller's loop is blocked meanwhile, as by any blocking library).
    async def cell() -> tuple[int, list[int]]:
        asyncio.get_running_loop()  # there is one, in this very thread
        return _script_session(worker.config())

    assert asyncio.run(cell()) == (42, [0, 1, 2])


def test_called_from_run_in_executor(worker: RunningWorker) -> None:
    async def main() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _script_session, worker.config())

    assert asyncio.run(main()) == (42, [0, 1, 2])


def test_called_from_a_thread_running_a_trio_loop(worker: RunningWorker) -> None:
    async def cell() -> tuple[int, list[int]]:
        return _script_session(worker.config())

    assert anyio.run(cell, backend="trio") == (42, [0, 1, 2])


def test_calling_from_the_clients_own_loop_is_refused(worker: RunningWorker) -> None:
    # A controller-side service runs on the client's loop: blocking there would deadlock.
    seen: list[BaseException] = []
    holder: list[gl.SyncExecutor] = []

    class Sink:
        async def push(self, text: str) -> int:
            try:
                holder[0].wait_ready(1)
            except RuntimeError as exc:
                seen.append(exc)
            return len(text)

        async def event(self, text: str) -> None:
            pass

    with gl.connect_sync(worker.config(), services={"sink": Sink()}) as executor:
        holder.append(executor)
        executor.wait_ready(WAIT)
        assert executor.service("calc", CalcSync).relay("abc") == 3
    assert len(seen) == 1
    assert "own event loop thread" in str(seen[0])
    assert "deadlock" in str(seen[0])


def test_a_wrong_secret_fails_fast(worker: RunningWorker) -> None:
    with (
        gl.connect_sync(worker.config(secret=gl.Secret(b"y" * 32))) as executor,
        pytest.raises(gl.AuthenticationError, match="same secret"),
    ):
        executor.wait_ready(30)  # raised at the first refusal, not at the timeout


def test_a_script_that_never_closes_still_exits(tmp_path: Any) -> None:
    # The client's thread is a daemon and close() runs at exit: no hang at interpreter exit
    # (anyio's start_blocking_portal alone would hang there forever).
    script = textwrap.dedent(
        """
        import garcon_link as gl
        config = gl.LinkConfig(executor_id="box", role=gl.Role.CONTROLLER,
                               secret=gl.Secret(b"x" * 32), listen=("127.0.0.1", 0))
        executor = gl.connect_sync(config)
        print(executor.availability, flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "offline"
    assert done.stderr == ""


def test_an_interrupt_cancels_the_call(worker: RunningWorker) -> None:
    # Ctrl-C in a notebook: KeyboardInterrupt in the waiting thread cancels the call's task,
    # which cancels the handler on the worker.
    main = threading.get_ident()
    with gl.connect_sync(worker.config()) as executor:
        executor.wait_ready(WAIT)
        calc = executor.service("calc", CalcSync)

        def interrupt_once_started() -> None:
            worker.wait_for("started:ctrl-c")
            signal.pthread_kill(main, signal.SIGINT)

        helper = threading.Thread(target=interrupt_once_started)
        helper.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                calc.hold("ctrl-c")
        finally:
            helper.join(WAIT)
        worker.wait_for("cancelled:ctrl-c")
        assert calc.add(1, 2) == 3  # the executor is unharmed


def test_a_start_failure_leaves_no_thread_behind() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = gl.LinkConfig(
            executor_id="box",
            role=gl.Role.CONTROLLER,
            secret=SECRET,
            listen=("127.0.0.1", taken.getsockname()[1]),
            limits=LIMITS,
        )
        before = {t.ident for t in threading.enumerate() if t.name == "garcon-link-sync"}
        with pytest.raises(gl.LinkError):
            gl.connect_sync(config)
        after = {t.ident for t in threading.enumerate() if t.name == "garcon-link-sync"}
        assert after == before
    worker_config = gl.LinkConfig(
        executor_id="box", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    with pytest.raises(gl.ConfigError, match="controller configuration"):
        gl.connect_sync(worker_config)


def test_threads_share_one_client_and_keyed_calls_run_once(worker: RunningWorker) -> None:
    with gl.connect_sync(worker.config()) as executor:
        executor.wait_ready(WAIT)
        calc = executor.service("calc", CalcSync)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            sums = list(pool.map(lambda i: calc.add(i, i), range(64)))
        assert sums == [2 * i for i in range(64)]
        keyed = gl.with_options(calc, idempotency_key="once")
        assert [keyed.add(5, 5), keyed.add(5, 5)] == [10, 10]
        assert worker.count("add") == 64 + 1  # the keyed call ran once


def test_closing_from_another_thread_fails_a_blocked_call_honestly(worker: RunningWorker) -> None:
    executor = gl.connect_sync(worker.config())
    executor.wait_ready(WAIT)
    calc = executor.service("calc", CalcSync)

    def close_once_started() -> None:
        worker.wait_for("started:closed-under")
        executor.close()

    closer = threading.Thread(target=close_once_started)
    closer.start()
    try:
        with pytest.raises(gl.OutcomeUnknown):  # it was running on the worker
            calc.hold("closed-under")
    finally:
        closer.join(WAIT)
    assert executor.availability == "disposed"


class _RecordingHook:
    """A client-side hook that records what each call carried and how it ended."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], str]] = []
        self.threads: set[int] = set()

    def call_started(self, call: gl.CallInfo) -> object:
        self.threads.add(threading.get_ident())
        return dict(call.metadata)

    def call_ended(self, call: gl.CallInfo, state: object, end: gl.CallEnd) -> None:
        assert isinstance(state, dict)
        self.seen.append((call.method, state, end.label))


def test_hooks_and_metadata_through_the_sync_client(worker: RunningWorker) -> None:
    hook = _RecordingHook()
    with gl.connect_sync(worker.config(), hooks=[hook]) as executor:
        executor.wait_ready(WAIT)
        calc = executor.service("calc", CalcSync)
        tagged = calc.with_options(metadata={"request-id": "r-1"})  # type: ignore[attr-defined]
        assert tagged.add(1, 2) == 3
        assert gl.with_options(calc, metadata={"request-id": "r-2"}).add(2, 2) == 4
        with pytest.raises(gl.NotDispatched) as invalid:
            calc.with_options(metadata={"Bad Key": "x"}).add(1, 1)  # type: ignore[attr-defined]
        assert invalid.value.code == "INVALID_METADATA"
    assert hook.seen[:2] == [
        ("add", {"request-id": "r-1"}, "ok"),
        ("add", {"request-id": "r-2"}, "ok"),
    ]
    assert threading.get_ident() not in hook.threads  # hooks run on the client's loop thread


def test_wait_ready_gives_up_after_refused_dials() -> None:
    with socket.socket() as reserved:  # bound, never listening: dials are refused
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        config = gl.LinkConfig(
            executor_id="box",
            role=gl.Role.CONTROLLER,
            secret=SECRET,
            dial=f"ws://127.0.0.1:{port}/executor",
            limits=LIMITS,
        )
        with (
            gl.connect_sync(config) as executor,
            pytest.raises(gl.NotDispatched, match="UNREACHABLE"),
        ):
            executor.wait_ready(3600, refused_dials=3)
