"""Peer: grpcio asyncio server, one unary method through a generic bytes handler (no protoc)."""

from __future__ import annotations

import grpc
import grpc.aio

from ._common import HOST, announce, parse_args, run_asyncio, start_watchdog

SERVICE = "bench.Echo"
METHOD = "Echo"
MAX_MESSAGE = 64 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


async def _echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    start_watchdog(args.max_seconds)

    async def serve() -> None:
        server = grpc.aio.server(options=OPTIONS)
        # No (de)serializer: grpc hands the handler the raw request bytes and sends the
        # returned bytes as they are (identity serialization).
        handler = grpc.unary_unary_rpc_method_handler(
            _echo, request_deserializer=None, response_serializer=None
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),)
        )
        port = server.add_insecure_port(f"{HOST}:{args.port}")
        await server.start()
        announce(port)
        await server.wait_for_termination()

    run_asyncio(serve, args.loop)


if __name__ == "__main__":
    main()
