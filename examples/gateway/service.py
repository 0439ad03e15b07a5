"""What every device serves: a typed contract and a toy implementation."""

from __future__ import annotations

import os
from typing import Protocol

import anyio


class Sensors(Protocol):
    async def whoami(self) -> str: ...

    async def read(self, name: str) -> float: ...

    async def bump(self, seconds: float) -> int: ...

    async def bumps(self) -> int: ...


class DeviceSensors:
    """Answers with this device's id (its worker's ``DEVICE_ID``); ``bump`` counts its runs."""

    def __init__(self) -> None:
        self.device = os.environ.get("DEVICE_ID", "unknown")
        self.runs = 0

    async def whoami(self) -> str:
        return self.device

    async def read(self, name: str) -> float:
        return 21.5 if name == "temperature" else 0.0

    async def bump(self, seconds: float) -> int:
        """Count one run, after ``seconds`` (a slow operation that must not run twice)."""
        await anyio.sleep(seconds)
        self.runs += 1
        return self.runs

    async def bumps(self) -> int:
        return self.runs
