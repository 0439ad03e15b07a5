"""garcon_link: resumable, authenticated WebSocket RPC to Python service objects in a worker.

The public surface is this module's ``__all__``; see README.md for the guarantees and each
module's docstring for its rules.
"""

from __future__ import annotations

import logging as _logging

from .api.controller import Availability, ExecutorInfo, RemoteExecutor, connect
from .api.facades import peer
from .api.fleet import ExecutorSnapshot, Fleet, FleetEvent, fleet
from .api.options import with_options
from .api.registration import Service
from .api.sync import SyncExecutor, connect_sync
from .api.worker import Worker, serve
from .core.wire import Role
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
from .rpc.hooks import CallEnd, CallHook, CallInfo, call_metadata
from .rpc.interface import oneway
from .rpc.resources import ResourceRef, ServiceScope, WorkerScope, current_scope
from .rpc.rpc import register_exception
from .settings.config import (
    DialExecutor,
    FleetConfig,
    LinkConfig,
    TlsConfig,
    load_config,
    load_fleet_config,
)
from .settings.keyring import Keyring
from .settings.secrets import Secret, generate_secret, write_secret_file
from .version import __version__

# A library leaves logging to the application: without a handler here, Python's last-resort
# handler prints the library's warnings on the stderr of every script that never set logging up.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "AuthenticationError",
    "Availability",
    "CallEnd",
    "CallError",
    "CallHook",
    "CallInfo",
    "ConfigError",
    "DialExecutor",
    "ExecutorInfo",
    "ExecutorSnapshot",
    "Fleet",
    "FleetConfig",
    "FleetEvent",
    "GarconLinkError",
    "HandshakeError",
    "Keyring",
    "Limits",
    "LinkConfig",
    "LinkError",
    "NotDispatched",
    "Outcome",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "ProtocolError",
    "Rejected",
    "RemoteError",
    "RemoteExecutor",
    "ResourceRef",
    "Role",
    "Secret",
    "Service",
    "ServiceScope",
    "SessionFailed",
    "StaleResource",
    "SyncExecutor",
    "TlsConfig",
    "Worker",
    "WorkerScope",
    "__version__",
    "call_metadata",
    "connect",
    "connect_sync",
    "current_scope",
    "fleet",
    "generate_secret",
    "load_config",
    "load_fleet_config",
    "oneway",
    "peer",
    "register_exception",
    "serve",
    "with_options",
    "write_secret_file",
]
