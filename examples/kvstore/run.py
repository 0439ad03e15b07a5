"""The kvstore example, both sides in this process: ``python examples/kvstore/run.py``.

The worker (``garcon_link.Worker``) and the controller (``garcon_link.connect``) each load their
TOML file from a temporary workspace holding a fresh secret. The controller uses the store
through a facade typed as ``KeyValueStore``: plain calls, then the ``changes()`` stream, which
replays the history and then follows live changes.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import anyio
from service import Change, KeyValueStore, served

import garcon_link as gl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import say, workspace  # noqa: E402


def show(change: Change) -> str:
    if change.value is None:
        return f"v{change.version} delete {change.key}"
    return f"v{change.version} set    {change.key} = {change.value!r}"


async def main(root: Path) -> None:
    # Listen on a free port (port 0) instead of the file's 8765; the controller dials what we got.
    worker_config = dataclasses.replace(
        gl.load_config(root / "worker.toml"), listen=("127.0.0.1", 0)
    )
    # The worker side: `async with gl.Worker(...)` serves until the block ends (gl.serve() is the
    # same, run until cancelled).
    async with gl.Worker(worker_config, {"kv": served}, on_event=say) as worker:
        controller_config = dataclasses.replace(
            gl.load_config(root / "controller.toml"), dial=worker.url
        )
        async with gl.connect(controller_config) as executor:
            await executor.wait_ready(timeout=10)
            info = await executor.info()
            say(f"controller ready: executor {info.executor_id}, services {sorted(info.services)}")

            kv = executor.service("kv", KeyValueStore)
            say(f"kv.set('color', 'blue')   -> version {await kv.set('color', 'blue')}")
            say(f"kv.set('size', 'large')   -> version {await kv.set('size', 'large')}")
            say(f"kv.get('color')           -> {await kv.get('color')!r}")
            say(f"kv.delete('size')         -> {await kv.delete('size')!r}")
            say(f"kv.get('size')            -> {await kv.get('size')!r}")

            say("kv.changes(since=0): the history, then live changes")
            seen: list[Change] = []
            async with anyio.create_task_group() as tg:
                changes = kv.changes(since=0)
                async for change in changes:
                    seen.append(change)
                    say(f"  {show(change)}")
                    if change.version == 3:
                        # History replayed; make a change while the stream is open.
                        tg.start_soon(kv.set, "color", "green")
                    if change.version == 4:
                        break
                await changes.aclose()  # cancels the generator on the worker

            expected = [
                Change(1, "color", "blue"),
                Change(2, "size", "large"),
                Change(3, "size", None),
                Change(4, "color", "green"),
            ]
            if seen != expected:
                raise SystemExit(f"unexpected changes: {seen}")
            say(f"kv.get('color')           -> {await kv.get('color')!r}")
    say("kvstore: ok")


if __name__ == "__main__":
    with workspace(HERE) as root:
        anyio.run(main, root)
