"""Error replies: the body a side sends for a call that failed or was refused, and the strict
reading of one by the caller (an unreadable body is ``UNKNOWN``, never ``FAILED``).

Also the allow-list of remote exception types re-raised locally as themselves
(:func:`register_exception`, undone by :func:`unregister_exception`). A handler's exception is
sent with its ``args`` encoded as values (``args``, at most :data:`MAX_ERROR_ARGS_BYTES` of CBOR;
or ``args_note`` saying why they were not sent), so an allow-listed type is re-raised with its
original arguments: ``KeyError("k")`` arrives as ``KeyError("k")``, not as ``KeyError("'k'")``.
"""

from __future__ import annotations

import traceback
from typing import Any

import cbor2

from ..errors import (
    CallError,
    NotDispatched,
    Outcome,
    OutcomeUnknown,
    Rejected,
    RemoteError,
    StaleResource,
)
from .envelopes import Envelope, Error, encode
from .towire import to_wire

__all__ = [
    "INTERRUPTED",
    "MAX_ERROR_ARGS_BYTES",
    "MAX_ERROR_MESSAGE",
    "MAX_REFUSAL_MESSAGE",
    "NOT_STARTED",
    "TYPE_ERROR",
    "encode_request",
    "error_body",
    "error_envelope",
    "error_from_body",
    "handler_error",
    "local_exception",
    "qualname",
    "register_exception",
    "unregister_exception",
]

# The ``cancel`` field of an error body that answers a cancel (cancel receipts, rpc.py).
NOT_STARTED, INTERRUPTED = "not_started", "cancelled"

MAX_REFUSAL_MESSAGE = 512
"""Characters of a refusal's message that are sent (it may quote peer-supplied names)."""
MAX_ERROR_MESSAGE = 16000
"""Characters of a handler's error message (and, separately, of its traceback) that are sent."""
MAX_ERROR_ARGS_BYTES = 16000
"""Bytes of a handler exception's encoded ``args`` that are sent; larger ones are not sent (the
caller then re-creates an allow-listed exception from its message, with a note saying why)."""

TYPE_ERROR: dict[str, Any] = {"remote_type": "TypeError"}

_registered_exceptions: dict[str, type[BaseException]] = {}


def register_exception(cls: type[BaseException]) -> type[BaseException]:
    """Allow ``cls`` raised by a remote handler to be re-raised locally as itself.

    Only registered classes are reconstructed (by qualified name, never by import), with the
    remote exception's ``args`` (decoded values: a tuple arrives as a list); when the peer could
    not send them, or ``cls`` refuses them, with the remote message as the single argument and a
    note (``add_note``) saying so. Anything else arrives as :class:`RemoteError`. Usable as a
    class decorator; builtin types work too (``register_exception(KeyError)``).
    """
    _registered_exceptions[qualname(cls)] = cls
    return cls


def unregister_exception(cls: type[BaseException]) -> bool:
    """Undo :func:`register_exception`: ``cls`` raised by a remote handler arrives as
    :class:`RemoteError` again.

    Returns:
        Whether ``cls`` was registered; ``False`` changes nothing (also when another class of
        the same qualified name is registered: that one stays).
    """
    name = qualname(cls)
    if _registered_exceptions.get(name) is not cls:
        return False
    del _registered_exceptions[name]
    return True


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def error_body(outcome: Outcome, code: str, message: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"outcome": outcome.value, "code": code, "message": message}
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def _malformed_error(why: str) -> OutcomeUnknown:
    return OutcomeUnknown("MALFORMED_ERROR", f"the peer's error reply is unreadable: {why}")


_OPTIONAL_ERROR_FIELDS: dict[str, type] = {
    "message": str,
    "remote_type": str,
    "traceback": str,
    "details": dict,
    "cancel": str,  # a cancel receipt (module docstring)
    "args": list,
    "args_note": str,
}


def error_from_body(body: Any) -> CallError:
    """The caller's exception for a received error body ``{outcome, code, message, ...}``.

    Strict: a body that is not a map, lacks a text ``code``, names no known outcome, or holds a
    known field of the wrong type is *unreadable*, and an unreadable error says nothing about
    whether the handler ran: :class:`OutcomeUnknown` (``MALFORMED_ERROR``), never
    :class:`RemoteError`. Unknown extra keys are ignored (room for later fields). Peer values are
    type-checked before any is converted to text, so no value can make this raise.
    """
    if not isinstance(body, dict):
        return _malformed_error(f"a {type(body).__name__}, not a map")
    code = body.get("code")
    if type(code) is not str:
        return _malformed_error("no text 'code'")
    for key, kind in _OPTIONAL_ERROR_FIELDS.items():
        if key in body and type(body[key]) is not kind:
            return _malformed_error(f"{key!r} is not a {kind.__name__}")
    message: str = body.get("message", "")
    remote_type: str | None = body.get("remote_type")
    outcome = body.get("outcome")
    if outcome == Outcome.NOT_DISPATCHED.value:
        return NotDispatched(code, message)
    if outcome == Outcome.REJECTED.value:
        stale = code == "STALE_RESOURCE" or remote_type == qualname(StaleResource)
        return StaleResource(code, message) if stale else Rejected(code, message)
    if outcome == Outcome.FAILED.value:
        return RemoteError(
            code,
            message,
            remote_type=remote_type,
            remote_traceback=body.get("traceback"),
            details=body.get("details"),
            remote_args=tuple(body["args"]) if "args" in body else None,
            remote_args_note=body.get("args_note"),
        )
    if outcome == Outcome.UNKNOWN.value:
        return OutcomeUnknown(code, message)
    return _malformed_error("no known 'outcome'")


def local_exception(error: CallError) -> BaseException:
    """Re-create an allow-listed remote exception, else return ``error`` itself."""
    if isinstance(error, RemoteError) and error.remote_type in _registered_exceptions:
        cls = _registered_exceptions[error.remote_type]
        note = error.remote_args_note
        exc: BaseException | None = None
        if error.remote_args is not None:
            try:
                exc = cls(*error.remote_args)
            except Exception as refused:
                note = f"{qualname(cls)} refused the remote arguments ({type(refused).__name__})"
        if exc is None:
            try:
                exc = cls(error.message)
            except Exception:
                return error
            if note is not None:
                exc.add_note(f"garcon_link: its message stands in for its arguments: {note}")
        exc.__cause__ = error
        return exc
    return error


def handler_error(exc: Exception) -> tuple[CallError, dict[str, Any]]:
    """What a caller is told about a handler that raised ``exc``, and the error body's extras.

    A handler may refuse (``Rejected``, e.g. ``scope.check`` -> ``StaleResource``, whatever its
    code); a failure of a call it made itself already says FAILED. Both keep their code; the
    type tells the caller which ``Rejected`` to raise. Anything else -- including
    NotDispatched/OutcomeUnknown from a call the handler made -- is a failure of *this* call,
    which did execute: never report it as not-dispatched (safe to retry) or unknown.
    """
    if isinstance(exc, Rejected | RemoteError):
        remote_type = exc.remote_type if isinstance(exc, RemoteError) else None
        return exc, {"remote_type": remote_type or qualname(type(exc))}
    tb = "".join(traceback.format_exception(exc))
    return RemoteError("HANDLER_FAILED", str(exc)), {
        "remote_type": qualname(type(exc)),
        "traceback": tb[-MAX_ERROR_MESSAGE:],
        **_exception_args(exc),
    }


def _exception_args(exc: BaseException) -> dict[str, Any]:
    """``{"args": [...]}``: ``exc.args`` as values, if they encode within
    :data:`MAX_ERROR_ARGS_BYTES`; else ``{"args_note": why}``."""
    try:
        args = to_wire(list(exc.args))
        size = len(cbor2.dumps(args))
    except Exception as refused:  # a value msgspec or CBOR cannot encode; a cycle, ...
        return {"args_note": f"its arguments do not encode ({type(refused).__name__})"}
    if size > MAX_ERROR_ARGS_BYTES:
        return {"args_note": f"its arguments encode to {size} bytes, over {MAX_ERROR_ARGS_BYTES}"}
    return {"args": args}


def encode_request(envelope: Envelope) -> bytes:
    """``envelope`` encoded; one that does not encode is ``NotDispatched("INVALID_ARGUMENTS")``:
    nothing was written."""
    try:
        return encode(envelope)
    except (cbor2.CBOREncodeError, TypeError, ValueError) as exc:
        raise NotDispatched("INVALID_ARGUMENTS", f"cannot encode the request: {exc}") from exc


def error_envelope(
    call_id: int, error: CallError, *, limit: int = MAX_ERROR_MESSAGE, **extra: Any
) -> bytes:
    """The ``error`` envelope telling the caller of ``call_id`` about ``error``, its message cut
    to ``limit`` characters."""
    message = error.message
    if len(message) > limit:
        message = message[:limit] + "... (cut)"
    return encode_request(Error(call_id, error_body(error.outcome, error.code, message, **extra)))
