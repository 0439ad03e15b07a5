"""A link's dial loop, and what a dialer keeps of being refused (docs/design.md#dialing).

Theory of operation
-------------------
One :class:`Dialer` per link. On a dialing link, :meth:`Dialer.run` is the dial loop: connect
(``connect_timeout``), upgrade, hand the socket to the link's handshake and admission (the
``authenticate`` callable), run the attachment it returns, repeat. Between attempts the delay
comes from :func:`~garcon_link.core.admission.backoff` -- first retry immediate, then full-jitter
exponential capped at ``backoff_max``, reset after a socket stayed up ``backoff_reset_after``.
Upgrade, handshake and admission together are bounded by ``handshake_timeout``.

A failed dial (:class:`~garcon_link.errors.LinkError`) is counted (``dials_refused`` and
``dials_refused_in_a_row`` when nothing of our scheme answered: :class:`Unreachable`), kept as
:attr:`Dialer.last_dial_error`, told to the dial listeners and logged at most once per
``log_interval`` per target and kind of failure (a :class:`~garcon_link.logs.PeerLogLimiter`);
any other exception is the peer's failure (the link's ``peer_failed``), never the loop's: it
dials again.

The dialer also keeps what the link's handshakes learn about this end's standing, for every
link (a listening link's handshakes report here too):

- :meth:`Dialer.refused`: a refusal a redial will not heal (wrong secret or executor id,
  version, role), kept as :attr:`Dialer.refusal` with the fix in its message and reported to the
  refusal listeners; logged once per reason until a handshake completes
  (:meth:`Dialer.handshake_completed`). Only a dialing link records one: a listener cannot tell
  its own peers from strangers. The loop keeps dialing (the other end may be fixed meanwhile).
- :meth:`Dialer.was_taken_over`: the peer closed with 4009, another runtime of our executor (or
  controller) took over. :attr:`Dialer.taken_over` is set, every session of the link is retired
  (``TAKEN_OVER``), :attr:`Dialer.stopped` is set and the loop stops for good.

The dialer reaches its link only through the callables it is given: whether the link is closing,
its handshake, its unexpected-error mapping, its ``last_error`` and the retirement of its
sessions.
"""

from __future__ import annotations

import logging
import random
import ssl
from collections.abc import Callable

import anyio
import anyio.lowlevel

from ..core.admission import backoff
from ..core.wire import Role
from ..errors import (
    AuthenticationError,
    FailureReason,
    HandshakeError,
    HandshakeFailure,
    LinkError,
    Unreachable,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields
from ..net.addresses import DialTarget
from ..net.ws import Admitted, Authenticate, LinkStatistics, client_upgrade, close_stream, connect

log = logging.getLogger("garcon_link.link")  # the link's logger: the name users configure (README)


def dial_peer(target: DialTarget | None) -> str | None:
    """The ``gl_peer`` log field of a dial target (``host:port``, as its socket's peer)."""
    return None if target is None else f"{target.host}:{target.port}"


def _failure_kind(exc: LinkError) -> str:
    """The limiter's reason for a failed dial: our own word for its kind, never its text."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, HandshakeFailure):
        return f"{type(exc).__name__} {reason.name}"
    return type(exc).__name__


class Dialer:
    """A link's dial loop (:meth:`run`, a dialing link only) and its refusal and takeover state.

    Args:
        target: where to dial; ``None`` on a listening or hosted link (no loop, no refusals
            recorded; a takeover is still recorded).
        limits: the link's bounds.
        stats: the link's counters.
        rng: the source of the backoff's jitter.
        ssl_context: the client context for ``wss://``.
        tag: the link's log prefix.
        role: the link's role (a takeover's log line names a controller's ``controller_id``).
        executor_id: the executor the link serves (log fields).
        controller_id: a controller's name for itself.
        closing: whether the link is closing (the loop stops).
        authenticate: the link's handshake and admission of a dialed socket.
        peer_failed: the link's mapping of an unexpected exception (logged, counted).
        note_error: sets the link's ``last_error``.
        retire_sessions: retires every session of the link with a reason and a detail.
    """

    def __init__(
        self,
        target: DialTarget | None,
        *,
        limits: Limits,
        stats: LinkStatistics,
        rng: random.Random,
        ssl_context: ssl.SSLContext | None,
        tag: str,
        role: Role,
        executor_id: str | None,
        controller_id: str | None,
        closing: Callable[[], bool],
        authenticate: Authenticate,
        peer_failed: Callable[[str, Exception], str],
        note_error: Callable[[str], None],
        retire_sessions: Callable[[FailureReason, str], None],
    ) -> None:
        self._target = target
        self._limits = limits
        self._stats = stats
        self._rng = rng
        self._ssl = ssl_context
        self._tag = tag
        self._role = role
        self._executor_id = executor_id
        self._controller_id = controller_id
        self._closing = closing
        self._authenticate = authenticate
        self._peer_failed = peer_failed
        self._note_error = note_error
        self._retire_sessions = retire_sessions
        self.taken_over: str | None = None
        """Set (the cause) when another process with this executor id took over: dialing
        stopped."""
        self.refusal: HandshakeError | None = None
        """The latest refusal of ours that a redial will not heal (wrong secret or executor id,
        version, role), with the fix in its message; cleared by a completed handshake. The dial
        loop keeps dialing (the other end may be fixed meanwhile)."""
        self._refusal_listeners: list[Callable[[HandshakeError], None]] = []
        self.last_dial_error: str | None = None
        """Why the latest dial attempt failed (``None`` once a dial attached a socket): what a
        caller waiting for readiness reports (a dialing link only)."""
        self._dial_listeners: list[Callable[[LinkError], None]] = []
        # A peer that stays down fails every dial: one WARNING per target and kind of failure
        # per ``log_interval``, the next one saying how many were left out.
        self._dial_log = PeerLogLimiter(
            log, interval=limits.log_interval, max_lines=limits.max_log_lines
        )
        self.stopped = anyio.Event()
        """Set when the link gave up for good (:attr:`taken_over`)."""

    # ------------------------------------------------------------------ listeners

    def on_refusal(self, listener: Callable[[HandshakeError], None]) -> Callable[[], None]:
        """Call ``listener(error)`` at each refusal a redial will not heal (see :attr:`refusal`).
        Returns an unsubscribe callable."""
        self._refusal_listeners.append(listener)
        return lambda: (
            self._refusal_listeners.remove(listener)
            if listener in self._refusal_listeners
            else None
        )

    def on_dial_failed(self, listener: Callable[[LinkError], None]) -> Callable[[], None]:
        """Call ``listener(error)`` after each failed dial attempt. Returns an unsubscribe
        callable."""
        self._dial_listeners.append(listener)
        return lambda: (
            self._dial_listeners.remove(listener) if listener in self._dial_listeners else None
        )

    # ------------------------------------------------------------------ standing

    def handshake_completed(self) -> None:
        """A handshake completed: the latest refusal no longer stands."""
        self.refusal = None

    def refused(self, reason: HandshakeFailure, detail: str, fix: str) -> None:
        """Record a refusal that will not heal (dialing only: a listener cannot tell its own
        peers from strangers) and report it once per reason until a handshake succeeds."""
        target = self._target
        if target is None:
            return
        error: HandshakeError = (
            AuthenticationError(f"{detail}; {fix}")
            if reason is HandshakeFailure.AUTH_FAILED
            else HandshakeError(reason, f"{detail}; {fix}")
        )
        first = self.refusal is None or self.refusal.reason is not reason
        self.refusal = error
        if first:
            log.warning(
                "%s %s refused us: %s",
                self._tag,
                target.url,
                error,
                extra=log_fields(executor=self._executor_id, peer=dial_peer(target)),
            )
        for listener in list(self._refusal_listeners):
            listener(error)

    def was_taken_over(self, reason: str) -> None:
        """The peer says another runtime of our executor took over: stop for good."""
        if self.taken_over is not None:
            return
        self.taken_over = reason or "another process with this executor id took over"
        self._note_error(f"taken over: {self.taken_over}")
        self._stats.taken_over += 1
        if self._role is Role.CONTROLLER and self._controller_id is not None:
            log.error(
                "%s another process with controller_id %r took over its session on executor %r "
                "(%s); not redialing: two processes claim one controller_id",
                self._tag,
                self._controller_id,
                self._executor_id,
                self.taken_over,
                extra=log_fields(executor=self._executor_id),
            )
        else:
            log.error(
                "%s another process took over executor %r (%s); not redialing: two processes "
                "claim one executor id",
                self._tag,
                self._executor_id,
                self.taken_over,
                extra=log_fields(executor=self._executor_id),
            )
        self._retire_sessions(FailureReason.TAKEN_OVER, self.taken_over)
        self.stopped.set()

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Dial until the link closes or is taken over."""
        target = self._target
        assert target is not None
        limits = self._limits
        delays = backoff(limits, self._rng)
        while not self._closing() and self.taken_over is None:
            self._stats.dial_attempts += 1
            up_since: float | None = None
            try:
                admitted = await self._dial_once(target)
                if admitted is not None:
                    up_since = anyio.current_time()
                    self.last_dial_error = None
                    await admitted()
            except LinkError as exc:
                self._dial_failed(target, exc)
            except Exception as exc:
                self._peer_failed(target.url, exc)  # never the dial loop's failure: dial again
            if self._given_up():
                return
            if up_since is not None and (
                anyio.current_time() - up_since >= limits.backoff_reset_after
            ):
                delays = backoff(limits, self._rng)
            delay = next(delays)
            if delay:
                log.debug(
                    "%s next dial in %.2fs",
                    self._tag,
                    delay,
                    extra=log_fields(executor=self._executor_id),
                )
                await anyio.sleep(delay)
            else:
                await anyio.lowlevel.checkpoint()

    def _given_up(self) -> bool:
        # A call, not ``self.taken_over`` in the loop: the awaits above may set it, and a type
        # checker's narrowing of the loop's condition does not see that.
        return self.taken_over is not None

    def _dial_failed(self, target: DialTarget, exc: LinkError) -> None:
        why = str(exc)
        self._note_error(why)
        self.last_dial_error = why
        if isinstance(exc, Unreachable):  # WrongScheme too: a redial meets the same server
            self._stats.dials_refused += 1
            self._stats.dials_refused_in_a_row += 1
        else:  # it connected and found something of its scheme
            self._stats.dials_refused_in_a_row = 0
        peer = dial_peer(target)
        assert peer is not None
        self._dial_log.log(
            peer,
            _failure_kind(exc),
            "%s dial %s failed: %s",
            self._tag,
            target.url,
            why,
            extra=log_fields(executor=self._executor_id, peer=peer),
        )
        for listener in list(self._dial_listeners):
            listener(exc)

    async def _dial_once(self, target: DialTarget) -> Admitted | None:
        limits = self._limits
        stream = await connect(target, limits)
        try:
            with anyio.move_on_after(limits.handshake_timeout) as deadline:
                sock = await client_upgrade(
                    stream, target, ssl_context=self._ssl, limits=limits, stats=self._stats
                )
                self._stats.dials_refused_in_a_row = 0
                return await self._authenticate(sock)
        except BaseException:
            # Shutdown (cancellation) included: never drop a connected stream unclosed.
            await close_stream(stream)
            raise
        await close_stream(stream)
        if deadline.cancelled_caught:
            self._stats.count_handshake_failure(HandshakeFailure.TIMEOUT)
            peer = f"{target.host}:{target.port}"
            raise LinkError(f"upgrade and handshake with {peer} exceeded the deadline")
        return None
