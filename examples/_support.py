"""Plumbing shared by the examples' ``run.py`` scripts (not part of the library).

* :func:`workspace` -- a temporary directory holding copies of an example's TOML files and a fresh
  ``link.secret`` written by ``garcon-link keygen`` (mode 0600). Secrets are never committed.
* :func:`set_port` -- point a copied config at the port actually in use (the committed files say
  8765; the scripts listen on port 0 so two runs never collide).
* :class:`WorkerProcess` -- ``garcon-link worker`` as a child process whose ``key=value`` lines
  are collected; it is always killed when the script ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import anyio
import anyio.abc
from anyio.streams.text import TextReceiveStream

GARCON_LINK = (sys.executable, "-m", "garcon_link.cli")
"""How to run the command line: the same as ``garcon-link`` on PATH, for this interpreter."""


def say(text: str = "") -> None:
    print(text, flush=True)


@contextlib.contextmanager
def workspace(example: Path) -> Iterator[Path]:
    """A temporary copy of ``example``'s configs plus a fresh secret; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"garcon-link-{example.name}-") as tmp:
        root = Path(tmp)
        for config in sorted(example.glob("*.toml")):
            shutil.copy(config, root / config.name)
        keygen = [*GARCON_LINK, "keygen", str(root / "link.secret")]
        subprocess.run(keygen, check=True, capture_output=True, text=True, timeout=30)
        say(f"$ garcon-link keygen {root / 'link.secret'}   (mode 0600, deleted afterwards)")
        yield root


def set_port(config: Path, port: int) -> None:
    """Replace the port of the ``listen``/``dial`` address in a copied config file."""
    text = config.read_text(encoding="utf-8")
    text = re.sub(r"(127\.0\.0\.1:)\d+", rf"\g<1>{port}", text)
    config.write_text(text, encoding="utf-8")


def field(line: str, key: str) -> str:
    """The value of ``key=value`` in a diagnostic line."""
    for part in line.split():
        name, _, value = part.partition("=")
        if name == key:
            return value
    raise ValueError(f"no {key}= in {line!r}")


class WorkerProcess:
    """``garcon-link worker CONFIG --service ...`` in a child process.

    Use ``async with WorkerProcess(...) as worker``; leaving the block kills the child.
    """

    def __init__(
        self,
        config: Path,
        services: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = [*GARCON_LINK, "worker", str(config)]
        for service in services:
            self.command += ["--service", service]
        # The worker stops by itself if this script dies and its stdin pipe closes.
        self.command.append("--stop-on-stdin-eof")
        self.cwd = cwd
        self.env = {**os.environ, **env} if env is not None else None
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._process: anyio.abc.Process | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    async def __aenter__(self) -> WorkerProcess:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._process = await anyio.open_process(
            self.command, cwd=self.cwd, stdin=subprocess.PIPE, env=self.env
        )
        assert self._process.stdout is not None and self._process.stderr is not None
        self._tg.start_soon(self._collect, self._process.stdout, self.lines)
        self._tg.start_soon(self._collect, self._process.stderr, self.stderr)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            with anyio.CancelScope(shield=True):
                self.kill()
                if self._process is not None:
                    with anyio.move_on_after(5):
                        await self._process.wait()
                    await self._process.aclose()
        finally:
            assert self._tg is not None
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)

    async def _collect(self, stream: anyio.abc.ByteReceiveStream, sink: list[str]) -> None:
        pending = ""
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in TextReceiveStream(stream, errors="replace"):
                pending += chunk
                *complete, pending = pending.split("\n")
                sink.extend(complete)

    async def wait_line(self, prefix: str, *, start: int = 0, timeout: float = 15) -> str:
        """The first stdout line (from index ``start``) that starts with ``prefix``."""
        with anyio.fail_after(timeout):
            while True:
                for line in self.lines[start:]:
                    if line.startswith(prefix):
                        return line
                if self._process is not None and self._process.returncode is not None:
                    raise RuntimeError(f"the worker exited: {' | '.join(self.stderr[-3:])}")
                await anyio.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: no goodbye, as if the machine lost power."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()

    async def stop(self) -> int:
        """SIGTERM (graceful) and the exit code."""
        assert self._process is not None
        self._process.terminate()
        with anyio.fail_after(10):
            return await self._process.wait()
