"""The supervision examples (examples/systemd, examples/container) say what they should.

Without systemd or Docker: the unit file parses as an INI file with the keys a notify service
needs, and its ``ExecStart`` is a ``garcon-link worker`` command the CLI's own parser accepts;
the Dockerfile's command is one too, and so is its health check, a ``garcon-link describe``
that ends within Docker's timeout. That check, run here against a real worker started from the
example's files (the port and the secret and TLS files moved to a temporary directory), passes
beside the worker's real controller without disturbing its session, and fails when nothing
listens.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import re
import secrets
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import anyio
import pytest
import trustme
from faultutil import wait_for

import garcon_link as gl
from garcon_link.cli._exits import EXIT_NOT_DISPATCHED, EXIT_TAKEN_OVER, EXIT_USAGE
from garcon_link.cli._parser import build_parser
from garcon_link.demo import DemoService
from garcon_link.testing import free_tcp_port

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
UNIT = EXAMPLES / "systemd" / "garcon-link-worker.service"
GATEWAY_UNIT = EXAMPLES / "systemd" / "garcon-link-gateway.service"
CONTAINER = EXAMPLES / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
DOCKER_STOP_TIMEOUT = 10.0  # docker stop's default grace before SIGKILL


def parse_cli(argv: list[str]) -> dict[str, object]:
    """``garcon-link`` arguments as the CLI parses them (argparse exits 2 on a bad one)."""
    return vars(build_parser().parse_args(argv))


# ---------------------------------------------------------------------------------- systemd


def unit(path: Path = UNIT) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(path.read_text(encoding="utf-8"), source=str(path))
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
    # The state directory is inside the one directory the sandbox lets the worker write.
    state_dir = ns["state_dir"]
    assert isinstance(state_dir, str)
    assert Path(state_dir).parent == Path("/var/lib") / service["StateDirectory"]


def test_the_gateway_unit_file_is_a_notify_service_that_drains() -> None:
    parsed = unit(GATEWAY_UNIT)
    assert parsed.sections() == ["Unit", "Service", "Install"]
    service = parsed["Service"]
    assert (service["Type"], service["NotifyAccess"]) == ("notify", "main")
    assert int(service["WatchdogSec"]) > 0
    assert EXIT_USAGE in {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert "AF_UNIX" in service["RestrictAddressFamilies"].split()
    program, *argv = shlex.split(service["ExecStart"])
    assert program.endswith("/garcon-link")
    ns = parse_cli(argv)
    assert ns["command"] == "gateway" and ns["config"] == "/etc/garcon-link/gateway.toml"
    drain = ns["drain"]
    assert isinstance(drain, float) and 0 < drain < float(service["TimeoutStopSec"])
    assert service["KillSignal"] == "SIGTERM"


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


def healthcheck() -> tuple[str, list[str]]:
    """The HEALTHCHECK's options and its command (the exec form: no shell in between)."""
    options, _, command = instructions()["HEALTHCHECK"].partition(" CMD ")
    argv = json.loads(command)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return options, argv


def docker_seconds(options: str, name: str) -> float:
    match = re.search(rf"--{name}=(\d+)s\b", options)
    assert match is not None, f"HEALTHCHECK has no --{name}=Ns"
    return float(match.group(1))


def test_the_container_runs_a_worker_the_cli_accepts() -> None:
    found = instructions()
    assert json.loads(found["ENTRYPOINT"]) == ["garcon-link"]
    ns = parse_cli(json.loads(found["CMD"]))
    assert ns["command"] == "worker" and ns["config"] == "/etc/garcon-link/worker.toml"
    drain = ns["drain"]
    assert isinstance(drain, float) and 0 < drain < DOCKER_STOP_TIMEOUT
    assert found["STOPSIGNAL"] == "SIGTERM"
    assert found["USER"] != "root"
    config = tomllib.loads((CONTAINER / "worker.toml").read_text(encoding="utf-8"))
    port = int(config["connection"]["listen"].rsplit(":", 1)[1])
    assert int(found["EXPOSE"]) == port


def test_the_health_check_is_a_describe_that_ends_within_its_timeout() -> None:
    options, argv = healthcheck()
    assert argv[0] == "garcon-link"
    ns = parse_cli(argv[1:])
    assert ns["command"] == "describe" and ns["config"] == "/etc/garcon-link/healthcheck.toml"
    # describe gives up after --timeout (or 3 refused dials) and exits non-zero: before Docker
    # would kill the check for its own --timeout, with a second left to start Python.
    assert ns["wait"] is None
    timeout = ns["timeout"]
    assert isinstance(timeout, float) and 0 < timeout <= docker_seconds(options, "timeout") - 1
    assert docker_seconds(options, "interval") > docker_seconds(options, "timeout")
    # The check's config is a controller of its own for the worker of worker.toml, on loopback.
    worker = tomllib.loads((CONTAINER / "worker.toml").read_text(encoding="utf-8"))
    check = tomllib.loads((CONTAINER / "healthcheck.toml").read_text(encoding="utf-8"))
    port = int(worker["connection"]["listen"].rsplit(":", 1)[1])
    assert check["role"] == "controller" and check["controller_id"] == "healthcheck"
    assert check["executor_id"] == worker["executor_id"]
    assert check["secret_file"] == worker["secret_file"]
    assert check["connection"]["dial"] == f"wss://127.0.0.1:{port}/executor"


@pytest.fixture
def container_config(tmp_path: Path) -> Path:
    """The example's configuration directory (what is mounted at /etc/garcon-link), made
    runnable here: its files, with the port moved to a free one on 127.0.0.1, and the secret
    and TLS files they name (a certificate for 127.0.0.1 from a test CA)."""
    port = free_tcp_port()
    for name in ("worker.toml", "healthcheck.toml"):
        text = (CONTAINER / name).read_text(encoding="utf-8")
        assert text.count(":8765") == 1, name
        text = text.replace(":8765", f":{port}").replace('"0.0.0.0:', '"127.0.0.1:')
        (tmp_path / name).write_text(text, encoding="utf-8")
    secret = tmp_path / "link.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return tmp_path


def run_healthcheck(config_dir: Path) -> subprocess.CompletedProcess[str]:
    """The Dockerfile's health check, its config path moved to ``config_dir``."""
    _, argv = healthcheck()
    argv = [a.replace("/etc/garcon-link/", f"{config_dir}/") for a in argv[1:]]
    return subprocess.run(
        [sys.executable, "-m", "garcon_link", *argv], capture_output=True, text=True, timeout=30
    )


@pytest.mark.anyio
async def test_the_health_check_passes_beside_the_real_controller(container_config: Path) -> None:
    worker_config = gl.load_config(container_config / "worker.toml")
    check_config = gl.load_config(container_config / "healthcheck.toml")
    controller_config = dataclasses.replace(check_config, controller_id="scheduler")
    with anyio.fail_after(60):
        async with (
            gl.Worker(worker_config, {"demo": DemoService()}) as worker,
            gl.connect(controller_config) as executor,
        ):
            await executor.wait_ready(10)
            history: list[str] = []  # the real controller's availability changes from now on
            executor.on_availability_changed(history.append)
            demo = executor.service("demo")
            for _ in range(2):
                done = await anyio.to_thread.run_sync(run_healthcheck, container_config)
                assert done.returncode == 0, done.stderr
                assert "demo.add(a: int, b: int) -> int" in done.stdout
                # The real controller kept its session: no takeover, no refusal, no pause.
                assert await demo.add(2, 3) == 5
            assert history == []
            stats = worker.link.statistics()
            assert stats.taken_over == 0 and stats.controllers_refused == 0
            assert stats.handshakes_completed == 3  # the controller's and two checks'
            # Each check's session ended with its process: none is left holding a slot.
            await wait_for(lambda: set(worker.controllers()) == {"scheduler"}, 10, "one session")
            assert executor.link.statistics().fresh_sessions == 1
    # Nothing listening: the check fails (3 refused dials end it at once).
    done = await anyio.to_thread.run_sync(run_healthcheck, container_config)
    assert done.returncode == EXIT_NOT_DISPATCHED, done.stderr
