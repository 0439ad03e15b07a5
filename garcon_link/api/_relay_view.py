"""A gateway's caller's view of the executors it may see, kept current from the gateway.

The view (:class:`RelayView`, one per :class:`~garcon_link.api.relay.GatewayFleet`) holds the
executors' handles (:class:`~garcon_link.api._relay_executor.GatewayExecutor`, made on first
mention and kept: at most :data:`MAX_VIEW`), which of them the gateway shows now, in the order
it first showed them, and the feed of their events. :meth:`RelayView.run` keeps it current: once
the gateway session is ready it follows the relay stream ``watch()`` (a snapshot, then each
change as it happens: :meth:`RelayView._follow_watch`), or, from a gateway without ``watch``,
asks for a snapshot every ``refresh_interval`` (:meth:`RelayView.refresh`), the events being the
changes between two snapshots (:meth:`RelayView._take`).

What a gateway sends is a peer's word (the docstring of :mod:`.relay` says what each case does):
an entry naming no executor is ignored (:meth:`RelayView._skipped`), events that are not known
kinds are derived from the state, and an answer of the wrong shape is a protocol error that
says what it was -- a watch message, ``OutcomeUnknown("MALFORMED_REPLY")``; a snapshot that is
not a list of maps, ``RemoteError("INVALID_RESULT")`` from the relay facade's check -- so the
round ends, says so in a rate-limited WARNING, and the next one asks again; the view is kept as
it was, never replaced by an empty one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast, get_args

import anyio

from ..errors import CallError, HandshakeError, OutcomeUnknown, Rejected
from ..limits import Limits
from ..logs import PeerLogLimiter, log_fields, peer_message, peer_text
from ..rpc.hooks import CallHook
from ..settings.keyring import executor_id_problem
from ._relay_executor import GatewayExecutor
from ._relay_wire import MAX_WATCH_ENTRIES, MAX_WATCH_EVENTS, RELAY_SERVICE, GatewayRelay
from .controller import RemoteExecutor
from .facades import FacadeStream
from .fleet import EventKind, ExecutorSnapshot, _EventFeed

__all__ = ["MAX_VIEW", "WATCH_RETRY", "RelayView"]

log = logging.getLogger("garcon_link.gateway")  # the name users configure (README)

MAX_VIEW = 1_000_000
"""Executors a caller keeps, at most, of what its gateway shows it (a fleet's largest
``max_executors``): an entry for one more is ignored."""
WATCH_RETRY = 1.0
"""Seconds, at most, a caller waits before opening its watch again after one ended."""
_NO_WATCH = frozenset({"UNKNOWN_SERVICE", "OPERATION_UNSUPPORTED", "UNSUPPORTED"})
"""The refusals of a gateway without ``watch``: its callers poll it instead."""
_WATCH_KINDS = frozenset(get_args(EventKind)) - {"lost"}
_MALFORMED = frozenset({"MALFORMED_REPLY", "INVALID_RESULT"})
"""The codes of a gateway's answer that does not read as the relay interface says."""


class RelayView:
    """The executors a caller may see, their handles and their events (module docstring).

    Args:
        caller_id: the caller's id (in log lines).
        gateway: the session to the gateway.
        relay: the gateway's relay service on that session.
        limits: the caller's bounds (each handle's too).
        hooks: per-call hooks, told about every call through the handles' facades.
        refresh_interval: seconds between two snapshots, from a gateway without ``watch``.
        events_buffer: events kept per follower of :attr:`events`.

    Attributes:
        members: every handle made, by executor id.
        visible: the executors the gateway shows now, in the order it first showed them.
        events: the feed of the executors' events.
    """

    def __init__(
        self,
        caller_id: str,
        gateway: RemoteExecutor,
        relay: GatewayRelay,
        limits: Limits,
        hooks: Sequence[CallHook],
        refresh_interval: float,
        events_buffer: int,
    ) -> None:
        self.caller_id = caller_id
        self._gateway = gateway
        self._relay = relay
        self._limits = limits
        self._hooks = tuple(hooks)
        self._refresh_interval = refresh_interval
        self.members: dict[str, GatewayExecutor] = {}
        self.visible: dict[str, None] = {}  # in the order the gateway first showed them
        self.events = _EventFeed(events_buffer)
        self._watching = False  # a watch is open and its snapshot applied
        # What the gateway makes this caller log: one line per reason per log_interval.
        self._log = PeerLogLimiter(
            log, interval=limits.log_interval, max_lines=limits.max_log_lines
        )

    def member(self, executor_id: str) -> GatewayExecutor:
        """The handle of ``executor_id``, made on first mention (its id already checked)."""
        member = self.members.get(executor_id)
        if member is None:
            member = self.members[executor_id] = GatewayExecutor(
                executor_id,
                self._gateway,
                self._relay,
                self._limits,
                self._hooks,
                self.visible.setdefault,
            )
        return member

    def executors(self) -> dict[str, ExecutorSnapshot]:
        """The executors the gateway shows now, as it last reported them."""
        out = {}
        for executor_id in self.visible:
            member = self.members[executor_id]
            out[executor_id] = ExecutorSnapshot(
                executor_id=executor_id,
                availability=member.availability,
                session=None,
                since=member.since,
                calls=member.calls,
                errors=member.errors,
                services=member.versions,
            )
        return out

    async def refresh(self) -> dict[str, ExecutorSnapshot]:
        """Ask the gateway now; returns :meth:`executors`. While the gateway's ``watch`` is
        open, the view it keeps is the answer (the gateway is not asked): a snapshot applied
        beside the watch would publish again the changes the watch delivers."""
        if self._watching:
            return self.executors()
        # The relay facade checks the answer against GatewayRelay.executors: anything but a
        # list of maps is RemoteError("INVALID_RESULT") saying what it was, raised here (and
        # logged by run()), so the view is never replaced by what does not read.
        entries = await self._relay.executors()
        if not self._watching:  # else the watch's snapshot came first, and is newer
            self._replace_view(entries)
        return self.executors()

    def _replace_view(self, entries: Iterable[Any]) -> None:
        """A whole snapshot: apply each entry, and forget what it no longer shows."""
        fresh: set[str] = set()
        for entry in entries:
            executor_id = self._take(entry, None)
            if executor_id is not None:
                fresh.add(executor_id)
        self._forget_all_but(fresh)

    def _forget_all_but(self, fresh: set[str]) -> None:
        for executor_id in [i for i in self.visible if i not in fresh]:
            del self.visible[executor_id]
            self._publish("forgotten", executor_id)

    def _take(self, entry: Any, kinds: Sequence[EventKind] | None) -> str | None:
        """Apply one executor's entry; publish ``kinds``, or, without them, what changed since
        the last entry (``joined`` for a new one, then its availability if it moved). The
        executor's id, or None if the entry names none."""
        executor_id = entry.get("executor_id") if isinstance(entry, dict) else None
        if not isinstance(executor_id, str) or executor_id_problem(executor_id) is not None:
            self._skipped(entry)
            return None
        assert isinstance(entry, dict)
        member = self.members.get(executor_id)
        if member is None and len(self.members) >= MAX_VIEW:
            return None
        was_visible = executor_id in self.visible
        before = member.availability if member is not None and was_visible else None
        if member is None:
            member = self.member(executor_id)
        member._apply(entry)
        if not was_visible:
            self.visible[executor_id] = None
        if kinds is not None:
            for kind in kinds:
                self._publish(kind, executor_id)
            return executor_id
        if before is None:
            self._publish("joined", executor_id)
            if member.availability != "offline":
                self._publish(member.availability, executor_id)
        elif member.availability != before:
            self._publish(member.availability, executor_id)
        return executor_id

    async def run(self) -> None:
        """Keep :meth:`executors` current: through the gateway's ``watch`` when it has one,
        else by a snapshot every ``refresh_interval``."""
        polled: object = None  # the gateway session that refused a watch
        while True:
            pause = self._refresh_interval
            try:
                await self._gateway.wait_ready()
                rpc = self._gateway.current_rpc
                if rpc is not polled and self._gateway.offers(RELAY_SERVICE, "watch"):
                    pause = min(pause, WATCH_RETRY)
                    try:
                        await self._follow_watch()
                    except Rejected as exc:
                        if exc.code not in _NO_WATCH:
                            raise
                        polled, pause = rpc, 0  # a gateway older than its caller: poll it
                else:
                    await self.refresh()
            except (CallError, HandshakeError) as exc:
                # The gateway session went away, or refused us (wait_ready says why to whoever
                # waits), or its answer did not read: the next round asks again (a new watch
                # begins with a snapshot, which sets the view right).
                if isinstance(exc, CallError) and exc.code in _MALFORMED:
                    self._log.log(
                        "gateway",
                        "malformed answer",
                        "caller %s: the gateway's view of its executors does not read (%s); "
                        "asked again in %.1fs",
                        self.caller_id,
                        peer_message(exc.message),
                        pause,
                        extra=log_fields(caller=self.caller_id),
                    )
            except Exception as exc:
                # An answer no check here foresaw, or a bug of ours: never the end of the fleet
                # (its calls do not depend on the view), and never silent: the line carries the
                # traceback. Asked again as above.
                self._log.log(
                    "gateway",
                    f"view failed: {type(exc).__name__}",
                    "caller %s: keeping the view of the gateway's executors failed (%s: %s); "
                    "asked again in %.1fs",
                    self.caller_id,
                    type(exc).__name__,
                    peer_message(str(exc)),
                    pause,
                    exc_info=exc,
                    extra=log_fields(caller=self.caller_id),
                    level=logging.ERROR,
                )
            await anyio.sleep(pause)

    async def _follow_watch(self) -> None:
        """Apply the gateway's ``watch`` messages until the stream ends (the session went, or
        the gateway drains).

        Raises:
            CallError: the stream failed, or the gateway sent a message that does not read
                (``OutcomeUnknown("MALFORMED_REPLY")``).
        """
        stream = cast("FacadeStream", self._relay.watch())
        fresh: set[str] | None = None
        try:
            async for message in stream:
                entries = message.get("entries") if isinstance(message, dict) else None
                if not isinstance(entries, list) or len(entries) > MAX_WATCH_ENTRIES:
                    raise OutcomeUnknown(
                        "MALFORMED_REPLY",
                        f"the gateway's watch message is not a list of at most "
                        f"{MAX_WATCH_ENTRIES} executors",
                    )
                if message.get("snapshot") is True:
                    fresh = set() if fresh is None else fresh
                    for entry in entries:
                        executor_id = self._take(entry, None)
                        if executor_id is not None:
                            fresh.add(executor_id)
                    if message.get("last") is True:
                        self._forget_all_but(fresh)
                        fresh = None
                        self._watching = True
                    continue
                for entry in entries:
                    self._change(entry)
        finally:
            self._watching = False
            await stream.aclose()

    def _change(self, entry: Any) -> None:
        """One executor's change from the gateway's ``watch``: its state now and its events
        (a malformed entry is skipped)."""
        executor_id = entry.get("executor_id") if isinstance(entry, dict) else None
        if not isinstance(executor_id, str) or executor_id_problem(executor_id) is not None:
            self._skipped(entry)
            return
        assert isinstance(entry, dict)
        kinds = entry.get("events")
        if not (
            isinstance(kinds, list)
            and len(kinds) <= MAX_WATCH_EVENTS
            and all(type(kind) is str and kind in _WATCH_KINDS for kind in kinds)
        ):
            if kinds is not None:
                self._log.log(
                    "gateway",
                    "malformed events",
                    "caller %s: the gateway's watch gave executor %s events that are not a list "
                    "of at most %d known kinds (%s); its events are derived from its state",
                    self.caller_id,
                    peer_text(executor_id),
                    MAX_WATCH_EVENTS,
                    peer_text(kinds),
                    extra=log_fields(caller=self.caller_id, executor=executor_id),
                )
            kinds = None  # derived from the state instead
        lost = entry.get("lost", 0)
        if type(lost) is int and 0 < lost < 2**31:
            self.events.publish("lost", executor_id, lost=lost)
        if entry.get("gone") is True:
            self.visible.pop(executor_id, None)
            for kind in kinds or ["forgotten"]:
                self._publish(kind, executor_id)
            return
        self._take(entry, kinds)

    def _skipped(self, entry: object) -> None:
        """Say (rate-limited) that an entry of the gateway's naming no executor is ignored."""
        executor_id = entry.get("executor_id") if isinstance(entry, dict) else None
        self._log.log(
            "gateway",
            "malformed entry",
            "caller %s: the gateway sent an entry that names no executor (%s); ignored",
            self.caller_id,
            f"executor_id {peer_text(executor_id)}"
            if isinstance(entry, dict)
            else f"not a map: {peer_text(entry)}",
            extra=log_fields(caller=self.caller_id),
        )

    def _publish(self, kind: EventKind, executor_id: str) -> None:
        self.events.publish(kind, executor_id)
