"""``python -m benchmarks``: measure the floors, the peers and garcon_link in one run.

Then garcon_link's own resume latency and retention memory (``resume.py``) and its fleet at
scale (``fleet.py``: 1,000 workers on one controller process), which have no counterpart among
the peers.

Writes ``benchmarks/results/latest.json`` and the generated section of
``benchmarks/README.md``, and prints that section.  Exit status 1 if an entry failed
(a peer that is not installed, or garcon_link not yet available, is not a failure).
With ``--python PY`` (repeatable) the measurement runs in those interpreters instead, one
after the other, and the report shows them side by side (``versions.py``; ``make bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from . import eventloop, fairness, fleet, harness, report, resume, versions
from .systems import BY_NAME, ENTRIES, Entry

HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = HERE / "results" / "latest.json"
DEFAULT_README = HERE / "README.md"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark garcon_link against raw floors and peer RPC libraries "
        "(servers in child processes on 127.0.0.1).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny counts (200 calls, 1 s of throughput, 1 repetition): checks the harness",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME[,NAME]",
        help="measure only these entries (or kinds: floor, peer, ours), e.g. "
        "resume,retention-rss,fleet; see --list",
    )
    parser.add_argument(
        "--repetitions", type=int, metavar="N", help="repetitions per figure (default 5)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        metavar="PATH",
        help="JSON results file (default: benchmarks/results/latest.json)",
    )
    parser.add_argument(
        "--no-readme", action="store_true", help="do not rewrite the table in the README"
    )
    parser.add_argument(
        "--readme", type=Path, default=DEFAULT_README, metavar="PATH", help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--baseline",
        default="wsproto",
        metavar="NAME",
        help="entry every other one is compared with (default: wsproto)",
    )
    parser.add_argument(
        "--loop",
        choices=eventloop.CHOICES,
        default="asyncio",
        help="event loop of the asyncio clients and servers (default: asyncio; auto: uvloop "
        "if installed)",
    )
    parser.add_argument(
        "--python",
        action="append",
        metavar="PY",
        help="measure under this interpreter (repeatable; a venv's python with garcon_link and "
        "the peers installed, as `make bench` builds) and report them side by side",
    )
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    return parser


def select(
    only: list[str] | None, parser: argparse.ArgumentParser
) -> tuple[list[Entry], list[str]]:
    """The echo entries and the ``resume.py`` and ``fleet.py`` measurements named by ``--only``
    (in the report's order), or all of them."""
    extras = (*resume.NAMES, *fleet.NAMES, *fairness.NAMES)
    if not only:
        return list(ENTRIES), list(extras)
    wanted: set[str] = set()
    for name in (part.strip() for option in only for part in option.split(",")):
        if not name:
            continue
        if name in BY_NAME or name in extras:
            wanted.add(name)
        elif name in ("floor", "peer", "ours"):
            wanted.update(entry.name for entry in ENTRIES if entry.kind == name)
            if name == "ours":
                wanted.update(extras)
        else:
            known = ", ".join([*BY_NAME, *extras])
            parser.error(f"unknown entry {name!r}; known: {known}")
    return (
        [entry for entry in ENTRIES if entry.name in wanted],
        [name for name in extras if name in wanted],
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for entry in ENTRIES:
            print(f"{entry.name:15} {entry.kind:6} {entry.description}")
        descriptions = {**resume.DESCRIPTIONS, **fleet.DESCRIPTIONS, **fairness.DESCRIPTIONS}
        for name, description in descriptions.items():
            print(f"{name:15} {'ours':6} {description}")
        return 0
    settings = harness.Settings()
    if args.quick:
        settings = settings.quick()
    if args.repetitions is not None:
        if args.repetitions < 1:
            parser.error("--repetitions must be at least 1")
        settings = dataclasses.replace(settings, repetitions=args.repetitions)
    entries, extras = select(args.only, parser)
    if args.python:
        return versions.run(args, sys.argv[1:] if argv is None else argv, entries, extras)

    with harness.signals_end_the_run():
        try:
            doc = harness.run(entries, settings, args.loop)
            extras_started = time.perf_counter()
            doc["resume_and_memory"] = resume.run(extras, settings, args.quick, args.loop)
            # fairness.py's figures stand against targets too: reported in the same table.
            doc["resume_and_memory"] += fairness.run(extras, settings, args.quick, args.loop)
            doc["fleet"] = fleet.run(extras, settings, args.quick, args.loop)
            doc["duration_s"] += time.perf_counter() - extras_started
        finally:
            harness.stop_all_servers()
    doc["quick"] = args.quick
    doc["command"] = ["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)]
    report.add_ratios(doc, args.baseline)

    section = report.markdown(doc)
    report.write_json(doc, args.output)
    written = [str(args.output)]
    if not args.no_readme:
        report.update_readme(args.readme, section)
        written.append(str(args.readme))
    print(section)
    print(f"written: {', '.join(written)}", file=sys.stderr)
    results = [*doc["entries"], *doc["resume_and_memory"], *doc["fleet"]]
    return 1 if any(entry["status"] == "error" for entry in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
