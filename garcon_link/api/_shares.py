"""The callers' shares of the gateway's session to each executor: calls and streams in flight
per caller and executor, bounded so that one caller cannot fill an executor's session for the
others nor queue much of its work there ahead of theirs (the bounds: the docstring of
:mod:`.gateway`).

A caller's **share** of an executor (:meth:`Shares.share_of`) is its whole share
(``gateway_caller_share`` of ``max_pending_calls``) while it is the only caller active there,
else ``gateway_contended_window`` split evenly between the callers active there, a caller being
active until ``gateway_active_window`` after its last call or stream there ended. Each relayed
call or stream takes one unit of its caller's share (:meth:`Shares.take`; past it,
``NotDispatched("OVERLOADED")``, never forwarded) and gives it back when it ends
(:meth:`Shares.give`). A relayed stream keeps granted its executor a window of credit scaled by
its caller's share now (:meth:`Shares.stream_window`); while its caller is past a share that
shrank under it, it waits its turn, taking no item (:meth:`Shares.wait_turn`).

Bounded: the executors remembered (:data:`MAX_ACTIVE_EXECUTORS`, those where every caller went
idle forgotten first); per executor, the callers active there; per share, its streams open.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from ..errors import NotDispatched
from ..limits import Limits
from ..logs import peer_text

__all__ = ["MAX_ACTIVE_EXECUTORS", "Share", "Shares"]

MAX_ACTIVE_EXECUTORS = 4096
"""Executors whose callers the gateway remembers (:meth:`Shares.share_of`) before it forgets
those where every caller went idle."""

Share = tuple[str, str]
"""A caller's share of one executor: ``(caller, executor)``."""


class Shares:
    """The callers' shares of the gateway's executors (module docstring); one per gateway.

    ``now`` is the clock the per-call path reads (the gateway sets its loop's own, looked up
    once, on asyncio)."""

    __slots__ = ("_active", "_ended", "_in_flight", "_limits", "_streams", "now", "whole")

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self.whole = max(1, int(limits.max_pending_calls * limits.gateway_caller_share))
        """A caller's share of an executor while no other caller is active there."""
        # The loop's clock, looked up once (anyio.current_time looks up the backend per call).
        self.now: Callable[[], float] = anyio.current_time
        # (caller, executor) -> calls and streams in flight (only those above zero).
        self._in_flight: dict[Share, int] = {}
        # executor -> {caller: when its last call or stream there began or ended}: the callers
        # active on it (take); a caller's entry goes once it is idle past the window.
        self._active: dict[str, dict[str, float]] = {}
        # (caller, executor) -> its relayed streams there, in the order they opened (wait_turn).
        self._streams: dict[Share, dict[object, None]] = {}
        # executor -> set (and replaced) when a call or stream there ends (wait_turn).
        self._ended: dict[str, anyio.Event] = {}

    def in_flight(self) -> dict[str, int]:
        """Each caller's calls and streams in flight now, over every executor (statistics)."""
        out: dict[str, int] = {}
        for (caller, _executor), held in self._in_flight.items():
            out[caller] = out.get(caller, 0) + held
        return out

    def stream_opened(self, share: Share, token: object) -> None:
        """A relayed stream of ``share`` opened (its place in :meth:`wait_turn`'s order)."""
        self._streams.setdefault(share, {})[token] = None

    def stream_closed(self, share: Share, token: object) -> None:
        """The relayed stream ``token`` of ``share`` ended (its share is given back apart)."""
        opened = self._streams.get(share)
        if opened is not None:
            opened.pop(token, None)
            if not opened:
                del self._streams[share]

    def past(self, share: Share) -> bool:
        """Whether ``share``'s caller has more in flight to its executor than its share there
        now (:meth:`limit_now`): its streams then wait their turn (:meth:`wait_turn`)."""
        return self._in_flight.get(share, 0) > self.limit_now(share[1])

    def take(self, caller: str, executor: str) -> Share:
        """Count one more call or stream of ``caller`` in flight to ``executor``, within its
        share of the gateway's session to that executor (:meth:`share_of`), so one caller
        cannot fill it, nor queue much of its work there ahead of another caller's call."""
        share = (caller, executor)
        held = self._in_flight.get(share, 0)
        now = self.now()
        active = self._active.get(executor)
        if active is None:
            if len(self._active) >= MAX_ACTIVE_EXECUTORS:
                self._forget_idle(now)
            active = self._active[executor] = {}
        active[caller] = now
        limit = self.whole
        if len(active) > 1:
            self._forget_idle_callers(executor, active, now)
            limit = self._limit(len(active))
        if held >= limit:
            raise NotDispatched(
                "OVERLOADED",
                f"caller {caller!r} has {held} calls in flight to executor "
                f"{peer_text(executor)}, its share of the gateway's session to it now ({limit}: "
                f"gateway_caller_share of max_pending_calls while it is the only caller active "
                f"there, else gateway_contended_window split between the callers active "
                f"there); nothing was forwarded",
            )
        self._in_flight[share] = held + 1
        return share

    def give(self, share: Share) -> None:
        """One call or stream of ``share`` ended: its unit back, the streams waiting their turn
        at its executor woken."""
        held = self._in_flight.get(share, 0) - 1
        if held > 0:
            self._in_flight[share] = held
        else:
            self._in_flight.pop(share, None)
        active = self._active.get(share[1])
        if active is not None:
            active[share[0]] = self.now()
        if self._ended:  # a stream waits its turn somewhere
            ended = self._ended.pop(share[1], None)
            if ended is not None:
                ended.set()

    def stream_window(self, caller: str, executor: str) -> int:
        """The credit, in items, a relayed stream of ``caller``'s to ``executor`` keeps granted
        it, asked at each grant: ``gateway_stream_window_items`` scaled by the caller's share
        there now (:meth:`share_of`) over its whole share, at least 1. Alone, a stream keeps
        the whole window; beside other callers, a caller's streams together hold about as many
        items on the executor's session ahead of another caller's reply as its share holds
        calls (8 streams of 1 item by default, not of 8), and the window grows back once the
        others have gone idle."""
        share = self.share_of(caller, executor)
        return max(1, self._limits.gateway_stream_window_items * share // self.whole)

    def limit_now(self, executor: str) -> int:
        """A caller's share of ``executor`` now, counting every caller remembered active there
        (idle ones included until :meth:`take` or :meth:`wait_turn` forgets them)."""
        active = self._active.get(executor)
        return self._limit(len(active)) if active else self.whole

    async def wait_turn(self, share: Share, token: object) -> None:
        """Hold a relayed stream (no item taken from the executor, so no credit granted it)
        while its caller is past its share of the executor and this stream is not among the
        first of its streams there, in opening order, that the share covers: when another
        caller arrives, a caller's streams opened while it was alone go on a share's worth at a
        time. Rechecked as each call or stream there ends, and every ``gateway_active_window``
        (the other callers may have gone idle)."""
        executor = share[1]
        while True:
            now = anyio.current_time()
            active = self._active.get(executor)
            if active is not None:
                self._forget_idle_callers(executor, active, now)
            limit = self._limit(len(active)) if active else self.whole
            if self._in_flight.get(share, 0) <= limit:
                return
            streams = self._streams.get(share, {})
            for rank, other in enumerate(streams):
                if other is token:
                    return
                if rank + 1 >= limit:
                    break
            ended = self._ended.get(executor)
            if ended is None:
                ended = self._ended[executor] = anyio.Event()
            with anyio.move_on_after(self._limits.gateway_active_window):
                await ended.wait()

    def _limit(self, active: int) -> int:
        """One caller's share of an executor's session while ``active`` callers are active
        there (:meth:`share_of`)."""
        if active <= 1:
            return self.whole
        return min(self.whole, max(1, self._limits.gateway_contended_window // active))

    def _idle(self, caller: str, executor: str, seen: float, now: float) -> bool:
        return (
            now - seen > self._limits.gateway_active_window
            and (caller, executor) not in self._in_flight
        )

    def _forget_idle_callers(self, executor: str, active: dict[str, float], now: float) -> None:
        for caller, seen in list(active.items()):
            if self._idle(caller, executor, seen, now):
                del active[caller]

    def _forget_idle(self, now: float) -> None:
        """Drop the executors where every caller went idle (``_active`` stays bounded: the
        executors are the fleet's members, and their idle entries go here)."""
        for executor, active in list(self._active.items()):
            self._forget_idle_callers(executor, active, now)
            if not active:
                del self._active[executor]

    def share_of(self, caller: str, executor: str) -> int:
        """How many calls and streams ``caller`` may have in flight to ``executor`` now: its
        whole share (``gateway_caller_share`` of ``max_pending_calls``) while no other caller is
        active there (one with a call or stream in flight there, or one ended within
        ``gateway_active_window``); else ``gateway_contended_window`` divided by the number of
        callers active there, itself included, at least one. Past it, its next call there is
        ``NotDispatched("OVERLOADED")``, never forwarded."""
        now = anyio.current_time()
        active = self._active.get(executor, {})
        others = sum(
            1
            for c, seen in active.items()
            if c != caller and not self._idle(c, executor, seen, now)
        )
        return self._limit(1 + others)
