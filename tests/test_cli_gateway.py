"""``garcon-link gateway CONFIG``, as an operator runs it: a worker process dials in, a caller
(with its key enrolled by ``keygen --caller``) calls it through the gateway, a caller without a
grant is refused, and SIGTERM ends the gateway with exit 0: after a drain in which a relayed call
still running finishes, with systemd told (a fake ``NOTIFY_SOCKET``), and never killed by the
signals that follow."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Protocol

import anyio
import pytest
from test_cli import CLI, FAST_LIMITS, Worker, run_cli
from test_cli_fleet import SERVICE_MODULE, Lines, start_worker, worker_config
from test_systemd import notify_socket, receive, signal_until_exit

import garcon_link as gl

pytestmark = pytest.mark.timeout(60)


class Who(Protocol):
    async def whoami(self) -> str: ...


def test_the_gateway_command_serves_callers_and_stops_on_sigterm(tmp_path: Path) -> None:
    (tmp_path / "svc.py").write_text(SERVICE_MODULE, encoding="utf-8")
    assert (
        run_cli("keygen", "--keyring", str(tmp_path / "keys"), "--executor", "box-1").returncode
        == 0
    )
    for caller_id in ("web-1", "intruder"):
        done = run_cli("keygen", "--keyring", str(tmp_path / "callers"), "--caller", caller_id)
        assert done.returncode == 0 and "copy it to the caller" in done.stdout, done.stderr
    config = tmp_path / "gateway.toml"
    config.write_text(
        'role = "gateway"\n[connection]\nlisten = "127.0.0.1:0"\n[executors]\nkeyring = "keys"\n'
        '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["web-*"]\n'
        f'executors = ["box-*"]\n{FAST_LIMITS}',
        encoding="utf-8",
    )
    process = subprocess.Popen(
        [*CLI, "gateway", str(config), "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    worker = None
    try:
        lines = Lines(process)
        url = json.loads(lines.wait(lambda line: '"listening"' in line))["url"]
        worker = start_worker(tmp_path, worker_config(tmp_path, "box-1", f'dial = "{url}"'), "b1")
        lines.wait(lambda line: '"box-1"' in line and '"ready"' in line)

        def key(caller_id: str) -> gl.Secret:
            secret = gl.Keyring(tmp_path / "callers").secret_for(caller_id)
            assert secret is not None
            return secret

        async def calls() -> None:
            limits = gl.Limits(backoff_base=0.05, backoff_max=0.2, connect_timeout=2.0)
            web = gl.CallerConfig(
                caller_id="web-1",
                secret=key("web-1"),
                dial=url,
                limits=limits,
            )
            async with gl.connect_gateway(web) as fleet:
                ex = fleet.executor("box-1")
                await ex.wait_ready(20)
                assert await ex.service("who", Who).whoami() == "b1"
            intruder = gl.CallerConfig(
                caller_id="intruder",
                secret=key("intruder"),
                dial=url,
                limits=limits,
            )
            async with gl.connect_gateway(intruder) as fleet:
                await fleet.gateway.wait_ready(20)
                with pytest.raises(gl.Rejected) as refused:
                    await fleet.executor("box-1").service("who", Who).whoami()
                assert refused.value.code == "FORBIDDEN"

        anyio.run(calls)
        # The command line, with a caller's configuration.
        for caller_id in ("web-1", "intruder"):
            (tmp_path / f"{caller_id}.toml").write_text(
                f'role = "caller"\ncaller_id = "{caller_id}"\n'
                f'secret_file = "callers/{caller_id}.secret"\n[connection]\ndial = "{url}"\n',
                encoding="utf-8",
            )
        done = run_cli("call", str(tmp_path / "web-1.toml"), "--executor", "box-1", "who.whoami")
        assert (done.returncode, done.stdout) == (0, '"b1"\n'), done.stderr
        done = run_cli("describe", str(tmp_path / "web-1.toml"), "--executor", "box-1")
        assert done.returncode == 0 and "who.whoami() -> str" in done.stdout, done.stderr
        done = run_cli("call", str(tmp_path / "intruder.toml"), "--executor", "box-1", "who.whoami")
        assert done.returncode == 4 and "[rejected:FORBIDDEN]" in done.stderr, done.stderr
        # An executor the gateway has never seen, that a grant names: after a second, one line
        # says what the command waits for; it goes on waiting until --timeout.
        web = str(tmp_path / "web-1.toml")
        done = run_cli("call", web, "--executor", "box-9", "who.whoami", "--timeout", "2.5")
        notice, error = done.stderr.strip().splitlines()
        assert done.returncode == 3, done.stderr
        assert notice.startswith("waiting for executor 'box-9': not connected to the gateway")
        assert "up to 2.5s" in notice
        assert error.startswith("error: [not_dispatched:NOT_READY]") and "2.5s" in error, error
        # One no grant names is refused at once, without the line.
        done = run_cli("call", web, "--executor", "other-1", "who.whoami", "--timeout", "30")
        assert done.returncode == 4 and "[rejected:FORBIDDEN]" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        done = run_cli("call", str(tmp_path / "web-1.toml"), "who.whoami")
        assert done.returncode == 2 and "needs --executor ID" in done.stderr, done.stderr
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    finally:
        if worker is not None:
            worker.kill()
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


SLOW_MODULE = """
import pathlib

import anyio


class Slow:
    async def wait(self, path: str) -> str:
        print("slow-started", flush=True)
        for _ in range(3000):  # until the test writes the file (30 s at most)
            if pathlib.Path(path).exists():
                return "finished"
            await anyio.sleep(0.01)
        return "never released"
"""

__all__ = ["notify_socket"]  # a fixture, imported for the test below


def test_the_gateway_drains_on_sigterm_and_tells_systemd(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    """SIGTERM with a relayed call running: STOPPING=1, a ``gateway-draining`` event counting
    it; a new ``call`` with a caller's configuration fails at once (4010: the gateway admits no
    new caller session), exit 3 and the draining line; the running call's result reaches its
    caller, ``gateway-stopping``, exit 0 -- and SIGTERM after SIGTERM until the exit does not
    kill the gateway."""
    sock, notify_path = notify_socket
    (tmp_path / "svc.py").write_text(SLOW_MODULE, encoding="utf-8")
    assert (
        run_cli("keygen", "--keyring", str(tmp_path / "keys"), "--executor", "box-1").returncode
        == 0
    )
    assert (
        run_cli("keygen", "--keyring", str(tmp_path / "callers"), "--caller", "web-1").returncode
        == 0
    )
    config = tmp_path / "gateway.toml"
    config.write_text(
        'role = "gateway"\n[connection]\nlisten = "127.0.0.1:0"\n[executors]\nkeyring = "keys"\n'
        '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["web-*"]\n'
        f'executors = ["box-*"]\n{FAST_LIMITS}',
        encoding="utf-8",
    )
    process = subprocess.Popen(
        [*CLI, "gateway", str(config), "--json", "--drain", "30"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "NOTIFY_SOCKET": notify_path},
    )
    worker = call = None
    seen: list[dict[str, str]] = []
    try:
        lines = Lines(process)
        url = json.loads(lines.wait(lambda line: '"listening"' in line))["url"]
        assert receive(sock, "READY=1", seen)["STATUS"] == f"gateway: listening on {url}"
        worker = Worker(
            worker_config(tmp_path, "box-1", f'dial = "{url}"'),
            "slow=svc:Slow",
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
        )
        lines.wait(lambda line: '"box-1"' in line and '"ready"' in line)
        (tmp_path / "web-1.toml").write_text(
            'role = "caller"\ncaller_id = "web-1"\nsecret_file = "callers/web-1.secret"\n'
            f'[connection]\ndial = "{url}"\n',
            encoding="utf-8",
        )
        release = tmp_path / "release"
        slow_call = ("slow.wait", json.dumps([str(release)]), "--timeout", "40")
        call = subprocess.Popen(
            [*CLI, "call", str(tmp_path / "web-1.toml"), "--executor", "box-1", *slow_call],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker.wait_line("slow-started")
        process.send_signal(signal.SIGTERM)
        stopping = receive(sock, "STOPPING=1", seen)
        assert stopping["STATUS"] == "gateway: SIGTERM, draining for up to 30s"
        draining = json.loads(lines.wait(lambda line: '"gateway-draining"' in line))
        assert draining == {
            "event": "gateway-draining",
            "reason": "SIGTERM",
            "seconds": 30.0,
            "running": 1,
        }
        # A caller the gateway does not serve yet: refused at once, not at --timeout.
        web = str(tmp_path / "web-1.toml")
        done = run_cli("call", web, "--executor", "box-1", "slow.wait", "[]", "--timeout", "60")
        assert done.returncode == 3, done.stderr
        assert done.stderr.startswith(
            "error: [not_dispatched:DRAINING] the gateway is draining: "
        ), done.stderr
        release.touch()
        out, err = call.communicate(timeout=30)
        assert (call.returncode, out) == (0, '"finished"\n'), err
        stopped = json.loads(lines.wait(lambda line: '"gateway-stopping"' in line))
        assert stopped == {"event": "gateway-stopping", "reason": "SIGTERM"}
        assert signal_until_exit(process) == 0
    finally:
        for child in (worker.process if worker is not None else None, call):
            if child is not None and child.poll() is None:
                child.kill()
                child.communicate(timeout=10)
        if process.poll() is None:
            process.kill()
        _, err = process.communicate(timeout=10)
    assert "systemd" not in err and "Traceback" not in err, err
