"""Supervision of started processes: one record per process group with its supervisor (output
pumps, stdin feeder, timeout watchdog, reaping), signals, and the detached tasks that run the
supervisors outside any task group (why: :mod:`garcon_link.services.process`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal as sig_mod
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import anyio.abc

from ..errors import Rejected
from ._process_values import ExitStatus
from ._spool import _DiskOutput, _Notifier, _Output

log = logging.getLogger("garcon_link.services.process")  # one logger for the whole process service


_FEED_CHUNK = 64 * 1024
_REAP_TIMEOUT = 2.0
_finish_order = itertools.count(1)


# ---------------------------------------------------------------------------- plumbing


def _start_detached(runner: Callable[[], Awaitable[None]], name: str, refs: set[Any]) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        trio.lowlevel.spawn_system_task(runner, name=name)
    else:

        async def main() -> None:
            await runner()

        task = loop.create_task(main(), name=name)
        refs.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(refs.discard)


class _DetachedTasks:
    """Tasks owned by an object, cancellable and awaitable from any task (why: see
    :mod:`garcon_link.services.process`)."""

    def __init__(self) -> None:
        self._live: dict[int, tuple[anyio.CancelScope, anyio.Event]] = {}
        self._refs: set[Any] = set()
        self._keys = itertools.count()
        self._closed = False

    def spawn(self, func: Callable[[], Awaitable[None]], name: str) -> None:
        if self._closed:
            raise RuntimeError("spawn() after aclose()")
        key = next(self._keys)
        scope = anyio.CancelScope()
        done = anyio.Event()
        self._live[key] = (scope, done)

        async def runner() -> None:
            try:
                with scope:
                    await func()
            except Exception:
                log.exception("background task %s failed", name)
            finally:
                self._live.pop(key, None)
                done.set()

        _start_detached(runner, name, self._refs)

    async def aclose(self) -> None:
        """Cancel every task and wait for each to finish its (shielded) cleanup."""
        self._closed = True
        entries = list(self._live.values())
        for scope, _ in entries:
            scope.cancel()
        for _, done in entries:
            await done.wait()


def _finished(proc: _Proc) -> int:
    return proc.finished


def _signal_name(number: int) -> str:
    try:
        return sig_mod.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _parse_signal(name: str) -> sig_mod.Signals:
    text = name.strip().upper()
    try:
        if text.isdigit():
            return sig_mod.Signals(int(text))
        return sig_mod.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise Rejected("INVALID_SIGNAL", f"unknown signal {name!r}") from None


class _Proc:
    """One started process and its supervisor state."""

    def __init__(
        self,
        proc_id: str,
        argv: list[str],
        cwd: str,
        process: anyio.abc.Process,
        *,
        retention: int,
        timeout: float | None,
        spec: tuple[object, ...] = (),
        spool: tuple[str, str] | None = None,
    ) -> None:
        self.id = proc_id
        self.argv = argv
        self.cwd = cwd
        self.spec = spec  # what start(id=...) compares
        self.process = process
        self.pid = process.pid
        self.changed = _Notifier()
        self.stdout: _Output
        self.stderr: _Output
        if spool is None:
            self.stdout = _Output("stdout", retention, self.changed)
            self.stderr = _Output("stderr", retention, self.changed)
        else:
            directory, prefix = spool
            self.stdout = _DiskOutput("stdout", retention, self.changed, directory, prefix)
            self.stderr = _DiskOutput("stderr", retention, self.changed, directory, prefix)
        self.started_at = time.time()
        self.exited_at: float | None = None
        self.exited_mono = 0.0
        self.has_stdin = process.stdin is not None
        self.stdin_buf = bytearray()
        self.stdin_pos = 0
        self.stdin_closing = False
        self.stdin_state: Literal["open", "closed", "broken"] = "open"
        self.timeout = timeout
        self.returncode: int | None = None
        self.timed_out = False
        self.forced = False
        self.done = anyio.Event()
        self.finished = 0  # order of completion, for evicting the oldest finished record

    # -- signals

    def killpg(self, signum: int) -> bool:
        """Signal the group while it may exist (not after the supervisor finished)."""
        if self.done.is_set():
            return False
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def force(self, signum: int) -> bool:
        """Signal the group on the service's own authority (reported as ``killed``)."""
        if self.done.is_set():
            return False
        self.forced = True
        return self.killpg(signum)

    def status(self) -> ExitStatus:
        rc = self.returncode
        if rc is None:
            return ExitStatus(None, None, self.timed_out, False)
        if rc < 0:
            return ExitStatus(None, _signal_name(-rc), self.timed_out, self.forced)
        return ExitStatus(rc, None, self.timed_out, False)

    # -- supervisor

    async def supervise(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                assert self.process.stdout is not None and self.process.stderr is not None
                tg.start_soon(self._pump, self.process.stdout, self.stdout)
                tg.start_soon(self._pump, self.process.stderr, self.stderr)
                if self.has_stdin:
                    tg.start_soon(self._feed)
                if self.timeout is not None:
                    tg.start_soon(self._watchdog, self.timeout)
                self.returncode = await self.process.wait()
                self.changed.notify()
                # Drained: every member holding the pipes is gone (or closed them).
                await self.stdout.closed.wait()
                await self.stderr.closed.wait()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()

    async def _finish(self) -> None:
        if self.returncode is None or not (self.stdout.eof and self.stderr.eof):
            # Cancelled (session end, service closed) before the group finished.
            self.force(sig_mod.SIGKILL)
            if self.returncode is None:
                with anyio.move_on_after(_REAP_TIMEOUT):
                    self.returncode = await self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                try:
                    await stream.aclose()
                except Exception:  # a broken pipe while closing changes nothing
                    pass
        self.stdout.close()
        self.stderr.close()
        if self.stdin_state == "open":
            self.stdin_state = "closed"
        self.stdin_buf.clear()
        self.finished = next(_finish_order)
        self.exited_at = time.time()
        self.exited_mono = time.monotonic()
        self.done.set()
        self.changed.notify()

    async def _pump(self, stream: anyio.abc.ByteReceiveStream, out: _Output) -> None:
        try:
            async for data in stream:
                out.append(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            out.close()

    async def _feed(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            while True:
                if self.stdin_buf:
                    chunk = bytes(self.stdin_buf[:_FEED_CHUNK])
                    del self.stdin_buf[: len(chunk)]
                    self.changed.notify()  # room for writers
                    await stdin.send(chunk)
                elif self.stdin_closing:
                    await stdin.aclose()
                    self.stdin_state = "closed"
                    self.changed.notify()
                    return
                else:
                    await self.changed.wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self.stdin_state = "broken"
            self.stdin_buf.clear()
            self.changed.notify()

    async def _watchdog(self, timeout: float) -> None:
        await anyio.sleep(timeout)
        if not self.done.is_set():
            self.timed_out = True
            self.force(sig_mod.SIGKILL)
            self.changed.notify()

    # -- stdin

    async def enqueue(self, data: bytes, offset: int, capacity: int) -> int:
        if not self.has_stdin:
            raise Rejected("NO_STDIN", f"process {self.id} was started without stdin")
        if offset < 0:
            raise Rejected("INVALID_ARGUMENTS", "offset must be >= 0")
        while True:
            skip = self.stdin_pos - offset
            if skip < 0:
                raise Rejected(
                    "STDIN_GAP", f"data starts at {offset}, but stdin is at {self.stdin_pos}"
                )
            if skip >= len(data):
                return self.stdin_pos  # already accepted (a replayed or repeated write)
            if self.stdin_closing or self.stdin_state != "open" or self.done.is_set():
                raise Rejected("STDIN_CLOSED", f"stdin of process {self.id} is closed")
            room = capacity - len(self.stdin_buf)
            if room <= 0:
                await self.changed.wait()
                continue
            part = data[skip : skip + room]
            self.stdin_buf += part
            self.stdin_pos += len(part)
            self.changed.notify()
