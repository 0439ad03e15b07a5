"""The listener's per-turn budget of handshake steps (``Limits.handshake_steps_per_turn``).

Counted in steps and arrivals, never timed: sockets that are mid-handshake all at once must not
hold up a session that is already attached, and the line of waiting steps is bounded.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest
from faultutil import OP_BINARY, upgrade_request, ws_frame
from linkutil import link_pair, small_limits, wait_until

import garcon_link as gl
from garcon_link.net.ws import LinkStatistics, TurnBudget
from garcon_link.settings.secrets import read_secret_file, write_secret_file

pytestmark = pytest.mark.anyio

DEADLINE = 20.0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the budget orders asyncio's loop turns (elsewhere a step runs at once)


@contextlib.contextmanager
def raw_sockets(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` plain non-blocking TCP sockets to the listener (connected, nothing sent)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port))
            s.setblocking(False)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


async def read_101(s: socket.socket) -> None:
    """Read the listener's answer to our upgrade request, up to the end of its head."""
    head = b""
    while b"\r\n\r\n" not in head:
        await anyio.wait_readable(s)
        chunk = s.recv(4096)
        assert chunk, "the listener closed instead of answering the upgrade"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head[:40]


async def test_steps_are_let_through_per_turn_in_arrival_order() -> None:
    """Ten steps asked at once with a budget of two: two per loop turn, in the order asked."""
    stats = LinkStatistics()
    budget = TurnBudget(2, stats)
    turn = 0
    ran: list[tuple[int, int]] = []  # (step, turn it ran in)
    ticking = True

    async def ticker() -> None:
        nonlocal turn
        while ticking:  # one increment per loop turn (sleep(0) is one turn)
            turn += 1
            await anyio.sleep(0)

    async def one(i: int) -> None:
        await budget.step()
        ran.append((i, turn))

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for i in range(10):
                tg.start_soon(one, i)
            while len(ran) < 10:
                await anyio.sleep(0)
            ticking = False
    assert [i for i, _ in ran] == list(range(10))
    per_turn: dict[int, int] = {}
    for _, t in ran:
        per_turn[t] = per_turn.get(t, 0) + 1
    assert max(per_turn.values()) <= 2, per_turn
    assert len(per_turn) >= 5, per_turn
    assert stats.handshake_steps_deferred == 8  # all but the first two waited past a turn
    assert stats.handshake_steps_waiting == 0


async def test_a_step_that_waited_max_wait_is_let_through_regardless_of_the_budget() -> None:
    """With ``max_wait=0`` every step in line is overdue at the next turn: all ten run in the
    same turn (a starved process must not make handshakes outlast their deadline)."""
    budget = TurnBudget(1, LinkStatistics(), max_wait=0.0)
    turn = 0
    ran: list[int] = []
    ticking = True

    async def ticker() -> None:
        nonlocal turn
        while ticking:
            turn += 1
            await anyio.sleep(0)

    async def one() -> None:
        await budget.step()
        ran.append(turn)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for _ in range(10):
                tg.start_soon(one)
            while len(ran) < 10:
                await anyio.sleep(0)
            ticking = False
    assert len(set(ran)) == 1, ran


async def test_a_cancelled_step_leaves_the_line() -> None:
    stats = LinkStatistics()
    budget = TurnBudget(1, stats)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                tg.start_soon(budget.step)
                tg.start_soon(budget.step)
                scope.cancel()
            with anyio.move_on_after(0) as gone:
                await budget.step()  # cancelled while waiting (its deadline is now)
            assert gone.cancelled_caught
            await budget.step()  # the line moves on without it
    assert stats.handshake_steps_waiting == 0


async def test_an_attached_session_is_served_before_a_burst_of_handshakes_is() -> None:
    """``burst`` upgraded sockets send a broken hello at once (each fails the handshake when
    its step runs), then the attached session delivers a few messages one after the other. With
    one step per turn they have arrived when only a few of the hellos were handled; without the
    budget every hello is handled in the turn after they arrived, before the second message."""
    burst, rounds = 40, 4
    limits = small_limits(
        handshake_steps_per_turn=1, max_unauthenticated_sockets=64, handshake_timeout=10.0
    )
    with anyio.fail_after(DEADLINE):
        async with link_pair("worker-dials", limits) as pair:
            listening, dialing = await pair.wait_ready()
            link = pair.listener.link

            def failed() -> int:
                return sum(link.statistics().handshakes_failed.values())

            at_arrival: list[int] = []
            arrived = anyio.Event()

            class Recording(list[bytes]):
                def append(self, item: bytes) -> None:
                    at_arrival.append(failed())
                    arrived.set()
                    super().append(item)

            listening.received = Recording()
            with raw_sockets(link.listen_address[1], burst) as socks:
                for s in socks:
                    s.sendall(upgrade_request())
                for s in socks:
                    await read_101(s)
                before = failed()
                hello = ws_frame(OP_BINARY, b"\xff not a hello")
                for s in socks:  # no await between these writes and the message below
                    s.sendall(hello)
                for i in range(rounds):  # each message once the previous one arrived
                    arrived = anyio.Event()
                    await dialing.transport.send(b"attached %d" % i)
                    await arrived.wait()
                await wait_until(lambda: failed() == before + burst, 10.0, "every broken hello")
    assert at_arrival[-1] - before < burst // 2, (at_arrival, before)
    assert link.statistics().handshake_steps_deferred >= burst // 2
    assert link.statistics().handshakes_failed.get("MALFORMED", 0) >= burst


async def test_the_line_is_bounded_by_the_unauthenticated_cap() -> None:
    """More sockets than ``max_unauthenticated_sockets`` upgrade at once: the oldest are
    evicted (counted), the line never holds more than the cap, and it empties."""
    cap, extra = 8, 4
    limits = small_limits(
        handshake_steps_per_turn=1, max_unauthenticated_sockets=cap, handshake_timeout=10.0
    )
    with anyio.fail_after(DEADLINE):
        async with link_pair("worker-dials", limits) as pair:
            await pair.wait_ready()
            link = pair.listener.link
            waiting: list[int] = []
            with raw_sockets(link.listen_address[1], cap + extra) as socks:
                for s in socks:
                    s.sendall(upgrade_request())
                for _ in range(200):  # bounded: every socket upgraded or evicted by then
                    waiting.append(link.statistics().handshake_steps_waiting)
                    await anyio.sleep(0)
                await wait_until(
                    lambda: link.statistics().evicted_unauthenticated == extra,
                    5.0,
                    "the oldest sockets evicted",
                )
                await wait_until(
                    lambda: link.statistics().handshake_steps_waiting == 0, 5.0, "an empty line"
                )
            assert max(waiting) <= cap, waiting
            assert link.statistics().evicted_unauthenticated == extra


async def test_what_a_socket_woke_in_a_turn_runs_ahead_of_the_step_let_through_then() -> None:
    """One step a turn goes through while bytes arrive on an established socket: the task its
    read woke (an attached session's reader) runs before the step let through in that turn."""
    import asyncio

    loop = asyncio.get_running_loop()
    budget = TurnBudget(1, LinkStatistics())
    order: list[str] = []
    a, b = socket.socketpair()
    a.setblocking(False)
    readable: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:  # the socket's callback in the loop turn its bytes arrive
        loop.remove_reader(a)
        order.append("read")
        readable.set_result(None)

    async def reader() -> None:
        await readable
        order.append("reader")

    async def step() -> None:
        await budget.step()
        order.append("step")

    loop.add_reader(a, on_readable)
    try:
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                for _ in range(8):
                    tg.start_soon(step)
                while order.count("step") < 2:  # steps go through one a turn
                    await anyio.sleep(0)
                b.send(b"x")
    finally:
        loop.remove_reader(a)
        a.close()
        b.close()
    assert order.count("step") == 8
    after = order.index("read") + 1
    assert order[after] == "reader", order


async def test_steps_are_let_through_by_their_measured_cost() -> None:
    """Eight steps a turn at most and three units of time a turn, each step costing one unit
    (an injected clock): the first turn lets eight through, unmeasured; every later one three."""
    now = [0.0]
    stats = LinkStatistics()
    budget = TurnBudget(8, stats, seconds_per_turn=3.0, clock=lambda: now[0])
    turn = 0
    ran: list[int] = []  # the turn each step ran in
    ticking = True

    async def ticker() -> None:
        nonlocal turn
        while ticking:
            turn += 1
            await anyio.sleep(0)

    async def one() -> None:
        await budget.step()
        ran.append(turn)
        now[0] += 1.0  # this step's work

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for _ in range(26):
                tg.start_soon(one)
            while len(ran) < 26:
                await anyio.sleep(0)
            ticking = False
    per_turn = [ran.count(t) for t in sorted(set(ran))]
    assert per_turn == [8, 3, 3, 3, 3, 3, 3], per_turn
    assert budget.allowance == 3
    assert stats.handshake_steps_deferred == 26 - 8
    assert stats.handshake_steps_waiting == 0


async def test_a_burst_of_lost_sockets_is_torn_down_a_few_per_turn(tmp_path: Path) -> None:
    """Eight executors' sockets are cut in one turn: their teardowns wait in a line of their
    own (one step a turn here; two steps a socket, its end and then its close), counted apart
    from handshakes; every session resumes and the line empties."""
    count = 8
    limits = small_limits(handshake_steps_per_turn=1, handshake_timeout=10.0)
    keyring = tmp_path / "keys"
    keyring.mkdir(mode=0o700)
    ids = [f"box-{i}" for i in range(count)]
    secrets = {i: read_secret_file(write_secret_file(keyring / f"{i}.secret")) for i in ids}
    config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=keyring, limits=limits)
    with anyio.fail_after(DEADLINE):
        async with gl.fleet(config) as fleet, AsyncExitStack() as stack:
            workers = [
                await stack.enter_async_context(
                    gl.Worker(
                        gl.LinkConfig(
                            executor_id=i,
                            role=gl.Role.WORKER,
                            secret=secrets[i],
                            dial=fleet.url,
                            limits=limits,
                        ),
                        {},
                    )
                )
                for i in ids
            ]
            for i in ids:
                await fleet.executor(i).wait_ready(10)
            before = fleet.statistics()
            async with anyio.create_task_group() as tg:
                for w in workers:  # all in one turn
                    tg.start_soon(w.link.disconnect)
            await wait_until(
                lambda: fleet.statistics().resumed == before.resumed + count,
                10.0,
                "every session resumed",
            )
            after = fleet.statistics()
    # Two teardown steps a socket (its end, then its close), one a turn.
    assert after.teardowns_deferred - before.teardowns_deferred >= count + count // 2, after
    assert after.teardowns_waiting == 0
    assert after.handshake_steps_deferred >= before.handshake_steps_deferred


async def test_an_upgrade_is_two_steps_its_parse_in_the_line() -> None:
    """``burst`` accepted sockets send their upgrade requests at once, one step a turn: each
    request is read, then parsed in a step of its own (h11's scan of the head), then checked
    and answered in a second one, so nearly all of the 2 x ``burst`` steps wait past a turn (with
    the parse outside the line there would be ``burst`` steps, at most ``burst - 1`` deferred)."""
    burst = 12
    limits = small_limits(
        handshake_steps_per_turn=1, max_unauthenticated_sockets=64, handshake_timeout=10.0
    )
    with anyio.fail_after(DEADLINE):
        async with link_pair("worker-dials", limits) as pair:
            await pair.wait_ready()
            link = pair.listener.link
            before = link.statistics()
            with raw_sockets(link.listen_address[1], burst) as socks:
                await wait_until(
                    lambda: link.statistics().connections == before.connections + burst,
                    5.0,
                    "every socket accepted",
                )
                for s in socks:  # no await between these writes: read in one turn
                    s.sendall(upgrade_request())
                for s in socks:
                    await read_101(s)
            deferred = link.statistics().handshake_steps_deferred - before.handshake_steps_deferred
    assert deferred >= burst + burst // 2, deferred


class _CpuClock:
    """A thread-CPU clock for :class:`TurnBudget`: while ``busy`` (a loop kept busy by other
    work) it runs with the wall clock, the thread always on the CPU; idle, it stands still."""

    def __init__(self) -> None:
        self._frozen: float | None = None

    @property
    def busy(self) -> bool:
        return self._frozen is None

    @busy.setter
    def busy(self, busy: bool) -> None:
        self._frozen = None if busy else time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() if self._frozen is None else self._frozen


@contextlib.asynccontextmanager
async def asked_steps(
    budget: TurnBudget, count: int = 3
) -> AsyncIterator[tuple[list[int], Callable[[int], None]]]:
    """``count`` steps asked of ``budget`` at once; yields the list of those that ran, in
    order, and a function that asks one more (numbered by its argument)."""
    ran: list[int] = []

    async def one(i: int) -> None:
        await budget.step()
        ran.append(i)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:

            def ask(i: int) -> None:
                tg.start_soon(one, i)

            for i in range(count):
                ask(i)
            yield ran, ask


async def test_a_busy_loop_holds_the_line_until_its_share_is_back() -> None:
    """``busy_share``: while other work keeps the loop's thread on the CPU, steps waiting in line
    are not let through turn after turn; once the loop is idle again they are."""
    clock = _CpuClock()
    stats = LinkStatistics()
    async with asked_steps(TurnBudget(1, stats, busy_share=0.5, clock=clock)) as (ran, _):
        await wait_until(lambda: ran == [0])
        for _ in range(50):  # turns (sleep(0) is one): the busy loop holds the others
            await anyio.sleep(0)
        assert ran == [0], ran
        assert stats.handshake_steps_waiting == 2
        clock.busy = False  # the loop goes idle: its share comes back, the line moves
        await wait_until(lambda: ran == [0, 1, 2])


async def test_a_busy_loop_never_holds_a_lone_step() -> None:
    """A step alone in line (one executor reconnecting) goes through at the next turn however
    busy the loop is: only a crowd of handshakes waits for the loop's share."""
    clock = _CpuClock()
    budget = TurnBudget(1, LinkStatistics(), busy_share=0.5, clock=clock)
    for _ in range(5):
        turns = 0
        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                done = anyio.Event()

                async def one(done: anyio.Event) -> None:
                    await budget.step()
                    done.set()

                tg.start_soon(one, done)
                while not done.is_set():
                    turns += 1
                    assert turns < 10, "a lone step was held"
                    await anyio.sleep(0)


async def test_a_held_line_still_lets_overdue_steps_through() -> None:
    """However busy the loop stays, no step waits past ``max_wait``."""
    clock = _CpuClock()
    budget = TurnBudget(1, LinkStatistics(), 0.02, busy_share=0.5, clock=clock)
    async with asked_steps(budget) as (ran, _):
        await wait_until(lambda: sorted(ran) == [0, 1, 2])
    assert clock.busy  # never idle: the steps went through by max_wait alone


async def test_the_line_knows_which_tasks_wait_in_it() -> None:
    """``waits(task)``: true while the task's step is in line, false once it is let through or
    cancelled; ``left`` is called each time a step leaves (the listener's accept loop looks
    again then)."""
    import asyncio

    left: list[int] = []
    clock = _CpuClock()  # busy: after the first step the line is held
    budget = TurnBudget(
        1, LinkStatistics(), busy_share=0.5, left=lambda: left.append(1), clock=clock
    )
    tasks: dict[int, asyncio.Task[object] | None] = {}
    ran: list[int] = []

    async def one(i: int) -> None:
        tasks[i] = asyncio.current_task()
        await budget.step()
        ran.append(i)

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(one, i)
            await wait_until(lambda: ran == [0] and len(tasks) == 4)
            assert [budget.waits(tasks[i]) for i in range(4)] == [False, True, True, True]
            assert len(left) == 1
            tg.cancel_scope.cancel()
    assert not any(budget.waits(t) for t in tasks.values())
    assert len(left) == 4  # the cancelled steps left too


async def test_a_held_line_moves_once_it_may_no_longer_be_held() -> None:
    """``may_hold`` (the listener: below seven eighths of its unauthenticated cap) ends the
    hold: a step asked while it says no moves the line at once."""
    clock = _CpuClock()
    hold = True
    budget = TurnBudget(1, LinkStatistics(), busy_share=0.5, may_hold=lambda: hold, clock=clock)
    async with asked_steps(budget, 3) as (ran, ask):
        await wait_until(lambda: ran == [0])
        for _ in range(50):  # the loop busy: held
            await anyio.sleep(0)
        assert ran == [0], ran
        hold = False
        ask(3)  # the line moves at once, one step a turn
        await wait_until(lambda: sorted(ran) == [0, 1, 2, 3])


async def test_past_the_cap_only_sockets_waiting_for_their_peer_are_evicted() -> None:
    """A line of eight held handshakes, then twelve more sockets at once, a cap of sixteen and
    no hello ever sent: every socket evicted had been answered (its 101, then nothing but the
    close) -- none was evicted while its step waited in the line; the newcomers waited in the
    kernel's backlog instead (``accepts_paused``) -- and sixteen remain, waiting for a hello."""
    cap, lined, more = 16, 8, 12
    limits = small_limits(
        handshake_steps_per_turn=1,
        max_unauthenticated_sockets=cap,
        handshake_timeout=60.0,  # max_wait 6 s: nothing overdue while the test runs
        handshake_busy_share=0.1,
    )
    spinning = True

    async def spin() -> None:  # keeps the loop's thread on the CPU: the line is held
        while spinning:
            end = time.thread_time() + 0.002
            while time.thread_time() < end:
                pass
            await anyio.sleep(0)

    with anyio.fail_after(DEADLINE):
        async with link_pair("worker-dials", limits) as pair:
            await pair.wait_ready()
            link = pair.listener.link
            before = link.statistics()
            port = link.listen_address[1]
            async with anyio.create_task_group() as tg:
                tg.start_soon(spin)
                with raw_sockets(port, lined) as first:
                    await wait_until(
                        lambda: link.statistics().connections == before.connections + lined,
                        10.0,
                        "the first sockets accepted",
                    )
                    for s in first:  # read in one turn: a line of eight, held
                        s.sendall(upgrade_request())
                    await wait_until(
                        lambda: link.statistics().handshake_steps_waiting == lined, 10.0, "line"
                    )
                    with raw_sockets(port, more) as rest:
                        for s in rest:
                            s.sendall(upgrade_request())
                        await wait_until(
                            lambda: (
                                link.statistics().evicted_unauthenticated
                                == before.evicted_unauthenticated + lined + more - cap
                            ),
                            10.0,
                            "all but the cap's worth evicted",
                        )
                        await wait_until(
                            lambda: link.statistics().handshake_steps_waiting == 0, 10.0, "none"
                        )
                        closed = 0
                        for s in first + rest:
                            await read_101(s)  # every one answered, the evicted ones too
                            try:
                                after = s.recv(4096)
                            except BlockingIOError:
                                continue  # still open: waiting for its hello
                            assert after == b"", after[:40]  # nothing after the 101 but the close
                            closed += 1
                        assert closed == lined + more - cap
                spinning = False
            assert link.statistics().accepts_paused > before.accepts_paused
