"""One executor as a gateway's caller sees it: :class:`GatewayExecutor`, and the calls of its
facades through the current gateway session (:class:`_RelaySession`).

A :class:`GatewayExecutor` has :class:`~garcon_link.RemoteExecutor`'s calling surface: its
facades (:mod:`.facades`) check and encode a call against the caller's interface exactly as a
direct call's, and :class:`_RelaySession` sends it as a relay call on the gateway's session
(:mod:`._relay_wire`). What the executor is (its availability, granted manifest, contract
versions and type descriptions) is what the gateway last showed of it, in a ``watch`` entry, a
snapshot or a ``describe`` answer (:meth:`GatewayExecutor._apply`), each read as a peer's word
and kept bounded (docstring of :mod:`.relay`). Its handles are made and kept by the caller's
view of the fleet (:mod:`._relay_view`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast, overload

import anyio

from ..core.wire import decode_item
from ..endpoint.transport import SessionTransport
from ..errors import (
    CallError,
    MalformedFrame,
    NotDispatched,
    Outcome,
    OutcomeUnknown,
    Rejected,
    RemoteError,
)
from ..limits import Limits
from ..logs import peer_message
from ..rpc.envelopes import byte_string_at
from ..rpc.errorbody import local_exception
from ..rpc.hooks import CallHook
from ..rpc.interface import MethodKind, MethodSpec, from_wire, service_spec
from ..rpc.rpc import CallObserver, ExecutorRpc
from ..rpc.typedoc import checked_type_descriptions
from ._relay_wire import (
    MAX_DESCRIBE_WAIT,
    RELAY_CALL,
    RELAY_NOTIFY,
    RELAY_SERVICE,
    RELAY_STREAM,
    GatewayRelay,
    _bounded_versions,
    _call_arguments,
    _payload,
    _relay_arguments,
    _RelayedItems,
    decode_outcome,
)
from .controller import Availability, ExecutorInfo, RemoteExecutor
from .described import Described, described, manifest_bytes, shared_types
from .facades import NO_METHODS, DynamicFacade, Facade, contract_refusals
from .registration import interface_class

__all__ = ["GatewayExecutor"]

T = TypeVar("T")


class _RelaySession:
    """One executor's calls through the current gateway session: what a facade calls through
    (:class:`~garcon_link.api.keyed.CallSession`)."""

    __slots__ = ("_executor", "peer_state_id", "rpc", "transport")

    def __init__(self, executor: GatewayExecutor, rpc: ExecutorRpc) -> None:
        self._executor = executor
        self.rpc = rpc  # the gateway session this view is of
        self.transport: SessionTransport = rpc.transport
        # A keyed retry binds to the gateway's runtime: the gateway binds its forwards.
        self.peer_state_id: bytes | None = None

    async def call(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        timeout: float | None,
        idempotency_key: bytes | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Any:
        payload = _payload(service, spec, args, kwargs)
        executor = self._executor.executor_id
        if spec.kind is MethodKind.ONEWAY:
            await self.rpc.notify_relayed(
                RELAY_SERVICE,
                RELAY_NOTIFY.name,
                _relay_arguments(executor, service, spec.name, payload),
                metadata,
            )
            return None
        if spec.kind is not MethodKind.UNARY:
            raise Rejected(
                "UNSUPPORTED", f"{service}.{spec.name} is a stream: open it with its facade"
            )
        limits = self._executor.limits
        if timeout is not None:
            timeout = float(timeout)
        reply = await self.rpc.call_relayed(
            RELAY_SERVICE,
            RELAY_CALL.name,
            _call_arguments(executor, service, spec.name, payload, idempotency_key, timeout),
            timeout=None if timeout is None else timeout + limits.cancel_grace,
            metadata=metadata,
        )
        if type(reply) is not bytes:
            raise OutcomeUnknown("MALFORMED_REPLY", "the gateway's reply is not an outcome")
        if reply[:2] == b"\x82\x01" and len(reply) > 2:
            # A value: a byte string taken as it is, else read alone, at the depth it has in
            # the outcome.
            value = byte_string_at(reply, 2)
            if value is None:
                try:
                    value = decode_item(reply[2:], limits.max_frame_bytes, depth=1)
                except MalformedFrame as exc:
                    raise OutcomeUnknown(
                        "MALFORMED_REPLY", f"the gateway's outcome is unreadable: {exc}"
                    ) from None
        else:
            value, error = decode_outcome(reply, limits.max_frame_bytes)
            if error is not None:
                raise local_exception(error)
        try:
            return from_wire(value, spec.result)
        except Exception as exc:
            raise RemoteError(
                "INVALID_RESULT", f"result does not match the interface: {exc}"
            ) from exc

    def stream(
        self,
        service: str,
        spec: MethodSpec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
    ) -> _RelayedItems:
        payload = _payload(service, spec, args, kwargs)
        executor = self._executor.executor_id
        inner = self.rpc.stream(
            RELAY_SERVICE, RELAY_STREAM, (executor, service, spec.name, payload), {}, metadata
        )
        return _RelayedItems(inner, spec, self._executor.limits.max_frame_bytes)


def _gateway_draining(gateway: RemoteExecutor) -> str:
    """Why a call through a draining gateway is refused, in one sentence: its session to us
    said goodbye, or it refused our new session (4010)."""
    if gateway.refused_for_drain():
        return (
            "the gateway is draining: it was told to stop and refuses new caller sessions "
            "(close 4010); ready again once it has restarted"
        )
    return (
        "the gateway is draining: it was told to stop and refuses new calls while those it "
        "relays finish; ready again once it has restarted"
    )


class GatewayExecutor:
    """One executor as a gateway's caller sees it: :class:`~garcon_link.RemoteExecutor`'s
    calling surface (``service()``, ``wait_ready()``, ``info``-like properties), made by
    :meth:`GatewayFleet.executor <garcon_link.api.relay.GatewayFleet.executor>`.

    Made by the caller's view of the fleet (:class:`~garcon_link.api._relay_view.RelayView`),
    which hands each handle what it reads: the session to the gateway and its relay facade,
    the bounds and hooks, and ``shown`` (the view's record that the gateway showed this
    executor: a ``describe`` answer shows it too). A handle holds no reference to the view."""

    def __init__(
        self,
        executor_id: str,
        gateway: RemoteExecutor,
        relay: GatewayRelay,
        limits: Limits,
        hooks: Sequence[CallHook],
        shown: Callable[[str], object],
    ) -> None:
        self.executor_id = executor_id
        self.limits = limits
        self._gateway = gateway
        self._relay = relay
        self._shown = shown
        self.calls = 0
        """Calls started through this handle's facades."""
        self.errors = 0
        """Of those, how many raised a :class:`~garcon_link.CallError`."""
        self._observer = CallObserver(hooks, limits, executor_id)
        self._manifest_version = 0
        self._contract_cache: dict[tuple[str, type], Any] = {}
        self._described: Described | None = None  # what _services and _contract_cache are of
        self._services: Mapping[str, Any] = {}
        self._refused: str | None = None  # why the last manifest shown was not kept
        self._types: Mapping[str, Any] = {}
        self._known = False
        self.availability: Availability = "offline"
        """As the gateway last reported it."""
        self.since = time.time()
        self._versions: Mapping[str, str] = {}
        self._session: _RelaySession | None = None

    def __repr__(self) -> str:
        return f"<GatewayExecutor {self.executor_id} ({self.availability})>"

    @property
    def observer(self) -> CallObserver:
        """The outcome point of every call through this handle's facades (its counters and
        hooks); internal, read by the facades once per facade or stream."""
        return self._observer

    @property
    def manifest_version(self) -> int:
        """How many times the gateway showed this executor's manifest (0: never); the facades
        compare their interface again when it moves."""
        return self._manifest_version

    def refusals(self, service: str, interface: type, view: Mapping[str, Any]) -> Any:
        """What :meth:`RemoteExecutor.refusals <garcon_link.RemoteExecutor.refusals>` says, on
        the manifest the gateway showed (internal: the facades).

        Raises:
            NotDispatched: that manifest is not known, or not one a controller would install.
        """
        key = (service, interface)
        refusals = self._contract_cache.get(key)
        if refusals is None:
            refusals = contract_refusals(service, view, self._manifest())
            self._contract_cache[key] = refusals
        return refusals

    @property
    def gateway(self) -> RemoteExecutor:
        """The session to the gateway itself, shared by every executor of the fleet (the sync
        client reads its ``last_error`` and waits on its dials)."""
        return self._gateway

    # -- what the gateway reports

    def _apply(self, entry: Mapping[str, Any]) -> None:
        availability = entry.get("availability")
        if availability in ("offline", "ready", "draining", "reconnecting", "disposed"):
            if availability != self.availability:
                self.since = time.time()
            self.availability = cast("Availability", availability)
        versions = entry.get("services")
        if isinstance(versions, dict):
            self._versions = _bounded_versions(versions, self.limits.max_manifest_bytes)
        manifest = entry.get("manifest")
        if isinstance(manifest, dict) and (not self._known or manifest != self._services):
            try:  # one copy per distinct manifest, as a controller's executors hold theirs
                encoded = manifest_bytes(manifest, self.limits.max_manifest_bytes)
            except ValueError as exc:
                # Not one a controller would install, so not kept (a gateway's entry may be as
                # large as a frame, for every executor it shows): the executor's calls are
                # refused as a controller's are while its session is refused.
                self._described = None
                self._services = {}
                self._refused = peer_message(str(exc), 200)
                self._contract_cache = {}
            else:
                self._refused = None
                self._described = described(manifest, encoded)
                self._services = self._described.services
                self._contract_cache = self._described.refusals
            self._known = True
            self._manifest_version += 1
        if isinstance(manifest, dict):
            # Checked and bounded as a controller checks a worker's: the gateway is a peer too.
            # Nothing (an older gateway): none.
            self._types = shared_types(
                checked_type_descriptions(entry.get("types"), self._services, self.limits)
            )

    def _manifest(self) -> Mapping[str, Any]:
        if self._refused is not None:
            raise NotDispatched(
                "OFFLINE",
                f"the gateway's manifest of executor {self.executor_id!r} is not one a controller "
                f"would install: {self._refused}",
            )
        if not self._known:
            raise NotDispatched(
                "OFFLINE",
                "the executor's manifest is not known yet: await executor.wait_ready() first",
            )
        return self._services

    def manifest(self) -> Mapping[str, Any]:
        """The executor's granted services and their methods, as the gateway last reported
        them (:meth:`wait_ready` learns them).

        Raises:
            NotDispatched: not learned yet.
        """
        return self._manifest()

    @property
    def versions(self) -> Mapping[str, str]:
        """Each granted service of the executor with its contract version."""
        return dict(self._versions)

    async def info(self) -> ExecutorInfo:
        """What the gateway shows of the executor now (asked at once, without waiting), as
        :meth:`RemoteExecutor.info <garcon_link.RemoteExecutor.info>` gives it: the granted
        services, their contract versions and type descriptions.

        ``contract`` is the hash this caller computes over the granted manifest it received
        (as a controller computes a worker's, never the peer's word): it equals the executor's
        own only when every service of the executor is granted. ``instance_id`` and
        ``session_id`` are empty and ``worker_instance_id`` and ``state_id`` ``None``: a caller
        sees no sessions of the gateway's executors. ``types`` is empty from a gateway that
        relays none (an older one).

        Raises:
            NotDispatched: the executor is not ready at the gateway (``OFFLINE``, ``DRAINING``,
                ``RECONNECTING``, ``DISPOSED``, as a direct executor's), or the gateway session
                is not.
            Rejected: ``FORBIDDEN``: no grant lets this caller see the executor.
            OutcomeUnknown: ``MALFORMED_REPLY``: the gateway's manifest is not one a controller
                would install.
        """
        entry = await self._relay.describe(self.executor_id, 0.0)
        if not isinstance(entry, dict):
            raise OutcomeUnknown("MALFORMED_REPLY", "the gateway's describe answer is not a map")
        self._apply(entry)
        self._shown(self.executor_id)  # the gateway showed it to us
        state = self.availability
        if state != "ready":
            raise NotDispatched(
                state.upper(), f"executor {self.executor_id!r} is {state} at the gateway"
            )
        manifest = entry.get("manifest")
        types: Mapping[str, Any] = {}
        if manifest is None and not entry.get("services"):
            # A ready executor with no (granted) service: the gateway sends no manifest.
            shown = described({}, manifest_bytes({}, 1))
        elif isinstance(manifest, dict) and self._described is not None:
            shown, types = self._described, self._types
        else:
            why = f": {self._refused}" if self._refused is not None else ""
            raise OutcomeUnknown(
                "MALFORMED_REPLY",
                f"the gateway's manifest of executor {self.executor_id!r} is not one a "
                f"controller would install{why}",
            )
        return ExecutorInfo(
            executor_id=self.executor_id,
            instance_id=b"",
            session_id=b"",
            services=shown.services,
            contract=shown.contract,
            versions=shown.versions,
            types=types,
        )

    @property
    def routable(self) -> bool:
        return self.availability == "ready"

    @property
    def pending_calls(self) -> int:
        return 0  # the gateway's count is its own; a caller sees only its calls' outcomes

    def offers(self, service: str, method: str | None = None) -> bool:
        """Whether the executor's granted manifest (as last learned) has ``service``
        (and ``method``)."""
        methods = self._services.get(service) if self._known else None
        if not isinstance(methods, Mapping):
            return False
        return method is None or isinstance(methods.get(method), Mapping)

    # -- facades

    @overload
    def service(self, name: str) -> Any: ...

    @overload
    def service(self, name: str, interface: Callable[..., T]) -> T: ...

    def service(self, name: str, interface: Callable[..., T] | None = None) -> T | Any:
        """A stable facade for service ``name`` of this executor, through the gateway
        (:meth:`RemoteExecutor.service <garcon_link.RemoteExecutor.service>`)."""
        if interface is None:
            return DynamicFacade(self, name, NO_METHODS, None, None)
        return cast("T", Facade(self, name, service_spec(interface_class(interface)), None, None))

    # -- sessions

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until the gateway reports this executor ``ready`` (and learn its manifest).

        Raises:
            TimeoutError: not ready within ``timeout``.
            Rejected: ``FORBIDDEN``: no grant lets this caller see the executor.
            CallError: the gateway session failed meanwhile.
        """
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        gateway = self._gateway
        while True:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                break
            try:
                await gateway.wait_ready(None if math.isinf(remaining) else remaining)
            except TimeoutError:
                break
            wait = min(remaining, MAX_DESCRIBE_WAIT)
            try:
                entry = await self._relay.describe(self.executor_id, wait)
            except CallError as exc:
                if exc.outcome is Outcome.REJECTED:
                    raise
                continue  # the gateway session went away meanwhile: wait for the next one
            self._apply(entry)
            self._shown(self.executor_id)  # the gateway showed it to us
            if self.availability == "ready":
                return
        if gateway.refused_for_drain() or gateway.availability == "draining":
            why = _gateway_draining(gateway)
        else:
            why = f"it is {self.availability}"
        raise TimeoutError(
            f"executor {self.executor_id!r} not ready within {timeout:g}s through the gateway "
            f"({why})"
        )

    async def rpc_for_call(self, dispatch_deadline: float) -> _RelaySession:
        """The gateway session a call of this executor goes on now, as
        :meth:`RemoteExecutor.rpc_for_call <garcon_link.RemoteExecutor.rpc_for_call>` finds it
        (internal: the facades and keyed calls call it for every call)."""
        gateway = self._gateway
        rpc = gateway.ready_rpc()
        if rpc is not None:
            # What the gateway's own rpc_for_call returns at once, without its coroutine.
            session = self._session
            return session if session is not None and session.rpc is rpc else self._session_on(rpc)
        try:
            return self._session_on(await gateway.rpc_for_call(dispatch_deadline))
        except NotDispatched as exc:
            if exc.code != "DRAINING" or gateway.draining:  # not the gateway's own drain
                raise
            raise NotDispatched("DRAINING", _gateway_draining(gateway)) from None

    @property
    def current_rpc(self) -> _RelaySession | None:
        rpc = self._gateway.current_rpc
        return self._session_on(rpc) if rpc is not None else None

    def _session_on(self, rpc: ExecutorRpc) -> _RelaySession:
        """One view per gateway session: a keyed retry tells "the same session refused again"
        (and backs off) by identity."""
        session = self._session
        if session is None or session.rpc is not rpc:
            session = self._session = _RelaySession(self, rpc)
        return session
