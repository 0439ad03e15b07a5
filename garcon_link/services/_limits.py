"""The bounds of the built-in services: :class:`ServiceLimits`, one value per worker, shared by the
file and process services (re-exported by :mod:`garcon_link.services`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError

KiB = 1024
MiB = 1024 * KiB


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    """Bounds of the built-in services (one value per worker; all fields have safe defaults).

    Every buffer the services keep is sized by a field below. Sizes are bytes, times seconds.
    Worst-case memory of the worker's process records is about ``max_processes`` x
    (2 x ``output_retention_bytes`` + ``stdin_buffer_bytes`` + ``max_process_spec_bytes``):
    196 MiB with the defaults (with a spool directory, output goes to disk instead: at most
    ``max_processes`` x 2 x ``disk_spool_bytes``, 2 GiB).
    """

    max_processes: int = field(
        default=64,
        metadata=_doc(
            "Process records the worker holds (the process service is worker-scoped): running "
            "processes plus finished ones whose status and output are kept. A start beyond it "
            "evicts the oldest finished record (its handle then raises PROCESS_RELEASED, or "
            "UNKNOWN_PROCESS for a caller-chosen id); if all are running it is refused with "
            "TOO_MANY_PROCESSES."
        ),
    )
    output_retention_bytes: int = field(
        default=1 * MiB,
        metadata=_doc(
            "Output kept per process and stream; older bytes are dropped and reported as an "
            "explicit truncation range."
        ),
    )
    stdin_buffer_bytes: int = field(
        default=1 * MiB,
        metadata=_doc(
            "Accepted stdin bytes not yet taken by the child; write_stdin waits past it."
        ),
    )
    max_read_bytes: int = field(
        default=4 * MiB,
        metadata=_doc("Largest single read (process output or file) and stream chunk."),
    )
    max_run_output_bytes: int = field(
        default=4 * MiB,
        metadata=_doc("Ceiling of run()'s max_output per stream (a result must fit one frame)."),
    )
    session_end_grace: float = field(
        default=0.5,
        metadata=_doc(
            "At session end every live process group gets SIGTERM, then SIGKILL after this."
        ),
    )
    max_uploads: int = field(
        default=16,
        metadata=_doc(
            "Unfinished uploads the worker holds, whichever session began them (the file "
            "service is worker-scoped; each upload holds a staged file and two descriptors). "
            "One more begin_upload is refused with TOO_MANY_UPLOADS."
        ),
    )
    max_list_entries: int = field(
        default=10_000,
        metadata=_doc("Largest page of list_dir."),
    )
    max_path_bytes: int = field(
        default=4096,
        metadata=_doc(
            "Longest path a caller may pass, in UTF-8 bytes (Linux's PATH_MAX); a longer one is "
            "refused with INVALID_PATH before any file system work. Each name in it is at most "
            "255 bytes (NAME_MAX)."
        ),
    )
    max_path_components: int = field(
        default=256,
        metadata=_doc(
            "Most names (between '/') in a caller's path; more is refused with INVALID_PATH "
            "before any file system work. Resolving a path costs about components x length."
        ),
    )
    max_reader_threads: int = field(
        default=64,
        metadata=_doc(
            "Read-only file operations running at once in this process, counting those whose "
            "caller gave up while the operating system still holds the thread (a hung network "
            "file system); one more is refused with OVERLOADED."
        ),
    )

    max_exited_processes: int = field(
        default=64,
        metadata=_doc(
            "Records of exited processes the worker keeps (status and spooled output, for "
            "list() and start(id=...) after a controller comes back); the oldest is evicted "
            "beyond it."
        ),
    )
    exited_process_ttl: float = field(
        default=3600.0,
        metadata=_doc(
            "Seconds an exited process's record is kept after it exited; then it is evicted "
            "(its id may be started again)."
        ),
    )
    max_process_id_length: int = field(
        default=128,
        metadata=_doc(
            "Longest caller-chosen process id (ASCII letters, digits and . _ - : @ +, starting "
            "with a letter or digit); a longer or other one is refused with INVALID_ARGUMENTS."
        ),
    )
    max_process_spec_bytes: int = field(
        default=64 * 1024,
        metadata=_doc(
            "Largest start()/run() argv and env together, in UTF-8 bytes (one more per item; "
            "cwd is bounded by max_path_bytes); beyond it the call is refused with "
            "INVALID_ARGUMENTS. It also bounds what list() returns (max_processes x this)."
        ),
    )
    disk_spool_bytes: int = field(
        default=16 * MiB,
        metadata=_doc(
            "Output kept on disk per process and stream when the process service has a spool "
            "directory (replaces output_retention_bytes for start()); dropped in whole "
            "segments of a quarter of it, reported as an exact truncation range."
        ),
    )
    upload_idle_timeout: float = field(
        default=3600.0,
        metadata=_doc(
            "Seconds an unfinished upload may go without a call on its handle (begin, chunk, "
            "status); then it is discarded with its staged file at the next upload call "
            "(its handle then gets UNKNOWN_UPLOAD)."
        ),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(
                    f"ServiceLimits.{f.name} must be a positive number, got {value!r}"
                )
            if f.type == "int" and not isinstance(value, int):
                raise ConfigError(f"ServiceLimits.{f.name} must be an integer, got {value!r}")

    @classmethod
    def describe(cls) -> dict[str, str]:
        """``{field name: documentation}`` for every bound."""
        return {f.name: str(f.metadata.get("doc", "")) for f in fields(cls)}
