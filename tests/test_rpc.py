"""Tests of garcon_link.rpc.rpc over live loopback pairs: outcomes, errors, types, cancellation,
timeouts, streams and flow control, budgets, and hostile envelopes.

Every end-to-end test runs in both directions (worker listens / controller listens) and on both
anyio backends. Assertions are on what happened on the worker (handler counters, cancellation
flags, generator closure), never on elapsed time; every wait is bounded by ``anyio.fail_after``.

The load tests (overload, storms, hundreds of streams) check that the session was never retired
(``"offline" not in pair.history``), not that its socket never dropped: the pairs' heartbeat
timeout is half a second, which a loaded machine can miss, and a resumed session loses nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio
import cbor2
import pytest
from rpcutil import (
    LIMITS,
    Calc,
    CalcImpl,
    Color,
    Custom,
    Direction,
    Point,
    Sink,
    SinkImpl,
    both_directions,
    next_call_id,
    open_pair,
    raw_call,
    raw_send,
)

import garcon_link as gl
from garcon_link.rpc.rpc import CALL, CANCEL, CREDIT, END, ERROR, ITEM, NOTIFY, RESULT, ExecutorRpc

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10  # seconds any single test may take before it is failed rather than hung


# ---------------------------------------------------------------------------------- outcomes


@both_directions
async def test_invalid_arguments_are_rejected_naming_the_field(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            # The caller checks first: the call is never sent.
            with pytest.raises(gl.Rejected) as refused:
                await calc.add("x", 1)  # type: ignore[arg-type]
            assert refused.value.code == "INVALID_ARGUMENTS"
            assert "argument 'a': expected `int`, got `str`" in refused.value.message
            # The worker checks again what a caller sends without that check.
            with pytest.raises(gl.Rejected) as info:
                await raw_call(pair.rpc, "calc", "add", ["x", 1])
            assert info.value.code == "INVALID_ARGUMENTS"
            assert info.value.outcome is gl.Outcome.REJECTED
            assert "'a'" in info.value.message
            with pytest.raises(gl.Rejected, match="'b'"):
                await calc.add(1, b=2.5)  # type: ignore[arg-type]
            with pytest.raises(gl.Rejected, match="'b'"):
                await raw_call(pair.rpc, "calc", "add", [1], {"b": 2.5})
            with pytest.raises(gl.Rejected, match="'gated'"):
                await calc.record(1, gated="yes")  # type: ignore[arg-type]
            with pytest.raises(gl.Rejected, match="'gated'"):
                await raw_call(pair.rpc, "calc", "record", [1], {"gated": "yes"})
            assert impl.counts["add"] == 0 and impl.counts[1] == 0
            assert await calc.add(1, 2) == 3


@both_directions
async def test_a_call_whose_arguments_do_not_decode_is_rejected_at_once(
    direction: Direction,
) -> None:
    # An integer past wire.MAX_BIGNUM_BYTES encodes but the receiver's decoder refuses it: the
    # envelope's head still names the call, so it is refused (it did not run) instead of
    # leaving the caller to its timeout -- which is far beyond this test's deadline.
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            with pytest.raises(gl.Rejected) as info:
                await calc.add(2**10000, 1)
            assert info.value.code == "INVALID_ARGUMENTS"
            assert "do not decode" in info.value.message
            assert "bignum of" in info.value.message  # the reason, in the decoder's words
            assert impl.counts["add"] == 0
            assert await calc.add(2**64, 1) == 2**64 + 1


@both_directions
async def test_arguments_that_cannot_be_sent_are_not_dispatched(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            with pytest.raises(gl.NotDispatched) as info:
                await calc.add(1)  # type: ignore[call-arg]
            assert info.value.code == "INVALID_ARGUMENTS"
            with pytest.raises(gl.NotDispatched, match="INVALID_ARGUMENTS"):
                await calc.add(1, 2, 3)  # type: ignore[call-arg]
            with pytest.raises(gl.NotDispatched, match="INVALID_ARGUMENTS"):
                await calc.add(object(), 2)  # type: ignore[arg-type]
            assert impl.counts["add"] == 0
            assert await calc.add(2, 2) == 4


class CalcPlus(Calc, Protocol):
    """What a controller with a newer interface than the worker's sees."""

    async def mul(self, a: int, b: int) -> int: ...


class Narrow(Protocol):
    async def add(self, a: int, b: int) -> int: ...


class Wide(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    async def admin_reset(self) -> int: ...


class ImplWithExtras(CalcImpl):
    async def admin_reset(self) -> int:
        self.counts["admin"] += 1
        return 0


@both_directions
async def test_unknown_and_private_methods_are_unsupported(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            plus = pair.executor.service("calc", CalcPlus)
            # a method or service the worker's manifest lacks: the facade refuses the call,
            # unsent; the worker refuses it too when it arrives anyway
            with pytest.raises(gl.Rejected) as info:
                await plus.mul(2, 3)
            assert info.value.code == "UNSUPPORTED"
            assert "calc.mul" in info.value.message
            rpc = pair.rpc
            with pytest.raises(gl.Rejected) as info:
                await raw_call(rpc, "calc", "mul", [2, 3])
            assert info.value.code == "OPERATION_UNSUPPORTED"
            assert "mul" in info.value.message
            with pytest.raises(gl.Rejected) as info:
                await pair.executor.service("nope", Calc).add(1, 2)
            assert info.value.code == "UNSUPPORTED"
            assert "no service 'nope'" in info.value.message
            with pytest.raises(gl.Rejected) as info:
                await raw_call(rpc, "nope", "add", [1, 2])
            assert info.value.code == "UNKNOWN_SERVICE"
            for method in ("_secret", "__init__", "__class__", "release", "_release_event", ""):
                with pytest.raises(gl.Rejected) as info:
                    await raw_call(rpc, "calc", method)
                assert info.value.code == "OPERATION_UNSUPPORTED", method
            for service in ("_calc", "$link", 5, None):
                with pytest.raises(gl.Rejected):
                    await raw_call(rpc, service, "add", [1, 2])
            assert impl.counts["secret"] == 0
            # the facade itself never offers private names
            assert not hasattr(plus, "_secret")
            assert await plus.add(1, 1) == 2


@both_directions
async def test_exposure_is_limited_to_the_registered_interface(direction: Direction) -> None:
    impl = ImplWithExtras()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": gl.Service(impl, Narrow)}) as pair:
            wide = pair.executor.service("calc", Wide)
            assert await wide.add(2, 5) == 7
            with pytest.raises(gl.Rejected, match="UNSUPPORTED"):
                await wide.admin_reset()  # not in the manifest: refused before sending
            with pytest.raises(gl.Rejected, match="OPERATION_UNSUPPORTED"):
                await raw_call(pair.rpc, "calc", "admin_reset")  # and by the worker
            with pytest.raises(gl.Rejected, match="OPERATION_UNSUPPORTED"):
                await raw_call(pair.rpc, "calc", "hold", ["k"])
            assert impl.counts["admin"] == 0 and impl.counts["k"] == 0
            info = await pair.executor.info()
            assert set(info.services["calc"]) == {"add"}


@both_directions
async def test_handler_exception_is_a_remote_error(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            calc = pair.calc()
            with pytest.raises(gl.RemoteError) as info:
                await calc.fail("boom")
            error = info.value
            assert error.outcome is gl.Outcome.FAILED
            assert error.code == "HANDLER_FAILED"
            assert error.message == "boom"
            assert error.remote_type == "builtins.ValueError"
            assert error.remote_traceback is not None
            assert "ValueError: boom" in error.remote_traceback
            assert "in fail" in error.remote_traceback
            assert "builtins.ValueError" in str(error)
            assert await calc.add(1, 2) == 3


@both_directions
async def test_registered_exception_is_reraised_as_itself(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            with pytest.raises(Custom, match="custom trouble") as info:
                await pair.calc().fail_custom("custom trouble")
            cause = info.value.__cause__
            assert isinstance(cause, gl.RemoteError)
            assert cause.remote_type == f"{Custom.__module__}.Custom"
            assert cause.remote_traceback and "Custom: custom trouble" in cause.remote_traceback


@both_directions
async def test_handler_raising_rejected_keeps_its_code(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            with pytest.raises(gl.Rejected) as info:
                await pair.calc().fail_reject()
            assert info.value.code == "NOT_NOW"
            assert info.value.message == "the handler refused"


class Expiring(Protocol):
    async def use(self) -> int: ...


class ExpiringImpl:
    async def use(self) -> int:
        raise gl.StaleResource("HANDLE_EXPIRED", "the handle expired")


@both_directions
async def test_stale_resource_raised_by_a_handler_keeps_its_class(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"e": ExpiringImpl()}) as pair:
            with pytest.raises(gl.StaleResource) as info:
                await pair.executor.service("e", Expiring).use()
            assert info.value.code == "HANDLE_EXPIRED"
            assert info.value.message == "the handle expired"


class Liar(Protocol):
    """The controller's (wrong) belief about ``calc.add``'s result type."""

    async def add(self, a: int, b: int) -> str: ...


class LyingImpl(CalcImpl):
    """Declares ``add -> int`` (through ``Calc``) and returns text at run time."""

    async def add(self, a, b):  # type: ignore[no-untyped-def]
        self.counts["add"] += 1
        return str(a + b)


@both_directions
async def test_result_not_matching_the_interface_fails_the_call(direction: Direction) -> None:
    impl = LyingImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": gl.Service(impl, Calc)}) as pair:
            with pytest.raises(gl.RemoteError) as info:
                await pair.calc().add(1, 2)  # the manifest says int; the value is text
            assert info.value.code == "INVALID_RESULT"
            assert impl.counts["add"] == 1
            # a facade whose belief contradicts the manifest is refused before sending
            with pytest.raises(gl.Rejected, match="CONTRACT_CHANGED"):
                await pair.executor.service("calc", Liar).add(1, 2)
            assert impl.counts["add"] == 1


# ---------------------------------------------------------------------------------- types


class Shape(enum.IntEnum):
    SQUARE = 4
    TRIANGLE = 3


@dataclass
class Box:
    corner: Point
    size: tuple[int, int]
    color: Color
    shape: Shape
    tags: dict[str, list[int]]
    seen: datetime.datetime
    payload: bytes
    note: str | None = None


class Types(Protocol):
    async def echo_box(self, box: Box) -> Box: ...
    async def echo_many(
        self,
        points: list[Point],
        lookup: dict[str, Color],
        pair: tuple[int, str],
        maybe: int | None,
        mode: Literal["a", "b"],
        blob: bytes,
        when: datetime.datetime,
        day: datetime.date,
    ) -> tuple[
        list[Point],
        dict[str, Color],
        tuple[int, str],
        int | None,
        Literal["a", "b"],
        bytes,
        datetime.datetime,
        datetime.date,
    ]: ...
    async def later(self, when: datetime.datetime, days: int) -> datetime.datetime: ...
    async def optional(self, point: Point | None = None) -> Point | None: ...
    def boxes(self, n: int) -> AsyncIterator[Box]: ...


class TypesImpl:
    def __init__(self) -> None:
        self.received: list[Any] = []

    async def echo_box(self, box: Box) -> Box:
        assert isinstance(box, Box) and isinstance(box.corner, Point)
        assert isinstance(box.color, Color) and isinstance(box.shape, Shape)
        assert isinstance(box.seen, datetime.datetime) and isinstance(box.size, tuple)
        self.received.append(box)
        return box

    async def echo_many(self, *args: Any) -> Any:
        self.received.append(args)
        return args

    async def later(self, when: datetime.datetime, days: int) -> datetime.datetime:
        assert when.tzinfo is not None
        return when + datetime.timedelta(days=days)

    async def optional(self, point: Point | None = None) -> Point | None:
        return None if point is None else Point(point.y, point.x, point.label)

    async def boxes(self, n: int) -> AsyncIterator[Box]:
        for i in range(n):
            yield _box(i)


def _box(i: int) -> Box:
    return Box(
        corner=Point(i, -i, label=None if i % 2 else f"p{i}"),
        size=(i, i + 1),
        color=Color.GREEN if i % 2 else Color.RED,
        shape=Shape.SQUARE,
        tags={"a": [i, i], "b": []},
        seen=datetime.datetime(2024, 2, 29, 12, 0, i, 250000, tzinfo=datetime.UTC),
        payload=bytes(range(i % 256)) + b"\x00\xff",
        note="n" if i else None,
    )


@both_directions
async def test_types_round_trip(direction: Direction) -> None:
    impl = TypesImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"types": gl.Service(impl, Types)}) as pair:
            types = pair.executor.service("types", Types)
            box = _box(3)
            assert await types.echo_box(box) == box
            assert impl.received[-1] == box
            when = datetime.datetime(
                2023, 12, 31, 23, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=-5))
            )
            args: tuple[
                list[Point],
                dict[str, Color],
                tuple[int, str],
                int | None,
                Literal["a", "b"],
                bytes,
                datetime.datetime,
                datetime.date,
            ] = (
                [Point(1, 2), Point(3, 4, "four")],
                {"r": Color.RED, "g": Color.GREEN},
                (7, "seven"),
                None,
                "b",
                b"\x00binary\xff",
                when,
                datetime.date(2024, 1, 1),
            )
            result = await types.echo_many(*args)
            assert result == args
            assert impl.received[-1] == args  # converted on the worker, too
            varied = (*args[:3], 5, *args[4:])
            assert await types.echo_many(*varied) == varied
            later = await types.later(when, 2)
            assert later == when + datetime.timedelta(days=2)
            assert later.utcoffset() == datetime.timedelta(hours=-5)
            assert await types.optional() is None
            assert await types.optional(Point(1, 2, "x")) == Point(2, 1, "x")
            assert [b async for b in types.boxes(5)] == [_box(i) for i in range(5)]
            with pytest.raises(gl.Rejected, match="'mode'"):
                await types.echo_many(*args[:4], "c", *args[5:])  # type: ignore[arg-type]
            with pytest.raises(gl.Rejected, match="INVALID_ARGUMENTS"):
                await raw_call(pair.rpc, "types", "echo_box", [{"corner": {"x": "1", "y": 2}}])


# ---------------------------------------------------------------------------------- cancellation


@both_directions
async def test_cancelling_the_caller_cancels_the_handler(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            async with anyio.create_task_group() as tg:
                tg.start_soon(calc.hold, "k")
                await impl.probe.wait("started:k")
                tg.cancel_scope.cancel()
            await impl.probe.wait("cancelled:k")
            assert impl.counts["k"] == 1
            assert pair.executor.statistics().pending_calls == 0
            assert await calc.add(1, 2) == 3


class Lingering(Protocol):
    async def linger(self) -> None: ...


class LingeringImpl:
    """A handler whose cancellation takes a while to finish (shielded cleanup)."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.cleaned_up = False

    async def linger(self) -> None:
        self.started.set()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.2)
            self.cleaned_up = True


@both_directions
async def test_stopping_the_worker_waits_for_cancelled_handlers_to_end(
    direction: Direction,
) -> None:
    """Handlers are structured: the session's end cancels them and waits for them to end (on
    asyncio they are tasks the RPC object tracks itself, not task-group children)."""
    impl = LingeringImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"slow": gl.Service(impl, Lingering)}) as pair:
            slow = pair.executor.service("slow", Lingering)
            async with anyio.create_task_group() as tg:

                async def linger() -> None:
                    with pytest.raises(gl.CallError):
                        await slow.linger()

                tg.start_soon(linger)
                await impl.started.wait()
                await pair.stop_worker()
                assert impl.cleaned_up  # stop waited for the handler's cleanup


@both_directions
async def test_timeout_is_outcome_unknown_and_cancels_the_handler(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = gl.with_options(pair.calc(), timeout=0.2)
            with pytest.raises(gl.OutcomeUnknown) as info:
                await calc.hold("t")
            assert info.value.code == "TIMEOUT"
            assert info.value.outcome is gl.Outcome.UNKNOWN
            await impl.probe.wait("cancelled:t")
            assert impl.counts["t"] == 1
            assert await calc.add(1, 2) == 3  # the short timeout is per call, not sticky


@both_directions
async def test_stream_aclose_cancels_the_generator(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            stream = calc.ticks("a")
            got = [await stream.__anext__() for _ in range(5)]
            assert got == [0, 1, 2, 3, 4]
            await stream.aclose()  # type: ignore[attr-defined]
            await impl.probe.wait("stream-closed:a")
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            await stream.aclose()  # type: ignore[attr-defined]  # idempotent

            # ``break`` inside ``aclosing`` does the same
            async with contextlib.aclosing(calc.ticks("b")) as ticks:  # type: ignore[type-var]
                async for i in ticks:
                    if i == 3:
                        break
            await impl.probe.wait("stream-closed:b")
            assert pair.executor.statistics().pending_calls == 0
            assert await calc.add(1, 2) == 3


@both_directions
async def test_cancelling_a_stream_consumer_cancels_the_generator(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:

            async def consume() -> None:
                async with contextlib.aclosing(pair.calc().ticks("c")) as ticks:  # type: ignore[type-var]
                    async for _ in ticks:
                        pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await impl.probe.wait("stream-started:c")
                tg.cancel_scope.cancel()
            await impl.probe.wait("stream-closed:c")


@both_directions
async def test_facade_stream_closed_before_start_never_runs(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            stream = pair.calc().count(3)
            await stream.aclose()  # type: ignore[attr-defined]
            with pytest.raises(StopAsyncIteration):
                await stream.__anext__()
            assert await pair.calc().add(0, 0) == 0
            assert impl.counts["count"] == 0


async def _break_out(calc: Calc, key: str) -> None:
    async for _ in calc.ticks(key):
        break  # no aclose(): the iterator is simply dropped


async def _break_out_of_a_generator(calc: Calc, key: str) -> None:
    async def relay() -> AsyncIterator[int]:
        async for i in calc.ticks(key):
            yield i

    async for _ in relay():
        break  # the loop's async-generator hooks close relay(), which drops the stream


async def _wait_idle(pair: Any) -> None:
    """Until neither side holds a call: no pending slot here, no handler on the worker."""
    worker_rpc = pair.worker.current_rpc
    while pair.rpc.statistics().pending_calls or worker_rpc.statistics().incoming_calls:
        await anyio.sleep(0.005)


async def _leave_many(pair: Any, impl: CalcImpl, leave: Any) -> None:
    """More streams left with ``break`` than the pending budget (256) allows; then each one's
    slot and worker handler must have been reclaimed. With the cyclic garbage collector off, so
    nothing but reference counting may free the dropped iterators."""
    calc = pair.calc()
    keys = [f"k{i}" for i in range(300)]
    gc.disable()
    try:
        for key in keys:
            await leave(calc, key)
    finally:
        gc.enable()
    assert await calc.add(1, 2) == 3
    await _wait_idle(pair)
    for key in keys:
        await impl.probe.wait(f"stream-closed:{key}")
    assert "offline" not in pair.history  # never retired (see the module docstring)


@both_directions
async def test_streams_left_with_break_are_reclaimed(direction: Direction) -> None:
    """(~0.5-1 s per run)"""
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            await _leave_many(pair, impl, _break_out)


# trio finalizes an abandoned async generator too, but warns that the *caller's* generator
# should have been closed with aclosing(); that advice is not what this test is about.
@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected:ResourceWarning")
async def test_streams_left_inside_an_async_generator_are_reclaimed() -> None:
    """The event loop's async-generator hooks close the abandoned generator, which drops the
    stream it iterated (~1 s per run)."""
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}) as pair:
            await _leave_many(pair, impl, _break_out_of_a_generator)


@both_directions
async def test_a_stream_lost_in_a_reference_cycle_is_reclaimed_by_the_collector(
    direction: Direction,
) -> None:
    """The finalizer then runs inside the garbage collector; it only schedules the reclaim."""
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            for i in range(20):
                stream = pair.calc().ticks(f"c{i}")
                assert await stream.__anext__() == 0
                cycle: list[Any] = [stream]
                cycle.append(cycle)
                del stream, cycle
            gc.collect()
            await _wait_idle(pair)
            for i in range(20):
                await impl.probe.wait(f"stream-closed:c{i}")
            assert await pair.calc().add(1, 2) == 3


class Broken(Protocol):
    def count(self, n: int) -> AsyncIterator[int]: ...
    def explode(self, n: int) -> AsyncIterator[int]: ...


class BrokenImpl:
    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def explode(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i
        raise RuntimeError("generator failed")


@both_directions
async def test_stream_error_after_items(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"b": BrokenImpl()}) as pair:
            broken = pair.executor.service("b", Broken)
            got: list[int] = []

            async def drain() -> None:
                async for i in broken.explode(4):
                    got.append(i)

            with pytest.raises(gl.RemoteError) as info:
                await drain()
            assert got == [0, 1, 2, 3]
            assert info.value.remote_type == "builtins.RuntimeError"
            assert [i async for i in broken.count(3)] == [0, 1, 2]


@both_directions
async def test_stream_credit_bounds_the_producer(direction: Direction) -> None:
    limits = LIMITS.replace(stream_window_items=4)
    produced: list[int] = []

    class Counting:
        async def count(self, n: int) -> AsyncIterator[int]:
            for i in range(n):
                produced.append(i)
                yield i

    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"c": Counting()}, limits=limits) as pair:
            stream = pair.executor.service("c", Broken).count(100)
            consumed = 0
            async for i in stream:
                assert i == consumed
                consumed += 1
                # the producer is never more than a few windows ahead of the consumer
                assert len(produced) <= consumed + 4 * limits.stream_window_items + 1
                for _ in range(5):
                    await anyio.lowlevel.checkpoint()
            assert consumed == 100


@both_directions
async def test_byte_credit_is_replenished(direction: Direction) -> None:
    # A byte window far smaller than the stream: the consumer must give back exactly what the
    # producer charges per item, or a long stream stalls once the initial byte credit is spent.
    limits = LIMITS.replace(stream_window_bytes=256)
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": CalcImpl()}, limits=limits) as pair:
            items = [i async for i in pair.calc().count(3000)]
            assert items == list(range(3000))


class Bulky(Protocol):
    def blobs(self, n: int, size: int) -> AsyncIterator[bytes]: ...


class BulkyImpl:
    async def blobs(self, n: int, size: int) -> AsyncIterator[bytes]:
        for i in range(n):
            yield i.to_bytes(4, "big") * (size // 4)


@both_directions
async def test_an_honest_producer_never_trips_the_credit_check(direction: Direction) -> None:
    """Credit is enforced by the consumer (an item beyond it ends the stream), so an honest
    producer must never look like a violator: here its own window is far larger than the
    consumer's (it is capped by the grant, not by its own limits), and every item is larger than
    the whole byte window (each one overdraws the byte credit, as the producer charges after
    encoding)."""
    consumer = LIMITS.replace(stream_window_items=4, stream_window_bytes=100)
    producer = LIMITS.replace(stream_window_items=1024)
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"b": BulkyImpl()}, limits=consumer, worker_limits=producer
        ) as pair:
            bulky = pair.executor.service("b", Bulky)
            got = [blob async for blob in bulky.blobs(200, 1000)]
            assert [int.from_bytes(b[:4], "big") for b in got] == list(range(200))
            assert pair.rpc.statistics().flow_violations == 0


# ---------------------------------------------------------------------------------- sizes


SMALL_FRAMES = LIMITS.replace(max_frame_bytes=64 * 1024)


class Sized(Protocol):
    async def echo(self, text: str) -> str: ...
    async def make(self, n: int) -> str: ...


class SizedImpl:
    async def echo(self, text: str) -> str:
        return text

    async def make(self, n: int) -> str:
        return "y" * n


@both_directions
async def test_payload_too_large_is_not_dispatched_and_harmless(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"s": SizedImpl()}, limits=SMALL_FRAMES) as pair:
            sized = pair.executor.service("s", Sized)
            with pytest.raises(gl.NotDispatched) as info:
                await sized.echo("x" * 100_000)
            assert info.value.code == "PAYLOAD_TOO_LARGE"
            with pytest.raises(gl.RemoteError) as failed:
                await sized.make(100_000)
            assert failed.value.code == "RESULT_TOO_LARGE"
            assert await sized.echo("x" * 60_000) == "x" * 60_000
            assert pair.history == ["ready"]


class Chunks(Protocol):
    def chunks(self, text: str) -> AsyncIterator[str]: ...


class ChunksImpl:
    async def chunks(self, text: str) -> AsyncIterator[str]:
        yield text


@both_directions
async def test_stream_whose_request_cannot_be_sent_ends(direction: Direction) -> None:
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"c": ChunksImpl()}, limits=SMALL_FRAMES) as pair:
            stream = pair.executor.service("c", Chunks).chunks("x" * 100_000)
            with pytest.raises(gl.NotDispatched, match="PAYLOAD_TOO_LARGE"):
                await stream.__anext__()
            with pytest.raises(StopAsyncIteration):  # not a hang
                await stream.__anext__()
            assert pair.executor.statistics().pending_calls == 0
            assert [c async for c in pair.executor.service("c", Chunks).chunks("ok")] == ["ok"]


class Relay(Protocol):
    async def relay_big(self, size: int) -> int: ...


class RelayImpl:
    def __init__(self) -> None:
        self.ran = 0

    async def relay_big(self, size: int) -> int:
        self.ran += 1
        return await gl.peer("sink", Sink).push("x" * size)


@both_directions
async def test_failed_nested_call_fails_the_outer_call(direction: Direction) -> None:
    # The handler ran, then a call *it* made was not dispatched. The outer call executed, so it
    # must be FAILED -- never NOT_DISPATCHED, which would tell the caller a retry is safe.
    relay, sink = RelayImpl(), SinkImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction,
            {"relay": relay},
            controller_services={"sink": sink},
            limits=SMALL_FRAMES,
        ) as pair:
            facade = pair.executor.service("relay", Relay)
            assert await facade.relay_big(10) == 10
            with pytest.raises(gl.RemoteError) as info:
                await facade.relay_big(100_000)
            assert info.value.outcome is gl.Outcome.FAILED
            assert info.value.remote_type == "garcon_link.errors.NotDispatched"
            assert "PAYLOAD_TOO_LARGE" in info.value.message
            assert relay.ran == 2 and sink.pushed == ["x" * 10]


# ---------------------------------------------------------------------------------- budgets


@both_directions
async def test_overload_on_the_caller(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            results: list[int] = []

            async def one(i: int) -> None:
                results.append(await calc.record(i, gated=True))

            async with anyio.create_task_group() as tg:
                for i in range(256):
                    tg.start_soon(one, i)
                for i in range(256):
                    await impl.probe.wait(f"record:{i}")
                with pytest.raises(gl.NotDispatched) as info:
                    await calc.add(1, 2)
                assert info.value.code == "OVERLOADED"
                assert info.value.outcome is gl.Outcome.NOT_DISPATCHED
                impl.gate.set()
            assert sorted(results) == [2 * i for i in range(256)]
            assert await calc.add(1, 2) == 3
            assert impl.counts["add"] == 1
            assert "offline" not in pair.history  # never retired (see the module docstring)


@both_directions
async def test_overload_on_the_receiver(direction: Direction) -> None:
    impl = CalcImpl()
    controller = LIMITS.replace(max_pending_calls=512)
    worker = LIMITS.replace(max_incoming_calls=256)
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"calc": impl}, limits=controller, worker_limits=worker
        ) as pair:
            calc = pair.calc()
            results: list[int] = []

            async def one(i: int) -> None:
                results.append(await calc.record(i, gated=True))

            async with anyio.create_task_group() as tg:
                for i in range(256):
                    tg.start_soon(one, i)
                for i in range(256):
                    await impl.probe.wait(f"record:{i}")
                with pytest.raises(gl.NotDispatched) as info:
                    await calc.record(1000)
                assert info.value.code == "OVERLOADED"
                assert impl.counts[1000] == 0
                impl.gate.set()
            assert sorted(results) == [2 * i for i in range(256)]
            assert await calc.record(1000) == 2000
            assert "offline" not in pair.history  # never retired (see the module docstring)


def test_refusals_past_the_backlog_keep_only_their_call_ids() -> None:
    """What is kept per call refused past ``max_queued_refusals``: its id, as a delta from the
    previous one (call ids strictly increase), so about the bytes it took on the wire."""
    from garcon_link.rpc.outbox import CallIds as _CallIds

    ids = _CallIds()
    wanted = [1, 2, 3, 200, 70_000, 2**40, 2**70 + 5, 2**70 + 6]
    for call_id in wanted[:4]:
        ids.append(call_id)
    assert [ids.popleft(), ids.popleft()] == [1, 2]
    for call_id in wanted[4:]:
        ids.append(call_id)
    assert len(ids) == 6
    assert [ids.popleft() for _ in range(6)] == wanted[2:]
    assert len(ids) == 0
    with pytest.raises(IndexError):
        ids.popleft()
    with pytest.raises(ValueError, match="does not increase"):
        ids.append(2**70 + 6)
    many = list(range(2**70 + 10, 2**70 + 1_000_010, 3))
    for call_id in many:
        ids.append(call_id)
    assert len(ids._data) < 2 * len(many)  # one byte per small delta, give or take
    assert [ids.popleft() for _ in many] == many
    ids.append(2**80)
    ids.clear()
    ids.append(2**80 + 1)
    assert ids.popleft() == 2**80 + 1


def test_the_refusal_backlog_must_exceed_the_pending_budget() -> None:
    """A peer configured alike must never fill our refusal backlog: at the bound our reader
    pauses, and the receipts that would drain it wait unread."""
    with pytest.raises(gl.ConfigError, match="max_queued_refusals"):
        gl.Limits(max_pending_calls=1024)
    assert gl.Limits(max_pending_calls=1024, max_queued_refusals=4096).max_queued_refusals == 4096


# ---------------------------------------------------------------------------------- retirement


async def test_retire_unknown_distinguishes_offered_from_never_written() -> None:
    """A request that never reached a socket is NOT_DISPATCHED; one that did is UNKNOWN."""
    from garcon_link.endpoint.transport import SessionTransport
    from garcon_link.rpc.interface import service_spec
    from garcon_link.rpc.rpc import Registry

    spec = service_spec(Calc).methods["add"]
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            transport = SessionTransport(b"s" * 32, b"r" * 16, LIMITS, tg)
            rpc = ExecutorRpc(transport, Registry(), LIMITS)
            tg.start_soon(rpc.run)
            outcome: list[BaseException] = []

            async def call() -> None:
                try:
                    await rpc.call("calc", spec, (1, 2), {}, timeout=None)
                except gl.CallError as exc:
                    outcome.append(exc)

            tg.start_soon(call)
            while not rpc.statistics().pending_calls:
                await anyio.lowlevel.checkpoint()
            transport.retire(gl.errors.FailureReason.GRACE_EXPIRED)
            while not outcome:
                await anyio.lowlevel.checkpoint()
            assert isinstance(outcome[0], gl.NotDispatched)
            assert outcome[0].code == "CONTINUITY_LOST"
            with pytest.raises(gl.NotDispatched, match="OFFLINE"):
                await rpc.call("calc", spec, (1, 2), {}, timeout=None)
            tg.cancel_scope.cancel()


# ---------------------------------------------------------------------------------- hostile peers


@both_directions
async def test_hostile_controller_envelopes(direction: Direction) -> None:
    """Hand-written envelopes over an authenticated session never crash the worker and never
    disturb an unrelated call in flight."""
    impl = CalcImpl()
    # A hint msgspec cannot convert to (a Protocol as a value type) is refused at registration
    # now; the receiving side's defence against it is tested in test_interface.
    services = {"calc": impl}
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, services) as pair:
            calc = pair.calc()
            rpc = pair.rpc
            unrelated: list[str] = []
            stream_items: list[int] = []

            async def long_call() -> None:
                unrelated.append(await calc.hold("long"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(long_call)
                await impl.probe.wait("started:long")
                # The hostile envelopes below name this call (its id: the session's test seam).
                (long_id,) = rpc.pending_call_ids()

                # -- not an envelope at all
                for body in (
                    b"",
                    b"\xff",
                    b"\x9f",  # an indefinite array that never ends
                    b"\x81" * 100_000 + b"\x00",  # nested far too deep
                    cbor2.dumps(5),
                    cbor2.dumps("call"),
                    cbor2.dumps(None),
                    cbor2.dumps({"kind": 0}),
                    cbor2.dumps([]),
                    cbor2.dumps([None]),
                    cbor2.dumps(["call", 1]),
                    cbor2.dumps([1.5, 1]),
                    cbor2.dumps([99, 1, 2]),
                    cbor2.dumps([-1]),
                    cbor2.dumps([2**64 - 1, 1]),
                    cbor2.dumps([cbor2.CBORTag(4242, 1), 1]),
                    # Its head names a new call: refused unexecuted (the reply names no call
                    # of ours and is dropped here), so the id must stay in sequence.
                    cbor2.dumps([CALL, next_call_id(rpc), "calc", "add", [1, 2], {}, 0, 0])
                    + b"\x00",
                ):
                    await raw_send(rpc, body)

                # -- replies, cancels and credit for ids the worker never issued
                for envelope in (
                    [RESULT, 123456, 1],
                    [ERROR, 123456, "no"],
                    [ITEM, 123456, 1],
                    [END, 123456],
                    [CANCEL, 123456],
                    [CREDIT, 123456, 5, 5],
                    [CREDIT, 123456, -5, 2**64 - 1],
                    [RESULT],
                    [ERROR, "x"],
                    [CANCEL],
                    [CANCEL, "1"],
                    [CREDIT, 1, "a", None],
                ):
                    await raw_send(rpc, envelope)

                # -- malformed calls that name an id get an error reply
                malformed = [
                    ("calc", "add", "not a list", {}),
                    ("calc", "add", [1, 2], [["not", "a map"]]),
                    ("calc", "add", [1, 2], {1: "int key"}),
                    ("calc", "add", [1, "2"], {}),
                    ("calc", "add", [1, 2, 3], {}),
                    ("calc", "add", [], {"a": 1, "b": 2, "c": 3}),
                    ("calc", "add", [["deep"] * 10, 1], {}),
                    ("calc", "add", ["x" * 4_000_000, 1], {}),
                    ("calc", "add", [list(range(200_000)), 1], {}),
                    ("calc", 7, [], {}),
                ]
                for service, method, args, kwargs in malformed:
                    with pytest.raises(gl.Rejected) as info:
                        await raw_call(rpc, service, method, args, kwargs)
                    assert info.value.code == "INVALID_ARGUMENTS" or (
                        info.value.code == "OPERATION_UNSUPPORTED" and method == 7
                    ), (service, method, info.value)
                for credit in ((-1, 0), (1.5, 0), ("1", 0), (0, -1)):
                    with pytest.raises(gl.Rejected, match="INVALID_ARGUMENTS"):
                        await raw_call(rpc, "calc", "count", [3], {}, credit)
                with pytest.raises(gl.Rejected, match="initial credit"):
                    await raw_call(rpc, "calc", "count", [3], {}, (0, 100))

                # (Hostile envelopes must name real call ids: the session's test seam.)
                # -- wrong arity: dropped, the caller learns nothing (it named no valid call)
                bad_id = next_call_id(rpc)
                last_used = bad_id - 1  # answered above, so the worker has seen it
                await raw_send(rpc, [CALL, bad_id, "calc", "add", [1, 2]])
                await raw_send(rpc, [CALL, "7", "calc", "add", [1, 2], {}, 0, 0])
                await raw_send(rpc, [CALL, True, "calc", "add", [1, 2], {}, 0, 0])

                # -- duplicate and decreasing ids are dropped, never executed
                for dup in (long_id, 1, last_used):
                    await raw_send(rpc, [CALL, dup, "calc", "record", [7000 + dup], {}, 0, 0])

                # -- a huge initial credit and a credit overflow on a live stream
                stream = calc.count(50)
                stream_items.append(await stream.__anext__())
                stream_id = max(rpc.pending_call_ids())
                await raw_send(rpc, [CREDIT, stream_id, 2**64 - 1, 2**64 - 1])
                await raw_send(rpc, [CREDIT, stream_id, -(2**63), -(2**63)])
                stream_items.extend([i async for i in stream])
                assert await raw_call(rpc, "calc", "add", [2, 3], {}, (2**64 - 1, 2**64 - 1)) == 5

                # -- a cancel storm over every id but the unrelated call's
                for cid in range(1, next_call_id(rpc) + 500):
                    if cid != long_id:
                        await raw_send(rpc, [CANCEL, cid])
                await raw_send(rpc, cbor2.dumps([[CANCEL, i] for i in range(5000)]))

                # -- notifications: garbage is dropped
                for envelope in (
                    [NOTIFY],
                    [NOTIFY, 1, 2, 3, 4],
                    [NOTIFY, "calc", "nope", [], {}],
                    [NOTIFY, "calc", "note", "text", {}],
                    [NOTIFY, "calc", "note", [1], {}],
                    [NOTIFY, "calc", "_secret", [], {}],
                ):
                    await raw_send(rpc, envelope)
                await raw_send(rpc, [NOTIFY, "calc", "note", ["fine"], {}])
                await impl.probe.wait("note:fine")

                # the session is intact and still in order
                assert await calc.add(20, 22) == 42
                assert pair.history == ["ready"]
                assert "cancelled:long" not in impl.probe
                impl._release("long")
            assert unrelated == ["long"]
            assert stream_items == list(range(50))
            assert impl.notes == ["fine"]
            assert impl.counts["secret"] == 0
            assert not any(impl.counts[7000 + i] for i in (long_id, 1, last_used))
            assert impl.counts["add"] == 2  # the two well-formed adds, nothing else
            assert pair.worker is not None and pair.worker.sessions == 1
            assert pair.history == ["ready"]


@both_directions
async def test_notification_storm_is_bounded(direction: Direction) -> None:
    # A peer may notify any unary method (the worker of a plain class cannot know which ones the
    # caller's interface marks one-way), but never more handlers than the incoming budget, and
    # never a stream.
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            rpc = pair.rpc
            for i in range(300):
                await raw_send(rpc, [NOTIFY, "calc", "hold", [f"n{i}"], {}])
            await raw_send(rpc, [NOTIFY, "calc", "count", [5], {}])
            with pytest.raises(gl.NotDispatched, match="OVERLOADED"):
                await pair.calc().add(1, 1)
            while sum(f"started:n{i}" in impl.probe for i in range(300)) < 256:
                await anyio.sleep(0.005)
            assert not any(f"started:n{i}" in impl.probe for i in range(256, 300))
            assert impl.counts["count"] == 0
            for i in range(256):
                impl._release(f"n{i}")
            with anyio.fail_after(2):
                while True:
                    try:
                        assert await pair.calc().add(1, 1) == 2
                        break
                    except gl.NotDispatched:
                        await anyio.sleep(0.01)
            assert impl.counts["count"] == 0
            assert "offline" not in pair.history  # never retired (see the module docstring)


@both_directions
async def test_notifications_count_against_the_incoming_budget(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = pair.calc()
            for _ in range(300):
                await calc.park()
            # processed in order: by the time this call is dispatched every park was, too
            with pytest.raises(gl.NotDispatched, match="OVERLOADED"):
                await calc.add(1, 2)
            while impl.counts["parked"] < 256:
                await anyio.sleep(0.005)
            impl.gate.set()
            with anyio.fail_after(2):
                while True:
                    try:
                        assert await calc.add(1, 2) == 3
                        break
                    except gl.NotDispatched:
                        await anyio.sleep(0.01)
            assert impl.counts["parked"] == 256
            assert "offline" not in pair.history  # never retired (see the module docstring)


class Evil(Protocol):
    async def lie(self, how: str) -> int: ...


class EvilImpl:
    """A worker handler that writes hand-made replies for its own call on the session."""

    async def lie(self, how: str) -> int:
        from garcon_link.rpc.rpc import current_rpc

        rpc = current_rpc()
        call_id = rpc.last_incoming_id  # the id to lie about
        envelopes: dict[str, list[Any]] = {
            "wrong-type": [RESULT, call_id, "not an int"],
            "short-result": [RESULT, call_id],
            "long-result": [RESULT, call_id, 1, 2],
            "error-not-map": [ERROR, call_id, "boom"],
            "error-odd-outcome": [ERROR, call_id, {"outcome": "weird", "code": 5}],
            "error-odd-fields": [
                ERROR,
                call_id,
                {"outcome": "failed", "code": "X", "remote_type": 5, "traceback": 7, "details": 1},
            ],
            "error-rejected": [ERROR, call_id, {"outcome": "rejected", "code": "STALE_RESOURCE"}],
            "error-no-code": [ERROR, call_id, {"outcome": "failed", "message": "m"}],
            "error-int-message": [ERROR, call_id, {"outcome": "failed", "code": "X", "message": 1}],
            "error-unknown": [ERROR, call_id, {"outcome": "unknown", "code": "LOST"}],
            "item-for-unary": [ITEM, call_id, 1],
            "end-for-unary": [END, call_id],
            "credit-for-ours": [CREDIT, call_id, 5, 5],
            "cancel-for-ours": [CANCEL, call_id],
        }
        undecodable = {
            # The value holds a tag (refused by strict decoding): only the head names the call.
            "undecodable-result": [RESULT, call_id, cbor2.CBORTag(1, 0)],
            "undecodable-error": [
                ERROR,
                call_id,
                {"outcome": "failed", "code": cbor2.CBORTag(1, 0)},
            ],
            # A bignum within wire.MAX_BIGNUM_BYTES decodes, but is no text code.
            "error-bignum-code": [ERROR, call_id, {"outcome": "failed", "code": 2**8000}],
            # Past that bound the envelope does not decode at all; its head still names the call.
            "error-huge-bignum-code": [ERROR, call_id, {"outcome": "failed", "code": 2**20000}],
        }
        if how in undecodable:
            await rpc.transport.send(cbor2.dumps(undecodable[how]))
            return 5
        if how == "garbage":
            for body in (
                b"\xff",
                cbor2.dumps(7),
                cbor2.dumps([42]),
                cbor2.dumps([RESULT, 10**9, 1]),
            ):
                await rpc.transport.send(body)
            await rpc.transport.send(cbor2.dumps([CALL, 10**9, "nope", "x", [], {}, 0, 0]))
            await rpc.transport.send(cbor2.dumps([CALL, 10**9 + 1, "$link", "nope", [], {}, 0, 0]))
            return 7
        await rpc.transport.send(cbor2.dumps(envelopes[how]))
        return 5  # the real reply; dropped when the forged one already settled the call


@both_directions
async def test_hostile_worker_envelopes(direction: Direction) -> None:
    impl = CalcImpl()
    services = {"calc": impl, "evil": EvilImpl()}
    # A reply we cannot read says nothing about whether the call ran: UNKNOWN, never FAILED
    # (rpc module docstring). A readable result of the wrong type: the call certainly ran.
    expected: dict[str, tuple[type[gl.CallError], str] | int] = {
        "wrong-type": (gl.RemoteError, "INVALID_RESULT"),
        "short-result": (gl.OutcomeUnknown, "MALFORMED_REPLY"),
        "long-result": (gl.OutcomeUnknown, "MALFORMED_REPLY"),
        "undecodable-result": (gl.OutcomeUnknown, "MALFORMED_REPLY"),
        "undecodable-error": (gl.OutcomeUnknown, "MALFORMED_REPLY"),
        "error-bignum-code": (gl.OutcomeUnknown, "MALFORMED_ERROR"),
        "error-huge-bignum-code": (gl.OutcomeUnknown, "MALFORMED_REPLY"),
        "error-not-map": (gl.OutcomeUnknown, "MALFORMED_ERROR"),
        "error-odd-outcome": (gl.OutcomeUnknown, "MALFORMED_ERROR"),
        "error-odd-fields": (gl.OutcomeUnknown, "MALFORMED_ERROR"),
        "error-no-code": (gl.OutcomeUnknown, "MALFORMED_ERROR"),
        "error-int-message": (gl.OutcomeUnknown, "MALFORMED_ERROR"),
        "error-unknown": (gl.OutcomeUnknown, "LOST"),
        "error-rejected": (gl.StaleResource, "STALE_RESOURCE"),
        "item-for-unary": 5,
        "end-for-unary": 5,
        "credit-for-ours": 5,
        "cancel-for-ours": 5,
        "garbage": 7,
    }
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, services) as pair:
            calc = pair.calc()
            evil = pair.executor.service("evil", Evil)
            unrelated: list[str] = []

            async def long_call() -> None:
                unrelated.append(await calc.hold("long"))

            async with anyio.create_task_group() as tg:
                tg.start_soon(long_call)
                await impl.probe.wait("started:long")
                for how, outcome in expected.items():
                    if isinstance(outcome, int):
                        assert await evil.lie(how) == outcome, how
                    else:
                        with pytest.raises(outcome[0]) as info:
                            await evil.lie(how)
                        assert info.value.code == outcome[1], how
                assert await calc.add(1, 2) == 3
                unreadable = [v for v in expected.values() if isinstance(v, tuple)]
                assert pair.rpc.statistics().malformed_replies == sum(
                    code.startswith("MALFORMED") for _, code in unreadable
                )
                impl._release("long")
            assert unrelated == ["long"]
            assert pair.history == ["ready"]
