"""Peer client: RPyC (default settings), one connection per thread, ``root.echo`` bound once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import rpyc

from . import HOST, Mode

MODE: Mode = "sync"


class _Client:
    def __init__(self, echo: Callable[[bytes], bytes]) -> None:
        self._echo = echo

    def call(self, payload: bytes) -> bytes:
        return self._echo(payload)


@contextmanager
def connect(port: int) -> Iterator[_Client]:
    conn = rpyc.connect(HOST, port, config={"sync_request_timeout": 60})
    try:
        # Look the method up once: each attribute access on a netref is a round trip.
        yield _Client(conn.root.echo)
    finally:
        conn.close()
