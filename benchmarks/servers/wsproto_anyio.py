"""Floor: raw wsproto over anyio sockets, echoing every binary message with a send of its own."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
from anyio.abc import ByteStream, SocketAttribute
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
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


def _answers(ws: WSConnection, parts: list[bytes]) -> Iterator[bytes]:
    """The bytes to send for each event of the data ``ws`` received, in order.

    ``parts`` holds the pieces of a message that is not finished yet, across receives.
    """
    for event in ws.events():
        if isinstance(event, Request):
            yield ws.send(AcceptConnection())
        elif isinstance(event, BytesMessage):
            parts.append(bytes(event.data))
            if event.message_finished:
                message = parts[0] if len(parts) == 1 else b"".join(parts)
                parts.clear()
                yield ws.send(BytesMessage(data=message))
        elif isinstance(event, TextMessage):
            pass  # the benchmark sends binary messages only
        elif isinstance(event, Ping):
            yield ws.send(event.response())
        elif isinstance(event, CloseConnection):
            yield ws.send(event.response())
            return


async def serve_connection(stream: ByteStream, *, coalesce: bool = False) -> None:
    """Echo on one connection until the peer closes it.

    Each answer is sent as soon as its message is parsed; with ``coalesce``, the answers to
    everything one ``receive`` brought are sent together, with one ``send``.
    """
    ws = WSConnection(ConnectionType.SERVER)
    parts: list[bytes] = []
    async with stream:
        while ws.state is not ConnectionState.CLOSED:
            try:
                data = await stream.receive(RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            ws.receive_data(data)
            if coalesce:
                batch = list(_answers(ws, parts))
                if batch:
                    await stream.send(batch[0] if len(batch) == 1 else b"".join(batch))
            else:
                for answer in _answers(ws, parts):
                    await stream.send(answer)


def main(
    argv: list[str] | None = None, *, coalesce: bool = False, description: str | None = __doc__
) -> None:
    args = parse_args(description or "", argv)
    start_watchdog(args.max_seconds)

    async def handle(stream: ByteStream) -> None:
        await serve_connection(stream, coalesce=coalesce)

    async def serve() -> None:
        listener = await anyio.create_tcp_listener(local_host=HOST, local_port=args.port)
        announce(listener.extra(SocketAttribute.local_port))
        await listener.serve(handle)

    anyio.run(serve, backend="asyncio", backend_options={"use_uvloop": args.loop == "uvloop"})


if __name__ == "__main__":
    main()
