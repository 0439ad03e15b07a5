"""The controller side: listens, waits for the device to dial in, then uses it.

    python controller.py controller.toml

Prints ``controller-listening url=...`` once listening (that is the URL the device dials), then
runs a command on the device, edits a file there with an optimistic version check, streams a
long-running command's output, and prints ``example-ok`` when every step behaved.

Durable processes: ``--hold`` also starts a build under a caller-chosen id
(``start(id="firmware-build", ...)``) and then waits to be killed, mid-build;
``--reconcile`` is the controller restarted afterwards: it finds the build again by its id
(``list()``, then ``start(id=...)`` with the same spec returns the same process without starting
another), reads its whole output by offset, checks it ran once, and prints ``example-ok``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

import garcon_link as gl
from garcon_link.services import FileService, ProcessService

BUILD_ID = "firmware-build"
BUILD = [
    "sh",
    "-c",
    "echo run >> runs.log; i=1; "
    'while [ $i -le 200 ]; do echo "build step $i"; i=$((i+1)); sleep 0.01; done',
]


async def use_device(config_path: Path, ready_timeout: float, mode: str) -> None:
    config = gl.load_config(config_path)
    async with gl.connect(config) as executor:
        print(f"controller-listening url={executor.link.url}", flush=True)
        await executor.wait_ready(timeout=ready_timeout)
        info = await executor.info()
        print(f"device-ready executor={info.executor_id} services={sorted(info.services)}")
        if mode == "reconcile":
            await reconcile(executor)
            return

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
        if mode != "hold":
            print("example-ok", flush=True)
            return

        # 4. A durable build: named by us, so a restarted controller can find it again.
        await files.mkdir("/builds", parents=True)
        build = await proc.start(id=BUILD_ID, argv=BUILD, cwd="/builds")
        print(f"durable-started id={build.id}: the controller now waits to be killed", flush=True)
        await anyio.sleep_forever()


async def reconcile(executor: gl.RemoteExecutor) -> None:
    """The restarted controller: find the build by its id and read all of its output."""
    proc = executor.service("process", ProcessService)
    files = executor.service("files", FileService)
    records = {r.id: r for r in await proc.list()}
    found = records[BUILD_ID]
    state = "running" if found.running else f"exited {found.status}"
    print(f"list(): {BUILD_ID} {state}, {found.stdout_end} stdout bytes so far")
    # Same id, same spec: the same process, not a second build.
    handle = await proc.start(id=BUILD_ID, argv=BUILD, cwd="/builds")
    assert handle == found.handle
    print(f"start(id={BUILD_ID!r}) again -> the same process (pid {found.pid})")
    status = await proc.wait(handle)
    output, offset = b"", 0
    while True:
        chunk = await proc.read(handle, "stdout", after=offset, max_bytes=1000)
        assert chunk.truncated is None, chunk.truncated  # nothing was dropped
        output += chunk.data
        offset = chunk.offset + len(chunk.data)
        if chunk.eof:
            break
    lines = output.decode().splitlines()
    assert lines == [f"build step {i}" for i in range(1, 201)], lines[-3:]
    runs = (await files.read("/builds/runs.log")).data
    print(
        f"read {len(output)} bytes by offset: {lines[0]!r} .. {lines[-1]!r}; "
        f"exit {status.code}; runs.log says it ran {runs.count(b'run')} time(s)"
    )
    assert status.code == 0 and runs == b"run\n"
    print("example-ok", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="controller TOML config (role = controller)")
    parser.add_argument("--ready-timeout", type=float, default=30.0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--hold", action="store_true", help="also start a durable build, then wait")
    mode.add_argument(
        "--reconcile", action="store_true", help="find the durable build again and read it"
    )
    args = parser.parse_args()
    chosen = "hold" if args.hold else "reconcile" if args.reconcile else "plain"
    anyio.run(use_device, args.config, args.ready_timeout, chosen)


if __name__ == "__main__":
    main()
