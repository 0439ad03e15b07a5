"""The command line's exit codes, its own exceptions, and how a failure becomes one error line
and one exit code (the table is in :mod:`garcon_link.cli`)."""

from __future__ import annotations

import asyncio
import errno
import sys

from ..errors import (
    ConfigError,
    GarconLinkError,
    HandshakeError,
    LinkError,
    NotDispatched,
    OutcomeUnknown,
    Rejected,
    RemoteError,
)

EXIT_OK = 0
EXIT_OTHER = 1
EXIT_USAGE = 2
EXIT_NOT_DISPATCHED = 3
EXIT_REJECTED = 4
EXIT_REMOTE_ERROR = 5
EXIT_OUTCOME_UNKNOWN = 6
EXIT_TAKEN_OVER = 7
EXIT_REFUSED = 8
EXIT_INTERRUPTED = 130

_EXIT_CODE_LINES = {
    EXIT_OK: "success",
    EXIT_OTHER: "other failure (link or OS error; an internal error: -v shows why)",
    EXIT_USAGE: "usage or configuration error (the message says what to change)",
    EXIT_NOT_DISPATCHED: "NotDispatched   not executed (offline, unreachable, draining, not ready)",
    EXIT_REJECTED: "Rejected        refused unexecuted (unknown method, bad arguments)",
    EXIT_REMOTE_ERROR: "RemoteError     executed and raised",
    EXIT_OUTCOME_UNKNOWN: "OutcomeUnknown  may have executed (timeout, continuity lost)",
    EXIT_TAKEN_OVER: "another process took over this executor id",
    EXIT_REFUSED: "refused by the other end: wrong secret or executor id, role, version",
    EXIT_INTERRUPTED: "interrupted (call: the message says whether the call was sent)",
}

COMMAND_EXIT_CODES: dict[str | None, tuple[int, ...]] = {
    None: tuple(_EXIT_CODE_LINES),  # garcon-link --help: every code
    "demo": (EXIT_OK, EXIT_OTHER),
    "worker": (EXIT_OK, EXIT_OTHER, EXIT_USAGE, EXIT_TAKEN_OVER),
    "keygen": (EXIT_OK, EXIT_OTHER, EXIT_USAGE),
    "init": (EXIT_OK, EXIT_OTHER, EXIT_USAGE),
    "call": (
        EXIT_OK,
        EXIT_OTHER,
        EXIT_USAGE,
        EXIT_NOT_DISPATCHED,
        EXIT_REJECTED,
        EXIT_REMOTE_ERROR,
        EXIT_OUTCOME_UNKNOWN,
        EXIT_REFUSED,
        EXIT_INTERRUPTED,
    ),
    "describe": (
        EXIT_OK,
        EXIT_OTHER,
        EXIT_USAGE,
        EXIT_NOT_DISPATCHED,
        EXIT_REFUSED,
        EXIT_INTERRUPTED,
    ),
    "fleet": (EXIT_OK, EXIT_OTHER, EXIT_USAGE),
    "gateway": (EXIT_OK, EXIT_OTHER, EXIT_USAGE),
    "stub": (EXIT_OK, EXIT_OTHER, EXIT_USAGE),
}
"""The exit codes each command can end with (``None``: the program as a whole)."""


def exit_codes_help(command: str | None = None) -> str:
    """The ``exit codes:`` block of a command's ``--help`` (only the codes it can end with)."""
    lines = ["exit codes:"]
    lines += [f"  {code:<4} {_EXIT_CODE_LINES[code]}" for code in COMMAND_EXIT_CODES[command]]
    outcome = EXIT_NOT_DISPATCHED in COMMAND_EXIT_CODES[command]
    shape = '"error: [outcome:code] message"' if outcome else '"error: message"'
    return (
        "\n".join(lines) + f"\n\nErrors print one line on stderr, {shape}, without a traceback.\n"
    )


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class StdoutClosed(Exception):
    """The reader of stdout went away (``garcon-link call ... | head -1``): the command ends
    quietly, exit 1, as a Unix filter does."""


class TakenOver(GarconLinkError):
    """A worker stopped because another process took over its executor id (exit code 7)."""


def exit_code_for(exc: BaseException) -> int:
    """The exit code for a failure (see the table in :mod:`garcon_link.cli`)."""
    if isinstance(exc, UsageError | ConfigError):
        return EXIT_USAGE
    if isinstance(exc, NotDispatched):
        return EXIT_NOT_DISPATCHED
    if isinstance(exc, Rejected):
        return EXIT_REJECTED
    if isinstance(exc, RemoteError):
        return EXIT_REMOTE_ERROR
    if isinstance(exc, OutcomeUnknown):
        return EXIT_OUTCOME_UNKNOWN
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, TakenOver):
        return EXIT_TAKEN_OVER
    if isinstance(exc, HandshakeError):
        return EXIT_REFUSED
    return EXIT_OTHER


def _leaf(exc: BaseException) -> BaseException:
    """The first meaningful exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not _is_cancellation(e)] or list(exc.exceptions)
        exc = inner[0]
    return exc


def _is_cancellation(exc: BaseException) -> bool:
    # Called after the event loop has ended: anyio.get_cancelled_exc_class() would raise
    # NoEventLoopError here, so name each backend's class instead (trio only if it was loaded).
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    cancelled = getattr(trio, "Cancelled", None)
    return isinstance(cancelled, type) and isinstance(exc, cancelled)


def _is_expected(exc: BaseException) -> bool:
    """A failure the one error line fully explains (anything else is a bug: -v shows it)."""
    return isinstance(
        exc, UsageError | GarconLinkError | OSError | KeyboardInterrupt | StdoutClosed
    )


_LISTEN_HINTS = {
    errno.EADDRINUSE: "another process listens there (the same worker or gateway already "
    "running?); stop it, or change [connection] listen (port 0 picks a free one)",
    errno.EACCES: "ports below 1024 need privileges; listen on a port from 1024 up (a proxy "
    "or the firewall can forward a low port to it)",
    errno.EADDRNOTAVAIL: "no interface of this machine has that address; listen on one of its "
    "addresses, or 0.0.0.0 for all of them (with [tls])",
}


_CALLER_IN_USE_HINT = (
    "with a configuration that listens, `garcon-link {command}` is a controller of its own that "
    "waits for workers to dial in, and another process listens there (a `garcon-link fleet` or "
    "your controller, on this configuration?); make the call from that program, or stop it first"
)


def _listen_hint(exc: BaseException, command: str | None = None) -> str:
    """What to do about an address a listener could not bind (empty for any other failure);
    ``command`` is the one that failed (``call`` and ``describe`` listen only as controllers)."""
    cause = exc.__cause__
    if not isinstance(exc, LinkError) or not isinstance(cause, OSError):
        return ""
    if not str(exc).startswith("cannot listen on"):
        return ""
    if cause.errno == errno.EADDRINUSE and command in ("call", "describe"):
        return "; " + _CALLER_IN_USE_HINT.format(command=command)
    hint = _LISTEN_HINTS.get(cause.errno or 0)
    return f"; {hint}" if hint else ""


def _describe(exc: BaseException, command: str | None = None) -> str:
    """The one error line's text for ``exc``, a failure of ``command``."""
    if isinstance(exc, UsageError | GarconLinkError):
        return str(exc) + _listen_hint(exc, command)
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "interrupted"
    if isinstance(exc, StdoutClosed):
        return "stdout was closed: nobody reads this command's output any more"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc}"
    return f"internal error, {type(exc).__name__}: {exc}"
