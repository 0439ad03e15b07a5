"""Scoped resource references and the per-session service scope.

A worker hands out references to things it owns for one logical session (a running process, an
open execution) as :class:`ResourceRef` values. A reference names the scope that minted it
(``executor_id`` and ``instance_id``); when the logical session is replaced the scope is closed,
its ``instance_id`` is never reused, and presenting an old reference raises
:class:`~garcon_link.errors.StaleResource` -- on the controller before anything is sent, and on
the worker when the reference arrives.

Handlers reach their scope through :func:`current_scope` (a context variable the worker runtime
sets around every handler call), or receive it as the argument of a per-session service factory.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from .errors import Rejected, StaleResource

__all__ = ["ResourceRef", "ServiceScope", "current_scope"]


@dataclass(frozen=True, slots=True)
class ResourceRef:
    """A reference to a resource owned by one service scope of one worker.

    Attributes:
        kind: what the resource is (``"process"``, ``"execution"``, ...).
        executor_id: the worker's configured name.
        instance_id: the service scope (one per logical session) that owns it.
        id: the resource's id within that scope.
    """

    kind: str
    executor_id: str
    instance_id: bytes
    id: str

    def __repr__(self) -> str:
        return f"ResourceRef({self.kind}:{self.id}@{self.executor_id}/{self.instance_id.hex()[:8]})"


@dataclass(frozen=True, slots=True)
class ServiceScope:
    """The worker's service scope for one logical session."""

    executor_id: str
    instance_id: bytes

    def resource(self, kind: str, id: str) -> ResourceRef:
        """Mint a reference to resource ``id`` of ``kind`` owned by this scope."""
        return ResourceRef(kind, self.executor_id, self.instance_id, id)

    def check(self, ref: ResourceRef, kind: str | None = None) -> str:
        """Return ``ref.id`` if ``ref`` belongs to this scope (and is of ``kind``).

        Raises:
            StaleResource: the reference was minted by another scope or executor.
            Rejected: the reference is of another kind (code ``WRONG_RESOURCE_KIND``).
        """
        if ref.executor_id != self.executor_id or ref.instance_id != self.instance_id:
            raise StaleResource(
                message=f"{ref!r} belongs to a replaced session or another executor"
            )
        if kind is not None and ref.kind != kind:
            raise Rejected("WRONG_RESOURCE_KIND", f"{ref!r} is not a {kind!r} resource")
        return ref.id


_current: contextvars.ContextVar[ServiceScope] = contextvars.ContextVar("garcon_link_scope")


def current_scope() -> ServiceScope:
    """The service scope of the handler being executed.

    Raises:
        LookupError: called outside a handler run by the worker runtime.
    """
    return _current.get()


def _set_scope(scope: ServiceScope) -> contextvars.Token[ServiceScope]:
    return _current.set(scope)
