"""Resumable, authenticated WebSocket RPC to Python service objects in a worker.

Usage (``garcon-link init DIR`` writes such a project; ``garcon-link --help`` lists commands)::

    import garcon_link as gl

    class Calculator(Protocol):  # the contract, shared by both sides
        async def add(self, a: int, b: int) -> int: ...

    # worker (or: garcon-link worker worker.toml --service calc=calc:CalculatorImpl)
    await gl.serve(gl.load_config("worker.toml"), {"calc": CalculatorImpl()})

    # controller (blocking code: with gl.connect_sync(config) as executor: ...)
    async with gl.connect(gl.load_config("controller.toml")) as executor:
        await executor.wait_ready(timeout=10)
        calc = executor.service("calc", Calculator)  # typed; survives reconnections
        print(await calc.add(1, 2))

Documentation: the site built from docs/ of the source tree (``make docs``: a tutorial, how-to
guides, the reference of every public name, explanations); every bound is a field
of :class:`Limits`. The public surface is ``__all__``; each module's docstring holds its rules.
"""

from __future__ import annotations

import logging as _logging

from .api.controller import Availability, ExecutorInfo, RemoteExecutor, connect
from .api.facades import peer
from .api.fleet import ExecutorSnapshot, Fleet, FleetEvent, fleet
from .api.gateway import CallerSnapshot, Gateway, gateway
from .api.options import with_options
from .api.registration import Service
from .api.relay import GatewayExecutor, GatewayFleet, connect_gateway
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
from .rpc.rpc import register_exception, unregister_exception
from .settings.callers import (
    CallerConfig,
    CallersConfig,
    GatewayConfig,
    load_caller_config,
    load_gateway_config,
)
from .settings.config import LinkConfig, load_config
from .settings.fleet import DialExecutor, FleetConfig, load_fleet_config
from .settings.grants import Grant
from .settings.keyring import Keyring
from .settings.secrets import Secret, generate_secret, write_secret_file
from .settings.tls import TlsConfig
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
    "CallerConfig",
    "CallerSnapshot",
    "CallersConfig",
    "ConfigError",
    "DialExecutor",
    "ExecutorInfo",
    "ExecutorSnapshot",
    "Fleet",
    "FleetConfig",
    "FleetEvent",
    "GarconLinkError",
    "Gateway",
    "GatewayConfig",
    "GatewayExecutor",
    "GatewayFleet",
    "Grant",
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
    "connect_gateway",
    "connect_sync",
    "current_scope",
    "fleet",
    "gateway",
    "generate_secret",
    "load_caller_config",
    "load_config",
    "load_fleet_config",
    "load_gateway_config",
    "oneway",
    "peer",
    "register_exception",
    "serve",
    "unregister_exception",
    "with_options",
    "write_secret_file",
]
