"""What an endpoint serves: :class:`Service`, and a services map checked into a ``Registry``.

Registration is checked up front: :class:`Service` checks its target against the interface when
constructed, and a worker checks each plain object it serves (as its own interface) when built,
raising one ``ConfigError`` that lists every problem (see :mod:`garcon_link.rpc.interface`).

Beside the public :class:`Service`, the api room uses :data:`ServiceMap`, :data:`ServiceFactory`,
:func:`registry_from`, :func:`check_registration` and :func:`interface_class` (the controller,
the worker, the fleet and the sync client build their registries and facades with them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from ..errors import ConfigError
from ..rpc.interface import ServiceSpec, derive_spec, registration_problems, service_spec
from ..rpc.resources import ServiceScope, WorkerScope
from ..rpc.rpc import Registry

__all__ = [
    "Service",
    "ServiceFactory",
    "ServiceMap",
    "check_registration",
    "interface_class",
    "registry_from",
]

T = TypeVar("T")
ServiceMap = Mapping[str, Any]  # name -> object, or Service
ServiceFactory = Callable[[ServiceScope], contextlib.AbstractAsyncContextManager[ServiceMap]]


@dataclass(frozen=True, slots=True)
class Service(Generic[T]):
    """An object exposed under an explicit interface (only the interface's methods are callable).

    Checked when constructed: every method of ``interface`` must be implemented by ``target``
    with the right kind (``async def`` for a unary call, an async generator function for a
    stream), accept the interface's parameters, annotate none of them (or a unary result) with a
    class that contradicts the interface's, and use only hints msgspec can convert (see
    :func:`garcon_link.interface.registration_problems`).

    ``scope`` is the lifetime of the resources it hands out: ``"session"`` (the
    default) -- its handlers run in the logical session's scope and the references they mint die
    with the session; ``"worker"`` -- its handlers run in the worker's scope
    (:class:`~garcon_link.resources.WorkerScope`): references carry the worker's runtime id,
    survive session replacement and controller restarts, and are stale only after the worker
    restarts. A worker-scoped object must outlive sessions: serve it in a mapping, or hand the
    same object to every session from a factory (``await scope.worker.shared(key, make)``).

    For mypy to check the target against the interface too, name the interface as the type
    argument: ``gl.Service[Calculator](impl, Calculator)`` (or annotate the variable,
    ``svc: gl.Service[Calculator] = ...``). ``gl.Service(impl, Calculator)`` alone cannot be
    checked statically: mypy infers ``T`` from ``impl``, and a ``Protocol`` cannot be
    accepted as ``type[T]`` (``type-abstract``), so ``interface`` is typed as any class.

    Raises:
        ConfigError: the message lists every problem and its fix.
        TypeError: ``interface`` is not a class, or its hints cannot be resolved.
    """

    target: T
    interface: Callable[..., object]
    scope: Literal["session", "worker"] = "session"

    def __post_init__(self) -> None:
        if self.scope not in ("session", "worker"):
            raise ConfigError(f"Service scope must be 'session' or 'worker', got {self.scope!r}")
        interface = interface_class(self.interface)
        check_registration(self.target, interface, f"Service(..., {_name(interface)})")


def _name(interface: object) -> str:
    return getattr(interface, "__qualname__", repr(interface))


def check_registration(target: object, interface: type, what: str) -> ServiceSpec:
    """The spec of ``interface`` once ``target`` is known to fit it (else ``ConfigError``)."""
    spec, problems = derive_spec(interface)
    if not problems:
        spec = service_spec(interface)  # cached
        problems = registration_problems(target, spec)
    if problems:
        raise ConfigError(
            f"{what}: {type(target).__qualname__} cannot be served as written:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return spec


def interface_class(interface: object) -> type:
    """``interface`` itself once it is known to be a class (else ``TypeError``)."""
    if not isinstance(interface, type):
        raise TypeError(f"an interface must be a class, got {interface!r}")
    return interface


def registry_from(services: ServiceMap, worker: WorkerScope | None = None) -> Registry:
    """The registry of a services map, each plain object checked as its own interface; a
    worker-scoped :class:`Service` runs in ``worker``'s scope when one is given."""
    registry = Registry()
    for name, value in services.items():
        if isinstance(value, Service):
            scope = worker.scope if worker is not None and value.scope == "worker" else None
            spec = service_spec(interface_class(value.interface))
            registry.add(name, value.target, spec, scope=scope)
        else:
            registry.add(name, value, check_registration(value, type(value), f"service {name!r}"))
    return registry
