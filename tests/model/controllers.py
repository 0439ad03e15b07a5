"""Two controllers on one listening worker (docs/guides/many-callers.md), explored as
:mod:`.network` explores one.

The world: controllers ``a`` and ``b`` (two processes: ``a`` has a ``controller_id``, ``b`` is
known by its runtime, as a controller without one is) each dial one listening worker. The worker
keeps one slot per controller, played by the worker-side sides ``w1``, ``w2``, ... (one more than
``max_controllers``, the most a link holds during an eviction), which share the worker's runtime
and its one retention pool. What the link decides is the library's own code, called as the link
calls it:

- which slot a hello meets: :func:`~garcon_link.core.admission.slot_key` (for the hello the
  worker echoes a resume offer to, :func:`~garcon_link.core.handshake.listener_offer`, and for
  the verified one it admits);
- the places the other slots hold: :func:`~garcon_link.core.admission.places`;
- resume, fresh, probe, refuse, takeover, evict: :func:`~garcon_link.core.admission.decide` on
  that slot, and which detached session gives its place up:
  :func:`~garcon_link.core.admission.evictee`;
- sessions, handshakes and the pre-readiness buffer: as in :mod:`.network`.

Each controller dials only while detached (its own dial loop); a dial is two steps (``dial``:
open and compose the hellos; ``admit``: both handshakes, the worker's decision first, then the
controller's), so that the other controller's steps, cuts, restarts and expiries interleave with
them. A worker restart ends every slot at once; a controller restart ends only its own process.

Invariants, in every state (beside :mod:`.invariants`' per session: prefix, honest receipts and
outcomes, legitimate retirement, retention):

- **Isolation**: a worker slot's session is replaced (``REPLACED``) only on a handshake of the
  controller it belongs to, and given up for another controller (``EVICTED``) only while no
  socket carries it: one controller's cut, restart or expiry never retires or disturbs another's
  session;
- **Agreement**: a controller and a worker slot on one socket hold the same session, and a
  socket carries at most one slot;
- **One pool**: the worker's retention pool counts exactly what its slots' sessions retain.

Goal: every controller attached to a live socket of its own, in the same session as the worker
slot on the other end, past both replay fences, with everything delivered and confirmed (a
restarted controller's old session may still wait, detached, on the worker: it expires in time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from garcon_link.core import admission
from garcon_link.core.admission import Fresh, Offer, Probe, Refuse, Resume, SlotKey, SlotView
from garcon_link.core.handshake import PROTOCOL_VERSION, Hello, listener_offer
from garcon_link.core.session import MessageSession, RetentionPool
from garcon_link.core.wire import Role
from garcon_link.endpoint.transport import PreReadinessBuffer
from garcon_link.errors import FailureReason, HandshakeFailure, SessionFailed

from .invariants import check_log
from .network import (
    ALLOWED_RETIREMENTS,
    EXECUTOR,
    Bounds,
    Log,
    Side,
    Socket,
    Violation,
    World,
    handshake_results,
    other,
)

__all__ = [
    "CONTROLLERS_CI",
    "CONTROLLERS_VERIFY",
    "CONTROLLER_IDS",
    "ControllerBounds",
    "ControllersWorld",
]

CONTROLLER_IDS = {"a": "nightly", "b": None}
"""Each controller process's ``controller_id`` (``b`` is known by its runtime)."""
CONTROLLERS = tuple(CONTROLLER_IDS)


@dataclass(frozen=True)
class ControllerBounds:
    """The scope of one exploration of :class:`ControllersWorld`.

    Attributes:
        sends: messages each controller may send in total (across sessions).
        worker_sends: messages each worker slot may send in total.
        cuts: socket cuts and closes, in all.
        restarts: controller process restarts, in all.
        worker_restarts: worker process restarts.
        expiries: grace expiries, in all.
        dials: handshakes the controllers may attempt, in all (refused ones included).
        max_controllers: the worker's ``Limits.max_controllers``.
        worker_frames: a worker slot's ``max_retained_frames``.
        pool_bytes: each controller's retention budget (:class:`~.network.Bounds`).
        splits: flushes that write one message per packet.
        connected: start with both controllers attached and ready (their first handshakes, one
            after the other, and both replay fences), so that the budgets go to what comes
            after; else from nothing (each controller's first dial counts against ``dials``).
    """

    sends: int = 1
    worker_sends: int = 0
    cuts: int = 1
    restarts: int = 1
    worker_restarts: int = 0
    expiries: int = 0
    dials: int = 4
    max_controllers: int = 2
    worker_frames: int = 2
    pool_bytes: int = 8
    splits: int = 0
    connected: bool = True

    def world(self) -> ControllersWorld:
        return ControllersWorld(self)

    def describe(self) -> str:
        return (
            f"controllers={len(CONTROLLERS)} max_controllers={self.max_controllers} "
            f"sends/controller={self.sends} sends/slot={self.worker_sends} cuts={self.cuts} "
            f"restarts={self.restarts} worker_restarts={self.worker_restarts} "
            f"expiries={self.expiries} dials={self.dials} splits={self.splits}"
            f"{' from both attached' if self.connected else ''}"
        )

    def one_pair(self) -> Bounds:
        """The two-side bounds whose limits each controller-worker pair has."""
        return Bounds(worker_frames=self.worker_frames, pool_bytes=self.pool_bytes)


CONTROLLERS_CI = (
    ControllerBounds(sends=1, cuts=1, restarts=0, dials=1),
    ControllerBounds(sends=0, cuts=1, restarts=1, dials=2),
)
"""The bounds ``tests/test_model.py`` explores for two controllers (about 1,400 states each, a
second or two of CPU each): a message each way and a cut or close anywhere; a cut and a
controller restart (a takeover for ``a``, an eviction for ``b``) anywhere."""
CONTROLLERS_VERIFY = ControllerBounds(sends=1, cuts=1, restarts=1, dials=2)
"""The bound ``make verify`` explores for two controllers (42,229 states, about 80 s of CPU)."""


class ControllersWorld(World):
    """One state: two controllers, one listening worker's slots, the sockets between them."""

    allowed_retirements = ALLOWED_RETIREMENTS | {FailureReason.EVICTED}

    def __init__(self, bounds: ControllerBounds) -> None:
        self.bounds = bounds  # type: ignore[assignment]  # the explorer only passes it back
        pair = bounds.one_pair()
        self.slots = tuple(f"w{i + 1}" for i in range(bounds.max_controllers + 1))
        self.sides = {}
        for x, controller_id in CONTROLLER_IDS.items():
            side = Side(x, pair.limits(1 << 30, pair.worker_frames), pair.pool_bytes, role="c")
            side.controller_id = controller_id
            self.sides[x] = side
        pool = RetentionPool(1 << 30)
        for y in self.slots:
            side = Side(y, pair.limits(pair.worker_frames, pair.pool_frames()), 1 << 30, role="w")
            side.process = "w"
            side.pool = pool
            self.sides[y] = side
        self.slot_of: dict[SlotKey, str] = {}
        self.owner: dict[bytes, str] = {}  # session id -> the controller it belongs to
        self.detached_at: dict[str, int] = {}  # worker slot -> when its socket last went
        self.detachments = 0
        self.sockets: dict[int, Socket] = {}
        self.logs: dict[bytes, Log] = {}
        self.cuts = 0
        self.splits = 0
        self.restarts = 0
        self.worker_restarts = 0
        self.expiries = 0
        self.dials = 0
        self.opened = 0
        if bounds.connected:
            self._connect()

    def _connect(self) -> None:
        """Both controllers' first handshakes, then every write and read until nothing is left
        to do: the state the exploration starts from (no budget spent)."""
        for x in CONTROLLERS:
            self.apply(("dial", x))
            self.apply(("admit", x))
        for _ in range(100):
            steps = [a for a in self.actions(healed=True) if a[0] in ("flush", "deliver")]
            if not steps:
                break
            self.apply(steps[0])
        if not self.goal():
            raise AssertionError("the model's start is not both controllers attached and ready")
        self.dials = 0

    def clone(self) -> ControllersWorld:
        new = ControllersWorld.__new__(ControllersWorld)
        new.__dict__.update(self.__dict__)
        pool = RetentionPool(self.worker_pool.limit)
        pool.used = self.worker_pool.used
        new.sides = {
            x: side.clone(pool if side.role == "w" else None) for x, side in self.sides.items()
        }
        new.sockets = {n: sock.clone() for n, sock in self.sockets.items()}
        new.logs = {sid: log.clone() for sid, log in self.logs.items()}
        new.slot_of = dict(self.slot_of)
        new.owner = dict(self.owner)
        new.detached_at = dict(self.detached_at)
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> ControllersWorld:
        return self.clone()

    @property
    def worker_pool(self) -> RetentionPool:
        return self.sides[self.slots[0]].pool

    @property
    def worker_runtime(self) -> bytes:
        return self.sides[self.slots[0]].runtime

    def _holds_place(self, y: str) -> bool:
        side = self.sides[y]
        return side.session is not None or side.sock is not None

    def _evictable(self, y: str) -> bool:
        side = self.sides[y]
        return side.session is not None and side.sock is None

    # ------------------------------------------------------------------ actions

    def actions(self, healed: bool = False) -> list[tuple[str, ...]]:
        acts: list[tuple[str, ...]] = []
        b = self.bounds
        assert isinstance(b, ControllerBounds)
        for x, side in self.sides.items():
            budget = b.sends if side.role == "c" else b.worker_sends
            acts += self._side_actions(x, budget, healed)
        if not healed and self.restarts < b.restarts:
            acts.extend(("restart", x) for x in CONTROLLERS)
        if not healed and self.worker_restarts < b.worker_restarts:
            acts.append(("restart", "w"))
        if not healed and self.cuts < b.cuts:
            acts.extend(("cut", str(n)) for n in self.sockets)
        for x in CONTROLLERS:
            c = self.sides[x]
            if c.sock is None and not c.stopped:
                if c.dialing is not None:
                    acts.append(("admit", x))
                elif healed or self.dials < b.dials:
                    acts.append(("dial", x))
        return acts

    def _leave(self, x: str, retired: bool = False) -> None:
        super()._leave(x, retired)
        self._mark_detached(x)

    def _notice(self, x: str) -> str:
        text = super()._notice(x)
        self._mark_detached(x)
        return text

    def _mark_detached(self, x: str) -> None:
        """A worker slot's socket went: when, for :func:`~garcon_link.core.admission.evictee`."""
        if self.sides[x].role == "w":
            self.detachments += 1
            self.detached_at[x] = self.detachments

    def _cut(self, n: str) -> str:
        sock = self.sockets.pop(int(n))
        lost = sum(len(q) for q in sock.queues.values())
        self.cuts += 1
        for x in CONTROLLERS:
            if self.sides[x].dialing == sock.number:
                self.sides[x].dialing = None
                return f"socket {self._name(sock.number)} ({x}'s) cut during its handshake"
        return f"socket {self._name(sock.number)} cut ({lost} message(s) in flight lost)"

    def _reset(self, side: Side, pool: RetentionPool) -> None:
        """A process's side after a restart: nothing held, a new runtime."""
        side.session = None
        side.session_id = None
        side.peer_runtime = None
        side.dialing = None
        side.fence_passed = False
        side.buffer = PreReadinessBuffer(side.limits)
        side.taken_over = []
        side.stopped = False
        side.incarnation += 1
        side.pool = pool

    def _restart(self, x: str) -> str:
        if x == "w":
            self.worker_restarts += 1
            pool = RetentionPool(self.worker_pool.limit)
            for y in self.slots:
                side = self.sides[y]
                if side.session_id is not None and side.session is not None:
                    self.logs[side.session_id].crashed.add("w")
                super()._leave(y)
                self._reset(side, pool)
            self.slot_of.clear()
            self.detached_at.clear()
            for c in CONTROLLERS:  # a handshake under way dies with the worker
                if self.sides[c].dialing is not None:
                    self.sockets.pop(self.sides[c].dialing or 0, None)
                    self.sides[c].dialing = None
            self._collect()
            return "the worker restarts (new runtime, no session in any slot)"
        side = self.sides[x]
        self.restarts += 1
        if side.session_id is not None and side.session is not None:
            self.logs[side.session_id].crashed.add("c")
        self._leave(x)
        if side.dialing is not None:
            self.sockets.pop(side.dialing, None)
        self._reset(side, RetentionPool(side.pool_limit))
        self._collect()
        return f"{x} restarts (new runtime {side.runtime.rstrip(b'.').decode()}, no session)"

    def _dial(self, x: str = CONTROLLERS[0]) -> str:  # (the base's dialer is its one worker)
        """Controller ``x`` opens a socket; both hellos are composed now: the worker's from the
        slot :func:`slot_key` names for ``x``'s (unverified) hello, as the link does."""
        c = self.sides[x]
        self.dials += 1
        self.opened += 1
        sock = Socket(self.opened, dialer=x)
        c_offer = c.offer()
        claimed = Hello(
            protocol=PROTOCOL_VERSION,
            package="model",
            role=Role.CONTROLLER,
            executor=EXECUTOR,
            runtime=c.runtime,
            peer_runtime=c_offer.peer_runtime if c_offer is not None else None,
            session=c_offer.session_id if c_offer is not None else None,
            received=c_offer.received if c_offer is not None else 0,
            nonce=bytes(32),
            controller=c.controller_id,
        )
        key = admission.slot_key(EXECUTOR, claimed.controller, claimed.runtime, per_controller=True)
        y = self.slot_of.get(key)
        held = self.sides[y].offer() if y is not None else None
        sock.hellos = (c_offer, listener_offer(claimed, held, self.worker_runtime))
        self.sockets[sock.number] = sock
        c.dialing = sock.number
        return f"{x} dials socket {self._name(sock.number)}"

    def _slot_for(self, key: SlotKey) -> str:
        """The worker slot for ``key``, or a free one (as the link drops slots that hold no
        place, and makes a new one)."""
        y = self.slot_of.get(key)
        if y is not None:
            return y
        for k, z in list(self.slot_of.items()):
            if not self._holds_place(z):
                del self.slot_of[k]
        used = set(self.slot_of.values())
        for z in self.slots:
            if z not in used and not self._holds_place(z):
                self.sides[z].taken_over = []
                self.slot_of[key] = z
                return z
        raise Violation("the worker holds more slots than max_controllers + 1")

    def _admit(self, x: str = CONTROLLERS[0]) -> str:
        """Both handshakes, then ``decide``: the worker's on the slot ``slot_key`` names (it
        holds its proof until it has admitted the controller), then the controller's."""
        b = self.bounds
        assert isinstance(b, ControllerBounds)
        c = self.sides[x]
        assert c.dialing is not None
        sock = self.sockets[c.dialing]
        c.dialing = None
        assert sock.hellos is not None
        offers = {"c": sock.hellos[0], "w": sock.hellos[1]}
        sock.hellos = None
        result_c, result_w = handshake_results(
            c.runtime, self.worker_runtime, offers, sock.number, controller=c.controller_id
        )
        if (result_c.resume, result_c.session_id) != (result_w.resume, result_w.session_id):
            raise Violation("the two handshakes settled on different sessions")
        resume, session_id = result_c.resume, result_c.session_id
        notes = [f"{x}'s handshake on {self._name(sock.number)}: {'resume' if resume else 'fresh'}"]
        peer = result_w.peer
        key = admission.slot_key(EXECUTOR, peer.controller, peer.runtime, per_controller=True)
        y = self._slot_for(key)
        w = self.sides[y]
        others = [(self._holds_place(z), self._evictable(z)) for z in self.slots if z != y]
        full, evictable = admission.places(others, b.max_controllers)
        view = SlotView(
            session=w.session_id if w.session is not None else None,
            peer_runtime=w.peer_runtime if w.session is not None else None,
            attached=w.sock is not None,
            full=full,
            evictable=evictable,
        )
        offer = Offer(
            resume=resume,
            session=session_id,
            runtime=c.runtime,
            taken_over=c.runtime in w.taken_over,
        )
        decision = admission.decide(view, offer)
        if isinstance(decision, Probe):
            old = self.sockets.get(w.sock) if w.sock is not None else None
            healthy = old is not None and "c" in old.ends
            decision = admission.decide(view, offer, probe_healthy=healthy)
            notes.append(f"{y} probes its attached socket: {'healthy' if healthy else 'dead'}")
        if isinstance(decision, Refuse):
            notes.append(f"the worker ({y}) refuses ({decision.reason.name})")
            self.sockets.pop(sock.number, None)
            if decision.reason is HandshakeFailure.TAKEN_OVER:
                c.stopped = True
                if c.session is not None:
                    self._retire(x, FailureReason.TAKEN_OVER)
            return "; ".join(notes)
        notes.append(f"the worker ({y}): {type(decision).__name__}")
        if isinstance(decision, Resume):
            assert w.session is not None
            if decision.supersede_attached and w.sock is not None:
                self._leave(y)
                w.session.detach(0.0)
                notes.append(f"{y} drops its old socket")
            try:
                w.session.attach(result_w.peer.received)
                w.buffer.attach()
            except SessionFailed as failure:
                self._retire(y, FailureReason.RESUME_REFUSED)
                self.sockets.pop(sock.number, None)
                return "; ".join([*notes, f"{y}'s resume refused: {failure}"])
        else:
            assert isinstance(decision, Fresh)
            if decision.evict_detached:
                candidates = [(z, self.detached_at.get(z, 0)) for z in self.slots]
                victim = admission.evictee(
                    (z, at) for z, at in candidates if z != y and self._evictable(z)
                )
                if victim is None:
                    raise Violation("decide() evicts, but no other slot holds a detached session")
                v = self.sides[victim]
                assert v.session_id is not None
                notes.append(f"{victim} ({self.owner[v.session_id]}'s, detached) evicted")
                self._retire(victim, FailureReason.EVICTED)
            if w.session is not None:
                assert w.session_id is not None
                if not decision.retire_current:
                    raise Violation(
                        f"{y} replaced its live session without retiring it: its pending "
                        "messages would never get an outcome"
                    )
                owner = self.owner[w.session_id]
                if owner != x:
                    raise Violation(
                        f"the worker retired {owner}'s session ({y}) for {x}'s handshake: one "
                        "controller disturbed another's session"
                    )
                if decision.taken_over:
                    assert w.peer_runtime is not None
                    w.taken_over.append(w.peer_runtime)
                self._retire(y, FailureReason.REPLACED)
            self._fresh(y, session_id, c.runtime, x)
        w.sock = sock.number
        sock.ends.add("w")
        sock.slot = y
        # The controller's decision, on its own slot.
        c_offer = Offer(
            resume=resume,
            session=session_id,
            runtime=self.worker_runtime,
            taken_over=self.worker_runtime in c.taken_over,
        )
        decision = admission.decide(c.view(), c_offer)
        if isinstance(decision, Probe):
            old = self.sockets.get(c.sock) if c.sock is not None else None
            healthy = old is not None and "w" in old.ends
            decision = admission.decide(c.view(), c_offer, probe_healthy=healthy)
        if isinstance(decision, Refuse):
            notes.append(f"{x} refuses ({decision.reason.name})")
            return "; ".join(notes)  # the worker's slot notices the socket is gone
        notes.append(f"{x}: {type(decision).__name__}")
        if isinstance(decision, Resume):
            assert c.session is not None
            try:
                c.session.attach(result_c.peer.received)
                c.buffer.attach()
            except SessionFailed as failure:
                self._retire(x, FailureReason.RESUME_REFUSED)
                return "; ".join([*notes, f"{x}'s resume refused: {failure}"])
        else:
            assert isinstance(decision, Fresh)
            if c.session is not None:
                if not decision.retire_current:
                    raise Violation(f"{x} replaced its live session without retiring it")
                if decision.taken_over:
                    assert c.peer_runtime is not None
                    c.taken_over.append(c.peer_runtime)
                self._retire(x, FailureReason.REPLACED)
            self._fresh(x, session_id, self.worker_runtime, x)
        c.sock = sock.number
        sock.ends.add("c")
        for side, peer_side in ((c, w), (w, c)):
            assert peer_side.session is not None
            side.fence_passed = False
            side.fence_target = peer_side.session.issued
        self._collect()
        return "; ".join(notes)

    def _fresh(self, x: str, session_id: bytes, peer_runtime: bytes, owner: str) -> None:
        side = self.sides[x]
        if session_id not in self.logs:
            self.logs[session_id] = Log()
            self.owner[session_id] = owner
        side.session = MessageSession(side.limits, side.pool)
        side.buffer = PreReadinessBuffer(side.limits)
        side.session_id = session_id
        side.peer_runtime = peer_runtime
        side.session.attach(0)

    def _check_pool_after_retire(self, x: str) -> None:
        if self.sides[x].role == "c":
            super()._check_pool_after_retire(x)

    def _collect(self) -> None:
        super()._collect()
        for sid in [sid for sid in self.owner if sid not in self.logs]:
            del self.owner[sid]

    # ------------------------------------------------------------------ invariants, goal

    def check(self) -> None:
        for log in self.logs.values():
            check_log(log, self.allowed_retirements)
        retained = 0
        carried: dict[int, dict[str, str]] = {}
        for x, side in self.sides.items():
            if side.sock is not None:
                ends = carried.setdefault(side.sock, {})
                if side.role in ends:
                    raise Violation(
                        f"{ends[side.role]} and {x} are attached to one socket "
                        f"{self._name(side.sock)}"
                    )
                ends[side.role] = x
            s = side.session
            if s is None:
                if side.role == "c" and side.pool.used != 0:
                    raise Violation(f"{x}'s retention pool holds {side.pool.used} bytes")
                continue
            assert side.session_id is not None
            log = self.logs[side.session_id]
            st = s.statistics()
            peer_got = len(log.delivered[other(side.role)])
            if s.confirmed > peer_got:
                raise Violation(
                    f"{x} holds confirmed={s.confirmed}, but the peer delivered only {peer_got}"
                )
            if not s.confirmed <= s.offered <= s.issued == len(log.sent[side.role]):
                raise Violation(f"{x}'s counters out of order")
            if st.retained_frames != st.issued - st.confirmed:
                raise Violation(f"{x} retains frames it has no business retaining")
            if st.retained_frames > max(1, side.limits.max_retained_frames):
                raise Violation(f"{x} retains {st.retained_frames} frames, over the bound")
            if side.role == "c" and side.pool.used != st.retained_bytes:
                raise Violation(f"{x}'s retention pool miscounts its session's bytes")
            if side.role == "w":
                retained += st.retained_bytes
        if self.worker_pool.used != retained:
            raise Violation(
                f"the worker's retention pool counts {self.worker_pool.used} bytes, its slots' "
                f"sessions retain {retained}"
            )
        for n, ends in carried.items():
            if len(ends) == 2:
                c, w = self.sides[ends["c"]], self.sides[ends["w"]]
                if c.session_id != w.session_id:
                    raise Violation(
                        f"{ends['c']} and the worker's {ends['w']} share socket {self._name(n)} "
                        "with different sessions"
                    )
        for y in self.slots:
            sid = self.sides[y].session_id
            if sid is not None:
                for x in CONTROLLERS:
                    if self.sides[x].session_id == sid and self.owner.get(sid) != x:
                        raise Violation(f"{x} holds a session that belongs to another controller")

    def goal(self) -> bool:
        if len(self.sockets) != len(CONTROLLERS):
            return False
        for x in CONTROLLERS:
            c = self.sides[x]
            sock = self.sockets.get(c.sock) if c.sock is not None else None
            if sock is None or len(sock.ends) != 2 or any(sock.queues.values()):
                return False
            w = self.sides[sock.slot] if sock.slot else None
            if w is None or w.sock != sock.number:
                return False
            if c.session is None or w.session is None or c.session_id != w.session_id:
                return False
            for side, peer in ((c, w), (w, c)):
                s = side.session
                assert s is not None and peer.session is not None
                if not side.fence_passed or s.frames_queued or s.receipt_due:
                    return False
                if not s.confirmed == s.issued == peer.session.accepted:
                    return False
        return True

    # ------------------------------------------------------------------ state key

    def key(self) -> tuple[Any, ...]:
        """As :meth:`World.key`: names by order of appearance; the core names the state in the
        healed graph, the budgets are the rest."""
        names: dict[Any, int] = {}

        def name(value: Any) -> int | None:
            if value is None:
                return None
            return names.setdefault(value, len(names))

        socks = {n: i for i, n in enumerate(sorted(self.sockets))}
        evictable = sorted(
            (self.detached_at.get(y, 0), y) for y in self.slots if self._evictable(y)
        )
        rank = {y: i for i, (_, y) in enumerate(evictable)}
        parts: list[Any] = []
        for x, side in self.sides.items():
            s = side.session
            sess: Any = None
            if s is not None:
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
                    None if side.dialing is None else socks.get(side.dialing),
                    side.fence_passed,
                    side.fence_target,
                    len(side.buffer),
                    tuple(name(r) for r in side.taken_over),
                    side.stopped,
                    side.pool.used,
                    rank.get(x),
                )
            )
        slot_of = sorted((str(name(k[1])), y) for k, y in self.slot_of.items())
        parts.append(tuple(slot_of))
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
                    tuple(tuple(sk.queues[r]) for r in ("c", "w")),
                    tuple(sorted(sk.ends)),
                    hellos,
                    sk.retired_by,
                    sk.dialer,
                    sk.slot,
                )
            )
        parts.append(tuple(sockets))
        logs = []
        for sid, log in sorted(self.logs.items(), key=lambda kv: names.get(kv[0], 99)):
            logs.append(
                (
                    name(sid),
                    self.owner.get(sid),
                    tuple(tuple(log.sent[r]) for r in ("c", "w")),
                    tuple(tuple(log.delivered[r]) for r in ("c", "w")),
                    tuple(
                        (r, t.reason.name, t.issued, t.offered, t.confirmed)
                        for r, t in sorted(log.retired.items())
                    ),
                    tuple(sorted(log.crashed)),
                )
            )
        parts.append(tuple(logs))
        budgets = (
            tuple(side.sends for side in self.sides.values()),
            self.cuts,
            self.splits,
            self.restarts,
            self.worker_restarts,
            self.expiries,
            self.dials,
        )
        return tuple(parts), budgets
