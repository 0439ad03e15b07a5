"""The hello and proof exchange on one socket (docs/design.md#handshake).

Theory of operation
-------------------
The messages and their checks are :mod:`garcon_link.core.handshake` (sans-IO); a
:class:`Handshaker` carries them over a socket for its link. The dialer sends its ``hello`` at
once (:meth:`Handshaker.greet`). The listener first reads the dialer's hello, takes the executor
id it *claims* and sends its own hello (:meth:`Handshaker.answer`), which echoes the claimed id;
only then does it look up the claimed executor's key (a file read for a keyring), so the hello
leaves after the same work whether the id is enrolled or not. An id the listener does not know
(not enrolled, revoked, or not its configured one) gets a random key, so the peer's proof fails
exactly as a wrong secret does: same close code (4001), same reason, same messages exchanged.
The listener's proof is held on the socket (``held_proof``) for the link to send once it has
admitted the peer. :meth:`Handshaker.complete` exchanges the rest until the handshake has a
verified result.

Each frame read while handshaking is bounded (``max_handshake_frame_bytes``; oversize and
malformed frames are handshake failures) and, listening, is one step of the listener's per-turn
handshake budget. A peer that closes mid-handshake is counted (``handshakes_abandoned``); its
close code may tell our end that a redial will not heal (4001, 4002, 4003: the link's dialer
records the refusal) or that another runtime took over (4009). A failed handshake is counted by
reason, logged rate-limited (as every unauthenticated socket's events) and closed with the
reason's close code.

A handshaker reaches its link only through the callables it is given: the dialer's refusal and
takeover records, the link's unexpected-error mapping and its ``last_error``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ..core.handshake import Handshake, HandshakeResult, Hello, ResumeOffer, derive_key
from ..core.wire import CloseCode, Role
from ..errors import FrameTooLarge, HandshakeError, HandshakeFailure, MalformedFrame
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_host, peer_text
from ..net.ws import LinkStatistics, WebSocket, close_code, describe_close

log = logging.getLogger("garcon_link.link")  # the link's logger: the name users configure (README)

UNEXPECTED = "unexpected error"
"""The close reason a peer gets for a socket ended by an unexpected error (details are logged)."""

WILL_NOT_HEAL: dict[int, tuple[HandshakeFailure, str]] = {
    # close code -> (reason, what the operator must fix); a redial cannot change any of these.
    4001: (
        HandshakeFailure.AUTH_FAILED,
        "both ends must use the same secret (secret_file), and the executor id must be the one "
        "the other end serves (a fleet controller or gateway needs keys/<executor_id>.secret; "
        "a gateway holds a caller's key as callers/<caller_id>.secret)",
    ),
    4002: (HandshakeFailure.VERSION_MISMATCH, "upgrade garcon-link on one end to match the other"),
    4003: (
        HandshakeFailure.ROLE_CONFLICT,
        'one end must be role = "worker" and the other role = "controller"',
    ),
}
"""Refusals a redial will not heal: reported at once to whoever waits."""


class Handshaker:
    """A link's side of the handshake, on each of its sockets in turn.

    Args:
        role: the link's role.
        runtime_id: the link's runtime id.
        controller_id: a controller's name for itself (sent in its hello).
        executor_id: the one executor the link serves (``None`` with ``keys``).
        key: that executor's derived key (``None`` with ``keys``).
        keys: a listener's ``executor_id -> secret | None`` lookup, called with claimed ids.
        limits: the link's bounds.
        stats: the link's counters.
        tag: the link's log prefix.
        peer_log: the rate limiter of unauthenticated sockets' log lines.
        refused: the link's record of a refusal a redial will not heal.
        taken_over: the link's record of a takeover (a peer's 4009).
        peer_failed: the link's mapping of an unexpected exception (logged, counted).
        note_error: sets the link's ``last_error``.
    """

    def __init__(
        self,
        *,
        role: Role,
        runtime_id: bytes,
        controller_id: str | None,
        executor_id: str | None,
        key: bytes | None,
        keys: Callable[[str], bytes | None] | None,
        limits: Limits,
        stats: LinkStatistics,
        tag: str,
        peer_log: PeerLogLimiter,
        refused: Callable[[HandshakeFailure, str, str], None],
        taken_over: Callable[[str], None],
        peer_failed: Callable[[str, Exception], str],
        note_error: Callable[[str], None],
    ) -> None:
        self._role = role
        self._runtime_id = runtime_id
        self._controller_id = controller_id
        self._executor_id = executor_id
        self._key = key
        self._keys = keys
        self._limits = limits
        self._stats = stats
        self._tag = tag
        self._peer_log = peer_log
        self._refused = refused
        self._taken_over = taken_over
        self._peer_failed = peer_failed
        self._note_error = note_error

    def key_for(self, executor_id: str) -> bytes | None:
        """The handshake key of ``executor_id`` (a claimed, unauthenticated id), or None."""
        if self._keys is None:
            return self._key if executor_id == self._executor_id else None
        try:
            secret = self._keys(executor_id)
            return derive_key(secret) if secret is not None else None
        except Exception as exc:  # a lookup must not fail the listener; the peer is refused
            self._peer_failed(f"key lookup for {peer_text(executor_id)}", exc)
            return None

    def _handshake(
        self, executor_id: str, key: bytes | None, resume: ResumeOffer | None
    ) -> Handshake:
        return Handshake(
            role=self._role,
            executor_id=executor_id,
            key=key,
            runtime=self._runtime_id,
            nonce=os.urandom(32),
            resume=resume,
            max_frame_bytes=self._limits.max_handshake_frame_bytes,
            controller=self._controller_id,
        )

    async def receive_frame(self, sock: WebSocket) -> bytes | None:
        """The peer's next handshake frame, or None when it closed (the socket is aborted)."""
        try:
            frame = await sock.receive_message()
        except FrameTooLarge as exc:
            raise HandshakeError(HandshakeFailure.OVERSIZE, str(exc)) from exc
        except MalformedFrame as exc:
            raise HandshakeError(HandshakeFailure.MALFORMED, str(exc)) from exc
        if frame is not None and sock.turns is not None:
            # Listening: what this frame leads to (our hello, or the proof's check and the
            # admission) is one step of the listener's per-turn handshake budget.
            await sock.turns.step()
        if frame is None:
            why = describe_close(sock)
            self._note_error(f"peer closed during handshake ({why})")
            self._stats.handshakes_abandoned += 1
            self._peer_log.log(
                peer_host(sock.peer),
                "closed",
                "%s %s: handshake ended: %s",
                self._tag,
                sock.peer,
                why,
                extra=log_fields(
                    executor=self._executor_id, peer=sock.peer, close_code=close_code(sock)
                ),
                logger=log,
            )
            if sock.peer_close is not None and sock.dialed:
                # Only a dialer was refused: a listener's peer has proved nothing yet, and
                # its close cannot stop this link or stand as its refusal.
                code, reason = sock.peer_close
                if code == CloseCode.TAKEN_OVER:
                    self._taken_over(reason)
                elif code in WILL_NOT_HEAL:
                    failure, fix = WILL_NOT_HEAL[code]
                    self._refused(
                        failure, f"{sock.peer} closed with {code} ({peer_text(reason)})", fix
                    )
            await sock.abort()
        return frame

    async def answer(
        self, sock: WebSocket, first: bytes, claimed: Hello, offer: ResumeOffer | None
    ) -> tuple[Handshake, bytes, bool]:
        """Listening: send our hello to the dialer's ``first`` (``claimed``, not yet verified)
        and hold our proof on ``sock``. Returns the handshake, the key it uses and whether the
        claimed executor is known (else the key is random)."""
        hs = self._handshake(claimed.executor, None, offer)
        await sock.send_message(hs.hello_frame())
        # The key only now, after the hello: reading it (a file for a keyring) takes
        # longer when it exists, and the hello must not wait for that.
        key = self.key_for(claimed.executor)
        known = True
        if key is None:
            # Not enrolled, revoked, or not ours: a random key makes the peer's proof
            # fail exactly as a wrong secret does (same code, reason and exchange).
            known = False
            key = os.urandom(32)
        hs.set_key(key)
        proof = hs.receive(first)
        assert proof is not None  # a valid hello always yields our proof
        sock.held_proof = proof
        return hs, key, known

    async def greet(self, sock: WebSocket, resume: ResumeOffer | None) -> tuple[Handshake, bytes]:
        """Dialing: send our hello (offering ``resume``). Returns the handshake and its key."""
        assert self._executor_id is not None and self._key is not None
        key = self._key
        hs = self._handshake(self._executor_id, key, resume)
        await sock.send_message(hs.hello_frame())
        return hs, key

    async def complete(self, sock: WebSocket, hs: Handshake) -> HandshakeResult | None:
        """Exchange frames until ``hs`` has a verified result (None: the peer closed)."""
        log.debug("%s %s: hello sent", self._tag, sock.peer, extra=log_fields(peer=sock.peer))
        while hs.result is None:
            frame = await self.receive_frame(sock)
            if frame is None:
                return None
            reply = hs.receive(frame)
            if reply is not None:
                await sock.send_message(reply)
                log.debug(
                    "%s %s: proof sent", self._tag, sock.peer, extra=log_fields(peer=sock.peer)
                )
        return hs.result

    async def failed(self, sock: WebSocket, exc: HandshakeError, unknown: str | None) -> None:
        """Count, log and close a failed handshake (``unknown``: the claimed executor id when
        it is not enrolled here)."""
        self._stats.count_handshake_failure(exc.reason)
        why = str(exc)
        if unknown is not None:
            why += f" (executor {peer_text(unknown)} is not enrolled here)"
        self._note_error(why)
        self._peer_log.log(
            peer_host(sock.peer),
            exc.reason.name,
            "%s %s: handshake refused: %s",
            self._tag,
            sock.peer,
            why,
            extra=log_fields(executor=self._executor_id, peer=sock.peer, close_code=exc.close_code),
            logger=log,
        )
        if exc.close_code in WILL_NOT_HEAL:
            _failure, fix = WILL_NOT_HEAL[exc.close_code]
            self._refused(exc.reason, f"we refused {sock.peer}: {exc}", fix)
        await sock.close(exc.close_code, exc.reason.description)

    async def unexpected(self, sock: WebSocket, exc: Exception) -> None:
        """An exception nobody expected while handshaking: the peer's failure (4008)."""
        self._peer_failed(sock.peer, exc)
        sock.local_close = (CloseCode.PROTOCOL_ERROR, UNEXPECTED)
        await sock.close(CloseCode.PROTOCOL_ERROR, UNEXPECTED)
