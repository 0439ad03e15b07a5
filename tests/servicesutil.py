"""Shared helper for the built-in service tests: a worker offering the built-ins, and a
controller connected to it over loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import garcon_link as gl
from garcon_link.services import ServiceLimits, builtin_services

SECRET = gl.Secret(b"builtin-services-test-secret-0123456789")
LIMITS = gl.Limits(
    heartbeat_interval=0.2,
    heartbeat_timeout=1.0,
    detached_grace=5.0,
    backoff_base=0.05,
    backoff_max=0.2,
)


@asynccontextmanager
async def linked(
    root: Path, service_limits: ServiceLimits | None = None
) -> AsyncIterator[gl.RemoteExecutor]:
    """A worker offering the built-ins under ``root`` and a controller connected to it."""
    worker_config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=LIMITS,
    )
    factory = builtin_services(["process", "files"], root, service_limits)
    async with gl.Worker(worker_config, factory) as worker:
        controller_config = gl.LinkConfig(
            executor_id="box",
            role=gl.Role.CONTROLLER,
            secret=SECRET,
            dial=worker.url,
            limits=LIMITS,
        )
        async with gl.connect(controller_config) as executor:
            await executor.wait_ready(10)
            yield executor


# No heartbeats during a test (a pong would trip an armed cut too early); a short grace so a
# cut session is retired quickly.
DURABLE_LIMITS = LIMITS.replace(heartbeat_interval=30.0, heartbeat_timeout=60.0, detached_grace=0.5)


@asynccontextmanager
async def lone_worker(
    root: Path, service_limits: ServiceLimits | None = None, spool_dir: Path | None = None
) -> AsyncIterator[gl.Worker]:
    """A listening worker offering the built-ins; controllers come and go (:func:`controller`)."""
    config = gl.LinkConfig(
        executor_id="box",
        role=gl.Role.WORKER,
        secret=SECRET,
        listen=("127.0.0.1", 0),
        limits=DURABLE_LIMITS,
    )
    factory = builtin_services(["process", "files"], root, service_limits, spool_dir=spool_dir)
    async with gl.Worker(config, factory) as worker:
        yield worker


@asynccontextmanager
async def controller(url: str) -> AsyncIterator[gl.RemoteExecutor]:
    """A fresh controller (a new process, as far as the worker can tell) dialing ``url``."""
    config = gl.LinkConfig(
        executor_id="box", role=gl.Role.CONTROLLER, secret=SECRET, dial=url, limits=DURABLE_LIMITS
    )
    async with gl.connect(config) as executor:
        await executor.wait_ready(10)
        yield executor
