"""Stateful property test: two MessageSessions under random sends, faults, cuts and resumes.

The network model is the one a WebSocket gives: while a socket is up, messages arrive in order
and unaltered (possibly late, possibly twice when a test replays one, with receipts possibly
moved within a message); a cut loses whatever was in flight. Under that model nothing may ever
be lost, duplicated or reordered for the consumers, and the session must never fail.
"""

from __future__ import annotations

from helpers import SessionPair, Side
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from garcon_link.core.session import SessionState, encoded_message_size
from garcon_link.core.wire import Packet, Receipt
from garcon_link.errors import RetentionFull
from garcon_link.limits import Limits

LIMITS = Limits(
    max_retained_frames=16,
    max_retained_bytes=4096,
    max_frame_bytes=1024,
    max_handshake_frame_bytes=512,
    detached_grace=10.0,
)

sides_ = st.sampled_from(["a", "b"])


def receipts_first(packets: list[Packet]) -> list[Packet]:
    """A harmless reordering: receipts ahead of the messages they travelled with."""
    receipts = [p for p in packets if isinstance(p, Receipt)]
    return receipts + [p for p in packets if not isinstance(p, Receipt)]


class SessionPairMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pair = SessionPair(LIMITS)
        self.now = 0.0
        self.deadline: float | None = None
        self.counter = 0
        self.last_accepted = {"a": 0, "b": 0}
        self.start_attachment()

    def start_attachment(self) -> None:
        """Note, per side, where the replay fence of the new attachment must fall."""
        # Fence: the first receipt a side receives on an attachment comes after everything the
        # peer had issued when it attached (the replay and frames queued while detached).
        self.fence_target = {s.name: self.pair.peer(s.name).session.issued for s in self.sides()}
        self.receipts_at_attach = {s.name: s.session.receipts_received for s in self.sides()}
        self.fence_seen = {"a": False, "b": False}

    def sides(self) -> tuple[Side, Side]:
        return self.pair.a, self.pair.b

    def deliver_from(self, sender: str, count: int) -> None:
        receiver = self.pair.peer(sender)
        for _ in range(count):
            if not self.pair.side(sender).wire:
                return
            self.pair.deliver(sender, 1)
            # The session reports the fence exactly when the first receipt of the attachment
            # arrives (counted here independently).
            fence = (
                not self.fence_seen[receiver.name]
                and receiver.session.receipts_received > self.receipts_at_attach[receiver.name]
            )
            assert receiver.events[-1].fence == fence
            if fence:
                assert receiver.session.accepted >= self.fence_target[receiver.name]
                self.fence_seen[receiver.name] = True

    # -- rules ----------------------------------------------------------------------------------

    @rule(
        side=sides_,
        sizes=st.lists(st.integers(min_value=0, max_value=900), min_size=1, max_size=3),
    )
    def send(self, side: str, sizes: list[int]) -> None:
        session = self.pair.side(side).session
        for size in sizes:
            self.counter += 1
            body = f"{side}{self.counter}:".encode().ljust(size, b".")
            expected = session.has_capacity(len(body))
            issued = session.issued
            try:
                ordinal = self.pair.send(side, body)
            except RetentionFull:
                assert not expected
                assert session.issued == issued
                assert session.failure is None
            else:
                assert expected
                assert ordinal == issued + 1

    @precondition(lambda self: self.pair.attached)
    @rule(side=sides_)
    def flush(self, side: str) -> None:
        self.pair.flush(side)

    @precondition(lambda self: self.pair.attached)
    @rule(
        side=sides_,
        count=st.integers(min_value=1, max_value=3),
        fault=st.sampled_from(["none", "none", "duplicate", "late duplicate", "receipts first"]),
    )
    def deliver(self, side: str, count: int, fault: str) -> None:
        wire = self.pair.side(side).wire
        if wire and fault == "duplicate":
            self.pair.duplicate(side)
            count += 1
        elif wire and fault == "receipts first":
            self.pair.reorder(side, receipts_first)
        self.deliver_from(side, count)
        if fault == "late duplicate":
            assert self.pair.redeliver(side) == []

    @precondition(lambda self: self.pair.attached)
    @rule(side=sides_, survivors=st.integers(min_value=0, max_value=2))
    def cut(self, side: str, survivors: int) -> None:
        # a few messages make it across, the rest is lost with the socket (a live socket never
        # loses data: any loss is the end of the socket)
        self.deliver_from(side, survivors)
        self.pair.cut(self.now)
        self.deadline = self.now + LIMITS.detached_grace
        for each in self.sides():
            assert each.session.grace_deadline == self.deadline
            assert each.session.data_to_send() == []

    @precondition(lambda self: not self.pair.attached)
    @rule()
    def reattach(self) -> None:
        self.pair.reattach()
        self.deadline = None
        for each in self.sides():
            assert each.session.grace_deadline is None
            assert each.session.receipt_due  # the trailing receipt: the peer's replay fence
        self.start_attachment()

    @rule(dt=st.floats(min_value=0.0, max_value=4.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        if self.deadline is not None:
            # detached: time passes, but stays inside the grace period
            self.now = min(self.now, self.deadline - 0.001)
        for each in self.sides():
            assert each.session.next_deadline() == self.deadline
            assert each.session.poll(self.now) is None

    @rule()
    def settle(self) -> None:
        self.settle_and_check()

    # -- checks ---------------------------------------------------------------------------------

    def settle_and_check(self) -> None:
        if not self.pair.attached:
            self.reattach()
        for _ in range(20):
            moved = self.pair.flush("a") + self.pair.flush("b")
            if not (moved or self.pair.a.wire or self.pair.b.wire):
                break
            self.deliver_from("a", len(self.pair.a.wire))
            self.deliver_from("b", len(self.pair.b.wire))
        else:
            raise AssertionError("the pair did not quiesce")
        for side in self.sides():
            peer = self.pair.peer(side.name)
            assert peer.received == side.sent
            stats = side.session.statistics()
            assert (stats.retained_frames, stats.retained_bytes) == (0, 0)
            assert stats.issued == stats.offered == stats.confirmed == len(side.sent)
            assert not side.session.receipt_due
            assert self.fence_seen[side.name]

    @invariant()
    def consumers_received_a_prefix_in_order(self) -> None:
        for side in self.sides():
            peer = self.pair.peer(side.name)
            received = peer.received
            assert received == side.sent[: len(received)]
            assert peer.session.accepted == len(received)
            assert peer.session.accepted >= self.last_accepted[peer.name]
            self.last_accepted[peer.name] = peer.session.accepted

    @invariant()
    def counters_and_retention_within_bounds(self) -> None:
        for side in self.sides():
            session = side.session
            peer = self.pair.peer(side.name).session
            assert session.failure is None
            assert session.state is not SessionState.FAILED
            assert session.confirmed <= peer.accepted <= session.offered
            assert session.confirmed <= session.offered <= session.issued == len(side.sent)
            stats = session.statistics()
            assert stats.retained_frames == session.issued - session.confirmed
            assert stats.retained_frames <= LIMITS.max_retained_frames
            assert stats.retained_bytes <= LIMITS.max_retained_bytes
            retained = side.sent[session.confirmed :]
            expected_bytes = sum(
                encoded_message_size(session.confirmed + 1 + i, len(body))
                for i, body in enumerate(retained)
            )
            assert stats.retained_bytes == expected_bytes

    def teardown(self) -> None:
        self.settle_and_check()


SessionPairMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=30, deadline=None
)
test_session_pair = SessionPairMachine.TestCase
