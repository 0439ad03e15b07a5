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
with ``NotDispatched("DRAINING")`` (``ExecutorRpc.start_drain``) while running handlers finish
and their replies are acknowledged. No new session begins during the drain: the links refuse
every fresh handshake with 4010 (``WebSocketLink.drain``; a new controller, or a controller
process that restarted, learns at once that the worker is draining, and no ``executor-ready``
line is printed for it), while a controller whose socket dropped mid-drain resumes its session
and gets its calls' real outcomes; a dialing link without a session stops dialing. What is
still running when the drain time is up ends as any close ends it: the caller's call fails
``OutcomeUnknown`` (never a result that did not happen). ``serve`` runs until cancelled, so it
runs its worker in a shielded task of its own and drains it when cancelled.

Hot inventory: :meth:`Worker.add_service` and :meth:`Worker.remove_service` change what the
worker serves while it runs. The change applies to every session being served (and to every
later one, on top of ``services`` or what the factory builds); each session's ``describe``
answers its registry as it is now, and each controller is told the new manifest on its running
session by the internal notification ``$link.inventory(sequence, services)``, numbered so that a
controller applies only the newest; several changes made before one is sent go as one.
Calls already running on a removed service finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..endpoint.link import WebSocketLink
from ..endpoint.transport import SessionTransport, TransportState
from ..errors import CallError, ConfigError, FailureReason
from ..limits import Limits
from ..logs import log_fields
from ..rpc.hooks import CallHook
from ..rpc.idempotency import IdempotencyStatistics, KeyedExecutions
from ..rpc.keystore import DurableKeys
from ..rpc.manifest import contract_hash
from ..rpc.registry import Bound
from ..rpc.resources import ServiceScope, WorkerScope
from ..rpc.rpc import CallObserver, ExecutorRpc, Registry, RpcStatistics
from ..rpc.statedir import StateDirectory, StateStatistics, open_state_directory
from ..rpc.typedoc import registry_type_descriptions
from ..settings.config import LinkConfig
from .endpoint import (
    CONTROLLER_ROWS,
    Endpoint,
    ExecutorStatistics,
    SessionTotals,
    link_from_config,
)
from .registration import ServiceFactory, ServiceMap, registry_from
from .systemd import SystemdNotifier

__all__ = ["EventSink", "Worker", "serve"]

log = logging.getLogger("garcon_link.remote")  # the name users configure (README)

EventSink = Callable[[str], None]


def _no_event(line: str) -> None:
    """The event sink of a worker given none."""


class Worker(Endpoint):
    """The worker side: serves ``services`` to each controller in a session of its own.

    Args:
        config: the worker's configuration (listen or dial).
        services: name -> object (or :class:`Service`), or a per-session scope factory.
        limits: overrides ``config.limits``.
        on_event: receives one ``key=value`` diagnostic line per event (``executor-listening``,
            ``executor-ready``); the CLI prints them.
        drain: seconds :meth:`aclose` (and so leaving ``async with``) drains before it closes
            (module docstring); 0, the default, closes at once. A block left because its
            enclosing scope was cancelled has had its tasks cancelled too: no drain then
            (:func:`serve` drains on cancellation).
        hooks: per-call hooks (:mod:`garcon_link.rpc.hooks`), run around every handler this worker
            runs (and every call back it makes through :func:`peer`).
        state_dir: the state directory (default: the config's ``state_dir``; None keeps keyed
            calls in memory only). Opened when the worker starts: its lock is taken, its
            database opened and loaded (:mod:`garcon_link.rpc.statedir`); keyed calls are then
            journaled there and survive a restart of the worker process
            (docs/guides/durability.md). Entering the worker raises ``ConfigError`` (one line)
            when the directory is unusable or another worker holds it.
        systemd: speak systemd's notify protocol when ``NOTIFY_SOCKET`` is set, as
            ``garcon-link worker`` does (:mod:`garcon_link.api.systemd`): ``READY=1`` once
            entered (listening, or dialing), ``STATUS=`` when a session is ready, ``WATCHDOG=1``
            every ``WatchdogSec / 2`` from the worker's event loop, ``STOPPING=1`` when
            :meth:`aclose` begins (before its drain). The variables are read, and removed from
            the environment, when the worker is entered. Without ``NOTIFY_SOCKET``: nothing.
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
        state_dir: str | os.PathLike[str] | None = None,
        systemd: bool = False,
    ) -> None:
        if config.role.value != "worker":
            raise ConfigError(
                f"serve() needs a worker configuration, got role {config.role.value!r}"
            )
        super().__init__(config, limits=limits)
        self.config = config
        self._services = services
        self._on_event = on_event or _no_event
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
        self.state_dir: Path | None = None
        """The state directory, once given (as an absolute path)."""
        chosen = state_dir if state_dir is not None else config.state_dir
        if chosen is not None:
            self.state_dir = Path(os.path.abspath(os.fspath(chosen)))
        self._state: StateDirectory | None = None
        self.drain = drain
        self._draining = False
        self._closed = False
        self._systemd = systemd
        self._notifier: SystemdNotifier | None = None  # once entered, with ``systemd``
        self._said_stopping = False  # STOPPING=1 is sent once
        # Hot inventory (module docstring): services added or removed while running, applied
        # over ``services`` in every session; the RPCs of the sessions being served; the
        # sequence number of the latest announcement; RPCs with an announcement due. The
        # frozensets are replaced when they change (rarely: no set per worker until then).
        self._added: dict[str, Bound] = {}
        self._removed: frozenset[str] = frozenset()
        self._serving: set[ExecutorRpc] = set()
        self._inventory_seq = 0
        self._announcing: frozenset[ExecutorRpc] = frozenset()

    def add_service(self, name: str, service: object) -> None:
        """Serve ``service`` as ``name`` from now on, on every session (replacing a service of
        that name); the controllers learn the new manifest without a new session.

        ``service`` is an object (its class is the interface) or a :class:`Service`, checked as
        at start-up. A worker-scoped ``Service`` runs in the worker scope.

        Raises:
            ConfigError: ``service`` cannot be served as written, or ``name`` is not a valid
                service name (empty, or starting with ``_`` or ``$``).
        """
        if not isinstance(name, str) or not name or name.startswith(("_", "$")):
            raise ConfigError(
                f"invalid service name {name!r}: use a non-empty name that does not start with "
                "'_' or '$'"
            )
        bound = registry_from({name: service}, self.worker_scope).get(name)
        assert bound is not None
        self._added[name] = bound
        self._removed -= {name}
        for rpc in self._serving:
            rpc.registry.add(name, bound.target, bound.spec, scope=bound.scope)
        self._announce()

    def remove_service(self, name: str) -> bool:
        """Stop serving ``name`` on every session; the controllers learn the new manifest
        without a new session. Calls already running finish; new ones are refused
        ``UNKNOWN_SERVICE`` by this worker (a controller's facades refuse them first, with
        ``UNSUPPORTED``, once they know). Returns False if no session served it and it was
        not among the services (nothing changes then)."""
        served = (
            name in self._added
            or (not callable(self._services) and name in self._services)
            or any(rpc.registry.get(name) is not None for rpc in self._serving)
        ) and name not in self._removed
        self._added.pop(name, None)
        for rpc in self._serving:
            rpc.registry.remove(name)
        self._removed |= {name}
        if served:
            self._announce()
        return served

    def _inventory(self, registry: Registry) -> Registry:
        """``registry`` (a new session's) with the services added and removed since start."""
        for name in self._removed:
            registry.remove(name)
        for name, bound in self._added.items():
            registry.add(name, bound.target, bound.spec, scope=bound.scope)
        return registry

    def _announce(self) -> None:
        """Schedule telling each controller served now the new manifest (coalesced: one
        announcement due per session, which sends the manifest as it is when it goes)."""
        if self._tg is None:
            return  # not started: each session's describe will say it
        due = self._serving - self._announcing
        self._announcing |= due
        for rpc in due:
            self._tg.start_soon(self._send_inventory, rpc)

    async def _send_inventory(self, rpc: ExecutorRpc) -> None:
        self._announcing -= {rpc}
        if rpc.retired:
            return
        self._inventory_seq += 1
        try:
            await rpc.announce_inventory(self._inventory_seq, rpc.registry.manifest())
        except CallError as exc:  # the session ended or the manifest does not fit: its next
            log.warning(  # session's describe says it
                "executor %s: could not announce the new manifest: %s",
                self.config.executor_id,
                exc,
                extra=log_fields(executor=self.config.executor_id),
            )

    def _spawn_keyed(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, *args)

    def idempotency_statistics(self) -> IdempotencyStatistics:
        """A snapshot of this worker's table of idempotency keys."""
        return self._keyed.statistics()

    def state_statistics(self) -> StateStatistics | None:
        """A snapshot of the state directory's writer, or None without one."""
        return None if self._state is None else self._state.statistics()

    def statistics(self, *, max_rows: int = CONTROLLER_ROWS) -> ExecutorStatistics:
        """A snapshot of this worker's calls, sessions and links (:class:`ExecutorStatistics`):
        the levels summed over every controller's session, and broken down by controller.

        Args:
            max_rows: at most this many controllers in the breakdown (``controllers``: the
                oldest sessions; the rest counted in ``controllers_omitted``); 0 for none.

        Raises:
            ValueError: ``max_rows`` is negative.
        """
        if max_rows < 0:
            raise ValueError(f"max_rows must be 0 or more, got {max_rows}")
        return self._totals.snapshot(
            self.config.executor_id,
            self._observer,
            self.link.statistics(),
            self.current_rpc,
            live=list(self._rpcs),
            more_links=[link.statistics() for link in self._more_links],
            controllers=self._controller_rpcs(),
            max_rows=max_rows,
        )

    def controllers(self) -> dict[str, RpcStatistics]:
        """The calls of each controller this worker serves now, by controller: its
        ``controller_id`` or its runtime id in hex (oldest session first) for a listening worker,
        the URL it dials for a dialing one. :meth:`statistics` has each one's session figures
        (``controllers``)."""
        return {label: rpc.statistics() for label, rpc in self._controller_rpcs().items()}

    def _controller_rpcs(self) -> dict[str, ExecutorRpc]:
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
            label: rpc
            for label, transport in named.items()
            if (rpc := by_transport.get(id(transport))) is not None
        }

    async def __aenter__(self) -> Worker:
        if self._systemd:
            self._notifier = SystemdNotifier.from_environ()
            self._on_event = self._notifier.follow_events(self._on_event)
        try:
            await self._enter()
        except BaseException:
            self._close_notifier()
            raise
        if self._notifier is not None:
            how = "listening on" if self.config.listen is not None else "dialing"
            self._notifier.ready(
                f"executor {self.config.executor_id}: {how} {self.url}, no session yet"
            )
            assert self._tg is not None
            self._tg.start_soon(self._notifier.beat)  # until _stop cancels the task group
        return self

    def _close_notifier(self) -> None:
        notifier, self._notifier = self._notifier, None
        if notifier is not None:
            notifier.close()

    async def _enter(self) -> None:
        if self.state_dir is not None:
            await self._open_state(self.state_dir)
        try:
            await self._start()
        except BaseException:
            await self._close_state()
            raise
        entered: list[WebSocketLink] = []
        try:
            for link in self._more_links:
                await link.__aenter__()
                entered.append(link)
        except BaseException:
            await self._close_more_links(entered)
            await self._stop()
            await self._close_state()
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

    @staticmethod
    async def _close_more_links(links: Sequence[WebSocketLink]) -> None:
        # Each entered a task group in this task: exit them in reverse, outside any cancel scope
        # opened since (the link shields its own close).
        for link in reversed(links):
            await link.__aexit__(None, None, None)

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _open_state(self, path: Path) -> None:
        """Take the directory's lock, open and load its database (in a thread: all of it
        blocks), and keep keyed calls there from now on."""
        executor_id = self.config.executor_id
        limits = self.limits

        def open_and_load() -> tuple[StateDirectory, DurableKeys]:
            state = open_state_directory(path, executor_id)
            try:
                return state, DurableKeys(state, limits)
            except BaseException:
                state.close_now()
                raise

        state, keys = await anyio.to_thread.run_sync(open_and_load)
        self._state = state
        self.worker_scope.state = state
        state.start()
        self._keyed = KeyedExecutions(self.limits, self._spawn_keyed, store=keys)
        stats = self._keyed.statistics()
        log.info(
            "executor %s: state directory %s: %d keyed call(s) restored, %d of them were "
            "running when the previous worker process stopped (WORKER_RESTARTED)",
            executor_id,
            path,
            stats.restored,
            stats.interrupted,
            extra=log_fields(executor=executor_id),
        )

    async def _close_state(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            with anyio.CancelScope(shield=True):
                await self._keyed.flush()
                await state.aclose()

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
        if not self._draining:
            self._stopping(
                f"executor {self.config.executor_id}: "
                + (f"draining for up to {seconds:g}s" if seconds > 0 else "stopping")
            )
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
                        try:
                            await self.worker_scope.aclose()
                        finally:
                            self._close_notifier()
                            await self._close_state()

    def _stopping(self, status: str) -> None:
        """Tell systemd the worker is stopping (``STOPPING=1``, ``STATUS=status``), once; nothing
        without ``systemd``. :meth:`aclose` says it; ``garcon-link worker`` says it first, with
        the signal that stops it."""
        if self._notifier is not None and not self._said_stopping:
            self._said_stopping = True
            self._notifier.stopping(status)

    async def _drain(self, seconds: float) -> None:
        self._draining = True
        assert self._own_link is not None
        for link in (self._own_link, *self._more_links):
            link.drain()  # no new session: fresh handshakes refused (4010), resumes admitted
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

    def _describe(self, registry: Registry, scope: ServiceScope) -> dict[str, Any]:
        """What a session's ``describe`` answers: its registry as it is now (hot inventory)."""
        manifest = registry.manifest()
        return {
            "executor_id": self.config.executor_id,
            "instance_id": scope.instance_id,
            "worker_instance_id": self.worker_scope.instance_id,
            "services": manifest,
            "contract": contract_hash(manifest),
            # The latest announcement sent before this answer: the controller ignores an
            # announcement not newer (its manifest is in this one already).
            "inventory": self._inventory_seq,
            # documentation, not contract
            "types": registry_type_descriptions(registry, self.limits),
            # With a state directory: its id, so a keyed caller knows a restarted worker
            # process still holds its keys (garcon_link.api.keyed).
            **({"state_id": self._state.state_id} if self._state is not None else {}),
        }

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        scope = self.worker_scope.session_scope(os.urandom(16))
        assert self._tg is not None
        if not callable(self._services):
            registry = self._inventory(registry_from(self._services, self.worker_scope))
            rpc = self._make_rpc(transport, registry, scope)
            self._tg.start_soon(self._run_session, transport, rpc, scope)
        else:
            # A scope factory is async: queue payloads until it is built (the transport buffers).
            self._tg.start_soon(self._build_scope_and_run, transport, scope)

    def _make_rpc(
        self, transport: SessionTransport, registry: Registry, scope: ServiceScope
    ) -> ExecutorRpc:
        rpc = ExecutorRpc(
            transport,
            registry,
            self.limits,
            scope=scope,
            describe=_Describe(self, registry, scope),
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
            registry = self._inventory(registry_from(services, self.worker_scope))
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
        announcer = _Announcer(self, transport, scope)
        announcer.unsubscribe = transport.add_listener(announcer)
        announcer(transport.state)
        self._serving.add(rpc)
        self._rpcs.append(rpc)
        try:
            await rpc.run()
        finally:
            self._serving.discard(rpc)
            announcer.stop()
            self._totals.ended(transport)
            self._rpcs.remove(rpc)

    def _announce_ready(self, transport: SessionTransport, scope: ServiceScope) -> None:
        self._on_event(
            f"executor-ready executor={self.config.executor_id} "
            f"session={transport.session_id.hex()} instance={scope.instance_id.hex()} "
            "resumed=false"
        )

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


class _Describe:
    """A session's ``describe`` callback (:meth:`Worker._describe`), without a closure."""

    __slots__ = ("registry", "scope", "worker")

    def __init__(self, worker: Worker, registry: Registry, scope: ServiceScope) -> None:
        self.worker = worker
        self.registry = registry
        self.scope = scope

    def __call__(self) -> dict[str, Any]:
        return self.worker._describe(self.registry, self.scope)


class _Announcer:
    """A session's state listener until it is first ready, when it writes the
    ``executor-ready`` event and unsubscribes: an idle session keeps only this object, emptied."""

    __slots__ = ("scope", "transport", "unsubscribe", "worker")

    def __init__(self, worker: Worker, transport: SessionTransport, scope: ServiceScope) -> None:
        self.worker: Worker | None = worker
        self.transport = transport
        self.scope: ServiceScope | None = scope
        self.unsubscribe: Callable[[], None] | None = None

    def __call__(self, state: TransportState) -> None:
        worker, scope = self.worker, self.scope
        if state is TransportState.READY and worker is not None and scope is not None:
            self.stop()
            worker._announce_ready(self.transport, scope)

    def stop(self) -> None:
        """No announcement from now on (idempotent)."""
        self.worker = self.scope = None
        unsubscribe, self.unsubscribe = self.unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()


async def serve(
    config: LinkConfig,
    services: ServiceMap | ServiceFactory,
    *,
    limits: Limits | None = None,
    on_event: EventSink | None = None,
    drain: float = 0.0,
    hooks: Sequence[CallHook] = (),
    state_dir: str | os.PathLike[str] | None = None,
    systemd: bool = False,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a worker until cancelled. With ``await tg.start(serve, ...)`` returns the link URL.
    The keyword arguments are :class:`Worker`'s.

    With ``drain`` > 0, cancellation drains first (up to ``drain`` seconds, shielded): new calls
    are refused with ``NotDispatched("DRAINING")`` while running ones finish (see
    :meth:`Worker.aclose`). (An ``async with Worker(..., drain=...)`` block drains when it is
    left normally; when its enclosing scope is cancelled, the worker's tasks are cancelled with
    it, so there is nothing left to drain: use ``serve`` for that.)
    """
    worker = Worker(
        config,
        services,
        limits=limits,
        on_event=on_event,
        drain=drain,
        hooks=hooks,
        state_dir=state_dir,
        systemd=systemd,
    )
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
