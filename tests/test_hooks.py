"""Tests of per-call hooks, call metadata and the call counters (garcon_link.rpc.hooks).

A recording hook sees one ``call_started`` and one ``call_ended`` per call, on both sides, with
the honest outcome of every kind of ending; metadata reaches the handler (``gl.call_metadata``)
and is bounded on both sides; a raising hook is logged once and changes nothing. Every wait is
bounded by ``anyio.fail_after``; nothing asserts on timing.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import anyio
import cbor2
import pytest
from rpcutil import LIMITS, CalcImpl, open_pair, raw_call

import garcon_link as gl
from garcon_link.api.facades import FacadeStream
from garcon_link.rpc import envelopes
from garcon_link.rpc.envelopes import (
    BadEnvelope,
    Call,
    Cancel,
    Credit,
    End,
    Error,
    Item,
    Notify,
    Result,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10
_trace: contextvars.ContextVar[str] = contextvars.ContextVar("trace", default="unset")


class Recorder:
    """A hook that records what it is told; optionally adds metadata or sets ``_trace``."""

    def __init__(self, add: dict[str, str] | None = None, trace: bool = False) -> None:
        self.started: list[gl.CallInfo] = []
        self.ended: list[tuple[gl.CallInfo, object, gl.CallEnd]] = []
        self.add = add or {}
        self.trace = trace

    def call_started(self, call: gl.CallInfo) -> object:
        self.started.append(call)
        if self.add:
            assert isinstance(call.metadata, dict)
            call.metadata.update(self.add)
        if self.trace:
            return _trace.set(call.metadata.get("trace-id", "none"))
        return len(self.started)

    def call_ended(self, call: gl.CallInfo, state: object, end: gl.CallEnd) -> None:
        if self.trace:
            assert isinstance(state, contextvars.Token)
            _trace.reset(state)
        self.ended.append((call, state, end))

    def ends(self) -> list[tuple[str, str, str, str | None]]:
        return [(c.method, c.kind, e.label, e.code) for c, _, e in self.ended]


class Broken:
    def call_started(self, call: gl.CallInfo) -> object:
        raise RuntimeError("broken start")

    def call_ended(self, call: gl.CallInfo, state: object, end: gl.CallEnd) -> None:
        raise RuntimeError("broken end")


class Meta(Protocol):
    async def seen(self) -> list[str]: ...
    def numbers(self, n: int) -> AsyncIterator[int]: ...
    @gl.oneway
    async def poke(self) -> None: ...


class MetaImpl:
    def __init__(self) -> None:
        self.poked: list[dict[str, str]] = []
        self.poked_event = anyio.Event()

    async def seen(self) -> list[str]:
        meta = gl.call_metadata()
        return [_trace.get(), *(f"{k}={v}" for k, v in sorted(meta.items()))]

    async def numbers(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
            await anyio.lowlevel.checkpoint()

    async def poke(self) -> None:
        self.poked.append(dict(gl.call_metadata()))
        self.poked_event.set()


# ---------------------------------------------------------------------------------- client side


async def test_a_client_hook_sees_every_outcome_kind() -> None:
    hook = Recorder()
    impl = CalcImpl()
    limits = LIMITS.replace(cancel_grace=2.0)
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}, hooks=(hook,), limits=limits) as p:
            calc = p.calc()
            assert await calc.add(1, 2) == 3
            with pytest.raises(gl.RemoteError):
                await calc.fail("boom")
            with pytest.raises(gl.Rejected):
                await calc.fail_reject()
            too_many = {f"k{i}": "v" for i in range(LIMITS.max_metadata_entries + 1)}
            with pytest.raises(gl.NotDispatched) as nd:
                await gl.with_options(calc, metadata=too_many).add(1, 1)
            assert nd.value.code == "INVALID_METADATA"
            # A timeout whose handler was interrupted: OutcomeUnknown("TIMEOUT").
            with pytest.raises(gl.OutcomeUnknown) as unknown:
                await gl.with_options(calc, timeout=0.2).hold("t")
            assert unknown.value.code == "TIMEOUT"
            # The caller's own cancellation.
            async with anyio.create_task_group() as tg:
                tg.start_soon(calc.hold, "c")
                await impl.probe.wait("started:c")
                tg.cancel_scope.cancel()
            stats = p.executor.statistics()
    assert hook.ends() == [
        ("add", "unary", "ok", None),
        ("fail", "unary", "failed", "HANDLER_FAILED"),
        ("fail_reject", "unary", "rejected", "NOT_NOW"),
        ("add", "unary", "not_dispatched", "INVALID_METADATA"),
        ("hold", "unary", "unknown", "TIMEOUT"),
        ("hold", "unary", "cancelled", "CANCELLED"),
    ]
    assert impl.counts["add"] == 1  # the invalid metadata was refused before sending
    assert [c.side for c in hook.started] == ["client"] * 6
    assert all(c.executor == "box" for c in hook.started)
    assert all(e.duration >= 0 for _, _, e in hook.ended)
    assert [s for _, s, _ in hook.ended] == [1, 2, 3, 4, 5, 6]  # state handed back
    calls = stats.calls.client
    assert calls[("ok", None)] == 1  # add (the internal describe is no facade call)
    assert calls[("failed", "HANDLER_FAILED")] == 1
    assert calls[("cancelled", "CANCELLED")] == 1
    assert calls[("unknown", "TIMEOUT")] == 1


async def test_counters_without_hooks_and_registered_exceptions() -> None:
    # No hook: the same counters, by outcome and code; a registered exception counts as the
    # RemoteError it was rebuilt from.
    with anyio.fail_after(DEADLINE):
        async with open_pair("controller-listens", {"calc": CalcImpl()}) as p:
            calc = p.calc()
            for i in range(3):
                assert await calc.add(i, 1) == i + 1
            with pytest.raises(Exception, match="custom"):
                await calc.fail_custom("custom")
            stats = p.executor.statistics().calls
    assert stats.client[("ok", None)] == 3
    assert stats.client[("failed", "HANDLER_FAILED")] == 1
    assert stats.total("client") == 4


async def test_each_handler_is_counted_once_on_the_server() -> None:
    # One count per handler, whatever its reply policy: unary (a result, an error), stream,
    # notification; the internal describe of the session's install is not counted.
    impl = MetaImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"meta": impl, "calc": CalcImpl()}) as p:
            calc = p.calc()
            for i in range(3):
                assert await calc.add(i, 1) == i + 1
            with pytest.raises(gl.RemoteError):
                await calc.fail("x")
            meta = p.executor.service("meta", Meta)
            assert [i async for i in meta.numbers(2)] == [0, 1]
            await meta.poke()
            await impl.poked_event.wait()
            assert p.worker is not None
            served = p.worker.statistics().calls
            while served.total("server") < 6:  # the server's ends follow the replies
                await anyio.sleep(0.01)
                served = p.worker.statistics().calls
            await anyio.sleep(0.05)
            served = p.worker.statistics().calls
    assert dict(served.server) == {("ok", None): 5, ("failed", "HANDLER_FAILED"): 1}


async def test_streams_and_notifications_are_observed_on_both_sides() -> None:
    client, server = Recorder(), Recorder()
    impl = MetaImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            "worker-listens", {"meta": impl}, hooks=(client,), worker_hooks=(server,)
        ) as p:
            meta = gl.with_options(p.executor.service("meta", Meta), metadata={"who": "me"})
            assert [i async for i in meta.numbers(3)] == [0, 1, 2]
            stream = meta.numbers(100)
            assert isinstance(stream, FacadeStream)  # an async iterator that also closes
            assert await stream.__anext__() == 0
            await stream.aclose()  # closed before its end
            await meta.poke()
            await impl.poked_event.wait()
            while len(server.ended) < 3:  # the server's ends follow the replies
                await anyio.sleep(0.01)
    assert client.ends() == [
        ("numbers", "stream", "ok", None),
        ("numbers", "stream", "cancelled", "CANCELLED"),
        ("poke", "notify", "ok", None),
    ]
    assert impl.poked == [{"who": "me"}]
    server_ends = sorted(server.ends())
    assert ("poke", "notify", "ok", None) in server_ends
    assert ("numbers", "stream", "ok", None) in server_ends
    assert all(c.side == "server" and c.metadata == {"who": "me"} for c in server.started)


# ---------------------------------------------------------------------------------- server side


async def test_server_hooks_wrap_the_handler_and_see_its_outcome() -> None:
    client = Recorder(add={"trace-id": "abc123"})
    server = Recorder(trace=True)
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            "controller-listens",
            {"meta": MetaImpl(), "calc": CalcImpl()},
            hooks=(client,),
            worker_hooks=(server,),
        ) as p:
            meta = gl.with_options(p.executor.service("meta", Meta), metadata={"user": "ann"})
            # The server hook's contextvar is visible in the handler; so is the metadata the
            # client hook added.
            assert await meta.seen() == ["abc123", "trace-id=abc123", "user=ann"]
            with pytest.raises(gl.RemoteError):
                await p.calc().fail("x")
            with pytest.raises(gl.Rejected):
                await p.calc().fail_reject()
            with pytest.raises(gl.Rejected) as unknown:
                await raw_call(p.rpc, "calc", "nope")
            assert unknown.value.code == "OPERATION_UNSUPPORTED"
            while len(server.ended) < 3:
                await anyio.sleep(0.01)
            assert p.worker is not None
            served = p.worker.statistics().calls.server
    assert server.ends() == [
        ("seen", "unary", "ok", None),
        ("fail", "unary", "failed", "HANDLER_FAILED"),
        ("fail_reject", "unary", "rejected", "NOT_NOW"),
    ]
    assert server.started[0].executor == "box"
    # A refusal runs no handler (no hook) but is counted.
    assert served[("rejected", "OPERATION_UNSUPPORTED")] == 1
    assert served[("ok", None)] >= 1


async def test_a_cancelled_handler_ends_cancelled_on_the_server() -> None:
    server = Recorder()
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}, worker_hooks=(server,)) as p:
            calc = p.calc()
            async with anyio.create_task_group() as tg:
                tg.start_soon(calc.hold, "k")
                await impl.probe.wait("started:k")
                tg.cancel_scope.cancel()
            await impl.probe.wait("cancelled:k")
            while not server.ended:
                await anyio.sleep(0.01)
    assert server.ends() == [("hold", "unary", "cancelled", "CANCELLED")]
    assert server.ended[0][2].outcome is gl.Outcome.UNKNOWN


async def test_a_raising_hook_is_logged_once_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="garcon_link")
    after = Recorder()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": CalcImpl()}, hooks=(Broken(), after)) as p:
            calc = p.calc()
            for i in range(3):
                assert await calc.add(i, i) == 2 * i
    broken = [r for r in caplog.records if "call hook" in r.getMessage()]
    assert len(broken) == 2, [r.getMessage() for r in broken]  # once per method, not per call
    assert after.ends() == [("add", "unary", "ok", None)] * 3


# ---------------------------------------------------------------------------------- metadata


async def test_metadata_bounds_on_the_caller() -> None:
    impl = MetaImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"meta": impl}) as p:
            meta = p.executor.service("meta", Meta)
            assert await gl.with_options(meta, metadata={"a.b-c_1": "é"}).seen() == [
                "unset",
                "a.b-c_1=é",
            ]
            assert await meta.seen() == ["unset"]  # none: nothing sent, nothing seen
            cases: list[dict[str, Any]] = [  # Any: one value is deliberately not text
                {"Upper": "x"},
                {"": "x"},
                {"k" * 65: "x"},
                {"k": 5},
                {"k": "x" * LIMITS.max_metadata_bytes},
            ]
            for bad in cases:
                with pytest.raises(gl.NotDispatched) as nd:
                    await gl.with_options(meta, metadata=bad).seen()
                assert nd.value.code == "INVALID_METADATA"
                with pytest.raises(gl.NotDispatched):
                    await gl.with_options(meta, metadata=bad).numbers(1).__anext__()
            with pytest.raises(TypeError):
                gl.with_options(meta, metadata=["not", "a", "map"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("metadata", "why"),
    [
        ({f"k{i}": "v" for i in range(17)}, "entries"),
        ({"k": "x" * 5000}, "bytes"),
        ({"K": "v"}, "key"),
        ({1: "v"}, "key is a int"),
        ({"k": b"bytes"}, "not text"),
        ("not a map", "must be a map"),
        ([["k", "v"]], "must be a map"),
    ],
)
async def test_a_peer_sending_bad_metadata_is_refused(metadata: Any, why: str) -> None:
    impl = MetaImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"meta": impl}) as p:
            with pytest.raises(gl.Rejected) as refused:
                await raw_call(
                    p.rpc,
                    "meta",
                    "seen",
                    envelope=lambda i: [0, i, "meta", "seen", [], {}, 0, 0, None, metadata],
                )
            assert refused.value.code == "INVALID_METADATA"
            assert why in refused.value.message
            # The session stays usable, and a good map is read.
            good = [0, 0, "meta", "seen", [], {}, 0, 0, None, {"x": "y"}]
            assert await raw_call(
                p.rpc, "meta", "seen", envelope=lambda i: [*good[:1], i, *good[2:]]
            ) == [
                "unset",
                "x=y",
            ]
            assert p.worker is not None
            counted = p.worker.statistics().calls.server
    assert counted[("rejected", "INVALID_METADATA")] == 1


# ---------------------------------------------------------------------------------- envelopes


def test_envelopes_encode_as_the_same_cbor_lists() -> None:
    cases: list[tuple[envelopes.Envelope, list[Any]]] = [
        (Call(1, "s", "m", [1], {}, 0, 0), [0, 1, "s", "m", [1], {}, 0, 0]),
        (Call(2, "s", "m", [], {}, 8, 9, b"k"), [0, 2, "s", "m", [], {}, 8, 9, b"k"]),
        (
            Call(3, "s", "m", [], {}, 0, 0, None, {"a": "b"}),
            [0, 3, "s", "m", [], {}, 0, 0, None, {"a": "b"}],
        ),
        (Call(4, "s", "m", [], {}, 0, 0, None, {}), [0, 4, "s", "m", [], {}, 0, 0]),
        (Result(5, "v"), [1, 5, "v"]),
        (Error(6, {"code": "X"}), [2, 6, {"code": "X"}]),
        (Cancel(7), [3, 7]),
        (Notify("s", "m", [], {}), [4, "s", "m", [], {}]),
        (Notify("s", "m", [], {}, {"a": "b"}), [4, "s", "m", [], {}, {"a": "b"}]),
        (Item(8, 1), [5, 8, 1]),
        (End(9), [6, 9]),
        (Credit(10, 4, 4096), [7, 10, 4, 4096]),
    ]
    for envelope, wire in cases:
        assert envelopes.encode(envelope) == cbor2.dumps(wire)
        match envelope:  # the hot paths' encoders give the same bytes
            case Call():
                fields = [getattr(envelope, f) for f in Call.__struct_fields__]
                assert envelopes.encode_call(*fields) == cbor2.dumps(wire)
            case Result():
                assert envelopes.encode_result(envelope.id, envelope.value) == cbor2.dumps(wire)
            case Item():
                assert envelopes.encode_item(envelope.id, envelope.value) == cbor2.dumps(wire)
        decoded = envelopes.decode(cbor2.loads(cbor2.dumps(wire)))
        assert envelopes.encode(decoded) == cbor2.dumps(wire)


@pytest.mark.parametrize(
    ("item", "kind", "call_id"),
    [
        (5, None, None),
        ([], None, None),
        ([True, 1], None, None),
        ([99, 1], 99, None),
        ([1, 5], 1, 5),
        ([1, "5", 1], 1, None),
        ([0, 1, "s", "m", [], {}, 0], 0, 1),
        ([0, 1, "s", "m", [], {}, 0, 0, None, {}, "extra"], 0, 1),
        ([7, 1, "a", 2], 7, 1),
        ([3, True], 3, None),
        ([4, "s", "m", [], {}, {}, 1], 4, None),
    ],
)
def test_malformed_envelopes_name_what_they_can(item: Any, kind: int | None, call_id: Any) -> None:
    with pytest.raises(BadEnvelope) as bad:
        envelopes.decode(item)
    assert (bad.value.kind, bad.value.call_id) == (kind, call_id)


# ---------------------------------------------------------------------------------- statistics


async def test_statistics_snapshots_across_a_resume_and_a_replacement() -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}) as p:
            calc = p.calc()
            first = p.executor.statistics()
            assert (first.sessions, first.resumes, first.pending_calls) == (1, 0, 0)
            assert first.fresh_sessions == 1
            assert first.bytes_sent > 0 and first.bytes_received > 0
            assert first.rpc is not None and first.transport is not None
            # Three calls at once: pending now and peak (controller), incoming (worker).
            async with anyio.create_task_group() as tg:
                for key in ("a", "b", "c"):
                    tg.start_soon(calc.hold, key)
                for key in ("a", "b", "c"):
                    await impl.probe.wait(f"started:{key}")
                busy = p.executor.statistics()
                assert p.worker is not None
                serving = p.worker.statistics()
                assert busy.pending_calls == 3 and busy.pending_calls_peak == 3
                assert serving.incoming_calls == 3 and serving.incoming_calls_peak == 3
                for key in ("a", "b", "c"):
                    impl._release(key)
            idle = p.executor.statistics()
            assert idle.pending_calls == 0 and idle.pending_calls_peak == 3
            assert idle.retained_frames_peak >= 1 and idle.retained_bytes_peak > 0
            assert idle.calls.client[("ok", None)] == 3
            # A cut: the same session resumes; counters go on.
            await p.disconnect()
            assert await calc.add(1, 1) == 2
            resumed = p.executor.statistics()
            assert (resumed.sessions, resumed.resumes) == (1, 1)
            assert resumed.bytes_sent > idle.bytes_sent
            # A new worker process: a fresh session; the endpoint's counters survive it.
            await p.restart_worker({"calc": CalcImpl()})
            await p.wait_attached_again()
            assert await calc.add(2, 2) == 4
            replaced = p.executor.statistics()
    assert replaced.sessions == 2 and replaced.fresh_sessions == 2
    assert replaced.calls.client[("ok", None)] == 5
    assert replaced.pending_calls_peak == 3 and replaced.retained_frames_peak >= 1


async def test_statistics_count_handshake_failures_by_reason() -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": CalcImpl()}) as p:
            assert p.worker is not None
            wrong = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.CONTROLLER,
                secret=gl.Secret(b"w" * 32),
                dial=p.worker.url,
                limits=LIMITS,
            )
            async with gl.connect(wrong) as intruder:
                with pytest.raises(gl.AuthenticationError):
                    await intruder.wait_ready(5)
            failed = p.worker.statistics().handshakes_failed
            assert failed.get("AUTH_FAILED", 0) >= 1
            assert await p.calc().add(1, 2) == 3  # the legitimate session is untouched


class Big(Protocol):
    async def make(self, n: int) -> str: ...


class BigImpl:
    async def make(self, n: int) -> str:
        return "y" * n


async def test_a_result_too_large_is_replaced_by_one_error_reply() -> None:
    # Before the fix in this change the handler's outcome point sent RESULT_TOO_LARGE twice
    # (the caller drops the second, so only the worker's issued count shows it).
    server = Recorder()
    limits = LIMITS.replace(max_frame_bytes=64 * 1024)
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            "worker-listens", {"big": BigImpl()}, limits=limits, worker_hooks=(server,)
        ) as p:
            big = p.executor.service("big", Big)
            assert p.worker is not None
            transport = p.worker.statistics().transport
            assert transport is not None
            before = transport.session.issued
            with pytest.raises(gl.RemoteError) as failed:
                await big.make(100_000)
            assert failed.value.code == "RESULT_TOO_LARGE"
            while not server.ended:
                await anyio.sleep(0.01)
            after = p.worker.statistics().transport
            assert after is not None
            assert after.session.issued == before + 1
            assert await big.make(10) == "y" * 10
    assert server.ends() == [
        ("make", "unary", "failed", "RESULT_TOO_LARGE"),
        ("make", "unary", "ok", None),
    ]


# ---------------------------------------------------------------------------------- interceptors


class Gate:
    """A hook that refuses some methods (``Rejected``) or breaks on others, on one ``side``."""

    def __init__(
        self, refuse: set[str], break_on: frozenset[str] = frozenset(), side: str = "server"
    ) -> None:
        self.refuse = refuse
        self.break_on = break_on
        self.side = side

    def call_started(self, call: gl.CallInfo) -> object:
        if call.side == self.side and call.method in self.refuse:
            raise gl.Rejected("FORBIDDEN", f"{call.service}.{call.method} is not granted")
        if call.side == self.side and call.method in self.break_on:
            raise RuntimeError("the grant store is down")
        return None

    def call_ended(self, call: gl.CallInfo, state: object, end: gl.CallEnd) -> None:
        pass


async def _served(p: Any, count: int) -> dict[tuple[str, str | None], int]:
    """The worker's server-side counts once ``count`` calls have ended there."""
    assert p.worker is not None
    while p.worker.statistics().calls.total("server") < count:  # ends follow the replies
        await anyio.sleep(0.01)
    return dict(p.worker.statistics().calls.server)


async def test_a_server_hook_refuses_a_call_before_the_handler_runs() -> None:
    impl, meta = CalcImpl(), MetaImpl()
    before, after = Recorder(), Recorder()
    gate = Gate(refuse={"add", "numbers", "poke"})
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            "worker-listens",
            {"calc": impl, "meta": meta},
            worker_hooks=(before, gate, after),
        ) as p:
            calc = p.calc()
            with pytest.raises(gl.Rejected) as info:
                await calc.add(1, 2)
            assert info.value.code == "FORBIDDEN"
            assert info.value.outcome is gl.Outcome.REJECTED
            assert info.value.message == "calc.add is not granted"
            # A stream is refused at its first item; a notification is dropped unrun.
            with pytest.raises(gl.Rejected, match="not granted"):
                [i async for i in p.executor.service("meta", Meta).numbers(3)]
            await p.executor.service("meta", Meta).poke()
            # The session serves on: a method the gate lets through runs.
            assert await calc.record(7) == 14
            served = await _served(p, 4)
    assert impl.counts["add"] == 0 and meta.poked == []  # the ledger: no refused handler ran
    assert served == {("rejected", "FORBIDDEN"): 3, ("ok", None): 1}
    # Hooks before the gate are ended with the refusal; hooks after it never started.
    assert sorted(before.ends()) == [
        ("add", "unary", "rejected", "FORBIDDEN"),
        ("numbers", "stream", "rejected", "FORBIDDEN"),
        ("poke", "notify", "rejected", "FORBIDDEN"),
        ("record", "unary", "ok", None),
    ]
    assert [c.method for c in after.started] == ["record"]


async def test_a_server_hook_that_breaks_refuses_the_call_and_the_session_lives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="garcon_link")
    impl = CalcImpl()
    gate = Gate(refuse=set(), break_on=frozenset({"add"}))
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}, worker_hooks=(gate,)) as p:
            calc = p.calc()
            for _ in range(2):
                with pytest.raises(gl.Rejected) as info:
                    await calc.add(1, 2)
                assert info.value.code == "HOOK_FAILED"
                assert "RuntimeError" in info.value.message
                assert "grant store" not in info.value.message  # the details stay on the worker
            assert await calc.record(3) == 6
            assert p.executor.availability == "ready"
            served = await _served(p, 3)
    assert impl.counts["add"] == 0
    assert served == {("rejected", "HOOK_FAILED"): 2, ("ok", None): 1}
    logged = [r for r in caplog.records if "call hook" in r.getMessage()]
    assert len(logged) == 1 and "HOOK_FAILED" in logged[0].getMessage()


async def test_a_client_hook_cannot_refuse() -> None:
    # Refusing is the serving side's decision; a client hook that raises is logged and ignored.
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        hooks = (Gate({"add"}, side="client"),)
        async with open_pair("worker-listens", {"calc": impl}, hooks=hooks) as p:
            assert await p.calc().add(1, 2) == 3
    assert impl.counts["add"] == 1


async def test_a_refused_keyed_call_is_its_recorded_reply() -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}, worker_hooks=(Gate({"add"}),)) as p:
            keyed = gl.with_options(p.calc(), idempotency_key="once")
            for _ in range(2):
                with pytest.raises(gl.Rejected) as info:
                    await keyed.add(1, 2)
                assert info.value.code == "FORBIDDEN"
    assert impl.counts["add"] == 0
