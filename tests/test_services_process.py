"""The built-in process service over real loopback sessions (worker + controller in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from servicesutil import LIMITS, SECRET, controller, linked, lone_worker

import garcon_link as gl
from garcon_link.rpc.statedir import open_state_directory
from garcon_link.services import (
    ExitStatus,
    FileService,
    LocalProcessService,
    ProcessService,
    ServiceLimits,
    TruncationMarker,
    builtin_services,
)
from garcon_link.testing import FaultProxy

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent
DEADLINE = 10.0  # a bound on a test's waits: a hang, not a result


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def until(predicate: object, timeout: float = 5.0) -> None:
    """Poll ``predicate()`` until true (a bounded wait for an external condition)."""
    assert callable(predicate)
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


async def read_until(
    proc: ProcessService, handle: gl.ResourceRef, needle: bytes, timeout: float = 10.0
) -> bytes:
    """Follow stdout until ``needle`` appears; returns what was read."""
    seen = b""
    with anyio.fail_after(timeout):
        stream = proc.output(handle)
        async for chunk in stream:
            if chunk.stream == "stdout":
                seen += chunk.data
                if needle in seen:
                    break
        await stream.aclose()  # type: ignore[attr-defined]
    return seen


async def test_run_reports_streams_in_order_and_exit_code(tmp_path: Path) -> None:
    script = "printf 'o1\\n'; printf 'e1\\n' >&2; printf 'o2\\n'; printf 'e2\\n' >&2; exit 7"
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            result = await proc.run(["sh", "-c", script])
            assert result.stdout == b"o1\no2\n"
            assert result.stderr == b"e1\ne2\n"
            assert result.status == ExitStatus(code=7, signal=None, timed_out=False, killed=False)
            assert not result.stdout_truncated and not result.stderr_truncated

            handle = await proc.start(["sh", "-c", script])
            assert handle.kind == "process"
            got: dict[str, bytes] = {"stdout": b"", "stderr": b""}
            ends: list[str] = []
            async for chunk in proc.output(handle):
                assert chunk.offset == len(got[chunk.stream])  # contiguous per stream
                assert chunk.truncated is None
                got[chunk.stream] += chunk.data
                if chunk.eof:
                    ends.append(chunk.stream)
            assert got == {"stdout": b"o1\no2\n", "stderr": b"e1\ne2\n"}
            assert sorted(ends) == ["stderr", "stdout"]
            status = await proc.wait(handle, timeout=10)
            assert status.code == 7 and status.signal is None and not status.killed
            info = await proc.info(handle)
            assert not info.running and info.status == status and info.pid > 0
            assert info.stdout_end == 6 and info.stderr_end == 6


async def test_stdin_is_ordered_idempotent_then_eof(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            handle = await proc.start(["cat"], stdin=True)
            assert await proc.write_stdin(handle, b"hello ", 0) == 6
            assert await proc.write_stdin(handle, b"hello ", 0) == 6  # replayed: ignored
            assert await proc.write_stdin(handle, b"lo world", 3) == 11  # overlap: tail only
            with pytest.raises(gl.Rejected) as gap:
                await proc.write_stdin(handle, b"!", 12)
            assert gap.value.code == "STDIN_GAP"
            await proc.close_stdin(handle)
            await proc.close_stdin(handle)  # idempotent
            status = await proc.wait(handle, timeout=10)
            assert status.code == 0
            chunk = await proc.read(handle, "stdout")
            assert chunk.data == b"hello world" and chunk.eof and chunk.offset == 0
            assert await proc.write_stdin(handle, b"world", 6) == 11  # a late replay: no-op
            with pytest.raises(gl.Rejected) as closed:
                await proc.write_stdin(handle, b"more", 11)
            assert closed.value.code == "STDIN_CLOSED"

            no_stdin = await proc.start(["true"])
            with pytest.raises(gl.Rejected) as none:
                await proc.write_stdin(no_stdin, b"x", 0)
            assert none.value.code == "NO_STDIN"

            result = await proc.run(["wc", "-c"], stdin_data=b"x" * 3_000_000)
            assert result.stdout.strip() == b"3000000"


async def test_terminate_kills_a_process_that_ignores_term(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            stubborn = await proc.start(
                ["sh", "-c", "trap '' TERM; echo ready; while :; do sleep 1; done"]
            )
            await read_until(proc, stubborn, b"ready")
            started = anyio.current_time()
            status = await proc.terminate(stubborn, grace=0.3)
            assert anyio.current_time() - started >= 0.3
            assert status.signal == "SIGKILL" and status.killed and status.code is None

            polite = await proc.start(["sleep", "60"])
            status = await proc.terminate(polite, grace=5)
            assert status.signal == "SIGTERM" and status.killed and not status.timed_out


async def test_start_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            handle = await proc.start(
                ["sh", "-c", "sleep 60 & echo $!; sleep 60 & echo $!; wait"], timeout=2.0
            )
            seen = await read_until(proc, handle, b"\n", timeout=10)
            while seen.count(b"\n") < 2:
                seen = (await proc.read(handle, "stdout")).data
                await anyio.sleep(0.02)
            children = [int(line) for line in seen.split()]
            leader = (await proc.info(handle)).pid
            assert all(alive(pid) for pid in [leader, *children])
            status = await proc.wait(handle, timeout=15)
            assert status.timed_out and status.killed and status.signal == "SIGKILL"
            await until(lambda: not any(alive(pid) for pid in [leader, *children]))


async def test_output_beyond_retention_reports_the_exact_dropped_range(tmp_path: Path) -> None:
    script = 'i=0; while [ $i -lt 100 ]; do printf "%049d\\n" $i; i=$((i+1)); done'
    expected = b"".join(b"%049d\n" % i for i in range(100))
    assert len(expected) == 5000
    with anyio.fail_after(30):
        async with linked(tmp_path, ServiceLimits(output_retention_bytes=1000)) as executor:
            proc = executor.service("process", ProcessService)
            handle = await proc.start(["sh", "-c", script])
            assert (await proc.wait(handle, timeout=10)).code == 0

            first = await proc.read(handle, "stdout", after=0, max_bytes=10_000)
            assert first.truncated == TruncationMarker(0, 4000)
            assert first.offset == 4000 and first.data == expected[4000:] and first.eof

            middle = await proc.read(handle, "stdout", after=3500, max_bytes=100)
            assert middle.truncated == TruncationMarker(3500, 4000)
            assert middle.data == expected[4000:4100] and not middle.eof

            retained = await proc.read(handle, "stdout", after=4500)
            assert retained.truncated is None and retained.data == expected[4500:]

            with pytest.raises(gl.Rejected) as beyond:
                await proc.read(handle, "stdout", after=5001)
            assert beyond.value.code == "INVALID_OFFSET"

            chunks = [c async for c in proc.output(handle)]
            stdout = [c for c in chunks if c.stream == "stdout"]
            assert stdout[0].truncated == TruncationMarker(0, 4000)
            assert b"".join(c.data for c in stdout) == expected[4000:]

            result = await proc.run(["sh", "-c", script], max_output=100)
            assert result.stdout == expected[-100:] and result.stdout_truncated


async def test_large_output_stream_accounts_for_every_byte(tmp_path: Path) -> None:
    total = 24_000_000
    with anyio.fail_after(60):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            handle = await proc.start(["head", "-c", str(total), "/dev/zero"])
            cursor = {"stdout": 0, "stderr": 0}
            async for chunk in proc.output(handle):
                if chunk.truncated is not None:
                    # Dropped bytes are reported exactly where the reader was.
                    assert chunk.truncated.start == cursor[chunk.stream]
                    assert chunk.truncated.end == chunk.offset
                else:
                    assert chunk.offset == cursor[chunk.stream]
                assert chunk.data == bytes(len(chunk.data))
                cursor[chunk.stream] = chunk.offset + len(chunk.data)
            assert cursor == {"stdout": total, "stderr": 0}
            assert (await proc.wait(handle, timeout=10)).code == 0


async def test_resumable_disconnect_loses_no_output(tmp_path: Path) -> None:
    script = 'i=0; while [ $i -lt 300 ]; do echo "line $i"; i=$((i+1)); sleep 0.005; done'
    expected = b"".join(b"line %d\n" % i for i in range(300))
    with anyio.fail_after(60):
        async with linked(tmp_path) as executor:
            history: list[str] = []
            executor.on_availability_changed(history.append)
            proc = executor.service("process", ProcessService)
            handle = await proc.start(["sh", "-c", script])
            stdout = b""
            cut = False
            async for chunk in proc.output(handle):
                assert chunk.truncated is None
                if chunk.stream == "stdout":
                    assert chunk.offset == len(stdout)
                    stdout += chunk.data
                    if not cut and chunk.data:
                        assert (await proc.info(handle)).running
                        await executor.link.disconnect()
                        cut = True
            assert cut and stdout == expected
            assert "reconnecting" in history and "offline" not in history
            assert (await proc.wait(handle, timeout=10)).code == 0


async def test_worker_restart_makes_old_handles_stale(tmp_path: Path) -> None:
    # The controller listens and the worker dials, so a restarted worker finds it again.
    controller_config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.CONTROLLER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    with anyio.fail_after(60):
        async with gl.connect(controller_config) as executor:
            worker_config = gl.LinkConfig(
                executor_id="box",
                role=gl.Role.WORKER,
                secret=SECRET,
                dial=executor.link.url,
                limits=LIMITS,
            )
            proc = executor.service("process", ProcessService)
            async with gl.Worker(worker_config, builtin_services(["process"], tmp_path)):
                await executor.wait_ready(10)
                first = (await executor.info()).instance_id
                handle = await proc.start(["sleep", "60"])
                pid = (await proc.info(handle)).pid
                assert alive(pid)
            # Stopping the worker retired the session: its processes were terminated.
            await until(lambda: not alive(pid))

            async with gl.Worker(worker_config, builtin_services(["process"], tmp_path)):
                with anyio.fail_after(15):
                    while True:
                        try:
                            if (await executor.info()).instance_id != first:
                                break
                        except gl.NotDispatched:
                            pass
                        await anyio.sleep(0.05)
                with pytest.raises(gl.StaleResource):
                    await proc.read(handle, "stdout")
                with pytest.raises(gl.StaleResource):
                    await proc.wait(handle)
                result = await proc.run(["echo", "fresh"])
                assert result.stdout == b"fresh\n"


async def test_cancelling_run_kills_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            outcome: list[str] = []

            async def call() -> None:
                try:
                    await proc.run(["sh", "-c", "sleep 60 & echo $! > pid; wait"], timeout=50)
                except anyio.get_cancelled_exc_class():
                    outcome.append("cancelled")
                    raise

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await until(lambda: pid_file.exists() and pid_file.read_text().strip() != "")
                child = int(pid_file.read_text())
                assert alive(child)
                tg.cancel_scope.cancel()
            assert outcome == ["cancelled"]
            await until(lambda: not alive(child))


async def test_process_limits_and_records(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path, ServiceLimits(max_processes=2)) as executor:
            proc = executor.service("process", ProcessService)
            first = await proc.start(["sleep", "60"])
            second = await proc.start(["sleep", "60"])
            with pytest.raises(gl.Rejected) as full:
                await proc.start(["true"])
            assert full.value.code == "TOO_MANY_PROCESSES"
            with pytest.raises(gl.Rejected) as running:
                await proc.release(second)
            assert running.value.code == "PROCESS_RUNNING"
            await proc.terminate(first, grace=1)
            third = await proc.start(["true"])  # evicts the finished record of ``first``
            with pytest.raises(gl.Rejected) as released:
                await proc.info(first)
            assert released.value.code == "PROCESS_RELEASED"
            assert (await proc.wait(third, timeout=10)).code == 0
            await proc.release(third)
            assert [p.handle for p in await proc.list_processes()] == [second]
            await proc.terminate(second, grace=1)


async def test_environment_is_clean_and_cwd_is_confined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GL_WORKER_SECRET_TOKEN", "must-not-leak")
    (tmp_path / "sub").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "sub").mkdir()
    (root / "escape").symlink_to(outside)
    with anyio.fail_after(30):
        async with linked(root) as executor:
            proc = executor.service("process", ProcessService)
            result = await proc.run(["env"], env={"FOO": "bar"})
            env = dict(
                line.split("=", 1) for line in result.stdout.decode().splitlines() if "=" in line
            )
            assert "GL_WORKER_SECRET_TOKEN" not in env
            assert env["FOO"] == "bar" and env["HOME"] == str(root.resolve())
            assert "PATH" in env

            result = await proc.run(["pwd"], cwd="/sub")
            assert result.stdout.decode().strip() == str((root / "sub").resolve())

            for cwd, code in [
                ("/../", "PERMISSION_DENIED"),
                ("/escape", "PERMISSION_DENIED"),
                ("sub", "INVALID_PATH"),
                ("/missing", "NOT_FOUND"),
            ]:
                with pytest.raises(gl.Rejected) as refused:
                    await proc.start(["pwd"], cwd=cwd)
                assert refused.value.code == code, cwd

            with pytest.raises(gl.Rejected) as missing:
                await proc.run(["/no/such/program"])
            assert missing.value.code == "SPAWN_FAILED"
            with pytest.raises(gl.Rejected) as empty:
                await proc.run([])
            assert empty.value.code == "INVALID_ARGUMENTS"


async def test_signal_wait_timeout_and_wrong_handles(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            files = executor.service("files", FileService)
            handle = await proc.start(["sleep", "60"])
            with pytest.raises(gl.RemoteError) as waited:
                await proc.wait(handle, timeout=0.1)
            assert waited.value.code == "WAIT_TIMEOUT"
            with pytest.raises(gl.Rejected) as bogus:
                await proc.signal(handle, "BOGUS")
            assert bogus.value.code == "INVALID_SIGNAL"
            assert await proc.signal(handle, "INT")
            status = await proc.wait(handle, timeout=10)
            assert status.signal == "SIGINT" and not status.killed
            assert not await proc.signal(handle, "TERM")  # the group is gone

            upload = await files.begin_upload("/x")
            with pytest.raises(gl.Rejected) as kind:
                await proc.read(upload, "stdout")
            assert kind.value.code == "WRONG_RESOURCE_KIND"
            await files.abort_upload(upload)


async def test_local_use_without_a_link(tmp_path: Path) -> None:
    scope = gl.ServiceScope("local", os.urandom(16))
    async with LocalProcessService(tmp_path, scope=scope) as proc:
        handle = await proc.start(["sh", "-c", "echo out; exec sleep 60"])
        await read_until(proc, handle, b"out")
        pid = (await proc.info(handle)).pid
    # Closing the service terminated what it started.
    assert not alive(pid)


def test_builtin_services_validates_its_arguments(tmp_path: Path) -> None:
    with pytest.raises(gl.ConfigError):
        builtin_services(["process", "shell"], tmp_path)
    with pytest.raises(gl.ConfigError):
        builtin_services([], tmp_path)
    with pytest.raises(gl.ConfigError):
        builtin_services(["files"], tmp_path / "missing")
    with pytest.raises(gl.ConfigError):
        ServiceLimits(max_processes=0)
    assert callable(builtin_services(["process,files"], tmp_path))


@pytest.mark.slow
def test_device_executor_example_runs(tmp_path: Path) -> None:
    example = REPO / "examples" / "device_executor" / "run.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "example-ok" in done.stdout


# ----------------------------------------------- durable processes (docs/design.md#processes)


async def test_start_by_id_is_idempotent_and_a_different_spec_conflicts(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            proc = executor.service("process", ProcessService)
            first = await proc.start(id="job-1", argv=["sleep", "60"])
            assert first.id == "job-1"
            again = await proc.start(["sleep", "60"], id="job-1")
            assert again == first
            with pytest.raises(gl.Rejected) as conflict:
                await proc.start(id="job-1", argv=["sleep", "61"])
            assert conflict.value.code == "CONFLICT"
            with pytest.raises(gl.Rejected) as conflict:
                await proc.start(id="job-1", argv=["sleep", "60"], env={"A": "1"})
            assert conflict.value.code == "CONFLICT"
            records = await proc.list()
            assert [(r.id, r.running) for r in records] == [("job-1", True)]
            status = await proc.terminate(first, grace=1)
            # An exited record still answers its id: the same spec returns it, unstarted.
            assert await proc.start(id="job-1", argv=["sleep", "60"]) == first
            (record,) = await proc.list()
            assert not record.running and record.status == status and record.exited_at
            assert await proc.list_processes() == [record]
            await proc.release(first)
            assert await proc.list() == []

            # Hostile ids, specs and offsets are refused before anything is started.
            for bad in ["", "x" * 129, "a/b", "-lead", "p7", "ünï", "a b", "a\0b"]:
                with pytest.raises(gl.Rejected) as refused:
                    await proc.start(id=bad, argv=["true"])
                assert refused.value.code == "INVALID_ARGUMENTS", bad
            with pytest.raises(gl.Rejected) as big:
                await proc.start(id="big", argv=["true", "x" * 70_000])
            assert big.value.code == "INVALID_ARGUMENTS"
            with pytest.raises(gl.Rejected) as big:
                await proc.start(["true"], env={f"V{i}": "y" * 1000 for i in range(70)})
            assert big.value.code == "INVALID_ARGUMENTS"
            done = await proc.start(id="echo", argv=["echo", "hi"])
            await proc.wait(done, timeout=10)
            for after in (-1, 4, 2**62):
                with pytest.raises(gl.Rejected) as offset:
                    await proc.read(done, "stdout", after=after)
                assert offset.value.code == "INVALID_OFFSET", after
            with pytest.raises(gl.Rejected) as offset:
                await proc.output(done, after_stdout=-5).__anext__()
            assert offset.value.code == "INVALID_OFFSET"
            assert (await proc.read(done, "stdout", after=0, max_bytes=2**62)).data == b"hi\n"
            assert await proc.list() == [await proc.info(done)]


async def test_exited_records_are_bounded_by_count(tmp_path: Path) -> None:
    limits = ServiceLimits(max_exited_processes=2)
    with anyio.fail_after(30):
        async with linked(tmp_path, limits) as executor:
            proc = executor.service("process", ProcessService)
            handles = []
            for i in range(4):
                handles.append(await proc.start(id=f"t{i}", argv=["true"]))
                await proc.wait(handles[-1], timeout=10)
            assert [r.id for r in await proc.list()] == ["t2", "t3"]
            with pytest.raises(gl.Rejected) as gone:
                await proc.info(handles[0])
            assert gone.value.code == "UNKNOWN_PROCESS"


async def test_exited_records_expire(tmp_path: Path) -> None:
    limits = ServiceLimits(exited_process_ttl=0.05)
    with anyio.fail_after(30):
        async with linked(tmp_path, limits) as executor:
            proc = executor.service("process", ProcessService)
            handle = await proc.start(id="brief", argv=["true"])
            await proc.wait(handle, timeout=10)
            while await proc.list():  # evicted once the TTL passed (a bounded wait)
                await anyio.sleep(0.02)
            # The id is free again: the same start runs a second time.
            again = await proc.start(id="brief", argv=["true"])
            assert (await proc.wait(again, timeout=10)).code == 0


@pytest.mark.parametrize("spool", ["memory", "disk"])
async def test_output_made_while_no_controller_is_attached_is_read_by_offset(
    tmp_path: Path, spool: str
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    spool_dir = tmp_path / "spool" if spool == "disk" else None
    if spool_dir is not None:
        spool_dir.mkdir()
    # 1000 bytes kept per stream: the 5000 bytes of "big" overflow it, "small" fits.
    limits = ServiceLimits(output_retention_bytes=1000, disk_spool_bytes=1000)
    big_script = (
        "while [ ! -e go ]; do sleep 0.01; done; "
        'i=0; while [ $i -lt 100 ]; do printf "%049d\\n" $i; i=$((i+1)); done; '
        "printf err >&2; touch big-done"
    )
    big_expected = b"".join(b"%049d\n" % i for i in range(100))
    small_script = "while [ ! -e go ]; do sleep 0.01; done; seq 1 100; touch small-done"
    small_expected = b"".join(b"%d\n" % i for i in range(1, 101))
    with anyio.fail_after(60):
        async with lone_worker(root, limits, spool_dir) as worker:
            async with controller(worker.url) as first:
                proc = first.service("process", ProcessService)
                big = await proc.start(id="big", argv=["sh", "-c", big_script])
                small = await proc.start(id="small", argv=["sh", "-c", small_script])
            # No controller now: let both produce everything and exit.
            (root / "go").touch()
            await until(lambda: (root / "big-done").exists() and (root / "small-done").exists())
            async with controller(worker.url) as second:
                proc = second.service("process", ProcessService)
                # Reconcile: the records are there by id, with exit status and output sizes.
                with anyio.fail_after(10):
                    while any(r.running or r.status is None for r in await proc.list()):
                        await anyio.sleep(0.02)
                records = {r.id: r for r in await proc.list()}
                assert set(records) == {"big", "small"}
                assert records["big"].status == ExitStatus(0, None, False, False)
                assert records["big"].stdout_end == 5000 and records["big"].stderr_end == 3
                assert records["big"].stdout_start == 4000  # exactly what overflowed
                assert records["small"].stdout_end == len(small_expected)
                assert records["small"].stdout_start == 0
                # The handles of the first controller are still valid (worker-scoped).
                assert records["big"].handle == big and records["small"].handle == small

                # Everything that fits is readable by offset, piece by piece.
                data, cursor = b"", 0
                while True:
                    chunk = await proc.read(small, "stdout", after=cursor, max_bytes=37)
                    assert chunk.truncated is None and chunk.offset == cursor
                    data += chunk.data
                    cursor += len(chunk.data)
                    if chunk.eof:
                        break
                assert data == small_expected
                # What overflowed is an exact range, then the rest follows.
                head = await proc.read(big, "stdout", after=0, max_bytes=10_000)
                assert head.truncated == TruncationMarker(0, 4000)
                assert head.offset == 4000 and head.data == big_expected[4000:] and head.eof
                mid = await proc.read(big, "stdout", after=4100, max_bytes=300)
                assert mid.truncated is None and mid.data == big_expected[4100:4400]
                err = await proc.read(big, "stderr")
                assert err.data == b"err" and err.eof
                chunks = [c async for c in proc.output(big)]
                out = [c for c in chunks if c.stream == "stdout"]
                assert out[0].truncated == TruncationMarker(0, 4000)
                assert b"".join(c.data for c in out) == big_expected[4000:]
                if spool_dir is not None:  # on disk, in whole segments of 250 bytes
                    assert sorted(p.name.split(".", 1)[1] for p in spool_dir.rglob("*.stdout.*"))
                # The same id and spec again returns the exited record: nothing runs twice.
                assert await proc.start(id="small", argv=["sh", "-c", small_script]) == small
                assert (await proc.info(small)).stdout_end == len(small_expected)
        if spool_dir is not None:
            assert list(spool_dir.iterdir()) == []  # the worker stopped: its spool is gone


async def test_a_start_whose_reply_was_lost_is_found_again_by_its_id(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    argv = ["sh", "-c", "echo ran >> ledger; exec sleep 60"]
    with anyio.fail_after(60):
        async with lone_worker(tmp_path) as worker:
            port = worker.link.listen_address[1]
            async with (
                FaultProxy("127.0.0.1", port) as proxy,
                controller(proxy.url("/executor")) as executor,
            ):
                proc = executor.service("process", ProcessService)
                assert await proc.list() == []  # a round trip: the link is quiet now
                # The request reaches the worker; the first byte back cuts the socket, and
                # no new one gets through until the grace retires the session.
                proxy.refuse()
                proxy.cut_after(0, "down")
                with pytest.raises(gl.OutcomeUnknown) as lost:
                    await proc.start(id="deploy-7", argv=argv)
                assert lost.value.code == "CONTINUITY_LOST"
                assert executor.availability == "offline"
                await until(ledger.exists)  # the lost call did start it
                assert proxy.statistics().cuts == 1
                proxy.heal()
                await executor.wait_ready(10)
                # The retry finds the process the lost call started: it ran once.
                handle = await proc.start(id="deploy-7", argv=argv)
                info = await proc.info(handle)
                assert info.running and info.id == "deploy-7"
                assert ledger.read_text() == "ran\n"
                assert [r.id for r in await proc.list()] == ["deploy-7"]
                await proc.terminate(handle, grace=1)
                assert ledger.read_text() == "ran\n"


# ---------------------------------------------------------------------------------- state directory


async def test_a_worker_restarted_on_its_state_directory_reports_its_processes(
    tmp_path: Path,
) -> None:
    """SIGKILL a worker (``--builtin process --state-dir``) that started three processes, kill
    one of them while it is down, restart it on the directory: the exited one is reported with
    its status, the killed one ``lost`` (exit unknown), the surviving one ``detached`` (same
    pid and start time; no output) -- which can be terminated; the same start by id starts
    nothing."""
    from faultutil import TESTS_DIR, controller_config, write_configs

    from garcon_link.testing import WorkerProcess, free_tcp_port

    root = tmp_path / "root"
    root.mkdir()
    worker_toml, _ = write_configs(tmp_path, port=free_tcp_port(), limits={})
    args = ("--builtin", "process", "--root", str(root), "--state-dir", str(tmp_path / "state"))
    pids: list[int] = []
    try:
        with anyio.fail_after(60):
            async with WorkerProcess(worker_toml, cwd=TESTS_DIR, args=args) as worker:
                await worker.start()
                # Redial at once when the worker is back (the default backoff may wait longer
                # than the test waits on a loaded machine).
                limits = gl.Limits(backoff_base=0.01, backoff_max=0.2, connect_timeout=2.0)
                config = controller_config(limits, worker.url)
                async with gl.connect(config) as executor:
                    await executor.wait_ready(10)
                    proc = executor.service("process", ProcessService)
                    quick = await proc.start(id="quick", argv=["sh", "-c", "exit 3"])
                    assert (await proc.wait(quick, timeout=10)).code == 3
                    for name in ("sleeper", "doomed"):
                        handle = await proc.start(id=name, argv=["sleep", "60"])
                        pids.append((await proc.info(handle)).pid)
                    await until(lambda: all(alive(pid) for pid in pids))
                    worker.kill()
                    assert await worker.wait() < 0
                    os.kill(pids[1], 9)  # dies while no worker watches it
                    await until(lambda: not alive(pids[1]))
                    assert alive(pids[0])
                    await worker.restart()
                    await executor.wait_ready(20)
                    records = {r.id: r for r in await proc.list()}
                    assert set(records) == {"quick", "sleeper", "doomed"}
                    assert (records["quick"].state, records["quick"].status) == (
                        "exited",
                        gl_exit(3),
                    )
                    sleeper, doomed = records["sleeper"], records["doomed"]
                    assert (sleeper.state, sleeper.running, sleeper.pid) == (
                        "detached",
                        True,
                        pids[0],
                    )
                    assert (doomed.state, doomed.running, doomed.status) == ("lost", False, None)
                    # The same start by id starts nothing; another spec conflicts.
                    again = await proc.start(id="sleeper", argv=["sleep", "60"])
                    assert (await proc.info(again)).pid == pids[0]
                    with pytest.raises(gl.Rejected, match="another spec"):
                        await proc.start(id="sleeper", argv=["sleep", "61"])
                    with pytest.raises(gl.Rejected) as info:
                        await proc.read(sleeper.handle, "stdout")
                    assert info.value.code == "PROCESS_DETACHED"
                    with pytest.raises(gl.Rejected) as info:
                        await proc.wait(doomed.handle, timeout=1)
                    assert info.value.code == "PROCESS_LOST"
                    status = await proc.terminate(sleeper.handle, grace=5)
                    assert status.killed and status.code is None
                    assert not alive(pids[0])
                    await proc.release(doomed.handle)
                    assert {r.id for r in await proc.list()} == {"quick", "sleeper"}
                    # What this worker learnt is kept in turn: killed again, restarted again.
                    worker.kill()
                    assert await worker.wait() < 0
                    await worker.restart()
                    await executor.wait_ready(20)
                    records = {r.id: r for r in await proc.list()}
                    assert set(records) == {"quick", "sleeper"}
                    assert records["sleeper"].state == "exited"
                    assert records["sleeper"].status == ExitStatus(None, None, False, True)
                    assert records["quick"].status == gl_exit(3)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, 9)


def gl_exit(code: int) -> ExitStatus:
    return ExitStatus(code, None, False, False)


async def test_a_closed_service_is_freed_by_its_reference_count_alone(tmp_path: Path) -> None:
    """The service and its parts (its table of records, its ledger of the state directory, the
    supervisors) make no reference cycle: a service that started, ran, restored and closed is
    freed the moment its last reference goes, not at a later pass of the cycle collector."""
    import gc
    import weakref

    state = await anyio.to_thread.run_sync(open_state_directory, tmp_path / "state", "box")
    state.start()
    scope = gl.ServiceScope("local", os.urandom(16))
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with anyio.fail_after(DEADLINE):
            service = LocalProcessService(tmp_path, scope=scope, state=state)
            async with service:
                handle = await service.start(["sh", "-c", "echo out"], id="one")
                assert (await service.wait(handle, timeout=DEADLINE)).code == 0
                assert (await service.run(["echo", "hi"])).stdout == b"hi\n"
                running = await service.start(["sleep", "60"])
                assert [info.id for info in await service.list()] == ["one", running.id]
            freed = weakref.ref(service)
            del service
            await anyio.wait_all_tasks_blocked()
            assert freed() is None, gc.get_referrers(freed())
    finally:
        if collecting:
            gc.enable()
        await state.aclose()
