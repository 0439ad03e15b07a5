"""The built-in file service: confined, versioned, atomic file access under one root (POSIX).

Path rule
---------
Every path a caller passes is an **absolute POSIX path in the service's own namespace**: the
configured root directory *is* ``/`` for the caller. ``"/src/main.c"`` names
``<root>/src/main.c`` on the worker; ``"src/main.c"`` (relative) is refused with
``Rejected("INVALID_PATH")``. Empty and ``.`` segments are ignored; a ``..`` segment anywhere is
refused with ``Rejected("PERMISSION_DENIED")`` (never normalised away). Paths returned by the
service (``FileStat.path``, :meth:`LocalFileService.canonical_path`) use the same namespace, so the
worker's real location of the root is never revealed.

Bounds come first: a path longer than ``ServiceLimits.max_path_bytes`` (4,096 UTF-8 bytes, as
Linux's ``PATH_MAX``), with more than ``ServiceLimits.max_path_components`` names (256) or with a
name over :data:`MAX_NAME_BYTES` (255, as ``NAME_MAX``) is refused with ``INVALID_PATH`` before
anything touches the disk. Resolving costs about names x length (``realpath`` joins and
``lstat``\\ s every prefix): a 2 MB path would take minutes of CPU, a bounded one milliseconds.

Symlinks are followed only while they stay inside the root. Resolution has two steps:

1. *check*: ``os.path.realpath`` of ``<root>/<path>`` must be the root or below it (after
   resolving every symlink); otherwise ``Rejected("PERMISSION_DENIED")`` -- never a silent
   redirect into the root. A symlink replaced or removed while ``realpath`` reads it is refused
   the same way (the OS error, which names the worker's real path, is dropped).
2. *use*: the operation walks the **resolved** components from the root, one ``openat`` per
   directory with ``O_NOFOLLOW``, and acts on the final name relative to that directory
   (``*at`` system calls, ``follow_symlinks=False``). Since the resolved path contained no
   symlink at check time, a symlink swapped in between the two steps makes the walk fail
   (``ELOOP``) and the call is refused, instead of escaping.

Operations on a link itself (:meth:`~LocalFileService.read_link`, :meth:`~LocalFileService.remove`,
:meth:`~LocalFileService.rename`) resolve only the parent and act on the final name. Other local
processes can still move a directory *out of* the root while an operation holds it open; that is
outside what a path check can prevent (run the worker in a container for a hard boundary).

Writes and versions
-------------------
A *version token* is ``"<mtime_ns>-<ctime_ns>-<size>-<inode>"`` in hex; any change through this
service or outside it changes it (``ctime`` cannot be set by unprivileged programs).

:meth:`~LocalFileService.write` stages the data in a hidden temporary file in the destination's
own directory (``.gl-<random>.tmp``, mode 0600 until published), verifies the staged length and the
expected digests, ``fsync``\\ s it, then publishes atomically: ``exclusive`` publishes with
``link(tmp, dst)`` (fails if ``dst`` exists, even against other programs) and unlinks the staged
name; otherwise ``rename(tmp, dst)`` replaces ``dst``. ``if_match`` re-reads the destination's
version under a per-path lock (shared by every service object of this process) immediately before
the rename. **Remaining window**: a program that is not this service can still change ``dst``
between that re-check and the rename (microseconds); garcon_link writers cannot. Any failure removes
the staged file, so a destination is either the old file or the complete new one, never partial.
New files get mode ``0o644`` (or ``mode``); replacing keeps the old file's permission bits unless
``mode`` is given -- except setuid, setgid and sticky, which are always dropped (the new content
is the caller's and is owned by the worker's user: keeping a set-id bit would publish a set-id
program someone else wrote). A ``mode`` that sets one of them is refused (``PERMISSION_DENIED``)
unless the service was built with ``allow_special_mode_bits=True`` (``garcon-link worker
--allow-special-mode-bits``). The same rules hold for uploads. The parent directory is
``fsync``\\ ed after publishing.

Large files move with bounded memory in chunks: :meth:`~LocalFileService.begin_upload` returns a
scoped ``"upload"`` resource reference, :meth:`~LocalFileService.upload_chunk` appends in order
(idempotent under replay: the caller passes each chunk's offset; a repeated range is ignored, a gap
is refused), :meth:`~LocalFileService.commit_upload` verifies size and digests (computed
incrementally while receiving) and publishes exactly as ``write`` does. A failed commit discards
the upload. Reading is bounded the same way: :meth:`~LocalFileService.read` by offset, or
:meth:`~LocalFileService.read_stream` (a credit-controlled remote stream).

Resumable uploads
-----------------
:func:`~garcon_link.services.builtin_services` serves one file service per worker
(``Service(..., scope="worker")``), so an unfinished upload belongs to the worker,
not to the logical session that began it: its handle carries the worker's runtime id, stays valid
across session replacement and controller restarts, and is ``StaleResource`` after the worker
restarts. :meth:`~LocalFileService.upload_status` tells a caller whose chunk ended
``OutcomeUnknown`` (or that reconnected) where to continue: ``received`` counts the bytes written
to the staged file, in order, and the digests always cover exactly those bytes (both are updated
in the thread that writes, under the upload's lock). A resent range already received is ignored
without being compared with what was received -- comparing would read the staged bytes back on
every replay; the commit's expected digests are what verify the content.

Bounds: ``ServiceLimits.max_uploads`` unfinished uploads per worker (each holds a staged file and
two descriptors); an upload with no call on its handle for ``ServiceLimits.upload_idle_timeout``
is discarded at the next upload call (``begin_upload``, ``upload_chunk``, ``upload_status``,
``commit_upload``) and its handle gets ``UNKNOWN_UPLOAD``; an upload being written to is never
idle. Closing the service (the worker stopping) discards every unfinished upload.

Threads and shutdown
--------------------
Blocking calls run in threads. Read-only work (every read, listing, ``stat`` and the check
step) runs in daemon threads that a cancelled call abandons at once, so neither a call's
cancellation, nor the end of a session, nor a SIGTERM'd worker waits for a read stuck in the OS
(a hung network file system); at most ``ServiceLimits.max_reader_threads`` such threads live at
once (then ``OVERLOADED``). Work that changes files is waited for, so a call never returns
while its change is still being made; each step is bounded, and a recursive removal stops at a
cancellation between entries. Long scans check between entries whether their caller left.

Errors
------
Refusals are :class:`~garcon_link.Rejected` (nothing was changed): ``INVALID_PATH``,
``PERMISSION_DENIED`` (confinement or the OS), ``NOT_FOUND``, ``ALREADY_EXISTS``,
``NOT_A_DIRECTORY``, ``IS_A_DIRECTORY``, ``NOT_A_FILE``, ``NOT_A_SYMLINK``,
``DIRECTORY_NOT_EMPTY``, ``VERSION_MISMATCH``, ``DIGEST_MISMATCH``, ``SIZE_MISMATCH``,
``UPLOAD_GAP``, ``UNKNOWN_UPLOAD``, ``TOO_MANY_UPLOADS``, ``INVALID_ARGUMENTS``, ``OVERLOADED``.
Failures while acting are :class:`~garcon_link.RemoteError`: ``IO_ERROR``, ``NO_SPACE``.
Messages name the caller's path, never the worker's real path: an OS error is shown by its
``strerror`` only.

This module is the service's face: the interface and :class:`LocalFileService`. Its parts live
beside it: the values and version tokens in ``_file_values.py``, the path policy
(:class:`ConfinedRoot`) in ``_confined.py``, the threads in ``_threads.py``, staging,
publishing and upload state in ``_staging.py``, and :class:`ServiceLimits` (shared with
:mod:`garcon_link.services.process`) in ``_limits.py``; the public names are importable from
here. POSIX only (``openat``/``O_NOFOLLOW``/``dir_fd``); Linux
is tested.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import logging
import os
import stat as stat_mod
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import blake3

from ..errors import Rejected, RemoteError
from ..logs import peer_text
from ..rpc.resources import ResourceRef, ServiceScope, current_scope
from ._confined import _DIR_FLAGS, MAX_NAME_BYTES, ConfinedRoot, _denied, _is_link, _os_errors
from ._file_values import (
    DirEntry,
    DirPage,
    FileKind,
    FileStat,
    ReadChunk,
    UploadStatus,
    _file_stat,
    _kind,
    version_token,
)
from ._limits import KiB, MiB, ServiceLimits
from ._staging import (
    _check_digest_args,
    _check_mode,
    _discard,
    _publish,
    _publish_lock,
    _stage,
    _Upload,
    _verify_digests,
    _write_all,
)
from ._threads import _attached, _checkpoint, _detached, _remove_tree, _SharedFd

__all__ = [
    "DirEntry",
    "DirPage",
    "FileKind",
    "FileService",
    "FileStat",
    "LocalFileService",
    "ReadChunk",
    "ServiceLimits",
    "UploadStatus",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


# ---------------------------------------------------------------------------- interface


class FileService(Protocol):
    """Files under the worker's configured root; ``/`` is the root (see the module docstring)."""

    async def stat(self, path: str) -> FileStat:
        """Describe ``path`` (following symlinks inside the root).

        Raises:
            Rejected: ``NOT_FOUND``, ``PERMISSION_DENIED`` (escapes the root), ``INVALID_PATH``.
        """
        ...

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists. A path that escapes the root is refused, not ``False``."""
        ...

    async def canonical_path(self, path: str) -> str:
        """``path`` with symlinks resolved, in the caller's namespace (need not exist)."""
        ...

    async def read_link(self, path: str) -> str:
        """The target of symlink ``path``: a relative target as stored, an absolute one in the
        caller's namespace. A target outside the root is refused (``PERMISSION_DENIED``)."""
        ...

    async def list_dir(self, path: str, after: str | None = None, limit: int = 1000) -> DirPage:
        """Up to ``limit`` entries of directory ``path`` with names sorted after ``after``."""
        ...

    async def read(self, path: str, offset: int = 0, max_bytes: int = 1 * MiB) -> ReadChunk:
        """Up to ``max_bytes`` (capped by ``ServiceLimits.max_read_bytes``) from ``offset``."""
        ...

    def read_stream(self, path: str, chunk_size: int = 256 * KiB) -> AsyncIterator[bytes]:
        """The whole file as a stream of chunks (bounded memory on both sides)."""
        ...

    async def mkdir(self, path: str, parents: bool = False) -> FileStat:
        """Create directory ``path``; ``parents`` creates missing parents and accepts an
        existing directory (``mkdir -p``)."""
        ...

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, symlink (not its target) or empty directory; ``recursive`` removes a
        directory tree (a partial failure raises ``RemoteError("IO_ERROR")``)."""
        ...

    async def rename(self, src: str, dst: str) -> FileStat:
        """Atomically rename ``src`` to ``dst`` (POSIX semantics: an existing file ``dst`` is
        replaced). Symlinks are moved, not followed."""
        ...

    async def write(
        self,
        path: str,
        data: bytes,
        expected_sha256: str | None = None,
        expected_blake3: str | None = None,
        if_match: str | None = None,
        exclusive: bool = False,
        mode: int | None = None,
    ) -> FileStat:
        """Atomically replace (or create) ``path`` with ``data``; see the module docstring.

        Args:
            expected_sha256, expected_blake3: hex digests ``data`` must have.
            if_match: publish only if the current version token equals this.
            exclusive: publish only if ``path`` does not exist (atomic ``link``).
            mode: permission bits (``0``-``0o777``; setuid/setgid/sticky only where the worker
                allows them). Without it a replaced file keeps its bits minus those three.

        Raises:
            Rejected: ``DIGEST_MISMATCH``, ``VERSION_MISMATCH``, ``ALREADY_EXISTS``, ... -- the
                destination is unchanged.
        """
        ...

    async def begin_upload(
        self,
        path: str,
        size: int | None = None,
        if_match: str | None = None,
        exclusive: bool = False,
        mode: int | None = None,
    ) -> ResourceRef:
        """Start a chunked upload to ``path``; returns an ``"upload"`` reference.

        ``size`` (optional) is checked at commit; ``if_match``/``exclusive`` are checked now
        (early refusal) and again atomically at commit. The upload belongs to the worker: its
        handle stays valid across session replacement and controller restarts, until it is
        committed, aborted, idle for ``ServiceLimits.upload_idle_timeout`` or the worker stops.

        Raises:
            Rejected: ``TOO_MANY_UPLOADS`` (``ServiceLimits.max_uploads`` per worker), or a
                refusal of the path as for ``write``.
        """
        ...

    async def upload_chunk(self, handle: ResourceRef, offset: int, data: bytes) -> int:
        """Append ``data`` that starts at byte ``offset``; returns the bytes received so far.

        A range already received is ignored, not compared (replay-safe: resending a chunk
        whose reply was lost is harmless); ``offset`` beyond the bytes received is refused with
        ``UPLOAD_GAP`` (ask :meth:`upload_status` where to continue).
        """
        ...

    async def upload_status(self, handle: ResourceRef) -> UploadStatus:
        """Where the upload stands: resume with ``upload_chunk(handle, status.received, ...)``.

        For a caller whose ``upload_chunk`` ended ``OutcomeUnknown`` (the chunk may or may not
        have been written), or that lost its session or restarted. Counts as activity for
        ``ServiceLimits.upload_idle_timeout``.

        Raises:
            Rejected: ``UNKNOWN_UPLOAD`` -- committed, aborted, expired or never begun.
            StaleResource: the worker restarted since the upload began (it was discarded).
        """
        ...

    async def commit_upload(
        self,
        handle: ResourceRef,
        expected_sha256: str | None = None,
        expected_blake3: str | None = None,
    ) -> FileStat:
        """Verify and publish the upload; any failure discards it (the destination stays)."""
        ...

    async def abort_upload(self, handle: ResourceRef) -> None:
        """Discard the upload and its staged file (idempotent)."""
        ...


# ---------------------------------------------------------------------------- implementation


class LocalFileService:
    """:class:`FileService` on the local file system, confined to ``root``.

    Blocking file system calls run in threads: read-only work in daemon threads a cancelled
    call abandons, changes in threads the call waits for (see ``_threads.py``). Every path is
    checked against the path bounds before any of it runs. Upload handles are
    minted in ``scope`` if given, else in :func:`~garcon_link.current_scope` at call time:
    served as ``gl.Service(impl, FileService, scope="worker")`` (what
    :func:`~garcon_link.services.builtin_services` does) that is the worker's scope, so
    unfinished uploads outlive sessions. Use ``async with`` (or :meth:`aclose`) to discard
    unfinished uploads. Expose it through ``gl.Service`` so only the interface is callable.

    One class, although a long one, because it is one interface of 16 methods, each a short
    composition of the same parts: the path check (``_confined.py``), the two kinds of thread
    (``_threads.py``) and staging and publishing (``_staging.py``); the upload table stays
    here because every upload method reads and changes it under the upload's lock.

    Args:
        root: the directory that is ``/`` for callers.
        scope: the service scope handles belong to (``None``: the caller's at call time).
        limits: bounds (:class:`ServiceLimits`).
        allow_special_mode_bits: accept a ``mode`` with setuid, setgid or sticky bits (refused
            with ``PERMISSION_DENIED`` by default). Replacing a file without ``mode`` never keeps
            these bits either way.
        clock: monotonic seconds, for ``ServiceLimits.upload_idle_timeout`` (injectable for
            tests).

    Raises:
        ConfigError: ``root`` is not an existing directory.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        scope: ServiceScope | None = None,
        limits: ServiceLimits | None = None,
        allow_special_mode_bits: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits or ServiceLimits()
        self._clock = clock
        self.root = ConfinedRoot(root, self.limits)
        self.allow_special_mode_bits = allow_special_mode_bits
        self._scope = scope
        self._uploads: dict[str, _Upload] = {}
        self._next_upload = 1
        self._closed = False

    async def __aenter__(self) -> LocalFileService:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Discard every unfinished upload (idempotent)."""
        self._closed = True
        uploads = list(self._uploads.values())
        self._uploads.clear()
        for upload in uploads:
            # Under the upload's lock: a chunk being written in a thread must finish before its
            # descriptor is closed (a reused descriptor number would receive the rest).
            async with upload.lock:
                upload.discard()

    def _current_scope(self) -> ServiceScope:
        return self._scope if self._scope is not None else current_scope()

    async def _reading(
        self,
        shown: str,
        func: Callable[[], _T],
        discard: Callable[[_T], None] | None = None,
    ) -> _T:
        """Run read-only ``func`` detached; OS errors name only the caller's path ``shown``."""

        def job() -> _T:
            with _os_errors(shown):
                return func()

        return await _detached(job, self.limits.max_reader_threads, discard)

    async def _changing(self, shown: str, func: Callable[[], _T]) -> _T:
        """Run ``func``, which changes files, attached; OS errors name only ``shown``."""

        def job() -> _T:
            with _os_errors(shown):
                return func()

        return await _attached(job)

    async def _resolve(self, path: str, *, follow_final: bool = True) -> tuple[str, ...]:
        """The check step (``realpath`` touches the disk: run it off the event loop)."""
        self.root.split(path)  # the bounds first, on the loop: a hostile path costs nothing more
        return await self._reading(path, lambda: self.root.resolve(path, follow_final=follow_final))

    def _check(self, path: str, *, follow_final: bool = True) -> tuple[str, ...]:
        """The check step inside a job that goes on to use the path (one thread hop)."""
        return self.root.resolve(path, follow_final=follow_final)

    # -- reading

    async def stat(self, path: str) -> FileStat:
        self.root.split(path)
        return await self._reading(path, lambda: self._stat_sync(self._check(path), path))

    def _lstat_final(self, parts: tuple[str, ...], shown: str) -> os.stat_result:
        """lstat of resolved ``parts``; a symlink here was swapped in after the check."""
        if not parts:
            fd = self.root.open_dir((), shown)
            try:
                return os.fstat(fd)
            finally:
                os.close(fd)
        with self.root.parent(parts, shown) as (dir_fd, name):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat_mod.S_ISLNK(st.st_mode):
            raise _denied(shown, "a symlink appeared in the path")
        return st

    def _stat_sync(self, parts: tuple[str, ...], shown: str) -> FileStat:
        with _os_errors(shown):
            return _file_stat(self.root.caller_path(parts), self._lstat_final(parts, shown))

    async def exists(self, path: str) -> bool:
        self.root.split(path)

        def check() -> bool:
            parts = self._check(path)
            try:
                self._stat_sync(parts, path)
            except Rejected as exc:
                if exc.code in ("NOT_FOUND", "NOT_A_DIRECTORY"):
                    return False
                raise
            return True

        return await self._reading(path, check)

    async def canonical_path(self, path: str) -> str:
        return self.root.caller_path(await self._resolve(path))

    async def read_link(self, path: str) -> str:
        self.root.split(path)

        def read() -> str:
            parts = self._check(path, follow_final=False)
            with self.root.parent(parts, path) as (dir_fd, name):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat_mod.S_ISLNK(st.st_mode):
                    raise Rejected("NOT_A_SYMLINK", f"{path}: is not a symlink")
                target = os.readlink(name, dir_fd=dir_fd)
            lexical = os.path.normpath(os.path.join(self.root.host_path(parts[:-1]), target))
            inside = self.root.inside(lexical)
            if inside is None:
                raise _denied(path, "the link points outside the root")
            return self.root.caller_path(inside) if os.path.isabs(target) else target

        return await self._reading(path, read)

    async def list_dir(self, path: str, after: str | None = None, limit: int = 1000) -> DirPage:
        if not 1 <= limit <= self.limits.max_list_entries:
            raise Rejected(
                "INVALID_ARGUMENTS", f"limit must be within 1..{self.limits.max_list_entries}"
            )
        if after is not None and len(after) > MAX_NAME_BYTES:
            raise Rejected("INVALID_ARGUMENTS", f"after is a name: at most {MAX_NAME_BYTES} bytes")
        self.root.split(path)

        def listing() -> DirPage:
            parts = self._check(path)
            dir_fd = self.root.open_dir(parts, path)
            try:
                fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            undecodable = 0

            def candidates() -> Iterator[tuple[str, os.DirEntry[str]]]:
                nonlocal undecodable
                with os.scandir(fd) as it:
                    for count, entry in enumerate(it):
                        if count % 1024 == 0:
                            _checkpoint()
                        try:
                            entry.name.encode("utf-8")
                        except UnicodeEncodeError:
                            undecodable += 1
                            continue
                        if after is None or entry.name > after:
                            yield entry.name, entry

            try:
                # Only the first limit + 1 names are kept: a huge directory costs time (scanned
                # with checkpoints), never memory.
                entries = heapq.nsmallest(limit + 1, candidates(), key=lambda e: e[0])
                page: list[DirEntry] = []
                for name, entry in entries[:limit]:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while listing
                    page.append(DirEntry(name, _kind(st.st_mode), st.st_size, st.st_mtime))
            finally:
                os.close(fd)
            next_after = entries[limit - 1][0] if len(entries) > limit else None
            return DirPage(self.root.caller_path(parts), page, next_after, undecodable)

        return await self._reading(path, listing)

    def _open_file(self, parts: tuple[str, ...], shown: str) -> tuple[int, os.stat_result]:
        """Open a regular file for reading without following a swapped-in symlink."""
        with self.root.parent(parts, shown) as (dir_fd, name):
            fd = os.open(
                name,
                os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                dir_fd=dir_fd,
            )
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise Rejected("IS_A_DIRECTORY", f"{shown}: is a directory")
            if not stat_mod.S_ISREG(st.st_mode):
                raise Rejected("NOT_A_FILE", f"{shown}: is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    async def read(self, path: str, offset: int = 0, max_bytes: int = 1 * MiB) -> ReadChunk:
        if offset < 0 or max_bytes < 1:
            raise Rejected("INVALID_ARGUMENTS", "offset must be >= 0 and max_bytes >= 1")
        max_bytes = min(max_bytes, self.limits.max_read_bytes)
        self.root.split(path)

        def read() -> ReadChunk:
            parts = self._check(path)
            fd, st = self._open_file(parts, path)
            try:
                data = os.pread(fd, max_bytes, offset) if offset < st.st_size else b""
            finally:
                os.close(fd)
            end = offset + len(data)
            return ReadChunk(
                self.root.caller_path(parts),
                offset,
                data,
                st.st_size,
                version_token(st),
                end >= st.st_size,
            )

        return await self._reading(path, read)

    async def read_stream(self, path: str, chunk_size: int = 256 * KiB) -> AsyncIterator[bytes]:
        if chunk_size < 1:
            raise Rejected("INVALID_ARGUMENTS", "chunk_size must be >= 1")
        chunk_size = min(chunk_size, self.limits.max_read_bytes)
        self.root.split(path)

        def open_() -> _SharedFd:
            return _SharedFd(self._open_file(self._check(path), path)[0])

        shared = await self._reading(path, open_, discard=_SharedFd.close)
        try:
            offset = 0
            while True:

                def read_at(at: int = offset) -> bytes:
                    with shared.use() as fd:
                        return os.pread(fd, chunk_size, at)

                data = await self._reading(path, read_at)
                if not data:
                    return
                offset += len(data)
                yield data
        finally:
            shared.close()

    # -- changing

    async def mkdir(self, path: str, parents: bool = False) -> FileStat:
        parts = await self._resolve(path)

        def make() -> FileStat:
            if not parts:
                if parents:
                    return self._stat_sync(parts, path)
                raise Rejected("ALREADY_EXISTS", f"{path}: already exists")
            with _os_errors(path):
                fd = self.root.open_dir((), path)
                try:
                    for i, name in enumerate(parts):
                        last = i == len(parts) - 1
                        if last and not parents:
                            os.mkdir(name, 0o755, dir_fd=fd)
                        elif parents:
                            with contextlib.suppress(FileExistsError):
                                os.mkdir(name, 0o755, dir_fd=fd)
                        try:
                            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                        except OSError as exc:
                            if _is_link(name, fd):
                                raise _denied(path, "a symlink appeared in the path") from exc
                            raise
                        os.close(fd)
                        fd = nfd
                    return _file_stat(self.root.caller_path(parts), os.fstat(fd))
                finally:
                    os.close(fd)

        return await self._changing(path, make)

    async def remove(self, path: str, recursive: bool = False) -> None:
        parts = await self._resolve(path, follow_final=False)

        def remove() -> None:
            with _os_errors(path), self.root.parent(parts, path) as (dir_fd, name):
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if not stat_mod.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=dir_fd)
                elif not recursive:
                    os.rmdir(name, dir_fd=dir_fd)
                else:
                    try:
                        _remove_tree(dir_fd, name)
                    except OSError as exc:
                        why = os.strerror(exc.errno) if exc.errno else type(exc).__name__
                        raise RemoteError(
                            "IO_ERROR", f"{path}: recursive removal stopped part-way: {why}"
                        ) from None

        await self._changing(path, remove)

    async def rename(self, src: str, dst: str) -> FileStat:
        src_parts = await self._resolve(src, follow_final=False)
        dst_parts = await self._resolve(dst, follow_final=False)

        def rename() -> FileStat:
            with (
                _os_errors(f"{src} -> {dst}"),
                self.root.parent(src_parts, src) as (src_fd, src_name),
                self.root.parent(dst_parts, dst) as (dst_fd, dst_name),
                _publish_lock(self.root.host_path(dst_parts)),
            ):
                os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                st = os.stat(dst_name, dir_fd=dst_fd, follow_symlinks=False)
                return _file_stat(self.root.caller_path(dst_parts), st)

        return await self._changing(f"{src} -> {dst}", rename)

    async def write(
        self,
        path: str,
        data: bytes,
        expected_sha256: str | None = None,
        expected_blake3: str | None = None,
        if_match: str | None = None,
        exclusive: bool = False,
        mode: int | None = None,
    ) -> FileStat:
        _check_digest_args(expected_sha256, expected_blake3)
        _check_mode(mode, allow_special=self.allow_special_mode_bits)
        if exclusive and if_match is not None:
            raise Rejected("INVALID_ARGUMENTS", "exclusive and if_match exclude each other")
        parts = await self._resolve(path)

        def write() -> FileStat:
            # Verify before touching the disk: a mismatch leaves everything as it was.
            _verify_digests(
                path,
                expected_sha256,
                expected_blake3,
                hashlib.sha256(data).hexdigest() if expected_sha256 is not None else "",
                blake3.blake3(data).hexdigest() if expected_blake3 is not None else "",
            )
            with _os_errors(path), self.root.parent(parts, path) as (dir_fd, name):
                fd, staged = _stage(dir_fd)
                try:
                    _write_all(fd, data, 0)
                    if os.fstat(fd).st_size != len(data):
                        raise RemoteError("IO_ERROR", f"{path}: staged size differs")
                    return _publish(
                        self.root,
                        parts,
                        path,
                        dir_fd,
                        name,
                        fd,
                        staged,
                        if_match=if_match,
                        exclusive=exclusive,
                        mode=mode,
                    )
                finally:
                    os.close(fd)
                    _discard(dir_fd, staged)  # no-op once published

        return await self._changing(path, write)

    # -- uploads

    async def begin_upload(
        self,
        path: str,
        size: int | None = None,
        if_match: str | None = None,
        exclusive: bool = False,
        mode: int | None = None,
    ) -> ResourceRef:
        _check_mode(mode, allow_special=self.allow_special_mode_bits)
        if size is not None and size < 0:
            raise Rejected("INVALID_ARGUMENTS", "size must be >= 0")
        if exclusive and if_match is not None:
            raise Rejected("INVALID_ARGUMENTS", "exclusive and if_match exclude each other")
        if self._closed:
            raise Rejected("SHUTTING_DOWN", "the file service is closed")
        await self._expire_idle()
        if len(self._uploads) >= self.limits.max_uploads:
            raise Rejected(
                "TOO_MANY_UPLOADS", f"{self.limits.max_uploads} uploads are already open"
            )
        scope = self._current_scope()
        parts = await self._resolve(path)

        def begin() -> tuple[int, tuple[int, int], int, str]:
            with _os_errors(path):
                if not parts:
                    raise Rejected("IS_A_DIRECTORY", f"{path}: is a directory")
                dir_fd = self.root.open_dir(parts[:-1], path)
                try:
                    name = parts[-1]
                    try:
                        current: os.stat_result | None = os.stat(
                            name, dir_fd=dir_fd, follow_symlinks=False
                        )
                    except FileNotFoundError:
                        current = None
                    if current is not None and stat_mod.S_ISDIR(current.st_mode):
                        raise Rejected("IS_A_DIRECTORY", f"{path}: is a directory")
                    if exclusive and current is not None:
                        raise Rejected("ALREADY_EXISTS", f"{path}: already exists")
                    if if_match is not None and (
                        current is None or version_token(current) != if_match
                    ):
                        raise Rejected("VERSION_MISMATCH", f"{path}: version is not {if_match}")
                    dir_st = os.fstat(dir_fd)
                    fd, staged = _stage(dir_fd)
                except BaseException:
                    os.close(dir_fd)
                    raise
                return dir_fd, (dir_st.st_dev, dir_st.st_ino), fd, staged

        dir_fd, dir_id, fd, staged = await self._changing(path, begin)
        upload = _Upload(
            parts,
            path,
            dir_fd,
            dir_id,
            fd,
            staged,
            size=size,
            if_match=if_match,
            exclusive=exclusive,
            mode=mode,
            now=self._clock(),
        )
        if self._closed or len(self._uploads) >= self.limits.max_uploads:
            upload.discard()
            raise Rejected("TOO_MANY_UPLOADS", "the upload limit was reached meanwhile")
        upload_id = f"u{self._next_upload}"
        self._next_upload += 1
        self._uploads[upload_id] = upload
        return scope.resource("upload", upload_id)

    async def _expire_idle(self) -> None:
        """Discard uploads idle longer than ``upload_idle_timeout`` (checked at upload calls).

        An upload whose lock is held is in use (a chunk being written, a commit), never idle.
        """
        cutoff = self._clock() - self.limits.upload_idle_timeout
        expired = [
            (upload_id, upload)
            for upload_id, upload in self._uploads.items()
            if upload.touched < cutoff and not upload.lock.locked()
        ]
        for upload_id, upload in expired:
            if self._uploads.get(upload_id) is upload:
                del self._uploads[upload_id]
                log.info("discarding upload %s to %s: idle", upload_id, peer_text(upload.shown))
                async with upload.lock:
                    upload.discard()

    async def _upload(self, handle: ResourceRef) -> tuple[str, _Upload]:
        """The live upload ``handle`` names (after expiring idle ones), touched now."""
        upload_id = self._current_scope().check(handle, "upload")
        await self._expire_idle()
        upload = self._uploads.get(upload_id)
        if upload is None:
            raise Rejected(
                "UNKNOWN_UPLOAD", f"{handle!r} was committed, aborted, expired or never existed"
            )
        upload.touched = self._clock()
        return upload_id, upload

    async def upload_status(self, handle: ResourceRef) -> UploadStatus:
        upload_id, upload = await self._upload(handle)
        # Under the lock: a chunk being written now is either counted whole or not at all.
        async with upload.lock:
            if self._uploads.get(upload_id) is not upload:
                raise Rejected("UNKNOWN_UPLOAD", f"{handle!r} was committed or aborted")
            return UploadStatus(upload.shown, upload.received, upload.size)

    async def upload_chunk(self, handle: ResourceRef, offset: int, data: bytes) -> int:
        upload_id, upload = await self._upload(handle)
        if offset < 0:
            raise Rejected("INVALID_ARGUMENTS", "offset must be >= 0")
        async with upload.lock:
            if self._uploads.get(upload_id) is not upload:
                raise Rejected("UNKNOWN_UPLOAD", f"{handle!r} was committed or aborted")
            if offset > upload.received:
                raise Rejected(
                    "UPLOAD_GAP", f"chunk starts at {offset}, but {upload.received} bytes arrived"
                )
            new = memoryview(data)[upload.received - offset :]
            if not new:
                return upload.received
            if upload.size is not None and upload.received + len(new) > upload.size:
                raise Rejected(
                    "SIZE_MISMATCH", f"{upload.shown}: more than the declared {upload.size} bytes"
                )

            def append() -> None:
                with _os_errors(upload.shown):
                    _write_all(upload.fd, new, upload.received)
                # Together with the write, in the thread: ``received`` and the digests never
                # disagree with the staged bytes, whatever happens to the awaiting call.
                upload.sha256.update(new)
                upload.blake3.update(new)
                upload.received += len(new)

            await self._changing(upload.shown, append)
            upload.touched = self._clock()
            return upload.received

    async def commit_upload(
        self,
        handle: ResourceRef,
        expected_sha256: str | None = None,
        expected_blake3: str | None = None,
    ) -> FileStat:
        _check_digest_args(expected_sha256, expected_blake3)
        upload_id, upload = await self._upload(handle)
        async with upload.lock:
            if self._uploads.pop(upload_id, None) is not upload:
                raise Rejected("UNKNOWN_UPLOAD", f"{handle!r} was committed or aborted")

            def commit() -> FileStat:
                try:
                    if upload.size is not None and upload.received != upload.size:
                        raise Rejected(
                            "SIZE_MISMATCH",
                            f"{upload.shown}: received {upload.received} of {upload.size} bytes",
                        )
                    _verify_digests(
                        upload.shown,
                        expected_sha256,
                        expected_blake3,
                        upload.sha256.hexdigest(),
                        upload.blake3.hexdigest(),
                    )
                    with _os_errors(upload.shown):
                        if os.fstat(upload.fd).st_size != upload.received:
                            raise RemoteError("IO_ERROR", f"{upload.shown}: staged size differs")
                        # The destination must still be the directory the upload started in.
                        parts = self.root.resolve(upload.shown)
                        fd = self.root.open_dir(parts[:-1], upload.shown)
                        try:
                            st = os.fstat(fd)
                        finally:
                            os.close(fd)
                        if (st.st_dev, st.st_ino) != upload.dir_id:
                            raise _denied(upload.shown, "the directory changed during the upload")
                        return _publish(
                            self.root,
                            parts,
                            upload.shown,
                            upload.dir_fd,
                            parts[-1],
                            upload.fd,
                            upload.staged,
                            if_match=upload.if_match,
                            exclusive=upload.exclusive,
                            mode=upload.mode,
                        )
                finally:
                    upload.discard()

            return await self._changing(upload.shown, commit)

    async def abort_upload(self, handle: ResourceRef) -> None:
        upload_id = self._current_scope().check(handle, "upload")
        upload = self._uploads.pop(upload_id, None)
        if upload is not None:
            async with upload.lock:
                upload.discard()


if TYPE_CHECKING:  # static conformance check: the implementation matches its interface

    def _conforms(service: LocalFileService) -> FileService:
        return service
