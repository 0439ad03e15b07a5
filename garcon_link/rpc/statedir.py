"""A worker's state directory: one lock, one SQLite database, one writer thread.

Theory of operation
-------------------
``garcon-link worker --state-dir DIR`` (``gl.Worker(state_dir=...)``, the ``state_dir`` config
key) keeps what must outlive the worker process in ``DIR``::

    DIR/lock             the single-instance lock: flock(LOCK_EX) held while the worker runs,
                         the file holds the holder's pid (for the refusal's message)
    DIR/state.sqlite3    the database (WAL mode: also state.sqlite3-wal and -shm), mode 0600

:func:`open_state_directory` (blocking: the worker calls it in a thread) creates the directory
(0700) if needed, takes the lock -- a second worker on the same directory is refused at once,
naming the holder's pid, before it touches the database -- then opens the database and checks
that it is ours (``application_id``), of a schema this version reads (``user_version``: a newer
one is refused, never downgraded) and of this executor id. Each of these refusals, and every
``sqlite3`` or OS error on the way, is one :class:`~garcon_link.errors.ConfigError` line naming
the file and the fix, never a traceback from below.

Writes go through :meth:`StateDirectory.write`: the event loop queues a batch of statements and
awaits its commit, never touching the database itself. One writer thread runs them in order,
*group commit*: it takes every batch queued while the previous transaction was committing, runs
them in one transaction and wakes their callers together -- so many keyed calls share one
fsync. A batch is committed when its ``write`` returns; batches commit in the order they were
queued, so an empty batch is a barrier (it returns once everything queued before it is on disk).

Durability. ``synchronous=FULL`` in WAL mode: a commit returns after the WAL is fsynced, so what
a caller was told is recorded survives a host crash or power loss, not only a process kill.
``NORMAL`` would lose the last commits on power loss: a keyed call's journal entry among them
would let the call run again after the reboot, which the guarantee excludes. Group commit pays
for the fsync (``benchmarks/bench_durable.py``).

A failed write (disk full, I/O error) breaks the writer for good (sticky, the stored cause is
raised by every later write as :class:`StateUnavailable`): the database stays what the last
commit left, which SQLite keeps consistent whatever happens to the process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import queue
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from ..errors import ConfigError
from ..net.backend import loop_scheduler

__all__ = [
    "APPLICATION_ID",
    "DATABASE_NAME",
    "LOCK_NAME",
    "SCHEMA_VERSION",
    "StateDirectory",
    "StateStatistics",
    "StateUnavailable",
    "Statement",
    "open_state_directory",
]

log = logging.getLogger("garcon_link.state")

DATABASE_NAME = "state.sqlite3"
LOCK_NAME = "lock"
APPLICATION_ID = 0x476C5354  # "GlST": a garcon-link state database
SCHEMA_VERSION = 1
MAX_BATCH = 512
"""Most batches one transaction takes (the rest wait for the next commit)."""

MAX_PROCESS_ROWS = 65536
"""Most process records read at open (the process service keeps fewer: its own bounds)."""
MAX_PROCESS_RECORD_BYTES = 256 * 1024
"""Largest process record read at open: the process service writes a few hundred bytes (a
record holds an argv and a cwd); a larger row was not written by it and is deleted unread."""
MAX_PROCESS_ID_CHARS = 64 * 1024
"""Longest process id read at open (the process service's ids are far shorter); a row of a
longer one is deleted unread."""
_MAX_META_CHARS = 1024
"""Longest ``meta`` value read (a state id is 32 hex digits, an executor id at most 200
characters): a longer one is read only as far as this, enough to refuse it."""

Statement = tuple[str, tuple[Any, ...]]

_SCHEMA = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    # One row per keyed call the worker remembers (garcon_link.rpc.keystore).
    "CREATE TABLE keyed_calls ("
    " service TEXT NOT NULL, method TEXT NOT NULL, key BLOB NOT NULL,"
    " digest BLOB NOT NULL, state TEXT NOT NULL CHECK (state IN ('running', 'done')),"
    " started_at REAL NOT NULL, finished_at REAL, reply_kind INTEGER, reply BLOB,"
    " PRIMARY KEY (service, method, key)) WITHOUT ROWID",
    "CREATE INDEX keyed_calls_finished ON keyed_calls (finished_at)",
    # One row per process of the built-in process service (its record, CBOR).
    "CREATE TABLE processes (id TEXT PRIMARY KEY, record BLOB NOT NULL) WITHOUT ROWID",
)


class StateUnavailable(Exception):
    """The state database cannot be written (its stored cause says why); raised by
    :meth:`StateDirectory.write` after a failed transaction, and by every write after it."""


@dataclass(frozen=True, slots=True)
class StateStatistics:
    """A snapshot of a :class:`StateDirectory`'s writer.

    Attributes:
        transactions: transactions committed.
        batches: write batches committed (one ``write`` call each).
        statements: statements committed.
        largest_group: most batches one transaction committed (group commit at work).
        failed: why the writer stopped, or None while it works.
    """

    transactions: int
    batches: int
    statements: int
    largest_group: int
    failed: str | None


@dataclass(eq=False, slots=True)
class _Batch:
    statements: Sequence[Statement]
    done: anyio.Event = field(default_factory=anyio.Event)
    error: StateUnavailable | None = None


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    return " ".join(text.split())[:300]


@contextlib.contextmanager
def _refusing(what: str, fix: str) -> Iterator[None]:
    """Map an OS or SQLite error while opening to one ConfigError line: ``what`` failed."""
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        if _cannot_write(exc):  # the file is not at fault: moving it away would not help
            fix = "free space on its file system (or give this worker another state directory)"
        raise ConfigError(f"{what}: {_one_line(exc)}; {fix}") from exc


_SQLITE_IOERR, _SQLITE_FULL = 10, 13  # primary result codes (the extended ones add high bits)


def _cannot_write(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk refused a write (full, quota, I/O error)."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in (_SQLITE_IOERR, _SQLITE_FULL)


class StateDirectory:
    """An open state directory (see the module docstring); made by
    :func:`open_state_directory`.

    Attributes:
        path: the directory.
        database: the database file.
    """

    def __init__(self, path: Path, lock_fd: int, connection: sqlite3.Connection) -> None:
        self.path = path
        self.database = path / DATABASE_NAME
        self._lock_fd: int | None = lock_fd
        self._db = connection
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._schedule: Callable[..., object] | None = None
        self._failed: StateUnavailable | None = None
        self._closed = False
        self._transactions = self._batches = self._statements = self._largest = 0
        self.state_id = b""
        """A random id made with the database: the same directory, whatever the process."""
        self.process_rows: list[tuple[Any, ...]] = []
        """The ``processes`` rows the last run left, read at open (the process service takes
        them once)."""

    # -- before the writer starts (the opening thread)

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of a query, before :meth:`start` (loading what the last run left).

        Raises:
            ConfigError: the database cannot be read (named, one line).
        """
        assert self._thread is None, "read() is for loading, before the writer starts"
        with _refusing(f"{self.database}: cannot read the state database", _MOVE_AWAY):
            return self._db.execute(sql, params).fetchall()

    def write_now(self, statements: Sequence[Statement]) -> None:
        """Run ``statements`` in one transaction, before :meth:`start` (what loading fixes up).

        Raises:
            ConfigError: the database cannot be written (named, one line).
        """
        assert self._thread is None
        with _refusing(f"{self.database}: cannot write the state database", _MOVE_AWAY):
            self._transaction(statements)

    # -- the writer

    def start(self) -> None:
        """Start the writer thread; :meth:`write` may be awaited from this event loop on."""
        if self._thread is not None:
            return
        self._schedule = loop_scheduler()
        self._thread = threading.Thread(target=self._run, name="garcon-link-state", daemon=True)
        self._thread.start()

    async def write(self, statements: Sequence[Statement]) -> None:
        """Commit ``statements`` (one batch, in one transaction, with whatever else is queued).

        Returns once they are durable (module docstring); a cancelled caller does not withdraw
        the batch. An empty batch waits for every batch queued before it.

        Raises:
            StateUnavailable: the writer failed (this batch or an earlier one), or it is closed.
        """
        if self._failed is not None:
            raise self._failed
        if self._closed or self._thread is None:
            raise StateUnavailable(f"{self.database}: the state database is closed")
        batch = _Batch(statements)
        self._queue.put(batch)
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error

    def statistics(self) -> StateStatistics:
        return StateStatistics(
            transactions=self._transactions,
            batches=self._batches,
            statements=self._statements,
            largest_group=self._largest,
            failed=None if self._failed is None else str(self._failed),
        )

    async def aclose(self) -> None:
        """Let the writer commit what is queued, stop it, close the database and release the
        lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            await anyio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        self.close_now()

    def close_now(self) -> None:
        """Close the database and release the lock without the writer (it is not running, or
        has stopped)."""
        self._closed = True
        with contextlib.suppress(sqlite3.Error):
            self._db.close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the flock

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            group = [first]
            while len(group) < MAX_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                group.append(more)
            error = self._failed
            if error is None:
                statements = [s for batch in group for s in batch.statements]
                try:
                    self._transaction(statements)
                except (sqlite3.Error, OSError) as exc:
                    error = StateUnavailable(
                        f"{self.database}: writing the state database failed: {_one_line(exc)}"
                    )
                    error.__cause__ = exc
                    self._failed = error
                    log.error("%s; keyed calls are refused from now on", error)
                else:
                    self._transactions += 1 if statements else 0
                    self._batches += len(group)
                    self._statements += len(statements)
                    self._largest = max(self._largest, len(group))
            assert self._schedule is not None
            try:
                self._schedule(_wake, group, error)
            except RuntimeError:  # the event loop is gone: nobody waits any more
                return

    def _transaction(self, statements: Sequence[Statement]) -> None:
        if not statements:
            return
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                db.execute(sql, params)
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise


def _wake(group: list[_Batch], error: StateUnavailable | None) -> None:
    for batch in group:
        batch.error = error
        batch.done.set()


_MOVE_AWAY = "move the file away (or give this worker another state directory)"


def open_state_directory(path: str | os.PathLike[str], executor_id: str) -> StateDirectory:
    """Create (0700) or open the state directory ``path``, take its lock, open its database.

    Blocking (file system and SQLite): the worker calls it in a thread.

    Raises:
        ConfigError: one line naming the directory or file and the fix: it cannot be created
            or is not a writable directory; another worker holds its lock (the message names
            its pid); the database is not a SQLite database, another program's, of a newer
            schema, another executor's, or damaged.
    """
    directory = Path(os.path.abspath(os.fspath(path)))
    fix_dir = "create it, fix its permissions, or give this worker another state directory"
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"state directory {directory}: not a directory; {fix_dir}")
    with _refusing(f"state directory {directory}: cannot create it", fix_dir):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not os.access(directory, os.W_OK | os.X_OK):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            raise ConfigError(
                f"state directory {directory}: on a read-only file system; remount it "
                "read-write, or give this worker a state directory on a writable one"
            )
        raise ConfigError(f"state directory {directory}: not writable by this user; {fix_dir}")
    lock_fd = _take_lock(directory)
    try:
        connection = _open_database(directory / DATABASE_NAME, executor_id)
    except BaseException:
        os.close(lock_fd)
        raise
    state = StateDirectory(directory, lock_fd, connection)
    try:
        rows = state.read(
            "SELECT substr(value, 1, ?) FROM meta WHERE name = 'state_id'", (_MAX_META_CHARS,)
        )
        state.state_id = _state_id(rows, state.database)
        state.process_rows = _process_rows(state)
    except BaseException:
        state.close_now()
        raise
    return state


def _process_rows(state: StateDirectory) -> list[tuple[Any, ...]]:
    """The ``processes`` rows, after deleting unread those too large to be the process
    service's (one warning says how many): a huge value left by another tool is never read
    into memory to be found too large."""
    bounds = (MAX_PROCESS_ID_CHARS, MAX_PROCESS_RECORD_BYTES)
    too_large = "FROM processes WHERE length(id) > ? OR length(record) > ?"
    (count,) = state.read(f"SELECT count(*) {too_large}", bounds)[0]
    if count:
        state.write_now([(f"DELETE {too_large}", bounds)])
        log.warning(
            "%s: deleted %d process record(s) larger than the process service writes (an id "
            "over %d characters or a record over %d bytes)",
            state.database,
            count,
            *bounds,
        )
    return state.read("SELECT id, record FROM processes LIMIT ?", (MAX_PROCESS_ROWS,))


def _state_id(rows: list[tuple[Any, ...]], database: Path) -> bytes:
    """The database's ``state_id``: 32 hex digits, as :func:`_prepare` writes it. Callers retry
    across worker processes that report the same id, so a missing or unreadable one is damage,
    not an empty id two directories could share."""
    value = rows[0][0] if rows else None
    if isinstance(value, str) and len(value) == 32:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    problem = "missing" if value is None else "not 32 hex digits"
    raise ConfigError(
        f"{database}: the state database is damaged (its state_id is {problem}); {_MOVE_AWAY}"
    )


def _open_own_file(path: Path, what: str, fix: str) -> int:
    """Open (creating, 0600) a file of the directory, refusing a symbolic link (its target,
    anywhere, would be written) and anything but a regular file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path}: a symbolic link; remove it (the worker writes only its own files in "
                "its state directory)"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            fix = f"let this worker's user read and write it (chown, chmod 600 {path})"
        raise ConfigError(f"{what}: {_one_line(exc)}; {fix}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{path}: not a regular file; {_MOVE_AWAY}")
    os.set_blocking(fd, True)
    return fd


def _take_lock(directory: Path) -> int:
    lock = directory / LOCK_NAME
    fd = _open_own_file(
        lock, f"state directory {directory}: cannot open its lock file {lock}", "fix it"
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        raise ConfigError(
            f"state directory {directory} is in use by another worker (pid {holder}, holding "
            f"{lock}); stop that worker first, or give this one another state directory"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise ConfigError(
            f"state directory {directory}: cannot lock {lock}: {_one_line(exc)}; use a local "
            "file system that supports flock"
        ) from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(
            f"state directory {directory}: cannot write {lock}: {_one_line(exc)}; free space "
            "or fix its permissions"
        ) from exc
    return fd


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _open_database(database: Path, executor_id: str) -> sqlite3.Connection:
    what = f"{database}: cannot open the state database"
    # Created here, 0600, so the database (and its WAL, which takes its mode) is private.
    os.close(_open_own_file(database, what, _MOVE_AWAY))
    with _refusing(what, _MOVE_AWAY):
        db = sqlite3.connect(
            os.fspath(database), timeout=0, isolation_level=None, check_same_thread=False
        )
    try:
        with _refusing(f"{database}: not a usable garcon-link state database", _MOVE_AWAY):
            _prepare(db, database, executor_id)
    except BaseException:
        db.close()
        raise
    return db


def _prepare(db: sqlite3.Connection, database: Path, executor_id: str) -> None:
    application_id = db.execute("PRAGMA application_id").fetchone()[0]
    version = db.execute("PRAGMA user_version").fetchone()[0]
    fresh = False
    if application_id == 0 and version == 0:
        if db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
            raise ConfigError(
                f"{database}: a SQLite database of another program, not a garcon-link state "
                f"database; {_MOVE_AWAY}"
            )
        fresh = True
    elif application_id != APPLICATION_ID:
        raise ConfigError(
            f"{database}: a SQLite database of another program (application id "
            f"{application_id:#x}), not a garcon-link state database; {_MOVE_AWAY}"
        )
    elif version > SCHEMA_VERSION:
        raise ConfigError(
            f"{database}: written by a newer garcon-link (state schema {version}; this version "
            f"reads up to {SCHEMA_VERSION}); run the newer version, or give this worker another "
            "state directory"
        )
    elif version < 1:
        raise ConfigError(
            f"{database}: a garcon-link state database of an unknown state schema {version} (this "
            f"version writes {SCHEMA_VERSION}); {_MOVE_AWAY}"
        )
    mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise ConfigError(
            f"{database}: the file system does not support SQLite's WAL mode (got {mode}); use "
            "a local file system for the state directory"
        )
    db.execute("PRAGMA synchronous=FULL")
    if fresh:
        db.execute("BEGIN IMMEDIATE")
        for sql in _SCHEMA:
            db.execute(sql)
        db.execute("INSERT INTO meta (name, value) VALUES ('executor_id', ?)", (executor_id,))
        db.execute("INSERT INTO meta (name, value) VALUES ('state_id', ?)", (os.urandom(16).hex(),))
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        db.execute("COMMIT")
        return
    check = db.execute("PRAGMA quick_check").fetchone()[0]
    if check != "ok":
        raise ConfigError(
            f"{database}: the state database is damaged ({_one_line(Exception(check))}); "
            f"{_MOVE_AWAY}"
        )
    row = db.execute(
        "SELECT substr(value, 1, ?) FROM meta WHERE name = 'executor_id'", (_MAX_META_CHARS,)
    ).fetchone()
    owner = None if row is None else row[0]
    if owner != executor_id:
        shown = "no executor" if owner is None else f"executor {str(owner)[:200]!r}"
        raise ConfigError(
            f"{database}: the state of {shown}, not of this worker ({executor_id!r}); give each "
            "executor id its own state directory"
        )
