"""Tests of garcon_link.net.ws's pure helpers: the upgrade refusal, the frame budget, close
descriptions and one-line reasons (no sockets; the sockets are tested over loopback in
``tests/test_link.py`` and ``tests/test_hostile.py``)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, cast

import h11
import pytest

from garcon_link.core.wire import CloseCode
from garcon_link.net.ws import (
    FrameBudget,
    WebSocket,
    close_code,
    describe_close,
    one_line,
    upgrade_refusal,
)

UPGRADE_HEADERS = [
    (b"Host", b"example.com"),
    (b"Upgrade", b"websocket"),
    (b"Connection", b"Upgrade"),
    (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
    (b"Sec-WebSocket-Version", b"13"),
]
PLAIN_HEAD = b"GET /executor HTTP/1.1\r\nHost: example.com\r\n\r\n"


def request(
    method: bytes = b"GET",
    target: bytes = b"/executor",
    extra: list[tuple[bytes, bytes]] | None = None,
    version: bytes = b"1.1",
) -> h11.Request:
    return h11.Request(
        method=method,
        target=target,
        headers=[*UPGRADE_HEADERS, *(extra or [])],
        http_version=version,
    )


@pytest.mark.parametrize(
    ("req", "head", "reason"),
    [
        (request(), PLAIN_HEAD, None),
        (request(extra=[(b"Content-Length", b"0")]), PLAIN_HEAD, None),
        (request(target=b"/other"), PLAIN_HEAD, None),  # a path is the listener's (404)
        (request(method=b"POST"), PLAIN_HEAD, "must be a GET"),
        (request(version=b"1.0"), PLAIN_HEAD, "must be HTTP/1.1"),
        (request(target=b"http://example.com/executor"), PLAIN_HEAD, "origin-form"),
        (request(target=b"*", method=b"OPTIONS"), PLAIN_HEAD, "must be a GET"),
        (request(extra=[(b"X-A", b"1")] * 3), PLAIN_HEAD, "more than 7 header fields"),
        (request(extra=[(b"Content-Length", b"5")]), PLAIN_HEAD, "must not have a body"),
        (request(extra=[(b"Transfer-Encoding", b"chunked")]), PLAIN_HEAD, "must not have a body"),
        (request(), b"GET / HTTP/1.1\r\nX-A: 1\r\n 2\r\n\r\n", "obsolete line folding"),
        (request(), b"GET / HTTP/1.1\r\nX-A: 1\r\n\t2\r\n\r\n", "obsolete line folding"),
    ],
)
def test_upgrade_refusal(req: h11.Request, head: bytes, reason: str | None) -> None:
    found = upgrade_refusal(req, head, max_headers=7)
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found


def test_upgrade_refusal_counts_header_fields_up_to_the_limit() -> None:
    req = request(extra=[(b"X-A", b"1")] * 2)  # 7 fields
    assert upgrade_refusal(req, PLAIN_HEAD, max_headers=7) is None
    assert upgrade_refusal(req, PLAIN_HEAD, max_headers=6) == "more than 6 header fields"


def test_a_fixed_allowance_is_spent_for_good() -> None:
    budget = FrameBudget.full(0.0, 2, now=0.0)
    assert [budget.spend(t) for t in (0.0, 1.0)] == [True, True]
    assert budget.delay(1.0) == 0.0
    assert not budget.spend(100.0)
    assert budget.delay(1000.0) == math.inf


@pytest.mark.parametrize(
    ("rate", "burst", "spent", "after", "tokens"),
    [
        (10.0, 5.0, 0, 0.0, 5.0),
        (10.0, 5.0, 5, 0.0, 0.0),
        (10.0, 5.0, 5, 0.2, 2.0),
        (10.0, 5.0, 5, 10.0, 5.0),  # capped at the burst
        (10.0, 5.0, 8, 0.0, -3.0),  # in debt
        (10.0, 5.0, 8, 0.5, 2.0),
    ],
)
def test_the_bucket_refills_at_its_rate_up_to_its_burst(
    rate: float, burst: float, spent: int, after: float, tokens: float
) -> None:
    budget = FrameBudget.full(rate, burst, now=0.0)
    budget.spend(0.0, spent)
    budget.spend(after, 0)
    assert budget.tokens == pytest.approx(tokens)
    assert budget.stamp == after


def test_time_going_backwards_earns_nothing() -> None:
    budget = FrameBudget.full(10.0, 5.0, now=10.0)
    budget.spend(10.0, 5)
    assert budget.spend(9.0, 0)
    assert (budget.tokens, budget.stamp) == (0.0, 10.0)


@pytest.mark.parametrize(
    ("rate", "burst", "debt", "quantum", "delay"),
    [
        (100.0, 50.0, 0, 0.01, 0.0),  # not in debt
        (100.0, 50.0, 1, 0.01, 0.02),  # one frame owed, then a batch of one frame (rate * quantum)
        (1000.0, 50.0, 1, 0.01, 0.011),  # a batch of ten frames
        (1000.0, 5.0, 1, 0.01, 0.006),  # the batch is at most the burst
        (10.0, 5.0, 3, 0.01, 0.4),  # a batch of at least one frame
    ],
)
def test_a_throttled_reader_waits_for_its_debt_and_a_batch(
    rate: float, burst: float, debt: int, quantum: float, delay: float
) -> None:
    budget = FrameBudget.full(rate, burst, now=0.0)
    budget.spend(0.0, int(burst) + debt)
    assert budget.delay(0.0, quantum) == pytest.approx(delay)


def test_the_throttle_delay_is_what_it_takes_to_spend_again() -> None:
    budget = FrameBudget.full(100.0, 10.0, now=0.0)
    budget.spend(0.0, 15)
    wait = budget.delay(0.0)
    assert budget.spend(wait) and budget.delay(wait) == 0.0


def fake_socket(
    local: tuple[int, str] | None = None, peer: tuple[int, str] | None = None
) -> WebSocket:
    return cast("WebSocket", SimpleNamespace(local_close=local, peer_close=peer))


@pytest.mark.parametrize(
    ("local", "peer", "code", "text"),
    [
        (None, None, None, "connection lost"),
        ((1000, "done"), None, 1000, "closed by us code=1000 cause='done'"),
        (None, (1001, "bye"), 1001, "closed by peer code=1001 cause='bye'"),
        ((4008, "late"), (1000, "x"), 4008, "closed by us code=4008 cause='late'"),  # ours first
        ((CloseCode(1009), "big"), None, 1009, "closed by us code=1009 cause='big'"),
    ],
)
def test_the_close_is_described_ours_first(
    local: Any, peer: Any, code: int | None, text: str
) -> None:
    sock = fake_socket(local, peer)
    assert close_code(sock) == code
    assert describe_close(sock) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ""),
        ("plain", "plain"),
        ("  two\nlines\r\n\tand tabs  ", "two lines and tabs"),
        ("x" * 200, "x" * 200),
        ("x" * 201, "x" * 197 + "..."),
        ("a " * 150, ("a " * 99)[:197] + "..."),
    ],
)
def test_one_line(text: str, expected: str) -> None:
    assert one_line(text) == expected
    assert "\n" not in one_line(text) and len(one_line(text)) <= 200
