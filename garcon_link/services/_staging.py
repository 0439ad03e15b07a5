"""Writes of the file service: version tokens, argument checks, staged files and their atomic
publication, and the state of one unfinished upload (the rules are in
:mod:`garcon_link.services.files`)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat as stat_mod
import threading

import anyio
import blake3

from ..errors import Rejected
from ._confined import ConfinedRoot, _denied
from ._file_values import FileStat, _file_stat, version_token

# Per-path publish locks shared by every LocalFileService of this process (striped: bounded).
_PUBLISH_LOCKS = tuple(threading.Lock() for _ in range(64))


def _publish_lock(host_path: str) -> threading.Lock:
    return _PUBLISH_LOCKS[hash(host_path) % len(_PUBLISH_LOCKS)]


def _check_digest_args(sha256: str | None, blake3_hex: str | None) -> None:
    for name, value in (("expected_sha256", sha256), ("expected_blake3", blake3_hex)):
        if value is not None and (
            len(value) != 64 or any(c not in "0123456789abcdefABCDEF" for c in value)
        ):
            raise Rejected("INVALID_ARGUMENTS", f"{name} must be 64 hex digits")


_SPECIAL_BITS = stat_mod.S_ISUID | stat_mod.S_ISGID | stat_mod.S_ISVTX


def _check_mode(mode: int | None, *, allow_special: bool) -> None:
    """Refuse a mode outside ``0..0o7777``, or with setuid/setgid/sticky unless allowed."""
    if mode is None:
        return
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise Rejected("INVALID_ARGUMENTS", f"mode must be an integer, got {type(mode).__name__}")
    if not 0 <= mode <= 0o7777:
        raise Rejected("INVALID_ARGUMENTS", f"mode must be within 0..0o7777, got {mode:#o}")
    if mode & _SPECIAL_BITS and not allow_special:
        raise Rejected(
            "PERMISSION_DENIED",
            f"mode {mode:#o} sets setuid, setgid or sticky bits, which this worker does not "
            "allow (allow_special_mode_bits)",
        )


def _verify_digests(
    path: str,
    sha256: str | None,
    blake3_hex: str | None,
    actual_sha256: str,
    actual_blake3: str,
) -> None:
    if sha256 is not None and sha256.lower() != actual_sha256:
        raise Rejected("DIGEST_MISMATCH", f"{path}: sha256 is {actual_sha256}, expected {sha256}")
    if blake3_hex is not None and blake3_hex.lower() != actual_blake3:
        raise Rejected(
            "DIGEST_MISMATCH", f"{path}: blake3 is {actual_blake3}, expected {blake3_hex}"
        )


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _stage(dir_fd: int) -> tuple[int, str]:
    """Create a hidden staged file in ``dir_fd``; returns ``(fd, name)``."""
    for _ in range(8):
        name = f".gl-{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
        except FileExistsError:
            continue
        return fd, name
    raise FileExistsError(errno.EEXIST, "could not create a unique staging file")


def _discard(dir_fd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _fsync_dir(dir_fd: int) -> None:
    # An O_PATH descriptor cannot be fsync'ed: open the directory itself for reading.
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _publish(
    root: ConfinedRoot,
    parts: tuple[str, ...],
    shown: str,
    dir_fd: int,
    name: str,
    staged_fd: int,
    staged: str,
    *,
    if_match: str | None,
    exclusive: bool,
    mode: int | None,
) -> FileStat:
    """Publish a staged, verified file as ``name`` in ``dir_fd`` (see
    :mod:`garcon_link.services.files`)."""
    try:
        current: os.stat_result | None = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        current = None
    if current is not None:
        if stat_mod.S_ISLNK(current.st_mode):
            raise _denied(shown, "a symlink appeared at the destination")
        if stat_mod.S_ISDIR(current.st_mode):
            raise Rejected("IS_A_DIRECTORY", f"{shown}: is a directory")
    if mode is None:
        # Keep the old permission bits, but never setuid/setgid/sticky: the new content is
        # the caller's, owned by the worker's user; keeping the bit would publish a set-id
        # program the caller wrote (only an explicit, allowed ``mode`` sets these bits).
        mode = stat_mod.S_IMODE(current.st_mode) & ~_SPECIAL_BITS if current is not None else 0o644
    os.fchmod(staged_fd, mode)
    os.fsync(staged_fd)
    with _publish_lock(root.host_path(parts)):
        if exclusive:
            try:
                os.link(staged, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                raise Rejected("ALREADY_EXISTS", f"{shown}: already exists") from None
            except OSError as exc:
                if exc.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
                    raise Rejected(
                        "EXCLUSIVE_UNSUPPORTED",
                        f"{shown}: the file system cannot publish exclusively (no hard links)",
                    ) from exc
                raise
            _discard(dir_fd, staged)
        else:
            if if_match is not None:
                try:
                    latest = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    raise Rejected(
                        "VERSION_MISMATCH", f"{shown}: does not exist (expected {if_match})"
                    ) from None
                if version_token(latest) != if_match or stat_mod.S_ISLNK(latest.st_mode):
                    raise Rejected(
                        "VERSION_MISMATCH",
                        f"{shown}: version is {version_token(latest)}, expected {if_match}",
                    )
            os.replace(staged, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    _fsync_dir(dir_fd)
    return _file_stat(root.caller_path(parts), os.fstat(staged_fd))


# ---------------------------------------------------------------------------- uploads


class _Upload:
    __slots__ = (
        "blake3",
        "dir_fd",
        "dir_id",
        "exclusive",
        "fd",
        "if_match",
        "lock",
        "mode",
        "parts",
        "received",
        "sha256",
        "shown",
        "size",
        "staged",
        "touched",
    )

    def __init__(
        self,
        parts: tuple[str, ...],
        shown: str,
        dir_fd: int,
        dir_id: tuple[int, int],
        fd: int,
        staged: str,
        *,
        size: int | None,
        if_match: str | None,
        exclusive: bool,
        mode: int | None,
        now: float,
    ) -> None:
        self.parts = parts
        self.shown = shown
        self.dir_fd = dir_fd
        self.dir_id = dir_id
        self.fd = fd
        self.staged = staged
        self.size = size
        self.if_match = if_match
        self.exclusive = exclusive
        self.mode = mode
        self.received = 0
        self.sha256 = hashlib.sha256()
        self.blake3 = blake3.blake3()
        self.lock = anyio.Lock()
        self.touched = now
        """When a call last used this upload (the service's clock): for the idle timeout."""

    def discard(self) -> None:
        """Remove the staged file and close descriptors (idempotent)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        if self.dir_fd >= 0:
            _discard(self.dir_fd, self.staged)
            with contextlib.suppress(OSError):
                os.close(self.dir_fd)
            self.dir_fd = -1
