"""What the process service keeps in the worker's state directory, and what it restored from it.

:class:`Ledger` is the service's side of :mod:`._records` (the rows): which ids have a stored
record, the deletes not written yet, and the records a previous worker process left
(:class:`~garcon_link.services._records.Restored`: ``exited``, ``lost`` or ``detached``). A
start's record is stored before its handle is returned, and again when the process finishes; a
record released or evicted is deleted with the next write. A write that fails or takes longer
than ``_RECORD_TIMEOUT`` is logged and the service goes on: the record is then not durable, the
process is unaffected.

A restored record is not our child: a detached one is watched through ``/proc``
(``_DETACHED_POLL``), signalled and terminated only after its identity is checked again, and its
exit status cannot be known; reading its output is refused by the service (the pipes went with
the old worker). Without a state directory the ledger keeps and restores nothing.

The ledger holds no service: the service owns it and hands it each process it asks about.
"""

from __future__ import annotations

import logging
import signal as sig_mod
import time
from collections.abc import Iterable

import anyio

from ..errors import Rejected, RemoteError
from ..rpc.resources import ResourceRef, ServiceScope
from ..rpc.statedir import StateDirectory, Statement, StateUnavailable
from ._process_values import ExitStatus, ProcessInfo
from ._records import (
    Restored,
    delete_statement,
    exit_statement,
    restore,
    restored_exit_statement,
    restored_status,
    signal_detached,
    start_statement,
)
from ._supervisor import _REAP_TIMEOUT, _Proc

__all__ = ["Ledger", "restored_info"]

log = logging.getLogger("garcon_link.services.process")  # one logger for the whole process service

_DETACHED_POLL = 0.1
"""Seconds between two looks at a detached process (not our child: it cannot be awaited)."""
_RECORD_TIMEOUT = 10.0
"""Seconds a start or an exit waits for its record to be committed before going on without
(logged: the record is then not durable)."""


def _exit_statement(proc: _Proc) -> Statement:
    return exit_statement(
        proc.id,
        proc.argv,
        proc.cwd,
        proc.pid,
        proc.spec,
        proc.started_at,
        proc.status(),
        proc.exited_at or time.time(),
        proc.stdout.end,
        proc.stderr.end,
    )


def restored_info(scope: ServiceScope, record: Restored) -> ProcessInfo:
    """The snapshot of a record a previous worker process left (its output went with it)."""
    return ProcessInfo(
        handle=scope.resource("process", record.id),
        argv=list(record.argv),
        cwd=record.cwd,
        pid=record.pid,
        running=record.state == "detached",
        status=record.status,
        stdout_end=record.stdout_end,
        stderr_end=record.stderr_end,
        stdin_offset=None,
        id=record.id,
        stdout_start=record.stdout_end,  # the output went with the old worker process
        stderr_start=record.stderr_end,
        started_at=record.started_at,
        exited_at=record.exited_at,
        state=record.state,
    )


class Ledger:
    """The process records in the state directory, and those restored from it.

    Args:
        state: the worker's state directory (``None``: nothing stored, nothing restored). The
            rows its opening read are taken (``state.process_rows`` is emptied).
    """

    def __init__(self, state: StateDirectory | None) -> None:
        self._state = state
        self._durable: set[str] = set()  # ids whose record is in the state directory
        self._pending: list[Statement] = []  # deletes not written yet
        self.restored: dict[str, Restored] = {}
        """The records a previous worker process left, by id, oldest start first."""
        if state is not None:
            self.restored, self._pending = restore(state.process_rows, str(state.database))
            state.process_rows = []
            self._durable.update(self.restored)
            if self.restored:
                lost = sum(r.state == "lost" for r in self.restored.values())
                log.info(
                    "restored %d process record(s) from the state directory, %d of them lost",
                    len(self.restored),
                    lost,
                )

    @property
    def keeping(self) -> bool:
        """Whether records are stored (a state directory was given)."""
        return self._state is not None

    async def persist(self, *statements: Statement) -> None:
        """Write ``statements`` (and the pending deletes) to the state directory; a failure is
        logged: the record is then not durable, the process is unaffected."""
        if self._state is None:
            return
        batch, self._pending = [*self._pending, *statements], []
        with anyio.move_on_after(_RECORD_TIMEOUT) as waited:
            try:
                await self._state.write(batch)
            except StateUnavailable as exc:
                log.warning("a process record was not stored: %s", exc)
        if waited.cancelled_caught:
            log.warning("a process record was not stored within %ss", _RECORD_TIMEOUT)

    async def started(self, proc: _Proc) -> None:
        """Store ``proc``'s start record (shielded: a restarted worker knows every handle it
        gave)."""
        self._durable.add(proc.id)
        with anyio.CancelScope(shield=True):
            record = start_statement(
                proc.id, proc.argv, proc.cwd, proc.pid, proc.spec, proc.started_at
            )
            await self.persist(record)

    async def exited(self, proc: _Proc) -> None:
        """Store ``proc``'s exit record (it finished), if its start record was stored."""
        if proc.id in self._durable:
            await self.persist(_exit_statement(proc))

    async def close(self, finished: Iterable[_Proc]) -> None:
        """Write the exit records of the ``finished`` processes whose start was stored, and
        the deletes not written yet (shielded: the service is closing)."""
        if self._state is None:
            return
        statements = [_exit_statement(p) for p in finished if p.id in self._durable]
        with anyio.CancelScope(shield=True):
            await self.persist(*statements)

    def forget(self, proc_id: str) -> None:
        """Drop ``proc_id``'s record (restored or stored); its row is deleted with the next
        write."""
        self.restored.pop(proc_id, None)
        if proc_id in self._durable:
            self._durable.discard(proc_id)
            self._pending.append(delete_statement(proc_id))

    def over(self) -> list[Restored]:
        """Restored records that are over (exited or lost), oldest finish first; a detached
        one found dead becomes lost."""
        for record in self.restored.values():
            if record.state == "detached" and not record.alive():
                record.state, record.exited_at = "lost", time.time()
        over = [r for r in self.restored.values() if r.state != "detached"]
        return sorted(over, key=lambda r: r.exited_at or 0.0)

    async def wait(self, record: Restored, timeout: float | None) -> ExitStatus:
        """``record``'s exit status once it is over (``PROCESS_LOST`` if it has none).

        Raises:
            RemoteError: ``WAIT_TIMEOUT`` after ``timeout`` seconds.
        """
        with anyio.move_on_after(timeout):
            # Not our child: nothing to await but a look at /proc.
            while record.alive():  # noqa: ASYNC110
                await anyio.sleep(_DETACHED_POLL)
            return restored_status(record)
        raise RemoteError(
            "WAIT_TIMEOUT", f"process {record.id} has not finished within {timeout} seconds"
        )

    async def terminate(self, record: Restored, grace: float) -> ExitStatus:
        """SIGTERM, then SIGKILL after ``grace``, a detached process's group; its exit status
        cannot be known (not our child): ``killed`` with no code or signal. A record that is
        not detached reports its status (``PROCESS_LOST`` if none)."""
        if record.state != "detached":
            return restored_status(record)
        for signum, wait in ((sig_mod.SIGTERM, grace), (sig_mod.SIGKILL, _REAP_TIMEOUT)):
            if not signal_detached(record, signum):
                break
            with anyio.move_on_after(wait):
                # Not our child: nothing to await but a look at /proc.
                while record.alive():  # noqa: ASYNC110
                    await anyio.sleep(_DETACHED_POLL)
        if record.alive():
            raise RemoteError("WAIT_TIMEOUT", f"process {record.id} survived SIGKILL")
        record.state, record.exited_at = "exited", time.time()
        record.status = ExitStatus(None, None, False, True)
        await self.persist(restored_exit_statement(record, record.status, record.exited_at))
        return record.status

    async def release(self, handle: ResourceRef, record: Restored) -> None:
        """Forget ``record`` and delete its row.

        Raises:
            Rejected: ``PROCESS_RUNNING`` (detached: still alive).
        """
        if record.state == "detached":
            raise Rejected("PROCESS_RUNNING", f"{handle!r} is still running; terminate it first")
        self.forget(record.id)
        await self.persist()
