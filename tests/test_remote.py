"""Tests of garcon_link.api (controller, worker, facades): stable facades, availability, resumable
cuts, worker restarts, contract checks, per-session scopes, bidirectional services and the worker
runtime.

Every end-to-end test runs in both directions (worker listens / controller listens) and on both
anyio backends. What ran on the worker is asserted through the services' counters; timing is
never asserted except as a generous upper bound on "fails at once" (which a wait of the dispatch
deadline would exceed); every wait is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import logging
import socket
from collections.abc import AsyncIterator
from typing import Annotated, Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import msgspec
import pytest
from faultutil import Raw
from rpcutil import (
    LIMITS,
    SECRET,
    Calc,
    CalcImpl,
    Direction,
    SinkImpl,
    both_directions,
    open_pair,
    own_link,
    raw_call,
)

import garcon_link as gl
from garcon_link.api.described import interned_counts
from garcon_link.core.wire import encode_canonical
from garcon_link.rpc.interface import service_spec
from garcon_link.rpc.manifest import method_entries

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10
QUICK_GRACE = LIMITS.replace(detached_grace=0.3)


class CalcImplPlus(CalcImpl):
    """A worker whose interface grew a method: a different contract."""

    async def mul(self, a: int, b: int) -> int:
        return a * b


# ---------------------------------------------------------------------------------- basics


@both_directions
async def test_calls_streams_and_info(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            executor = pair.executor
            assert executor.availability == "ready"
            calc = executor.service("calc", Calc)
            assert await calc.add(1, 2) == 3
            assert [i async for i in calc.count(5)] == [0, 1, 2, 3, 4]
            await calc.note("hello")
            await impl.probe.wait("note:hello")
            info = await executor.info()
            assert info.executor_id == "box"
            assert len(info.instance_id) == 16
            assert info.session_id == executor.link.transport.session_id  # type: ignore[union-attr]
            assert set(info.services) == {"calc"}
            assert info.services["calc"]["add"] == {
                "kind": "unary",
                "signature": "(a: int, b: int) -> int",
            }
            assert info.services["calc"]["count"]["kind"] == "stream"
            assert len(info.contract) == 64
            assert "calc" in repr(calc) and "box" in repr(calc)
            assert pair.history == ["ready"]


async def test_a_dynamic_facade_is_built_from_the_manifest() -> None:
    # Before: executor.service(name) needed an interface class (TypeError without one).
    impl = CalcImpl()
    controller_cfg = gl.LinkConfig(
        executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    not_yet = gl.connect(controller_cfg).service("calc")
    with pytest.raises(gl.NotDispatched, match="wait_ready"):
        not_yet.add  # noqa: B018 -- the manifest is not known before a session was installed
    assert "add" not in dir(not_yet)
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}) as pair:
            calc = pair.executor.service("calc")
            assert await calc.add(1, 2) == 3
            assert await calc.add(a=2, b=3) == 5
            assert [i async for i in calc.count(3)] == [0, 1, 2]
            assert {"add", "count", "hold"} <= set(dir(calc))
            assert "dynamic facade calc" in repr(calc)
            with pytest.raises(gl.Rejected, match="INVALID_ARGUMENTS"):
                await calc.add("x", 1)  # validated on the worker
            with pytest.raises(AttributeError, match=r"'calc' has no callable method 'nope'"):
                calc.nope  # noqa: B018
            assert not hasattr(calc, "_private")
            patient = gl.with_options(calc, timeout=5)
            assert await patient.add(2, 2) == 4
            with pytest.raises(AttributeError, match="no service named 'nothing'"):
                pair.executor.service("nothing").add  # noqa: B018


@pytest.mark.timeout(20)
async def test_serve_prints_diagnostics_and_runs_until_cancelled() -> None:
    lines: list[str] = []
    wcfg = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            url = await tg.start(
                lambda task_status: gl.serve(
                    wcfg, {"calc": CalcImpl()}, on_event=lines.append, task_status=task_status
                )
            )
            assert url.startswith("ws://127.0.0.1:") and url.endswith("/executor")
            ccfg = gl.LinkConfig(
                executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, dial=url, limits=LIMITS
            )
            async with gl.connect(ccfg) as executor:
                await executor.wait_ready(5)
                info = await executor.info()
                assert await executor.service("calc", Calc).add(2, 2) == 4
                while len(lines) < 2:
                    await anyio.sleep(0.005)
            cancelled_at = anyio.current_time()
            tg.cancel_scope.cancel()
    # Regression: cancelling serve() used to spin the asyncio loop at 100% CPU (a
    # CancelledError that was its own __context__), only broken by the pytest timeout.
    assert anyio.current_time() - cancelled_at < 5
    assert lines[0] == f"executor-listening url={url} executor=box"
    assert lines[1] == (
        f"executor-ready executor=box session={info.session_id.hex()} "
        f"instance={info.instance_id.hex()} resumed=false"
    )
    for line in lines:
        assert all("=" in part for part in line.split()[1:])


def test_roles_are_checked() -> None:
    worker_cfg = gl.LinkConfig(
        executor_id="box", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    controller_cfg = gl.LinkConfig(
        executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    with pytest.raises(gl.ConfigError, match="controller"):
        gl.connect(worker_cfg)
    with pytest.raises(gl.ConfigError, match="worker"):
        gl.Worker(controller_cfg, {})
    with pytest.raises(TypeError):
        gl.with_options(object(), timeout=1)
    with pytest.raises(LookupError):
        gl.peer("sink", Calc)
    with pytest.raises(LookupError):
        gl.current_scope()
    executor = gl.connect(controller_cfg)
    with pytest.raises(TypeError, match="class"):
        executor.service("calc", lambda: 1)


async def test_start_failure_raises_the_link_error_itself() -> None:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as taken:
        port = taken.extra(anyio.abc.SocketAttribute.local_port)
        for role in (gl.Role.WORKER, gl.Role.CONTROLLER):
            cfg = gl.LinkConfig(
                executor_id="box",
                role=role,
                secret=SECRET,
                listen=("127.0.0.1", port),
                limits=LIMITS,
            )
            endpoint = gl.Worker(cfg, {}) if role is gl.Role.WORKER else gl.connect(cfg)
            with anyio.fail_after(DEADLINE), pytest.raises(gl.LinkError, match="cannot listen"):
                async with endpoint:
                    pass


@both_directions
async def test_dispose_is_final(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            calc = pair.calc()
            seen: list[str] = []
            unsubscribe = pair.executor.on_availability_changed(seen.append)
            late: list[str] = []
            pair.executor.on_availability_changed(late.append)()  # unsubscribed at once
            unsubscribe()
            unsubscribe()  # idempotent
            await pair.stop_controller()
            assert pair.executor.availability == "disposed"
            assert pair.history == ["ready", "disposed"]
            assert seen == [] and late == []
            with pytest.raises(gl.NotDispatched) as info:
                await calc.add(1, 2)
            assert info.value.code == "DISPOSED"
            with pytest.raises(gl.NotDispatched, match="DISPOSED"):
                await pair.executor.wait_ready(1)
            await pair.executor.aclose()  # idempotent
            assert pair.history == ["ready", "disposed"]


@both_directions
async def test_availability_callback_errors_are_contained(direction: Direction) -> None:
    def broken(_: str) -> None:
        raise RuntimeError("callback bug")

    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            pair.executor.on_availability_changed(broken)
            await pair.disconnect()
            assert await pair.calc().add(1, 2) == 3
            assert pair.history[-1] == "ready"


# ---------------------------------------------------------------------------------- resumable cuts


@both_directions
async def test_a_cut_and_resume_leave_no_exception_in_a_reference_cycle(
    direction: Direction,
) -> None:
    """What a detach ends (heartbeat, writer, replay watch) returns instead of dying of a
    cancellation that anyio's asyncio task group keeps in a cycle with its traceback and
    frames: at 1,000 sessions such garbage makes the cyclic collector's full passes more
    frequent."""
    cuts = 3
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            assert await pair.calc().add(1, 2) == 3
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for i in range(cuts):
                    await pair.disconnect()
                    assert await pair.calc().add(i, 1) == i + 1
                gc.collect()
                caught = [o for o in gc.garbage if isinstance(o, BaseException)]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
    assert [type(e).__name__ for e in caught] == []


@both_directions
async def test_cuts_mid_stream_lose_and_double_nothing(direction: Direction) -> None:
    impl = CalcImpl()
    n = 2000
    cuts = {150, 600, 1100, 1700}
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            items: list[int] = []
            async for i in pair.calc().count(n):
                items.append(i)
                if i in cuts:
                    await pair.executor.link.disconnect()
            assert items == list(range(n))
            assert impl.counts["count"] == 1
            assert pair.history.count("offline") == 0
            assert pair.history.count("reconnecting") >= 1
            assert pair.history[0] == "ready" and pair.history[-1] == "ready"
            assert pair.worker is not None and pair.worker.sessions == 1


@both_directions
async def test_cuts_mid_batch_of_concurrent_calls(direction: Direction) -> None:
    impl = CalcImpl()
    n = 200
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            results: dict[int, int] = {}

            async def one(i: int) -> None:
                results[i] = await calc.record(i, gated=i % 2 == 0)

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
                # cut while requests are still being written and handlers are parked
                await impl.probe.wait("record:10")
                await pair.disconnect()
                await impl.probe.wait("record:120")
                await pair.disconnect()
                for i in range(n):
                    await impl.probe.wait(f"record:{i}")
                # cut while the replies of the gated half are in flight
                impl.gate.set()
                await pair.executor.link.disconnect()
                await pair.wait_attached_again()
                await pair.disconnect()
            assert results == {i: 2 * i for i in range(n)}
            assert all(impl.counts[i] == 1 for i in range(n)), "a handler ran twice"
            assert "offline" not in pair.history
            assert pair.worker is not None and pair.worker.sessions == 1


@both_directions
async def test_dispatch_deadline_waits_for_a_reconnecting_executor(direction: Direction) -> None:
    impl = CalcImpl()
    limits = LIMITS.replace(detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}, limits=limits, proxy=True) as pair:
            assert pair.proxy is not None
            calc = pair.calc()
            assert await calc.add(1, 1) == 2
            pair.proxy.refuse()
            pair.proxy.cut()
            await pair.wait_availability("reconnecting")

            # deadline 0 (the default): fails at once
            with anyio.fail_after(1), pytest.raises(gl.NotDispatched) as info:
                await calc.add(1, 2)
            assert info.value.code == "RECONNECTING"

            # a short deadline that expires: NotDispatched after waiting
            started = anyio.current_time()
            with pytest.raises(gl.NotDispatched, match="RECONNECTING"):
                await gl.with_options(calc, dispatch_deadline=0.1).add(1, 2)
            assert anyio.current_time() - started >= 0.1
            assert impl.counts["add"] == 1

            # a deadline that outlasts the outage: the call goes through once resumed
            patient = gl.with_options(calc, dispatch_deadline=5)
            results: list[int] = []

            async def call() -> None:
                results.append(await patient.add(2, 3))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.sleep(0.05)
                assert results == []
                pair.proxy.heal()
            assert results == [5]
            assert impl.counts["add"] == 2
            assert pair.history == ["ready", "reconnecting", "ready"]


# ---------------------------------------------------------------------------------- restarts


@both_directions
async def test_worker_restart_mid_call(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}, limits=QUICK_GRACE) as pair:
            calc = pair.calc()
            ref = await calc.open_job("first")
            assert await calc.job_name(ref) == "first"
            first_instance = (await pair.executor.info()).instance_id
            outcome: list[BaseException] = []
            stream_items: list[int] = []
            impl.stream_delay = 0.001

            async def pending_call() -> None:
                try:
                    await calc.hold("k")
                except gl.CallError as exc:
                    outcome.append(exc)

            async def pending_stream() -> None:
                try:
                    async for i in calc.ticks("s"):
                        stream_items.append(i)
                except gl.CallError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(pending_call)
                tg.start_soon(pending_stream)
                await impl.probe.wait("started:k")
                await impl.probe.wait("stream-started:s")
                while len(stream_items) < 5:
                    await anyio.sleep(0.001)
                # A crash, not a clean stop: a clean stop sends 1001 and the controller retires
                # the session at once (test_clean_worker_stop_retires_at_once).
                await pair.crash_worker()
                await pair.wait_availability("reconnecting")

                # reconnecting: fails at once by default, after the deadline otherwise
                with anyio.fail_after(1), pytest.raises(gl.NotDispatched, match="RECONNECTING"):
                    await calc.add(1, 2)
                with pytest.raises(gl.NotDispatched):
                    await gl.with_options(calc, dispatch_deadline=0.05).add(1, 2)

                await pair.wait_availability("offline")  # the grace ran out
            assert len(outcome) == 2
            assert all(isinstance(e, gl.OutcomeUnknown) for e in outcome), outcome
            assert all(e.code == "CONTINUITY_LOST" for e in outcome)  # type: ignore[attr-defined]
            assert stream_items == list(range(len(stream_items)))  # in order, nothing doubled

            # offline: NotDispatched at once, whatever the dispatch deadline
            with anyio.fail_after(1):
                with pytest.raises(gl.NotDispatched) as info:
                    await gl.with_options(calc, dispatch_deadline=30).add(1, 2)
                assert info.value.code == "OFFLINE"
                with pytest.raises(gl.NotDispatched, match="OFFLINE"):
                    await calc.count(3).__anext__()
                with pytest.raises(gl.NotDispatched, match="OFFLINE"):
                    await pair.executor.info()
            with pytest.raises(TimeoutError, match="not ready"):
                await pair.executor.wait_ready(0.05)

            impl2 = CalcImpl()
            await pair.start_worker({"calc": impl2})
            await pair.executor.wait_ready(5)
            # the same facade object works again, on the new session
            assert await calc.add(1, 2) == 3
            assert impl2.counts["add"] == 1 and impl.counts["add"] == 0
            info2 = await pair.executor.info()
            assert info2.instance_id != first_instance
            # the old session's resource is stale; a new one works
            with pytest.raises(gl.StaleResource) as stale:
                await calc.job_name(ref)
            assert stale.value.outcome is gl.Outcome.REJECTED
            assert impl.counts["k"] == 1 and impl2.counts["k"] == 0
            ref2 = await calc.open_job("second")
            assert ref2.instance_id == info2.instance_id
            assert await calc.job_name(ref2) == "second"
            assert pair.history == ["ready", "reconnecting", "offline", "ready"]


@both_directions
async def test_clean_worker_stop_retires_at_once(direction: Direction) -> None:
    # A worker that shuts down cleanly closes with 1001: its session is gone, so the controller
    # retires it at once -- no waiting out the detached grace -- and goes straight to offline.
    impl = CalcImpl()
    long_grace = LIMITS.replace(detached_grace=30.0)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}, limits=long_grace) as pair:
            calc = pair.calc()
            outcome: list[BaseException] = []

            async def pending_call() -> None:
                try:
                    await calc.hold("k")
                except gl.CallError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(pending_call)
                await impl.probe.wait("started:k")
                await pair.stop_worker()
                await pair.wait_availability("offline")  # well inside DEADLINE << grace
            assert [type(e) for e in outcome] == [gl.OutcomeUnknown]
            assert pair.history == ["ready", "offline"]


@both_directions
async def test_quick_worker_restart_replaces_the_session(direction: Direction) -> None:
    # The new worker arrives before the grace expires: the old session is replaced at once.
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            outcome: list[BaseException] = []

            async def pending_call() -> None:
                try:
                    await calc.hold("k")
                except gl.CallError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(pending_call)
                await impl.probe.wait("started:k")
                impl2 = CalcImpl()
                await pair.restart_worker({"calc": impl2})
                await pair.executor.wait_ready(5)
            assert len(outcome) == 1 and isinstance(outcome[0], gl.OutcomeUnknown)
            assert await calc.add(2, 2) == 4
            assert impl2.counts["add"] == 1
            assert pair.history.count("offline") == 1
            assert pair.history[0] == "ready" and pair.history[-1] == "ready"
            assert pair.history[pair.history.index("offline") + 1 :] == ["ready"]


@both_directions
async def test_stale_resource_is_refused_by_the_worker_too(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}, limits=QUICK_GRACE) as pair:
            calc = pair.calc()
            ref = await calc.open_job("a")
            await pair.restart_worker({"calc": impl})
            await pair.executor.wait_ready(5)
            # the controller refuses before sending; a peer that sends it anyway is refused by
            # the worker's scope check before the handler runs
            wire_ref = {
                "kind": ref.kind,
                "executor_id": ref.executor_id,
                "instance_id": ref.instance_id,
                "id": ref.id,
            }
            with pytest.raises(gl.StaleResource):
                await raw_call(pair.rpc, "calc", "job_name", [wire_ref])
            forged = dict(wire_ref, executor_id="other-box")
            with pytest.raises(gl.StaleResource):
                await raw_call(pair.rpc, "calc", "job_name", [forged])
            fresh = await calc.open_job("b")
            wrong_kind = {**wire_ref, "instance_id": fresh.instance_id, "kind": "process"}
            with pytest.raises(gl.Rejected, match="WRONG_RESOURCE_KIND") as info:
                await raw_call(pair.rpc, "calc", "job_name", [wrong_kind])
            assert not isinstance(info.value, gl.StaleResource)  # wrong kind, not stale


class CalcAddOnly:
    """A worker that serves ``add`` alone: every other method of ``Calc`` was removed."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {"add": 0}

    async def add(self, a: int, b: int) -> int:
        self.counts["add"] += 1
        return a + b


class CalcReturnsText(CalcImpl):
    """Only a return type differs from CalcImpl."""

    async def add(self, a: int, b: int) -> str:  # type: ignore[override]
        self.counts["add"] += 1
        return str(a + b)


class CalcPlus(Calc, Protocol):
    async def mul(self, a: int, b: int) -> int: ...


@both_directions
async def test_changed_contract_is_refused(direction: Direction) -> None:
    """Contracts are judged per method: a worker upgraded additively is installed behind the
    same facades; only a method changed incompatibly, or removed, fails -- its own calls, at
    once, nothing sent."""
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            assert await calc.add(1, 2) == 3
            # additive: a new method. The same facade goes on; a wider view reaches ``mul``.
            await pair.restart_worker({"calc": CalcImplPlus()})
            await pair.executor.wait_ready(5)
            assert await calc.add(1, 2) == 3
            plus = pair.executor.service("calc", CalcPlus)
            assert await plus.mul(2, 3) == 6
            assert pair.executor.last_error is None
            assert pair.restarts() == ["ready", "offline", "ready"], pair.history

            # incompatible: ``add`` returns text. Only ``add`` fails, before anything is sent.
            changed = CalcReturnsText()
            await pair.restart_worker({"calc": changed})
            await pair.executor.wait_ready(5)
            with pytest.raises(gl.Rejected) as info:
                await calc.add(1, 2)
            assert info.value.code == "CONTRACT_CHANGED"
            assert "calc.add" in info.value.message
            assert "result int  =>  'str' (wider)" in info.value.message
            assert changed.counts["add"] == 0  # not run: not even sent
            assert [i async for i in calc.count(3)] == [0, 1, 2]  # the others are fine
            with pytest.raises(gl.Rejected, match="UNSUPPORTED"):
                await plus.mul(1, 1)  # not offered by this worker
            # removed: a worker serving ``add`` alone
            await pair.restart_worker({"calc": CalcAddOnly()})
            await pair.executor.wait_ready(5)
            assert await calc.add(2, 2) == 4
            with pytest.raises(gl.Rejected) as removed:
                await calc.note("x")
            assert removed.value.code == "UNSUPPORTED"
            with pytest.raises(gl.Rejected, match="UNSUPPORTED"):
                await anext(calc.count(1))
            # and the original contract is served again by the next worker
            await pair.restart_worker({"calc": CalcImpl()})
            await pair.executor.wait_ready(5)
            assert [i async for i in calc.count(2)] == [0, 1]
            assert pair.restarts() == ["ready"] + ["offline", "ready"] * 4, pair.history


async def test_a_changed_return_type_is_a_contract_change() -> None:
    # ``-> int`` becoming ``-> str`` is a change the facade sees before sending: the call fails
    # Rejected(CONTRACT_CHANGED) at once rather than running and failing INVALID_RESULT.
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": CalcImpl()}) as pair:
            calc = pair.calc()
            assert await calc.add(1, 2) == 3
            changed = CalcReturnsText()
            await pair.restart_worker({"calc": changed})
            await pair.executor.wait_ready(5)
            with pytest.raises(gl.Rejected, match="CONTRACT_CHANGED"):
                await calc.add(1, 2)
            assert changed.counts["add"] == 0
            # a facade made now is checked at once too; the dynamic one follows the worker
            assert await pair.executor.service("calc").add(1, 2) == "3"


class LabelV1(msgspec.Struct):
    text: str
    size: int = 1


class LabelV2(msgspec.Struct):
    """LabelV1 with ``size`` renamed: a V2 worker would silently read a V1 caller's ``size``
    as its default."""

    text: str
    points: int = 1


LabelV1.__qualname__ = LabelV1.__name__ = LabelV2.__qualname__ = LabelV2.__name__ = "Label"


class Labeler(Protocol):
    async def measure(self, label: LabelV1) -> int: ...
    async def weigh(self, label: LabelV1) -> int: ...


class LabelerV1:
    async def measure(self, label: LabelV1) -> int:
        return label.size

    async def weigh(self, label: LabelV1) -> int:
        return label.size


class LabelerV2:
    def __init__(self) -> None:
        self.runs = 0

    async def measure(self, label: LabelV2) -> int:
        self.runs += 1
        return label.points

    async def weigh(self, label: LabelV2) -> int:
        self.runs += 1
        return label.points


async def test_a_renamed_struct_field_is_a_contract_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The signature text is the same on both workers (``(label: test_remote.Label) -> int``):
    # only the manifest's field listing shows the rename, and the call fails before sending.
    # Label is listed once, in measure's entry: weigh only refers to it, and is refused too.
    caplog.set_level(logging.INFO, logger="garcon_link.remote")
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"labels": LabelerV1()}) as pair:
            labels = pair.executor.service("labels", Labeler)
            assert await labels.measure(LabelV1("a", size=3)) == 3
            changed = LabelerV2()
            await pair.restart_worker({"labels": changed})
            await pair.executor.wait_ready(5)
            with pytest.raises(gl.Rejected) as info:
                await labels.measure(LabelV1("a", size=3))
            assert info.value.code == "CONTRACT_CHANGED"
            assert "Label.size removed or renamed on the worker" in info.value.message
            with pytest.raises(gl.Rejected) as info:
                await labels.weigh(LabelV1("a", size=3))
            assert "Label.size removed or renamed on the worker" in info.value.message
            assert changed.runs == 0
            (line,) = [
                r.getMessage() for r in caplog.records if "contract changed" in r.getMessage()
            ]
            assert "labels.measure: incompatible" in line and "labels.weigh: incompatible" in line


T = TypeVar("T")


class Box(msgspec.Struct, Generic[T], omit_defaults=True):
    item: T
    note: str = ""


@dataclasses.dataclass
class Crate(Generic[T]):
    items: list[T]


class Boxes(Protocol):
    async def double(self, box: Box[int]) -> Box[int]: ...
    async def pack(self, crates: list[Crate[str]]) -> Crate[str]: ...


class BoxesImpl:
    async def double(self, box: Box[int]) -> Box[int]:
        return Box(box.item * 2, note=box.note)

    async def pack(self, crates: list[Crate[str]]) -> Crate[str]:
        return Crate([item for crate in crates for item in crate.items])


async def test_generic_structs_and_dataclasses_cross_a_real_worker() -> None:
    """A generic ``msgspec.Struct`` or dataclass, parametrized (``Box[int]``), is a record
    type like any other: registered, listed in the manifest with its fields' bound types,
    checked on the caller's side and converted on the worker's."""
    manifest = method_entries(service_spec(Boxes).manifest())
    (name, layout), *_ = manifest["double"]["structs"].items()
    assert name.endswith("Box[int]") and layout["use"] == "both"
    assert layout["fields"] == [["item", "int", False], ["note", "str", True]]
    (name, layout), *_ = manifest["pack"]["structs"].items()
    assert name.endswith("Crate[str]") and layout["fields"] == [["items", "list[str]", False]]
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"boxes": BoxesImpl()}) as pair:
            boxes = pair.executor.service("boxes", Boxes)
            assert await boxes.double(Box(21)) == Box(42)
            assert await boxes.double(Box(1, note="n")) == Box(2, note="n")
            assert await boxes.pack([Crate(["a"]), Crate(["b", "c"])]) == Crate(["a", "b", "c"])
            with pytest.raises(gl.Rejected, match=r"expected `int`, got `str` at `\$\.item`"):
                await boxes.double(Box("x"))  # type: ignore[arg-type]
            with pytest.raises(gl.Rejected, match=r"expected `Box\[int\]`, got `int`"):
                await boxes.double(3)  # type: ignore[arg-type]
            dynamic = pair.executor.service("boxes")
            assert await dynamic.double({"item": 5}) == {"item": 10, "note": ""}


# ---------------------------------------------------------------------------- hot inventory


class Greeter(Protocol):
    async def greet(self, name: str) -> str: ...


class GreeterImpl:
    def __init__(self) -> None:
        self.greeted = 0

    async def greet(self, name: str) -> str:
        self.greeted += 1
        return f"hello {name}"


async def manifest_where(executor: gl.RemoteExecutor, holds: Any) -> gl.ExecutorInfo:
    """The executor's description once ``holds(info)``; bounded by the caller's deadline."""
    while not holds(info := await executor.info()):
        await anyio.sleep(0.005)
    return info


@both_directions
async def test_services_added_and_removed_while_running(direction: Direction) -> None:
    """The controller learns the worker's new manifest on the running session (no new session,
    no availability change); a removed service's calls fail UNSUPPORTED without being sent; a
    new session (here: a new controller) is described with the services as they are now."""
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            executor, worker = pair.executor, pair.live_worker
            session = (await executor.info()).session_id
            version = (await executor.info()).versions["calc"]
            greeter = executor.service("greeter", Greeter)
            with pytest.raises(gl.Rejected) as absent:
                await greeter.greet("ann")  # not served yet: refused before sending
            assert absent.value.code == "UNSUPPORTED"

            impl = GreeterImpl()
            worker.add_service("greeter", impl)
            info = await manifest_where(executor, lambda i: "greeter" in i.services)
            assert info.session_id == session and pair.history == ["ready"]
            assert set(info.versions) == {"calc", "greeter"}
            assert info.versions["calc"] == version  # calc's own contract did not change
            assert await greeter.greet("ann") == "hello ann"
            assert await executor.service("greeter").greet("bob") == "hello bob"  # dynamic
            assert executor.inventory_updates == 1

            assert worker.remove_service("greeter") is True
            assert worker.remove_service("greeter") is False  # nothing left to remove
            await manifest_where(executor, lambda i: "greeter" not in i.services)
            with pytest.raises(gl.Rejected) as removed:
                await greeter.greet("ann")
            assert removed.value.code == "UNSUPPORTED"
            assert "greeter.greet" in removed.value.message
            assert impl.greeted == 2  # the refused call was never sent
            with pytest.raises(gl.Rejected, match="UNKNOWN_SERVICE"):
                await raw_call(pair.rpc, "greeter", "greet", ["x"])  # the worker refuses too

            worker.add_service("greeter", impl)
            await manifest_where(executor, lambda i: "greeter" in i.services)
            worker.remove_service("calc")  # one it started with
            await manifest_where(executor, lambda i: "calc" not in i.services)
            with pytest.raises(gl.Rejected, match="UNSUPPORTED"):
                await pair.calc().add(1, 2)

            await pair.stop_controller()
            executor = await pair.start_controller()
            await executor.wait_ready(5)
            assert set((await executor.info()).services) == {"greeter"}
            assert await executor.service("greeter", Greeter).greet("cy") == "hello cy"


def test_add_service_checks_what_it_serves() -> None:
    config = gl.LinkConfig(
        executor_id="box", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    worker = gl.Worker(config, {"calc": CalcImpl()})
    with pytest.raises(gl.ConfigError, match=r"SyncCalc\.total is a plain"):
        worker.add_service("sync", SyncCalc())
    for name in ("", "_hidden", "$link"):
        with pytest.raises(gl.ConfigError, match="invalid service name"):
            worker.add_service(name, GreeterImpl())
    worker.add_service("greeter", GreeterImpl())  # before start: every session will serve it
    assert worker.remove_service("calc") is True


async def test_hostile_inventory_announcements_are_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker (holding a key) that announces malformed, oversized, stale or a flood of
    manifests: each bad one is dropped and counted, the manifest stays the last good one, what
    is logged is bounded, the controller holds the last of the flood only, and the session
    serves on. A controller is told nothing of the kind
    (an announcement to a controller is dropped as an unreadable notification). ~0.5 s."""
    caplog.set_level(logging.INFO, logger="garcon_link.remote")
    fits = len(encode_canonical({"calc": service_spec(CalcImpl).manifest()}))
    limits = LIMITS.replace(max_manifest_bytes=fits + 200)
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": CalcImpl()}, limits=limits) as pair:
            executor, worker_rpc = pair.executor, pair.worker_rpc
            good = (await executor.info()).services
            bad: list[Any] = [
                "junk",
                {"calc": "junk"},
                {"calc": {1: {}}},
                {"calc": good["calc"], "big": {"m": {"kind": "unary", "signature": "x" * fits}}},
            ]
            for sequence, services in enumerate(bad, start=1):
                await worker_rpc.announce_inventory(sequence, services)
            await worker_rpc.transport.send(  # not [sequence, services]
                b"\x85\x04e$linkiinventory\x81\x01\xa0"
            )
            gc.collect()
            held = interned_counts()[0]
            flood = 500
            for sequence in range(10, 10 + flood):
                services = {"calc": good["calc"], f"s{sequence}": {}}
                await worker_rpc.announce_inventory(sequence, services)
            await worker_rpc.announce_inventory(5, {"stale": {}})  # older than one applied
            last = f"s{9 + flood}"
            info = await manifest_where(executor, lambda i: last in i.services)
            await pair.calc().add(1, 1)  # a round trip: the stale one has arrived too
            info = await executor.info()
            assert set(info.services) == {"calc", last}
            assert executor.inventory_dropped == len(bad) + 1
            assert executor.inventory_updates == flood
            gc.collect()  # the manifests held: the last one, not one per announcement
            assert interned_counts()[0] <= held + 1
            assert await pair.calc().add(1, 2) == 3
            lines = [r for r in caplog.records if "announced manifest" in r.getMessage()]
            changes = [r for r in caplog.records if "contract changed" in r.getMessage()]
            assert 1 <= len(lines) <= limits.max_log_lines + 1
            assert len(changes) <= limits.max_log_lines + 1
            assert "offline" not in pair.history  # the same session throughout
            # an announcement the other way is nobody's to apply
            before = worker_rpc.statistics().notifications_dropped
            await pair.rpc.announce_inventory(1, {})
            while worker_rpc.statistics().notifications_dropped == before:
                await anyio.sleep(0.005)


async def test_the_changes_logged_for_a_huge_manifest_are_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker announcing a thousand new methods costs the controller a bounded number of
    comparisons (it parses the peer's signatures): the log line names a few, counts the rest."""
    caplog.set_level(logging.INFO, logger="garcon_link.remote")

    def wide(result: str) -> dict[str, Any]:
        methods = {
            f"m{i:04}": {"kind": "unary", "signature": f"(a: int) -> {result}"} for i in range(1000)
        }
        return {"calc": service_spec(CalcImpl).manifest(), "wide": methods}

    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": CalcImpl()}) as pair:
            await pair.worker_rpc.announce_inventory(1, wide("str"))
            await manifest_where(pair.executor, lambda i: "wide" in i.services)
            lines = [r.getMessage() for r in caplog.records if "contract changed" in r.getMessage()]
            assert len(lines) == 1  # (and at most one per log_interval)
            assert "(additive as far as compared (64))" in lines[0]
            assert "wide.m0000: additive (new method)" in lines[0]
            assert "and 992 more" in lines[0]  # 64 compared, 8 named, the rest counted
            assert len(lines[0]) < 2000


class CalcBad(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    def blocking(self) -> int: ...


class WrongCalc:
    def add(self, a: int, b: int) -> int:
        return a + b

    def blocking(self) -> int:
        return 1


class SyncCalc:
    async def add(self, a: int, b: int) -> int:
        return a + b

    def total(self) -> int:  # public and sync: refused, not silently dropped
        return 0


def test_registration_checks_the_implementation() -> None:
    # Before: gl.Service(Wrong(), Calc) and a public plain ``def`` passed; calls then failed.
    with pytest.raises(gl.ConfigError) as info:
        gl.Service(WrongCalc(), Calc)
    text = str(info.value)
    assert text.startswith("Service(..., Calc): WrongCalc cannot be served as written:\n")
    assert "add: WrongCalc.add is a plain `def`" in text
    assert "count: WrongCalc has no method 'count'" in text
    assert "note: WrongCalc has no method 'note'" in text
    assert gl.Service(CalcImpl(), Calc).interface is Calc

    worker_cfg = gl.LinkConfig(
        executor_id="box", role=gl.Role.WORKER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    with pytest.raises(gl.ConfigError, match=r"(?s)service 'calc': .*SyncCalc\.total is a plain"):
        gl.Worker(worker_cfg, {"calc": SyncCalc()})
    with pytest.raises(gl.ConfigError, match=r"CalcBad\.blocking is a plain `def`"):
        gl.Service(WrongCalc(), CalcBad)


def test_a_plain_def_in_a_protocol_fails_at_facade_creation() -> None:
    # Before: the facade was created, mypy accepted ``calc.blocking()``, and the call raised
    # AttributeError on _Facade.
    controller_cfg = gl.LinkConfig(
        executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, listen=("127.0.0.1", 0)
    )
    executor = gl.connect(controller_cfg)
    with pytest.raises(gl.ConfigError, match=r"CalcBad\.blocking is a plain `def`.*async def"):
        executor.service("calc", CalcBad)


@both_directions
async def test_a_refused_session_is_retired_and_the_link_dials_again(
    direction: Direction, caplog: pytest.LogCaptureFixture
) -> None:
    """A session that is not installed (here: its manifest is over the controller's
    ``max_manifest_bytes``) is not left connected: it is retired with 4005 and the dialing side
    dials again per its backoff; every new session is described afresh, and the cause stays
    visible. ~0.5 s."""
    caplog.set_level(logging.ERROR, logger="garcon_link.remote")
    fits = len(encode_canonical({"calc": service_spec(CalcImpl).manifest()}))
    limits = LIMITS.replace(max_manifest_bytes=fits)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}, limits=limits) as pair:
            calc = pair.calc()
            assert await calc.add(1, 2) == 3
            await pair.restart_worker({"calc": CalcImplPlus()})  # one method more: too big
            stats = pair.executor.link.statistics
            base = stats().fresh_sessions
            while stats().fresh_sessions < base + 3:  # refused, retired, dialed again, ...
                await anyio.sleep(0.005)
            assert pair.executor.availability == "offline"
            assert pair.history == ["ready", "offline"]
            with pytest.raises(gl.NotDispatched) as info:
                await calc.add(1, 2)
            assert info.value.code == "OFFLINE"
            assert "over max_manifest_bytes" in info.value.message
            assert "not installed: describe failed" in caplog.text
            # the next worker with a manifest that fits is installed by the same dial loop
            await pair.restart_worker({"calc": CalcImpl()})
            await pair.executor.wait_ready(5)
            assert await calc.add(1, 2) == 3
            assert pair.restarts() == ["ready", "offline", "ready"], pair.history


async def test_a_describe_that_times_out_retires_the_session() -> None:
    """A worker that never answers ``describe`` (bounded by ``call_timeout``): the session is
    retired (the worker hears 4005) instead of sitting connected but never installed; the cause
    is in ``last_error`` and in the calls' ``NotDispatched``; an honest worker is then
    installed. ~0.5 s."""
    limits = LIMITS.replace(call_timeout=0.3)
    config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.CONTROLLER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=limits,
    )
    with anyio.fail_after(DEADLINE):
        async with gl.connect(config) as executor:
            async with Raw.connect(own_link(executor).listen_address[1]) as raw:
                assert await raw.upgrade()
                await raw.authenticate(
                    role=gl.Role.WORKER, secret=SECRET.reveal(), executor_id="box"
                )
                call = await raw.replies(lambda e: e[0] == 0, 5)
                assert call[2:4] == ["$link", "describe"]  # never answered
                assert str(await raw.outcome(5)) == "close 4005"
            assert executor.availability == "offline"
            assert "describe failed" in (executor.last_error or "")
            assert "TIMEOUT" in (executor.last_error or "")
            with pytest.raises(gl.NotDispatched, match="describe failed") as info:
                await executor.info()
            assert info.value.code == "OFFLINE"
            worker = gl.Worker(
                gl.LinkConfig(
                    executor_id="box",
                    role=gl.Role.WORKER,
                    secret=SECRET,
                    dial=executor.link.url,
                    limits=limits,
                ),
                {"calc": CalcImpl()},
            )
            async with worker:
                await executor.wait_ready(5)
                assert await executor.service("calc", Calc).add(1, 2) == 3


# ---------------------------------------------------------------------------------- nothing there


def _reserved_port() -> socket.socket:
    """A loopback socket bound and not listening: dials to its port are refused, and no other
    process (tests run in parallel) can take the port meanwhile."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def _dialing_controller(port: int) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id="box",
        role=gl.Role.CONTROLLER,
        secret=SECRET,
        dial=f"ws://127.0.0.1:{port}/executor",
        limits=LIMITS,
    )


async def test_wait_ready_gives_up_at_the_first_dial_that_meets_the_other_scheme() -> None:
    """A ``wss://`` dial answered in plain text meets the same answer at every redial: one such
    dial ends a ``refused_dials`` wait, however many it allows, naming the URL."""

    async def plain_text(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                await stream.receive()
                await stream.send(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")

    with anyio.fail_after(DEADLINE):
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        config = dataclasses.replace(
            _dialing_controller(port), dial=f"wss://127.0.0.1:{port}/executor"
        )
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, plain_text)
            async with gl.connect(config) as executor:
                with pytest.raises(gl.NotDispatched) as info:
                    await executor.wait_ready(timeout=3600, refused_dials=1000)
                assert info.value.code == "UNREACHABLE"
                assert str(info.value).endswith(
                    f"wss://127.0.0.1:{port}/executor: 127.0.0.1:{port} answered in plain text, "
                    "not TLS (a ws:// server?); dial ws:// or its TLS port"
                )
            tg.cancel_scope.cancel()


async def test_wait_ready_gives_up_after_refused_dials_naming_the_address() -> None:
    """``refused_dials``: a dial refused at the TCP level ends the wait long before its timeout,
    with the address and the OS's reason; the counts are in the link's statistics."""
    with _reserved_port() as reserved, anyio.fail_after(DEADLINE):
        port = reserved.getsockname()[1]
        async with gl.connect(_dialing_controller(port)) as executor:
            with pytest.raises(gl.NotDispatched) as info:
                await executor.wait_ready(timeout=3600, refused_dials=3)
            assert info.value.code == "UNREACHABLE"
            assert f"cannot connect to 127.0.0.1:{port}: Connection refused" in str(info.value)
            link = executor.statistics().link
            assert link.dials_refused >= 3 and link.dials_refused_in_a_row >= 3
            assert link.dials_refused <= link.dial_attempts
            with pytest.raises(ValueError, match="refused_dials"):
                await executor.wait_ready(timeout=1, refused_dials=0)


async def test_wait_ready_timeout_names_the_last_dial_error() -> None:
    with _reserved_port() as reserved, anyio.fail_after(DEADLINE):
        port = reserved.getsockname()[1]
        async with gl.connect(_dialing_controller(port)) as executor:
            while executor.statistics().link.dials_refused < 1:
                await anyio.sleep(0.005)
            with pytest.raises(TimeoutError) as info:
                await executor.wait_ready(timeout=0.05)
            message = str(info.value)
            assert "not ready within 0.05s" in message
            assert f"last dial: cannot connect to 127.0.0.1:{port}: Connection refused" in message
            assert executor.link.last_dial_error is not None


async def test_refused_dials_in_a_row_restart_from_zero_once_a_dial_connects() -> None:
    with _reserved_port() as reserved, anyio.fail_after(DEADLINE):
        port = reserved.getsockname()[1]
        async with gl.connect(_dialing_controller(port)) as executor:
            stats = executor.statistics
            while stats().link.dials_refused_in_a_row < 2:
                await anyio.sleep(0.005)
            reserved.listen()  # the kernel completes connections; nobody answers the upgrade
            while stats().link.dials_refused_in_a_row != 0:
                await anyio.sleep(0.005)
            assert stats().link.dials_refused >= 2


@both_directions
async def test_a_call_stalled_on_a_lost_socket_is_logged_before_the_grace_ends(
    direction: Direction, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker out of reach (socket cut, reconnections refused): the pending call is reported
    after ``stalled_call_report`` with the last dial error (when the controller dials), not only
    when ``detached_grace`` ends it; one line per executor per ``log_interval``."""
    caplog.set_level(logging.WARNING, logger="garcon_link.remote")
    limits = LIMITS.replace(detached_grace=600.0, stalled_call_report=0.05)
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}, limits=limits, proxy=True) as pair:
            calc = pair.calc()
            assert pair.proxy is not None
            async with anyio.create_task_group() as tg:
                tg.start_soon(calc.hold, "k")
                await impl.probe.wait("started:k")
                pair.proxy.refuse()
                pair.proxy.cut()
                await pair.wait_availability("reconnecting")
                while "waiting for replies" not in caplog.text:
                    await anyio.sleep(0.005)
                assert pair.executor.availability == "reconnecting"
                pair.proxy.heal()
                impl._release("k")
    lines = [r.getMessage() for r in caplog.records if "waiting for replies" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "executor box: 1 call(s) waiting for replies" in lines[0]
    assert "unless it is back within" in lines[0] and "(detached_grace)" in lines[0]
    if direction == "worker-listens":
        assert "last dial: " in lines[0]


@both_directions
async def test_per_session_scope_factory(direction: Direction) -> None:
    log: list[tuple[str, bytes]] = []
    let_exit = anyio.Event()
    impls: list[CalcImpl] = []

    @contextlib.asynccontextmanager
    async def factory(scope: gl.ServiceScope) -> AsyncIterator[dict[str, Any]]:
        assert scope.executor_id == "box"
        impl = CalcImpl()
        impls.append(impl)
        log.append(("enter", scope.instance_id))
        try:
            yield {"calc": impl}
        finally:
            log.append(("exit-started", scope.instance_id))
            await let_exit.wait()  # a slow cleanup must not hold up the next session
            log.append(("exit-done", scope.instance_id))

    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, factory) as pair:
            calc = pair.calc()
            ref = await calc.open_job("a")
            first = (await pair.executor.info()).instance_id
            assert log == [("enter", first)]
            assert ref.instance_id == first

            # a new controller: a fresh logical session on the same worker
            await pair.stop_controller()
            await pair.start_controller()
            await pair.executor.wait_ready(5)
            calc = pair.calc()
            second = (await pair.executor.info()).instance_id
            assert second != first
            assert ("enter", second) in log
            assert await calc.add(1, 2) == 3
            assert impls[1].counts["add"] == 1 and impls[0].counts["add"] == 0
            ref2 = await calc.open_job("b")
            assert ref2.instance_id == second
            while ("exit-started", first) not in log:
                await anyio.sleep(0.005)
            # the old scope's exit started after the replacement, and is still blocked
            assert log.index(("exit-started", first)) > log.index(("enter", first))
            assert ("exit-done", first) not in log
            assert ("exit-started", second) not in log
            let_exit.set()
            while ("exit-done", first) not in log:
                await anyio.sleep(0.005)
            assert pair.worker is not None and pair.worker.sessions == 2
    assert ("exit-done", second) in log  # closed when the worker stopped


TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant")


class Whoami(Protocol):
    async def tenant(self) -> str: ...


class WhoamiImpl:
    async def tenant(self) -> str:
        return TENANT.get("unset")


@both_directions
async def test_handlers_see_context_variables_the_scope_factory_set(direction: Direction) -> None:
    """Dispatch runs in the socket reader's task, but handlers must inherit the context of
    the task that entered the service scope (a factory may set request-wide variables)."""

    @contextlib.asynccontextmanager
    async def factory(scope: gl.ServiceScope) -> AsyncIterator[dict[str, Any]]:
        TENANT.set(scope.instance_id.hex())
        yield {"who": WhoamiImpl()}

    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, factory) as pair:
            who = pair.executor.service("who", Whoami)
            instance = (await pair.executor.info()).instance_id
            assert await who.tenant() == instance.hex()


@both_directions
async def test_scope_cleanup_is_bounded(direction: Direction) -> None:
    exits: list[str] = []

    @contextlib.asynccontextmanager
    async def factory(scope: gl.ServiceScope) -> AsyncIterator[dict[str, Any]]:
        try:
            yield {"calc": CalcImpl()}
        finally:
            try:
                await anyio.sleep_forever()
            finally:
                exits.append(scope.instance_id.hex())

    limits = LIMITS.replace(scope_cleanup_timeout=0.2)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, factory, limits=limits) as pair:
            await pair.stop_controller()
            await pair.start_controller()
            await pair.executor.wait_ready(5)
            assert await pair.calc().add(1, 1) == 2
            while not exits:  # abandoned after scope_cleanup_timeout
                await anyio.sleep(0.01)


@both_directions
async def test_failing_scope_factory_retires_the_session(direction: Direction) -> None:
    attempts: list[int] = []

    @contextlib.asynccontextmanager
    async def factory(scope: gl.ServiceScope) -> AsyncIterator[dict[str, Any]]:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("scope construction failed")
        yield {"calc": CalcImpl()}

    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, factory, ready=False) as pair:
            await pair.executor.wait_ready(5)
            assert await pair.calc().add(1, 1) == 2
            assert len(attempts) >= 2
    # nothing of the refused session is left open (an unclosed stream warns when collected)
    gc.collect()


# ---------------------------------------------------------------------------------- bidirectional


@both_directions
async def test_worker_calls_back_into_the_controller(direction: Direction) -> None:
    sink = SinkImpl()
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}, controller_services={"sink": sink}) as pair:
            calc = pair.calc()
            assert await calc.relay("hello") == 5
            assert sink.pushed == ["hello"]
            await sink.probe.wait("event:before hello")
            assert sink.events == ["before hello"]
            # many at once, both directions busy
            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(calc.relay, f"m{i}")
            assert sorted(sink.pushed[1:]) == sorted(f"m{i}" for i in range(50))
            await calc.note("one-way")
            await impl.probe.wait("note:one-way")
            assert pair.history == ["ready"]


@both_directions
async def test_callbacks_survive_a_cut(direction: Direction) -> None:
    sink = SinkImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"calc": CalcImpl()}, controller_services={"sink": sink}
        ) as pair:
            # A call made right after the cut may find the executor reconnecting: it waits for
            # the resume (dispatch_deadline) instead of failing at once (the default).
            calc = gl.with_options(pair.calc(), dispatch_deadline=DEADLINE)
            for i in range(20):
                assert await calc.relay(f"x{i}") == len(f"x{i}")
                if i % 5 == 0:
                    await pair.executor.link.disconnect()
            assert sink.pushed == [f"x{i}" for i in range(20)]
            assert "offline" not in pair.history


@both_directions
async def test_peer_facade_with_unknown_controller_service(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            # the controller exposes no "sink": the worker's callback is rejected, and that
            # refusal is what the handler raised
            with pytest.raises(gl.Rejected) as info:
                await pair.calc().relay("x")
            assert info.value.code == "UNKNOWN_SERVICE"


# ---------------------------------------------------------------------- worker-scoped services


async def _wait_new_instance(executor: gl.RemoteExecutor, old: bytes) -> gl.ExecutorInfo:
    while True:
        try:
            info = await executor.info()
            if info.instance_id != old:
                return info
        except gl.NotDispatched:
            pass
        await anyio.sleep(0.01)


@both_directions
async def test_worker_scoped_references_survive_session_replacement(direction: Direction) -> None:
    # Same implementation class served twice: per session ("calc") and worker-scoped ("jobs").
    shared, per_session = CalcImpl(), CalcImpl()
    services = {"calc": per_session, "jobs": gl.Service(shared, Calc, scope="worker")}
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, services, limits=QUICK_GRACE) as pair:
            jobs = pair.executor.service("jobs", Calc)
            calc = pair.calc()
            wref = await jobs.open_job("durable")
            sref = await calc.open_job("ephemeral")
            info = await pair.executor.info()
            assert info.worker_instance_id is not None
            assert pair.worker is not None
            assert info.worker_instance_id == own_link(pair.worker).runtime_id
            assert wref.instance_id == info.worker_instance_id != info.instance_id
            assert sref.instance_id == info.instance_id

            # A controller restart is a fresh logical session on the same worker.
            await pair.stop_controller()
            await pair.start_controller()
            executor = pair.executor
            await executor.wait_ready(5)
            info2 = await _wait_new_instance(executor, info.instance_id)
            assert info2.worker_instance_id == info.worker_instance_id
            jobs = executor.service("jobs", Calc)
            calc = executor.service("calc", Calc)
            assert await jobs.job_name(wref) == "durable"  # still valid
            with pytest.raises(gl.StaleResource):
                await calc.job_name(sref)  # per-session: today's rule
            # Scopes are strict inside handlers: a per-session handler refuses a worker
            # reference (the controller lets it through: it names the live worker).
            with pytest.raises(gl.StaleResource):
                await calc.job_name(wref)

            # A worker restart (a new runtime) makes the worker reference stale, on both sides.
            await pair.restart_worker(services)
            await _wait_new_instance(executor, info2.instance_id)
            with pytest.raises(gl.StaleResource):
                await jobs.job_name(wref)
            wire_ref = {
                "kind": wref.kind,
                "executor_id": wref.executor_id,
                "instance_id": wref.instance_id,
                "id": wref.id,
            }
            with pytest.raises(gl.StaleResource):
                await raw_call(pair.rpc, "jobs", "job_name", [wire_ref])
            fresh = await jobs.open_job("again")
            assert await jobs.job_name(fresh) == "again"


def test_service_scope_is_checked() -> None:
    with pytest.raises(gl.ConfigError, match="scope"):
        gl.Service(CalcImpl(), Calc, scope="process")  # type: ignore[arg-type]


async def test_worker_scope_shares_one_object_and_closes_it_once() -> None:
    scope = gl.WorkerScope("box", b"r" * 16)
    closed: list[str] = []

    class Thing(contextlib.AbstractAsyncContextManager["Thing"]):
        async def __aexit__(self, *exc: object) -> None:
            closed.append("thing")

    made: list[Thing] = []

    def make() -> Thing:
        made.append(Thing())
        return made[-1]

    first = await scope.shared("k", make)
    assert await scope.shared("k", make) is first and len(made) == 1
    session = scope.session_scope(b"s" * 16)
    assert session.worker is scope
    assert session.admits(scope.scope.resource("x", "1"))
    assert session.admits(session.resource("x", "1"))
    assert not scope.scope.admits(session.resource("x", "1"))
    await scope.aclose()
    await scope.aclose()
    assert closed == ["thing"]
    with pytest.raises(RuntimeError):
        await scope.shared("k", make)


# ---------------------------------------------------------------------------------- abort


async def test_abort_inside_connect_ends_the_link_not_the_body() -> None:
    """``executor.link.abort()`` from the body ends the link only: later calls fail honestly
    and the body runs on to its end (no foreign cancellation out of the host task)."""
    wcfg = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    reached = []
    with anyio.fail_after(DEADLINE):
        async with gl.Worker(wcfg, {"calc": CalcImpl()}) as worker:
            ccfg = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.CONTROLLER,
                secret=SECRET,
                dial=worker.url,
                limits=LIMITS,
            )
            async with gl.connect(ccfg) as executor:
                calc = executor.service("calc", Calc)
                await executor.wait_ready(5)
                assert await calc.add(1, 2) == 3
                await executor.link.abort()  # type: ignore[union-attr]
                with pytest.raises((gl.NotDispatched, gl.OutcomeUnknown)):
                    await calc.add(1, 2)
                await anyio.sleep(0)
                reached.append("controller")
            await own_link(worker).abort()
            await anyio.sleep(0)
            reached.append("worker")
    assert reached == ["controller", "worker"]


async def test_a_call_in_flight_when_the_host_aborts_the_link_ends_honestly() -> None:
    """Aborted from the body of ``async with gl.connect(...)``: the call in flight ends
    ``OutcomeUnknown`` (it may have run), the body goes on."""
    impl = CalcImpl()
    wcfg = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    outcome: list[BaseException] = []
    with anyio.fail_after(DEADLINE):
        async with gl.Worker(wcfg, {"calc": impl}) as worker:
            ccfg = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.CONTROLLER,
                secret=SECRET,
                dial=worker.url,
                limits=LIMITS,
            )
            async with gl.connect(ccfg) as executor:
                await executor.wait_ready(5)
                calc = executor.service("calc", Calc)

                async def held() -> None:
                    try:
                        await calc.hold("k")
                    except gl.CallError as exc:
                        outcome.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(held)
                    await impl.probe.wait("started:k")
                    await own_link(executor).abort()
                outcome.append(RuntimeError("the body ran on"))
    assert [type(e) for e in outcome] == [gl.OutcomeUnknown, RuntimeError]


class Bounded(Protocol):
    async def take(self, n: Annotated[int, msgspec.Meta(ge=0)]) -> int: ...


class BoundedImpl:
    def __init__(self) -> None:
        self.taken: list[int] = []

    async def take(self, n: Annotated[int, msgspec.Meta(ge=0)]) -> int:
        self.taken.append(n)
        return n


class BoundedOut(Protocol):
    async def give(self, n: int) -> Annotated[int, msgspec.Meta(ge=0)]: ...


class BoundedOutImpl:
    async def give(self, n: int) -> int:  # does not keep the interface's promise
        return n


async def test_a_result_outside_its_meta_constraint_is_refused_by_the_caller() -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            "worker-listens", {"b": gl.Service(BoundedOutImpl(), BoundedOut)}
        ) as pair:
            out = pair.executor.service("b", BoundedOut)
            assert await out.give(1) == 1
            with pytest.raises(gl.RemoteError, match=r"INVALID_RESULT.*>= 0"):
                await out.give(-1)


async def test_a_meta_constraint_is_enforced_by_the_worker() -> None:
    impl = BoundedImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"b": gl.Service(impl, Bounded)}) as pair:
            typed = pair.executor.service("b", Bounded)
            dynamic = pair.executor.service("b")  # no hints on this side: the worker decides
            assert await typed.take(0) == 0
            for facade in (typed, dynamic):
                with pytest.raises(gl.Rejected, match=r"INVALID_ARGUMENTS.*'n'.*>= 0"):
                    await facade.take(-1)
    assert impl.taken == [0]


class Reply(msgspec.Struct, omit_defaults=True):
    n: int
    mode: str = "fast"


class OtherReply(msgspec.Struct, omit_defaults=True):
    """The same type in a caller of another version: same name, another default."""

    n: int
    mode: str = "slow"


OtherReply.__qualname__ = "Reply"  # the same type text in the signature: the same contract


class Echo(Protocol):
    async def echo(self, r: Reply) -> Reply: ...
    def echoes(self, r: Reply) -> AsyncIterator[list[Reply]]: ...


class OtherEcho(Protocol):
    async def echo(self, r: OtherReply) -> OtherReply: ...
    def echoes(self, r: OtherReply) -> AsyncIterator[list[OtherReply]]: ...


class EchoImpl:
    def __init__(self) -> None:
        self.got: list[Reply] = []

    async def echo(self, r: Reply) -> Reply:
        self.got.append(r)
        return Reply(r.n)

    async def echoes(self, r: Reply) -> AsyncIterator[list[Reply]]:
        self.got.append(r)
        yield [Reply(r.n)]


async def test_default_valued_fields_are_sent_so_another_version_reads_the_senders_values() -> None:
    impl = EchoImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"e": gl.Service(impl, Echo)}) as pair:
            other = pair.executor.service("e", OtherEcho)
            got = await other.echo(OtherReply(1))
            assert (got.n, got.mode) == (1, "fast")  # the worker's value, not the caller's default
            assert [
                [(r.n, r.mode) for r in items] async for items in other.echoes(OtherReply(2))
            ] == [[(2, "fast")]]
    assert [(r.n, r.mode) for r in impl.got] == [(1, "slow"), (2, "slow")]
