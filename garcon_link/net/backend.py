"""The event-loop backend seam: which backend runs (asyncio or trio) and how to reach its loop.

Rooms above ask here instead of reaching into a backend's own module (:mod:`._asyncio_stream`
is private to this room).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ._asyncio_stream import on_asyncio

__all__ = ["loop_scheduler", "on_asyncio"]


def loop_scheduler() -> Callable[..., object]:
    """``schedule(callback, *args)`` that runs ``callback`` soon on the *current* event loop and
    may itself be called from anywhere: any thread, or inside the garbage collector at any point
    of the loop thread (asyncio's ``call_soon_threadsafe`` and trio's ``run_sync_soon`` only
    append to a queue and wake the loop; neither touches our state)."""
    if on_asyncio():
        return asyncio.get_running_loop().call_soon_threadsafe
    import trio  # the only other backend anyio runs on

    return trio.lowlevel.current_trio_token().run_sync_soon
