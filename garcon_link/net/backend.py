"""The event-loop backend seam: which backend runs (asyncio or trio) and how to reach its loop.

Rooms above ask here instead of reaching into a backend's own module (:mod:`._asyncio_stream`
is private to this room).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel

from ._asyncio_stream import on_asyncio

__all__ = ["cancel_scope_factory", "checkpointer", "loop_scheduler", "on_asyncio"]


def _asyncio_checkpoint() -> Awaitable[None]:
    return asyncio.sleep(0)


def checkpointer() -> Callable[[], Awaitable[None]]:
    """The running backend's checkpoint, looked up once: on asyncio ``asyncio.sleep(0)``, which
    is what ``anyio.lowlevel.checkpoint()`` awaits there after looking up the backend (sniffio)
    on every call; else anyio's."""
    return _asyncio_checkpoint if on_asyncio() else anyio.lowlevel.checkpoint


def cancel_scope_factory() -> Callable[[], anyio.CancelScope]:
    """Makes a new ``anyio.CancelScope()`` (no deadline, not shielded) for the running backend,
    the backend looked up once: on asyncio the backend's own scope class, which
    ``anyio.CancelScope()`` instantiates after looking up the backend (sniffio) every time."""
    if on_asyncio():
        scope_class: Callable[[], anyio.CancelScope] = type(anyio.CancelScope())
        return scope_class
    return anyio.CancelScope


def loop_scheduler() -> Callable[..., object]:
    """``schedule(callback, *args)`` that runs ``callback`` soon on the *current* event loop and
    may itself be called from anywhere: any thread, or inside the garbage collector at any point
    of the loop thread (asyncio's ``call_soon_threadsafe`` and trio's ``run_sync_soon`` only
    append to a queue and wake the loop; neither touches our state)."""
    if on_asyncio():
        return asyncio.get_running_loop().call_soon_threadsafe
    import trio  # the only other backend anyio runs on

    return trio.lowlevel.current_trio_token().run_sync_soon
