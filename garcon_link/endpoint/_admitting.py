"""An authenticated socket admitted to its slot, or refused (docs/design.md#link).

Theory of operation
-------------------
The link's handshake verifies a peer and hands its socket here, still under the handshake
deadline. :meth:`Admission.admit` finds the peer's slot (a new one: a listening worker's through
:class:`~garcon_link.endpoint._places.Places`, a ``keys`` listener's while fewer than
``max_executors`` are held, else the socket is refused with 1013), reads it as
:func:`~garcon_link.core.admission.decide` sees it, and obeys:

- ``Refuse``: the socket is closed with the reason's close code, the refusal counted and logged
  (rate-limited per peer host: a peer can cause it);
- ``Probe``: the attached socket is pinged within ``takeover_probe_timeout`` and the slot read
  again, with the probe's outcome;
- ``Resume``: the session is carried on (its attached socket superseded first when the rule says
  so);
- ``Fresh``: a detached session is evicted from its place if the rule says so, the current
  session retired (``REPLACED``; a takeover remembers the runtime it took over and closes that
  socket with 4009), and a new :class:`~garcon_link.endpoint.transport.SessionTransport` begun,
  the session listeners told before its first packet.

One socket per slot is being admitted at a time (``slot.admitting``, set with no await since the
slot was read). Our held proof goes out only once the peer is admitted, so a refused peer never
completes a handshake. :attr:`Admission.closing` and :attr:`Admission.draining` are the link's
standing as admission reads it: closing refuses every socket, draining every fresh session
(4010) while a resume is admitted.

The admission holds the link's slot table, places, counters and session listeners, never the
link itself (no reference cycle).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import anyio.abc

from ..core.admission import (
    BUSY,
    Decision,
    Fresh,
    Offer,
    Probe,
    Refuse,
    Resume,
    SlotKey,
    decide,
    slot_key,
)
from ..core.handshake import HandshakeResult, Hello
from ..core.session import RetentionPool
from ..core.wire import CloseCode
from ..errors import FailureReason, HandshakeFailure
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_host, peer_text
from ..net.ws import LinkStatistics, SocketGone, WebSocket
from ._places import Places
from ._slots import _Slot
from .transport import SessionTransport

__all__ = ["Admission", "SessionListener"]

log = logging.getLogger("garcon_link.link")  # the link's logger: the name users configure (README)

SessionListener = Callable[[SessionTransport, HandshakeResult], None]
"""Told each new logical session, before its first packet is processed."""


class Admission:
    """The admission of a link's authenticated sockets to its slots.

    Args:
        slots: the link's slot table (this object adds slots to it).
        places: a listening worker's ``max_controllers`` places among those slots.
        limits: the link's bounds.
        stats: the link's counters.
        retention: the retention budget of the link's sessions.
        listeners: the link's session listeners (the link's own list: it adds and removes).
        per_controller: whether the link is a listening worker (one slot per controller).
        max_executors: the most slots a link holds outside a listening worker.
        tag: the link's log prefix.
        peer_log: the rate limiter of authenticated peers' log lines.
    """

    def __init__(
        self,
        slots: dict[SlotKey, _Slot],
        places: Places,
        limits: Limits,
        stats: LinkStatistics,
        *,
        retention: RetentionPool,
        listeners: list[SessionListener],
        per_controller: bool,
        max_executors: int,
        tag: str,
        peer_log: PeerLogLimiter,
    ) -> None:
        self._slots = slots
        self._places = places
        self._limits = limits
        self._stats = stats
        self._retention = retention
        self._listeners = listeners
        self._per_controller = per_controller
        self._max_executors = max_executors
        self._tag = tag
        self._peer_log = peer_log
        self._sessions_begun = 0
        self.closing = False
        """The link is closing: every socket is refused."""
        self.draining = False
        """The link drains: every fresh session is refused (4010), a resume is admitted."""

    def slot_key(self, hello: Hello) -> SlotKey:
        """The slot a verified (or, for a resume offer, claimed) hello belongs to."""
        return slot_key(
            hello.executor, hello.controller, hello.runtime, per_controller=self._per_controller
        )

    async def admit(
        self, sock: WebSocket, result: HandshakeResult, tg: anyio.abc.TaskGroup
    ) -> tuple[_Slot, SessionTransport, int] | None:
        """Apply :func:`decide` to the executor's slot and send our held proof.

        One socket per slot at a time (``slot.admitting``); the caller bounds this by the
        handshake deadline. Returns the slot, the session to attach and the peer's resume
        position, or None when the socket was refused (and closed) or lost.

        Args:
            sock: the socket, its handshake verified and our proof held.
            result: the verified handshake.
            tg: the link's task group, where a fresh session runs its timers.
        """
        executor_id = result.peer.executor
        key = self.slot_key(result.peer)
        slot = self._slots.get(key)
        if slot is None and self._per_controller:
            slot = self._places.new_slot(key)
        elif slot is None:
            if len(self._slots) >= self._max_executors:
                self._stats.executors_refused += 1
                await self._refuse(
                    sock,
                    Refuse(
                        HandshakeFailure.REGISTRY_FULL,
                        f"max_executors={self._max_executors} executors are registered",
                    ),
                )
                return None
            slot = self._slots[key] = _Slot(executor_id)
        offer = Offer(
            resume=result.resume,
            session=result.session_id,
            runtime=result.peer.runtime,
            taken_over=result.peer.runtime in slot.taken_over,
        )
        full, evictable = self._places.of(slot)
        view = slot.view(self.closing, sock, full=full, evictable=evictable, draining=self.draining)
        decision = decide(view, offer)
        if isinstance(decision, Refuse):
            await self._refused_at_admission(sock, decision, slot)
            return None
        # Decided without an await since the view: no other socket is being admitted.
        slot.admitting = sock
        try:
            admitted = await self._apply(slot, sock, result, offer, decision, tg)
            if admitted is None:
                return None
            proof, sock.held_proof = sock.held_proof, None
            # On asyncio the proof goes out in one write with the session's first frames (the
            # replay fence the writer sends as soon as the session is attached, next turn).
            if proof is not None and not sock.hold_message_nowait(proof):
                try:
                    await sock.send_message(proof)
                except SocketGone:
                    return None  # the session waits, detached, for the next socket (or its grace)
                log.debug(
                    "%s %s: proof sent (admitted)",
                    self._tag,
                    sock.peer,
                    extra=log_fields(executor=slot.executor_id, peer=sock.peer),
                )
            sock.authenticated()
            return admitted
        finally:
            if slot.admitting is sock:
                slot.admitting = None

    async def _apply(
        self,
        slot: _Slot,
        sock: WebSocket,
        result: HandshakeResult,
        offer: Offer,
        decision: Decision,
        tg: anyio.abc.TaskGroup,
    ) -> tuple[_Slot, SessionTransport, int] | None:
        """Carry out ``decision`` for ``sock`` (probing first if it says so)."""
        if isinstance(decision, Probe):
            old = slot.attached
            healthy = old is not None and await old.probe(self._limits.takeover_probe_timeout)
            if not healthy:
                log.info(
                    "%s attached socket failed the takeover probe",
                    self._tag,
                    extra=log_fields(executor=slot.executor_id, peer=sock.peer),
                )
            full, evictable = self._places.of(slot)
            view = slot.view(
                self.closing, sock, full=full, evictable=evictable, draining=self.draining
            )
            decision = decide(view, offer, probe_healthy=healthy)
        if isinstance(decision, Refuse):
            await self._refused_at_admission(sock, decision, slot)
            return None
        current = slot.live
        if isinstance(decision, Resume):
            assert current is not None
            if decision.supersede_attached and current.attached:
                old = slot.attached
                if old is not None:
                    old.local_close = (CloseCode.SUPERSEDED, "superseded by a resumed socket")
                current.detach_socket()
                await current.wait_detached()
            self._stats.resumed += 1
            return slot, current, result.peer.received
        assert isinstance(decision, Fresh)
        if decision.evict_detached:
            self._places.evict(slot, sock)
        if current is not None and decision.retire_current:
            if decision.taken_over:
                slot.taken_over.append(current.peer_runtime)
                old = slot.attached
                if old is not None:
                    reason = HandshakeFailure.TAKEN_OVER
                    old.local_close = (reason.close_code, self._taken_over_text(slot, reason))
            current.retire(FailureReason.REPLACED, "a fresh session replaced it")
            if current.attached:
                await current.wait_detached()
        transport = SessionTransport(
            result.session_id, result.peer.runtime, self._limits, tg, pool=self._retention
        )
        slot.transport = transport
        self._sessions_begun += 1
        slot.since = self._sessions_begun
        self._stats.fresh_sessions += 1
        for listener in list(self._listeners):
            listener(transport, result)
        return slot, transport, 0

    @staticmethod
    def _taken_over_text(slot: _Slot, reason: HandshakeFailure) -> str:
        if isinstance(slot.controller, str):
            return "another process with this controller_id took over"
        return reason.description

    async def _refused_at_admission(self, sock: WebSocket, refusal: Refuse, slot: _Slot) -> None:
        if refusal.reason is HandshakeFailure.SUPERSEDED:
            if refusal == BUSY:
                self._stats.admissions_busy += 1
            else:
                self._stats.takeovers_refused += 1
        elif refusal.reason is HandshakeFailure.DRAINING:
            self._stats.sessions_refused_draining += 1
        elif refusal.reason is HandshakeFailure.CONTROLLERS_FULL:
            self._stats.controllers_refused += 1
            refusal = dataclasses.replace(refusal, detail=self._places.full_detail())
        elif refusal.reason is HandshakeFailure.TAKEN_OVER:
            refusal = dataclasses.replace(
                refusal, detail=self._taken_over_text(slot, refusal.reason)
            )
        await self._refuse(sock, refusal, controller=slot.label)

    async def _refuse(
        self, sock: WebSocket, refusal: Refuse, *, controller: str | None = None
    ) -> None:
        # A full worker is the operator's business (more controllers than it was sized for):
        # a warning, rate-limited as every line a peer can cause.
        full = refusal.reason is HandshakeFailure.CONTROLLERS_FULL
        self._peer_log.log(
            peer_host(sock.peer),
            refusal.reason.name,
            "%s %s: refused%s: %s",
            self._tag,
            sock.peer,
            f" controller {peer_text(controller)}" if controller is not None else "",
            refusal.detail,
            extra=log_fields(
                peer=sock.peer, close_code=refusal.reason.close_code, controller=controller
            ),
            level=logging.WARNING if full else logging.INFO,
        )
        code = refusal.reason.close_code
        sock.local_close = (code, refusal.detail)
        await sock.close(code, refusal.detail)
