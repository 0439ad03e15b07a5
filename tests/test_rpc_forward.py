"""``ExecutorRpc.forward``: a relayed call issued without a task and ended by callback (what a
gateway forwards a caller's unary call with). Its result's value is handed over as the bytes the
peer sent, never decoded; its timeout and its caller's cancel end it with the peer's receipt.

Over live loopback pairs, both directions; ``forward`` is asyncio's (on trio it declines, and
the gateway's handler path forwards instead).
"""

from __future__ import annotations

from typing import Any

import anyio
import cbor2
import pytest
from rpcutil import CalcImpl, Direction, both_directions, open_pair, raw_send

import garcon_link as gl
from garcon_link.rpc.errorbody import INTERRUPTED
from garcon_link.rpc.rpc import ExecutorRpc, Forward

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10


class Ends:
    """What ``on_end`` was told, and an event per end."""

    def __init__(self) -> None:
        self.ended: list[Forward] = []
        self.event = anyio.Event()

    def __call__(self, forward: Forward) -> None:
        self.ended.append(forward)
        self.event.set()

    async def one(self) -> Forward:
        await self.event.wait()
        self.event = anyio.Event()
        return self.ended[-1]


def arguments(*args: Any, **kwargs: Any) -> bytes:
    return cbor2.dumps(list(args)) + cbor2.dumps(kwargs)


def forward(
    rpc: ExecutorRpc, method: str, args: bytes, ends: Ends, timeout: float = 5.0
) -> Forward:
    issued = rpc.forward("calc", method, args, None, None, timeout, ends)
    assert issued is not None
    return issued


@both_directions
async def test_a_forwarded_result_is_handed_over_as_sent(
    direction: Direction, anyio_backend: str
) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            ends = Ends()
            if anyio_backend != "asyncio":
                assert pair.rpc.forward("calc", "add", arguments(1, 2), None, None, 5, ends) is None
                return
            forward(pair.rpc, "add", arguments(2, 3), ends)
            done = await ends.one()
            assert done.error is None and done.encoded == cbor2.dumps(5)
            # A peer's result is passed on as sent (here not in shortest form), not re-encoded.
            held = forward(pair.rpc, "hold", arguments("k"), ends)
            await impl.probe.wait("started:k")
            await raw_send(
                pair.worker_rpc, b"\x83\x01" + cbor2.dumps(held.pending.id) + b"\x18\x05"
            )
            done = await ends.one()
            assert done.error is None and done.encoded == b"\x18\x05"
            # One that does not decode as plain data (undefined) fails the call, as unreadable.
            held = forward(pair.rpc, "hold", arguments("j"), ends)
            await impl.probe.wait("started:j")
            await raw_send(pair.worker_rpc, b"\x83\x01" + cbor2.dumps(held.pending.id) + b"\xf7")
            done = await ends.one()
            assert isinstance(done.error, gl.OutcomeUnknown), done.error
            assert done.error.code == "MALFORMED_REPLY" and done.encoded is None
            # An error is decoded as usual.
            forward(pair.rpc, "fail", arguments("boom"), ends)
            done = await ends.one()
            assert isinstance(done.error, gl.RemoteError) and done.encoded is None
            impl._release("k")
            impl._release("j")
            assert len(ends.ended) == 4  # the late replies to the held calls were dropped


@both_directions
async def test_a_forwards_timeout_and_cancel_end_with_the_peers_receipt(
    direction: Direction, anyio_backend: str
) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("forward() is asyncio's")
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            ends = Ends()
            forward(pair.rpc, "hold", arguments("t"), ends, timeout=0.2)
            await impl.probe.wait("cancelled:t")
            done = await ends.one()
            assert isinstance(done.error, gl.OutcomeUnknown) and done.error.code == "TIMEOUT"
            assert done.receipt is None
            cancelled = forward(pair.rpc, "hold", arguments("c"), ends)
            await impl.probe.wait("started:c")
            cancelled.cancel()
            await impl.probe.wait("cancelled:c")
            done = await ends.one()
            assert isinstance(done.error, gl.OutcomeUnknown) and done.error.code == "CANCELLED"
            assert done.receipt == INTERRUPTED
            # Abandoned: cancelled on the peer, and nothing is told.
            abandoned = forward(pair.rpc, "hold", arguments("a"), ends)
            await impl.probe.wait("started:a")
            abandoned.abandon()
            await impl.probe.wait("cancelled:a")
            assert len(ends.ended) == 2
            assert pair.rpc.statistics().pending_calls == 0


@both_directions
async def test_forwards_time_out_each_at_its_own_deadline(
    direction: Direction, anyio_backend: str
) -> None:
    """The session's forwards share one timer: one ended early, one with a later deadline and
    one with an earlier deadline than those queued before it each keep their own outcome."""
    if anyio_backend != "asyncio":
        pytest.skip("forward() is asyncio's")
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            ends = Ends()
            answered = forward(pair.rpc, "hold", arguments("a"), ends, timeout=1.0)
            late = forward(pair.rpc, "hold", arguments("b"), ends, timeout=1.2)
            early = forward(pair.rpc, "hold", arguments("c"), ends, timeout=0.3)
            await impl.probe.wait("started:a")
            impl._release("a")
            for _ in range(3):
                await ends.one()
            assert answered.error is None and answered.encoded == cbor2.dumps("a")
            assert ends.ended.index(early) < ends.ended.index(late)
            for done in (early, late):
                assert isinstance(done.error, gl.OutcomeUnknown) and done.error.code == "TIMEOUT"
            assert ["cancelled:a" in impl.probe, "cancelled:b" in impl.probe] == [False, True]
            assert "cancelled:c" in impl.probe
            assert pair.rpc.statistics().pending_calls == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (b"\x43abc", b"abc"),  # a byte string: read from the envelope's bytes
        (b"\x58\x03abc", b"abc"),  # with a longer head than it needs
        (b"\x59\x00\x00", b""),
        (b"\x5f\x41a\x42bc\xff", b"abc"),  # indefinite: decoded as usual
        (b"\x18\x05", 5),  # not a byte string: decoded as usual
        (b"\x82\x01\x41z", [1, b"z"]),
    ],
)
async def test_a_relayed_call_s_result_reads_as_its_decode_would(
    value: bytes, expected: object, anyio_backend: str
) -> None:
    """``call_relayed``'s reply whose value is a byte string is taken from the envelope's bytes
    without decoding it: the same value as the decode gives, any other decoded as usual."""
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"calc": impl}) as pair:
            async with anyio.create_task_group() as tg:
                got: list[object] = []

                async def call() -> None:
                    got.append(
                        await pair.rpc.call_relayed("calc", "hold", arguments("k"), timeout=5)
                    )

                tg.start_soon(call)
                await impl.probe.wait("started:k")
                (call_id,) = pair.rpc.pending_call_ids()
                await raw_send(pair.worker_rpc, b"\x83\x01" + cbor2.dumps(call_id) + value)
            impl._release("k")
            assert got == [expected]
            assert pair.rpc.statistics().pending_calls == 0
