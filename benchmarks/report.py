"""Results of a run: ratios between entries, the JSON file and the markdown table."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BEGIN = "<!-- BEGIN GENERATED RESULTS: python -m benchmarks rewrites this section -->"
END = "<!-- END GENERATED RESULTS -->"

EN_DASH = "\u2013"
MICRO = "\u00b5"
AT_MOST = "\u2264"


@dataclass(frozen=True)
class Metric:
    key: str
    header: str
    short: str
    lower_is_better: bool


METRICS = (
    Metric("latency_p50_us", f"p50 {MICRO}s", "p50", lower_is_better=True),
    Metric("latency_p99_us", f"p99 {MICRO}s", "p99", lower_is_better=True),
    Metric("throughput_calls_per_s", "calls/s, 64 in flight", "calls/s", lower_is_better=False),
    Metric("bulk_mb_per_s", "1 MiB echo, MB/s", "MB/s", lower_is_better=False),
)

REFERENCE_KINDS = ("floor", "peer")


# ------------------------------------------------------------------------------ ratios


def ratios(doc: dict[str, Any], subject: str, reference: str) -> dict[str, float | None]:
    """``subject`` ÷ ``reference``, metric by metric, from the medians of this run.

    None where either entry has no figure.  Lower is better for latencies, higher for
    calls/s and MB/s: a ratio means the same whichever entry is measured.
    """
    medians = {entry["name"]: entry.get("metrics", {}) for entry in doc["entries"]}
    out: dict[str, float | None] = {}
    for metric in METRICS:
        top = medians.get(subject, {}).get(metric.key)
        bottom = medians.get(reference, {}).get(metric.key)
        if top is None or bottom is None or bottom["median"] == 0:
            out[metric.key] = None
        else:
            out[metric.key] = top["median"] / bottom["median"]
    return out


def measured(doc: dict[str, Any], *kinds: str) -> list[str]:
    """Names of the entries of these kinds that have figures in this run."""
    return [
        entry["name"]
        for entry in doc["entries"]
        if entry["status"] == "ok" and (not kinds or entry["kind"] in kinds)
    ]


def add_ratios(doc: dict[str, Any], baseline: str) -> None:
    """Ratios of every entry to ``baseline``, and of each garcon_link entry to every floor
    and peer measured in the same run."""
    references = measured(doc, *REFERENCE_KINDS)
    doc["ratios"] = {
        "definition": "median of the entry / median of the reference, for each metric",
        "baseline": baseline,
        "to_baseline": (
            {name: ratios(doc, name, baseline) for name in measured(doc)}
            if baseline in references
            else {}
        ),
        "ours": {
            name: {reference: ratios(doc, name, reference) for reference in references}
            for name in measured(doc, "ours")
        },
    }


# -------------------------------------------------------------------------------- JSON


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write the results atomically (``*.tmp`` then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def read_json(path: Path) -> dict[str, Any]:
    """A results file written by :func:`write_json`."""
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return doc


# ---------------------------------------------------------------------------- markdown


def number(value: float) -> str:
    """About three significant digits, thousands separated."""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def figure(summary: dict[str, Any] | None) -> str:
    """``median (min-max)`` (with an en dash), or the median alone for a single repetition."""
    if summary is None:
        return "n/a"
    text = number(summary["median"])
    if len(summary["values"]) > 1:
        text += f" ({number(summary['min'])}{EN_DASH}{number(summary['max'])})"
    return text


def ratio_cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(
    header: list[str], rows: list[list[str]], left: int = 1, notes: bool = False
) -> list[str]:
    """A markdown table: the first ``left`` columns (and a last ``notes`` one) left-aligned,
    the figures right-aligned."""
    aligns = [
        "---" if i < left or (notes and i == len(header) - 1) else "---:"
        for i in range(len(header))
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
    lines.extend("| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows)
    return lines


DISTURBED_PERCENT = 5.0
"""Other processes' load above which the report warns that the figures are disturbed."""


def _load_sentence(cpu: dict[str, Any] | None) -> str:
    if not cpu:
        return "CPU steal and other load: unknown (no /proc/stat)."
    text = (
        f"CPU steal during the run: {cpu['steal_percent']:.2f} % of the machine's CPU time; "
        f"other processes: {cpu['other_load_percent']:.1f} %."
    )
    if cpu["other_load_percent"] > DISTURBED_PERCENT:
        text += (
            " **The machine was shared with other work during this run: the figures,"
            " above all the p99 latencies, are disturbed; compare entries only within it.**"
        )
    return text


def _preamble(doc: dict[str, Any]) -> list[str]:
    machine = doc["machine"]
    settings = doc["settings"]
    cpu = doc.get("cpu")
    memory = f", {machine['memory_gib']} GiB" if machine.get("memory_gib") else ""
    return [
        f"Run of {doc['started_at']}, {_duration(doc['duration_s'])}"
        + (" (`--quick`: tiny counts, not figures to quote)" if doc.get("quick") else "")
        + ".",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs "
        f"({machine['cpus_usable']} usable){memory}, {machine['platform']}; "
        f"{machine['python']}; event loop `{doc['event_loop']}`. " + _load_sentence(cpu),
        "",
        f"Each figure is the median of {settings['repetitions']} repetition(s)"
        + (f", (min{EN_DASH}max) of them" if settings["repetitions"] > 1 else "")
        + f". Latency: {settings['latency_calls']:,} sequential calls of "
        f"{settings['small_bytes']} bytes after {settings['latency_warmup']:,} warm-up calls. "
        f"Throughput: {settings['concurrency']} calls in flight for {settings['throughput_s']:g} s "
        f"after {settings['throughput_warmup_s']:g} s of warm-up. Bulk: {settings['bulk_bytes']:,}"
        f"-byte arguments echoed one at a time for at least {settings['bulk_s']:g} s and "
        f"{settings['bulk_min_calls']} calls, in 10^6 bytes of argument per second.",
    ]


def _results_table(doc: dict[str, Any]) -> list[str]:
    rows = []
    for entry in doc["entries"]:
        cpu = entry.get("cpu") if entry["status"] == "ok" else None
        steal_text = f"{cpu['steal_percent']:.1f}" if cpu else ""
        other_text = f"{cpu['other_load_percent']:.0f}" if cpu else ""
        if entry["status"] == "ok":
            cells = [figure(entry["metrics"].get(metric.key)) for metric in METRICS]
            note = entry.get("settings_note", "")
        else:
            cells = [EN_DASH] * len(METRICS)
            note = f"**{entry['status']}**: {entry['note']}"
        rows.append([f"`{entry['name']}`", entry["kind"], *cells, steal_text, other_text, note])
    header = [
        "entry",
        "kind",
        *(metric.header for metric in METRICS),
        "steal %",
        "other load %",
        "notes",
    ]
    return _table(header, rows, left=2, notes=True)


def _ratio_rows(subject_ratios: dict[str, dict[str, float | None]]) -> list[list[str]]:
    return [
        [f"`{name}`", *(ratio_cell(values[metric.key]) for metric in METRICS)]
        for name, values in subject_ratios.items()
    ]


def _baseline_section(doc: dict[str, Any]) -> list[str]:
    baseline = doc["ratios"]["baseline"]
    lines = ["", f"#### Ratio to `{baseline}`", ""]
    to_baseline = doc["ratios"]["to_baseline"]
    if not to_baseline:
        return [*lines, f"_`{baseline}` has no figures in this run: no ratios._"]
    lines += [
        f"Each median divided by the same median of `{baseline}`: below 1 is faster for the "
        "latencies, above 1 is faster for calls/s and MB/s.",
        "",
    ]
    header = ["entry", *(metric.short for metric in METRICS)]
    return lines + _table(header, _ratio_rows(to_baseline))


def _ours_section(doc: dict[str, Any]) -> list[str]:
    lines = ["", "#### garcon_link against each floor and peer of this run", ""]
    ours = doc["ratios"]["ours"]
    if not ours:
        reasons = sorted(
            {
                f"{entry['status']}: {entry['note']}"
                for entry in doc["entries"]
                if entry["kind"] == "ours" and entry["status"] != "ok"
            }
        )
        why = "; ".join(reasons) if reasons else "no garcon_link entry selected"
        return [*lines, f"_No garcon_link figures in this run ({why}). See `benchmarks/ours.py`._"]
    lines += [
        "Each figure of ours divided by the same figure of the reference (same reading as above).",
    ]
    header = ["reference", *(metric.short for metric in METRICS)]
    for name, by_reference in ours.items():
        lines += ["", f"`{name}`:", ""]
        lines += _table(header, _ratio_rows(by_reference))
    return lines


def _target_cell(item: dict[str, Any]) -> str:
    return "" if item["target"] is None else f"{AT_MOST} {number(item['target'])} {item['unit']}"


def _met_cell(item: dict[str, Any]) -> str:
    if item["met"] is None:
        return ""
    return "yes" if item["met"] else "**no**"


def _targets_table(results: list[dict[str, Any]]) -> list[str]:
    """Figures of ``resume.py`` / ``fleet.py`` results against their targets."""
    rows = []
    for result in results:
        if result["status"] != "ok":
            rows.append(
                [f"`{result['name']}`", f"**{result['status']}**: {result['note']}", "", ""]
            )
            continue
        for item in result["figures"]:
            rows.append(
                [
                    item["label"],
                    f"{figure(item['summary'])} {item['unit']}",
                    _target_cell(item),
                    _met_cell(item),
                ]
            )
    return _table(["measurement", "figure", "target", "met?"], rows)


def _resume_section(doc: dict[str, Any]) -> list[str]:
    """The table of ``benchmarks/resume.py``: garcon_link-only figures against their targets."""
    results = doc.get("resume_and_memory") or []
    if not results:
        return []
    lines = [
        "",
        "#### garcon_link resume and memory",
        "",
        "No peer has these, so they stand against targets instead of ratios (see "
        "`benchmarks/resume.py`). Resume: time from a proxy cut to the controller's session "
        "being past its replay fence on a new socket with every retained frame confirmed. "
        "Memory: the controller process alone, worker unreachable (blackholed), 64 KiB "
        f"notifications sent until retention is full. Median (min{EN_DASH}max) of the "
        "repetitions.",
        "",
    ]
    return lines + _targets_table(results)


def describe_histogram(buckets: list[list[float]]) -> str:
    """``per 0.1 s: 3 5 0 ...`` (counts from the cut on)."""
    if not buckets:
        return "none"
    width = buckets[1][0] if len(buckets) > 1 else 0.1
    return f"per {width:g} s: " + " ".join(str(int(count)) for _, count in buckets)


def _fleet_section(doc: dict[str, Any]) -> list[str]:
    """The table of ``benchmarks/fleet.py``: one run, each figure against its target."""
    results = doc.get("fleet") or []
    if not results:
        return []
    lines = [
        "",
        "#### garcon_link fleet",
        "",
        "Workers in child processes dial one listening controller process (see "
        "`benchmarks/fleet.py`); one run, default limits. The map figure is the median "
        f"(min{EN_DASH}max) of its repetitions.",
        "",
    ]
    lines += _targets_table(results)
    for result in results:
        runs = result.get("runs") or []
        if result["status"] == "ok" and runs:
            full = runs[-1]
            for key, what in (
                ("redial_histogram", "connections arriving at the listener (redials)"),
                ("ready_histogram", "cut executors ready again"),
            ):
                counts = describe_histogram(full[key])
                lines += ["", f"Storm, {what} after the cut, {counts}."]
    return lines


def _versions(doc: dict[str, Any]) -> list[str]:
    installed = [
        f"{name} {version}"
        for name, version in doc["machine"]["packages"].items()
        if version is not None
    ]
    return ["", "Versions: " + ", ".join(installed) + "."]


def markdown(doc: dict[str, Any]) -> str:
    """The generated section of ``benchmarks/README.md`` (without the markers)."""
    echo: list[str] = []
    if doc["entries"]:
        echo = ["", *_results_table(doc), *_baseline_section(doc), *_ours_section(doc)]
    lines = [*_preamble(doc), *echo, *_resume_section(doc), *_fleet_section(doc), *_versions(doc)]
    return "\n".join(lines) + "\n"


def update_readme(path: Path, section: str) -> None:
    """Replace what lies between the markers of ``path`` (appended if they are missing)."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section}{END}"
    start, end = text.find(BEGIN), text.find(END)
    if start != -1 and end > start:
        text = text[:start] + block + text[end + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## Results\n\n" + block + "\n"
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


# ------------------------------------------------------- several interpreters (versions.py)


def _run_title(run: dict[str, Any]) -> str:
    loop = "uvloop" if run["loop"] == "uvloop" else f"`--loop {run['loop']}`"
    if run["loop"] == "asyncio":
        loop = "plain asyncio"
    return f"{run['python']}, {loop}"


def _comparison_section(main_runs: list[dict[str, Any]]) -> list[str]:
    """Each echo entry's medians under every interpreter, each with its ratio to the
    baseline measured under the same interpreter in the same run."""
    docs = [run["doc"] for run in main_runs]
    baselines = sorted({doc["ratios"]["baseline"] for doc in docs})
    names: list[str] = []
    for doc in docs:
        names += [name for name in measured(doc) if name not in names]
    if not names:
        return []
    baseline = baselines[0] if len(baselines) == 1 else "the baseline"
    versions = [run["version"] for run in main_runs]
    lines = [
        "",
        f"### Python {' against '.join(versions)}",
        "",
        "Each entry's median under each interpreter, and in brackets its ratio to "
        f"`{baseline}` measured under the same interpreter in the same run (below 1 is faster "
        "for the latencies, above 1 for calls/s and MB/s). Full tables per interpreter below.",
        "",
    ]
    header = ["entry"]
    for metric in METRICS:
        short = metric.header if metric.lower_is_better else metric.short  # with the unit
        header += [f"{short} {version}" for version in versions]
    rows = []
    for name in names:
        row = [f"`{name}`"]
        for metric in METRICS:
            for doc in docs:
                entry = next((e for e in doc["entries"] if e["name"] == name), None)
                summary = (entry or {}).get("metrics", {}).get(metric.key)
                if summary is None:
                    row.append(EN_DASH)
                    continue
                ratio = doc["ratios"]["to_baseline"].get(name, {}).get(metric.key)
                suffix = "" if ratio is None else f" ({ratio:.2f}\u00d7)"
                row.append(number(summary["median"]) + suffix)
        rows.append(row)
    return lines + _table(header, rows)


def _loop_section(uvloop_run: dict[str, Any], asyncio_doc: dict[str, Any] | None) -> list[str]:
    """The uvloop figures divided by the same interpreter's plain asyncio ones."""
    if asyncio_doc is None:
        return []
    uv_doc = uvloop_run["doc"]
    medians = {entry["name"]: entry.get("metrics", {}) for entry in asyncio_doc["entries"]}
    rows = []
    for name in measured(uv_doc):
        entry = next(e for e in uv_doc["entries"] if e["name"] == name)
        cells = []
        for metric in METRICS:
            top = entry["metrics"].get(metric.key)
            bottom = medians.get(name, {}).get(metric.key)
            ok = top is not None and bottom is not None and bottom["median"]
            cells.append(ratio_cell(top["median"] / bottom["median"] if ok else None))
        rows.append([f"`{name}`", *cells])
    if not rows:
        return []
    header = ["entry", *(metric.short for metric in METRICS)]
    lines = [
        "",
        f"#### uvloop against plain asyncio, {uvloop_run['python']}",
        "",
        "Each uvloop median divided by the plain asyncio median of the same entry under the same "
        "interpreter (same reading as the ratios).",
        "",
        *_table(header, rows),
    ]
    # Synchronous peers (threads on both ends) run no event loop: their figures of the plain
    # asyncio run hold for uvloop too, so ours on uvloop can be read against them.
    threaded = [
        entry["name"]
        for entry in asyncio_doc["entries"]
        if entry["status"] == "ok"
        and entry["kind"] == "peer"
        and entry.get("client_mode") == "sync"
    ]
    ours = measured(uv_doc, "ours")
    if not threaded or not ours:
        return lines
    lines += [
        "",
        "garcon_link on uvloop against the threaded peers (no event loop on either end: their "
        "figures are the plain asyncio run's), each figure of ours divided by theirs:",
        "",
    ]
    # later entries win in ratios(): ours from the uvloop run, the peers from the asyncio one
    both = {"entries": [*asyncio_doc["entries"], *uv_doc["entries"]]}
    for name in ours:
        peer_rows = [
            [f"`{peer}`", *map(ratio_cell, ratios(both, name, peer).values())] for peer in threaded
        ]
        lines += [f"`{name}`:", "", *_table(["reference", *header[1:]], peer_rows), ""]
    return lines[:-1]


def combined_markdown(combined: dict[str, Any]) -> str:
    """The generated section for a run under several interpreters (``versions.py``)."""
    runs = combined["runs"]
    main_runs = [run for run in runs if run["role"] == "main" and run["doc"] is not None]
    uvloop_runs = [run for run in runs if run["role"] == "uvloop"]
    pythons = ", ".join(run["python"] for run in runs if run["role"] == "main")
    first = main_runs[0]["doc"] if main_runs else {}
    only_first = [
        name
        for name, key in (("resume, memory", "resume_and_memory"), ("fleet", "fleet"))
        if first.get(key)
    ]
    lines = [
        f"Run of {combined['started_at']}, {_duration(combined['duration_s'])} in all: "
        f"`{' '.join(combined['command'])}`, under {pythons}, one after the other on the same "
        "machine, each in its own venv.",
        "",
        "Every interpreter measured the echo entries on plain asyncio"
        + (
            f"; garcon_link's {' and '.join(only_first)} figures come from "
            f"{main_runs[0]['python']} only"
            if only_first and len(main_runs) > 1
            else ""
        )
        + "; "
        + (
            f"the floors and garcon_link ran once more on uvloop under {uvloop_runs[0]['python']}"
            " (its own tables, never mixed with the plain asyncio ones)."
            if uvloop_runs
            else f"no uvloop figures: {combined.get('uvloop_note') or 'not run'}."
        ),
    ]
    failed = [run for run in runs if run["note"]]
    for run in failed:
        lines += ["", f"**{_run_title(run)}** ({run['file']}): {run['note']}."]
    if any(run["doc"].get("quick") for run in main_runs):
        lines += ["", "`--quick`: tiny counts, not figures to quote."]
    lines += _comparison_section(main_runs)
    for run in main_runs:
        lines += ["", f"### {_run_title(run)}", "", markdown(run["doc"]).rstrip("\n")]
    for run in uvloop_runs:
        if run["doc"] is None:
            continue
        lines += ["", f"### {_run_title(run)}", "", markdown(run["doc"]).rstrip("\n")]
        asyncio_doc = next(
            (m["doc"] for m in main_runs if m["executable"] == run["executable"]), None
        )
        lines += _loop_section(run, asyncio_doc)
    return "\n".join(lines) + "\n"
