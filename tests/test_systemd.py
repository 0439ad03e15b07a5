"""systemd's notify protocol (garcon_link/api/systemd.py), with a fake ``NOTIFY_SOCKET``.

The test binds the datagram socket systemd would (in ``tmp_path``, or in the abstract namespace)
and reads what the notifier -- and a real ``garcon-link worker`` child process -- sends:
``READY=1`` once the worker is up (listening, or dialing a controller that is not there),
``WATCHDOG=1`` with a small ``WATCHDOG_USEC``, ``STOPPING=1`` on SIGTERM. A careless
``NOTIFY_SOCKET`` (naming nothing, too long, not a path) costs one log line and the worker runs.
Every wait is bounded; nothing depends on how fast a beat comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import garcon_link as gl
from garcon_link.api.systemd import (
    MAX_STATUS_CHARS,
    MIN_WATCHDOG_INTERVAL,
    SystemdNotifier,
    notify_address,
    watchdog_interval,
)

pytestmark = pytest.mark.timeout(60)

CLI = (sys.executable, "-m", "garcon_link.cli")
WAIT = 20.0  # the longest any datagram is waited for (a hang, not a result)


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket, as systemd's, and its ``NOTIFY_SOCKET`` value."""
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield sock, str(path)


def receive(
    sock: socket.socket, wanted: str, seen: list[dict[str, str]], prefix: bool = False
) -> dict[str, str]:
    """Datagrams until one assigns ``wanted`` (``KEY=value``; with ``prefix``, a value starting
    so); each is appended to ``seen``."""
    deadline = time.monotonic() + WAIT
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no {wanted!r} within {WAIT}s; got {seen}")
        sock.settimeout(remaining)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            continue
        message = dict(line.split("=", 1) for line in data.decode().splitlines())
        seen.append(message)
        key, value = wanted.split("=", 1)
        got = message.get(key)
        if got == value or (prefix and got is not None and got.startswith(value)):
            return message


# ---------------------------------------------------------------------------------- pure parts


def test_notify_address_is_a_path_or_an_abstract_name() -> None:
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@garcon/notify") == b"\0garcon/notify"
    for careless in ("relative/notify", "@", "vsock:2:1234"):
        with pytest.raises(ValueError, match="NOTIFY_SOCKET"):
            notify_address(careless)


@pytest.mark.parametrize(
    ("usec", "watchdog_pid", "expected"),
    [
        (None, None, None),
        ("", None, None),
        ("1000000", None, 0.5),
        ("1000000", "4242", 0.5),  # this process
        ("1000000", "1", None),  # another process's watchdog
        ("30000000", "", 15.0),
        ("1", None, MIN_WATCHDOG_INTERVAL),  # no busy loop
    ],
)
def test_watchdog_interval(usec: str | None, watchdog_pid: str | None, expected: float) -> None:
    assert watchdog_interval(usec, watchdog_pid, 4242) == expected


@pytest.mark.parametrize(
    ("usec", "watchdog_pid"), [("x", None), ("0", None), ("-5", None), ("9", "me")]
)
def test_a_careless_watchdog_setting_is_refused(usec: str, watchdog_pid: str | None) -> None:
    with pytest.raises(ValueError, match="WATCHDOG_"):
        watchdog_interval(usec, watchdog_pid, 4242)


def test_from_environ_reads_and_removes_the_variables(
    notify_socket: tuple[socket.socket, str],
) -> None:
    _, path = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "7", "HOME": "/h"}
    notifier = SystemdNotifier.from_environ(env, pid=7)
    assert (notifier.address, notifier.watchdog) == (path, 1.0)
    assert env == {"HOME": "/h"}  # what the worker starts does not inherit them
    assert not SystemdNotifier.from_environ({}).enabled


def test_careless_variables_are_one_log_line_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="garcon_link")
    notifier = SystemdNotifier.from_environ({"NOTIFY_SOCKET": "notify"})
    assert not notifier.enabled and not notifier.send("READY=1")
    notifier = SystemdNotifier.from_environ({"NOTIFY_SOCKET": "/n", "WATCHDOG_USEC": "soon"})
    assert notifier.enabled and notifier.watchdog is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "systemd notify is off",
        "systemd watchdog is off",
    ]


# ---------------------------------------------------------------------------------- sending


def test_status_lines_reach_the_socket_flat_and_bounded(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    notifier = SystemdNotifier(path)
    try:
        notifier.ready("serving\nREADY=0 " + "x" * 1000)
        seen: list[dict[str, str]] = []
        message = receive(sock, "READY=1", seen)
        assert set(message) == {"READY", "STATUS"}  # the newline did not start an assignment
        assert message["STATUS"].startswith("serving READY=0 x")
        assert len(message["STATUS"]) == MAX_STATUS_CHARS
        notifier.stopping("draining")
        assert receive(sock, "STOPPING=1", seen)["STATUS"] == "draining"
        assert (notifier.sent, notifier.failures) == (2, 0)
    finally:
        notifier.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_an_abstract_notify_socket() -> None:
    name = f"garcon-link-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        notifier = SystemdNotifier.from_environ({"NOTIFY_SOCKET": "@" + name})
        try:
            notifier.status("hello")
            assert receive(sock, "STATUS=hello", [])
        finally:
            notifier.close()


@pytest.mark.parametrize("where", ["nowhere", "too long"])
def test_a_socket_that_cannot_be_reached_is_logged_once(
    where: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="garcon_link")
    path = tmp_path / "missing" / "notify" if where == "nowhere" else tmp_path / ("n" * 200)
    notifier = SystemdNotifier(str(path), watchdog=1.0)
    try:
        assert not notifier.send("READY=1")
        assert not notifier.send("WATCHDOG=1")
        assert not notifier.send("STOPPING=1")
    finally:
        notifier.close()
    assert (notifier.sent, notifier.failures) == (0, 3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "runs on without telling systemd" in lines[0], lines


# ---------------------------------------------------------------------------------- the worker


def write_config(directory: Path, connection: str) -> Path:
    gl.write_secret_file(directory / "link.secret")
    path = directory / "worker.toml"
    path.write_text(
        'executor_id = "sd-box"\nrole = "worker"\nsecret_file = "link.secret"\n\n'
        f"[connection]\n{connection}\n\n[limits]\nbackoff_base = 0.05\nbackoff_max = 0.2\n",
        encoding="utf-8",
    )
    return path


DEMO = "demo=garcon_link.demo:DemoService"


def start_worker(config: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, "worker", str(config), "--service", DEMO],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def stop(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    """SIGTERM (if still running), then the exit status and output."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        out, err = process.communicate(timeout=WAIT)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=WAIT)
    return process.returncode, out, err


def rest(sock: socket.socket) -> list[dict[str, str]]:
    """The datagrams already waiting on ``sock`` (once the sender has exited: all it sent)."""
    got: list[dict[str, str]] = []
    sock.setblocking(False)
    try:
        while True:
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return got
            got.append(dict(line.split("=", 1) for line in data.decode().splitlines()))
    finally:
        sock.setblocking(True)


def test_the_worker_says_ready_watchdog_and_stopping(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    """The command's worker is a ``gl.Worker(systemd=True)`` told the signal: one ``READY=1``,
    beats, and one ``STOPPING=1`` naming the signal (closing the worker says no other)."""
    sock, path = notify_socket
    config = write_config(tmp_path, 'listen = "127.0.0.1:0"')
    process = start_worker(config, {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})
    seen: list[dict[str, str]] = []
    try:
        ready = receive(sock, "READY=1", seen)
        assert ready["STATUS"].startswith("executor sd-box: listening on ws://127.0.0.1:")
        receive(sock, "WATCHDOG=1", seen)
        process.send_signal(signal.SIGTERM)
        stopping = receive(sock, "STOPPING=1", seen)
        assert stopping["STATUS"].startswith("executor sd-box: SIGTERM, draining")
    finally:
        code, out, err = stop(process)  # a second SIGTERM, if it has not exited yet
    assert code == 0, err
    assert "executor-stopping executor=sd-box reason=SIGTERM" in out
    assert "systemd" not in err  # nothing went wrong telling it
    seen += rest(sock)
    assert [m for m in seen if "READY" in m] == [ready]
    assert [m for m in seen if "STOPPING" in m] == [stopping]


def test_a_dialing_worker_is_ready_before_any_controller_answers(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    with socket.socket() as dead:  # bound, never listening: every dial is refused
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        config = write_config(tmp_path, f'dial = "ws://127.0.0.1:{port}/executor"')
        process = start_worker(config, {"NOTIFY_SOCKET": path})
        try:
            ready = receive(sock, "READY=1", [])
            assert ready["STATUS"].startswith("executor sd-box: dialing ws://127.0.0.1:")
        finally:
            code, _, err = stop(process)
    assert code == 0, err


def test_a_careless_notify_socket_is_one_line_and_the_worker_runs(tmp_path: Path) -> None:
    config = write_config(tmp_path, 'listen = "127.0.0.1:0"')
    process = start_worker(config, {"NOTIFY_SOCKET": str(tmp_path / "nobody" / "notify")})
    assert process.stdout is not None
    try:
        deadline = time.monotonic() + WAIT
        line = ""
        while not line.startswith("executor-listening") and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "the worker exited"
    finally:
        code, _, err = stop(process)
    assert code == 0, err
    lines = [x for x in err.splitlines() if "NOTIFY_SOCKET" in x]
    assert len(lines) == 1 and "runs on without telling systemd" in lines[0], err


def signal_until_exit(process: subprocess.Popen[str], sends: int = 5000) -> int:
    """SIGTERM ``process`` again and again, about a millisecond apart, until it exits (at most
    ``sends`` times); its exit status. Some signal lands in whatever moment of its exit path
    the process is in: between its close and its exit too."""
    for _ in range(sends):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        time.sleep(0.001)
    return process.wait(timeout=WAIT)


def test_signals_after_the_drain_do_not_kill_the_worker(tmp_path: Path) -> None:
    """SIGTERM, then SIGTERM after SIGTERM until the worker exits: it exits 0, never by a
    signal, whichever step of its close and exit the later ones find it in."""
    config = write_config(tmp_path, 'listen = "127.0.0.1:0"')
    process = start_worker(config, {})
    assert process.stdout is not None
    try:
        deadline = time.monotonic() + WAIT
        line = ""
        while not line.startswith("executor-listening") and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "the worker exited"
        process.send_signal(signal.SIGTERM)
        while not line.startswith("executor-stopping") and time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, "the worker exited"
        code = signal_until_exit(process)
    finally:
        _, _, err = stop(process)
    assert code == 0, err
    assert line == "executor-stopping executor=sd-box reason=SIGTERM\n"


def test_a_second_signal_cuts_the_drain_short(tmp_path: Path) -> None:
    """A call holds the worker's 60 s drain; a second SIGTERM ends it: the worker exits 0 (long
    before the drain's end: the wait is shorter than it), and the call still running ends
    OutcomeUnknown for its caller (exit 6), as on any close."""
    config = write_config(tmp_path, 'listen = "127.0.0.1:0"')
    process = subprocess.Popen(
        [*CLI, "worker", str(config), "--drain", "60", "--service", DEMO],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    call = None
    try:
        line = process.stdout.readline()
        assert line.startswith("executor-listening url="), line
        url = line.split()[1].removeprefix("url=")
        controller = tmp_path / "controller.toml"
        controller.write_text(
            'executor_id = "sd-box"\nrole = "controller"\nsecret_file = "link.secret"\n\n'
            f'[connection]\ndial = "{url}"\n',
            encoding="utf-8",
        )
        call = subprocess.Popen(
            [*CLI, "call", str(controller), "demo.hold", "[120]", "--timeout", "150"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(40):  # until the call holds (each look is a fresh `call` process)
            held = subprocess.run(
                [*CLI, "call", str(controller), "demo.holding"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=WAIT,
            )
            if held.stdout.strip() == "1":
                break
        else:
            raise AssertionError(f"the call never held the worker: {held.stderr}")
        process.send_signal(signal.SIGTERM)
        while not line.startswith("executor-draining"):
            line = process.stdout.readline()
            assert line, "the worker exited"
        assert "reason=SIGTERM seconds=60 running=1" in line, line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT) == 0
        _, err = call.communicate(timeout=WAIT)
        assert (call.returncode, err.split("]")[0]) == (6, "error: [unknown:CONTINUITY_LOST"), err
    finally:
        if call is not None and call.poll() is None:
            call.kill()
            call.communicate(timeout=WAIT)
        _, out, err = stop(process)
    assert "executor-stopping executor=sd-box reason=SIGTERM" in out, out
    assert "the drain is cut short" in err, err


# ------------------------------------------------------------------------------ a library worker


def _library_worker_config() -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id="lib-box",
        role=gl.Role.WORKER,
        secret=gl.Secret(b"s" * 32),
        listen=("127.0.0.1", 0),
    )


@pytest.mark.anyio
async def test_a_library_worker_with_systemd_says_ready_status_watchdog_and_stopping(
    notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    cfg = _library_worker_config()
    seen: list[dict[str, str]] = []
    with anyio.fail_after(WAIT):
        async with gl.Worker(cfg, {}, systemd=True, drain=0.5) as worker:
            assert "NOTIFY_SOCKET" not in os.environ  # what it starts cannot speak for it
            ready = receive(sock, "READY=1", seen)  # sent before the body runs
            assert ready["STATUS"] == f"executor lib-box: listening on {worker.url}, no session yet"
            await anyio.to_thread.run_sync(receive, sock, "WATCHDOG=1", seen)
            controller = dataclasses.replace(
                cfg, role=gl.Role.CONTROLLER, listen=None, dial=worker.url
            )
            async with gl.connect(controller) as executor:
                await executor.wait_ready(5)
                status = await anyio.to_thread.run_sync(
                    receive, sock, "STATUS=executor-ready executor=lib-box", seen, True
                )
                assert "READY" not in status
    stopping = receive(sock, "STOPPING=1", seen)  # sent when the close began
    assert stopping["STATUS"] == "executor lib-box: draining for up to 0.5s"
    assert [m for m in seen if "READY" in m] == [ready]


@pytest.mark.anyio
async def test_a_library_worker_without_the_option_leaves_systemd_alone(
    notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    with anyio.fail_after(WAIT):
        async with gl.Worker(_library_worker_config(), {}):
            assert os.environ["NOTIFY_SOCKET"] == path  # not read: the program's to use
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)
