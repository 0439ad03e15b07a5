"""Exceptions and call outcomes of garcon_link.

Every exception the library raises on purpose derives from :class:`GarconLinkError`. Exceptions of
the libraries below us (wsproto, h11, cbor2, msgspec, OS errors) never cross the public API: each
layer maps them at its boundary with ``raise ... from``, so the original stays on ``__cause__``.

The tree, split by who is at fault and what a caller can do about it::

    GarconLinkError
    ├── ConfigError                     bad configuration: fix the file or the arguments
    ├── PayloadTooLarge                 one send refused before an ordinal was assigned
    ├── RetentionFull                   sans-IO "would block": wait for receipts, then retry
    ├── CallError(outcome, code, message)          what happened to one remote call
    │   ├── NotDispatched               definitely not executed: safe to retry
    │   ├── Rejected                    reached the peer, refused unexecuted
    │   │   └── StaleResource           a resource reference from a retired session
    │   ├── OutcomeUnknown              may have executed: never retried for you
    │   └── RemoteError                 executed and raised (remote_type, remote_traceback, details)
    └── LinkError                       the link or its logical session
        ├── Unreachable                 a dial found nothing: connection refused, name unknown
        │   └── WrongScheme             TLS asked, plain text answered (wss:// at ws://), or back
        ├── ProtocolError               the peer broke the wire protocol
        │   └── MalformedFrame          a frame that does not decode (not CBOR, bad shape, ...)
        │       └── FrameTooLarge       a frame over the configured limit (close code 1009)
        ├── HandshakeError(reason)      the handshake was refused; ``reason`` says why
        │   └── AuthenticationError     a proof did not verify (wrong secret, reflected proof)
        └── SessionFailed(reason)       the logical session is terminally retired; sticky

``SessionFailed`` is the stored cause of a broken :class:`~garcon_link.core.session.MessageSession`:
after it, every later operation on that session raises the same object again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

__all__ = [
    "AuthenticationError",
    "CallError",
    "ConfigError",
    "FailureReason",
    "FrameTooLarge",
    "GarconLinkError",
    "HandshakeError",
    "HandshakeFailure",
    "LinkError",
    "MalformedFrame",
    "NotDispatched",
    "Outcome",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "ProtocolError",
    "Rejected",
    "RemoteError",
    "RetentionFull",
    "SessionFailed",
    "StaleResource",
    "Unreachable",
    "WrongScheme",
]


class Outcome(enum.Enum):
    """What is known about whether a remote call executed.

    ``NOT_DISPATCHED``
        Definitely not executed: the executor was offline, overloaded or disposed, the payload was
        too large, the call was cancelled before dispatch, or its request was never written to any
        socket before continuity was lost. Retrying is safe.
    ``REJECTED``
        The request reached the peer and was refused without executing (unknown service or method,
        invalid arguments, stale resource). Retrying the same request fails the same way.
    ``UNKNOWN``
        The call may have executed: continuity was lost after the request was written, it timed
        out, or it was cancelled after dispatch. Only the caller can decide whether to retry.
    ``FAILED``
        The call executed and raised (or, code ``INVALID_RESULT``, ran to completion and returned
        a value its interface does not allow). A reply the caller cannot read is never
        ``FAILED``: it says nothing about execution, so it is ``UNKNOWN``.
    """

    NOT_DISPATCHED = "not_dispatched"
    REJECTED = "rejected"
    UNKNOWN = "unknown"
    FAILED = "failed"


class GarconLinkError(Exception):
    """Root of every exception garcon_link raises on purpose."""


class ConfigError(GarconLinkError):
    """The configuration is invalid; the message names the file, the field and the fix."""


class PayloadTooLarge(GarconLinkError):
    """A single send was refused because its encoded frame exceeds the frame limit.

    Raised before an ordinal is assigned: the session is unaffected and later sends proceed.
    """

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return f"encoded frame of {self.size} bytes exceeds the frame limit of {self.limit} bytes"


class RetentionFull(GarconLinkError):
    """Sans-IO back-pressure signal: retention is at its frame or byte bound.

    Not a failure. The async layer waits until receipts free capacity and sends again.
    """


class CallError(GarconLinkError):
    """A remote call did not return a result.

    Attributes:
        outcome: what is known about execution (see :class:`Outcome`).
        code: a stable machine-readable code, e.g. ``"OFFLINE"``, ``"TIMEOUT"``.
        message: a human-readable explanation.
    """

    outcome: Outcome = Outcome.UNKNOWN

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        text = f"[{self.outcome.value}:{self.code}]"
        return f"{text} {self.message}" if self.message else text


class NotDispatched(CallError):
    """The call definitely did not execute; it is safe to retry."""

    outcome = Outcome.NOT_DISPATCHED


class Rejected(CallError):
    """The peer refused the call without executing it."""

    outcome = Outcome.REJECTED


class StaleResource(Rejected):
    """A resource reference belongs to a logical session that has been replaced."""

    def __init__(self, code: str = "STALE_RESOURCE", message: str = "") -> None:
        super().__init__(code, message)


class OutcomeUnknown(CallError):
    """The call may or may not have executed. It is never retried automatically."""

    outcome = Outcome.UNKNOWN


class RemoteError(CallError):
    """The remote handler executed and raised (or returned a result that does not match the
    interface: code ``INVALID_RESULT``, ``remote_type`` ``None``).

    Attributes:
        remote_type: qualified name of the remote exception type (``"builtins.ValueError"``).
        remote_traceback: the remote traceback as text, or ``None`` if the peer sent none.
        details: extra structured details sent by the peer.
        remote_args: the remote exception's ``args`` as values (decoded wire data: a tuple
            arrives as a list), or ``None`` if the peer sent none.
        remote_args_note: why the peer did not send them (they do not encode, or are too
            large), or ``None``.
    """

    outcome = Outcome.FAILED

    def __init__(
        self,
        code: str,
        message: str = "",
        *,
        remote_type: str | None = None,
        remote_traceback: str | None = None,
        details: Mapping[str, Any] | None = None,
        remote_args: tuple[Any, ...] | None = None,
        remote_args_note: str | None = None,
    ) -> None:
        super().__init__(code, message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.details: Mapping[str, Any] = dict(details or {})
        self.remote_args = remote_args
        self.remote_args_note = remote_args_note

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (remote {self.remote_type})" if self.remote_type else base


class LinkError(GarconLinkError):
    """The link, its socket or its logical session failed."""


class Unreachable(LinkError):
    """A dial found nothing at its address: the TCP connection was refused (nothing listens
    there) or the host name did not resolve. Redialing helps only if the other end is starting
    (or the name is being published); the message names the address."""


class WrongScheme(Unreachable):
    """A dial found the other scheme at its address: a ``wss://`` dial answered in plain text,
    or a ``ws://`` dial answered with TLS. A redial meets the same server, so it is counted as
    a dial that found nothing; the message names the URL, what came back and the fix."""


class ProtocolError(LinkError):
    """The peer violated the wire protocol."""


class MalformedFrame(ProtocolError):
    """Bytes from the peer that do not decode as the expected frame.

    Every decoder in :mod:`garcon_link.core.wire` raises this (or :class:`FrameTooLarge`) and
    nothing else for bad input, whatever the bytes are.
    """


class FrameTooLarge(MalformedFrame):
    """A frame exceeds the configured size limit; detected before it is decoded."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return f"frame of {self.size} bytes exceeds the limit of {self.limit} bytes"


class _CodedReason(enum.Enum):
    """Base of the reason enums: each member is ``(description, close code sent to the peer)``."""

    def __init__(self, description: str, close_code: int) -> None:
        self.description = description
        self.close_code = close_code


_R = TypeVar("_R", bound=_CodedReason)


class _ReasonedError(LinkError, Generic[_R]):
    """A link error that carries a coded ``reason`` and a free-text ``detail``."""

    def __init__(self, reason: _R, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    @property
    def close_code(self) -> int:
        return self.reason.close_code


class HandshakeFailure(_CodedReason):
    """Why a handshake was refused, with the WebSocket close code each reason uses."""

    MALFORMED = ("malformed handshake frame", 4008)
    UNEXPECTED = ("handshake frame out of order", 4008)
    OVERSIZE = ("handshake frame over size limit", 1009)
    VERSION_MISMATCH = ("protocol version mismatch", 4002)
    ROLE_CONFLICT = ("both peers claim the same role", 4003)
    EXECUTOR_MISMATCH = ("executor id mismatch", 4003)
    AUTH_FAILED = ("proof did not verify", 4001)
    TIMEOUT = ("handshake deadline expired", 4008)
    SUPERSEDED = ("another peer holds a healthy session", 4004)
    RESUME_REFUSED = ("resume position refused", 4005)
    TAKEN_OVER = ("another process took over this executor id", 4009)
    REGISTRY_FULL = ("the controller serves its maximum number of executors", 1013)
    CONTROLLERS_FULL = ("the worker serves its maximum number of controllers", 1013)
    DRAINING = ("the worker is draining (stopping): it admits no new session", 4010)


class HandshakeError(_ReasonedError[HandshakeFailure]):
    """The handshake was refused. ``reason`` is a :class:`HandshakeFailure`."""

    def __str__(self) -> str:
        text = self.reason.description
        return f"{text}: {self.detail}" if self.detail else text


class AuthenticationError(HandshakeError):
    """The peer's proof did not verify: wrong secret, reflected proof or tampered transcript."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(HandshakeFailure.AUTH_FAILED, detail)


class FailureReason(_CodedReason):
    """Why a logical session was retired, with the close code sent to the peer (if any)."""

    GAP = ("inbound ordinal skipped ahead", 4008)
    RECEIPT_BEYOND_OFFERED = ("receipt acknowledges frames never written", 4008)
    MALFORMED_PACKET = ("malformed session packet", 4008)
    RESUME_REFUSED = ("peer's resume position is outside what can be replayed", 4005)
    GRACE_EXPIRED = ("detached longer than the grace period", 4005)
    REPLAY_STALLED = ("replay made no progress within its deadline", 4006)
    INBOUND_OVERFLOW = ("pre-readiness inbound buffer overflowed", 4008)
    REPLACED = ("replaced by a fresh logical session", 4005)
    PEER_RETIRED = ("the peer retired the session", 4005)
    REFUSED = ("refused after the handshake (describe failed or its manifest was refused)", 4005)
    CLOSED = ("closed locally", 1001)
    REVOKED = ("the executor's key was revoked", 4001)
    TAKEN_OVER = ("another process took over this executor id", 4009)
    EVICTED = ("detached, and its place given to another controller (max_controllers)", 4005)


class SessionFailed(_ReasonedError[FailureReason]):
    """The logical session is retired for good. Stored and re-raised by every later operation."""

    @property
    def cause(self) -> str:
        """Why, without the ``session retired:`` prefix (for messages that already say so)."""
        text = self.reason.description
        return f"{text} ({self.detail})" if self.detail else text

    def __str__(self) -> str:
        return f"session retired: {self.cause}"
