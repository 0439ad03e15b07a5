"""Per-call options of a facade, async or sync: :func:`with_options`.

It takes both kinds of facade: the async one (:mod:`.facades`) and the sync one (:mod:`.sync`,
built on the async one), so it lives above both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar, cast

from .facades import UNSET, Facade, Unset
from .sync import SyncFacade

__all__ = ["with_options"]

T = TypeVar("T")


def with_options(
    facade: T,
    *,
    timeout: float | Unset | None = UNSET,
    dispatch_deadline: float | Unset | None = UNSET,
    idempotency_key: str | bytes | Unset | None = UNSET,
    retry_unknown: bool | Unset = UNSET,
    metadata: Mapping[str, str] | Unset | None = UNSET,
) -> T:
    """A copy of ``facade`` with other call options (typed as the same interface).

    ``facade`` comes from :meth:`RemoteExecutor.service` or from a sync client's
    :meth:`~garcon_link.api.sync.SyncExecutor.service`.

    Args:
        timeout: per-call deadline in seconds (``None``: the configured default). With
            ``retry_unknown`` it bounds all attempts together.
        dispatch_deadline: how long a call waits for a reconnecting executor (0: not at all).
        idempotency_key: names one operation (``str``, sent as UTF-8, or ``bytes``; 1 to 128
            bytes): the worker runs a unary call with this key, method and arguments at most
            once while its process lives and the key is remembered (docs/design.md#idempotency,
            :mod:`garcon_link.rpc.idempotency`). ``None`` removes it. Calling a stream or one-way
            method through a keyed facade raises ``TypeError``.
        retry_unknown: retry a keyed call that ends ``OutcomeUnknown`` or ``NotDispatched``
            until its timeout, waiting for readiness in between; only with a key.
        metadata: call metadata sent with every call of the copy (text keys of
            ``[a-z0-9._-]``, text values; read by the handler with
            :func:`garcon_link.call_metadata`); client hooks may add to it. Over
            ``Limits.max_metadata_entries``/``max_metadata_bytes`` a call fails with
            ``NotDispatched("INVALID_METADATA")`` before anything is sent. ``None`` or ``{}``
            removes it.

    Raises:
        TypeError: not a facade, a key that is neither ``str`` nor ``bytes``, or a
            ``retry_unknown`` that is not a bool.
        ValueError: an empty key, a key over 128 bytes, or ``retry_unknown`` without a key.
    """
    if not isinstance(facade, Facade | SyncFacade):
        raise TypeError("with_options() takes a facade returned by RemoteExecutor.service()")
    return cast(
        "T",
        facade.with_options(
            timeout=timeout,
            dispatch_deadline=dispatch_deadline,
            idempotency_key=idempotency_key,
            retry_unknown=retry_unknown,
            metadata=metadata,
        ),
    )
