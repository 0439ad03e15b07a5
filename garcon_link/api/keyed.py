"""The caller's side of idempotency keys: one keyed unary call, retried across sessions.

The worker's side -- the table of keys and the runner that executes each key once -- is
:mod:`garcon_link.rpc.idempotency`, which says what is guaranteed.

With ``retry_unknown=True`` (:func:`call_with_key`) a call that ends ``OutcomeUnknown`` or
``NotDispatched`` is retried with the same key until its deadline (the call's timeout, measured
from the first attempt), waiting for the executor to be ``ready`` in between (and backing off,
:func:`retry_delays`, when the same session refused again). ``Rejected`` and ``RemoteError`` are
never retried, nor are outcomes that retrying cannot change (``DISPOSED``, ``PAYLOAD_TOO_LARGE``,
``INVALID_ARGUMENTS``, ``CANCELLED_WHILE_RUNNING``). An attempt that ended ``OutcomeUnknown``
binds the call to the worker *runtime* (the process start, ``SessionTransport.peer_runtime``) it
was sent to; if a later session belongs to another runtime, the table that would have recognised
the key died with the old process, so the call is *not* retried: it fails
``OutcomeUnknown("WORKER_RESTARTED")``, saying the guarantee ended with the worker process --
unless both runtimes said (``describe``'s ``state_id``) they keep the same state directory: the
new process then holds the keys (:mod:`garcon_link.rpc.keystore`), and the retry goes on (a call
that was running when the old process died is answered ``WORKER_RESTARTED`` by the worker,
which ends it). Once an attempt may have executed, the call never ends ``NotDispatched``.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Protocol

import anyio

from ..endpoint.transport import SessionTransport
from ..errors import CallError, NotDispatched, OutcomeUnknown
from ..rpc.interface import MethodKind, MethodSpec

__all__ = ["CallSession", "ItemStream", "KeyedCaller", "call_with_key", "retry_delays"]


class ItemStream(Protocol):
    """A stream a facade iterates: a :class:`~garcon_link.rpc.rpc.RemoteStream`, or a gateway
    caller's relayed one."""

    def __aiter__(self) -> ItemStream: ...

    async def __anext__(self) -> Any: ...

    async def aclose(self) -> None: ...


class CallSession(Protocol):
    """What a facade calls through: one session's :class:`~garcon_link.rpc.rpc.ExecutorRpc`,
    or a gateway caller's view of one executor through its gateway session
    (:mod:`garcon_link.api.relay`). ``transport.peer_runtime`` is the runtime a keyed call's
    attempt binds to."""

    @property
    def transport(self) -> SessionTransport: ...

    @property
    def peer_state_id(self) -> bytes | None: ...

    @property
    def call(self) -> Callable[..., Awaitable[Any]]: ...

    @property
    def stream(self) -> Callable[..., ItemStream]: ...


class KeyedCaller(Protocol):
    """What :func:`call_with_key` needs of an executor (a
    :class:`~garcon_link.api.controller.RemoteExecutor`, which calls it)."""

    @property
    def current_rpc(self) -> CallSession | None: ...

    async def wait_ready(self, timeout: float | None = None) -> None: ...

    async def rpc_for_call(self, dispatch_deadline: float) -> CallSession:
        """The session a call goes on now (waiting up to ``dispatch_deadline`` for one)."""
        ...


_FINAL_UNKNOWN = frozenset({"TIMEOUT", "CANCELLED_WHILE_RUNNING", "WORKER_RESTARTED"})
_FINAL_NOT_DISPATCHED = frozenset({"TIMEOUT", "DISPOSED", "PAYLOAD_TOO_LARGE", "INVALID_ARGUMENTS"})


def retry_delays(first: float = 0.05, cap: float = 1.0) -> Iterator[float]:
    """Pauses between two attempts on the *same* session (a refusal such as ``OVERLOADED``):
    ``first``, doubling, capped at ``cap``. A new session is tried at once."""
    delay = first
    while True:
        yield delay
        delay = min(delay * 2, cap)


async def call_with_key(
    executor: KeyedCaller,
    service: str,
    method: MethodSpec,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    key: bytes,
    timeout: float | None,
    dispatch_deadline: float,
    retry_unknown: bool,
    metadata: Mapping[str, str] | None = None,
) -> Any:
    """One keyed unary call through ``executor`` (what a keyed facade method does).

    Raises:
        TypeError: ``method`` is a stream or one-way method (keys apply to unary calls only).
        CallError: per the outcome; with ``retry_unknown`` see the module docstring.
    """
    if method.kind is not MethodKind.UNARY:
        raise TypeError(
            f"{service}.{method.name} is a {method.kind.value} method: idempotency keys apply "
            "to unary calls only"
        )
    if not retry_unknown:
        rpc = await executor.rpc_for_call(dispatch_deadline)
        return await rpc.call(
            service, method, args, kwargs, timeout=timeout, idempotency_key=key, metadata=metadata
        )
    deadline = math.inf if timeout is None else anyio.current_time() + timeout
    delays = retry_delays()
    ran_on: bytes | None = None  # the worker runtime an attempt may have executed on
    ran_on_state: bytes | None = None  # ... and its state directory, if it keeps one
    last: CallError | None = None
    previous: object = None
    attempts = 0
    try:
        while True:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                raise _gave_up(last, timeout, attempts)
            try:
                await executor.wait_ready(None if math.isinf(remaining) else remaining)
            except TimeoutError:
                raise _gave_up(last, timeout, attempts) from None
            current = executor.current_rpc
            if current is None:  # retired between the wake-up and now
                continue
            runtime = current.transport.peer_runtime
            if (
                ran_on is not None
                and runtime != ran_on
                and ran_on_state is not None
                and current.peer_state_id == ran_on_state
            ):
                # Restarted on the same state directory: the new process holds the keys.
                ran_on = runtime
            if ran_on is not None and runtime != ran_on:
                raise OutcomeUnknown(
                    "WORKER_RESTARTED",
                    f"an attempt may have executed on worker process {ran_on.hex()[:12]}, which "
                    f"is gone (now {runtime.hex()[:12]}): the idempotency guarantee ended with "
                    "that worker process (its table of keys went with it), so the call was not "
                    f"retried; last attempt: {last}",
                ) from last
            if current is previous:
                # Refused again by the same session: back off before the next attempt.
                await anyio.sleep(min(next(delays), max(remaining, 0)))
                previous = None
                continue
            previous = current
            attempts += 1
            try:
                return await current.call(
                    service,
                    method,
                    args,
                    kwargs,
                    timeout=remaining,
                    idempotency_key=key,
                    metadata=metadata,
                )
            except OutcomeUnknown as exc:
                if ran_on is None:
                    ran_on, ran_on_state = runtime, current.peer_state_id
                if exc.code in _FINAL_UNKNOWN:
                    raise
                last = exc
            except NotDispatched as exc:
                if exc.code in _FINAL_NOT_DISPATCHED:
                    raise
                last = exc
    except NotDispatched as exc:
        if ran_on is None:
            raise
        # An earlier attempt may have executed: the call as a whole is not "not dispatched".
        raise OutcomeUnknown(
            exc.code, f"{exc.message} (an earlier attempt with this key may have executed)"
        ) from exc


def _gave_up(last: CallError | None, timeout: float | None, attempts: int) -> CallError:
    why = f"; last attempt: {last}" if last is not None else ""
    message = f"no result within {timeout}s ({attempts} attempts with the key){why}"
    if isinstance(last, OutcomeUnknown):
        return OutcomeUnknown("TIMEOUT", message)
    return NotDispatched("TIMEOUT", message)
