"""The command line's exit codes, its own exceptions, and how a failure becomes one error line
and one exit code (the table is in :mod:`garcon_link.cli`)."""

from __future__ import annotations

import asyncio
import sys

from ..errors import (
    ConfigError,
    GarconLinkError,
    HandshakeError,
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

_EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    other failure (link or OS error; an internal error: -v shows why)
  2    usage or configuration error
  3    NotDispatched   not executed (offline, not ready within --timeout)
  4    Rejected        refused unexecuted (unknown method, bad arguments)
  5    RemoteError     executed and raised
  6    OutcomeUnknown  may have executed (timeout, continuity lost)
  7    worker: another process took over this executor id
  8    refused by the other end: wrong secret or executor id, role, version
  130  interrupted (call: the message says whether the call was sent)

Errors print one line on stderr, "error: [outcome:code] message", without a traceback.
"""


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


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
    return isinstance(exc, UsageError | GarconLinkError | OSError | KeyboardInterrupt)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, UsageError | GarconLinkError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "interrupted"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc}"
    return f"internal error, {type(exc).__name__}: {exc}"
