"""Log records a person and a machine can read: the ``extra`` fields, a JSON-lines formatter,
and the one rule for everything a peer can make us log.

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
gl_controller  str    on a worker, the controller a session belongs to: its ``controller_id``, or
                      its runtime id in hex when it has none
gl_caller      str    on a gateway, the caller (its ``caller_id``) a line is about
============== ====== ============================================================================

Messages are plain words (no glyphs); payloads and secrets never appear in them.

:class:`JsonFormatter` writes one JSON object per line: ``time`` (UTC, ISO 8601, milliseconds),
``level``, ``logger``, ``message``, every ``gl_*`` field the record has, and ``exception`` (the
formatted traceback) when there is one. ``garcon-link ... --log-json`` uses it.

**What a peer can make us log is bounded** (a peer chooses how often it fails and what its
names hold; the log and the memory must not follow):

* *Counted always*: every event a peer causes is counted in a statistics snapshot
  (``LinkStatistics.handshakes_failed``, ``upgrades_refused``, ``tls_handshakes_failed``,
  ``handshakes_abandoned``...; ``RpcStatistics.malformed_envelopes``, ``part_violations``,
  ``notifications_dropped``...): the counts are exact, the log is a sample.
* *Logged at most once per interval per peer and reason*: through a :class:`PeerLogLimiter`
  (``Limits.log_interval``, 60 s; at most ``Limits.max_log_lines`` lines per interval for all
  peers together; at most :data:`MAX_LOG_KEYS` remembered pairs). The next line of a pair says
  how many were suppressed since the last one. A peer is a host before authentication (a new
  port is the same peer) and a logical session after it; a reason is one of our own words.
* *Unauthenticated failures below WARNING*: refused upgrades and handshakes, TLS failures,
  handshake deadlines, evictions and sockets closed mid-handshake log at INFO; one WARNING per
  interval sums them up (``300 unauthenticated connections failed in the last 60s
  (AUTH_FAILED=200, HTTP 404=100)``), the first at once.
* *Peer values through one bounded formatter*: :func:`peer_text` renders a value a peer chose
  (a service or method name, a kind, an id, a path, a close reason, an executor id) escaped to
  printable ASCII and cut at :data:`PEER_TEXT_CHARS` with its true length, never rendering it
  whole first; :func:`peer_message` cuts a message that embeds such values (an exception's) at
  :data:`MESSAGE_CHARS`. Error messages sent back to the peer (refusals) use the same formatter,
  so neither a log line nor a refusal grows with the peer's input.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Mapping

__all__ = [
    "FIELDS",
    "MAX_LOG_KEYS",
    "MESSAGE_CHARS",
    "PEER_TEXT_CHARS",
    "JsonFormatter",
    "PeerLogLimiter",
    "log_fields",
    "peer_host",
    "peer_message",
    "peer_text",
]

FIELDS = ("gl_executor", "gl_session", "gl_peer", "gl_close_code", "gl_controller", "gl_caller")
"""The documented ``extra`` field names (every ``gl_*`` attribute is written by the formatter)."""


def log_fields(
    *,
    executor: str | None = None,
    session: bytes | str | None = None,
    peer: str | None = None,
    close_code: int | None = None,
    controller: str | None = None,
    caller: str | None = None,
) -> dict[str, object]:
    """The ``extra=`` mapping of a log call: the fields that are known (``None`` is left out).

    Args:
        executor: the executor id.
        session: the logical session id (bytes are written as hex).
        peer: the socket's remote end, ``host:port``.
        close_code: the WebSocket close code.
        controller: the controller a worker's session belongs to (:data:`FIELDS`).
        caller: the gateway caller a line is about.
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
    if controller is not None:
        extra["gl_controller"] = controller
    if caller is not None:
        extra["gl_caller"] = caller
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


# ------------------------------------------------------------------------ peer-supplied values

PEER_TEXT_CHARS = 80
"""The most characters of a peer's value :func:`peer_text` shows (its length follows when cut)."""

MESSAGE_CHARS = 300
"""The most characters :func:`peer_text` shows of an exception's message."""

MAX_LOG_KEYS = 1024
"""The most ``(peer, reason)`` pairs one :class:`PeerLogLimiter` remembers (oldest evicted)."""

_PRINTABLE = frozenset(chr(c) for c in range(0x20, 0x7F)) - {"\\", "'"}
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(text: str, limit: int, quote: str) -> tuple[str, int]:
    """At most ``limit`` characters of ``text`` rendered printable ASCII; how many it took."""
    out: list[str] = []
    used = 0
    taken = 0
    for ch in text[:limit]:  # never more than ``limit`` characters are looked at
        if ch in _PRINTABLE or (ch == "'" and not quote):
            shown = ch
        elif ch in "\\'":
            shown = "\\" + ch
        elif ch in _SHORT_ESCAPES:
            shown = _SHORT_ESCAPES[ch]
        else:
            code = ord(ch)
            shown = (
                f"\\x{code:02x}"
                if code < 0x100
                else f"\\u{code:04x}"
                if code < 0x10000
                else f"\\U{code:08x}"
            )
        if used + len(shown) > limit:
            break
        out.append(shown)
        used += len(shown)
        taken += 1
    return "".join(out), taken


def peer_text(value: object, limit: int | None = None) -> str:
    """A short, printable rendering of a value a peer chose, for a log line or an error message.

    Text is quoted and escaped to printable ASCII (quotes, backslashes, control characters and
    non-ASCII as Python escapes), bytes likewise as ``b'...'``; when cut, ``...`` and the true
    length follow (``'aaaa'... (8388608 chars)``). An integer over 64 bits is named by its bit
    length, a container by its type and length, any other object by its type; an exception by
    its message as :func:`peer_message` renders it (a message may embed peer values). Never
    raises and never costs more than ``O(limit)``: nothing is rendered whole before it is cut.

    Args:
        value: anything a peer sent, or an exception whose message may embed such values.
        limit: the most characters shown of the value (default :data:`PEER_TEXT_CHARS`, or
            :data:`MESSAGE_CHARS` for an exception); the result adds at most quotes and the
            ``... (N chars)`` suffix.

    Returns:
        At most ``limit + 40`` printable ASCII characters.
    """
    try:
        if isinstance(value, BaseException):
            return peer_message(str(value), MESSAGE_CHARS if limit is None else limit)
        cap = PEER_TEXT_CHARS if limit is None else max(limit, 8)
        kind = type(value)
        if kind is str:
            text: str = value  # type: ignore[assignment]
            shown, taken = _escaped(text, cap, "'")
            cut = f"... ({len(text)} chars)" if taken < len(text) else ""
            return f"'{shown}'{cut}"
        if kind in (bytes, bytearray, memoryview):
            data = bytes(value[:cap])  # type: ignore[index]
            total = len(value)  # type: ignore[arg-type]
            shown, taken = _escaped(data.decode("latin-1"), cap, "'")
            cut = f"... ({total} bytes)" if taken < total else ""
            return f"b'{shown}'{cut}"
        if kind is int:
            number: int = value  # type: ignore[assignment]
            if number.bit_length() > 64:
                return f"<{'-' if number < 0 else ''}integer of {number.bit_length()} bits>"
            return str(number)
        if kind in (bool, float, type(None)):
            return repr(value)
        if kind in (list, tuple, dict, set, frozenset):
            return f"<{kind.__name__} of {len(value)}>"  # type: ignore[arg-type]
        return f"<{kind.__name__}>"
    except Exception:  # a hostile value must not turn a log line into a crash
        return "<unprintable value>"


def peer_message(text: str, limit: int = MESSAGE_CHARS) -> str:
    """A message that may embed peer values (an exception's, a cause built from a manifest):
    unquoted, escaped to printable ASCII (so on one line: a line break reads ``\\n``) and cut
    at ``limit`` characters with its true length (``... (N chars)``); ``O(limit)`` whatever
    the length of ``text``."""
    try:
        shown, taken = _escaped(text, limit, "")  # line breaks escaped: one line
        return f"{shown}... ({len(text)} chars)" if taken < len(text) else shown
    except Exception:
        return "<unprintable value>"


def peer_host(peer: str) -> str:
    """The host of a ``host:port`` peer (the limiter's key: a new port is the same peer)."""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


# ------------------------------------------------------------------------------ the limiter


class PeerLogLimiter:
    """Counts every event a peer causes and logs at most one line per peer and reason per interval.

    ``log(peer, reason, msg, *args)`` counts the event; it writes the line (at ``level``) when
    no line was written for that ``(peer, reason)`` in the last ``interval`` seconds and fewer
    than ``max_lines`` lines were written by this limiter in the current interval; a line after
    a quiet spell says how many were suppressed since the previous one. ``reason`` must be one
    of the caller's own words, never a peer's value: it names the kind of event.

    With ``summary`` (e.g. ``"handshakes refused"``) every event is also counted per reason,
    and at most once per interval a WARNING sums them up: ``300 handshakes refused in the last
    60 s (AUTH_FAILED=250, HTTP 400=50)``. The first event writes the first summary at once, so
    an operator who logs warnings only still hears of a problem; a summary is written when an
    event comes, so the last one of a flood is written with the next event.

    Memory is bounded whatever the peers send: at most :data:`MAX_LOG_KEYS` pairs (the oldest is
    forgotten) and as many reasons. The exact counts belong to the caller's statistics; the
    limiter's :attr:`events` and :attr:`suppressed` are its own.

    Args:
        logger: where the lines go.
        level: the level of each line (INFO for unauthenticated peers, WARNING after).
        interval: seconds between two lines of one peer and reason (``Limits.log_interval``).
        max_lines: lines per interval of this limiter, all peers together
            (``Limits.max_log_lines``): many addresses do not buy many lines.
        summary: what the periodic WARNING counts, or ``None`` for no summary.
        clock: seconds, monotonic (injectable for tests).
        max_keys: the most ``(peer, reason)`` pairs remembered.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        level: int = logging.WARNING,
        interval: float = 60.0,
        max_lines: int = 100,
        summary: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = MAX_LOG_KEYS,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval = interval
        self._max_lines = max_lines
        self._summary = summary
        self._clock = clock
        self._max_keys = max(1, max_keys)
        self._keys: dict[tuple[str, str], list[float]] = {}  # [last line at, suppressed since]
        self._window_start: float | None = None  # of the current max_lines budget
        self._window_lines = 0
        self._summary_at: float | None = None
        self._counts: dict[str, int] = {}  # per reason, since the last summary
        self.events = 0
        """Events counted since the limiter was made."""
        self.suppressed = 0
        """Events that wrote no line."""

    @property
    def remembered(self) -> int:
        """The ``(peer, reason)`` pairs remembered now (at most ``max_keys``)."""
        return len(self._keys)

    def log(
        self,
        peer: str,
        reason: str,
        msg: str,
        *args: object,
        exc_info: BaseException | bool | None = None,
        extra: Mapping[str, object] | None = None,
        logger: logging.Logger | None = None,
        level: int | None = None,
    ) -> bool:
        """Count one event; log ``msg % args`` if it is due. Returns whether a line was written.

        ``logger`` and ``level`` override the limiter's own for this line (one limiter can
        count the events of several layers; its summary goes to its own logger).
        """
        now = self._clock()
        self.events += 1
        written = self._line(
            now,
            peer,
            reason,
            msg,
            args,
            exc_info,
            extra,
            logger or self._logger,
            self._level if level is None else level,
        )
        if self._summary is not None:
            self._summarize(now, reason)
        return written

    def _line(
        self,
        now: float,
        peer: str,
        reason: str,
        msg: str,
        args: tuple[object, ...],
        exc_info: BaseException | bool | None,
        extra: Mapping[str, object] | None,
        logger: logging.Logger,
        level: int,
    ) -> bool:
        if self._window_start is None or now - self._window_start >= self._interval:
            self._window_start = now
            self._window_lines = 0
        key = (peer, reason)
        entry = self._keys.pop(key, None)  # re-inserted last: the dict is oldest first
        due = entry is None or now - entry[0] >= self._interval
        if not due or self._window_lines >= self._max_lines:
            if entry is None:
                entry = [now, 0.0]
            entry[1] += 1
            self._remember(key, entry)
            self.suppressed += 1
            return False
        missed = int(entry[1]) if entry is not None else 0
        self._remember(key, [now, 0.0])
        self._window_lines += 1
        if not logger.isEnabledFor(level):
            return False
        if missed:
            msg = f"{msg} ({missed} more since the last such line)"
        logger.log(level, msg, *args, exc_info=exc_info, extra=extra)
        return True

    def _remember(self, key: tuple[str, str], entry: list[float]) -> None:
        while len(self._keys) >= self._max_keys:
            del self._keys[next(iter(self._keys))]
        self._keys[key] = entry

    def _summarize(self, now: float, reason: str) -> None:
        if reason in self._counts or len(self._counts) < self._max_keys:
            self._counts[reason] = self._counts.get(reason, 0) + 1
        last = self._summary_at
        if last is not None and now - last < self._interval:
            return
        self._summary_at = now
        counts, self._counts = self._counts, {}
        total = sum(counts.values())
        reasons = ", ".join(f"{name}={n}" for name, n in sorted(counts.items()))
        if last is None:
            self._logger.warning(
                "%d %s (%s); more are summarized at most every %gs",
                total,
                self._summary,
                reasons,
                self._interval,
            )
        else:
            self._logger.warning(
                "%d %s in the last %.0fs (%s)", total, self._summary, now - last, reasons
            )
