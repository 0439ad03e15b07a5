"""Tests of garcon_link.logs and the layers' log lines: gl_* extra fields, plain words, --log-json.

A real link event (a socket attached, then closed) is logged with the fields a machine needs
(caplog); every log call in the package has an ASCII message (read from the source, so a glyph
added later fails here); ``garcon-link worker --log-json`` and ``garcon-link call --log-json``
write JSON lines (subprocesses, as in ``test_cli.py``).
"""

from __future__ import annotations

import ast
import json
import logging
import sys
from pathlib import Path

import anyio
import pytest
from rpcutil import CalcImpl, open_pair
from test_cli import SERVICE, Worker, run_cli, write_config

import garcon_link
from garcon_link.logs import FIELDS, JsonFormatter, log_fields

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
    assert set(log_fields(executor="a", session="b", peer="c", close_code=1)) == set(FIELDS)


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
        assert record.gl_close_code == 1001  # type: ignore[attr-defined] -- shutting down
    assert all(r.getMessage().isascii() for r in caplog.records)


def _log_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in LOG_METHODS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in {"log", "_log", "logger"}
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
                    offenders.append(f"{path.name}:{call.lineno}: {node.value!r}")
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
