"""The services one side exposes to its peer: name -> interface spec, implementation, scope.

Names starting with ``_`` or ``$`` are refused: ``$link`` is the internal service. Its method
``describe`` answers this side's manifest (``DESCRIBE_SPEC``); ``inventory`` is a notification a
worker sends when its services change on a running session, ``[sequence, services manifest]``
(``INVENTORY_SPEC``), which the receiving side hands to its listener instead of a handler
(:meth:`~garcon_link.rpc.rpc.ExecutorRpc.on_inventory`).
The notification ``draining`` (``DRAINING_METHOD``, no arguments) is a side's goodbye: it is
draining and admits no new call for the rest of the session
(:meth:`~garcon_link.rpc.rpc.ExecutorRpc.start_drain`). The notification ``parts``
(``PARTS_METHOD``, ``[count]``), sent once per session when the peer's first part arrives, says
the side reads parts with transfer ids and holds ``count`` (its ``Limits.bulk_transfers``) at once
(:mod:`garcon_link.rpc.chunks`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .interface import MethodKind, MethodSpec, ServiceSpec
from .resources import ServiceScope, _current

__all__ = [
    "DESCRIBE_SPEC",
    "DRAINING_METHOD",
    "INTERNAL_SERVICE",
    "INVENTORY_SPEC",
    "PARTS_METHOD",
    "Bound",
    "Registry",
    "in_scope",
]

INTERNAL_SERVICE = "$link"

DRAINING_METHOD = "draining"
"""The internal notification a draining side sends once per session (its goodbye)."""

PARTS_METHOD = "parts"
"""The internal notification a side sends once per session, when the peer's first part arrives:
it reads parts with transfer ids, so the peer may interleave its transfers, as many at once as
its one argument says (:mod:`garcon_link.rpc.chunks`)."""

# The one internal method ("$link".describe): no arguments, the manifest map as its result.
DESCRIBE_SPEC = MethodSpec(
    name="describe",
    kind=MethodKind.UNARY,
    signature=inspect.Signature(),
    hints={},
    result=Any,
)

# The internal notification ("$link".inventory): a worker's new manifest, numbered.
INVENTORY_SPEC = MethodSpec(
    name="inventory",
    kind=MethodKind.ONEWAY,
    signature=inspect.Signature(
        [
            inspect.Parameter("sequence", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("services", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ]
    ),
    hints={},
    result=None,
)


@dataclass(frozen=True, slots=True)
class Bound:
    spec: ServiceSpec
    target: object
    scope: ServiceScope | None = None  # set for a worker-scoped service


class Registry:
    """Services one side exposes: name -> (interface spec, implementation object)."""

    def __init__(self) -> None:
        self._services: dict[str, Bound] = {}

    def add(
        self, name: str, target: object, spec: ServiceSpec, *, scope: ServiceScope | None = None
    ) -> None:
        """Expose ``target`` as ``name``; with ``scope``, its handlers run in that scope (their
        ``current_scope()``) instead of the session's: a worker-scoped service."""
        if not name or name.startswith(("_", "$")):
            raise ValueError(f"invalid service name {name!r}")
        self._services[name] = Bound(spec, target, scope)

    def remove(self, name: str) -> bool:
        """Stop exposing ``name``; False if it was not exposed. Calls already running go on."""
        return self._services.pop(name, None) is not None

    def get(self, name: str) -> Bound | None:
        return self._services.get(name)

    def names(self) -> list[str]:
        return sorted(self._services)

    def manifest(self) -> dict[str, Any]:
        return {name: b.spec.manifest() for name, b in sorted(self._services.items())}


def in_scope(scope: ServiceScope, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` run with ``scope`` as its ``current_scope()``.

    Each handler runs in a task (and context) of its own, so setting the variable for the rest
    of that task reaches a coroutine's body and an async generator's alike.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        _current.set(scope)
        return target(*args, **kwargs)

    return call
