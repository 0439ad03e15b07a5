"""Scoped resource references, the per-session service scope and the worker scope.

A worker hands out references to things it owns (a running process, an open execution) as
:class:`ResourceRef` values. A reference names the scope that minted it (``executor_id`` and
``instance_id``). There are two kinds of scope (docs/design.md#resource-references):

* **per-session** (the default): one :class:`ServiceScope` per logical session, with a fresh random
  ``instance_id``. When the session is replaced the scope is closed, its ``instance_id`` is never
  reused, and presenting an old reference raises :class:`~garcon_link.errors.StaleResource` -- on
  the controller before anything is sent, and on the worker when the reference arrives.
* **worker** (``gl.Service(obj, Iface, scope="worker")``): one :class:`WorkerScope` per
  :class:`~garcon_link.Worker`, whose ``instance_id`` is the worker link's ``runtime_id`` (16
  random bytes per process start). Its references stay valid across session replacement and
  controller restarts, and become ``StaleResource`` only when the worker restarts (a new runtime).
  The controller learns the worker's runtime from ``describe`` (``worker_instance_id``).

Handlers reach their scope through :func:`current_scope` (a context variable the worker runtime
sets around every handler call): a per-session service sees its session's scope, a worker-scoped
service sees the worker's scope (so ``current_scope().resource(...)`` mints a reference of the
right lifetime without the service knowing which it is). A per-session service factory receives
the session's scope; ``scope.worker`` is the worker scope, whose :meth:`WorkerScope.shared` keeps
one object for the worker's life (closed when the worker stops).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio

from ..errors import Rejected, StaleResource
from .statedir import StateDirectory

__all__ = ["ResourceRef", "ServiceScope", "WorkerScope", "current_scope"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ResourceRef:
    """A reference to a resource owned by one service scope of one worker.

    Attributes:
        kind: what the resource is (``"process"``, ``"execution"``, ...).
        executor_id: the worker's configured name.
        instance_id: the scope that owns it: a logical session's scope, or the worker's runtime
            for a worker-scoped service.
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
    """A service scope: one logical session's, or the worker's (see the module docstring).

    Attributes:
        executor_id: the worker's configured name.
        instance_id: what references minted here carry.
        worker: the worker scope this session scope belongs to (``None`` outside a worker, and on
            the worker scope's own :attr:`WorkerScope.scope`).
    """

    executor_id: str
    instance_id: bytes
    worker: WorkerScope | None = field(default=None, compare=False, repr=False)

    def resource(self, kind: str, id: str) -> ResourceRef:
        """Mint a reference to resource ``id`` of ``kind`` owned by this scope."""
        return ResourceRef(kind, self.executor_id, self.instance_id, id)

    def check(self, ref: ResourceRef, kind: str | None = None) -> str:
        """Return ``ref.id`` if ``ref`` belongs to this scope (and is of ``kind``).

        Strict: a per-session scope does not accept the worker scope's references, nor the
        reverse.

        Raises:
            StaleResource: the reference was minted by another scope or executor.
            Rejected: the reference is of another kind (code ``WRONG_RESOURCE_KIND``).
        """
        # The kind first: a live reference of another scope of this worker (an upload handle
        # given to the worker-scoped process service) is the caller's mix-up, not staleness.
        if ref.executor_id == self.executor_id and kind is not None and ref.kind != kind:
            raise Rejected("WRONG_RESOURCE_KIND", f"{ref!r} is not a {kind!r} resource")
        if ref.executor_id != self.executor_id or ref.instance_id != self.instance_id:
            raise StaleResource(
                message=f"{ref!r} belongs to a replaced session or another executor"
            )
        return ref.id

    def admits(self, ref: ResourceRef) -> bool:
        """Whether ``ref`` was minted by this scope or by the worker scope it belongs to.

        What the worker checks before dispatching a call that carries a reference; the
        handler's own :meth:`check` then applies its scope's strict rule.
        """
        if ref.executor_id != self.executor_id:
            return False
        if ref.instance_id == self.instance_id:
            return True
        return self.worker is not None and ref.instance_id == self.worker.instance_id


class WorkerScope:
    """The scope of one worker process: shared by its successive logical sessions.

    Its :attr:`instance_id` is the worker link's runtime id. Objects registered with
    :meth:`shared` live until the worker stops (:meth:`aclose`, called by
    :class:`~garcon_link.Worker` on exit), whatever happens to sessions.

    Args:
        executor_id: the worker's configured name.
        instance_id: the worker's runtime id (16 bytes).
    """

    def __init__(self, executor_id: str, instance_id: bytes) -> None:
        self.executor_id = executor_id
        self.instance_id = instance_id
        self.scope = ServiceScope(executor_id, instance_id)
        """The scope worker-scoped handlers run in: mints and checks worker references."""
        self._shared: dict[Hashable, object] = {}
        self.state: StateDirectory | None = None
        """The worker's state directory, once open (worker-scoped services keep records
        there), else None."""
        self._stack = contextlib.AsyncExitStack()
        self._lock: anyio.Lock | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<WorkerScope {self.executor_id}/{self.instance_id.hex()[:8]}>"

    def session_scope(self, instance_id: bytes) -> ServiceScope:
        """A per-session scope belonging to this worker scope."""
        return ServiceScope(self.executor_id, instance_id, self)

    async def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """The object stored under ``key``, made by ``make()`` the first time.

        If the object is an async context manager it is entered now and exited when the worker
        stops (so a per-session factory can hand out one worker-lifetime object to each session).

        Raises:
            RuntimeError: the worker scope is closed.
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if self._closed:
                raise RuntimeError("the worker scope is closed")
            if key in self._shared:
                return cast("T", self._shared[key])
            obj = make()
            if isinstance(obj, contextlib.AbstractAsyncContextManager):
                await self._stack.enter_async_context(cast("Any", obj))
            self._shared[key] = obj
            return obj

    async def aclose(self) -> None:
        """Close every shared object (last made, first closed); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._shared.clear()
        await self._stack.aclose()


_current: contextvars.ContextVar[ServiceScope] = contextvars.ContextVar("garcon_link_scope")


def current_scope() -> ServiceScope:
    """The service scope of the handler being executed.

    A worker-scoped service (``gl.Service(..., scope="worker")``) sees the worker's scope; any
    other sees its logical session's.

    Raises:
        LookupError: called outside a handler run by the worker runtime.
    """
    return _current.get()


def _set_scope(scope: ServiceScope) -> contextvars.Token[ServiceScope]:
    return _current.set(scope)
