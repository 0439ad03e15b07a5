"""The contract manifest: what a worker declares it serves, compared, hashed and read back.

A worker's manifest maps service -> method -> ``{kind, signature}``, the signature text (the
return type included) of each :class:`~garcon_link.rpc.interface.MethodSpec`, and the fields of
the record types it reaches (:func:`~garcon_link.rpc.layouts.struct_layouts`), when it
reaches any, listed once per service: a table in one method's ``"records"``, each method's
``"uses"`` referring to it (:meth:`~garcon_link.rpc.interface.ServiceSpec.manifest`). From it
come:

* each method's entry with its own record types (:func:`method_entries`), what a comparison
  reads, from either form a worker may send (the table, or ``"structs"`` in each entry);

* its BLAKE3 *contract hash* (:func:`contract_hash`), which a controller compares across session
  replacements, and the list of methods that changed between two manifests
  (:func:`manifest_changes`): changing ``-> int`` to ``-> str`` is a contract change;
* a :class:`~garcon_link.rpc.interface.MethodSpec` for a method known only from a worker's
  manifest (:func:`manifest_method`), whose result is checked against the type its signature
  text declares (:func:`manifest_result_hint`), rebuilt without importing or evaluating
  anything, and bounded (:data:`MAX_SIGNATURE_CHARS`): the text is the peer's.

The comparison of one method's contract with another's, by kind of change, is
:mod:`garcon_link.rpc.contract`'s.
"""

from __future__ import annotations

import ast
import collections.abc
import datetime
import decimal
import inspect
import itertools
import re
import typing
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3

from ..core.wire import encode_canonical
from ..errors import Rejected
from ..logs import peer_message, peer_text
from .interface import _STREAM_ORIGINS, MethodKind, MethodSpec
from .layouts import MAX_RECORD_TABLE, MAX_STRUCT_FIELDS, MAX_STRUCT_TEXT, UNSET_FIELD

__all__ = [
    "MAX_SIGNATURE_CHARS",
    "contract_hash",
    "manifest_changes",
    "manifest_method",
    "manifest_result_hint",
    "method_entries",
    "UnreadableRecords",
]


def manifest_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The differences between two services manifests, one line per changed method.

    ``"calc.add: (a: int, b: int) -> int  =>  (a: int, b: int) -> str"``; a service or method
    that only one side has reads ``(absent)`` on the other. Malformed entries compare as text.
    A method's record types are its own (:func:`method_entries`): a changed type shows in each
    method that uses it.
    """
    lines: list[str] = []
    for service in sorted(set(old) | set(new), key=str):
        before, after = old.get(service), new.get(service)
        if not isinstance(before, Mapping) or not isinstance(after, Mapping):
            if before != after:
                lines.append(
                    f"{service}: {'(absent)' if before is None else 'service'}  =>  "
                    f"{'(absent)' if after is None else 'service'}"
                )
            continue
        before, after = method_entries(before), method_entries(after)
        for method in sorted(set(before) | set(after), key=str):
            b, a = before.get(method), after.get(method)
            if b != a:
                lines.append(f"{service}.{method}: {_method_text(b)}  =>  {_method_text(a)}")
    return lines


USES = ("argument", "result", "both")
"""How a method uses a record type it reaches (the second item of each of its ``"uses"``)."""


class UnreadableRecords(str):
    """In place of a method's ``"structs"`` (:func:`method_entries`): why the record types it
    refers to cannot be read (a comparison finds the method incompatible)."""

    __slots__ = ()


def method_entries(methods: object) -> dict[str, Any]:
    """Each method's entry of one service's manifest (method -> entry) with its record types
    in it, as one method's contract reads them: ``"structs"``, ``{type: record}``
    (:func:`~garcon_link.rpc.layouts.struct_layouts`' form), in place of ``"uses"``, and no
    ``"records"``.

    A manifest lists each record type once per service: the *record table*,
    ``[[name, encoding, unknown, tag, fields], ...]``, in one method's ``"records"`` (the first
    method by name that uses one, as this version writes it), and each method's ``"uses"``,
    ``[[index into the table, use], ...]``
    (:func:`~garcon_link.rpc.layouts.record_table`). An entry without ``"uses"`` is as it
    was sent: with ``"structs"`` of its own (a worker of the version that listed them per
    method), or with no record types (one that listed none). Entries that are not maps stay as
    they are, and the record contents are checked where they are compared
    (:mod:`garcon_link.rpc.contract`).

    The worker wrote it: a table that is not a list of named records of at most
    :data:`~garcon_link.rpc.layouts.MAX_RECORD_TABLE` types and fields, a second table, a use
    that is not ``[index in range, use]`` or names a type twice, or a method's uses over
    :data:`~garcon_link.rpc.layouts.MAX_STRUCT_FIELDS` make ``"structs"`` an
    :class:`UnreadableRecords` naming why, for each method that refers to the table (a method
    without ``"uses"`` is unaffected). Costs one pass over the table and each method's uses."""
    if not isinstance(methods, Mapping):
        return {}
    holders = [e for e in methods.values() if isinstance(e, Mapping) and "records" in e]
    table, problem = _record_table(holders)
    entries: dict[str, Any] = {}
    shared: dict[tuple[int, str], dict[str, Any]] = {}  # one record map per (type, use)
    for name, entry in methods.items():
        if not isinstance(entry, Mapping) or ("uses" not in entry and "records" not in entry):
            entries[name] = entry
            continue
        resolved = {k: v for k, v in entry.items() if k not in ("uses", "records", "structs")}
        if "uses" in entry:
            resolved["structs"] = (
                UnreadableRecords(problem)
                if problem is not None
                else _resolve_uses(entry["uses"], table, shared)
            )
        entries[name] = resolved
    return entries


def _record_table(holders: list[Mapping[str, Any]]) -> tuple[list[list[Any]], str | None]:
    """The record table of the one entry of ``holders`` (``[]``: none), or why it is refused:
    a list of ``[name, encoding, unknown, tag, fields]``, the fields a list (their contents are
    checked where they are compared)."""
    if not holders:
        return [], "no method lists the record table"
    if len(holders) > 1:
        return [], f"{len(holders)} methods list a record table (one does)"
    table = holders[0]["records"]
    if not isinstance(table, list):
        return [], "the record table is not a list"
    size = 0
    for index, record in enumerate(table):
        if not isinstance(record, list) or len(record) != len(_RECORD_KEYS) + 1:
            return [], f"record {index} is not [name, encoding, unknown, tag, fields]"
        name, fields = record[0], record[-1]
        if not isinstance(name, str) or not name or len(name) > MAX_STRUCT_TEXT:
            return [], f"record {index} has no name of at most {MAX_STRUCT_TEXT} characters"
        if not isinstance(fields, list):
            return [], f"record {index} ({peer_text(name, 80)}) has no list of fields"
        size += 1 + len(fields)
        if size > MAX_RECORD_TABLE:
            return [], f"the record table lists over {MAX_RECORD_TABLE} types and fields"
    return table, None


_RECORD_KEYS = ("encoding", "unknown", "tag", "fields")
"""A table record's items after its name, as :func:`method_entries` names them."""


def _resolve_uses(
    uses: object, table: list[list[Any]], shared: dict[tuple[int, str], dict[str, Any]]
) -> dict[str, Any] | UnreadableRecords:
    """One method's ``"uses"`` as ``{type: record with its use}``."""
    if not isinstance(uses, list) or len(uses) > len(table):
        return UnreadableRecords("its uses are not a list of at most one per record")
    structs: dict[str, Any] = {}
    size = 0
    for item in uses:
        if not (
            isinstance(item, list) and len(item) == 2 and type(item[0]) is int and item[1] in USES
        ):
            return UnreadableRecords("a use is not [index, 'argument' | 'result' | 'both']")
        index, use = item
        if not 0 <= index < len(table):
            return UnreadableRecords(f"a use refers to record {index} of {len(table)}")
        name, *rest = table[index]
        if name in structs:
            return UnreadableRecords(f"it uses {peer_text(name, 80)} twice")
        size += 1 + len(rest[-1])
        if size > MAX_STRUCT_FIELDS:
            return UnreadableRecords(f"its record types hold over {MAX_STRUCT_FIELDS} fields")
        resolved = shared.get((index, use))
        if resolved is None:
            resolved = shared[(index, use)] = {
                "use": use,
                **dict(zip(_RECORD_KEYS, rest, strict=True)),
            }
        structs[name] = resolved
    return dict(sorted(structs.items()))


# Names a manifest's signature text may use that rebuild to a type without importing anything
# (resolved hints print builtins bare and other types as ``module.qualname``).
_KNOWN_NAMES: dict[str, Any] = {
    "int": int,
    "str": str,
    "float": float,
    "bool": bool,
    "bytes": bytes,
    "bytearray": bytearray,
    "None": None,
    "NoneType": None,
    "list": list,
    "dict": dict,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "Any": Any,
    "typing.Any": Any,
    "datetime.datetime": datetime.datetime,
    "datetime.date": datetime.date,
    "datetime.time": datetime.time,
    "datetime.timedelta": datetime.timedelta,
    "uuid.UUID": uuid.UUID,
    "decimal.Decimal": decimal.Decimal,
}


_KNOWN_GENERICS: dict[str, Any] = {
    **{name: _KNOWN_NAMES[name] for name in ("list", "dict", "tuple", "set", "frozenset")},
    **{
        f"{prefix}{name}": getattr(typing, name)
        for prefix in ("", "typing.")
        for name in ("Optional", "Union", "Literal", "List", "Dict", "Tuple", "Set", "FrozenSet")
    },
}


# A method known only from a manifest accepts any arguments: the worker validates them.
_DYNAMIC_SIGNATURE = inspect.Signature(
    [
        inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
)


def _names(manifest: Mapping[Any, Any], shown: int = 20) -> str:
    """The first ``shown`` names of a worker's manifest, for an error message (bounded)."""
    names = sorted(manifest, key=str)
    text = ", ".join(
        name if _PLAIN_NAME.fullmatch(name) else peer_text(name)
        for name in (str(n) for n in names[:shown])
    )
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return peer_message(text or "none") + more


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def manifest_method(services: Mapping[str, Any], service: str, method: str) -> MethodSpec:
    """A :class:`MethodSpec` for ``service.method`` built from a worker's manifest.

    It accepts any arguments and passes them through untyped (the worker validates them); its
    result (a stream's items) is checked against :func:`manifest_result_hint`.

    Raises:
        Rejected: the manifest has no such service or method (``UNKNOWN_SERVICE`` /
            ``OPERATION_UNSUPPORTED``, as the worker itself would answer), or an unknown kind.
    """
    methods = services.get(service)
    if not isinstance(methods, Mapping):
        known = _names(services)
        raise Rejected("UNKNOWN_SERVICE", f"no service named {service!r} (services: {known})")
    entry = methods.get(method)
    if not isinstance(entry, Mapping) or method.startswith("_"):
        known = _names(methods)
        raise Rejected(
            "OPERATION_UNSUPPORTED",
            f"{service!r} has no callable method {method!r} (methods: {known})",
        )
    try:
        kind = MethodKind(entry.get("kind"))
    except ValueError:
        raise Rejected(
            "OPERATION_UNSUPPORTED", f"{service}.{method} has an unknown kind {entry.get('kind')!r}"
        ) from None
    return MethodSpec(method, kind, _DYNAMIC_SIGNATURE, {}, manifest_result_hint(entry))


MAX_SIGNATURE_CHARS = 65536
"""Longest manifest signature text :func:`manifest_result_hint` parses; a longer one is ``Any``."""


def manifest_result_hint(entry: Mapping[str, Any]) -> Any:
    """The result type (a stream's item type) a manifest entry declares, as far as it is known.

    Rebuilt from the signature text without importing or evaluating anything: builtins,
    containers, ``Optional``/``Union``/``Literal``, ``X | Y``, datetimes, ``UUID`` and
    ``Decimal`` are rebuilt; any other name (a dataclass, an enum, a ``ResourceRef``) becomes
    ``Any`` where it occurs, so values there pass unchecked. No return annotation, text that
    does not parse, or text longer than :data:`MAX_SIGNATURE_CHARS` (the peer wrote it, and
    parsing costs time and memory in its length): ``Any``.
    """
    signature = entry.get("signature")
    if not isinstance(signature, str) or len(signature) > MAX_SIGNATURE_CHARS:
        return Any
    try:
        tree = ast.parse(f"def f{signature}: pass")
        func = tree.body[0]
        assert isinstance(func, ast.FunctionDef)
        if func.returns is None:
            return Any
        hint = _hint_from_node(func.returns)
    except (SyntaxError, ValueError, TypeError, AssertionError, RecursionError):
        return Any
    if entry.get("kind") == MethodKind.STREAM.value:
        args = typing.get_args(hint)
        return args[0] if len(args) == 1 and typing.get_origin(hint) in _STREAM_ORIGINS else Any
    if entry.get("kind") == MethodKind.ONEWAY.value:
        return None
    return hint


def _hint_from_node(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        if node.value is None:
            return None
        if isinstance(node.value, str | int | bool | bytes):  # a Literal's value
            return _Literal(node.value)
        return Any
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = _hint_from_node(node.left), _hint_from_node(node.right)
        return Any if Any in (left, right) else typing.Union[left, right]  # noqa: UP007
    name = _dotted(node)
    if name is not None:
        if name in _STREAM_NAMES:
            return _STREAM_NAMES[name]
        return _KNOWN_NAMES.get(name, Any)
    if isinstance(node, ast.Subscript):
        origin_name = _dotted(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if origin_name in _STREAM_NAMES:
            return _STREAM_NAMES[origin_name][_hint_from_node(items[0])]
        origin = _KNOWN_GENERICS.get(origin_name or "")
        if origin is None:
            return Any
        if origin is typing.Literal:
            values = [_hint_from_node(item) for item in items]
            if not all(isinstance(v, _Literal) for v in values):
                return Any
            return typing.Literal[tuple(v.value for v in values)]
        args = tuple(
            ... if isinstance(item, ast.Constant) and item.value is ... else _hint_from_node(item)
            for item in items
        )
        if any(isinstance(a, _Literal) for a in args):
            return Any
        return origin[args if len(args) > 1 else args[0]]
    return Any


@dataclass(frozen=True, slots=True)
class _Literal:
    value: Any


_STREAM_NAMES: dict[str, Any] = {
    f"{prefix}{name}": getattr(collections.abc, name)
    for prefix in ("", "collections.abc.", "typing.")
    for name in ("AsyncIterator", "AsyncGenerator", "AsyncIterable")
}


def _dotted(node: Any) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _method_text(entry: Any) -> str:
    if entry is None:
        return "(absent)"
    if isinstance(entry, Mapping):
        structs = entry.get("structs")
        shown = ""
        if isinstance(structs, UnreadableRecords):
            shown = f" structs unreadable ({peer_text(str(structs))})"
        elif isinstance(structs, Mapping):  # the peer's: shown bounded
            shown = " structs " + peer_text(
                "; ".join(
                    f"{name}({_fields_text(record)})"
                    for name, record in itertools.islice(structs.items(), 8)
                )
            )
        return f"{entry.get('kind')} {entry.get('signature')}{shown}"
    return repr(entry)


def _fields_text(record: Any) -> str:
    """A ``"structs"`` record's fields as ``x: int, y: int = ...`` (at most 16 shown)."""
    fields = record.get("fields") if isinstance(record, Mapping) else None
    if not isinstance(fields, list):
        return "?"
    return ", ".join(
        f"{f[0]}: {f[1]}{_default_text(f[2])}" if isinstance(f, list) and len(f) == 3 else "?"
        for f in itertools.islice(fields, 16)
    )


def _default_text(default: object) -> str:
    if default is False:
        return ""
    return " = UNSET" if default == UNSET_FIELD else " = ..."


def contract_hash(manifest: Mapping[str, Any]) -> str:
    """BLAKE3 hex digest of the canonical CBOR of a services manifest."""
    return blake3.blake3(encode_canonical(dict(manifest))).hexdigest()
