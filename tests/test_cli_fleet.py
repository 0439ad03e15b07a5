"""The command line of a controller for many executors, as a user runs it.

* ``garcon-link fleet CONFIG --json`` prints one JSON line per event as workers dial in, and
  exits 0 on SIGTERM; without a terminal and without ``--json`` it prints ``key=value`` lines;
* ``garcon-link call CONFIG --executor ID ...`` calls one executor of a fleet configuration
  (here one that dials two listening workers), and refuses a missing or unknown ``--executor``;
  ``describe --executor ID`` describes one;
* ``garcon-link worker`` exits 7 with one line when another process took over its executor id
  (SIGSTOP the first, start a second with the same id, SIGCONT the first).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cli import CLI, FAST_LIMITS, Worker, assert_one_error_line, run_cli
from test_systemd import rest

import garcon_link as gl
from garcon_link import cli

pytestmark = pytest.mark.timeout(60)

SERVICE_MODULE = """
import os


class Who:
    async def whoami(self) -> str:
        return os.environ["WHO"]
"""


def worker_config(directory: Path, executor_id: str, connection: str) -> Path:
    path = directory / f"{executor_id}.toml"
    path.write_text(
        f'executor_id = "{executor_id}"\nrole = "worker"\n'
        f'secret_file = "keys/{executor_id}.secret"\n\n[connection]\n{connection}\n{FAST_LIMITS}'
        "takeover_probe_timeout = 0.3\n",
        encoding="utf-8",
    )
    return path


def start_worker(
    directory: Path, config: Path, who: str, env: dict[str, str] | None = None
) -> Worker:
    env = {**os.environ, "WHO": who, "PYTHONPATH": str(directory), **(env or {})}
    return Worker(config, "who=svc:Who", cwd=directory, env=env)


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    (tmp_path / "svc.py").write_text(SERVICE_MODULE, encoding="utf-8")
    for executor_id in ("box-1", "box-2"):
        done = run_cli("keygen", "--keyring", str(tmp_path / "keys"), "--executor", executor_id)
        assert done.returncode == 0, done.stderr
        assert "(mode 0600)" in done.stdout and executor_id in done.stdout
    return tmp_path


def listening_fleet_config(directory: Path, port: int) -> Path:
    """A fleet listening on ``port`` (0: any free port, in its ``listening`` event)."""
    path = directory / "fleet.toml"
    path.write_text(
        f'role = "controller"\n\n[connection]\nlisten = "127.0.0.1:{port}"\n\n'
        f'[executors]\nkeyring = "keys"\n{FAST_LIMITS}',
        encoding="utf-8",
    )
    return path


def start_fleet(config: Path, cwd: Path) -> subprocess.Popen[str]:
    """``garcon-link fleet CONFIG --json`` as a child process."""
    return subprocess.Popen(
        [*CLI, "fleet", str(config), "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )


class Lines:
    """A child process's stdout, read line by line by a thread; waits have a deadline."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                self._queue.put(line.rstrip("\n"))
        except ValueError:  # the test closed the pipe (its process is gone) while this read
            pass
        self._queue.put(None)

    def wait(self, predicate: Callable[[str], bool], timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if predicate(line):
                    return line
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"not within {timeout}s; lines: {self.seen}")
            try:
                received = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if received is None:
                raise AssertionError(f"the process exited; lines: {self.seen}")
            self.seen.append(received)


def test_fleet_prints_json_events_as_workers_dial_in(fleet_dir: Path) -> None:
    process = start_fleet(listening_fleet_config(fleet_dir, 0), fleet_dir)
    workers = []
    try:
        lines = Lines(process)
        first = json.loads(lines.wait(lambda line: '"listening"' in line))
        assert first.keys() == {"event", "url"} and first["event"] == "listening"
        assert re.fullmatch(r"ws://127\.0\.0\.1:[1-9][0-9]*/executor", first["url"]), first
        dial = f'dial = "{first["url"]}?executor={{}}"'
        for executor_id in ("box-1", "box-2"):
            cfg = worker_config(fleet_dir, executor_id, dial.format(executor_id))
            workers.append(start_worker(fleet_dir, cfg, executor_id))
        for executor_id in ("box-1", "box-2"):

            def ready(line: str, i: str = executor_id) -> bool:
                return f'"executor": "{i}"' in line and "ready" in line

            lines.wait(ready)
        events = [json.loads(line) for line in lines.seen[1:]]
        assert {(e["event"], e["executor"]) for e in events} >= {
            ("joined", "box-1"),
            ("ready", "box-1"),
            ("joined", "box-2"),
            ("ready", "box-2"),
        }
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        for worker in workers:
            worker.kill()
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def test_call_reaches_the_executor_named_with_executor(fleet_dir: Path) -> None:
    workers = {}
    try:
        entries = []
        for executor_id in ("box-1", "box-2"):
            cfg = worker_config(fleet_dir, executor_id, 'listen = "127.0.0.1:0"')
            workers[executor_id] = start_worker(fleet_dir, cfg, executor_id)
            url = workers[executor_id].wait_line("executor-listening").split()[1].split("=", 1)[1]
            entries.append(
                f'[[executors.dial]]\nid = "{executor_id}"\nurl = "{url}"\n'
                f'secret_file = "keys/{executor_id}.secret"\n'
            )
        config = fleet_dir / "dialing.toml"
        config.write_text('role = "controller"\n\n' + "\n".join(entries) + FAST_LIMITS)
        done = run_cli("call", str(config), "--executor", "box-2", "who.whoami")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == "box-2"
        done = run_cli("describe", str(config), "--executor", "box-1", "--json")
        assert done.returncode == 0, done.stderr
        described = json.loads(done.stdout)
        assert described["executor_id"] == "box-1" and "whoami" in described["services"]["who"]
        done = run_cli("call", str(config), "who.whoami")
        assert done.returncode == cli.EXIT_USAGE
        assert (
            done.stderr.strip() == "error: a fleet configuration ([executors]) needs --executor ID"
        )
        done = run_cli("call", str(config), "--executor", "box-9", "who.whoami")
        assert done.returncode == cli.EXIT_USAGE
        assert "box-9" in done.stderr and "not one this fleet serves" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        # `garcon-link fleet` on it, not on a terminal: a fleet that only dials says whom, not
        # that it listens.
        fleet_process = subprocess.Popen(
            [*CLI, "fleet", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=fleet_dir,
        )
        try:
            first = Lines(fleet_process).wait(lambda line: line.startswith("fleet-"))
            assert first == "fleet-dialing executors=box-1,box-2"
        finally:
            fleet_process.kill()
            fleet_process.communicate(timeout=10)
    finally:
        for worker in workers.values():
            worker.kill()


def test_a_worker_whose_id_another_process_took_over_exits_7(fleet_dir: Path) -> None:
    """The first worker exits 7 and, under systemd, says ``STOPPING=1`` once, naming the
    takeover (its worker's own close says no other)."""
    controller = start_fleet(listening_fleet_config(fleet_dir, 0), fleet_dir)
    first = second = None
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(fleet_dir / "notify"))
    try:
        lines = Lines(controller)
        url = json.loads(lines.wait(lambda line: '"listening"' in line))["url"]
        cfg = worker_config(fleet_dir, "box-1", f'dial = "{url}"')
        systemd = {"NOTIFY_SOCKET": str(fleet_dir / "notify")}
        first = start_worker(fleet_dir, cfg, "first", env=systemd)
        first.wait_line("executor-ready")
        first.process.send_signal(signal.SIGSTOP)  # its socket stops answering
        second = start_worker(fleet_dir, cfg, "second")
        second.wait_line("executor-ready")  # took over after the probe went unanswered
        first.process.send_signal(signal.SIGCONT)
        assert first.process.wait(timeout=20) == cli.EXIT_TAKEN_OVER
        assert first.wait_line("executor-stopping").endswith("reason=TAKEN_OVER")
        errors = [line for line in first.stderr().splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "another process took over executor id 'box-1'" in errors[0]
        assert "(another process took over" not in errors[0]  # said once
        assert "an executor_id (and a key) of its own" in errors[0]
        assert second.process.poll() is None  # the newer one keeps serving
        said = [message for message in rest(notify) if "STOPPING" in message]
        status = "executor box-1: taken over by another process"
        assert said == [{"STOPPING": "1", "STATUS": status}]
    finally:
        notify.close()
        for worker in (first, second):
            if worker is not None:
                worker.process.send_signal(signal.SIGCONT)
                worker.kill()
        controller.kill()
        controller.communicate(timeout=10)


SERVICES = ["s0\\n@v", "s1\\n@v", "s2\\n@v", "s3\\n@v", "+2"]


def test_fleet_table_lists_every_executor() -> None:
    class FakeFleet:
        def executors(self) -> dict[str, gl.ExecutorSnapshot]:
            return {
                "b": gl.ExecutorSnapshot("b", "offline", None, 100.0, 3, 1),
                "a": gl.ExecutorSnapshot(
                    "a", "ready", "0123456789ab", 190.0, 12, 0, {"calc": "aaaabbbbcccc"}
                ),
                "c": gl.ExecutorSnapshot(
                    "c", "ready", "ba9876543210", 190.0, 0, 0, {f"s{i}\n": "v" for i in range(6)}
                ),
            }

    lines = cli.fleet_table(FakeFleet(), now=200.0)  # type: ignore[arg-type]
    assert [line.split() for line in lines] == [
        ["executor", "availability", "session", "since", "calls", "errors", "services"],
        ["a", "ready", "0123456789ab", "10s", "ago", "12", "0", "calc@aaaabbbbcccc"],
        ["b", "offline", "-", "100s", "ago", "3", "1", "-"],
        # each service with its contract version; a worker's names escaped, at most four shown
        ["c", "ready", "ba9876543210", "10s", "ago", "0", "0", *SERVICES],
    ]


def test_a_dial_entry_with_nothing_listening_fails_fast_naming_its_url(fleet_dir: Path) -> None:
    with socket.socket() as reserved:  # bound, never listening: dials are refused
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        url = f"ws://127.0.0.1:{port}/executor"
        config = fleet_dir / "fleet.toml"
        config.write_text(
            f'role = "controller"\n\n[[executors.dial]]\nid = "box-1"\nurl = "{url}"\n'
            f'secret_file = "keys/box-1.secret"\n{FAST_LIMITS}',
            encoding="utf-8",
        )
        done = run_cli("call", str(config), "--executor", "box-1", "who.whoami", "--timeout", "600")
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert_one_error_line(
        done.stderr,
        "[not_dispatched:UNREACHABLE]",
        f"cannot connect to 127.0.0.1:{port}",
        f'url = "{url}" of the [[executors.dial]] entry with id = "box-1" in fleet.toml',
    )


def test_a_call_to_an_executor_nobody_enrolled_names_the_enrollment(fleet_dir: Path) -> None:
    """A listening fleet waits in vain for an id without a key file: the message says so and
    gives the keygen command; an enrolled id that is only absent gets no such hint."""
    config = listening_fleet_config(fleet_dir, 0)
    done = run_cli("call", str(config), "--executor", "box-9", "who.whoami", "--timeout", "0.5")
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert_one_error_line(
        done.stderr,
        "no worker can join as 'box-9'",
        str(fleet_dir / "keys" / "box-9.secret"),
        "garcon-link keygen --keyring",
    )
    done = run_cli("call", str(config), "--executor", "box-1", "who.whoami", "--timeout", "0.5")
    assert done.returncode == cli.EXIT_NOT_DISPATCHED
    assert "no worker can join" not in done.stderr
