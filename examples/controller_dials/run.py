"""controller_dials: the worker listens, the controller dials.

Run: ``python examples/controller_dials/run.py``.

1. ``garcon-link worker worker.toml --service greeter=service:FriendlyGreeter`` runs as a child
   process and prints ``executor-listening``;
2. a controller in this process dials it and calls through a typed facade (a call and a stream);
3. ``garcon-link call controller.toml greeter.greet '["Grace"]'`` does the same from the shell;
4. the worker is stopped with SIGTERM and exits 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
from service import Greeter

import garcon_link as gl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import GARCON_LINK, WorkerProcess, field, say, set_port, workspace  # noqa: E402


async def main(root: Path) -> None:
    set_port(root / "worker.toml", 0)  # any free port; we read the real one from the worker
    services = ["greeter=service:FriendlyGreeter"]
    say(f"$ garcon-link worker worker.toml --service {services[0]}")
    async with WorkerProcess(root / "worker.toml", services, cwd=HERE) as worker:
        listening = await worker.wait_line("executor-listening")
        say(f"  {listening}")
        url = field(listening, "url")
        set_port(root / "controller.toml", int(url.rsplit(":", 1)[1].split("/")[0]))

        async with gl.connect(gl.load_config(root / "controller.toml")) as executor:
            await executor.wait_ready(timeout=10)
            say(f"controller dialed {url}: {executor.availability}")
            say(f"  {await worker.wait_line('executor-ready')}")
            greeter = executor.service("greeter", Greeter)
            greeting = await greeter.greet("Ada")
            say(f"await greeter.greet('Ada')       -> {greeting!r}")
            items = [i async for i in greeter.countdown(5)]
            say(f"async for i in greeter.countdown(5) -> {items}")
            if items != [5, 4, 3, 2, 1, 0] or "Ada" not in greeting:
                raise SystemExit("unexpected results")

        # The same from the shell: a fresh controller (a new logical session on the worker).
        command = [
            *GARCON_LINK,
            "call",
            str(root / "controller.toml"),
            "greeter.greet",
            '["Grace"]',
        ]
        say("$ garcon-link call controller.toml greeter.greet '[\"Grace\"]'")
        done = await anyio.to_thread.run_sync(
            lambda: subprocess.run(command, capture_output=True, text=True, timeout=30)
        )
        say(f"  {done.stdout.strip()}   (exit {done.returncode})")
        if done.returncode != 0 or "Grace" not in done.stdout:
            raise SystemExit(f"garcon-link call failed: {done.stderr.strip()}")

        code = await worker.stop()
        say(f"SIGTERM -> {worker.lines[-1]}   (exit {code})")
        if code != 0:
            raise SystemExit(f"the worker exited with {code}")
    say("controller_dials: ok")


if __name__ == "__main__":
    with workspace(HERE) as root:
        anyio.run(main, root)
