"""worker_dials: the controller listens, the worker dials in.

Run: ``python examples/worker_dials/run.py``.

1. a controller in this process listens (``connect()`` with a ``listen`` config);
2. ``garcon-link worker worker.toml --service builds=service:build_runner`` dials in;
3. the controller streams a build log through a typed facade;
4. the worker is killed (SIGKILL): the session is retired after the grace period, calls fail
   ``NotDispatched`` at once (no hidden queue);
5. the worker is started again, dials in, and the *same facade* works on a fresh session with a
   new service scope.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
from service import BuildRunner

import garcon_link as gl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import WorkerProcess, say, set_port, workspace  # noqa: E402

SERVICES = ["builds=service:build_runner"]


async def wait_for(executor: gl.RemoteExecutor, state: str, timeout: float = 15) -> None:
    changed = anyio.Event()
    unsubscribe = executor.on_availability_changed(lambda _: changed.set())
    try:
        with anyio.fail_after(timeout):
            while executor.availability != state:
                await changed.wait()
                changed = anyio.Event()
    finally:
        unsubscribe()


async def main(root: Path) -> None:
    set_port(root / "controller.toml", 0)  # any free port; the worker's copy gets the real one
    async with gl.connect(gl.load_config(root / "controller.toml")) as executor:
        url = executor.link.url
        say(f"controller listening on {url} (in this process)")
        set_port(root / "worker.toml", executor.link.listen_address[1])
        executor.on_availability_changed(lambda state: say(f"  [availability: {state}]"))

        say(f"$ garcon-link worker worker.toml --service {SERVICES[0]}")
        async with WorkerProcess(root / "worker.toml", SERVICES, cwd=HERE) as worker:
            say(f"  {await worker.wait_line('executor-dialing')}")
            await executor.wait_ready(timeout=15)
            builds = executor.service("builds", BuildRunner)
            first = await builds.whoami()
            say(f"await builds.whoami()  -> {first!r}")
            say("async for line in builds.run('unit'):")
            lines = [line async for line in builds.run("unit")]
            for line in lines:
                say(f"  {line.text}")
            if [line.step for line in lines] != [1, 2, 3, 4]:
                raise SystemExit(f"unexpected build log: {lines}")

            worker.kill()
            say(f"SIGKILL the worker (pid {worker.pid})")
            await wait_for(executor, "offline")
            try:
                await builds.whoami()
                raise SystemExit("a call while offline must not succeed")
            except gl.NotDispatched as exc:
                say(f"await builds.whoami()  -> NotDispatched {exc}")

        say("start the worker again: it dials in")
        async with WorkerProcess(root / "worker.toml", SERVICES, cwd=HERE) as worker:
            await wait_for(executor, "ready")
            second = await builds.whoami()  # the same facade object as before
            say(f"await builds.whoami()  -> {second!r}   (same facade, fresh session)")
            if second == first:
                raise SystemExit("expected a new service scope after the restart")
            code = await worker.stop()
            say(f"SIGTERM -> {worker.lines[-1]}   (exit {code})")
    say("worker_dials: ok")


if __name__ == "__main__":
    with workspace(HERE) as root:
        anyio.run(main, root)
