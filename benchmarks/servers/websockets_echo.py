"""Floor: the ``websockets`` library echoing every binary message (compression off)."""

from __future__ import annotations

import asyncio

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from ._common import HOST, announce, parse_args, run_asyncio, start_watchdog

MAX_SIZE = 64 * 1024 * 1024


async def _handle(ws: ServerConnection) -> None:
    try:
        async for message in ws:
            await ws.send(message)
    except ConnectionClosed:
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    start_watchdog(args.max_seconds)

    async def run() -> None:
        async with serve(
            _handle,
            HOST,
            args.port,
            compression=None,
            max_size=MAX_SIZE,
            ping_interval=None,
        ) as server:
            announce(next(iter(server.sockets)).getsockname()[1])
            await asyncio.Future()  # until the watchdog ends the process

    run_asyncio(run, args.loop)


if __name__ == "__main__":
    main()
