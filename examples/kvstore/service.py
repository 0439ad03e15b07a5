"""A small key-value store: the interface both sides share, and the worker's implementation.

The interface is a ``typing.Protocol``; only its methods are callable remotely (the worker
registers the implementation under it with ``garcon_link.Service``). Values are converted and
validated against the type hints on receipt, including the ``Change`` dataclass.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import anyio

import garcon_link as gl


@dataclass(frozen=True)
class Change:
    """One change of the store; ``value`` is ``None`` for a deletion."""

    version: int
    key: str
    value: str | None


class KeyValueStore(Protocol):
    """The contract, shared by the controller and the worker."""

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str) -> int:
        """Store ``value``; returns the store's new version."""
        ...

    async def delete(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        ...

    def changes(self, since: int = 0) -> AsyncIterator[Change]:
        """Every change after version ``since`` (from a bounded history), then live ones."""
        ...


class MemoryStore:
    """The worker's implementation: a dict, a version counter and a bounded change history."""

    HISTORY = 1000

    def __init__(self) -> None:
        self._data: dict[str, str] = {}
        self._version = 0
        self._history: collections.deque[Change] = collections.deque(maxlen=self.HISTORY)
        self._changed: anyio.Event | None = None  # created lazily: needs a running event loop

    async def get(self, key: str) -> str | None:
        return self._data.get(key)

    async def set(self, key: str, value: str) -> int:
        self._data[key] = value
        return self._record(key, value)

    async def delete(self, key: str) -> bool:
        existed = self._data.pop(key, None) is not None
        if existed:
            self._record(key, None)
        return existed

    async def changes(self, since: int = 0) -> AsyncIterator[Change]:
        seen = since
        while True:
            for change in list(self._history):
                if change.version > seen:
                    seen = change.version
                    yield change
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()

    def _record(self, key: str, value: str | None) -> int:
        self._version += 1
        self._history.append(Change(self._version, key, value))
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return self._version


served = gl.Service(MemoryStore(), KeyValueStore)
"""What the worker serves: the store, exposed only through ``KeyValueStore``.

From the shell: ``garcon-link worker worker.toml --service kv=service:served``.
"""
