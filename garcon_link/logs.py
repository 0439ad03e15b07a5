"""Log records a person and a machine can read: the ``extra`` fields and a JSON-lines formatter.

**Loggers.** One per layer, named after its module, all under the package logger
``garcon_link`` (which has a ``NullHandler``: the application decides where logs go):
``garcon_link.ws`` (sockets, upgrades, the unauthenticated stage), ``garcon_link.link``
(handshake, admission, attach and close of each socket, dialing), ``garcon_link.transport``
(one logical session's delivery and retirement), ``garcon_link.session`` (replay),
``garcon_link.rpc`` (envelopes, notifications, streams), ``garcon_link.remote`` (executors,
workers, drains, service scopes), ``garcon_link.keyring``, ``garcon_link.cli``,
``garcon_link.services.*`` and ``garcon_link.contrib.*``.

**Fields.** Every line that concerns an executor, a logical session, a peer or a closed socket
carries what is known of them as ``LogRecord`` attributes (set with ``extra=``; absent when not
known):

============== ====== ============================================================================
field          type   meaning
============== ====== ============================================================================
gl_executor    str    the executor id
gl_session     str    the logical session id, 64 hex digits (messages show a prefix of it)
gl_peer        str    the remote end of the socket, ``host:port``
gl_close_code  int    the WebSocket close code of the socket's end (``4008``, ``1001``...)
============== ====== ============================================================================

Messages are plain words (no glyphs); payloads and secrets never appear in them.

:class:`JsonFormatter` writes one JSON object per line: ``time`` (UTC, ISO 8601, milliseconds),
``level``, ``logger``, ``message``, every ``gl_*`` field the record has, and ``exception`` (the
formatted traceback) when there is one. ``garcon-link ... --log-json`` uses it.
"""

from __future__ import annotations

import datetime
import json
import logging

__all__ = ["FIELDS", "JsonFormatter", "log_fields"]

FIELDS = ("gl_executor", "gl_session", "gl_peer", "gl_close_code")
"""The documented ``extra`` field names (every ``gl_*`` attribute is written by the formatter)."""


def log_fields(
    *,
    executor: str | None = None,
    session: bytes | str | None = None,
    peer: str | None = None,
    close_code: int | None = None,
) -> dict[str, object]:
    """The ``extra=`` mapping of a log call: the fields that are known (``None`` is left out).

    Args:
        executor: the executor id.
        session: the logical session id (bytes are written as hex).
        peer: the socket's remote end, ``host:port``.
        close_code: the WebSocket close code.
    """
    extra: dict[str, object] = {}
    if executor is not None:
        extra["gl_executor"] = executor
    if session is not None:
        extra["gl_session"] = session.hex() if isinstance(session, bytes) else session
    if peer is not None:
        extra["gl_peer"] = peer
    if close_code is not None:
        extra["gl_close_code"] = int(close_code)
    return extra


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring); non-ASCII is escaped."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        line: dict[str, object] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name.startswith("gl_"):
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)
