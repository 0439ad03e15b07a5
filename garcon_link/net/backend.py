"""The event-loop backend seam: which backend runs (asyncio or trio) and how to reach its loop.

Rooms above ask here instead of reaching into a backend's own module (:mod:`._asyncio_stream`
is private to this room).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel

from ._asyncio_stream import on_asyncio

__all__ = [
    "OutermostScope",
    "cancel_scope_factory",
    "checkpointer",
    "late_scopes",
    "loop_scheduler",
    "on_asyncio",
]


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


def _asyncio_task_states() -> Any:
    """anyio's asyncio task states (``task -> TaskState``, whose ``cancel_scope`` is the task's
    innermost open scope), if that backend keeps them as :class:`OutermostScope` expects; else
    ``None``."""
    try:
        from anyio._backends import _asyncio as backend
    except ImportError:
        return None
    states = getattr(backend, "_task_states", None)
    scope_class = getattr(backend, "CancelScope", None)
    wanted = ("_parent_scope", "_tasks", "_reparent")
    if states is None or scope_class is None or not all(hasattr(scope_class, a) for a in wanted):
        return None
    if "cancel_scope" not in getattr(getattr(backend, "TaskState", None), "__slots__", ()):
        return None
    return states


_TASK_STATES = _asyncio_task_states()


def late_scopes() -> bool:
    """Whether the running backend's tasks can enter a cancel scope as their outermost one after
    entering scopes of their own (:class:`OutermostScope`): on asyncio, with an anyio whose task
    state is as expected; never on trio."""
    return _TASK_STATES is not None and on_asyncio()


class OutermostScope:
    """``with OutermostScope(scope):`` enters ``scope`` (a new asyncio ``anyio.CancelScope``) in
    the current task as the outermost of the task's cancel scopes -- where it would be had it
    been entered before any of them -- and leaves it as ``with scope:`` would.

    For a task that ran without a scope until now (a call's handler, whose scope is entered only
    once it suspends: :meth:`~garcon_link.rpc.handlers.Handlers.run`) and is suspended inside
    scopes of its own: those become children of ``scope``, so cancelling ``scope`` reaches the
    task through them as anyio delivers any cancellation (not into a shielded one), and leaving
    them hands the task back to ``scope``. Needs :func:`late_scopes`.
    """

    __slots__ = ("scope",)

    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope = scope

    def __enter__(self) -> anyio.CancelScope:
        scope: Any = self.scope
        states: Any = _TASK_STATES
        task = asyncio.current_task()
        state: Any = states.get(task) if task is not None else None
        innermost = state.cancel_scope if state is not None else None
        if innermost is None:
            return scope.__enter__()  # type: ignore[no-any-return]
        outermost = innermost
        while outermost._parent_scope is not None:
            outermost = outermost._parent_scope
        # Entered as the task's only scope (the task's own set aside meanwhile), then made the
        # parent of its outermost one; the task stays in its innermost scope's tasks.
        state.cancel_scope = None
        try:
            scope.__enter__()
        finally:
            state.cancel_scope = innermost
        scope._tasks.discard(task)
        outermost._reparent(scope)
        return self.scope

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool:
        return bool(self.scope.__exit__(exc_type, exc_val, exc_tb))
