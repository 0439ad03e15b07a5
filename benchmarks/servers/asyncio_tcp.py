"""Floor: raw asyncio TCP echo of length-prefixed frames (4-byte big-endian length, payload)."""

from __future__ import annotations

import asyncio
import contextlib
import struct

from ._common import HOST, announce, parse_args, run_asyncio, start_watchdog

HEADER = struct.Struct("!I")


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            header = await reader.readexactly(HEADER.size)
            (length,) = HEADER.unpack(header)
            payload = await reader.readexactly(length)
            writer.writelines((header, payload))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    start_watchdog(args.max_seconds)

    async def serve() -> None:
        server = await asyncio.start_server(_handle, HOST, args.port)
        announce(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    run_asyncio(serve, args.loop)


if __name__ == "__main__":
    main()
