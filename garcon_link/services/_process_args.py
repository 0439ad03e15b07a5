"""The process service's checks of what a caller passes: argv, env, a process id, their size
together, and seconds (documented in :mod:`garcon_link.services.process`). Each refuses with
``Rejected("INVALID_ARGUMENTS")`` and a message naming the bound, before anything is copied or
spawned."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from ..errors import Rejected


def _check_argv(argv: list[str]) -> None:
    if not argv or not argv[0]:
        raise Rejected("INVALID_ARGUMENTS", "argv needs at least a program name")
    if any("\0" in arg for arg in argv):
        raise Rejected("INVALID_ARGUMENTS", "argv must not contain NUL characters")


def _check_env(env: Mapping[str, str]) -> None:
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise Rejected("INVALID_ARGUMENTS", f"invalid environment variable {key!r}")


_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]*")
_GENERATED_ID = re.compile(r"p[0-9]+")


def _check_id(proc_id: str, limit: int) -> None:
    if len(proc_id) > limit or not _ID_PATTERN.fullmatch(proc_id):
        raise Rejected(
            "INVALID_ARGUMENTS",
            f"a process id is 1 to {limit} of [A-Za-z0-9._:@+-], starting with a letter or digit",
        )
    if _GENERATED_ID.fullmatch(proc_id):
        raise Rejected("INVALID_ARGUMENTS", "ids of the form p<digits> are generated ones")


def _check_spec_size(argv: list[str], env: Mapping[str, str] | None, limit: int) -> None:
    # Counted before anything is copied or spawned (the frame limit bounded the decoding);
    # cwd has its own bound, ServiceLimits.max_path_bytes.
    size = 0
    for item in (*argv, *(env or {}).keys(), *(env or {}).values()):
        size += len(item.encode("utf-8", "surrogatepass")) + 1
        if size > limit:
            raise Rejected("INVALID_ARGUMENTS", f"argv and env exceed {limit} bytes together")


def _check_seconds(name: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise Rejected("INVALID_ARGUMENTS", f"{name} must be a finite number > 0, got {value}")
