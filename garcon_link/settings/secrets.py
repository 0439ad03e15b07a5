"""Secrets: the :class:`Secret` value and the policy for files that hold one.

A secret file (or a config file's inline ``secret``) holds text. It is stripped of surrounding
whitespace; if what remains is an even number (64 or more) of hex digits it is decoded as hex,
otherwise its bytes are used as they are (:func:`decode_secret`). Either way at least
:data:`MIN_SECRET_BYTES` (32) bytes must remain. :func:`write_secret_file` (``garcon-link
keygen``) writes 32 random bytes as 64 hex digits, created exclusively or replaced atomically,
at mode 0600. The value lives in a :class:`Secret`, whose ``repr``/``str`` are redacted, whose
equality is a constant-time compare and which refuses to be pickled (so it cannot ride into a
child process). No message of this module contains a secret.

A file holding a secret is refused (:func:`load_secret_file`, :func:`read_secret`) when it is
missing or unreadable, not a regular file or larger than 64 KiB, when its secret is shorter than
32 bytes, when on POSIX its mode grants anything to group or others (``st_mode & 0o077``; fix with
``chmod 600``), and when a directory above it lets another user replace it
(:func:`unsafe_directory`). A keyring directory obeys the same directory rule
(:func:`keyring_directory_problem`).

Every refusal of the settings room has one shape, built by :func:`refusal`:
``<file>: <field>: <problem>; <how to fix it>``. Beside the public names, the settings room uses
:data:`KEYGEN_HINT`, :data:`Source`, :func:`refusal`, :func:`decode_secret`,
:func:`open_mode_problem`, :func:`refuse_open_mode`, :func:`unsafe_directory`,
:func:`refuse_unsafe_directory`, :class:`SecretFileRefused`, :func:`load_secret_file`,
:func:`read_secret` and :func:`keyring_directory_problem` (the config loaders and the keyring).
"""

from __future__ import annotations

import errno
import hmac
import os
import secrets
import stat
import string
from pathlib import Path
from typing import Any, NoReturn

from ..errors import ConfigError

__all__ = [
    "KEYGEN_HINT",
    "MIN_SECRET_BYTES",
    "Secret",
    "SecretFileRefused",
    "Source",
    "decode_secret",
    "generate_secret",
    "keyring_directory_problem",
    "load_secret_file",
    "open_mode_problem",
    "read_secret",
    "read_secret_file",
    "refusal",
    "refuse_open_mode",
    "refuse_unsafe_directory",
    "unsafe_directory",
    "write_secret_file",
]

MIN_SECRET_BYTES = 32
"""A secret must hold at least this many bytes (after hex decoding)."""

KEYGEN_HINT = "generate one with `garcon-link keygen PATH`"

_GENERATED_SECRET_BYTES = 32
_MAX_SECRET_FILE_BYTES = 64 * 1024  # read bound: a secret file is a few dozen bytes
_HEX_DIGITS = string.hexdigits.encode("ascii")


# --------------------------------------------------------------------------- messages


# A config built in code has no file: its class name stands in for it (a str "source").
Source = Path | str | None


def refusal(source: Source, what: str, problem: str, fix: str) -> ConfigError:
    """Build the one message shape of the settings room: file, field, problem, fix."""
    where = str(source) if source is not None else "LinkConfig"
    return ConfigError(f"{where}: {what}: {problem}; {fix}")


# --------------------------------------------------------------------------- the value


class Secret:
    """The shared link secret: redacted in every text form, compared in constant time.

    A ``Secret`` is immutable. It refuses to be pickled (``TypeError``) so that it cannot be
    shipped to a child process by accident; ``copy.copy``/``deepcopy`` return the same object.

    Raises:
        TypeError: ``value`` is not ``bytes``/``bytearray``.
        ConfigError: ``value`` is shorter than :data:`MIN_SECRET_BYTES`.
    """

    __slots__ = ("_value",)

    _value: bytes

    def __init__(self, value: bytes | bytearray) -> None:
        if not isinstance(value, bytes | bytearray):
            raise TypeError(f"Secret takes bytes, not {type(value).__name__}")
        if len(value) < MIN_SECRET_BYTES:
            raise ConfigError(
                f"secret: {len(value)} bytes is too short, at least {MIN_SECRET_BYTES} bytes are "
                f"required; {KEYGEN_HINT}"
            )
        object.__setattr__(self, "_value", bytes(value))

    def reveal(self) -> bytes:
        """Return the secret bytes. Keep the result out of logs, messages and environments."""
        return self._value

    def __len__(self) -> int:
        return len(self._value)

    def __repr__(self) -> str:
        return f"Secret(<redacted, {len(self._value)} bytes>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        # Python's str/bytes hash is keyed per process (SipHash), so it reveals nothing useful.
        return hash((Secret, self._value))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Secret is immutable")

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Secret cannot be pickled: it must not leave this process")

    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Secret:
        return self


def generate_secret() -> Secret:
    """Return a fresh secret of 32 bytes from :mod:`secrets`."""
    return Secret(secrets.token_bytes(_GENERATED_SECRET_BYTES))


def decode_secret(raw: bytes) -> bytes:
    """Strip ``raw``; 64+ (even) hex digits decode as hex, anything else is used as is."""
    text = raw.strip()
    if (
        len(text) >= 2 * MIN_SECRET_BYTES
        and len(text) % 2 == 0
        and not text.translate(None, _HEX_DIGITS)  # nothing left once the hex digits go
    ):
        return bytes.fromhex(text.decode("ascii"))
    return text


def open_mode_problem(mode: int, path: Path) -> tuple[str, str] | None:
    """POSIX only: ``(problem, fix)`` when group or others may access a file holding a secret."""
    if os.name == "posix" and mode & 0o077:
        return (
            f"{path} is for a secret, which only its owner may read, but its mode "
            f"{stat.S_IMODE(mode):04o} grants access to group/others",
            f"run `chmod 600 {path}`",
        )
    return None


def refuse_open_mode(mode: int, path: Path, source: Path | None, what: str) -> None:
    """POSIX only: refuse a file holding a secret that group or others may access."""
    found = open_mode_problem(mode, path)
    if found is not None:
        raise refusal(source, what, *found)


def unsafe_directory(path: Path) -> tuple[Path, str, str] | None:
    """POSIX: a directory above ``path`` through which another user could replace it.

    Returns ``(directory, problem, fix)`` or ``None``. Checked, like OpenSSH's ``StrictModes``
    walk (``safe_path``), from ``/`` down to the file's own directory, along the path as given
    *and* along its real path (a symlink in the chain is replaceable by whoever may write the
    directory holding it, and its target's chain is what is finally read):

    * a directory writable by everyone without the sticky bit: anyone may rename the secret
      away and put their own file (or directory) in its place -- refused;
    * a directory writable by everyone *with* the sticky bit (``/tmp``): only the owner of an
      entry, the directory's owner and root may rename or delete it, so it is safe exactly when
      the directory and the next entry of the path belong to this user or root -- refused
      otherwise, accepted silently when so (refusing ``/tmp`` itself would break common setups
      such as Kubernetes secret volumes and per-user temporary directories for no gain).

    Not checked: group-writable directories (user-private-group setups make directories
    group-writable for a group holding only the user; OpenSSH refuses those too), directories
    owned by other users (volumes mounted into containers commonly belong to another uid), and
    directories that cannot be examined (opening the file reports what is wrong there).
    """
    if os.name != "posix":
        return None
    me = os.geteuid()
    given = Path(os.path.abspath(path))
    chains = [given]
    real = Path(os.path.realpath(given))
    if real != given:
        chains.append(real)
    for chain in chains:
        directories = list(reversed(chain.parents))  # "/", "/a", "/a/b", ...
        entries = [*directories[1:], chain]  # the entry of each directory the path goes through
        for directory, entry in zip(directories, entries, strict=True):
            try:
                info = os.stat(directory)
            except OSError:
                continue
            mode = info.st_mode
            if not mode & stat.S_IWOTH:
                continue
            shown = f"{stat.S_IMODE(mode):04o}"
            real_directory = Path(os.path.realpath(directory))
            if real_directory != directory:  # reached through a symlink: name the real one
                shown += f", reached as {directory}"
                directory = real_directory
            if not mode & stat.S_ISVTX:
                return (
                    directory,
                    f"is writable by everyone (mode {shown}) without the sticky bit, so anyone "
                    f"can replace {path}",
                    f"run `chmod o-w {directory}` (or `chmod +t {directory}`), or move the secret "
                    "to a private directory",
                )
            try:
                entry_owner = os.lstat(entry).st_uid
            except OSError:
                continue
            for name, owner in ((directory, info.st_uid), (entry, entry_owner)):
                if owner not in (0, me):
                    return (
                        directory,
                        f"is writable by everyone (mode {shown}, sticky) and {name} belongs to "
                        f"another user (uid {owner}), who can replace {path}",
                        "move the secret to a directory of your own",
                    )
    return None


def refuse_unsafe_directory(path: Path, source: Path | None, what: str) -> None:
    """Refuse a secret file that another user could replace (see :func:`unsafe_directory`)."""
    found = unsafe_directory(path)
    if found is not None:
        directory, problem, fix = found
        raise refusal(source, what, f"the directory {directory} holding a secret {problem}", fix)


class SecretFileRefused(Exception):
    """Why :func:`load_secret_file` refused a file: ``problem`` and ``fix`` texts, never the
    secret. ``kind`` says which rule (``missing``, ``symlink``, ``open``, ``not-regular``,
    ``mode``, ``read``, ``too-large``, ``too-short``) so that callers may word the fix their way."""

    def __init__(self, kind: str, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.kind = kind
        self.problem = problem
        self.fix = fix


def load_secret_file(
    path: Path, *, follow_symlinks: bool = True, keygen_hint: str = KEYGEN_HINT
) -> Secret:
    """Open, check and decode one secret file: the core shared by config files and the keyring.

    The file is opened once (``O_NONBLOCK``: a FIFO must not hang the read; ``O_NOFOLLOW`` when
    ``follow_symlinks`` is false) and everything is checked on that descriptor: a regular file,
    on POSIX no access for group/others, at most ``_MAX_SECRET_FILE_BYTES``, and a decoded secret
    (:func:`decode_secret`) of at least :data:`MIN_SECRET_BYTES`. The directories above the file
    are not examined here (see :func:`unsafe_directory`).

    Raises:
        SecretFileRefused: any of the above; an ``OSError`` is its ``__cause__``.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise SecretFileRefused(
            "missing", f"secret file {path} does not exist", f"fix the path or {keygen_hint}"
        ) from exc
    except OSError as exc:
        # O_NOFOLLOW on a symlink fails with ELOOP (EMLINK on FreeBSD, EFTYPE on NetBSD).
        if not follow_symlinks and exc.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():
            raise SecretFileRefused(
                "symlink",
                f"{path} is a symbolic link, which is not followed here",
                "replace the link with a copy of the file it points to",
            ) from exc
        raise SecretFileRefused(
            "open",
            f"cannot open secret file {path} ({exc.strerror or type(exc).__name__})",
            "check the path and its permissions",
        ) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretFileRefused(
                "not-regular", f"{path} is not a regular file", "point it at a file"
            )
        found = open_mode_problem(info.st_mode, path)
        if found is not None:
            raise SecretFileRefused("mode", *found)
        with os.fdopen(fd, "rb") as file:
            fd = -1  # the file object owns (and closes) it now
            raw = file.read(_MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise SecretFileRefused(
            "read",
            f"cannot read secret file {path} ({exc.strerror or type(exc).__name__})",
            "check the file",
        ) from exc
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > _MAX_SECRET_FILE_BYTES:
        raise SecretFileRefused(
            "too-large",
            f"secret file {path} is larger than {_MAX_SECRET_FILE_BYTES} bytes",
            f"point it at a secret file; {keygen_hint}",
        )
    value = decode_secret(raw)
    if len(value) < MIN_SECRET_BYTES:
        raise SecretFileRefused(
            "too-short",
            f"the secret in {path} is {len(value)} bytes, at least {MIN_SECRET_BYTES} are required",
            keygen_hint,
        )
    return Secret(value)


def read_secret(path: Path, source: Path | None, what: str) -> Secret:
    """Read a secret file named by a config file: every refusal is a ``ConfigError``."""
    refuse_unsafe_directory(path, source, what)
    try:
        return load_secret_file(path)
    except SecretFileRefused as refused:
        raise refusal(source, what, refused.problem, refused.fix) from refused.__cause__


def keyring_directory_problem(directory: Path, kind: str = "executor") -> tuple[str, str] | None:
    """``(problem, fix)`` when ``directory`` cannot serve as a keyring, else ``None``.

    It must exist, be a directory (symlinks to one are followed: the operator chose the path),
    and on POSIX no directory on its path may let another user replace a key file in it
    (:func:`unsafe_directory`, applied to a placeholder entry ``<executor_id>.secret``).
    ``kind`` (``"executor"`` or ``"caller"``) is what the keyring enrolls, as the fix names it.
    """
    try:
        info = os.stat(directory)
    except FileNotFoundError:
        return (
            f"the keyring directory {directory} does not exist",
            f"create it with `garcon-link keygen --keyring DIR --{kind} ID` (mode 0700)",
        )
    except OSError as exc:
        return (
            f"cannot examine the keyring directory {directory} "
            f"({exc.strerror or type(exc).__name__})",
            "check the path and its permissions",
        )
    if not stat.S_ISDIR(info.st_mode):
        return (f"{directory} is not a directory", "point keyring at a directory of key files")
    if not os.access(directory, os.R_OK | os.X_OK):
        # Every handshake would fail, one warning per peer: say it once, at startup.
        return (
            f"the keyring directory {directory} cannot be read by this user",
            f"let this process's user read it (chown it to that user; chmod 700 {directory})",
        )
    found = unsafe_directory(directory / f"<{kind}_id>.secret")
    if found is not None:
        unsafe, problem, fix = found
        return (f"the directory {unsafe} holding the keyring {problem}", fix)
    return None


def read_secret_file(path: str | os.PathLike[str]) -> Secret:
    """Read a secret file written by :func:`write_secret_file` (or by hand).

    Args:
        path: the file. Its stripped content is hex-decoded when it is 64+ hex digits, otherwise
            used as bytes.

    Raises:
        ConfigError: the file is missing or unreadable, on POSIX its mode grants group/others any
            access or a directory above it lets another user replace it, or the secret is
            shorter than 32 bytes.
    """
    target = Path(path)
    return read_secret(target, target, "secret file")


def write_secret_file(path: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write a fresh secret (64 hex digits and a newline) to ``path`` with mode 0600.

    Without ``force`` the file is created exclusively (``O_CREAT | O_EXCL``) at mode 0600, so an
    existing file is never touched. With ``force`` the secret goes to a 0600 temporary file in the
    same directory which then atomically replaces ``path``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ConfigError: ``path`` exists and ``force`` is false, a directory above it would let
            another user replace it (as :func:`~garcon_link.settings.config.load_config` would
            refuse), or the file cannot be written.
    """
    target = Path(path)
    found = unsafe_directory(target)
    if found is not None:
        directory, problem, fix = found
        raise ConfigError(f"{target}: the directory {directory} {problem}; {fix}")
    data = (generate_secret().reveal().hex() + "\n").encode("ascii")
    try:
        if force:
            _replace_atomically(target, data)
        else:
            _create_exclusively(target, data)
    except FileExistsError as exc:
        raise ConfigError(
            f"{target}: refusing to overwrite an existing file; remove it or pass --force "
            "(force=True) to replace it with a new secret"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"{target}: cannot write the secret file ({exc.strerror or type(exc).__name__}); "
            "check that the directory exists and is writable"
        ) from exc
    return target


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def _create_exclusively(target: Path, data: bytes) -> None:
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(target, flags, 0o600)
    try:
        _write_all(fd, data)
    except BaseException:
        os.close(fd)
        target.unlink(missing_ok=True)
        raise
    os.close(fd)


def _replace_atomically(target: Path, data: bytes) -> None:
    # mkstemp creates the file with O_EXCL and mode 0600 in the target's directory, so the
    # secret is never readable by others, and os.replace swaps it in atomically. tempfile is
    # imported here, by what writes a key, not by every program that reads one (1.5 ms).
    import tempfile

    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
