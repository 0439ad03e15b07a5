"""gateway: a fleet that several programs share, each with its own key and grants.

Run: ``python examples/gateway/run.py``. (Guide: docs/guides/gateway.md.)

1. ``garcon-link keygen --keyring keys --executor device-N`` enrolls two devices and
   ``garcon-link keygen --keyring callers --caller ID`` three callers;
2. a gateway runs in this process (``gl.gateway(gl.load_gateway_config("gateway.toml"))``); two
   ``garcon-link worker device-N.toml`` processes dial in (through a fault proxy, to cut them);
3. two caller processes with different grants: ``garcon-link call web-1.toml --executor
   device-1 sensors.whoami`` is served; ``guest`` (granted device-2 only) is refused
   ``FORBIDDEN`` on device-1 -- the call never reaches it -- and served on device-2;
4. an in-process caller (``gl.connect_gateway``) keeps calling while the gateway<->device-1
   connection is cut: the session resumes, nothing is lost;
5. a keyed call (``retry_unknown``) whose caller<->gateway session is lost mid-call is retried
   with its key on a new session: device-1 runs it exactly once.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
from service import Sensors

import garcon_link as gl
from garcon_link.testing import FaultProxy

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import GARCON_LINK, WorkerProcess, say, set_port, workspace  # noqa: E402

DEVICES = ["device-1", "device-2"]
CALLERS = ["web-1", "web-2", "guest"]
SERVICES = ["sensors=service:DeviceSensors"]


def enroll(root: Path, kind: str, name: str) -> None:
    keyring = "keys" if kind == "executor" else "callers"
    command = [*GARCON_LINK, "keygen", "--keyring", str(root / keyring), f"--{kind}", name]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
    say(f"$ garcon-link keygen --keyring {keyring} --{kind} {name}")
    say(f"  {done.stdout.strip().replace(str(root) + '/', '')}")


def copy_config(root: Path, template: str, old: str, new: str, port: int) -> Path:
    text = (root / template).read_text(encoding="utf-8").replace(old, new)
    path = root / f"{new}.toml"
    path.write_text(text, encoding="utf-8")
    set_port(path, port)
    return path


async def caller_process(config: Path, *args: str) -> None:
    """``garcon-link call CONFIG ...`` in a child process; prints what it printed."""
    command = [*GARCON_LINK, "call", str(config), *args]
    done = await anyio.run_process(command, check=False)
    output = (done.stdout or done.stderr).decode().strip()
    say(f"$ garcon-link call {config.name} {' '.join(args)}")
    say(f"  {output}   (exit {done.returncode})")


async def main(root: Path) -> None:
    for device in DEVICES:
        enroll(root, "executor", device)
    for caller in CALLERS:
        enroll(root, "caller", caller)
    set_port(root / "gateway.toml", 0)  # any free port
    async with gl.gateway(gl.load_gateway_config(root / "gateway.toml")) as gw:
        port = gw.listen_address[1]
        say(f"gateway listening on {gw.url} (in this process)")
        async with (
            FaultProxy("127.0.0.1", port) as device_hop,
            FaultProxy("127.0.0.1", port) as caller_hop,
            AsyncExitStack() as workers,
        ):
            for device in DEVICES:
                config = copy_config(root, "device.toml", "device-1", device, device_hop.port)
                say(f"$ garcon-link worker {config.name} --service {SERVICES[0]}")
                process = WorkerProcess(config, SERVICES, cwd=HERE, env={"DEVICE_ID": device})
                await workers.enter_async_context(process)
            for device in DEVICES:
                await gw.fleet.executor(device).wait_ready(timeout=15)
            say(f"devices ready: {sorted(gw.fleet.executors())}")

            # Two caller processes with different grants.
            web = copy_config(root, "caller.toml", "web-1", "web-1", port)
            guest = copy_config(root, "caller.toml", "web-1", "guest", port)
            await caller_process(web, "--executor", "device-1", "sensors.whoami")
            await caller_process(guest, "--executor", "device-1", "sensors.whoami")
            await caller_process(guest, "--executor", "device-2", "sensors.read", '["temperature"]')

            # An in-process caller, through a proxy that cuts its connection to the gateway.
            config = gl.load_caller_config(
                copy_config(root, "caller.toml", "web-1", "web-2", caller_hop.port)
            )
            limits = config.limits.replace(detached_grace=1.0)
            async with gl.connect_gateway(config, limits=limits) as fleet:
                device = fleet.executor("device-1")
                await device.wait_ready(timeout=15)
                sensors = device.service("sensors", Sensors)
                say(f"web-2 sees {sorted(fleet.executors())}")

                before = gw.fleet.executors()["device-1"].session
                device_hop.cut()
                answers = [await sensors.whoami() for _ in range(3)]
                after = gw.fleet.executors()["device-1"].session
                say(
                    f"gateway<->device-1 cut: session {before} -> {after} "
                    f"({'resumed' if before == after else 'replaced'}); whoami x3 -> {answers}"
                )
                if before != after:
                    raise SystemExit("a brief cut must resume the same session")

                keyed = gl.with_options(
                    sensors, idempotency_key="bump-1", retry_unknown=True, timeout=30
                )
                result: list[int] = []

                async def bump() -> None:
                    result.append(await keyed.bump(1.5))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(bump)
                    await anyio.sleep(0.3)  # the call is running on device-1 now
                    caller_hop.refuse()
                    caller_hop.cut()
                    say("web-2<->gateway cut and refused for 1.5 s: web-2's session is lost")
                    await anyio.sleep(1.5)
                    caller_hop.refuse(False)
                runs = await sensors.bumps()
                say(
                    f"keyed bump() retried on a new session -> {result[0]}; "
                    f"device-1 ran it {runs} time(s)"
                )
                if runs != 1:
                    raise SystemExit("a keyed call must run exactly once")
            say("callers:")
            for caller_id, row in sorted(gw.callers().items()):
                say(
                    f"  {caller_id:<7} calls={row.calls} errors={row.errors} "
                    f"forbidden={row.forbidden}"
                )
            await workers.aclose()
    say("gateway: ok")


if __name__ == "__main__":
    with workspace(HERE) as root:
        anyio.run(main, root)
