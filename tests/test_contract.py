"""Tests of garcon_link.rpc.contract: one method's contract as a caller expects it against the
worker's, every kind of change in both directions, from real interfaces and from peer text."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from typing import Any, Protocol

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
from garcon_link.rpc.interface import service_spec
from garcon_link.rpc.manifest import MAX_SIGNATURE_CHARS, manifest_changes

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


# msgspec Structs declared ``array_like=True`` travel as arrays: their fields by position. The
# signature text names the type only, so the manifest says how such a type is laid out.


class PointV1(msgspec.Struct, array_like=True):
    x: int
    y: int


class PointReordered(msgspec.Struct, array_like=True):
    y: int
    x: int


class PointRemoved(msgspec.Struct, array_like=True):
    x: int


class PointAppended(msgspec.Struct, array_like=True):
    x: int
    y: int
    z: int = 0


class PointAppendedRequired(msgspec.Struct, array_like=True):
    x: int
    y: int
    z: int


class PointRetyped(msgspec.Struct, array_like=True):
    x: int
    y: str


class PointAsMap(msgspec.Struct):
    x: int
    y: int


class PointMapReordered(msgspec.Struct):
    y: int
    x: int


def _shapes(point: type) -> dict[str, Any]:
    """A ``geo`` service whose methods take and return ``point`` (also nested), declared under
    one name, ``Point``, as two versions of one program would."""
    point.__qualname__ = point.__name__ = "Point"

    async def move(self: Any, p: Any, by: int = 1) -> Any: ...

    async def bounds(self: Any) -> Any: ...

    move.__annotations__ = {"p": point, "by": int, "return": point}
    bounds.__annotations__ = {"return": list[point]}  # type: ignore[valid-type]
    geo = types.new_class(
        "Geo", (Protocol,), exec_body=lambda ns: ns.update(move=move, bounds=bounds)
    )
    return service_spec(geo).manifest()


@pytest.mark.parametrize(
    ("worker", "verdict", "difference"),
    [
        (PointV1, C, ""),
        (PointReordered, I, "positional"),
        (PointRemoved, I, "positional"),
        (PointRetyped, I, "positional"),
        (PointAppendedRequired, I, "positional"),
        (PointAppended, A, "new optional field"),
    ],
    ids=["same", "reordered", "removed", "retyped", "appended-required", "appended"],
)
def test_an_array_like_struct_is_compared_by_position(
    worker: type, verdict: Compatibility, difference: str
) -> None:
    """Reordering, removing, retyping the fields of an ``array_like`` struct, or appending a
    required one, changes what each position means: incompatible, though the signature text is
    the same. An optional field appended at the end is additive (msgspec fills it in from a
    shorter array, and ignores it in a longer one)."""
    view = _shapes(PointV1)
    offered = _shapes(worker)
    for method in ("move", "bounds"):
        got, text = compare_method(view[method], offered[method])
        assert got is verdict, (method, text)
        assert difference in text
        assert (text == "") is (got is C)
    if worker is not PointV1:
        assert service_version(view) != service_version(offered)
        changes = manifest_changes({"geo": view}, {"geo": offered})
        assert len(changes) == 2 and "positional" in changes[0], changes


def test_a_worker_listing_no_layouts_is_compared_on_its_signature() -> None:
    """A worker of an earlier version lists no layouts: its methods are compared on their
    signature text, as before, so callers may be upgraded first. A worker that lists layouts,
    but not of a struct the view has as ``array_like``, has dropped ``array_like`` from it."""
    view = _shapes(PointV1)
    old_worker = {
        name: {k: v for k, v in entry.items() if k != "positional"} for name, entry in view.items()
    }
    assert compare_method(view["move"], old_worker["move"]) == (C, "")
    as_map = _shapes(PointAsMap)["move"]
    assert "positional" not in as_map
    assert compare_method(view["move"], as_map) == (C, "")  # the one case this cannot tell
    other = {**as_map, "positional": {"Other": ["x: int"]}}
    got, text = compare_method(view["move"], other)
    assert got is I and "not positional" in text, text


def test_a_map_struct_may_reorder_its_fields() -> None:
    """A struct without ``array_like`` travels as a map keyed by field name: its field order is
    not part of the contract, and its manifest entry is the signature alone."""
    view, offered = _shapes(PointAsMap), _shapes(PointMapReordered)
    assert compare_method(view["move"], offered["move"]) == (C, "")
    assert set(view["move"]) == {"kind", "signature"}


@pytest.mark.parametrize(
    "layout",
    ["junk", {"Point": "x: int"}, {"Point": [1, 2]}, {"Point": ["x: int"] * 10_000}, {1: []}],
    ids=["text", "fields-text", "fields-numbers", "long", "name-number"],
)
def test_a_worker_layout_that_cannot_be_read_is_incompatible(layout: Any) -> None:
    view = _shapes(PointV1)["move"]
    offered = {**view, "positional": layout}
    got, text = compare_method(view, offered)
    assert got is I
    assert len(text) < 600
