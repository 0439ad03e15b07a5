"""What a controller and a worker share: one link, an ``ExecutorRpc`` per logical session, and
the statistics snapshot of both (docs/design.md#facades).

Both :class:`~garcon_link.RemoteExecutor` (controller) and :class:`~garcon_link.Worker` (what
:func:`~garcon_link.serve` runs) are an *endpoint*: one :class:`~garcon_link.endpoint.link.
WebSocketLink` plus, for each logical session it carries, one :class:`~garcon_link.rpc.rpc.
ExecutorRpc`. Which side dials is configuration, not role.

Beside the public :class:`ExecutorStatistics`, the api room uses :class:`Endpoint` (the base of
both), :class:`SessionTotals` (the counters that outlive a session) and
:func:`link_from_config` (the fleet builds its links with it too).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..core.session import RetentionPool
from ..endpoint.link import ExecutorLink, LinkStatistics, WebSocketLink
from ..endpoint.transport import SessionTransport, TransportStatistics
from ..limits import Limits
from ..rpc.rpc import CallObserver, CallStatistics, ExecutorRpc, RpcStatistics
from ..settings.config import LinkConfig

__all__ = ["Endpoint", "ExecutorStatistics", "SessionTotals", "link_from_config"]


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """A snapshot of one endpoint (:meth:`RemoteExecutor.statistics`, :meth:`Worker.statistics`):
    its calls, its sessions, its link. docs/reference/statistics.md lists what each field means.

    Counters (``calls``, ``*_peak``, ``sessions``, ``replays``, ``replayed_frames``) cover the
    endpoint's lifetime, across session replacements; ``pending_calls``, ``incoming_calls``,
    ``retained_*`` (without ``_peak``) are the current session's, 0 without one. The link's
    figures (``resumes``, ``fresh_sessions``, ``handshakes_failed``, ``bytes_*``) are its link's:
    for a fleet member, the fleet's link it shares with the other members.

    Attributes:
        executor_id: the executor this endpoint is (worker) or talks to (controller).
        calls: calls ended, by side, outcome label and code (:class:`~garcon_link.rpc.
            CallStatistics`): counted where each call's outcome is decided.
        pending_calls: our calls awaiting a reply on the current session.
        pending_calls_peak: the most ever pending at once on one session.
        incoming_calls: the peer's calls whose handlers run now.
        incoming_calls_peak: the most ever running at once on one session.
        retained_frames: our frames awaiting the peer's receipt (current session).
        retained_frames_peak: the most ever retained at once by one session.
        retained_bytes: bytes of those frames.
        retained_bytes_peak: the most bytes ever retained at once by one session.
        sessions: logical sessions this endpoint ran (ended ones and the current one).
        resumes: sockets that resumed a session (the link's count).
        fresh_sessions: sessions the link began afresh.
        replays: attachments that re-sent frames a lost socket may not have delivered.
        replayed_frames: frames re-sent by those replays.
        handshakes_failed: failed handshakes by reason (``AUTH_FAILED``, ...).
        bytes_sent: bytes written to the link's sockets.
        bytes_received: bytes read from them.
        link: the link's full :class:`~garcon_link.endpoint.link.LinkStatistics`.
        transport: the current session's transport snapshot, if any.
        rpc: the current session's :class:`~garcon_link.rpc.rpc.RpcStatistics`, if any.
    """

    executor_id: str
    calls: CallStatistics
    pending_calls: int
    pending_calls_peak: int
    incoming_calls: int
    incoming_calls_peak: int
    retained_frames: int
    retained_frames_peak: int
    retained_bytes: int
    retained_bytes_peak: int
    sessions: int
    resumes: int
    fresh_sessions: int
    replays: int
    replayed_frames: int
    handshakes_failed: Mapping[str, int]
    bytes_sent: int
    bytes_received: int
    link: LinkStatistics
    transport: TransportStatistics | None
    rpc: RpcStatistics | None


class SessionTotals:
    """What ended sessions counted, kept by the endpoint (a session's own counters go with it)."""

    __slots__ = ("bytes_peak", "frames_peak", "replayed_frames", "replays", "sessions")

    def __init__(self) -> None:
        self.sessions = self.replays = self.replayed_frames = 0
        self.frames_peak = self.bytes_peak = 0

    def ended(self, transport: SessionTransport) -> None:
        session = transport.statistics().session
        self.replays += session.replays
        self.replayed_frames += session.replayed_frames
        self.frames_peak = max(self.frames_peak, session.retained_frames_peak)
        self.bytes_peak = max(self.bytes_peak, session.retained_bytes_peak)

    def snapshot(
        self,
        executor_id: str,
        observer: CallObserver,
        link: LinkStatistics,
        rpc: ExecutorRpc | None,
    ) -> ExecutorStatistics:
        transport = rpc.transport.statistics() if rpc is not None else None
        calls = rpc.statistics() if rpc is not None else None
        session = transport.session if transport is not None else None
        return ExecutorStatistics(
            executor_id=executor_id,
            calls=observer.statistics(),
            pending_calls=calls.pending_calls if calls is not None else 0,
            pending_calls_peak=observer.pending_peak,
            incoming_calls=calls.incoming_calls if calls is not None else 0,
            incoming_calls_peak=observer.incoming_peak,
            retained_frames=session.retained_frames if session is not None else 0,
            retained_frames_peak=max(
                self.frames_peak, session.retained_frames_peak if session is not None else 0
            ),
            retained_bytes=session.retained_bytes if session is not None else 0,
            retained_bytes_peak=max(
                self.bytes_peak, session.retained_bytes_peak if session is not None else 0
            ),
            sessions=self.sessions,
            resumes=link.resumed,
            fresh_sessions=link.fresh_sessions,
            replays=self.replays + (session.replays if session is not None else 0),
            replayed_frames=self.replayed_frames
            + (session.replayed_frames if session is not None else 0),
            handshakes_failed=types.MappingProxyType(dict(link.handshakes_failed)),
            bytes_sent=link.bytes_sent,
            bytes_received=link.bytes_received,
            link=link,
            transport=transport,
            rpc=calls,
        )


def link_from_config(
    config: LinkConfig,
    limits: Limits,
    retention: RetentionPool | None = None,
    *,
    dial: str | None = None,
    runtime_id: bytes | None = None,
) -> WebSocketLink:
    """The link ``config`` describes (dial or listen, TLS, its secret), drawing retained bytes
    on ``retention`` when given (a fleet's shared budget). ``dial`` picks one of
    ``config.dial_urls`` (a worker dialing several controllers has a link per URL, all with
    the same ``runtime_id``)."""
    if dial is not None:
        return WebSocketLink(
            retention=retention,
            role=config.role,
            executor_id=config.executor_id,
            secret=config.secret.reveal(),
            limits=limits,
            dial=dial,
            ssl_context=config.ssl_context(),
            allow_insecure_development=config.allow_insecure_development,
            runtime_id=runtime_id,
        )
    return WebSocketLink(
        retention=retention,
        role=config.role,
        executor_id=config.executor_id,
        secret=config.secret.reveal(),
        limits=limits,
        listen=config.listen,
        dial=config.dial_target if config.dial is not None else None,
        ssl_context=config.ssl_context(),
        allow_insecure_development=config.allow_insecure_development,
        controller_id=config.controller_id,
    )


class Endpoint:
    """Shared machinery: a link, and an ExecutorRpc per logical session.

    An endpoint built from a config owns its link (it enters and closes it); a fleet member
    (``RemoteExecutor._fleet_member``) shares its fleet's link and task group.
    """

    def __init__(self, config: LinkConfig, *, limits: Limits | None = None) -> None:
        self.limits = limits or config.limits
        self._own_link: WebSocketLink | None = link_from_config(config, self.limits)
        self.link: WebSocketLink | ExecutorLink = self._own_link
        self._own_link.on_session(self._on_session)
        self._tg: anyio.abc.TaskGroup | None = None

    # The task group and the link are entered and exited by hand, not through an
    # ``AsyncExitStack``: when the host task is cancelled, the stack re-raises the same
    # ``CancelledError`` from two exits and its context fix-up makes the exception its own
    # ``__context__``; anyio's asyncio backend then loops forever walking that chain.

    async def _start(self) -> None:
        assert self._own_link is not None
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            await self._own_link.__aenter__()
        except BaseException:
            # Exit the task group as if nothing happened, so the caller gets the link's own
            # exception (e.g. LinkError "cannot listen"), not an ExceptionGroup around it.
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
            raise

    async def _stop(self) -> None:
        link = self._own_link
        if link is None:
            return  # a fleet member: the fleet closes the link
        tg = self._tg
        try:
            with anyio.CancelScope(shield=True):
                await link.aclose()
            await link.__aexit__(None, None, None)
        except BaseException as exc:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if tg is not None:
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)

    def _on_session(self, transport: SessionTransport, result: HandshakeResult) -> None:
        raise NotImplementedError

    _draining = False

    @property
    def draining(self) -> bool:
        """Whether a graceful stop is under way (``aclose(drain=...)``, a worker's SIGTERM): new
        calls fail with ``NotDispatched("DRAINING")``, calls in flight finish."""
        return self._draining
