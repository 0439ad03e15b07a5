"""Path policy of the file service: caller paths checked, resolved and walked below one root
(:class:`ConfinedRoot`), and OS errors shown by the caller's path only. The rules are in
:mod:`garcon_link.services.files`."""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
from collections.abc import Iterator

from ..errors import CallError, ConfigError, Rejected, RemoteError
from ._limits import ServiceLimits

_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)
_ROOT_FLAGS = os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)

MAX_NAME_BYTES = 255
"""Longest name (one path component) in bytes, as Linux's NAME_MAX: longer is INVALID_PATH."""


def _denied(path: str, why: str) -> Rejected:
    return Rejected("PERMISSION_DENIED", f"{path}: {why}")


class ConfinedRoot:
    """Resolves caller paths to components below one root directory.

    The rules are those of :mod:`garcon_link.services.files`: bounds first, then the check
    step (:meth:`resolve`) and the use step (:meth:`open_dir`, :meth:`parent`).

    Args:
        root: the directory that is ``/`` for callers; it must exist.
        limits: the path bounds (``max_path_bytes``, ``max_path_components``).

    Raises:
        ConfigError: ``root`` is not an existing directory.
    """

    def __init__(self, root: str | os.PathLike[str], limits: ServiceLimits | None = None) -> None:
        real = os.path.realpath(os.fspath(root))
        if not os.path.isdir(real):
            raise ConfigError(f"service root {os.fspath(root)!r} is not an existing directory")
        self.host = real
        self.limits = limits or ServiceLimits()
        self._prefix = real if real.endswith("/") else real + "/"

    def split(self, path: str) -> tuple[str, ...]:
        """Validate a caller path and return its components (no resolution, no file system).

        The bounds are checked first, so a hostile path costs at most one pass over
        ``max_path_bytes`` characters here and is never resolved.

        Raises:
            Rejected: ``INVALID_PATH`` (not a string, longer than ``max_path_bytes``, more than
                ``max_path_components`` names, a name over 255 bytes, not absolute, NUL, not
                encodable), ``PERMISSION_DENIED`` (``..``).
        """
        if not isinstance(path, str):
            raise Rejected("INVALID_PATH", "a path is a string")
        limit = self.limits.max_path_bytes
        too_long = f"a path is at most {limit} bytes (ServiceLimits.max_path_bytes)"
        if len(path) > limit:  # a character is at least one byte: refuse before encoding
            raise Rejected("INVALID_PATH", f"{too_long}; this one has {len(path)} characters")
        try:
            raw = os.fsencode(path)
        except UnicodeEncodeError:
            raise Rejected("INVALID_PATH", "a path must be valid Unicode text") from None
        if len(raw) > limit:
            raise Rejected("INVALID_PATH", f"{too_long}; this one has {len(raw)}")
        if b"\0" in raw:
            raise Rejected("INVALID_PATH", "a path is a string without NUL characters")
        if not path.startswith("/"):
            raise Rejected(
                "INVALID_PATH", f"{path!r} is relative; paths are absolute and '/' is the root"
            )
        parts = tuple(p for p in path.split("/") if p not in ("", "."))
        if len(parts) > self.limits.max_path_components:
            raise Rejected(
                "INVALID_PATH",
                f"a path has at most {self.limits.max_path_components} names "
                f"(ServiceLimits.max_path_components); this one has {len(parts)}",
            )
        if any(len(name) > MAX_NAME_BYTES for name in raw.split(b"/")):
            raise Rejected("INVALID_PATH", f"a name in a path is at most {MAX_NAME_BYTES} bytes")
        if ".." in parts:
            raise _denied(path, "'..' segments are refused")
        return parts

    def caller_path(self, parts: tuple[str, ...]) -> str:
        """The caller-namespace path of resolved components."""
        return "/" + "/".join(parts)

    def host_path(self, parts: tuple[str, ...]) -> str:
        """The worker's real path of resolved components (never shown to callers)."""
        return os.path.join(self.host, *parts)

    def inside(self, host_path: str) -> tuple[str, ...] | None:
        """The components of a normalised worker path below the root, or ``None`` outside."""
        if host_path == self.host:
            return ()
        if not host_path.startswith(self._prefix):
            return None
        return tuple(host_path[len(self._prefix) :].split("/"))

    def _real_parts(self, parts: tuple[str, ...], shown: str) -> tuple[str, ...]:
        inside = self.inside(os.path.realpath(os.path.join(self.host, *parts)))
        if inside is None:
            raise _denied(shown, "resolves outside the root (symlink)")
        return inside

    def resolve(self, path: str, *, follow_final: bool = True) -> tuple[str, ...]:
        """Check step: the components of ``path`` with symlinks resolved, confined to the root.

        With ``follow_final=False`` only the parent is resolved and the final name is kept (for
        operations on a link itself).

        Raises:
            Rejected: as :meth:`split`, or ``PERMISSION_DENIED`` if resolution leaves the root,
                the path changes while it is resolved, or symlinks nest too deeply.
        """
        parts = self.split(path)
        try:
            if follow_final or not parts:
                return self._real_parts(parts, path)
            return (*self._real_parts(parts[:-1], path), parts[-1])
        except OSError:
            # realpath lstat()s a name, then readlink()s it if it was a symlink: a link replaced
            # or removed in between raises here, and the OSError names the worker's real path.
            # A path changing under the check is refused like any other unsafe path.
            raise _denied(path, "the path changed while it was being checked") from None
        except RecursionError:  # realpath recurses once per symlink it follows
            raise _denied(path, "too many levels of symbolic links") from None

    def open_dir(self, parts: tuple[str, ...], shown: str) -> int:
        """Use step: open the directory of resolved ``parts`` without following any symlink.

        Returns a file descriptor (``O_PATH`` where available) the caller must close.

        Raises:
            Rejected: a component is now a symlink (``PERMISSION_DENIED``) or not a directory.
            OSError: other failures (e.g. ``FileNotFoundError``), mapped by the caller.
        """
        fd = os.open(self.host, _ROOT_FLAGS)
        try:
            for name in parts:
                try:
                    nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _is_link(
                        name, fd
                    ):
                        raise _denied(shown, "a symlink appeared in the path") from exc
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextlib.contextmanager
    def parent(self, parts: tuple[str, ...], shown: str) -> Iterator[tuple[int, str]]:
        """``(directory fd, final name)`` of resolved, non-root ``parts``; closes the fd."""
        if not parts:
            raise _denied(shown, "not permitted on the root itself")
        fd = self.open_dir(parts[:-1], shown)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat_mod.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def _os_errors(path: str) -> Iterator[None]:
    """Map OS errors to the service's error codes, naming the caller's path only."""
    try:
        yield
    except CallError:
        raise
    except OSError as exc:
        raise _map_os_error(exc, path) from exc


def _map_os_error(exc: OSError, path: str) -> CallError:
    code = exc.errno
    text = os.strerror(code) if code is not None else str(exc)
    rejected = {
        errno.ENOENT: "NOT_FOUND",
        errno.EEXIST: "ALREADY_EXISTS",
        errno.ENOTDIR: "NOT_A_DIRECTORY",
        errno.EISDIR: "IS_A_DIRECTORY",
        errno.EACCES: "PERMISSION_DENIED",
        errno.EPERM: "PERMISSION_DENIED",
        errno.ELOOP: "PERMISSION_DENIED",
        errno.ENOTEMPTY: "DIRECTORY_NOT_EMPTY",
        errno.ENAMETOOLONG: "INVALID_PATH",
        errno.EINVAL: "INVALID_ARGUMENTS",
        errno.EXDEV: "INVALID_ARGUMENTS",
        errno.EROFS: "PERMISSION_DENIED",
    }
    if code in rejected:
        return Rejected(rejected[code], f"{path}: {text}")
    if code in (errno.ENOSPC, errno.EDQUOT):
        return RemoteError("NO_SPACE", f"{path}: {text}")
    return RemoteError("IO_ERROR", f"{path}: {text}")
