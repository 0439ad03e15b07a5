"""The measured systems: floors, peers and garcon_link itself, in the order of the report."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["floor", "peer", "ours"]


@dataclass(frozen=True)
class Entry:
    """One line of the report: a server module, a client and what they need installed."""

    name: str
    kind: Kind
    description: str
    server: str
    """Module under ``benchmarks.servers`` run as the child process."""
    client: str
    """``module:attribute`` of the client's ``connect`` (see ``benchmarks/clients``)."""
    requires: tuple[str, ...] = ()
    """Importable modules (``pip`` distribution in the note) without which it is skipped."""
    install: str = ""
    availability: str | None = None
    """``module:function`` returning a reason it cannot run yet, or None."""
    settings_note: str = ""

    def skip_reason(self) -> tuple[str, str] | None:
        """``(status, note)`` when the entry cannot run here, else None."""
        missing = [name for name in self.requires if not _importable(name)]
        if missing:
            hint = f" (pip install {self.install})" if self.install else ""
            return "not installed", f"missing {', '.join(missing)}{hint}"
        if self.availability is not None:
            reason = _resolve(self.availability)()
            if reason is not None:
                return "not available", str(reason)
        return None

    def load_client(self) -> tuple[str, Any]:
        """``(MODE, connect)`` of the client."""
        module_name, _, attribute = self.client.partition(":")
        module = importlib.import_module(module_name)
        return str(module.MODE), getattr(module, attribute)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def _resolve(path: str) -> Any:
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


ENTRIES: tuple[Entry, ...] = (
    Entry(
        name="asyncio-tcp",
        kind="floor",
        description="raw asyncio TCP echo, length-prefixed frames",
        server="asyncio_tcp",
        client="benchmarks.clients.asyncio_tcp:connect",
    ),
    Entry(
        name="wsproto",
        kind="floor",
        description="raw wsproto over anyio sockets, binary message echo",
        server="wsproto_anyio",
        client="benchmarks.clients.wsproto_anyio:connect",
        requires=("anyio", "wsproto"),
        install="anyio wsproto",
    ),
    Entry(
        name="wsproto-coalesced",
        kind="floor",
        description=(
            "raw wsproto over anyio sockets, binary message echo; the messages of one event-loop"
            " turn (client) or of one receive (server) written with one send"
        ),
        server="wsproto_coalesced",
        client="benchmarks.clients.wsproto_anyio:connect_coalesced",
        requires=("anyio", "wsproto"),
        install="anyio wsproto",
    ),
    Entry(
        name="websockets",
        kind="floor",
        description="websockets library (asyncio API, compression off), binary message echo",
        server="websockets_echo",
        client="benchmarks.clients.websockets_echo:connect",
        requires=("websockets.asyncio",),
        install="'websockets>=13'",
    ),
    Entry(
        name="rpyc",
        kind="peer",
        description="RPyC ThreadedServer, service with an exposed echo method",
        server="rpyc_echo",
        client="benchmarks.clients.rpyc_echo:connect",
        requires=("rpyc",),
        install="rpyc",
        settings_note="defaults: zlib level 1 on messages over 3000 bytes",
    ),
    Entry(
        name="pyro5-marshal",
        kind="peer",
        description="Pyro5 daemon, exposed echo method, marshal serializer",
        server="pyro5_echo",
        client="benchmarks.clients.pyro5_echo:connect_marshal",
        requires=("Pyro5", "serpent"),
        install="Pyro5",
    ),
    Entry(
        name="pyro5-serpent",
        kind="peer",
        description="Pyro5 daemon, exposed echo method, serpent serializer",
        server="pyro5_echo",
        client="benchmarks.clients.pyro5_echo:connect_serpent",
        requires=("Pyro5", "serpent"),
        install="Pyro5",
        settings_note="serpent sends bytes as base64",
    ),
    Entry(
        name="grpc",
        kind="peer",
        description="grpcio asyncio, unary bytes method via a generic handler",
        server="grpc_echo",
        client="benchmarks.clients.grpc_echo:connect",
        requires=("grpc",),
        install="grpcio",
    ),
    Entry(
        name="ours-call",
        kind="ours",
        description="garcon_link facade method call",
        server="ours",
        client="benchmarks.ours:connect_call",
        availability="benchmarks.ours:unavailable_reason",
    ),
    Entry(
        name="ours-stream",
        kind="ours",
        description="garcon_link stream item echoed",
        server="ours",
        client="benchmarks.ours:connect_stream",
        availability="benchmarks.ours:unavailable_reason",
    ),
    Entry(
        name="ours-notify",
        kind="ours",
        description="garcon_link notification answered by a notification",
        server="ours",
        client="benchmarks.ours:connect_notify",
        availability="benchmarks.ours:unavailable_reason",
    ),
)

BY_NAME = {entry.name: entry for entry in ENTRIES}
