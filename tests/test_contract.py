"""Tests of garcon_link.rpc.contract: one method's contract as a caller expects it against the
worker's, every kind of change in both directions, from real interfaces and from peer text."""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import AsyncIterator, Callable
from typing import (
    Any,
    NamedTuple,
    NotRequired,
    Optional,
    Protocol,
    Required,
    TypedDict,
    TypeVar,
)

import msgspec
import pytest

import garcon_link as gl
from garcon_link.rpc.contract import (
    Compatibility,
    Verdict,
    compare_manifests,
    compare_method,
    service_version,
)
from garcon_link.rpc.interface import MAX_STRUCT_FIELDS, service_spec
from garcon_link.rpc.manifest import MAX_SIGNATURE_CHARS, manifest_changes, method_entries

C, A, I, R = (  # noqa: E741 -- one letter per column of the table
    Compatibility.COMPATIBLE,
    Compatibility.ADDITIVE,
    Compatibility.INCOMPATIBLE,
    Compatibility.REMOVED,
)


def unary(signature: str) -> dict[str, str]:
    return {"kind": "unary", "signature": signature}


def stream(signature: str) -> dict[str, str]:
    return {"kind": "stream", "signature": signature}


# (what changed, the view's entry, the worker's entry, verdict old -> new, verdict new -> old,
#  a fragment of the old -> new difference)
TABLE: list[tuple[str, Any, Any, Compatibility, Compatibility, str]] = [
    ("same", unary("(a: int) -> int"), unary("(a: int) -> int"), C, C, ""),
    ("new method", None, unary("(a: int) -> int"), A, R, "new method"),
    (
        "new optional positional parameter",
        unary("(a: int) -> int"),
        unary("(a: int, b: int = 0) -> int"),
        A,
        I,
        "new optional parameter 'b'",
    ),
    (
        "new optional keyword-only parameter",
        unary("(a: int) -> int"),
        unary("(a: int, *, scale: float = 1.0) -> int"),
        A,
        I,
        "new optional parameter 'scale'",
    ),
    (
        "new required parameter",
        unary("(a: int) -> int"),
        unary("(a: int, b: int) -> int"),
        I,
        I,
        "new required parameter 'b'",
    ),
    (
        "parameter inserted before another",
        unary("(a: int, c: int) -> int"),
        unary("(a: int, b: int = 0, c: int = 0) -> int"),
        I,
        I,
        "parameter 'c' moved",
    ),
    (
        "renamed parameter",
        unary("(a: int) -> int"),
        unary("(x: int) -> int"),
        I,
        I,
        "parameter 'a' removed",
    ),
    (
        "wider parameter type (union)",
        unary("(a: int) -> int"),
        unary("(a: int | str) -> int"),
        A,
        I,
        "wider parameter 'a'",
    ),
    (
        "wider parameter type (Optional)",
        unary("(a: int) -> int"),
        unary("(a: Optional[int]) -> int"),
        A,
        I,
        "wider parameter 'a'",
    ),
    (
        "wider parameter type (numeric tower)",
        unary("(a: int) -> int"),
        unary("(a: float) -> int"),
        A,
        I,
        "wider parameter 'a'",
    ),
    (
        "wider parameter type (Any)",
        unary("(a: int) -> int"),
        unary("(a: typing.Any) -> int"),
        A,
        I,
        "wider parameter 'a'",
    ),
    (
        "other parameter type",
        unary("(a: int, b: int) -> int"),
        unary("(a: str, b: int) -> int"),
        I,
        I,
        "parameter 'a': int  =>  'str' (narrower)",
    ),
    (
        "narrower result type",
        unary("(a: int) -> int | None"),
        unary("(a: int) -> int"),
        A,
        I,
        "narrower result 'int'",
    ),
    (
        "other result type",
        unary("(a: int, b: int) -> int"),
        unary("(a: int, b: int) -> str"),
        I,
        I,
        "result int  =>  'str' (wider)",
    ),
    (
        "narrower stream item type",
        stream("(n: int) -> collections.abc.AsyncIterator[int | None]"),
        stream("(n: int) -> collections.abc.AsyncIterator[int]"),
        A,
        I,
        "narrower result",
    ),
    (
        "generic types compare as text",
        unary("(a: list[int]) -> int"),
        unary("(a: list[int | None]) -> int"),
        I,
        I,
        "parameter 'a'",
    ),
    (
        "parameter gained a default",
        unary("(a: int, b: int) -> int"),
        unary("(a: int, b: int = 2) -> int"),
        A,
        I,
        "parameter 'b' became optional",
    ),
    (
        "changed default",
        unary("(a: int, b: int = 1) -> int"),
        unary("(a: int, b: int = 2) -> int"),
        I,
        I,
        "parameter 'b': default 1  =>  '2'",
    ),
    (
        "positional became keyword-only",
        unary("(a: int, b: int) -> int"),
        unary("(a: int, *, b: int) -> int"),
        I,
        I,
        "parameter 'b' moved or became keyword",
    ),
    (
        "new *args and **kwargs",
        unary("(a: int) -> int"),
        unary("(a: int, *rest: int, **options: str) -> int"),
        A,
        I,
        "new *args 'rest'",
    ),
    ("unary became stream", unary("(n: int) -> int"), stream("(n: int) -> int"), I, I, "kind"),
    (
        "same types spelled differently",
        unary("(a: Optional[int]) -> int"),
        unary("(a: int | None) -> int"),
        C,
        C,
        "",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "forward", "backward", "difference"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_every_kind_of_change_in_both_directions(
    old: Any, new: Any, forward: Compatibility, backward: Compatibility, difference: str
) -> None:
    verdict, text = compare_method(old, new)
    assert verdict is forward
    assert difference in text
    assert compare_method(new, old)[0] is backward
    assert (text == "") is (verdict is Compatibility.COMPATIBLE)


def test_a_one_way_view_of_a_unary_method_is_the_callers_choice() -> None:
    oneway = {"kind": "oneway", "signature": "(text: str) -> None"}
    assert compare_method(oneway, unary("(text: str) -> None"))[0] is C
    assert compare_method(unary("(text: str) -> None"), oneway)[0] is I


@pytest.mark.parametrize(
    "entry",
    [
        "not a map",
        {"kind": "unary", "signature": 42},
        {"kind": "unary", "signature": "(a: int -> int"},
        {"kind": "unary", "signature": "(a: int) -> int; import os"},
        {"kind": "unary", "signature": "(" + "a: int, " * MAX_SIGNATURE_CHARS + ") -> int"},
        {"kind": "unary", "signature": "(a: " + "list[" * 5000 + "int" + "]" * 5000 + ") -> int"},
        {"kind": "teleport", "signature": "(a: int) -> int"},
    ],
    ids=["not a map", "text", "syntax", "statement", "long", "deep", "kind"],
)
def test_a_worker_entry_that_cannot_be_read_is_incompatible_never_an_error(entry: Any) -> None:
    verdict, text = compare_method(unary("(a: int) -> int"), entry)
    assert verdict is I
    assert len(text) < 600  # bounded, whatever the peer sent


class CalcV1(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    async def scale(self, x: float) -> float: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    @gl.oneway
    async def note(self, text: str) -> None: ...


class CalcV2(Protocol):
    """CalcV1 upgraded: one method added, one widened, one changed, one removed."""

    async def add(self, a: int, b: int, c: int = 0) -> int: ...
    async def scale(self, x: float) -> str: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    async def mul(self, a: int, b: int) -> int: ...


def test_manifests_of_real_interfaces_compare_method_by_method() -> None:
    v1 = {"calc": service_spec(CalcV1).manifest()}
    v2 = {"calc": service_spec(CalcV2).manifest(), "files": {"read": unary("(p: str) -> bytes")}}
    verdicts = {(v.service, v.method): v for v in compare_manifests(v1, v2)}
    assert {key: v.compatibility for key, v in verdicts.items()} == {
        ("calc", "add"): A,
        ("calc", "count"): C,
        ("calc", "mul"): A,
        ("calc", "note"): R,
        ("calc", "scale"): I,
        ("files", "read"): A,
    }
    assert verdicts["calc", "scale"].difference == "result float  =>  'str' (wider)"
    assert verdicts["files", "read"].difference == "new service"
    assert verdicts["calc", "add"].usable and not verdicts["calc", "scale"].usable
    backward = {(v.service, v.method): v.compatibility for v in compare_manifests(v2, v1)}
    assert backward[("calc", "add")] is I  # a v2 caller may pass c: a v1 worker does not take it
    assert backward[("calc", "mul")] is R
    assert backward[("files", "read")] is R
    assert backward[("calc", "note")] is A


def test_a_removed_or_unreadable_service() -> None:
    view = {"calc": {"add": unary("(a: int) -> int")}}
    assert compare_manifests(view, {}) == [Verdict("calc", "add", R, "service removed")]
    assert compare_manifests(view, {"calc": "junk"})[0].compatibility is I


def test_the_service_version_is_the_contract_not_its_descriptions() -> None:
    methods = {"add": unary("(a: int) -> int")}
    described = {"add": {**unary("(a: int) -> int"), "description": "adds"}}
    assert service_version(methods) == service_version(described)
    assert len(service_version(methods)) == 12
    assert service_version(methods) != service_version({"add": unary("(a: int) -> str")})


# The fields of record types (msgspec Structs, dataclasses, TypedDicts, NamedTuples) the
# signature text only names. Each class below is one version of a type named ``Point`` (or
# ``Box``), as two versions of one program would declare it.

T = TypeVar("T", bound=type)


def _as(name: str) -> Callable[[T], T]:
    def rename(cls: T) -> T:
        cls.__qualname__ = cls.__name__ = name
        return cls

    return rename


@_as("Point")
class MapV1(msgspec.Struct):
    x: int
    y: int = 0


@_as("Point")
class MapReordered(msgspec.Struct):
    y: int = 0
    x: int = 0


@_as("Point")
class MapAddedOptional(msgspec.Struct):
    x: int
    y: int = 0
    z: int = 0


@_as("Point")
class MapAddedRequired(msgspec.Struct):
    x: int
    z: int
    y: int = 0


@_as("Point")
class MapRemovedOptional(msgspec.Struct):
    x: int


@_as("Point")
class MapRemovedRequired(msgspec.Struct):
    y: int = 0


@_as("Point")
class MapRenamed(msgspec.Struct):
    x: int
    w: int = 0


@_as("Point")
class MapEncodedRenamed(msgspec.Struct, rename={"y": "why"}):
    x: int
    y: int = 0


@_as("Point")
class MapWidened(msgspec.Struct):
    x: int | None
    y: int = 0


@_as("Point")
class MapRetyped(msgspec.Struct):
    x: str
    y: int = 0


@_as("Point")
class MapSpelledOtherwise(msgspec.Struct):
    x: Optional[int]  # noqa: UP045 -- MapWidened's type spelled otherwise
    y: int = 0


@_as("Point")
class MapTagged(msgspec.Struct, tag="p"):
    x: int
    y: int = 0


@_as("Point")
class StrictV1(msgspec.Struct, forbid_unknown_fields=True):
    x: int


@_as("Point")
class StrictAdded(msgspec.Struct, forbid_unknown_fields=True):
    x: int
    z: int = 0


@_as("Point")
@dataclasses.dataclass
class DataV1:
    x: int


@_as("Point")
@dataclasses.dataclass
class DataAdded:
    x: int
    z: int = 0


@_as("Point")
class DictV1(TypedDict):
    x: int


@_as("Point")
class DictAdded(TypedDict, total=False):
    x: Required[int]
    z: int


@_as("Point")
class ArrayV1(msgspec.Struct, array_like=True):
    x: int
    y: int


@_as("Point")
class ArrayReordered(msgspec.Struct, array_like=True):
    y: int
    x: int


@_as("Point")
class ArrayAppended(msgspec.Struct, array_like=True):
    x: int
    y: int
    z: int = 0


@_as("Point")
class ArrayAppendedRequired(msgspec.Struct, array_like=True):
    x: int
    y: int
    z: int


@_as("Point")
class ArrayRemoved(msgspec.Struct, array_like=True):
    x: int


@_as("Point")
class ArrayRetyped(msgspec.Struct, array_like=True):
    x: int
    y: str


@_as("Point")
class ArrayAsMap(msgspec.Struct):
    x: int
    y: int


@_as("Point")
class TupleV1(NamedTuple):
    x: int


@_as("Point")
class TupleAppended(NamedTuple):
    x: int
    z: int = 0


@_as("Inner")
class InnerV1(msgspec.Struct, array_like=True):
    a: int
    b: int


@_as("Inner")
class InnerReordered(msgspec.Struct, array_like=True):
    b: int
    a: int


@_as("Point")
class PointEnum(enum.Enum):
    ORIGIN = 0


@_as("Box")
class BoxOfEnum(msgspec.Struct):
    corner: PointEnum
    items: list[InnerV1] = []


@_as("Holder")
class HolderV1(msgspec.Struct):
    corner: MapV1 | None = None
    n: int = 0


@_as("Holder")
class HolderWithout(msgspec.Struct):
    n: int = 0


@_as("Box")
class BoxV1(msgspec.Struct):
    corner: MapV1
    items: list[InnerV1] = []


@_as("Box")
class BoxInnerChanged(msgspec.Struct):
    corner: MapRetyped
    items: list[InnerV1] = []


@_as("Box")
class BoxDeepChanged(msgspec.Struct):
    corner: MapV1
    items: list[InnerReordered] = []


# Fields a writer may leave out: a msgspec.UNSET default (left out while it holds it), a
# TypedDict key that is not required (left out while absent).
@_as("Point")
class UnsetNone(msgspec.Struct):
    x: int


@_as("Point")
class UnsetAdded(msgspec.Struct):
    x: int
    z: int | msgspec.UnsetType = msgspec.UNSET


@_as("Point")
class UnsetRetyped(msgspec.Struct):
    x: int
    z: str | msgspec.UnsetType = msgspec.UNSET


@_as("Point")
class UnsetWidened(msgspec.Struct):
    x: int
    z: int | str | msgspec.UnsetType = msgspec.UNSET


@_as("Point")
class UnsetAsDefault(msgspec.Struct):
    x: int
    z: int = 0


@_as("Point")
class UnsetAsRequired(msgspec.Struct):
    x: int
    z: int


@_as("Point")
class UnsetPlainType(msgspec.Struct):
    """An UNSET default on a type that does not name UnsetType (msgspec accepts it)."""

    x: int
    z: int = msgspec.UNSET  # type: ignore[assignment]


@_as("Point")
class UnsetStrictNone(msgspec.Struct, forbid_unknown_fields=True):
    x: int


@_as("Point")
class UnsetStrictAdded(msgspec.Struct, forbid_unknown_fields=True):
    x: int
    z: int | msgspec.UnsetType = msgspec.UNSET


@_as("Point")
@dataclasses.dataclass
class UnsetDataNone:
    x: int


@_as("Point")
@dataclasses.dataclass
class UnsetDataAdded:
    x: int
    z: int | msgspec.UnsetType = msgspec.UNSET


@_as("Point")
class DictKeyOptional(TypedDict):
    x: int
    z: NotRequired[int]


@_as("Point")
class DictKeyRequired(TypedDict):
    x: int
    z: int


def _uses(point: Any, use: str) -> dict[str, Any]:
    """The manifest entry of a method that takes ``point`` (``use`` "argument"), returns it
    ("result") or both."""

    async def method(self: Any, p: Any) -> Any: ...

    method.__annotations__ = {
        "p": point if use != "result" else int,
        "return": point if use != "argument" else int,
    }
    api = types.new_class("Geo", (Protocol,), exec_body=lambda ns: ns.update(method=method))
    return dict(method_entries(service_spec(api).manifest())["method"])


# (what changed, the old type, the new type, then the verdict old -> new and new -> old where
#  the type is an argument, then the same where it is a result, and a fragment every
#  difference that is not compatible names). A type used both ways is judged both ways: the
#  worse of the two.
STRUCT_TABLE: list[
    tuple[str, Any, Any, Compatibility, Compatibility, Compatibility, Compatibility, str]
] = [
    ("same", MapV1, MapV1, C, C, C, C, ""),
    ("map fields reordered", MapV1, MapReordered, C, C, C, C, ""),
    ("same type spelled otherwise", MapWidened, MapSpelledOtherwise, C, C, C, C, ""),
    ("optional field added", MapV1, MapAddedOptional, A, I, A, A, "Point.z"),
    ("required field added", MapV1, MapAddedRequired, I, I, A, I, "Point.z"),
    ("optional field removed", MapV1, MapRemovedOptional, I, A, A, A, "Point.y"),
    ("required field removed", MapV1, MapRemovedRequired, I, I, I, A, "Point.x"),
    ("field renamed", MapV1, MapRenamed, I, I, A, A, "Point."),
    ("field's encoded name changed", MapV1, MapEncodedRenamed, I, I, A, A, "Point."),
    ("field type widened", MapV1, MapWidened, A, I, I, A, "Point.x"),
    ("field type changed", MapV1, MapRetyped, I, I, I, I, "Point.x"),
    ("tag added", MapV1, MapTagged, I, I, I, I, "Point: tag"),
    ("field added, unknown fields forbidden", StrictV1, StrictAdded, A, I, I, A, "Point.z"),
    ("dataclass field added", DataV1, DataAdded, A, I, I, A, "Point.z"),
    ("TypedDict key added", DictV1, DictAdded, A, I, I, A, "Point.z"),
    ("array fields reordered", ArrayV1, ArrayReordered, I, I, I, I, "field 0 is"),
    ("array field appended", ArrayV1, ArrayAppended, A, I, I, A, "Point.z"),
    ("array required field appended", ArrayV1, ArrayAppendedRequired, I, I, I, I, "Point.z"),
    ("array field removed", ArrayV1, ArrayRemoved, I, I, I, I, "Point.y"),
    ("array field retyped", ArrayV1, ArrayRetyped, I, I, I, I, "Point.y"),
    ("array_like turned off", ArrayV1, ArrayAsMap, I, I, I, I, "Point: encoded as"),
    ("NamedTuple field appended", TupleV1, TupleAppended, A, I, I, A, "Point.z"),
    ("nested type's field changed", BoxV1, BoxInnerChanged, I, I, I, I, "Point.x"),
    ("field holding a record removed", HolderV1, HolderWithout, I, A, A, A, "Holder.corner"),
    ("type nested in a list changed", BoxV1, BoxDeepChanged, I, I, I, I, "field 0 is"),
    # A field a writer may leave out (UNSET, a TypedDict key not required): the reader must
    # have a default for it, whether or not the type text names UnsetType.
    ("unset field added", UnsetNone, UnsetAdded, A, I, A, A, "Point.z"),
    (
        "unset field added, unknown refused",
        UnsetStrictNone,
        UnsetStrictAdded,
        A,
        I,
        I,
        A,
        "Point.z",
    ),
    ("dataclass unset field added", UnsetDataNone, UnsetDataAdded, A, I, I, A, "Point.z"),
    ("unset field retyped", UnsetAdded, UnsetRetyped, I, I, I, I, "Point.z"),
    ("unset field widened", UnsetAdded, UnsetWidened, A, I, I, A, "Point.z"),
    ("unset field given a default", UnsetAdded, UnsetAsDefault, A, A, A, A, "Point.z"),
    ("unset field made required", UnsetAdded, UnsetAsRequired, I, A, A, I, "Point.z"),
    (
        "UNSET default on a plain type required",
        UnsetPlainType,
        UnsetAsRequired,
        I,
        A,
        A,
        I,
        "Point.z",
    ),
    ("TypedDict key made required", DictKeyOptional, DictKeyRequired, I, A, A, I, "Point.z"),
]


def _worse(a: Compatibility, b: Compatibility) -> Compatibility:
    order = [C, A, I]
    return max(a, b, key=order.index)


@pytest.mark.parametrize(
    ("old", "new", "arg_forward", "arg_backward", "res_forward", "res_backward", "named"),
    [row[1:] for row in STRUCT_TABLE],
    ids=[row[0] for row in STRUCT_TABLE],
)
def test_every_change_of_a_record_types_fields_by_use_and_direction(
    old: Any,
    new: Any,
    arg_forward: Compatibility,
    arg_backward: Compatibility,
    res_forward: Compatibility,
    res_backward: Compatibility,
    named: str,
) -> None:
    """The view (the caller's) is the first type, the worker's the second (forward), then the
    reverse (backward). The signature text is the same in every case: only the fields differ."""
    expected = {
        "argument": (arg_forward, arg_backward),
        "result": (res_forward, res_backward),
        "both": (_worse(arg_forward, res_forward), _worse(arg_backward, res_backward)),
    }
    for use, verdicts in expected.items():
        mine, theirs = _uses(old, use), _uses(new, use)
        assert mine["signature"] == theirs["signature"]
        for (view, worker), want in zip(((mine, theirs), (theirs, mine)), verdicts, strict=True):
            got, text = compare_method(view, worker)
            assert got is want, (use, text)
            assert (text == "") is (got is C), (use, text)
            if got is not C:
                assert named in text, (use, text)


def test_a_changed_field_is_named_with_its_type() -> None:
    got = compare_method(_uses(MapV1, "argument"), _uses(MapRetyped, "argument"))
    assert got[0] is I
    assert "Point.x: int  =>  'str' (narrower)" in got[1]
    got = compare_method(_uses(MapV1, "result"), _uses(MapAddedOptional, "result"))
    assert got[0] is A and got[1].endswith("Point.z: new field (ignored here)"), got


def test_a_record_type_that_is_no_longer_one_on_the_worker() -> None:
    """A type the view lists that the worker does not, though the worker still names it (here
    an enum of the same name), is incompatible; one the worker no longer reaches is left to what
    reached it (the table's removed field)."""
    got, text = compare_method(_uses(BoxV1, "argument"), _uses(BoxOfEnum, "argument"))
    assert got is I and text.endswith("Point is not a record type on the worker"), text


class Plain(Protocol):
    async def add(self, a: int, b: list[int]) -> dict[str, int]: ...


def test_the_manifest_lists_every_record_type_by_use() -> None:
    """Every record type a method reaches, at any depth (``Inner`` inside a list inside
    ``Box``), with how the method uses it; a method of plain types lists none (its entry is
    what an earlier version's was)."""
    structs = _uses(BoxV1, "both")["structs"]
    prefix = next(iter(structs)).rsplit(".", 1)[0]  # the test module, as Python names it
    assert structs == {
        f"{prefix}.Box": {
            "use": "both",
            "encoding": "map",
            "unknown": "ignored",
            "tag": None,
            "fields": [
                ["corner", f"{prefix}.Point", False],
                ["items", f"list[{prefix}.Inner]", True],
            ],
        },
        f"{prefix}.Inner": {
            "use": "both",
            "encoding": "array",
            "unknown": "refused",
            "tag": None,
            "fields": [["a", "int", False], ["b", "int", False]],
        },
        f"{prefix}.Point": {
            "use": "both",
            "encoding": "map",
            "unknown": "ignored",
            "tag": None,
            "fields": [["x", "int", False], ["y", "int", True]],
        },
    }
    assert _uses(MapV1, "argument")["structs"][f"{prefix}.Point"]["use"] == "argument"
    assert _uses(DataV1, "result")["structs"][f"{prefix}.Point"]["unknown"] == "refused"
    assert _uses(MapTagged, "result")["structs"][f"{prefix}.Point"]["tag"] == ["type", "p"]
    assert set(service_spec(Plain).manifest()["add"]) == {"kind", "signature"}


def test_types_with_more_fields_than_the_bound_are_not_listed() -> None:
    """Past MAX_STRUCT_FIELDS types and fields a method lists none (compared on its signature
    alone, as an earlier version's is) rather than a listing a worker could not send back."""
    wide = msgspec.defstruct("Wide", [(f"f{i}", int) for i in range(MAX_STRUCT_FIELDS)])
    narrow = msgspec.defstruct("Narrow", [(f"f{i}", int) for i in range(MAX_STRUCT_FIELDS - 1)])
    assert "structs" not in _uses(wide, "argument")
    assert len(_uses(narrow, "argument")["structs"]) == 1


def test_a_worker_listing_no_fields_is_compared_on_its_signature() -> None:
    """A worker of an earlier version lists no record types: its methods are compared on their
    signature text, as before, so callers may be upgraded first; a view without them likewise
    (an earlier worker's entry against its successor's, as a controller logs a change)."""
    view = _uses(MapV1, "both")
    old_worker = {k: v for k, v in _uses(MapRetyped, "both").items() if k != "structs"}
    assert compare_method(view, old_worker) == (C, "")
    assert compare_method(old_worker, view) == (C, "")


def test_the_service_version_does_not_change_with_the_listing() -> None:
    """The same interfaces on a worker of an earlier version (no ``"structs"``) and of this one
    have the same service version; a changed field alone does not change it either (it shows
    in compare_method's verdict)."""
    new = {"method": _uses(MapV1, "both")}
    old = {"method": {k: v for k, v in new["method"].items() if k != "structs"}}
    assert service_version(new) == service_version(old)
    assert service_version(new) == service_version({"method": _uses(MapRetyped, "both")})


def test_a_changed_field_is_shown_in_the_manifest_changes() -> None:
    before, after = _uses(MapV1, "argument"), _uses(MapRetyped, "argument")
    changes = manifest_changes({"geo": {"m": before}}, {"geo": {"m": after}})
    assert len(changes) == 1 and "x: str" in changes[0], changes


_FIELD = ["x", "int", False]
_RECORD = {"use": "both", "encoding": "map", "unknown": "ignored", "tag": None}


@pytest.mark.parametrize(
    "structs",
    [
        "junk",
        {"Point": "x: int"},
        {"Point": {**_RECORD, "fields": "x"}},
        {"Point": {**_RECORD, "fields": [["x", "int"]]}},
        {"Point": {**_RECORD, "fields": [["x", 1, False]]}},
        {"Point": {**_RECORD, "fields": [["x", "int", "no"]]}},
        {"Point": {**_RECORD, "fields": [_FIELD, _FIELD]}},
        {"Point": {**_RECORD, "fields": [_FIELD] * 10_000}},
        {"Point": {**_RECORD, "fields": [["x", "int" * 10_000, False]]}},
        {"x" * 10_000: {**_RECORD, "fields": []}},
        {1: {**_RECORD, "fields": []}},
        {"Point": {**_RECORD, "encoding": "tree", "fields": []}},
        {"Point": {**_RECORD, "use": None, "fields": []}},
        {"Point": {**_RECORD, "tag": [1, 2, 3], "fields": []}},
    ],
    ids=[
        "text",
        "record-text",
        "fields-text",
        "field-short",
        "field-type-number",
        "field-default-text",
        "field-twice",
        "many-fields",
        "long-type",
        "long-name",
        "name-number",
        "encoding",
        "use",
        "tag",
    ],
)
def test_a_worker_listing_that_cannot_be_read_is_incompatible(structs: Any) -> None:
    view = _uses(MapV1, "both")
    got, text = compare_method(view, {**view, "structs": structs})
    assert got is I
    assert len(text) < 600


def test_a_worker_field_type_that_does_not_parse_is_compared_as_text() -> None:
    view = _uses(MapV1, "argument")
    ((name, record),) = view["structs"].items()
    odd = {**record, "fields": [["x", "int)(", False], ["y", "int", True]]}
    got, text = compare_method(view, {**view, "structs": {name: odd}})
    assert got is I and "Point.x: int  =>  'int)('" in text, text
