"""The state directory (garcon_link/rpc/statedir.py) and the idempotency table kept in it
(garcon_link/rpc/keystore.py), without sockets: the worker's keyed runner driven directly.

Refusals are one line naming the file; a second opener is refused naming the holder's pid;
keyed calls survive a close-and-reopen (finished: replayed; running: ``WORKER_RESTARTED``)
within the table's bounds; and a child process SIGKILLed at random points of its journal writes
leaves a database that opens and never reports finished a call whose handler did not finish.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import cbor2
import pytest

import garcon_link as gl
from garcon_link.rpc.envelopes import ERROR, RESULT
from garcon_link.rpc.idempotency import (
    Await,
    Execute,
    KeyedExecutions,
    Replay,
    Reply,
    TableKey,
)
from garcon_link.rpc.keystore import DurableKeys
from garcon_link.rpc.statedir import (
    DATABASE_NAME,
    LOCK_NAME,
    StateDirectory,
    StateUnavailable,
    open_state_directory,
)

pytestmark = pytest.mark.timeout(60)

TESTS_DIR = Path(__file__).resolve().parent
LIMITS = gl.Limits()


def refusal(path: Path, executor: str = "box") -> str:
    with pytest.raises(gl.ConfigError) as info:
        open_state_directory(path, executor).close_now()
    text = str(info.value)
    assert "\n" not in text and "Traceback" not in text
    return text


# ---------------------------------------------------------------------------------- refusals


def test_a_second_opener_is_refused_naming_the_holder_s_pid(tmp_path: Path) -> None:
    state = open_state_directory(tmp_path / "s", "box")
    try:
        assert (tmp_path / "s" / LOCK_NAME).read_text().strip() == str(os.getpid())
        text = refusal(tmp_path / "s")
        assert f"in use by another worker (pid {os.getpid()}" in text
    finally:
        state.close_now()
    open_state_directory(tmp_path / "s", "box").close_now()  # released


def test_the_directory_and_database_are_private(tmp_path: Path) -> None:
    open_state_directory(tmp_path / "s", "box").close_now()
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "s" / DATABASE_NAME).stat().st_mode & 0o777 == 0o600


def test_a_directory_that_cannot_be_created_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "cannot create it" in refusal(tmp_path / "file" / "state")
    assert "not a directory" in refusal(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_directory_that_is_not_writable_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "ro"
    target.mkdir(mode=0o500)
    try:
        assert "not writable" in refusal(target)
    finally:
        target.chmod(0o700)


def test_a_directory_on_a_read_only_file_system_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even root cannot write a read-only mount: the fix is a remount, not permissions. The
    file system's answers are faked (a mount needs privileges)."""
    target = tmp_path / "ro"
    target.mkdir()
    real_statvfs = os.statvfs

    def read_only(path: object) -> os.statvfs_result:
        found = real_statvfs(path)  # type: ignore[arg-type]
        fields = list(found)
        fields[8] = found.f_flag | os.ST_RDONLY  # f_flag
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    monkeypatch.setattr(os, "statvfs", read_only)
    text = refusal(target)
    assert "read-only file system" in text and "remount it read-write" in text


def test_a_file_that_is_no_database_is_named(tmp_path: Path) -> None:
    target = tmp_path / "s"
    target.mkdir()
    (target / DATABASE_NAME).write_bytes(os.urandom(4096))
    text = refusal(target)
    assert str(target / DATABASE_NAME) in text and "move the file away" in text


def test_another_program_s_database_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "s"
    target.mkdir()
    db = sqlite3.connect(target / DATABASE_NAME)
    db.execute("CREATE TABLE users (name TEXT)")
    db.commit()
    db.close()
    assert "of another program" in refusal(target)
    db = sqlite3.connect(target / DATABASE_NAME)
    db.execute("PRAGMA application_id=1234")
    db.commit()
    db.close()
    assert "application id 0x4d2" in refusal(target)


def test_a_newer_schema_and_another_executor_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "s"
    open_state_directory(target, "box").close_now()
    assert "the state of executor 'box', not of this worker ('other')" in refusal(target, "other")
    db = sqlite3.connect(target / DATABASE_NAME)
    db.execute("PRAGMA user_version=99")
    db.commit()
    db.close()
    assert "written by a newer garcon-link (state schema 99" in refusal(target)


@pytest.mark.parametrize("version", [0, -5])
def test_a_schema_version_this_version_never_wrote_is_refused(tmp_path: Path, version: int) -> None:
    target = tmp_path / "s"
    open_state_directory(target, "box").close_now()
    db = sqlite3.connect(target / DATABASE_NAME)
    db.execute(f"PRAGMA user_version={version}")
    db.commit()
    db.close()
    text = refusal(target)
    assert str(target / DATABASE_NAME) in text and f"unknown state schema {version}" in text


@pytest.mark.parametrize("state_id", ["zz", "", "ab" * 300])
def test_a_damaged_state_id_is_refused_naming_the_file(tmp_path: Path, state_id: str) -> None:
    target = tmp_path / "s"
    open_state_directory(target, "box").close_now()
    db = sqlite3.connect(target / DATABASE_NAME)
    db.execute("UPDATE meta SET value = ? WHERE name = 'state_id'", (state_id,))
    db.commit()
    db.close()
    text = refusal(target)
    assert str(target / DATABASE_NAME) in text and "state_id" in text and "damaged" in text


@pytest.mark.parametrize("name", [LOCK_NAME, DATABASE_NAME])
def test_a_symlink_in_the_directory_is_refused_and_its_target_untouched(
    tmp_path: Path, name: str
) -> None:
    target = tmp_path / "s"
    target.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (target / name).symlink_to(victim)
    text = refusal(target)
    assert str(target / name) in text and "symbolic link" in text
    assert victim.read_text() == "precious"


def test_a_worker_with_an_unusable_state_directory_fails_to_start(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=gl.Secret(b"x" * 32),
        listen=("127.0.0.1", 0),
        state_dir=tmp_path / "file",
    )

    async def main() -> None:
        async with gl.Worker(config, {}):
            raise AssertionError("started")

    with pytest.raises(gl.ConfigError, match="not a directory"):
        anyio.run(main)


# ---------------------------------------------------------------------------------- the writer


@pytest.mark.anyio
async def test_writes_commit_in_order_and_share_transactions(tmp_path: Path) -> None:
    state = await anyio.to_thread.run_sync(open_state_directory, tmp_path, "box")
    state.start()
    try:
        sql = "INSERT INTO meta (name, value) VALUES (?, ?)"
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(state.write, [(sql, (f"n{i}", str(i)))])
        await state.write([])  # a barrier
        stats = state.statistics()
        assert (stats.batches, stats.statements, stats.failed) == (201, 200, None)
        assert stats.transactions <= 200
        # A failing statement breaks the writer for good; nothing of its transaction stays.
        with pytest.raises(StateUnavailable, match="UNIQUE constraint"):
            await state.write([(sql, ("extra", "1")), (sql, ("n1", "again"))])
        with pytest.raises(StateUnavailable):
            await state.write([])
    finally:
        await state.aclose()
    db = sqlite3.connect(tmp_path / DATABASE_NAME)
    names = {name for (name,) in db.execute("SELECT name FROM meta")}
    db.close()
    assert len(names) == 202 and "extra" not in names  # with executor_id and state_id


# ---------------------------------------------------------------------------------- keyed calls


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(name: str) -> TableKey:
    return ("svc", "m", name.encode())


@asynccontextmanager
async def keyed_on_disk(
    path: Path, limits: gl.Limits = LIMITS, wall: Callable[[], float] | None = None
) -> AsyncIterator[tuple[KeyedExecutions, StateDirectory]]:
    def open_all() -> tuple[StateDirectory, DurableKeys]:
        state = open_state_directory(path, "box")
        return state, DurableKeys(state, limits, **({"wall": wall} if wall else {}))

    state, keys = await anyio.to_thread.run_sync(open_all)
    state.start()
    try:
        async with anyio.create_task_group() as tg:
            yield KeyedExecutions(limits, tg.start_soon, store=keys), state
            tg.cancel_scope.cancel()
    finally:
        await state.aclose()


def decode(reply: Reply) -> object:
    kind, body = reply
    value = cbor2.loads(body)
    return value if kind == RESULT else ("error", value["code"])


@pytest.mark.anyio
async def test_finished_calls_replay_and_running_ones_are_worker_restarted(tmp_path: Path) -> None:
    gate = anyio.Event()
    started: list[str] = []

    async def handler(name: str, hold: bool) -> Reply:
        started.append(name)
        if hold:
            await gate.wait()
        return RESULT, cbor2.dumps(f"result of {name}")

    async with keyed_on_disk(tmp_path) as (keyed, _):
        done = keyed.admit(key("done"), b"d" * 32)
        assert isinstance(done, Execute)
        keyed.start(done.entry, lambda: handler("done", False))
        assert decode(await keyed.wait(done.entry)) == "result of done"
        held = keyed.admit(key("held"), b"h" * 32)
        assert isinstance(held, Execute)
        keyed.start(held.entry, lambda: handler("held", True))
        while started != ["done", "held"]:
            await anyio.sleep(0.001)  # (bounded by the test's timeout)
        # The worker stops with "held" still running: its task is cancelled.
    assert started == ["done", "held"]
    async with keyed_on_disk(tmp_path) as (keyed, _):
        stats = keyed.statistics()
        assert (stats.restored, stats.interrupted, stats.entries) == (2, 1, 2)
        again = keyed.admit(key("done"), b"d" * 32)
        assert isinstance(again, Replay)
        assert decode(await keyed.wait(again.entry)) == "result of done"
        lost = keyed.admit(key("held"), b"h" * 32)
        assert isinstance(lost, Replay)
        assert decode(await keyed.wait(lost.entry)) == ("error", "WORKER_RESTARTED")
        assert keyed.admit(key("held"), b"x" * 32).__class__.__name__ == "Conflict"
        await keyed.flush()
    # WORKER_RESTARTED was recorded in the running row's place: it stays the answer.
    async with keyed_on_disk(tmp_path) as (keyed, _):
        assert keyed.statistics().interrupted == 0
        lost = keyed.admit(key("held"), b"h" * 32)
        assert isinstance(lost, Replay)
        assert decode(await keyed.wait(lost.entry)) == ("error", "WORKER_RESTARTED")
    assert started == ["done", "held"]  # nothing ran again


def rows(path: Path) -> list[tuple[bytes, str]]:
    db = sqlite3.connect(path / DATABASE_NAME)
    try:
        return sorted(db.execute("SELECT key, state FROM keyed_calls"))
    finally:
        db.close()


@pytest.mark.anyio
async def test_the_bounds_hold_on_disk_across_a_restart(tmp_path: Path) -> None:
    async def ok() -> Reply:
        return RESULT, cbor2.dumps(1)

    wall = Clock()
    async with keyed_on_disk(tmp_path, wall=wall) as (keyed, _):
        for i in range(5):
            decision = keyed.admit(key(f"k{i}"), b"d" * 32)
            assert isinstance(decision, Execute)
            keyed.start(decision.entry, ok)
            await keyed.wait(decision.entry)
            wall.now += 1
        await keyed.flush()
    assert len(rows(tmp_path)) == 5
    # Fewer entries allowed: only the newest finished stay, on disk too.
    small = LIMITS.replace(idempotency_max_entries=3)
    async with keyed_on_disk(tmp_path, small, wall=wall) as (keyed, _):
        assert keyed.statistics().entries == 3
        assert isinstance(keyed.admit(key("k4"), b"d" * 32), Replay)
        # k0 was forgotten: it runs again (and its entry evicts the oldest, k2).
        assert isinstance(keyed.admit(key("k0"), b"d" * 32), Execute)
        keyed.table.abandon(keyed.table.entries()[-1])
        await keyed.flush()
    assert [k for k, _ in rows(tmp_path)] == [b"k3", b"k4"]
    # Age counts on the wall clock across the restart: k3 finished at 1003, k4 at 1004.
    wall.now = 1003 + LIMITS.idempotency_max_age + 0.5
    async with keyed_on_disk(tmp_path, wall=wall) as (keyed, _):
        assert isinstance(keyed.admit(key("k4"), b"d" * 32), Replay)
        assert isinstance(keyed.admit(key("k3"), b"d" * 32), Execute)
        keyed.table.abandon(keyed.table.entries()[-1])
        await keyed.flush()
    assert [k for k, _ in rows(tmp_path)] == [b"k4"]


@pytest.mark.anyio
async def test_a_journal_that_cannot_be_written_refuses_the_call_unrun(tmp_path: Path) -> None:
    ran: list[bool] = []

    async def handler() -> Reply:
        ran.append(True)
        return RESULT, cbor2.dumps(1)

    async with keyed_on_disk(tmp_path) as (keyed, state):
        # Break the writer with a statement that fails (what a full disk would do).
        with pytest.raises(StateUnavailable):
            await state.write([("INSERT INTO nowhere VALUES (1)", ())])
        decision = keyed.admit(key("k"), b"d" * 32)
        assert isinstance(decision, Execute)
        keyed.start(decision.entry, handler)
        assert decode(await keyed.wait(decision.entry)) == ("error", "STATE_UNAVAILABLE")
        assert ran == [] and keyed.statistics().entries == 0
        assert not isinstance(keyed.admit(key("k"), b"d" * 32), Await | Replay)


@pytest.mark.anyio
async def test_a_call_refused_unrun_is_answered_to_a_waiter_that_comes_after(
    tmp_path: Path,
) -> None:
    """Once the writer has stopped, a keyed call is refused at once: its execution can end
    before the session's waiter asks for the reply, which must still be the refusal."""

    async def handler() -> Reply:
        raise AssertionError("ran")

    async with keyed_on_disk(tmp_path) as (keyed, state):
        with pytest.raises(StateUnavailable):
            await state.write([("INSERT INTO nowhere VALUES (1)", ())])
        decision = keyed.admit(key("k"), b"d" * 32)
        assert isinstance(decision, Execute)
        keyed.start(decision.entry, handler)
        for _ in range(100):  # let the execution end first
            if keyed.statistics().entries == 0:
                break
            await anyio.lowlevel.checkpoint()
        assert keyed.statistics().entries == 0
        with anyio.fail_after(5):
            assert decode(await keyed.wait(decision.entry)) == ("error", "STATE_UNAVAILABLE")


@pytest.mark.anyio
async def test_calls_refused_by_a_stopped_writer_log_one_line_per_interval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def handler() -> Reply:
        raise AssertionError("ran")

    async with keyed_on_disk(tmp_path) as (keyed, state):
        with pytest.raises(StateUnavailable):
            await state.write([("INSERT INTO nowhere VALUES (1)", ())])
        for i in range(20):
            decision = keyed.admit(key(f"k{i}"), b"d" * 32)
            assert isinstance(decision, Execute)
            keyed.start(decision.entry, handler)
            with anyio.fail_after(5):
                assert decode(await keyed.wait(decision.entry)) == ("error", "STATE_UNAVAILABLE")
    refused = [r for r in caplog.records if "keyed call refused, unrun" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.ERROR


# ---------------------------------------------------------------------------------- crashes


CRASH_CHILD = TESTS_DIR / "statedir_child.py"


def test_sigkill_during_journal_writes_never_reports_an_unfinished_call_finished(
    tmp_path: Path,
) -> None:
    """A child journals keyed calls as fast as it can (each handler appends ``start k`` and
    ``done k`` to a ledger around a random pause); it is SIGKILLed at a random moment, eight
    times. Each time the database opens, every row the child left says ``done`` only for a
    call whose handler wrote ``done``, and every handler that started has its row."""
    rng = random.Random(28)
    state_dir = tmp_path / "state"
    ledger = tmp_path / "ledger"
    for round_ in range(8):
        child = subprocess.Popen(
            [sys.executable, str(CRASH_CHILD), str(state_dir), str(ledger), str(round_)],
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"ready\n"  # bounded by the test's timeout
            subprocess.run(
                [sys.executable, "-c", f"import time; time.sleep({rng.uniform(0.02, 0.3)})"],
                check=True,
            )
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        state = open_state_directory(state_dir, "crash-box")  # always opens
        try:
            on_disk = dict(state.read("SELECT key, state FROM keyed_calls"))
            replies = dict(
                state.read("SELECT key, reply_kind FROM keyed_calls WHERE state = 'done'")
            )
        finally:
            state.close_now()
        events = [line.split() for line in ledger.read_text().splitlines() if line]
        started = {k for e, k in events if e == "start"}
        finished = {k for e, k in events if e == "done"}
        for raw, row_state in on_disk.items():
            name = raw.decode()
            if row_state == "done" and replies[raw] != ERROR:
                assert name in finished, f"round {round_}: {name} reported finished, never did"
        assert started <= {raw.decode() for raw in on_disk}, f"round {round_}: started unjournaled"


def test_every_test_the_durability_guide_cites_exists() -> None:
    guide = (TESTS_DIR.parent / "docs" / "guides" / "durability.md").read_text("utf-8")
    cited = 0
    for cell in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`((?:, `::\w+`)*)", guide):
        path, first, more = cell
        source = (TESTS_DIR.parent / path).read_text("utf-8")
        for name in (first, *re.findall(r"::(\w+)", more)):
            assert re.search(rf"def {name}\(", source), f"{path}::{name} is cited, not defined"
            cited += 1
    assert cited >= 10


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="POSIX file size limits")
def test_a_database_that_cannot_be_written_at_startup_names_free_space(tmp_path: Path) -> None:
    """A full disk, as a file size limit simulates it (writes past it fail): the worker says to
    free space, not to move the file away."""
    import resource

    from faultutil import write_configs

    worker_toml, _ = write_configs(tmp_path, port=0, limits={})

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "garcon_link",
            "worker",
            str(worker_toml),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        preexec_fn=small_files,  # only signal() and setrlimit() in the child
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert str(tmp_path / "state" / DATABASE_NAME) in lines[0] and "free space" in lines[0]


@pytest.mark.parametrize("case", ["not-a-directory", "not-a-database"])
def test_the_command_line_says_why_in_one_line(tmp_path: Path, case: str) -> None:
    from faultutil import write_configs

    worker_toml, _ = write_configs(tmp_path, port=0, limits={})
    target = tmp_path / "state"
    if case == "not-a-directory":
        target.write_text("x")
    else:
        target.mkdir()
        (target / DATABASE_NAME).write_bytes(b"\x01" * 4096)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "garcon_link",
            "worker",
            str(worker_toml),
            "--state-dir",
            str(target),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert ("not a directory" if case == "not-a-directory" else "file is not a database") in lines[
        0
    ]
