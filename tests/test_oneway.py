"""One-way calls (``gl.oneway``, notifications) refused at the worker by the method's contract.

The caller checks its arguments before sending, but a peer with another interface, another
language or a relay in between can still send a notification whose arguments fail the worker's
checks (types, msgspec ``Meta`` constraints). No reply tells the caller, so the worker counts
each (``ExecutorStatistics.oneway_refused``, and in ``calls.server`` as a refused call) and logs
it, at most once per ``log_interval``.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import anyio
import msgspec
import pytest
from linkutil import wait_until
from rpcutil import LIMITS, Direction, both_directions, open_pair, raw_send

import garcon_link as gl
from garcon_link.rpc.rpc import NOTIFY

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 20


class Sink:
    def __init__(self) -> None:
        self.got: list[Any] = []
        self.done = anyio.Event()

    @gl.oneway
    async def put(self, n: Annotated[int, msgspec.Meta(ge=0)], label: str = "") -> None:
        self.got.append((n, label))
        self.done.set()


# Each fails the contract of Sink.put: a constraint, a type, a missing or unknown argument.
_BAD: list[tuple[list[Any], dict[str, Any]]] = [
    ([-1], {}),
    (["1"], {}),
    ([1.5], {}),
    ([True], {}),
    ([1], {"label": 2}),
    ([], {}),
    ([1], {"nope": 1}),
]


@both_directions
async def test_a_refused_one_way_call_is_counted_and_logged_once_per_interval(
    direction: Direction, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="garcon_link")
    sink = Sink()
    rounds = 3
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"sink": sink}) as pair:
            worker = pair.live_worker
            assert worker.statistics().oneway_refused == 0
            for _ in range(rounds):
                for args, kwargs in _BAD:
                    await raw_send(pair.rpc, [NOTIFY, "sink", "put", args, kwargs])
            # A good one behind them, in order: when it has run, every bad one was handled.
            await pair.rpc.notify("sink", _put_spec(), (7,), {})
            await wait_until(lambda: sink.done.is_set())
            stats = worker.statistics()
    assert sink.got == [(7, "")]
    refused = rounds * len(_BAD)
    assert stats.oneway_refused == refused
    assert stats.calls.server.get(("rejected", "INVALID_ARGUMENTS")) == refused
    assert stats.calls.total("server", "ok") == 1
    lines = [r for r in caplog.records if "refusing one-way call" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # one per log_interval (60 s)
    assert lines[0].levelno == logging.WARNING
    assert "'sink'.'put'" in lines[0].getMessage()


async def test_an_unknown_one_way_method_is_dropped_not_refused() -> None:
    """A notification naming no method served here is dropped as before
    (``notifications_dropped``), not counted as a refusal by a contract."""
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"sink": Sink()}) as pair:
            await raw_send(pair.rpc, [NOTIFY, "sink", "nope", [1], {}])
            await raw_send(pair.rpc, [NOTIFY, "nosuch", "put", [1], {}])
            await wait_until(lambda: pair.worker_rpc.statistics().notifications_dropped == 2)
            assert pair.live_worker.statistics().oneway_refused == 0


def _put_spec() -> Any:
    from garcon_link.rpc.interface import service_spec

    return service_spec(Sink).methods["put"]


assert LIMITS.log_interval >= 60  # the test above relies on one line per interval
