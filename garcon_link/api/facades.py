"""Facades: the objects that turn an interface's methods into calls.

Facades (:meth:`RemoteExecutor.service <garcon_link.RemoteExecutor.service>`) hold no session:
each call resolves the current one at call time (:meth:`FacadeHost.rpc_for_call`). While
``reconnecting`` a call waits up to its ``dispatch_deadline`` for ``ready``; while ``offline``
(or past the deadline) it raises ``NotDispatched`` at once. There is no hidden offline queue. A
facade created without an interface is *dynamic*: its methods are looked up in the worker's
current manifest, arguments are validated by the worker only. A facade stream is its call's
outcome point on the client side. Inside a handler, :func:`peer` gives a facade on the
caller's service, bound to the handler's session.

Contracts, method by method. A typed facade's interface is its *view* of the service. Whenever
the worker's manifest is known -- at :meth:`~garcon_link.RemoteExecutor.service` and after every
new session or inventory change (the executor's ``manifest_version``) -- each method of the view
is compared with the worker's (:func:`~garcon_link.rpc.contract.compare_method`), once per
manifest. A call of a method whose contract changed incompatibly fails at once, nothing sent,
with ``Rejected("CONTRACT_CHANGED")`` naming the difference; of a method (or service) the worker
no longer offers, ``Rejected("UNSUPPORTED")``. Compatible and additive methods are called as
usual, so a worker upgraded with new methods, services or optional parameters stays usable
behind the facades made before.

Beside the public :func:`peer`, the api room uses :class:`FacadeHost` (what a facade needs of
its executor), :class:`Facade`, :class:`DynamicFacade`, :class:`FacadeStream`,
:data:`NO_METHODS` and :data:`UNSET` of type :class:`Unset` (the sync client and
``with_options`` wrap them), and :func:`counts_as_error` (what an executor's ``errors`` counts).
"""

from __future__ import annotations

import enum
import types
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final, Protocol, TypeVar, cast

from ..errors import CallError, NotDispatched, Outcome, Rejected
from ..limits import Limits
from ..net.backend import loop_scheduler
from ..rpc.contract import Compatibility, compare_method
from ..rpc.idempotency import normalize_key
from ..rpc.interface import MethodKind, MethodSpec, ServiceSpec, service_spec
from ..rpc.manifest import manifest_method, method_entries
from ..rpc.rpc import CallObserver, ExecutorRpc, Observed, end_of
from .keyed import ItemStream, KeyedCaller, call_with_key
from .registration import interface_class

__all__ = [
    "NO_METHODS",
    "UNSET",
    "Unset",
    "DynamicFacade",
    "Facade",
    "FacadeHost",
    "FacadeStream",
    "counts_as_error",
    "peer",
]

T = TypeVar("T")


class Unset(enum.Enum):
    """The type of :data:`UNSET` (one member, so a type checker narrows ``x is UNSET``)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"  # how help() and signatures show the default


UNSET: Final = Unset.UNSET
"""The default of every ``with_options`` argument: "keep the facade's value"."""


class FacadeHost(KeyedCaller, Protocol):
    """What a facade needs of its executor (a :class:`~garcon_link.RemoteExecutor`, or a
    gateway caller's :class:`~garcon_link.api.relay.GatewayExecutor`): its bounds and counters,
    its calls' outcome point (read once per facade), the session of a call
    (:meth:`~KeyedCaller.rpc_for_call`), the worker's manifest, how many times it was learned
    (0: never; read at every call) and a view's refusals on it, compared once per manifest and
    interface and shared by the facades made since."""

    executor_id: str
    limits: Limits
    calls: int
    errors: int

    @property
    def observer(self) -> CallObserver: ...

    @property
    def manifest_version(self) -> int: ...

    def manifest(self) -> Mapping[str, Any]: ...

    def refusals(self, service: str, interface: type, view: Mapping[str, Any]) -> Any: ...


class _Refusal:
    """Why one method of a view cannot be called on the worker's current contract."""

    __slots__ = ("code", "message")

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        self.message = message

    def error(self) -> Rejected:
        return Rejected(self.code, self.message)  # a fresh exception per call


def contract_refusals(
    service: str, view: Mapping[str, Any], manifest: Mapping[str, Any]
) -> dict[str, _Refusal]:
    """The methods of ``view`` (one service's manifest, as the facade's interface has it) that
    cannot be called on the worker's ``manifest`` (all its services), and why."""
    theirs = manifest.get(service)
    if isinstance(theirs, Mapping):  # each method's record types in its entry
        theirs = method_entries(theirs)
    refusals: dict[str, _Refusal] = {}
    for method, entry in method_entries(view).items():
        offered = theirs.get(method) if isinstance(theirs, Mapping) else None
        if theirs is not None and not isinstance(theirs, Mapping):
            compatibility, difference = Compatibility.INCOMPATIBLE, "its entry cannot be read"
        else:
            compatibility, difference = compare_method(entry, offered)
        if compatibility is Compatibility.REMOVED:
            what = f"no service {service!r}" if theirs is None else "no such method"
            refusals[method] = _Refusal(
                "UNSUPPORTED",
                f"{service}.{method}: the worker does not offer it ({what}); nothing was sent",
            )
        elif compatibility is Compatibility.INCOMPATIBLE:
            refusals[method] = _Refusal(
                "CONTRACT_CHANGED",
                f"{service}.{method}: the worker's contract is incompatible with this "
                f"interface's ({difference}); nothing was sent",
            )
    return refusals


def counts_as_error(exc: CallError) -> bool:
    """Whether a failed call counts in its executor's ``errors``: every :class:`CallError` but
    a drain's refusal (``NotDispatched("DRAINING")``, from either side), as a drain is an orderly
    goodbye, not a fault."""
    return not (exc.outcome is Outcome.NOT_DISPATCHED and exc.code == "DRAINING")


class Facade:
    """Runtime object behind a typed facade: one bound coroutine/stream function per method."""

    def __init__(
        self,
        executor: FacadeHost,
        name: str,
        spec: ServiceSpec,
        timeout: float | None,
        dispatch_deadline: float | None,
        *,
        idempotency_key: bytes | None = None,
        retry_unknown: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._executor = executor
        self._observer = executor.observer  # the executor's one outcome point
        self._metadata = metadata
        self._key = idempotency_key
        self._retry_unknown = retry_unknown
        self._name = name
        self._spec = spec
        self._timeout = executor.limits.call_timeout if timeout is None else timeout
        self._deadline = (
            executor.limits.dispatch_deadline if dispatch_deadline is None else dispatch_deadline
        )
        self._view = spec.manifest()
        self._refusals: dict[str, _Refusal] = {}
        self._compared = 0  # the executor's manifest_version the refusals were computed for
        for method in spec.methods.values():
            setattr(self, method.name, self._bind(method))
        self._check_method(None)  # at creation, when the manifest is known already

    def _check_method(self, method: str | None) -> None:
        """Raise ``Rejected`` if ``method`` cannot be called on the worker's current contract
        (module docstring); compare the view again first if the manifest changed since."""
        executor = self._executor
        version = executor.manifest_version
        if version != self._compared and self._view:
            self._refusals = executor.refusals(self._name, self._spec.interface, self._view)
            self._compared = version
        refusal = self._refusals.get(method) if method is not None else None
        if refusal is not None:
            raise refusal.error()

    def __repr__(self) -> str:
        interface = self._spec.interface.__qualname__
        return f"<facade {self._name}: {interface} @ {self._executor.executor_id}>"

    def with_options(
        self,
        *,
        timeout: float | Unset | None = UNSET,
        dispatch_deadline: float | Unset | None = UNSET,
        idempotency_key: str | bytes | Unset | None = UNSET,
        retry_unknown: bool | Unset = UNSET,
        metadata: Mapping[str, str] | Unset | None = UNSET,
    ) -> Any:
        key = self._key if idempotency_key is UNSET else idempotency_key
        if key is not None:
            key = normalize_key(key)
        retry = self._retry_unknown if retry_unknown is UNSET else retry_unknown
        if not isinstance(retry, bool):
            raise TypeError(f"retry_unknown must be a bool, got {type(retry).__name__}")
        if retry and key is None:
            raise ValueError(
                "retry_unknown=True needs an idempotency_key: without one a retry could run "
                "the call twice"
            )
        return type(self)(  # a dynamic facade stays dynamic
            self._executor,
            self._name,
            self._spec,
            self._timeout if timeout is UNSET else timeout,
            self._deadline if dispatch_deadline is UNSET else dispatch_deadline,
            idempotency_key=key,
            retry_unknown=retry,
            metadata=_frozen_metadata(self._metadata if metadata is UNSET else metadata),
        )

    def _bind(self, method: MethodSpec) -> Callable[..., Any]:
        executor, name, facade, observer = self._executor, self._name, self, self._observer

        if method.kind is MethodKind.STREAM:

            def open_stream(*args: Any, **kwargs: Any) -> FacadeStream:
                if facade._key is not None:
                    raise TypeError(
                        f"{name}.{method.name} is a stream: idempotency keys apply to unary "
                        "calls only"
                    )
                return FacadeStream(
                    executor,
                    name,
                    method,
                    args,
                    kwargs,
                    facade._deadline,
                    facade._metadata,
                    facade._check_method,
                )

            open_stream.__name__ = method.name
            return open_stream

        async def call(*args: Any, **kwargs: Any) -> Any:
            executor.calls += 1

            async def attempt(metadata: Mapping[str, str] | None) -> Any:
                if facade._key is not None:
                    facade._check_method(method.name)
                    return await call_with_key(
                        executor,
                        name,
                        method,
                        args,
                        kwargs,
                        key=facade._key,
                        timeout=facade._timeout,
                        dispatch_deadline=facade._deadline,
                        retry_unknown=facade._retry_unknown,
                        metadata=metadata,
                    )
                rpc = await executor.rpc_for_call(facade._deadline)
                facade._check_method(method.name)  # against the manifest of that session
                return await rpc.call(
                    name, method, args, kwargs, timeout=facade._timeout, metadata=metadata
                )

            try:
                return await observer.call(name, method, facade._metadata, attempt)
            except CallError as exc:
                if counts_as_error(exc):
                    executor.errors += 1
                raise

        call.__name__ = method.name
        return call


class DynamicFacade(Facade):
    """A facade without an interface: each method is looked up in the worker's manifest."""

    def __repr__(self) -> str:
        return f"<dynamic facade {self._name} @ {self._executor.executor_id}>"

    def __getattr__(self, method: str) -> Callable[..., Any]:
        # Only called for names the instance does not have (never for _name, _executor...).
        if method.startswith("_"):
            raise AttributeError(method)
        try:
            spec = manifest_method(self._executor.manifest(), self._name, method)
        except Rejected as exc:
            raise AttributeError(exc.message) from None
        return self._bind(spec)

    def __dir__(self) -> list[str]:
        try:
            methods = self._executor.manifest().get(self._name)
        except NotDispatched:
            methods = None
        known = sorted(methods) if isinstance(methods, Mapping) else []
        return sorted({*super().__dir__(), *known})


class _NoInterface:
    """The interface of a dynamic facade: no methods of its own."""


NO_METHODS = ServiceSpec(interface=_NoInterface, methods={})


class _StreamOutcome:
    """Ends one facade stream at its executor's outcome point exactly once (the facade and, if it
    is dropped unclosed, its finalizer share it)."""

    __slots__ = ("done", "observed", "observer")

    def __init__(self, observer: CallObserver, observed: Observed | None) -> None:
        self.observer = observer
        self.observed = observed
        self.done = False

    def end(self, outcome: Outcome | None, code: str | None, cancelled: bool) -> None:
        if not self.done:
            self.done = True
            self.observer.client_ended(self.observed, outcome, code, cancelled)

    def dropped(self) -> None:
        self.end(Outcome.UNKNOWN, "CANCELLED", True)


def _schedule_dropped(schedule: Callable[..., object], outcome: _StreamOutcome) -> None:
    # A finalizer (maybe inside the garbage collector): only schedule; never raise.
    try:
        schedule(outcome.dropped)
    except Exception:
        pass


class FacadeStream(AsyncIterator[Any]):
    """Resolves the current session on first iteration, then delegates to a RemoteStream.

    It is the client side's outcome point of a stream: exhausted (ok), raised (its outcome),
    closed before its end or dropped unclosed (``cancelled``).
    """

    def __init__(
        self,
        executor: FacadeHost,
        name: str,
        method: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        deadline: float,
        metadata: Mapping[str, str] | None = None,
        check: Callable[[str], None] | None = None,
    ) -> None:
        self._executor = executor
        self._check = check
        self._name = name
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._deadline = deadline
        self._metadata = metadata
        self._stream: ItemStream | None = None
        self._outcome: _StreamOutcome | None = None
        self._finalizer: Any = None
        self._closed = False

    def __aiter__(self) -> FacadeStream:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        executor = self._executor
        try:
            if self._stream is None:
                outcome = self._start()
                observer = outcome.observer
                observed = outcome.observed
                metadata = self._metadata
                if observed is not None:
                    metadata = cast("dict[str, str]", observed.info.metadata) or None
                if metadata:
                    observer.check_metadata(metadata)
                rpc = await executor.rpc_for_call(self._deadline)
                if self._check is not None:
                    self._check(self._method.name)
                self._stream = rpc.stream(
                    self._name, self._method, self._args, self._kwargs, metadata
                )
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._end(None, None, False)
            raise
        except BaseException as exc:
            if isinstance(exc, CallError) and counts_as_error(exc):
                executor.errors += 1
            self._end(*end_of(exc))
            raise

    def _start(self) -> _StreamOutcome:
        if self._outcome is not None:
            return self._outcome  # a first iteration that raised before the stream was opened
        self._executor.calls += 1
        observer = self._executor.observer
        observed = observer.stream_started(self._name, self._method, self._metadata)
        self._outcome = outcome = _StreamOutcome(observer, observed)
        self._finalizer = weakref.finalize(self, _schedule_dropped, loop_scheduler(), outcome)
        self._finalizer.atexit = False
        return outcome

    def _end(self, outcome: Outcome | None, code: str | None, cancelled: bool) -> None:
        if self._outcome is not None:
            self._outcome.end(outcome, code, cancelled)
        if self._finalizer is not None:
            self._finalizer.detach()

    async def aclose(self) -> None:
        """Stop the stream (idempotent); it is never started if it had not been yet."""
        self._closed = True
        self._end(Outcome.UNKNOWN, "CANCELLED", True)
        if self._stream is not None:
            await self._stream.aclose()


def _frozen_metadata(metadata: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """A read-only copy of a facade's metadata (validated when a call is made)."""
    if not metadata:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__}")
    return types.MappingProxyType(dict(metadata))


def peer(name: str, interface: Callable[..., T]) -> T:
    """Inside a handler: a facade on the *caller's* service ``name`` (bidirectional calls).

    The facade is bound to the session the handler runs in. ``interface`` is a class, as for
    :meth:`RemoteExecutor.service` (which explains the annotation).

    Raises:
        LookupError: called outside a handler.
        TypeError: ``interface`` is not a class.
    """
    from ..rpc.rpc import current_rpc

    rpc = current_rpc()
    return cast("T", _PeerFacade(rpc, name, service_spec(interface_class(interface))))


class _PeerFacade:
    def __init__(self, rpc: ExecutorRpc, name: str, spec: ServiceSpec) -> None:
        for method in spec.methods.values():
            setattr(self, method.name, self._bind(rpc, name, method))

    @staticmethod
    def _bind(rpc: ExecutorRpc, name: str, method: MethodSpec) -> Callable[..., Any]:
        if method.kind is MethodKind.STREAM:
            return lambda *a, **k: rpc.stream(name, method, a, k)

        async def call(*args: Any, **kwargs: Any) -> Any:
            async def attempt(metadata: Mapping[str, str] | None) -> Any:
                timeout = rpc.limits.call_timeout
                return await rpc.call(
                    name, method, args, kwargs, timeout=timeout, metadata=metadata
                )

            return await rpc.observer.call(name, method, None, attempt)

        return call
