"""Peer: Pyro5 daemon with an exposed ``echo`` object; it serves every Pyro5 serializer.

The client picks the serializer (marshal or serpent).  With serpent, bytes travel as a
base64 dict; the object turns them back into bytes, as an application would.
"""

from __future__ import annotations

from typing import Any

import Pyro5
import Pyro5.api
import serpent

from ._common import HOST, announce, parse_args, start_watchdog

OBJECT_ID = "bench.echo"


@Pyro5.api.expose
@Pyro5.api.behavior(instance_mode="single")
class Echo:
    """Returns its argument (as bytes)."""

    def echo(self, data: Any) -> bytes:
        if isinstance(data, dict):
            return bytes(serpent.tobytes(data))
        return bytes(data)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    start_watchdog(args.max_seconds)
    # The throughput test holds 64 connections, one per client thread; the thread pool
    # server needs a worker thread for each.
    Pyro5.config.THREADPOOL_SIZE = 256
    Pyro5.config.THREADPOOL_SIZE_MIN = 8
    daemon = Pyro5.api.Daemon(host=HOST, port=args.port)
    daemon.register(Echo(), objectId=OBJECT_ID)
    announce(int(daemon.locationStr.rsplit(":", 1)[1]))
    daemon.requestLoop()


if __name__ == "__main__":
    main()
