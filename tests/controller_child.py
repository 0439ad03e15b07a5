"""Child of tests/test_many_controllers.py: one controller process of a shared worker.

Usage: ``python controller_child.py URL SECRET_FILE BACKEND [CONTROLLER_ID]``. Connects to the
worker at ``URL`` (executor ``box``) with :func:`garcon_link.connect` on the anyio ``BACKEND``
(as ``CONTROLLER_ID`` if given and not empty), waits until ready
and prints ``READY <its runtime id in hex>``; then answers each line on stdin with one JSON line
on stdout (every step bounded by :data:`STEP_TIMEOUT`):

* ``use N`` -> ``{"add": calc.add(N, 100), "count": list(calc.count(3 + N))}``;
* ``start ID`` -> ``{"started": ID}``: the worker's process service starts a short child, ``ID``;
* ``list`` -> ``{"ids": [...]}``: the process ids the worker's process service lists;
* ``stats`` -> ``{"sessions": N}``: how many sessions this controller has had.

An error is answered ``{"error": "..."}`` (the test fails on it). Exits when stdin closes (or
when killed: the test SIGKILLs one of these as a crashed controller).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
from rpcutil import Calc

import garcon_link as gl
from garcon_link.endpoint.link import WebSocketLink
from garcon_link.services import ProcessService

STEP_TIMEOUT = 10.0
# A socket lost under a loaded machine's stalls resumes its session: the tests count sessions.
LIMITS = gl.Limits(
    heartbeat_interval=0.05,
    heartbeat_timeout=2.0,
    detached_grace=30.0,
    backoff_base=0.01,
    backoff_max=0.05,
    call_timeout=STEP_TIMEOUT,
)


def reply(message: object) -> None:
    print(json.dumps(message), flush=True)


async def answer(executor: gl.RemoteExecutor, command: str, arg: str) -> object:
    calc = executor.service("calc", Calc)
    process = executor.service("process", ProcessService)
    if command == "use":
        n = int(arg)
        return {"add": await calc.add(n, 100), "count": [x async for x in calc.count(3 + n)]}
    if command == "start":
        await process.start([sys.executable, "-c", "pass"], id=arg)
        return {"started": arg}
    if command == "list":
        return {"ids": sorted(info.id for info in await process.list())}
    if command == "stats":
        return {"sessions": executor.statistics().sessions}
    return {"error": f"unknown command {command!r}"}


async def main(url: str, secret_file: Path, controller_id: str) -> None:
    config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.CONTROLLER,
        secret=gl.Secret(secret_file.read_bytes()),
        dial=url,
        limits=LIMITS,
        controller_id=controller_id or None,
    )
    async with gl.connect(config) as executor:
        await executor.wait_ready(timeout=STEP_TIMEOUT)
        link = executor.link
        assert isinstance(link, WebSocketLink)
        print(f"READY {link.runtime_id.hex()}", flush=True)
        lines = anyio.wrap_file(sys.stdin)
        while line := await lines.readline():
            command, _, arg = line.strip().partition(" ")
            try:
                with anyio.fail_after(STEP_TIMEOUT):
                    reply(await answer(executor, command, arg))
            except Exception as exc:  # reported to the test, which fails on it
                reply({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    controller_id = sys.argv[4] if len(sys.argv) > 4 else ""
    anyio.run(main, sys.argv[1], Path(sys.argv[2]), controller_id, backend=sys.argv[3])
