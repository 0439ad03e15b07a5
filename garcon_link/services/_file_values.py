"""The values the file service returns (stats, directory pages, read chunks, upload status) and
the version token of a file (documented in :mod:`garcon_link.services.files`)."""

from __future__ import annotations

import os
import stat as stat_mod
from dataclasses import dataclass
from typing import Literal

FileKind = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True, slots=True)
class FileStat:
    """What :meth:`FileService.stat` reports.

    Attributes:
        path: the canonical path in the caller's namespace (symlinks resolved).
        kind: ``"file"``, ``"dir"``, ``"symlink"`` or ``"other"`` (device, FIFO, socket).
        size: size in bytes.
        mode: permission bits (``st_mode & 0o7777``).
        mtime: modification time, seconds since the epoch.
        version: the version token (see the module docstring); pass it as ``if_match``.
    """

    path: str
    kind: FileKind
    size: int
    mode: int
    mtime: float
    version: str


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing (not following symlinks: a link is ``"symlink"``)."""

    name: str
    kind: FileKind
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class DirPage:
    """One page of a sorted directory listing.

    Attributes:
        path: the listed directory (canonical).
        entries: entries sorted by name, all after the requested ``after``.
        next_after: pass as ``after`` for the next page; ``None`` when this is the last page.
        undecodable: entries skipped because their names are not valid UTF-8.
    """

    path: str
    entries: list[DirEntry]
    next_after: str | None
    undecodable: int = 0


@dataclass(frozen=True, slots=True)
class ReadChunk:
    """Bytes read at ``offset``; ``eof`` when the chunk reaches the file's end.

    ``version`` and ``size`` describe the file as opened for this read: read a file in several
    chunks and compare versions to detect a concurrent change.
    """

    path: str
    offset: int
    data: bytes
    size: int
    version: str
    eof: bool


@dataclass(frozen=True, slots=True)
class UploadStatus:
    """Where an unfinished upload stands (:meth:`FileService.upload_status`).

    Attributes:
        path: the destination, as given to ``begin_upload``.
        received: bytes received and written to the staged file, in order from 0: the offset
            the next chunk must start at (a chunk starting earlier is accepted, its already
            received part ignored).
        size: the size declared to ``begin_upload`` (``None``: not declared).
    """

    path: str
    received: int
    size: int | None


def _kind(mode: int) -> FileKind:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "dir"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def version_token(st: os.stat_result) -> str:
    """The version token of a stat result (see :mod:`garcon_link.services.files`)."""
    return f"{st.st_mtime_ns:x}-{st.st_ctime_ns:x}-{st.st_size:x}-{st.st_ino:x}"


def _file_stat(path: str, st: os.stat_result) -> FileStat:
    return FileStat(
        path=path,
        kind=_kind(st.st_mode),
        size=st.st_size,
        mode=stat_mod.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
        version=version_token(st),
    )
