"""Type descriptions: the fields of the types a service's methods use, for ``describe``.

A manifest names each method's types (``area(r: lab.Rect) -> float``): enough for a contract,
not for a person who must write ``r`` as JSON on the command line without the Python classes. So
the worker's internal ``describe`` answer carries, beside the manifest, a *type description* per
service (``"types"``: service name -> description)::

    {"types": [{"name": "lab.Rect", "kind": "dataclass",
                "fields": [{"name": "w", "type": "float", "required": True},
                           {"name": "label", "type": "str", "required": False, "default": "x"}]},
               {"name": "lab.Color", "kind": "enum", "values": ["red", "green"]}],
     "more": 3,                       # named types over Limits.described_types, not described
     "schema": {"methods": {"area": {"parameters": {...}, "result": {...}}},
                "$defs": {"lab.Rect": {...}}},
     "note": "..."}                   # why part of it is missing, when it is

* ``types``: the named types -- dataclass, TypedDict, msgspec.Struct, NamedTuple, enum -- the
  methods' parameter and result hints reach, nearest first (breadth first through fields and
  containers). A field is named by its JSON key (a Struct's renamed field by its new name), its
  type is Python text as in the signatures, its default the JSON a caller would write
  (``msgspec.to_builtins``: bytes as base64, datetimes as RFC 3339 text, enums as their values).
* ``schema``: a JSON Schema document whose root holds ``$defs`` (``#/$defs/...`` refers there),
  from :func:`msgspec.json.schema_components`: per method ``parameters`` (the keyword-arguments
  object of ``garcon-link call``; the array form takes the same values in signature order) and
  ``result`` (a unary call) or ``items`` (each item of a stream). ``bytes`` is a base64 string
  there, as on the command line; on the wire (CBOR) it stays bytes.

It is documentation, not contract: the services manifest, its contract hash and every comparison
of manifests ignore it, so a worker whose description changes (or is cut) serves on behind the
same facades.

Bounds. The worker writes it, so both sides bound it (:class:`~garcon_link.limits.Limits`): the
worker describes at most ``described_types`` types per service and counts the rest (``more``);
a description over ``type_description_bytes`` or ``type_description_depth`` is sent without its
schema, or, if still over, as a ``note`` alone. All services together are bounded too: in name
order, descriptions are sent while they sum to at most ``type_descriptions_total_bytes`` and the
describe answer fits ``max_frame_bytes``, and each service past that is sent as a ``note`` alone
(many services each near their own bound must not make ``describe`` fail). The controller keeps
a received description only if it is a map, within those bounds, lists at most
``described_types`` types and keeps the sum of those kept within ``type_descriptions_total_bytes``;
otherwise it keeps ``{"note": why}`` instead, and services the manifest does not name are dropped.
Rendering (:func:`type_description_lines`) escapes and cuts every text it shows (the peer chose it).
"""

from __future__ import annotations

import collections
import inspect
import json
from collections.abc import Mapping
from typing import Any

import msgspec
import msgspec.inspect
import msgspec.json

from ..core.wire import encode_canonical
from ..limits import Limits
from ..logs import peer_message, peer_text
from .interface import MethodKind, MethodSpec, ServiceSpec
from .registry import Registry
from .values import record_class, record_hints

__all__ = [
    "checked_type_descriptions",
    "registry_type_descriptions",
    "service_type_description",
    "type_description_lines",
]

_NAMED = (
    msgspec.inspect.DataclassType,
    msgspec.inspect.TypedDictType,
    msgspec.inspect.StructType,
    msgspec.inspect.NamedTupleType,
    msgspec.inspect.EnumType,
)
_KINDS: dict[type, str] = {
    msgspec.inspect.DataclassType: "dataclass",
    msgspec.inspect.TypedDictType: "typeddict",
    msgspec.inspect.StructType: "struct",
    msgspec.inspect.NamedTupleType: "namedtuple",
    msgspec.inspect.EnumType: "enum",
}
# Shown texts from a description: type names and field types, docs, defaults.
_NAME_CHARS = 200
_DEFAULT_CHARS = 120
_DOC_CHARS = 200


# ------------------------------------------------------------------------------ the worker side


# Descriptions built once per interface and bounds, however many sessions describe them; the
# least recently described is dropped past _CACHED (a dict keeps the order of use: a hit moves
# its entry to the end).
_cache: dict[tuple[type, int, int, int], tuple[dict[str, Any], int]] = {}
_CACHED = 256  # interfaces a process serves are few; tests make many


# Room left in a describe answer's frame beside the manifest and the descriptions: its other
# keys (executor id, instance ids, the contract hash, the state id) and the envelope around it.
_ANSWER_ROOM = 4096


def registry_type_descriptions(registry: Registry, limits: Limits) -> dict[str, Any]:
    """Service name -> :func:`service_type_description`, for every service of ``registry``,
    within a total.

    Services are taken in name order while the encoded descriptions sum to at most
    ``Limits.type_descriptions_total_bytes`` and the describe answer (with its manifest) stays
    within ``max_frame_bytes``; each service past that gets ``{"note": why}`` (counted in the
    sum), so a worker of many services each near ``type_description_bytes`` still answers
    ``describe`` and the reader sees which were left out.
    """
    manifest_size = len(encode_canonical(registry.manifest()))
    frame_room = limits.max_frame_bytes - manifest_size - _ANSWER_ROOM
    budget = min(limits.type_descriptions_total_bytes, frame_room)
    if budget == frame_room:
        why = (
            "types not described: the describe answer would be over Limits.max_frame_bytes "
            f"({limits.max_frame_bytes}) with them"
        )
    else:
        why = (
            "types not described: with the services named before it, over "
            f"Limits.type_descriptions_total_bytes ({limits.type_descriptions_total_bytes})"
        )
    left_out = {"note": why}
    left_out_size = len(encode_canonical(left_out))
    described: dict[str, Any] = {}
    used = 0
    for name in registry.names():
        bound = registry.get(name)
        if bound is None:
            continue
        description, size = _sized_description(bound.spec, limits)
        if used + size > budget:
            description, size = left_out, left_out_size
        described[name] = description
        used += size
    return described


def service_type_description(spec: ServiceSpec, limits: Limits) -> dict[str, Any]:
    """The type description of one service: built once per interface and bounds, and the same
    object for every session that describes it (the :data:`_CACHED` most recently described
    are kept).

    Never raises: a hint msgspec cannot describe leaves the schema out, with a ``note``.
    """
    return _sized_description(spec, limits)[0]


def _sized_description(spec: ServiceSpec, limits: Limits) -> tuple[dict[str, Any], int]:
    """:func:`service_type_description` and its encoded size, cached together."""
    key = (
        spec.interface,
        limits.described_types,
        limits.type_description_bytes,
        limits.type_description_depth,
    )
    cached = _cache.pop(key, None)
    if cached is None:
        try:
            described = _description(spec, limits.described_types)
        except Exception as exc:  # documentation must never keep a session from starting
            described = {"note": f"types not described: {type(exc).__name__}: {exc}"}
        bounded = _bounded(described, limits)
        cached = (bounded, len(encode_canonical(bounded)))
        if len(_cache) >= _CACHED:
            del _cache[next(iter(_cache))]  # the least recently described
    _cache[key] = cached
    return cached


def _description(spec: ServiceSpec, max_types: int) -> dict[str, Any]:
    hints = _method_hints(spec)
    flat = [hint for params, result in hints.values() for hint in (*params.values(), result)]
    description: dict[str, Any] = {}
    try:
        named, more = _named_types(flat, max_types)
    except (TypeError, ValueError) as exc:  # registration refuses such hints; a spec may not
        return {"types": [], "note": f"types not described: {exc}"}
    description["types"] = [_type_entry(node) for node in named]
    if more:
        description["more"] = more
    try:
        description["schema"] = _schema(spec, hints)
    except (TypeError, ValueError) as exc:
        description["note"] = f"no JSON Schema: {exc}"
    return description


def _method_hints(spec: ServiceSpec) -> dict[str, tuple[dict[str, Any], Any]]:
    """Method -> (parameter name -> hint, result hint); ``Any`` where nothing is declared."""
    hints = {}
    for name, method in sorted(spec.methods.items()):
        params = {
            p.name: _hint(method.hints.get(p.name, Any)) for p in _parameters(method).values()
        }
        result = None if method.kind is MethodKind.ONEWAY else _hint(method.result)
        hints[name] = (params, result)
    return hints


def _parameters(method: MethodSpec) -> Mapping[str, inspect.Parameter]:
    return {
        name: p
        for name, p in method.signature.parameters.items()
        if p.kind is not inspect.Parameter.VAR_POSITIONAL
    }


def _hint(hint: Any) -> Any:
    return Any if hint is inspect.Parameter.empty or hint is inspect.Signature.empty else hint


def _named_types(hints: list[Any], max_types: int) -> tuple[list[Any], int]:
    """The named types ``hints`` reach, breadth first (nearest first), at most ``max_types``;
    and how many more there are."""
    queue: collections.deque[Any] = collections.deque(msgspec.inspect.multi_type_info(hints))
    seen: set[int] = set()  # nodes (a recursive type's node contains itself)
    classes: set[type] = set()  # the same class may have a node per place it is used in
    named: list[Any] = []
    more = 0
    while queue:
        node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, _NAMED):
            if node.cls in classes:
                continue
            classes.add(node.cls)
            if len(named) < max_types:
                named.append(node)
            else:
                more += 1
        if isinstance(node, msgspec.inspect.Type | msgspec.inspect.Field):
            for attr in node.__struct_fields__:
                child = getattr(node, attr)
                queue.extend(child if isinstance(child, tuple) else (child,))
    return named, more


def _type_entry(node: Any) -> dict[str, Any]:
    cls = record_class(node.cls)  # Box for a generic Box[int]
    entry: dict[str, Any] = {
        "name": inspect.formatannotation(node.cls),
        "kind": _KINDS[type(node)],
    }
    doc = cls.__dict__.get("__doc__")
    if isinstance(doc, str) and doc.strip() and not doc.startswith(f"{cls.__name__}("):
        entry["doc"] = doc.strip().splitlines()[0][:_DOC_CHARS]  # not a dataclass's own
    if isinstance(node, msgspec.inspect.EnumType):
        entry["values"] = [_json_value(member.value) for member in cls]
        return entry
    annotations = record_hints(node.cls)  # {} when unresolvable: msgspec resolved them, so rarely
    fields: list[dict[str, Any]] = []
    if isinstance(node, msgspec.inspect.StructType):
        if node.array_like:
            entry["array_like"] = True
        if node.tag_field is not None:
            tag = {"name": node.tag_field, "type": f"Literal[{node.tag!r}]", "required": True}
            fields.append(tag)
    for f in node.fields:
        hint = annotations.get(f.name, Any)
        field_entry: dict[str, Any] = {
            "name": f.encode_name,
            "type": inspect.formatannotation(hint),
            "required": bool(f.required),
        }
        if f.default is not msgspec.NODEFAULT:
            field_entry["default"] = _json_value(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            factory = f.default_factory
            if factory in (list, dict, set, frozenset, tuple, bytearray, str, bytes, int, float):
                field_entry["default"] = _json_value(factory())
            else:
                field_entry["default_factory"] = getattr(factory, "__qualname__", repr(factory))
        fields.append(field_entry)
    entry["fields"] = fields
    return entry


def _json_value(value: Any) -> Any:
    """``value`` as the JSON a caller writes (bytes: base64 text; unknown: its repr)."""
    try:
        return msgspec.to_builtins(value)
    except (TypeError, ValueError):
        return repr(value)[:_DEFAULT_CHARS]


def _schema(spec: ServiceSpec, hints: dict[str, tuple[dict[str, Any], Any]]) -> dict[str, Any]:
    order: list[Any] = []
    for params, result in hints.values():
        order.extend(params.values())
        order.append(result)
    schemas, defs = msgspec.json.schema_components(order)
    found = iter(schemas)
    methods: dict[str, Any] = {}
    for name, (params, _result) in hints.items():
        method = spec.methods[name]
        signature = _parameters(method)
        properties: dict[str, Any] = {}
        required: list[str] = []
        extra: Any = False
        for param in params:
            schema = dict(next(found))
            p = signature[param]
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                extra = schema
                continue
            if p.default is inspect.Parameter.empty:
                required.append(param)
            else:
                schema["default"] = _json_value(p.default)
            properties[param] = schema
        result_schema = next(found)
        described: dict[str, Any] = {
            "kind": method.kind.value,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": extra,
            },
        }
        if method.kind is MethodKind.UNARY:
            described["result"] = result_schema
        elif method.kind is MethodKind.STREAM:
            described["items"] = result_schema
        methods[name] = described
    document: dict[str, Any] = {"methods": methods}
    if defs:
        document["$defs"] = defs
    return document


def _bounded(description: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """``description`` within the bounds: whole, else without its schema, else a note alone."""
    why = _over(description, limits)
    if why is None:
        return description
    lighter = {k: v for k, v in description.items() if k != "schema"}
    lighter["note"] = f"no JSON Schema: {why}"
    if "schema" in description and _over(lighter, limits) is None:
        return lighter
    return {"note": f"types not described: {why}"}


def _over(description: Any, limits: Limits) -> str | None:
    """Why ``description`` is over the bounds (``None``: it is not)."""
    return _over_sized(description, limits)[0]


def _over_sized(description: Any, limits: Limits) -> tuple[str | None, int]:
    """Why ``description`` is over the bounds (``None``: it is not), and its encoded size (0
    when it was not encoded)."""
    depth = _depth(description, limits.type_description_depth)
    if depth > limits.type_description_depth:
        why = f"nested deeper than Limits.type_description_depth ({limits.type_description_depth})"
        return why, 0
    try:
        size = len(encode_canonical(description))
    except Exception as exc:  # cbor2's own errors: not encodable, so not kept
        return f"not encodable ({type(exc).__name__})", 0
    if size > limits.type_description_bytes:
        why = f"{size} bytes, over Limits.type_description_bytes ({limits.type_description_bytes})"
        return why, size
    return None, size


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of maps and arrays in ``value``; stops at ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


# ------------------------------------------------------------------------------ the controller side


def checked_type_descriptions(
    received: Any, services: Mapping[str, Any], limits: Limits
) -> dict[str, Any]:
    """The type descriptions a worker sent, as far as they are within the bounds.

    Only services the manifest (``services``) names are kept. A description that is not a map,
    is over ``type_description_bytes`` or ``type_description_depth``, or lists more than
    ``described_types`` types is replaced by ``{"note": why}``, as is each one past a sum of
    ``type_descriptions_total_bytes`` (taken in the manifest's order); the contract is never
    affected. Nothing (an older worker): ``{}``. Never raises.
    """
    if not isinstance(received, Mapping):
        return {}
    kept: dict[str, Any] = {}
    used = 0
    for name in services:
        if name not in received:
            continue
        description = received[name]
        why: str | None
        if not isinstance(description, Mapping):
            why = "not a map"
        else:
            why, size = _over_sized(description, limits)
            types = description.get("types")
            if why is None and isinstance(types, list) and len(types) > limits.described_types:
                why = f"{len(types)} types, over Limits.described_types ({limits.described_types})"
            if why is None and used + size > limits.type_descriptions_total_bytes:
                why = (
                    "with the services before it, over Limits.type_descriptions_total_bytes "
                    f"({limits.type_descriptions_total_bytes})"
                )
            if why is None:
                used += size
        kept[name] = {"note": f"dropped: {why}"} if why else dict(description)
    return kept


def type_description_lines(descriptions: Mapping[str, Any]) -> list[str]:
    """The text ``garcon-link describe`` prints under the methods: each named type once.

    ``dataclass lab.Rect`` then one line per field, ``  w: float``, ``  label: str = "x"`` (the
    default as JSON), ``  color: lab.Color  (optional)`` (a key that may be left out);
    ``enum lab.Color: "red", "green"``. Malformed parts are skipped; every text the peer chose
    is escaped and cut.
    """
    lines: list[str] = []
    shown: set[str] = set()
    for service in sorted(descriptions, key=str):
        description = descriptions[service]
        if not isinstance(description, Mapping):
            continue
        types = description.get("types")
        for entry in types if isinstance(types, list) else []:
            if isinstance(entry, Mapping) and str(entry.get("name")) not in shown:
                shown.add(str(entry.get("name")))
                lines.extend(_entry_lines(entry))
        more = description.get("more")
        if isinstance(more, int) and not isinstance(more, bool) and more > 0:
            lines.append(
                f"({_text(service)}: {more} more types not described, over Limits.described_types)"
            )
        note = description.get("note")
        if isinstance(note, str):
            lines.append(f"({_text(service)}: {_text(note, 300)})")
    return lines


def _entry_lines(entry: Mapping[str, Any]) -> list[str]:
    kind, name = _text(entry.get("kind"), 20), _text(entry.get("name"))
    doc = entry.get("doc")
    suffix = f"  # {_text(doc, _DOC_CHARS)}" if isinstance(doc, str) else ""
    values = entry.get("values")
    if isinstance(values, list):
        shown = ", ".join(_json_text(v) for v in values[:50])
        more = f", ... ({len(values)} values)" if len(values) > 50 else ""
        return [f"{kind} {name}: {shown}{more}{suffix}"]
    array = "  (a JSON array, fields in this order)" if entry.get("array_like") else ""
    if kind == "namedtuple":
        array = "  (a JSON array, fields in this order)"
    lines = [f"{kind} {name}{array}{suffix}"]
    fields = entry.get("fields")
    for f in fields if isinstance(fields, list) else []:
        if not isinstance(f, Mapping):
            continue
        line = f"  {_text(f.get('name'))}: {_text(f.get('type'))}"
        if "default" in f:
            line += f" = {_json_text(f['default'])}"
        elif isinstance(f.get("default_factory"), str):
            line += f" = {_text(f['default_factory'])}()"
        elif f.get("required") is False:
            line += "  (optional)"
        lines.append(line)
    return lines


def _text(value: Any, limit: int = _NAME_CHARS) -> str:
    return peer_message(value, limit) if isinstance(value, str) else peer_text(value, limit)


def _json_text(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=_not_json)
    except (ValueError, TypeError, RecursionError):
        text = "?"
    return peer_message(text, _DEFAULT_CHARS)


def _not_json(value: Any) -> Any:
    raise TypeError(type(value).__name__)
