"""Output of a started process: one bounded tail per stream, addressed by absolute offsets, kept in
memory or spooled to segment files (``--spool-dir``), with the exact range a reader lost."""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque

import anyio
import anyio.abc

from ..errors import Rejected, RemoteError
from ._process_values import OutputChunk, StreamName, TruncationMarker

log = logging.getLogger("garcon_link.services.process")  # one logger for the whole process service


class _Notifier:
    """A level-less wake-up: ``wait()`` returns after the next ``notify()``."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


def _clamp_offset(
    name: str, start: int, end: int, after: int
) -> tuple[int, TruncationMarker | None]:
    """Where a read from ``after`` starts in a spool that keeps ``[start, end)``, and the exact
    range lost before it, if any.

    Raises:
        Rejected: ``INVALID_OFFSET``, ``after`` is negative or past what was produced.
    """
    if after < 0 or after > end:
        raise Rejected(
            "INVALID_OFFSET", f"{name} offset {after} is outside the {end} bytes produced so far"
        )
    if after < start:
        return start, TruncationMarker(after, start)
    return after, None


class _Output:
    """One output stream: a bounded tail of bytes addressed by absolute stream offsets."""

    def __init__(self, name: StreamName, retention: int, changed: _Notifier) -> None:
        self.name: StreamName = name
        self.retention = retention
        self.start = 0  # offset of the first retained byte
        self.end = 0  # bytes produced so far
        self.eof = False
        self._buf = bytearray()
        self._changed = changed
        self.closed = anyio.Event()

    def append(self, data: bytes) -> None:
        self._buf += data
        self.end += len(data)
        excess = len(self._buf) - self.retention
        if excess > 0:
            del self._buf[:excess]  # O(1) amortised for a bytearray's head
            self.start += excess
        self._changed.notify()

    def close(self) -> None:
        if not self.eof:
            self.eof = True
            self.closed.set()
            self._changed.notify()

    def chunk(self, after: int, max_bytes: int) -> OutputChunk:
        after, truncated = _clamp_offset(self.name, self.start, self.end, after)
        i = after - self.start
        data = bytes(self._buf[i : i + max_bytes])
        eof = self.eof and after + len(data) == self.end
        return OutputChunk(self.name, after, data, truncated, eof)

    def tail(self) -> bytes:
        return bytes(self._buf)

    def discard(self) -> None:
        """Free what is retained (the record is being forgotten)."""
        self._buf = bytearray()


class _DiskOutput(_Output):
    """One output stream spooled to segment files (``--spool-dir``).

    The stream is cut into files of ``retention // 4`` bytes; when more than ``retention``
    bytes are kept, whole oldest segments are deleted, so ``start`` (the first retained
    offset) is always a segment boundary and every truncation range is exact. A write that
    fails (disk full) drops everything retained so far: the reader is told exactly that range.
    Files are written with plain ``os.write`` from the pump (local disk; short writes).
    """

    def __init__(
        self, name: StreamName, retention: int, changed: _Notifier, directory: str, prefix: str
    ) -> None:
        super().__init__(name, retention, changed)
        self._dir = directory
        self._prefix = prefix
        self._segment_bytes = max(retention // 4, 1)
        self._segments: deque[list[int]] = deque()  # [start offset, length, file number]
        self._fd: int | None = None
        self._files = 0

    def _path(self, number: int) -> str:
        return os.path.join(self._dir, f"{self._prefix}.{self.name}.{number}")

    def append(self, data: bytes) -> None:
        try:
            self._write(data)
        except OSError as exc:
            log.warning("spooling %s failed (%s): dropping what it held", self.name, exc)
            self._drop_files()
            self.end += len(data)
            self.start = self.end
        else:
            self.end += len(data)
            while len(self._segments) > 1 and self.end - self._segments[0][0] > self.retention:
                os.unlink(self._path(self._segments.popleft()[2]))
                self.start = self._segments[0][0]
        self._changed.notify()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        position = self.end
        while view:
            last = self._segments[-1] if self._segments else None
            if last is None or self._fd is None or last[1] >= self._segment_bytes:
                self._close_fd()
                number = self._files
                self._files += 1
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                self._fd = os.open(self._path(number), flags, 0o600)
                last = [position, 0, number]
                self._segments.append(last)
                if len(self._segments) == 1:
                    self.start = position
            written = os.write(self._fd, view[: self._segment_bytes - last[1]])
            last[1] += written
            position += written
            view = view[written:]

    def chunk(self, after: int, max_bytes: int) -> OutputChunk:
        after, truncated = _clamp_offset(self.name, self.start, self.end, after)
        data = bytearray()
        try:
            for seg_start, length, number in list(self._segments):
                if seg_start + length <= after + len(data):
                    continue
                want = min(seg_start + length - (after + len(data)), max_bytes - len(data))
                if want <= 0:
                    break
                fd = os.open(self._path(number), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    piece = os.pread(fd, want, after + len(data) - seg_start)
                finally:
                    os.close(fd)
                data += piece
                if len(piece) < want:
                    break
        except OSError as exc:
            raise RemoteError("SPOOL_FAILED", f"cannot read the {self.name} spool: {exc}") from exc
        eof = self.eof and after + len(data) == self.end
        return OutputChunk(self.name, after, bytes(data), truncated, eof)

    def tail(self) -> bytes:
        return self.chunk(self.start, self.end - self.start).data

    def close(self) -> None:
        self._close_fd()
        super().close()

    def discard(self) -> None:
        self._drop_files()

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _drop_files(self) -> None:
        self._close_fd()
        while self._segments:
            with contextlib.suppress(OSError):
                os.unlink(self._path(self._segments.popleft()[2]))
