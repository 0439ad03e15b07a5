"""A child process running several workers of a fleet test (tests/test_fleet_processes.py).

Usage: ``python fleet_workers.py KEYRING ID=URL [ID=URL ...]``. Each worker dials its URL with
the id and the key ``KEYRING/<ID>.secret`` and serves ``ident.whoami`` (its own id) and
``ident.apply(token)``, which appends ``<id> <token>`` to ``KEYRING/../ledger-<ID>`` (one line per
execution: the ledger the test checks exactly-once against). Prints ``started`` once every worker
is running; exits when stdin closes (or when killed).
"""

from __future__ import annotations

import os
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

import garcon_link as gl
from garcon_link.settings.secrets import read_secret_file

LIMITS = gl.Limits(
    heartbeat_interval=0.2,
    heartbeat_timeout=2.0,
    detached_grace=5.0,
    backoff_base=0.02,
    backoff_max=0.2,
    connect_timeout=2.0,
)


class Ident:
    def __init__(self, executor_id: str, ledger: Path) -> None:
        self.executor_id = executor_id
        self.ledger = ledger

    async def whoami(self) -> str:
        return self.executor_id

    async def apply(self, token: str) -> str:
        fd = os.open(self.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{self.executor_id} {token}\n".encode())
        finally:
            os.close(fd)
        return f"{self.executor_id}:{token}"


async def main(keyring: Path, targets: list[tuple[str, str]]) -> None:
    async with AsyncExitStack() as stack:
        for executor_id, url in targets:
            secret = read_secret_file(keyring / f"{executor_id}.secret")
            config = gl.LinkConfig(
                executor_id=executor_id,
                role=gl.Role.WORKER,
                secret=secret,
                dial=url,
                limits=LIMITS,
            )
            ledger = keyring.parent / f"ledger-{executor_id}"
            await stack.enter_async_context(
                gl.Worker(config, {"ident": Ident(executor_id, ledger)})
            )
        print("started", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


if __name__ == "__main__":
    pairs = [arg.split("=", 1) for arg in sys.argv[2:]]
    anyio.run(main, Path(sys.argv[1]), [(i, u) for i, u in pairs])
