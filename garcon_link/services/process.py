"""The built-in process service: run programs on the worker, stream their output (POSIX).

The service's methods (start, output, exit, release) are kept here; the table of its records
(lookups, eviction, room for one more) is :mod:`._process_table`, the supervision of one process
group :mod:`._supervisor`, the rows stored in the state directory :mod:`._records`, what the
service keeps there and restored from it (and what can be done with a restored record)
:mod:`._ledger`, the spools :mod:`._spool`, the checks of a caller's arguments
:mod:`._process_args`.

Theory of operation
-------------------
:meth:`LocalProcessService.start` spawns ``argv`` directly (no shell: pass ``["sh", "-c", ...]``
to get one) in **its own session and process group** (``start_new_session=True``), with:

* ``cwd`` -- a directory in the file service's namespace (``/`` is the service root; same rules as
  :mod:`garcon_link.services.files`: absolute, no ``..``, symlinks only inside the root). ``None``
  is the root.
* ``env`` -- merged over a **clean base** (``PATH``, ``LANG``, ``LC_ALL``, ``TZ``, ``USER``,
  ``LOGNAME`` copied from the worker when set, ``HOME`` = the root, ``PWD`` = the working
  directory). The worker's own environment (and the link secret) is never passed on.

The root confines the *paths callers pass*, not what a program may do: a started program runs
with the worker's user and privileges. Exposing this service is handing out a shell.

Durable processes. Served by :func:`~garcon_link.services.builtin_services`, the
service is **worker-scoped**: one object per worker process, shared by every logical session.
The handle is a :class:`~garcon_link.ResourceRef` of kind ``"process"`` carrying the worker's
runtime id: it stays valid when the session is replaced or the controller restarts, and raises
:class:`~garcon_link.StaleResource` only after the worker restarts. A process keeps running when
its controller disconnects; it is terminated when the worker stops. ``start(id=...)`` names a
process: while the worker holds its record (running, or exited within ``exited_process_ttl`` and
among the last ``max_exited_processes``), the same id with the same spec returns that process's
handle without starting anything, so a start whose reply was lost (``OutcomeUnknown``) is safe to
repeat; another spec is ``Rejected("CONFLICT")``. Once a record is evicted (or released) its id
may start a new process. :meth:`~LocalProcessService.list` reports every record, running and
exited, with exit status and output offsets, for reconcile. Without a state directory the
guarantee ends with the worker process: a worker that is killed (not stopped) leaves its process
groups orphaned and forgets them. With one (``state``, the worker's ``--state-dir``), each
``start()`` record is stored before its handle is returned and again when the process finishes
(:mod:`._records`), and a restarted worker reports what its predecessor left: ``exited`` with
its status, ``lost`` (it was running when that worker died; exit unknown) or ``detached`` (the
same pid, start time and boot: still alive, not supervised). Their output and stdin went with
the old worker (the pipes die with it): reading is refused (``OUTPUT_LOST``,
``PROCESS_DETACHED``); a detached process can be signalled and terminated (its exit status
cannot be known: not our child) and is watched through ``/proc``; ``wait`` on a lost one is
``PROCESS_LOST``. Handles are minted by the new worker (old ones are ``StaleResource``), and
``start(id=...)`` with the same spec (compared by digest) starts nothing. The PID (see
:meth:`~LocalProcessService.info`) is diagnostic only -- never signal it.

Per process, one supervisor task pumps stdout and stderr into **bounded spools** -- memory
(``ServiceLimits.output_retention_bytes`` each) by default, or segment files in a spool directory
(``spool_dir``, ``ServiceLimits.disk_spool_bytes`` each, dropped in whole segments) -- feeds
stdin, and enforces the start ``timeout``. Output is kept while no controller is attached.
Output is addressed by per-stream byte offsets; when retention overflows, the oldest bytes are
dropped and a reader asking for an earlier offset gets an :class:`OutputChunk` whose
``truncated`` marker carries the exact dropped range ``[start, end)`` -- never a silent gap.
:meth:`~LocalProcessService.output` follows both streams as one remote stream (credit-controlled
by the RPC layer): it survives a resumable reconnect with nothing lost or duplicated, and a
consumer that restarts passes the offsets it already has.

Stdin is ordered and replay-safe: every :meth:`~LocalProcessService.write_stdin` names the offset
its data starts at; bytes before the current position are ignored (a repeated write is a no-op), a
gap is refused. Accepted bytes go to a bounded buffer (``ServiceLimits.stdin_buffer_bytes``) that
the supervisor drains into the pipe, so a write never tears a pipe write in half when cancelled.

Termination always targets the **whole process group**: :meth:`~LocalProcessService.signal`,
:meth:`~LocalProcessService.terminate` (SIGTERM, then SIGKILL after ``grace``), the start
``timeout`` (SIGKILL, ``ExitStatus.timed_out``), a cancelled :meth:`~LocalProcessService.run`
(SIGKILL) and closing the service -- the worker stopping (SIGTERM, then SIGKILL after
``ServiceLimits.session_end_grace``). :meth:`~LocalProcessService.wait` returns once the leader has
exited **and** both output pipes reached EOF, so everything written is readable. A descendant that
leaves the group (``setsid``) and keeps the pipes open delays that; on close its pipes are closed
regardless.

``run`` is start + wait + collect in one call. Cancelling a ``run`` that is running (the caller's
cancel scope or timeout) kills its process group; the caller sees the cancellation or
``OutcomeUnknown``. Only a ``run`` that was definitely not dispatched (``NotDispatched``) is safe to
retry blindly: the command may have had effects. The call itself is bounded by the controller's
call timeout (``Limits.call_timeout``, 120 s by default): for longer runs raise it per call
(``gl.with_options(proc, timeout=...)``) or use ``start`` + ``wait``, which is safe to repeat.

Errors: ``Rejected`` -- ``INVALID_ARGUMENTS``, ``CONFLICT``, ``SPAWN_FAILED``,
``TOO_MANY_PROCESSES``, ``UNKNOWN_PROCESS``, ``PROCESS_RELEASED``, ``PROCESS_RUNNING``,
``PROCESS_LOST``, ``PROCESS_DETACHED``, ``OUTPUT_LOST``,
``INVALID_OFFSET``, ``NO_STDIN``, ``STDIN_GAP``, ``STDIN_CLOSED``, ``INVALID_SIGNAL``,
``SHUTTING_DOWN`` and the path codes of the file service; ``RemoteError("WAIT_TIMEOUT")``
when :meth:`~LocalProcessService.wait` gives up, ``RemoteError("SPOOL_FAILED")`` when a disk
spool cannot be read.

Why the supervisors are not in a task group: the worker enters a per-session service factory in
one task and exits it in another, and a task group's cancel scope cannot span tasks. Each
supervisor is a backend task of its own (``asyncio`` task or ``trio`` system task) wrapped in a
cancel scope this service cancels and awaits on close (``_DetachedTasks``).

This module is the service's face: the interface and :class:`LocalProcessService`. Its parts
live beside it: the values in ``_process_values.py`` (importable from here), the checks of a
caller's arguments in ``_process_args.py``, the output of a stream, in memory or spooled to disk,
in ``_spool.py``, the supervision of a process group (its record, signals, the detached tasks)
in ``_supervisor.py``, the records in the state directory and those restored from it in
``_ledger.py``, and the table of records (lookup, eviction, ``max_processes``) in
``_process_table.py``.

POSIX only (process groups, ``killpg``); tested on Linux with asyncio and trio.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal as sig_mod
import subprocess
import tempfile
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc

from ..errors import ConfigError, Rejected, RemoteError
from ..logs import peer_text
from ..rpc.resources import ResourceRef, ServiceScope, current_scope
from ..rpc.statedir import StateDirectory
from ._confined import ConfinedRoot, _os_errors
from ._ledger import Ledger, restored_info
from ._limits import MiB, ServiceLimits
from ._process_args import (
    _check_argv,
    _check_env,
    _check_id,
    _check_seconds,
    _check_spec_size,
)
from ._process_table import ProcessTable, process_info
from ._process_values import (
    ExitStatus,
    OutputChunk,
    ProcessInfo,
    RunResult,
    StreamName,
    TruncationMarker,
)
from ._records import Restored, signal_detached, spec_digest
from ._supervisor import _REAP_TIMEOUT, _DetachedTasks, _parse_signal, _Proc

__all__ = [
    "ExitStatus",
    "LocalProcessService",
    "OutputChunk",
    "ProcessInfo",
    "ProcessService",
    "RunResult",
    "StreamName",
    "TruncationMarker",
    "default_base_env",
]

log = logging.getLogger(__name__)

_STREAM_CHUNK = 256 * 1024


# ---------------------------------------------------------------------------- interface

# Spelled here: inside the classes below ``list`` names a method.
_Infos = list[ProcessInfo]
_Argv = list[str]


class ProcessService(Protocol):
    """Programs on the worker (see the module docstring for the rules)."""

    async def start(
        self,
        argv: _Argv,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        timeout: float | None = None,
        id: str | None = None,
    ) -> ResourceRef:
        """Start ``argv`` (no shell) in its own process group; returns a ``"process"`` handle.

        With ``id`` the start is idempotent for as long as the worker keeps the record (see the
        module docstring): if a process with that id exists (running or exited) and was started
        with the same spec (``argv``, ``cwd``, ``env``, ``stdin``, ``timeout``), its handle is
        returned and nothing is started; with another spec the call is refused (``CONFLICT``).

        Args:
            argv: the program and its arguments; ``argv[0]`` is looked up on ``PATH``.
            cwd: working directory in the service namespace (``None``: the root).
            env: variables set over the clean base environment.
            stdin: open a stdin pipe (else stdin is ``/dev/null``).
            timeout: seconds until the service kills the group (``ExitStatus.timed_out``).
            id: the caller's name for the process (1 to ``max_process_id_length`` of
                ``[A-Za-z0-9._:@+-]``, starting with a letter or digit, not of the generated
                form ``p<digits>``); ``None``: a generated ``p<n>``, never idempotent.

        Raises:
            Rejected: ``CONFLICT`` (``id`` taken by another spec), ``SPAWN_FAILED`` (not found,
                not executable), ``TOO_MANY_PROCESSES``, a path refusal for ``cwd``,
                ``INVALID_ARGUMENTS`` (also: a bad ``id``, argv and env over
                ``max_process_spec_bytes``).
        """
        ...

    async def read(
        self, handle: ResourceRef, stream: StreamName, after: int = 0, max_bytes: int = 65536
    ) -> OutputChunk:
        """Up to ``max_bytes`` of ``stream`` from offset ``after`` (returns at once; may be empty).

        Raises:
            Rejected: ``INVALID_OFFSET`` when ``after`` is beyond what was produced.
        """
        ...

    def output(
        self, handle: ResourceRef, after_stdout: int = 0, after_stderr: int = 0
    ) -> AsyncIterator[OutputChunk]:
        """Follow both streams from the given offsets until both reach EOF.

        Each stream's last chunk has ``eof=True`` (possibly with empty data).
        """
        ...

    async def write_stdin(self, handle: ResourceRef, data: bytes, offset: int) -> int:
        """Append ``data``, which starts at stdin offset ``offset``; returns the new position.

        Raises:
            Rejected: ``STDIN_GAP`` (``offset`` beyond the position), ``STDIN_CLOSED``,
                ``NO_STDIN``.
        """
        ...

    async def close_stdin(self, handle: ResourceRef) -> None:
        """Close stdin once the accepted bytes are delivered (idempotent)."""
        ...

    async def signal(self, handle: ResourceRef, name: str) -> bool:
        """Send signal ``name`` (``"TERM"``, ``"SIGINT"``, ``"9"``) to the process group.

        Returns ``False`` if the group is already gone.
        """
        ...

    async def terminate(self, handle: ResourceRef, grace: float = 5.0) -> ExitStatus:
        """SIGTERM the group, SIGKILL it after ``grace`` seconds; returns the exit status."""
        ...

    async def wait(self, handle: ResourceRef, timeout: float | None = None) -> ExitStatus:
        """The exit status, once the process exited and its output drained.

        Raises:
            RemoteError: ``WAIT_TIMEOUT`` after ``timeout`` seconds (the process is untouched).
        """
        ...

    async def info(self, handle: ResourceRef) -> ProcessInfo:
        """A snapshot of the process."""
        ...

    async def list(self) -> _Infos:
        """Every process record the worker holds, running and exited, oldest start first.

        For reconcile after a controller restart. Bounded: at most ``max_processes`` records,
        each with a spec of at most ``max_process_spec_bytes``. Exited records leave after
        ``exited_process_ttl`` or beyond ``max_exited_processes``.
        """
        ...

    async def list_processes(self) -> _Infos:
        """The same as :meth:`list` (the name before processes became worker-scoped)."""
        ...

    async def release(self, handle: ResourceRef) -> None:
        """Forget a finished process (frees its record and retained output).

        Raises:
            Rejected: ``PROCESS_RUNNING``.
        """
        ...

    async def run(
        self,
        argv: _Argv,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin_data: bytes | None = None,
        timeout: float = 60.0,
        max_output: int = 1 * MiB,
    ) -> RunResult:
        """Run to completion: feed ``stdin_data`` (then EOF), wait, return status and output.

        ``max_output`` bounds each stream (capped by ``ServiceLimits.max_run_output_bytes``);
        the last bytes are kept. ``timeout`` kills the group (``status.timed_out``). Cancelling
        the call kills the group.
        """
        ...


def default_base_env(home: str) -> dict[str, str]:
    """The clean base environment of started processes (see the module docstring)."""
    env = {"PATH": os.environ.get("PATH") or os.defpath, "LANG": "C.UTF-8"}
    for key in ("LANG", "LC_ALL", "TZ", "USER", "LOGNAME"):
        value = os.environ.get(key)
        if value:
            env[key] = value
    env["HOME"] = home
    return env


# ---------------------------------------------------------------------------- implementation


class LocalProcessService:
    """:class:`ProcessService` running programs on this machine.

    Handles are minted in ``scope`` if given, else in :func:`~garcon_link.current_scope` at
    call time: served as ``gl.Service(impl, ProcessService, scope="worker")`` (what
    :func:`~garcon_link.services.builtin_services` does) that is the worker's scope, so handles
    survive session replacement. Use ``async with`` (or :meth:`aclose`): closing terminates
    every process the service started. Only the interface is callable through the link.

    Args:
        root: the directory that is ``/`` for ``cwd`` (and ``HOME`` of started processes).
        scope: the service scope handles belong to (``None``: the caller's at call time).
        limits: bounds (:class:`~garcon_link.services.ServiceLimits`).
        base_env: replaces the default clean base environment (:func:`default_base_env`).
        spool_dir: spool output of ``start()`` to files in a private subdirectory of this
            existing directory (bounded by ``disk_spool_bytes`` per stream; removed on close)
            instead of memory (``output_retention_bytes``).
        state: the worker's state directory: records of ``start()`` are kept there, and those
            a previous worker process left are restored (:mod:`._records`).

    Raises:
        ConfigError: ``root`` or ``spool_dir`` is not an existing directory.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        scope: ServiceScope | None = None,
        limits: ServiceLimits | None = None,
        base_env: Mapping[str, str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        state: StateDirectory | None = None,
    ) -> None:
        self.limits = limits or ServiceLimits()
        self.root = ConfinedRoot(root, self.limits)
        self._spool: str | None = None
        if spool_dir is not None:
            if not os.path.isdir(spool_dir):
                raise ConfigError(f"spool directory {os.fspath(spool_dir)!r} is not a directory")
            # A private directory per service object: ours to empty on close.
            self._spool = tempfile.mkdtemp(prefix="garcon-link-spool-", dir=spool_dir)
        self._spool_files = itertools.count(1)
        self._scope = scope
        self._base_env = (
            dict(base_env) if base_env is not None else default_base_env(self.root.host)
        )
        self._tasks = _DetachedTasks()
        self._closed = False
        self._ledger = Ledger(state)
        self._table = ProcessTable(self.limits, self._ledger)

    async def _record_exit(self, proc: _Proc) -> None:
        await proc.done.wait()
        if self._table.holds(proc):
            await self._ledger.exited(proc)

    async def __aenter__(self) -> LocalProcessService:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Terminate every live process group (SIGTERM, SIGKILL after the grace); idempotent."""
        if self._closed:
            return
        self._closed = True
        table = self._table
        live = [p for p in (*table.procs.values(), *table.runs) if not p.done.is_set()]
        if live:
            log.info("session ended: terminating %d process group(s)", len(live))
        grace = self.limits.session_end_grace
        for proc in live:
            proc.force(sig_mod.SIGTERM)
        with anyio.move_on_after(grace):
            for proc in live:
                await proc.done.wait()
        for proc in live:
            proc.force(sig_mod.SIGKILL)
        with anyio.move_on_after(grace):
            for proc in live:
                await proc.done.wait()
        await self._ledger.close(p for p in table.procs.values() if p.done.is_set())
        await self._tasks.aclose()
        for proc in table.procs.values():
            proc.stdout.discard()
            proc.stderr.discard()
        table.procs.clear()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)

    def _current_scope(self) -> ServiceScope:
        return self._scope if self._scope is not None else current_scope()

    def _check_open(self) -> None:
        """Refuse a new process once the service is closing (``SHUTTING_DOWN``)."""
        if self._closed:
            raise Rejected("SHUTTING_DOWN", "the worker is stopping")

    def _get(self, handle: ResourceRef) -> _Proc:
        return self._table.get(handle, self._current_scope().check(handle, "process"))

    def _lookup(self, handle: ResourceRef) -> _Proc | Restored:
        return self._table.lookup(handle, self._current_scope().check(handle, "process"))

    async def _spawn(
        self,
        argv: _Argv,
        cwd: str | None,
        env: Mapping[str, str] | None,
        *,
        stdin: bool,
        timeout: float | None,
        retention: int,
        proc_id: str | None = None,
        spec: tuple[object, ...] = (),
        spool: bool = False,
    ) -> _Proc:
        self._check_spec(argv, cwd, env, timeout)
        shown = cwd if cwd is not None else "/"
        self.root.split(shown)

        def check_cwd() -> tuple[str, ...]:
            parts = self.root.resolve(shown)
            with _os_errors(shown):
                os.close(self.root.open_dir(parts, shown))
            return parts

        parts = await anyio.to_thread.run_sync(check_cwd)
        cwd_host = self.root.host_path(parts)
        merged = {**self._base_env, "PWD": cwd_host, **(env or {})}
        self._check_open()
        self._table.make_room()
        self._table.reserved += 1
        try:
            # Shielded: a process spawned by a cancelled call must still be tracked (and killed).
            with anyio.CancelScope(shield=True):
                process = await anyio.open_process(
                    argv,
                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd_host,
                    env=merged,
                    start_new_session=True,
                )
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno is not None else str(exc)
            raise Rejected("SPAWN_FAILED", f"cannot start {argv[0]!r}: {why}") from exc
        finally:
            self._table.reserved -= 1
        if proc_id is None:
            proc_id = self._table.new_id()
        spool_at = None
        if spool and self._spool is not None:
            spool_at = (self._spool, str(next(self._spool_files)))
            retention = self.limits.disk_spool_bytes
        proc = _Proc(
            proc_id,
            list(argv),
            self.root.caller_path(parts),
            process,
            retention=retention,
            timeout=timeout,
            spec=spec,
            spool=spool_at,
        )
        if self._closed:
            # The service closed while spawning: the process must not outlive it.
            os.killpg(proc.pid, sig_mod.SIGKILL)
            with anyio.CancelScope(shield=True), anyio.move_on_after(_REAP_TIMEOUT):
                await process.aclose()
            raise Rejected("SHUTTING_DOWN", "the worker is stopping")
        self._tasks.spawn(proc.supervise, f"garcon-link process {proc_id} ({argv[0]})")
        log.debug("started %s pid=%d: %s", proc_id, proc.pid, peer_text(argv[0]))
        return proc

    def _check_spec(
        self,
        argv: _Argv,
        cwd: str | None,
        env: Mapping[str, str] | None,
        timeout: float | None,
    ) -> None:
        _check_spec_size(argv, env, self.limits.max_process_spec_bytes)
        _check_argv(argv)
        _check_env(env or {})
        _check_seconds("timeout", timeout)

    # -- the interface

    async def start(
        self,
        argv: _Argv,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bool = False,
        timeout: float | None = None,
        id: str | None = None,
    ) -> ResourceRef:
        scope = self._current_scope()
        self._check_spec(argv, cwd, env, timeout)
        spec: tuple[object, ...] = (
            tuple(argv),
            cwd if cwd is not None else "/",
            tuple(sorted((env or {}).items())),
            stdin,
            timeout,
        )
        if id is not None:
            _check_id(id, self.limits.max_process_id_length)
            self._table.prune()
            restored = self._ledger.restored.get(id)
            if restored is not None:
                # Started by a previous worker process: the same spec starts nothing.
                if restored.spec != spec_digest(spec):
                    raise Rejected(
                        "CONFLICT", f"process {id!r} exists and was started with another spec"
                    )
                return scope.resource("process", id)
            if await self._table.existing(id, spec) is not None:
                return scope.resource("process", id)
            self._table.starting(id, spec)
        try:
            proc = await self._spawn(
                argv,
                cwd,
                env,
                stdin=stdin,
                timeout=timeout,
                retention=self.limits.output_retention_bytes,
                proc_id=id,
                spec=spec,
                spool=True,
            )
            self._table.procs[proc.id] = proc
            if self._ledger.keeping:
                # Stored before the reply: a restarted worker knows every handle it gave.
                await self._ledger.started(proc)
                self._tasks.spawn(
                    lambda: self._record_exit(proc), f"garcon-link process record {proc.id}"
                )
        finally:
            if id is not None:
                self._table.started(id)
        return scope.resource("process", proc.id)

    async def read(
        self, handle: ResourceRef, stream: StreamName, after: int = 0, max_bytes: int = 65536
    ) -> OutputChunk:
        proc = self._get(handle)
        if max_bytes < 1:
            raise Rejected("INVALID_ARGUMENTS", "max_bytes must be >= 1")
        out = proc.stdout if stream == "stdout" else proc.stderr
        return out.chunk(after, min(max_bytes, self.limits.max_read_bytes))

    async def output(
        self, handle: ResourceRef, after_stdout: int = 0, after_stderr: int = 0
    ) -> AsyncIterator[OutputChunk]:
        proc = self._get(handle)
        outs = (proc.stdout, proc.stderr)
        cursors = [after_stdout, after_stderr]
        for out, cursor in zip(outs, cursors, strict=True):
            if cursor < 0 or cursor > out.end:
                raise Rejected("INVALID_OFFSET", f"{out.name} offset {cursor} is out of range")
        finished = [False, False]
        limit = min(_STREAM_CHUNK, self.limits.max_read_bytes)
        while not all(finished):
            progressed = False
            for i, out in enumerate(outs):
                if finished[i] or (cursors[i] >= out.end and not out.eof):
                    continue
                chunk = out.chunk(cursors[i], limit)
                cursors[i] = chunk.offset + len(chunk.data)
                finished[i] = chunk.eof
                progressed = True
                yield chunk
            if not progressed:
                # No await between the checks above and this wait: no wake-up is missed.
                await proc.changed.wait()

    async def write_stdin(self, handle: ResourceRef, data: bytes, offset: int) -> int:
        proc = self._get(handle)
        return await proc.enqueue(data, offset, self.limits.stdin_buffer_bytes)

    async def close_stdin(self, handle: ResourceRef) -> None:
        proc = self._get(handle)
        if proc.has_stdin and not proc.stdin_closing:
            proc.stdin_closing = True
            proc.changed.notify()

    async def signal(self, handle: ResourceRef, name: str) -> bool:
        found = self._lookup(handle)
        signum = _parse_signal(name)
        if isinstance(found, Restored):
            return signal_detached(found, signum)
        return found.killpg(signum)

    async def terminate(self, handle: ResourceRef, grace: float = 5.0) -> ExitStatus:
        _check_seconds("grace", grace, allow_zero=True)
        found = self._lookup(handle)
        if isinstance(found, Restored):
            return await self._ledger.terminate(found, grace)
        proc = found
        if proc.force(sig_mod.SIGTERM):
            with anyio.move_on_after(grace):
                await proc.done.wait()
            proc.force(sig_mod.SIGKILL)
        # The leader dies at once after SIGKILL; allow a moment for the pipes to drain.
        with anyio.move_on_after(_REAP_TIMEOUT):
            await proc.done.wait()
        return proc.status()

    async def wait(self, handle: ResourceRef, timeout: float | None = None) -> ExitStatus:
        _check_seconds("timeout", timeout, allow_zero=True)
        found = self._lookup(handle)
        if isinstance(found, Restored):
            return await self._ledger.wait(found, timeout)
        proc = found
        with anyio.move_on_after(timeout):
            await proc.done.wait()
            return proc.status()
        raise RemoteError(
            "WAIT_TIMEOUT", f"process {proc.id} has not finished within {timeout} seconds"
        )

    async def info(self, handle: ResourceRef) -> ProcessInfo:
        found = self._lookup(handle)
        scope = self._current_scope()
        if isinstance(found, Restored):
            return restored_info(scope, found)
        return process_info(scope, found)

    async def list(self) -> _Infos:
        scope = self._current_scope()
        self._table.prune()
        restored = [restored_info(scope, r) for r in self._ledger.restored.values()]
        return [*restored, *(process_info(scope, proc) for proc in self._table.procs.values())]

    async def list_processes(self) -> _Infos:
        return await self.list()

    async def release(self, handle: ResourceRef) -> None:
        found = self._lookup(handle)
        if isinstance(found, Restored):
            await self._ledger.release(handle, found)
            return
        proc = found
        if not proc.done.is_set():
            raise Rejected("PROCESS_RUNNING", f"{handle!r} is still running; terminate it first")
        self._table.forget(proc)

    async def run(
        self,
        argv: _Argv,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin_data: bytes | None = None,
        timeout: float = 60.0,
        max_output: int = 1 * MiB,
    ) -> RunResult:
        if max_output < 0:
            raise Rejected("INVALID_ARGUMENTS", "max_output must be >= 0")
        proc = await self._spawn(
            argv,
            cwd,
            env,
            stdin=stdin_data is not None,
            timeout=timeout,
            retention=min(max_output, self.limits.max_run_output_bytes),
        )
        self._table.runs.add(proc)
        try:
            async with anyio.create_task_group() as tg:
                if stdin_data is not None:
                    tg.start_soon(self._feed_all, proc, stdin_data)
                await proc.done.wait()
                tg.cancel_scope.cancel()
        except BaseException:
            # Cancelled (or failed) while running: the process must not outlive the call.
            with anyio.CancelScope(shield=True):
                if proc.force(sig_mod.SIGKILL):
                    log.info("run of %s cancelled: killed its process group", peer_text(argv[0]))
                with anyio.move_on_after(_REAP_TIMEOUT):
                    await proc.done.wait()
            raise
        finally:
            self._table.runs.discard(proc)
        return RunResult(
            status=proc.status(),
            stdout=proc.stdout.tail(),
            stderr=proc.stderr.tail(),
            stdout_truncated=proc.stdout.start > 0,
            stderr_truncated=proc.stderr.start > 0,
        )

    async def _feed_all(self, proc: _Proc, data: bytes) -> None:
        try:
            await proc.enqueue(data, 0, self.limits.stdin_buffer_bytes)
        except Rejected:
            return  # the program exited without reading all of it
        proc.stdin_closing = True
        proc.changed.notify()


if TYPE_CHECKING:  # static conformance check: the implementation matches its interface

    def _conforms(service: LocalProcessService) -> ProcessService:
        return service
