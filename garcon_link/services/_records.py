"""The process service's records in the worker's state directory (the ``processes`` table of
:mod:`garcon_link.rpc.statedir`), so a restarted worker still knows what its predecessor started.

One row per record started with ``start()`` (``run()`` is one call: nothing to reconcile), a
CBOR map: argv, cwd, pid, the process's start time (``/proc/<pid>/stat`` field 22, clock ticks
since boot) and the boot id (``/proc/sys/kernel/random/boot_id``), a digest of the start's spec
(not the spec: ``env`` may hold secrets), the wall-clock start and, once the process finished,
its exit status, finish time and output sizes. Written when the process starts and when it
finishes; deleted when the record is released or evicted.

What a restarted worker makes of a row (:func:`restore`):

* finished -- an exited record with its status; its output is gone (it was captured by the old
  worker process), so reads are refused with ``OUTPUT_LOST``;
* running, and a process with that pid, start time and boot id still exists -- ``detached``: it
  is the same process, alive but no longer supervised. Its output cannot be captured again (the
  pipes died with the worker that held them), its exit status cannot be known (it is not our
  child); it can be signalled and terminated (the start time is checked again first);
* running otherwise -- ``lost``: it was running when its worker died; its exit is unknown.

Every row read is checked; a row that is not what this module writes is skipped (and deleted)
with a warning, not trusted. A restored record is signalled only after that check is made again
(:func:`signal_detached`); its exit status is the one stored, or none (:func:`restored_status`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import blake3
import cbor2

from ..errors import Rejected
from ..rpc.statedir import Statement
from ._process_values import ExitStatus

log = logging.getLogger("garcon_link.services.process")

__all__ = [
    "Restored",
    "boot_id",
    "delete_statement",
    "exit_statement",
    "restore",
    "restored_exit_statement",
    "restored_status",
    "same_process",
    "signal_detached",
    "spec_digest",
    "start_statement",
    "start_ticks",
]

RestoredState = Literal["exited", "lost", "detached"]

_UPSERT = "INSERT OR REPLACE INTO processes (id, record) VALUES (?, ?)"
_DELETE = "DELETE FROM processes WHERE id = ?"
_MAX_RECORD = 256 * 1024  # a row larger than this was not written by us


def start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None if there is none,
    it is a zombie (dead, not reaped yet), or this is not Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read(4096)
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19])  # field 22; fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            return file.read(64).strip()
    except OSError:
        return ""


def same_process(pid: int, ticks: int | None, boot: str) -> bool:
    """Whether ``pid`` is still the process that started at ``ticks`` in boot ``boot``."""
    return ticks is not None and bool(boot) and boot == boot_id() and start_ticks(pid) == ticks


def spec_digest(spec: tuple[object, ...]) -> bytes:
    return blake3.blake3(cbor2.dumps(list(spec), canonical=True)).digest()


@dataclass(slots=True, eq=False)
class Restored:
    """A record a previous worker process left (module docstring)."""

    id: str
    argv: list[str]
    cwd: str
    pid: int
    ticks: int | None
    boot: str
    spec: bytes
    started_at: float
    state: RestoredState
    status: ExitStatus | None
    exited_at: float | None
    stdout_end: int
    stderr_end: int

    def alive(self) -> bool:
        return self.state == "detached" and same_process(self.pid, self.ticks, self.boot)


def start_statement(
    proc_id: str, argv: list[str], cwd: str, pid: int, spec: tuple[object, ...], started_at: float
) -> Statement:
    record = {
        "argv": argv,
        "cwd": cwd,
        "pid": pid,
        "ticks": start_ticks(pid),
        "boot": boot_id(),
        "spec": spec_digest(spec),
        "started_at": started_at,
    }
    return _UPSERT, (proc_id, cbor2.dumps(record))


def exit_statement(
    proc_id: str,
    argv: list[str],
    cwd: str,
    pid: int,
    spec: tuple[object, ...],
    started_at: float,
    status: ExitStatus,
    exited_at: float,
    stdout_end: int,
    stderr_end: int,
) -> Statement:
    record = {
        "argv": argv,
        "cwd": cwd,
        "pid": pid,
        "spec": spec_digest(spec),
        "started_at": started_at,
        "status": [status.code, status.signal, status.timed_out, status.killed],
        "exited_at": exited_at,
        "stdout_end": stdout_end,
        "stderr_end": stderr_end,
    }
    return _UPSERT, (proc_id, cbor2.dumps(record))


def restored_exit_statement(record: Restored, status: ExitStatus, exited_at: float) -> Statement:
    """The row of a restored record that finished under this worker (terminated)."""
    row = {
        "argv": record.argv,
        "cwd": record.cwd,
        "pid": record.pid,
        "spec": record.spec,
        "started_at": record.started_at,
        "status": [status.code, status.signal, status.timed_out, status.killed],
        "exited_at": exited_at,
        "stdout_end": record.stdout_end,
        "stderr_end": record.stderr_end,
    }
    return _UPSERT, (record.id, cbor2.dumps(row))


def delete_statement(proc_id: str) -> Statement:
    return _DELETE, (proc_id,)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parse(proc_id: object, blob: object) -> Restored | None:
    if not isinstance(proc_id, str) or not isinstance(blob, bytes) or len(blob) > _MAX_RECORD:
        return None
    try:
        record: Any = cbor2.loads(blob)
    except Exception:  # anything cbor2 raises for bytes it cannot read
        return None
    if not isinstance(record, dict):
        return None
    argv, cwd, pid = record.get("argv"), record.get("cwd"), record.get("pid")
    spec: Any = record.get("spec")
    started_at: Any = record.get("started_at")
    if not (
        isinstance(argv, list)
        and all(isinstance(a, str) for a in argv)
        and isinstance(cwd, str)
        and isinstance(pid, int)
        and pid > 0
        and isinstance(spec, bytes)
        and _number(started_at)
    ):
        return None
    status_value = record.get("status")
    if status_value is None:
        ticks, boot = record.get("ticks"), record.get("boot", "")
        if ticks is not None and not isinstance(ticks, int):
            return None
        if not isinstance(boot, str):
            return None
        state: RestoredState = "detached" if same_process(pid, ticks, boot) else "lost"
        return Restored(
            proc_id, argv, cwd, pid, ticks, boot, spec, float(started_at), state, None,
            None if state == "detached" else time.time(), 0, 0,
        )  # fmt: skip
    exited_at: Any = record.get("exited_at")
    ends: tuple[Any, Any] = (record.get("stdout_end"), record.get("stderr_end"))
    if not (
        isinstance(status_value, list)
        and len(status_value) == 4
        and (status_value[0] is None or isinstance(status_value[0], int))
        and (status_value[1] is None or isinstance(status_value[1], str))
        and isinstance(status_value[2], bool)
        and isinstance(status_value[3], bool)
        and _number(exited_at)
        and all(isinstance(end, int) and end >= 0 for end in ends)
    ):
        return None
    status = ExitStatus(*status_value)
    return Restored(
        proc_id, argv, cwd, pid, None, "", spec, float(started_at), "exited", status,
        float(exited_at), int(ends[0]), int(ends[1]),
    )  # fmt: skip


def restore(rows: list[tuple[Any, ...]], where: str) -> tuple[dict[str, Restored], list[Statement]]:
    """The records in ``rows`` (``(id, record)``), oldest start first, and the statements that
    delete the unreadable ones (``where`` names the database in the warning)."""
    restored: list[Restored] = []
    bad: list[Statement] = []
    for row in rows:
        record = _parse(*row) if len(row) == 2 else None
        if record is None:
            log.warning("%s: skipping a process record garcon-link did not write", where)
            if isinstance(row[0], str):
                bad.append(delete_statement(row[0]))
            continue
        restored.append(record)
    restored.sort(key=lambda r: r.started_at)
    return {r.id: r for r in restored}, bad


def signal_detached(record: Restored, signum: int) -> bool:
    """Signal the group of a process a previous worker started, if it is provably still the
    same process (pid, start time and boot checked right before)."""
    if not record.alive():
        return False
    try:
        os.killpg(record.pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def restored_status(record: Restored) -> ExitStatus:
    """The exit status of a record a previous worker left; a lost one has none."""
    if record.status is not None:
        return record.status
    raise Rejected(
        "PROCESS_LOST",
        f"process {record.id!r} was running when the worker process that started it stopped; "
        "its exit status is unknown",
    )
