"""A socket's handshake handed to admission, and its attachment returned (docs/design.md#link).

Theory of operation
-------------------
The listener (for each upgraded socket) and the dial loop (for each dialed one) call
:meth:`Authentication.authenticate` under the handshake deadline. It runs the
:class:`~garcon_link.endpoint._handshaking.Handshaker`'s exchange -- listening, the peer's hello
is read first and answered with the resume offer of the slot it claims (a hello of our own role
goes to the hosted link's authentication, :attr:`Authentication.guest`); dialing, our hello goes
first with our slot's resume offer -- then hands the verified handshake to
:class:`~garcon_link.endpoint._admitting.Admission`. An admitted socket comes back as a callable
that runs its attachment (:meth:`~garcon_link.endpoint._attaching.Attachments.run`); a refused,
failed or lost one as ``None``, closed with its cause. A dialed socket the peer closed with 4010
before admitting us is the dialer's refusal (``DRAINING``) until a handshake completes.

The authentication holds the link's parts, never the link: the link sets :attr:`tg` when its
tasks run, and :attr:`guest` when it hosts another link.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import anyio.abc

from ..core.admission import SlotKey
from ..core.handshake import Handshake, peek_hello
from ..core.wire import CloseCode, Role
from ..errors import HandshakeError, HandshakeFailure
from ..limits import Limits
from ..logs import peer_text
from ..net.ws import Admitted, LinkStatistics, SocketGone, WebSocket
from ._admitting import Admission
from ._attaching import Attachments
from ._handshaking import Handshaker
from ._slots import _Slot

__all__ = ["Authentication"]


class Authentication:
    """The handshake and admission of a link's sockets.

    Args:
        slots: the link's slot table (read: the resume offer of a claimed slot).
        handshaker: the link's hello and proof exchange.
        admission: the link's admission of a verified socket.
        attachments: the link's attached sockets (an admitted socket's attachment).
        limits: the link's bounds.
        stats: the link's counters (``handshakes_completed``).
        role: the link's role (a hello of the same role is the guest's).
        runtime_id: this process's runtime id (a listener's resume offer).
        executor_id: the executor a dialing link serves.
        refused: the dialer's record of a refusal a redial will not heal.
        handshake_completed: tells the dialer a handshake completed.
    """

    def __init__(
        self,
        slots: dict[SlotKey, _Slot],
        handshaker: Handshaker,
        admission: Admission,
        attachments: Attachments,
        limits: Limits,
        stats: LinkStatistics,
        *,
        role: Role,
        runtime_id: bytes,
        executor_id: str | None,
        refused: Callable[[HandshakeFailure, str, str], None],
        handshake_completed: Callable[[], None],
    ) -> None:
        self._slots = slots
        self._handshaker = handshaker
        self._admission = admission
        self._attachments = attachments
        self._limits = limits
        self._stats = stats
        self._role = role
        self._runtime_id = runtime_id
        self._executor_id = executor_id
        self._refused = refused
        self._handshake_completed = handshake_completed
        self.tg: anyio.abc.TaskGroup | None = None
        """The link's task group, once its tasks run (where a fresh session runs its timers)."""
        self.guest: Authentication | None = None
        """The hosted link's authentication: every hello of our own role goes to it."""

    async def incoming(self, sock: WebSocket) -> Admitted | None:
        """:meth:`authenticate` for a socket the listener upgraded."""
        return await self.authenticate(sock, listening=True)

    async def authenticate(
        self, sock: WebSocket, *, listening: bool = False, first: bytes | None = None
    ) -> Admitted | None:
        """Exchange hello and proof, then admit the peer (the caller bounds all of it by the
        handshake deadline).

        Listening, the peer's hello is read first and our proof is held until the peer is
        admitted (:meth:`Admission.admit`); dialing, our hello goes first and our proof as soon
        as we have the listener's hello, so nothing deadlocks.
        """
        shake = self._handshaker
        hs: Handshake | None = None
        known = True
        try:
            if listening:
                if first is None:
                    first = await shake.receive_frame(sock)
                    if first is None:
                        return None
                claimed = peek_hello(first, max_frame_bytes=self._limits.max_handshake_frame_bytes)
                guest = self.guest
                if guest is not None and claimed.role is self._role:
                    # A peer of our own role: the hosted link's (host()).
                    return await guest.authenticate(sock, listening=True, first=first)
                slot = self._slots.get(self._admission.slot_key(claimed))
                offer = slot.offer_to(claimed, self._runtime_id) if slot is not None else None
                hs, key, known = await shake.answer(sock, first, claimed, offer)
            else:
                assert self._executor_id is not None
                slot = self._slots.get((self._executor_id, None))
                hs, key = await shake.greet(sock, slot.resume_offer() if slot is not None else None)
            result = await shake.complete(sock, hs)
            if result is None:
                self._refused_draining(sock)
                return None
        except HandshakeError as exc:
            unknown = hs.local_hello.executor if not known and hs is not None else None
            await shake.failed(sock, exc, unknown)
            return None
        except SocketGone:
            await sock.abort()
            return None
        except Exception as exc:
            await shake.unexpected(sock, exc)
            return None
        self._stats.handshakes_completed += 1
        self._handshake_completed()
        assert self.tg is not None
        admitted = await self._admission.admit(sock, result, self.tg)
        if admitted is None:
            return None
        slot, transport, peer_received = admitted
        attachments = self._attachments
        return functools.partial(
            attachments.run, sock, slot, transport, peer_received, result.resume, key
        )

    def _refused_draining(self, sock: WebSocket) -> None:
        """A dialed socket the peer closed with 4010 before admitting us: the worker drains,
        the link's refusal until a handshake completes (the loop dials on, for its restart)."""
        close = sock.peer_close
        if sock.dialed and close is not None and close[0] == CloseCode.DRAINING:
            self._refused(
                HandshakeFailure.DRAINING,
                f"{sock.peer} closed with {close[0]} ({peer_text(close[1])})",
                "it was told to stop; a restarted worker admits new sessions again",
            )
