"""A link's latest failure, and the one mapping of an exception nobody expected while serving
one peer (docs/design.md#link).

Every part of the link that serves a peer -- the listener, the dial loop, the handshake, an
attached socket's pump -- reports here: :meth:`Failures.note` keeps a cause as the link's
``last_error``; :meth:`Failures.peer_failed` maps an unexpected exception to that peer's failure,
never the listener's, the dial loop's or the process's. The parts hold this object's methods,
not the link's.
"""

from __future__ import annotations

from ..logs import PeerLogLimiter, log_fields, peer_host, peer_text
from ..net.ws import LinkStatistics, one_line

__all__ = ["Failures"]


class Failures:
    """A link's latest failure and its mapping of unexpected exceptions.

    Args:
        stats: the link's counters (``unexpected_errors``).
        peer_log: the rate limiter of authenticated peers' log lines.
        tag: the link's log prefix.
        executor_id: the executor the link serves (log fields), if one.
    """

    __slots__ = ("_executor_id", "_peer_log", "_stats", "_tag", "last_error")

    def __init__(
        self, stats: LinkStatistics, peer_log: PeerLogLimiter, *, tag: str, executor_id: str | None
    ) -> None:
        self._stats = stats
        self._peer_log = peer_log
        self._tag = tag
        self._executor_id = executor_id
        self.last_error: str | None = None
        """The latest failure's cause, one line (``None`` until one)."""

    def note(self, why: str) -> None:
        """Keep ``why`` as the latest failure's cause."""
        self.last_error = why

    def peer_failed(self, peer: str, exc: Exception) -> str:
        """The one mapping of an exception nobody expected while serving one peer.

        Such an exception is a bug (here or in a library below) that the peer's bytes reached:
        it is that peer's failure, never the listener's, the dial loop's or the process's. The
        caller ends that socket (4008 when it can still say so); this logs the traceback, counts
        it and returns a one-line cause. Cancellation is not an :class:`Exception` and passes.
        """
        detail = peer_text(exc)  # never raises; bounded whatever the message holds
        why = one_line(f"unexpected {type(exc).__name__}" + (f": {detail}" if detail else ""))
        self._stats.unexpected_errors += 1
        self.last_error = why
        self._peer_log.log(
            peer_host(peer),
            type(exc).__name__,
            "%s peer %s failed with an unexpected error: %s",
            self._tag,
            peer,
            why,
            exc_info=exc,
            extra=log_fields(executor=self._executor_id),
        )
        return why
