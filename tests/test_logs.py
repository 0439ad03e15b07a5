"""Tests of garcon_link.logs and the layers' log lines: gl_* extra fields, plain words, --log-json,
and what a peer can make us log.

A real link event (a socket attached, then closed) is logged with the fields a machine needs
(caplog); every log call in the package has an ASCII message (read from the source, so a glyph
added later fails here); ``garcon-link worker --log-json`` and ``garcon-link call --log-json``
write JSON lines (subprocesses, as in ``test_cli.py``).

Bounded logging: :func:`peer_text` cuts before it renders (tracemalloc), the
:class:`PeerLogLimiter` is driven by an injected clock; then real floods -- 300 refused
handshakes on a loopback listener, 20,000 abort parts and 3,000 malformed envelopes on a wired
pair, a notification naming an 8 MiB service -- write a few short lines while the statistics
count every event (both anyio backends).
"""

from __future__ import annotations

import ast
import json
import logging
import socket
import sys
import tracemalloc
from pathlib import Path

import anyio
import cbor2
import pytest
from faultutil import Raw, worker_config
from linkutil import wait_until
from rpcutil import CalcImpl, Direction, both_directions, open_pair, own_link, raw_call, raw_send
from test_cli import SERVICE, Worker, run_cli, write_config

import garcon_link
import garcon_link as gl
from garcon_link import cli
from garcon_link.cli._output import _error_line
from garcon_link.logs import (
    FIELDS,
    MESSAGE_CHARS,
    PEER_TEXT_CHARS,
    JsonFormatter,
    PeerLogLimiter,
    log_fields,
    peer_text,
)
from garcon_link.rpc.chunks import ABORT, encode_part
from garcon_link.rpc.rpc import CALL, NOTIFY

PACKAGE = Path(garcon_link.__file__).resolve().parent
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def test_log_fields_leaves_out_what_is_not_known() -> None:
    assert log_fields() == {}
    assert log_fields(executor="box", session=b"\x01\xff", peer="127.0.0.1:5", close_code=4008) == {
        "gl_executor": "box",
        "gl_session": "01ff",
        "gl_peer": "127.0.0.1:5",
        "gl_close_code": 4008,
    }
    every = log_fields(
        executor="a", session="b", peer="c", close_code=1, controller="d", caller="e"
    )
    assert set(every) == set(FIELDS)


def test_json_formatter_writes_one_object_per_line() -> None:
    logger = logging.getLogger("garcon_link.test")
    record = logger.makeRecord(
        "garcon_link.test",
        logging.WARNING,
        __file__,
        1,
        "peer %s said\n%s",
        ("127.0.0.1:9", "h\u00e9llo"),
        None,
        extra=log_fields(executor="box", close_code=1001),
    )
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line and line.isascii()
    parsed = json.loads(line)
    assert parsed["level"] == "WARNING"
    assert parsed["logger"] == "garcon_link.test"
    assert parsed["message"] == "peer 127.0.0.1:9 said\nh\u00e9llo"
    assert parsed["gl_executor"] == "box" and parsed["gl_close_code"] == 1001
    assert "gl_session" not in parsed
    assert parsed["time"].endswith("Z") and "T" in parsed["time"]
    assert "ValueError: boom" in parsed["exception"]


@pytest.mark.anyio
async def test_a_socket_attached_and_closed_is_logged_with_its_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="garcon_link")
    with anyio.fail_after(10):
        async with open_pair("worker-listens", {"calc": CalcImpl()}) as pair:
            session = pair.executor.link.transport.session_id.hex()  # type: ignore[union-attr]
            assert await pair.calc().add(1, 2) == 3
    records = [r for r in caplog.records if r.name == "garcon_link.link"]
    attached = [r for r in records if "attached" in r.getMessage()]
    assert len(attached) == 2  # one line per end
    for record in attached:
        assert record.gl_executor == "box"  # type: ignore[attr-defined]
        assert record.gl_session == session  # type: ignore[attr-defined]
        assert record.gl_peer.startswith("127.0.0.1:")  # type: ignore[attr-defined]
    closed = [r for r in records if ": socket closed" in r.getMessage()]
    assert closed, [r.getMessage() for r in records]
    for record in closed:
        assert record.gl_session == session  # type: ignore[attr-defined]
        assert record.gl_close_code == 1001  # type: ignore[attr-defined]  # shutting down
    assert all(r.getMessage().isascii() for r in caplog.records)


def _log_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in LOG_METHODS
        and (
            (
                isinstance(node.func.value, ast.Name)
                and node.func.value.id in {"log", "_log", "logger"}
            )
            # a PeerLogLimiter: self._peer_log.log(...), self.peer_log.log(...)
            or (
                isinstance(node.func.value, ast.Attribute) and node.func.value.attr.endswith("_log")
            )
        )
    ]


def test_no_log_message_in_the_package_has_a_glyph() -> None:
    found = 0
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in _log_calls(ast.parse(path.read_text(encoding="utf-8"))):
            found += 1
            for node in ast.walk(call):
                text = node.value if isinstance(node, ast.Constant) else None
                if isinstance(text, str) and not text.isascii():
                    offenders.append(f"{path.name}:{call.lineno}: {text!r}")
    assert found > 50  # the scan sees the package's log calls
    assert offenders == []


@pytest.mark.slow
def test_log_json_writes_json_lines_from_the_worker_and_the_controller(tmp_path: Path) -> None:
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, SERVICE, extra=("-vv", "--log-json"))
    try:
        url = worker.url()
        controller = write_config(tmp_path, "controller.toml", "controller", f'dial = "{url}"')
        done = run_cli("--log-json", "call", str(controller), "demo.add", "[1, 2]", "-vv")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "3"
        assert worker.process.stdin is not None
        worker.process.stdin.close()
        assert worker.process.wait(timeout=20) == 0
        assert worker.process.stderr is not None
        worker_err = worker.process.stderr.read()
    finally:
        worker.kill()
    for side, text in (("controller", done.stderr), ("worker", worker_err)):
        lines = [json.loads(line) for line in text.splitlines()]  # every line is one object
        assert lines, side
        for line in lines:
            assert {"time", "level", "logger", "message"} <= set(line), line
            assert line["logger"].startswith("garcon_link"), line
        attached = [line for line in lines if "attached" in line["message"]]
        assert attached, (side, lines)
        assert attached[0]["gl_executor"] == "cli-box"
        assert len(attached[0]["gl_session"]) == 64
        assert attached[0]["gl_peer"].startswith("127.0.0.1:")
    # The worker (still running when the controller went) logged the socket's end and its code.
    worker_lines = [json.loads(line) for line in worker_err.splitlines()]
    closed = [line for line in worker_lines if ": socket closed by peer" in line["message"]]
    assert closed and closed[0]["gl_close_code"] == 1001, worker_lines


def test_log_json_makes_the_error_line_a_json_object_too(tmp_path: Path) -> None:
    """With ``--log-json`` every line on stderr parses, the final ``error:`` line included: the
    same shape as the log lines (level ERROR, logger garcon_link.cli); without it, plain text."""
    with socket.socket() as held:  # bound, not listening: every dial is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        url = f'dial = "ws://127.0.0.1:{port}/executor"'
        controller = write_config(tmp_path, "controller.toml", "controller", url)
        done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--log-json", "-v")
        plain = run_cli("call", str(controller), "demo.add", "[1, 2]")
    assert done.returncode == plain.returncode == cli.EXIT_NOT_DISPATCHED
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is one object
    last = lines[-1]
    assert {"time", "level", "logger", "message"} <= set(last), last
    assert (last["level"], last["logger"]) == ("ERROR", "garcon_link.cli"), last
    assert last["message"].startswith("error: [not_dispatched:UNREACHABLE] "), last
    assert "exception" not in last  # an expected failure: its line says it all
    assert plain.stderr.startswith("error: [not_dispatched:UNREACHABLE] "), plain.stderr


def test_the_json_error_line_carries_a_traceback_as_its_exception(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An internal error's ``-v`` traceback goes inside the JSON line, not beside it."""
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        _error_line("internal error, RuntimeError: boom", json_lines=True, exc=exc)
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    line = json.loads(err)
    assert line["message"] == "error: internal error, RuntimeError: boom"
    assert "Traceback" in line["exception"] and "boom" in line["exception"]


# ------------------------------------------------------------------- peer_text and the limiter


def test_peer_text_cuts_before_rendering_and_says_the_true_length() -> None:
    huge = "a" * (8 * 1024 * 1024)
    shown = peer_text(huge)
    assert shown == "'" + "a" * PEER_TEXT_CHARS + f"'... ({len(huge)} chars)"
    assert peer_text("calc") == "'calc'"
    assert peer_text("h\u00e9\n'\\\x00") == "'h\\xe9\\n\\'\\\\\\x00'"
    assert peer_text(b"\x00ab" * 1000) == "b'" + "\\x00ab" * 13 + "'... (3000 bytes)"
    assert peer_text(2**100) == "<integer of 101 bits>" and peer_text(-5) == "-5"
    assert peer_text([1] * 10**6) == "<list of 1000000>"
    assert peer_text({"k": 1}) == "<dict of 1>" and peer_text(None) == "None"
    assert peer_text(object()) == "<object>"
    assert peer_text("x" * 500, 20).startswith("'" + "x" * 20 + "'...")
    assert peer_text(-(10**5000)) == "<-integer of 16610 bits>"  # str() would raise
    assert peer_text(float("nan")) == "nan" and peer_text(True) == "True"
    assert peer_text(1, limit=0) == "1"


def test_peer_text_survives_a_value_whose_len_raises() -> None:
    class Evil(list):  # type: ignore[type-arg]
        def __len__(self) -> int:
            raise RuntimeError("no")

    class EvilText(str):
        def __len__(self) -> int:
            raise RuntimeError("no")

    assert peer_text(Evil()) == "<Evil>"  # named by its type: len() is never asked
    assert peer_text(EvilText("x")) == "<EvilText>"


def test_peer_text_of_an_exception_is_its_message_on_one_line_and_bounded() -> None:
    assert peer_text(ValueError("bad\n  thing")) == "bad\\n  thing"
    long = peer_text(ValueError("no service named " + "s" * 10**6))
    assert len(long) <= MESSAGE_CHARS + 40 and long.endswith(f"({10**6 + 17} chars)")

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert peer_text(Unprintable()) == "<unprintable value>"


def test_peer_text_never_renders_a_huge_value_whole() -> None:
    huge = "\u20ac" * (4 * 1024 * 1024)  # every character escaped: 6 output chars each
    data, error = huge.encode(), ValueError(huge)
    tracemalloc.start()
    try:
        peer_text(huge)
        peer_text(data)
        peer_text(error)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(clock: Clock, **options: object) -> PeerLogLimiter:
    return PeerLogLimiter(logging.getLogger("garcon_link.test"), clock=clock, **options)  # type: ignore[arg-type]


def test_the_limiter_logs_once_per_peer_and_reason_per_interval_with_the_suppressed_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="garcon_link.test")
    clock = Clock()
    limiter = _limiter(clock, interval=60.0)
    for _ in range(1000):
        limiter.log("10.0.0.1", "bad", "peer %s did %s", "10.0.0.1", "bad")
    limiter.log("10.0.0.1", "worse", "peer did worse")
    limiter.log("10.0.0.2", "bad", "another peer")
    assert [r.getMessage() for r in caplog.records] == [
        "peer 10.0.0.1 did bad",
        "peer did worse",
        "another peer",
    ]
    assert limiter.events == 1002 and limiter.suppressed == 999
    clock.now += 59.9
    limiter.log("10.0.0.1", "bad", "still bad")
    assert len(caplog.records) == 3
    clock.now += 0.1
    limiter.log("10.0.0.1", "bad", "bad again")
    assert caplog.records[-1].getMessage() == "bad again (1000 more since the last such line)"
    assert caplog.records[-1].levelno == logging.WARNING


def test_the_limiter_writes_at_most_max_lines_per_interval_whatever_the_addresses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="garcon_link.test")
    clock = Clock()
    limiter = _limiter(clock, interval=10.0, max_lines=5, max_keys=100)
    for n in range(100_000):  # a new address every time
        limiter.log(f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}", "bad", "refused")
    assert len(caplog.records) == 5
    assert limiter.remembered == 100  # the oldest pairs were forgotten: memory stays bounded
    clock.now += 10.0
    limiter.log("192.0.2.1", "bad", "refused")
    assert len(caplog.records) == 6


def test_the_summary_is_a_warning_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="garcon_link.test")
    clock = Clock()
    limiter = _limiter(clock, level=logging.INFO, interval=60.0, summary="handshakes refused")
    for n in range(300):
        limiter.log(f"10.0.0.{n % 3}", "AUTH_FAILED" if n % 2 else "HTTP 404", "refused")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["1 handshakes refused (HTTP 404=1); more are summarized at most every 60s"]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 6  # 3 peers x 2 reasons
    clock.now += 61
    limiter.log("10.0.0.9", "TIMEOUT", "refused")
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage() == (
        "300 handshakes refused in the last 61s (AUTH_FAILED=150, HTTP 404=149, TIMEOUT=1)"
    )


# ------------------------------------------------------------- floods: what a peer makes us log

FLOOD_LIMITS = gl.Limits(handshake_timeout=2.0, takeover_probe_timeout=1.0, close_timeout=0.3)


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("garcon_link") and r.levelno == level
    ]


@pytest.mark.anyio
async def test_a_flood_of_refused_handshakes_logs_a_few_lines_and_counts_them_all(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """300 bogus handshakes from one host (200 with a wrong secret, 100 on a wrong path): a
    line per reason and one WARNING summary, not a WARNING each; statistics count them all."""
    caplog.set_level(logging.INFO, logger="garcon_link")
    with anyio.fail_after(60):
        async with gl.Worker(worker_config(FLOOD_LIMITS), {}) as worker:
            port = own_link(worker).listen_address[1]

            async def wrong_secret() -> None:
                async with Raw.connect(port) as raw:
                    assert await raw.upgrade()
                    with pytest.raises(ConnectionError):
                        await raw.authenticate(secret=b"w" * 32)

            async def wrong_path() -> None:
                async with Raw.connect(port) as raw:
                    assert not await raw.upgrade("/nope")
                    assert raw.http_status == 404

            for batch in range(15):
                async with anyio.create_task_group() as tg:
                    for n in range(20):
                        tg.start_soon(wrong_path if (batch * 20 + n) % 3 == 2 else wrong_secret)
            stats = worker.link.statistics()
    assert stats.handshakes_failed.get("AUTH_FAILED") == 200, stats.handshakes_failed
    assert stats.upgrades_refused == {404: 100}
    warnings = _lines(caplog, logging.WARNING)
    infos = _lines(caplog, logging.INFO)
    assert len(warnings) <= 2, warnings  # the summary (a second if the flood crossed a minute)
    assert any("unauthenticated connections failed" in w for w in warnings), warnings
    refusals = [m for m in infos if "refused" in m]
    assert 2 <= len(refusals) <= 4, refusals  # one per reason (per interval)


@pytest.mark.anyio
@both_directions
async def test_floods_of_abort_parts_and_malformed_envelopes_log_a_line_per_reason(
    direction: Direction, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="garcon_link")
    with anyio.fail_after(60):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            rpc = pair.rpc
            worker_rpc = pair.worker_rpc
            for _ in range(20_000):
                await raw_send(rpc, encode_part(ABORT, b""))  # an abort with nothing in progress
            for n in range(3_000):
                bad = ([99, 1], "not a list", [CALL, "x"], b"\xff")[n % 4]
                await raw_send(rpc, bad)
            assert await pair.calc().add(1, 2) == 3  # in order after all of the above
            stats = worker_rpc.statistics()
    assert stats.part_violations == 20_000
    assert stats.malformed_envelopes == 3_000
    rpc_lines = [r.getMessage() for r in caplog.records if r.name == "garcon_link.rpc"]
    assert len(rpc_lines) <= 4, rpc_lines[:10]  # one per reason (parts, malformed) per interval


@pytest.mark.anyio
@both_directions
async def test_a_notification_naming_an_8_mib_service_costs_a_short_line_and_no_memory(
    direction: Direction, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="garcon_link")
    huge = "s" * (8 * 1024 * 1024)
    notify = cbor2.dumps([NOTIFY, huge, "add", [1, 2], {}])
    with anyio.fail_after(60):
        async with open_pair(direction, {"calc": CalcImpl()}) as pair:
            worker_rpc = pair.worker_rpc
            tracemalloc.start()
            try:
                await raw_send(pair.rpc, notify)
                await wait_until(lambda: worker_rpc.statistics().notifications_dropped == 1)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            with pytest.raises(gl.Rejected) as refused:
                await raw_call(pair.rpc, huge, "add", [1, 2], {})
            assert await pair.calc().add(1, 2) == 3
    longest = max((len(r.getMessage()) for r in caplog.records), default=0)
    assert longest < 500, longest
    assert len(str(refused.value)) < 500 and "(8388608 chars)" in str(refused.value)
    # The message is sent, framed, received and decoded in this process: ~40 MiB of copies of
    # 8 MiB. Logging the name whole and formatting it into the refusal took the peak to ~104 MiB.
    assert peak < 64 * 1024 * 1024, f"peak {peak / 1024 / 1024:.0f} MiB"


def test_log_interval_below_a_second_is_refused() -> None:
    with pytest.raises(gl.ConfigError, match="log_interval must be at least 1 second"):
        gl.Limits(log_interval=0.001)
    assert gl.Limits(log_interval=1.0).log_interval == 1.0
