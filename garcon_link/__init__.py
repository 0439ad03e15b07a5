"""garcon_link: resumable, authenticated WebSocket RPC to Python service objects in a worker.

See README.md for the guarantees and DESIGN notes in each module's docstring.
"""

from __future__ import annotations

from .errors import (
    AuthenticationError,
    CallError,
    ConfigError,
    GarconLinkError,
    HandshakeError,
    LinkError,
    NotDispatched,
    Outcome,
    OutcomeUnknown,
    PayloadTooLarge,
    ProtocolError,
    Rejected,
    RemoteError,
    SessionFailed,
    StaleResource,
)
from .limits import Limits

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "CallError",
    "ConfigError",
    "GarconLinkError",
    "HandshakeError",
    "Limits",
    "LinkError",
    "NotDispatched",
    "Outcome",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "ProtocolError",
    "Rejected",
    "RemoteError",
    "SessionFailed",
    "StaleResource",
    "__version__",
]
