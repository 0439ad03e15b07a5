"""A blocking client for scripts, notebooks and tests: :func:`connect_sync`.

``gl.connect_sync(config)`` starts an event loop of its own in a background thread (a daemon
thread running ``anyio.run`` with a :class:`~anyio.from_thread.BlockingPortal`), connects a
:class:`~garcon_link.RemoteExecutor` there, and returns a :class:`SyncExecutor`: the same surface
where it makes sense, without ``await``::

    with gl.connect_sync(config) as executor:
        executor.wait_ready(10)
        calc = executor.service("calc", CalculatorSync)
        print(calc.add(1, 2))
        for i in calc.count(3):
            print(i)

Each call runs as a task on that loop; the calling thread blocks until it ends, and gets its
result or its exception -- the same :class:`~garcon_link.CallError` subclasses, with the same
reasons, as the async facade raises (``NotDispatched``, ``OutcomeUnknown``, ``RemoteError``,
...). Every call is bounded by its timeout (``Limits.call_timeout`` or ``with_options``). An
interruption of the waiting thread (``KeyboardInterrupt`` in a notebook) cancels the call's task
and propagates; what that means for the call is what cancelling an async call means (it may have
run on the worker).

Typing. A sync facade cannot be derived from an async ``Protocol`` by a type checker, so the sync
client is typed by a **sync view** of the interface: a ``Protocol`` of plain ``def`` methods, a
stream returning ``Iterator[T]`` (or ``Iterable``/``Generator``), ``@gl.oneway def`` for a
notification (:func:`garcon_link.rpc.views.sync_service_spec`)::

    class CalculatorSync(Protocol):
        def add(self, a: int, b: int) -> int: ...
        def count(self, n: int) -> Iterator[int]: ...

``executor.service("calc", CalculatorSync)`` is typed ``CalculatorSync``, so mypy and pyright
check every call. The view is *checked*, not trusted: its manifest (the async interface's, a
stream reading ``AsyncIterator[T]`` in both) is compared with the worker's manifest for that
service, method by method (:mod:`garcon_link.rpc.contract`) -- when the facade is created if a
session was installed already, else before its first call is sent. A view with a method the
worker does not offer, or offers with an incompatible contract, is taken for a mistake in the
view: :class:`~garcon_link.ConfigError` lists each such method (nothing is sent); what the
worker adds (methods, optional parameters) is fine. After that first check the facade follows
the worker's upgrades as an async facade does: a method whose contract later changes
incompatibly fails its own calls with ``Rejected("CONTRACT_CHANGED")``, one removed with
``Rejected("UNSUPPORTED")``. Passing the async interface itself raises ``ConfigError`` whose
message is the source of the sync view to paste. ``executor.service(name)`` without an interface
is the dynamic facade (typed ``Any``), as in the async client.

Streams are plain iterators (:class:`SyncStream`). Leaving a ``for`` loop early (``break``, an
exception) drops the iterator, and the dropped stream is cancelled on the worker (as an
abandoned async stream is; CPython frees it at once). ``stream.close()`` or ``with
calc.count(3) as items:`` closes it explicitly, which is the way when a reference to it is kept.

Threads and running loops. The client's loop is its own thread's: the calling thread may be any
thread, including one that runs an event loop of its own -- a Jupyter kernel's, or code called
from a coroutine. That is supported, and it *blocks that loop* for the duration of each call, as
any blocking library does (``requests``, ``time.sleep``); from async code, use
:func:`garcon_link.connect` instead, or ``loop.run_in_executor``. Calling from the client's own
loop thread (e.g. from a controller-side service handler given to ``connect_sync(services=)``)
would deadlock and raises ``RuntimeError`` at once.

Lifetime. :meth:`SyncExecutor.close` (and leaving ``with``) disposes the executor and stops the
thread. The thread is a daemon and ``close`` is registered with :mod:`atexit`, so a script that
never closes still exits, after a graceful close (``anyio.from_thread.start_blocking_portal``'s
pool thread is joined *before* atexit handlers run: a forgotten portal hangs the interpreter
at exit, which is why it is not used here).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast, overload

import anyio
from anyio.from_thread import BlockingPortal

from ..errors import ConfigError, NotDispatched, OutcomeUnknown
from ..limits import Limits
from ..rpc.contract import Compatibility, compare_method
from ..rpc.hooks import CallHook
from ..rpc.interface import ServiceSpec
from ..rpc.manifest import manifest_changes, method_entries
from ..rpc.views import sync_service_spec
from ..settings.callers import CallerConfig
from ..settings.config import LinkConfig
from .controller import Availability, ExecutorInfo, RemoteExecutor, connect
from .facades import NO_METHODS, UNSET, DynamicFacade, Facade, FacadeStream, Unset
from .registration import ServiceMap, interface_class
from .relay import GatewayExecutor, GatewayFleet, connect_gateway

__all__ = ["SyncExecutor", "SyncFacade", "SyncStream", "connect_sync"]

T = TypeVar("T")
R = TypeVar("R")


def connect_sync(
    config: LinkConfig | CallerConfig,
    *,
    services: ServiceMap | None = None,
    limits: Limits | None = None,
    hooks: Sequence[CallHook] = (),
    controller_id: str | None = None,
    executor_id: str | None = None,
) -> SyncExecutor:
    """The controller side, blocking: ``with connect_sync(config) as executor: ...``.

    The executor is started (listening or dialing) when this returns; ``wait_ready`` waits for
    the worker. See the module docstring for threads, typing and lifetime.

    Args:
        config: a controller configuration, as for :func:`garcon_link.connect`.
        services: controller-side services the worker may call back; their (async) handlers
            run on the client's own loop.
        limits: overrides ``config.limits``.
        hooks: per-call hooks (:mod:`garcon_link.rpc.hooks`); they run on the client's loop thread.
        controller_id: replaces the config's, as for :func:`garcon_link.connect`.
        executor_id: with a gateway caller's configuration (:class:`~garcon_link.CallerConfig`),
            the executor to talk to through the gateway (:func:`garcon_link.connect_gateway`);
            required then, refused otherwise.

    Raises:
        ConfigError: ``config`` is not a controller (or caller) configuration, or
            ``executor_id`` is missing with a caller's or given with another.
        LinkError: the executor cannot start (e.g. it cannot listen on its address).
    """
    if isinstance(config, CallerConfig):
        if executor_id is None:
            raise ConfigError(
                "connect_sync(caller config) needs executor_id=: the executor to call"
            )
        if services or controller_id is not None:
            raise ConfigError("a gateway caller serves no services and has no controller_id")
        return SyncExecutor(config, limits=limits, hooks=hooks, executor_id=executor_id)
    if executor_id is not None:
        raise ConfigError("executor_id= is for a gateway caller's configuration (role = caller)")
    if controller_id is not None:
        config = dataclasses.replace(config, controller_id=controller_id)
    return SyncExecutor(config, services=services, limits=limits, hooks=hooks)


class _LoopThread:
    """A daemon thread running an event loop and a portal into it."""

    def __init__(self) -> None:
        started: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def main() -> None:
            async with BlockingPortal() as portal:
                started.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(main)
            except BaseException as exc:  # pragma: no cover - the loop failed to start
                if not started.done():
                    started.set_exception(exc)

        self.thread = threading.Thread(target=run, name="garcon-link-sync", daemon=True)
        self.thread.start()
        self.portal = started.result()

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # already stopped
            self.portal.call(self.portal.stop, True)
        self.thread.join()


class SyncExecutor:
    """A :class:`~garcon_link.RemoteExecutor` driven from blocking code (:func:`connect_sync`).

    Use it as a context manager, or call :meth:`close` (also run at interpreter exit).
    """

    def __init__(
        self,
        config: LinkConfig | CallerConfig,
        *,
        services: ServiceMap | None = None,
        limits: Limits | None = None,
        hooks: Sequence[CallHook] = (),
        executor_id: str | None = None,
    ) -> None:
        self._closed = False
        self._lock = threading.Lock()
        self._drain = 0.0
        self._loop = _LoopThread()
        self._gateway: GatewayFleet | None = None
        try:
            # Built on the loop thread: its events belong to that loop, never to a loop the
            # calling thread may be running (Jupyter's).
            if isinstance(config, CallerConfig):
                assert executor_id is not None
                self._gateway = self._loop.portal.call(
                    functools.partial(connect_gateway, config, limits=limits, hooks=hooks)
                )
                self._cm = self._loop.portal.wrap_async_context_manager(
                    self._hold_gateway(self._gateway)
                )
                self._cm.__enter__()
                self._executor: RemoteExecutor | GatewayExecutor = self._loop.portal.call(
                    self._gateway.executor, executor_id
                )
            else:
                self._executor = self._loop.portal.call(
                    functools.partial(
                        connect, config, services=services, limits=limits, hooks=hooks
                    )
                )
                self._cm = self._loop.portal.wrap_async_context_manager(self._hold())
                self._cm.__enter__()
        except BaseException:
            self._loop.stop()
            raise
        atexit.register(self.close)

    @contextlib.asynccontextmanager
    async def _hold(self) -> AsyncIterator[RemoteExecutor]:
        # One task enters and leaves the executor (its task group requires it).
        executor = self._executor
        assert isinstance(executor, RemoteExecutor)
        async with executor:
            yield executor
            await executor.aclose(drain=self._drain)

    @contextlib.asynccontextmanager
    async def _hold_gateway(self, gateway: GatewayFleet) -> AsyncIterator[RemoteExecutor]:
        async with gateway:
            yield gateway.gateway

    def __enter__(self) -> SyncExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncExecutor {self.executor_id} {self.availability}>"

    def close(self, *, drain: float = 0.0) -> None:
        """Dispose the executor (as :meth:`RemoteExecutor.aclose`, with ``drain``) and stop the
        thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._drain = drain
        try:
            self._cm.__exit__(None, None, None)
        finally:
            self._loop.stop()

    # -- the executor's surface

    @property
    def executor(self) -> RemoteExecutor | GatewayExecutor:
        """The async executor underneath (its methods must run on the client's loop): a
        :class:`~garcon_link.GatewayExecutor` through a gateway."""
        return self._executor

    @property
    def executor_id(self) -> str:
        return self._executor.executor_id

    @property
    def availability(self) -> Availability:
        return self._executor.availability

    @property
    def last_error(self) -> str | None:
        executor = self._executor
        if isinstance(executor, GatewayExecutor):
            return executor.gateway.last_error
        return executor.last_error

    def wait_ready(self, timeout: float | None = None, *, refused_dials: int | None = None) -> None:
        """Block until the executor is ready; ``refused_dials`` and what it raises are those of
        :meth:`RemoteExecutor.wait_ready` (through a gateway, the dials are the gateway's)."""
        executor = self._executor
        if isinstance(executor, GatewayExecutor):
            if refused_dials is not None:
                gateway = executor.gateway
                self._call(gateway.wait_ready, timeout, refused_dials=refused_dials)
            self._call(executor.wait_ready, timeout)
            return
        self._call(executor.wait_ready, timeout, refused_dials=refused_dials)

    def info(self) -> ExecutorInfo:
        """The current session's description (see :meth:`RemoteExecutor.info`); through a
        gateway, that of the granted services (:meth:`GatewayExecutor.info
        <garcon_link.api.relay.GatewayExecutor.info>`)."""
        return cast("ExecutorInfo", self._call(self._executor.info))

    @overload
    def service(self, name: str) -> Any: ...

    @overload
    def service(self, name: str, interface: Callable[..., T]) -> T: ...

    def service(self, name: str, interface: Callable[..., T] | None = None) -> T | Any:
        """A facade for service ``name``, typed as the sync view ``interface``.

        ``interface`` is a class of plain ``def`` methods (module docstring); without it the
        facade is dynamic, built from the worker's manifest, typed ``Any``.

        Raises:
            TypeError: ``interface`` is not a class.
            ConfigError: ``interface`` is not a sync view (the message shows the one to write
                when it is the async interface), or a session is installed and its manifest
                lacks a method of ``interface`` or has it with an incompatible contract (the
                message lists the methods).
        """
        if interface is None:
            return SyncFacade(self, DynamicFacade(self._executor, name, NO_METHODS, None, None))
        spec = sync_service_spec(interface_class(interface))
        facade = SyncFacade(self, Facade(self._executor, name, spec, None, None))
        facade._check_contract()
        return cast("T", facade)

    # -- plumbing

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a coroutine function or a plain one) on the loop."""
        if threading.get_ident() == self._loop.thread.ident:
            raise RuntimeError(
                "a SyncExecutor was called from its own event loop thread (e.g. from a "
                "controller-side service handler): that would deadlock; use the async API "
                "there (sync_executor.executor)"
            )
        if self._closed:
            raise NotDispatched("DISPOSED", "the executor was closed")
        task = _Task(functools.partial(fn, *args, **kwargs))
        future: concurrent.futures.Future[Any] | None = None
        try:
            future = self._loop.portal.start_task_soon(task.run)
            return future.result()
        except concurrent.futures.CancelledError:
            # Its task was cancelled by close() in another thread, after the executor failed
            # what it could honestly fail: whether this call ran is not known.
            raise OutcomeUnknown(
                "DISPOSED", "the executor was closed during the call; it may have run"
            ) from None
        except RuntimeError:
            if future is None:  # the portal stopped meanwhile
                raise NotDispatched("DISPOSED", "the executor was closed") from None
            raise
        except BaseException:
            # Interrupted (KeyboardInterrupt), possibly before start_task_soon returned the
            # future: cancel the task through its own handle.
            if future is None or not future.done():
                task.cancel(self._loop.portal)
            raise


class _Task:
    """One call's task on the client's loop, cancellable from any thread at any point: before
    it started (it then never runs its call), while it runs, or after (nothing happens)."""

    def __init__(self, call: Callable[[], Awaitable[Any]]) -> None:
        self._call = call
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False

    async def run(self) -> Any:
        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._cancelled:
                scope.cancel()
            return await self._call()
        raise concurrent.futures.CancelledError  # cancelled: the future reports it

    def cancel(self, portal: BlockingPortal) -> None:
        self._cancelled = True  # seen by run() if it has not set its scope yet
        scope = self._scope
        if scope is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: so is the task
                portal.start_task_soon(scope.cancel)


class SyncFacade:
    """Runtime object behind a sync facade: one blocking function per method of the interface.

    ``with_options`` (or :func:`garcon_link.with_options`) returns a copy with other call
    options, as for the async facade.
    """

    def __init__(self, owner: SyncExecutor, facade: Facade) -> None:
        self._owner = owner
        self._facade = facade
        self._checked = False
        for name in facade._spec.methods:
            setattr(self, name, self._wrap(getattr(facade, name)))

    def __repr__(self) -> str:
        return "<sync " + repr(self._facade)[1:]

    def __getattr__(self, method: str) -> Callable[..., Any]:
        # Only for names the instance lacks: a dynamic facade's methods come from the manifest.
        if method.startswith("_") or not isinstance(self._facade, DynamicFacade):
            raise AttributeError(method)
        return self._wrap(getattr(self._facade, method))

    def __dir__(self) -> list[str]:
        methods = (name for name in dir(self._facade) if not name.startswith("_"))
        return sorted({*super().__dir__(), *methods})

    def with_options(
        self,
        *,
        timeout: float | Unset | None = UNSET,
        dispatch_deadline: float | Unset | None = UNSET,
        idempotency_key: str | bytes | Unset | None = UNSET,
        retry_unknown: bool | Unset = UNSET,
        metadata: Mapping[str, str] | Unset | None = UNSET,
    ) -> Any:
        """A copy with other call options (see :func:`garcon_link.with_options`)."""
        copy = SyncFacade(
            self._owner,
            self._facade.with_options(
                timeout=timeout,
                dispatch_deadline=dispatch_deadline,
                idempotency_key=idempotency_key,
                retry_unknown=retry_unknown,
                metadata=metadata,
            ),
        )
        copy._checked = self._checked
        return copy

    def _check_contract(self) -> None:
        """Compare the interface with the worker's manifest once one is known (module
        docstring). Runs on the loop thread before a call, or at creation."""
        spec: ServiceSpec = self._facade._spec
        if self._checked or not spec.methods:
            return
        executor = self._owner._executor
        if not executor.manifest_version:
            return  # no session installed yet
        manifest = executor.manifest()
        name = self._facade._name
        worker = manifest.get(name)
        interface = spec.interface.__qualname__
        if not isinstance(worker, Mapping):
            known = ", ".join(sorted(manifest)) or "none"
            raise ConfigError(
                f"{interface}: the worker serves no service {name!r} (services: {known})"
            )
        mine, worker = method_entries(spec.manifest()), method_entries(worker)
        # Only what a caller with this view cannot use (a one-way view of a unary method is the
        # caller's choice; an optional parameter the worker added is not the view's concern).
        unusable = [m for m in mine if not _usable(compare_method(mine[m], worker.get(m))[0])]
        theirs = {m: worker.get(m) for m in unusable}
        changes = manifest_changes({name: theirs}, {name: {m: mine[m] for m in unusable}})
        if changes:
            raise ConfigError(
                f"{interface} does not match the worker's service {name!r} "
                "(the worker's  =>  this interface's):\n" + "\n".join(f"  {c}" for c in changes)
            )
        self._checked = True

    def _wrap(self, bound: Callable[..., Any]) -> Callable[..., Any]:
        owner = self._owner
        if inspect.iscoroutinefunction(bound):

            async def checked(*args: Any, **kwargs: Any) -> Any:
                self._check_contract()  # no await before the call resolves its session
                return await bound(*args, **kwargs)

            def call(*args: Any, **kwargs: Any) -> Any:
                return owner._call(checked, *args, **kwargs)

            call.__name__ = bound.__name__
            return call

        def open_stream(*args: Any, **kwargs: Any) -> SyncStream:
            return SyncStream(owner, bound(*args, **kwargs), self._check_contract)

        open_stream.__name__ = bound.__name__
        return open_stream


def _usable(compatibility: Compatibility) -> bool:
    return compatibility in (Compatibility.COMPATIBLE, Compatibility.ADDITIVE)


class SyncStream(Iterator[Any]):
    """A remote stream as a plain iterator; started by the first ``next``.

    ``close()`` (or leaving ``with``) stops it on the worker; so does dropping it (module
    docstring). Iteration raises the async stream's errors (``OutcomeUnknown``, ...).
    """

    def __init__(
        self, owner: SyncExecutor, stream: FacadeStream, check: Callable[[], None]
    ) -> None:
        self._owner = owner
        self._stream = stream
        self._check = check
        self._done = False

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            more, value = self._owner._call(self._next)
        except BaseException:
            self._done = True  # a failed stream is over (its error was raised)
            raise
        if not more:
            self._done = True
            raise StopIteration
        return value

    async def _next(self) -> tuple[bool, Any]:
        self._check()
        try:
            return True, await self._stream.__anext__()
        except StopAsyncIteration:
            return False, None

    def close(self) -> None:
        """Stop the stream (idempotent); never started if it was not yet."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(NotDispatched):  # the executor is closed: so is the stream
            self._owner._call(self._stream.aclose)

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
