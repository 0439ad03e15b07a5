"""``garcon-link demo``: as a subprocess it keeps every promise and never leaves a child behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from garcon_link import demo

DEMO = (sys.executable, "-m", "garcon_link.cli", "demo")


def _alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting to be reaped does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        try:
            return "\nState:\tZ" not in status.read_text()
        except OSError:
            return False
    return True


def _worker_pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", output)]


@pytest.mark.slow
def test_demo_keeps_every_promise() -> None:
    started = time.monotonic()
    done = subprocess.run(
        DEMO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    elapsed = time.monotonic() - started
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "Traceback" not in out + done.stderr
    assert elapsed < 30, f"the demo took {elapsed:.1f}s"
    # 3: the cut resumes the same session with nothing lost or doubled.
    assert "expected 2000, received 2000, duplicates 0, missing 0" in out
    assert re.search(r"logical session\s+-> (\w+) -> \1 \(unchanged\)", out)
    assert "1 resume, 0 fresh sessions; 0 new executor-ready" in out
    # 4: the killed worker's pending call, and calls while it is gone.
    assert re.search(r"the pending demo\.hold\(30\)\s+-> OutcomeUnknown \[unknown:", out)
    assert re.search(r"while reconnecting\s+-> NotDispatched \[not_dispatched:RECONNECTING\]", out)
    assert re.search(r"while offline\s+-> NotDispatched \[not_dispatched:OFFLINE\]", out)
    assert re.search(r"the same facade: demo\.add\(2, 3\)\s+-> 5", out)
    assert "(new)" in out and "(matches)" in out
    # 5: SIGTERM drains: the executing call gets its result, a new call is refused.
    assert re.search(r"executor-draining executor=demo-worker reason=SIGTERM .*running=1", out)
    assert re.search(r"availability\s+-> ready -> draining \(the worker's goodbye\)", out)
    assert re.search(r"while draining\s+-> NotDispatched \[not_dispatched:DRAINING\]", out)
    assert re.search(r"the pending demo\.hold\(1\.5\)\s+-> 'done'", out)
    assert re.search(r"the worker\s+-> exit 0", out)
    # 6: the summary.
    assert "8/8 promises kept" in out
    assert out.count(" yes\n") == 8
    for pid in _worker_pids(out):
        assert not _alive(pid), f"worker pid {pid} outlived the demo"


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_interrupted_demo_kills_its_worker() -> None:
    process = subprocess.Popen(
        DEMO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
    )
    try:
        assert process.stdout is not None
        seen = ""
        deadline = time.monotonic() + 30
        while "1. calls" not in seen and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen += line
        pids = _worker_pids(seen)
        assert pids, seen
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=30)
        assert process.returncode == 130, seen + rest
        assert "interrupted" in rest
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def test_summary_fails_when_a_promise_is_broken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = demo._Demo(tmp_path)
    for result in run.results:
        result.ok = True
        result.observed = "fine"
    assert run.summary() is True
    run.results[2].ok = False
    assert run.summary() is False
    out = capsys.readouterr().out
    assert "7/8 promises kept" in out
    assert "broken: step 3" in out
