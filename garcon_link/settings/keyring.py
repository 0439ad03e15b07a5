"""A listening controller's keyring: one secret file per executor, read at each handshake.

Theory of operation (docs/design.md#keyrings)
---------------------------------------------
A keyring is a directory holding ``<executor_id>.secret`` files, each a secret as
``garcon-link keygen`` writes it (mode 0600). The listener reads the executor id the dialer
claims in its hello and asks :meth:`Keyring.secret_for` for that executor's key, *before* the
peer is authenticated. Nothing is cached: adding a file enrolls an executor, deleting it revokes
it, replacing it rotates the key, all without a restart.

Because the id comes from an unauthenticated peer, :meth:`Keyring.secret_for`

* checks it with :func:`executor_id_problem` before touching the file system: only ASCII
  letters, digits, ``.``, ``_`` and ``-``, not starting with ``.``, at most
  :data:`MAX_EXECUTOR_ID_CHARS` characters -- so it can name nothing outside the directory;
* opens the file with ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`` (a symlink is refused, a FIFO does
  not hang the handshake) and checks everything on the open descriptor with the rules a config
  file's ``secret_file`` obeys (regular file, no access for group/others, at most 64 KiB, at
  least 32 bytes of secret);
* never raises and returns ``None`` on any problem: the caller refuses unknown, revoked and
  misconfigured executors alike, so the wire tells them apart in no way.

A missing file is the normal "not enrolled" case and is logged at debug level only (at most once
per id per ``warn_interval``, ten such lines per interval in all: the ids are strangers'). A present
file that is refused is an operator's mistake: it is logged as a warning naming the file, the
problem and the fix (``run `chmod 600 .../box-1.secret```), at most once per file and problem
per ``warn_interval`` seconds (a redialing worker must not flood the log). No log line holds a
secret.

The directory itself is checked once, when the :class:`Keyring` is built (it exists, is a
directory, and no directory on its path lets another user replace a key file): a careless setup
fails at startup with a ``ConfigError`` rather than silently refusing every peer.

Executor ids
------------
A worker's config accepts any printable id without whitespace (``LinkConfig``); a keyring only
accepts the file-name-safe subset above. A worker whose id holds e.g. ``:`` or non-ASCII letters
still loads its config, but :func:`enroll` refuses it and a listening controller never finds its
key: give such a worker an id like ``box-1``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigError
from ..logs import PeerLogLimiter, log_fields
from ..net.addresses import MAX_EXECUTOR_ID_CHARS, executor_id_problem
from .secrets import (
    Secret,
    SecretFileRefused,
    keyring_directory_problem,
    load_secret_file,
    write_secret_file,
)

__all__ = [
    "KEY_SUFFIX",
    "MAX_ENROLLED_SCAN",
    "MAX_EXECUTOR_ID_CHARS",
    "Keyring",
    "enroll",
    "executor_id_problem",
]

KEY_SUFFIX = ".secret"
"""The key file of executor ``ID`` is ``<keyring>/ID.secret``."""

MAX_ENROLLED_SCAN = 100_000
""":meth:`Keyring.enrolled` examines at most this many directory entries."""

_WARN_INTERVAL = 60.0
_MAX_WARNED = 1024  # rate-limit memory: (path, problem) pairs remembered at once


def _enroll_hint(kind: str) -> str:
    return f"re-enroll with `garcon-link keygen --keyring DIR --{kind} ID --force`"


log = logging.getLogger("garcon_link.keyring")  # the name users configure (README)


def _shown_id(value: str) -> str:
    return repr(value) if len(value) <= 80 else f"{value[:80]!r}..."


class Keyring:
    """The per-executor key directory of a listening controller (see the module docstring).

    Args:
        directory: the keyring directory; stored as an absolute path.
        clock: seconds, monotonic; read only to rate-limit warnings (injectable for tests).
        warn_interval: a refused file's warning is repeated at most once per this many seconds
            for the same file and problem.
        kind: what the keyring enrolls, as its log lines and fixes name it: ``"executor"`` (a
            fleet's keyring) or ``"caller"`` (a gateway's ``[callers] keyring``).

    Raises:
        ConfigError: ``directory`` does not exist, is not a directory, or (POSIX) a directory on
            its path lets another user replace a key file (writable by everyone, see
            :func:`garcon_link.settings.config.load_config`'s rules for secret files).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.monotonic,
        warn_interval: float = _WARN_INTERVAL,
        kind: str = "executor",
    ) -> None:
        if kind not in ("executor", "caller"):
            raise ValueError(f"Keyring kind must be 'executor' or 'caller', got {kind!r}")
        self._kind = kind
        self._directory = Path(os.path.abspath(os.fspath(directory)))
        found = keyring_directory_problem(self._directory, kind)
        if found is not None:
            problem, fix = found
            raise ConfigError(f"keyring {self._directory}: {problem}; {fix}")
        self._clock = clock
        self._warn_interval = warn_interval
        self._warned: dict[tuple[str, str], float] = {}
        # Lookups peers cause (any stranger can claim ids): debug lines at most once per id and
        # reason per interval, few per interval in all.
        self._lookups = PeerLogLimiter(
            log, level=logging.DEBUG, interval=warn_interval, max_lines=10, clock=clock
        )

    @property
    def directory(self) -> Path:
        """The keyring directory (absolute)."""
        return self._directory

    def __repr__(self) -> str:
        return f"Keyring({str(self._directory)!r})"

    def secret_for(self, executor_id: str) -> Secret | None:
        """The key of ``executor_id``, read now; ``None`` if it is not enrolled or is refused.

        ``executor_id`` may be anything a peer sent (it is typed ``str`` for callers, checked as
        ``object``): it is validated with :func:`executor_id_problem` before any file-system
        access. Never raises; never logs the secret.

        Returns:
            The :class:`~garcon_link.Secret` of ``<directory>/<executor_id>.secret``, or
            ``None`` when the id is refused, the file is missing (not enrolled, logged at debug
            level) or the file is refused (logged as a rate-limited warning with the fix).
        """
        problem = executor_id_problem(executor_id)
        if problem is not None:
            # The value is the peer's: it is not echoed.
            self._lookups.log("", "refused id", "key lookup refused: the executor id %s", problem)
            return None
        path = self._directory / f"{executor_id}{KEY_SUFFIX}"
        hint = _enroll_hint(self._kind)
        try:
            return load_secret_file(path, follow_symlinks=False, keygen_hint=hint)
        except SecretFileRefused as refused:
            if refused.kind == "missing":
                self._missing(executor_id, path)
                return None
            fix = refused.fix
            if refused.kind == "not-regular":
                fix = f"replace it with a key file: {hint}"
            self._warn(executor_id, path, refused.problem, fix)
            return None

    def enrolled(self) -> list[str]:
        """The ids of the executors that have a key file now, sorted.

        Listed: regular files (not symlinks) named ``<id>.secret`` whose ``id`` passes
        :func:`executor_id_problem`. Their content is not read, so a listed executor may still be
        refused at its handshake (its file's mode, size or content). At most
        :data:`MAX_ENROLLED_SCAN` directory entries are examined. Never raises: an unreadable
        directory gives ``[]`` and a rate-limited warning.
        """
        found: list[str] = []
        try:
            with os.scandir(self._directory) as entries:
                for scanned, entry in enumerate(entries, start=1):
                    if scanned > MAX_ENROLLED_SCAN:
                        self._warn(
                            None,
                            self._directory,
                            f"holds more than {MAX_ENROLLED_SCAN} entries; only the first "
                            "were listed",
                            "keep only key files in the keyring directory",
                        )
                        break
                    stem = entry.name.removesuffix(KEY_SUFFIX)
                    if stem == entry.name or executor_id_problem(stem) is not None:
                        continue
                    try:
                        if entry.is_file(follow_symlinks=False):
                            found.append(stem)
                    except OSError:
                        continue
        except OSError as exc:
            self._warn(
                None,
                self._directory,
                f"cannot list the keyring ({exc.strerror or type(exc).__name__})",
                "check that the directory exists and is readable",
            )
        return sorted(found)

    # ----------------------------------------------------------------------- logging

    def _missing(self, executor_id: str, path: Path) -> None:
        try:
            directory_ok = stat.S_ISDIR(os.stat(self._directory).st_mode)
        except OSError:
            directory_ok = False
        if directory_ok:
            self._lookups.log(
                executor_id,
                "not enrolled",
                "%s %s is not enrolled (no %s)",
                self._kind,
                executor_id,
                path,
                extra=_extra(executor_id),
            )
            return
        # Every lookup fails now: that is worth a warning, not a debug line per peer.
        self._warn(
            executor_id,
            self._directory,
            f"the keyring directory is gone, so no {self._kind} can authenticate",
            "restore the directory (and its key files)",
        )

    def _warn(self, executor_id: str | None, path: Path, problem: str, fix: str) -> None:
        now = self._clock()
        key = (str(path), problem)
        last = self._warned.get(key)
        if last is not None and now - last < self._warn_interval:
            return
        if last is None and len(self._warned) >= _MAX_WARNED:
            self._forget_warnings(now)
        self._warned[key] = now
        who = f"{self._kind} {executor_id}" if executor_id is not None else "keyring"
        log.warning(
            "%s refused: %s; %s (repeated at most every %gs)",
            who,
            problem if str(path) in problem else f"{path}: {problem}",
            fix,
            self._warn_interval,
            extra=_extra(executor_id),
        )

    def _forget_warnings(self, now: float) -> None:
        expired = [k for k, at in self._warned.items() if now - at >= self._warn_interval]
        for k in expired:
            del self._warned[k]
        while len(self._warned) >= _MAX_WARNED:  # all recent: drop the oldest
            del self._warned[next(iter(self._warned))]


def _extra(executor_id: str | None) -> dict[str, object]:
    return log_fields(executor=executor_id)


def enroll(
    directory: str | os.PathLike[str],
    executor_id: str,
    *,
    force: bool = False,
    kind: str = "executor",
) -> Path:
    """Enroll an executor: write a fresh key to ``<directory>/<executor_id>.secret`` (mode 0600).

    The directory is created with mode 0700 if missing (its parents too, with default modes).
    Copy the file to the worker and name it as the worker's ``secret_file``.

    Args:
        directory: the keyring directory.
        executor_id: the worker's ``executor_id``; must pass :func:`executor_id_problem`.
        force: replace an existing key (rotation: the old key stops working at the next
            handshake).
        kind: ``"caller"`` to enroll a gateway's caller (``executor_id`` is then its
            ``caller_id``; refusals name a caller).

    Returns:
        The path of the key file (``directory`` joined as given, not made absolute).

    Raises:
        ConfigError: the id is refused (the message says which characters a keyring accepts),
            the directory cannot be created or is unsafe, or the file exists without ``force``.
    """
    problem = executor_id_problem(executor_id)
    if problem is not None and kind == "caller":
        shown = _shown_id(executor_id) if isinstance(executor_id, str) else "the caller id"
        raise ConfigError(
            f"caller id {shown} cannot name a keyring file: it {problem}; give the caller an id "
            "of ASCII letters, digits, '.', '_' and '-', not starting with '.' (e.g. \"web-1\")"
        )
    if problem is not None:
        shown = _shown_id(executor_id) if isinstance(executor_id, str) else "the executor id"
        raise ConfigError(
            f"executor id {shown} cannot name a keyring file: it {problem}; a worker whose "
            "executor_id a file name cannot safely hold (such as one with ':' or non-ASCII "
            'letters) still loads its config but cannot be enrolled: rename it, e.g. "box-1"'
        )
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(
            f"keyring {folder}: is not a directory; name a directory for the keyring (it is "
            "created if missing)"
        )
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"keyring {folder}: cannot create the directory "
            f"({exc.strerror or type(exc).__name__}); check the path and its permissions"
        ) from exc
    found = keyring_directory_problem(Path(os.path.abspath(folder)), kind)
    if found is not None:
        problem, fix = found
        raise ConfigError(f"keyring {folder}: {problem}; {fix}")
    return write_secret_file(folder / f"{executor_id}{KEY_SUFFIX}", force=force)
