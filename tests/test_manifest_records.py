"""Record types listed once per service (a table in one method's ``"records"``, each method's
``"uses"`` referring to it), read by this version and by the version that listed them per
method (tests/old_contract.py, a frozen copy of its reader), in both directions of an upgrade."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import old_contract
import pytest
from cbor_strategies import cbor_values, fuzz_settings, hostile_scalars
from hypothesis import given
from hypothesis import strategies as st

from garcon_link.core.wire import encode_canonical
from garcon_link.rpc.contract import (
    Compatibility,
    compare_manifests,
    compare_method,
    service_version,
)
from garcon_link.rpc.interface import (
    MAX_RECORD_TABLE,
    MAX_STRUCT_FIELDS,
    UNSET_FIELD,
    service_spec,
    struct_layouts,
)
from garcon_link.rpc.manifest import UnreadableRecords, manifest_changes, method_entries
from garcon_link.services.files import FileService
from garcon_link.services.process import ProcessService

C, A, I = Compatibility.COMPATIBLE, Compatibility.ADDITIVE, Compatibility.INCOMPATIBLE  # noqa: E741


class Point(msgspec.Struct):
    x: int
    y: int = 0
    note: str | msgspec.UnsetType = msgspec.UNSET


class Rect(msgspec.Struct):
    corner: Point
    w: int
    h: int


class Stats(msgspec.Struct):
    count: int
    mean: float


class Shapes(Protocol):
    async def area(self, r: Rect) -> float: ...
    async def move(self, r: Rect, by: Point) -> Rect: ...
    async def ping(self) -> int: ...
    async def stats(self, rs: list[Rect]) -> Stats: ...


class OneUse(Protocol):
    """One method of one record type: the table costs no more than the listing in its entry."""

    async def put(self, p: Point) -> None: ...


def _many(count: int) -> type:
    """A service of ``count`` methods sharing three record types."""

    async def method(self: Any, r: Rect, p: Point) -> Stats:
        raise NotImplementedError

    body = {f"m{i:03d}": method for i in range(count)}
    return types.new_class("Many", (Protocol,), exec_body=lambda ns: ns.update(body))


def old_manifest(interface: type) -> dict[str, Any]:
    """A service's manifest as the version that listed record types per method wrote it: each
    entry's ``"structs"``, fields marked ``True`` for a default, an UNSET one too."""
    spec = service_spec(interface)
    manifest: dict[str, Any] = {}
    for name, m in sorted(spec.methods.items()):
        entry: dict[str, Any] = {"kind": m.kind.value, "signature": str(m.signature)}
        layouts = struct_layouts(tuple(m.hints.values()), m.result)
        if layouts:
            entry["structs"] = {
                type_name: {**record, "fields": [[f[0], f[1], f[2] is not False] for f in fields]}
                for type_name, record in layouts.items()
                for fields in [record["fields"]]
            }
        manifest[name] = entry
    return manifest


def old_manifest_like(entries: dict[str, Any]) -> dict[str, Any]:
    """Expanded entries (:func:`method_entries`) with UNSET marks as the old writer wrote them."""
    out = {}
    for name, entry in entries.items():
        entry = dict(entry)
        if "structs" in entry:
            entry["structs"] = {
                t: {**r, "fields": [[f[0], f[1], f[2] is not False] for f in r["fields"]]}
                for t, r in entry["structs"].items()
            }
        out[name] = entry
    return out


def retyped(manifest: dict[str, Any], type_suffix: str, field: str, text: str) -> dict[str, Any]:
    """``manifest`` (either form) with the type of ``field`` of each record type whose name ends
    with ``type_suffix`` replaced by ``text``."""
    changed = copy.deepcopy(manifest)
    for e in changed.values():
        for n, r in e.get("structs", {}).items():
            if n.endswith(type_suffix):
                r["fields"] = [[f[0], text if f[0] == field else f[1], f[2]] for f in r["fields"]]
    for r in (r for e in changed.values() for r in e.get("records", [])):
        if r[0].endswith(type_suffix):
            r[4] = [[f[0], text if f[0] == field else f[1], f[2]] for f in r[4]]
    return changed


SERVICES = [Shapes, OneUse, FileService, ProcessService, _many(40)]


@pytest.mark.parametrize("interface", SERVICES, ids=lambda i: i.__name__)
def test_each_record_type_is_listed_once_per_service(interface: type) -> None:
    """One table per service, in one method's entry; every method's uses refer into it; read
    back per method, each method's record types are what the per-method listing held (an UNSET
    field now marked as one); the manifest is smaller."""
    new, old = service_spec(interface).manifest(), old_manifest(interface)
    holders = [name for name, entry in new.items() if "records" in entry]
    assert len(holders) == 1
    (holder,) = holders
    assert holder == min(name for name, entry in new.items() if "uses" in entry)
    table = new[holder]["records"]
    names = [record[0] for record in table]
    assert len(names) == len(set(names))  # each once
    reached = {name for entry in old.values() for name in entry.get("structs", {})}
    assert set(names) == reached
    assert all(0 <= i < len(table) for e in new.values() for i, _ in e.get("uses", []))
    assert old_manifest_like(method_entries(new)) == old
    assert len(encode_canonical(new)) < len(encode_canonical(old))


def test_many_methods_sharing_few_types_cost_about_their_signatures() -> None:
    """40 methods of three shared types: the per-method listing was over 4x the signatures
    alone; listed once, under 1.5x."""
    interface = _many(40)
    new, old = service_spec(interface).manifest(), old_manifest(interface)
    bare = {n: {"kind": e["kind"], "signature": e["signature"]} for n, e in new.items()}
    size = len(encode_canonical(bare))
    assert len(encode_canonical(old)) > 4 * size
    assert len(encode_canonical(new)) < 1.5 * size


def test_an_old_reader_reads_the_new_form() -> None:
    """A controller of the version that listed record types per method, given this version's
    manifest, ignores the table and the uses (keys it does not know) and compares each method
    on its signature, as it compares a worker that lists none: never 'cannot be read'. A
    changed signature is still seen; a changed field is not (what that version sees of a worker
    of the version before it). The service versions are the same in both forms."""
    new, old = service_spec(Shapes).manifest(), old_manifest(Shapes)
    for view in (old, new):
        verdicts = old_contract.compare_manifests({"s": view}, {"s": new})
        assert [v.compatibility.value for v in verdicts] == ["compatible"] * 4, verdicts
    moved = copy.deepcopy(new)
    moved["area"]["signature"] = "(r: tests.Rect) -> int"
    verdicts = old_contract.compare_manifests({"s": old}, {"s": moved})
    assert {v.method: v.compatibility.value for v in verdicts}["area"] == "incompatible"
    changed = retyped(new, "Point", "x", "str")
    assert all(v.usable for v in old_contract.compare_manifests({"s": old}, {"s": changed}))
    assert service_version(new) == service_version(old) == old_contract.service_version(new)


def test_a_new_reader_reads_the_old_form() -> None:
    """This version, given the per-method form (a worker not yet upgraded, or one against its
    successor in a controller's log), compares every record type of every method."""
    new, old = service_spec(Shapes).manifest(), old_manifest(Shapes)
    for view, worker in ((new, old), (old, new), (old, old)):
        verdicts = compare_manifests({"s": view}, {"s": worker})
        assert [v.compatibility for v in verdicts] == [C] * 4, verdicts
    for view, worker in (
        (new, retyped(old, "Point", "x", "str")),
        (old, retyped(new, "Point", "x", "str")),
    ):
        by_method = {v.method: v for v in compare_manifests({"s": view}, {"s": worker})}
        for method in ("area", "move", "stats"):
            assert by_method[method].compatibility is I
            assert "Point.x: int  =>  'str'" in by_method[method].difference
        assert by_method["ping"].compatibility is C


def test_an_unset_field_listed_by_the_old_form_is_read_as_one() -> None:
    """The per-method form marked an UNSET field ``True`` (a default): a field with a default
    whose type admits ``msgspec.UnsetType`` is read as one a writer may leave out, so a worker
    of this version that requires it is incompatible with such a view."""
    old = old_manifest(Shapes)
    assert ["note", "str | msgspec.UnsetType", True] in old["move"]["structs"][_name("Point")][
        "fields"
    ]
    required = copy.deepcopy(service_spec(Shapes).manifest())
    for record in required["area"]["records"]:
        if record[0].endswith("Point"):
            record[4] = [[f[0], f[1], False if f[0] == "note" else f[2]] for f in record[4]]
    got, text = compare_method(old["move"], method_entries(required)["move"])
    assert got is I and "Point.note: the caller may leave it out (unset)" in text, text


def _name(suffix: str) -> str:
    return next(str(n) for n in old_manifest(Shapes)["move"]["structs"] if n.endswith(suffix))


def test_manifest_changes_show_a_changed_type_in_each_method_that_uses_it() -> None:
    new = service_spec(Shapes).manifest()
    changes = manifest_changes({"s": new}, {"s": retyped(new, "Stats", "mean", "int")})
    assert [c.split(":")[0] for c in changes] == ["s.stats"]
    changes = manifest_changes({"s": new}, {"s": retyped(new, "Point", "y", "str")})
    assert [c.split(":")[0] for c in changes] == ["s.area", "s.move", "s.stats"]
    record = {"use": "both", "encoding": "map", "unknown": "ignored", "tag": None}
    before = {
        "kind": "unary",
        "signature": "(p: P) -> int",
        "structs": {"P": record | {"fields": [["a", "int", UNSET_FIELD]]}},
    }
    after = before | {"structs": {"P": record | {"fields": [["a", "int", False]]}}}
    (change,) = manifest_changes({"s": {"m": before}}, {"s": {"m": after}})
    assert "P(a: int = UNSET)" in change and change.endswith("P(a: int)'"), change


def test_the_table_is_bounded_per_service() -> None:
    """Past MAX_RECORD_TABLE types and fields, a method whose new types do not fit lists none
    (compared on its signature alone); the methods before it keep theirs."""
    width = 999
    body: dict[str, Any] = {}
    count = MAX_RECORD_TABLE // (width + 1) + 1
    for i in range(count):
        wide = msgspec.defstruct(f"Wide{i}", [(f"f{j}", int) for j in range(width)])

        async def method(self: Any, p: Any) -> int:
            return 0

        method.__annotations__ = {"p": wide, "return": int}
        body[f"m{i:02d}"] = method
    api = types.new_class("Wide", (Protocol,), exec_body=lambda ns: ns.update(body))
    manifest = service_spec(api).manifest()
    listed = [name for name, entry in manifest.items() if "uses" in entry]
    assert listed == [f"m{i:02d}" for i in range(count - 1)]
    assert sum(1 + len(r[4]) for r in manifest["m00"]["records"]) <= MAX_RECORD_TABLE


# -- what a worker may send instead (peer input): each refused with a clear difference, only
#    for the methods that refer to the table

Mutation = Callable[[dict[str, Any]], None]


def _table(m: dict[str, Any]) -> list[Any]:
    table: list[Any] = m["area"]["records"]
    return table


HOSTILE: list[tuple[str, Mutation, str]] = [
    ("table-text", lambda m: m["area"].update(records="junk"), "not a list"),
    ("record-text", lambda m: _table(m).__setitem__(0, "x"), "record 0 is not [name"),
    ("record-map", lambda m: _table(m).__setitem__(0, {"name": "P"}), "record 0 is not [name"),
    ("record-short", lambda m: _table(m)[0].pop(), "record 0 is not [name"),
    ("name-number", lambda m: _table(m)[0].__setitem__(0, 7), "record 0 has no name"),
    ("name-empty", lambda m: _table(m)[0].__setitem__(0, ""), "record 0 has no name"),
    ("long-name", lambda m: _table(m)[0].__setitem__(0, "x" * 5000), "record 0 has no name"),
    ("fields-text", lambda m: _table(m)[0].__setitem__(4, "x"), "has no list of fields"),
    (
        "huge-table",
        lambda m: _table(m).extend(
            [["T", "map", "ignored", None, [["a", "int", False]] * 1000]] * 9
        ),
        f"over {MAX_RECORD_TABLE} types and fields",
    ),
    ("two-tables", lambda m: m["move"].update(records=_table(m)), "2 methods list a record table"),
    ("no-table", lambda m: m["area"].pop("records"), "no method lists the record table"),
    ("uses-text", lambda m: m["area"].update(uses="0"), "not a list of at most one per record"),
    ("too-many-uses", lambda m: m["area"].update(uses=[[0, "both"]] * 50), "at most one per"),
    ("index-out", lambda m: m["area"].update(uses=[[9, "both"]]), "refers to record 9 of"),
    ("index-negative", lambda m: m["area"].update(uses=[[-1, "both"]]), "refers to record -1"),
    ("index-bool", lambda m: m["area"].update(uses=[[True, "both"]]), "a use is not [index"),
    ("index-text", lambda m: m["area"].update(uses=[["0", "both"]]), "a use is not [index"),
    ("use-unknown", lambda m: m["area"].update(uses=[[0, "sideways"]]), "a use is not [index"),
    ("use-short", lambda m: m["area"].update(uses=[[0]]), "a use is not [index"),
    ("use-twice", lambda m: m["area"].update(uses=[[0, "both"], [0, "result"]]), "twice"),
    (
        "method-over-bound",
        lambda m: _table(m)[0].__setitem__(4, [["a", "int", False]] * MAX_STRUCT_FIELDS),
        f"over {MAX_STRUCT_FIELDS} fields",
    ),
    (
        "field-unreadable",
        lambda m: _table(m)[0].__setitem__(4, [["x", "int", "maybe"]]),
        "struct fields cannot be read",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "fragment"), [row[1:] for row in HOSTILE], ids=[row[0] for row in HOSTILE]
)
def test_a_table_that_cannot_be_read_makes_its_methods_incompatible(
    mutate: Mutation, fragment: str
) -> None:
    view = service_spec(Shapes).manifest()
    worker = copy.deepcopy(view)
    mutate(worker)
    verdicts = {v.method: v for v in compare_manifests({"s": view}, {"s": worker})}
    assert verdicts["ping"].compatibility is C  # it refers to no record type
    assert verdicts["area"].compatibility is I, verdicts["area"]
    assert fragment in verdicts["area"].difference, verdicts["area"].difference
    assert all(len(v.difference) < 600 for v in verdicts.values())
    assert len("".join(manifest_changes({"s": view}, {"s": worker}))) < 20_000


def test_an_unreadable_table_is_named_in_the_expanded_entry() -> None:
    worker = copy.deepcopy(service_spec(Shapes).manifest())
    worker["area"]["uses"] = [[99, "both"]]
    structs = method_entries(worker)["area"]["structs"]
    assert isinstance(structs, UnreadableRecords) and "record 99 of 3" in structs
    assert "records" not in method_entries(worker)["area"]


_hostile = st.one_of(cbor_values, hostile_scalars)


@st.composite
def _mutated(draw: st.DrawFn) -> dict[str, Any]:
    """Shapes' manifest with one part of its table or uses replaced by a hostile value."""
    manifest = copy.deepcopy(service_spec(Shapes).manifest())
    where = draw(st.sampled_from(["records", "record", "field", "uses", "use", "methods"]))
    value = draw(_hostile)
    table = manifest["area"]["records"]
    if where == "records":
        manifest[draw(st.sampled_from(sorted(manifest)))]["records"] = value
    elif where == "record":
        table[draw(st.integers(0, len(table) - 1))] = value
    elif where == "field":
        record = table[draw(st.integers(0, len(table) - 1))]
        record[draw(st.integers(0, len(record) - 1))] = value
    elif where == "uses":
        manifest[draw(st.sampled_from(sorted(manifest)))]["uses"] = value
    elif where == "use":
        manifest["move"]["uses"][draw(st.integers(0, 1))] = value
    else:
        return {"s": value}
    return {"s": manifest}


@fuzz_settings(200)
@given(worker=_mutated())
def test_fuzz_a_hostile_table_is_read_without_error(worker: dict[str, Any]) -> None:
    """Whatever replaces part of the table or the uses, reading and comparing never raise, the
    differences stay short, and a method that refers to no record type is unaffected."""
    view = {"s": service_spec(Shapes).manifest()}
    verdicts = compare_manifests(view, worker)
    assert all(len(v.difference) < 600 for v in verdicts)
    methods = worker["s"]
    if isinstance(methods, dict) and methods.get("ping") == view["s"]["ping"]:
        assert {v.method: v.compatibility for v in verdicts}["ping"] is C
    manifest_changes(view, worker)
    method_entries(methods)


def test_the_unset_mark_is_what_the_writer_lists() -> None:
    layouts = struct_layouts((Point,), None)
    assert layouts[_name("Point")]["fields"] == [
        ["x", "int", False],
        ["y", "int", True],
        ["note", "str | msgspec.UnsetType", UNSET_FIELD],
    ]
