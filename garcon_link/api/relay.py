"""A gateway's caller: the :class:`~garcon_link.Fleet` surface over one session to a gateway.

Theory of operation (docs/guides/gateway.md; the gateway's side is
:mod:`garcon_link.api.gateway`)
---------------------------------------------------------------------------------------------
A caller (``role = "caller"``, :class:`~garcon_link.settings.callers.CallerConfig`) dials its
gateway as a controller dials a worker: one logical session, authenticated with the caller's own
key, whose "worker" serves one service, :data:`RELAY_SERVICE`, of interface
:class:`GatewayRelay`. :func:`connect_gateway` returns a :class:`GatewayFleet`, whose
:meth:`~GatewayFleet.executor` handles (:class:`GatewayExecutor`) give the typed and dynamic
facades of :class:`~garcon_link.RemoteExecutor`. A facade call of executor ``X`` is checked and
encoded here, against the caller's interface, exactly as a direct call is; the encoded ``[args,
kwargs]`` travel as one byte string in the relay call ``call(X, service, method, payload, key,
timeout)``. The gateway checks the caller's grant, frames the bytes without decoding them and
forwards them to ``X``'s session; it answers with an *outcome* (:func:`encode_outcome`): the
executor's result, or the error that ended the call on either hop, with its outcome and code.
So the caller raises what a direct call would have raised, and the relay call itself fails
only when the caller-gateway hop fails -- then with that hop's honest outcome
(``NotDispatched`` if the request never left, ``OutcomeUnknown`` if it may have been forwarded).

The relay call's own deadline is the call's ``timeout`` plus ``cancel_grace``: the gateway's
verdict on the forwarded call (a ``TIMEOUT`` with its cancel receipt) arrives before the
caller's own timer would cut the first hop.

Executors a caller may not see (no grant names both) are absent from :meth:`~GatewayFleet.
executors`; their calls are refused ``Rejected("FORBIDDEN")`` by the gateway, never forwarded.

What a caller learns of one executor comes from the relay's ``describe``: its availability,
the manifest of its granted services and their type descriptions (the gateway sends no other
service's). The caller interns the manifest, computes its contract hash itself (as a controller
does a worker's: the executor's own hash covers services the caller may not see, and the gateway
does not send it) and checks the type descriptions as a controller checks a worker's
(:func:`~garcon_link.rpc.typedoc.checked_type_descriptions`): :meth:`GatewayExecutor.info`.
A manifest a controller would not install (malformed, or over ``max_manifest_bytes``) is not
kept: the executor's calls are refused ``NotDispatched("OFFLINE")`` saying why, as a
controller's are while it refuses a worker's session; the contract versions the gateway lists
are kept up to the same size. So a caller keeps a bounded amount of each executor it is shown,
whatever a gateway sends.
An older gateway's answer has no ``types`` (none, then); an older caller does not look them up.

The caller's view of the fleet is pushed: once its session is ready the caller opens the relay
stream ``watch()``, one per session. The gateway sends the snapshot of the executors the caller
may see (in messages of at most :data:`MAX_WATCH_ENTRIES` entries, the first and last marked),
then, as the gateway's fleet publishes each event of such an executor, an entry with that
executor's state now and its events (``joined``, ``ready``, ``draining``, ``reconnecting``,
``offline``, ``disposed``, ``forgotten``), in the order they happened. :meth:`GatewayFleet.
executors` is that view and :meth:`GatewayFleet.events` those events, so both are current within
one message of a change. The watch is a relayed stream with credit: while the caller does not
take its messages, the gateway keeps one pending entry per executor (the latest state wins) with
its last :data:`MAX_WATCH_EVENTS` events, and counts the older ones, which the caller's
followers get as a ``lost`` event naming the executor. Replacing the gateway's grants
re-filters every watch at once (``joined`` for an executor now seen, ``forgotten`` for one no
longer seen); a revoked caller's session, and its watch, end. A gateway without ``watch`` (an
older one: its manifest lacks it, or it refuses the method) is polled instead: a snapshot every
``refresh_interval`` seconds (``Limits.gateway_refresh_interval`` unless given), the events
being the changes between two snapshots. What a gateway sends is a peer's word: an entry naming
no executor is ignored, events that are not known kinds are derived from the state, a message
that does not read ends the watch (a new one begins with a snapshot); each is said in a
rate-limited WARNING, and an exception no check foresaw is logged at ERROR with its traceback,
never the end of the fleet.

Streams are relayed with credit end to end: the gateway pulls an item from the executor only
when the caller's credit lets it send one, so a slow caller slows the executor's producer and the
gateway holds at most one window of items per stream. Each item is an encoded outcome too, and a
stream that fails on either hop ends with an error item carrying its outcome and code.
One-way methods are relayed as notifications (no reply, no outcome).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast, get_args, overload

import anyio
import anyio.abc
import cbor2

from ..core.wire import decode_item, encode_head
from ..endpoint.transport import SessionTransport
from ..errors import (
    CallError,
    HandshakeError,
    MalformedFrame,
    NotDispatched,
    Outcome,
    OutcomeUnknown,
    Rejected,
    RemoteError,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_message, peer_text
from ..rpc.envelopes import byte_string_at
from ..rpc.errorbody import MAX_ERROR_MESSAGE, error_body, error_from_body, local_exception
from ..rpc.hooks import CallHook
from ..rpc.interface import MethodKind, MethodSpec, from_wire, oneway, service_spec, to_wire
from ..rpc.rpc import CallObserver, ExecutorRpc, RemoteStream
from ..rpc.typedoc import checked_type_descriptions
from ..settings.callers import CallerConfig
from ..settings.keyring import executor_id_problem
from .controller import Availability, ExecutorInfo, RemoteExecutor
from .described import Described, described, manifest_bytes, shared_types
from .facades import NO_METHODS, DynamicFacade, Facade, FacadeStream
from .fleet import EventKind, ExecutorSnapshot, FleetEvent, Where, _EventFeed
from .registration import interface_class

__all__ = [
    "RELAY_SERVICE",
    "GatewayExecutor",
    "GatewayFleet",
    "GatewayRelay",
    "connect_gateway",
    "decode_outcome",
    "encode_outcome",
]

T = TypeVar("T")

log = logging.getLogger("garcon_link.gateway")  # the name users configure (README)

RELAY_SERVICE = "gateway"
"""The service a gateway serves its callers."""
MAX_DESCRIBE_WAIT = 30.0
"""Seconds the gateway waits, at most, for an executor to be ready in one ``describe``."""
MAX_WATCH_ENTRIES = 256
"""Executors one ``watch`` message names at most: a longer snapshot or backlog takes several."""
MAX_WATCH_EVENTS = 8
"""Events one ``watch`` entry carries at most for its executor: while a caller is behind, the
gateway keeps that many per executor, drops the oldest beyond and says how many (``lost``)."""
MAX_VIEW = 1_000_000
"""Executors a caller keeps, at most, of what its gateway shows it (a fleet's largest
``max_executors``): an entry for one more is ignored."""
WATCH_RETRY = 1.0
"""Seconds, at most, a caller waits before opening its watch again after one ended."""
_OK, _FAILED = 1, 2


class GatewayRelay(Protocol):
    """The gateway's service to its callers (module docstring); not for applications."""

    async def call(
        self,
        executor: str,
        service: str,
        method: str,
        payload: bytes,
        key: bytes | None,
        timeout: float | None,
    ) -> bytes:
        """Forward one unary call; the outcome, encoded (:func:`encode_outcome`)."""
        ...

    def stream(
        self, executor: str, service: str, method: str, payload: bytes
    ) -> AsyncIterator[bytes]:
        """Forward one stream; each item an encoded outcome (:func:`encode_outcome`): the
        executor's items, then, if the stream failed, its error."""
        ...

    @oneway
    async def notify(self, executor: str, service: str, method: str, payload: bytes) -> None:
        """Forward one notification (dropped, and counted, if no grant allows it)."""
        ...

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        """``executor``'s availability, manifest and type descriptions (of its granted services
        only), after waiting up to ``wait`` seconds for it to be ready."""
        ...

    async def executors(self) -> list[dict[str, Any]]:
        """A snapshot of every executor the caller may see."""
        ...

    def watch(self) -> AsyncIterator[dict[str, Any]]:
        """The executors the caller may see, pushed: a snapshot (one or more messages marked
        ``snapshot``, the last also ``last``), then each change as it happens (module
        docstring). One watch per caller session."""
        ...


_RELAY_SPEC = service_spec(GatewayRelay)
_NO_WATCH = frozenset({"UNKNOWN_SERVICE", "OPERATION_UNSUPPORTED", "UNSUPPORTED"})
"""The refusals of a gateway without ``watch``: its callers poll it instead."""
_WATCH_KINDS = frozenset(get_args(EventKind)) - {"lost"}
_MALFORMED = frozenset({"MALFORMED_REPLY", "INVALID_RESULT"})
"""The codes of a gateway's answer that does not read as the relay interface says."""
RELAY_CALL: MethodSpec = _RELAY_SPEC.methods["call"]
RELAY_STREAM: MethodSpec = _RELAY_SPEC.methods["stream"]
RELAY_NOTIFY: MethodSpec = _RELAY_SPEC.methods["notify"]


def encode_outcome(value: Any = None, error: CallError | None = None) -> bytes:
    """A relayed call's outcome: ``[1, value]`` (``value`` is decoded CBOR data, as received)
    or ``[2, error body]`` (the body an error envelope carries)."""
    if error is None:
        return b"\x82\x01" + cbor2.dumps(value)
    message = error.message
    if len(message) > MAX_ERROR_MESSAGE:
        message = message[:MAX_ERROR_MESSAGE] + "... (cut)"
    extra: dict[str, Any] = {}
    if isinstance(error, RemoteError):
        extra = {
            "remote_type": error.remote_type,
            "traceback": error.remote_traceback,
            "details": error.details,
            "args": list(error.remote_args) if error.remote_args is not None else None,
            "args_note": error.remote_args_note,
        }
    return cbor2.dumps([_FAILED, error_body(error.outcome, error.code, message, **extra)])


def decode_outcome(data: bytes, max_bytes: int) -> tuple[Any, CallError | None]:
    """``(value, None)`` or ``(None, error)`` from :func:`encode_outcome`'s bytes. Bytes that
    do not read are ``OutcomeUnknown("MALFORMED_REPLY")``: they say nothing about execution."""
    try:
        item = decode_item(data, max_bytes)
    except MalformedFrame as exc:
        return None, OutcomeUnknown(
            "MALFORMED_REPLY", f"the gateway's outcome is unreadable: {exc}"
        )
    if type(item) is list and len(item) == 2 and item[0] in (_OK, _FAILED):
        if item[0] == _OK:
            return item[1], None
        return None, error_from_body(item[1])
    return None, OutcomeUnknown("MALFORMED_REPLY", "the gateway's outcome has the wrong shape")


class _RelaySession:
    """One executor's calls through the current gateway session: what a facade calls through
    (:class:`~garcon_link.api.keyed.CallSession`)."""

    __slots__ = ("_executor", "_rpc", "peer_state_id", "transport")

    def __init__(self, executor: GatewayExecutor, rpc: ExecutorRpc) -> None:
        self._executor = executor
        self._rpc = rpc
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
            await self._rpc.notify_relayed(
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
        reply = await self._rpc.call_relayed(
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
        inner = self._rpc.stream(
            RELAY_SERVICE, RELAY_STREAM, (executor, service, spec.name, payload), {}, metadata
        )
        return _RelayedItems(inner, spec, self._executor.limits.max_frame_bytes)


def _relay_arguments(*args: str | bytes | float | None) -> bytes:
    """The relay method's ``args`` array and empty ``kwargs`` map, encoded back to back (the
    ``arguments`` of :meth:`~garcon_link.rpc.caller.Caller.call_relayed`). The values are built
    here, of the relay interface's own types, so the per-call binding and checking of a typed
    call has nothing to find: the gateway checks them against :class:`GatewayRelay` as it
    checks any caller's."""
    return cbor2.dumps(list(args)) + b"\xa0"


_NAMES: dict[tuple[str, str, str], bytes] = {}
"""The head of a relay call's ``args`` up to its payload, per executor, service and method."""
_MAX_NAMES = 4096
"""Entries :data:`_NAMES` holds at most: past that it starts over."""


def _call_arguments(
    executor: str,
    service: str,
    method: str,
    payload: bytes,
    key: bytes | None,
    timeout: float | None,
) -> bytes:
    """:func:`_relay_arguments` of a unary call, framed by hand around the values (the same
    bytes: each element of an array is encoded as it would be alone, and the names' part is
    kept per executor and method): on every relayed call's path."""
    names = _NAMES.get((executor, service, method))
    if names is None:
        names = b"\x86" + cbor2.dumps(executor) + cbor2.dumps(service) + cbor2.dumps(method)
        if len(_NAMES) >= _MAX_NAMES:
            _NAMES.clear()
        _NAMES[executor, service, method] = names
    return b"".join(
        (
            names,
            encode_head(2, len(payload)),
            payload,
            b"\xf6" if key is None else cbor2.dumps(key),
            b"\xf6\xa0" if timeout is None else cbor2.dumps(timeout) + b"\xa0",
        )
    )


def _payload(
    service: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> bytes:
    """``[args, kwargs]`` bound, checked and encoded as a direct call's would be (framed by
    hand around them: the bytes of ``cbor2.dumps([args, kwargs])``)."""
    try:
        pos, kw = spec.bind(args, kwargs)
        full = spec.args_with_defaults
        wire = to_wire(pos, with_defaults=full)
        payload = b"".join(
            (
                b"\x82\x81" + cbor2.dumps(wire[0])
                if type(wire) is list and len(wire) == 1
                else b"\x82" + cbor2.dumps(wire),
                cbor2.dumps(to_wire(kw, with_defaults=full)) if kw else b"\xa0",
            )
        )
    except (TypeError, ValueError, cbor2.CBOREncodeError) as exc:
        raise NotDispatched("INVALID_ARGUMENTS", f"{service}.{spec.name}: {exc}") from exc
    try:
        spec.check_arguments(pos, kw)
    except TypeError as exc:
        raise Rejected("INVALID_ARGUMENTS", f"{service}.{spec.name}: {exc}") from exc
    return payload


class _RelayedItems(AsyncIterator[Any]):
    """A relayed stream as its facade iterates it: each outcome item of the gateway's stream
    decoded and converted to the method's item type; an error item raised as its outcome. The
    credit the caller grants the gateway is the inner stream's, granted as items are taken."""

    def __init__(self, inner: RemoteStream, spec: MethodSpec, max_bytes: int) -> None:
        self._inner = inner
        self._spec = spec
        self._max_bytes = max_bytes

    def __aiter__(self) -> _RelayedItems:
        return self

    async def __anext__(self) -> Any:
        item = await self._inner.__anext__()
        if type(item) is not bytes:
            await self._inner.aclose()
            raise OutcomeUnknown("MALFORMED_REPLY", "the gateway sent a stream item of no outcome")
        value, error = decode_outcome(item, self._max_bytes)
        if error is not None:
            await self._inner.aclose()
            raise local_exception(error)
        try:
            return from_wire(value, self._spec.result)
        except Exception as exc:
            await self._inner.aclose()
            raise RemoteError(
                "INVALID_RESULT", f"stream item does not match the interface: {exc}"
            ) from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


def _bounded_versions(versions: Mapping[Any, Any], limit: int) -> dict[str, str]:
    """A gateway's contract versions of an executor's services (name -> 12 hex digits), as far
    as they take at most ``limit`` (``max_manifest_bytes``: each version is smaller than its
    service's manifest entry), each charged its text and 16 bytes; entries that are not text
    to text are skipped. Past the limit none is kept: the gateway's report is not believed."""
    kept: dict[str, str] = {}
    size = 0
    for name, version in versions.items():
        if type(name) is not str or type(version) is not str:
            continue
        size += len(name) + len(version) + 16
        if size > limit:
            return {}
        kept[name] = version
    return kept


def _gateway_draining(gateway: RemoteExecutor) -> str:
    """Why a call through a draining gateway is refused, in one sentence: its session to us
    said goodbye, or it refused our new session (4010)."""
    if gateway._refused_for_drain():
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
    :meth:`GatewayFleet.executor`."""

    def __init__(self, fleet: GatewayFleet, executor_id: str) -> None:
        self.executor_id = executor_id
        self.limits = fleet.limits
        self._fleet = fleet
        self.calls = 0
        """Calls started through this handle's facades."""
        self.errors = 0
        """Of those, how many raised a :class:`~garcon_link.CallError`."""
        self._observer = CallObserver(fleet._hooks, fleet.limits, executor_id)
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
        entry = await self._fleet._relay.describe(self.executor_id, 0.0)
        if not isinstance(entry, dict):
            raise OutcomeUnknown("MALFORMED_REPLY", "the gateway's describe answer is not a map")
        self._apply(entry)
        self._fleet._visible.setdefault(self.executor_id)  # the gateway showed it to us
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
        gateway = self._fleet._gateway
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
                entry = await self._fleet._relay.describe(self.executor_id, wait)
            except CallError as exc:
                if exc.outcome is Outcome.REJECTED:
                    raise
                continue  # the gateway session went away meanwhile: wait for the next one
            self._apply(entry)
            self._fleet._visible.setdefault(self.executor_id)  # the gateway showed it to us
            if self.availability == "ready":
                return
        if gateway._refused_for_drain() or gateway.availability == "draining":
            why = _gateway_draining(gateway)
        else:
            why = f"it is {self.availability}"
        raise TimeoutError(
            f"executor {self.executor_id!r} not ready within {timeout:g}s through the gateway "
            f"({why})"
        )

    async def _rpc_for_call(self, dispatch_deadline: float) -> _RelaySession:
        gateway = self._fleet._gateway
        rpc = gateway._rpc
        if rpc is not None and gateway._availability == "ready" and not gateway._draining:
            # What the gateway's own _rpc_for_call returns at once, without its coroutine.
            session = self._session
            return session if session is not None and session._rpc is rpc else self._session_on(rpc)
        try:
            return self._session_on(await gateway._rpc_for_call(dispatch_deadline))
        except NotDispatched as exc:
            if exc.code != "DRAINING" or gateway._draining:  # not the gateway's own drain
                raise
            raise NotDispatched("DRAINING", _gateway_draining(gateway)) from None

    @property
    def current_rpc(self) -> _RelaySession | None:
        rpc = self._fleet._gateway.current_rpc
        return self._session_on(rpc) if rpc is not None else None

    def _session_on(self, rpc: ExecutorRpc) -> _RelaySession:
        """One view per gateway session: a keyed retry tells "the same session refused again"
        (and backs off) by identity."""
        session = self._session
        if session is None or session._rpc is not rpc:
            session = self._session = _RelaySession(self, rpc)
        return session


class GatewayFleet:
    """What :func:`connect_gateway` returns: :class:`~garcon_link.Fleet`'s surface over a
    gateway (module docstring). Use ``async with gl.connect_gateway(config) as fleet``.

    Args:
        config: the caller's configuration.
        limits: overrides the config's.
        hooks: per-call hooks told about every call made through the executors' facades.
        refresh_interval: seconds between two snapshots of the executors the caller may see,
            from a gateway without ``watch`` (default: the limits' ``gateway_refresh_interval``).
        events_buffer: events kept per :meth:`events` subscriber.
    """

    def __init__(
        self,
        config: CallerConfig,
        *,
        limits: Limits | None = None,
        hooks: Sequence[CallHook] = (),
        refresh_interval: float | None = None,
        events_buffer: int = 1024,
    ) -> None:
        if not isinstance(config, CallerConfig):
            raise TypeError(f"connect_gateway() needs a CallerConfig, got {type(config).__name__}")
        if refresh_interval is not None and not refresh_interval > 0:
            raise ValueError("refresh_interval must be positive")
        self.config = config
        self.limits = limits or config.limits
        self._hooks = tuple(hooks)
        self._refresh_interval = (
            self.limits.gateway_refresh_interval if refresh_interval is None else refresh_interval
        )
        self._gateway = RemoteExecutor(config.link_config(), limits=self.limits)
        self._relay = self._gateway.service(RELAY_SERVICE, GatewayRelay)
        self._members: dict[str, GatewayExecutor] = {}
        self._visible: dict[str, None] = {}  # in the order the gateway first showed them
        self._events = _EventFeed(events_buffer)
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._watching = False  # a watch is open and its snapshot applied
        # What the gateway makes this caller log: one line per reason per log_interval.
        self._log = PeerLogLimiter(
            log, interval=self.limits.log_interval, max_lines=self.limits.max_log_lines
        )

    @property
    def caller_id(self) -> str:
        return self.config.caller_id

    @property
    def gateway(self) -> RemoteExecutor:
        """The session to the gateway itself (availability, statistics)."""
        return self._gateway

    async def __aenter__(self) -> GatewayFleet:
        await self._gateway.__aenter__()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        tg.start_soon(self._view_loop)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the gateway session (pending calls fail honestly). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._events.close()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
        await self._gateway.aclose()

    # -- members

    def executor(self, executor_id: str) -> GatewayExecutor:
        """The stable handle of ``executor_id`` (through the gateway).

        Raises:
            ValueError: the id cannot name an executor.
            RuntimeError: the fleet is not entered, or closed.
        """
        if self._tg is None or self._closed:
            raise RuntimeError("the gateway fleet is not running: use `async with`")
        member = self._members.get(executor_id)
        if member is None:
            problem = executor_id_problem(executor_id)
            if problem is not None:
                raise ValueError(f"executor id {executor_id!r}: {problem}")
            member = self._members[executor_id] = GatewayExecutor(self, executor_id)
        return member

    def executors(self) -> dict[str, ExecutorSnapshot]:
        """The executors this caller may see, as the gateway last reported them (pushed as they
        change; from a gateway without ``watch``, every ``refresh_interval`` and at
        :meth:`refresh`)."""
        out = {}
        for executor_id in self._visible:
            member = self._members[executor_id]
            out[executor_id] = ExecutorSnapshot(
                executor_id=executor_id,
                availability=member.availability,
                session=None,
                since=member.since,
                calls=member.calls,
                errors=member.errors,
                services=member.versions,
            )
        return out

    async def refresh(self) -> dict[str, ExecutorSnapshot]:
        """Ask the gateway now; returns :meth:`executors`. While the gateway's ``watch`` is
        open, the view it keeps is the answer (the gateway is not asked): a snapshot applied
        beside the watch would publish again the changes the watch delivers."""
        if self._watching:
            return self.executors()
        entries = await self._relay.executors()
        if not self._watching:  # else the watch's snapshot came first, and is newer
            self._replace_view(entries if isinstance(entries, list) else [])
        return self.executors()

    def _replace_view(self, entries: Iterable[Any]) -> None:
        """A whole snapshot: apply each entry, and forget what it no longer shows."""
        fresh: set[str] = set()
        for entry in entries:
            executor_id = self._take(entry, None)
            if executor_id is not None:
                fresh.add(executor_id)
        self._forget_all_but(fresh)

    def _forget_all_but(self, fresh: set[str]) -> None:
        for executor_id in [i for i in self._visible if i not in fresh]:
            del self._visible[executor_id]
            self._publish("forgotten", executor_id)

    def _take(self, entry: Any, kinds: Sequence[EventKind] | None) -> str | None:
        """Apply one executor's entry; publish ``kinds``, or, without them, what changed since
        the last entry (``joined`` for a new one, then its availability if it moved). The
        executor's id, or None if the entry names none."""
        executor_id = entry.get("executor_id") if isinstance(entry, dict) else None
        if not isinstance(executor_id, str) or executor_id_problem(executor_id) is not None:
            self._skipped(entry)
            return None
        assert isinstance(entry, dict)
        member = self._members.get(executor_id)
        if member is None and len(self._members) >= MAX_VIEW:
            return None
        was_visible = executor_id in self._visible
        before = member.availability if member is not None and was_visible else None
        if member is None:
            member = self._members[executor_id] = GatewayExecutor(self, executor_id)
        member._apply(entry)
        if not was_visible:
            self._visible[executor_id] = None
        if kinds is not None:
            for kind in kinds:
                self._publish(kind, executor_id)
            return executor_id
        if before is None:
            self._publish("joined", executor_id)
            if member.availability != "offline":
                self._publish(member.availability, executor_id)
        elif member.availability != before:
            self._publish(member.availability, executor_id)
        return executor_id

    async def _view_loop(self) -> None:
        """Keep :meth:`executors` current: through the gateway's ``watch`` when it has one,
        else by a snapshot every ``refresh_interval``."""
        polled: object = None  # the gateway session that refused a watch
        while True:
            pause = self._refresh_interval
            try:
                await self._gateway.wait_ready()
                rpc = self._gateway.current_rpc
                if rpc is not polled and self._gateway.offers(RELAY_SERVICE, "watch"):
                    pause = min(pause, WATCH_RETRY)
                    try:
                        await self._follow_watch()
                    except Rejected as exc:
                        if exc.code not in _NO_WATCH:
                            raise
                        polled, pause = rpc, 0  # a gateway older than its caller: poll it
                else:
                    await self.refresh()
            except (CallError, HandshakeError) as exc:
                # The gateway session went away, or refused us (wait_ready says why to whoever
                # waits), or its answer did not read: the next round asks again (a new watch
                # begins with a snapshot, which sets the view right).
                if isinstance(exc, CallError) and exc.code in _MALFORMED:
                    self._log.log(
                        "gateway",
                        "malformed answer",
                        "caller %s: the gateway's view of its executors does not read (%s); "
                        "asked again in %.1fs",
                        self.caller_id,
                        peer_message(exc.message),
                        pause,
                        extra=log_fields(caller=self.caller_id),
                    )
            except Exception as exc:
                # An answer no check here foresaw, or a bug of ours: never the end of the fleet
                # (its calls do not depend on the view), and never silent: the line carries the
                # traceback. Asked again as above.
                self._log.log(
                    "gateway",
                    f"view failed: {type(exc).__name__}",
                    "caller %s: keeping the view of the gateway's executors failed (%s: %s); "
                    "asked again in %.1fs",
                    self.caller_id,
                    type(exc).__name__,
                    peer_message(str(exc)),
                    pause,
                    exc_info=exc,
                    extra=log_fields(caller=self.caller_id),
                    level=logging.ERROR,
                )
            await anyio.sleep(pause)

    async def _follow_watch(self) -> None:
        """Apply the gateway's ``watch`` messages until the stream ends (the session went, or
        the gateway drains).

        Raises:
            CallError: the stream failed, or the gateway sent a message that does not read
                (``OutcomeUnknown("MALFORMED_REPLY")``).
        """
        stream = cast("FacadeStream", self._relay.watch())
        fresh: set[str] | None = None
        try:
            async for message in stream:
                entries = message.get("entries") if isinstance(message, dict) else None
                if not isinstance(entries, list) or len(entries) > MAX_WATCH_ENTRIES:
                    raise OutcomeUnknown(
                        "MALFORMED_REPLY",
                        f"the gateway's watch message is not a list of at most "
                        f"{MAX_WATCH_ENTRIES} executors",
                    )
                if message.get("snapshot") is True:
                    fresh = set() if fresh is None else fresh
                    for entry in entries:
                        executor_id = self._take(entry, None)
                        if executor_id is not None:
                            fresh.add(executor_id)
                    if message.get("last") is True:
                        self._forget_all_but(fresh)
                        fresh = None
                        self._watching = True
                    continue
                for entry in entries:
                    self._change(entry)
        finally:
            self._watching = False
            await stream.aclose()

    def _change(self, entry: Any) -> None:
        """One executor's change from the gateway's ``watch``: its state now and its events
        (a malformed entry is skipped)."""
        executor_id = entry.get("executor_id") if isinstance(entry, dict) else None
        if not isinstance(executor_id, str) or executor_id_problem(executor_id) is not None:
            self._skipped(entry)
            return
        assert isinstance(entry, dict)
        kinds = entry.get("events")
        if not (
            isinstance(kinds, list)
            and len(kinds) <= MAX_WATCH_EVENTS
            and all(type(kind) is str and kind in _WATCH_KINDS for kind in kinds)
        ):
            if kinds is not None:
                self._log.log(
                    "gateway",
                    "malformed events",
                    "caller %s: the gateway's watch gave executor %s events that are not a list "
                    "of at most %d known kinds (%s); its events are derived from its state",
                    self.caller_id,
                    peer_text(executor_id),
                    MAX_WATCH_EVENTS,
                    peer_text(kinds),
                    extra=log_fields(caller=self.caller_id, executor=executor_id),
                )
            kinds = None  # derived from the state instead
        lost = entry.get("lost", 0)
        if type(lost) is int and 0 < lost < 2**31:
            self._events.publish("lost", executor_id, lost=lost)
        if entry.get("gone") is True:
            self._visible.pop(executor_id, None)
            for kind in kinds or ["forgotten"]:
                self._publish(kind, executor_id)
            return
        self._take(entry, kinds)

    def _skipped(self, entry: object) -> None:
        """Say (rate-limited) that an entry of the gateway's naming no executor is ignored."""
        executor_id = entry.get("executor_id") if isinstance(entry, dict) else None
        self._log.log(
            "gateway",
            "malformed entry",
            "caller %s: the gateway sent an entry that names no executor (%s); ignored",
            self.caller_id,
            f"executor_id {peer_text(executor_id)}"
            if isinstance(entry, dict)
            else f"not a map: {peer_text(entry)}",
            extra=log_fields(caller=self.caller_id),
        )

    # -- events

    def _publish(self, kind: EventKind, executor_id: str) -> None:
        self._events.publish(kind, executor_id)

    def events(self) -> AsyncIterator[FleetEvent]:
        """Every change of the executors this caller may see, as the gateway pushes it (or,
        from a gateway without ``watch``, between two snapshots: module docstring), bounded as
        :meth:`Fleet.events <garcon_link.Fleet.events>` is."""
        return self._events.follow()

    # -- fan-out

    async def map(
        self,
        fn: Callable[[GatewayExecutor], Awaitable[T]],
        ids: Iterable[str] | None = None,
        *,
        concurrency: int = 64,
        where: Where | None = None,
    ) -> dict[str, T | CallError]:
        """:meth:`Fleet.map <garcon_link.Fleet.map>` through the gateway: ``fn(executor)`` for
        each executor (default: every one this caller may see, but those ``draining``), at most
        ``concurrency`` at once; ``{id: value | CallError}``."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if ids is not None:
            targets = [self.executor(i) for i in ids]
        else:
            targets = [
                self._members[i]
                for i in self._visible
                if self._members[i].availability != "draining"
            ]
        if where is not None:
            if isinstance(where, str):
                service, _, method = where.partition(".")
                targets = [m for m in targets if m.routable and m.offers(service, method or None)]
            else:
                admits = cast("Callable[[Any], bool]", where)
                targets = [m for m in targets if m.routable and admits(m)]
        results: dict[str, T | CallError] = {}
        limiter = anyio.CapacityLimiter(concurrency)

        async def one(member: GatewayExecutor) -> None:
            async with limiter:
                try:
                    results[member.executor_id] = await fn(member)
                except CallError as exc:
                    results[member.executor_id] = exc

        async with anyio.create_task_group() as tg:
            for member in targets:
                tg.start_soon(one, member)
        return {member.executor_id: results[member.executor_id] for member in targets}


def connect_gateway(
    config: CallerConfig,
    *,
    limits: Limits | None = None,
    hooks: Sequence[CallHook] = (),
    refresh_interval: float | None = None,
) -> GatewayFleet:
    """A caller's fleet through a gateway: ``async with gl.connect_gateway(config) as fleet``.

    ``config`` is a :class:`~garcon_link.CallerConfig` (``gl.load_caller_config``). The result
    has :class:`~garcon_link.Fleet`'s surface (``executor(id)`` with typed and dynamic facades,
    ``executors()``, ``events()``, ``map()``), so code written against an in-process fleet runs
    unchanged; see docs/guides/gateway.md for what each outcome means across the two hops.
    """
    return GatewayFleet(config, limits=limits, hooks=hooks, refresh_interval=refresh_interval)
