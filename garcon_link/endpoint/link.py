"""The session endpoint: authenticated sockets, one session slot per executor (docs/design.md#link).

The decisions are pure functions elsewhere (:func:`~garcon_link.core.admission.decide`,
:func:`~garcon_link.core.heartbeat.heartbeat_step`, :func:`~garcon_link.core.admission.backoff`);
the link's parts are beside it: one slot :mod:`garcon_link.endpoint._slots`, a socket's handshake
handed to admission :mod:`garcon_link.endpoint._authenticating`, the hello and proof exchange
:mod:`garcon_link.endpoint._handshaking`, the admission of a verified socket to its slot
:mod:`garcon_link.endpoint._admitting`, the dial loop :mod:`garcon_link.endpoint._dialing`, an
attached socket's life :mod:`garcon_link.endpoint._attaching` and its heartbeat
:mod:`garcon_link.endpoint._heartbeat`, a listening worker's ``max_controllers`` places
:mod:`garcon_link.endpoint._places`, the latest failure and the mapping of an unexpected one
:mod:`garcon_link.endpoint._failures`, the checks of the link's arguments and its TLS context
:mod:`garcon_link.endpoint._arguments`, one executor's view of a link
:mod:`garcon_link.endpoint._executor_link`. This module builds the parts and holds them: the slot
table, the link's lifecycle (its tasks, drain, close) and its public surface.

Theory of operation
-------------------
A :class:`WebSocketLink` is one endpoint of logical sessions: a listener or a dialer (either role
may do either). Its WebSocket sockets come from :mod:`garcon_link.net.ws` (upgrade, framing, frame
budgets, the unauthenticated-socket cap); this module authenticates them and attaches each to the
right :class:`~garcon_link.endpoint.transport.SessionTransport`. It holds one **slot** per executor
id -- that executor's logical session, its attached socket, the runtimes that were taken over -- so
one listening controller serves many executors. A link configured with one ``executor_id`` and one
secret has exactly one slot (as has every dialing link); a listening link given ``keys`` (a
lookup ``executor_id -> secret``, e.g. a :class:`~garcon_link.settings.keyring.Keyring`) creates
slots as executors authenticate, up to ``max_executors``. A *listening worker* holds one slot
per controller instead (docs/design.md#many-controllers): the controller a hello comes from is its
``controller`` (the controller's configured ``controller_id``) or, without one, its runtime, so two
controller processes are two controllers, each with its own session, admitted side by side, up to
``Limits.max_controllers`` sessions; the takeover rule and 4009 apply within one controller's slot
(the same ``controller_id`` from a new runtime).

1. **Handshake.** :class:`~garcon_link.endpoint._authenticating.Authentication` has
   :class:`~garcon_link.endpoint._handshaking.Handshaker` exchange hello and proof
   (:mod:`garcon_link.core.handshake`): the dialer's hello goes at once; the listener reads the
   dialer's hello first and answers it with its own, which advertises the session it holds for
   the claimed executor id only if the dialer's hello already names it
   (:func:`~garcon_link.core.handshake.listener_offer`, the slot's ``offer_to``): nothing of the
   listener's identity, nor whether that executor is enrolled or online, goes out before the peer
   has proved its key, and an id the listener does not know fails exactly as a wrong secret does
   (4001). A hello of the listener's own role goes to the hosted link
   (:meth:`WebSocketLink.host`). The listener sends its own proof only once it has admitted the
   peer (step 2), so a refused peer never completes a handshake and a listener never hands out a
   proof that could be reflected. Upgrade, handshake and admission must finish within
   ``handshake_timeout`` (else 4008). A refusal closes with the reason's close code.
2. **Admission** (:class:`~garcon_link.endpoint._admitting.Admission`) obeys :func:`decide`, a pure
   function of the slot (:class:`SlotView`) and the verified handshake (:class:`Offer`): ``Resume``
   iff runtimes cross-match and session ids match; else ``Fresh`` (the current session is retired,
   ``REPLACED``); the *takeover rule* -- a fresh handshake from another runtime while a socket is
   attached is refused (4004) unless that socket fails a ping probe within
   ``takeover_probe_timeout`` (``Probe``); and a runtime whose session another runtime of the same
   executor took over is refused with 4009 (``TAKEN_OVER``): two processes claim one executor id,
   which is an operator error, so the refused side stops dialing
   (:attr:`WebSocketLink.taken_over`). At most one socket per executor is being admitted at a time:
   another one that completes its handshake meanwhile is refused at once (4004), so sockets holding
   one executor's key cannot queue up. Admission runs under the handshake deadline, before the
   socket counts as authenticated: the listener's authenticated-socket cap counts only sockets
   attached to a session (``max_authenticated_sockets`` plus one per executor a keyring listener
   serves), so one executor's key holder cannot fill it. Session listeners run before a fresh
   session's first packet is processed.
3. **Attached.** :class:`~garcon_link.endpoint._attaching.Attachments` attaches the admitted
   socket to its slot and runs the session's pump beside the socket's heartbeat
   (:class:`~garcon_link.endpoint._heartbeat.Heartbeat`): pings, a resumable close (4007) after
   ``heartbeat_timeout`` of silence while the socket is being read, and with ``keys`` the
   re-read of the executor's key (a deleted key file ends the socket, 4001, and retires the
   session, ``REVOKED``); then detaches and closes it with its cause. A close from the peer
   with 1001 (shutdown), 4005, 4006, 4008 or 4009 means the peer retired the session: it is
   retired here at once, not after the grace.
4. **Dialing.** One dial loop per dialing link, :class:`~garcon_link.endpoint._dialing.Dialer`:
   connect, upgrade, then this module's handshake and admission, run, back off, repeat. The
   dialer also keeps what handshakes learn of this end's standing: a refusal a redial will not
   heal (:attr:`WebSocketLink.refusal`) and a takeover (4009: :attr:`WebSocketLink.taken_over`,
   every session retired, dialing stopped for good).

Failures
--------
Every closed socket is logged with its cause. Lower-library exceptions are classified once, in
:mod:`garcon_link.net.ws`. Any *other* exception raised while serving one peer -- a bug, here or
below, that the peer's bytes reached -- is that peer's failure, never the process's
(:meth:`~garcon_link.endpoint._failures.Failures.peer_failed`): the socket is closed (4008 while
it can still say so; the session it carried is retired), the traceback is logged and counted
(``unexpected_errors``), and the listener keeps listening and the dial loop keeps dialing.
Cancellation is not an ``Exception`` and passes. Other log records carry causes as text, never
exception objects: a handler that keeps records (a test's capture, a memory handler) would
otherwise keep every refused socket's frames and buffers alive.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import ssl
from collections.abc import Callable

import anyio
import anyio.abc

from ..core.admission import SlotKey
from ..core.handshake import derive_key
from ..core.session import RetentionPool
from ..core.wire import CloseCode, Role
from ..errors import (
    ConfigError,
    FailureReason,
    HandshakeError,
    LinkError,
)
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields
from ..net.addresses import EXECUTOR_PATH, DialTarget, is_loopback_host, parse_dial_url
from ..net.ws import (
    Admitted,
    FrameBudget,
    LinkStatistics,
    WebSocket,
    WebSocketListener,
    unauthenticated_log,
    upgrade_refusal,
)
from ._admitting import Admission, SessionListener
from ._arguments import KeyLookup, check_arguments, tls_context
from ._attaching import Attachments
from ._authenticating import Authentication
from ._dialing import Dialer
from ._executor_link import ExecutorLink
from ._failures import Failures
from ._handshaking import Handshaker
from ._heartbeat import Heartbeat
from ._places import Places
from ._slots import _Slot
from .transport import SessionTransport

__all__ = [
    "EXECUTOR_PATH",
    "ExecutorLink",
    "FrameBudget",
    "LinkStatistics",
    "WebSocketLink",
    "is_loopback_host",
    "upgrade_refusal",
]

log = logging.getLogger("garcon_link.link")  # the name users configure (README)


class WebSocketLink:
    """One endpoint: a listener on ``/executor`` or a dialer, carrying logical sessions.

    Use as an async context manager; the link runs its listener or dial loop in the background
    until :meth:`aclose` (idempotent).

    Args:
        role: this endpoint's role.
        executor_id: the one executor this link serves (required when dialing; with ``secret``).
        secret: that executor's shared secret (>= 32 bytes); only a derived key is kept.
        keys: instead of ``executor_id``/``secret``, for a listener serving many executors:
            ``executor_id -> secret | None``, called at each handshake with the id the peer
            claims (before it is authenticated), e.g. :meth:`Keyring.secret_for`.
        max_executors: with ``keys``, the most executors (slots) held at once; the next one is
            refused (1013) until :meth:`forget` frees a slot.
        limits: bounds.
        listen: ``(host, port)`` to listen on (port 0 picks a free port), or
        dial: ``ws://host:port/executor`` or ``wss://...`` (or a parsed :class:`DialTarget`).
        ssl_context: server context (listen) or client context (dial, ``wss://`` only).
        allow_insecure_development: permit plain text off loopback.
        retention: the retention budget to share (default: a new one of
            ``max_total_retained_bytes``).
        controller_id: a controller's name for itself, sent in its hello: a worker holds one
            session per controller, and a new process with the same ``controller_id`` takes
            over the old one's (default None: each process is a controller of its own).
        runtime_id: this process's runtime id (16 bytes) when several links speak for one
            process (a worker dialing several controllers); default: a new random one.
        names: who holds the ``max_controllers`` places and who takes them, as refusals and
            evictions word them (a gateway's callers link: ``("gateway", "caller")``).
    """

    def __init__(
        self,
        *,
        role: Role,
        executor_id: str | None = None,
        secret: bytes | None = None,
        keys: KeyLookup | None = None,
        max_executors: int = 10_000,
        limits: Limits | None = None,
        listen: tuple[str, int] | None = None,
        dial: str | DialTarget | None = None,
        ssl_context: ssl.SSLContext | None = None,
        allow_insecure_development: bool = False,
        rng: random.Random | None = None,
        retention: RetentionPool | None = None,
        controller_id: str | None = None,
        runtime_id: bytes | None = None,
        hosted: bool = False,
        names: tuple[str, str] = ("worker", "controller"),
    ) -> None:
        check_arguments(
            role,
            executor_id=executor_id,
            secret=secret,
            keys=keys,
            max_executors=max_executors,
            listen=listen,
            dial=dial,
            hosted=hosted,
            controller_id=controller_id,
        )
        self.role = Role(role)
        self.controller_id = controller_id
        # A listening worker keeps one slot per controller (module docstring).
        self._per_controller = self.role is Role.WORKER and (listen is not None or hosted)
        self._hosted = hosted
        self.executor_id = executor_id
        self.limits = limits or Limits()
        self._keys = keys
        self._key: bytes | None = None
        if secret is not None:
            try:
                self._key = derive_key(secret)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        self._max_executors = max_executors if keys is not None else 1
        self.runtime_id = runtime_id if runtime_id is not None else os.urandom(16)
        self._listen = listen
        self._dial = parse_dial_url(dial) if isinstance(dial, str) else dial
        self._ssl = tls_context(self._dial, listen, ssl_context, allow_insecure_development)
        self._host_tg: anyio.abc.TaskGroup | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._slots: dict[SlotKey, _Slot] = {}
        if executor_id is not None and not self._per_controller:
            self._slots[(executor_id, None)] = _Slot(executor_id)
        self.retention = retention or RetentionPool(self.limits.max_total_retained_bytes)
        """The retention budget of every session of this link (shared by a fleet's links)."""
        self._closed = anyio.Event()
        self._stats = LinkStatistics()
        self._tag = f"{self.role.value}[{self.runtime_id.hex()[:6]}]"
        # Authenticated peers' events (admission refusals, unexpected errors): rate-limited too.
        self._peer_log = PeerLogLimiter(
            log, interval=self.limits.log_interval, max_lines=self.limits.max_log_lines
        )
        self._failures = failures = Failures(
            self._stats, self._peer_log, tag=self._tag, executor_id=executor_id
        )
        self._dialer = Dialer(
            self._dial,
            limits=self.limits,
            stats=self._stats,
            rng=rng or random.Random(),
            ssl_context=self._ssl,
            tag=self._tag,
            role=self.role,
            executor_id=executor_id,
            controller_id=controller_id,
            # Draining, a dialer without a session has nothing to resume: it stops dialing.
            closing=lambda: (
                self._admission.closing or (self._admission.draining and self.transport is None)
            ),
            authenticate=self._authenticate,
            peer_failed=failures.peer_failed,
            note_error=failures.note,
            retire_sessions=self._retire_sessions,
        )
        self._unauthenticated_log = unauthenticated_log(self.limits)
        self._handshaker = Handshaker(
            role=self.role,
            runtime_id=self.runtime_id,
            controller_id=controller_id,
            executor_id=executor_id,
            key=self._key,
            keys=keys,
            limits=self.limits,
            stats=self._stats,
            tag=self._tag,
            peer_log=self._unauthenticated_log,
            refused=self._dialer.refused,
            taken_over=self._dialer.was_taken_over,
            peer_failed=failures.peer_failed,
            note_error=failures.note,
        )
        heartbeat = Heartbeat(
            self.limits,
            self._stats,
            dialer=self._dial is not None,
            tag=self._tag,
            key_for=self._handshaker.key_for if keys is not None else None,
        )
        self._attachments = attachments = Attachments(
            self.limits,
            self._stats,
            tag=self._tag,
            heartbeat=heartbeat,
            peer_failed=failures.peer_failed,
            taken_over=self._dialer.was_taken_over,
        )
        # Who holds the places and who takes them, as refusals name them ("this worker holds
        # sessions for max_controllers=N controllers"; a gateway's callers link passes its own).
        self._places = Places(
            self._slots,
            self.limits,
            self._stats,
            per_controller=self._per_controller,
            names=names,
            tag=self._tag,
            peer_log=self._peer_log,
        )
        self._listeners: list[SessionListener] = []
        self._admission = Admission(
            self._slots,
            self._places,
            self.limits,
            self._stats,
            retention=self.retention,
            listeners=self._listeners,
            per_controller=self._per_controller,
            max_executors=self._max_executors,
            tag=self._tag,
            peer_log=self._peer_log,
        )
        self._authentication = Authentication(
            self._slots,
            self._handshaker,
            self._admission,
            attachments,
            self.limits,
            self._stats,
            role=self.role,
            runtime_id=self.runtime_id,
            executor_id=executor_id,
            refused=self._dialer.refused,
            handshake_completed=self._dialer.handshake_completed,
        )
        self._listener: WebSocketListener | None = None
        if listen is not None:
            self._listener = WebSocketListener(
                limits=self.limits,
                stats=self._stats,
                ssl_context=self._ssl,
                tag=self._tag,
                on_error=failures.peer_failed,
                peer_log=self._unauthenticated_log,
                # One attached socket per executor, plus the configured allowance. Sockets being
                # admitted are not counted: they are still under the handshake deadline and the
                # unauthenticated cap (and one per executor at most).
                max_authenticated=self.limits.max_authenticated_sockets
                + (self._max_executors if keys is not None else 0)
                + (self.limits.max_controllers if self._per_controller else 0),
                occupied=lambda: attachments.count,
            )

    # ------------------------------------------------------------------ public surface

    def _slots_of(self, executor_id: str | None) -> list[_Slot]:
        return [s for s in self._slots.values() if s.executor_id == executor_id]

    @property
    def transport(self) -> SessionTransport | None:
        """The current logical session of a single-executor link (``None`` before the first
        handshake, after retire, and always for a ``keys`` link: see :meth:`session`); on a
        listening worker, the newest of its controllers' sessions (see :meth:`controllers`)."""
        return self.session(self.executor_id) if self.executor_id is not None else None

    def session(self, executor_id: str) -> SessionTransport | None:
        """The current logical session of ``executor_id`` (``None`` if it has none); the newest
        one on a listening worker holding sessions for several controllers."""
        live = [s for s in self._slots_of(executor_id) if s.live is not None]
        newest = max(live, key=lambda s: s.since, default=None)
        return newest.live if newest is not None else None

    def controllers(self) -> dict[str, SessionTransport]:
        """A listening worker's live sessions by controller (its ``controller_id``, or its
        runtime id in hex), oldest session first; empty on every other link."""
        live = sorted(
            (s for s in self._slots.values() if s.controller is not None and s.live is not None),
            key=lambda s: s.since,
        )
        return {str(s.label): t for s in live if (t := s.live) is not None}

    def executors(self) -> list[str]:
        """The executor ids that hold a slot (in the order they first authenticated)."""
        return list(dict.fromkeys(s.executor_id for s in self._slots.values()))

    @property
    def listen_address(self) -> tuple[str, int]:
        address = self._listener.address if self._listener is not None else None
        if address is None:
            raise RuntimeError("the link is not listening")
        return address

    @property
    def url(self) -> str:
        """The URL a peer dials (listener) or that this link dials."""
        if self._dial is not None:
            return self._dial.url
        scheme = "ws" if self._ssl is None else "wss"
        host, port = self.listen_address
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{port}{EXECUTOR_PATH}"

    def on_session(self, listener: SessionListener) -> Callable[[], None]:
        """Call ``listener(transport, handshake_result)`` for each new logical session.

        Runs synchronously before the session's first packet is processed, so a consumer can be
        installed with nothing missed; ``handshake_result.peer.executor`` names the executor.
        Returns an unsubscribe callable.
        """
        listeners = self._listeners
        listeners.append(listener)
        return lambda: listeners.remove(listener) if listener in listeners else None

    def on_refusal(self, listener: Callable[[HandshakeError], None]) -> Callable[[], None]:
        """Call ``listener(error)`` when the peer refuses this dialing link for a reason a
        redial will not heal (see :attr:`refusal`). Returns an unsubscribe callable."""
        return self._dialer.on_refusal(listener)

    def on_dial_failed(self, listener: Callable[[LinkError], None]) -> Callable[[], None]:
        """Call ``listener(error)`` after each failed dial attempt (:class:`Unreachable` when
        nothing listens or the name does not resolve). Returns an unsubscribe callable."""
        return self._dialer.on_dial_failed(listener)

    @property
    def taken_over(self) -> str | None:
        """Set (the cause) when another process with this executor id took over: dialing
        stopped."""
        return self._dialer.taken_over

    @property
    def refusal(self) -> HandshakeError | None:
        """The latest refusal of ours that a redial will not heal (wrong secret or executor id,
        version, role), with the fix in its message; cleared by a completed handshake. The dial
        loop keeps dialing (the other end may be fixed meanwhile)."""
        return self._dialer.refusal

    @property
    def last_dial_error(self) -> str | None:
        """Why the latest dial attempt failed (``None`` once a dial attached a socket): what a
        caller waiting for readiness reports (a dialing link only)."""
        return self._dialer.last_dial_error

    @property
    def stopped(self) -> anyio.Event:
        """Set when the link gave up for good (:attr:`taken_over`); :meth:`aclose` still
        needed."""
        return self._dialer.stopped

    @property
    def last_error(self) -> str | None:
        """The latest failure's cause, one line: a dial, a handshake, a refusal, a takeover or an
        unexpected error while serving a peer (``None`` until one)."""
        return self._failures.last_error

    def _retire_sessions(self, reason: FailureReason, detail: str) -> None:
        for slot in self._slots.values():
            if slot.transport is not None:
                slot.transport.retire(reason, detail)

    def statistics(self) -> LinkStatistics:
        s = self._stats
        return dataclasses.replace(
            s,
            upgrades_refused=dict(s.upgrades_refused),
            handshakes_failed=dict(s.handshakes_failed),
        )

    def host(self, guest: WebSocketLink) -> None:
        """Hand every hello of *our own* role on this listener to ``guest`` (a ``hosted``
        worker-role link): a gateway's one port admits executors (workers, to this
        controller-role link) and callers (controllers, to the guest) alike. The guest
        authenticates, admits and serves those sockets with its own keys, slots and bounds; the
        listener's authenticated-socket cap grows by the guest's ``max_controllers``.

        Raises:
            ConfigError: this link does not listen, or ``guest`` is not hosted.
        """
        if self._listener is None or not guest._hosted or guest.role is self.role:
            raise ConfigError("host() needs a listening link and a hosted link of the other role")
        self._authentication.guest = guest._authentication
        ours, theirs = self._attachments, guest._attachments
        self._listener.count_also(guest.limits.max_controllers, lambda: ours.count + theirs.count)

    # The link's own tasks (listener, dial loop, sockets, heartbeats) run in an inner task group
    # hosted by a child task of the task group entered in the host's task. ``_shutdown`` cancels
    # only the inner group, so ``abort()``/``aclose()`` from the host's body end the link, never
    # the body: the body goes on and sees the link's state (calls fail NotDispatched or
    # OutcomeUnknown), not a cancellation it did not ask for.

    async def __aenter__(self) -> WebSocketLink:
        host = anyio.create_task_group()
        await host.__aenter__()
        self._host_tg = host
        try:
            await host.start(self._run_tasks)
        except BaseException:
            host.cancel_scope.cancel()
            await host.__aexit__(None, None, None)
            raise
        return self

    async def _run_tasks(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        # Entered by hand, not ``async with``: a start-up failure (e.g. LinkError "cannot
        # listen") then reaches the caller of ``__aenter__`` itself, not an ExceptionGroup.
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = self._authentication.tg = tg
        try:
            if self._listener is not None:
                assert self._listen is not None
                host, port = self._listen
                await tg.start(self._listener.serve, host, port, self._authentication.incoming, tg)
                log.info(
                    "%s listening on %s",
                    self._tag,
                    self.url,
                    extra=log_fields(executor=self.executor_id),
                )
            elif not self._hosted:
                tg.start_soon(self._dialer.run)
        except BaseException:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise
        task_status.started()
        try:
            await anyio.sleep_forever()  # until _shutdown cancels ``tg``
        except BaseException as exc:
            if not await tg.__aexit__(type(exc), exc, exc.__traceback__):
                raise

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._host_tg is not None
        try:
            with anyio.CancelScope(shield=True):
                await self.aclose()
        finally:
            await self._host_tg.__aexit__(None, None, None)

    async def disconnect(self, executor_id: str | None = None) -> None:
        """Drop the attached socket abruptly (as a network loss would); keep the session.

        Args:
            executor_id: which executor's socket (default: the single executor's; every
                controller's socket on a listening worker).
        """
        for slot in self._slots_of(executor_id if executor_id is not None else self.executor_id):
            sock = slot.attached
            if sock is not None:
                sock.local_close = (0, "disconnect() requested")
                await sock.abort()

    def forget(self, executor_id: str) -> bool:
        """Retire ``executor_id``'s session and free its slot (``keys`` links only).

        Returns whether a slot was freed. A slot with an attached socket is kept (False).
        """
        slot = self._slots.get((executor_id, None))
        if slot is None or self._keys is None or slot.attached is not None:
            return False
        if slot.transport is not None:
            slot.transport.retire(FailureReason.CLOSED, "forgotten")
        del self._slots[(executor_id, None)]
        return True

    def drain(self) -> None:
        """Admit no new session from now on (a draining worker; idempotent): every fresh
        handshake is refused with 4010 (:data:`~garcon_link.core.admission.DRAINING`), while a
        resume of a session the link holds is admitted as ever. A dialing link stops dialing
        once it holds no live session."""
        self._admission.draining = True

    async def aclose(self) -> None:
        """Retire every session, stop listening or dialing, close every socket (idempotent).

        The peers are told with close code 1001, so they retire their sessions at once instead
        of waiting out their detached grace.
        """
        await self._shutdown(graceful=True)

    async def abort(self) -> None:
        """Stop as a killed process would: sockets dropped without a close frame (idempotent).

        The peers see a lost connection, wait (``reconnecting``) and retire their sessions when
        the grace expires. Meant for tests and demonstrations of crash behaviour.
        """
        await self._shutdown(graceful=False)

    async def _shutdown(self, *, graceful: bool) -> None:
        if self._admission.closing:
            return
        self._admission.closing = True
        if self._listener is not None:
            self._listener.closing = True
        slots = list(self._slots.values())
        if not graceful:
            for slot in slots:
                if slot.attached is not None:
                    slot.attached.local_close = (0, "abort() requested")
                    await slot.attached.abort()
        for slot in slots:
            if slot.transport is not None:
                slot.transport.retire(FailureReason.CLOSED, "link closed")
        if graceful:
            for slot in slots:
                sock = slot.attached
                if sock is not None:
                    # drain=False: the socket's reader may still be running.
                    await sock.close(CloseCode.GOING_AWAY, "shutting down", drain=False)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
        self._closed.set()

    # ------------------------------------------------------------------ handshake

    async def _authenticate(self, sock: WebSocket) -> Admitted | None:
        """A dialed socket's handshake and admission (the dial loop's)."""
        return await self._authentication.authenticate(sock)
