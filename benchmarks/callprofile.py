"""``python -m benchmarks.callprofile``: what one sequential call costs, counted, not timed.

Timings on a shared 2-core VM move by a quarter from run to run; counts do not. For the raw
wsproto floor and garcon_link's facade call (the ``wsproto`` and ``ours-call`` entries: same
server child process, same client, 32-byte echo), this counts per call:

- **loop turns** of the client's event loop (``BaseEventLoop._run_once``);
- **syscalls** of the server process by name (``strace -c -f``; needs strace);
- **messages** the client wrote and read (garcon_link only: its transport statistics), for
  sequential calls and, after them, for :data:`IN_FLIGHT` calls in flight (what coalescing
  leaves: several calls' frames in one message, one socket write), and the times its socket
  writer task woke (``TransportStatistics.writer_wakeups``: each a task switch);
- with ``--instructions``, **instructions** executed by each side during the measured calls
  (valgrind's callgrind, instrumentation switched on for those calls only; the run is about
  50 times slower), and for ``ours-call`` their ratio to the ``wsproto`` floor's, per side:
  once for the sequential calls and once for the calls made :data:`IN_FLIGHT` at a time (each
  phase zeroed before and dumped after, so neither counts the other). The side not being
  counted runs at full speed, so in flight the counted side is the slow one: its reads find
  more of the other side's messages waiting than they would at full speed on both sides.
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
INSTRUCTIONS = (
    "client_instructions",
    "server_instructions",
    "client_flight_instructions",
    "server_flight_instructions",
)


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


def _callgrind(pid: int, option: str) -> None:
    subprocess.run(
        ["callgrind_control", option, str(pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )


def _totals(pattern: Path) -> dict[str, int]:
    """The instructions of each phase in callgrind's dumps (``pattern``: a glob), by phase:
    each dump's description names the phase it closed (see :func:`_callgrind_phases`)."""
    totals: dict[str, int] = {}
    for path in pattern.parent.glob(pattern.name):
        text = path.read_text(errors="replace")
        match = re.search(r"^totals:\s+(\d+)", text, re.M)
        phase = re.search(r"^desc: Trigger: .*?phase-(\w+)", text, re.M)
        if match and phase:
            totals[phase.group(1)] = totals.get(phase.group(1), 0) + int(match.group(1))
    return totals


def _callgrind_phases(pid: int) -> tuple[Phase, Phase]:
    """Counters zeroed and instrumentation on at a phase's start; off and a dump named after
    the phase at its end."""

    def start(phase: str) -> None:
        _callgrind(pid, "--zero")
        _callgrind(pid, "--instr=on")

    def stop(phase: str) -> None:
        _callgrind(pid, "--instr=off")
        _callgrind(pid, f"--dump=phase-{phase}")

    return start, stop


Phase = Callable[[str], None]
"""Called with ``"calls"`` (the sequential calls) or ``"flight"`` (the calls in flight)."""
Around = Callable[[subprocess.Popen[str]], tuple[Phase, Phase]]
"""Given the server process: what to do right before and right after each measured phase."""


def _measure(entry: str, calls: int, *, around: Around, prefix: list[str]) -> dict[str, Any]:
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
            start("calls")
            for _ in range(calls):
                if await echo.call(PAYLOAD) != PAYLOAD:
                    raise RuntimeError("echo mismatch")
            stop("calls")
            result["client_turns"] = (turns[0] - turns_before) / calls
            after = _transport(echo)
            if stats is not None and after is not None:
                result["client_written"] = (after[0] - stats[0]) / calls
                result["client_read"] = (after[1] - stats[1]) / calls
                result["client_wakeups"] = (after[2] - stats[2]) / calls
            # The same number of calls (to a multiple of IN_FLIGHT), IN_FLIGHT at a time.
            per_task = max(1, calls // IN_FLIGHT)

            async def caller() -> None:
                for _ in range(per_task):
                    if await echo.call(PAYLOAD) != PAYLOAD:
                        raise RuntimeError("echo mismatch")

            start("flight")
            await asyncio.gather(*(caller() for _ in range(IN_FLIGHT)))
            stop("flight")
            result["flight_calls"] = per_task * IN_FLIGHT
            flight = _transport(echo)
            if after is not None and flight is not None:
                result["flight_written"] = (flight[0] - after[0]) / result["flight_calls"]
                result["flight_read"] = (flight[1] - after[1]) / result["flight_calls"]
                result["flight_wakeups"] = (flight[2] - after[2]) / result["flight_calls"]

    try:
        loop.run_until_complete(client())
    finally:
        loop.close()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=120)
    return result


def _transport(echo: Any) -> tuple[int, int, int] | None:
    """garcon_link's client: (messages written, messages read, writer wake-ups) so far."""
    executor = getattr(echo, "executor", None)
    if executor is None:
        return None
    stats = executor.statistics().transport
    if stats is None:
        return None
    return (stats.messages_written, stats.messages_read, stats.writer_wakeups)


def syscalls(entry: str, calls: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "strace.txt"
        tracer: list[subprocess.Popen[bytes]] = []

        def around(proc: subprocess.Popen[str]) -> tuple[Phase, Phase]:
            def start(phase: str) -> None:
                if phase != "calls":  # strace counts the sequential calls only
                    return
                tracer.append(
                    subprocess.Popen(
                        ["strace", "-c", "-f", "-o", str(out), "-p", str(proc.pid)],
                        stderr=subprocess.DEVNULL,
                    )
                )
                # strace attaches asynchronously: give it time before the measured calls.
                time.sleep(0.5)

            def stop(phase: str) -> None:
                if phase != "calls":
                    return
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

        def around(proc: subprocess.Popen[str]) -> tuple[Phase, Phase]:
            return _callgrind_phases(proc.pid)

        result = _measure(entry, calls, around=around, prefix=prefix)
        server = _totals(Path(tmp) / "server.*")
        result["server_instructions"] = server["calls"] / calls
        result["server_flight_instructions"] = server["flight"] / result["flight_calls"]
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
        client = _totals(Path(tmp) / "client.*")
        result["client_instructions"] = client["calls"] / calls
        result["client_flight_instructions"] = client["flight"] / result["flight_calls"]
        return result


def _self_instrument(entry: str, calls: int) -> None:
    """Run under callgrind by :func:`instructions`: count this process's measured calls."""
    me = os.getpid()

    def around(proc: subprocess.Popen[str]) -> tuple[Phase, Phase]:
        return _callgrind_phases(me)

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
            for key in INSTRUCTIONS:
                row[key] = counted[key]
        rows.append((entry, row))
    floor = dict(rows).get("wsproto")
    print(f"Per sequential 32-byte call, CPython {version}, {args.calls} calls:\n")
    header = ["entry", "client loop turns", "client msgs out/in", f"same, {IN_FLIGHT} in flight"]
    header.append(f"client writer wake-ups (sequential / {IN_FLIGHT} in flight)")
    header.append("server syscalls (top 5)")
    if args.instructions:
        header += ["client instructions", "server instructions"]
        header += [f"client, {IN_FLIGHT} in flight", f"server, {IN_FLIGHT} in flight"]
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
            f"{row['client_wakeups']:.3f} / {row['flight_wakeups']:.3f}"
            if "flight_wakeups" in row
            else "-",
            f"{sum(counts.values()):.2f}: {shown}",
        ]
        if args.instructions:
            cells += [_instructions(row, floor, key) for key in INSTRUCTIONS]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
