"""What the parts of one :class:`~garcon_link.endpoint.transport.SessionTransport` share.

The transport is one state machine whose parts -- its pumps, its timers and the owner that runs
them -- must see each other's changes within the loop turn that made them (a fence passed, the
socket gone, a receipt come due). A fact more than one part reads lives here, in one
:class:`Shared` object, and nowhere else; what one part alone reads stays in that part.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import ParamSpec

import anyio

from ..core.replay import ReplayWatch
from ..core.session import MessageSession
from ..limits import Limits
from .transport_types import MessageSocket

__all__ = ["Shared", "log", "weak_method"]

log = logging.getLogger("garcon_link.transport")  # the name users configure (README)

P = ParamSpec("P")


def weak_method(method: Callable[P, object]) -> Callable[P, None]:
    """``method`` (a bound method of the owner) called through a weak reference to its object,
    for a part to keep: the owner holds its parts, so a part holding the owner would make a
    reference cycle, and a dropped transport would wait for the cycle collector instead of
    being freed at once. A part calls the owner only while the owner runs it (an attachment's
    pumps and timers; the grace watch is handed the owner's method itself); once the owner is
    gone the call does nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


class Shared:
    """The state the transport's parts share (one per transport).

    Set once: ``session``, ``limits``, ``session_id``, ``label``. Per attachment, set by the
    owner: ``sock`` and ``scope`` (the socket and the run's cancel scope while attached, else
    ``None``) and ``replay`` (a fresh :class:`~garcon_link.core.replay.ReplayWatch` at each
    attach). ``fence_passed``: the peer's replay fence has passed on this attachment (the reader
    sets it, the owner clears it at attach; a frame is written before the fence by the writer
    only). ``receipt_due_at``: ``time.monotonic()`` when the receipt due now became due (the
    reader notes it, the writer and the receipt timer wait ``receipt_delay`` from it).
    """

    __slots__ = (
        "fence_passed",
        "label",
        "limits",
        "receipt_due_at",
        "replay",
        "scope",
        "session",
        "session_id",
        "sock",
    )

    def __init__(
        self, session: MessageSession, limits: Limits, session_id: bytes, label: str
    ) -> None:
        self.session = session
        self.limits = limits
        self.session_id = session_id
        self.label = label
        self.sock: MessageSocket | None = None
        self.scope: anyio.CancelScope | None = None
        self.fence_passed = False
        self.replay = ReplayWatch(0, 0.0, limits.replay_inactivity)
        self.receipt_due_at = 0.0
