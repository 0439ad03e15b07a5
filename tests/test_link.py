"""WebSocketLink over real loopback sockets (docs/design.md#link): continuity, retirement, defences.

Every end-to-end test runs in both dial directions (the controller dials the worker, or the worker
dials the controller) and on both anyio backends. Time bounds are shrunk with :func:`small_limits`;
tests wait for conditions under bounded deadlines and never assert on a sleep. Misbehaving peers
are hand-written (:class:`linkutil.RawClient`); after each one the listener must still complete a
session with a legitimate peer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

import anyio
import anyio.abc
import cbor2
import h11
import pytest
import trustme
from anyio.abc import SocketAttribute
from faultutil import (
    OP_BINARY,
    OP_CONTINUATION,
    OP_PING,
    Raw,
    accept_upgrade,
    raw_listener,
    ws_frame,
)
from linkutil import (
    CONTROLLER,
    DIRECTIONS,
    EXECUTOR,
    SECRET,
    Endpoint,
    RawClient,
    SessionRecord,
    body,
    endpoint,
    link_pair,
    make_link,
    roles,
    send_all,
    small_limits,
    start_link,
    wait_until,
)
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, RejectConnection

from garcon_link.core.admission import backoff
from garcon_link.core.handshake import Handshake, Hello, ResumeOffer, compute_mac, derive_key
from garcon_link.core.session import MessageSession, Received
from garcon_link.core.wire import Role, encode_canonical, encode_message
from garcon_link.endpoint.link import (
    FrameBudget,
    WebSocketLink,
    is_loopback_host,
    upgrade_refusal,
)
from garcon_link.endpoint.transport import TransportState
from garcon_link.errors import ConfigError, FailureReason, LinkError, SessionFailed
from garcon_link.limits import Limits
from garcon_link.net.addresses import parse_dial_url
from garcon_link.net.ws import LinkStatistics, client_upgrade, connect
from garcon_link.settings.keyring import Keyring
from garcon_link.settings.secrets import write_secret_file
from garcon_link.testing import FaultProxy

pytestmark = pytest.mark.timeout(30)

anyio_test = pytest.mark.anyio
by_direction = pytest.mark.parametrize("direction", DIRECTIONS)

DEADLINE = 10.0  # no single test may take longer than this (it would be a hang, not a result)
CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


def ws_frame_size(payload: int, *, masked: bool) -> int:
    """Bytes of one unfragmented WebSocket frame carrying ``payload`` bytes."""
    header = 2 if payload < 126 else 4 if payload < 65536 else 10
    return header + (4 if masked else 0) + payload


# ------------------------------------------------------------------------------------------------
# backoff(): a pure generator, tested without a clock (outside any event loop)


class _CeilingRng(random.Random):
    """Always draws the top of the range, to expose the ceiling sequence."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_backoff_first_delay_zero_then_full_jitter_within_capped_ceiling() -> None:
    limits = Limits(backoff_base=0.1, backoff_max=1.5)
    gen = backoff(limits, random.Random(1234))
    delays = [next(gen) for _ in range(40)]
    assert delays[0] == 0.0
    for n, delay in enumerate(delays[1:]):
        assert 0.0 <= delay <= min(limits.backoff_max, limits.backoff_base * 2**n)
    # Full jitter: the draws are spread over the range, not pinned to its top.
    assert len(set(delays[1:])) == len(delays) - 1
    assert min(delays[10:]) < limits.backoff_max / 2 < max(delays[10:])


def test_backoff_ceiling_doubles_from_base_and_is_capped() -> None:
    limits = Limits(backoff_base=0.25, backoff_max=3.0)
    gen = backoff(limits, _CeilingRng())
    assert [next(gen) for _ in range(8)] == [0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_backoff_is_reproducible_with_a_seeded_rng() -> None:
    limits = Limits(backoff_base=0.01, backoff_max=0.05)
    a = backoff(limits, random.Random(7))
    b = backoff(limits, random.Random(7))
    assert [next(a) for _ in range(20)] == [next(b) for _ in range(20)]


# ------------------------------------------------------------------------------------------------
# construction


def test_link_needs_exactly_one_of_listen_and_dial() -> None:
    with pytest.raises(ConfigError):
        WebSocketLink(role=Role.WORKER, executor_id=EXECUTOR, secret=SECRET)
    with pytest.raises(ConfigError):
        WebSocketLink(
            role=Role.WORKER,
            executor_id=EXECUTOR,
            secret=SECRET,
            listen=("127.0.0.1", 0),
            dial="ws://127.0.0.1:1/executor",
        )


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1/executor",
        "ws://127.0.0.1:1/other",
        "ws://user:pw@127.0.0.1:1/executor",
        "ws://127.0.0.1:1/executor?x=1",
        "ws://127.0.0.1:99999/executor",
    ],
)
def test_bad_dial_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        WebSocketLink(role=Role.CONTROLLER, executor_id=EXECUTOR, secret=SECRET, dial=url)


def test_short_secret_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        WebSocketLink(
            role=Role.WORKER, executor_id=EXECUTOR, secret=b"short", listen=("127.0.0.1", 0)
        )


def test_plain_text_off_loopback_requires_allow_insecure_development() -> None:
    with pytest.raises(ConfigError, match="allow_insecure_development"):
        WebSocketLink(
            role=Role.CONTROLLER,
            executor_id=EXECUTOR,
            secret=SECRET,
            dial="ws://build-box.example:80/executor",
        )
    with pytest.raises(ConfigError):
        WebSocketLink(role=Role.WORKER, executor_id=EXECUTOR, secret=SECRET, listen=("0.0.0.0", 0))
    WebSocketLink(
        role=Role.CONTROLLER,
        executor_id=EXECUTOR,
        secret=SECRET,
        dial="ws://build-box.example:80/executor",
        allow_insecure_development=True,
    )
    WebSocketLink(
        role=Role.CONTROLLER,
        executor_id=EXECUTOR,
        secret=SECRET,
        dial="wss://build-box.example/executor",
    )


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("LOCALHOST", True),
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("10.0.0.1", False),
        ("0.0.0.0", False),
        ("example.com", False),
        ("::ffff:127.0.0.1", False),  # on every Python version (3.13 alone calls it loopback)
        ("[::ffff:127.0.0.1]", False),
    ],
)
def test_is_loopback_host(host: str, expected: bool) -> None:
    assert is_loopback_host(host) is expected


# ------------------------------------------------------------------------------------------------
# a session, and continuity across forced disconnects


@anyio_test
@by_direction
async def test_session_comes_up_and_carries_messages_both_ways(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            lrec, drec = await pair.wait_ready()
            # The listener role really is the one requested, and each side knows its peer.
            listen_role, dial_role = roles(direction)
            assert pair.listener.link.role is listen_role and pair.dialer.link.role is dial_role
            assert lrec.transport.peer_runtime == pair.dialer.link.runtime_id
            assert drec.transport.peer_runtime == pair.listener.link.runtime_id
            assert not lrec.result.resume and not drec.result.resume
            assert pair.listener.link.transport is lrec.transport

            down = [body(i, "d") for i in range(50)]
            up = [body(i, "u") for i in range(50)]
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all, lrec.transport, down)
                tg.start_soon(send_all, drec.transport, up)
            await pair.dialer.wait_received(50)
            await pair.listener.wait_received(50)
            assert drec.received == down and lrec.received == up

            # Receipts flow back, so retention drains on both sides.
            for rec in (lrec, drec):

                def drained(r: SessionRecord = rec) -> bool:
                    return r.transport.statistics().session.confirmed == 50

                await wait_until(drained)
                stats = rec.transport.statistics()
                assert stats.state is TransportState.READY
                assert stats.attachments == 1
                assert stats.session.retained_frames == 0 and stats.session.retained_bytes == 0
                assert stats.session.issued == stats.session.offered == 50
                assert stats.session.accepted == 50 and stats.session.delivered == 50
                assert stats.buffered_payloads == 0 and stats.buffered_bytes == 0
                assert stats.messages_written >= 1 and stats.messages_read >= 1

            ls, ds = pair.listener.link.statistics(), pair.dialer.link.statistics()
            assert ls.connections == 1 and ls.handshakes_completed == 1
            assert ls.fresh_sessions == ds.fresh_sessions == 1
            assert ls.resumed == ds.resumed == 0
            assert ds.dial_attempts == 1 and ds.handshakes_completed == 1
            assert ls.heartbeat_timeouts == ds.heartbeat_timeouts == 0
            assert pair.listener.link.last_error is None


@anyio_test
@by_direction
@pytest.mark.parametrize("who", ["listener", "dialer", "both"])
async def test_messages_survive_repeated_disconnects_exactly_once_in_order(
    direction: str, who: str
) -> None:
    """Messages sent before, during and after forced disconnects, in both directions at once,
    arrive exactly once and in order on the one logical session."""
    n = 300
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            lrec, drec = await pair.wait_ready()
            session_id = lrec.session_id
            down = [body(i, "d") for i in range(n)]
            up = [body(i, "u") for i in range(n)]
            cutters = {
                "listener": [pair.listener],
                "dialer": [pair.dialer],
                "both": [pair.listener, pair.dialer],
            }[who]

            async def send_with_disconnects(
                transport_sender: Endpoint, bodies: list[bytes]
            ) -> None:
                t = transport_sender.current.transport
                for i, b in enumerate(bodies):
                    await t.send(b)
                    if i % 37 == 0:
                        await anyio.sleep(0)  # let the writer run: some frames leave, some wait
                    if i % 50 == 25:
                        cutter = cutters[(i // 50) % len(cutters)]
                        await cutter.link.disconnect()

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_with_disconnects, pair.listener, down)
                tg.start_soon(send_with_disconnects, pair.dialer, up)
            await pair.dialer.wait_received(n)
            await pair.listener.wait_received(n)
            assert drec.received == down
            assert lrec.received == up
            # One logical session throughout, resumed on new sockets.
            assert len(pair.listener.sessions) == len(pair.dialer.sessions) == 1
            assert pair.listener.current.session_id == pair.dialer.current.session_id == session_id
            assert pair.listener.link.statistics().resumed >= 1
            assert pair.dialer.link.statistics().resumed >= 1
            await wait_until(lambda: lrec.ready and drec.ready)


@anyio_test
@by_direction
@pytest.mark.parametrize("sender", ["listener", "dialer"])
@pytest.mark.parametrize("cut", ["message-end", "mid-message", "receipt"])
async def test_cut_around_one_message_and_its_receipt(
    direction: str, sender: str, cut: str
) -> None:
    """A cut at an exact byte: right after the peer received the message (its receipt can never
    come back), inside the message, or on the receipt itself. Exactly once in every case."""
    limits = small_limits(heartbeat_interval=5.0, heartbeat_timeout=10.0, detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits, proxy=True) as pair:
            assert pair.proxy is not None
            await pair.wait_ready()
            src = pair.listener if sender == "listener" else pair.dialer
            dst = pair.dialer if sender == "listener" else pair.listener
            src_t, dst_t = src.current.transport, dst.current.transport
            # The proxy's "down" carries listener -> dialer; client (dialer) frames are masked.
            forward: Literal["up", "down"] = "down" if sender == "listener" else "up"
            backward: Literal["up", "down"] = "up" if sender == "listener" else "down"
            first = body(0)
            size = ws_frame_size(len(encode_message(1, first)), masked=sender == "dialer")
            if cut == "message-end":
                pair.proxy.cut_after(size, forward)
            elif cut == "mid-message":
                pair.proxy.cut_after(size - 3, forward)
            else:
                pair.proxy.cut_after(0, backward)
            pair.proxy.refuse()  # hold the reconnection until the state has been checked
            await src_t.send(first)
            await wait_until(
                lambda: (
                    src_t.state is TransportState.DETACHED
                    and dst_t.state is TransportState.DETACHED
                ),
                what="both sides to detach after the cut",
            )
            stats = src_t.statistics().session
            assert stats.offered == 1 and stats.confirmed == 0  # no receipt got back
            delivered = 0 if cut == "mid-message" else 1
            assert dst_t.accepted == delivered
            assert dst.current.received == [first][:delivered]

            later = [body(i) for i in range(1, 6)]
            await send_all(src_t, later[:2])  # sent while detached
            pair.proxy.heal()
            await wait_until(lambda: src_t.statistics().attachments == 2 and src.current.ready)
            await send_all(src_t, later[2:])
            await dst.wait_received(6)
            assert dst.current.received == [first, *later]
            await wait_until(lambda: src_t.statistics().session.confirmed == 6)
            assert src_t.statistics().session.retained_frames == 0
            if cut == "mid-message":
                assert src_t.statistics().session.replayed_frames >= 1
            assert len(src.sessions) == len(dst.sessions) == 1
            assert src.link.statistics().resumed == dst.link.statistics().resumed == 1


@anyio_test
@by_direction
async def test_exactly_once_across_proxy_cuts_at_many_byte_offsets(direction: str) -> None:
    """Bursts in both directions, each cut after a different number of bytes."""
    limits = small_limits(detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits, proxy=True) as pair:
            assert pair.proxy is not None
            lrec, drec = await pair.wait_ready()
            down: list[bytes] = []
            up: list[bytes] = []
            for round_, budget in enumerate([0, 1, 7, 40, 129, 600, 2500]):
                pair.proxy.cut_after(budget, "both")
                batch_down = [body(i, f"d{round_}-") * 3 for i in range(25)]
                batch_up = [body(i, f"u{round_}-") * 3 for i in range(25)]
                down += batch_down
                up += batch_up
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_all, lrec.transport, batch_down)
                    tg.start_soon(send_all, drec.transport, batch_up)
                await pair.dialer.wait_received(len(down))
                await pair.listener.wait_received(len(up))
            assert drec.received == down
            assert lrec.received == up
            assert len(pair.listener.sessions) == len(pair.dialer.sessions) == 1
            assert pair.proxy.statistics().cuts >= 5


# ------------------------------------------------------------------------------------------------
# a slow consumer is back-pressure: never silence, never a stalled replay, never lost payloads


@anyio_test
@by_direction
async def test_a_stalled_consumer_is_not_mistaken_for_a_silent_peer(direction: str) -> None:
    """Regression: while the reader waited for a stalled consumer it read nothing, so the
    heartbeat declared the healthy peer silent (4007) -- and the payloads the reader had already
    accepted from that socket were lost with it."""
    limits = small_limits(heartbeat_interval=0.05, heartbeat_timeout=0.3, delivery_queue=4)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits) as pair:
            lrec, drec = await pair.wait_ready()
            pair.dialer.gate.close()
            sent = [body(i) for i in range(60)]
            await send_all(lrec.transport, sent)
            await wait_until(lambda: drec.transport.statistics().queued_payloads >= 4)
            await anyio.sleep(4 * limits.heartbeat_timeout)  # the consumer stays stalled
            # The reader is held up with accepted payloads in hand: back-pressure.
            assert drec.transport.statistics().queued_payloads > limits.delivery_queue
            pair.dialer.gate.open()
            await pair.dialer.wait_received(60)
            assert drec.received == sent
            for ep in (pair.listener, pair.dialer):
                stats = ep.link.statistics()
                assert stats.heartbeat_timeouts == 0 and stats.resumed == 0
            assert drec.ready and len(pair.dialer.sessions) == 1


@anyio_test
@by_direction
async def test_a_stalled_consumer_during_replay_does_not_retire_the_session(direction: str) -> None:
    """Regression: after a resume the reader waited for the stalled consumer at the replay
    fence, and the replay inactivity deadline retired the session (REPLAY_STALLED)."""
    limits = small_limits(
        heartbeat_interval=0.05,
        heartbeat_timeout=0.3,
        replay_inactivity=0.3,
        delivery_queue=4,
        detached_grace=5.0,
    )
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits) as pair:
            lrec, drec = await pair.wait_ready()
            pair.dialer.gate.close()
            sent = [body(i) for i in range(60)]
            await send_all(lrec.transport, sent)
            await wait_until(lambda: drec.transport.statistics().queued_payloads >= 4)
            await pair.listener.link.disconnect()
            await wait_until(lambda: pair.dialer.link.statistics().resumed == 1)
            await anyio.sleep(3 * limits.replay_inactivity)  # the consumer stays stalled
            assert drec.transport.failure is None and lrec.transport.failure is None
            pair.dialer.gate.open()
            await pair.dialer.wait_received(60)
            assert drec.received == sent
            await wait_until(lambda: drec.ready and lrec.ready)
            assert len(pair.dialer.sessions) == len(pair.listener.sessions) == 1


@anyio_test
@by_direction
async def test_a_stalled_consumer_does_not_let_a_newcomer_take_over(direction: str) -> None:
    """Regression: the takeover probe could not see the healthy peer's pong while the reader
    waited for a stalled consumer, so any new runtime took the session over."""
    limits = small_limits(delivery_queue=4, takeover_probe_timeout=0.2)
    _listen_role, dial_role = roles(direction)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits) as pair:
            lrec, drec = await pair.wait_ready()
            pair.listener.gate.close()
            sent = [body(i) for i in range(40)]
            await send_all(drec.transport, sent)
            await wait_until(lambda: lrec.transport.statistics().queued_payloads >= 4)
            async with RawClient.connect(pair.listener.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                assert await client.authenticate_refused(client.handshake(dial_role)) == 4004
            assert lrec.transport.failure is None
            pair.listener.gate.open()
            await pair.listener.wait_received(40)
            assert lrec.received == sent


# ------------------------------------------------------------------------------------------------
# retirement: restart, grace, replay stall


@anyio_test
@by_direction
@pytest.mark.parametrize("restarted", ["dialer", "listener"])
@pytest.mark.parametrize("how", ["crash", "clean"])
async def test_peer_restart_gives_a_fresh_session_and_retires_the_old_one(
    direction: str, restarted: str, how: str
) -> None:
    """A peer process restarts (a new link object: a new runtime id). After a crash the old
    session waits, detached, and is REPLACED when the new runtime arrives; after a clean
    shutdown (close 1001) it is retired at once (PEER_RETIRED). Either way the new peer gets a
    fresh session and nothing of the old one reaches it."""
    listen_role, dial_role = roles(direction)
    limits = small_limits(detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener = await start_link(tg, make_link(listen_role, limits, listen=("127.0.0.1", 0)))
            port = listener.link.listen_address[1]
            async with FaultProxy("127.0.0.1", port) as proxy:
                url = proxy.url()
                dialer = await start_link(tg, make_link(dial_role, limits, dial=url))
                old_l = await listener.endpoint.wait_ready()
                await dialer.endpoint.wait_ready()
                await send_all(old_l.transport, [b"old-1"])
                await dialer.endpoint.wait_received(1)

                survivor, going = (
                    (dialer, listener)
                    if restarted == "listener"
                    else (
                        listener,
                        dialer,
                    )
                )
                old_s = survivor.endpoint.current
                if how == "crash":  # the sockets die without a close frame
                    proxy.refuse()
                    proxy.cut()
                    await wait_until(lambda: old_s.transport.state is TransportState.DETACHED)
                await going.stop()
                if how == "crash":
                    # Sent into the old session while its peer is gone: must never reach the
                    # new peer.
                    await send_all(old_s.transport, [b"stale-1", b"stale-2"])
                    assert old_s.transport.state is TransportState.DETACHED
                    expected = FailureReason.REPLACED
                else:
                    await wait_until(lambda: old_s.transport.state is TransportState.RETIRED)
                    expected = FailureReason.PEER_RETIRED
                if restarted == "dialer":
                    dialer = reborn = await start_link(tg, make_link(dial_role, limits, dial=url))
                else:
                    listener = reborn = await start_link(
                        tg, make_link(listen_role, limits, listen=("127.0.0.1", port))
                    )
                proxy.heal()
                new_s = await survivor.endpoint.wait_ready(2)
                new_p = await reborn.endpoint.wait_ready(1)

                assert new_s.session_id == new_p.session_id != old_s.session_id
                assert not new_s.result.resume and not new_p.result.resume
                assert old_s.transport.state is TransportState.RETIRED
                failure = old_s.transport.failure
                assert failure is not None and failure.reason is expected
                await wait_until(lambda: old_s.ended)  # its consumer saw the end
                with pytest.raises(SessionFailed):
                    await old_s.transport.send(b"too late")

                await send_all(new_s.transport, [b"new-1", b"new-2"])
                await send_all(new_p.transport, [b"back-1"])
                await wait_until(lambda: len(new_p.received) == 2 and len(new_s.received) == 1)
                assert new_p.received == [b"new-1", b"new-2"]
                assert new_s.received == [b"back-1"]
                assert survivor.link.statistics().fresh_sessions == 2
                await dialer.stop()
                await listener.stop()
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_grace_expiry_retires_a_detached_session_then_a_fresh_one_starts(
    direction: str,
) -> None:
    grace = 0.5
    limits = small_limits(detached_grace=grace)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits, proxy=True) as pair:
            assert pair.proxy is not None
            lrec, drec = await pair.wait_ready()
            pair.proxy.refuse()
            pair.proxy.cut()
            await wait_until(
                lambda: (
                    lrec.transport.state is TransportState.DETACHED
                    and drec.transport.state is TransportState.DETACHED
                )
            )
            await send_all(lrec.transport, [b"never delivered"])
            detached_at = anyio.current_time()
            await wait_until(
                lambda: (
                    lrec.transport.state is TransportState.RETIRED
                    and drec.transport.state is TransportState.RETIRED
                ),
                timeout=grace + 3,
                what="both sides to retire the detached session",
            )
            assert anyio.current_time() - detached_at >= grace * 0.9
            for rec in (lrec, drec):
                failure = rec.transport.failure
                assert failure is not None and failure.reason is FailureReason.GRACE_EXPIRED

                def ended(r: SessionRecord = rec) -> bool:
                    return r.ended

                await wait_until(ended)
            assert pair.listener.link.transport is None and pair.dialer.link.transport is None

            pair.proxy.heal()
            new_l, new_d = await pair.wait_ready(2)
            assert new_l.session_id != lrec.session_id
            await send_all(new_l.transport, [b"fresh"])
            await pair.dialer.wait_received(1, new_d)
            assert new_d.received == [b"fresh"]
            assert drec.received == []


@anyio_test
@by_direction
async def test_silent_peer_is_detected_by_the_heartbeat_and_the_session_resumes(
    direction: str,
) -> None:
    limits = small_limits(heartbeat_interval=0.05, heartbeat_timeout=0.3, detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits, proxy=True) as pair:
            assert pair.proxy is not None
            lrec, drec = await pair.wait_ready()
            await send_all(lrec.transport, [b"before"])
            await pair.dialer.wait_received(1)
            pair.proxy.blackhole()
            await send_all(lrec.transport, [b"during-1", b"during-2"])
            await send_all(drec.transport, [b"up-during"])
            # Each side notices on its own: no inbound frame for heartbeat_timeout -> close 4007.
            took = await wait_until(
                lambda: (
                    pair.listener.link.statistics().heartbeat_timeouts >= 1
                    and pair.dialer.link.statistics().heartbeat_timeouts >= 1
                ),
                timeout=3.0,
                what="both heartbeats to time out",
            )
            assert took <= limits.heartbeat_timeout + 1.5
            await wait_until(
                lambda: (
                    lrec.transport.state is TransportState.DETACHED
                    and drec.transport.state is TransportState.DETACHED
                )
            )
            pair.proxy.heal()
            await wait_until(lambda: lrec.ready and drec.ready, what="the session to resume")
            await send_all(lrec.transport, [b"after"])
            await pair.dialer.wait_received(4)
            await pair.listener.wait_received(1)
            assert drec.received == [b"before", b"during-1", b"during-2", b"after"]
            assert lrec.received == [b"up-during"]
            assert len(pair.listener.sessions) == len(pair.dialer.sessions) == 1
            assert pair.listener.link.statistics().resumed >= 1


@anyio_test
async def test_an_idle_socket_carries_one_ping_and_one_pong_per_interval() -> None:
    """Only a side that heard nothing for an interval pings: the other hears that ping (and
    answers it) and skips its own. Two-sided pinging would move 16 bytes per interval through
    the proxy (a masked 6-byte ping and pong up, a 2-byte ping and pong down); one-sided, 8."""
    interval = 0.05
    limits = small_limits(heartbeat_interval=interval, heartbeat_timeout=0.5)
    with anyio.fail_after(DEADLINE):
        async with link_pair("controller-dials", limits, proxy=True) as pair:
            assert pair.proxy is not None
            await pair.wait_ready()
            await anyio.sleep(2 * interval)  # the handshake's frames and receipts are done
            before = pair.proxy.statistics()
            started = anyio.current_time()
            await anyio.sleep(20 * interval)
            after = pair.proxy.statistics()
            elapsed = anyio.current_time() - started
            moved = (after.bytes_up - before.bytes_up) + (after.bytes_down - before.bytes_down)
            assert 0 < moved <= 8 * (elapsed / interval + 2), (moved, elapsed)
            # ... and that is enough for both sides' silence checks.
            assert pair.listener.link.statistics().heartbeat_timeouts == 0
            assert pair.dialer.link.statistics().heartbeat_timeouts == 0


# ------------------------------------------------------------------------------------------------
# hand-written peers against a listener; a legitimate peer must still get through afterwards


@asynccontextmanager
async def listening(
    direction: str, limits: Limits | None = None
) -> AsyncIterator[tuple[Endpoint, Role]]:
    """A listener for ``direction``; yields it and the role a peer must claim. On exit a
    legitimate peer must complete a session with it (so it kept serving)."""
    listen_role, dial_role = roles(direction)
    limits = limits or small_limits()
    async with anyio.create_task_group() as tg:
        async with endpoint(tg, make_link(listen_role, limits, listen=("127.0.0.1", 0))) as ep:
            yield ep, dial_role
            await legit_session(tg, ep, dial_role, limits)
        tg.cancel_scope.cancel()


async def legit_session(
    tg: anyio.abc.TaskGroup, listener: Endpoint, role: Role, limits: Limits
) -> None:
    before = len(listener.sessions)
    async with endpoint(tg, make_link(role, limits, dial=listener.link.url)) as peer:
        mine = await peer.wait_ready()
        theirs = await listener.wait_ready(before + 1)
        assert mine.session_id == theirs.session_id
        await theirs.transport.send(b"hello legit")
        await peer.wait_received(1, mine)
        assert mine.received == [b"hello legit"]


async def raw_session(client: RawClient, role: Role, listener: Endpoint) -> None:
    """Upgrade, authenticate and pass the fence as ``role``; the listener's session is READY."""
    assert isinstance(await client.upgrade(), AcceptConnection)
    result = await client.authenticate(client.handshake(role))
    await client.send_fence()
    rec = await listener.wait_ready(len(listener.sessions) or 1)
    assert rec.session_id == result.session_id


def parse_status(response: bytes) -> int:
    status_line = response.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 "), response[:80]
    return int(status_line.split()[1])


@anyio_test
@by_direction
async def test_wrong_path_gets_404(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                event = await client.upgrade("/not-executor")
                assert isinstance(event, RejectConnection) and event.status_code == 404
                await client.read_until_eof()
            assert ep.link.statistics().upgrades_refused == {404: 1}


@anyio_test
@by_direction
@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 32 + b"\r\n\r\n",
        b"GARBAGE GARBAGE GARBAGE\r\n\r\n",
        b"GET /executor HTTP/1.1\r\nHost: x\r\n\r\n",  # HTTP, but no upgrade
    ],
    ids=["tls-hello", "not-http", "no-upgrade"],
)
async def test_garbage_instead_of_an_upgrade_gets_400(direction: str, garbage: bytes) -> None:
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await client.write(garbage)
                response = await client.read_until_eof()
                assert parse_status(response) == 400
            assert ep.link.statistics().upgrades_refused == {400: 1}


@anyio_test
@by_direction
async def test_text_frame_during_the_handshake_is_refused(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.send_text('{"t": "hello"}')
                assert await client.wait_closed() == 4008  # a protocol error in the handshake
            assert ep.link.statistics().handshakes_failed == {"MALFORMED": 1}
            assert ep.sessions == []


@anyio_test
@by_direction
async def test_text_frame_after_authentication_closes_1003_and_retires(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await raw_session(client, role, ep)
                await client.send_text("not binary")
                assert await client.wait_closed() == 1003
            rec = ep.current
            await wait_until(lambda: rec.transport.state is TransportState.RETIRED)
            failure = rec.transport.failure
            assert failure is not None and failure.reason is FailureReason.MALFORMED_PACKET


@anyio_test
@by_direction
async def test_oversize_hello_is_closed_1009(direction: str) -> None:
    limits = small_limits()
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.send_bytes(b"\xa0" + b"x" * limits.max_handshake_frame_bytes)
                assert await client.wait_closed() == 1009
            assert ep.link.statistics().handshakes_failed == {"OVERSIZE": 1}


@anyio_test
@by_direction
async def test_reflected_proof_is_refused_4001(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                hs = client.handshake(role)
                await client.send_bytes(hs.hello_frame())
                assert hs.receive(await client.next_message()) is not None
                # The listener holds its proof until ours verifies, so an attacker has nothing
                # to reflect; send what its proof *is* (the test knows the secret) to show a
                # reflected proof fails even so.
                listener_hello = hs.peer_hello
                assert listener_hello is not None
                mac = compute_mac(
                    derive_key(SECRET), listener_hello.role.value, hs.local_hello, listener_hello
                )
                await client.send_bytes(encode_canonical({"t": "proof", "mac": mac}))
                assert await client.wait_closed() == 4001
            assert ep.link.statistics().handshakes_failed == {"AUTH_FAILED": 1}
            assert ep.sessions == []


@anyio_test
@by_direction
async def test_wrong_secret_is_refused_4001(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                hs = client.handshake(role, secret=b"w" * 32)
                await client.send_bytes(hs.hello_frame())
                proof = hs.receive(await client.next_message())
                assert proof is not None
                await client.send_bytes(proof)
                assert await client.wait_closed() == 4001
            assert ep.link.statistics().handshakes_failed == {"AUTH_FAILED": 1}
            assert "proof did not verify" in (ep.link.last_error or "")
            assert ep.sessions == []


@anyio_test
@by_direction
@pytest.mark.parametrize("stage", ["before-upgrade", "after-upgrade", "after-hello"])
async def test_a_peer_that_goes_quiet_is_closed_by_the_handshake_deadline(
    direction: str, stage: str
) -> None:
    limits = small_limits(handshake_timeout=0.3, takeover_probe_timeout=0.2)
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                start = anyio.current_time()
                if stage != "before-upgrade":
                    assert isinstance(await client.upgrade(), AcceptConnection)
                if stage == "after-hello":
                    await client.send_bytes(client.handshake(role).hello_frame())
                code = await client.wait_closed()
                if stage == "before-upgrade":
                    assert code is None and client.eof  # no WebSocket yet: the stream just ends
                else:
                    assert code == 4008  # HandshakeFailure.TIMEOUT
                assert anyio.current_time() - start <= limits.handshake_timeout + 1.5
            assert ep.link.statistics().handshakes_failed == {"TIMEOUT": 1}
            assert ep.sessions == []


@anyio_test
@by_direction
async def test_20mib_message_after_authentication_is_closed_1009(direction: str) -> None:
    limits = small_limits(heartbeat_timeout=3.0)  # default max_frame_bytes: 16 MiB
    assert limits.max_frame_bytes == 16 * 1024 * 1024
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await raw_session(client, role, ep)
                code: list[int | None] = []

                async def read_close() -> None:
                    code.append(await client.wait_closed())

                async with anyio.create_task_group() as tg:
                    tg.start_soon(read_close)
                    payload = client.ws.send(BytesMessage(data=b"\x00" * (20 * 1024 * 1024)))
                    try:
                        await client.write(payload)
                    except (anyio.BrokenResourceError, OSError):
                        pass  # the listener stopped reading at the limit and closed
                assert code == [1009]
                assert "too big" in (client.close_reason or "")
            rec = ep.current
            await wait_until(lambda: rec.transport.state is TransportState.RETIRED)
            assert rec.received == []


@anyio_test
@by_direction
async def test_silent_raw_peer_that_stops_reading_is_closed_4007(direction: str) -> None:
    limits = small_limits(heartbeat_interval=0.05, heartbeat_timeout=0.3, detached_grace=5.0)
    with anyio.fail_after(DEADLINE):
        async with (
            listening(direction, limits) as (ep, role),
            RawClient.connect(ep.link.listen_address) as client,
        ):
            await raw_session(client, role, ep)
            rec = ep.current
            # Stop reading, keep TCP open.
            took = await wait_until(
                lambda: ep.link.statistics().heartbeat_timeouts == 1, timeout=3.0
            )
            assert took <= limits.heartbeat_timeout + 1.0
            # What the listener wrote meanwhile: pings, then the close frame.
            assert await client.wait_closed(answer_pings=False) == 4007
            assert "no inbound frame" in (client.close_reason or "")  # the real cause
            assert client.pings >= 1
            # A heartbeat close is resumable: the session is detached, not retired.
            await wait_until(lambda: rec.transport.state is TransportState.DETACHED)


@anyio_test
@by_direction
async def test_replay_stall_retires_the_session_although_heartbeats_continue(
    direction: str,
) -> None:
    """A raw peer resumes, lets the listener replay, answers every ping but never sends a
    receipt: the session is retired (REPLAY_STALLED, close 4006) after replay_inactivity."""
    limits = small_limits(
        heartbeat_interval=0.05, heartbeat_timeout=0.3, replay_inactivity=0.5, detached_grace=5.0
    )
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role):
            runtime = os.urandom(16)
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                result = await client.authenticate(client.handshake(role, runtime=runtime))
                await client.send_fence()
                rec = await ep.wait_ready()
                await send_all(rec.transport, [b"r1", b"r2", b"r3"])
                assert await client.read_bodies(3) == [b"r1", b"r2", b"r3"]  # never acknowledged
            await wait_until(lambda: rec.transport.state is TransportState.DETACHED)
            offer = ResumeOffer(
                session_id=result.session_id, peer_runtime=ep.link.runtime_id, received=0
            )
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                resumed = await client.authenticate(
                    client.handshake(role, runtime=runtime, resume=offer)
                )
                assert resumed.resume and resumed.session_id == result.session_id
                start = anyio.current_time()
                assert await client.read_bodies(3) == [b"r1", b"r2", b"r3"]  # the replay
                pings_before = client.pings
                # Keep answering pings, never send a receipt.
                assert await client.wait_closed() == 4006
                elapsed = anyio.current_time() - start
                assert client.pings - pings_before >= 2  # heartbeats went on during the stall
            assert elapsed >= limits.replay_inactivity * 0.9
            assert elapsed <= limits.replay_inactivity + 2.0
            failure = rec.transport.failure
            assert failure is not None and failure.reason is FailureReason.REPLAY_STALLED
            assert ep.link.statistics().heartbeat_timeouts == 0
            assert ep.link.statistics().resumed == 1


@anyio_test
@by_direction
async def test_unauthenticated_sockets_are_capped_oldest_evicted(direction: str) -> None:
    limits = small_limits(max_unauthenticated_sockets=4, handshake_timeout=5.0)
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role), anyio.create_task_group() as tg:
            idle: list[RawClient] = []
            try:
                for i in range(10):  # idle sockets: connected, never a byte sent
                    idle.append(RawClient(await anyio.connect_tcp(*ep.link.listen_address)))

                    def held(i: int = i) -> bool:
                        return ep.link.statistics().connections == i + 1

                    await wait_until(held)
                assert ep.link.statistics().evicted_unauthenticated == 6
                # The six oldest were closed; the four newest are still held open.
                for client in idle[:6]:
                    await client.read_until_eof()
                for client in idle[6:]:
                    with anyio.move_on_after(0.05):
                        await client.read_until_eof()
                    assert not client.eof
                # A legitimate peer still completes while they are held (evicting the oldest).
                await legit_session(tg, ep, role, limits)
                assert ep.link.statistics().evicted_unauthenticated == 7
                await idle[6].read_until_eof()
            finally:
                for client in idle:
                    await anyio.aclose_forcefully(client.stream)
            tg.cancel_scope.cancel()


@anyio_test
async def test_a_key_holder_replacing_its_own_socket_keeps_few_closes_waiting() -> None:
    """Each new socket of one runtime replaces the attached one at once (no probe); a peer that
    never answers the close would hold each replaced socket for ``close_timeout``. At most
    ``max_authenticated_sockets`` detached sockets wait for their peer's close frame: the others
    get theirs and are closed at once."""
    allowance = 2
    limits = small_limits(close_timeout=5.0, max_authenticated_sockets=allowance)
    runtime = os.urandom(16)
    clients: list[RawClient] = []
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            link = make_link(Role.WORKER, limits, listen=("127.0.0.1", 0))
            async with endpoint(tg, link) as ep, contextlib.AsyncExitStack() as stack:
                for _ in range(8):
                    client = await stack.enter_async_context(RawClient.connect(link.listen_address))
                    assert isinstance(await client.upgrade(), AcceptConnection)
                    await client.authenticate(client.handshake(Role.CONTROLLER, runtime=runtime))
                    clients.append(client)  # and never reads again (no close frame back)
                await wait_until(lambda: ep.link.statistics().fresh_sessions == 8)
                # The first `allowance` replaced sockets wait; the next ones are closed at once.
                for client in clients[allowance:-1]:
                    with anyio.fail_after(1.0):
                        await client.read_until_eof()
                assert ep.link.statistics().closes_not_drained == 7 - allowance
                assert ep.current.transport.attached  # the last one
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_authenticated_cap_answers_503(direction: str) -> None:
    limits = small_limits(max_authenticated_sockets=1, max_controllers=1)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits) as pair:
            await pair.wait_ready()
            if direction == "controller-dials":
                # A listening worker allows one attached socket per controller beyond the
                # allowance: another controller's socket is upgraded, then refused at admission
                # because max_controllers are held (1013), never attached.
                _listen_role, dial_role = roles(direction)
                async with RawClient.connect(pair.listener.link.listen_address) as client:
                    assert isinstance(await client.upgrade(), AcceptConnection)
                    other = Handshake(
                        role=dial_role,
                        executor_id=EXECUTOR,
                        key=derive_key(SECRET),
                        runtime=os.urandom(16),
                        nonce=os.urandom(32),
                        resume=None,
                        controller="another-controller",
                    )
                    assert await client.authenticate_refused(other) == 1013
                assert pair.listener.link.statistics().controllers_refused == 1
                assert pair.listener.current.ready
                return
            async with RawClient.connect(pair.listener.link.listen_address) as client:
                event = await client.upgrade()
                assert isinstance(event, RejectConnection) and event.status_code == 503
            assert pair.listener.link.statistics().upgrades_refused == {503: 1}
            assert pair.listener.current.ready


async def listener_hello(
    address: tuple[str, int],
    role: Role,
    executor_id: str,
    *,
    runtime: bytes | None = None,
    resume: ResumeOffer | None = None,
) -> bytes:
    """The hello a listener answers to a dialer claiming ``executor_id`` with a wrong key."""
    hs = Handshake(
        role=role,
        executor_id=executor_id,
        key=derive_key(b"w" * 32),
        runtime=runtime or os.urandom(16),
        nonce=os.urandom(32),
        resume=resume,
        controller=CONTROLLER if role is Role.CONTROLLER else None,
    )
    async with RawClient.connect(address) as client:
        assert isinstance(await client.upgrade(), AcceptConnection)
        await client.send_bytes(hs.hello_frame())
        return await client.next_message()


@anyio_test
@by_direction
async def test_the_listener_hello_tells_an_unauthenticated_peer_nothing_of_its_session(
    direction: str,
) -> None:
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            lrec, _drec = await pair.wait_ready()
            await lrec.transport.send(b"counted")
            await pair.dialer.wait_received(1)
            await wait_until(lambda: lrec.transport.offered == 1 and pair.dialer.current.ready)
            address = pair.listener.link.listen_address
            _listen_role, dial_role = roles(direction)
            # The id the listener serves, online, and an id it does not know (same length).
            online = await listener_hello(address, dial_role, EXECUTOR)
            unknown = await listener_hello(address, dial_role, "xyz")
            assert len(online) == len(unknown)
            a, b = (Hello.from_wire(cbor2.loads(frame)) for frame in (online, unknown))
            assert a.session is a.peer_runtime is None and a.received == 0
            assert dataclasses.replace(a, executor="xyz", nonce=b.nonce) == b
            # A dialer whose hello names the session, its runtime and ours is told where the
            # listener stands (that is what a resume needs); it learns nothing it did not name.
            dialer = pair.dialer.link
            named = await listener_hello(
                address,
                dial_role,
                EXECUTOR,
                runtime=dialer.runtime_id,
                resume=ResumeOffer(lrec.session_id, pair.listener.link.runtime_id, 1),
            )
            c = Hello.from_wire(cbor2.loads(named))
            assert (c.session, c.peer_runtime) == (lrec.session_id, dialer.runtime_id)
            # The honest session was not disturbed by any of it.
            assert lrec.ready and pair.listener.link.statistics().fresh_sessions == 1


@anyio_test
async def test_the_key_is_read_after_the_hello_for_an_enrolled_and_an_unknown_id(
    tmp_path: Path,
) -> None:
    """The hello leaves after the same work whether the claimed id is enrolled or not: the key
    (a file read, slower when the file exists) is looked up only once the hello was sent. The
    lookup peeks at the dialer's socket (which does not read until the lookup is over): the
    whole hello has reached it, for both ids."""
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir(mode=0o700)
    write_secret_file(keys_dir / "enrolled.secret")
    keyring = Keyring(keys_dir)
    peekers: list[socket.socket] = []
    arrived: dict[str, bytes] = {}
    looked_up = anyio.Event()

    def keys(executor_id: str) -> bytes | None:
        try:
            # Blocks the loop only until the bytes are there (loopback), or 1 s if never sent.
            arrived[executor_id] = peekers[-1].recv(1 << 16, socket.MSG_PEEK)
        except TimeoutError:
            arrived[executor_id] = b""
        looked_up.set()
        secret = keyring.secret_for(executor_id)
        return secret.reveal() if secret is not None else None

    link = WebSocketLink(
        role=Role.CONTROLLER, keys=keys, limits=small_limits(), listen=("127.0.0.1", 0)
    )
    with anyio.fail_after(DEADLINE), contextlib.ExitStack() as stack:
        async with link:
            for executor_id in ("enrolled", "stranger"):
                hs = Handshake(
                    role=Role.WORKER,
                    executor_id=executor_id,
                    key=derive_key(b"w" * 32),
                    runtime=os.urandom(16),
                    nonce=os.urandom(32),
                    resume=None,
                )
                looked_up = anyio.Event()
                async with RawClient.connect(link.listen_address) as client:
                    raw = client.stream.extra(SocketAttribute.raw_socket)
                    # A duplicate of the dialer's descriptor (asyncio's wrapper cannot peek).
                    peeker = socket.fromfd(raw.fileno(), raw.family, raw.type)
                    stack.callback(peeker.close)
                    peeker.settimeout(1.0)
                    peekers.append(peeker)
                    assert isinstance(await client.upgrade(), AcceptConnection)
                    await client.send_bytes(hs.hello_frame())
                    await looked_up.wait()
                    hello = await client.next_message()
                    proof = hs.receive(hello)
                    assert proof is not None
                    await client.send_bytes(proof)
                    assert await client.wait_closed() == 4001
                # One unmasked binary frame holding exactly the hello (125 < size < 64 KiB).
                assert arrived[executor_id] == b"\x82\x7e" + len(hello).to_bytes(2, "big") + hello
            assert link.statistics().handshakes_failed == {"AUTH_FAILED": 2}


# ------------------------------------------------------------------------------------------------
# takeover


@anyio_test
@by_direction
async def test_second_peer_is_refused_4004_while_the_first_is_healthy(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            lrec, drec = await pair.wait_ready()
            _listen_role, dial_role = roles(direction)
            async with RawClient.connect(pair.listener.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                # The listener holds its proof until it admits a peer: a refused one never
                # completes the handshake, it only sees 4004.
                assert await client.authenticate_refused(client.handshake(dial_role)) == 4004
            stats = pair.listener.link.statistics()
            assert stats.takeovers_refused == 1 and stats.fresh_sessions == 1
            # The healthy session is untouched.
            assert pair.listener.link.transport is lrec.transport and lrec.ready
            await lrec.transport.send(b"still here")
            await pair.dialer.wait_received(1)
            assert drec.received == [b"still here"]


@anyio_test
@by_direction
async def test_second_real_peer_keeps_being_refused_while_the_first_is_healthy(
    direction: str,
) -> None:
    limits = small_limits(takeover_probe_timeout=0.2)
    _listen_role, dial_role = roles(direction)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits) as pair:
            lrec, drec = await pair.wait_ready()
            second = make_link(dial_role, limits, dial=pair.listener.link.url)
            async with endpoint(pair.tg, second) as ep2:
                await wait_until(lambda: pair.listener.link.statistics().takeovers_refused >= 3)
                # The newcomer never gets a session that comes up ...
                assert not any(rec.ready for rec in ep2.sessions)
                # ... and the first peer's session is untouched.
                assert pair.listener.link.transport is lrec.transport and lrec.ready
                assert len(pair.listener.sessions) == 1
                await drec.transport.send(b"undisturbed")
                await pair.listener.wait_received(1)
                assert lrec.received == [b"undisturbed"]


@anyio_test
@by_direction
async def test_second_peer_takes_over_when_the_first_fails_the_probe(direction: str) -> None:
    # A long heartbeat: the takeover must come from the probe, not from the silence check.
    limits = small_limits(heartbeat_interval=2.0, heartbeat_timeout=6.0, takeover_probe_timeout=0.3)
    _listen_role, dial_role = roles(direction)
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction, limits, proxy=True) as pair:
            assert pair.proxy is not None
            lrec, _drec = await pair.wait_ready()
            pair.proxy.blackhole()
            start = anyio.current_time()
            second = make_link(dial_role, limits, dial=pair.listener.link.url)
            async with endpoint(pair.tg, second) as ep2:
                mine = await ep2.wait_ready()
                theirs = await pair.listener.wait_ready(2)
                took = anyio.current_time() - start
                assert mine.session_id == theirs.session_id != lrec.session_id
                assert theirs.transport.peer_runtime == second.runtime_id
                assert took >= limits.takeover_probe_timeout * 0.9
                failure = lrec.transport.failure
                assert failure is not None and failure.reason is FailureReason.REPLACED
                stats = pair.listener.link.statistics()
                assert stats.heartbeat_timeouts == 0 and stats.takeovers_refused == 0
                await theirs.transport.send(b"to the new peer")
                await ep2.wait_received(1, mine)
                assert mine.received == [b"to the new peer"]
                await pair.dialer.link.aclose()  # the old peer would only be refused again


# ------------------------------------------------------------------------------------------------
# TLS


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(ctx)
    return ctx


@anyio_test
@by_direction
async def test_tls_session(direction: str, ca: trustme.CA) -> None:
    listen_role, dial_role = roles(direction)
    limits = small_limits()
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(client_ctx)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener_link = make_link(
                listen_role, limits, listen=("127.0.0.1", 0), ssl_context=server_context(ca)
            )
            async with endpoint(tg, listener_link) as listener:
                assert listener_link.url.startswith("wss://127.0.0.1:")
                dialer_link = make_link(
                    dial_role, limits, dial=listener_link.url, ssl_context=client_ctx
                )
                async with endpoint(tg, dialer_link) as dialer:
                    lrec = await listener.wait_ready()
                    drec = await dialer.wait_ready()
                    assert lrec.session_id == drec.session_id
                    await send_all(drec.transport, [b"over", b"tls"])
                    await listener.wait_received(2)
                    assert lrec.received == [b"over", b"tls"]
                    # Resumption works over TLS too.
                    await dialer_link.disconnect()
                    await send_all(drec.transport, [b"again"])
                    await listener.wait_received(3)
                    assert lrec.received == [b"over", b"tls", b"again"]
                    assert len(listener.sessions) == 1
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_tls_dialer_that_does_not_trust_the_certificate_fails_clearly(
    direction: str, ca: trustme.CA
) -> None:
    listen_role, dial_role = roles(direction)
    limits = small_limits()
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener_link = make_link(
                listen_role, limits, listen=("127.0.0.1", 0), ssl_context=server_context(ca)
            )
            async with endpoint(tg, listener_link) as listener:
                untrusting = make_link(dial_role, limits, dial=listener_link.url)  # system CAs
                async with endpoint(tg, untrusting) as dialer:
                    await wait_until(
                        lambda: (
                            untrusting.statistics().dial_attempts >= 2
                            and untrusting.last_error is not None
                        )
                    )
                    error = untrusting.last_error
                    assert error is not None
                    assert "certificate" in error.lower() and "verif" in error.lower()
                    assert dialer.sessions == [] and listener.sessions == []
                    assert untrusting.statistics().handshakes_completed == 0
                    assert untrusting.transport is None
            tg.cancel_scope.cancel()


@anyio_test
@pytest.mark.parametrize("listener_tls", [True, False], ids=["ws-at-tls", "wss-at-plain"])
async def test_a_dial_of_the_other_scheme_counts_as_refused_and_says_so(
    listener_tls: bool, ca: trustme.CA
) -> None:
    """``ws://`` at a TLS listener (answered with a plain-text 426 asking for TLS) and ``wss://``
    at a plain-text one meet the same answer at every redial: counted as refused dials in a
    row (what ``wait_ready(refused_dials=...)`` gives up on), the error naming the URL."""
    listen_role, dial_role = roles("controller-dials")
    limits = small_limits()
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(client_ctx)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener_link = make_link(
                listen_role,
                limits,
                listen=("127.0.0.1", 0),
                ssl_context=server_context(ca) if listener_tls else None,
            )
            async with endpoint(tg, listener_link):
                scheme = ("wss://", "ws://") if listener_tls else ("ws://", "wss://")
                url = listener_link.url.replace(*scheme)
                dialer_link = make_link(dial_role, limits, dial=url, ssl_context=client_ctx)
                async with endpoint(tg, dialer_link):
                    await wait_until(lambda: dialer_link.statistics().dials_refused_in_a_row >= 3)
                    error = dialer_link.last_dial_error
                    assert error is not None and error.startswith(f"{url}: ")
                    if listener_tls:
                        assert "answered with TLS, not plain text" in error and "wss://" in error
                        assert listener_link.statistics().tls_handshakes_failed >= 3
                    else:
                        assert "answered in plain text, not TLS" in error
            tg.cancel_scope.cancel()


@anyio_test
@pytest.mark.parametrize(
    ("answer", "refused", "words"),
    [
        (b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n", True, "HTTP 404: no garcon"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", True, "did not answer the WebSocket upgrade in HTTP"),
        (b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n", False, "HTTP 502"),
    ],
    ids=["404", "not-http", "502"],
)
async def test_a_dial_answered_by_another_server_counts_as_refused_unless_it_may_change(
    answer: bytes, refused: bool, words: str
) -> None:
    """A 404 to the upgrade, or an answer that is not HTTP, is what every redial meets (the
    wrong path, another program on that port): counted as refused dials in a row, which
    ``wait_ready(refused_dials=...)`` gives up on. A proxy's 502 (the worker behind it
    restarting) is worth redialing: not counted."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)

    async def answer_once(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                await stream.receive()
                await stream.send(answer)

    _, dial_role = roles("controller-dials")
    with anyio.fail_after(DEADLINE):
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, answer_once)
            dialer = make_link(dial_role, small_limits(), dial=f"ws://127.0.0.1:{port}/executor")
            failures: list[LinkError] = []
            dialer.on_dial_failed(failures.append)
            async with endpoint(tg, dialer):
                await wait_until(lambda: len(failures) >= 3)
                assert all(words in str(failure) for failure in failures), failures
                stats = dialer.statistics()
                if refused:
                    assert stats.dials_refused >= 3 and stats.dials_refused_in_a_row >= 3
                else:
                    assert stats.dials_refused == 0
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
@pytest.mark.parametrize("code", [4009, 4001], ids=["taken-over", "wrong-key"])
async def test_a_stranger_closing_with_a_refusal_code_does_not_stop_a_listener(
    direction: str, code: int
) -> None:
    """4009 (taken over) and 4001 (bad key) tell a *dialer* it was refused. A listener's peer
    that upgrades and closes with one before sending a hello has proved nothing: the listener
    counts an abandoned handshake and goes on -- not taken over, not stopped, no refusal
    recorded -- and serves the next, genuine dialer."""
    listen_role, dial_role = roles(direction)
    limits = small_limits()
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener = make_link(listen_role, limits, listen=("127.0.0.1", 0))
            async with endpoint(tg, listener) as served:
                target = parse_dial_url(listener.url)
                stream = await connect(target, limits)
                sock = await client_upgrade(
                    stream, target, ssl_context=None, limits=limits, stats=LinkStatistics()
                )
                await sock.close(code, "you were taken over")
                await wait_until(lambda: listener.statistics().handshakes_abandoned >= 1)
                assert listener.taken_over is None and listener.refusal is None
                assert not listener.stopped.is_set()
                assert listener.statistics().taken_over == 0
                dialer = make_link(dial_role, limits, dial=listener.url)
                async with endpoint(tg, dialer):
                    await wait_until(lambda: len(served.sessions) == 1)
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_an_authenticated_dialer_closing_with_4009_retires_only_its_session(
    direction: str,
) -> None:
    """A dialer holding the key that closes its attached socket with 4009 ends its own session
    (a peer's 4009 retires it at once); the listener is not taken over and serves the next
    dialer -- one executor's key must not stop a fleet's listener."""
    listen_role, dial_role = roles(direction)
    limits = small_limits()
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener = make_link(listen_role, limits, listen=("127.0.0.1", 0))
            async with endpoint(tg, listener) as served:
                async with RawClient.connect(listener.listen_address) as client:
                    assert isinstance(await client.upgrade(), AcceptConnection)
                    await client.authenticate(client.handshake(dial_role))
                    await wait_until(lambda: len(served.sessions) == 1)
                    await client.write(client.ws.send(CloseConnection(code=4009, reason="mine")))
                    retired = served.sessions[0].transport
                    await wait_until(lambda: retired.state is TransportState.RETIRED)
                assert listener.taken_over is None and not listener.stopped.is_set()
                assert listener.statistics().taken_over == 0
                dialer = make_link(dial_role, limits, dial=listener.url)
                async with endpoint(tg, dialer):
                    await wait_until(lambda: len(served.sessions) == 2)
            tg.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------------
# shutdown


@anyio_test
@by_direction
async def test_aclose_is_idempotent_and_retires_the_session(direction: str) -> None:
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            lrec, drec = await pair.wait_ready()
            await pair.dialer.link.aclose()
            await pair.dialer.link.aclose()
            failure = drec.transport.failure
            assert failure is not None and failure.reason is FailureReason.CLOSED
            assert pair.dialer.link.transport is None
            # The peer saw 1001 (a deliberate shutdown): it retires its side at once.
            await wait_until(lambda: lrec.transport.state is TransportState.RETIRED)
            failure = lrec.transport.failure
            assert failure is not None and failure.reason is FailureReason.PEER_RETIRED
            assert pair.listener.link.transport is None


@anyio_test
@by_direction
@pytest.mark.parametrize("stage", ["connected", "upgraded", "hello-sent"])
async def test_closing_a_listener_closes_sockets_still_in_the_handshake(
    direction: str, stage: str
) -> None:
    """Regression: sockets in the upgrade or handshake were dropped without being closed when
    the link shut down (the peer hung until garbage collection; asyncio warned)."""
    listen_role, dial_role = roles(direction)
    limits = small_limits(handshake_timeout=5.0)
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener = await start_link(tg, make_link(listen_role, limits, listen=("127.0.0.1", 0)))
            async with RawClient.connect(listener.link.listen_address) as client:
                if stage != "connected":
                    assert isinstance(await client.upgrade(), AcceptConnection)
                if stage == "hello-sent":
                    await client.send_bytes(client.handshake(dial_role).hello_frame())
                    await client.next_message()
                await wait_until(lambda: listener.link.statistics().connections == 1)
                await listener.stop()
                with anyio.fail_after(2.0):
                    await client.wait_closed()
                assert client.eof or client.close_code == 1001
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_closing_a_dialer_closes_its_socket_in_the_handshake(direction: str) -> None:
    """Regression: the dialer's socket was dropped unclosed when its link shut down."""
    _listen_role, dial_role = roles(direction)
    limits = small_limits(handshake_timeout=5.0)
    with anyio.fail_after(DEADLINE):
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as server:
            port = server.extra(anyio.abc.SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                dialer = await start_link(
                    tg, make_link(dial_role, limits, dial=f"ws://127.0.0.1:{port}/executor")
                )
                listener = server.listeners[0]
                assert isinstance(listener, anyio.abc.SocketListener)
                accepted = await listener.accept()  # never answers the upgrade
                async with accepted:
                    await accepted.receive()  # the upgrade request
                    await dialer.stop()
                    with anyio.fail_after(2.0):
                        while True:
                            try:
                                await accepted.receive()
                            except (anyio.EndOfStream, anyio.BrokenResourceError):
                                break
                tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_a_refused_real_dialer_creates_no_session_on_its_retries(direction: str) -> None:
    """Regression: the refused peer used to complete the handshake, decide 'fresh' and create a
    session (and, in a worker, a service scope) on every retry, only to be closed with 4004."""
    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            await pair.wait_ready()
            _listen_role, dial_role = roles(direction)
            url = pair.listener.link.url
            second = await start_link(pair.tg, make_link(dial_role, small_limits(), dial=url))
            try:
                await wait_until(lambda: pair.listener.link.statistics().takeovers_refused >= 3)
                assert second.endpoint.sessions == []
                assert second.link.statistics().fresh_sessions == 0
                assert "4004" in (second.link.last_error or "")
            finally:
                await second.stop()


# ------------------------------------------------------------------------------------------------
# hostile input: containment of unexpected errors, frame budgets, the upgrade request

HUGE = 10**5000
"""An integer cbor2 encodes as a bignum (tag 2) of ~5,000 digits: ``repr()`` of it raises
``ValueError`` (Python's int-to-str digit limit), which once escaped the handshake."""


def honest_handshake(role: Role) -> Handshake:
    """A fresh handshake of ``role`` with the shared test secret (no session to resume)."""
    return Handshake(
        role=role,
        executor_id=EXECUTOR,
        key=derive_key(SECRET),
        runtime=os.urandom(16),
        nonce=os.urandom(32),
        resume=None,
    )


def hello_with(hs: Handshake, **changes: object) -> bytes:
    """``hs``'s hello frame with ``changes`` applied to its map (still canonical CBOR)."""
    return encode_canonical({**hs.local_hello.to_wire(), **changes})


@anyio_test
@by_direction
@pytest.mark.parametrize("field", ["protocol", "t"])
async def test_a_bignum_in_the_hello_ends_only_that_socket(direction: str, field: str) -> None:
    """Regression: the worker process exited with status 1."""
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, role):  # on exit: a legitimate peer gets in
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.send_bytes(hello_with(client.handshake(role), **{field: HUGE}))
                assert await client.wait_closed() in (4002, 4008)
            assert ep.sessions == []


@anyio_test
@by_direction
async def test_a_hostile_listener_cannot_stop_the_dial_loop(direction: str) -> None:
    """Regression: the same bignum sent by a *listener* made the dial loop
    raise; it must count as that attempt's failure and the dialer dial again."""
    _listen_role, dial_role = roles(direction)
    attempts = 0

    async def hostile(stream: anyio.abc.SocketStream) -> None:
        nonlocal attempts
        attempts += 1
        hs = honest_handshake(dial_role.peer)
        with contextlib.suppress(*CLOSED):
            await accept_upgrade(stream, hello_with(hs, protocol=HUGE))
            while await stream.receive():  # until the dialer hangs up (bounded by its deadline)
                pass

    with anyio.fail_after(DEADLINE):
        async with raw_listener(hostile) as port:
            link = make_link(dial_role, small_limits(), dial=f"ws://127.0.0.1:{port}/executor")
            async with link:
                await wait_until(lambda: attempts >= 3, what="three dial attempts")
            assert link.statistics().dial_attempts >= 3


@anyio_test
@by_direction
async def test_an_unexpected_exception_in_the_handshake_ends_only_that_socket(
    direction: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Containment, independent of any decoder fix: whatever the handshake raises is the
    peer's failure (logged with its traceback), on both the listening and the dialing side."""
    caplog.set_level(logging.WARNING, logger="garcon_link.link")

    def broken(self: Handshake, data: bytes) -> bytes | None:
        raise RuntimeError("injected fault")

    with anyio.fail_after(DEADLINE):
        async with link_pair(direction) as pair:
            monkeypatch.setattr(Handshake, "receive", broken)
            await wait_until(
                lambda: (
                    pair.listener.link.statistics().unexpected_errors >= 2
                    and pair.dialer.link.statistics().unexpected_errors >= 2
                ),
                what="both links to contain two injected faults each",
            )
            monkeypatch.undo()
            await pair.wait_ready()  # the listener kept listening, the dialer kept dialing
    faults = [r for r in caplog.records if "unexpected RuntimeError: injected fault" in r.message]
    assert faults and all(r.exc_info is not None for r in faults)


@anyio_test
@by_direction
async def test_an_unexpected_exception_after_authentication_retires_only_that_session(
    direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = b"\xf7 boom"
    real = MessageSession.receive

    def receive(self: MessageSession, data: bytes) -> Received:
        if data == marker:
            raise RuntimeError("injected fault")
        return real(self, data)

    monkeypatch.setattr(MessageSession, "receive", receive)
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await raw_session(client, role, ep)
                await client.send_bytes(marker)
                assert await client.wait_closed() == 4008
            rec = ep.current
            await wait_until(lambda: rec.transport.state is TransportState.RETIRED)
            assert ep.link.statistics().unexpected_errors == 1


@anyio_test
@by_direction
async def test_log_records_carry_causes_as_text_not_exception_objects(
    direction: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record that holds an exception holds its traceback, its frames and their locals -- the
    refused socket with its buffers -- for as long as any handler keeps the record (pytest's
    capture kept ~900 flooding sockets, 210 MiB, alive during one test)."""
    caplog.set_level(logging.DEBUG, logger="garcon_link.link")
    with anyio.fail_after(DEADLINE):
        async with listening(direction) as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.send_bytes(b"\xa1")  # a truncated hello: refused (4008)
                assert await client.wait_closed() == 4008
            _listen_role, dial_role = roles(direction)
            link = make_link(dial_role, small_limits(), dial="ws://127.0.0.1:1/executor")
            async with link:  # nothing listens on port 1: the dial fails, and is logged
                await wait_until(lambda: link.statistics().dial_attempts >= 2)
    records = [r for r in caplog.records if r.name == "garcon_link.link"]
    assert any("handshake refused" in r.getMessage() for r in records)
    assert any("dial" in r.getMessage() and "failed" in r.getMessage() for r in records)
    for record in records:
        assert record.exc_info is None, record.getMessage()
        args = record.args if isinstance(record.args, tuple) else ()
        assert not any(isinstance(a, BaseException) for a in args), record.getMessage()


SUSPICIOUS_UPGRADES = {
    "http-1.0": (b"GET /executor HTTP/1.0\r\n", b"", "HTTP/1.1"),
    "absolute-form": (b"GET http://127.0.0.1/executor HTTP/1.1\r\n", b"", "origin-form"),
    "te-and-cl": (
        b"GET /executor HTTP/1.1\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
        "body",
    ),
    "content-length": (b"GET /executor HTTP/1.1\r\n", b"Content-Length: 3\r\n", "body"),
    "obs-fold": (b"GET /executor HTTP/1.1\r\n", b"X-Folded: a\r\n b\r\n", "folding"),
    "2000-headers": (b"GET /executor HTTP/1.1\r\n", b"X-A: b\r\n" * 2000, "header fields"),
    "post": (b"POST /executor HTTP/1.1\r\n", b"", "GET"),
    "idna-host": (b"GET /executor HTTP/1.1\r\n", b"", "bad upgrade request"),
}
_UPGRADE_HEADERS = (
    b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
)


@anyio_test
@pytest.mark.parametrize("case", list(SUSPICIOUS_UPGRADES))
async def test_suspicious_upgrade_requests_get_400_with_a_one_line_reason(case: str) -> None:
    """Regression: each of these was upgraded (101); ``idna-host`` (a Host that is
    not valid IDNA) made wsproto raise a UnicodeError that ended the worker process."""
    request_line, extra, reason = SUSPICIOUS_UPGRADES[case]
    host = b"Host: xn--zz\r\n" if case == "idna-host" else b"Host: 127.0.0.1\r\n"
    body = b"abc" if case == "content-length" else b""
    request = request_line + host + _UPGRADE_HEADERS + extra + b"\r\n" + body
    with anyio.fail_after(DEADLINE):
        async with listening("controller-dials") as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await client.write(request)
                response = await client.read_until_eof()
            assert parse_status(response) == 400, response[:200]
            text = response.split(b"\r\n\r\n", 1)[1].decode()
            assert text.count("\n") == 1 and reason in text, text
            assert ep.link.statistics().upgrades_refused == {400: 1}


def _request(
    method: str = "GET",
    target: str = "/executor",
    version: str = "1.1",
    headers: list[tuple[str, str]] | None = None,
) -> h11.Request:
    return h11.Request(
        method=method,
        target=target,
        http_version=version,
        headers=[("Host", "x"), *(headers or [])],
    )


_HEAD = b"GET /executor HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize(
    ("request_", "head", "refused"),
    [
        (_request(), _HEAD, None),
        (_request(headers=[("Content-Length", "0")]), _HEAD, None),
        (_request(headers=[("X", "y")] * 99), _HEAD, None),  # 100 with Host: the limit
        (_request(headers=[("X", "y")] * 100), _HEAD, "more than 100 header fields"),
        (_request(method="POST"), _HEAD, "must be a GET"),
        (_request(version="1.0"), _HEAD, "must be HTTP/1.1"),
        (_request(target="http://x/executor"), _HEAD, "origin-form"),
        (_request(target="*"), _HEAD, "origin-form"),
        (_request(headers=[("Content-Length", "1")]), _HEAD, "body"),
        (_request(headers=[("Transfer-Encoding", "chunked")]), _HEAD, "body"),
        (_request(), b"GET /executor HTTP/1.1\r\nHost: x\r\nA: b\r\n\tc\r\n\r\n", "folding"),
        (_request(), b"GET /executor HTTP/1.1\r\nHost: x\r\nA: b\n c\n\n", "folding"),
    ],
)
def test_upgrade_refusal_table(request_: h11.Request, head: bytes, refused: str | None) -> None:
    """The decision as a pure function of the parsed request and its bytes (no sockets)."""
    why = upgrade_refusal(request_, head, max_headers=100)
    assert why == refused if refused is None else why is not None and refused in why


@anyio_test
@by_direction
async def test_a_hello_pipelined_with_the_upgrade_request_is_kept(direction: str) -> None:
    """Regression: bytes after the upgrade request were dropped, so a client that
    sends its hello without waiting for the 101 waited out the handshake deadline (4008)."""
    limits = small_limits(handshake_timeout=5.0)  # a dropped hello would show as a hang
    with anyio.fail_after(DEADLINE):
        async with (
            listening(direction, limits) as (ep, role),
            Raw.connect(ep.link.listen_address[1]) as raw,
        ):
            hs = honest_handshake(role)
            assert await raw.upgrade_pipelined(ws_frame(OP_BINARY, hs.hello_frame()))
            while hs.result is None:  # the listener's hello, then (admitted) its proof
                with anyio.fail_after(2.0):
                    frame = await raw.next_message()
                assert frame is not None, f"closed with {raw.close_code}"
                reply = hs.receive(frame)
                if reply is not None:
                    await raw.send_message(reply)
            assert ep.link.statistics().handshakes_completed == 1


@anyio_test
@by_direction
async def test_frames_in_the_same_read_as_the_101_are_kept_by_the_dialer(direction: str) -> None:
    """The client side of the same question: a listener that writes its hello together with the
    101 response. (wsproto's client keeps those bytes: a guard.)"""
    _listen_role, dial_role = roles(direction)
    done = anyio.Event()

    async def listener(stream: anyio.abc.SocketStream) -> None:
        hs = honest_handshake(dial_role.peer)
        with contextlib.suppress(*CLOSED):
            ws = await accept_upgrade(stream, hs.hello_frame())
            while hs.result is None:
                ws.receive_data(await stream.receive())
                for event in ws.events():
                    if isinstance(event, BytesMessage):  # each one whole: small frames
                        reply = hs.receive(bytes(event.data))
                        if reply is not None:
                            await stream.send(ws.send(BytesMessage(data=reply)))
            done.set()
            await anyio.sleep_forever()

    with anyio.fail_after(DEADLINE):
        async with raw_listener(listener) as port, anyio.create_task_group() as tg:
            link = make_link(dial_role, small_limits(), dial=f"ws://127.0.0.1:{port}/executor")
            async with endpoint(tg, link):  # (its recorder consumes the session it creates)
                await done.wait()
                await wait_until(lambda: link.statistics().handshakes_completed == 1)
            tg.cancel_scope.cancel()


@anyio_test
@by_direction
async def test_a_message_of_too_many_fragments_is_closed_1009(direction: str) -> None:
    """Regression: a message that never finishes, in tiny fragments, grew
    without a cap (only payload bytes were counted). Now it is refused at the fragment bound."""
    limits = small_limits(max_message_fragments=64)
    flood = ws_frame(OP_BINARY, b"ab", fin=False) + ws_frame(OP_CONTINUATION, b"cd", fin=False) * 70
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await raw_session(client, role, ep)
                await client.write(flood)
                assert await client.wait_closed() == 1009
            rec = ep.current
            await wait_until(lambda: rec.transport.state is TransportState.RETIRED)
            assert "64 frames" in str(rec.transport.failure)


@anyio_test
@by_direction
async def test_a_message_of_exactly_max_fragments_is_one_message(direction: str) -> None:
    limits = small_limits(max_message_fragments=64)
    message = encode_message(1, b"x" * 62)
    header, payload = message[:-62], message[-62:]
    frames = ws_frame(OP_BINARY, header, fin=False)  # 1 frame
    for i in range(62):  # + 62 frames of one byte each
        frames += ws_frame(OP_CONTINUATION, payload[i : i + 1], fin=False)
    frames += ws_frame(OP_CONTINUATION, b"", fin=True)  # + an empty final one: 64
    with anyio.fail_after(DEADLINE):
        async with (
            listening(direction, limits) as (ep, role),
            RawClient.connect(ep.link.listen_address) as client,
        ):
            await raw_session(client, role, ep)
            await client.write(frames)
            await ep.wait_received(1)
            assert ep.current.received == [b"x" * 62]


@anyio_test
@by_direction
async def test_more_frames_than_a_handshake_needs_closes_the_socket_at_once(
    direction: str,
) -> None:
    """Before authentication a socket may send ``max_handshake_frames`` frames of any kind; the
    next one ends it with 4008 at once, not at the handshake deadline (regression: a flood of
    empty continuation frames or pings was parsed until the deadline, starving the loop)."""
    limits = small_limits(handshake_timeout=5.0, max_handshake_frames=8, frame_burst=64)
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, _role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.write(ws_frame(OP_PING, b"p") * 9)
                assert await client.wait_closed() == 4008
            stats = ep.link.statistics()
            assert stats.handshake_frames_exceeded == 1
            assert stats.handshakes_failed == {"MALFORMED": 1}  # not TIMEOUT: at once


@anyio_test
@by_direction
async def test_a_handshake_within_the_frame_allowance_succeeds(direction: str) -> None:
    limits = small_limits(max_handshake_frames=8, frame_burst=64)
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                assert isinstance(await client.upgrade(), AcceptConnection)
                await client.write(ws_frame(OP_PING, b"p") * 6)  # + hello + proof = 8
                await raw_session_after_upgrade(client, role, ep)
            assert ep.link.statistics().handshake_frames_exceeded == 0


async def raw_session_after_upgrade(client: RawClient, role: Role, listener: Endpoint) -> None:
    result = await client.authenticate(client.handshake(role))
    await client.send_fence()
    rec = await listener.wait_ready(len(listener.sessions) or 1)
    assert rec.session_id == result.session_id


@anyio_test
@by_direction
async def test_an_authenticated_frame_flood_is_throttled_not_closed(direction: str) -> None:
    """After authentication frames spend a token bucket (``frame_rate``, ``frame_burst``): a
    flood is read at that rate -- its message behind it cannot arrive sooner -- and the session
    survives. (Regression: every frame of a read was processed at once, without yielding.)"""
    rate, burst, pings = 2000, 100, 1000
    limits = small_limits(frame_rate=rate, frame_burst=burst, heartbeat_timeout=5.0)
    with anyio.fail_after(DEADLINE):
        async with listening(direction, limits) as (ep, role):
            async with RawClient.connect(ep.link.listen_address) as client:
                await raw_session(client, role, ep)
                rec = ep.current
                start = anyio.current_time()
                flood = ws_frame(OP_PING, b"") * pings + ws_frame(
                    OP_BINARY, encode_message(1, b"m")
                )
                await client.write(flood)
                await ep.wait_received(1, rec)
                elapsed = anyio.current_time() - start
                # A lower bound the token bucket guarantees (load can only make it slower).
                assert elapsed >= 0.9 * (pings - burst) / rate, elapsed
                assert rec.ready
            assert ep.link.statistics().throttled_reads >= 1


@pytest.mark.parametrize(
    ("rate", "burst", "steps", "expected"),
    [
        # (now, frames spent) -> (spend() result, delay() afterwards)
        (0.0, 3, [(0.0, 3), (9.0, 1)], [(True, 0.0), (False, math.inf)]),  # fixed allowance
        (10.0, 5, [(0.0, 5), (0.0, 1)], [(True, 0.0), (False, 0.2)]),  # debt 1 + 0.1 s worth
        (10.0, 5, [(0.0, 5), (0.5, 5)], [(True, 0.0), (True, 0.0)]),  # refilled in 0.5 s
        (10.0, 5, [(0.0, 1), (100.0, 5)], [(True, 0.0), (True, 0.0)]),  # capped at burst
        (10.0, 5, [(0.0, 5), (100.0, 6)], [(True, 0.0), (False, 0.2)]),  # ... so not 6
        (1000.0, 4, [(0.0, 5)], [(False, 0.005)]),  # quantum capped at burst: earn 1 + 4
    ],
)
def test_frame_budget_table(
    rate: float,
    burst: int,
    steps: list[tuple[float, int]],
    expected: list[tuple[bool, float]],
) -> None:
    """The token bucket as a pure function of ``now`` (no clock, no sockets)."""
    budget = FrameBudget.full(rate, burst, 0.0)
    got: list[tuple[bool, object]] = []
    for now, frames in steps:
        ok = budget.spend(now, frames)
        got.append((ok, budget.delay(now)))
    assert got == [(ok, pytest.approx(d)) for ok, d in expected]


def test_unauthenticated_share_must_be_smaller_than_the_authenticated_one() -> None:
    with pytest.raises(ConfigError, match="max_handshake_frames"):
        Limits(max_handshake_frames=64, frame_burst=64)


@anyio_test
@pytest.mark.parametrize("how", ["abort", "aclose"])
async def test_closing_a_link_from_its_hosts_body_ends_the_link_not_the_body(how: str) -> None:
    """The link's tasks run in a group of their own: ``abort()`` or ``aclose()`` from the task
    that entered the link ends the link, and the body runs on (a fleet, a gateway, a worker and
    a controller all host their links this way)."""
    reached: list[str] = []
    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            listener = make_link(Role.WORKER, small_limits(), listen=("127.0.0.1", 0))
            async with endpoint(tg, listener):
                dialer = make_link(Role.CONTROLLER, small_limits(), dial=listener.url)
                async with endpoint(tg, dialer) as dialing:
                    record = await dialing.wait_ready()
                    await getattr(dialer, how)()
                    await anyio.sleep(0)
                    # The link's honest state, seen by the body it did not cancel.
                    assert record.transport.state is TransportState.RETIRED
                    reached.append("dialer")
                await getattr(listener, how)()
                await anyio.sleep(0)
                reached.append("listener")
    assert reached == ["dialer", "listener"]
