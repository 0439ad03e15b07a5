"""The service every device serves: a typed contract and a toy implementation."""

from __future__ import annotations

import os
import zlib
from typing import Protocol


class Sensors(Protocol):
    async def whoami(self) -> str: ...

    async def read(self, name: str) -> float: ...


class DeviceSensors:
    """Answers with this device's id (its worker's ``DEVICE_ID``) and a reading derived from it."""

    def __init__(self) -> None:
        self.device = os.environ.get("DEVICE_ID", "unknown")

    async def whoami(self) -> str:
        return self.device

    async def read(self, name: str) -> float:
        return round(15 + zlib.crc32(f"{self.device}/{name}".encode()) % 1000 / 100, 2)
