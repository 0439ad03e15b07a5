"""fleet: one controller, several device executors that dial out to it (docs/design.md#fleets).

Run: ``python examples/fleet/run.py``.

1. ``garcon-link keygen --keyring keys --executor device-N`` enrolls three devices: one key file
   each, mode 0600 (the worker gets a copy of its own file);
2. a fleet controller in this process listens (``gl.fleet(gl.load_fleet_config(...))``); three
   ``garcon-link worker device-N.toml`` processes dial in, each with its own id and key;
3. ``fleet.map`` asks every device at once; each answers with its own id;
4. a fourth process claiming ``device-1`` again is refused (4004) while the first answers, and
   backs off: the first keeps its session;
5. deleting ``keys/device-3.secret`` revokes it: its session is retired within
   ``key_recheck_interval``, no restart; the other two keep serving;
6. ``fleet.executors()`` is the table ``garcon-link fleet controller.toml`` prints live.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
from service import Sensors

import garcon_link as gl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import GARCON_LINK, WorkerProcess, say, set_port, workspace  # noqa: E402

DEVICES = ["device-1", "device-2", "device-3"]
SERVICES = ["sensors=service:DeviceSensors"]


def enroll(root: Path, device: str) -> None:
    command = [*GARCON_LINK, "keygen", "--keyring", str(root / "keys"), "--executor", device]
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
    say(f"$ garcon-link keygen --keyring keys --executor {device}")
    say(f"  {done.stdout.strip().replace(str(root) + '/', '')}")


def device_config(root: Path, device: str, port: int) -> Path:
    text = (root / "device.toml").read_text(encoding="utf-8").replace("device-1", device)
    path = root / f"{device}.toml"
    path.write_text(text, encoding="utf-8")
    set_port(path, port)
    return path


def table(fleet: gl.Fleet) -> None:
    say(f"  {'executor':<10} {'availability':<13} {'session':<13} calls errors")
    for executor_id, row in sorted(fleet.executors().items()):
        session = row.session or "-"
        availability = row.availability
        say(f"  {executor_id:<10} {availability:<13} {session:<13} {row.calls:>5} {row.errors:>6}")


async def poll_until(predicate: Callable[[], bool], timeout: float = 15) -> None:
    """Check ``predicate`` every 50 ms (a counter or a state, not an event), up to ``timeout``."""
    with anyio.fail_after(timeout):
        while not predicate():  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def main(root: Path) -> None:
    for device in DEVICES:
        enroll(root, device)
    set_port(root / "controller.toml", 0)  # any free port; the devices' copies get the real one
    async with gl.fleet(gl.load_fleet_config(root / "controller.toml")) as fleet:
        say(f"fleet controller listening on {fleet.url} (in this process)")
        port = fleet.listen_address[1]
        async with anyio.create_task_group() as tg, AsyncExitStack() as workers:

            async def follow() -> None:
                async for event in fleet.events():
                    say(f"  [event: {event.executor_id} {event.kind}]")

            tg.start_soon(follow)
            for device in DEVICES:
                config = device_config(root, device, port)
                say(f"$ garcon-link worker {config.name} --service {SERVICES[0]}")
                process = WorkerProcess(config, SERVICES, cwd=HERE, env={"DEVICE_ID": device})
                await workers.enter_async_context(process)
            try:
                for device in DEVICES:
                    await fleet.executor(device).wait_ready(timeout=15)
                names = await fleet.map(lambda ex: ex.service("sensors", Sensors).whoami())
                names = dict(sorted(names.items()))  # map() keeps the fleet's order: who came first
                say(f"await fleet.map(whoami) -> {names}")
                if names != {d: d for d in DEVICES}:
                    raise SystemExit(f"a call reached the wrong device: {names}")
                temperature = (
                    await fleet.executor("device-2").service("sensors", Sensors).read("temperature")
                )
                say(f"device-2 temperature     -> {temperature}")

                say("a second process claims device-1:")
                config = root / "device-1.toml"
                async with WorkerProcess(
                    config, SERVICES, cwd=HERE, env={"DEVICE_ID": "device-1 (twin)"}
                ) as twin:
                    await twin.wait_line("executor-dialing")
                    await poll_until(lambda: fleet.statistics().takeovers_refused >= 2)
                    whoami = await fleet.executor("device-1").service("sensors", Sensors).whoami()
                    say(
                        f"  refused {fleet.statistics().takeovers_refused}x (4004, backing off); "
                        f"device-1 still answers {whoami!r}"
                    )
                    if whoami != "device-1":
                        raise SystemExit("the twin must not take over a healthy session")

                say("$ rm keys/device-3.secret   (revoke)")
                (root / "keys" / "device-3.secret").unlink()
                await poll_until(lambda: fleet.executor("device-3").availability == "offline")
                try:
                    sensors = gl.with_options(
                        fleet.executor("device-3").service("sensors", Sensors), dispatch_deadline=0
                    )
                    await sensors.whoami()
                    raise SystemExit("a revoked device must not answer")
                except gl.NotDispatched as exc:
                    say(f"device-3 whoami()        -> NotDispatched {exc}")
                names = await fleet.map(
                    lambda ex: ex.service("sensors", Sensors).whoami(), ["device-1", "device-2"]
                )
                say(f"device-1, device-2       -> {names}")
                say("fleet.executors():")
                table(fleet)
            finally:
                await workers.aclose()
                tg.cancel_scope.cancel()
    say("fleet: ok")


if __name__ == "__main__":
    with workspace(HERE) as root:
        anyio.run(main, root)
