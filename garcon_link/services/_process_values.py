"""The values the process service returns: output chunks, truncation markers, exit statuses,
run results and process records (documented in :mod:`garcon_link.services.process`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..rpc.resources import ResourceRef

StreamName = Literal["stdout", "stderr"]


# ---------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class TruncationMarker:
    """Output bytes ``[start, end)`` of one stream were dropped by retention before being read."""

    start: int
    end: int


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """Bytes of one output stream starting at ``offset``.

    Attributes:
        stream: ``"stdout"`` or ``"stderr"``.
        offset: stream offset of ``data[0]`` (continue with ``offset + len(data)``).
        data: the raw bytes (may be empty).
        truncated: set when the requested offset was already dropped: the dropped range, which
            ends at ``offset``.
        eof: the stream is closed and ``data`` reaches its end.
    """

    stream: StreamName
    offset: int
    data: bytes
    truncated: TruncationMarker | None
    eof: bool


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How a process ended.

    Attributes:
        code: the exit code, or ``None`` if it died of a signal.
        signal: the signal's name (``"SIGKILL"``) if it died of one, else ``None``.
        timed_out: the start ``timeout`` expired and the service killed the group.
        killed: it died of a signal the service sent on its own authority (``terminate``, the
            start timeout, a cancelled ``run``, the end of the session) -- not ``signal()``.
    """

    code: int | None
    signal: str | None
    timed_out: bool
    killed: bool


@dataclass(frozen=True, slots=True)
class RunResult:
    """What :meth:`ProcessService.run` returns.

    ``stdout``/``stderr`` hold at most ``max_output`` bytes each: the **last** bytes written;
    ``*_truncated`` says earlier bytes were dropped.
    """

    status: ExitStatus
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A snapshot of one started process.

    Attributes:
        handle: its reference.
        argv: what was started.
        cwd: its working directory in the caller's namespace.
        pid: diagnostic only (also the process group id).
        running: the leader has not exited yet.
        status: the exit status once the leader exited and the output drained, else ``None``.
        stdout_end, stderr_end: bytes produced so far per stream.
        stdin_offset: stdin bytes accepted so far (``None`` if started without stdin).
        id: the process id: the caller's (``start(id=...)``) or a generated ``p<n>``.
        stdout_start, stderr_start: the first offset still retained per stream; everything
            before it was dropped (a read from an earlier offset reports that exact range).
        started_at: wall-clock time (``time.time()``) of the start.
        exited_at: wall-clock time the record finished (exit and output drained), else ``None``.
        state: ``"running"`` or ``"exited"``; for a record a previous worker process left in
            the state directory, ``"exited"``, ``"lost"`` (it was running when that worker
            died; its exit is unknown) or ``"detached"`` (the same process is still alive,
            no longer supervised: its output is not captured). Empty from a worker that
            predates the field.
    """

    handle: ResourceRef
    argv: list[str]
    cwd: str
    pid: int
    running: bool
    status: ExitStatus | None
    stdout_end: int
    stderr_end: int
    stdin_offset: int | None
    id: str = ""
    stdout_start: int = 0
    stderr_start: int = 0
    started_at: float = 0.0
    exited_at: float | None = None
    state: str = ""
