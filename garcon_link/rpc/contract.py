"""Contracts compared method by method: what a caller expects against what a worker offers.

A manifest (:meth:`~garcon_link.rpc.interface.ServiceSpec.manifest`) maps service -> method ->
``{"kind", "signature"}``, and ``"positional"`` when the method's types hold ``msgspec.Struct``
types declared ``array_like=True`` (other keys, such as descriptions, are not part of the
contract). A
caller's *view* is the manifest of the interface its facade was made with; the worker's manifest
is what its current session described (or announced since). :func:`compare_method` decides, for
one method, one of four :class:`Compatibility` values, and names the difference:

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

A struct declared ``array_like=True`` is encoded as an array, its fields by position, while
the signature text names the type only: its fields in order are the entry's ``"positional"``
(:func:`~garcon_link.rpc.interface.positional_layouts`). For each such type the view names, the
worker's fields must be the same, in the same order, or the same followed by fields with
defaults (``ADDITIVE``: msgspec fills a missing trailing field in and ignores an extra one);
anything else -- a field reordered, removed, renamed, retyped, a required one appended, the type
no longer ``array_like`` or newly so -- is ``INCOMPATIBLE``, as each position would then mean
something else. A struct encoded as a map (the default) is matched by field name, so the order
of its fields is not part of the contract.

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
from .manifest import MAX_SIGNATURE_CHARS

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
    layout = _compare_layouts(expected.get("positional"), offered.get("positional"), want_text)
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


MAX_LAYOUT_FIELDS = 1024
"""The most types and fields a worker's ``"positional"`` entry may list for one method, all
counted together; more is unreadable (incompatible)."""


def _layouts(value: object) -> dict[str, list[str]] | None:
    """A ``"positional"`` entry as ``{type: [field, ...]}``; ``None`` if it is not one."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        return None
    layouts: dict[str, list[str]] = {}
    total = 0
    for name, fields in value.items():
        if not isinstance(name, str) or not isinstance(fields, list):
            return None
        total += 1 + len(fields)  # each name is searched for in the signature text
        if total > MAX_LAYOUT_FIELDS or not all(isinstance(f, str) for f in fields):
            return None
        layouts[name] = fields
    return layouts


def _compare_layouts(
    expected: object, offered: object, signature: object
) -> tuple[Compatibility, str] | None:
    """The ``array_like`` structs of one method (module docstring): ``INCOMPATIBLE`` or
    ``ADDITIVE`` and the difference, or ``None`` when they match or the worker lists none.

    A worker that lists no layouts for the method (no ``"positional"`` key) is either of an
    earlier version, which never lists them, or one whose types for it hold no ``array_like``
    struct: the two cannot be told apart, so the method is compared on its signature alone, as
    earlier versions compared it. Callers may then be upgraded before workers; what is missed is
    a worker that dropped ``array_like`` from every struct of the method, whose values then fail
    to decode (an array where a map is expected) rather than being misread."""
    if offered is None:
        return None
    mine, theirs = _layouts(expected), _layouts(offered)
    if theirs is None:
        return Compatibility.INCOMPATIBLE, "the worker's positional struct layout cannot be read"
    if mine is None:  # ours, and always readable; nothing to compare otherwise
        return None
    text = signature if isinstance(signature, str) else ""
    for name in sorted(theirs):
        if name not in mine and re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text):
            return (
                Compatibility.INCOMPATIBLE,
                f"{peer_text(name, _SHOWN)} is positional (array_like) on the worker",
            )
    appended: list[str] = []
    for name, want in sorted(mine.items()):
        got_fields = theirs.get(name)
        if got_fields is None:
            return (
                Compatibility.INCOMPATIBLE,
                f"{name} is not positional (array_like) on the worker",
            )
        if got_fields == want:
            continue
        extra = got_fields[len(want) :]
        if got_fields[: len(want)] == want and all(f.endswith(" = ...") for f in extra):
            appended.append(f"{name}: new optional field(s) {peer_text(', '.join(extra), _SHOWN)}")
            continue
        index = next(
            (i for i, (a, b) in enumerate(zip(want, got_fields, strict=False)) if a != b),
            min(len(want), len(got_fields)),
        )
        mine_text = want[index] if index < len(want) else "(none)"
        theirs_text = got_fields[index] if index < len(got_fields) else "(none)"
        return (
            Compatibility.INCOMPATIBLE,
            f"{name} (positional, array_like): field {index} {mine_text}  =>  "
            f"{peer_text(theirs_text, _SHOWN)}",
        )
    if appended:
        return Compatibility.ADDITIVE, "; ".join(appended[:4])
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
        for method in sorted(set(mine) | set(theirs), key=str):
            compatibility, difference = compare_method(mine.get(method), theirs.get(method))
            verdicts.append(Verdict(name, str(method), compatibility, difference))
    return verdicts


def _method_names(methods: object) -> Iterable[str]:
    return sorted((str(m) for m in methods), key=str) if isinstance(methods, Mapping) else ()


def service_version(methods: Mapping[str, Any]) -> str:
    """A service's contract version: 12 hex digits of the BLAKE3 hash of its methods' kinds,
    signatures and positional struct layouts (other keys of an entry, such as descriptions, do
    not change it)."""
    contract = {
        str(name): (
            {
                "kind": entry.get("kind"),
                "signature": entry.get("signature"),
                **({"positional": entry["positional"]} if "positional" in entry else {}),
            }
            if isinstance(entry, Mapping)
            else None
        )
        for name, entry in methods.items()
    }
    return blake3.blake3(encode_canonical(contract)).hexdigest()[:12]
