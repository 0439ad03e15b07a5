"""Threads of the file service: detached read-only work a cancelled call abandons, attached work
that changes files, checkpoints that stop work whose caller left, and the recursive removal."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import anyio

from ..errors import Rejected

# ---------------------------------------------------------------------------- threads
#
# Blocking file system work runs in threads. A thread cannot be interrupted, and a thread of
# ``anyio.to_thread`` is also joined when the interpreter exits, so work that never ends (a read
# stuck in a hung network file system, a scan of a huge directory) would hold a cancelled call,
# the session's end and even a SIGTERM'd worker. Hence two kinds:
#
# * read-only work is *detached* (:func:`_detached`): it runs in a daemon thread; the awaiting
#   task may abandon it when cancelled, and the process may exit while it runs. Nothing it does
#   needs undoing; a result that arrives after the caller left is discarded (``discard``).
# * work that changes files is *attached* (:func:`_attached`): the task waits for it even when
#   cancelled, so a call never returns while its change is still being made. Every such step is
#   bounded (by the path bounds and the frame size), except a recursive removal, which checks
#   for cancellation between entries.
#
# Long loops in either kind call :func:`_checkpoint`, which stops work whose caller is gone.


_T = TypeVar("_T")


class _Abandoned(Exception):
    """Raised at a checkpoint of detached work whose caller is gone (reaches no caller)."""


_thread_state = threading.local()


_READER_IDLE_SECONDS = 10.0


class _Readers:
    """Detached read jobs of this process and the idle daemon threads that run them.

    ``running`` counts jobs accepted and not finished, abandoned ones included (bounded by
    ``ServiceLimits.max_reader_threads``). A thread that finished a job waits for the next one up
    to ``_READER_IDLE_SECONDS`` (no thread start per read), then exits; one stuck in the OS stays
    out of the idle list and keeps its job counted.
    """

    lock = threading.Lock()
    running = 0
    idle: ClassVar[list[queue.SimpleQueue[Callable[[], None]]]] = []  # idle inboxes, LIFO

    @classmethod
    def submit(cls, job: Callable[[], None], limit: int) -> None:
        """Run ``job`` (which must not raise) on an idle or new daemon thread."""
        with cls.lock:
            if cls.running >= limit:
                raise Rejected(
                    "OVERLOADED",
                    f"{limit} file reads are still running in this worker "
                    "(ServiceLimits.max_reader_threads)",
                )
            cls.running += 1
            inbox = cls.idle.pop() if cls.idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            try:
                thread = threading.Thread(
                    target=cls._serve, args=(inbox,), name="garcon-link file read", daemon=True
                )
                thread.start()
            except BaseException:
                with cls.lock:
                    cls.running -= 1
                raise
        inbox.put(job)

    @classmethod
    def _serve(cls, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            try:
                job = inbox.get(timeout=_READER_IDLE_SECONDS)
            except queue.Empty:
                with cls.lock:
                    if inbox in cls.idle:
                        cls.idle.remove(inbox)
                        return
                continue  # taken from the idle list just now: its job is on the way
            try:
                job()
            finally:
                with cls.lock:
                    cls.running -= 1
                    cls.idle.append(inbox)


def _checkpoint() -> None:
    """Stop the current thread's work if its caller is gone (a no-op outside service threads)."""
    future: concurrent.futures.Future[Any] | None = getattr(_thread_state, "future", None)
    if future is not None:
        if future.cancelled():
            raise _Abandoned
    elif getattr(_thread_state, "attached", False):
        anyio.from_thread.check_cancelled()


async def _attached(func: Callable[[], _T]) -> _T:
    """Run ``func`` in a worker thread and wait for it, even when cancelled."""

    def run() -> _T:
        _thread_state.attached = True
        try:
            return func()
        finally:
            _thread_state.attached = False

    return await anyio.to_thread.run_sync(run)


async def _detached(
    func: Callable[[], _T], limit: int, discard: Callable[[_T], None] | None = None
) -> _T:
    """Run read-only ``func`` in a daemon thread; a cancelled caller abandons it at once.

    The task waits in an ``anyio.to_thread`` call that may be abandoned; cancelling the future
    releases that thread and makes the daemon's :func:`_checkpoint` stop. ``discard`` receives
    a result that was produced after the caller left (e.g. to close a descriptor).

    Raises:
        Rejected: ``OVERLOADED`` when ``limit`` detached reads are already running.
    """
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        if future.cancelled():
            return
        _thread_state.future = future
        try:
            result = func()
        except BaseException as exc:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(exc)
            return
        finally:
            _thread_state.future = None
        try:
            future.set_result(result)
        except concurrent.futures.InvalidStateError:  # the caller left meanwhile
            if discard is not None:
                with contextlib.suppress(Exception):
                    discard(result)

    _Readers.submit(run, limit)
    try:
        return await anyio.to_thread.run_sync(future.result, abandon_on_cancel=True)
    finally:
        future.cancel()  # once done, a no-op; else it releases the waiting thread


class _SharedFd:
    """A descriptor used by detached reads: closed by whoever finishes with it last, so a read
    abandoned in flight never touches a descriptor number that was closed and reused."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        with self._lock:
            if self._closing:
                raise _Abandoned
            self._users += 1
        try:
            yield self._fd
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._closing and self._users == 0
        if last:
            os.close(self._fd)

    def close(self) -> None:
        """Close now, or when the read in flight ends (idempotent)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = self._users == 0
        if now:
            os.close(self._fd)


_SCAN_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(slots=True)
class _Emptying:
    fd: int
    name: str
    parent_fd: int
    subdirs: list[str] | None = None


def _remove_tree(parent_fd: int, name: str) -> None:
    """Remove directory ``name`` of ``parent_fd`` and everything in it.

    Depth-first with an explicit stack (no recursion limit); every directory is opened relative
    to its parent with ``O_NOFOLLOW``, so a symlink swapped in is never followed (an ``ELOOP``
    stops the removal). Checks for cancellation between entries.
    """
    stack = [_Emptying(os.open(name, _SCAN_FLAGS, dir_fd=parent_fd), name, parent_fd)]
    try:
        while stack:
            top = stack[-1]
            if top.subdirs is None:
                top.subdirs = []
                with os.scandir(top.fd) as entries:
                    for entry in entries:
                        _checkpoint()
                        if entry.is_dir(follow_symlinks=False):
                            top.subdirs.append(entry.name)
                        else:
                            os.unlink(entry.name, dir_fd=top.fd)
            if top.subdirs:
                child = top.subdirs.pop()
                stack.append(_Emptying(os.open(child, _SCAN_FLAGS, dir_fd=top.fd), child, top.fd))
                continue
            stack.pop()
            os.close(top.fd)
            os.rmdir(top.name, dir_fd=top.parent_fd)
    finally:
        for frame in stack:
            os.close(frame.fd)
