"""A retention budget shared by many sessions (``Limits.max_total_retained_bytes``).

Sans-IO: sessions sharing a :class:`RetentionPool` admit frames only while the pool has room,
except each session's lone frame (so no caller can deadlock); receipts and failures give the
bytes back; a full pool is back-pressure, never a failure. A Hypothesis run checks that the
pool's count always equals the sum of what its sessions retain.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from garcon_link.core.session import MessageSession, RetentionPool, encoded_message_size
from garcon_link.core.wire import encode_receipt
from garcon_link.errors import FailureReason
from garcon_link.limits import Limits

BODY = b"x" * 100
FRAME = encoded_message_size(1, len(BODY))  # ordinals 1-23 encode in the same size


def test_a_full_pool_holds_back_every_session_but_their_lone_frames() -> None:
    pool = RetentionPool(3 * FRAME)
    a, b = MessageSession(Limits(), pool), MessageSession(Limits(), pool)
    for _ in range(3):
        a.send(BODY)
    assert pool.used == 3 * FRAME
    assert not a.has_capacity(len(BODY))  # a's own retention is far from its bound
    assert b.has_capacity(len(BODY))  # a lone frame is always admitted
    b.send(BODY)
    assert pool.used == 4 * FRAME  # over by at most one frame per session
    assert not b.has_capacity(len(BODY))
    a.attach(0)
    a.data_to_send()
    a.receive(encode_receipt(2))  # the peer holds two of a's frames
    assert pool.used == 2 * FRAME
    assert b.has_capacity(len(BODY)) and a.has_capacity(len(BODY))
    a.fail(FailureReason.CLOSED)
    assert pool.used == FRAME  # b's frame only
    assert b.failure is None  # nobody failed for the pool


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["send", "ack", "fail"]), st.integers(0, 5)),
        max_size=60,
    )
)
def test_the_pool_counts_exactly_what_its_sessions_retain(
    steps: list[tuple[int, str, int]],
) -> None:
    pool = RetentionPool(10 * FRAME)
    sessions = [MessageSession(Limits(), pool) for _ in range(3)]
    for s in sessions:
        s.attach(0)
    for index, action, n in steps:
        s = sessions[index]
        if s.failure is not None:
            continue
        if action == "send" and s.has_capacity(len(BODY)):
            s.send(BODY)
            s.data_to_send()
        elif action == "ack":
            stats = s.statistics()
            through = min(stats.offered, stats.confirmed + n)
            s.receive(encode_receipt(through))
        elif action == "fail":
            s.fail(FailureReason.CLOSED)
        assert pool.used == sum(x.statistics().retained_bytes for x in sessions)
        assert pool.used <= pool.limit + len(sessions) * FRAME
