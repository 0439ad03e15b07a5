"""rolling_upgrade: a fleet upgraded one worker at a time under load (docs/guides/upgrading.md).

Run: ``python examples/rolling_upgrade/run.py``.

1. twenty workers are enrolled (one key file each in ``keys/``) and dial a fleet controller in
   this process; each serves ``calc`` at v1 (``add``, ``scale``);
2. a caller calls ``add`` on them without pause, through facades typed by the v1 interface,
   made once;
3. the workers are restarted one by one at v2 (``mul`` added; ``scale`` returns text): each
   replacement session is installed behind the same facades, ``add`` goes on, ``scale``
   through the v1 facade is refused on v2 workers (``CONTRACT_CHANGED``, nothing sent), and
   ``fleet.pick("calc", "mul")`` sends the new method to v2 workers only;
4. the ledger of what the handlers ran shows that no v2 ``scale`` ran, and the failed ``add``
   calls are the honest outcomes of the restarts (not dispatched, or unknown when a call was
   in flight as its worker stopped).

The workers run in this process to keep the example quick; ``garcon-link worker box-NN.toml``
processes behave the same.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import anyio
import anyio.abc
from service import CalcV1, CalcV1Impl, CalcV2, CalcV2Impl, Ledger

import garcon_link as gl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _support import say, set_port, workspace  # noqa: E402

WORKERS = 20
IDS = [f"box-{i:02d}" for i in range(WORKERS)]


def worker_config(root: Path, executor_id: str, port: int) -> gl.LinkConfig:
    text = (root / "worker.toml").read_text(encoding="utf-8").replace("box-00", executor_id)
    path = root / f"{executor_id}.toml"
    path.write_text(text, encoding="utf-8")
    set_port(path, port)
    return gl.load_config(path)


class Hosted:
    """A worker in a task of its own; ``close()`` stops it cleanly and waits until it has."""

    def __init__(self) -> None:
        self.stop = anyio.Event()
        self.stopped = anyio.Event()

    async def close(self) -> None:
        self.stop.set()
        await self.stopped.wait()


async def main(root: Path) -> None:
    (root / "keys").mkdir(mode=0o700)
    for executor_id in IDS:
        gl.write_secret_file(root / "keys" / f"{executor_id}.secret")
    say(f"enrolled {WORKERS} workers: keys/box-00.secret .. keys/box-{WORKERS - 1}.secret")
    set_port(root / "controller.toml", 0)
    ledger: Ledger = []
    outcomes: Counter[str] = Counter()
    async with gl.fleet(gl.load_fleet_config(root / "controller.toml")) as fleet:
        port = fleet.listen_address[1]
        configs = {i: worker_config(root, i, port) for i in IDS}

        async def serve(
            executor_id: str, version: str, *, task_status: anyio.abc.TaskStatus[Hosted]
        ) -> None:
            impl = (CalcV1Impl if version == "v1" else CalcV2Impl)(executor_id, ledger)
            hosted = Hosted()
            try:
                async with gl.Worker(configs[executor_id], {"calc": impl}):
                    task_status.started(hosted)
                    await hosted.stop.wait()
            finally:
                hosted.stopped.set()

        async with anyio.create_task_group() as hosts:
            workers = {i: await hosts.start(serve, i, "v1") for i in IDS}
            facades = {i: fleet.executor(i).service("calc", CalcV1) for i in IDS}
            for executor_id in IDS:
                await fleet.executor(executor_id).wait_ready(20)
            say(f"{WORKERS} workers ready at v1; a caller calls add() on them without pause")
            done = anyio.Event()

            async def caller() -> None:
                for n in range(1_000_000):  # bounded; stops when the upgrade is over
                    if done.is_set():
                        return
                    try:
                        await facades[IDS[n % WORKERS]].add(n, 1)
                        outcomes["ok"] += 1
                    except gl.CallError as exc:
                        outcomes[f"{type(exc).__name__} [{exc.outcome.value}:{exc.code}]"] += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                for step, executor_id in enumerate(IDS, start=1):
                    await workers[executor_id].close()
                    workers[executor_id] = await hosts.start(serve, executor_id, "v2")
                    await fleet.executor(executor_id).wait_ready(20)
                    if step in (1, WORKERS // 2, WORKERS):
                        await report(fleet, facades, step)
                done.set()
            for hosted in workers.values():
                await hosted.close()

    say("add() during the upgrade:")
    for outcome, count in sorted(outcomes.items()):
        say(f"  {count:>6}  {outcome}")
    ran = Counter((version, method) for _, version, method in ledger)
    say(f"ledger: v2 scale handlers that ran for a v1 caller: {ran[('v2', 'scale')]}")
    assert ran[("v2", "scale")] == 0
    assert set(outcomes) <= {
        "ok",
        "NotDispatched [not_dispatched:OFFLINE]",
        "NotDispatched [not_dispatched:RECONNECTING]",
        "NotDispatched [not_dispatched:CONTINUITY_LOST]",
        "OutcomeUnknown [unknown:CONTINUITY_LOST]",
    }, outcomes
    say("rolling_upgrade: ok")


async def report(fleet: gl.Fleet, facades: dict[str, CalcV1], step: int) -> None:
    say(f"upgraded {step}/{WORKERS}:")
    v1 = next((i for i in IDS[step:]), None)
    if v1 is not None:
        say(f"  {v1} (v1)  scale(1.5) via the v1 facade -> {await facades[v1].scale(1.5)!r}")
    v2 = IDS[step - 1]
    try:
        await facades[v2].scale(1.5)
    except gl.Rejected as exc:
        say(f"  {v2} (v2)  scale(1.5) via the v1 facade -> Rejected {exc}")
    picked = sorted({fleet.pick("calc", "mul").executor_id for _ in range(2 * WORKERS)})
    say(f"  fleet.pick('calc', 'mul') over {2 * WORKERS} picks -> {', '.join(picked)}")
    chosen = fleet.pick("calc", "mul")
    mul = await chosen.service("calc", CalcV2).mul(6, 7)
    say(f"  {chosen.executor_id}.mul(6, 7) -> {mul}")
    versions = Counter(row.services.get("calc", "-") for row in fleet.executors().values())
    say(f"  contract versions of calc in the fleet: {dict(sorted(versions.items()))}")


if __name__ == "__main__":
    with workspace(HERE) as root:
        anyio.run(main, root)
