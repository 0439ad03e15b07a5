"""Run a small project's commands as a user would: shell lines through ``sh`` with ``garcon-link``
and ``python`` shimmed to this interpreter and checkout (used by test_readme.py and test_cli.py),
and read the example blocks the README and the tutorial (docs/tutorial.md) mark.
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
TUTORIAL = README.parent / "docs" / "tutorial.md"
DEADLINE = 30.0


def readme_blocks(marker: str, page: Path = README) -> dict[str, str]:
    """``<!-- MARKER[: NAME] -->`` followed by a fenced block in ``page`` (the README or a page of
    docs/) -> {NAME or "": block content}."""
    pattern = re.compile(
        r"<!-- " + re.escape(marker) + r"(?::\s*(\S+))? -->\n```[a-z]*\n(.*?)```\n", re.DOTALL
    )
    return {m.group(1) or "": m.group(2) for m in pattern.finditer(page.read_text("utf-8"))}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shim_path(directory: Path) -> dict[str, str]:
    """An environment whose ``garcon-link`` and ``python`` run this interpreter and checkout."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    for name, argv in (
        ("garcon-link", [sys.executable, "-m", "garcon_link.cli"]),
        ("python", [sys.executable]),
    ):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.join(argv)} "$@"\n', encoding="utf-8")
        shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    checkout = str(README.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (checkout, env.get("PYTHONPATH")) if p)
    return env


def command_lines(block: str) -> list[str]:
    """The command of each line (a trailing ``# comment`` dropped)."""
    lines = []
    for raw in block.splitlines():
        command = raw.split("#", 1)[0].strip()
        if command:
            lines.append(command)
    return lines


@contextmanager
def background(command: str, cwd: Path, env: dict[str, str]) -> Iterator[queue.Queue[str | None]]:
    """Run a long-lived command through ``sh``; yield a queue of its stdout lines."""
    process = subprocess.Popen(
        ["sh", "-c", command],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: `cd X && cmd` forks under sh
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield lines
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        reader.join(timeout=10)
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def wait_line(lines: queue.Queue[str | None], prefix: str, timeout: float = DEADLINE) -> str:
    seen: list[str] = []
    for _ in range(1000):
        line = lines.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"exited before a {prefix!r} line: {seen}")
        if line.startswith(prefix):
            return line
        seen.append(line)
    raise AssertionError(f"no {prefix!r} line in {seen}")


def run_project(directory: Path, commands: list[str], env: dict[str, str]) -> str:
    """Run the one-shot commands, the worker in the background, then the controller; return
    what the controller printed. The worker is the command that mentions ``worker``; every
    command before it runs to completion first."""
    (worker_index,) = [i for i, c in enumerate(commands) if " worker " in f" {c} "]
    for command in commands[:worker_index]:
        done = subprocess.run(
            ["sh", "-c", command], cwd=directory, env=env, capture_output=True, text=True,
            timeout=DEADLINE, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stdout, done.stderr)
    with background(commands[worker_index], directory, env) as worker_lines:
        wait_line(worker_lines, "executor-listening")
        outputs = []
        for command in commands[worker_index + 1 :]:
            done = subprocess.run(
                ["sh", "-c", command], cwd=directory, env=env, capture_output=True, text=True,
                timeout=DEADLINE, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert done.returncode == 0, (command, done.stdout, done.stderr)
            outputs.append(done.stdout)
        wait_line(worker_lines, "executor-ready")
    return "".join(outputs)
