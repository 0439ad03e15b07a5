"""Peer: RPyC ``ThreadedServer`` with a service exposing ``echo`` (RPyC's default settings)."""

from __future__ import annotations

import rpyc
from rpyc.utils.server import ThreadedServer

from ._common import HOST, announce, parse_args, start_watchdog


class EchoService(rpyc.Service):  # type: ignore[misc]
    """Returns its argument."""

    def exposed_echo(self, data: bytes) -> bytes:
        return data


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    start_watchdog(args.max_seconds)
    server = ThreadedServer(
        EchoService,
        hostname=HOST,
        port=args.port,
        protocol_config={"sync_request_timeout": 60},
        auto_register=False,  # no registry broadcast: loopback only
    )
    # The constructor binds, start() listens then serves; listen first (start() then skips
    # it) so that the port is accepting connections when the harness is told.
    server._listen()
    announce(int(server.port))
    server.start()


if __name__ == "__main__":
    main()
