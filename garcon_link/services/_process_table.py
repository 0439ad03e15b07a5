"""The process service's table of records: what is held, found, evicted and counted.

Theory of operation
-------------------
:class:`ProcessTable` holds the processes ``start()`` began, by id (running, or exited and not
yet evicted), the ``run()`` calls under way, the spawns in progress (reserved places) and the
ids whose start is in progress; the records a previous worker process left are the ledger's
(:class:`~garcon_link.services._ledger.Ledger`) and count here too. Together they are bounded by
``max_processes``:

- :meth:`ProcessTable.prune` evicts exited records beyond ``max_exited_processes`` or older than
  ``exited_process_ttl`` (restored ones first: they are older). Every lookup prunes first.
- :meth:`ProcessTable.make_room` makes room for one more: a restored record that is over goes
  first, then the exited record that finished first; with every place held by a running
  process the start is refused (``TOO_MANY_PROCESSES``).
- :meth:`ProcessTable.lookup` finds a handle's record: a restored one, or ours; an id the table
  generated and no longer holds was released (``PROCESS_RELEASED``), any other is
  ``UNKNOWN_PROCESS``.
- :meth:`ProcessTable.existing` answers a ``start(id=...)``: the record started with that spec
  (once a start of it in progress has finished), or ``CONFLICT`` for another spec.

The table holds no service; the service owns it, spawns and supervises.
"""

from __future__ import annotations

import time

import anyio

from ..errors import Rejected
from ..rpc.resources import ResourceRef, ServiceScope
from ._ledger import Ledger
from ._limits import ServiceLimits
from ._process_values import ProcessInfo
from ._records import Restored
from ._supervisor import _finished, _Proc

__all__ = ["ProcessTable", "process_info"]

Spec = tuple[object, ...]


def process_info(scope: ServiceScope, proc: _Proc) -> ProcessInfo:
    """The snapshot of a process this worker process started."""
    done = proc.done.is_set()
    return ProcessInfo(
        handle=scope.resource("process", proc.id),
        argv=list(proc.argv),
        cwd=proc.cwd,
        pid=proc.pid,
        running=proc.returncode is None and not proc.done.is_set(),
        status=proc.status() if done else None,
        stdout_end=proc.stdout.end,
        stderr_end=proc.stderr.end,
        stdin_offset=proc.stdin_pos if proc.has_stdin else None,
        id=proc.id,
        stdout_start=proc.stdout.start,
        stderr_start=proc.stderr.start,
        started_at=proc.started_at,
        exited_at=proc.exited_at if done else None,
        state="exited" if done else "running",
    )


class ProcessTable:
    """The records of one process service (see the module).

    Args:
        limits: the service's bounds (``max_processes``, ``max_exited_processes``,
            ``exited_process_ttl``).
        ledger: the service's ledger: the restored records, and where a forgotten record's row
            is deleted.
    """

    def __init__(self, limits: ServiceLimits, ledger: Ledger) -> None:
        self._limits = limits
        self._ledger = ledger
        self.procs: dict[str, _Proc] = {}
        """The processes ``start()`` began, by id, until evicted or released."""
        self.runs: set[_Proc] = set()
        """The processes of ``run()`` calls under way."""
        self.reserved = 0
        """Spawns in progress: places held before their process exists."""
        self._next_id = 1
        self._starting: dict[str, tuple[Spec, anyio.Event]] = {}

    def new_id(self) -> str:
        """A generated id, ``p<n>`` (never given twice by this table)."""
        proc_id = f"p{self._next_id}"
        self._next_id += 1
        return proc_id

    def holds(self, proc: _Proc) -> bool:
        """Whether ``proc`` is the record of its id (not evicted, released or replaced)."""
        return self.procs.get(proc.id) is proc

    def lookup(self, handle: ResourceRef, proc_id: str) -> _Proc | Restored:
        """The record of ``proc_id`` (``handle``'s, checked by the service).

        Raises:
            Rejected: ``PROCESS_RELEASED``, ``UNKNOWN_PROCESS``.
        """
        self.prune()
        restored = self._ledger.restored.get(proc_id)
        if restored is not None:
            return restored
        proc = self.procs.get(proc_id)
        if proc is not None:
            return proc
        number = proc_id[1:]
        if proc_id.startswith("p") and number.isdigit() and int(number) < self._next_id:
            raise Rejected("PROCESS_RELEASED", f"{handle!r} was released")
        raise Rejected(
            "UNKNOWN_PROCESS",
            f"{handle!r} names no process record (never started, released or evicted)",
        )

    def get(self, handle: ResourceRef, proc_id: str) -> _Proc:
        """The record of ``proc_id``, one whose output and stdin this worker holds.

        Raises:
            Rejected: ``OUTPUT_LOST``, ``PROCESS_DETACHED`` (a previous worker's), and those of
                :meth:`lookup`.
        """
        found = self.lookup(handle, proc_id)
        if isinstance(found, Restored):
            raise Rejected(
                "OUTPUT_LOST" if found.state != "detached" else "PROCESS_DETACHED",
                f"process {found.id!r} was started by a previous worker process "
                f"({found.state}): its output and stdin went with that process",
            )
        return found

    def forget(self, proc: _Proc) -> None:
        """Drop ``proc``'s record (if it is its id's) and its retained output."""
        if self.procs.get(proc.id) is proc:
            del self.procs[proc.id]
            self._ledger.forget(proc.id)
        proc.stdout.discard()
        proc.stderr.discard()

    def prune(self) -> None:
        """Evict exited records beyond ``max_exited_processes`` or older than the TTL (those a
        previous worker left first: they are older)."""
        over = self._ledger.over()
        exited = sorted((p for p in self.procs.values() if p.done.is_set()), key=_finished)
        excess = len(exited) + len(over) - self._limits.max_exited_processes
        wall_cutoff = time.time() - self._limits.exited_process_ttl
        for record in over:
            assert record.exited_at is not None
            if excess > 0 or record.exited_at < wall_cutoff:
                self._ledger.forget(record.id)
                excess -= 1
        cutoff = time.monotonic() - self._limits.exited_process_ttl
        for i, proc in enumerate(exited):
            if i < excess or proc.exited_mono < cutoff:
                self.forget(proc)

    def make_room(self) -> None:
        """Make room for one more process (see the module).

        Raises:
            Rejected: ``TOO_MANY_PROCESSES``.
        """
        self.prune()
        held = len(self.procs) + len(self.runs) + self.reserved + len(self._ledger.restored)
        if held < self._limits.max_processes:
            return
        over = self._ledger.over()
        if over:
            self._ledger.forget(over[0].id)
            return
        finished = [p for p in self.procs.values() if p.done.is_set()]
        if not finished:
            raise Rejected(
                "TOO_MANY_PROCESSES",
                f"{self._limits.max_processes} processes are running on this worker",
            )
        self.forget(min(finished, key=_finished))

    async def existing(self, proc_id: str, spec: Spec) -> _Proc | None:
        """The record of ``proc_id`` started with ``spec``, once any start of it in progress
        has finished; ``None`` if there is none (``CONFLICT`` if it has another spec)."""
        while True:
            self.prune()
            proc = self.procs.get(proc_id)
            starting = self._starting.get(proc_id)
            if proc is None and starting is None:
                return None
            theirs = proc.spec if proc is not None else starting[0] if starting else ()
            if theirs != spec:
                raise Rejected(
                    "CONFLICT", f"process {proc_id!r} exists and was started with another spec"
                )
            if proc is not None:
                return proc
            assert starting is not None
            await starting[1].wait()

    def starting(self, proc_id: str, spec: Spec) -> None:
        """A start of ``proc_id`` with ``spec`` is in progress until :meth:`started`."""
        self._starting[proc_id] = (spec, anyio.Event())

    def started(self, proc_id: str) -> None:
        """The start of ``proc_id`` ended (its record is held, or it failed): those waiting in
        :meth:`existing` look again."""
        _, started = self._starting.pop(proc_id)
        started.set()
