"""The worker runtime: :class:`Worker` and :func:`serve` (docs/design.md#facades).

A worker serves ``services`` to several controllers at once, one logical session each (up to
``Limits.max_controllers``; docs/design.md#many-controllers): each session has its own
:class:`~garcon_link.rpc.rpc.ExecutorRpc` (ordinals, retention, budgets, session-scoped
resources), while worker-scoped services and the idempotency table are shared by all.
``services`` is either a mapping of name -> object, or a factory called once per logical session
with its
:class:`~garcon_link.rpc.resources.ServiceScope` that returns an async context manager yielding
that mapping (:mod:`garcon_link.api.registration` checks what it holds). A retired session's
scope is closed in the background, bounded by ``scope_cleanup_timeout``, never blocking the new
session. Beside them, one :class:`~garcon_link.rpc.resources.WorkerScope` lives as long as the
:class:`Worker` (its id is the link's ``runtime_id``): a ``Service(..., scope="worker")`` runs
its handlers there and ``describe`` reports it as ``worker_instance_id``
(docs/design.md#durable-work). The worker scope is closed after the link, when the worker stops.

Graceful drain (``Worker(..., drain=)``, ``Worker.aclose(drain=)``, ``serve(..., drain=)``, and
``garcon-link worker`` on SIGTERM): every session refuses its controller's new calls, unexecuted,
with ``NotDispatched("DRAINING")`` (``ExecutorRpc.start_drain``; so does a session that begins
during the drain) while running handlers finish and their replies are acknowledged. What is
still running when the drain time is up ends as any close ends it: the caller's call fails
``OutcomeUnknown`` (never a result that did not happen). ``serve`` runs until cancelled, so it
runs its worker in a shielded task of its own and drains it when cancelled.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..endpoint.link import WebSocketLink
from ..endpoint.transport import SessionTransport, TransportState
from ..errors import ConfigError, FailureReason
from ..limits import Limits
from ..logs import log_fields
from ..rpc.hooks import CallHook
from ..rpc.idempotency import IdempotencyStatistics, KeyedExecutions
from ..rpc.interface import contract_hash
from ..rpc.resources import ServiceScope, WorkerScope
from ..rpc.rpc import CallObserver, ExecutorRpc, Registry, RpcStatistics
from ..settings.config import LinkConfig
from .endpoint import Endpoint, ExecutorStatistics, SessionTotals, link_from_config
from .registration import ServiceFactory, ServiceMap, registry_from

__all__ = ["EventSink", "Worker", "serve"]

log = logging.getLogger("garcon_link.remote")  # the name users configure (README)

EventSink = Callable[[str], None]


class Worker(Endpoint):
    """The worker side: serves ``services`` to each controller in a session of its own.

    Args:
        config: the worker's configuration (listen or dial).
        services: name -> object (or :class:`Service`), or a per-session scope factory.
        on_event: receives one ``key=value`` diagnostic line per event (``executor-listening``,
            ``executor-ready``); the CLI prints them.
        drain: seconds :meth:`aclose` (and so leaving ``async with``) drains before it closes
            (module docstring); 0, the default, closes at once. A block left because its
            enclosing scope was cancelled has had its tasks cancelled too: no drain then
            (:func:`serve` drains on cancellation).
        controller_services: not used by the worker itself; see :func:`garcon_link.peer`.
        hooks: per-call hooks (:mod:`garcon_link.rpc.hooks`), run around every handler this worker
            runs (and every call back it makes through :func:`peer`).
    """

    link: WebSocketLink  # always its own link: a worker is never a fleet member

    def __init__(
        self,
        config: LinkConfig,
        services: ServiceMap | ServiceFactory,
        *,
        limits: Limits | None = None,
        on_event: EventSink | None = None,
        drain: float = 0.0,
        hooks: Sequence[CallHook] = (),
    ) -> None:
        if config.role.value != "worker":
            raise ConfigError(
                f"serve() needs a worker configuration, got role {config.role.value!r}"
            )
        super().__init__(config, limits=limits)
        self.config = config
        self._services = services
        self._on_event = on_event or (lambda line: None)
        if not callable(services):
            # Validate the exposure once, up front, so a bad interface fails at start-up.
            registry_from(services)
        self.sessions = 0
        self._observer = CallObserver(hooks, self.limits, config.executor_id)
        self._totals = SessionTotals()
        self._rpcs: list[ExecutorRpc] = []  # one per session being served, oldest first
        assert self._own_link is not None
        own = self._own_link
        # A worker dialing several controllers: one more link per URL, speaking for this same
        # process (its runtime id) and drawing on the same retention budget.
        self._more_links = [
            link_from_config(
                config, self.limits, own.retention, dial=url, runtime_id=own.runtime_id
            )
            for url in config.also_dial
        ]
        for link in self._more_links:
            link.on_session(self._on_session)
        self.worker_scope = WorkerScope(config.executor_id, self._own_link.runtime_id)
        """Shared by every logical session of this worker (worker-scoped services);
        closed when the worker stops."""
        # Keyed calls, for the process lifetime: shared by every session, run in our task group.
        self._keyed = KeyedExecutions(self.limits, self._spawn_keyed)
        self.drain = drain
        self._draining = False
        self._closed = False

    def _spawn_keyed(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, *args)

    def idempotency_statistics(self) -> IdempotencyStatistics:
        """A snapshot of this worker's table of idempotency keys."""
        return self._keyed.statistics()

    def statistics(self) -> ExecutorStatistics:
        """A snapshot of this worker's calls, sessions and link (:class:`ExecutorStatistics`)."""
        return self._totals.snapshot(
            self.config.executor_id, self._observer, self.link.statistics(), self.current_rpc
        )

    def controllers(self) -> dict[str, RpcStatistics]:
        """The calls of each controller this worker serves now, by controller: its
        ``controller_id`` or its runtime id in hex (oldest session first) for a listening worker,
        the URL it dials for a dialing one."""
        by_transport = {id(rpc.transport): rpc for rpc in self._rpcs}
        assert self._own_link is not None
        named = self._own_link.controllers()
        if self.config.dial is not None:
            named = {
                link.url: transport
                for link in (self._own_link, *self._more_links)
                if (transport := link.transport) is not None
            }
        return {
            label: rpc.statistics()
            for label, transport in named.items()
            if (rpc := by_transport.get(id(transport))) is not None
        }

    async def __aenter__(self) -> Worker:
        await self._start()
        entered: list[WebSocketLink] = []
        try:
            for link in self._more_links:
                await link.__aenter__()
                entered.append(link)
        except BaseException:
            await self._close_more_links(entered)
            await self._stop()
            raise
        if self.config.listen is not None:
            self._on_event(
                f"executor-listening url={self.link.url} executor={self.config.executor_id}"
            )
        else:
            for link in (self.link, *self._more_links):
                self._on_event(
                    f"executor-dialing url={link.url} executor={self.config.executor_id}"
                )
        return self

    @staticmethod
    async def _close_more_links(links: Sequence[WebSocketLink]) -> None:
        # Each entered a task group in this task: exit them in reverse, outside any cancel scope
        # opened since (the link shields its own close).
        for link in reversed(links):
            await link.__aexit__(None, None, None)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self, *, drain: float | None = None) -> None:
        """Stop serving and close the link (1001). Idempotent. Like
        :meth:`RemoteExecutor.aclose`, call it from the task that entered the worker, not inside
        a cancel scope opened since.

        Args:
            drain: seconds to drain first (module docstring; default: the ``drain`` given to
                the constructor). Shielded from cancellation, bounded by these seconds.
        """
        if self._closed:
            return
        seconds = self.drain if drain is None else drain
        try:
            if seconds > 0 and not self._draining:
                with anyio.CancelScope(shield=True):
                    await self._drain(seconds)
        finally:
            if not self._closed:
                self._closed = True
                try:
                    await self._close_more_links(self._more_links)
                    await self._stop()
                finally:
                    # After the sessions: worker-scoped objects (e.g. the process service)
                    # outlive them.
                    with anyio.CancelScope(shield=True):
                        await self.worker_scope.aclose()

    async def _drain(self, seconds: float) -> None:
        self._draining = True
        rpcs = list(self._rpcs)
        if not rpcs:
            return
        for rpc in rpcs:
            rpc.start_drain()
        log.info(
            "executor %s: draining %d running call(s) for up to %.1fs",
            self.config.executor_id,
            sum(rpc.statistics().incoming_calls for rpc in rpcs),
            seconds,
            extra=log_fields(executor=self.config.executor_id),
        )
        deadline = anyio.current_time() + seconds
        drained = True
        for rpc in rpcs:  # every session drains at once; this waits for each in turn
            remaining = max(0.0, deadline - anyio.current_time())
            drained = await rpc.drained(remaining) and drained
        if not drained:
            log.warning(
                "executor %s: drain time (%.1fs) is up with %d call(s) still running; closing "
                "(their callers see OutcomeUnknown)",
                self.config.executor_id,
                seconds,
                sum(rpc.statistics().incoming_calls for rpc in rpcs),
                extra=log_fields(executor=self.config.executor_id),
            )

    @property
    def url(self) -> str:
        return self.link.url

    @property
    def taken_over(self) -> str | None:
        """Why this worker stopped for good: another process with its executor id took over
        its session (at any of the controllers it dials), else None. :meth:`wait_stopped`
        returns once it is set."""
        links = [self._own_link, *self._more_links] if self._own_link is not None else []
        return next((link.taken_over for link in links if link.taken_over is not None), None)

    async def wait_stopped(self) -> None:
        """Return once the worker gave up for good (see :attr:`taken_over`)."""
        assert self._own_link is not None
        async with anyio.create_task_group() as tg:

            async def wait(link: WebSocketLink) -> None:
                await link.stopped.wait()
                tg.cancel_scope.cancel()

            for link in (self._own_link, *self._more_links):
                tg.start_soon(wait, link)

    @property
    def current_rpc(self) -> ExecutorRpc | None:
        """The RPC of the newest session being served (for its ``statistics()``), if any;
        :meth:`controllers` has every controller's."""
        return self._rpcs[-1] if self._rpcs else None

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        scope = self.worker_scope.session_scope(os.urandom(16))
        assert self._tg is not None
        if not callable(self._services):
            registry = registry_from(self._services, self.worker_scope)
            rpc = self._make_rpc(transport, registry, scope)
            self._tg.start_soon(self._run_session, transport, rpc, scope)
        else:
            # A scope factory is async: queue payloads until it is built (the transport buffers).
            self._tg.start_soon(self._build_scope_and_run, transport, scope)

    def _make_rpc(
        self, transport: SessionTransport, registry: Registry, scope: ServiceScope
    ) -> ExecutorRpc:
        manifest = registry.manifest()
        contract = contract_hash(manifest)

        def describe() -> dict[str, Any]:
            return {
                "executor_id": self.config.executor_id,
                "instance_id": scope.instance_id,
                "worker_instance_id": self.worker_scope.instance_id,
                "services": manifest,
                "contract": contract,
            }

        rpc = ExecutorRpc(
            transport,
            registry,
            self.limits,
            scope=scope,
            describe=describe,
            peer="controller",
            idempotency=self._keyed,
            observer=self._observer,
        )
        if self._draining:
            rpc.start_drain()  # a session that begins during the drain admits no call either
        return rpc

    async def _build_scope_and_run(self, transport: SessionTransport, scope: ServiceScope) -> None:
        factory = cast("ServiceFactory", self._services)
        stack = contextlib.AsyncExitStack()
        try:
            services = await stack.enter_async_context(factory(scope))
            registry = registry_from(services, self.worker_scope)
        except Exception as exc:
            log.exception(
                "service scope factory failed; retiring the session",
                extra=log_fields(executor=self.config.executor_id, session=transport.session_id),
            )
            transport.retire(FailureReason.CLOSED, f"service scope failed: {exc}")
            transport.payloads().close()  # no ExecutorRpc will ever consume this session
            await stack.aclose()
            return
        rpc = self._make_rpc(transport, registry, scope)
        try:
            await self._run_session(transport, rpc, scope)
        finally:
            # Exit the scope in the task that entered it (factories may hold task groups or
            # cancel scopes across their yield); this task is per session, so the new session
            # is never blocked by it.
            await self._close_scope(stack, scope)

    async def _run_session(
        self,
        transport: SessionTransport,
        rpc: ExecutorRpc,
        scope: ServiceScope,
    ) -> None:
        self.sessions += 1
        self._totals.sessions += 1

        def announce(state: TransportState) -> None:
            if state is TransportState.READY and not announced:
                announced.append(True)
                self._on_event(
                    f"executor-ready executor={self.config.executor_id} "
                    f"session={transport.session_id.hex()} instance={scope.instance_id.hex()} "
                    "resumed=false"
                )

        announced: list[bool] = []
        unsubscribe = transport.add_listener(announce)
        announce(transport.state)
        self._rpcs.append(rpc)
        try:
            await rpc.run()
        finally:
            unsubscribe()
            self._totals.ended(transport)
            self._rpcs.remove(rpc)

    async def _close_scope(self, stack: contextlib.AsyncExitStack, scope: ServiceScope) -> None:
        with anyio.move_on_after(self.limits.scope_cleanup_timeout, shield=True) as cleanup:
            try:
                await stack.aclose()
            except Exception:
                log.exception(
                    "closing service scope %s failed",
                    scope.instance_id.hex()[:8],
                    extra=log_fields(executor=scope.executor_id),
                )
        if cleanup.cancelled_caught:
            log.warning(
                "service scope %s did not close within %.1fs",
                scope.instance_id.hex()[:8],
                self.limits.scope_cleanup_timeout,
                extra=log_fields(executor=scope.executor_id),
            )


async def serve(
    config: LinkConfig,
    services: ServiceMap | ServiceFactory,
    *,
    limits: Limits | None = None,
    on_event: EventSink | None = None,
    drain: float = 0.0,
    hooks: Sequence[CallHook] = (),
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a worker until cancelled. With ``await tg.start(serve, ...)`` returns the link URL.

    With ``drain`` > 0, cancellation drains first (up to ``drain`` seconds, shielded): new calls
    are refused with ``NotDispatched("DRAINING")`` while running ones finish (see
    :meth:`Worker.aclose`). (An ``async with Worker(..., drain=...)`` block drains when it is
    left normally; when its enclosing scope is cancelled, the worker's tasks are cancelled with
    it, so there is nothing left to drain: use ``serve`` for that.)
    """
    worker = Worker(config, services, limits=limits, on_event=on_event, drain=drain, hooks=hooks)
    if drain <= 0:
        async with worker:
            task_status.started(worker.url)
            await anyio.sleep_forever()
        return
    # The cancellation that stops serve() would cancel the worker's own tasks too (its task
    # group is entered here), and a drain needs them: the worker runs shielded in a task of its
    # own, told to drain and close when this one is cancelled.
    stop = anyio.Event()

    async def run(*, task_status: anyio.abc.TaskStatus[str]) -> None:
        with anyio.CancelScope(shield=True):
            async with worker:
                task_status.started(worker.url)
                await stop.wait()

    async with anyio.create_task_group() as tg:
        task_status.started(await tg.start(run))
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()
