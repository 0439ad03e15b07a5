"""The built-in file service over real loopback sessions (worker + controller in-process)."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import blake3
import pytest
from servicesutil import controller, linked, lone_worker

import garcon_link as gl
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.services import (
    ConfinedRoot,
    FileService,
    LocalFileService,
    ServiceLimits,
    UploadStatus,
)
from garcon_link.testing import FaultProxy

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """``root`` (served) and ``outside`` (a sibling holding a secret file)."""
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"top secret")
    (root / "inside").mkdir()
    (root / "inside" / "file.txt").write_bytes(b"inside data")
    return root, outside


def staged_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".gl-"))


async def expect_refused(call: object, code: str = "PERMISSION_DENIED") -> None:
    assert hasattr(call, "__await__")
    with pytest.raises(gl.Rejected) as refused:
        await call
    assert refused.value.code == code, refused.value


async def test_confinement_refuses_dotdot_relative_and_outside_paths(
    layout: tuple[Path, Path],
) -> None:
    root, outside = layout
    with anyio.fail_after(30):
        async with linked(root) as executor:
            files = executor.service("files", FileService)
            await expect_refused(files.read("/../outside/secret.txt"))
            await expect_refused(files.read("/inside/../../outside/secret.txt"))
            await expect_refused(files.stat("/inside/.."))
            await expect_refused(files.write("/../evil.txt", b"x"))
            await expect_refused(files.read("inside/file.txt"), "INVALID_PATH")
            # An absolute path names a path below the root ("/" is the root), never the host's.
            await expect_refused(files.read(str(outside / "secret.txt")), "NOT_FOUND")
            await expect_refused(files.read("/etc/passwd"), "NOT_FOUND")
            await expect_refused(files.remove("/"))
            await expect_refused(files.rename("/inside", "/"))
            assert await files.canonical_path("/inside/./file.txt") == "/inside/file.txt"
            assert (await files.read("//inside//file.txt")).data == b"inside data"
    assert not (root.parent / "evil.txt").exists()


async def test_symlink_escapes_are_refused(layout: tuple[Path, Path]) -> None:
    root, outside = layout
    (root / "file-escape").symlink_to(outside / "secret.txt")
    (root / "dir-escape").symlink_to(outside)
    (root / "abs-inside").symlink_to(root / "inside" / "file.txt")
    (root / "rel-inside").symlink_to("inside/file.txt")
    (root / "dangling-escape").symlink_to(outside / "new.txt")
    with anyio.fail_after(30):
        async with linked(root) as executor:
            files = executor.service("files", FileService)
            # Files.
            await expect_refused(files.read("/file-escape"))
            await expect_refused(files.stat("/file-escape"))
            await expect_refused(files.exists("/file-escape"))
            await expect_refused(files.write("/file-escape", b"overwritten"))
            await expect_refused(files.write("/dangling-escape", b"created"))
            await expect_refused(files.read_link("/file-escape"))
            # Directories.
            await expect_refused(files.list_dir("/dir-escape"))
            await expect_refused(files.read("/dir-escape/secret.txt"))
            await expect_refused(files.write("/dir-escape/new.txt", b"x"))
            await expect_refused(files.mkdir("/dir-escape/sub", parents=True))
            await expect_refused(files.begin_upload("/dir-escape/big.bin"))
            await expect_refused(files.rename("/inside/file.txt", "/dir-escape/stolen.txt"))
            # Links that stay inside are followed.
            assert (await files.read("/abs-inside")).data == b"inside data"
            assert (await files.read("/rel-inside")).data == b"inside data"
            assert (await files.stat("/rel-inside")).path == "/inside/file.txt"
            assert await files.read_link("/rel-inside") == "inside/file.txt"
            assert await files.read_link("/abs-inside") == "/inside/file.txt"
            listing = {e.name: e.kind for e in (await files.list_dir("/")).entries}
            assert listing["dir-escape"] == "symlink" and listing["inside"] == "dir"
            # Removing an escaping link removes the link, not its target.
            await files.remove("/file-escape")
            assert (outside / "secret.txt").read_bytes() == b"top secret"

            # A symlink swapped in between calls: the second call is refused.
            (root / "swap").symlink_to("inside")
            assert (await files.read("/swap/file.txt")).data == b"inside data"
            (root / "swap").unlink()
            (root / "swap").symlink_to(outside)
            await expect_refused(files.read("/swap/secret.txt"))
            await expect_refused(files.write("/swap/secret.txt", b"pwned"))
    assert (outside / "secret.txt").read_bytes() == b"top secret"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_a_symlink_swapped_in_after_the_check_is_refused_at_use(
    layout: tuple[Path, Path],
) -> None:
    root, outside = layout
    confined = ConfinedRoot(root)
    parts = confined.resolve("/inside/file.txt")
    assert parts == ("inside", "file.txt")
    # Between the check (resolve) and the use (open_dir), "inside" becomes an escaping link.
    (root / "inside").rename(root / "moved")
    (root / "inside").symlink_to(outside)
    with pytest.raises(gl.Rejected) as refused:
        confined.open_dir(parts[:-1], "/inside/file.txt")
    assert refused.value.code == "PERMISSION_DENIED"


async def test_write_with_a_wrong_digest_leaves_the_old_file(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            files = executor.service("files", FileService)
            old = await files.write("/doc.txt", b"version 1")
            new_data = b"version 2"
            for kwargs in (
                {"expected_sha256": hashlib.sha256(b"other").hexdigest()},
                {"expected_blake3": blake3.blake3(b"other").hexdigest()},
            ):
                with pytest.raises(gl.Rejected) as mismatch:
                    await files.write("/doc.txt", new_data, **kwargs)  # type: ignore[arg-type]
                assert mismatch.value.code == "DIGEST_MISMATCH"
            assert (tmp_path / "doc.txt").read_bytes() == b"version 1"
            assert (await files.stat("/doc.txt")).version == old.version
            assert staged_files(tmp_path) == []
            new = await files.write(
                "/doc.txt",
                new_data,
                expected_sha256=hashlib.sha256(new_data).hexdigest().upper(),
                expected_blake3=blake3.blake3(new_data).hexdigest(),
                mode=0o600,
            )
            assert new.size == 9 and new.mode == 0o600 and new.version != old.version
            assert (tmp_path / "doc.txt").read_bytes() == new_data
            with pytest.raises(gl.Rejected) as bad:
                await files.write("/doc.txt", b"x", expected_sha256="zz")
            assert bad.value.code == "INVALID_ARGUMENTS"


async def test_concurrent_exclusive_creates_have_exactly_one_winner(tmp_path: Path) -> None:
    results: dict[int, str] = {}
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            files = executor.service("files", FileService)

            async def create(i: int) -> None:
                try:
                    await files.write("/lock", b"owner %d" % i, exclusive=True)
                    results[i] = "won"
                except gl.Rejected as exc:
                    results[i] = exc.code

            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(create, i)
    winners = [i for i, r in results.items() if r == "won"]
    assert len(winners) == 1
    assert sorted(r for r in results.values() if r != "won") == ["ALREADY_EXISTS"] * 19
    assert (tmp_path / "lock").read_bytes() == b"owner %d" % winners[0]
    assert staged_files(tmp_path) == []


async def test_if_match_refuses_a_stale_version(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            files = executor.service("files", FileService)
            with pytest.raises(gl.Rejected) as missing:
                await files.write("/cfg", b"x", if_match="0-0-0-0")
            assert missing.value.code == "VERSION_MISMATCH"
            first = await files.write("/cfg", b"a = 1\n")
            second = await files.write("/cfg", b"a = 2\n", if_match=first.version)
            with pytest.raises(gl.Rejected) as stale:
                await files.write("/cfg", b"a = 3\n", if_match=first.version)
            assert stale.value.code == "VERSION_MISMATCH"
            assert (tmp_path / "cfg").read_bytes() == b"a = 2\n"
            # A change made outside the service changes the version too.
            with (tmp_path / "cfg").open("ab") as f:
                f.write(b"b = 1\n")
            with pytest.raises(gl.Rejected):
                await files.write("/cfg", b"a = 4\n", if_match=second.version)
            current = await files.stat("/cfg")
            await files.write("/cfg", b"a = 4\n", if_match=current.version)
            with pytest.raises(gl.Rejected) as both:
                await files.write("/cfg", b"x", if_match=current.version, exclusive=True)
            assert both.value.code == "INVALID_ARGUMENTS"
            assert staged_files(tmp_path) == []


def chunk_of(i: int, size: int = MiB) -> bytes:
    """Deterministic pseudo-random chunk ``i`` (never the whole file in memory)."""
    return blake3.blake3(i.to_bytes(8, "big")).digest(length=size)


async def test_a_100_mib_file_round_trips_with_bounded_memory(tmp_path: Path) -> None:
    chunks = 100
    with anyio.fail_after(120):
        async with linked(tmp_path) as executor:
            files = executor.service("files", FileService)
            tracemalloc.start()
            try:
                baseline = tracemalloc.get_traced_memory()[0]
                tracemalloc.reset_peak()
                sha = hashlib.sha256()
                handle = await files.begin_upload("/big.bin", size=chunks * MiB)
                for i in range(chunks):
                    data = chunk_of(i)
                    sha.update(data)
                    assert await files.upload_chunk(handle, i * MiB, data) == (i + 1) * MiB
                    if i == 10:  # a replayed chunk is ignored, a gap is refused
                        assert await files.upload_chunk(handle, i * MiB, data) == (i + 1) * MiB
                        with pytest.raises(gl.Rejected) as gap:
                            await files.upload_chunk(handle, (i + 2) * MiB, data)
                        assert gap.value.code == "UPLOAD_GAP"
                    del data
                stat = await files.commit_upload(handle, expected_sha256=sha.hexdigest())
                assert stat.size == chunks * MiB
                upload_peak = tracemalloc.get_traced_memory()[1] - baseline

                tracemalloc.reset_peak()
                down = hashlib.sha256()
                received = 0
                async for piece in files.read_stream("/big.bin", chunk_size=256 * 1024):
                    down.update(piece)
                    received += len(piece)
                download_peak = tracemalloc.get_traced_memory()[1] - baseline
            finally:
                tracemalloc.stop()
    assert received == chunks * MiB and down.hexdigest() == sha.hexdigest()
    assert (tmp_path / "big.bin").stat().st_size == chunks * MiB
    assert upload_peak < 48 * MiB, upload_peak
    assert download_peak < 48 * MiB, download_peak
    assert staged_files(tmp_path) == []


async def test_upload_failures_leave_the_destination(tmp_path: Path) -> None:
    (tmp_path / "target").write_bytes(b"original")
    with anyio.fail_after(30):
        async with linked(tmp_path, ServiceLimits(max_uploads=1)) as executor:
            files = executor.service("files", FileService)
            handle = await files.begin_upload("/target", size=6)
            with pytest.raises(gl.Rejected) as busy:
                await files.begin_upload("/other")
            assert busy.value.code == "TOO_MANY_UPLOADS"
            await files.upload_chunk(handle, 0, b"abc")
            with pytest.raises(gl.Rejected) as too_big:
                await files.upload_chunk(handle, 3, b"defg")
            assert too_big.value.code == "SIZE_MISMATCH"
            await files.upload_chunk(handle, 3, b"def")
            with pytest.raises(gl.Rejected) as mismatch:
                await files.commit_upload(handle, expected_blake3=blake3.blake3(b"x").hexdigest())
            assert mismatch.value.code == "DIGEST_MISMATCH"
            assert (tmp_path / "target").read_bytes() == b"original"
            assert staged_files(tmp_path) == []
            with pytest.raises(gl.Rejected) as gone:
                await files.upload_chunk(handle, 6, b"")
            assert gone.value.code == "UNKNOWN_UPLOAD"
            await files.abort_upload(handle)  # idempotent

            exclusive = await files.begin_upload("/fresh", exclusive=True)
            await files.upload_chunk(exclusive, 0, b"new")
            (tmp_path / "fresh").write_bytes(b"someone else")
            with pytest.raises(gl.Rejected) as taken:
                await files.commit_upload(exclusive)
            assert taken.value.code == "ALREADY_EXISTS"
            assert (tmp_path / "fresh").read_bytes() == b"someone else"

            unfinished = await files.begin_upload("/later")
            await files.upload_chunk(unfinished, 0, b"partial")
            assert len(staged_files(tmp_path)) == 1
    # The worker stopped: its unfinished upload was discarded.
    assert staged_files(tmp_path) == [] and not (tmp_path / "later").exists()


async def test_directory_operations(tmp_path: Path) -> None:
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            files = executor.service("files", FileService)
            made = await files.mkdir("/a/b/c", parents=True)
            assert made.kind == "dir" and made.path == "/a/b/c"
            await files.mkdir("/a/b/c", parents=True)  # like mkdir -p
            with pytest.raises(gl.Rejected) as exists:
                await files.mkdir("/a/b/c")
            assert exists.value.code == "ALREADY_EXISTS"
            with pytest.raises(gl.Rejected) as no_parent:
                await files.mkdir("/x/y")
            assert no_parent.value.code == "NOT_FOUND"

            names = [f"f{i:02d}" for i in range(25)]
            for name in reversed(names):
                await files.write(f"/a/{name}", name.encode())
            seen: list[str] = []
            after = None
            while True:
                page = await files.list_dir("/a", after=after, limit=10)
                seen += [e.name for e in page.entries]
                if page.next_after is None:
                    break
                after = page.next_after
            assert seen == ["b", *names]

            chunk = await files.read("/a/f03", offset=1, max_bytes=1)
            assert chunk.data == b"0" and not chunk.eof and chunk.size == 3
            tail = await files.read("/a/f03", offset=2)
            assert tail.data == b"3" and tail.eof and tail.version == chunk.version
            assert (await files.read("/a/f03", offset=10)).data == b""

            assert await files.exists("/a/f01") and not await files.exists("/a/nope")
            assert not await files.exists("/a/f01/under-a-file")
            moved = await files.rename("/a/f01", "/a/b/moved")
            assert moved.path == "/a/b/moved" and not await files.exists("/a/f01")
            with pytest.raises(gl.Rejected) as not_empty:
                await files.remove("/a")
            assert not_empty.value.code == "DIRECTORY_NOT_EMPTY"
            with pytest.raises(gl.Rejected) as is_dir:
                await files.read("/a")
            assert is_dir.value.code == "IS_A_DIRECTORY"
            with pytest.raises(gl.Rejected) as not_link:
                await files.read_link("/a/f02")
            assert not_link.value.code == "NOT_A_SYMLINK"
            await files.remove("/a", recursive=True)
            assert not (tmp_path / "a").exists()
            assert (await files.stat("/")).kind == "dir"
            with pytest.raises(gl.Rejected) as missing:
                async for _ in files.read_stream("/missing"):
                    pass
            assert missing.value.code == "NOT_FOUND"


async def test_local_use_and_stale_handles(tmp_path: Path) -> None:
    scope = gl.ServiceScope("local", os.urandom(16))
    other = gl.ServiceScope("local", os.urandom(16))
    async with LocalFileService(tmp_path, scope=scope) as files:
        handle = await files.begin_upload("/f")
        forged = other.resource("upload", handle.id)
        with pytest.raises(gl.StaleResource):
            await files.upload_chunk(forged, 0, b"x")
        await files.upload_chunk(handle, 0, b"x")
        assert (await files.commit_upload(handle)).size == 1
    assert (tmp_path / "f").read_bytes() == b"x"


# --------------------------------------------------------------------------- hostile input

LONG_PATH = "/" + "a/" * (1024 * 1024)  # 2 MiB: resolving it took minutes of CPU in a thread


async def test_a_2_mib_path_is_refused_at_once_and_holds_up_no_one(tmp_path: Path) -> None:
    """Break 6: the bounds are checked before any resolution (~0.1 s here on 2 cores)."""
    (tmp_path / "small.txt").write_bytes(b"small")
    with anyio.fail_after(30):
        async with linked(tmp_path) as executor:
            files = executor.service("files", FileService)
            small_latencies: list[float] = []
            refused: list[gl.Rejected] = []

            async def hostile() -> None:
                with pytest.raises(gl.Rejected) as info:
                    await files.stat(LONG_PATH)
                refused.append(info.value)

            async def small() -> None:
                for _ in range(5):
                    started = anyio.current_time()
                    assert (await files.stat("/small.txt")).size == 5
                    small_latencies.append(anyio.current_time() - started)

            with anyio.fail_after(10):  # before the fix: minutes (the 2 MiB path was resolved)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(hostile)
                    tg.start_soon(small)
            assert refused[0].code == "INVALID_PATH", refused[0]
            assert "4096 bytes" in refused[0].message
            assert len(str(refused[0])) < 500  # the path is not echoed back
            assert max(small_latencies) < 2.0, small_latencies  # upper bound, not a measure


def _path_calls(svc: LocalFileService, path: str) -> dict[str, Callable[[], Awaitable[object]]]:
    """One call per method that takes a path, with ``path`` in it."""

    async def stream() -> None:
        async for _ in svc.read_stream(path):
            pass

    return {
        "stat": lambda: svc.stat(path),
        "exists": lambda: svc.exists(path),
        "canonical_path": lambda: svc.canonical_path(path),
        "read_link": lambda: svc.read_link(path),
        "list_dir": lambda: svc.list_dir(path),
        "read": lambda: svc.read(path),
        "read_stream": stream,
        "mkdir": lambda: svc.mkdir(path, parents=True),
        "remove": lambda: svc.remove(path),
        "rename src": lambda: svc.rename(path, "/ok"),
        "rename dst": lambda: svc.rename("/ok", path),
        "write": lambda: svc.write(path, b"x"),
        "begin_upload": lambda: svc.begin_upload(path),
    }


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/" + "x" * 4096, "at most 4096 bytes"),
        ("/" + "é" * 2048, "at most 4096 bytes"),  # 4,097 bytes in 2,049 characters
        ("/d" * 257, "at most 256 names"),
        ("/" + "n" * 256, "at most 255 bytes"),
        ("/bad\ud800", "valid Unicode"),  # a lone surrogate (\udcff would be byte 0xff)
        ("/nul\0", "NUL"),
    ],
)
async def test_every_method_that_takes_a_path_checks_the_bounds(
    tmp_path: Path, path: str, fragment: str
) -> None:
    (tmp_path / "ok").write_bytes(b"ok")
    scope = gl.ServiceScope("local", os.urandom(16))
    async with LocalFileService(tmp_path, scope=scope) as svc:
        calls = _path_calls(svc, path)
        for name, call in calls.items():
            with pytest.raises(gl.Rejected) as info:
                await call()
            assert (info.value.code, fragment in info.value.message) == ("INVALID_PATH", True), (
                name,
                info.value,
            )
    assert (tmp_path / "ok").read_bytes() == b"ok"


def test_the_path_bounds_are_inclusive_and_configurable(tmp_path: Path) -> None:
    confined = ConfinedRoot(tmp_path)
    assert len(confined.split("/" + "/".join(["x" * 255] * 16))) == 16  # 4,096 bytes
    assert len(confined.split("/d" * 256)) == 256
    assert confined.split("/" + "n" * 255) == ("n" * 255,)
    assert confined.split("/" * 4096) == ()  # empty names are not counted
    small = ConfinedRoot(tmp_path, ServiceLimits(max_path_bytes=8, max_path_components=2))
    assert small.split("/a/b") == ("a", "b")
    for path in ("/a/b/c", "/123456789"):
        with pytest.raises(gl.Rejected) as info:
            small.split(path)
        assert info.value.code == "INVALID_PATH"


async def test_the_process_cwd_is_bounded_too(tmp_path: Path) -> None:
    from garcon_link.services import LocalProcessService

    scope = gl.ServiceScope("local", os.urandom(16))
    async with LocalProcessService(tmp_path, scope=scope) as proc:
        for path in (LONG_PATH, "/d" * 257):
            with pytest.raises(gl.Rejected) as info:
                await proc.run(["true"], cwd=path)
            assert info.value.code == "INVALID_PATH"


async def test_a_cancelled_read_stuck_in_the_os_is_abandoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read stuck in a system call (a hung network file system) neither holds its caller's
    cancellation nor outlives it unbounded: further reads past the cap are OVERLOADED."""
    import threading

    entered = threading.Event()
    release = threading.Event()
    real_scandir = os.scandir

    def stuck_scandir(fd: object) -> object:
        entered.set()
        release.wait(30)
        return real_scandir(fd)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", stuck_scandir)
    (tmp_path / "f").write_bytes(b"data")
    limits = ServiceLimits(max_reader_threads=1)
    try:
        async with LocalFileService(tmp_path, limits=limits) as svc:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(svc.list_dir, "/")
                    await anyio.to_thread.run_sync(entered.wait, 10)
                    tg.cancel_scope.cancel()  # returns at once: the thread is abandoned
                # The abandoned thread still counts: the cap refuses one more read ...
                with pytest.raises(gl.Rejected) as info:
                    await svc.stat("/f")
                assert info.value.code == "OVERLOADED"
                release.set()
                # ... until it ends (bounded wait for the daemon thread to finish).
                codes: list[str] = []
                for _ in range(1000):
                    try:
                        assert (await svc.stat("/f")).size == 4
                        break
                    except gl.Rejected as exc:
                        codes.append(exc.code)
                        await anyio.sleep(0.01)
                else:
                    raise AssertionError("the abandoned read never ended")
                assert set(codes) <= {"OVERLOADED"}, codes
    finally:
        release.set()


def _assert_no_root(error: BaseException, *roots: Path) -> None:
    texts = [str(error), repr(error), getattr(error, "message", "")]
    texts.append(str(getattr(error, "details", None)))
    texts.append(str(getattr(error, "remote_traceback", None)))
    for text in texts:
        for root in roots:
            assert str(root) not in text, text


REALPATH_RAISES_ON_A_SWAP = sys.version_info < (3, 13)
"""Before 3.13, ``os.path.realpath`` lets readlink's EINVAL (the link became a file between its
lstat and readlink) escape as an OSError naming the real path; 3.13 reads it as "not a link"."""


async def test_a_symlink_swapped_during_the_check_is_refused_without_the_real_path(
    layout: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """realpath lstat()s a link, then readlink()s it: replace the link in between (the hook
    does it just before the real readlink). It used to be HANDLER_FAILED whose message and
    traceback held the worker's real root path."""
    root, _ = layout
    link = root / "swap"
    link.symlink_to("inside")
    real_readlink = os.readlink

    def racing_readlink(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> str:
        if os.fspath(path) == str(link):
            link.unlink()
            link.write_bytes(b"now a file")  # readlink -> EINVAL, naming the real path
        return real_readlink(path, dir_fd=dir_fd)

    with anyio.fail_after(30):
        async with linked(root) as executor:
            files = executor.service("files", FileService)
            monkeypatch.setattr(os, "readlink", racing_readlink)
            for call in (
                lambda: files.stat("/swap/file.txt"),
                lambda: files.read("/swap/file.txt"),
                lambda: files.write("/swap/new.txt", b"x"),
                lambda: files.canonical_path("/swap"),
                lambda: files.list_dir("/swap"),
            ):
                link.unlink()
                link.symlink_to("inside")
                if REALPATH_RAISES_ON_A_SWAP:
                    with pytest.raises(gl.CallError) as info:
                        await call()
                    assert isinstance(info.value, gl.Rejected), info.value
                    assert info.value.code == "PERMISSION_DENIED", info.value
                    assert "changed while it was being checked" in info.value.message
                    assert "/swap" in info.value.message
                    _assert_no_root(info.value, root, root.parent)
                else:
                    # 3.13+: realpath takes readlink's EINVAL as "not a link", so the call sees
                    # what the link became -- a file -- and is judged on that, still confined.
                    error: gl.CallError | None = None
                    try:
                        await call()
                    except gl.CallError as exc:
                        error = exc
                    if error is not None:
                        assert isinstance(error, gl.Rejected), error
                        assert error.code == "NOT_A_DIRECTORY", error
                        _assert_no_root(error, root, root.parent)
    assert not (root / "inside" / "new.txt").exists()


async def test_no_error_names_the_real_root(layout: tuple[Path, Path]) -> None:
    """Every kind of refusal and failure, through the RPC layer: only caller paths appear."""
    root, _ = layout
    (root / "loop").symlink_to("loop")
    (root / "dir").mkdir()
    (root / "dir" / "x").write_bytes(b"x")
    (root / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(root / "fifo")
    with anyio.fail_after(30):
        async with linked(root) as executor:
            files = executor.service("files", FileService)
            for call in (
                lambda: files.stat("/missing/x"),
                lambda: files.read("/loop"),
                lambda: files.read("/fifo"),
                lambda: files.read("/dir"),
                lambda: files.list_dir("/inside/file.txt"),
                lambda: files.mkdir("/dir/x/y"),
                lambda: files.remove("/dir"),
                lambda: files.rename("/missing", "/elsewhere"),
                lambda: files.write("/inside/file.txt/x", b"x"),
                lambda: files.write("/dir", b"x"),
                lambda: files.write("/x", b"x", exclusive=True, if_match="1"),
                lambda: files.read_link("/inside"),
                lambda: files.read("/../x"),
            ):
                with pytest.raises(gl.CallError) as info:
                    await call()
                assert isinstance(info.value, gl.Rejected | gl.RemoteError), info.value
                assert info.value.code != "HANDLER_FAILED", info.value
                _assert_no_root(info.value, root, root.parent)


async def test_recursive_removal_never_follows_a_symlink(layout: tuple[Path, Path]) -> None:
    root, outside = layout
    tree = root / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    for i in range(50):
        (tree / "a" / f"f{i}").write_bytes(b"x")
    (tree / "a" / "b" / "deep").write_bytes(b"x")
    (tree / "to-outside").symlink_to(outside)
    (tree / "a" / "b" / "file-link").symlink_to(outside / "secret.txt")
    async with LocalFileService(root) as svc:
        await svc.remove("/tree", recursive=True)
    assert not tree.exists()
    assert (outside / "secret.txt").read_bytes() == b"top secret"


async def test_a_cancelled_recursive_removal_stops_between_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Changes are waited for (the call never returns mid-step), but a long removal checks for
    cancellation between entries instead of running to the end."""
    import threading

    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(100):
        (tree / f"f{i}").write_bytes(b"x")
    entered = threading.Event()
    go = threading.Event()
    real_unlink = os.unlink

    def slow_unlink(*args: object, **kwargs: object) -> None:
        if not entered.is_set():
            entered.set()
            go.wait(30)
        real_unlink(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", slow_unlink)  # only the first call waits
    try:
        async with LocalFileService(tmp_path) as svc:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(svc.remove, "/tree", True)
                    await anyio.to_thread.run_sync(entered.wait, 10)
                    tg.cancel_scope.cancel()
                    go.set()
    finally:
        go.set()
    left = len(list(tree.iterdir()))
    assert 90 <= left < 100, left  # stopped at the next entry, not at the end


# --------------------------------------------------------------------------- special mode bits


async def test_rewriting_a_set_id_file_drops_the_special_bits(tmp_path: Path) -> None:
    """Break 7: replacing a setuid/setgid/sticky file without ``mode`` keeps its other bits only
    (it used to keep 0o4755 on the caller's new content)."""
    scope = gl.ServiceScope("local", os.urandom(16))
    async with LocalFileService(tmp_path, scope=scope) as svc:
        for old_mode, kept in ((0o4755, 0o755), (0o2750, 0o750), (0o1644, 0o644), (0o6711, 0o711)):
            target = tmp_path / "tool"
            target.write_bytes(b"old")
            target.chmod(old_mode)
            assert target.stat().st_mode & 0o7777 == old_mode
            written = await svc.write("/tool", b"new")
            assert (written.mode, target.stat().st_mode & 0o7777) == (kept, kept), oct(old_mode)
            target.chmod(old_mode)
            handle = await svc.begin_upload("/tool")
            await svc.upload_chunk(handle, 0, b"uploaded")
            committed = await svc.commit_upload(handle)
            assert (committed.mode, target.stat().st_mode & 0o7777) == (kept, kept), oct(old_mode)
            assert target.read_bytes() == b"uploaded"


async def test_an_explicit_special_mode_is_refused_unless_allowed(tmp_path: Path) -> None:
    scope = gl.ServiceScope("local", os.urandom(16))
    (tmp_path / "tool").write_bytes(b"old")
    async with LocalFileService(tmp_path, scope=scope) as svc:
        for mode in (0o4755, 0o2755, 0o1777):
            for call in (
                functools.partial(svc.write, "/tool", b"new", mode=mode),
                functools.partial(svc.begin_upload, "/tool", mode=mode),
            ):
                with pytest.raises(gl.Rejected) as info:
                    await call()
                assert info.value.code == "PERMISSION_DENIED", info.value
                assert "allow_special_mode_bits" in info.value.message
        for bad in (0o10000, -1):
            with pytest.raises(gl.Rejected) as info:
                await svc.write("/tool", b"new", mode=bad)
            assert info.value.code == "INVALID_ARGUMENTS"
        assert (await svc.write("/tool", b"plain", mode=0o700)).mode == 0o700
    assert (tmp_path / "tool").read_bytes() == b"plain"
    assert staged_files(tmp_path) == []
    async with LocalFileService(tmp_path, scope=scope, allow_special_mode_bits=True) as svc:
        assert (await svc.write("/tool", b"new", mode=0o4755)).mode == 0o4755
        handle = await svc.begin_upload("/tool", mode=0o2755)
        await svc.upload_chunk(handle, 0, b"up")
        assert (await svc.commit_upload(handle)).mode & 0o7777 in (0o2755, 0o755)
    assert (tmp_path / "tool").stat().st_mode & 0o4000 == 0


async def test_builtin_services_pass_the_special_bits_flag(tmp_path: Path) -> None:
    from garcon_link.services import builtin_services

    (tmp_path / "tool").write_bytes(b"old")
    for allow, expected in ((False, "PERMISSION_DENIED"), (True, None)):
        factory = builtin_services(["files"], tmp_path, allow_special_mode_bits=allow)
        scope = gl.ServiceScope("local", os.urandom(16))
        async with factory(scope) as services:
            impl = services["files"]
            assert isinstance(impl, gl.Service)
            svc = impl.target
            assert isinstance(svc, LocalFileService)
            if expected is None:
                assert (await svc.write("/tool", b"x", mode=0o4755)).mode == 0o4755
            else:
                with pytest.raises(gl.Rejected) as info:
                    await svc.write("/tool", b"x", mode=0o4755)
                assert info.value.code == expected


# ------------------------------------------- durable uploads (docs/design.md#durable-work)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


def staged_sizes(directory: Path) -> list[int]:
    return [(directory / name).stat().st_size for name in staged_files(directory)]


async def test_a_chunk_whose_reply_was_lost_is_resumed_on_a_fresh_session(tmp_path: Path) -> None:
    content = os.urandom(5000)
    with anyio.fail_after(60):
        async with lone_worker(tmp_path) as worker:
            link = worker.link
            assert isinstance(link, WebSocketLink)  # a worker's own link
            port = link.listen_address[1]
            async with (
                FaultProxy("127.0.0.1", port) as proxy,
                controller(proxy.url("/executor")) as executor,
            ):
                files = executor.service("files", FileService)
                session = (await executor.info()).instance_id
                handle = await files.begin_upload("/out.bin", size=len(content))
                assert await files.upload_chunk(handle, 0, content[:2000]) == 2000
                # The chunk reaches the worker; the first byte back cuts the socket, and no new
                # one gets through until the grace retires the session.
                proxy.refuse()
                proxy.cut_after(0, "down")
                with pytest.raises(gl.OutcomeUnknown):
                    await files.upload_chunk(handle, 2000, content[2000:3500])
                await until(lambda: staged_sizes(tmp_path) == [3500])  # the lost chunk landed
                assert proxy.statistics().cuts == 1
                proxy.heal()
                await executor.wait_ready(10)
                assert (await executor.info()).instance_id != session  # a fresh session
                # Resume: ask where to continue; the same handle is still the same upload.
                status = await files.upload_status(handle)
                assert status == UploadStatus("/out.bin", 3500, len(content))
                # Resending the chunk whose reply was lost is harmless (its range is ignored).
                assert await files.upload_chunk(handle, 2000, content[2000:3500]) == 3500
                with pytest.raises(gl.Rejected) as gap:
                    await files.upload_chunk(handle, 4000, content[4000:])
                assert gap.value.code == "UPLOAD_GAP"
                assert await files.upload_chunk(handle, status.received, content[3500:]) == 5000
                stat = await files.commit_upload(
                    handle, expected_sha256=hashlib.sha256(content).hexdigest()
                )
                assert stat.size == len(content)
    assert hashlib.sha256((tmp_path / "out.bin").read_bytes()).digest() == (
        hashlib.sha256(content).digest()
    )
    assert staged_files(tmp_path) == []


async def test_an_upload_outlives_its_controller_but_not_its_worker(tmp_path: Path) -> None:
    with anyio.fail_after(60):
        async with lone_worker(tmp_path) as worker:
            async with controller(worker.url) as first:
                files = first.service("files", FileService)
                handle = await files.begin_upload("/data")
                await files.upload_chunk(handle, 0, b"first half, ")
            # A restarted controller (a new logical session) continues the same upload.
            async with controller(worker.url) as second:
                files = second.service("files", FileService)
                status = await files.upload_status(handle)
                assert (status.path, status.received, status.size) == ("/data", 12, None)
                await files.upload_chunk(handle, status.received, b"second half")
                unfinished = await files.begin_upload("/never")
                await files.upload_chunk(unfinished, 0, b"partial")
                assert (await files.commit_upload(handle)).size == 23
            assert (tmp_path / "data").read_bytes() == b"first half, second half"
            assert len(staged_files(tmp_path)) == 1  # /never, still waiting for its owner
        # Stopping the worker discarded the unfinished upload.
        assert staged_files(tmp_path) == []
        async with lone_worker(tmp_path) as restarted, controller(restarted.url) as third:
            files = third.service("files", FileService)
            with pytest.raises(gl.StaleResource):
                await files.upload_status(unfinished)
            with pytest.raises(gl.StaleResource):
                await files.upload_chunk(unfinished, 7, b"more")
    assert not (tmp_path / "never").exists()


async def test_the_upload_count_is_bounded_per_worker(tmp_path: Path) -> None:
    with anyio.fail_after(60):
        async with lone_worker(tmp_path, ServiceLimits(max_uploads=2)) as worker:
            async with controller(worker.url) as first:
                files = first.service("files", FileService)
                kept = [await files.begin_upload(f"/f{i}") for i in range(2)]
            async with controller(worker.url) as second:
                files = second.service("files", FileService)
                # Another session does not get a fresh allowance: the worker holds two.
                with pytest.raises(gl.Rejected) as busy:
                    await files.begin_upload("/f2")
                assert busy.value.code == "TOO_MANY_UPLOADS"
                assert len(staged_files(tmp_path)) == 2
                await files.abort_upload(kept[0])
                third = await files.begin_upload("/f2")
                await files.abort_upload(third)
                await files.abort_upload(kept[1])
            assert staged_files(tmp_path) == []


async def test_an_idle_upload_is_discarded(tmp_path: Path) -> None:
    now = [1000.0]
    scope = gl.ServiceScope("local", os.urandom(16))
    limits = ServiceLimits(max_uploads=2, upload_idle_timeout=10.0)
    async with LocalFileService(tmp_path, scope=scope, limits=limits, clock=lambda: now[0]) as svc:
        busy = await svc.begin_upload("/busy")
        idle = await svc.begin_upload("/idle")
        now[0] += 6
        await svc.upload_chunk(busy, 0, b"x")  # a call on the handle keeps it alive
        now[0] += 4  # idle for exactly the bound: still kept
        assert (await svc.upload_status(idle)).received == 0
        now[0] += 6
        assert (await svc.upload_status(busy)).received == 1  # touched 10 s ago: kept
        now[0] += 10.5
        # Both idle past the bound now: the next upload call discards them, files and all, and
        # their slots are free again.
        fresh = await svc.begin_upload("/fresh")
        assert len(staged_files(tmp_path)) == 1
        for gone in (busy, idle):
            with pytest.raises(gl.Rejected) as unknown:
                await svc.upload_status(gone)
            assert unknown.value.code == "UNKNOWN_UPLOAD"
        await svc.begin_upload("/second")
        with pytest.raises(gl.Rejected) as full:
            await svc.begin_upload("/third")
        assert full.value.code == "TOO_MANY_UPLOADS"
        await svc.upload_chunk(fresh, 0, b"ok")
        assert (await svc.commit_upload(fresh)).size == 2
    assert staged_files(tmp_path) == []
    assert (tmp_path / "fresh").read_bytes() == b"ok"
    assert not (tmp_path / "busy").exists() and not (tmp_path / "idle").exists()


def test_upload_idle_timeout_is_the_last_bound() -> None:
    assert list(ServiceLimits.describe())[-1] == "upload_idle_timeout"
    assert ServiceLimits().upload_idle_timeout == 3600.0
    with pytest.raises(gl.ConfigError):
        ServiceLimits(upload_idle_timeout=0)
