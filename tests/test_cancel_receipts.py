"""Cancel receipts: the worker answers a ``cancel`` with what happened,
and a timed-out caller's outcome says so (see the module docstring of ``garcon_link.rpc.rpc``).

Each answer is produced deterministically, on facts, not on timing races:

* **not started** -- the worker is made to receive the call only together with its cancel (a
  hook on its dispatch holds the ``call`` envelope back until the ``cancel`` arrives, as a
  congested link would), so the handler is cancelled before it starts: ``NotDispatched
  ("TIMEOUT")`` and the handler never ran;
* **cancelled** -- the handler runs (a probe says so) and blocks on an event until the timeout's
  cancel interrupts it: ``OutcomeUnknown("TIMEOUT")`` saying it was cancelled while running;
* **completed** -- the handler shields itself and is released only once the worker has seen the
  cancel, so it completes *after* the caller's timeout: the caller gets the real result;
* **no answer** within ``Limits.cancel_grace`` (what an old worker does for an interrupted
  handler) -- today's ``OutcomeUnknown("TIMEOUT")``.

The timeouts are short configured bounds (the call's own deadline); what is asserted never
depends on how long anything took.
"""

from __future__ import annotations

from typing import Protocol

import anyio
import pytest
from rpcutil import LIMITS, CalcImpl, Direction, Pair, both_directions, open_pair

import garcon_link as gl
from garcon_link.rpc.envelopes import Call, Cancel
from garcon_link.rpc.rpc import ExecutorRpc

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10.0
TIMEOUT = 0.3  # the calls' own deadline: the handler has started long before it


class Stubborn(Protocol):
    async def finish(self) -> str: ...


class StubbornImpl:
    """A handler that finishes even when cancelled (it shields itself)."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.release = anyio.Event()
        self.finished = 0

    async def finish(self) -> str:
        self.started.set()
        with anyio.CancelScope(shield=True):
            await self.release.wait()
        self.finished += 1
        return "finished"


def _worker_rpc(pair: Pair) -> ExecutorRpc:
    return pair.worker_rpc


def _on_cancel_seen(rpc: ExecutorRpc) -> anyio.Event:
    """An event set once the worker has handled a ``cancel`` (after the real handling).

    It wraps the private handler on purpose: no public statistic says *when* a cancel was
    handled, and these tests order a cancel against a handler's start at that exact point.
    """
    seen = anyio.Event()
    handle = rpc._on_cancel

    def on_cancel(envelope: Cancel) -> None:
        handle(envelope)
        seen.set()

    rpc._on_cancel = on_cancel
    return seen


@both_directions
async def test_cancelled_before_it_started_is_not_dispatched(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            rpc = _worker_rpc(pair)
            held_back: list[Call] = []
            # The private handlers are driven on purpose: the test delivers a call and its cancel
            # in one dispatch turn (the race a public API cannot produce on demand).
            on_call, on_cancel = rpc._on_call, rpc._on_cancel

            def hold_back(envelope: Call) -> None:
                if envelope.method == "hold":
                    held_back.append(envelope)  # arrives with its cancel, below
                else:
                    on_call(envelope)

            def deliver_with_cancel(envelope: Cancel) -> None:
                for call in held_back:
                    on_call(call)  # its handler task exists but has not run yet...
                held_back.clear()
                on_cancel(envelope)  # ...when the cancel is handled

            rpc._on_call = hold_back
            rpc._on_cancel = deliver_with_cancel

            calc = gl.with_options(pair.calc(), timeout=TIMEOUT)
            with pytest.raises(gl.NotDispatched) as info:
                await calc.hold("n")
            assert info.value.code == "TIMEOUT"
            assert "before it started" in info.value.message
            assert impl.counts["n"] == 0 and "started:n" not in impl.probe  # never ran
            assert await calc.add(1, 2) == 3


@both_directions
async def test_cancelled_while_running_is_outcome_unknown(direction: Direction) -> None:
    impl = CalcImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"calc": impl}) as pair:
            calc = gl.with_options(pair.calc(), timeout=TIMEOUT)
            with pytest.raises(gl.OutcomeUnknown) as info:
                await calc.hold("r")
            assert info.value.code == "TIMEOUT"
            assert "cancelled while running" in info.value.message  # the receipt, not silence
            assert "cancelled:r" in impl.probe  # already: the receipt followed the cancellation
            assert impl.counts["r"] == 1
            assert pair.executor.statistics().pending_calls == 0


@both_directions
async def test_completed_after_the_timeout_delivers_the_result(direction: Direction) -> None:
    impl = StubbornImpl()
    limits = LIMITS.replace(cancel_grace=DEADLINE)  # the answer comes as soon as it is released
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"stubborn": gl.Service(impl, Stubborn)}, limits=limits
        ) as pair:
            cancel_seen = _on_cancel_seen(_worker_rpc(pair))
            stubborn = gl.with_options(pair.executor.service("stubborn", Stubborn), timeout=TIMEOUT)
            async with anyio.create_task_group() as tg:
                result: list[str] = []

                async def call() -> None:
                    result.append(await stubborn.finish())

                tg.start_soon(call)
                await impl.started.wait()
                await cancel_seen.wait()  # the caller timed out and its cancel reached the worker
                assert impl.finished == 0
                impl.release.set()  # it completes anyway
            assert result == ["finished"]  # delivered, not OutcomeUnknown("TIMEOUT")
            assert impl.finished == 1


@both_directions
async def test_no_answer_within_the_grace_is_outcome_unknown(direction: Direction) -> None:
    impl = StubbornImpl()
    limits = LIMITS.replace(cancel_grace=0.2)
    with anyio.fail_after(DEADLINE):
        async with open_pair(
            direction, {"stubborn": gl.Service(impl, Stubborn)}, limits=limits
        ) as pair:
            stubborn = gl.with_options(pair.executor.service("stubborn", Stubborn), timeout=TIMEOUT)
            with pytest.raises(gl.OutcomeUnknown) as info:
                await stubborn.finish()  # still shielded when the grace is over
            assert info.value.code == "TIMEOUT"
            assert info.value.message.endswith("cancel sent")
            assert pair.executor.statistics().pending_calls == 0
            impl.release.set()  # its late result is dropped; the session goes on
            assert await stubborn.finish() == "finished"
