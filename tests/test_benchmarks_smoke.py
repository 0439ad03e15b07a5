"""Smoke test of the benchmark harness: a quick run of the two floors the test venv has.

It checks that the runner starts the servers, measures and writes its JSON; not speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ("asyncio-tcp", "wsproto")
METRICS = ("latency_p50_us", "latency_p99_us", "throughput_calls_per_s", "bulk_mb_per_s")


def quick_run(only: str, output: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks --quick --only ONLY --no-readme --output OUTPUT``."""
    command = [sys.executable, "-m", "benchmarks", "--quick", "--only", only, "--no-readme"]
    return subprocess.run(
        [*command, "--output", str(output)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_quick_run_of_the_floors_writes_positive_figures(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    readme = ROOT / "benchmarks" / "README.md"
    readme_before = readme.read_bytes() if readme.exists() else None

    completed = quick_run(",".join(ENTRIES), output, timeout=60)

    assert completed.returncode == 0, completed.stdout + completed.stderr
    doc = json.loads(output.read_text(encoding="utf-8"))
    assert [entry["name"] for entry in doc["entries"]] == list(ENTRIES)
    for entry in doc["entries"]:
        assert entry["status"] == "ok", entry
        for metric in METRICS:
            figure = entry["metrics"][metric]
            assert figure["median"] > 0, (entry["name"], metric, figure)
            assert figure["min"] <= figure["median"] <= figure["max"]
    assert doc["settings"]["repetitions"] == 1
    assert doc["machine"]["cpu_count"] >= 1
    assert doc["ratios"]["baseline"] == "wsproto"
    assert doc["ratios"]["to_baseline"]["wsproto"]["latency_p50_us"] == 1.0
    assert "| `asyncio-tcp` | floor |" in completed.stdout
    assert (readme.read_bytes() if readme.exists() else None) == readme_before


RESUME_ENTRIES = ("resume", "retention-rss")


def test_quick_run_of_resume_and_retention_rss_writes_positive_figures(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    completed = quick_run(",".join(RESUME_ENTRIES), output, timeout=30)

    assert completed.returncode == 0, completed.stdout + completed.stderr
    doc = json.loads(output.read_text(encoding="utf-8"))
    assert doc["entries"] == []
    results = doc["resume_and_memory"]
    assert [result["name"] for result in results] == list(RESUME_ENTRIES)
    for result in results:
        assert result["status"] == "ok", result
        assert result["figures"], result
        for item in result["figures"]:
            figure = item["summary"]
            assert figure["median"] > 0, (result["name"], item["key"], figure)
            assert figure["min"] <= figure["median"] <= figure["max"]
    resume_runs = results[0]["runs"]
    assert all(run["retained_frames_at_cut"] >= run["frames"] for run in resume_runs)
    assert all(run["replayed_frames"] <= run["frames"] for run in resume_runs)
    rss = results[1]["runs"][0]
    assert (
        rss["retained_bytes"]
        <= rss["budget_bytes"]
        < rss["retained_bytes"] + rss["payload_bytes"] * 2
    )
    assert "#### garcon_link resume and memory" in completed.stdout


def test_quick_run_of_the_fleet_benchmark_measures_every_figure(tmp_path: Path) -> None:
    """``--only fleet --quick``: 50 workers in two child processes dial one controller child."""
    output = tmp_path / "results.json"
    completed = quick_run("fleet", output, timeout=60)

    assert completed.returncode == 0, completed.stdout + completed.stderr
    doc = json.loads(output.read_text(encoding="utf-8"))
    [result] = doc["fleet"]
    assert result["status"] == "ok", result
    keys = [item["key"] for item in result["figures"]]
    assert keys == [
        "cold_start_s",
        "rss_per_executor_kib",
        "map_p50_s",
        "idle_p99_ms",
        "storm_recovered_s",
        "storm_p99_factor",
        "handshakes_per_s_peak",
    ]
    for item in result["figures"]:
        assert 0 < item["summary"]["median"] < float("inf"), item
    low, full = result["runs"]
    assert (low["workers"], full["workers"]) == (10, 50)
    # The storm cut every worker of the second child; each came back on a new socket.
    assert full["storm_cut"] == 25
    assert full["storm_connections"] >= 25
    assert full["storm_resumed"] + full["storm_fresh_sessions"] >= 25
    assert full["storm_call_errors"] == 0
    assert sum(count for _, count in full["redial_histogram"]) == full["storm_connections"]
    assert "#### garcon_link fleet" in completed.stdout


def test_quick_run_of_the_fairness_benchmark_measures_every_figure(tmp_path: Path) -> None:
    """``--only fairness --quick``: small calls idle, then during 4 x 2 MiB echoes."""
    output = tmp_path / "results.json"
    completed = quick_run("fairness", output, timeout=60)

    assert completed.returncode == 0, completed.stdout + completed.stderr
    doc = json.loads(output.read_text(encoding="utf-8"))
    [result] = doc["resume_and_memory"]
    assert (result["name"], result["status"]) == ("fairness", "ok"), result
    keys = [item["key"] for item in result["figures"]]
    assert keys == [
        "fairness_p99_factor",
        "fairness_idle_p99_ms",
        "fairness_during_p99_ms",
        "fairness_bulk_mb_per_s",
    ]
    for item in result["figures"]:
        assert 0 < item["summary"]["median"] < float("inf"), item
    [run] = result["runs"]
    assert run["bulk_bytes"] == 4 * 2 * 1024 * 1024
    assert run["during_calls"] >= 1
