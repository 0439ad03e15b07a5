"""Contracts compared method by method: what a caller expects against what a worker offers.

A manifest (:meth:`~garcon_link.rpc.interface.ServiceSpec.manifest`) maps service -> method ->
``{"kind", "signature"}``, and the record types the method's types hold (below; other keys,
such as descriptions, are not part of the contract). :func:`compare_method` compares two
entries each holding its own record types under ``"structs"``: a manifest lists them once per
service (``"records"`` and ``"uses"``), and :func:`compare_manifests` expands both sides with
:func:`~garcon_link.rpc.manifest.method_entries` first, as must any other caller. A caller's
*view* is the manifest of the interface its facade was made with; the worker's manifest is what
its current session described (or announced since). :func:`compare_method` decides, for one
method, one of four :class:`Compatibility` values, and names the difference:

* ``COMPATIBLE`` -- the same kind and signature text;
* ``ADDITIVE`` -- different, but every call the view makes binds to the worker's signature with
  the same meaning and every result the worker returns is one the view accepts: a new optional
  parameter with a default (after the view's positional ones, or keyword-only), a parameter that
  gained a default, a wider parameter type, a narrower result (a stream's item) type, a new
  ``*args``/``**kwargs``. New methods and new services are additive too
  (:func:`compare_manifests`);
* ``INCOMPATIBLE`` -- anything else: another kind, a parameter removed, renamed, moved, made
  required or of another kind, a changed default value, a narrower parameter type, a wider
  result type, a signature that cannot be read;
* ``REMOVED`` -- the view's method (or its whole service) is not offered.

The signature text names a record type -- a ``msgspec.Struct``, a dataclass, a ``TypedDict``, a
``NamedTuple`` -- but not its fields, so an entry also lists, under ``"structs"``, the fields of
every record type its parameters and result hold at any depth
(:func:`~garcon_link.rpc.layouts.struct_layouts`, expanded from the service's table), and
each is judged as the view uses it:

* in an *argument* (the caller builds it, the worker reads it): a field the worker added with a
  default is ``ADDITIVE`` (the worker fills it in), one added without a default, one it removed
  or renamed (the caller's value would be dropped or refused), or a field's type the worker
  narrowed is ``INCOMPATIBLE``; a wider type is ``ADDITIVE``;
* in a *result* (the worker builds it, the caller reads it): a field the worker added is
  ``ADDITIVE`` only where the view's type ignores unknown fields (a map-encoded
  ``msgspec.Struct`` without ``forbid_unknown_fields``; a dataclass or ``TypedDict`` refuses
  one), else ``INCOMPATIBLE``; a field the worker removed is ``ADDITIVE`` when the view's has a
  default (filled in), else ``INCOMPATIBLE``; a wider type is ``INCOMPATIBLE``, a narrower one
  ``ADDITIVE``;
* a type used both ways is judged both ways;
* a map-encoded type matches fields by name (their order is not part of the contract); an
  array-encoded one (a ``NamedTuple``, a struct declared ``array_like=True``) by position: the
  same names in the same order, and only trailing fields a reader fills in from defaults may
  differ (an argument's at the worker's end, a result's at the view's: a reader refuses a longer
  array). Another encoding or another tag is ``INCOMPATIBLE``.

Whether a field both sides have has a default does not matter when its writer always sends
it: every field is sent, a default too (:func:`~garcon_link.rpc.towire.to_wire`). A field
the writer may leave out (:data:`~garcon_link.rpc.layouts.UNSET_FIELD`: a ``msgspec.UNSET``
default, a ``TypedDict`` key that is not required) needs a default on the reader's side -- the
worker's for an argument, the view's for a result -- else ``INCOMPATIBLE``; a difference in
whether it may be left out that the reader copes with is ``ADDITIVE``. ``msgspec.UnsetType`` in
a field's type is never a value on the wire and is left out of type comparisons. An entry
listed per method by the version before the table marked such a field ``True``; one whose type
admits ``UnsetType`` is read as ``"unset"``.

A worker's entry without ``"structs"`` (0.1.0, which lists no record types) is compared on its
signature alone (:func:`_compare_structs`); one that cannot be read, refers to a table that
cannot be (:class:`~garcon_link.rpc.manifest.UnreadableRecords`, naming why), or lists more
than :data:`~garcon_link.rpc.layouts.MAX_STRUCT_FIELDS` types and fields, is
``INCOMPATIBLE``.

Types are compared on the signature text, without importing or evaluating anything: a union
(``X | Y``, ``Optional[X]``, ``Union[X, Y]``) is the set of its members, ``Any`` (or no
annotation) accepts everything, ``int`` fits where ``float`` or ``complex`` is expected (PEP 484's
numeric tower, which msgspec's conversion follows), and any other member matches only the same
text (``list[int]`` and ``list[int | None]`` are different types here: incompatible, never
silently assumed to fit). A calling view that declares a unary method one-way (it does not wait
for the reply) is compatible with it: that is the caller's choice.

The worker's manifest is the peer's text: a signature longer than :data:`MAX_SIGNATURE_CHARS` or
one that does not parse is incompatible ("cannot be read"), never an exception, and every peer
value in a difference is rendered by :func:`~garcon_link.logs.peer_text` (bounded).
"""

from __future__ import annotations

import ast
import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3

from ..core.wire import encode_canonical
from ..logs import peer_text
from .layouts import MAX_STRUCT_FIELDS, MAX_STRUCT_TEXT, UNSET_FIELD
from .manifest import MAX_SIGNATURE_CHARS, UnreadableRecords, method_entries

__all__ = [
    "Compatibility",
    "Verdict",
    "compare_manifests",
    "compare_method",
    "service_version",
]

_SHOWN = 200
"""The most characters of one side's text a difference shows (the peer's, through peer_text)."""


class Compatibility(enum.Enum):
    """What a worker's method is to a caller that expects the view's (module docstring)."""

    COMPATIBLE = "compatible"
    ADDITIVE = "additive"
    INCOMPATIBLE = "incompatible"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One method's comparison: ``service.method`` is ``compatibility``, because ``difference``
    (empty when compatible)."""

    service: str
    method: str
    compatibility: Compatibility
    difference: str = ""

    @property
    def usable(self) -> bool:
        """Whether a caller with the view may call the worker's method."""
        return self.compatibility in (Compatibility.COMPATIBLE, Compatibility.ADDITIVE)


_TOP = "Any"
_NUMERIC = {"int": ("float", "complex"), "float": ("complex",)}
_STREAM_NAMES = {
    f"{prefix}{name}"
    for prefix in ("", "collections.abc.", "typing.")
    for name in ("AsyncIterator", "AsyncGenerator", "AsyncIterable")
}
_UNION_NAMES = {"Union", "typing.Union"}
_OPTIONAL_NAMES = {"Optional", "typing.Optional"}


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    kind: str  # "positional only", "positional", "keyword", "*args", "**kwargs"
    annotation: frozenset[str]
    default: str | None  # the default's text; None: required


@dataclass(frozen=True, slots=True)
class _Signature:
    params: tuple[_Param, ...]
    result: frozenset[str]


class _Unreadable(Exception):
    """A signature text that cannot be compared."""


def _members(node: ast.expr | None) -> frozenset[str]:
    """The set of union members an annotation names (``{"Any"}``: anything)."""
    if node is None:
        return frozenset({_TOP})
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _members(node.left) | _members(node.right)
    if isinstance(node, ast.Subscript):
        origin = ast.unparse(node.value)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if origin in _UNION_NAMES:
            return frozenset().union(*(_members(item) for item in items))
        if origin in _OPTIONAL_NAMES and len(items) == 1:
            return _members(items[0]) | {"None"}
    text = ast.unparse(node)
    if text in ("typing.Any", "Any"):
        return frozenset({_TOP})
    if text == "NoneType":
        return frozenset({"None"})
    return frozenset({text})


def _accepts(wider: frozenset[str], narrower: frozenset[str]) -> bool:
    """Whether every value of ``narrower`` is a value of ``wider``."""
    if _TOP in wider:
        return True
    return all(
        member in wider or any(w in wider for w in _NUMERIC.get(member, ())) for member in narrower
    )


def _type_text(members: frozenset[str]) -> str:
    return " | ".join(sorted(members))


def _parse(signature: object, kind: str) -> _Signature:
    """The parameters and result (a stream's item type) of a manifest signature text.

    Raises:
        _Unreadable: not text, too long, or not a signature.
    """
    if not isinstance(signature, str) or len(signature) > MAX_SIGNATURE_CHARS:
        raise _Unreadable("not a signature text of at most MAX_SIGNATURE_CHARS characters")
    try:
        tree = ast.parse(f"def f{signature}: pass")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _Unreadable("the signature does not parse") from None
    func = tree.body[0] if len(tree.body) == 1 else None
    if not isinstance(func, ast.FunctionDef):
        raise _Unreadable("the signature does not parse")
    try:
        return _signature(func, kind)
    except RecursionError:
        raise _Unreadable("the signature is nested too deeply") from None


def _signature(func: ast.FunctionDef, kind: str) -> _Signature:
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    params: list[_Param] = []
    for index, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind_text = "positional only" if index < len(args.posonlyargs) else "positional"
        params.append(_param(arg, kind_text, default))
    if args.vararg is not None:
        params.append(_param(args.vararg, "*args", None))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(_param(arg, "keyword", kw_default))
    if args.kwarg is not None:
        params.append(_param(args.kwarg, "**kwargs", None))
    returns = func.returns
    if (
        kind == "stream"
        and isinstance(returns, ast.Subscript)
        and ast.unparse(returns.value) in _STREAM_NAMES
    ):
        returns = returns.slice
    result = frozenset({"None"}) if kind == "oneway" else _members(returns)
    return _Signature(tuple(params), result)


def _param(arg: ast.arg, kind: str, default: ast.expr | None) -> _Param:
    text = None if default is None else ast.unparse(default)
    return _Param(arg.arg, kind, _members(arg.annotation), text)


def compare_method(expected: object, offered: object) -> tuple[Compatibility, str]:
    """Compare one method's manifest entry as a caller expects it with the worker's.

    Args:
        expected: the view's entry (``{"kind", "signature"}``); ``None``: the view has no such
            method (the worker's is then ``ADDITIVE``, a new method).
        offered: the worker's entry; ``None``: the worker has no such method (``REMOVED``).

    Returns:
        The compatibility and the difference, one line (``""`` when compatible): the first
        incompatible difference if there is one, else the additive ones.
    """
    if offered is None:
        return Compatibility.REMOVED, "removed" if expected is not None else ""
    if expected is None:
        return Compatibility.ADDITIVE, "new method"
    if not isinstance(offered, Mapping) or not isinstance(expected, Mapping):
        return Compatibility.INCOMPATIBLE, "the worker's entry cannot be read"
    want_kind, got_kind = expected.get("kind"), offered.get("kind")
    if want_kind != got_kind and not (want_kind == "oneway" and got_kind == "unary"):
        return (
            Compatibility.INCOMPATIBLE,
            f"kind {want_kind}  =>  {peer_text(got_kind, _SHOWN)}",
        )
    want_text, got_text = expected.get("signature"), offered.get("signature")
    layout = _compare_structs(expected.get("structs"), offered.get("structs"), got_text)
    if layout is not None and layout[0] is Compatibility.INCOMPATIBLE:
        return layout
    if want_text == got_text:
        return layout or (Compatibility.COMPATIBLE, "")
    try:
        mine = _parse(want_text, str(want_kind))
    except _Unreadable:
        mine = None
    try:
        theirs = _parse(got_text, str(want_kind))
    except _Unreadable as exc:
        return Compatibility.INCOMPATIBLE, f"the worker's signature cannot be read ({exc})"
    if mine is None:  # our own text that does not parse (an unusual default's repr): as text
        return (
            Compatibility.INCOMPATIBLE,
            f"signature {str(want_text)[:_SHOWN]}  =>  {peer_text(got_text, _SHOWN)}",
        )
    incompatible, additive = _differences(mine, theirs)
    if incompatible:
        return Compatibility.INCOMPATIBLE, incompatible[0]
    if layout is not None:
        additive.append(layout[1])
    if additive:
        return Compatibility.ADDITIVE, "; ".join(additive[:4])
    # The same parameters and types spelled differently (e.g. Optional[int] and int | None).
    return Compatibility.COMPATIBLE, ""


def _read_structs(value: object) -> dict[str, _Struct] | None:
    """A ``"structs"`` entry (:func:`~garcon_link.rpc.layouts.struct_layouts`) as
    ``{type: _Struct}``; ``None`` if it is not one within the bounds."""
    if not isinstance(value, Mapping):
        return None
    structs: dict[str, _Struct] = {}
    total = 0
    for name, record in value.items():
        if not _short_text(name) or not isinstance(record, Mapping):
            return None
        fields = record.get("fields")
        if not isinstance(fields, list):
            return None
        total += 1 + len(fields)
        if total > MAX_STRUCT_FIELDS:
            return None
        read: list[_Field] = []
        for item in fields:
            if not (
                isinstance(item, list)
                and len(item) == 3
                and _short_text(item[0])
                and _short_text(item[1])
                and (isinstance(item[2], bool) or item[2] == UNSET_FIELD)
            ):
                return None
            read.append(_field(item[0], item[1], item[2]))
        use, encoding, unknown = record.get("use"), record.get("encoding"), record.get("unknown")
        tag = record.get("tag")
        if (
            use not in ("argument", "result", "both")
            or encoding not in ("map", "array")
            or unknown not in ("ignored", "refused")
            or not (
                tag is None
                or (
                    isinstance(tag, list)
                    and len(tag) == 2
                    and _short_text(tag[0])
                    and (_short_text(tag[1]) or type(tag[1]) is int)
                )
            )
            or len({f.name for f in read}) != len(read)
        ):
            return None
        tag_text = None if tag is None else f"{_name(tag[0])}={peer_text(tag[1], 64)}"
        structs[name] = _Struct(str(use), str(encoding), unknown == "ignored", tag_text, read)
    return structs


_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,199}")


def _name(value: str) -> str:
    """A field or type name of the worker's, shown as is when it is a plain (dotted) name,
    else bounded and escaped."""
    return value if _PLAIN_NAME.fullmatch(value) else peer_text(value, _SHOWN)


def _short_text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_STRUCT_TEXT


@dataclass(frozen=True, slots=True)
class _Field:
    name: str  # as encoded
    type: str
    has_default: bool  # a reader fills it in when it is missing (an unset one too)
    unset: bool  # a writer may leave it out (UNSET_FIELD)


_UNSET_TYPES = frozenset({"msgspec.UnsetType", "UnsetType"})


def _field(name: str, type_text: str, default: bool | str) -> _Field:
    """A listed field. ``default`` is ``True``, ``False`` or :data:`UNSET_FIELD`; a worker of
    the version that listed record types per method wrote ``True`` for an ``UNSET`` default, so
    a field with a default whose type admits ``msgspec.UnsetType`` is taken as unset too."""
    unset = default == UNSET_FIELD
    if default is True and "UnsetType" in type_text:
        members = _field_members(type_text)
        unset = members is not None and not members.isdisjoint(_UNSET_TYPES)
    return _Field(name, type_text, default is not False, unset)


@dataclass(frozen=True, slots=True)
class _Struct:
    use: str  # "argument", "result", "both"
    encoding: str  # "map", "array"
    ignores_unknown: bool
    tag: str | None
    fields: list[_Field]


def _compare_structs(
    expected: object, offered: object, signature: object
) -> tuple[Compatibility, str] | None:
    """The record types of one method (module docstring): ``INCOMPATIBLE`` or ``ADDITIVE`` and
    the difference, or ``None`` when they match or either side lists none.

    A worker that lists no record types for the method (no ``"structs"`` key) is either of an
    earlier version, which never lists them, or one whose types for it hold none: the two
    cannot be told apart, so the method is compared on its signature alone, as earlier versions
    compared it (callers may be upgraded before workers). The same holds for a view without the
    key (an earlier worker's entry compared with its successor's in a controller's log)."""
    if offered is None or expected is None:
        return None
    if isinstance(offered, UnreadableRecords):
        return Compatibility.INCOMPATIBLE, f"the worker's record types cannot be read ({offered})"
    theirs = _read_structs(offered)
    if theirs is None:
        return Compatibility.INCOMPATIBLE, "the worker's struct fields cannot be read"
    mine = _read_structs(expected)
    if mine is None:  # ours, and always readable; nothing to compare otherwise
        return None
    additive: list[str] = []
    named: set[str] | None = None
    for name, want in sorted(mine.items()):
        got = theirs.get(name)
        if got is None:
            # The worker's values hold no such record: what reached it (a parameter, a field)
            # is compared on its own, unless the worker still names the type (then it is no
            # longer a record there, e.g. an enum of the same name).
            if named is None:
                named = _names_in(signature, theirs.values())
            if name in named:
                return Compatibility.INCOMPATIBLE, f"{name} is not a record type on the worker"
            continue
        problem = _compare_struct(name, want, got, additive)
        if problem is not None:
            return Compatibility.INCOMPATIBLE, problem
    if additive:
        return Compatibility.ADDITIVE, "; ".join(additive[:4])
    return None


_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _names_in(signature: object, structs: Iterable[_Struct]) -> set[str]:
    """The (dotted) names the worker's signature text and field types use."""
    texts = [signature if isinstance(signature, str) else ""]
    texts.extend(f.type for struct in structs for f in struct.fields)
    return {match for text in texts for match in _NAME.findall(text)}


_AS = {"map": "a map", "array": "an array"}


def _compare_struct(name: str, want: _Struct, got: _Struct, additive: list[str]) -> str | None:
    """The first incompatible difference of one record type (``None``: none), judged as the
    view uses it (an argument, a result or both); additive differences go to ``additive``."""
    if want.encoding != got.encoding:
        return f"{name}: encoded as {_AS[want.encoding]}  =>  as {_AS[got.encoding]}"
    if want.tag != got.tag:
        return f"{name}: tag {want.tag or '(none)'}  =>  {got.tag or '(none)'}"
    notes: list[str] = []
    for direction in ("argument", "result"):
        if want.use not in (direction, "both"):
            continue
        judge = _judge_array if want.encoding == "array" else _judge_map
        problem = judge(name, want, got, direction == "argument", notes)
        if problem is not None:
            return problem
    additive.extend(dict.fromkeys(notes))  # a type used both ways notes a difference once
    return None


def _judge_map(
    name: str, want: _Struct, got: _Struct, argument: bool, notes: list[str]
) -> str | None:
    """A map-encoded type, its fields matched by name. ``argument``: the caller builds it (the
    view's fields) and the worker reads it; else the worker builds it and the caller reads it."""
    theirs = {f.name: f for f in got.fields}
    known = {f.name for f in want.fields}
    for field in want.fields:
        other = theirs.get(field.name)
        if other is None:
            if argument:
                return (
                    f"{name}.{field.name} removed or renamed on the worker "
                    "(the caller's value would be dropped or refused)"
                )
            if not field.has_default:
                return f"{name}.{field.name} removed or renamed on the worker (required here)"
            notes.append(f"{name}.{field.name} removed on the worker (defaulted here)")
            continue
        problem = _compare_field_type(f"{name}.{field.name}", field, other, argument, notes)
        if problem is not None:
            return problem
    for other in got.fields:
        if other.name in known:
            continue
        shown = f"{name}.{_name(other.name)}"
        if argument:
            if not other.has_default:
                return f"{shown}: new required field on the worker"
            notes.append(f"{shown}: new optional field")
        elif not want.ignores_unknown:
            return f"{shown}: new on the worker, and {name} refuses unknown fields here"
        else:
            notes.append(f"{shown}: new field (ignored here)")
    return None


def _judge_array(
    name: str, want: _Struct, got: _Struct, argument: bool, notes: list[str]
) -> str | None:
    """An array-encoded type, its fields matched by position: the same names in the same order,
    then either side may have more only where the reader fills them in from defaults (a
    reader refuses an array longer than its fields)."""
    for index, (field, other) in enumerate(zip(want.fields, got.fields, strict=False)):
        if field.name != other.name:
            return (
                f"{name}.{field.name}: field {index} is {_name(other.name)} on the worker "
                "(by position)"
            )
        problem = _compare_field_type(f"{name}.{field.name}", field, other, argument, notes)
        if problem is not None:
            return problem
    mine_extra = want.fields[len(got.fields) :]
    theirs_extra = got.fields[len(want.fields) :]
    if theirs_extra:
        first = f"{name}.{_name(theirs_extra[0].name)}"
        if not argument:
            return f"{first}: new at the end on the worker (by position: refused here)"
        required = next((f for f in theirs_extra if not f.has_default), None)
        if required is not None:
            return f"{name}.{_name(required.name)}: new required field on the worker"
        notes.append(f"{first}: new optional field at the end")
    if mine_extra:
        first = f"{name}.{mine_extra[0].name}"
        if argument:
            return f"{first}: removed at the end on the worker (by position: refused there)"
        required = next((f for f in mine_extra if not f.has_default), None)
        if required is not None:
            return f"{name}.{required.name}: removed on the worker (required here)"
        notes.append(f"{first}: removed at the end on the worker (defaulted here)")
    return None


def _compare_field_type(
    path: str, want: _Field, got: _Field, argument: bool, notes: list[str]
) -> str | None:
    """One field both sides have: its type by the parameters' rules (an argument's may get
    wider, a result's narrower), ``msgspec.UnsetType`` aside, and whether the writer may leave
    it out where the reader requires it. Whether a field the writer always writes has a default
    does not matter: every such field is sent, a default too
    (:func:`~garcon_link.rpc.towire.to_wire`)."""
    writer, reader = (want, got) if argument else (got, want)
    who, where = ("the caller", "on the worker") if argument else ("the worker", "here")
    if writer.unset and not reader.has_default:
        return f"{path}: {who} may leave it out (unset), required {where}"
    if want.unset != got.unset:
        change = "may be left out (unset)" if got.unset else "is always written"
        notes.append(f"{path} {change} on the worker")
    if want.type == got.type:
        return None
    mine, theirs = _field_members(want.type), _field_members(got.type)
    if mine is None or theirs is None:  # compared as text
        return f"{path}: {want.type[:_SHOWN]}  =>  {peer_text(got.type, _SHOWN)}"
    mine, theirs = mine - _UNSET_TYPES, theirs - _UNSET_TYPES  # never a value on the wire
    if mine == theirs:
        return None  # the same type spelled differently
    reader_types, written = (theirs, mine) if argument else (mine, theirs)
    if not _accepts(reader_types, written):
        how = "narrower" if argument else "wider"
        return f"{path}: {_type_text(mine)}  =>  {peer_text(_type_text(theirs), _SHOWN)} ({how})"
    how = "wider" if argument else "narrower"
    notes.append(f"{how} {path}: {peer_text(_type_text(theirs), _SHOWN)}")
    return None


def _field_members(text: str) -> frozenset[str] | None:
    """A field's type text as a set of union members (``None``: it does not parse)."""
    try:
        tree = ast.parse(text, mode="eval")
        return _members(tree.body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _differences(mine: _Signature, theirs: _Signature) -> tuple[list[str], list[str]]:
    """(incompatible, additive) differences of the worker's signature from the view's."""
    incompatible: list[str] = []
    additive: list[str] = []
    by_name = {p.name: p for p in theirs.params}
    mine_positional = [p for p in mine.params if p.kind in ("positional only", "positional")]
    theirs_positional = [p for p in theirs.params if p.kind in ("positional only", "positional")]
    for index, want in enumerate(mine_positional):
        got = theirs_positional[index] if index < len(theirs_positional) else None
        if got is None or got.name != want.name:
            where = by_name.get(want.name)
            incompatible.append(
                f"parameter {want.name!r} removed"
                if where is None
                else f"parameter {want.name!r} moved or became {where.kind}"
            )
            continue
        _compare_param(want, got, incompatible, additive)
    for want in mine.params:
        if want.kind in ("positional only", "positional"):
            continue
        got = by_name.get(want.name)
        if want.kind in ("*args", "**kwargs"):
            got = next((p for p in theirs.params if p.kind == want.kind), None)
        if got is None or got.kind != want.kind:
            incompatible.append(f"parameter {want.name!r} ({want.kind}) removed")
            continue
        _compare_param(want, got, incompatible, additive)
    known = {p.name for p in mine.params}
    for index, got in enumerate(theirs.params):
        is_positional = got.kind in ("positional only", "positional")
        if is_positional and index < len(mine_positional):
            continue  # compared above
        if got.kind in ("*args", "**kwargs"):
            if not any(p.kind == got.kind for p in mine.params):
                additive.append(f"new {got.kind} {got.name!r}")
            continue
        if got.name in known and not is_positional:
            continue
        if got.default is None:
            incompatible.append(f"new required parameter {got.name!r}")
        else:
            additive.append(f"new optional parameter {got.name!r}")
    if not _accepts(mine.result, theirs.result):
        incompatible.append(
            f"result {_type_text(mine.result)}  =>  {peer_text(_type_text(theirs.result), _SHOWN)}"
            " (wider)"
        )
    elif mine.result != theirs.result:
        additive.append(f"narrower result {peer_text(_type_text(theirs.result), _SHOWN)}")
    return incompatible, additive


def _compare_param(want: _Param, got: _Param, incompatible: list[str], additive: list[str]) -> None:
    name = want.name
    if want.kind != got.kind:
        incompatible.append(f"parameter {name!r}: {want.kind}  =>  {got.kind}")
    elif not _accepts(got.annotation, want.annotation):
        incompatible.append(
            f"parameter {name!r}: {_type_text(want.annotation)}  =>  "
            f"{peer_text(_type_text(got.annotation), _SHOWN)} (narrower)"
        )
    elif want.default is not None and got.default != want.default:
        shown = "required" if got.default is None else peer_text(got.default, _SHOWN)
        incompatible.append(f"parameter {name!r}: default {want.default}  =>  {shown}")
    else:
        if want.annotation != got.annotation:
            additive.append(
                f"wider parameter {name!r}: {peer_text(_type_text(got.annotation), _SHOWN)}"
            )
        if want.default is None and got.default is not None:
            additive.append(f"parameter {name!r} became optional")


def compare_manifests(expected: Mapping[str, Any], offered: Mapping[str, Any]) -> list[Verdict]:
    """Every method of either manifest (service -> method -> entry), compared.

    A service the worker offers and the view lacks reads ``ADDITIVE`` ("new service") for each of
    its methods, one the view has and the worker lacks ``REMOVED`` ("service removed"); a
    worker's service entry that is not a map makes each of the view's methods there
    ``INCOMPATIBLE``. Sorted by service, then method.
    """
    verdicts: list[Verdict] = []
    for service in sorted(set(expected) | set(offered), key=str):
        mine, theirs = expected.get(service), offered.get(service)
        name = str(service)
        if mine is None:
            for method in _method_names(theirs):
                verdicts.append(Verdict(name, method, Compatibility.ADDITIVE, "new service"))
            continue
        if not isinstance(mine, Mapping):
            continue  # the view is ours and always a map; nothing to compare otherwise
        if theirs is None:
            for method in sorted(mine, key=str):
                verdicts.append(Verdict(name, method, Compatibility.REMOVED, "service removed"))
            continue
        if not isinstance(theirs, Mapping):
            for method in sorted(mine, key=str):
                verdicts.append(
                    Verdict(
                        name,
                        method,
                        Compatibility.INCOMPATIBLE,
                        "the worker's service entry cannot be read",
                    )
                )
            continue
        mine, theirs = method_entries(mine), method_entries(theirs)
        for method in sorted(set(mine) | set(theirs), key=str):
            compatibility, difference = compare_method(mine.get(method), theirs.get(method))
            verdicts.append(Verdict(name, str(method), compatibility, difference))
    return verdicts


def _method_names(methods: object) -> Iterable[str]:
    return sorted((str(m) for m in methods), key=str) if isinstance(methods, Mapping) else ()


def service_version(methods: Mapping[str, Any]) -> str:
    """A service's contract version: 12 hex digits of the BLAKE3 hash of its methods' kinds and
    signatures. Other keys of an entry do not change it: descriptions, and the fields of its
    record types (``"records"``, ``"uses"``; ``"structs"`` in the per-method form), which a
    worker of 0.1.0 does not list, and which are listed in another form than before -- so a
    worker upgraded to this version with the same interfaces keeps its version, and a change of
    a struct's fields alone shows in :func:`compare_method`'s verdicts, not in the version."""
    contract = {
        str(name): (
            {"kind": entry.get("kind"), "signature": entry.get("signature")}
            if isinstance(entry, Mapping)
            else None
        )
        for name, entry in methods.items()
    }
    return blake3.blake3(encode_canonical(contract)).hexdigest()[:12]
