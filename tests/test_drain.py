"""Graceful drain (docs/design.md#drain), in process: ``Worker.aclose(drain=)`` and
``RemoteExecutor.aclose(drain=)``, in both link directions.

What each test proves, on facts recorded by the worker's instrumented service (never on a sleep):

* a call in flight when the drain starts finishes and its caller gets the real result;
* a new call during the drain fails at once with ``NotDispatched("DRAINING")`` and never runs
  (the worker refuses it unexecuted; the controller does not even send it);
* a call still running when the drain time is up fails ``OutcomeUnknown`` (its handler is
  cancelled), never a success that did not happen;
* the session then closes for good (the controller goes ``offline`` or ``disposed``);
* the worker's goodbye: the controller's availability is ``draining`` before the call in flight
  ends, a new call is refused there without being sent, and no drain refusal counts as an error;
  a worker repeating its goodbye in a flood makes one transition and one log line.

The 64-calls-under-SIGTERM test against a real ``garcon-link worker`` process is in
``tests/test_process_faults.py``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import pytest
from rpcutil import LIMITS, SECRET, Calc, CalcImpl, both_directions, open_pair

import garcon_link as gl
from garcon_link.api.facades import counts_as_error
from garcon_link.cli._fleet import fleet_table
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.rpc.envelopes import Notify, encode

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10.0  # every wait below is bounded by this (a hang, not a result)


async def _outcome(call: Any, sink: list[Any], done: anyio.Event) -> None:
    try:
        sink.append(await call)
    except gl.CallError as exc:
        sink.append(exc)
    finally:
        done.set()


def _start(tg: anyio.abc.TaskGroup, call: Any) -> tuple[list[Any], anyio.Event]:
    """Run ``call`` in a task; its result or CallError lands in the list, then the event is set."""
    sink: list[Any] = []
    done = anyio.Event()
    tg.start_soon(_outcome, call, sink, done)
    return sink, done


async def _wait_until(predicate: Any) -> None:
    """Bounded by the caller's deadline; polls only a fact that has no event of its own."""
    while not predicate():
        await anyio.sleep(0.005)


class _WorkerHost:
    """A worker run in its own task (an endpoint is closed by the task that entered it), closed
    with ``aclose(drain=...)`` when told to."""

    def __init__(self, worker: gl.Worker) -> None:
        self.worker = worker
        self.closed = anyio.Event()
        self._stop = anyio.Event()
        self._drain = 0.0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            async with self.worker:
                task_status.started()
                await self._stop.wait()
                await self.worker.aclose(drain=self._drain)
        finally:
            self.closed.set()

    def stop(self, drain: float = 0.0) -> None:
        self._drain = drain
        self._stop.set()


def _config(role: gl.Role, *, listen: bool, url: str = "") -> gl.LinkConfig:
    where: dict[str, Any] = {"listen": ("127.0.0.1", 0)} if listen else {"dial": url}
    return gl.LinkConfig(executor_id="box", role=role, secret=SECRET, limits=LIMITS, **where)


@contextlib.asynccontextmanager
async def _ends(direction: str, impl: CalcImpl) -> AsyncIterator[tuple[Calc, Any, _WorkerHost]]:
    """A controller entered in this task and a worker hosted in another, ready; yields the
    facade, the executor and the worker's host. ``executor.aclose()`` exits scopes this entered:
    call it in the body itself, not inside a cancel scope opened there."""
    async with anyio.create_task_group() as tg:
        host: _WorkerHost | None = None
        if direction == "worker-listens":
            host = _WorkerHost(gl.Worker(_config(gl.Role.WORKER, listen=True), {"calc": impl}))
            await tg.start(host.run)
            executor = gl.connect(_config(gl.Role.CONTROLLER, listen=False, url=host.worker.url))
        else:
            executor = gl.connect(_config(gl.Role.CONTROLLER, listen=True))
        try:
            async with executor:
                if host is None:
                    worker = _config(gl.Role.WORKER, listen=False, url=executor.link.url)
                    host = _WorkerHost(gl.Worker(worker, {"calc": impl}))
                    await tg.start(host.run)
                with anyio.fail_after(5):
                    await executor.wait_ready()
                yield executor.service("calc", Calc), executor, host
        finally:
            with anyio.CancelScope(shield=True), anyio.fail_after(DEADLINE):
                if host is not None:
                    host.stop()
                    await host.closed.wait()


# ---------------------------------------------------------------------------------- worker


@both_directions
async def test_worker_drain_finishes_running_calls_and_refuses_new_ones(direction: Any) -> None:
    impl = CalcImpl()
    async with _ends(direction, impl) as (calc, executor, host), anyio.create_task_group() as tg:
        worker = host.worker
        with anyio.fail_after(DEADLINE):
            held, held_done = _start(tg, calc.hold("a"))
            await impl.probe.wait("started:a")
            host.stop(drain=DEADLINE)
            await _wait_until(lambda: worker.draining)

            with pytest.raises(gl.NotDispatched) as refused:
                await calc.add(1, 2)
            assert refused.value.code == "DRAINING"
            assert impl.counts["add"] == 0  # refused unexecuted
            with pytest.raises(gl.NotDispatched) as refused_stream:
                async for _ in calc.count(3):
                    pass
            assert refused_stream.value.code == "DRAINING"
            assert impl.counts["count"] == 0
            assert not host.closed.is_set()  # still waiting for "a"

            impl._release("a")
            await held_done.wait()
            assert held == ["a"]  # the real result, delivered before the close
            await host.closed.wait()
            await _wait_until(lambda: executor.availability == "offline")
        assert "cancelled:a" not in impl.probe


@both_directions
async def test_worker_drain_time_up_fails_running_calls_as_unknown(direction: Any) -> None:
    impl = CalcImpl()
    async with _ends(direction, impl) as (calc, _, host), anyio.create_task_group() as tg:
        with anyio.fail_after(DEADLINE):
            held, held_done = _start(tg, calc.hold("stuck"))
            await impl.probe.wait("started:stuck")
            host.stop(drain=0.2)
            await host.closed.wait()
            await held_done.wait()
        assert len(held) == 1 and isinstance(held[0], gl.OutcomeUnknown), held
        unknown = held[0]
        assert unknown.code == "CONTINUITY_LOST", unknown
        # What happened, in the words of the end that calls: the worker stopped mid-call.
        assert "the worker stopped (shut down) while the call ran" in unknown.message, unknown
        assert "cancelled:stuck" in impl.probe  # the close cancelled it: no result was made up


@both_directions
async def test_the_controller_sees_the_workers_goodbye_as_draining(direction: Any) -> None:
    impl = CalcImpl()
    async with _ends(direction, impl) as (calc, executor, host), anyio.create_task_group() as tg:
        changes: list[str] = []
        draining = anyio.Event()

        def changed(value: str) -> None:
            changes.append(value)
            if value == "draining":
                draining.set()

        executor.on_availability_changed(changed)
        with anyio.fail_after(DEADLINE):
            held, held_done = _start(tg, calc.hold("a"))
            await impl.probe.wait("started:a")
            sent_before = host.worker.statistics().calls.total("server")
            host.stop(drain=DEADLINE)
            await draining.wait()  # while "a" is held: the worker cannot have closed yet
            assert not held_done.is_set()
            assert executor.availability == "draining"
            with pytest.raises(TimeoutError) as late:
                await executor.wait_ready(timeout=0.05)  # draining is not ready
            assert "the worker is draining" in str(late.value), late.value
            assert "no session yet" not in str(late.value)

            with pytest.raises(gl.NotDispatched) as refused:
                await calc.add(1, 2)
            assert refused.value.code == "DRAINING"
            assert impl.counts["add"] == 0
            # Refused here, not sent: the worker saw no new call.
            assert host.worker.statistics().calls.total("server") == sent_before

            impl._release("a")
            await held_done.wait()
            assert held == ["a"]  # a call sent before the goodbye finishes as usual
            await host.closed.wait()
            await _wait_until(lambda: executor.availability == "offline")
        assert changes == ["draining", "offline"]
        assert executor.errors == 0  # a drain is not an error
        assert executor.statistics().calls.client[("not_dispatched", "DRAINING")] == 1


@both_directions
async def test_the_goodbye_outlives_socket_cuts(direction: Any) -> None:
    """Sent while the socket is down, it is replayed on the resume; once known, a resumed session
    goes back to ``draining``, never to ``ready``."""
    limits = LIMITS.replace(detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}, limits=limits, proxy=True) as pair:
            proxy = pair.proxy
            assert proxy is not None
            proxy.refuse()
            proxy.cut()
            await pair.wait_availability("reconnecting")
            pair.worker_rpc.start_drain()  # the goodbye waits in the worker's retention
            proxy.heal()
            await pair.wait_availability("draining")
            seen = len(pair.history)
            proxy.refuse()
            proxy.cut()
            await pair.wait_availability("reconnecting")
            proxy.heal()
            await pair.wait_availability("draining")
            assert pair.history[seen:] == ["reconnecting", "draining"], pair.history
            assert pair.history[:2] == ["ready", "reconnecting"], pair.history
            assert pair.rpc.peer_draining  # the same session throughout
            assert pair.executor.statistics().sessions == 1


async def test_a_flood_of_goodbyes_is_one_transition(caplog: pytest.LogCaptureFixture) -> None:
    """A worker with a key repeating its goodbye: one transition, one log line, nothing kept."""
    caplog.set_level(logging.DEBUG, logger="garcon_link")
    impl = CalcImpl()
    async with _ends("worker-listens", impl) as (_, executor, host):
        changes: list[str] = []
        executor.on_availability_changed(changes.append)
        worker_rpc = host.worker.current_rpc
        controller_rpc = executor.current_rpc
        assert worker_rpc is not None and controller_rpc is not None
        goodbye = encode(Notify("$link", "draining", [], {}))
        with anyio.fail_after(DEADLINE):
            for _ in range(2000):
                await worker_rpc.transport.send(goodbye)
            # Envelopes are dispatched in order: once this one is dropped, all were handled.
            await worker_rpc.transport.send(encode(Notify("nothing", "here", [], {})))
            await _wait_until(lambda: controller_rpc.statistics().notifications_dropped >= 1)
        stats = controller_rpc.statistics()
        assert (stats.notifications_dropped, stats.malformed_envelopes) == (1, 0)
        assert changes == ["draining"]
        lines = [r.getMessage() for r in caplog.records if "draining" in r.getMessage()]
        assert lines == ["executor box: ready -> draining"], lines


async def test_a_draining_worker_refuses_new_sessions_and_admits_resumes() -> None:
    """While a worker drains, a controller it has never served is refused at the handshake
    (4010) at once -- no session, no ``executor-ready`` line -- and says the worker is draining;
    the controller it serves still resumes after a socket loss and gets its call's real result."""
    impl = CalcImpl()
    events: list[str] = []
    worker = gl.Worker(_config(gl.Role.WORKER, listen=True), {"calc": impl}, on_event=events.append)
    host = _WorkerHost(worker)
    async with anyio.create_task_group() as tg:
        await tg.start(host.run)
        first = gl.connect(_config(gl.Role.CONTROLLER, listen=False, url=worker.url))
        async with first:
            with anyio.fail_after(DEADLINE):
                await first.wait_ready()
                calc = first.service("calc", Calc)
                held, held_done = _start(tg, calc.hold("a"))
                await impl.probe.wait("started:a")
                host.stop(drain=DEADLINE)
                await _wait_until(lambda: first.availability == "draining")

                second = gl.connect(_config(gl.Role.CONTROLLER, listen=False, url=worker.url))
                async with second:
                    with pytest.raises(gl.NotDispatched) as refused:
                        await second.wait_ready(refused_dials=1)  # at once, not at a timeout
                    assert refused.value.code == "DRAINING", refused.value
                    assert "is draining" in refused.value.message
                    assert "4010" in refused.value.message
                    assert second.availability == "offline"  # it never had a session
                    with pytest.raises(gl.NotDispatched) as call_refused:
                        await second.service("calc", Calc).add(1, 2)
                    assert call_refused.value.code == "DRAINING"
                    assert second.errors == 0  # a drain refusal is not an error
                    link = second.link.statistics()
                    assert link.fresh_sessions == 0 and link.handshakes_completed == 0
                    assert worker.link.statistics().sessions_refused_draining >= 1
                    # Waiting without refused_dials goes on (for a restart) and says why.
                    with pytest.raises(TimeoutError, match="is draining"):
                        await second.wait_ready(timeout=0.05)
                    assert impl.counts["add"] == 0

                    # The served controller's socket drops mid-drain: its resume is admitted.
                    resumed_before = worker.link.statistics().resumed
                    await first.link.disconnect()
                    await _wait_until(lambda: worker.link.statistics().resumed > resumed_before)
                    await _wait_until(lambda: first.availability == "draining")
                    impl._release("a")
                    await held_done.wait()
                    assert held == ["a"]  # the real result, after the resume
                    await host.closed.wait()

                    # The worker has gone: once a dial finds nothing there, its drain refusal
                    # no longer stands.
                    await _wait_until(lambda: second.link.statistics().dials_refused_in_a_row)
                    with pytest.raises(gl.NotDispatched) as gone:
                        await second.wait_ready(refused_dials=3)
                    assert gone.value.code == "UNREACHABLE", gone.value
    assert [e.split()[0] for e in events].count("executor-ready") == 1, events
    assert worker.sessions == 1


async def test_an_executor_a_draining_worker_refused_says_so_where_it_shows_offline() -> None:
    """An executor the draining worker refused (4010) stays ``offline`` -- it has no session --
    but says the worker drains wherever one looks: its ``last_error``, a fleet's snapshot
    (``reason``) and ``garcon-link fleet``'s table, and ``wait_ready``'s timeout says it once.
    Once a dial finds nothing there (the worker has exited), none of them says so any more."""
    impl = CalcImpl()
    worker = gl.Worker(_config(gl.Role.WORKER, listen=True), {"calc": impl})
    host = _WorkerHost(worker)
    async with anyio.create_task_group() as tg:
        await tg.start(host.run)
        first = gl.connect(_config(gl.Role.CONTROLLER, listen=False, url=worker.url))
        async with first:
            with anyio.fail_after(DEADLINE):
                await first.wait_ready()
                held, held_done = _start(tg, first.service("calc", Calc).hold("a"))
                await impl.probe.wait("started:a")
                host.stop(drain=DEADLINE)
                await _wait_until(lambda: first.availability == "draining")

                dialing = _config(gl.Role.CONTROLLER, listen=False, url=worker.url)
                async with gl.connect(dialing) as second, gl.fleet(dialing) as fleet:
                    member = fleet.executor("box")
                    await _wait_until(lambda: second.link.refusal and member.link.refusal)
                    for executor in (second, member):
                        assert executor.availability == "offline"
                        assert executor.last_error is not None
                        assert "is draining" in executor.last_error, executor.last_error
                        assert "4010" in executor.last_error
                    snapshot = fleet.executors()["box"]
                    assert (snapshot.availability, snapshot.reason) == ("offline", "draining")
                    assert fleet_table(fleet)[1].split()[:3] == ["box", "offline", "(draining)"]
                    with pytest.raises(TimeoutError) as timed_out:
                        await second.wait_ready(timeout=0.05)
                    assert str(timed_out.value).count("is draining") == 1, timed_out.value

                    impl._release("a")
                    await held_done.wait()
                    assert held == ["a"]
                    await host.closed.wait()
                    # The worker has gone: a dial finds nothing there.
                    await _wait_until(
                        lambda: (
                            second.link.statistics().dials_refused_in_a_row
                            and member.link.statistics().dials_refused_in_a_row
                        )
                    )
                    assert second.last_error is None and member.last_error is None
                    assert fleet.executors()["box"].reason is None
                    assert fleet_table(fleet)[1].split()[:2] == ["box", "offline"]
                    assert fleet_table(fleet)[1].split()[2] == "-"


def _free_port() -> int:
    """A loopback port just freed: nothing listens there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _dead_url() -> str:
    """A loopback URL where nothing listens: every dial is refused."""
    return f"ws://127.0.0.1:{_free_port()}/executor"


async def test_a_draining_dialing_worker_stops_dialing_where_it_has_no_session() -> None:
    """A dialing worker's link without a session has nothing to resume once the worker drains:
    it stops dialing, while the link holding a session goes on serving it. The yardstick is a
    dial loop of our own with the same backoff to the same dead address."""
    dead = _dead_url()
    impl = CalcImpl()
    async with anyio.create_task_group() as tg:
        executor = gl.connect(_config(gl.Role.CONTROLLER, listen=True))
        async with executor:
            config = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.WORKER,
                secret=SECRET,
                dial=dead,  # its own link: worker.statistics().link
                also_dial=(executor.link.url,),
                limits=LIMITS,
            )
            host = _WorkerHost(gl.Worker(config, {"calc": impl}))
            await tg.start(host.run)
            worker = host.worker
            with anyio.fail_after(DEADLINE):
                await executor.wait_ready()
                calc = executor.service("calc", Calc)
                held, held_done = _start(tg, calc.hold("a"))
                await impl.probe.wait("started:a")
                # The dead link dials on until the drain.
                await _wait_until(lambda: worker.statistics().link.dials_refused >= 2)
                host.stop(drain=DEADLINE)
                await _wait_until(lambda: executor.availability == "draining")
                before = worker.statistics().link.dial_attempts
                yardstick = WebSocketLink(
                    role=gl.Role.CONTROLLER,
                    executor_id="box",
                    secret=SECRET.reveal(),
                    dial=dead,
                    limits=LIMITS,
                )
                async with yardstick:
                    await _wait_until(lambda: yardstick.statistics().dial_attempts >= 20)
                # At most the attempt under way when the drain began.
                assert worker.statistics().link.dial_attempts <= before + 1
                impl._release("a")
                await held_done.wait()
                assert held == ["a"]
                await host.closed.wait()


async def test_a_draining_dialing_worker_refuses_a_restarted_controller_s_fresh_session() -> None:
    """The controller a dialing worker serves restarts (same address, a new process) while the
    worker drains: the worker's resume meets no session there, the handshake settles on a fresh
    one, and the worker refuses it (4010) -- the new controller retires the session it had just
    admitted at once (not after its detached grace) and never becomes ready."""
    port = _free_port()
    limits = LIMITS.replace(detached_grace=30.0)  # far beyond every wait below

    def controller() -> gl.RemoteExecutor:
        config = gl.LinkConfig(
            executor_id="box",
            role=gl.Role.CONTROLLER,
            secret=SECRET,
            listen=("127.0.0.1", port),
            limits=limits,
        )
        return gl.connect(config)

    impl = CalcImpl()
    async with anyio.create_task_group() as tg:
        first = controller()
        async with first:
            config = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.WORKER,
                secret=SECRET,
                dial=first.link.url,
                limits=limits,
            )
            host = _WorkerHost(gl.Worker(config, {"calc": impl}))
            await tg.start(host.run)
            with anyio.fail_after(DEADLINE):
                await first.wait_ready()
                _start(tg, first.service("calc", Calc).hold("a"))
                await impl.probe.wait("started:a")
                host.stop(drain=DEADLINE)
                await _wait_until(lambda: first.availability == "draining")
                assert isinstance(first.link, WebSocketLink)
                await first.link.abort()  # the controller process dies
        sessions: list[Any] = []
        second = controller()
        assert isinstance(second.link, WebSocketLink)
        second.link.on_session(lambda transport, _result: sessions.append(transport))
        async with second:
            with anyio.fail_after(DEADLINE):
                await _wait_until(lambda: bool(sessions) and sessions[0].failure is not None)
                failure = sessions[0].failure
                assert "4010" in str(failure), failure
                assert second.availability == "offline"
                assert host.worker.sessions == 1  # the worker began no session
                impl._release("a")
                # Its reply can never be acknowledged (its controller is gone): end the drain's
                # wait by ending the worker's link, rather than by waiting the drain time out.
                await host.worker.link.abort()
                await host.closed.wait()


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        (gl.NotDispatched("DRAINING", "draining"), False),
        (gl.NotDispatched("OFFLINE", "offline"), True),
        (gl.NotDispatched("OVERLOADED", "busy"), True),
        (gl.OutcomeUnknown("DRAINING", "not a refusal: it may have run"), True),
        (gl.Rejected("UNKNOWN_SERVICE", "no"), True),
    ],
)
def test_only_a_drain_refusal_is_not_an_error(error: gl.CallError, counted: bool) -> None:
    assert counts_as_error(error) is counted


async def test_serve_with_drain_drains_when_cancelled() -> None:
    """``serve(..., drain=)`` runs until cancelled; the cancellation drains first (shielded)."""
    impl = CalcImpl()
    worker_config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    serving = anyio.CancelScope()

    async def serve(*, task_status: anyio.abc.TaskStatus[str]) -> None:
        with serving:
            await gl.serve(worker_config, {"calc": impl}, drain=DEADLINE, task_status=task_status)

    async with anyio.create_task_group() as tg:
        url = await tg.start(serve)
        controller = gl.LinkConfig(
            executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, dial=url, limits=LIMITS
        )
        async with gl.connect(controller) as executor, anyio.create_task_group() as calls:
            with anyio.fail_after(DEADLINE):
                await executor.wait_ready(5)
                calc = executor.service("calc", Calc)
                held, held_done = _start(calls, calc.hold("s"))
                await impl.probe.wait("started:s")
                serving.cancel()  # serve() is cancelled: it drains
                refused: gl.NotDispatched | None = None
                while refused is None:  # until the drain has begun (calls before it just run)
                    ran = impl.counts["add"]
                    try:
                        await calc.add(1, 1)
                    except gl.NotDispatched as exc:
                        refused = exc
                assert refused.code == "DRAINING"
                assert impl.counts["add"] == ran  # refused unexecuted
                impl._release("s")
                await held_done.wait()
    assert held == ["s"]


# ---------------------------------------------------------------------------------- controller


@both_directions
async def test_controller_drain_finishes_pending_calls_and_refuses_new_ones(
    direction: Any,
) -> None:
    impl = CalcImpl()
    async with anyio.create_task_group() as tg, _ends(direction, impl) as (calc, executor, host):
        worker_rpc = host.worker.current_rpc
        assert worker_rpc is not None
        seen: dict[str, Any] = {}

        async def meanwhile() -> None:
            await _wait_until(lambda: executor.draining)
            incoming_before = worker_rpc.statistics().incoming_calls
            for name, call in (("add", calc.add(1, 2)), ("count", anext(aiter(calc.count(2))))):
                try:
                    await call
                except gl.NotDispatched as exc:
                    seen[name] = exc.code
            seen["sent"] = worker_rpc.statistics().incoming_calls - incoming_before
            seen["availability"] = executor.availability
            impl._release("c")

        held, held_done = _start(tg, calc.hold("c"))
        with anyio.fail_after(DEADLINE):
            await impl.probe.wait("started:c")
        tg.start_soon(meanwhile)
        await executor.aclose(drain=DEADLINE)  # returns once "c" replied (or DEADLINE)
        with anyio.fail_after(DEADLINE):
            await held_done.wait()
        assert held == ["c"]
        assert seen == {"add": "DRAINING", "count": "DRAINING", "sent": 0, "availability": "ready"}
        assert impl.counts["add"] == 0 and impl.counts["count"] == 0
        assert executor.availability == "disposed"
        with pytest.raises(gl.NotDispatched) as after:
            await calc.add(1, 2)
        assert after.value.code == "DISPOSED"


@both_directions
async def test_controller_drain_time_up_fails_pending_calls_as_unknown(direction: Any) -> None:
    impl = CalcImpl()
    async with anyio.create_task_group() as tg, _ends(direction, impl) as (calc, executor, _):
        held, held_done = _start(tg, calc.hold("late"))
        with anyio.fail_after(DEADLINE):
            await impl.probe.wait("started:late")
        await executor.aclose(drain=0.2)
        with anyio.fail_after(DEADLINE):
            await held_done.wait()
            assert len(held) == 1 and isinstance(held[0], gl.OutcomeUnknown), held
            await impl.probe.wait("cancelled:late")  # the worker saw the session end


async def test_drain_with_nothing_in_flight_closes_at_once() -> None:
    impl = CalcImpl()
    async with _ends("worker-listens", impl) as (calc, executor, host):
        assert await calc.add(2, 2) == 4
        started = anyio.current_time()
        await executor.aclose(drain=30)
        host.stop(drain=30)
        with anyio.fail_after(DEADLINE):
            await host.closed.wait()
        assert anyio.current_time() - started < 2  # far below the drain time: nothing to wait
        assert executor.availability == "disposed"
