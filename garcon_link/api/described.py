"""What workers describe, held once per distinct value however many executors described it.

A controller of many executors running the same code receives the same services manifest and
the same type descriptions from each of them. Each executor keeps what its session described
(:class:`ExecutorInfo`), but the decoded values are *interned*: an
executor holds the one :class:`Described` (and the one type descriptions map) of its manifest,
shared with every other executor, of this controller or of another in the process (a fleet's
members, a gateway's fleet), that described the same bytes. What is derived from a manifest --
each service's contract version, the facades' contract comparisons
(:func:`~garcon_link.api.facades.contract_refusals`), :meth:`RemoteExecutor.offers
<garcon_link.RemoteExecutor.offers>`, the changes logged when a manifest replaces another -- is
computed once per distinct manifest (or pair of them), not per executor.

The key is the BLAKE3 hash of the canonical CBOR of what was received, computed here, never the
hash the worker states (``contract``): a worker cannot make its manifest stand for another's.

Bounded: the tables hold weak references. An entry lives while some executor's description (or
one being installed) refers to it, so a table has at most one entry per executor with a
session, however many distinct manifests a worker announces (each replaces its executor's
previous one, which leaves the table when nothing else holds it). What a :class:`Described`
caches grows with the (service, interface) pairs this process's code compares it with.

Interned values are shared: read them, never change them.

Besides the tables, this module reads what a worker's ``describe`` answered into the
executor's :class:`ExecutorInfo` (:func:`executor_info`: every field checked as sent, never
converted), and compares two manifests (:func:`contract_changes`): what a controller logs when
a manifest replaces another.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import blake3

from ..core.wire import encode_canonical
from ..limits import Limits
from ..logs import peer_text
from ..rpc.contract import Compatibility, compare_method, service_version
from ..rpc.manifest import method_entries
from ..rpc.typedoc import checked_type_descriptions

__all__ = [
    "CHANGES_COMPARED",
    "Described",
    "ExecutorInfo",
    "contract_changes",
    "described",
    "executor_info",
    "interned_counts",
    "manifest_bytes",
    "manifest_problem",
    "shared_types",
]


class Described:
    """One distinct services manifest and what is derived from it, shared by every executor
    that described it."""

    __slots__ = ("__weakref__", "changes_from", "contract", "refusals", "services", "versions")

    def __init__(self, services: dict[str, Any], contract: str) -> None:
        self.services: Mapping[str, Any] = services
        self.contract = contract
        """The BLAKE3 hex digest of the manifest's canonical CBOR, as computed here."""
        self.versions: Mapping[str, str] = {
            name: service_version(methods) for name, methods in sorted(services.items())
        }
        self.refusals: dict[tuple[str, type], Any] = {}
        """(service, interface) -> the methods of the interface's view the manifest refuses
        (:func:`~garcon_link.api.facades.contract_refusals`), for facades and
        :meth:`RemoteExecutor.offers <garcon_link.RemoteExecutor.offers>`."""
        self.changes_from: dict[str, tuple[list[tuple[str, Compatibility, str]], int]] = {}
        """An earlier manifest's contract -> what changed from it to this one, as a controller
        logs it (the last few: :func:`contract_changes`)."""


class _Types(dict[str, Any]):
    """A type descriptions map (a ``dict`` subclass, so that a table can refer to it weakly)."""


_lock = threading.Lock()  # sync clients run their loops in threads of their own
_manifests: weakref.WeakValueDictionary[str, Described] = weakref.WeakValueDictionary()
_types: weakref.WeakValueDictionary[str, _Types] = weakref.WeakValueDictionary()


def manifest_bytes(services: object, limit: int) -> bytes:
    """The canonical CBOR of a worker's services manifest (what :func:`described` interns): a
    map of service name to a map of method name to entry, at most ``limit`` bytes.

    Raises:
        ValueError: why it is refused
            (:func:`manifest_problem` says the same).
    """
    if not isinstance(services, Mapping):
        raise ValueError("the manifest is not a map")
    for name, methods in services.items():
        if not isinstance(name, str) or not isinstance(methods, Mapping):
            raise ValueError(f"service {peer_text(name)} is not a name and a map of methods")
        if not all(isinstance(method, str) for method in methods):
            raise ValueError(f"service {peer_text(name)} has a method name that is not text")
    try:
        encoded = encode_canonical(dict(services))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the manifest does not encode: {peer_text(exc)}") from None
    if len(encoded) > limit:
        raise ValueError(f"the manifest is {len(encoded)} bytes, over max_manifest_bytes ({limit})")
    return encoded


def described(services: dict[str, Any], encoded: bytes) -> Described:
    """The one :class:`Described` of a manifest: ``services``, decoded from the worker's message,
    and ``encoded``, its canonical CBOR (:func:`manifest_bytes`). ``services`` itself is dropped
    when an equal manifest is held already."""
    contract = blake3.blake3(encoded).hexdigest()
    with _lock:
        held = _manifests.get(contract)
        if held is None:
            held = _manifests[contract] = Described(services, contract)
        return held


def shared_types(types: dict[str, Any]) -> Mapping[str, Any]:
    """The one map equal to ``types``, checked type descriptions
    (:func:`~garcon_link.rpc.typedoc.checked_type_descriptions`); ``{}`` as is."""
    if not types:
        return types
    try:
        key = blake3.blake3(encode_canonical(types)).hexdigest()
    except (TypeError, ValueError):  # a value the peer sent that does not encode again: its own
        return types
    with _lock:
        held = _types.get(key)
        if held is None:
            held = _types[key] = _Types(types)
        return held


def interned_counts() -> tuple[int, int]:
    """(distinct manifests, distinct type descriptions) held now in this process."""
    with _lock:
        return len(_manifests), len(_types)


# ---------------------------------------------------------------------- the describe answer


@dataclass(frozen=True, slots=True)
class ExecutorInfo:
    """What the worker described for the current session."""

    executor_id: str
    instance_id: bytes
    session_id: bytes
    services: Mapping[str, Any]
    """The services manifest; one copy shared by every executor that described the same one
    (:func:`described`): read it, never change it."""
    contract: str
    """The BLAKE3 hash of the manifest's canonical CBOR, as this controller computed it.
    Through a gateway, the manifest is the granted services' only, so the hash equals the
    executor's own only when every service is granted."""
    worker_instance_id: bytes | None = None
    """The worker's runtime id, which worker-scoped references carry (``None``: an older
    worker that does not say)."""
    versions: Mapping[str, str] = field(default_factory=dict)
    """Each service's contract version (:func:`~garcon_link.rpc.contract.service_version`):
    it changes when a method of the service is added, removed or changes its signature."""

    types: Mapping[str, Any] = field(default_factory=dict)
    """Service name -> the description of the types its methods use (fields, defaults, a JSON
    Schema; :mod:`garcon_link.rpc.typedoc`), as far as it is within the bounds. Documentation,
    not contract: empty from a worker that sends none."""

    state_id: bytes | None = None
    """The id of the worker's state directory (``None``: it keeps none, or does not say)."""


def executor_info(answer: Any, session_id: bytes, limits: Limits) -> tuple[ExecutorInfo, Described]:
    """What a worker's ``describe`` ``answer`` says of it on the session ``session_id``, and its
    manifest's one :class:`Described` (interned by the hash of what was received: the worker's
    own ``"contract"`` is not trusted for it).

    Every field is checked as sent, never converted: the manifest (:func:`manifest_bytes`,
    at most ``limits.max_manifest_bytes``), the executor id, the ids of 1 to 64 bytes; the type
    descriptions are checked and bounded but never refuse the answer (:func:`_with_types`).

    Raises:
        KeyError, TypeError, ValueError: the answer is refused; the message says why.
    """
    encoded = manifest_bytes(answer["services"], limits.max_manifest_bytes)
    shared = described(dict(answer["services"]), encoded)
    info = ExecutorInfo(
        executor_id=_described_id(answer["executor_id"]),
        instance_id=_required_bytes(answer["instance_id"], "instance_id"),
        session_id=session_id,
        services=shared.services,
        contract=shared.contract,
        worker_instance_id=_optional_bytes(answer.get("worker_instance_id")),
        versions=shared.versions,
        state_id=_optional_bytes(answer.get("state_id"), "state_id"),
    )
    return _with_types(info, answer.get("types"), limits), shared


def _with_types(info: ExecutorInfo, received: Any, limits: Limits) -> ExecutorInfo:
    """``info`` with the type descriptions the worker sent, checked (never refuses a session:
    they are documentation; one over the bounds is replaced by a note), the one copy of them
    (:func:`shared_types`)."""
    return dataclasses.replace(
        info, types=shared_types(checked_type_descriptions(received, info.services, limits))
    )


def _optional_bytes(value: object, name: str = "worker_instance_id") -> bytes | None:
    if value is None:
        return None
    if not isinstance(value, bytes) or len(value) > 64:
        raise TypeError(f"{name} is not bytes of 64 or fewer")
    return value


def _required_bytes(value: object, name: str) -> bytes:
    """An id a worker's ``describe`` must give as 1 to 64 bytes: anything else is refused as
    sent, never converted (``bytes(2**40)`` would allocate a terabyte)."""
    if not isinstance(value, bytes) or not 0 < len(value) <= 64:
        raise TypeError(f"{name} is not bytes of 1 to 64")
    return value


def _described_id(value: object) -> str:
    """The executor id a worker's ``describe`` gives: text of 1 to 200 characters, as a
    configuration's ``executor_id`` is (never converted: ``str`` of a huge integer raises, of a
    map is a text as large as the frame)."""
    if not isinstance(value, str) or not 0 < len(value) <= 200:
        raise TypeError("executor_id is not text of 1 to 200 characters")
    return value


# ---------------------------------------------------------------------- two manifests compared

CHANGES_COMPARED = 64
"""The most differing manifest entries :func:`contract_changes` compares (the rest are counted)."""


def manifest_problem(services: object, limit: int) -> str | None:
    """Why a worker's services manifest is refused (``None``: it is not): not a map of service
    name to a map of method name to entry, or over ``limit`` bytes of canonical CBOR."""
    try:
        manifest_bytes(services, limit)
    except ValueError as exc:
        return str(exc)
    return None


def _differing(
    before: Mapping[str, Any], after: Mapping[str, Any]
) -> Iterator[tuple[str, Any, Any]]:
    """``("service.method", old entry, new entry)`` for each entry that differs (``None``:
    absent), without parsing anything; both are well-formed manifests (:func:`manifest_problem`)."""
    for service in sorted(set(before) | set(after)):
        old, new = before.get(service, {}), after.get(service, {})
        if old == new:
            continue
        old, new = method_entries(old), method_entries(new)  # each with its record types
        for method in sorted(set(old) | set(new)):
            if old.get(method) != new.get(method):
                yield f"{service}.{method}", old.get(method), new.get(method)


_PAIRS_KEPT = 8
"""The most earlier manifests a manifest keeps its changes from (:func:`contract_changes`)."""


def contract_changes(
    before: Described, after: Described
) -> tuple[list[tuple[str, Compatibility, str]], int]:
    """The entries of ``after`` that are not compatible with ``before``'s (name, verdict,
    difference), and how many differing entries were not compared.

    Only entries that differ are compared, and at most ``CHANGES_COMPARED`` of them: a
    worker's manifest is the peer's, so the parsing it costs here stays bounded however many
    methods changed (the rest are counted). Computed once per pair of distinct manifests (an
    upgrade of many executors to the same code changes each from the same one): ``after``
    keeps the last :data:`_PAIRS_KEPT`."""
    known = after.changes_from.get(before.contract)
    if known is not None:
        return known
    differing = list(_differing(before.services, after.services))
    compared = [
        (name, *compare_method(old, new)) for name, old, new in differing[:CHANGES_COMPARED]
    ]
    known = (
        [c for c in compared if c[1] is not Compatibility.COMPATIBLE],
        len(differing) - min(len(differing), CHANGES_COMPARED),
    )
    if len(after.changes_from) >= _PAIRS_KEPT:
        after.changes_from.pop(next(iter(after.changes_from)), None)
    after.changes_from[before.contract] = known
    return known
