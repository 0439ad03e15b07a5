"""The record types a method's values may hold, as its contract lists them: each type's fields,
encoding and tag (:func:`struct_layouts`), listed once per service (:func:`record_table`), and
the bounds of those listings.

A manifest (:meth:`~garcon_link.rpc.interface.ServiceSpec.manifest`) carries the table; the
contract comparison reads it (:mod:`garcon_link.rpc.contract`, through
:func:`~garcon_link.rpc.manifest.method_entries`). Derived from the hints alone, once per hint.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import msgspec.inspect

from .hints import type_nodes
from .values import record_class, record_hints

__all__ = [
    "MAX_RECORD_TABLE",
    "MAX_STRUCT_FIELDS",
    "MAX_STRUCT_TEXT",
    "UNSET_FIELD",
    "record_table",
    "struct_layouts",
]


MAX_STRUCT_FIELDS = 1024
"""The most types and fields (counted together) one method's record types may hold to be
listed: a method whose types have more lists none (it is compared on its signature alone), and
a worker's method that refers to more cannot be read (:mod:`garcon_link.rpc.contract`)."""

MAX_RECORD_TABLE = 8192
"""The most types and fields (counted together) one service's record table lists
(:func:`record_table`): a method whose record types would take the table past it lists none,
and a worker's table over it cannot be read (:func:`~garcon_link.rpc.manifest.method_entries`)."""

MAX_STRUCT_TEXT = 4096
"""The longest type name or field type text a record type's listing holds (longer: as
:data:`MAX_STRUCT_FIELDS`)."""

UNSET_FIELD = "unset"
"""The third item of a listed field a writer may leave out of a value: one whose default is
``msgspec.UNSET`` (left out while it holds it), or a ``TypedDict``'s key that is not required
(left out while absent). A reader takes such a field as unset, or fills in its default. The
other fields are always written: ``False``, required (a reader refuses a value without it), or
``True``, with a default (a reader fills it in when it is missing)."""

_RECORD_TYPES = (
    msgspec.inspect.StructType,
    msgspec.inspect.DataclassType,
    msgspec.inspect.TypedDictType,
    msgspec.inspect.NamedTupleType,
)


def struct_layouts(params: Sequence[Any], result: Any) -> dict[str, dict[str, Any]]:
    """The record types -- ``msgspec.Struct``, dataclass (or attrs class), ``TypedDict``,
    ``NamedTuple`` -- that values of the parameter hints ``params`` and the result hint
    ``result`` may hold, at any depth, as one method's contract reads them: ``{type: record}``,
    the type named as the signature text writes it (:func:`inspect.formatannotation`), each
    record a map of

    * ``"use"``: ``"argument"`` (the caller builds it), ``"result"`` (the worker builds it) or
      ``"both"``;
    * ``"encoding"``: ``"map"`` (keyed by field name) or ``"array"`` (by position: a
      ``NamedTuple``, a struct declared ``array_like=True``);
    * ``"unknown"``: ``"ignored"`` or ``"refused"``, what this side's decoding does with a field
      it does not know (only a map-encoded ``msgspec.Struct`` without
      ``forbid_unknown_fields`` ignores one: :func:`~garcon_link.rpc.values.from_wire`
      refuses the rest);
    * ``"tag"``: a tagged struct's ``[tag field, tag]``, else ``None``;
    * ``"fields"``: ``[[name as encoded, type text, has a default], ...]`` in wire order, the
      third item :data:`UNSET_FIELD` for a field a writer may leave out.

    The fields of such types are part of a method's contract, which the signature text (naming
    the type only) does not show (:func:`garcon_link.rpc.contract.compare_method`). A manifest
    lists each type once per service (:func:`record_table`). Empty when the types hold none, or
    more than :data:`MAX_STRUCT_FIELDS` types and fields. Made once per hint (cached)."""
    layouts: dict[str, dict[str, Any]] = {}
    for hint, use in [*((p, "argument") for p in params), (result, "result")]:
        try:
            found = _records_cached(hint)
        except TypeError:  # an unhashable hint: not cached
            found = _records(hint)
        for name, (encoding, unknown, tag, fields) in found:
            record = layouts.get(name)
            if record is None:
                layouts[name] = {
                    "use": use,
                    "encoding": encoding,
                    "unknown": unknown,
                    "tag": None if tag is None else list(tag),
                    "fields": [list(f) for f in fields],
                }
            elif record["use"] != use:
                record["use"] = "both"
    size = sum(1 + len(record["fields"]) for record in layouts.values())
    return dict(sorted(layouts.items())) if size <= MAX_STRUCT_FIELDS else {}


def record_table(
    methods: Sequence[tuple[Iterable[Any], Any]],
) -> tuple[list[list[Any]], list[list[list[Any]]]]:
    """One service's record types, each listed once, and what each method uses of them.

    ``methods``: each method's parameter hints and result hint, in the manifest's order.
    Returns the *record table* -- ``[[name, encoding, unknown, tag, fields], ...]``, a
    :func:`struct_layouts` record without its use, named -- and, per method, its ``"uses"``:
    ``[[index into the table, use], ...]`` in the order of the types' names (empty: none). A
    method whose types :func:`struct_layouts` lists none of, or whose new types would take the
    table past :data:`MAX_RECORD_TABLE` types and fields, uses none (it is compared on its
    signature alone). Two methods that reach different types of one name (the name is what
    the signature text writes) list each."""
    table: list[list[Any]] = []
    index: dict[tuple[str, str, str, Any, Any], int] = {}
    size = 0
    uses: list[list[list[Any]]] = []
    for params, result in methods:
        layouts = struct_layouts(tuple(params), result)
        keys = {name: _record_key(name, record) for name, record in layouts.items()}
        new = [name for name, key in keys.items() if key not in index]
        extra = sum(1 + len(layouts[name]["fields"]) for name in new)
        if not layouts or size + extra > MAX_RECORD_TABLE:
            uses.append([])
            continue
        for name in new:
            index[keys[name]] = len(table)
            table.append([name, *(layouts[name][k] for k in _TABLE_ITEMS)])
        size += extra
        uses.append([[index[keys[name]], layouts[name]["use"]] for name in layouts])
    return table, uses


_TABLE_ITEMS = ("encoding", "unknown", "tag", "fields")
"""A record table entry's items after the type's name."""


def _record_key(name: str, record: dict[str, Any]) -> tuple[str, str, str, Any, Any]:
    """What makes two listings one record of the table (all but the use)."""
    return (
        name,
        record["encoding"],
        record["unknown"],
        None if record["tag"] is None else tuple(record["tag"]),
        tuple(tuple(f) for f in record["fields"]),
    )


_Record = tuple[str, str, tuple[str, Any] | None, tuple[tuple[str, str, bool | str], ...]]


@functools.lru_cache(maxsize=1024)
def _records_cached(hint: Any) -> tuple[tuple[str, _Record], ...]:
    return _records(hint)


def _records(hint: Any) -> tuple[tuple[str, _Record], ...]:
    if hint is Any or hint is inspect.Parameter.empty or hint is None:
        return ()
    try:
        info = msgspec.inspect.type_info(hint)
    except Exception:  # not a type msgspec knows
        return ()
    found: dict[str, _Record] = {}
    for node in type_nodes(info):
        if not isinstance(node, _RECORD_TYPES):
            continue
        hints = record_hints(node.cls)  # {} when typing cannot read them (msgspec did)
        unset = _unset_fields(node)
        fields = tuple(
            (
                f.encode_name,
                inspect.formatannotation(hints.get(f.name, Any)),
                UNSET_FIELD if f.name in unset else not f.required,
            )
            for f in node.fields
        )
        array = isinstance(node, msgspec.inspect.NamedTupleType)
        ignores, tag = False, None
        if isinstance(node, msgspec.inspect.StructType):
            array = node.array_like
            ignores = not array and not node.forbid_unknown_fields
            tag = None if node.tag_field is None else (node.tag_field, node.tag)
        found[inspect.formatannotation(node.cls)] = (
            "array" if array else "map",
            "ignored" if ignores else "refused",
            tag,
            fields,
        )
    return tuple(sorted(found.items()))


def _unset_fields(node: Any) -> set[str]:
    """The fields of a record type a writer may leave out of a value: those whose default is
    ``msgspec.UNSET`` (which ``msgspec.inspect`` does not show), and a ``TypedDict``'s keys
    that are not required."""
    if isinstance(node, msgspec.inspect.TypedDictType):
        return {f.name for f in node.fields if not f.required}
    cls = record_class(node.cls)
    defaults: dict[str, Any] = {}
    if isinstance(node, msgspec.inspect.StructType):
        names = cls.__struct_fields__
        values = cls.__struct_defaults__
        defaults = dict(zip(names[len(names) - len(values) :], values, strict=True))
    elif isinstance(node, msgspec.inspect.NamedTupleType):
        defaults = dict(getattr(cls, "_field_defaults", {}))
    elif dataclasses.is_dataclass(cls):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    else:  # an attrs class
        attributes = getattr(cls, "__attrs_attrs__", ())
        defaults = {a.name: a.default for a in attributes}
    return {name for name, value in defaults.items() if value is msgspec.UNSET}
