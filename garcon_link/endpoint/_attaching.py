"""An admitted socket's life on its slot: attached, pumped, detached, closed (docs/design.md#link).

Theory of operation
-------------------
The link admits a socket (its handshake verified, :func:`~garcon_link.core.admission.decide`
applied) and hands it here with the session to carry. :meth:`Attachments.run` marks it the
slot's attached socket -- with no await since the admission, so the slot sees it attached before
any other socket of its executor can be admitted -- and runs the session's pump
(:meth:`~garcon_link.endpoint.transport.SessionTransport.run`) beside the socket's heartbeat
(:mod:`garcon_link.endpoint._heartbeat`) until either ends the socket. An exception nobody
expected while pumping is that peer's failure: the link's ``peer_failed`` logs and counts it and
the session, which may be inconsistent after it, is retired (``MALFORMED_PACKET``).

On detaching, the slot records the order of its detachment (which detached session a listening
worker evicts first). A peer's close with 4009 tells the link's dialer it was taken over. The
socket is then closed with its cause: ours if we ended it (4007, 1009, 4004...), the session's
failure if it was retired, else a plain end (1000) -- never 1001, which a peer still reading
would take for a shutdown and retire the session. At most ``max_authenticated_sockets`` detached
sockets wait for the peer's close frame; past them the close frame is sent without waiting
(``closes_not_drained``), so a key holder replacing its own socket in a loop cannot keep one
descriptor per replacement for ``close_timeout``.

:attr:`Attachments.count` is the number of attached sockets: what the listener's
authenticated-socket cap counts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import anyio

from ..core.wire import CloseCode
from ..errors import FailureReason, SessionFailed
from ..limits import Limits
from ..logs import log_fields, peer_text
from ..net.backend import on_asyncio
from ..net.ws import LinkStatistics, WebSocket, close_code, describe_close
from ._heartbeat import Heartbeat
from ._slots import _Slot
from .transport import SessionTransport

log = logging.getLogger("garcon_link.link")  # the link's logger: the name users configure (README)

"""Starts a task in the link's task group (a heartbeat's ping that waits for the socket);
whether it did."""


class Attachments:
    """The sockets attached to a link's slots.

    Args:
        limits: the link's bounds.
        stats: the link's counters.
        tag: the link's log prefix.
        heartbeat: the heartbeat to run beside each attached socket's pump.
        peer_failed: the link's mapping of an unexpected exception (logged, counted).
        taken_over: the link's record of a takeover (a peer's 4009).
    """

    def __init__(
        self,
        limits: Limits,
        stats: LinkStatistics,
        *,
        tag: str,
        heartbeat: Heartbeat,
        peer_failed: Callable[[str, Exception], str],
        taken_over: Callable[[str], None],
    ) -> None:
        self._limits = limits
        self._stats = stats
        self._tag = tag
        self._heartbeat = heartbeat
        self._peer_failed = peer_failed
        self._taken_over = taken_over
        self.count = 0
        """Sockets attached to a slot (what the authenticated cap counts)."""
        self._detachments = 0  # sockets detached from a slot (orders slots by detachment)
        self._closing_sockets = 0  # detached sockets waiting for the peer's close frame

    async def _pump(self, sock: WebSocket, transport: SessionTransport, peer_received: int) -> None:
        try:
            await transport.run(sock, peer_received)
        except SessionFailed:
            pass  # stored as transport.failure; the close below reports it
        except Exception as exc:
            # That peer's failure, not the link's. What the session holds may be inconsistent
            # after it, so it is retired (a broken machine stays broken).
            why = self._peer_failed(sock.peer, exc)
            transport.retire(FailureReason.MALFORMED_PACKET, why)

    async def run(
        self,
        sock: WebSocket,
        slot: _Slot,
        transport: SessionTransport,
        peer_received: int,
        resumed: bool,
        key: bytes,
    ) -> None:
        """Attach ``sock`` to ``slot`` carrying ``transport`` (the peer has received up to
        ``peer_received``; ``resumed``: the handshake resumed the session), pump it until it
        ends, detach and close it; on any exit (cancellation too) the socket is closed.

        What the link's listener runs for an admitted socket, as a ``functools.partial`` of this
        method: a partial of a bound method keeps three GC-tracked objects for the socket's life,
        a closure over the same arguments eleven (its cells, the handshake's result)."""
        try:
            # Nothing awaited between the admission and here: the slot sees this socket attached
            # before any other socket of its executor can be admitted.
            slot.key = key
            slot.attached = sock
            log.info(
                "%s %s: attached executor=%s%s session=%s resumed=%s",
                self._tag,
                sock.peer,
                slot.executor_id,
                f" controller={peer_text(slot.label)}" if slot.label is not None else "",
                transport.session_id.hex()[:12],
                resumed,
                extra=log_fields(
                    executor=slot.executor_id,
                    session=transport.session_id,
                    peer=sock.peer,
                    controller=slot.label,
                ),
            )
            self.count += 1
            try:
                if on_asyncio():
                    # The heartbeat as loop timers: no task (nor task group) per attachment.
                    with anyio.CancelScope() as scope:
                        beating = self._heartbeat.start(slot, sock, scope)
                        try:
                            await self._pump(sock, transport, peer_received)
                        finally:
                            beating.stop()
                else:
                    async with anyio.create_task_group() as tg:
                        # The heartbeat ends in a scope of its own, so that its task returns
                        # instead of ending in a CancelledError (anyio's task group keeps that in a
                        # reference cycle with its traceback: garbage for the cyclic collector at
                        # every detach).
                        beat = anyio.CancelScope()
                        tg.start_soon(self._heartbeat.run, slot, sock, tg.cancel_scope, beat)
                        await self._pump(sock, transport, peer_received)
                        beat.cancel()
            finally:
                self.count -= 1
                if slot.attached is sock:
                    slot.attached = None
                    self._detachments += 1
                    slot.detached = self._detachments
            if sock.teardowns is not None and anyio.current_effective_deadline() != -math.inf:
                # Listening, and not cancelled (a shutdown closes at once): the rest of the end
                # (the log line, the close frame, the socket's close) is a teardown step of its own,
                # in line behind the other lost sockets', as the socket's end was.
                await sock.teardowns.step()
            if (
                sock.dialed
                and sock.peer_close is not None
                and sock.peer_close[0] == CloseCode.TAKEN_OVER
            ):
                # A listener takes over; a dialer's 4009 to a listener means nothing.
                self._taken_over(sock.peer_close[1])
            # The cause: ours if we ended it (4007, 1009, 4004...), the session's failure if it was
            # retired, else a plain end -- not 1001, which a peer still reading would take for a
            # shutdown and retire the session.
            if sock.local_close is None and sock.peer_close is None:
                failure = transport.failure
                sock.local_close = (
                    (failure.close_code, str(failure))
                    if failure is not None
                    else (int(CloseCode.NORMAL), "socket ended")
                )
            log.info(
                "%s %s: socket %s",
                self._tag,
                sock.peer,
                describe_close(sock),
                extra=log_fields(
                    executor=slot.executor_id,
                    session=transport.session_id,
                    peer=sock.peer,
                    close_code=close_code(sock),
                    controller=slot.label,
                ),
            )
            code, cause = sock.local_close or (0, "")
            # A detached socket no longer counts as attached; while it waits for the peer's close
            # frame it is one of at most max_authenticated_sockets such sockets: past them the close
            # frame is sent without waiting (a key holder replacing its own socket in a loop would
            # otherwise keep one descriptor per replacement for close_timeout).
            drain = self._closing_sockets < self._limits.max_authenticated_sockets
            if not drain:
                self._stats.closes_not_drained += 1
            self._closing_sockets += 1
            try:
                await sock.close(
                    int(code) or CloseCode.NORMAL, cause or "socket ended", drain=drain
                )
            finally:
                self._closing_sockets -= 1
        finally:
            await sock.abort()  # a no-op after a close; closes the socket on cancellation
