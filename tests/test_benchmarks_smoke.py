"""Smoke test of the benchmark harness: a quick run of the floors the test venv has.

It checks that the runner starts the servers, measures and writes its JSON; not speed.  The
coalescing wsproto floor is also checked for what makes it that floor: its client writes the
messages of one event-loop turn, and its server the answers to one read, with one send.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import platform
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
from anyio.abc import ByteStream
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Request

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ("asyncio-tcp", "wsproto", "wsproto-coalesced")
METRICS = ("latency_p50_us", "latency_p99_us", "throughput_calls_per_s", "bulk_mb_per_s")


def quick_run(
    only: str, output: Path, timeout: float, *more: str
) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks --quick --only ONLY --no-readme --output OUTPUT [MORE]``."""
    command = [sys.executable, "-m", "benchmarks", "--quick", "--only", only, "--no-readme"]
    return subprocess.run(
        [*command, "--output", str(output), *more],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def relay_run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.relay ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.relay", *args],
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


def test_quick_run_under_python_reports_the_interpreter_and_uvloop_apart(tmp_path: Path) -> None:
    """``--python PY`` (what ``make bench`` runs for each interpreter): the measurement runs in
    a child under PY on plain asyncio, then once more on uvloop when PY has it; each run has its
    own file and table, and ``--output`` holds both."""
    output = tmp_path / "latest.json"
    completed = quick_run(",".join(ENTRIES), output, 90, "--python", sys.executable)

    assert completed.returncode == 0, completed.stdout + completed.stderr
    combined = json.loads(output.read_text(encoding="utf-8"))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    has_uvloop = importlib.util.find_spec("uvloop") is not None
    runs = combined["runs"]
    assert [(run["role"], run["loop"], run["file"]) for run in runs] == [
        ("main", "asyncio", f"python{version}.json"),
        *([("uvloop", "uvloop", f"python{version}-uvloop.json")] if has_uvloop else []),
    ]
    for run in runs:
        doc = json.loads((tmp_path / run["file"]).read_text(encoding="utf-8"))
        assert doc == run["doc"]
        assert doc["event_loop"] == run["loop"]
        assert [entry["name"] for entry in doc["entries"]] == list(ENTRIES)
        assert all(entry["status"] == "ok" for entry in doc["entries"]), doc["entries"]
    section = completed.stdout
    assert f"### Python {version}\n" in section
    assert "| `wsproto` | " in section and "(1.00\u00d7)" in section
    assert f"### CPython {platform.python_version()}, plain asyncio" in section
    if has_uvloop:
        assert f"### CPython {platform.python_version()}, uvloop" in section
        assert "#### uvloop against plain asyncio" in section
    else:
        assert "no uvloop figures: uvloop is not installed" in section


@contextmanager
def _repository_on_path() -> Iterator[None]:
    """The repository on ``sys.path``, to import ``benchmarks`` from it."""
    sys.path.insert(0, str(ROOT))
    try:
        yield
    finally:
        sys.path.remove(str(ROOT))


class _ScriptedStream(ByteStream):
    """A byte stream whose reads are given up front and whose sends are recorded."""

    def __init__(self, reads: list[bytes]) -> None:
        self._reads: Iterator[bytes] = iter(reads)
        self.sends: list[bytes] = []

    async def receive(self, max_bytes: int = 65536) -> bytes:
        for data in self._reads:
            assert len(data) <= max_bytes
            return data
        raise anyio.EndOfStream

    async def send(self, item: bytes) -> None:
        self.sends.append(item)

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize(("coalesce", "sends"), [(True, 1), (False, 64)])
def test_the_wsproto_floor_server_answers_one_read_with_one_send_only_when_coalescing(
    coalesce: bool, sends: int
) -> None:
    """One read bringing 64 messages: the coalescing server answers them all with one send,
    the plain one with a send each; both echo every message, in order."""
    with _repository_on_path():
        from benchmarks.servers.wsproto_anyio import serve_connection
    client = WSConnection(ConnectionType.CLIENT)
    handshake = client.send(Request(host="127.0.0.1", target="/"))
    rehearsal = WSConnection(ConnectionType.SERVER)  # opens the client, to write the burst
    rehearsal.receive_data(handshake)
    assert isinstance(next(rehearsal.events()), Request)
    client.receive_data(rehearsal.send(AcceptConnection()))
    assert isinstance(next(client.events()), AcceptConnection)
    payloads = [index.to_bytes(4, "big") * 8 for index in range(64)]
    burst = b"".join(client.send(BytesMessage(data=payload)) for payload in payloads)
    stream = _ScriptedStream([handshake, burst])

    asyncio.run(serve_connection(stream, coalesce=coalesce))

    accept, *answers = stream.sends
    assert accept.startswith(b"HTTP/1.1 101 ")
    assert len(answers) == sends
    client.receive_data(b"".join(answers))
    events = list(client.events())
    assert [event.data for event in events if isinstance(event, BytesMessage)] == payloads
    assert len(events) == len(payloads)


def test_the_coalescing_wsproto_floor_client_writes_a_turns_calls_with_one_send() -> None:
    """64 calls issued in one event-loop turn leave with one send; 64 callers calling in a loop,
    as the throughput measurement does, write several messages per send (a client with a send
    per message fails both)."""
    with _repository_on_path():
        from benchmarks.clients.wsproto_anyio import SendStatistics, connect_coalesced
        from benchmarks.harness import ServerProcess
    payloads = [index.to_bytes(4, "big") * 8 for index in range(64)]
    rounds = 20

    async def measure(port: int) -> tuple[SendStatistics, SendStatistics]:
        async with connect_coalesced(port) as client:
            replies = await asyncio.gather(*(client.call(payload) for payload in payloads))
            assert replies == payloads
            one_turn = client.statistics()

            async def caller(payload: bytes) -> None:
                for _ in range(rounds):
                    assert await client.call(payload) == payload

            await asyncio.gather(*(caller(payload) for payload in payloads))
            return one_turn, client.statistics()

    with ServerProcess("wsproto_coalesced", "asyncio", 20.0, 60.0) as server:
        one_turn, looped = asyncio.run(asyncio.wait_for(measure(server.port), 30))

    assert one_turn == SendStatistics(messages=64, sends=1)
    messages = 64 * (1 + rounds)
    assert looped.messages == messages, looped
    assert looped.sends * 4 <= messages, looped


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
        "storm_gc_pause_ms",
        "storm_p99_factor_storm_nice",
        "storm_p99_factor_gc_freeze",
        "storm_gc_pause_ms_gc_freeze",
        "handshakes_per_s_peak",
    ]
    for item in result["figures"]:
        assert 0 < item["summary"]["median"] < float("inf"), item
    low, full, frozen, modelled = result["runs"]
    assert (low["workers"], full["workers"], frozen["workers"]) == (10, 50, 50)
    assert (full["storm_nice"], modelled["storm_nice"]) == (False, True)
    assert modelled["storm_resumed"] + modelled["storm_fresh_sessions"] >= 25
    # Every phase's collections, and the GC-tracked objects per idle session on each side.
    assert {"cold start", "idle", "idle calls", "storm"} <= full["gc"].keys()
    assert full["gc"]["storm"]["passes"]["0"]["count"] > 0
    for side in ("controller", "worker"):
        assert full[f"gc_tracked_{side}"]["per_session"] > 0
    assert "gc_frozen" not in full
    assert frozen["gc_frozen"] > 0
    # The storm cut every worker of the second child; each came back on a new socket.
    assert full["storm_cut"] == 25
    assert full["storm_connections"] >= 25
    assert full["storm_resumed"] + full["storm_fresh_sessions"] >= 25
    assert full["storm_call_errors"] == 0
    assert sum(count for _, count in full["redial_histogram"]) == full["storm_connections"]
    assert "#### garcon_link fleet" in completed.stdout


def test_the_combined_report_names_a_run_that_wrote_nothing() -> None:
    """A child that died before writing its results is named with its exit status, and the
    interpreters that did write theirs are still compared."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks import report
    finally:
        sys.path.remove(str(ROOT))
    entry = {
        "name": "wsproto",
        "kind": "floor",
        "status": "ok",
        "metrics": {
            metric: {"median": 2.0, "min": 2.0, "max": 2.0, "values": [2.0]} for metric in METRICS
        },
    }
    doc = {
        "started_at": "2026-12-01T00:00:00Z",
        "duration_s": 1.0,
        "settings": {
            "repetitions": 1,
            "latency_calls": 1,
            "small_bytes": 32,
            "latency_warmup": 1,
            "concurrency": 64,
            "throughput_s": 1,
            "throughput_warmup_s": 1,
            "bulk_bytes": 1,
            "bulk_s": 1,
            "bulk_min_calls": 1,
        },
        "event_loop": "asyncio",
        "machine": {
            "cpu_model": "cpu",
            "cpu_count": 2,
            "cpus_usable": 2,
            "platform": "linux",
            "python": "CPython 3.11.7",
            "packages": {},
        },
        "entries": [entry],
        "quick": True,
    }
    report.add_ratios(doc, "wsproto")
    run = {"version": "3.11", "executable": "/py311", "role": "main", "exit_status": 0}
    runs = [
        {**run, "python": "CPython 3.11.7", "loop": "asyncio", "file": "python3.11.json"}
        | {"note": "", "doc": doc},
        {**run, "python": "CPython 3.13.0", "version": "3.13", "executable": "/py313"}
        | {"loop": "asyncio", "file": "python3.13.json", "exit_status": -9}
        | {"note": "exit status -9, no results written", "doc": None},
    ]
    combined = {
        "started_at": "2026-12-01T00:00:00Z",
        "duration_s": 2.0,
        "command": ["python", "-m", "benchmarks"],
        "uvloop_note": "uvloop is not installed",
        "runs": runs,
    }
    section = report.combined_markdown(combined)
    assert "**CPython 3.13.0, plain asyncio** (python3.13.json): exit status -9" in section
    assert "no uvloop figures: uvloop is not installed." in section
    assert "| `wsproto` | 2.00 (1.00\u00d7) |" in section
    assert "### CPython 3.11.7, plain asyncio" in section
    assert "### CPython 3.13.0" not in section


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
        "fairness_during_max_ms",
        "fairness_bulk_mb_per_s",
    ]
    for item in result["figures"]:
        assert 0 < item["summary"]["median"] < float("inf"), item
    [run] = result["runs"]
    assert run["bulk_bytes"] == 4 * 2 * 1024 * 1024
    assert run["during_calls"] >= 1


def test_the_relay_benchmark_refuses_an_unknown_flood_phase_before_it_starts() -> None:
    """``--floods`` is checked up front (``none`` runs no flood phase): an unknown phase is a
    usage error naming the choices, not a flooder child that dies and a crash in the parent."""
    completed = relay_run("--quick", "--floods", "calls,bogus", timeout=30)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "unknown phase 'bogus'" in completed.stderr
    assert "ungranted, calls, streams" in completed.stderr and "Traceback" not in completed.stderr


def test_the_relay_benchmarks_flood_phase_alternates_windows_with_both_flooders() -> None:
    """``--floods-only``: a granted call flood, its flooder paused and resumed through its stdin
    for each pair of windows, run at nice 19 (judged) and at the default priority: each gives
    its median and worst factor, its median p99s, and served calls; ``--flood-pairs 0`` is a
    usage error."""
    command = ("--floods-only", "--floods", "calls")
    completed = relay_run(*command, "--flood-pairs", "2", "--calls", "60", timeout=120)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    figures = json.loads(completed.stdout)
    for suffix in ("", "_plain"):
        factor = figures[f"flood_calls_p99_factor{suffix}"]
        assert 0 < factor <= figures[f"flood_calls_p99_factor_worst{suffix}"] < float("inf")
        assert figures[f"flood_calls_idle_p99_us{suffix}"] > 0
        assert figures[f"flood_calls_p99_us{suffix}"] > 0
        assert figures[f"flood_calls_ok{suffix}"] > 0
    assert "flooder at nice 19 (judged)" in completed.stderr
    assert "flooder not niced:" in completed.stderr
    refused = relay_run(*command, "--flood-pairs", "0", timeout=30)
    assert refused.returncode == 2 and "--flood-pairs must be at least 1" in refused.stderr


def test_the_relay_benchmarks_floor_echoes_through_each_proxy_and_reports_its_ratios() -> None:
    """``--floor-only``: the raw wsproto echo direct, through the byte-forwarding proxy and
    through the wsproto-level relay (a wrong echo through either fails the run), each with
    positive figures, the proxies' CPU per call, and the ratios the relay run prints."""
    completed = relay_run("--floor-only", "--calls", "100", "--seconds", "0.3", timeout=60)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    floor = json.loads(completed.stdout)
    for arrangement in ("direct", "bytes", "ws"):
        for figure in ("p50_us", "p99_us", "calls_per_s_64"):
            assert 0 < floor[f"{arrangement}_{figure}"] < float("inf"), (arrangement, figure)
    for kind in ("bytes", "ws"):
        assert floor[f"{kind}_proxy_cpu_us_per_call_64"] >= 0
        assert floor[f"{kind}_p50_factor"] == floor[f"{kind}_p50_us"] / floor["direct_p50_us"]
    assert "through the byte proxy" in completed.stderr


def test_the_turn_tracer_counts_every_turn_its_handles_gc_passes_and_categories() -> None:
    """``benchmarks.turns.TurnTracer`` (both benchmarks' tracer): two turns of known work, the
    automatic GC off so that the only passes are the two asked for."""
    import asyncio
    import gc

    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.turns import Turn, TurnTracer
    finally:
        sys.path.remove(str(ROOT))

    def collect() -> None:
        gc.collect()

    def classify(handle: asyncio.Handle) -> str:
        return "collect" if handle._callback is collect else "rest"  # type: ignore[attr-defined]

    tracer = TurnTracer(classify)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        with tracer:
            await asyncio.sleep(0)  # a turn: this task's step
            loop.call_soon(collect)
            loop.call_soon(collect)
            await asyncio.sleep(0)  # a turn: the two callbacks, then this task's step

    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    turns: list[Turn] = tracer.turns()
    assert [t.handles for t in turns] == [1, 3]
    assert [t.gc_passes for t in turns] == [(0, 0, 0), (0, 0, 2)]
    assert set(turns[1].cpu_by_category) == {"collect", "rest", "GC"}
    assert all(t.end_ns >= t.start_ns and t.cpu_ns > 0 for t in turns)


def test_relay_cpu_bounds_take_the_busiest_process_or_the_shared_cores() -> None:
    """``benchmarks.relay.cpu_bounds``: three processes on two cores are bound by their total
    CPU shared out; with a core each, by the busiest alone."""
    from benchmarks.relay import cpu_bounds

    here, each = cpu_bounds({"caller": 15.0, "gateway": 20.0, "worker": 20.0}, 2)
    assert (round(here), round(each)) == (36364, 50000)
    here, each = cpu_bounds({"caller": 10.0, "worker": 40.0}, 2)
    assert (round(here), round(each)) == (25000, 25000)
