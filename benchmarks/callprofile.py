"""``python -m benchmarks.callprofile``: what one sequential call costs, counted, not timed.

Timings on a shared 2-core VM move by a quarter from run to run; counts do not. For the raw
wsproto floor and garcon_link's facade call (the ``wsproto`` and ``ours-call`` entries: same
server child process, same client, 32-byte echo), this counts per call:

- **loop turns** of the client's event loop (``BaseEventLoop._run_once``);
- **syscalls** of the server process by name (``strace -c -f``; needs strace);
- **messages** the client wrote and read (garcon_link only: its transport statistics), for
  sequential calls and, after them, for :data:`IN_FLIGHT` calls in flight (what coalescing
  leaves: several calls' frames in one message, one socket write);
- with ``--instructions``, **instructions** executed by each side during the measured calls
  (valgrind's callgrind, instrumentation switched on for those calls only; the run is about
  50 times slower), and for ``ours-call`` their ratio to the ``wsproto`` floor's, per side.
  Instructions do not depend on the machine's speed, but they do on its load a little: how
  the two processes' loop turns interleave decides how often a receipt rides alone or a
  writer wakes, which moves a count by up to a tenth between runs on a busy machine (compare
  runs made back to back).

The output is a Markdown table (``benchmarks/README.md`` quotes one). Usage::

    python -m benchmarks.callprofile [--calls N] [--instructions] [--only wsproto,ours-call]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .systems import BY_NAME

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ("wsproto", "ours-call")
PAYLOAD = b"x" * 32
WARMUP = 300
IN_FLIGHT = 64


def _server(entry: str, prefix: list[str]) -> tuple[subprocess.Popen[str], int]:
    module = f"benchmarks.servers.{BY_NAME[entry].server}"
    command = [*prefix, sys.executable, "-m", module, "--port", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        raise RuntimeError(f"{entry} server did not start: {line!r}")
    return proc, int(line.split()[1])


def _counting_loop() -> tuple[asyncio.AbstractEventLoop, list[int]]:
    loop = asyncio.new_event_loop()
    count = [0]
    run_once = loop._run_once  # type: ignore[attr-defined]

    def counted() -> None:
        count[0] += 1
        run_once()

    loop._run_once = counted  # type: ignore[attr-defined]
    return loop, count


def _callgrind(pid: int, switch: str) -> None:
    subprocess.run(
        ["callgrind_control", "-i", switch, str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _totals(pattern: Path) -> int:
    total = 0
    for path in pattern.parent.glob(pattern.name):
        match = re.search(r"^totals:\s+(\d+)", path.read_text(errors="replace"), re.M)
        if match:
            total += int(match.group(1))
    return total


def _measure(
    entry: str,
    calls: int,
    *,
    around: Callable[[subprocess.Popen[str]], tuple[Callable[[], None], Callable[[], None]]],
    prefix: list[str],
) -> dict[str, Any]:
    proc, port = _server(entry, prefix)
    _, connect = BY_NAME[entry].load_client()
    loop, turns = _counting_loop()
    result: dict[str, Any] = {}

    async def client() -> None:
        async with connect(port) as echo:
            for _ in range(WARMUP):
                await echo.call(PAYLOAD)
            start, stop = around(proc)
            stats = _transport(echo)
            turns_before = turns[0]
            start()
            for _ in range(calls):
                if await echo.call(PAYLOAD) != PAYLOAD:
                    raise RuntimeError("echo mismatch")
            stop()
            result["client_turns"] = (turns[0] - turns_before) / calls
            after = _transport(echo)
            if stats is not None and after is not None:
                result["client_written"] = (after[0] - stats[0]) / calls
                result["client_read"] = (after[1] - stats[1]) / calls
                # The same calls, IN_FLIGHT at a time (not counted by strace or callgrind).
                per_task = max(1, calls // IN_FLIGHT)

                async def caller() -> None:
                    for _ in range(per_task):
                        if await echo.call(PAYLOAD) != PAYLOAD:
                            raise RuntimeError("echo mismatch")

                await asyncio.gather(*(caller() for _ in range(IN_FLIGHT)))
                flight = _transport(echo)
                assert flight is not None
                result["flight_written"] = (flight[0] - after[0]) / (per_task * IN_FLIGHT)
                result["flight_read"] = (flight[1] - after[1]) / (per_task * IN_FLIGHT)

    try:
        loop.run_until_complete(client())
    finally:
        loop.close()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=120)
    return result


def _transport(echo: Any) -> tuple[int, int] | None:
    """garcon_link's client: (messages written, messages read) so far."""
    executor = getattr(echo, "executor", None)
    if executor is None:
        return None
    stats = executor.statistics().transport
    return None if stats is None else (stats.messages_written, stats.messages_read)


def syscalls(entry: str, calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "strace.txt"
        tracer: list[subprocess.Popen[bytes]] = []

        def around(proc: subprocess.Popen[str]) -> tuple[Callable[[], None], Callable[[], None]]:
            def start() -> None:
                tracer.append(
                    subprocess.Popen(
                        ["strace", "-c", "-f", "-o", str(out), "-p", str(proc.pid)],
                        stderr=subprocess.DEVNULL,
                    )
                )
                # strace attaches asynchronously: give it time before the measured calls.
                time.sleep(0.5)

            def stop() -> None:
                tracer[0].terminate()
                tracer[0].wait(timeout=30)

            return start, stop

        result = _measure(entry, calls, around=around, prefix=[])
        counts: dict[str, float] = {}
        for line in out.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                counts[parts[-1]] = int(parts[3]) / calls
        result["server_syscalls"] = counts
        return result


def instructions(entry: str, calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server_out = Path(tmp) / "server.%p"
        prefix = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={server_out}",
        ]

        def around(proc: subprocess.Popen[str]) -> tuple[Callable[[], None], Callable[[], None]]:
            def start() -> None:
                _callgrind(proc.pid, "on")

            def stop() -> None:
                _callgrind(proc.pid, "off")

            return start, stop

        result = _measure(entry, calls, around=around, prefix=prefix)
        result["server_instructions"] = _totals(Path(tmp) / "server.*") / calls
        # The client side: this module again, under callgrind, measuring itself.
        client_out = Path(tmp) / "client.%p"
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={client_out}",
                sys.executable,
                "-m",
                "benchmarks.callprofile",
                "--self-instrument",
                "--only",
                entry,
                "--calls",
                str(calls),
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        result["client_instructions"] = _totals(Path(tmp) / "client.*") / calls
        return result


def _self_instrument(entry: str, calls: int) -> None:
    """Run under callgrind by :func:`instructions`: count this process's measured calls."""
    me = os.getpid()

    def around(proc: subprocess.Popen[str]) -> tuple[Callable[[], None], Callable[[], None]]:
        return (lambda: _callgrind(me, "on")), (lambda: _callgrind(me, "off"))

    _measure(entry, calls, around=around, prefix=[])


def _instructions(row: dict[str, Any], floor: dict[str, Any] | None, key: str) -> str:
    """``row``'s count of ``key`` in thousands, with its ratio to the wsproto floor's (when
    the floor was measured too and this is another entry)."""
    cell = f"{row[key] / 1000:.0f}k"
    if floor is not None and floor is not row and floor.get(key):
        cell += f" ({row[key] / floor[key]:.2f}x)"
    return cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.callprofile", description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="measured calls (default 2000)")
    parser.add_argument("--only", default=",".join(ENTRIES), help="entries, comma-separated")
    parser.add_argument(
        "--instructions", action="store_true", help="also count instructions (valgrind)"
    )
    parser.add_argument("--self-instrument", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    entries = [name.strip() for name in args.only.split(",") if name.strip()]
    if args.self_instrument:
        _self_instrument(entries[0], args.calls)
        return 0
    if shutil.which("strace") is None:
        parser.error("strace is needed (Debian: apt-get install strace)")
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind")
    version = ".".join(map(str, sys.version_info[:3]))
    rows = []
    for entry in entries:
        row = syscalls(entry, args.calls)
        if args.instructions:
            counted = instructions(entry, min(args.calls, 1000))
            # Only the instructions: turns and messages come from the run at full speed.
            row["client_instructions"] = counted["client_instructions"]
            row["server_instructions"] = counted["server_instructions"]
        rows.append((entry, row))
    floor = dict(rows).get("wsproto")
    print(f"Per sequential 32-byte call, CPython {version}, {args.calls} calls:\n")
    header = ["entry", "client loop turns", "client msgs out/in", f"same, {IN_FLIGHT} in flight"]
    header.append("server syscalls (top 5)")
    if args.instructions:
        header += ["client instructions", "server instructions"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for entry, row in rows:
        counts = row["server_syscalls"]
        shown = ", ".join(
            f"{name} {n:.2f}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:5]
        )
        messages = (
            f"{row['client_written']:.2f} / {row['client_read']:.2f}"
            if "client_written" in row
            else "-"
        )
        flight = (
            f"{row['flight_written']:.3f} / {row['flight_read']:.3f}"
            if "flight_written" in row
            else "-"
        )
        cells = [
            entry,
            f"{row['client_turns']:.2f}",
            messages,
            flight,
            f"{sum(counts.values()):.2f}: {shown}",
        ]
        if args.instructions:
            cells += [
                _instructions(row, floor, "client_instructions"),
                _instructions(row, floor, "server_instructions"),
            ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
