"""A real worker process for the keyed-call tests that SIGKILL it (tests/test_idempotency_remote.py,
tests/soak/test_kill_soak.py): its limits, its start, and a ledger service for the soak.

* :data:`PROCESS_LIMITS` -- the worker's and the controller's ``Limits`` (as TOML keys): a fast
  heartbeat and redial, so a killed worker is noticed and a restarted one reached in well under a
  second, and a ``detached_grace``/``call_timeout`` that outlast a restart.
* :func:`worker_process` -- ``garcon-link worker`` (a :class:`garcon_link.testing.WorkerProcess`)
  on a fixed port, serving ``ledger`` (:class:`faultutil.LedgerService` unless told otherwise),
  optionally on a state directory, with its journal file.
* :class:`KeyedLedgerService` -- the soak's service: each execution appends ``start`` and
  ``done`` lines (key, worker pid, ``CLOCK_MONOTONIC`` time) to an append-only file, each
  synced to disk before the handler goes on, and returns its checksum *with the pid of the process
  that ran it*, so a replayed result names the execution it came from. :func:`read_ledger` parses
  the file.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
from faultutil import JOURNAL_ENV, TESTS_DIR, checksum, write_configs

from garcon_link.testing import WorkerProcess, free_tcp_port

PROCESS_LIMITS: dict[str, Any] = {
    "heartbeat_interval": 0.05,
    "heartbeat_timeout": 0.5,
    "detached_grace": 20.0,
    "handshake_timeout": 2.0,
    "takeover_probe_timeout": 0.3,
    "connect_timeout": 1.0,
    "backoff_base": 0.01,
    "backoff_max": 0.1,
    "close_timeout": 0.3,
    "scope_cleanup_timeout": 0.5,
    "call_timeout": 20.0,
}

LEDGER_SERVICE = "ledger=faultutil:LedgerService"
KEYED_LEDGER_SERVICE = "ledger=keyedworker:KeyedLedgerService"


@asynccontextmanager
async def worker_process(
    tmp_path: Path,
    *,
    state_dir: Path | None = None,
    service: str = LEDGER_SERVICE,
    limits: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[WorkerProcess, Path]]:
    """A started worker process serving ``service`` on a fixed loopback port (so a restart comes
    back on the same URL), with ``--state-dir state_dir`` if given. Yields it and the path of
    the journal its service writes (``GARCON_TEST_JOURNAL``); leaving kills and reaps it."""
    worker_toml, _ = write_configs(
        tmp_path, port=free_tcp_port(), limits=PROCESS_LIMITS if limits is None else limits
    )
    journal = tmp_path / "journal"
    async with WorkerProcess(
        worker_toml,
        [service],
        cwd=TESTS_DIR,
        env={JOURNAL_ENV: str(journal)},
        args=() if state_dir is None else ("--state-dir", str(state_dir)),
    ) as worker:
        await worker.start()
        yield worker, journal


# ------------------------------------------------------------------------------ the soak's ledger


class KeyedLedger(Protocol):
    """:class:`KeyedLedgerService` as a controller sees it."""

    async def run(self, key: str, payload: bytes, hold: float) -> str: ...


def keyed_result(key: str, payload: bytes, pid: int) -> str:
    """What :meth:`KeyedLedgerService.run` returns when process ``pid`` executes it."""
    return f"{checksum(key, payload)} {pid}"


class KeyedLedgerService:
    """Each execution of :meth:`run` appends ``start KEY PID NS`` before it does anything and
    ``done KEY PID NS`` just before it returns (``NS``: ``time.monotonic_ns()``, one clock for
    every process of the machine), to the file ``GARCON_TEST_JOURNAL`` names, opened
    ``O_APPEND``; each line is synced to disk (``fsync``, in a thread) before the handler goes
    on. A SIGKILL can cut an execution between its lines, never inside one."""

    def __init__(self) -> None:
        self._fd = os.open(os.environ[JOURNAL_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._pid = os.getpid()

    async def _line(self, event: str, key: str) -> None:
        os.write(self._fd, f"{event} {key} {self._pid} {time.monotonic_ns()}\n".encode())
        await anyio.to_thread.run_sync(os.fsync, self._fd)

    async def run(self, key: str, payload: bytes, hold: float) -> str:
        await self._line("start", key)
        if hold > 0:
            await anyio.sleep(hold)
        await self._line("done", key)
        return keyed_result(key, payload, self._pid)


@dataclass(frozen=True, slots=True)
class LedgerLine:
    event: str  # start | done
    key: str
    pid: int
    at: float  # time.monotonic() of the write, in seconds


def read_ledger(path: Path) -> list[LedgerLine]:
    """The lines :class:`KeyedLedgerService` wrote, in order (empty if there is no file).

    Raises:
        AssertionError: a line is malformed (torn writes would show here).
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines: list[LedgerLine] = []
    for raw in text.splitlines():
        parts = raw.split(" ")
        assert len(parts) == 4 and parts[0] in ("start", "done"), f"bad ledger line {raw!r}"
        lines.append(LedgerLine(parts[0], parts[1], int(parts[2]), int(parts[3]) / 1e9))
    return lines
