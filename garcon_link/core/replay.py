"""ReplayWatch: when one attachment's replay has finished, and when it has stalled (sans-IO).

Theory of operation
-------------------
When a socket attaches, each side replays what the other has not confirmed. The replay of one
attachment is *finished* once the peer's replay fence has passed and the peer has confirmed every
frame we had issued when the attachment began (the ``target``). Until then it must make
*progress*: a new inbound ordinal, or a receipt confirming more of our frames
(:attr:`~garcon_link.core.session.Received.progress`); heartbeats, duplicates and stale receipts
are not progress. ``Limits.replay_inactivity`` without progress is a stall (the transport retires
the session, ``REPLAY_STALLED``). Time the transport's reader spends waiting for our own slow
consumer is not the peer's inactivity: :meth:`ReplayWatch.restart` starts the clock afresh when
such a wait ends, and the transport judges no stall while one is under way.

States::

    WATCHING --observe(): fence passed and confirmed >= target--> DONE
    WATCHING --stop() (the session is retired)-----------------> DONE

It reads no clock: the time is passed in as ``now``.
"""

from __future__ import annotations

__all__ = ["ReplayWatch"]


class ReplayWatch:
    """The replay of one attachment: finished yet, and when it counts as stalled.

    Args:
        target: the highest ordinal we had issued when the attachment began.
        now: when the attachment began (the inactivity clock starts there).
        inactivity: ``Limits.replay_inactivity``.
    """

    __slots__ = ("_done", "_inactivity", "_progress_at", "_target")

    def __init__(self, target: int, now: float, inactivity: float) -> None:
        self._target = target
        self._progress_at = now
        self._inactivity = inactivity
        self._done = False

    @property
    def done(self) -> bool:
        """The replay finished (or the watch was stopped); never becomes ``False`` again."""
        return self._done

    @property
    def deadline(self) -> float:
        """When the replay counts as stalled unless it makes progress first."""
        return self._progress_at + self._inactivity

    def observe(self, progress: bool, *, fence_passed: bool, confirmed: int, now: float) -> bool:
        """Account for one inbound message once it was handed over.

        Args:
            progress: the message made replay progress (``Received.progress``).
            fence_passed: the peer's replay fence has passed on this attachment.
            confirmed: the highest of our ordinals the peer has confirmed.
            now: the current time.

        Returns:
            ``True`` if this call finished the replay (once); ``False`` otherwise, and always
            once done.
        """
        if self._done:
            return False
        if progress:
            self._progress_at = now
        if fence_passed and confirmed >= self._target:
            self._done = True
            return True
        return False

    def restart(self, now: float) -> None:
        """Our consumer stopped holding the reader at ``now``: the inactivity clock starts
        afresh."""
        self._progress_at = now

    def stop(self) -> None:
        """The session is retired: nothing is watched any more."""
        self._done = True
