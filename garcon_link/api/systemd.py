"""systemd's notify protocol, without a dependency: for ``garcon-link worker`` and
``garcon-link gateway``, and for a worker in a program of its own (``gl.Worker(...,
systemd=True)``).

Theory of operation
-------------------
When systemd starts a ``Type=notify`` service it sets ``NOTIFY_SOCKET``: the address of an
``AF_UNIX`` datagram socket (a path, or a name in the abstract namespace when it starts with
``@``). The service tells systemd about itself by sending datagrams of ``KEY=value`` lines:

* ``READY=1`` once the worker is up: its listening socket is bound, or -- a worker that dials --
  its dial loop has started. Not at the first session: a controller that is down would then keep
  the unit "activating" until systemd's start timeout killed the worker, and restarting it would
  not bring the controller back. Whether a session is up shows in ``STATUS=``.
* ``STOPPING=1`` when the worker starts to stop: a signal to the command (its drain, or the stop
  without one), a library worker's ``aclose()`` (leaving its ``async with``), or another process
  took the executor id over.
* ``WATCHDOG=1`` every ``WATCHDOG_USEC / 2`` when ``WATCHDOG_USEC`` is set and ``WATCHDOG_PID``
  is unset or this process's pid; it comes from a task on the worker's event loop, so it stops
  when the loop is stuck, which is what systemd's ``WatchdogSec=`` is there to notice.
* ``STATUS=...``: one line for ``systemctl status`` (serving, session ready, draining).

The variables are removed from the environment once read, so the processes a worker starts (the
built-in process service) do not inherit them and cannot speak for it.

A careless operator: a ``NOTIFY_SOCKET`` that is not an absolute path or ``@name``, that names
nothing, or that is too long for a socket address, and a ``WATCHDOG_USEC`` that is not a
positive integer, each cost one warning line, the first time, and the worker runs on: telling
systemd is never fatal. Later failures are counted (:attr:`SystemdNotifier.failures`), not
logged. A ``WATCHDOG_USEC`` below ``2 * MIN_WATCHDOG_INTERVAL`` is served at that interval, so
no setting turns the watchdog into a busy loop. ``STATUS=`` text is cut to ``MAX_STATUS_CHARS``
and holds no control character (a newline would start another assignment).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, MutableMapping

import anyio

__all__ = [
    "MAX_STATUS_CHARS",
    "MIN_WATCHDOG_INTERVAL",
    "SystemdNotifier",
    "notify_address",
    "watchdog_interval",
]

log = logging.getLogger("garcon_link.remote")  # the worker's: the name users configure (README)

MIN_WATCHDOG_INTERVAL = 0.05
"""The shortest pause (seconds) between two ``WATCHDOG=1``, whatever ``WATCHDOG_USEC`` says."""

MAX_STATUS_CHARS = 200
"""The longest ``STATUS=`` text sent (executor ids and URLs come from the configuration)."""

_SHOWN_CHARS = 120  # the most characters of an environment value shown in a log line

ENVIRONMENT = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
"""What systemd sets for the notify protocol (removed from the environment once read)."""


def _shown(value: str) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def notify_address(value: str) -> str | bytes:
    """The socket address ``NOTIFY_SOCKET`` names: a path, or an abstract name (``@name``,
    returned as bytes starting with NUL).

    Raises:
        ValueError: neither an absolute path nor ``@name`` (the message says which it is).
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode("utf-8", "surrogateescape")
    if value.startswith("/"):
        return value
    raise ValueError(
        f"NOTIFY_SOCKET={_shown(value)} is neither an absolute path nor an abstract socket "
        "name (@name)"
    )


def watchdog_interval(usec: str | None, watchdog_pid: str | None, pid: int) -> float | None:
    """Seconds between two ``WATCHDOG=1``: half of ``WATCHDOG_USEC``, at least
    ``MIN_WATCHDOG_INTERVAL``; ``None`` when ``WATCHDOG_USEC`` is unset or empty, or
    ``WATCHDOG_PID`` names another process (the watchdog is not ours).

    Raises:
        ValueError: ``WATCHDOG_USEC`` is not a positive integer, or ``WATCHDOG_PID`` is not
            an integer.
    """
    if not usec:
        return None
    if watchdog_pid:
        try:
            owner = int(watchdog_pid)
        except ValueError:
            raise ValueError(f"WATCHDOG_PID={_shown(watchdog_pid)} is not a pid") from None
        if owner != pid:
            return None
    try:
        micros = int(usec)
    except ValueError:
        micros = 0
    if micros <= 0:
        raise ValueError(f"WATCHDOG_USEC={_shown(usec)} is not a positive number of microseconds")
    return max(micros / 2_000_000, MIN_WATCHDOG_INTERVAL)


def _status_text(text: str) -> str:
    flat = "".join(c if c.isprintable() else " " for c in text)
    return flat[:MAX_STATUS_CHARS]


class SystemdNotifier:
    """Tells systemd about the worker (module docstring); does nothing without an address.

    Args:
        address: where to send (:func:`notify_address`), or ``None``: every method is a no-op.
        watchdog: seconds between two ``WATCHDOG=1`` (:func:`watchdog_interval`), or ``None``.
    """

    def __init__(self, address: str | bytes | None, watchdog: float | None = None) -> None:
        self.address = address
        self.watchdog = watchdog if address is not None else None
        self.sent = 0
        """Datagrams sent."""
        self.failures = 0
        """Datagrams that could not be sent (only the first is logged)."""
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] | None = None, pid: int | None = None
    ) -> SystemdNotifier:
        """The notifier ``environ`` (default ``os.environ``) asks for; the variables are removed
        from it. A value that cannot be used is logged once and leaves that part off."""
        env = os.environ if environ is None else environ
        values = {name: env.pop(name, "") for name in ENVIRONMENT}
        if not values["NOTIFY_SOCKET"]:
            return cls(None)
        try:
            address = notify_address(values["NOTIFY_SOCKET"])
        except ValueError as exc:
            log.warning("systemd notify is off: %s", exc)
            return cls(None)
        try:
            interval = watchdog_interval(
                values["WATCHDOG_USEC"],
                values["WATCHDOG_PID"],
                os.getpid() if pid is None else pid,
            )
        except ValueError as exc:
            log.warning("systemd watchdog is off: %s", exc)
            interval = None
        return cls(address, interval)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send one datagram of ``KEY=value`` lines; ``False`` if it could not be sent (the
        first failure is logged, every one counted). Never raises."""
        if self.address is None:
            return False
        data = "\n".join(assignments).encode("utf-8", "replace")
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)  # a receiver that is not reading: dropped, not waited for
                self._sock = sock
            self._sock.sendto(data, self.address)
        except (OSError, AttributeError, ValueError) as exc:  # AttributeError: no AF_UNIX here
            self.failures += 1
            if not self._warned:
                self._warned = True
                shown = (
                    self.address
                    if isinstance(self.address, str)
                    else "@" + self.address[1:].decode("utf-8", "replace")
                )
                log.warning(
                    "systemd notify: cannot send to NOTIFY_SOCKET=%s (%s: %s); the worker runs "
                    "on without telling systemd",
                    _shown(shown),
                    type(exc).__name__,
                    exc,
                )
            return False
        self.sent += 1
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={_status_text(status)}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={_status_text(status)}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={_status_text(status)}")

    def follow_events(self, on_event: Callable[[str], None]) -> Callable[[str], None]:
        """``on_event`` that also reports each ``executor-ready`` line as ``STATUS=``."""
        if self.address is None:
            return on_event

        def follow(line: str) -> None:
            on_event(line)
            if line.startswith("executor-ready "):
                self.status(line)

        return follow

    async def beat(self) -> None:
        """``WATCHDOG=1`` every :attr:`watchdog` seconds, until cancelled (returns at once
        without a watchdog). Run it in a task of the worker's event loop."""
        interval = self.watchdog
        if interval is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await anyio.sleep(interval)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
