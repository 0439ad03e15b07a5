"""Built-in machine services a worker can offer: processes and files (POSIX only).

Expose them from the command line (``garcon-link worker CONFIG --builtin process,files --root
DIR``) or in code::

    import garcon_link as gl
    from garcon_link.services import FileService, ProcessService, builtin_services

    # worker
    await gl.serve(config, builtin_services(["process", "files"], root="/srv/work"))

    # controller
    proc = executor.service("process", ProcessService)
    files = executor.service("files", FileService)
    result = await proc.run(["make", "-C", "/src"], timeout=600)
    stat = await files.write("/src/VERSION", b"1.2\\n")

:func:`builtin_services` returns a per-session factory. Both services are *worker-scoped*
(docs/design.md#durable-work): one object per worker, shared by every logical session, served as
``Service(..., scope="worker")``; their handles carry the worker's runtime id, so they survive
session replacement and controller restarts and become ``StaleResource`` only when the worker
restarts. **Processes** are terminated only when the worker stops (SIGTERM, SIGKILL after
``ServiceLimits.session_end_grace``). Unfinished **uploads** of the file service are resumed by
handle and offset (``upload_status``), bounded per worker (``max_uploads``) and by idle time
(``upload_idle_timeout``), and discarded when the worker stops.

The root is ``/`` for callers: every path is absolute in the service's namespace and confined to
the root (rules in :mod:`garcon_link.services.files`). It confines paths, not programs: a started
process runs with the worker's privileges (see :mod:`garcon_link.services.process`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from ..api.registration import Service
from ..errors import ConfigError
from ..rpc.resources import ServiceScope
from ..rpc.statedir import StateDirectory
from ._confined import ConfinedRoot
from ._file_values import version_token
from .files import (
    DirEntry,
    DirPage,
    FileKind,
    FileService,
    FileStat,
    LocalFileService,
    ReadChunk,
    ServiceLimits,
    UploadStatus,
)
from .process import (
    ExitStatus,
    LocalProcessService,
    OutputChunk,
    ProcessInfo,
    ProcessService,
    RunResult,
    StreamName,
    TruncationMarker,
    default_base_env,
)

__all__ = [
    "BUILTIN_SERVICES",
    "ConfinedRoot",
    "DirEntry",
    "DirPage",
    "ExitStatus",
    "FileKind",
    "FileService",
    "FileStat",
    "LocalFileService",
    "LocalProcessService",
    "OutputChunk",
    "ProcessInfo",
    "ProcessService",
    "ReadChunk",
    "RunResult",
    "ServiceFactory",
    "ServiceLimits",
    "StreamName",
    "TruncationMarker",
    "UploadStatus",
    "builtin_services",
    "default_base_env",
    "version_token",
]

BUILTIN_SERVICES: Mapping[str, type] = {"process": ProcessService, "files": FileService}
"""Built-in service name -> its interface (what a controller passes to ``executor.service``)."""

ServiceFactory = Callable[
    [ServiceScope], contextlib.AbstractAsyncContextManager[Mapping[str, object]]
]
"""A per-session service factory, as :class:`~garcon_link.Worker` accepts."""


def _parse_names(names: Sequence[str]) -> list[str]:
    if isinstance(names, str):
        names = [names]
    wanted: list[str] = []
    for item in names:
        for name in item.split(","):
            name = name.strip()
            if not name:
                continue
            if name not in BUILTIN_SERVICES:
                known = ", ".join(sorted(BUILTIN_SERVICES))
                raise ConfigError(f"unknown built-in service {name!r} (built-ins: {known})")
            if name not in wanted:
                wanted.append(name)
    if not wanted:
        raise ConfigError("no built-in service named (built-ins: files, process)")
    return wanted


def builtin_services(
    names: Sequence[str],
    root: str | os.PathLike[str],
    limits: ServiceLimits | None = None,
    *,
    allow_special_mode_bits: bool = False,
    spool_dir: str | os.PathLike[str] | None = None,
) -> ServiceFactory:
    """A per-session factory serving the named built-in services under ``root``.

    Args:
        names: any of ``"process"`` and ``"files"``; items may be comma-separated
            (``["process,files"]``).
        root: an existing directory; it is ``/`` for callers and the working directory and
            ``HOME`` of started processes.
        limits: bounds of the services (defaults: :class:`ServiceLimits`).
        allow_special_mode_bits: let file service callers set setuid, setgid and sticky bits
            with an explicit ``mode`` (refused by default; see
            :class:`~garcon_link.services.LocalFileService`).
        spool_dir: an existing directory where the process service spools output to disk
            (``ServiceLimits.disk_spool_bytes`` per stream) instead of memory.

    Returns:
        ``factory(scope)`` -> an async context manager yielding ``{name: Service(...)}``. Each
        service is made once per worker (``scope.worker.shared``) and closed when the worker
        stops, terminating its processes and discarding its unfinished uploads. Called with a
        scope that has no worker (outside a :class:`~garcon_link.Worker`), the services are
        per-session: closed when the session's context exits.

    Raises:
        ConfigError: an unknown name, no name, or ``root`` or ``spool_dir`` is not an existing
            directory.
    """
    wanted = _parse_names(names)
    ConfinedRoot(root, limits)  # fail now, not at the first session
    if spool_dir is not None and not os.path.isdir(spool_dir):
        raise ConfigError(f"spool directory {os.fspath(spool_dir)!r} is not a directory")
    root_path = Path(root)
    service_limits = limits or ServiceLimits()
    key = object()  # this factory's worker-lifetime process service
    files_key = object()  # ... and file service (its unfinished uploads)

    def make_process(state: StateDirectory | None) -> LocalProcessService:
        return LocalProcessService(
            root_path, limits=service_limits, spool_dir=spool_dir, state=state
        )

    def make_files() -> LocalFileService:
        return LocalFileService(
            root_path, limits=service_limits, allow_special_mode_bits=allow_special_mode_bits
        )

    @contextlib.asynccontextmanager
    async def per_session(scope: ServiceScope) -> AsyncIterator[Mapping[str, object]]:
        async with contextlib.AsyncExitStack() as stack:
            services: dict[str, object] = {}
            if "process" in wanted and scope.worker is not None:
                worker = scope.worker
                shared = await worker.shared(key, lambda: make_process(worker.state))
                services["process"] = Service(shared, ProcessService, scope="worker")
            elif "process" in wanted:
                process = LocalProcessService(
                    root_path, scope=scope, limits=service_limits, spool_dir=spool_dir
                )
                await stack.enter_async_context(process)
                services["process"] = Service(process, ProcessService)
            if "files" in wanted and scope.worker is not None:
                shared_files = await scope.worker.shared(files_key, make_files)
                services["files"] = Service(shared_files, FileService, scope="worker")
            elif "files" in wanted:
                files = LocalFileService(
                    root_path,
                    scope=scope,
                    limits=service_limits,
                    allow_special_mode_bits=allow_special_mode_bits,
                )
                await stack.enter_async_context(files)
                services["files"] = Service(files, FileService)
            yield services

    return per_session
