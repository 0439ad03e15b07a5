"""Child of tests/test_fd_limit.py: a listening worker whose RLIMIT_NOFILE is tiny.

Usage: ``python fd_limit_child.py BACKEND NOFILE SECRET_HEX``. Serves ``echo.echo(text)`` as
executor ``fd`` on 127.0.0.1 (any port), prints ``READY <port>``, then answers each ``stats``
line on stdin with ``STATS <connections the listener accepted>``; exits when stdin closes. The
library's warnings go to stderr as ``LOG <logger> <message>`` lines. Accept failures are retried
every 20 ms and reported at most every 0.5 s, so a test sees many failures per log line.
"""

from __future__ import annotations

import logging
import resource
import sys

import anyio

import garcon_link as gl
from garcon_link.net import _asyncio_stream

LIMITS = gl.Limits(max_unauthenticated_sockets=1000, handshake_timeout=60.0)


class Echo:
    async def echo(self, text: str) -> str:
        return text


async def main(nofile: int, secret: bytes) -> None:
    config = gl.LinkConfig(
        executor_id="fd",
        role=gl.Role.WORKER,
        secret=gl.Secret(secret),
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    async with gl.Worker(config, {"echo": Echo()}) as worker:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
        print(f"READY {worker.link.listen_address[1]}", flush=True)
        lines = anyio.wrap_file(sys.stdin)
        while line := await lines.readline():
            if line.strip() == "stats":
                print(f"STATS {worker.link.statistics().connections}", flush=True)


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="LOG %(name)s %(message)s")
    _asyncio_stream.ACCEPT_ERROR_PAUSE = 0.02
    _asyncio_stream.ACCEPT_LOG_INTERVAL = 0.5
    anyio.run(main, int(sys.argv[2]), bytes.fromhex(sys.argv[3]), backend=sys.argv[1])
