"""``python -m benchmarks --python PY [--python PY ...]``: one report from several interpreters.

Each interpreter (a venv's ``python`` with garcon_link and the peers installed: ``make bench``
builds ``.venv-3.11``, ``.venv-3.13``, ... and passes them) runs ``python -m benchmarks`` in a
child process of its own, one after the other, each writing ``results/python3.X.json``:

* every interpreter measures the selected echo entries on plain asyncio;
* the first one also measures the garcon_link-only entries (``resume``, ``retention-rss``,
  ``fleet``, ...): they say little about the interpreter and take minutes;
* the last one measures the echo entries whose servers run an asyncio event loop (floors and
  ours) once more on uvloop (``results/python3.X-uvloop.json``), with at most
  :data:`UVLOOP_REPETITIONS` repetitions, when uvloop is installed there (the ``fast`` extra).

Then ``results/latest.json`` (``--output``) holds all of these documents (``"runs"``) and the
README's generated section shows them side by side (``report.combined_markdown``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import harness, report
from .systems import Entry

UVLOOP_REPETITIONS = 3
"""Repetitions of the uvloop run at most (the asyncio runs use ``--repetitions``)."""

CHILD_LIMIT_S = 4 * 3600.0
"""Upper bound of one interpreter's run (the full run is about 8 minutes per interpreter)."""

_PROBE = (
    "import importlib.util, platform, sys; "
    "print('%d.%d' % sys.version_info[:2], platform.python_implementation(), "
    "platform.python_version(), importlib.util.find_spec('uvloop') is not None)"
)


def _probe(python: str) -> tuple[str, str, bool]:
    """``(X.Y, 'CPython 3.X.Z', uvloop installed)`` of an interpreter."""
    completed = subprocess.run(
        [python, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if completed.returncode != 0:
        raise SystemExit(f"--python {python}: cannot run it: {completed.stderr.strip()}")
    version, implementation, full, uvloop = completed.stdout.split()
    return version, f"{implementation} {full}", uvloop == "True"


def _common_args(args: argparse.Namespace) -> list[str]:
    """The options every child gets (not ``--only``, ``--loop``, ``--output``, the README)."""
    common = ["--baseline", args.baseline]
    if args.quick:
        common.append("--quick")
    if args.repetitions is not None:
        common += ["--repetitions", str(args.repetitions)]
    return common


def _child(
    python: str, names: list[str], extra_args: list[str], loop: str, output: Path
) -> tuple[int, dict[str, Any] | None]:
    """Run ``python -m benchmarks`` for ``names`` in ``python``; its exit code and document."""
    output.unlink(missing_ok=True)  # never report a previous run's file as this one's
    command = [python, "-m", "benchmarks", "--only", ",".join(names), *extra_args]
    command += ["--loop", loop, "--no-readme", "--output", str(output)]
    print(f"== {' '.join(command)}", file=sys.stderr, flush=True)
    try:
        completed = subprocess.run(
            command,
            cwd=harness.ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # the section it would print; the log goes to stderr
            timeout=CHILD_LIMIT_S,
            check=False,
        )
        code = completed.returncode
    except subprocess.TimeoutExpired:
        code = -1
    doc = report.read_json(output) if output.exists() else None
    return code, doc


def run(args: argparse.Namespace, argv: list[str], entries: list[Entry], extras: list[str]) -> int:
    """Measure under every ``--python`` and write one report; exit status 1 if any failed."""
    started = time.time()
    wall_before = time.perf_counter()
    # children run in the repository: a relative path must not change meaning
    pythons = [os.path.abspath(p) if os.sep in p else shutil.which(p) or p for p in args.python]
    probes = [_probe(python) for python in pythons]
    common = _common_args(args)
    results_dir = Path(args.output).parent
    runs: list[dict[str, Any]] = []
    used: set[str] = set()

    def measure(index: int, names: list[str], loop: str, role: str, extra: list[str]) -> None:
        version, label, _ = probes[index]
        stem = f"python{version}" + ("-uvloop" if role == "uvloop" else "")
        while stem in used:  # the same X.Y twice: python3.11-2.json
            stem += "-2"
        used.add(stem)
        output = results_dir / f"{stem}.json"
        code, doc = _child(pythons[index], names, [*common, *extra], loop, output)
        note = ""
        if doc is None:
            note = f"exit status {code}, no results written"
        elif code != 0:
            note = f"exit status {code}: an entry failed (see its notes)"
        runs.append(
            {
                "python": label,
                "version": version,
                "executable": pythons[index],
                "loop": loop,
                "role": role,
                "file": output.name,
                "exit_status": code,
                "note": note,
                "doc": doc,
            }
        )

    echo = [entry.name for entry in entries]
    for index in range(len(pythons)):
        names = echo + extras if index == 0 else echo
        if names:
            measure(index, names, args.loop, "main", [])

    uvloop_note = ""
    last = len(pythons) - 1
    asyncio_served = [entry.name for entry in entries if entry.kind in ("floor", "ours")]
    if args.loop != "asyncio":
        uvloop_note = f"the runs above are on `--loop {args.loop}` already"
    elif not asyncio_served:
        uvloop_note = "no floor or garcon_link echo entry selected"
    elif not probes[last][2]:
        uvloop_note = (
            f"uvloop is not installed under {probes[last][1]} "
            "(pip install 'garcon-link[fast]'): no uvloop figures"
        )
    else:
        repetitions = min(args.repetitions or harness.Settings().repetitions, UVLOOP_REPETITIONS)
        extra = [] if args.quick else ["--repetitions", str(repetitions)]
        measure(last, asyncio_served, "uvloop", "uvloop", extra)

    combined = {
        "schema": 2,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "duration_s": time.perf_counter() - wall_before,
        "command": ["python", "-m", "benchmarks", *argv],
        "uvloop_note": uvloop_note,
        "runs": runs,
    }
    section = report.combined_markdown(combined)
    report.write_json(combined, args.output)
    written = [str(args.output), *(str(results_dir / run["file"]) for run in runs)]
    if not args.no_readme:
        report.update_readme(args.readme, section)
        written.append(str(args.readme))
    print(section)
    print(f"written: {', '.join(written)}", file=sys.stderr)
    return 1 if any(run["exit_status"] != 0 or run["doc"] is None for run in runs) else 0
