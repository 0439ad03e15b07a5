"""Per-call hooks (interceptor-style, both sides) and call metadata: the contract.

A *call hook* is any object with the two methods of :class:`CallHook`. It is registered where an
endpoint is made (``gl.connect(..., hooks=[...])``, ``gl.fleet(..., hooks=...)``,
``gl.Worker(..., hooks=...)``, ``gl.serve(..., hooks=...)``) and is then told about every remote
call that endpoint makes or serves:

* **Client side** (the caller of a facade method): :meth:`CallHook.call_started` runs in the
  caller's task *before* the request is encoded, so a hook may add entries to
  :attr:`CallInfo.metadata` (a trace context, a user header) and they are sent with the call.
  :meth:`CallHook.call_ended` runs in the same task once the call's outcome is decided: a reply, a
  raised :class:`~garcon_link.errors.CallError`, or the caller's own cancellation. A stream ends
  when its iterator is exhausted, closed or reclaimed; a notification ends when it is sent.
  A cancelled caller ends with ``cancelled=True``, outcome ``UNKNOWN`` and code ``CANCELLED``
  (the request may have been sent); so does a stream closed or dropped before its end.
* **Server side** (the worker running a handler): both methods run *inside the handler's task*,
  ``call_started`` just before the handler starts and ``call_ended`` just after it returns, raises
  or is cancelled. A context variable set in ``call_started`` is therefore visible to the handler
  and can be reset in ``call_ended`` (this is how the OpenTelemetry adapter makes the worker's span
  the current one). :attr:`CallInfo.metadata` is the metadata the caller sent (read-only).
  ``call_ended`` runs once the handler's reply is handed to the session. A call refused without
  running (unknown method, bad arguments or metadata, overloaded, draining) runs no handler and
  so no hook; it is counted in the endpoint's statistics. A keyed call is observed once per
  execution, not per repeat of its key. The internal ``describe`` call is not observed.

**Refusing a call (an interceptor).** On the server side, ``call_started`` may refuse the call
before its handler runs by raising :class:`~garcon_link.errors.Rejected` with a code of its own
(``raise gl.Rejected("FORBIDDEN", "calc.add is not granted")``): the caller's call raises that
``Rejected`` (code and message as raised), the handler never runs, and the endpoint's statistics
count the call as ``("rejected", code)``. The hooks registered before the refusing one are ended
(``call_ended`` with outcome ``REJECTED`` and the code); the refusing hook and those after it
were never started and are not ended. A stream is refused at its first item; a notification,
which has no reply, is dropped unrun (and counted). The rule for every other exception is *fail
closed*: a server-side ``call_started`` that raises anything else refuses the call
``Rejected("HOOK_FAILED")`` -- its message names only the exception's type; the traceback is
logged on the worker, once per hook -- because a hook may be a gate, and a broken gate must not
let calls through. Either way the session and its other calls are unaffected. For a keyed call
the refusal is the execution's recorded reply (a repeat of the key is answered with it).

Elsewhere a hook that raises is logged (once per hook and method, at WARNING) and otherwise
ignored: a client-side hook, and ``call_ended`` on either side, never change a call's outcome.
Whatever ``call_started`` returns is handed back to ``call_ended`` as ``state``, so a hook keeps
no per-call table of its own. With no hook registered the call path does no hook work at all
(one length check).

*Call metadata* is a small, bounded map of text to text sent with a call (``with_options(
metadata={...})`` on a facade, plus whatever client hooks add). A handler reads it with
:func:`call_metadata`. Bounds (:class:`~garcon_link.limits.Limits`): at most
``max_metadata_entries`` entries; keys are 1-64 characters of ``[a-z0-9._-]``; the encoded map is
at most ``max_metadata_bytes``. A caller exceeding them gets ``NotDispatched("INVALID_METADATA")``
before anything is sent; a peer sending more is refused ``Rejected("INVALID_METADATA")``.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal, Protocol

from ..errors import Outcome

__all__ = [
    "CallEnd",
    "CallHook",
    "CallInfo",
    "CallKind",
    "CallSide",
    "call_metadata",
]

CallSide = Literal["client", "server"]
CallKind = Literal["unary", "stream", "notify"]

_EMPTY: Mapping[str, str] = types.MappingProxyType({})

# Set by the server side around a handler (the RPC layer owns the token); read by call_metadata().
_current_metadata: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "garcon_link_call_metadata", default=_EMPTY
)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """One remote call, as a hook sees it.

    Attributes:
        side: ``"client"`` for the caller, ``"server"`` for the handler's side.
        service: The service name the call addresses.
        method: The method name.
        kind: ``"unary"``, ``"stream"`` or ``"notify"`` (a oneway notification).
        executor: The executor id when known (the controller's view of a fleet member, or the
            worker's own id), else ``None``.
        metadata: Client side: the metadata about to be sent; a hook may add entries (they are
            validated after every hook ran). Server side: what the caller sent (read-only).
    """

    side: CallSide
    service: str
    method: str
    kind: CallKind
    executor: str | None
    metadata: MutableMapping[str, str] | Mapping[str, str]


@dataclass(frozen=True, slots=True)
class CallEnd:
    """How one call ended.

    Attributes:
        outcome: ``None`` when the call succeeded; otherwise the honest
            :class:`~garcon_link.errors.Outcome` of the raised
            :class:`~garcon_link.errors.CallError` (client side), or of what the handler's side
            knows (server side: ``FAILED`` when the handler raised, ``UNKNOWN`` when it was
            cancelled, ``REJECTED`` for invalid arguments).
        code: The outcome's code (``"OVERLOADED"``, ``"HANDLER_FAILED"``, ...), or ``None``.
        duration: Seconds from ``call_started`` to ``call_ended`` (monotonic clock).
        cancelled: ``True`` when the call ended because the caller's (client side) or the
            handler's (server side) task was cancelled.
    """

    outcome: Outcome | None
    code: str | None
    duration: float
    cancelled: bool = False

    @property
    def label(self) -> str:
        """A short label for metrics: ``"ok"``, ``"cancelled"`` or the outcome's value."""
        if self.cancelled:
            return "cancelled"
        return "ok" if self.outcome is None else self.outcome.value


class CallHook(Protocol):
    """What a per-call hook implements (see the module docstring for when each runs)."""

    def call_started(self, call: CallInfo) -> object:
        """A call starts; the return value comes back as ``state`` in :meth:`call_ended`.

        Raises:
            Rejected: server side only (``call.side == "server"``): refuse the call before its
                handler runs, with this code and message (module docstring). Any other
                exception raised on the server side refuses it ``Rejected("HOOK_FAILED")``;
                on the client side, exceptions are logged and ignored.
        """
        ...

    def call_ended(self, call: CallInfo, state: object, end: CallEnd) -> None:
        """The call ended; ``end`` says how."""
        ...


def call_metadata() -> Mapping[str, str]:
    """The metadata the caller sent with the call this handler serves (empty outside one)."""
    return _current_metadata.get()
