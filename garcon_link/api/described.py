"""What workers describe, held once per distinct value however many executors described it.

A controller of many executors running the same code receives the same services manifest and
the same type descriptions from each of them. Each executor keeps what its session described
(:class:`~garcon_link.api.controller.ExecutorInfo`), but the decoded values are *interned*: an
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
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

import blake3

from ..core.wire import encode_canonical
from ..logs import peer_text
from ..rpc.contract import Compatibility, service_version

__all__ = ["Described", "described", "interned_counts", "manifest_bytes", "shared_types"]


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
        logs it (the last few: ``garcon_link.api.controller._changes``)."""


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
            (:func:`~garcon_link.api.controller.manifest_problem` says the same).
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
