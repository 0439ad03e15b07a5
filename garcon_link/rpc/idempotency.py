"""Idempotency keys: exactly-once execution of a keyed call across continuity loss.

Theory of operation
-------------------
A caller names one operation with a key (``gl.with_options(facade, idempotency_key="build-42")``).
The key travels as the optional ninth element of the ``call`` envelope (see
:mod:`garcon_link.rpc.rpc`). The worker keeps one :class:`IdempotencyTable` for its *process
lifetime* -- shared by every logical session of a :class:`~garcon_link.Worker`, so retiring a
session loses nothing -- keyed by ``(service, method, key)``. Each entry remembers a digest of the
arguments (BLAKE3 of the canonical CBOR of ``[args, kwargs]`` as received; the caller binds them to
the signature first, so ``f(1, b=2)`` and ``f(1, 2)`` match, but an omitted default and the same
value passed explicitly do not) and, once the call finished, its reply::

    begin(key, digest, now) ->  Execute   no entry: one is created (RUNNING); run the handler
                                Await     a RUNNING entry, same digest: wait for its reply
                                Replay    a DONE entry, same digest: its recorded reply, not run
                                Conflict  same key, other arguments: Rejected IDEMPOTENCY_CONFLICT
                                Full      no room (all RUNNING): NotDispatched OVERLOADED
    finish(entry, reply, now)   RUNNING -> DONE: the reply is recorded
    abandon(entry)              RUNNING, handler never started (cancelled first) -> forgotten

Invariants of the table (checked by a property test): at most ``idempotency_max_entries``
entries and ``idempotency_max_bytes`` accounted bytes at every moment; only DONE entries are
evicted -- oldest finished first, to make room or once older than ``idempotency_max_age`` -- so a
RUNNING entry (whose handler may be executing) is never forgotten. A reply too large to keep
within the byte bound is replaced by a small stand-in, ``RemoteError("RESULT_NOT_KEPT")``: the
call certainly ran, so a repeat must not run it again, and its value cannot be given.
The table is pure: time is passed in, nothing here awaits.

The keyed handler does not run in its session's task: :class:`KeyedExecutions` (the worker's
adapter) spawns it in the *worker's* task group, and each call with that key -- the first and
every repeat, on any session -- only waits for the entry. So a session retired while the handler
runs does not cancel it (the retry on the next session waits for the same execution and gets its
real reply). A ``cancel`` from the caller of the call that started the execution cancels it, as
for any call; a ``cancel`` of a repeat only ends that repeat's wait. A handler
cancelled before it started is forgotten (a later call with the key runs it); one cancelled while
running records ``OutcomeUnknown("CANCELLED_WHILE_RUNNING")``.

Scope of keys: unary calls only. A stream cannot be replayed from a record and a one-way call has
no reply to record, so a key on either is refused: ``TypeError`` on the caller's side when the
method is called, ``Rejected("INVALID_ARGUMENTS")`` on the worker for a keyed stream envelope
(``notify`` has no key slot).

Caller side: a keyed call retried across sessions (``retry_unknown=True``) is
:func:`garcon_link.api.keyed.call_with_key`, above the executor it waits on.

What is guaranteed: while one worker process lives, and while the key's entry is in its table
(not evicted by count, bytes or age), every call with the same key, method and arguments --
from this controller, a restarted one or another one -- gets the reply of exactly one execution.
Not guaranteed: across a worker restart (the table is in memory); after eviction (the key runs
again); for a per-session service scope that is closed under a handler still running for a
retired session (serve such methods from a mapping or a worker-scoped service).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import blake3
import cbor2

from ..errors import CallError, NotDispatched, OutcomeUnknown, RemoteError
from ..limits import Limits
from .envelopes import ERROR
from .statedir import StateUnavailable

log = logging.getLogger("garcon_link.state")

__all__ = [
    "ENTRY_OVERHEAD",
    "MAX_KEY_BYTES",
    "WORKER_RESTARTED",
    "Await",
    "Change",
    "Conflict",
    "Decision",
    "Entry",
    "EntryState",
    "Execute",
    "Forgotten",
    "Full",
    "IdempotencyStatistics",
    "IdempotencyTable",
    "Journaled",
    "KeyStore",
    "KeyedExecutions",
    "MemoryKeys",
    "Recorded",
    "Replay",
    "StoredCall",
    "arguments_digest",
    "normalize_key",
]

MAX_KEY_BYTES = 128
"""Longest idempotency key, in bytes (a ``str`` key counts its UTF-8 encoding)."""

ENTRY_OVERHEAD = 256
"""Bytes charged per entry on top of its key, names, digest and recorded reply (the objects)."""

STAND_IN_RESERVE = 256
"""Bytes every RUNNING entry reserves, so its stand-in reply always fits when it finishes."""


TableKey = tuple[str, str, bytes]  # (service, method, key)
Reply = tuple[int, bytes]  # (RESULT or ERROR, encoded third element of that envelope)


def normalize_key(key: object) -> bytes:
    """The wire form of an idempotency key: bytes as given, a ``str`` as its UTF-8 encoding.

    Raises:
        TypeError: ``key`` is neither ``str`` nor ``bytes``.
        ValueError: empty, longer than :data:`MAX_KEY_BYTES` bytes, or text that does not
            encode as UTF-8.
    """
    if isinstance(key, str):
        try:
            data = key.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "an idempotency key of text must encode as UTF-8 (it holds a lone surrogate)"
            ) from None
    elif isinstance(key, bytes):
        data = key
    else:
        raise TypeError(f"an idempotency key is str or bytes, got {type(key).__name__}")
    if not 1 <= len(data) <= MAX_KEY_BYTES:
        raise ValueError(
            f"an idempotency key is 1 to {MAX_KEY_BYTES} bytes (UTF-8), got {len(data)}"
        )
    return data


def key_problem(key: object) -> str | None:
    """Why a key received from a peer is unusable, else None (it must already be bytes)."""
    if type(key) is not bytes:
        return f"the idempotency key must be bytes, got {type(key).__name__}"
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        return f"the idempotency key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}"
    return None


def arguments_digest(args: list[Any], kwargs: Mapping[str, Any]) -> bytes:
    """BLAKE3 of the canonical CBOR of ``[args, kwargs]`` (their wire form, as received).

    Raises:
        ValueError: the values cannot be encoded canonically.
    """
    try:
        data = cbor2.dumps([args, dict(kwargs)], canonical=True)
    except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
        raise ValueError(f"cannot digest the arguments: {exc}") from exc
    return blake3.blake3(data).digest()


def error_reply(error: CallError) -> Reply:
    """A recorded reply that is ``error`` (for the stand-ins the table and runner record)."""
    body = {"outcome": error.outcome.value, "code": error.code, "message": error.message}
    return ERROR, cbor2.dumps(body)


# ---------------------------------------------------------------------------------- the table


class EntryState(enum.Enum):
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Entry:
    """One keyed call the worker remembers (mutated by :class:`IdempotencyTable`; once the table
    has abandoned it, :class:`KeyedExecutions` sets its ``reply`` for late waiters)."""

    key: TableKey
    digest: bytes
    serial: int
    started_at: float
    size: int
    state: EntryState = EntryState.RUNNING
    finished_at: float | None = None
    reply: Reply | None = None


@dataclass(frozen=True, slots=True)
class Execute:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Await:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Replay:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Conflict:
    entry: Entry


@dataclass(frozen=True, slots=True)
class Full:
    reason: str


Decision = Execute | Await | Replay | Conflict | Full


@dataclass(frozen=True, slots=True)
class Journaled:
    """A new RUNNING entry: to be stored before its handler starts."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Recorded:
    """An entry became DONE: its reply, to be stored before it is sent."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Forgotten:
    """An entry left the table (evicted, or abandoned before it started)."""

    key: TableKey


Change = Journaled | Recorded | Forgotten


@dataclass(frozen=True, slots=True)
class IdempotencyStatistics:
    """A snapshot of an :class:`IdempotencyTable`.

    Attributes:
        entries: keyed calls remembered (running and finished).
        running: of those, how many are still running.
        bytes: accounted bytes (at most ``idempotency_max_bytes``).
        executions: keyed calls that ran (an ``Execute`` decision).
        replays: repeats answered from a record, without running.
        waits: repeats that waited for a running execution.
        conflicts: same key with other arguments (``IDEMPOTENCY_CONFLICT``).
        refusals: new keys refused because the table was full of running calls.
        evictions: finished entries forgotten (for room or age).
        not_kept: replies replaced by the ``RESULT_NOT_KEPT`` stand-in.
        restored: entries loaded from the state directory when the worker started.
        interrupted: of those, calls that were running when the previous worker process
            stopped (answered ``OutcomeUnknown("WORKER_RESTARTED")``, never run again).
    """

    entries: int
    running: int
    bytes: int
    executions: int
    replays: int
    waits: int
    conflicts: int
    refusals: int
    evictions: int
    not_kept: int
    restored: int = 0
    interrupted: int = 0


def _base_size(key: TableKey) -> int:
    service, method, raw = key
    return ENTRY_OVERHEAD + len(service.encode()) + len(method.encode()) + len(raw) + 32


class IdempotencyTable:
    """The worker's record of keyed calls (pure: ``now`` is passed in). See the module docstring.

    Args:
        max_entries: entries at most (running plus finished).
        max_bytes: accounted bytes at most.
        max_age: seconds a finished entry is kept after it finished.
    """

    def __init__(
        self, max_entries: int, max_bytes: int, max_age: float, *, track_changes: bool = False
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_age = max_age
        self._entries: dict[TableKey, Entry] = {}
        self._finished: OrderedDict[TableKey, Entry] = OrderedDict()  # in order of finishing
        self._bytes = 0
        self._serial = 0
        self._executions = self._replays = self._waits = self._conflicts = 0
        self._refusals = self._evictions = self._not_kept = 0
        self._restored = self._interrupted = 0
        self._changes: list[Change] = []  # kept only with track_changes (a durable store)
        self._track = track_changes

    def take_changes(self) -> list[Change]:
        """What changed since the last call, in order (what a durable store writes)."""
        changes, self._changes = self._changes, []
        return changes

    @classmethod
    def from_limits(cls, limits: Limits, *, track_changes: bool = False) -> IdempotencyTable:
        return cls(
            limits.idempotency_max_entries,
            limits.idempotency_max_bytes,
            limits.idempotency_max_age,
            track_changes=track_changes,
        )

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: TableKey) -> Entry | None:
        return self._entries.get(key)

    def entries(self) -> list[Entry]:
        """Every entry (a copy of the list), for tests and diagnostics."""
        return list(self._entries.values())

    def statistics(self) -> IdempotencyStatistics:
        return IdempotencyStatistics(
            entries=len(self._entries),
            running=len(self._entries) - len(self._finished),
            bytes=self._bytes,
            executions=self._executions,
            replays=self._replays,
            waits=self._waits,
            conflicts=self._conflicts,
            refusals=self._refusals,
            evictions=self._evictions,
            not_kept=self._not_kept,
            restored=self._restored,
            interrupted=self._interrupted,
        )

    def begin(self, key: TableKey, digest: bytes, now: float) -> Decision:
        """Decide what a call with ``key`` and arguments ``digest`` does (see the module doc)."""
        self.expire(now)
        entry = self._entries.get(key)
        if entry is not None:
            if entry.digest != digest:
                self._conflicts += 1
                return Conflict(entry)
            if entry.state is EntryState.RUNNING:
                self._waits += 1
                return Await(entry)
            self._replays += 1
            return Replay(entry)
        size = _base_size(key) + STAND_IN_RESERVE
        if not self._make_room(1, size):
            self._refusals += 1
            running = len(self._entries) - len(self._finished)
            return Full(
                f"the idempotency table is full: {running} keyed calls are running "
                f"({len(self._entries)}/{self.max_entries} entries, "
                f"{self._bytes}/{self.max_bytes} bytes)"
            )
        self._serial += 1
        entry = Entry(key=key, digest=digest, serial=self._serial, started_at=now, size=size)
        self._entries[key] = entry
        self._bytes += size
        self._executions += 1
        self._note(Journaled(entry))
        return Execute(entry)

    def finish(self, entry: Entry, reply: Reply, now: float) -> Reply:
        """Record ``reply`` for a RUNNING entry; returns what was recorded (maybe a stand-in).

        Raises:
            ValueError: ``entry`` is not a running entry of this table.
        """
        self._check_running(entry)
        self.expire(now)
        base = _base_size(entry.key)
        kind, body = reply
        extra = base + len(body) - entry.size
        if extra > 0 and not self._make_room(0, extra):
            self._not_kept += 1
            kind, body = _stand_in(len(body))
        new_size = base + len(body)
        self._bytes += new_size - entry.size
        entry.size = new_size
        entry.state = EntryState.DONE
        entry.finished_at = now
        entry.reply = (kind, body)
        self._finished[entry.key] = entry
        self._note(Recorded(entry))
        return entry.reply

    def restore(
        self, key: TableKey, digest: bytes, reply: Reply, finished_at: float, *, interrupted: bool
    ) -> bool:
        """Put back a DONE entry a durable store kept (loading, oldest first). ``interrupted``:
        it was RUNNING when its worker process stopped, and ``reply`` is the stand-in to record
        in its place. False if it does not fit the bounds even after evicting older ones (it is
        then forgotten).
        """
        if key in self._entries:
            return False
        size = _base_size(key) + len(reply[1])
        if not self._make_room(1, size):
            self._note(Forgotten(key))
            return False
        self._serial += 1
        entry = Entry(
            key=key,
            digest=digest,
            serial=self._serial,
            started_at=finished_at,
            size=size,
            state=EntryState.DONE,
            finished_at=finished_at,
            reply=reply,
        )
        self._entries[key] = entry
        self._finished[key] = entry
        self._bytes += size
        self._restored += 1
        if interrupted:
            self._interrupted += 1
            self._note(Recorded(entry))
        return True

    def abandon(self, entry: Entry) -> None:
        """Forget a RUNNING entry whose handler never started (a later call runs it)."""
        self._check_running(entry)
        del self._entries[entry.key]
        self._bytes -= entry.size
        self._note(Forgotten(entry.key))

    def expire(self, now: float) -> None:
        """Forget finished entries that are ``max_age`` old or older, oldest first."""
        while self._finished:
            oldest = next(iter(self._finished.values()))
            assert oldest.finished_at is not None
            if now - oldest.finished_at < self.max_age:
                break
            self._evict_oldest()

    def _note(self, change: Change) -> None:
        if self._track:
            self._changes.append(change)

    def _check_running(self, entry: Entry) -> None:
        if self._entries.get(entry.key) is not entry or entry.state is not EntryState.RUNNING:
            raise ValueError("not a running entry of this table")

    def _make_room(self, count: int, nbytes: int) -> bool:
        """Evict finished entries, oldest first, until ``count`` more entries and ``nbytes``
        more bytes fit; False if they cannot (what remains is running)."""
        while self._finished and (
            len(self._entries) + count > self.max_entries or self._bytes + nbytes > self.max_bytes
        ):
            self._evict_oldest()
        return (
            len(self._entries) + count <= self.max_entries
            and self._bytes + nbytes <= self.max_bytes
        )

    def _evict_oldest(self) -> None:
        _, entry = self._finished.popitem(last=False)
        del self._entries[entry.key]
        self._bytes -= entry.size
        self._evictions += 1
        self._note(Forgotten(entry.key))


def _stand_in(size: int) -> Reply:
    kind, body = error_reply(
        RemoteError(
            "RESULT_NOT_KEPT",
            f"a call with this idempotency key ran to completion, but its reply ({size} bytes) "
            "exceeds the idempotency table's byte bound, so only the fact that it ran was kept",
        )
    )
    assert len(body) <= STAND_IN_RESERVE
    return kind, body


# ---------------------------------------------------------------------------------- the runner


_CANCELLED_WHILE_RUNNING = error_reply(
    OutcomeUnknown(
        "CANCELLED_WHILE_RUNNING",
        "the call with this idempotency key was cancelled by its caller while it ran; it may "
        "have partly executed",
    )
)
_CANCELLED_BEFORE_START = error_reply(
    NotDispatched("CANCELLED", "the call with this idempotency key was cancelled before it started")
)
WORKER_RESTARTED = error_reply(
    OutcomeUnknown(
        "WORKER_RESTARTED",
        "the call with this idempotency key was running when its worker process stopped (killed, "
        "crashed or closed); it may have partly executed, and it is not run again",
    )
)
"""What a keyed call that was running when the worker process stopped is answered after the
restart (recorded in its entry's place: a retry gets it too)."""


@dataclass(frozen=True, slots=True)
class StoredCall:
    """One keyed call a :class:`KeyStore` kept: ``reply`` None if it was still running."""

    key: TableKey
    digest: bytes
    reply: Reply | None
    finished_at: float  # on the caller's clock (``now`` of ``load``)


class KeyStore(Protocol):
    """Where a worker's keyed calls are kept beyond its memory (:class:`MemoryKeys` keeps them
    nowhere else; :class:`~garcon_link.rpc.keystore.DurableKeys` in the state directory).

    ``save`` returns once ``changes`` (the table's, in order) are stored, or raises
    :class:`~garcon_link.rpc.statedir.StateUnavailable`; saves complete in the order they
    were made, so an empty one waits for those made before it.
    """

    @property
    def durable(self) -> bool: ...

    def load(self, now: float) -> list[StoredCall]: ...

    async def save(self, changes: Sequence[Change], now: float) -> None: ...


class MemoryKeys:
    """The store of a worker without a state directory: nothing outlives its process."""

    durable = False

    def load(self, now: float) -> list[StoredCall]:
        return []

    async def save(self, changes: Sequence[Change], now: float) -> None:
        return None


@dataclass(eq=False)
class _Run:
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    cancelled: bool = False
    reply: Reply | None = None


Spawn = Callable[..., object]  # spawn(async_fn, *args): a task group's start_soon


class KeyedExecutions:
    """A worker's keyed calls: the table plus the tasks that run them (worker lifetime).

    With a durable ``store``, an ``Execute`` decision's entry is stored before its handler
    starts (a store that fails refuses the call, ``NotDispatched("STATE_UNAVAILABLE")``, unrun)
    and its reply before any waiter gets it (a store that fails then is logged: the reply is
    still the truth, and the stored entry stays ``running``, so a restart answers
    ``WORKER_RESTARTED``). Each wait is bounded by ``state_write_timeout``. What the store kept
    is loaded first, oldest first, within the table's bounds; a call it kept as running is
    answered :data:`WORKER_RESTARTED`.

    Args:
        limits: the table's bounds (``idempotency_max_*``) and ``state_write_timeout``.
        spawn: starts a task that outlives every session (the worker's task group).
        clock: the time source of the table (default: the event loop's clock).
        store: where entries are kept beyond memory (default :class:`MemoryKeys`).
    """

    def __init__(
        self,
        limits: Limits,
        spawn: Spawn,
        *,
        clock: Callable[[], float] = anyio.current_time,
        store: KeyStore | None = None,
    ) -> None:
        self.store: KeyStore = store if store is not None else MemoryKeys()
        self.table = IdempotencyTable.from_limits(limits, track_changes=self.store.durable)
        self._write_timeout = limits.state_write_timeout
        self._spawn = spawn
        self._clock = clock
        self._runs: dict[int, _Run] = {}
        # A stopped store fails every keyed call alike: one error line per kind and
        # log_interval, counting the calls it stands for (callers cannot flood the log).
        self._log_interval = limits.log_interval
        self._logged: dict[str, tuple[float, int]] = {}  # message -> (last line at, quiet)
        if self.store.durable:
            now = clock()
            for call in self.store.load(now):
                interrupted = call.reply is None
                self.table.restore(
                    call.key,
                    call.digest,
                    WORKER_RESTARTED if call.reply is None else call.reply,
                    now if interrupted else call.finished_at,
                    interrupted=interrupted,
                )
            self.table.expire(now)

    def statistics(self) -> IdempotencyStatistics:
        return self.table.statistics()

    def admit(self, key: TableKey, digest: bytes) -> Decision:
        return self.table.begin(key, digest, self._clock())

    def start(self, entry: Entry, execute: Callable[[], Awaitable[Reply]]) -> None:
        """Run ``execute`` (the handler, mapped to a reply) for an ``Execute`` decision."""
        run = self._runs[entry.serial] = _Run()
        self._spawn(self._execute, entry, run, execute)

    def cancel(self, entry: Entry) -> None:
        """Cancel the execution of ``entry`` if it still runs (its caller sent ``cancel``)."""
        run = self._runs.get(entry.serial)
        if run is not None:
            run.cancelled = True
            run.scope.cancel()

    async def wait(self, entry: Entry) -> Reply:
        """The reply of ``entry``: recorded, or once its execution ends."""
        run = self._runs.get(entry.serial)
        if run is not None:
            await run.done.wait()
            assert run.reply is not None
            return run.reply
        assert entry.reply is not None, "an entry without a run is finished"
        return entry.reply

    async def flush(self) -> None:
        """Store what changed and is not stored yet (evictions, abandoned entries); a store
        that fails is logged. For a worker that stops."""
        if self.store.durable:
            with anyio.move_on_after(self._write_timeout, shield=True):
                with contextlib.suppress(StateUnavailable):
                    await self.store.save(self.table.take_changes(), self._clock())

    async def _save(self) -> StateUnavailable | None:
        """Store the table's changes (see the class docstring); why not, or None once stored."""
        with anyio.move_on_after(self._write_timeout):
            try:
                await self.store.save(self.table.take_changes(), self._clock())
            except StateUnavailable as exc:
                return exc
            return None
        return StateUnavailable(
            f"the state database did not store a keyed call within {self._write_timeout}s"
        )

    def _log_failure(self, what: str, problem: StateUnavailable) -> None:
        now = self._clock()
        last = self._logged.get(what)
        if last is not None and now - last[0] < self._log_interval:
            self._logged[what] = (last[0], last[1] + 1)
            return
        quiet = last[1] if last is not None else 0
        self._logged[what] = (now, 0)
        since = f" ({quiet} more since the last such line)" if quiet else ""
        log.error("%s: %s%s", what, problem, since)

    async def _execute(
        self, entry: Entry, run: _Run, execute: Callable[[], Awaitable[Reply]]
    ) -> None:
        reply: Reply | None = None
        try:
            if self.store.durable and not run.cancelled:
                problem = await self._save()  # the journal: before the handler starts
                if problem is not None:
                    self.table.abandon(entry)
                    self._log_failure("keyed call refused, unrun", problem)
                    run.reply = error_reply(NotDispatched("STATE_UNAVAILABLE", str(problem)))
                    return
            if run.cancelled:
                self.table.abandon(entry)
                run.reply = _CANCELLED_BEFORE_START
                return
            with run.scope:
                reply = await execute()
            if reply is None:
                reply = _CANCELLED_WHILE_RUNNING
            recorded = self.table.finish(entry, reply, self._clock())
            if self.store.durable:
                with anyio.CancelScope(shield=True):  # the outcome: before the reply is sent
                    problem = await self._save()
                if problem is not None:
                    self._log_failure("a keyed call's outcome was not stored", problem)
            run.reply = recorded
        finally:
            if run.reply is None:  # the worker is shutting down (its task group was cancelled)
                run.reply = _CANCELLED_WHILE_RUNNING
            if entry.reply is None and self.table.get(entry.key) is not entry:
                # Abandoned (refused unrun, or cancelled before it started): the table forgot
                # it, so a waiter that asks after this run ended reads its answer here. A store
                # that has stopped refuses at once, before the session's waiter has asked.
                entry.reply = run.reply
            del self._runs[entry.serial]
            run.done.set()
