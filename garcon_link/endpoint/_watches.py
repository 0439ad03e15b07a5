"""The transport's watches: replay inactivity and the detached grace (one :class:`Watches`).

* **Replay inactivity**: while one attachment's replay is unfinished
  (:class:`~garcon_link.core.replay.ReplayWatch`, in :attr:`Shared.replay
  <garcon_link.endpoint._shared.Shared>`), the session is retired with ``REPLAY_STALLED`` once
  ``replay_inactivity`` passes with no progress. Time the reader spends waiting for our own
  consumer is not the peer's inactivity: such a wait (:mod:`._delivery`) is bracketed with
  :meth:`pause` and :meth:`resume`, no stall is judged meanwhile, and the clock starts afresh
  when it ends.
* **Grace**: a detached session is retired with ``GRACE_EXPIRED`` at the session's deadline
  (``detached_grace`` after the detach).

On asyncio both are loop timers (no task, no task switch per attachment); elsewhere (trio) each
is a task. Either way they decide nothing themselves: the deadlines are the replay watch's and
the session's, and a stall or an expiry is reported to the owner (``retire``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import anyio

from ..errors import FailureReason
from ..net.backend import on_asyncio
from ._shared import Shared

__all__ = ["Watches"]


class Watches:
    """The replay and grace watches of one transport.

    Args:
        shared: the state the transport's parts share.
        task_group: where the grace task runs (trio); normally the link's.
        retire: the owner's ``retire(reason, detail)``, held weakly (see
            :func:`~garcon_link.endpoint._shared.weak_method`).
    """

    def __init__(
        self,
        shared: Shared,
        task_group: anyio.abc.TaskGroup,
        retire: Callable[[FailureReason, str], None],
    ) -> None:
        self._shared = shared
        self._session = shared.session
        self._tg = task_group
        self._retire = retire
        self._inactivity = shared.limits.replay_inactivity
        self._grace_scope: anyio.CancelScope | None = None
        self._replay_done = anyio.Event()  # set once the replay is done: wakes _watch_replay
        # Set while the reader waits for our own consumer (see pause).
        self._consumer_wait: anyio.Event | None = None
        # On asyncio the replay and grace watches are loop timers, not tasks: the loop (None
        # elsewhere), the timers while armed, and whether the replay timer fired while our own
        # consumer held the reader up (it is armed again when that wait ends).
        self._loop = asyncio.get_running_loop() if on_asyncio() else None
        self._replay_timer: asyncio.TimerHandle | None = None
        self._replay_parked = False
        self._grace_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the owner's calls

    def attached(self) -> None:
        """A socket attaches: the grace watch ends, a new replay is watched (the owner has
        put a fresh :class:`~garcon_link.core.replay.ReplayWatch` in ``shared.replay``)."""
        if self._grace_scope is not None:
            self._grace_scope.cancel()
            self._grace_scope = None
        self._cancel_grace_timer()
        self._replay_done = anyio.Event()

    def watch_replay(self, task_group: anyio.abc.TaskGroup) -> anyio.CancelScope | None:
        """Start watching the replay of the attachment whose pumps run in ``task_group``: a loop
        timer on asyncio (``None`` returned), else a task, which ends when the returned scope
        (shielded from the run's) is cancelled."""
        if self._loop is not None:
            self._arm_replay_timer()
            return None
        watching = anyio.CancelScope(shield=True)
        task_group.start_soon(self._replay_watch, watching)
        return watching

    def replay_finished(self) -> None:
        """The replay watch reported the replay done (its ``observe``): the watch ends."""
        self._replay_done.set()

    def detached(self) -> None:
        """The socket is gone: the replay watch ends."""
        self._cancel_replay_timer()

    def watch_grace(self, retire: Callable[[FailureReason, str], object]) -> None:
        """The session is detached (and lives on): the grace watch starts. ``retire``: the
        owner's, held by the timer or task until the watch ends (what keeps a detached
        transport alive through its grace, as the socket's pumps do while attached)."""
        loop = self._loop
        if loop is None:
            self._tg.start_soon(self._grace_watch, retire)
            return
        deadline = self._session.next_deadline()
        if deadline is not None:  # (anyio's clock on asyncio is the loop's)
            self._grace_timer = loop.call_at(deadline, self._grace_timer_fired, retire)

    def retire(self) -> None:
        """The session is retired: nothing is watched any more."""
        self._shared.replay.stop()
        self._replay_done.set()
        self._cancel_replay_timer()
        self._cancel_grace_timer()
        if self._grace_scope is not None:
            self._grace_scope.cancel()

    # ------------------------------------------------------------------ the reader's waits

    def pause(self) -> anyio.Event:
        """The reader starts waiting for our own consumer: no stall is judged until
        :meth:`resume`."""
        waiting = self._consumer_wait = anyio.Event()
        return waiting

    def resume(self, waiting: anyio.Event) -> None:
        """The wait :meth:`pause` began ended: the replay inactivity clock starts afresh."""
        self._consumer_wait = None
        self._shared.replay.restart(anyio.current_time())
        waiting.set()
        if self._replay_parked:
            self._replay_parked = False
            if self._shared.scope is not None and not self._shared.replay.done:
                self._arm_replay_timer()

    # ------------------------------------------------------------------ replay

    async def _replay_watch(self, watching: anyio.CancelScope) -> None:
        with watching:
            await self._watch_replay()

    def _arm_replay_timer(self) -> None:
        """The replay watch on asyncio: a loop timer at the replay's deadline (see
        :meth:`_replay_timer_fired`)."""
        assert self._loop is not None
        self._replay_timer = self._loop.call_at(
            self._shared.replay.deadline, self._replay_timer_fired
        )

    def _replay_timer_fired(self) -> None:
        """As :meth:`_watch_replay`, in a loop callback: nothing once the replay is done or the
        socket detached; armed again while the deadline moved on with progress; parked while our
        own consumer holds the reader up (:meth:`resume` arms it again when that wait ends, with
        the clock restarted); else the replay stalled and the session retires."""
        self._replay_timer = None
        replay = self._shared.replay
        if replay.done or self._shared.scope is None:
            return
        assert self._loop is not None
        if replay.deadline > self._loop.time():
            self._arm_replay_timer()
        elif self._consumer_wait is not None:
            self._replay_parked = True
        else:
            inactivity = self._inactivity
            self._retire(FailureReason.REPLAY_STALLED, f"no replay progress for {inactivity:g}s")

    def _cancel_replay_timer(self) -> None:
        self._replay_parked = False
        timer, self._replay_timer = self._replay_timer, None
        if timer is not None:
            timer.cancel()

    async def _watch_replay(self) -> None:
        inactivity = self._inactivity
        while not self._replay_done.is_set():
            remaining = self._shared.replay.deadline - anyio.current_time()
            if remaining <= 0:
                waiting = self._consumer_wait
                if waiting is not None:
                    # The reader is held up by our own slow consumer: that is back-pressure,
                    # not a stalled peer. The clock restarts when the consumer catches up.
                    await waiting.wait()
                    continue
                self._retire(
                    FailureReason.REPLAY_STALLED, f"no replay progress for {inactivity:g}s"
                )
                return
            with anyio.move_on_after(remaining):
                await self._replay_done.wait()

    # ------------------------------------------------------------------ grace

    def _grace_timer_fired(self, retire: Callable[[FailureReason, str], object]) -> None:
        """The grace watch on asyncio (a loop callback): as :meth:`_grace_watch` at its
        deadline."""
        self._grace_timer = None
        assert self._loop is not None
        failure = self._session.poll(self._loop.time())
        if failure is not None:
            retire(failure.reason, "")

    def _cancel_grace_timer(self) -> None:
        timer, self._grace_timer = self._grace_timer, None
        if timer is not None:
            timer.cancel()

    async def _grace_watch(self, retire: Callable[[FailureReason, str], object]) -> None:
        with anyio.CancelScope() as scope:
            self._grace_scope = scope
            deadline = self._session.next_deadline()
            if deadline is None:
                return
            await anyio.sleep_until(deadline)
            failure = self._session.poll(anyio.current_time())
            if failure is not None:
                retire(failure.reason, "")
        if self._grace_scope is scope:
            self._grace_scope = None
