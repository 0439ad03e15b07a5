"""Serving until a signal, then draining and stopping: what ``garcon-link worker`` and
``garcon-link gateway`` share (``garcon-link fleet``, which does not drain, shares the signals).

Theory of operation
-------------------
:class:`StopSignals` catches SIGINT and SIGTERM with plain ``signal.signal`` handlers that hand
each signal to the event loop (``call_soon_threadsafe``, or trio's ``run_sync_soon``).
:func:`run_until_signal` then waits for the first one (beating systemd's watchdog meanwhile,
unless the served object does: a ``gl.Worker(systemd=True)``), says ``STOPPING=1``, drains for
up to ``--drain`` seconds while a second signal may cut the drain short, and prints
``<what>-stopping``.

The previous handlers are never put back. Once :class:`StopSignals` is left -- the served
object is closed by then -- SIGINT and SIGTERM are ignored (``SIG_IGN``) until the process exits,
so a signal sent after the drain (a supervisor's, an operator's second Ctrl-C) can never find the
default disposition and kill the process by signal (-15, no clean exit) between the close and
the exit. anyio's signal receiver is not used for this reason: it puts the default disposition
back when it closes, and so does asyncio's loop when it closes; and the interpreter's
finalization does so for a Python handler, but leaves ``SIG_IGN`` alone. Processes started
before the exit would inherit ``SIG_IGN``; none are started once the served object is closed.

Ignoring signals during the teardown is safe because the teardown is bounded: closing a worker
or a gateway is bounded by the library's own timeouts (``close_timeout``,
``scope_cleanup_timeout``; a thread stuck in the operating system is abandoned, not joined), and
after it only the interpreter's exit remains. SIGKILL, as systemd's ``TimeoutStopSec`` sends it,
still ends a process stuck anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import anyio

from ..api.systemd import SystemdNotifier
from ._output import _emit

__all__ = [
    "DEFAULT_DRAIN",
    "STOP_SIGNALS",
    "StopSignals",
    "drain_seconds",
    "event_line",
    "run_until_signal",
]

log = logging.getLogger("garcon_link.cli")  # one logger for the whole command line

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a serving command."""

DEFAULT_DRAIN = 10.0
"""Seconds ``garcon-link worker`` and ``garcon-link gateway`` drain on a signal unless
``--drain`` says otherwise."""


def drain_seconds(text: str) -> float:
    """``--drain``'s value: finite seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {text!r}")
    return value


_QUEUED = 8  # signals kept until the loop reads them (more are dropped: one is enough to act on)


class StopSignals:
    """SIGINT and SIGTERM as a stream of signal numbers for the running event loop (module
    docstring). ``with StopSignals() as signals:`` from inside the loop, in a process that exits
    once it is left: leaving it ignores both signals from then on.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[int] = collections.deque(maxlen=_QUEUED)
        self._arrived = anyio.Event()
        self._wake: Callable[[Callable[[], None]], Any] | None = None
        # asyncio: the socket pair a signal's arrival is written to (see __enter__), and the
        # wakeup fd it replaced
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._old_wakeup = -1
        self.listening = False
        """Whether signals reach :meth:`next` (false once left: they are ignored)."""

    def __enter__(self) -> StopSignals:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - trio (the command line runs asyncio)
            import trio

            self._wake = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            self._wake = loop.call_soon_threadsafe
            # A signal may be delivered to any thread of the process (the stdin watcher's
            # os.kill, a worker thread when a supervisor signals the process); Python runs the
            # handler in the main thread only once it executes bytecode again, and an idle loop
            # waits in epoll with no timeout. The wakeup fd makes the signal's arrival a byte on
            # a socket the loop watches, so the loop wakes and the handler runs at once
            # (asyncio's own add_signal_handler does the same; it is not used: module docstring).
            reader, writer = socket.socketpair()
            reader.setblocking(False)
            writer.setblocking(False)
            self._pair = (reader, writer)
            self._old_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            loop.add_reader(reader.fileno(), self._drain_wakeups, reader)
        self.listening = True
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Ignored from now until the exit (module docstring). SIG_IGN, not a handler that does
        # nothing: the interpreter's finalization puts SIG_DFL back in place of a Python
        # handler, never of SIG_IGN. Both are "caught or ignored": no default in between.
        self.listening = False
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if self._pair is not None:
            reader, writer = self._pair
            self._pair = None
            signal.set_wakeup_fd(self._old_wakeup)
            with contextlib.suppress(RuntimeError):  # the loop already closed
                asyncio.get_running_loop().remove_reader(reader.fileno())
            reader.close()
            writer.close()

    @staticmethod
    def _drain_wakeups(reader: socket.socket) -> None:
        """The loop's reader of the wakeup socket: empty it (the handler does the rest)."""
        with contextlib.suppress(OSError):
            while reader.recv(4096):
                pass

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        # In the main thread, between two bytecodes: only hand the signal to the loop.
        wake = self._wake
        if not self.listening or wake is None:
            return
        try:
            wake(lambda: self._deliver(signum))
        except RuntimeError:  # the loop is closing: nothing is waiting any more
            pass

    def _deliver(self, signum: int) -> None:
        if self.listening:
            self._queue.append(signum)
            self._arrived.set()

    async def next(self) -> int:
        """The next signal received (waits for one)."""
        while not self._queue:
            await self._arrived.wait()
            self._arrived = anyio.Event()
        return self._queue.popleft()


def event_line(name: str, values: dict[str, object], fields: str = "") -> str:
    """``name [fields] key=value ...``: one event line (floats shown short: ``seconds=10``)."""
    shown = " ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
    return " ".join(part for part in (name, fields, shown) if part)


async def run_until_signal(
    signals: StopSignals,
    notifier: SystemdNotifier | None,
    *,
    what: str,
    fields: str = "",
    status: str,
    drain: float,
    drain_for: Callable[[float], Awaitable[object]],
    running: Callable[[], int],
    stopped: Callable[[], Awaitable[None]] | None = None,
    reason_of: Callable[[int], str] | None = None,
    stopping: Callable[[str], None] | None = None,
    on_signal: Callable[[], None] | None = None,
    emit: Callable[[str, dict[str, object]], None] | None = None,
) -> str | None:
    """Serve until a signal; then drain and say so. Called once the served object is up (its
    ``READY=1`` sent), inside its ``async with``.

    Until the first signal ``notifier``'s watchdog beats (``None``: the served object speaks to
    systemd itself, as a ``gl.Worker(systemd=True)`` does, its watchdog included). The signal
    (``reason_of(signum)``, by default its name) is told to systemd (``STOPPING=1``,
    ``STATUS=<status>: <reason>, draining ...``: through ``stopping(status)``, by default
    ``notifier.stopping``) and ``on_signal`` is called; with ``drain`` > 0 a ``<what>-draining``
    event (the reason, the seconds, ``running()``) is emitted and ``drain_for(drain)`` runs,
    beating the watchdog, until it returns or another signal cuts it short. Then
    ``<what>-stopping`` is emitted. Events go to ``emit(name, fields)``; by default one line
    ``name [fields] k=v ...``.

    Returns:
        The reason, or ``None`` if ``stopped`` returned first (the object stopped by itself:
        nothing is drained or emitted).
    """
    if emit is None:

        def emit(name: str, values: dict[str, object]) -> None:
            _emit(event_line(name, values, fields))

    reason: str | None = None
    async with anyio.create_task_group() as tg:

        async def stopped_by_itself() -> None:
            assert stopped is not None
            await stopped()
            tg.cancel_scope.cancel()

        if stopped is not None:
            tg.start_soon(stopped_by_itself)
        if notifier is not None:
            tg.start_soon(notifier.beat)
        signum = await signals.next()
        reason = reason_of(signum) if reason_of is not None else signal.Signals(signum).name
        tg.cancel_scope.cancel()
    if reason is None:
        return None
    if stopping is None and notifier is not None:
        stopping = notifier.stopping
    if stopping is not None:
        stopping(
            f"{status}: {reason}, "
            + (f"draining for up to {drain:g}s" if drain > 0 else "stopping")
        )
    if on_signal is not None:
        on_signal()
    if drain > 0:
        emit(f"{what}-draining", {"reason": reason, "seconds": drain, "running": running()})
        async with anyio.create_task_group() as tg:

            async def second_signal() -> None:
                await signals.next()
                log.warning("a second signal: the drain is cut short")
                tg.cancel_scope.cancel()

            tg.start_soon(second_signal)
            if notifier is not None:
                tg.start_soon(notifier.beat)  # the drain is part of the service's life
            await drain_for(drain)
            tg.cancel_scope.cancel()
    emit(f"{what}-stopping", {"reason": reason})
    sys.stdout.flush()
    return reason
