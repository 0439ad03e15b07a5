"""Grants: which caller of a gateway may call which executor's services (docs/guides/gateway.md).

A gateway (``garcon-link gateway CONFIG``) admits *callers*, each authenticated by its own key,
and authorizes each call by its ``[[callers.grant]]`` entries::

    [[callers.grant]]
    callers = ["web-*"]                  # glob patterns on caller ids
    executors = ["device-*"]             # glob patterns on executor ids
    services = ["calc", "process"]       # optional; absent = every service

The rule, in :func:`allows` (a pure function; ``tests/test_grants.py`` is its table):

* **No grant, no access.** A call is allowed iff at least one grant matches the caller id, the
  executor id *and* the service; with no grants at all nothing is allowed.
* A grant without ``services`` covers every service of the executors it names; one with
  ``services`` covers those only. Grants add up: they never take access away.
* Patterns are shell-style globs matched case-sensitively against the whole id
  (:func:`fnmatch.fnmatchcase`): ``*`` any run of characters, ``?`` one character, ``[...]`` a
  set. Nothing else is special, so ``"box-1"`` matches only ``box-1``. Internal services (names
  starting with ``$``) are never granted: the gateway answers for those itself.
* :func:`sees` -- whether a caller may see an executor at all (in ``executors()`` and events) --
  is true iff some grant names both, whatever its services.

Bounds: at most :data:`MAX_GRANTS` grants, :data:`MAX_PATTERNS` patterns per field, each 1 to
:data:`MAX_PATTERN_CHARS` printable characters without whitespace; a pattern is compiled once,
when the grant is built, so matching costs one regular-expression match per pattern and grant.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ._toml import _type_name
from .secrets import Source, refusal

__all__ = ["MAX_GRANTS", "MAX_PATTERNS", "MAX_PATTERN_CHARS", "Grant", "allows", "sees"]

MAX_GRANTS = 1024
"""``[[callers.grant]]`` entries a gateway accepts."""
MAX_PATTERNS = 64
"""Patterns in one grant's ``callers``, ``executors`` or ``services``."""
MAX_PATTERN_CHARS = 200
"""Characters of one pattern (the longest id is as long)."""

_GRANT = "[[callers.grant]]"
_FIX = 'e.g. callers = ["web-*"], executors = ["device-*"], services = ["calc"]'


def check_patterns(value: object, src: Source, what: str, *, required: bool) -> tuple[str, ...]:
    """The patterns of one grant field, checked (module docstring's bounds)."""
    if value is None and not required:
        return ()
    if isinstance(value, list | tuple):
        patterns = tuple(value)
    else:
        raise refusal(src, what, f"expected a list of patterns, got {_type_name(value)}", _FIX)
    if not patterns:
        raise refusal(
            src, what, "the list is empty", "name at least one pattern, or remove the field"
        )
    if len(patterns) > MAX_PATTERNS:
        raise refusal(
            src,
            what,
            f"{len(patterns)} patterns, more than {MAX_PATTERNS}",
            'use wider patterns (e.g. "device-*") or split the grant',
        )
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise refusal(src, what, f"a pattern is {_type_name(pattern)}, not a string", _FIX)
        if not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise refusal(
                src,
                what,
                f"a pattern must be 1-{MAX_PATTERN_CHARS} characters, got {len(pattern)}",
                _FIX,
            )
        if not pattern.isprintable() or any(ch.isspace() for ch in pattern):
            raise refusal(
                src, what, f"pattern {pattern!r} holds whitespace or unprintable characters", _FIX
            )
    return patterns


def _compile(patterns: Iterable[str]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))


@dataclass(frozen=True, slots=True)
class Grant:
    """One ``[[callers.grant]]`` entry (module docstring).

    Attributes:
        callers: glob patterns on caller ids (at least one).
        executors: glob patterns on executor ids (at least one).
        services: glob patterns on service names; empty: every service.

    Raises:
        ConfigError: a field breaks a rule; the message names the field and the fix.
    """

    callers: tuple[str, ...]
    executors: tuple[str, ...]
    services: tuple[str, ...] = ()
    source: Path | None = field(default=None, compare=False)
    number: int = field(default=1, compare=False)
    _callers: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _executors: re.Pattern[str] = field(init=False, repr=False, compare=False)
    _services: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        src: Source = self.source if self.source is not None else "Grant"
        prefix = f"{_GRANT} #{self.number} "
        callers = check_patterns(self.callers, src, f"{prefix}callers", required=True)
        executors = check_patterns(self.executors, src, f"{prefix}executors", required=True)
        services = check_patterns(self.services or None, src, f"{prefix}services", required=False)
        object.__setattr__(self, "callers", callers)
        object.__setattr__(self, "executors", executors)
        object.__setattr__(self, "services", services)
        object.__setattr__(self, "_callers", _compile(callers))
        object.__setattr__(self, "_executors", _compile(executors))
        object.__setattr__(self, "_services", _compile(services) if services else None)

    def names(self, caller: str, executor: str) -> bool:
        """Whether this grant names ``caller`` and ``executor`` (whatever its services)."""
        return (
            self._callers.match(caller) is not None and self._executors.match(executor) is not None
        )

    def covers(self, service: str) -> bool:
        """Whether this grant covers ``service`` of the executors it names."""
        if service.startswith("$"):
            return False
        return self._services is None or self._services.match(service) is not None


def allows(grants: Sequence[Grant], caller: str, executor: str, service: str) -> bool:
    """Whether ``caller`` may call ``service`` on ``executor`` (module docstring)."""
    return any(g.names(caller, executor) and g.covers(service) for g in grants)


def sees(grants: Sequence[Grant], caller: str, executor: str) -> bool:
    """Whether ``caller`` may see ``executor`` (some grant names both)."""
    return any(g.names(caller, executor) for g in grants)


def check_grant_count(count: int, src: Source) -> None:
    """Refuse more than :data:`MAX_GRANTS` grants."""
    if count > MAX_GRANTS:
        raise refusal(
            src,
            _GRANT,
            f"{count} grants, more than {MAX_GRANTS}",
            "merge grants with wider patterns",
        )
