"""The ``garcon-link`` command line: keygen, worker + call across processes, exit codes, errors.

Cross-process tests run ``python -m garcon_link.cli`` (what the ``garcon-link`` script runs) as
subprocesses with bounded timeouts; every child is killed in ``finally``. The worker serves
``garcon_link.demo:DemoService`` (add, echo, fail, count, hold, holding).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest
import trustme
from projectutil import command_lines, run_project, shim_path

import garcon_link as gl
from garcon_link import _scaffold, cli
from garcon_link.api.relay import GatewayExecutor
from garcon_link.cli import _call, _output
from garcon_link.cli._exits import _describe, _leaf
from garcon_link.rpc.interface import MethodKind
from garcon_link.settings.config import CONFIG_ENV_VAR
from garcon_link.settings.secrets import read_secret_file

CLI = (sys.executable, "-m", "garcon_link.cli")
SERVICE = "demo=garcon_link.demo:DemoService"
FAST_LIMITS = """
[limits]
heartbeat_interval = 0.5
heartbeat_timeout = 2.0
detached_grace = 2.0
backoff_base = 0.05
backoff_max = 0.2
connect_timeout = 2.0
"""


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A port that refuses connections: bound and not listening for the whole test, so no other
    process (tests run in parallel) can start listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def write_config(directory: Path, name: str, role: str, connection: str) -> Path:
    secret = directory / "link.secret"
    if not secret.exists():
        gl.write_secret_file(secret)
    path = directory / name
    path.write_text(
        f'executor_id = "cli-box"\nrole = "{role}"\nsecret_file = "link.secret"\n\n'
        f"[connection]\n{connection}\n{FAST_LIMITS}",
        encoding="utf-8",
    )
    return path


def run_cli(
    *args: str, timeout: float = 30, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


class Worker:
    """``garcon-link worker`` in a child process, its stdout read line by line by a thread."""

    def __init__(
        self,
        config: Path,
        *services: str,
        cwd: Path | None = None,
        extra: tuple[str, ...] = (),
        launcher: tuple[str, ...] = CLI,
        env: dict[str, str] | None = None,
    ) -> None:
        command = [*launcher, "worker", str(config), "--stop-on-stdin-eof", *extra]
        for service in services:
            command += ["--service", service]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_line(self, prefix: str, timeout: float = 20) -> str:
        for line in self.lines:
            if line.startswith(prefix):
                return line
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {prefix!r} line within {timeout}s: {self.lines}")
            try:
                received = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if received is None:
                raise AssertionError(f"worker exited before {prefix!r}: {self.stderr()}")
            self.lines.append(received)
            if received.startswith(prefix):
                return received

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 20) -> None:
        """Read lines until ``predicate()`` holds."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"condition not met within {timeout}s: {self.lines}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"worker exited: {self.stderr()}")
            self.lines.append(line)

    def drained(self) -> bool:
        """Move every line already read into :attr:`lines`; True once stdout has ended."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return False
            if line is None:
                return True
            self.lines.append(line)

    def url(self) -> str:
        line = self.wait_line("executor-listening")
        return next(p.split("=", 1)[1] for p in line.split() if p.startswith("url="))

    def stderr(self) -> str:
        if self.process.poll() is None or self.process.stderr is None:
            return ""
        return self.process.stderr.read()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=10)
        finally:
            for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture(scope="module")
def listening_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, Path]]:
    """One worker listening on a free port, and a controller config that dials it."""
    directory = tmp_path_factory.mktemp("cli-worker")
    worker_toml = write_config(directory, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, SERVICE)
    try:
        url = worker.url()
        controller = write_config(directory, "controller.toml", "controller", f'dial = "{url}"')
        yield worker, controller
    finally:
        worker.kill()


def assert_one_error_line(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# --------------------------------------------------------------------------- keygen


def test_keygen_writes_a_0600_secret_that_load_config_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "link.secret"
    assert cli.main(["keygen", str(path)]) == 0
    assert capsys.readouterr().out.strip() == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text().strip()) == 64
    config = tmp_path / "w.toml"
    config.write_text(
        'executor_id = "x"\nrole = "worker"\nsecret_file = "link.secret"\n'
        '[connection]\nlisten = "127.0.0.1:0"\n'
    )
    assert len(gl.load_config(config).secret) == 32


def test_keygen_refuses_to_overwrite_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "link.secret"
    assert cli.main(["keygen", str(path)]) == 0
    first = path.read_bytes()
    capsys.readouterr()
    assert cli.main(["keygen", str(path)]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(captured.err, "refusing to overwrite", "--force")
    assert path.read_bytes() == first
    assert cli.main(["keygen", str(path), "--force"]) == 0
    assert path.read_bytes() != first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_keygen_as_a_command(tmp_path: Path) -> None:
    path = tmp_path / "k.secret"
    done = run_cli("keygen", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(path)
    again = run_cli("keygen", str(path))
    assert again.returncode == 2
    assert_one_error_line(again.stderr, "refusing to overwrite")


def test_keygen_enrolls_an_executor_in_a_keyring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    assert cli.main(["keygen", "--keyring", str(keys), "--executor", "box-1"]) == 0
    out = capsys.readouterr().out
    path = keys / "box-1.secret"
    assert out == (
        f"enrolled box-1: {path} (mode 0600); copy it to the worker as its secret_file\n"
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) & 0o077 == 0
    secret = path.read_text().strip()
    assert secret not in out
    assert gl.Keyring(keys).secret_for("box-1") == read_secret_file(path)
    # The file is a worker's secret_file as it is.
    worker = tmp_path / "w.toml"
    worker.write_text(
        f'executor_id = "box-1"\nrole = "worker"\nsecret_file = "{path}"\n'
        '[connection]\ndial = "ws://127.0.0.1:8443/executor"\n'
    )
    assert gl.load_config(worker).secret == gl.Keyring(keys).secret_for("box-1")


def test_keygen_enrolls_a_gateway_caller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callers = tmp_path / "callers"
    assert cli.main(["keygen", "--keyring", str(callers), "--caller", "web-1"]) == 0
    path = callers / "web-1.secret"
    assert capsys.readouterr().out == (
        f"enrolled web-1: {path} (mode 0600); copy it to the caller as its secret_file\n"
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # The file is the caller's secret_file as it is.
    caller = tmp_path / "c.toml"
    caller.write_text(
        f'role = "caller"\ncaller_id = "web-1"\nsecret_file = "{path}"\n'
        '[connection]\ndial = "ws://127.0.0.1:8443/executor"\n'
    )
    assert gl.load_caller_config(caller).secret == gl.Keyring(callers).secret_for("web-1")
    assert cli.main(["keygen", "--keyring", "K", "--caller", "a", "--executor", "b"]) == 2
    assert "not both" in capsys.readouterr().err


def test_keygen_keyring_as_a_command(tmp_path: Path) -> None:
    done = run_cli("keygen", "--keyring", str(tmp_path / "keys"), "--executor", "box-1")
    assert done.returncode == 0, done.stderr
    path = tmp_path / "keys" / "box-1.secret"
    assert done.stdout.startswith(f"enrolled box-1: {path} (mode 0600)")
    assert path.read_text().strip() not in done.stdout + done.stderr
    again = run_cli("keygen", "--keyring", str(tmp_path / "keys"), "--executor", "box-1")
    assert again.returncode == 2
    assert_one_error_line(again.stderr, "refusing to overwrite", "--force")
    forced = run_cli(
        "keygen", "--keyring", str(tmp_path / "keys"), "--executor", "box-1", "--force"
    )
    assert forced.returncode == 0, forced.stderr


def test_a_caller_that_dials_a_worker_is_told_it_is_not_a_gateway(
    listening_worker: tuple[Worker, Path], tmp_path: Path
) -> None:
    """The worker's own id and secret get the caller through the handshake: what it reached
    must still be named, not reported as a missing service of the call."""
    worker, controller = listening_worker
    caller = tmp_path / "caller.toml"
    caller.write_text(
        f'role = "caller"\ncaller_id = "cli-box"\nsecret_file = "{controller.parent}/link.secret"'
        f'\n[connection]\ndial = "{worker.url()}"\n',
        encoding="utf-8",
    )
    done = run_cli("call", str(caller), "--executor", "box-1", "demo.add", "[1, 2]")
    assert done.returncode == cli.EXIT_USAGE
    assert_one_error_line(done.stderr, worker.url(), "not a gateway", str(caller))


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--keyring", "K"], ["--keyring needs --executor"]),
        (["--executor", "box-1"], ["--executor needs --keyring"]),
        (["PATH", "--keyring", "K", "--executor", "box-1"], ["either PATH or --keyring"]),
        ([], ["needs PATH"]),
        (["--keyring", "K", "--executor", "box:1"], ["ASCII letters", "still loads its config"]),
        (["--keyring", "K", "--executor", "../x"], ["starts with '.'", "rename"]),
        (["--keyring", "K", "--caller", "a/b"], ["caller id 'a/b'", "ASCII letters", "web-1"]),
        (["--keyring", "K", "--caller", ".."], ["caller id '..'", "starts with '.'"]),
        (["--keyring", "K", "--caller", "a" * 1000], ["caller id", "longer than 200"]),
    ],
)
def test_keygen_keyring_usage_errors(
    tmp_path: Path,
    args: list[str],
    fragments: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["keygen", *args]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(captured.err, *fragments)
    if "--caller" in args:  # a caller's id is not worded as a worker's
        assert "executor" not in captured.err and "worker" not in captured.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
@pytest.mark.parametrize("command", ["call", "worker", "gateway"])
def test_a_config_that_is_a_fifo_is_one_line_not_a_hang(tmp_path: Path, command: str) -> None:
    fifo = tmp_path / "link.toml"
    os.mkfifo(fifo)
    args = [command, str(fifo)] + (["calc.add"] if command == "call" else [])
    done = run_cli(*args, timeout=10)
    assert done.returncode == 2
    assert_one_error_line(done.stderr, str(fifo), "not a regular file")


def test_keygen_into_a_keyring_that_is_a_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "callers").write_text("x")
    keyring = str(tmp_path / "callers")
    assert cli.main(["keygen", "--keyring", keyring, "--caller", "web-1"]) == cli.EXIT_USAGE
    assert_one_error_line(capsys.readouterr().err, keyring, "is not a directory")


def test_a_gateway_without_grants_warns_at_startup(tmp_path: Path) -> None:
    for directory in ("keys", "callers"):
        (tmp_path / directory).mkdir(mode=0o700)
    config = tmp_path / "gateway.toml"
    config.write_text(
        'role = "gateway"\n[connection]\nlisten = "127.0.0.1:0"\n[executors]\nkeyring = "keys"\n'
        '[callers]\nkeyring = "callers"\n',
        encoding="utf-8",
    )
    process = subprocess.Popen(
        [*CLI, "gateway", str(config), "--json", "--drain", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        warning = process.stderr.readline()
        assert warning.startswith("warning: ") and "no [[callers.grant]]" in warning
        assert str(config) in warning and "FORBIDDEN" in warning
    finally:
        process.terminate()
        process.communicate(timeout=10)


def test_a_gateway_s_missing_caller_keyring_names_the_caller_enrollment(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir(mode=0o700)
    config = tmp_path / "gateway.toml"
    config.write_text(
        'role = "gateway"\n[connection]\nlisten = "127.0.0.1:0"\n[executors]\nkeyring = "keys"\n'
        '[callers]\nkeyring = "callers"\n',
        encoding="utf-8",
    )
    done = run_cli("gateway", str(config))
    assert done.returncode == 2
    assert_one_error_line(
        done.stderr, str(config), "[callers] keyring", "--keyring DIR --caller ID"
    )


# --------------------------------------------------------------------------- init


def test_init_writes_a_project_whose_two_printed_commands_work(tmp_path: Path) -> None:
    project = tmp_path / "my project"  # a space: the printed commands must quote it
    done = run_cli("init", str(project), "--port", str(free_port()))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in project.iterdir()) == [
        "calc.py",
        "controller.toml",
        "link.secret",
        "worker.toml",
    ]
    assert stat.S_IMODE((project / "link.secret").stat().st_mode) == 0o600
    assert gl.load_config(project / "worker.toml").secret == (
        gl.load_config(project / "controller.toml").secret
    )
    commands = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if " && " in line]
    assert len(commands) == 2, done.stdout
    env = shim_path(tmp_path)
    # Run from elsewhere: each printed command carries its own `cd`.
    output = run_project(tmp_path, command_lines("\n".join(commands)), env)
    assert output == "3\n[0, 1, 2]\n"


def test_init_in_the_current_directory_prints_commands_without_cd(tmp_path: Path) -> None:
    # This interpreter's directory first on PATH (an activated venv): the plain names.
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = run_cli("init", ".", "--port", str(free_port()), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "cd " not in done.stdout
    assert "start the worker:       garcon-link worker worker.toml --service" in done.stdout
    assert "then, in another shell: python calc.py" in done.stdout


def test_init_names_its_own_programs_when_path_finds_others(tmp_path: Path) -> None:
    # A fresh shell (no venv activated): a plain `python calc.py` there could not import
    # garcon_link, so init prints the paths of the programs it runs with.
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "python").is_file():
        pytest.skip("the interpreter's directory has no `python`")
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    done = run_cli("init", "proj", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[2].startswith("then, in another shell: cd proj && "), lines
    program, script = lines[2].split(" && ", 1)[1].split()
    assert script == "calc.py"
    assert os.path.samefile(tmp_path / "proj" / program, bin_dir / "python"), program


def test_init_refuses_a_non_empty_directory_unless_forced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    refused = run_cli("init", str(tmp_path))
    assert refused.returncode == cli.EXIT_USAGE
    assert refused.stdout == ""
    assert_one_error_line(refused.stderr, "not empty", "--force")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    forced = run_cli("init", str(tmp_path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert stat.S_IMODE((tmp_path / "link.secret").stat().st_mode) == 0o600
    assert (tmp_path / "calc.py").read_text() == _scaffold.CALC_PY


def test_init_refuses_a_file_and_a_bad_port(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    assert_one_error_line(run_cli("init", str(tmp_path / "f")).stderr, "not a directory")
    bad = run_cli("init", str(tmp_path / "d"), "--port", "0")
    assert bad.returncode == cli.EXIT_USAGE
    assert not (tmp_path / "d").exists()
    # Under a file: the directory cannot be created; the line says which and what to give.
    under_file = run_cli("init", str(tmp_path / "f" / "project"))
    assert under_file.returncode == cli.EXIT_USAGE
    assert_one_error_line(
        under_file.stderr, str(tmp_path / "f" / "project"), "cannot create the directory"
    )


# --------------------------------------------------------------------------- worker + call


def test_call_unary_positional_and_keyword(listening_worker: tuple[Worker, Path]) -> None:
    _, controller = listening_worker
    done = run_cli("call", str(controller), "demo.add", "[2, 3]")
    assert (done.returncode, done.stdout, done.stderr) == (0, "5\n", "")
    done = run_cli("call", str(controller), "demo.add", '{"a": 40, "b": 2}')
    assert (done.returncode, done.stdout) == (0, "42\n")
    done = run_cli("call", str(controller), "demo.echo", '["héllo"]')
    assert json.loads(done.stdout) == "héllo"


def test_call_stream_prints_one_json_line_per_item(listening_worker: tuple[Worker, Path]) -> None:
    _, controller = listening_worker
    done = run_cli("call", str(controller), "demo.count", "[4]")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in done.stdout.splitlines()] == [0, 1, 2, 3]


def test_a_stream_piped_into_a_reader_that_leaves_ends_quietly(
    listening_worker: tuple[Worker, Path],
) -> None:
    # `garcon-link call ... demo.count '[1000000]' | head -1`: once head has its line and
    # closes the pipe, call stops (the stream is closed on the worker) without an error line.
    _, controller = listening_worker
    process = subprocess.Popen(
        [*CLI, "call", str(controller), "demo.count", "[1000000]"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "0\n"
        process.stdout.close()
        assert process.wait(timeout=30) == cli.EXIT_OTHER
        assert process.stderr is not None
        assert process.stderr.read() == ""
    finally:
        process.kill()
        process.wait(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def test_worker_prints_listening_and_ready_lines(listening_worker: tuple[Worker, Path]) -> None:
    worker, controller = listening_worker
    assert run_cli("call", str(controller), "demo.holding").returncode == 0
    listening = worker.wait_line("executor-listening")
    assert listening.startswith("executor-listening url=ws://127.0.0.1:")
    assert listening.endswith(" executor=cli-box")
    ready = worker.wait_line("executor-ready")
    keys = dict(part.split("=", 1) for part in ready.split()[1:])
    assert keys["executor"] == "cli-box"
    assert len(bytes.fromhex(keys["session"])) == 32
    assert len(bytes.fromhex(keys["instance"])) == 16
    assert keys["resumed"] == "false"


def test_call_config_from_environment(listening_worker: tuple[Worker, Path]) -> None:
    _, controller = listening_worker
    env = {**os.environ, CONFIG_ENV_VAR: str(controller)}
    omitted = run_cli("call", "demo.add", "[1, 1]", env=env)
    assert (omitted.returncode, omitted.stdout) == (0, "2\n"), omitted.stderr
    dash = run_cli("call", "-", "demo.holding", env=env)
    assert (dash.returncode, dash.stdout) == (0, "0\n"), dash.stderr


def test_worker_dials_and_call_listens(tmp_path: Path) -> None:
    """Worker-dials-controller: ``call`` listens and waits for the worker to dial in."""
    port = free_port()
    controller = write_config(
        tmp_path, "controller.toml", "controller", f'listen = "127.0.0.1:{port}"'
    )
    worker_toml = write_config(
        tmp_path, "worker.toml", "worker", f'dial = "ws://127.0.0.1:{port}/executor"'
    )
    call = subprocess.Popen(
        [*CLI, "call", str(controller), "demo.add", "[20, 22]", "--timeout", "30"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker: Worker | None = None
    try:
        time.sleep(0.3)  # let `call` bind its port first (the worker would redial anyway)
        worker = Worker(worker_toml, SERVICE)
        assert worker.wait_line("executor-dialing").startswith(
            f"executor-dialing url=ws://127.0.0.1:{port}/executor"
        )
        out, err = call.communicate(timeout=40)
        assert (call.returncode, out, err) == (0, "42\n", "")
        worker.wait_line("executor-ready")
        # The worker keeps dialing: a second `call` gets it too.
        again = run_cli("call", str(controller), "demo.count", "[2]", "--timeout", "30")
        assert (again.returncode, again.stdout) == (0, "0\n1\n"), again.stderr
    finally:
        if call.poll() is None:
            call.kill()
        call.wait(timeout=10)
        if worker is not None:
            worker.kill()


def test_worker_stops_gracefully_on_sigterm_and_sigint(tmp_path: Path) -> None:
    config = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    for signum in (signal.SIGTERM, signal.SIGINT):
        worker = Worker(config, SERVICE)
        try:
            worker.wait_line("executor-listening")
            worker.process.send_signal(signum)
            assert worker.process.wait(timeout=15) == 0
            line = worker.wait_line("executor-stopping")
            assert line == f"executor-stopping executor=cli-box reason={signum.name}"
        finally:
            worker.kill()


def test_worker_stops_when_stdin_closes(tmp_path: Path) -> None:
    config = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(config, SERVICE)
    try:
        worker.wait_line("executor-listening")
        assert worker.process.stdin is not None
        worker.process.stdin.close()
        assert worker.process.wait(timeout=15) == 0
        assert worker.wait_line("executor-stopping").endswith("reason=stdin-closed")
    finally:
        worker.kill()


def test_worker_serves_objects_and_per_session_factories_from_the_cwd(tmp_path: Path) -> None:
    (tmp_path / "my_services.py").write_text(
        """
import contextlib

class Counter:
    def __init__(self):
        self.n = 0
    async def bump(self) -> int:
        self.n += 1
        return self.n

class Scoped:
    def __init__(self, scope):
        self.scope = scope
    async def instance(self) -> str:
        return self.scope.instance_id.hex()

@contextlib.asynccontextmanager
async def scoped(scope):
    yield Scoped(scope)

shared = Counter()
""",
        encoding="utf-8",
    )
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(
        worker_toml,
        "counter=my_services:shared",
        "scoped=my_services:scoped",
        cwd=tmp_path,
    )
    try:
        url = worker.url()
        controller = write_config(tmp_path, "controller.toml", "controller", f'dial = "{url}"')
        first = run_cli("call", str(controller), "counter.bump")
        second = run_cli("call", str(controller), "counter.bump")
        assert (first.stdout, second.stdout) == ("1\n", "2\n"), first.stderr + second.stderr
        # Each `call` is a new logical session: a factory builds a new scope for each.
        a = run_cli("call", str(controller), "scoped.instance")
        b = run_cli("call", str(controller), "scoped.instance")
        assert a.returncode == b.returncode == 0, a.stderr + b.stderr
        assert json.loads(a.stdout) != json.loads(b.stdout)
        # ... and the worker announced that scope's instance id on its executor-ready line.
        assert worker.wait_line("executor-ready executor=cli-box session=", timeout=1)
        worker.wait_for(lambda: any(json.loads(b.stdout) in line for line in worker.lines))
    finally:
        worker.kill()


def test_call_checks_results_and_describe_prints_signatures(tmp_path: Path) -> None:
    # Before: a ``-> int`` method returning text printed it with exit 0, and there was no
    # ``describe`` command.
    (tmp_path / "liar.py").write_text(
        """
from collections.abc import AsyncIterator

class Liar:
    async def number(self) -> int:
        return "seven"
    async def honest(self, n: int) -> list[int]:
        return [n]
    async def size(self, data: bytes) -> int:
        return len(data)
    async def numbers(self) -> AsyncIterator[int]:
        yield 1
        yield "two"
""",
        encoding="utf-8",
    )
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, "liar=liar:Liar", cwd=tmp_path)
    try:
        url = worker.url()
        controller = write_config(tmp_path, "controller.toml", "controller", f'dial = "{url}"')
        lied = run_cli("call", str(controller), "liar.number")
        assert lied.returncode == cli.EXIT_REMOTE_ERROR == 5, lied.stderr
        assert lied.stdout == ""
        assert_one_error_line(lied.stderr, "[failed:INVALID_RESULT]", "expected `int`, got `str`")
        honest = run_cli("call", str(controller), "liar.honest", "[3]")
        assert (honest.returncode, honest.stdout) == (0, "[3]\n"), honest.stderr
        # JSON has no bytes: the command sends them as base64 text, and says so to the worker.
        sized = run_cli("call", str(controller), "liar.size", '["aGVsbG8="]')
        assert (sized.returncode, sized.stdout) == (0, "5\n"), sized.stderr
        # A stream item that breaks the contract ends the stream: what came before stands.
        stream = run_cli("call", str(controller), "liar.numbers")
        assert stream.returncode == cli.EXIT_OUTCOME_UNKNOWN, stream.stderr
        assert stream.stdout == "1\n"
        assert_one_error_line(stream.stderr, "expected `int`, got `str`")

        described = run_cli("describe", str(controller))
        assert described.returncode == 0, described.stderr
        assert described.stdout.splitlines() == [
            "unary  liar.honest(n: int) -> list[int]",
            "unary  liar.number() -> int",
            "stream liar.numbers() -> collections.abc.AsyncIterator[int]",
            "unary  liar.size(data: bytes) -> int",
        ]
        as_json = run_cli("describe", str(controller), "--json")
        assert as_json.returncode == 0, as_json.stderr
        document = json.loads(as_json.stdout)
        assert document["executor_id"] == "cli-box"
        assert len(document["contract"]) == 64
        assert document["services"]["liar"]["number"] == {
            "kind": "unary",
            "signature": "() -> int",
        }
    finally:
        worker.kill()


def test_describe_shows_the_fields_of_the_types_a_service_uses(tmp_path: Path) -> None:
    # Before: describe printed ``lab.area(r: bench.Rect) -> float`` and nothing about Rect, so
    # the JSON argument of ``call`` could not be written without the worker's source.
    (tmp_path / "bench.py").write_text(
        """
import dataclasses
import enum

class Shade(enum.Enum):
    LIGHT = "light"
    DARK = "dark"

@dataclasses.dataclass
class Point:
    x: float
    y: float = 0.0

@dataclasses.dataclass
class Rect:
    w: float
    h: float
    corner: Point | None = None
    shade: Shade = Shade.LIGHT

class Bench:
    async def area(self, r: Rect) -> float:
        return r.w * r.h
    async def corner(self, r: Rect) -> Point | None:
        return r.corner
""",
        encoding="utf-8",
    )
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, "lab=bench:Bench", cwd=tmp_path)
    try:
        url = worker.url()
        controller = write_config(tmp_path, "controller.toml", "controller", f'dial = "{url}"')
        described = run_cli("describe", str(controller))
        assert described.returncode == 0, described.stderr
        assert described.stdout.splitlines() == [
            "unary  lab.area(r: bench.Rect) -> float",
            "unary  lab.corner(r: bench.Rect) -> bench.Point | None",
            "",
            "dataclass bench.Rect",
            "  w: float",
            "  h: float",
            "  corner: bench.Point | None = null",
            '  shade: bench.Shade = "light"',
            "dataclass bench.Point",
            "  x: float",
            "  y: float = 0.0",
            'enum bench.Shade: "light", "dark"',
        ]
        # What the lines say is enough to write the argument.
        called = run_cli(
            "call", str(controller), "lab.corner", '{"r": {"w": 2, "h": 3, "corner": {"x": 1}}}'
        )
        assert called.returncode == 0, called.stderr
        assert json.loads(called.stdout)["x"] == 1.0
        as_json = run_cli("describe", str(controller), "--json")
        assert as_json.returncode == 0, as_json.stderr
        document = json.loads(as_json.stdout)
        schema = document["types"]["lab"]["schema"]
        assert schema["methods"]["area"]["parameters"]["properties"] == {
            "r": {"$ref": "#/$defs/Rect"}
        }
        assert schema["$defs"]["Rect"]["required"] == ["w", "h"]
        assert sorted(schema["$defs"]["Shade"]["enum"]) == ["dark", "light"]
        area = document["services"]["lab"]["area"]  # the contract: the fields are part of it
        assert (area["kind"], area["signature"]) == ("unary", "(r: bench.Rect) -> float")
        records = [r[0] for m in document["services"]["lab"].values() for r in m.get("records", [])]
        assert sorted(records[i] for i, _ in area["uses"]) == ["bench.Point", "bench.Rect"]
    finally:
        worker.kill()


def test_describe_when_the_worker_is_down(tmp_path: Path, dead_port: int) -> None:
    controller = write_config(
        tmp_path, "controller.toml", "controller", f'dial = "ws://127.0.0.1:{dead_port}/executor"'
    )
    done = run_cli("describe", str(controller), "--wait", "0.5")
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert_one_error_line(done.stderr, "NOT_READY", "last dial: cannot connect to 127.0.0.1:")


def test_worker_serves_the_builtin_services_confined_to_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "note.txt").write_bytes(b"on the worker\n")
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, extra=("--builtin", "process,files", "--root", str(root)))
    try:
        url = worker.url()
        controller = write_config(tmp_path, "controller.toml", "controller", f'dial = "{url}"')
        read = run_cli("call", str(controller), "files.read", '["/note.txt"]')
        assert read.returncode == 0, read.stderr
        assert base64.b64decode(json.loads(read.stdout)["data"]) == b"on the worker\n"
        ran = run_cli("call", str(controller), "process.run", '[["sh", "-c", "pwd; exit 3"]]')
        assert ran.returncode == 0, ran.stderr
        result = json.loads(ran.stdout)
        assert result["status"]["code"] == 3
        assert base64.b64decode(result["stdout"]).decode().strip() == str(root.resolve())
        escape = run_cli("call", str(controller), "files.read", '["/../etc/passwd"]')
        assert escape.returncode == cli.EXIT_REJECTED
        assert_one_error_line(escape.stderr, "PERMISSION_DENIED")
        setuid = run_cli(
            "call", str(controller), "files.write", '{"path": "/tool", "data": "", "mode": 2541}'
        )
        assert setuid.returncode == cli.EXIT_REJECTED, setuid.stderr
        assert_one_error_line(setuid.stderr, "PERMISSION_DENIED", "allow_special_mode_bits")
        assert not (root / "tool").exists()
    finally:
        worker.kill()


def test_worker_help_names_every_line_it_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """An operator greps for these: the help names each event line the worker prints."""
    assert cli.main(["worker", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for line in ("executor-listening", "executor-dialing", "executor-ready"):
        assert line in text
    assert "executor-draining" in text and "executor-stopping" in text
    assert "NOTIFY_SOCKET" in text


def test_builtin_needs_a_root(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "cfg.toml", "--builtin", "files"]) == 2
    assert_one_error_line(capsys.readouterr().err, "--root")
    assert cli.main(["worker", "cfg.toml", "--allow-special-mode-bits"]) == 2
    assert_one_error_line(capsys.readouterr().err, "--allow-special-mode-bits", "--builtin")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_allow_special_mode_bits_reaches_the_file_service(tmp_path: Path) -> None:
    for allow in (False, True):
        factory = cli.build_services(
            [], builtin=["files"], root=str(tmp_path), allow_special_mode_bits=allow
        )
        assert callable(factory)
        async with factory(gl.ServiceScope("local", os.urandom(16))) as services:
            files = services["files"].target
            assert files.allow_special_mode_bits is allow


def test_stop_on_stdin_eof_with_stdin_at_eof_from_the_start(tmp_path: Path) -> None:
    """The watcher used to start before the signal handler: with stdin already at EOF its
    SIGTERM killed the process by default (exit 143, no executor-stopping line). ~0.7 s a run."""
    config = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    for _ in range(5):
        done = subprocess.run(
            [*CLI, "worker", str(config), "--service", SERVICE, "--stop-on-stdin-eof"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
        lines = done.stdout.splitlines()
        assert lines[0].startswith("executor-listening "), lines
        assert lines[-1] == "executor-stopping executor=cli-box reason=stdin-closed", lines


CRASH_LAUNCHER = (
    sys.executable,
    "-c",
    """
import sys
import anyio
from garcon_link import cli
from garcon_link.cli import _worker

async def crash(config, services, *more):
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.sleep_forever)
        raise RuntimeError("injected fault")

_worker._serve_until_signal = crash
sys.exit(cli.main(sys.argv[1:]))
""",
)


def test_an_internal_error_is_one_line_and_v_shows_its_traceback(tmp_path: Path) -> None:
    """A bug inside the loop (an exception group holding a RuntimeError) used to print a
    92-line traceback ending in NoEventLoopError: the formatter called anyio after the loop."""
    config = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    done = subprocess.run(
        [*CRASH_LAUNCHER, "worker", str(config)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == cli.EXIT_OTHER == 1, done.stderr
    assert_one_error_line(done.stderr, "internal error, RuntimeError: injected fault", "-v")
    verbose = subprocess.run(
        [*CRASH_LAUNCHER, "worker", str(config), "-v"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert verbose.returncode == 1, verbose.stderr
    assert "Traceback" in verbose.stderr and "NoEventLoopError" not in verbose.stderr
    assert "| RuntimeError: injected fault" in verbose.stderr  # inside the group's traceback
    last = verbose.stderr.strip().splitlines()[-1]
    assert last == "error: internal error, RuntimeError: injected fault", last


def test_describing_a_failure_needs_no_event_loop() -> None:
    group = BaseExceptionGroup("outer", [ExceptionGroup("inner", [ValueError("bad")])])
    assert isinstance(_leaf(group), ValueError)
    assert _describe(_leaf(group)).startswith("internal error, ValueError: bad")
    assert _describe(OSError(98, "Address already in use")) == "Address already in use"
    assert cli.exit_code_for(_leaf(group)) == 1


# --------------------------------------------------------------------------- exit codes


def test_not_dispatched_when_the_worker_is_down(tmp_path: Path, dead_port: int) -> None:
    """--wait: the old behaviour, for a worker that is starting (refused dials go on)."""
    controller = write_config(
        tmp_path, "controller.toml", "controller", f'dial = "ws://127.0.0.1:{dead_port}/executor"'
    )
    started = time.monotonic()
    done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--wait", "0.5")
    assert done.returncode == cli.EXIT_NOT_DISPATCHED == 3
    assert done.stdout == ""
    assert_one_error_line(done.stderr, "[not_dispatched:NOT_READY]", "not ready within 0.5s")
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("command", ["call", "describe"])
def test_nothing_listening_fails_fast_naming_the_address_and_the_field(
    tmp_path: Path, dead_port: int, command: str
) -> None:
    """Dials refused at the TCP level end the command after a few attempts, not at --timeout:
    exit 3 with the address, the config field that holds it, and --wait."""
    controller = write_config(
        tmp_path, "controller.toml", "controller", f'dial = "ws://127.0.0.1:{dead_port}/executor"'
    )
    operands = ["demo.add", "[1, 2]"] if command == "call" else []
    started = time.monotonic()
    done = run_cli(command, str(controller), *operands, "--timeout", "600", timeout=120)
    assert time.monotonic() - started < 100  # a guard only: --timeout would be 600 s
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert done.stdout == ""
    assert_one_error_line(
        done.stderr,
        "[not_dispatched:UNREACHABLE]",
        f"cannot connect to 127.0.0.1:{dead_port}: Connection refused",
        f'[connection] dial = "ws://127.0.0.1:{dead_port}/executor" in controller.toml',
        "--wait S",
    )


def test_a_wss_dial_at_a_plain_text_worker_fails_fast_naming_the_url(
    listening_worker: tuple[Worker, Path], tmp_path: Path
) -> None:
    """A server that answers in plain text where TLS was asked for will answer the same way to
    every redial: the command ends as for a refused dial, not at --timeout."""
    worker, _ = listening_worker
    url = worker.url().replace("ws://", "wss://")
    controller = write_config(tmp_path, "controller.toml", "controller", f'dial = "{url}"')
    started = time.monotonic()
    done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--timeout", "600", timeout=120)
    assert time.monotonic() - started < 100  # a guard only: --timeout would be 600 s
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert_one_error_line(
        done.stderr, "[not_dispatched:UNREACHABLE]", url, "answered in plain text, not TLS"
    )
    assert "dials in a row" not in done.stderr  # the first such dial ends the command


def test_wait_must_be_positive(tmp_path: Path) -> None:
    done = run_cli("call", "demo.add", "--wait", "0")
    assert done.returncode == cli.EXIT_USAGE
    assert_one_error_line(done.stderr, "--wait must be > 0", "--wait 30")


def test_not_dispatched_when_no_worker_dials_in(tmp_path: Path) -> None:
    controller = write_config(tmp_path, "controller.toml", "controller", 'listen = "127.0.0.1:0"')
    done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--timeout", "0.5")
    assert done.returncode == 3
    assert_one_error_line(done.stderr, "[not_dispatched:NOT_READY]")


def test_a_worker_with_every_place_taken_is_not_asked_whether_it_runs(tmp_path: Path) -> None:
    """A worker that refuses a controller because max_controllers are held (1013) runs: the
    message says so and names the bound, instead of asking whether the worker runs."""
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    with worker_toml.open("a", encoding="utf-8") as file:
        file.write("max_controllers = 1\n")  # in the [limits] table FAST_LIMITS ends with
    worker = Worker(worker_toml, SERVICE)
    holder: subprocess.Popen[bytes] | None = None
    try:
        controller = write_config(tmp_path, "c.toml", "controller", f'dial = "{worker.url()}"')
        holder = subprocess.Popen(
            [*CLI, "call", str(controller), "demo.hold", "[30]"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        worker.wait_line("executor-ready")
        done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--timeout", "1")
        assert done.returncode == cli.EXIT_NOT_DISPATCHED
        assert_one_error_line(
            done.stderr, "NOT_READY", "max_controllers=1", "every session place it has is taken"
        )
        assert "is the worker running?" not in done.stderr
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=10)
        worker.kill()


def test_a_call_to_a_draining_worker_says_it_drains(tmp_path: Path) -> None:
    """A worker told to stop still finishes its running call; a new ``call`` or ``describe``
    meanwhile is told at once -- not at ``--timeout`` -- that the worker drains (exit 3,
    DRAINING), not asked whether it runs; the worker admits no session for them."""
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, SERVICE, extra=("--drain", "30"))
    holder: subprocess.Popen[bytes] | None = None
    try:
        controller = write_config(tmp_path, "c.toml", "controller", f'dial = "{worker.url()}"')
        holder = subprocess.Popen(
            [*CLI, "call", str(controller), "demo.hold", "[30]"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while run_cli("call", str(controller), "demo.holding").stdout.strip() != "1":
            assert time.monotonic() < deadline, "the held call never started"
            assert holder.poll() is None
        worker.process.send_signal(signal.SIGTERM)
        assert worker.wait_line("executor-draining").endswith("running=1")
        # The subprocess bound (20 s) is far below --timeout: waiting it out fails the test.
        done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--timeout", "60", timeout=20)
        assert done.returncode == cli.EXIT_NOT_DISPATCHED
        assert_one_error_line(done.stderr, "[not_dispatched:DRAINING]", "is draining", "--wait")
        described = run_cli("describe", str(controller), "--timeout", "60", timeout=20)
        assert described.returncode == cli.EXIT_NOT_DISPATCHED
        assert_one_error_line(described.stderr, "[not_dispatched:DRAINING]", "is draining")
        worker.process.kill()
        worker.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not worker.drained():  # until the reader thread has seen stdout end
            assert time.monotonic() < deadline, worker.lines
            time.sleep(0.01)
        after = worker.lines[worker.lines.index(worker.wait_line("executor-draining")) :]
        assert not [line for line in after if line.startswith("executor-ready")], after
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=10)
        worker.kill()


class _GatewaySaysDraining:
    """What ``call`` sees of an executor through a gateway that reports it ``draining``: every
    wait for readiness runs out (``GatewayExecutor``'s surface, as ``_executor_ready`` uses it)."""

    executor_id = "box-1"
    availability = "draining"

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def wait_ready(self, timeout: float | None = None) -> None:
        assert timeout is not None
        self.waits.append(timeout)
        await anyio.lowlevel.checkpoint()
        raise TimeoutError


def test_through_a_gateway_a_draining_executor_fails_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without ``--wait``: DRAINING after the first slice of the wait, not at ``--timeout``, and
    no 'waiting for' line; with ``--wait``, the wait goes on (for the restarted worker)."""
    executor = _GatewaySaysDraining()
    gateway_executor = cast("GatewayExecutor", executor)
    with pytest.raises(gl.NotDispatched) as refused:
        anyio.run(lambda: _call._executor_ready(gateway_executor, 60.0, fail_draining=True))
    assert refused.value.code == "DRAINING"
    assert "is draining at the gateway" in refused.value.message
    assert executor.waits == [_call.NOTICE_AFTER]
    assert capsys.readouterr().err == ""
    waited = _GatewaySaysDraining()
    with pytest.raises(gl.NotDispatched) as late:
        anyio.run(lambda: _call._executor_ready(cast("GatewayExecutor", waited), 0.05))
    assert late.value.code == "NOT_READY" and waited.waits


def test_a_certificate_that_does_not_verify_is_named_as_the_cause() -> None:
    why = (
        "executor 'box' not ready within 10s: last dial: TLS handshake with 127.0.0.1:8443 "
        "failed: CERTIFICATE_VERIFY_FAILED"
    )
    hint = _call._not_ready_hint(why, "worker")
    assert "certificate does not verify" in hint and "[tls] ca" in hint
    assert "running?" not in hint
    assert _call._not_ready_hint("last dial: timed out", "gateway") == "is the gateway running?"
    held = "closed by peer code=4004 cause='another peer holds a healthy session'"
    assert "its own controller_id" in _call._not_ready_hint(held, "worker")


@pytest.mark.parametrize("names", [("127.0.0.1",), ("elsewhere.example",)], ids=["ca", "name"])
def test_a_certificate_that_does_not_verify_is_not_called_unreachable(
    tmp_path: Path, names: tuple[str, ...]
) -> None:
    """A TLS worker whose certificate the controller cannot verify (a CA it does not trust, or
    a certificate for another name) runs: the hint names the trust store, the name and the
    validity dates, not whether the worker runs there or --wait."""
    issuer, trusted = trustme.CA(), trustme.CA()
    issuer.issue_cert(*names).private_key_and_cert_chain_pem.write_to_path(tmp_path / "w.pem")
    (issuer if names != ("127.0.0.1",) else trusted).cert_pem.write_to_path(tmp_path / "ca.pem")
    worker_toml = write_config(
        tmp_path,
        "worker.toml",
        "worker",
        'listen = "127.0.0.1:0"\n\n[tls]\ncert = "w.pem"\nkey = "w.pem"\n',
    )
    worker = Worker(worker_toml, SERVICE)
    try:
        url = worker.url()
        assert url.startswith("wss://")
        dial = f'dial = "{url}"\n\n[tls]\nca = "ca.pem"\n'
        controller = write_config(tmp_path, "c.toml", "controller", dial)
        done = run_cli("call", str(controller), "demo.add", "[1, 2]", "--timeout", "60", timeout=20)
    finally:
        worker.kill()
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert_one_error_line(
        done.stderr,
        "[not_dispatched:UNREACHABLE]",
        "CERTIFICATE_VERIFY_FAILED",
        '[tls] ca = "',
        "must name the host or IP address of [connection] dial",
        "validity dates",
    )
    assert "runs there" not in done.stderr and "--wait" not in done.stderr


def test_a_listening_call_met_by_a_worker_with_another_secret_says_so(tmp_path: Path) -> None:
    """The worker dials in, and its proof does not verify: the message names the secret, not
    whether the worker runs."""
    port = free_port()
    controller = write_config(tmp_path, "c.toml", "controller", f'listen = "127.0.0.1:{port}"')
    other = tmp_path / "other"
    other.mkdir()
    worker_toml = write_config(
        other, "w.toml", "worker", f'dial = "ws://127.0.0.1:{port}/executor"'
    )
    caller = subprocess.Popen(
        [*CLI, "call", str(controller), "demo.add", "[1, 2]", "--timeout", "3"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    worker = Worker(worker_toml, SERVICE)
    try:
        _, stderr = caller.communicate(timeout=30)
    finally:
        worker.kill()
    assert caller.returncode == cli.EXIT_NOT_DISPATCHED
    assert_one_error_line(stderr, "proof did not verify", "same secret (secret_file)")
    assert "running?" not in stderr


def test_wrong_secret_exits_8_at_once_and_says_what_to_fix(
    listening_worker: tuple[Worker, Path], tmp_path: Path
) -> None:
    """A refusal that will not heal is reported at once with its own exit code, not as
    NOT_READY when --timeout ends."""
    worker, _ = listening_worker
    wrong = write_config(tmp_path, "controller.toml", "controller", f'dial = "{worker.url()}"')
    done = run_cli("call", str(wrong), "demo.add", "[1, 2]", "--timeout", "30")
    assert done.returncode == cli.EXIT_REFUSED == 8
    assert_one_error_line(done.stderr, "proof did not verify", "same secret (secret_file)")
    # A gateway's caller is told where a gateway keeps its key.
    gl.write_secret_file(tmp_path / "web-1.secret")
    caller = tmp_path / "caller.toml"
    caller.write_text(
        'role = "caller"\ncaller_id = "web-1"\nsecret_file = "web-1.secret"\n'
        f'[connection]\ndial = "{worker.url()}"\n',
        encoding="utf-8",
    )
    done = run_cli("call", str(caller), "--executor", "box-1", "demo.add", "[1, 2]")
    assert done.returncode == cli.EXIT_REFUSED
    assert_one_error_line(done.stderr, "proof did not verify", "callers/<caller_id>.secret")


@pytest.mark.parametrize(
    ("target", "arguments", "fragment"),
    [
        ("demo.nope", "[]", "[rejected:OPERATION_UNSUPPORTED]"),
        ("nope.add", "[1, 2]", "[rejected:UNKNOWN_SERVICE]"),
        ("demo.add", '["x", 2]', "[rejected:INVALID_ARGUMENTS]"),
        ("demo.add", "[1]", "[rejected:INVALID_ARGUMENTS]"),
        ("demo._private", "[]", "[rejected:"),
    ],
)
def test_rejected_exit_code(
    listening_worker: tuple[Worker, Path], target: str, arguments: str, fragment: str
) -> None:
    _, controller = listening_worker
    done = run_cli("call", str(controller), target, arguments)
    assert done.returncode == cli.EXIT_REJECTED == 4
    assert done.stdout == ""
    assert_one_error_line(done.stderr, fragment)


def test_remote_error_exit_code(listening_worker: tuple[Worker, Path]) -> None:
    _, controller = listening_worker
    done = run_cli("call", str(controller), "demo.fail", '["kaput"]')
    assert done.returncode == cli.EXIT_REMOTE_ERROR == 5
    assert_one_error_line(done.stderr, "[failed:HANDLER_FAILED] kaput", "builtins.ValueError")
    verbose = run_cli("call", "-v", str(controller), "demo.fail", '["kaput"]')
    assert verbose.returncode == 5
    assert "Traceback" in verbose.stderr  # the *remote* traceback, on request only
    assert verbose.stderr.strip().splitlines()[-1].startswith("error: [failed:HANDLER_FAILED]")


def test_outcome_unknown_exit_code_on_call_timeout(listening_worker: tuple[Worker, Path]) -> None:
    _, controller = listening_worker
    done = run_cli("call", str(controller), "demo.hold", "[10]", "--call-timeout", "0.3")
    assert done.returncode == cli.EXIT_OUTCOME_UNKNOWN == 6
    assert_one_error_line(done.stderr, "[unknown:TIMEOUT]")


# --------------------------------------------------------------------------- clean errors


def test_bad_config_path_is_one_clean_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    for command in (["call", str(missing), "demo.add"], ["worker", str(missing)]):
        done = run_cli(*command)
        assert done.returncode == 2
        assert_one_error_line(done.stderr, str(missing), "not found")


def test_config_errors_and_wrong_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("executor_id = \n", encoding="utf-8")
    assert cli.main(["call", str(bad), "demo.add"]) == 2
    assert_one_error_line(capsys.readouterr().err, "TOML syntax error")
    # A file of the other role names the command and the file it needs, not an API function.
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    controller_toml = write_config(
        tmp_path, "controller.toml", "controller", 'dial = "ws://127.0.0.1:1/executor"'
    )
    for argv, command, role in (
        (["call", str(worker_toml), "demo.add"], "call", "controller"),
        (["describe", str(worker_toml)], "describe", "controller"),
        (["fleet", str(worker_toml)], "fleet", "controller"),
        (["worker", str(controller_toml)], "worker", "worker"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert_one_error_line(err, f"`garcon-link {command}` needs a {role}'s", f"{role}.toml")
        assert "()" not in err, err
    # No CONFIG and no $GARCON_LINK_CONFIG: the command line to write, not load_config().
    env_missing = {k: v for k, v in os.environ.items() if k != CONFIG_ENV_VAR}
    for argv, example in (
        (["call", "demo.add"], "garcon-link call controller.toml demo.add"),
        (["describe"], "garcon-link describe controller.toml"),
        (["worker"], "garcon-link worker worker.toml"),
        (["gateway"], "garcon-link gateway gateway.toml"),
    ):
        done = run_cli(*argv, env=env_missing)
        assert done.returncode == 2
        assert_one_error_line(done.stderr, CONFIG_ENV_VAR, example)
        assert "load_config" not in done.stderr, done.stderr


def test_port_in_use_is_exit_1(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path, "worker.toml", "worker", f'listen = "127.0.0.1:{port}"')
        done = run_cli("worker", str(config))
    assert done.returncode == 1
    assert_one_error_line(
        done.stderr,
        f"cannot listen on 127.0.0.1:{port}",
        "another process listens there",
        "change [connection] listen",
    )


@pytest.mark.parametrize("command", ["call", "describe"])
def test_a_listening_call_on_a_busy_port_names_the_controller_there(
    tmp_path: Path, command: str
) -> None:
    """``call`` with a listening configuration is a controller itself: on a port another
    controller holds (``garcon-link fleet`` on the same file) it says so."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = write_config(tmp_path, "c.toml", "controller", f'listen = "127.0.0.1:{port}"')
        operands = ["demo.add", "[1, 2]"] if command == "call" else []
        done = run_cli(command, str(config), *operands)
    assert done.returncode == 1
    assert_one_error_line(
        done.stderr,
        f"cannot listen on 127.0.0.1:{port}",
        f"`garcon-link {command}` is a controller of its own",
        "make the call from that program",
    )


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["call", "cfg.toml", "demo.add", "[1,"], "not valid JSON"),
        (["call", "cfg.toml", "demo.add", "[" + "9" * 5000 + "]"], "not valid JSON"),
        (["call", "cfg.toml", "demo.add", '"x"'], "JSON array"),
        (["call", "cfg.toml", "demo.add", "[" * 100_000], "nests arrays or objects too deeply"),
        (["call", "cfg.toml", "noservice"], "SERVICE.METHOD"),
        (["call", "a", "b", "c", "d"], "SERVICE.METHOD"),
        (["call", "cfg.toml", "demo.add", "--timeout", "0"], "--timeout"),
        (["worker", "cfg.toml", "--service", "oops"], "NAME=module:attr"),
        (["worker", "cfg.toml", "--service", "x=no_such_module_xyz:y"], "cannot import"),
        (["worker", "cfg.toml", "--service", "x=garcon_link.demo:Nope"], "no attribute"),
        (["worker", "cfg.toml", "--service", "x=garcon_link.demo:DemoApi"], "instantiate"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, fragment)


def test_duplicate_service_names_are_refused() -> None:
    with pytest.raises(cli.UsageError, match="given twice"):
        cli.build_services(["d=garcon_link.demo:DemoService", "d=garcon_link.demo:DemoService"])


def test_spool_dir_needs_the_builtin_process_service(tmp_path: Path) -> None:
    with pytest.raises(cli.UsageError, match="--spool-dir"):
        cli.build_services([], spool_dir=str(tmp_path))
    with pytest.raises(gl.ConfigError, match="spool directory"):
        cli.build_services(
            [], builtin=["process"], root=str(tmp_path), spool_dir=str(tmp_path / "missing")
        )
    assert callable(
        cli.build_services([], builtin=["process"], root=str(tmp_path), spool_dir=str(tmp_path))
    )


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "error:" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2
    assert cli.main(["--help"]) == 0
    help_text = capsys.readouterr().out
    for code in ("3    NotDispatched", "4    Rejected", "5    RemoteError", "6    OutcomeUnknown"):
        assert code in help_text


# --------------------------------------------------------------------------- helpers, in process


def test_split_call_operands() -> None:
    split = _call._split_call_operands
    assert split(["calc.add"]) == (None, "calc.add", None)
    assert split(["calc.add", "[1]"]) == (None, "calc.add", "[1]")
    assert split(["calc.add", '{"a": 1}']) == (None, "calc.add", '{"a": 1}')
    assert split(["c.toml", "calc.add"]) == ("c.toml", "calc.add", None)
    assert split(["c.toml", "calc.add", "[1]"]) == ("c.toml", "calc.add", "[1]")


def test_jsonable_bytes_are_base64() -> None:
    value = {"blob": b"\x00\xff", b"k": [1, (2, 3)], 7: None}
    assert cli.jsonable(value) == {"blob": "AP8=", "aw==": [1, [2, 3]], "7": None}


def test_dynamic_method_from_a_manifest() -> None:
    services = {"calc": {"add": {"kind": "unary", "signature": "(a: int, b: int)"}}}
    spec = cli.dynamic_method(services, "calc", "add")
    assert spec.kind is MethodKind.UNARY
    assert spec.result is Any  # no return type in the signature: nothing to check
    typed = {"calc": {"add": {"kind": "unary", "signature": "(a: int, b: int) -> int"}}}
    assert cli.dynamic_method(typed, "calc", "add").result is int
    assert spec.bind((1,), {"b": 2}) == ([1], {"b": 2})
    with pytest.raises(gl.Rejected, match="UNKNOWN_SERVICE"):
        cli.dynamic_method(services, "nope", "add")
    with pytest.raises(gl.Rejected, match="OPERATION_UNSUPPORTED"):
        cli.dynamic_method(services, "calc", "sub")


def test_exit_code_table() -> None:
    assert cli.exit_code_for(gl.NotDispatched("X")) == 3
    assert cli.exit_code_for(gl.Rejected("X")) == 4
    assert cli.exit_code_for(gl.StaleResource()) == 4
    assert cli.exit_code_for(gl.RemoteError("X")) == 5
    assert cli.exit_code_for(gl.OutcomeUnknown("X")) == 6
    assert cli.exit_code_for(gl.ConfigError("x")) == 2
    assert cli.exit_code_for(gl.LinkError("x")) == 1
    assert cli.exit_code_for(RuntimeError("x")) == 1


STUCK_SCAN_LAUNCHER = (
    sys.executable,
    "-c",
    """
import os
import sys
from garcon_link import cli

fifo = os.environ["STUCK_FIFO"]
real_scandir = os.scandir

def stuck_scandir(fd):
    # Blocks in open(2) of a FIFO nobody writes: a system call that never returns, as a read on
    # a hung network file system does.
    print("scan-stuck", flush=True)
    with open(fifo, "rb"):
        pass
    return real_scandir(fd)

os.scandir = stuck_scandir
sys.exit(cli.main(sys.argv[1:]))
""",
)


def test_sigterm_stops_the_worker_while_a_file_read_is_stuck(tmp_path: Path) -> None:
    """Break 6 (shutdown): a read stuck in the OS used to hold a SIGTERM'd worker forever (its
    uncancellable thread was joined at exit). Now the read is abandoned. About 2 s."""
    root = tmp_path / "root"
    root.mkdir()
    fifo = tmp_path / "stuck.fifo"
    os.mkfifo(fifo)
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(
        worker_toml,
        # The stuck call is in flight: the drain waits for it (1 s here), then it is abandoned.
        extra=("--builtin", "files", "--root", str(root), "--drain", "1"),
        launcher=STUCK_SCAN_LAUNCHER,
        env={**os.environ, "STUCK_FIFO": str(fifo)},
    )
    call: subprocess.Popen[str] | None = None
    try:
        controller = write_config(
            tmp_path, "controller.toml", "controller", f'dial = "{worker.url()}"'
        )
        call = subprocess.Popen(
            [*CLI, "call", str(controller), "files.list_dir", '["/"]', "--timeout", "20"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker.wait_line("scan-stuck")
        worker.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert worker.process.wait(timeout=10) == 0  # before the fix: never (TimeoutExpired)
        assert time.monotonic() - started < 10
        assert worker.wait_line("executor-stopping").endswith("reason=SIGTERM")
    finally:
        with contextlib.suppress(OSError):  # let a thread stuck in the open go (before the fix)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.kill()
        if call is not None:
            if call.poll() is None:
                call.kill()
            call.communicate(timeout=10)


# -------------------------------------------------------------------------------------- polish


def test_python_m_garcon_link_is_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "garcon_link", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: garcon-link" in done.stdout
    assert "init" in done.stdout


def test_v_is_accepted_before_the_command_as_well_as_after(tmp_path: Path, dead_port: int) -> None:
    assert cli.main(["-v", "keygen", str(tmp_path / "a.secret")]) == 0
    assert cli.main(["keygen", "-v", str(tmp_path / "b.secret")]) == 0
    controller = write_config(
        tmp_path, "controller.toml", "controller", f'dial = "ws://127.0.0.1:{dead_port}/executor"'
    )
    # -v before the command logs as -v after it does: the dial failures are warnings.
    done = run_cli("-v", "call", str(controller), "demo.add", "[1, 2]", "--wait", "0.5")
    assert done.returncode == cli.EXIT_NOT_DISPATCHED, done.stderr
    assert "WARNING" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: [not_dispatched:NOT_READY]")


HELP_COMMANDS = ("demo", "worker", "keygen", "init", "call", "describe", "stub", "fleet", "gateway")


@pytest.mark.parametrize(
    "command",
    [[], *([name] for name in HELP_COMMANDS)],
)
def test_help_is_wrapped_to_the_terminal(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main([*command, "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: garcon-link")
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, too_long
    # Every operand and option says what it is: argparse prints one without help text as its
    # name alone, with no description beside it or indented below it.
    undescribed, section = [], False
    lines = text.splitlines()
    for line, following in zip(lines, [*lines[1:], ""], strict=True):
        if line in ("positional arguments:", "options:"):
            section = True
        elif not line.strip():
            section = False
        elif (
            section
            and line.startswith("  ")
            and not line.startswith("   ")
            and "  " not in line.strip()
            and not following.startswith("   ")
        ):
            undescribed.append(line.strip())
    assert not undescribed, undescribed


def test_a_worker_with_no_services_warns_on_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    for services in ([], ["--service", SERVICE]):
        done = subprocess.run(
            [*CLI, "worker", str(config), "--stop-on-stdin-eof", *services],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
        if services:
            assert warnings == []
        else:
            assert len(warnings) == 1, done.stderr
            assert "serves nothing" in warnings[0]
            assert "--service NAME=module:attr" in warnings[0]


def interrupt(process: subprocess.Popen[str], signum: int = signal.SIGINT) -> tuple[int, str]:
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=30)
    return process.returncode, stderr


@pytest.mark.parametrize(
    ("signum", "said"),
    [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated (SIGTERM)")],
)
def test_ctrl_c_during_call_says_the_call_was_sent_and_may_have_run(
    tmp_path: Path, signum: int, said: str
) -> None:
    """Ctrl-C, and SIGTERM (``timeout``, a supervisor) alike."""
    # A second controller would replace the session (and cancel the call): the handler tells
    # the test that it runs by creating a file.
    (tmp_path / "held.py").write_text(
        "import pathlib\nimport anyio\n\n"
        "class Held:\n"
        "    async def hold(self) -> None:\n"
        "        pathlib.Path('started').touch()\n"
        "        await anyio.sleep(60)\n",
        encoding="utf-8",
    )
    worker_toml = write_config(tmp_path, "worker.toml", "worker", 'listen = "127.0.0.1:0"')
    worker = Worker(worker_toml, "held=held:Held", cwd=tmp_path)
    call = None
    try:
        controller = write_config(
            tmp_path, "controller.toml", "controller", f'dial = "{worker.url()}"'
        )
        call = subprocess.Popen(
            [*CLI, "call", str(controller), "held.hold"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not (tmp_path / "started").exists():
            assert time.monotonic() < deadline, "the held call never started"
            assert call.poll() is None, call.communicate()
            time.sleep(0.02)
        code, stderr = interrupt(call, signum)
        assert code == cli.EXIT_INTERRUPTED
        assert_one_error_line(stderr, f"{said} after the call was sent", "may have run")
    finally:
        if call is not None and call.poll() is None:
            call.kill()
            call.communicate(timeout=10)
        worker.kill()


def test_ctrl_c_before_the_call_is_sent_says_it_did_not_run(tmp_path: Path, dead_port: int) -> None:
    controller = write_config(
        tmp_path, "controller.toml", "controller", f'dial = "ws://127.0.0.1:{dead_port}/executor"'
    )
    call = subprocess.Popen(
        [*CLI, "call", "-v", str(controller), "demo.add", "[1, 2]", "--timeout", "60"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert call.stderr is not None
        # The first logged dial failure: the event loop runs and the call waits for readiness.
        for _ in range(100):
            line = call.stderr.readline()
            assert line, "call exited before dialing"
            if "dial" in line:
                break
        code, stderr = interrupt(call)
        assert code == cli.EXIT_INTERRUPTED
        # -v may log more dial failures before the interruption: the error line is the last.
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert errors == [stderr.strip().splitlines()[-1]], stderr
        assert "interrupted before the call was sent" in errors[0]
        assert "did not run" in errors[0]
    finally:
        if call.poll() is None:
            call.kill()
            call.communicate(timeout=10)


def test_a_sigterm_after_a_short_timeout_leaves_the_timeout_s_outcome(tmp_path: Path) -> None:
    """``--timeout 0.3`` ends the call (NOT_READY, exit 3); SIGTERMs sent from the moment its
    error line is out until the process has exited change nothing: no death by signal, no
    second line (SIGTERM is ignored once the outcome is settled)."""
    port = free_port()
    controller = write_config(tmp_path, "c.toml", "controller", f'listen = "127.0.0.1:{port}"')
    call = subprocess.Popen(
        [*CLI, "call", str(controller), "demo.add", "[1, 2]", "--timeout", "0.3"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert call.stderr is not None
        first = call.stderr.readline()  # the error line: the outcome is settled
        assert first.startswith("error: [not_dispatched:NOT_READY]"), first
        sent = 0
        while call.poll() is None and sent < 10_000:  # until it has exited (bounded)
            with contextlib.suppress(ProcessLookupError):
                call.send_signal(signal.SIGTERM)
            sent += 1
            time.sleep(0.001)
        _, rest = call.communicate(timeout=30)
        assert call.returncode == cli.EXIT_NOT_DISPATCHED, (sent, rest)
        assert rest == "", rest
    finally:
        if call.poll() is None:
            call.kill()
        call.communicate(timeout=10)


def test_a_sigterm_while_call_loads_its_config_says_it_did_not_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The SIGTERM handler is in place before anything of ``call`` can take time: a SIGTERM
    while CONFIG is read is the one ``terminated before the call was sent`` line, exit 130."""
    controller = write_config(tmp_path, "c.toml", "controller", 'listen = "127.0.0.1:0"')
    loaded: list[bool] = []

    def load_then_terminated(*args: Any) -> Any:
        loaded.append(True)
        signal.raise_signal(signal.SIGTERM)  # as timeout(1) would, while CONFIG is read
        return real_load(*args)

    real_load = _output._load_caller_or_any
    monkeypatch.setattr(_call, "_load_caller_or_any", load_then_terminated)
    # This process's own handler, so that a SIGTERM that call does not handle is only counted.
    missed: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: missed.append(signum))
    try:
        code = cli.main(["call", str(controller), "demo.add", "[1, 2]", "--timeout", "0.3"])
        restored = signal.getsignal(signal.SIGTERM)
    finally:
        guard = signal.signal(signal.SIGTERM, previous)
    assert (code, loaded, missed) == (cli.EXIT_INTERRUPTED, [True], [])
    assert_one_error_line(capsys.readouterr().err, "terminated (SIGTERM) before the call was sent")
    assert restored is guard  # a caller of main() gets its handler back


# --------------------------------------------------------------------------- stub

TYPING_FIXTURES = Path(__file__).resolve().parent / "typing"


@pytest.mark.parametrize(("options", "view"), [(["--sync"], "LabSync"), ([], "Lab")])
def test_stub_prints_a_view_that_pastes_as_is(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    options: list[str],
    view: str,
) -> None:
    # Before: there was no ``stub`` command (exit 2), and the sync view garcon-link showed (in
    # connect_sync's error) lacked its imports.
    import importlib

    from garcon_link.rpc.interface import service_spec
    from garcon_link.rpc.views import sync_service_spec

    (tmp_path / "lab_interface.py").write_bytes((TYPING_FIXTURES / "lab_interface.py").read_bytes())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lab_interface", "pasted_stub"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # imported afresh, forgotten after
    assert cli.main(["stub", "lab_interface:Lab", *options]) == 0
    printed = capsys.readouterr()
    assert printed.err == ""
    assert printed.out.startswith("import datetime\nimport uuid\n")
    (tmp_path / "pasted_stub.py").write_text(printed.out, encoding="utf-8")
    pasted = getattr(importlib.import_module("pasted_stub"), view)
    lab = importlib.import_module("lab_interface")
    derive = sync_service_spec if options else service_spec
    assert derive(pasted).manifest() == service_spec(lab.Lab).manifest()
    assert {"area", "scale", "pick", "walk", "job", "stamp", "note"} <= set(vars(pasted))


def test_stub_refuses_what_is_not_an_interface(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "not_one.py").write_text("VALUE = 1\nclass Plain:\n    def run(self) -> int: ...\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "not_one", raising=False)
    for target, message in [
        ("not_one", "expected MODULE:ATTR"),
        ("no_such_module:X", "cannot import module 'no_such_module'"),
        ("not_one:Nope", "has no attribute 'Nope'"),
        ("not_one:VALUE", "VALUE is not a class"),
        ("not_one:Plain", "Plain.run is a plain `def`"),
    ]:
        assert cli.main(["stub", target, "--sync"]) == cli.EXIT_USAGE, target
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("command", "listed", "absent"),
    [
        ("worker", ["  7 "], ["NotDispatched", "RemoteError", "  8 "]),
        ("keygen", ["  2 "], ["NotDispatched", "  7 "]),
        ("describe", ["NotDispatched", "  8 "], ["RemoteError", "Rejected", "  7 "]),
        ("call", ["NotDispatched", "Rejected", "RemoteError", "OutcomeUnknown"], ["  7 "]),
    ],
)
def test_command_help_lists_only_its_own_exit_codes(
    command: str, listed: list[str], absent: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command, "--help"]) == 0
    codes = capsys.readouterr().out.split("exit codes:", 1)[1]
    for text in listed:
        assert text in codes, (command, text)
    for text in absent:
        assert text not in codes, (command, text)


def test_describe_lines_escape_what_a_hostile_worker_names() -> None:
    """The manifest is the worker's text: an escape sequence in a method name or signature
    reaches the terminal escaped, and a huge signature is cut."""
    from garcon_link.cli._call import DESCRIBE_LINE_CHARS, describe_lines

    services = {
        "calc": {
            "add\x1b[2J": {"kind": "unary", "signature": "(a: int) -> int\r\n\x07"},
            "big": {"kind": "unary", "signature": "(" + "a" * 100_000 + ")"},
        }
    }
    lines = describe_lines(services)
    assert lines[0] == "unary  calc.add\\x1b[2J(a: int) -> int\\r\\n\\x07"
    assert all(line.isprintable() and line.isascii() for line in lines)
    assert len(lines[1]) <= DESCRIBE_LINE_CHARS + 40 and lines[1].endswith(" chars)")


@pytest.mark.parametrize("flags", [[], ["-vv"], ["--log-json"]])
def test_main_called_in_a_program_leaves_its_root_logger_as_it_was(
    tmp_path: Path, flags: list[str]
) -> None:
    """A command sets up the root logger for the process it is; a program calling ``main()``
    gets its own handlers and level back (its later log records are not dropped)."""
    import logging

    root = logging.getLogger()
    mine = logging.NullHandler()
    level, handlers = root.level, list(root.handlers)
    root.addHandler(mine)
    root.setLevel(logging.INFO)
    try:
        missing = tmp_path / "missing.toml"
        assert cli.main([*flags, "call", str(missing), "calc.add", "[1, 2]"]) == cli.EXIT_USAGE
        assert root.level == logging.INFO
        assert mine in root.handlers
        assert all(h in root.handlers for h in handlers)
        assert len(root.handlers) == len(handlers) + 1
    finally:
        root.removeHandler(mine)
        root.setLevel(level)


_SIGNAL_TO_ANOTHER_THREAD = """
import asyncio, signal, socket, threading, time
import anyio
from garcon_link.cli._lifecycle import StopSignals

async def main() -> None:
    fallback_r, fallback_w = socket.socketpair()
    asyncio.get_running_loop().add_reader(fallback_r.fileno(), fallback_r.recv, 1)
    sent_at = []
    with StopSignals() as signals:
        waiting = threading.Event()

        def other_thread() -> None:
            waiting.wait()
            time.sleep(0.2)  # the loop is idle in its poll by then, with no timer
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            time.sleep(2.0)
            sent_at.append(time.monotonic())
            fallback_w.send(b"x")  # the loop's next wake-up for something else

        threading.Thread(target=other_thread, daemon=True).start()
        waiting.set()
        name = signal.Signals(await signals.next()).name
        got_at = time.monotonic()
    print(name, "before the fallback" if not sent_at or got_at < sent_at[0] else "after it")

anyio.run(main)
"""


def test_a_stop_signal_delivered_to_another_thread_wakes_an_idle_loop() -> None:
    """A SIGTERM the kernel hands to a thread other than the loop's (the stdin watcher's
    os.kill, a worker thread under a supervisor's kill) reaches ``StopSignals.next()`` at once,
    not when the idle loop next wakes for something else (here a byte sent 2 s later)."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGNAL_TO_ANOTHER_THREAD],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "SIGTERM before the fallback"
