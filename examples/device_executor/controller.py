"""The controller side: listens, waits for the device to dial in, then uses it.

    python controller.py controller.toml

Prints ``controller-listening url=...`` once listening (that is the URL the device dials), then
runs a command on the device, edits a file there with an optimistic version check, streams a
long-running command's output, and prints ``example-ok`` when every step behaved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

import garcon_link as gl
from garcon_link.services import FileService, ProcessService


async def use_device(config_path: Path, ready_timeout: float) -> None:
    config = gl.load_config(config_path)
    async with gl.connect(config) as executor:
        print(f"controller-listening url={executor.link.url}", flush=True)
        await executor.wait_ready(timeout=ready_timeout)
        info = await executor.info()
        print(f"device-ready executor={info.executor_id} services={sorted(info.services)}")

        proc = executor.service("process", ProcessService)
        files = executor.service("files", FileService)

        # 1. Run a command and collect its output.
        result = await proc.run(["uname", "-sm"], timeout=30)
        print(f"uname: {result.stdout.decode().strip()} (exit {result.status.code})")
        assert result.status.code == 0

        # 2. Edit a file: create it, then change it only if nobody else did meanwhile.
        await files.mkdir("/notes", parents=True)
        created = await files.write("/notes/todo.txt", b"- flash firmware\n", exclusive=True)
        current = await files.read("/notes/todo.txt")
        edited = current.data + b"- reboot\n"
        stat = await files.write("/notes/todo.txt", edited, if_match=created.version)
        print(f"edited {stat.path}: {stat.size} bytes, version {stat.version}")
        try:
            await files.write("/notes/todo.txt", b"stale edit\n", if_match=created.version)
        except gl.Rejected as exc:
            print(f"stale edit refused: {exc.code}")
        else:
            raise AssertionError("a stale edit was accepted")

        # 3. Start a process and follow its output as it is produced.
        handle = await proc.start(
            ["sh", "-c", "for i in 1 2 3; do echo step $i; done; cat todo.txt"], cwd="/notes"
        )
        async for chunk in proc.output(handle):
            for line in chunk.data.decode().splitlines():
                print(f"[{chunk.stream}] {line}")
        status = await proc.wait(handle)
        print(f"process exited with {status.code}")
        assert status.code == 0
        print("example-ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="controller TOML config (role = controller)")
    parser.add_argument("--ready-timeout", type=float, default=30.0)
    args = parser.parse_args()
    anyio.run(use_device, args.config, args.ready_timeout)


if __name__ == "__main__":
    main()
