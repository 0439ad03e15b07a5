"""Rows of a state database (garcon_link.rpc.statedir) that a careless operator, another tool or
a crash left: huge blobs, values of the wrong type in every column, NULLs where SQLite lets them
in. Opening the directory and loading what it holds either refuses in one ConfigError line
naming the file, or skips the row (with a warning for a process record); it never raises a
sqlite3 or cbor2 exception, and it never reads a huge value into memory to find it too large.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import pytest

import garcon_link as gl
from garcon_link.rpc.keystore import DurableKeys
from garcon_link.rpc.statedir import DATABASE_NAME, open_state_directory
from garcon_link.services._records import restore

pytestmark = pytest.mark.timeout(30)

LIMITS = gl.Limits(idempotency_max_bytes=1024 * 1024)  # below HUGE: a huge reply is too large
HUGE = 8 * 1024 * 1024  # one value far past every bound; a few of them in a test
MEMORY_BOUND = 4 * 1024 * 1024  # what opening and loading may allocate at their peak here


def _fresh(tmp_path: Path) -> Path:
    open_state_directory(tmp_path, "box").close_now()
    return tmp_path / DATABASE_NAME


def _tamper(database: Path, *statements: tuple[str, tuple[Any, ...]]) -> None:
    db = sqlite3.connect(database, isolation_level=None)
    try:
        for sql, params in statements:
            db.execute(sql, params)
    finally:
        db.close()


@contextlib.contextmanager
def _peak_below(limit: int) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak} bytes allocated"


def _open_and_load(path: Path) -> list[Any]:
    state = open_state_directory(path, "box")
    try:
        restored, _ = restore(state.process_rows, str(state.database))
        keys = DurableKeys(state, LIMITS).load(0.0)
        return [restored, keys]
    finally:
        state.close_now()


def _one_line(path: Path) -> str:
    with pytest.raises(gl.ConfigError) as info:
        _open_and_load(path)
    text = str(info.value)
    assert "\n" not in text and str(path / DATABASE_NAME) in text and len(text) < 1_000
    return text


_RECORD = "INSERT INTO processes (id, record) VALUES (?, ?)"
_KEYED = (
    "INSERT INTO keyed_calls (service, method, key, digest, state, started_at, finished_at,"
    " reply_kind, reply) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _keyed(**changed: Any) -> tuple[str, tuple[Any, ...]]:
    row = {
        "service": "calc",
        "method": "add",
        "key": b"k1",
        "digest": bytes(32),
        "state": "done",
        "started_at": 1.0,
        "finished_at": 2.0,
        "reply_kind": 1,
        "reply": cbor2.dumps([1, 7, 3]),
    } | changed
    return _KEYED, tuple(row.values())


# ------------------------------------------------------------------------------ huge values


def test_huge_process_records_and_ids_are_skipped_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    database = _fresh(tmp_path)
    _tamper(
        database,
        (_RECORD, ("big-1", bytes(HUGE))),
        (_RECORD, ("big-2", bytes(HUGE))),
        (_RECORD, ("x" * HUGE, cbor2.dumps({"argv": ["true"]}))),
        (_RECORD, (b"y" * HUGE, b"")),
    )
    caplog.set_level(logging.WARNING)
    with _peak_below(MEMORY_BOUND):
        restored, _ = _open_and_load(tmp_path)
    assert restored == {}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(len(line) < 1_000 for line in warnings)
    # Opened again: the rows too large to read are gone, with a line that says so.
    caplog.clear()
    with _peak_below(MEMORY_BOUND):
        _open_and_load(tmp_path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("column", ["service", "method", "key", "digest", "reply"])
def test_a_huge_value_in_any_keyed_calls_column_is_dropped_unread(
    tmp_path: Path, column: str
) -> None:
    database = _fresh(tmp_path)
    huge: Any = "s" * HUGE if column in ("service", "method") else bytes(HUGE)
    _tamper(database, _keyed(**({"key": b"big"} | {column: huge})), _keyed(key=b"ok"))
    with _peak_below(MEMORY_BOUND):
        _, keys = _open_and_load(tmp_path)
    assert [call.key[2] for call in keys] == [b"ok"]


@pytest.mark.parametrize("value", ["x" * HUGE, bytes(HUGE), None, 7])
@pytest.mark.parametrize("name", ["state_id", "executor_id"])
def test_a_huge_or_mistyped_meta_value_is_one_line_read_within_bounds(
    tmp_path: Path, name: str, value: Any
) -> None:
    database = _fresh(tmp_path)
    if value is None:
        _tamper(database, ("DELETE FROM meta WHERE name = ?", (name,)))
    else:
        _tamper(database, ("UPDATE meta SET value = ? WHERE name = ?", (value, name)))
    with _peak_below(MEMORY_BOUND):
        text = _one_line(tmp_path)
    assert name in text or "executor" in text


# ------------------------------------------------------------------------------ wrong types

_WRONG: list[dict[str, Any]] = [
    {"service": b"calc"},
    {"service": 3},
    {"method": 2.5},
    {"key": "k1"},
    {"key": 11},
    {"digest": "d"},
    {"state": "running", "finished_at": "soon", "reply_kind": b"?", "reply": 5},
    {"finished_at": None},
    {"finished_at": "yesterday"},
    {"finished_at": float("inf")},
    {"finished_at": float("-inf")},
    {"finished_at": 2**62},
    {"reply_kind": None},
    {"reply_kind": 99},
    {"reply_kind": "1"},
    {"reply": None},
    {"reply": "text"},
    {"reply": b""},
    {"reply": b"\xff\xff not cbor"},
    {"started_at": "then"},
]


@pytest.mark.parametrize(
    "changed", _WRONG, ids=lambda d: "-".join(f"{k}={v!r}"[:24] for k, v in d.items())
)
def test_a_keyed_calls_row_of_the_wrong_types_is_one_line_or_loaded(
    tmp_path: Path, changed: dict[str, Any]
) -> None:
    database = _fresh(tmp_path)
    _tamper(database, _keyed(**changed))
    try:
        _open_and_load(tmp_path)
    except gl.ConfigError as exc:
        text = str(exc)
        assert "\n" not in text and str(tmp_path / DATABASE_NAME) in text


_RECORDS: list[tuple[Any, Any]] = [
    (1, cbor2.dumps({})),
    ("p-text", "not a blob"),
    ("p-int", 5),
    ("p-float", 1.5),
    ("p-cbor-int", cbor2.dumps(5)),
    ("p-deep", b"\x81" * 100_000 + b"\x00"),
    ("p-bignum", b"\xc2\x5a\x00\x10\x00\x00" + bytes(16)),
    ("p-tags", cbor2.dumps(cbor2.CBORTag(99999, [1]))),
    ("p-truncated", cbor2.dumps({"argv": ["a" * 100]})[:-5]),
    (
        "p-fields",
        cbor2.dumps({"argv": [1], "cwd": b"/", "pid": -1, "spec": "x", "started_at": "t"}),
    ),
    (
        "p-nan",
        cbor2.dumps({"argv": [], "cwd": "/", "pid": 1, "spec": b"", "started_at": float("nan")}),
    ),
]


@pytest.mark.parametrize("row", _RECORDS, ids=lambda r: str(r[0]))
def test_a_process_record_of_the_wrong_shape_is_skipped_with_a_warning(
    tmp_path: Path, row: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    database = _fresh(tmp_path)
    _tamper(database, (_RECORD, row))
    caplog.set_level(logging.WARNING)
    restored, _ = _open_and_load(tmp_path)
    assert restored == {}
    assert any("skipping a process record" in r.getMessage() for r in caplog.records)
