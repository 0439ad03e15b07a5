"""The supervision examples (examples/systemd, examples/container) say what they should.

Without systemd or Docker: the unit file parses as an INI file with the keys a notify service
needs, and its ``ExecStart`` is a ``garcon-link worker`` command the CLI's own parser accepts;
the Dockerfile's command is one too, and its health check -- run here against a real worker
listening with TLS, as in the container -- passes while the worker answers and fails when
nothing does.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import anyio
import pytest
import trustme

import garcon_link as gl
from garcon_link.cli._exits import EXIT_TAKEN_OVER, EXIT_USAGE
from garcon_link.cli._parser import build_parser
from garcon_link.settings.config import TlsConfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
UNIT = EXAMPLES / "systemd" / "garcon-link-worker.service"
DOCKERFILE = EXAMPLES / "container" / "Dockerfile"
DOCKER_STOP_TIMEOUT = 10.0  # docker stop's default grace before SIGKILL


def parse_cli(argv: list[str]) -> dict[str, object]:
    """``garcon-link`` arguments as the CLI parses them (argparse exits 2 on a bad one)."""
    return vars(build_parser().parse_args(argv))


# ---------------------------------------------------------------------------------- systemd


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(UNIT.read_text(encoding="utf-8"), source=str(UNIT))
    return parser


def test_the_unit_file_is_a_notify_service_with_a_watchdog() -> None:
    parsed = unit()
    assert parsed.sections() == ["Unit", "Service", "Install"]
    service = parsed["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["Restart"] == "on-failure"
    assert int(service["WatchdogSec"]) > 0
    prevented = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert {EXIT_USAGE, EXIT_TAKEN_OVER} <= prevented
    # The notify socket is an AF_UNIX datagram socket: the sandbox must allow it.
    assert "AF_UNIX" in service["RestrictAddressFamilies"].split()
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert service[key] == value, key
    assert parsed["Install"]["WantedBy"] == "multi-user.target"


def test_the_unit_file_runs_a_worker_the_cli_accepts() -> None:
    service = unit()["Service"]
    program, *argv = shlex.split(service["ExecStart"])
    assert program.endswith("/garcon-link")
    ns = parse_cli(argv)
    assert ns["command"] == "worker" and ns["config"] == "/etc/garcon-link/worker.toml"
    drain = ns["drain"]
    assert isinstance(drain, float) and 0 < drain < float(service["TimeoutStopSec"])
    assert service["KillSignal"] == "SIGTERM"  # what starts the drain


# ---------------------------------------------------------------------------------- container


def instructions() -> dict[str, str]:
    """The Dockerfile's instructions (continuation lines joined); each appears once here."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    found: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, rest = line.strip().partition(" ")
            found[name.upper()] = rest.strip()
    return found


def healthcheck_argv() -> list[str]:
    options, _, command = instructions()["HEALTHCHECK"].partition(" CMD ")
    assert "--timeout=" in options and "--interval=" in options
    argv = json.loads(command)  # the exec form: no shell in between
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def test_the_container_runs_a_worker_the_cli_accepts() -> None:
    found = instructions()
    assert json.loads(found["ENTRYPOINT"]) == ["garcon-link"]
    ns = parse_cli(json.loads(found["CMD"]))
    assert ns["command"] == "worker" and ns["config"] == "/etc/garcon-link/worker.toml"
    drain = ns["drain"]
    assert isinstance(drain, float) and 0 < drain < DOCKER_STOP_TIMEOUT
    assert found["STOPSIGNAL"] == "SIGTERM"
    assert found["USER"] != "root"
    # The port the worker listens on is the one exposed and the one the health check asks.
    config = tomllib.loads((DOCKERFILE.parent / "worker.toml").read_text(encoding="utf-8"))
    port = int(config["connection"]["listen"].rsplit(":", 1)[1])
    assert int(found["EXPOSE"]) == port
    assert f"'127.0.0.1', {port}," in healthcheck_argv()[2]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    root = tmp_path_factory.mktemp("tls")
    issued = trustme.CA().issue_cert("localhost", "127.0.0.1")
    issued.private_key_and_cert_chain_pem.write_to_path(str(root / "server.pem"))
    return TlsConfig(cert=root / "server.pem")


def run_healthcheck(port: int) -> int:
    """The Dockerfile's health check against ``port``; its exit status."""
    program, flag, code = healthcheck_argv()
    assert (program, flag) == ("python", "-c")
    code = code.replace("'127.0.0.1', 8765,", f"'127.0.0.1', {port},")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
    return done.returncode


@pytest.mark.anyio
async def test_the_health_check_passes_while_the_worker_answers(tls: TlsConfig) -> None:
    config = gl.LinkConfig(
        executor_id="container-box-1",
        role=gl.Role.WORKER,
        secret=gl.generate_secret(),
        listen=("127.0.0.1", 0),
        tls=tls,
    )
    with anyio.fail_after(60):
        async with gl.Worker(config, {}) as worker:
            port = worker.link.listen_address[1]
            assert await anyio.to_thread.run_sync(run_healthcheck, port) == 0
            stats = worker.link.statistics()
            assert stats.handshakes_completed == 0 and stats.fresh_sessions == 0  # no session
    with socket.socket() as dead:  # bound, not listening: nothing answers
        dead.bind(("127.0.0.1", 0))
        assert await anyio.to_thread.run_sync(run_healthcheck, dead.getsockname()[1]) != 0
