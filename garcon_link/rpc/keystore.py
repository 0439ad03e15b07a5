"""The idempotency table kept in the state directory: :class:`DurableKeys`.

The table (:class:`~garcon_link.rpc.idempotency.IdempotencyTable`) decides, in memory; this
store mirrors it into the ``keyed_calls`` table of the state database
(:mod:`garcon_link.rpc.statedir`), one row per entry::

    Journaled(entry)   INSERT   state 'running'            before the handler starts
    Recorded(entry)    UPSERT   state 'done', the reply    before the reply is sent
    Forgotten(key)     DELETE                              with the next write

So the rows on disk are the table's entries, within the same bounds (an eviction's delete
rides with the next write; until it lands, one more row may be on disk than in memory, and
loading enforces the bounds again). Times on disk are wall-clock seconds (the table's clock is
the event loop's, which starts again with each process); a finished entry's age goes on
counting across a restart, and an entry whose wall-clock time lies in the future (the clock was
set back) counts as finished now.

Loading (:meth:`DurableKeys.load`, in the thread that opens the directory): rows larger than the
byte bound (names, key, digest and reply together), and finished rows beyond the newest
``idempotency_max_entries``, are deleted unread; the rest come oldest finished first (the table
evicts more if the bytes demand it), then the running ones, which the worker answers
``WORKER_RESTARTED`` and records as such.
A row whose columns are not of the types written here makes the database unusable (one
ConfigError line).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ConfigError
from ..limits import Limits
from .envelopes import ERROR, RESULT
from .idempotency import Change, Forgotten, Journaled, Recorded, StoredCall
from .statedir import StateDirectory, Statement

__all__ = ["DurableKeys"]

_INSERT = (
    "INSERT OR REPLACE INTO keyed_calls (service, method, key, digest, state, started_at)"
    " VALUES (?, ?, ?, ?, 'running', ?)"
)
_RECORD = (
    "INSERT OR REPLACE INTO keyed_calls"
    " (service, method, key, digest, state, started_at, finished_at, reply_kind, reply)"
    " VALUES (?, ?, ?, ?, 'done', ?, ?, ?, ?)"
)
_DELETE = "DELETE FROM keyed_calls WHERE service = ? AND method = ? AND key = ?"
_LOAD = (
    "SELECT service, method, key, digest, state, finished_at, reply_kind, reply"
    " FROM keyed_calls ORDER BY state = 'running', finished_at LIMIT ?"
)
# Before loading: what cannot fit the bounds goes, unread (a row larger than the table's byte
# bound -- its names, key, digest and reply; beyond the newest max_entries finished rows).
_TOO_LARGE = (
    "DELETE FROM keyed_calls WHERE length(service) + length(method) + length(key)"
    " + length(digest) + coalesce(length(reply), 0) > ?"
)
_TOO_MANY = (
    "DELETE FROM keyed_calls WHERE state != 'running' AND (service, method, key) NOT IN"
    " (SELECT service, method, key FROM keyed_calls WHERE state != 'running'"
    " ORDER BY finished_at DESC LIMIT ?)"
)


class DurableKeys:
    """A :class:`~garcon_link.rpc.idempotency.KeyStore` in a state directory (module
    docstring). Built in the opening thread: it reads what the last run left at once.

    Args:
        state: the open state directory (its writer not started yet).
        limits: the table's bounds (what is loaded at most).
        wall: the wall clock (seconds since the epoch).

    Raises:
        ConfigError: the rows cannot be read, or are not of the types written here.
    """

    durable = True

    def __init__(
        self, state: StateDirectory, limits: Limits, *, wall: Callable[[], float] = time.time
    ) -> None:
        self.state = state
        self._wall = wall
        entries = limits.idempotency_max_entries
        state.write_now([(_TOO_LARGE, (limits.idempotency_max_bytes,)), (_TOO_MANY, (entries,))])
        # Running rows are at most max_entries too (the table admits no more).
        self._rows = [self._checked(row) for row in state.read(_LOAD, (2 * entries,))]

    def _checked(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        service, method, key, digest, state, finished_at, kind, reply = row
        ok = (
            isinstance(service, str)
            and isinstance(method, str)
            and isinstance(key, bytes)
            and isinstance(digest, bytes)
            and (
                (state == "running")
                or (
                    state == "done"
                    and isinstance(finished_at, float)
                    and kind in (RESULT, ERROR)
                    and isinstance(reply, bytes)
                )
            )
        )
        if not ok:
            raise ConfigError(
                f"{self.state.database}: a keyed_calls row is not what garcon-link writes; "
                "move the file away (or give this worker another state directory)"
            )
        return row

    def load(self, now: float) -> list[StoredCall]:
        """What the last run left (module docstring), on the caller's clock ``now``."""
        wall_now = self._wall()
        calls = []
        for service, method, key, digest, state, finished_at, kind, reply in self._rows:
            table_key = (service, method, key)
            if state == "running":
                calls.append(StoredCall(table_key, digest, None, now))
            else:
                age = max(0.0, wall_now - finished_at)
                calls.append(StoredCall(table_key, digest, (kind, reply), now - age))
        self._rows = []
        return calls

    async def save(self, changes: Sequence[Change], now: float) -> None:
        """Store ``changes`` (one batch; see :meth:`StateDirectory.write`)."""
        await self.state.write(self.statements(changes, now))

    def statements(self, changes: Sequence[Change], now: float) -> list[Statement]:
        """The SQL for ``changes`` (values read now: entries change after)."""
        offset = self._wall() - now  # table clock -> wall clock
        out: list[Statement] = []
        for change in changes:
            if isinstance(change, Forgotten):
                out.append((_DELETE, change.key))
                continue
            entry = change.entry
            service, method, key = entry.key
            if isinstance(change, Journaled):
                started = entry.started_at + offset
                out.append((_INSERT, (service, method, key, entry.digest, started)))
            else:
                assert isinstance(change, Recorded)
                assert entry.reply is not None and entry.finished_at is not None
                kind, body = entry.reply
                out.append(
                    (
                        _RECORD,
                        (
                            service,
                            method,
                            key,
                            entry.digest,
                            entry.started_at + offset,
                            entry.finished_at + offset,
                            kind,
                            body,
                        ),
                    )
                )
        return out
