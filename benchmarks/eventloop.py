"""Choice of asyncio event loop for clients and servers: plain asyncio, or uvloop if installed."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable

CHOICES = ("auto", "asyncio", "uvloop")


def resolve(choice: str) -> str:
    """Turn ``auto`` into ``uvloop`` when uvloop is installed, else ``asyncio``."""
    if choice == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if choice not in CHOICES:
        raise ValueError(f"unknown event loop {choice!r}")
    return choice


def factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The ``loop_factory`` for :class:`asyncio.Runner` (None: the default asyncio loop)."""
    if resolve(name) == "uvloop":
        import uvloop  # optional: imported only when chosen

        new_event_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
        return new_event_loop
    return None
