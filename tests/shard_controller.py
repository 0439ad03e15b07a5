"""Child of tests/test_nginx_sharding.py: one listening fleet controller process (one shard).

Usage: ``python shard_controller.py KEYRING``. Runs :func:`garcon_link.api.fleet` on 127.0.0.1 (any
port) with the keyring and the limits of tests/test_nginx.py, prints ``READY <port>``, then
answers each line on stdin with one JSON line on stdout:

* ``state`` -> ``{"executors": {id: [availability, session]}, "resumed": N, "fresh": N}``: the
  fleet's :meth:`~garcon_link.Fleet.executors` snapshot and its listening link's resume and
  fresh-session counters;
* ``call ID`` -> ``{"answer": ...}`` or ``{"error": ...}``: ``ident.whoami()`` on executor ``ID``
  through ``fleet.executor(ID)`` (bounded by 10 s).

Exits when stdin closes (or when killed: the test SIGKILLs one of these).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Protocol

import anyio
from test_nginx import LIMITS

import garcon_link as gl

CALL_TIMEOUT = 10.0


class Ident(Protocol):
    async def whoami(self) -> str: ...


def reply(message: object) -> None:
    print(json.dumps(message), flush=True)


async def main(keyring: Path) -> None:
    config = gl.FleetConfig(listen=("127.0.0.1", 0), keyring=keyring, limits=LIMITS)
    async with gl.fleet(config) as fleet:
        print(f"READY {fleet.listen_address[1]}", flush=True)
        lines = anyio.wrap_file(sys.stdin)
        while line := await lines.readline():
            command, _, arg = line.strip().partition(" ")
            if command == "state":
                stats = fleet.statistics()
                executors = {i: [s.availability, s.session] for i, s in fleet.executors().items()}
                reply(
                    {
                        "executors": executors,
                        "resumed": stats.resumed,
                        "fresh": stats.fresh_sessions,
                    }
                )
            elif command == "call":
                try:
                    with anyio.fail_after(CALL_TIMEOUT):
                        answer = await fleet.executor(arg).service("ident", Ident).whoami()
                except Exception as exc:  # reported to the test, which fails on it
                    reply({"error": f"{type(exc).__name__}: {exc}"})
                else:
                    reply({"answer": answer})
            else:
                reply({"error": f"unknown command {command!r}"})


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
