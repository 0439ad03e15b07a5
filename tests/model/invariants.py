"""The invariants checked in every state, and the goal of the liveness check.

Safety, in every state:

- **Prefix**: what each side delivered in a session is exactly the first messages the other
  side sent in it: in order, gap-free, duplicate-free.
- **Honest receipts**: a side's ``confirmed`` never exceeds what the peer really delivered.
- **Honest outcomes**: when a side retires a session, its pending messages (``confirmed <
  ordinal <= issued``) are classified by the outcome rule -- ``ordinal <= offered``: written to
  some socket, ``OutcomeUnknown``; otherwise never written, ``NotDispatched`` -- and the peer
  never delivers a ``NotDispatched`` one, then or later.
- **Legitimate retirement**: a session is retired only for a reason this network can cause
  (:data:`~.network.ALLOWED_RETIREMENTS`): an honest network never provokes a gap, a receipt
  beyond what was written or a refused resume.
- **Agreement**: when both sides are attached to one socket, they hold the same session.
- **Retention**: within ``max_retained_frames`` and the pool's limit (a lone frame is always
  admitted), exactly the unconfirmed frames (``issued - confirmed``), and the retention pool
  counts exactly the bytes its session retains.
- **Pre-readiness buffer**: what a side holds before the peer's replay fence never passes its
  bound, which is what the peer can retain (checked as each payload is held, when the side
  reads a message): an honest peer never causes ``INBOUND_OVERFLOW``.

Goal (liveness): both sides attached to the only socket, in the same session, past the replay
fence, nothing in flight, nothing left to write, and every message either side issued in it
delivered and confirmed.
"""

from __future__ import annotations

from garcon_link.errors import FailureReason

from .network import ALLOWED_RETIREMENTS, SIDES, Log, Violation, World, other

__all__ = ["check_log", "check_world", "goal"]


def check_log(log: Log, allowed: frozenset[FailureReason] = ALLOWED_RETIREMENTS) -> None:
    for x in SIDES:
        delivered = log.delivered[x]
        sent = log.sent[other(x)]
        if delivered != sent[: len(delivered)]:
            raise Violation(
                f"{x} delivered {[b.decode() for b in delivered]}, but the peer sent "
                f"{[b.decode() for b in sent]}: not an in-order, gap-free, duplicate-free prefix"
            )
        retired = log.retired.get(x)
        if retired is None:
            continue
        if retired.reason not in allowed:
            raise Violation(
                f"{x} retired its session for {retired.reason.name}, which an honest network "
                "never causes"
            )
        peer_got = len(log.delivered[other(x)])
        if retired.not_dispatched and peer_got >= retired.not_dispatched.start:
            raise Violation(
                f"{x} retired with ordinals {list(retired.not_dispatched)} classified "
                f"NotDispatched (never written; offered={retired.offered}), but the peer "
                f"delivered {peer_got} message(s)"
            )
        if retired.confirmed > peer_got:
            raise Violation(
                f"{x} retired with confirmed={retired.confirmed}, but the peer delivered only "
                f"{peer_got}"
            )


def check_world(world: World) -> None:
    for log in world.logs.values():
        check_log(log)
    for x in SIDES:
        side = world.sides[x]
        limits = side.limits
        s = side.session
        if s is None:
            if side.pool.used != 0:
                raise Violation(f"{x}'s retention pool holds {side.pool.used} bytes, no session")
            continue
        assert side.session_id is not None
        log = world.logs[side.session_id]
        st = s.statistics()
        peer_got = len(log.delivered[other(x)])
        if s.confirmed > peer_got:
            raise Violation(
                f"{x} holds confirmed={s.confirmed}, but the peer delivered only {peer_got}: "
                "a receipt acknowledged what was never delivered"
            )
        if not s.confirmed <= s.offered <= s.issued == len(log.sent[x]):
            raise Violation(
                f"{x}'s counters out of order: confirmed={s.confirmed} offered={s.offered} "
                f"issued={s.issued} sent={len(log.sent[x])}"
            )
        if st.retained_frames != st.issued - st.confirmed:
            raise Violation(
                f"{x} retains {st.retained_frames} frame(s), but {st.issued - st.confirmed} "
                "are unconfirmed"
            )
        if st.retained_frames > max(1, limits.max_retained_frames):
            raise Violation(f"{x} retains {st.retained_frames} frames, over the bound")
        if st.retained_bytes > limits.max_retained_bytes:
            raise Violation(f"{x} retains {st.retained_bytes} bytes, over the bound")
        if side.pool.used > side.pool.limit and st.retained_frames > 1:
            raise Violation(f"{x}'s retention pool holds {side.pool.used} bytes, over its limit")
        if side.pool.used != st.retained_bytes:
            raise Violation(
                f"{x}'s retention pool counts {side.pool.used} bytes, its session retains "
                f"{st.retained_bytes}"
            )
    c, w = world.sides["c"], world.sides["w"]
    if c.sock is not None and c.sock == w.sock and c.session_id != w.session_id:
        raise Violation("both sides are attached to one socket with different sessions")


def goal(world: World) -> bool:
    """All delivered and confirmed, both ready, nothing left to do (see the module docstring)."""
    c, w = world.sides["c"], world.sides["w"]
    live = world.sockets.get(c.sock) if c.sock is not None else None
    if live is None or w.sock != live.number or len(live.ends) != 2:
        return False
    if any(live.queues[x] for x in SIDES) or len(world.sockets) != 1:
        return False
    if c.session is None or w.session is None or c.session_id != w.session_id:
        return False
    for side, peer in ((c, w), (w, c)):
        s = side.session
        assert s is not None and peer.session is not None
        if not side.fence_passed:
            return False
        if s.frames_queued or s.receipt_due:
            return False
        if not s.confirmed == s.issued == peer.session.accepted:
            return False
    return True
