"""Peer client: Pyro5 proxy (default settings but the serializer), one proxy per thread."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import Pyro5.api
import serpent

from . import HOST, Mode

MODE: Mode = "sync"
OBJECT_ID = "bench.echo"


class _Client:
    def __init__(self, proxy: Any) -> None:
        self._proxy = proxy

    def call(self, payload: bytes) -> bytes:
        reply = self._proxy.echo(payload)
        if isinstance(reply, dict):  # serpent sends bytes as a base64 dict
            return bytes(serpent.tobytes(reply))
        return bytes(reply)


def connector(serializer: str) -> Callable[[int], AbstractContextManager[_Client]]:
    """``connect`` for one Pyro5 serializer (``marshal``, ``serpent``, ...)."""

    @contextmanager
    def connect(port: int) -> Iterator[_Client]:
        proxy = Pyro5.api.Proxy(f"PYRO:{OBJECT_ID}@{HOST}:{port}")
        try:
            proxy._pyroSerializer = serializer
            proxy._pyroTimeout = 60
            proxy._pyroBind()
            yield _Client(proxy)
        finally:
            proxy._pyroRelease()

    return connect


connect_marshal = connector("marshal")
connect_serpent = connector("serpent")
