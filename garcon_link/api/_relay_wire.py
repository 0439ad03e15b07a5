"""The relay interface and what crosses it: the gateway's service to its callers, the outcome
each relayed call or stream item is answered with, and a call's arguments as the caller encodes
them.

Both sides read this module: the caller (:mod:`.relay`, :mod:`._relay_executor`) encodes the
relay calls and reads their outcomes; the gateway (:mod:`.gateway`, :mod:`._relaying`) serves
:class:`GatewayRelay` and encodes the outcomes.

An **outcome** (:func:`encode_outcome`) is ``[1, value]`` (the executor's result, as decoded
CBOR data) or ``[2, error body]`` (the body an error envelope carries: the error that ended the
call on either hop, with its outcome and code). So the caller raises what a direct call would
have raised, and the relay call itself fails only when the caller-gateway hop fails.

A relayed call's **arguments** are checked and encoded on the caller's side exactly as a direct
call's are (:func:`_payload`: ``[args, kwargs]`` as one byte string), and travel in the relay
call ``call(executor, service, method, payload, key, timeout)``, whose own arguments are framed
by hand (:func:`_call_arguments`: the bytes cbor2 would write, the names' part kept per executor
and method). The gateway frames the payload without decoding it (:mod:`._framing`).

What a caller reads of a gateway is a peer's word: an outcome that does not read is
``OutcomeUnknown("MALFORMED_REPLY")``, a stream item likewise (:class:`_RelayedItems`), and the
contract versions a gateway lists of an executor are kept only up to ``max_manifest_bytes``
(:func:`_bounded_versions`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import cbor2

from ..core.wire import decode_item, encode_head
from ..errors import CallError, MalformedFrame, NotDispatched, OutcomeUnknown, Rejected, RemoteError
from ..rpc.errorbody import MAX_ERROR_MESSAGE, error_body, error_from_body, local_exception
from ..rpc.interface import MethodSpec, from_wire, oneway, service_spec, to_wire
from ..rpc.rpc import RemoteStream

__all__ = [
    "MAX_DESCRIBE_WAIT",
    "MAX_WATCH_ENTRIES",
    "MAX_WATCH_EVENTS",
    "RELAY_CALL",
    "RELAY_NOTIFY",
    "RELAY_SERVICE",
    "RELAY_STREAM",
    "GatewayRelay",
    "decode_outcome",
    "encode_outcome",
]

RELAY_SERVICE = "gateway"
"""The service a gateway serves its callers."""
MAX_DESCRIBE_WAIT = 30.0
"""Seconds the gateway waits, at most, for an executor to be ready in one ``describe``."""
MAX_WATCH_ENTRIES = 256
"""Executors one ``watch`` message names at most: a longer snapshot or backlog takes several."""
MAX_WATCH_EVENTS = 8
"""Events one ``watch`` entry carries at most for its executor: while a caller is behind, the
gateway keeps that many per executor, drops the oldest beyond and says how many (``lost``)."""
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
