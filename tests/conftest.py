"""Shared test configuration: anyio backends, Hypothesis profiles, soak options."""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("ci", parent=settings.get_profile("default"), print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_configure(config: pytest.Config) -> None:
    # A test run started in the background of a non-interactive shell (`cmd &`, nohup, some CI
    # runners) starts with SIGINT ignored, and an ignored signal is inherited by every child
    # process: a worker, a CLI or a process-service child started by a test would then not react
    # to the Ctrl-C the test sends it. The tests run with what a foreground program gets.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-minutes",
        type=float,
        default=None,
        help="run the chaos soak for this many minutes instead of the short CI version",
    )


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every anyio test on both backends."""
    return str(request.param)
