"""The worker_dials example's service: a build runner that streams its log.

Served with a per-session factory (``--service builds=service:build_runner``): each logical session
gets its own runner, built from the session's ``ServiceScope``, so what a runner reports names the
scope (``instance_id``) that owns it, and its cleanup runs when the session is retired.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import anyio

import garcon_link as gl


@dataclass(frozen=True)
class LogLine:
    step: int
    text: str


class BuildRunner(Protocol):
    def run(self, target: str) -> AsyncIterator[LogLine]: ...

    async def whoami(self) -> str: ...


class LocalBuildRunner:
    """A pretend build: a few log lines, a little apart."""

    def __init__(self, scope: gl.ServiceScope) -> None:
        self.scope = scope

    async def run(self, target: str) -> AsyncIterator[LogLine]:
        steps = ["configure", "compile", f"test {target}", "package"]
        for number, step in enumerate(steps, start=1):
            await anyio.sleep(0.02)
            yield LogLine(number, f"[{number}/{len(steps)}] {step}: ok")

    async def whoami(self) -> str:
        return f"{self.scope.executor_id} instance {self.scope.instance_id.hex()[:12]}"


@contextlib.asynccontextmanager
async def build_runner(scope: gl.ServiceScope) -> AsyncIterator[gl.Service]:
    """Per-session factory: one runner per logical session, closed when the session is retired."""
    yield gl.Service(LocalBuildRunner(scope), BuildRunner)
