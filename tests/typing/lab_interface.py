"""An interface whose hints need imports: the source ``garcon-link stub`` prints for it must paste
as is (tests/test_typing.py type-checks it; tests/test_cli.py imports it and compares contracts)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Optional, Protocol, TypedDict

import garcon_link as gl


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclasses.dataclass
class Point:
    x: float
    y: float = 0.0


@dataclasses.dataclass
class Rect:
    w: float
    h: float
    label: str = "x"
    origin: Point | None = None
    tags: list[str] = dataclasses.field(default_factory=list)


class Options(TypedDict, total=False):
    color: Color
    when: datetime.datetime


class Lab(Protocol):
    async def area(self, r: Rect) -> float: ...
    async def scale(self, r: Rect, k: float = 2.0, *, color: Color = Color.RED) -> Rect: ...
    async def pick(
        self,
        mode: Literal["a", "b"],
        options: Optional[Options] = None,  # noqa: UP045
    ) -> list[uuid.UUID | None]: ...
    def walk(self, n: int) -> AsyncIterator[Point]: ...
    async def job(self, ref: gl.ResourceRef) -> dict[str, Any]: ...
    async def stamp(self, data: bytes = b"\x00") -> datetime.datetime: ...
    @gl.oneway
    async def note(self, text: str = "hi") -> None: ...
