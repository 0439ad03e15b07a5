"""A child process for ``test_statedir``'s SIGKILL loop: keyed calls journaled in a state
directory as fast as they come, until the test kills it.

Usage: ``statedir_child.py STATE_DIR LEDGER ROUND``. Prints ``ready`` once the directory is
open. Each call's handler appends ``start KEY`` to LEDGER, pauses a random moment, appends
``done KEY`` and returns; 32 run at a time.
"""

from __future__ import annotations

import os
import random
import sys

import anyio
import cbor2

import garcon_link as gl
from garcon_link.rpc.envelopes import RESULT
from garcon_link.rpc.idempotency import Execute, KeyedExecutions, Reply
from garcon_link.rpc.keystore import DurableKeys
from garcon_link.rpc.statedir import open_state_directory


async def main(state_dir: str, ledger_path: str, round_: str) -> None:
    limits = gl.Limits()
    ledger = os.open(ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def open_all() -> DurableKeys:
        return DurableKeys(open_state_directory(state_dir, "crash-box"), limits)

    keys = await anyio.to_thread.run_sync(open_all)
    keys.state.start()
    rng = random.Random(int(round_))
    print("ready", flush=True)
    slots = anyio.Semaphore(32)

    async def handler(name: str) -> Reply:
        os.write(ledger, f"start {name}\n".encode())
        await anyio.sleep(rng.uniform(0, 0.005))
        os.write(ledger, f"done {name}\n".encode())
        return RESULT, cbor2.dumps(name)

    async def one(keyed: KeyedExecutions, name: str) -> None:
        try:
            decision = keyed.admit(("svc", "m", name.encode()), b"d" * 32)
            assert isinstance(decision, Execute)
            keyed.start(decision.entry, lambda: handler(name))
            await keyed.wait(decision.entry)
        finally:
            slots.release()

    async with anyio.create_task_group() as tg:
        keyed = KeyedExecutions(limits, tg.start_soon, store=keys)
        for i in range(10**9):
            await slots.acquire()
            tg.start_soon(one, keyed, f"r{round_}-{i}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
