"""The world the explorer walks: two processes, their session slots, and the sockets between them.

Everything that decides anything is the library's own sans-IO code, called as the link and the
transport call it: :class:`~garcon_link.core.session.MessageSession` (ordinals, receipts,
retention, replay), a real :class:`~garcon_link.core.handshake.Handshake` on each side (hello,
proof, the resume rule and the session id), and :func:`~garcon_link.core.admission.decide` on each
side's slot (resume, fresh, probe, refuse, takeover). This module only plays the network and the
bookkeeping around them.

Network model (per socket lifetime, as TCP gives it):

- each direction of a socket is a FIFO of WebSocket messages: no reordering, no loss, no
  duplication while the socket lives;
- a *cut* kills the socket and loses whatever was in flight in both directions; each side
  learns of it on its own (``notice``), so one side may stay attached to a dead socket --
  writing into the void, half-open -- while the other has already detached and redialed;
- a *close* is one side ending its socket (resumably: a heartbeat timeout): it detaches and
  reads nothing more, but what it wrote still reaches the peer, which notices the close only
  after reading it (a cut and a close share the ``cuts`` budget);
- a side that retires its session while attached closes the socket with a code that tells the
  peer so (the peer retires too when it reads the close, ``PEER_RETIRED``);
- duplicates exist only as replay: after a reattach the peer's retained frames come again
  (the peer may have read some of them from the old socket after its hello was composed);
- a *restart* kills one process: its sessions vanish with it and it comes back with a new
  runtime id and nothing to resume (the kernel closes its socket after what it wrote; a
  handshake under way dies).

The dialer is the worker (``w``), the listener the controller (``c``). The worker dials only
while it is detached (one dial loop). A dial is two steps, so that everything else can happen
in between: ``dial`` opens the socket and composes both hellos from the slots as they are then
(resume offers with their ``received`` positions; the listener's is what
:func:`~garcon_link.core.handshake.listener_offer` lets it echo to the worker's hello); ``admit``
runs both real handshakes to completion and applies ``decide`` to each slot as it is *now* (the
old socket may have delivered more meanwhile, a session may have expired) -- the listener
first, because it holds its proof until it has admitted the dialer, so a refusal means the
dialer never completes; then the dialer. The takeover probe is answered by the attached socket
only while the peer's end of it is open.

Grace expiry is not a clock: a detached session may expire at any moment (``expire``), and the
model calls :meth:`MessageSession.poll` at exactly its grace deadline.

A flush writes what the session hands out as one WebSocket message, or -- within the ``splits``
budget -- one message per packet (the transport's writer splits a large batch: so a replay can
arrive without its trailing receipt, and a cut can come between them). Each side keeps the
transport's :class:`~garcon_link.endpoint.transport.PreReadinessBuffer` as the transport does: what
it accepts before the peer's replay fence is held, released at the fence, and what an attachment
left is handed over when the next one begins. Its bound is what the peer can retain (an honest
configuration); an overflow is a violation: an honest peer must never cause one. (The consumer takes
every payload at once here, so the transport's wait for a slow one is not modelled.)
"""

from __future__ import annotations

import copy
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from garcon_link.core import admission
from garcon_link.core.admission import Fresh, Offer, Probe, Refuse, Resume, SlotView
from garcon_link.core.handshake import (
    PROTOCOL_VERSION,
    Handshake,
    HandshakeResult,
    Hello,
    ResumeOffer,
    derive_key,
    listener_offer,
)
from garcon_link.core.session import (
    MessageSession,
    RetentionPool,
    SessionState,
    encoded_message_size,
)
from garcon_link.core.wire import Role
from garcon_link.endpoint.transport import PreReadinessBuffer
from garcon_link.errors import FailureReason, HandshakeFailure, RetentionFull, SessionFailed
from garcon_link.limits import Limits

__all__ = [
    "ALLOWED_RETIREMENTS",
    "CI",
    "VERIFY",
    "Bounds",
    "Log",
    "Retired",
    "Side",
    "Violation",
    "World",
]

SIDES = ("c", "w")
ROLES = {"c": Role.CONTROLLER, "w": Role.WORKER}
KEY = derive_key(bytes(range(32)))
EXECUTOR = "model-box"

ALLOWED_RETIREMENTS = frozenset(
    {FailureReason.GRACE_EXPIRED, FailureReason.REPLACED, FailureReason.PEER_RETIRED}
)
"""Why a session may be retired under this network model: it expired, the peer lost its state
(a restart, or its own expiry) and a fresh session replaced it, or the peer told us it retired.
Anything else (a gap, a receipt beyond what was written, a refused resume) is a protocol bug:
an honest network never provokes it."""


class Violation(Exception):
    """An invariant does not hold (or the real code raised where it must not)."""


@dataclass(frozen=True)
class Bounds:
    """The scope of one exploration.

    Attributes:
        sends: messages each side may send in total (across sessions).
        cuts: socket cuts (in-flight data lost).
        restarts: process restarts (either side; the process comes back with a new runtime).
        expiries: grace expiries (a detached session retired).
        dials: handshakes the worker may attempt (refused ones included).
        worker_frames: the worker's ``Limits.max_retained_frames`` (its pool is unbounded).
        pool_bytes: the controller's shared retention budget (``RetentionPool``), in encoded
            bytes (its frame count is unbounded): each side meets another kind of
            limit (a frame is 6 bytes: the default pool of 8 holds one; the worker retains two, so
            it writes batches of two frames).
        splits: flushes that write one message per packet instead of one message in all.
        worker_sends: the worker's budget of sends, when it differs from ``sends``.
    """

    sends: int = 1
    cuts: int = 1
    restarts: int = 1
    expiries: int = 1
    dials: int = 3
    worker_frames: int = 2
    pool_bytes: int = 8
    splits: int = 0
    worker_sends: int | None = None

    def describe(self) -> str:
        worker_sends = "" if self.worker_sends is None else f" sends(w)={self.worker_sends}"
        return (
            f"sends/side={self.sends} cuts={self.cuts} restarts={self.restarts} "
            f"expiries={self.expiries} dials={self.dials} frames(w)={self.worker_frames} "
            f"pool_bytes(c)={self.pool_bytes} splits={self.splits}{worker_sends}"
        )

    def world(self) -> World:
        """The initial state of an exploration within these bounds."""
        return World(self)

    def sends_of(self, x: str) -> int:
        """Side ``x``'s budget of sends."""
        return self.sends if x == "c" or self.worker_sends is None else self.worker_sends

    def pool_frames(self) -> int:
        """Frames the controller's pool can retain at once (each message frame of the model is
        6 bytes while a side sends fewer than 10; a lone frame is always admitted)."""
        return max(1, self.pool_bytes // encoded_message_size(1, 2))

    def limits(self, frames: int, inbound: int) -> Limits:
        """A side's limits: it retains ``frames``; its pre-readiness buffer holds ``inbound``
        payloads, what its peer retains (the honest configuration)."""
        return Limits(
            max_retained_frames=frames,
            max_inbound_buffer_payloads=inbound,
            max_retained_bytes=4096,
            max_frame_bytes=1024,
            max_handshake_frame_bytes=512,
            detached_grace=5.0,
        )


CI = Bounds()
"""The bound ``tests/test_model.py`` explores (26,304 states, about 10 s of CPU)."""
VERIFY = Bounds(sends=2)
"""The bound ``make verify`` explores (226,810 states, about 115 s of CPU)."""


@dataclass(frozen=True)
class Retired:
    """What one side knew of a session when it retired it: the inputs of the outcome rule."""

    reason: FailureReason
    issued: int
    offered: int
    confirmed: int

    @property
    def unknown(self) -> range:
        """Pending ordinals written to some socket: ``OutcomeUnknown`` (rpc: ordinal <= offered)."""
        return range(self.confirmed + 1, self.offered + 1)

    @property
    def not_dispatched(self) -> range:
        """Pending ordinals never written: ``NotDispatched`` -- the peer must never get them."""
        return range(max(self.offered, self.confirmed) + 1, self.issued + 1)


@dataclass
class Log:
    """The application's view of one logical session: what each side sent and delivered."""

    sent: dict[str, list[bytes]] = field(default_factory=lambda: {"c": [], "w": []})
    delivered: dict[str, list[bytes]] = field(default_factory=lambda: {"c": [], "w": []})
    retired: dict[str, Retired] = field(default_factory=dict)
    crashed: set[str] = field(default_factory=set)

    def clone(self) -> Log:
        return Log(
            {x: list(v) for x, v in self.sent.items()},
            {x: list(v) for x, v in self.delivered.items()},
            dict(self.retired),
            set(self.crashed),
        )


@dataclass
class Side:
    """One process: its runtime, its slot (one executor) and its retention pool."""

    name: str
    limits: Limits
    pool_limit: int
    role: str = ""  # "c" or "w": how sockets and logs name it (its name, in the two-side world)
    process: str = ""  # the process it is a slot of (its name, unless it is a worker's slot)
    controller_id: str | None = None  # a controller's, if it has one
    incarnation: int = 0
    session: MessageSession | None = None
    session_id: bytes | None = None
    peer_runtime: bytes | None = None
    sock: int | None = None  # the socket the session is attached to (maybe dead)
    dialing: int | None = None  # the socket whose handshake is under way (the dialer only)
    fence_passed: bool = False
    fence_target: int = 0
    taken_over: list[bytes] = field(default_factory=list)
    stopped: bool = False
    sends: int = 0
    pool: RetentionPool = field(init=False)
    buffer: PreReadinessBuffer = field(init=False)  # the transport's, for the current session

    def __post_init__(self) -> None:
        self.role = self.role or self.name
        self.process = self.process or self.name
        self.pool = RetentionPool(self.pool_limit)
        self.buffer = PreReadinessBuffer(self.limits)

    def clone(self, pool: RetentionPool | None = None) -> Side:
        """A copy; ``pool``: the copy of a pool it shares with other sides (a process's slots),
        else its own pool is copied."""
        new = Side.__new__(Side)
        new.__dict__.update(self.__dict__)
        if pool is None:
            pool = RetentionPool(self.pool.limit)
            pool.used = self.pool.used
        new.pool = pool
        new.session = None if self.session is None else clone_session(self.session, new.pool)
        new.buffer = clone_slots(self.buffer)
        new.taken_over = list(self.taken_over)
        return new

    @property
    def runtime(self) -> bytes:
        return _RUNTIMES[self.process, self.incarnation]

    def offer(self) -> ResumeOffer | None:
        s = self.session
        if s is None:
            return None
        assert self.session_id is not None and self.peer_runtime is not None
        return ResumeOffer(
            session_id=self.session_id, peer_runtime=self.peer_runtime, received=s.accepted
        )

    def view(self) -> SlotView:
        return SlotView(
            closing=False,
            session=self.session_id if self.session is not None else None,
            peer_runtime=self.peer_runtime if self.session is not None else None,
            attached=self.sock is not None,
        )


@dataclass
class Socket:
    """One socket. ``queues[x]``: messages written by ``x``, not yet read by the other side."""

    number: int
    queues: dict[str, deque[bytes]] = field(default_factory=lambda: {"c": deque(), "w": deque()})
    ends: set[str] = field(default_factory=set)  # the sides attached to it (their end is open)
    hellos: tuple[ResumeOffer | None, ResumeOffer | None] | None = None  # handshake under way
    retired_by: str | None = None  # closed by a side that retired the session
    dialer: str = ""  # the side that dialed it (a world with several controllers)
    slot: str = ""  # the listener's side it was admitted to (a world with several controllers)

    def clone(self) -> Socket:
        return Socket(
            self.number,
            {x: q.copy() for x, q in self.queues.items()},
            set(self.ends),
            self.hellos,
            self.retired_by,
            self.dialer,
            self.slot,
        )


_SLOTS: tuple[str, ...] = tuple(MessageSession.__slots__)
_GET_SLOTS = operator.attrgetter(*_SLOTS)
_CONTAINERS = (deque, list, dict, set)


def clone_session(session: MessageSession, pool: RetentionPool) -> MessageSession:
    """Copy a session without knowing its internals: its slots copied one level deep (a
    container among them is copied; what containers hold -- ints, bytes, tuples -- and every
    other value is immutable), and its retention pool swapped for ``pool`` (the copy of the
    original's). About 2.5 times faster than :func:`copy.deepcopy`, to the same effect."""
    new = MessageSession.__new__(MessageSession)
    for name, value in zip(_SLOTS, _GET_SLOTS(session), strict=True):
        if type(value) in _CONTAINERS:
            value = value.copy()
        elif type(value) is RetentionPool:
            value = pool
        setattr(new, name, value)
    return new


def clone_slots(obj: PreReadinessBuffer) -> PreReadinessBuffer:
    """Copy a slotted object as :func:`clone_session` does (containers one level deep)."""
    new = type(obj).__new__(type(obj))
    for name in type(obj).__slots__:
        value = getattr(obj, name)
        setattr(new, name, value.copy() if type(value) in _CONTAINERS else value)
    return new


class _Runtimes(dict[tuple[str, int], bytes]):
    def __missing__(self, key: tuple[str, int]) -> bytes:
        value = self[key] = f"{key[0]}{key[1]}".encode().ljust(16, b".")
        return value


_RUNTIMES = _Runtimes()


HANDSHAKES: dict[Any, tuple[HandshakeResult, HandshakeResult]] = {}
"""Handshake results by their inputs (the handshake is deterministic: the nonce is the socket's
number). Cleared by the explorer at the start of each exploration, so a mutation installed
around an exploration is always run."""


def handshake_results(
    runtime_c: bytes,
    runtime_w: bytes,
    offers: dict[str, ResumeOffer | None],
    number: int,
    controller: str | None = None,
) -> tuple[HandshakeResult, HandshakeResult]:
    """Run both sides' real handshakes on one socket (hello, proof, resume rule, session id);
    ``controller``: the controller's ``controller_id``, if it has one."""
    key = (runtime_c, runtime_w, offers["c"], offers["w"], number, controller)
    known = HANDSHAKES.get(key)
    if known is not None:
        return known
    nonce = number.to_bytes(32, "big")
    runtimes = {"c": runtime_c, "w": runtime_w}
    hs = {
        x: Handshake(
            role=ROLES[x],
            executor_id=EXECUTOR,
            key=KEY,
            runtime=runtimes[x],
            nonce=nonce,
            resume=offers[x],
            package="model",
            controller=controller if x == "c" else None,
        )
        for x in SIDES
    }
    proof_c = hs["c"].receive(hs["w"].hello_frame())
    proof_w = hs["w"].receive(hs["c"].hello_frame())
    assert proof_c is not None and proof_w is not None
    hs["c"].receive(proof_w)
    hs["w"].receive(proof_c)
    result_c, result_w = hs["c"].result, hs["w"].result
    assert result_c is not None and result_w is not None
    HANDSHAKES[key] = result_c, result_w
    return result_c, result_w


def other(name: str) -> str:
    return "w" if name == "c" else "c"


class World:
    """One state of the model. Actions mutate it in place; the explorer copies it first."""

    verbose = False
    """Describe packets in what :meth:`apply` returns (set when a trace is printed)."""
    allowed_retirements = ALLOWED_RETIREMENTS
    """Why a session may be retired in this world (:data:`ALLOWED_RETIREMENTS`)."""

    def check(self) -> None:
        """Raise :class:`Violation` unless every invariant holds (:mod:`.invariants`)."""
        from .invariants import check_world  # a cycle-free late import

        check_world(self)

    def goal(self) -> bool:
        """The liveness goal (:func:`.invariants.goal`)."""
        from .invariants import goal

        return goal(self)

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.sides = {
            "c": Side("c", bounds.limits(1 << 30, bounds.worker_frames), bounds.pool_bytes),
            "w": Side("w", bounds.limits(bounds.worker_frames, bounds.pool_frames()), 1 << 30),
        }
        self.sockets: dict[int, Socket] = {}
        self.logs: dict[bytes, Log] = {}
        self.cuts = 0
        self.splits = 0
        self.restarts = 0
        self.expiries = 0
        self.dials = 0
        self.opened = 0  # sockets ever opened (names them; not part of the state key)

    def __deepcopy__(self, memo: dict[int, Any]) -> World:
        # Limits and Bounds are frozen: share them instead of copying them into every state.
        for side in self.sides.values():
            memo[id(side.limits)] = side.limits
        memo[id(self.bounds)] = self.bounds
        new = World.__new__(World)
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def clone(self) -> World:
        """A copy sharing only immutable parts (bytes, frozen objects): much faster than
        :func:`copy.deepcopy`, and the same result (see :func:`clone_session`)."""
        new = World.__new__(World)
        new.__dict__.update(self.__dict__)
        new.sides = {x: side.clone() for x, side in self.sides.items()}
        new.sockets = {n: sock.clone() for n, sock in self.sockets.items()}
        new.logs = {sid: log.clone() for sid, log in self.logs.items()}
        return new

    # ------------------------------------------------------------------ actions

    def _readable(self, x: str) -> Socket | None:
        """The socket ``x`` is attached to, if it still has something for ``x`` to read."""
        n = self.sides[x].sock
        sock = self.sockets.get(n) if n is not None else None
        return sock if sock is not None and sock.queues[self._peer_role(x)] else None

    def _gone(self, x: str) -> bool:
        """``x`` is attached to a socket that is dead, or closed by the peer and drained."""
        n = self.sides[x].sock
        if n is None:
            return False
        sock = self.sockets.get(n)
        peer = self._peer_role(x)
        return sock is None or (peer not in sock.ends and not sock.queues[peer])

    def _peer_role(self, x: str) -> str:
        """The role of ``x``'s peer: how ``x``'s socket names the other end."""
        return other(self.sides[x].role)

    def _side_actions(self, x: str, send_budget: int, healed: bool) -> list[tuple[str, ...]]:
        """What side ``x`` may do now through its session and socket (``send_budget``: the
        sends it may make in all); :meth:`actions` adds restarts and cuts."""
        acts: list[tuple[str, ...]] = []
        b = self.bounds
        side = self.sides[x]
        s = side.session
        if not healed and s is not None and side.sends < send_budget:
            acts.append(("send", x))
        if (
            s is not None
            and s.state is SessionState.ATTACHED
            and (s.frames_queued or s.receipt_due)
        ):
            acts.append(("flush", x))
            if not healed and self.splits < b.splits and s.frames_queued + s.receipt_due > 1:
                acts.append(("flush", x, "split"))
        if self._readable(x) is not None:
            acts.append(("deliver", x))
        if self._gone(x):
            acts.append(("notice", x))
        if not healed and self.cuts < b.cuts and side.sock is not None:
            sock = self.sockets.get(side.sock)
            if sock is not None and self._peer_role(x) in sock.ends:
                acts.append(("close", x))
        if (
            not healed
            and self.expiries < b.expiries
            and s is not None
            and s.state is SessionState.DETACHED
            and s.grace_deadline is not None
        ):
            acts.append(("expire", x))
        return acts

    def actions(self, healed: bool = False) -> list[tuple[str, ...]]:
        """The actions enabled now (``healed``: only those of a network that no longer fails)."""
        acts: list[tuple[str, ...]] = []
        b = self.bounds
        for x in SIDES:
            acts += self._side_actions(x, b.sends_of(x), healed)
            if not healed and self.restarts < b.restarts:
                acts.append(("restart", x))
        if not healed and self.cuts < b.cuts:
            acts.extend(("cut", str(n)) for n in self.sockets)
        w = self.sides["w"]
        if w.sock is None and not w.stopped:
            if w.dialing is not None:
                acts.append(("admit",))
            elif healed or self.dials < b.dials:
                acts.append(("dial",))
        return acts

    def apply(self, action: tuple[str, ...]) -> str:
        """Perform ``action``; return a one-line description of what happened."""
        kind = action[0]
        method = getattr(self, "_" + kind)
        try:
            result: str = method(*action[1:])
        except Violation:
            raise
        except Exception as exc:  # the real code raised where the protocol says it must not
            raise Violation(f"{' '.join(action)} raised {type(exc).__name__}: {exc}") from exc
        return result

    def _send(self, x: str) -> str:
        side = self.sides[x]
        s = side.session
        assert s is not None and side.session_id is not None
        body = f"{x}{side.sends + 1}".encode()
        side.sends += 1
        try:
            ordinal = s.send(body)
        except RetentionFull:
            return f"{x} send {body.decode()}: retention full, not issued (the caller gives up)"
        self.logs[side.session_id].sent[side.role].append(body)
        return f"{x} sends {body.decode()} as #{ordinal} ({s.state.value})"

    def _flush(self, x: str, split: str = "") -> str:
        side = self.sides[x]
        s = side.session
        assert s is not None
        packets = s.data_to_send()
        assert packets
        assert len(packets) <= side.limits.max_packets_per_message
        messages = [b"".join(packets)]
        if split:
            self.splits += 1
            messages = packets
        what = "] [".join(describe_packets([m]) for m in messages) if self.verbose else ""
        sock = self.sockets.get(side.sock) if side.sock is not None else None
        if sock is not None and self._peer_role(x) in sock.ends:
            sock.queues[side.role].extend(messages)
            return f"{x} writes [{what}]"
        return f"{x} writes [{what}] into a socket nobody reads (lost)"

    def _deliver(self, x: str) -> str:
        side = self.sides[x]
        sock = self._readable(x)
        assert sock is not None
        data = sock.queues[self._peer_role(x)].popleft()
        s = side.session
        assert s is not None and side.session_id is not None
        what = describe_packets([data]) if self.verbose else ""
        try:
            received = s.receive(data)
        except SessionFailed as failure:
            self._retire(x, failure.reason)
            return f"{x} reads [{what}]: session FAILED ({failure})"
        bodies = [bytes(body) for body in received.bodies]
        self.logs[side.session_id].delivered[side.role].extend(bodies)
        note = ""
        if not side.fence_passed:
            # The transport holds what comes before the fence (the same message included).
            for body in bodies:
                overflow = side.buffer.hold(body)
                if overflow is not None:
                    raise Violation(
                        f"{x}'s pre-readiness buffer overflowed ({overflow}; it holds what "
                        f"the peer retains, {side.limits.max_inbound_buffer_payloads}): "
                        "INBOUND_OVERFLOW, which an honest peer must never cause"
                    )
        if received.fence:
            assert not side.fence_passed, "the session reported a second fence on one attachment"
            side.fence_passed = True
            side.buffer.release()
            note = " (replay fence: ready)"
            if s.accepted < side.fence_target:
                raise Violation(
                    f"{x} passed the replay fence with accepted={s.accepted}, but the peer had "
                    f"issued {side.fence_target} when it attached: ready before the replay"
                )
        got = ", ".join(b.decode() for b in bodies) or "nothing new"
        return f"{x} reads [{what}] -> delivers {got}{note}"

    def _cut(self, n: str) -> str:
        sock = self.sockets.pop(int(n))
        lost = sum(len(q) for q in sock.queues.values())
        self.cuts += 1
        w = self.sides["w"]
        if w.dialing == sock.number:
            w.dialing = None
            return f"socket {self._name(sock.number)} cut during its handshake"
        return f"socket {self._name(sock.number)} cut ({lost} message(s) in flight lost)"

    def _close(self, x: str) -> str:
        """``x`` ends its socket (e.g. its heartbeat timed out): it stops reading, what it
        wrote still reaches the peer, which notices the close after reading it."""
        side = self.sides[x]
        assert side.sock is not None and side.session is not None
        self.cuts += 1
        self._leave(x)
        side.session.detach(0.0)
        return f"{x} closes its socket (resumably) and detaches"

    def _leave(self, x: str, retired: bool = False) -> None:
        """``x`` closes its end of its socket; the other side reads what is left, then the
        close (``retired``: with a code saying the session is retired)."""
        side = self.sides[x]
        if side.sock is not None:
            sock = self.sockets.get(side.sock)
            if sock is not None:
                sock.ends.discard(side.role)
                sock.queues[self._peer_role(x)].clear()
                if retired:
                    sock.retired_by = side.role
                if not sock.ends:
                    del self.sockets[sock.number]
        side.sock = None

    def _notice(self, x: str) -> str:
        side = self.sides[x]
        s = side.session
        assert s is not None and side.sock is not None
        sock = self.sockets.pop(side.sock, None)
        side.sock = None
        if sock is not None and sock.retired_by is not None:
            self._retire(x, FailureReason.PEER_RETIRED)
            return f"{x} reads the close: the peer retired the session, so does {x}"
        s.detach(0.0)
        return f"{x} notices its socket is gone: detached"

    def _expire(self, x: str) -> str:
        side = self.sides[x]
        s = side.session
        assert s is not None and s.grace_deadline is not None
        deadline = s.grace_deadline
        if s.poll(deadline - 1e-3) is not None:
            raise Violation(f"{x}'s session expired before its grace deadline")
        failure = s.poll(deadline)
        if failure is None:
            raise Violation(f"{x}'s session did not expire at its grace deadline")
        self.expiries += 1
        self._retire(x, failure.reason)
        return f"{x}'s grace expires: session retired"

    def _restart(self, x: str) -> str:
        side = self.sides[x]
        if side.session_id is not None and side.session is not None:
            self.logs[side.session_id].crashed.add(side.role)
        self._leave(x)  # the kernel closes the dead process's socket (after what it wrote)
        w = self.sides["w"]
        if w.dialing is not None:  # a handshake under way dies with either end
            self.sockets.pop(w.dialing, None)
            w.dialing = None
        side.session = None
        side.session_id = None
        side.peer_runtime = None
        side.dialing = None
        side.fence_passed = False
        side.buffer = PreReadinessBuffer(side.limits)
        side.taken_over = []
        side.stopped = False
        side.incarnation += 1
        side.pool = RetentionPool(side.pool_limit)
        self.restarts += 1
        self._collect()
        return f"{x} restarts (new runtime {side.runtime.rstrip(b'.').decode()}, no session)"

    def _dial(self) -> str:
        """The worker opens a socket; both hellos are composed now, from the slots as they are."""
        w = self.sides["w"]
        self.dials += 1
        self.opened += 1
        sock = Socket(self.opened)
        w_offer = w.offer()
        # What the listener may echo depends on the worker's hello (nonce aside).
        claimed = Hello(
            protocol=PROTOCOL_VERSION,
            package="model",
            role=ROLES["w"],
            executor=EXECUTOR,
            runtime=w.runtime,
            peer_runtime=w_offer.peer_runtime if w_offer is not None else None,
            session=w_offer.session_id if w_offer is not None else None,
            received=w_offer.received if w_offer is not None else 0,
            nonce=bytes(32),
        )
        c = self.sides["c"]
        sock.hellos = (listener_offer(claimed, c.offer(), c.runtime), w_offer)
        self.sockets[sock.number] = sock
        w.dialing = sock.number
        c_offer, w_offer = sock.hellos
        return (
            f"w dials socket {self._name(sock.number)}: hellos advertise "
            f"c={_describe_offer(c_offer)} w={_describe_offer(w_offer)}"
        )

    def _admit(self) -> str:
        """Proofs, then ``decide`` on each side with its slot as it is *now* (the listener first:
        it holds its proof until it has admitted the dialer)."""
        w = self.sides["w"]
        assert w.dialing is not None
        sock = self.sockets[w.dialing]
        w.dialing = None
        assert sock.hellos is not None
        offers = dict(zip(SIDES, sock.hellos, strict=True))
        sock.hellos = None
        result_c, result_w = handshake_results(
            self.sides["c"].runtime, self.sides["w"].runtime, offers, sock.number
        )
        if (result_c.resume, result_c.session_id) != (result_w.resume, result_w.session_id):
            raise Violation("the two handshakes settled on different sessions")
        resume, session_id = result_c.resume, result_c.session_id
        notes = [
            f"handshake on socket {self._name(sock.number)}: {'resume' if resume else 'fresh'}"
        ]
        for x in SIDES:
            side, peer = self.sides[x], self.sides[other(x)]
            result = result_c if x == "c" else result_w
            offer = Offer(
                resume=resume,
                session=session_id,
                runtime=peer.runtime,
                taken_over=peer.runtime in side.taken_over,
            )
            decision = admission.decide(side.view(), offer)
            if isinstance(decision, Probe):
                # The attached socket answers a ping only while the peer's end of it is open.
                old = self.sockets.get(side.sock) if side.sock is not None else None
                healthy = old is not None and other(x) in old.ends
                decision = admission.decide(side.view(), offer, probe_healthy=healthy)
                notes.append(f"{x} probes its attached socket: {'healthy' if healthy else 'dead'}")
            if isinstance(decision, Refuse):
                notes.append(f"{x} refuses ({decision.reason.name})")
                sock.ends.discard(x)
                if not sock.ends:
                    self.sockets.pop(sock.number, None)
                if x == "c" and decision.reason is HandshakeFailure.TAKEN_OVER:
                    # The dialer gives up for good and retires what it holds (link: 4009).
                    w.stopped = True
                    if w.session is not None:
                        self._retire("w", FailureReason.TAKEN_OVER)
                if x == "c":
                    self.sockets.pop(sock.number, None)
                return "; ".join(notes)
            notes.append(f"{x}: {type(decision).__name__}")
            if isinstance(decision, Resume):
                assert side.session is not None
                if decision.supersede_attached and side.sock is not None:
                    self._leave(x)
                    side.session.detach(0.0)
                    notes.append(f"{x} drops its old socket")
                try:
                    side.session.attach(result.peer.received)
                    side.buffer.attach()  # handed over before the new socket is read
                except SessionFailed as failure:
                    self._retire(x, FailureReason.RESUME_REFUSED)
                    notes.append(f"{x}'s resume refused: {failure}")
                    sock.ends.discard(x)
                    if x == "c" or not sock.ends:
                        self.sockets.pop(sock.number, None)
                    return "; ".join(notes)
            else:
                assert isinstance(decision, Fresh)
                if side.session is not None:
                    if not decision.retire_current:
                        raise Violation(
                            f"{x} replaced its live session without retiring it: its pending "
                            "messages would never get an outcome"
                        )
                    if decision.taken_over:
                        assert side.peer_runtime is not None
                        side.taken_over.append(side.peer_runtime)
                    self._retire(x, FailureReason.REPLACED)
                if session_id not in self.logs:
                    self.logs[session_id] = Log()
                side.session = MessageSession(side.limits, side.pool)
                side.buffer = PreReadinessBuffer(side.limits)
                side.session_id = session_id
                side.peer_runtime = peer.runtime
                side.session.attach(0)
            side.sock = sock.number
            sock.ends.add(x)
        for x in SIDES:
            side, peer = self.sides[x], self.sides[other(x)]
            assert peer.session is not None
            side.fence_passed = False
            side.fence_target = peer.session.issued
        self._collect()
        return "; ".join(notes)

    def _retire(self, x: str, reason: FailureReason) -> None:
        """Retire ``x``'s session: record the outcome rule's inputs, free the slot, close."""
        side = self.sides[x]
        s = side.session
        assert s is not None and side.session_id is not None
        failure = s.fail(reason)
        stats = s.statistics()
        self.logs[side.session_id].retired[side.role] = Retired(
            failure.reason, stats.issued, stats.offered, stats.confirmed
        )
        self._check_pool_after_retire(x)
        self._leave(x, retired=True)
        side.session = None
        side.buffer = PreReadinessBuffer(side.limits)  # retirement hands it over
        side.session_id = None
        side.peer_runtime = None
        self._collect()

    def _check_pool_after_retire(self, x: str) -> None:
        side = self.sides[x]
        if side.pool.used != 0:
            raise Violation(
                f"{x}'s retention pool holds {side.pool.used} bytes after its only session retired"
            )

    def _collect(self) -> None:
        """Forget the logs of sessions neither side holds any more (after a last check)."""
        held = {s.session_id for s in self.sides.values() if s.session is not None}
        for sid in list(self.logs):
            if sid not in held:
                from .invariants import check_log  # a cycle-free late import

                check_log(self.logs[sid], self.allowed_retirements)
                del self.logs[sid]

    def _name(self, number: int) -> str:
        return f"#{number}"

    # ------------------------------------------------------------------ state key

    def key(self) -> tuple[Any, ...]:
        """A canonical, hashable summary: equal keys mean equal futures.

        Session ids, runtimes and sockets are named by their order of appearance, not their
        bytes or numbers (which depend on nonces, incarnations and history), so states that
        differ only in names merge. Built from the sessions' public state (properties), the
        slots and the queues. The key is ``(core, budgets)``: ``core`` alone names the state in
        the healed graph, where the budgets do not apply.
        """
        names: dict[Any, int] = {}

        def name(value: Any) -> int | None:
            if value is None:
                return None
            return names.setdefault(value, len(names))

        socks = {n: i for i, n in enumerate(sorted(self.sockets))}
        parts: list[Any] = []
        for x in SIDES:
            side = self.sides[x]
            s = side.session
            if s is None:
                sess: Any = None
            else:
                # Retained frames and bytes are implied: exactly the frames (confirmed, issued]
                # of the log (checked in every state), counted by the pool (below).
                sess = (
                    s.state,
                    s.issued,
                    s.offered,
                    s.confirmed,
                    s.accepted,
                    s.frames_queued,
                    s.receipt_due,
                    s.receipt_urgent,
                    s.grace_deadline is not None,
                )
            sock: Any = None
            if side.sock is not None:
                sock = socks.get(side.sock, "dead")
            parts.append(
                (
                    name(side.runtime),
                    name(side.session_id),
                    name(side.peer_runtime),
                    sess,
                    sock,
                    None if side.dialing is None else socks[side.dialing],
                    side.fence_passed,
                    side.fence_target,
                    len(side.buffer),
                    tuple(name(r) for r in side.taken_over),
                    side.stopped,
                    side.pool.used,
                )
            )
        sockets = []
        for n in sorted(self.sockets):
            sk = self.sockets[n]
            hellos = None
            if sk.hellos is not None:
                hellos = tuple(
                    None if o is None else (name(o.session_id), name(o.peer_runtime), o.received)
                    for o in sk.hellos
                )
            sockets.append(
                (
                    tuple(tuple(sk.queues[x]) for x in SIDES),
                    tuple(sorted(sk.ends)),
                    hellos,
                    sk.retired_by,
                )
            )
        parts.append(tuple(sockets))
        logs = []
        for sid, log in sorted(self.logs.items(), key=lambda kv: names.get(kv[0], 99)):
            logs.append(
                (
                    name(sid),
                    tuple(tuple(log.sent[x]) for x in SIDES),
                    tuple(tuple(log.delivered[x]) for x in SIDES),
                    tuple(
                        (x, r.reason.name, r.issued, r.offered, r.confirmed)
                        for x, r in sorted(log.retired.items())
                    ),
                    tuple(sorted(log.crashed)),
                )
            )
        parts.append(tuple(logs))
        budgets = (
            self.sides["c"].sends,
            self.sides["w"].sends,
            self.cuts,
            self.splits,
            self.restarts,
            self.expiries,
            self.dials,
        )
        return tuple(parts), budgets


def _describe_offer(offer: ResumeOffer | None) -> str:
    if offer is None:
        return "none"
    return f"(session {offer.session_id.hex()[:6]}, received {offer.received})"


# ---------------------------------------------------------------------- describing packets


def describe_packets(packets: list[bytes]) -> str:
    from garcon_link.core.wire import Message, iter_packets

    words = []
    for packet in packets:
        for p in iter_packets(packet, 1 << 20, 1 << 10):
            if isinstance(p, Message):
                words.append(f"#{p.ordinal}:{bytes(p.body).decode()}")
            else:
                words.append(f"receipt<={p.through}")
    return " ".join(words)
