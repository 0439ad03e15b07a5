"""One executor's (or one controller's) slot in a :class:`~garcon_link.endpoint.link.WebSocketLink`.

A slot holds that executor's logical session, the socket attached to it, the socket being
admitted and the runtimes that were taken over; it answers what the admission rule
(:func:`~garcon_link.core.admission.decide`) and the listener's hello
(:func:`~garcon_link.core.handshake.listener_offer`) read of it. The link changes slots; this
module only describes one (docs/design.md#link).
"""

from __future__ import annotations

import collections

from ..core.admission import SlotView
from ..core.handshake import Hello, ResumeOffer, listener_offer
from ..net.ws import WebSocket
from .transport import SessionTransport, TransportState

_TAKEN_OVER_MEMORY = 16
"""Runtimes per slot remembered as taken over (older ones fall back to the takeover rule)."""


class _Slot:
    """One executor's state in a link: its session, attached socket and taken-over runtimes."""

    __slots__ = (
        "admitting",
        "attached",
        "controller",
        "detached",
        "executor_id",
        "key",
        "since",
        "taken_over",
        "transport",
    )

    def __init__(self, executor_id: str, controller: str | bytes | None = None) -> None:
        self.executor_id = executor_id
        self.controller = controller
        self.since = 0  # when its current session began, in sessions begun by the link
        self.detached = 0  # when its socket last detached, in detachments seen by the link
        self.transport: SessionTransport | None = None
        self.attached: WebSocket | None = None
        # The socket being admitted (decision, probe, takeover, proof): one at a time.
        self.admitting: WebSocket | None = None
        self.taken_over: collections.deque[bytes] = collections.deque(maxlen=_TAKEN_OVER_MEMORY)
        self.key: bytes | None = None  # the key the attached socket authenticated with

    @property
    def live(self) -> SessionTransport | None:
        t = self.transport
        return t if t is not None and t.state is not TransportState.RETIRED else None

    @property
    def label(self) -> str | None:
        """The controller, as logs and snapshots name it (None: not a controller's slot)."""
        c = self.controller
        return c.hex() if isinstance(c, bytes) else c

    @property
    def holds_place(self) -> bool:
        """Whether the slot counts against ``max_controllers``: a session, a socket or an
        admission under way."""
        return self.live is not None or self.attached is not None or self.admitting is not None

    @property
    def evictable(self) -> bool:
        """Whether the slot holds only a detached session (no socket carries it and none is
        being admitted for it): a crashed or cut-off controller's, which may give its place up."""
        t = self.live
        return t is not None and not t.attached and self.attached is None and self.admitting is None

    def view(
        self,
        closing: bool,
        sock: WebSocket,
        *,
        full: bool = False,
        evictable: bool = False,
        draining: bool = False,
    ) -> SlotView:
        """The slot as :func:`decide` sees it for ``sock`` (whose own admission is not another)."""
        t = self.live
        return SlotView(
            closing=closing,
            session=t.session_id if t is not None else None,
            peer_runtime=t.peer_runtime if t is not None else None,
            attached=t is not None and t.attached,
            admitting=self.admitting is not None and self.admitting is not sock,
            full=full,
            evictable=evictable,
            draining=draining,
        )

    def resume_offer(self) -> ResumeOffer | None:
        t = self.live
        if t is None:
            return None
        return ResumeOffer(
            session_id=t.session_id, peer_runtime=t.peer_runtime, received=t.accepted
        )

    def offer_to(self, peer: Hello, runtime: bytes) -> ResumeOffer | None:
        """What a listener (runtime ``runtime``) advertises to ``peer``'s unverified hello
        (:func:`listener_offer`). The offer is built only for a hello that names the live
        session, so every other hello costs what an unknown executor's does."""
        t = self.live
        if t is None or peer.session != t.session_id:
            return None
        return listener_offer(peer, self.resume_offer(), runtime)
