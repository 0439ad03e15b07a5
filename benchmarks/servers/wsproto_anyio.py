"""Floor: raw wsproto over anyio sockets, echoing every binary message."""

from __future__ import annotations

import anyio
from anyio.abc import SocketAttribute, SocketStream
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
    TextMessage,
)

from ._common import HOST, announce, parse_args, start_watchdog

RECEIVE_BYTES = 256 * 1024


async def _handle(stream: SocketStream) -> None:
    ws = WSConnection(ConnectionType.SERVER)
    parts: list[bytes] = []
    async with stream:
        while True:
            try:
                data = await stream.receive(RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, Request):
                    await stream.send(ws.send(AcceptConnection()))
                elif isinstance(event, BytesMessage):
                    parts.append(bytes(event.data))
                    if event.message_finished:
                        message = parts[0] if len(parts) == 1 else b"".join(parts)
                        parts.clear()
                        await stream.send(ws.send(BytesMessage(data=message)))
                elif isinstance(event, TextMessage):
                    pass  # the benchmark sends binary messages only
                elif isinstance(event, Ping):
                    await stream.send(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    await stream.send(ws.send(event.response()))
                    return


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    start_watchdog(args.max_seconds)

    async def serve() -> None:
        listener = await anyio.create_tcp_listener(local_host=HOST, local_port=args.port)
        announce(listener.extra(SocketAttribute.local_port))
        await listener.serve(_handle)

    anyio.run(serve, backend="asyncio", backend_options={"use_uvloop": args.loop == "uvloop"})


if __name__ == "__main__":
    main()
