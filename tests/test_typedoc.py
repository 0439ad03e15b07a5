"""Type descriptions in the manifest (garcon_link.rpc.typedoc): what a worker describes, within
which bounds, what a controller keeps of a hostile one, and how ``describe`` shows it.

Pure functions are tested directly; one pair over loopback checks that the description reaches
``executor.info()`` without touching the contract, and that a controller with smaller bounds than
its worker keeps a note instead (the worker is the peer that chose the size).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import AsyncIterator
from typing import Any, Generic, NamedTuple, Protocol, TypedDict, TypeVar

import anyio
import msgspec
import pytest
from rpcutil import open_pair

import garcon_link as gl
from garcon_link.core.wire import encode_canonical
from garcon_link.rpc.interface import service_spec
from garcon_link.rpc.manifest import contract_hash
from garcon_link.rpc.typedoc import (
    checked_type_descriptions,
    service_type_description,
    type_description_lines,
)

LIMITS = gl.Limits()


class Shade(enum.Enum):
    LIGHT = "light"
    DARK = "dark"


@dataclasses.dataclass
class Point:
    x: float
    y: float = 0.0


@dataclasses.dataclass
class Rect:
    """A rectangle on the lab's bench."""

    w: float
    h: float
    label: str = "x"
    corner: Point | None = None
    tags: list[str] = dataclasses.field(default_factory=list)
    blob: bytes = b"\x00\x01"


class Options(TypedDict, total=False):
    shade: Shade
    when: datetime.datetime


class Stamp(msgspec.Struct, rename="camel", tag=True):
    made_at: str
    count: int = 1


class Pair(NamedTuple):
    left: int
    right: int


@dataclasses.dataclass
class Tree:
    children: list[Tree]


class Lab(Protocol):
    async def area(self, r: Rect) -> float: ...
    async def paint(self, r: Rect, shade: Shade = Shade.DARK, *, options: Options) -> Rect: ...
    def walk(self, n: int) -> AsyncIterator[Point]: ...
    async def stamp(self, s: Stamp, pair: Pair) -> Tree: ...
    @gl.oneway
    async def note(self, text: str, data: bytes = b"hi") -> None: ...


class LabImpl:
    async def area(self, r: Rect) -> float:
        return r.w * r.h

    async def paint(self, r: Rect, shade: Shade = Shade.DARK, *, options: Options) -> Rect:
        return r

    async def walk(self, n: int) -> AsyncIterator[Point]:
        for i in range(n):
            yield Point(i)

    async def stamp(self, s: Stamp, pair: Pair) -> Tree:
        return Tree([])

    async def note(self, text: str, data: bytes = b"hi") -> None:
        pass


def _names(description: dict[str, Any]) -> list[str]:
    return [entry["name"] for entry in description["types"]]


# ---------------------------------------------------------------------------- the worker side


def test_every_named_type_is_described_once_nearest_first() -> None:
    description = service_type_description(service_spec(Lab), LIMITS)
    here = __name__
    # Breadth first from the methods (sorted by name): area's Rect, paint's Shade and Options,
    # stamp's Stamp, Pair and Tree, walk's Point (already reached through Rect).
    assert _names(description) == [
        f"{here}.Rect",
        f"{here}.Shade",
        f"{here}.Options",
        f"{here}.Stamp",
        f"{here}.Pair",
        f"{here}.Tree",
        f"{here}.Point",
    ]
    by_name = {entry["name"]: entry for entry in description["types"]}
    assert by_name[f"{here}.Rect"] == {
        "name": f"{here}.Rect",
        "kind": "dataclass",
        "doc": "A rectangle on the lab's bench.",
        "fields": [
            {"name": "w", "type": "float", "required": True},
            {"name": "h", "type": "float", "required": True},
            {"name": "label", "type": "str", "required": False, "default": "x"},
            {"name": "corner", "type": f"{here}.Point | None", "required": False, "default": None},
            {"name": "tags", "type": "list[str]", "required": False, "default": []},
            {"name": "blob", "type": "bytes", "required": False, "default": "AAE="},
        ],
    }
    assert by_name[f"{here}.Shade"]["values"] == ["light", "dark"]
    assert [f["required"] for f in by_name[f"{here}.Options"]["fields"]] == [False, False]
    stamp = by_name[f"{here}.Stamp"]
    assert [f["name"] for f in stamp["fields"]] == ["type", "madeAt", "count"]  # JSON keys
    assert stamp["fields"][0]["type"] == "Literal['Stamp']"
    assert by_name[f"{here}.Pair"]["kind"] == "namedtuple"
    assert "more" not in description and "note" not in description


def test_the_json_schema_describes_parameters_results_and_stream_items() -> None:
    schema = service_type_description(service_spec(Lab), LIMITS)["schema"]
    area = schema["methods"]["area"]
    assert area["parameters"] == {
        "type": "object",
        "properties": {"r": {"$ref": "#/$defs/Rect"}},
        "required": ["r"],
        "additionalProperties": False,
    }
    assert area["result"] == {"type": "number"}
    paint = schema["methods"]["paint"]["parameters"]
    assert paint["required"] == ["r", "options"]
    assert paint["properties"]["shade"] == {"$ref": "#/$defs/Shade", "default": "dark"}
    assert schema["methods"]["walk"]["items"] == {"$ref": "#/$defs/Point"}
    note = schema["methods"]["note"]
    assert "result" not in note and "items" not in note
    # bytes: base64 text in JSON (the command line's form); CBOR carries bytes as bytes.
    assert note["parameters"]["properties"]["data"] == {
        "type": "string",
        "contentEncoding": "base64",
        "default": "aGk=",
    }
    rect = schema["$defs"]["Rect"]
    assert rect["required"] == ["w", "h"]
    assert rect["properties"]["blob"]["contentEncoding"] == "base64"
    assert schema["$defs"]["Tree"]["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}


def test_the_description_is_not_part_of_the_contract() -> None:
    spec = service_spec(Lab)
    manifest = spec.manifest()
    # The fields of its record types are (compared with variance), the description is not.
    contract = {"kind", "signature", "uses", "records"}
    assert all(set(entry) <= contract for entry in manifest.values())
    smaller = service_type_description(spec, LIMITS.replace(described_types=1))
    assert smaller != service_type_description(spec, LIMITS)
    assert contract_hash({"lab": spec.manifest()}) == contract_hash({"lab": manifest})


def test_the_worker_bounds_its_description() -> None:
    spec = service_spec(Lab)
    two = service_type_description(spec, LIMITS.replace(described_types=2))
    assert len(two["types"]) == 2 and two["more"] == 5
    assert type_description_lines({"lab": two})[-1] == (
        "(lab: 5 more types not described, over Limits.described_types)"
    )
    # Over the bytes: the schema goes first, then everything but a note.
    whole = len(encode_canonical(service_type_description(spec, LIMITS)))
    assert whole > 2000
    light = service_type_description(spec, LIMITS.replace(type_description_bytes=2000))
    assert "schema" not in light and len(light["types"]) == 7
    assert "over Limits.type_description_bytes (2000)" in light["note"]
    tiny = service_type_description(spec, LIMITS.replace(type_description_bytes=100))
    assert set(tiny) == {"note"} and tiny["note"].startswith("types not described: ")
    shallow = service_type_description(spec, LIMITS.replace(type_description_depth=3))
    assert "type_description_depth (3)" in shallow["note"]


# ---------------------------------------------------------------------------- the controller side


def _deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def test_a_controller_keeps_only_descriptions_within_the_bounds() -> None:
    services: dict[str, Any] = {"lab": {}, "calc": {}, "deep": {}, "many": {}, "big": {}}
    good = service_type_description(service_spec(Lab), LIMITS)
    received = {
        "lab": good,
        "calc": ["not", "a", "map"],
        "deep": {"types": [], "schema": _deep(40)},
        "many": {"types": [{"name": f"T{i}"} for i in range(65)]},
        "big": {"types": [], "schema": {"blob": "x" * 70_000}},
        "unlisted": good,  # a service the manifest does not name
    }
    kept = checked_type_descriptions(received, services, LIMITS)
    assert set(kept) == {"lab", "calc", "deep", "many", "big"}
    assert kept["lab"] == good
    assert kept["calc"] == {"note": "dropped: not a map"}
    assert "type_description_depth (32)" in kept["deep"]["note"]
    assert "65 types, over Limits.described_types (64)" in kept["many"]["note"]
    assert "over Limits.type_description_bytes (65536)" in kept["big"]["note"]
    nothing: Any
    for nothing in (None, [], "types", 7):
        assert checked_type_descriptions(nothing, services, LIMITS) == {}


def test_the_text_of_a_description() -> None:
    description = service_type_description(service_spec(Lab), LIMITS)
    here = __name__
    lines = type_description_lines({"lab": description, "other": description})
    assert lines == [
        f"dataclass {here}.Rect  # A rectangle on the lab's bench.",
        "  w: float",
        "  h: float",
        '  label: str = "x"',
        f"  corner: {here}.Point | None = null",
        "  tags: list[str] = []",
        '  blob: bytes = "AAE="',
        f'enum {here}.Shade: "light", "dark"',
        f"typeddict {here}.Options",
        f"  shade: {here}.Shade  (optional)",
        "  when: datetime.datetime  (optional)",
        f"struct {here}.Stamp",
        "  type: Literal['Stamp']",
        "  madeAt: str",
        "  count: int = 1",
        f"namedtuple {here}.Pair  (a JSON array, fields in this order)",
        "  left: int",
        "  right: int",
        f"dataclass {here}.Tree",
        f"  children: list[{here}.Tree]",
        f"dataclass {here}.Point",
        "  x: float",
        "  y: float = 0.0",
    ]


def test_a_hostile_description_is_shown_escaped_and_cut() -> None:
    hostile = {
        "types": [
            "not a map",
            {"name": "evil\n\x1b[2Jname", "kind": "dataclass", "fields": "not a list"},
            {
                "name": "T",
                "kind": "dataclass",
                "fields": [7, {"name": "f" * 5000, "type": ["x"], "default": b"\x00" * 10}],
            },
            {"name": "E", "kind": "enum", "values": list(range(60))},
        ],
        "more": True,
        "note": "line\nbreak",
    }
    lines = type_description_lines({"svc\n": hostile})
    assert lines[0] == "dataclass evil\\n\\x1b[2Jname"
    assert lines[1] == "dataclass T"
    assert lines[2].startswith("  " + "f" * 200 + "... (5000 chars): <list of 1> = ?")
    assert lines[3].startswith("enum E: 0, 1, 2") and lines[3].endswith(", ... (60 values)")
    assert lines[4] == "(svc\\n: line\\nbreak)"
    assert len(lines) == 5
    assert all(line.isprintable() and len(line) < 600 for line in lines)


# ---------------------------------------------------------------------------- over a link


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_controller_gets_the_description_beside_an_unchanged_contract() -> None:
    services = {"lab": gl.Service(LabImpl(), Lab)}
    with anyio.fail_after(20):
        async with open_pair("worker-listens", services) as pair:
            info = await pair.executor.info()
            assert info.contract == contract_hash(info.services)
            assert info.types["lab"] == service_type_description(service_spec(Lab), LIMITS)
            lab = pair.executor.service("lab", Lab)
            assert await lab.area(Rect(2, 3)) == 6
        # A controller with smaller bounds than its worker keeps a note, and serves on.
        small = LIMITS.replace(type_description_bytes=500)
        async with open_pair(
            "worker-listens", services, limits=small, worker_limits=LIMITS
        ) as pair:
            info = await pair.executor.info()
            size = len(encode_canonical(service_type_description(service_spec(Lab), LIMITS)))
            assert info.types["lab"] == {
                "note": f"dropped: {size} bytes, over Limits.type_description_bytes (500)"
            }
            assert info.contract == contract_hash(info.services)
            lab = pair.executor.service("lab", Lab)
            assert await lab.area(Rect(2, 3)) == 6


def test_a_description_is_built_once_per_interface_and_bounds() -> None:
    class Once(Protocol):
        async def where(self, p: Point) -> Shade: ...

    spec = service_spec(Once)
    first = service_type_description(spec, LIMITS)
    assert service_type_description(spec, LIMITS) is first  # every later session: no rebuild
    assert service_type_description(service_spec(Once), LIMITS) is first
    smaller = LIMITS.replace(described_types=1)
    assert service_type_description(spec, smaller) is not first  # other bounds: its own entry


def test_the_interface_described_most_recently_stays_cached_past_the_bound() -> None:
    class Served(Protocol):
        async def where(self, p: Point) -> Shade: ...

    served = service_spec(Served)
    kept = service_type_description(served, LIMITS)
    for i in range(300):  # more interfaces than the cache holds, as tests (not workers) make
        other: Any = type(f"Other{i}", (), {"f": _one_method})
        service_type_description(service_spec(other), LIMITS)
        assert service_type_description(served, LIMITS) is kept  # used all along: never dropped


async def _one_method(self: Any, n: int) -> int:
    return n


T = TypeVar("T")


class Twin(msgspec.Struct, Generic[T]):
    """Two of a kind."""

    left: T
    right: list[T] = []


class Twins(Protocol):
    async def swap(self, pair: Twin[int]) -> Twin[str]: ...


def test_a_generic_struct_is_described_with_its_bound_field_types() -> None:
    types = service_type_description(service_spec(Twins), LIMITS)["types"]
    by_name = {t["name"].rsplit(".", 1)[-1]: t for t in types}
    assert set(by_name) == {"Twin[int]", "Twin[str]"}
    fields = [(f["name"], f["type"]) for f in by_name["Twin[int]"]["fields"]]
    assert fields == [("left", "int"), ("right", "list[int]")]
    assert by_name["Twin[str]"]["doc"] == "Two of a kind."
