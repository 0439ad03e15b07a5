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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.abc

from ..core.handshake import HandshakeResult
from ..core.session import RetentionPool
from ..endpoint.link import ExecutorLink, LinkStatistics, WebSocketLink
from ..endpoint.transport import SessionTransport, TransportStatistics
from ..limits import Limits
from ..rpc.rpc import CallObserver, CallStatistics, ExecutorRpc, RpcStatistics
from ..settings.config import LinkConfig

__all__ = [
    "CONTROLLER_ROWS",
    "ControllerStatistics",
    "Endpoint",
    "ExecutorStatistics",
    "SessionTotals",
    "link_from_config",
]

CONTROLLER_ROWS = 64
"""By default, at most this many controllers in :attr:`ExecutorStatistics.controllers` (the
oldest sessions; the others are counted in ``controllers_omitted``, and always in the sums)."""


@dataclass(frozen=True, slots=True)
class ControllerStatistics:
    """One controller's session on a worker, in :attr:`ExecutorStatistics.controllers`.

    Attributes:
        attached: a socket carries the session now.
        pending_calls: the worker's calls to that controller awaiting a reply.
        incoming_calls: that controller's calls whose handlers run now.
        retained_frames: frames to that controller awaiting its receipt.
        retained_bytes: bytes of those frames.
        replays: attachments that re-sent frames a lost socket may not have delivered.
        replayed_frames: frames re-sent by those replays.
    """

    attached: bool
    pending_calls: int
    incoming_calls: int
    retained_frames: int
    retained_bytes: int
    replays: int
    replayed_frames: int

    @classmethod
    def of(cls, rpc: ExecutorRpc) -> ControllerStatistics:
        transport = rpc.transport.statistics()
        calls = rpc.statistics()
        session = transport.session
        return cls(
            attached=rpc.transport.attached,
            pending_calls=calls.pending_calls,
            incoming_calls=calls.incoming_calls,
            retained_frames=session.retained_frames,
            retained_bytes=session.retained_bytes,
            replays=session.replays,
            replayed_frames=session.replayed_frames,
        )


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """A snapshot of one endpoint (:meth:`RemoteExecutor.statistics`, :meth:`Worker.statistics`):
    its calls, its sessions, its link. docs/reference/statistics.md lists what each field means.

    Counters (``calls``, ``*_peak``, ``sessions``, ``replays``, ``replayed_frames``) cover the
    endpoint's lifetime, across session replacements; ``pending_calls``, ``incoming_calls``,
    ``retained_*`` (without ``_peak``) are the current session's, 0 without one. The link's
    figures (``resumes``, ``fresh_sessions``, ``handshakes_failed``, ``bytes_*``) are its link's:
    for a fleet member, the fleet's link it shares with the other members.

    A worker serving several controllers (docs/guides/many-callers.md) has a session per
    controller: its ``pending_calls``, ``incoming_calls`` and ``retained_*`` are the sums over
    every session it serves now, its ``*_peak`` the most any one session reached, its
    ``replays`` and ``replayed_frames`` those of every session, its link figures the sums over
    the links it dials (a dialing worker has one per controller URL); ``transport`` and ``rpc``
    stay the newest session's, and ``controllers`` breaks the sessions down by controller.

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
        controllers: a worker's sessions by controller (its ``controller_id`` or runtime id in
            hex, or the URL a dialing worker dials), oldest first, at most
            :data:`CONTROLLER_ROWS` of them (``Worker.statistics(max_rows=...)``); empty for a
            controller.
        controllers_omitted: the worker's sessions past that bound, not in ``controllers``
            (they are in the sums).
        oneway_refused: the peer's one-way calls (``gl.oneway`` methods, notifications) refused
            without running because their arguments or metadata failed the method's contract
            (types, constraints): no reply tells the caller, so this count and a rate-limited
            WARNING are where it shows. Each is also in ``calls.server`` (``rejected`` and its
            code, as a refused call).
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
    controllers: Mapping[str, ControllerStatistics] = field(
        default_factory=lambda: types.MappingProxyType({})
    )
    controllers_omitted: int = field(default=0, metadata={"metric": "gauge"})
    oneway_refused: int = 0


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
        *,
        live: Sequence[ExecutorRpc] | None = None,
        more_links: Sequence[LinkStatistics] = (),
        controllers: Mapping[str, ExecutorRpc] | None = None,
        max_rows: int = 0,
    ) -> ExecutorStatistics:
        """The endpoint's snapshot; ``rpc`` is the newest session's.

        A worker also passes ``live`` (every session it serves now: the levels are their sums),
        ``more_links`` (the other links it dials: their figures are added to ``link``'s) and
        ``controllers`` (its sessions by controller, oldest first: the breakdown, at most
        ``max_rows`` of them).
        """
        transport = rpc.transport.statistics() if rpc is not None else None
        calls = rpc.statistics() if rpc is not None else None
        sessions = [r.transport.statistics().session for r in live or ()]
        rpcs = [r.statistics() for r in live or ()]
        if live is None:
            session = transport.session if transport is not None else None
            sessions = [session] if session is not None else []
            rpcs = [calls] if calls is not None else []
        links = [link, *more_links]
        failed: dict[str, int] = {}
        for one in links:
            for reason, count in one.handshakes_failed.items():
                failed[reason] = failed.get(reason, 0) + count
        rows = dict(controllers or {})
        shown = dict(list(rows.items())[:max_rows])
        return ExecutorStatistics(
            executor_id=executor_id,
            calls=observer.statistics(),
            pending_calls=sum(c.pending_calls for c in rpcs),
            pending_calls_peak=observer.pending_peak,
            incoming_calls=sum(c.incoming_calls for c in rpcs),
            incoming_calls_peak=observer.incoming_peak,
            retained_frames=sum(s.retained_frames for s in sessions),
            retained_frames_peak=max(
                [self.frames_peak, *(s.retained_frames_peak for s in sessions)]
            ),
            retained_bytes=sum(s.retained_bytes for s in sessions),
            retained_bytes_peak=max([self.bytes_peak, *(s.retained_bytes_peak for s in sessions)]),
            sessions=self.sessions,
            resumes=sum(one.resumed for one in links),
            fresh_sessions=sum(one.fresh_sessions for one in links),
            replays=self.replays + sum(s.replays for s in sessions),
            replayed_frames=self.replayed_frames + sum(s.replayed_frames for s in sessions),
            handshakes_failed=types.MappingProxyType(failed),
            bytes_sent=sum(one.bytes_sent for one in links),
            bytes_received=sum(one.bytes_received for one in links),
            link=link,
            transport=transport,
            rpc=calls,
            controllers=types.MappingProxyType(
                {label: ControllerStatistics.of(r) for label, r in shown.items()}
            ),
            controllers_omitted=len(rows) - len(shown),
            oneway_refused=observer.oneway_refused,
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

    __slots__ = ("_own_link", "_tg", "limits", "link")

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
