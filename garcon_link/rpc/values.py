"""Strict values: a value checked against a declared type, on each side of a call.

Theory of operation. A value crosses a call twice: the caller's Python object is encoded
(:func:`~garcon_link.rpc.towire.to_wire`: msgspec ``to_builtins``, then CBOR), and the
receiver converts the decoded data to the declared type. The encoding keeps what CBOR can say
(``bytes`` stay a byte string, ``str`` a text string, a dataclass becomes a map) and turns the
rest into text: ``datetime``/``date``/``time`` (RFC 3339), ``timedelta`` (ISO 8601 duration),
``UUID`` and ``Decimal`` travel as text strings, a ``set``/``tuple`` as an array, an enum member as
its value. So each side checks what it can see:

* **The caller** (:func:`check_value`, mode *python*) checks the Python object against the
  declared type, with no coercion: ``str`` is never ``bytes``, a ``datetime`` is not a ``str``
  (nor the reverse), a ``dict`` is not a dataclass, a ``set`` is not a ``list``, a ``bool`` is not
  an ``int``, an ``int`` is a ``float``; an enum parameter takes its members, a dataclass
  parameter an instance of it whose fields hold what they declare. A refused value is never
  sent.
* **The receiver** (:func:`from_wire`, mode *wire*) never trusts that check: it checks the
  decoded data against the declared type the same way -- a text string where ``bytes`` is
  declared is refused, not base64-decoded; a map for a dataclass or ``TypedDict`` with a key
  that is not one of its fields is refused, naming the field -- then msgspec builds the value
  (strictly), checking the text of a ``datetime``/``UUID``/``Decimal`` and any ``Meta``
  constraints. Where the wire cannot say what the caller sent (a ``datetime`` and its text, a
  ``set`` and a ``list``), the caller's check is the one that tells them apart.
* **A JSON client** (the ``garcon-link call`` command) has no ``bytes`` nor ``Decimal``: it marks
  its calls with the metadata entry ``garcon-link.values: json`` (:data:`VALUES_METADATA_KEY`),
  and the receiver then also accepts base64 text for ``bytes`` and a number for a ``Decimal``
  (mode *json*). Base64 is a JSON concern only: a Python caller's text is never decoded.

Messages use Python type names (``expected `bytes`, got `str` ``, ``expected `set[int]`, got
`list` ``) and the path of the offending part (``at `$.inner.name` ``). ``Any`` (or no hint)
accepts anything; a ``msgspec.Struct`` refuses unknown fields only when its own
``forbid_unknown_fields`` says so. Checking costs one walk of the value, which the frame limit
already bounds on the receiving side; a caller's value nested deeper than Python's recursion
limit is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import functools
import inspect
import typing
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

from ..logs import peer_text

__all__ = [
    "JSON_VALUES",
    "VALUES_METADATA_KEY",
    "Check",
    "Convert",
    "ValueMode",
    "check_value",
    "from_wire",
    "python_check",
    "record_class",
    "record_hints",
    "type_text",
    "wire_convert",
]

ValueMode = Literal["python", "wire", "json"]

VALUES_METADATA_KEY = "garcon-link.values"
"""The call metadata entry by which a JSON client asks for JSON's representation of values."""
JSON_VALUES = "json"
"""Its value: ``bytes`` may arrive as base64 text and a ``Decimal`` as a number."""

_SHOWN_FIELDS = 3  # unknown fields named in a message
_SHOWN_CHARS = 40  # characters of a peer's key, name or value shown in a message


def record_class(cls: Any) -> Any:
    """The class of a record type msgspec describes: ``Box`` for a generic ``Box[int]`` (whose
    ``msgspec.inspect`` node's ``cls`` is the alias, which ``isinstance`` refuses), else ``cls``."""
    origin = typing.get_origin(cls)
    return origin if isinstance(origin, type) else cls


def record_hints(cls: Any) -> dict[str, Any]:
    """The field hints of a record type, with a generic's parameters replaced by the alias's
    arguments (``item: T`` of ``Box[int]`` is ``int``); empty when ``typing`` cannot resolve
    them (msgspec did, so rarely)."""
    origin = record_class(cls)
    try:
        hints = typing.get_type_hints(origin)
    except Exception:  # unresolvable annotations
        return {}
    if origin is cls:
        return hints
    parameters = getattr(origin, "__parameters__", ())
    bound = dict(zip(parameters, typing.get_args(cls), strict=False))
    return {name: _bind(hint, bound) for name, hint in hints.items()}


def _bind(hint: Any, bound: dict[Any, Any]) -> Any:
    if hint in bound:
        return bound[hint]
    parameters = getattr(hint, "__parameters__", ())
    if not parameters or not all(p in bound for p in parameters):
        return hint
    try:
        return hint[tuple(bound[p] for p in parameters)]
    except TypeError:  # not subscriptable with them: left as declared
        return hint


class _Mismatch(Exception):
    """A value that does not fit; ``path`` grows (innermost first) as the walk unwinds."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text
        self.path: list[str] = []

    def message(self) -> str:
        if not self.path:
            return self.text
        return f"{self.text} at `$" + "".join(reversed(self.path)) + "`"


def check_value(value: Any, hint: Any) -> None:
    """Check a caller's Python value against the declared ``hint`` (mode *python*).

    Raises:
        TypeError: the value does not fit; the message says what was expected, what was given
            (Python type names) and where.
    """
    check = python_check(hint)
    if check is not None:
        check(value)


def from_wire(value: Any, hint: Any, *, mode: ValueMode = "wire") -> Any:
    """Convert decoded wire data to ``hint``, strictly (``Any`` passes it through).

    Args:
        value: what CBOR decoded (plain data).
        hint: the declared type.
        mode: ``"wire"`` for a Python peer's data, ``"json"`` for a JSON client's (module
            docstring).

    Raises:
        msgspec.ValidationError: the value does not fit the hint.
        TypeError: msgspec cannot convert to ``hint`` at all.
    """
    convert = wire_convert(hint, mode)
    return value if convert is None else convert(value)


Check = Callable[[Any], None]
Convert = Callable[[Any], Any]


def python_check(hint: Any) -> Check | None:
    """The function :func:`check_value` applies for ``hint`` (``None``: nothing to check),
    made once per hint: a caller keeps it for each parameter of a method."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    try:
        return _python_check_cached(hint)
    except TypeError:  # an unhashable hint: not cached
        return _python_check(hint)


def wire_convert(hint: Any, mode: ValueMode = "wire") -> Convert | None:
    """The function :func:`from_wire` applies for ``hint`` in ``mode`` (``None``: the value
    passes as decoded), made once per hint and mode."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    try:
        return _wire_convert_cached(hint, mode)
    except TypeError:  # an unhashable hint: not cached
        return _wire_convert(hint, mode)


def _python_check(hint: Any) -> Check | None:
    node = _info(hint)
    if node is None:  # a type msgspec cannot describe: the receiver refuses what does not fit
        return None
    if type(node) is mi.AnyType:
        return None
    leaf = _PYTHON_LEAVES.get(type(node))
    if leaf is not None:
        return leaf

    def check(value: Any) -> None:
        try:
            _check(node, value, "python")
        except _Mismatch as exc:
            raise TypeError(exc.message()) from None
        except RecursionError:
            raise TypeError("the value is nested too deeply to check") from None

    return check


def _wire_convert(hint: Any, mode: ValueMode) -> Convert | None:
    if hint is None or hint is type(None):
        return _wire_none
    node = _info(hint)
    if node is None:  # msgspec decides (a hint it cannot convert to raises TypeError)

        def convert_any(value: Any) -> Any:
            return msgspec.convert(value, hint, strict=True)

        return convert_any
    kind = type(node)
    if kind is mi.AnyType:
        return None
    # A leaf checked exactly, with no constraint to check: nothing to build.
    if node == _BARE.get(kind) and not (kind is mi.BytesType and mode == "json"):
        return _WIRE_LEAVES[kind]

    def convert(value: Any) -> Any:
        try:
            _check(node, value, mode)
        except _Mismatch as exc:
            raise msgspec.ValidationError(exc.message()) from None
        except RecursionError:  # cbor2 caps the nesting of decoded data; a deep hint may not
            raise msgspec.ValidationError("the value is nested too deeply to check") from None
        return msgspec.convert(value, hint, strict=True)

    return convert


@functools.lru_cache(maxsize=1024)  # hints rebuilt from a peer's manifest vary: bounded
def _python_check_cached(hint: Any) -> Check | None:
    return _python_check(hint)


@functools.lru_cache(maxsize=1024)
def _wire_convert_cached(hint: Any, mode: ValueMode) -> Convert | None:
    return _wire_convert(hint, mode)


def _wire_none(value: Any) -> None:
    if value is not None:
        raise msgspec.ValidationError(f"expected `None`, got `{_got(value)}`")


def _python_int(value: Any) -> None:
    # An IntEnum member is an int (it is sent as its value); a bool never is.
    if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"expected `int`, got `{_got(value)}`")


def _python_str(value: Any) -> None:
    if type(value) is not str and not isinstance(value, str):
        raise TypeError(f"expected `str`, got `{_got(value)}`")


def _python_bool(value: Any) -> None:
    if type(value) is not bool:
        raise TypeError(f"expected `bool`, got `{_got(value)}`")


def _python_float(value: Any) -> None:
    kind = type(value)
    if (
        kind is not float
        and kind is not int
        and (not isinstance(value, int | float) or isinstance(value, bool))
    ):
        raise TypeError(f"expected `float`, got `{_got(value)}`")


def _python_bytes(value: Any) -> None:
    kind = type(value)
    if kind is not bytes and kind is not bytearray:
        raise TypeError(f"expected `bytes`, got `{_got(value)}`")


def _python_none(value: Any) -> None:
    if value is not None:
        raise TypeError(f"expected `None`, got `{_got(value)}`")


def _wire_int(value: Any) -> Any:
    if type(value) is not int:
        raise msgspec.ValidationError(f"expected `int`, got `{_got(value)}`")
    return value


def _wire_str(value: Any) -> Any:
    if type(value) is not str:
        raise msgspec.ValidationError(f"expected `str`, got `{_got(value)}`")
    return value


def _wire_bool(value: Any) -> Any:
    if type(value) is not bool:
        raise msgspec.ValidationError(f"expected `bool`, got `{_got(value)}`")
    return value


def _wire_float(value: Any) -> Any:
    kind = type(value)
    if kind is float:
        return value
    if kind is int:
        try:
            return float(value)
        except OverflowError:  # past a float's range: refused as msgspec.convert refuses it
            raise msgspec.ValidationError("expected `float`, got `int` out of range") from None
    raise msgspec.ValidationError(f"expected `float`, got `{_got(value)}`")


def _wire_bytes(value: Any) -> Any:
    if type(value) is not bytes:
        raise msgspec.ValidationError(f"expected `bytes`, got `{_got(value)}`")
    return value


_PYTHON_LEAVES: dict[type, Check] = {
    mi.NoneType: _python_none,
    mi.BoolType: _python_bool,
    mi.IntType: _python_int,
    mi.FloatType: _python_float,
    mi.StrType: _python_str,
    mi.BytesType: _python_bytes,
}
_WIRE_LEAVES: dict[type, Convert] = {
    mi.NoneType: _wire_none,
    mi.BoolType: _wire_bool,
    mi.IntType: _wire_int,
    mi.FloatType: _wire_float,
    mi.StrType: _wire_str,
    mi.BytesType: _wire_bytes,
}
# The leaves with no constraint (a constrained one is built by msgspec, which checks it).
_BARE: dict[type, mi.Type] = {
    mi.NoneType: mi.NoneType(),
    mi.BoolType: mi.BoolType(),
    mi.IntType: mi.IntType(),
    mi.FloatType: mi.FloatType(),
    mi.StrType: mi.StrType(),
    mi.BytesType: mi.BytesType(),
}


def type_text(hint: Any) -> str:
    """``hint`` in Python's words (``set[int]``, ``int | None``, ``Rect``) for a message."""
    node = _info(hint)
    if node is None:
        return hint.__qualname__ if isinstance(hint, type) else repr(hint)
    return _text(node)


@functools.lru_cache(maxsize=1024)
def _cached_info(hint: Any) -> mi.Type | None:
    try:
        return mi.type_info(hint)
    except (TypeError, ValueError):
        return None


def _info(hint: Any) -> mi.Type | None:
    try:
        return _cached_info(hint)
    except TypeError:  # an unhashable hint: not cached
        try:
            return mi.type_info(hint)
        except (TypeError, ValueError):
            return None


# -- the walk: one function per kind of declared type, each checking one level


def _got(value: Any) -> str:
    return "None" if value is None else type(value).__qualname__


def _refuse(node: mi.Type, value: Any) -> _Mismatch:
    return _Mismatch(f"expected `{_text(node)}`, got `{_got(value)}`")


def _check(node: mi.Type, value: Any, mode: ValueMode) -> None:
    _CHECKS.get(type(node), _check_nothing)(node, value, mode)


def _check_nothing(node: Any, value: Any, mode: ValueMode) -> None:
    """Any, Raw, Ext, a custom type: msgspec (on the receiving side) decides."""


def _check_none(node: Any, value: Any, mode: ValueMode) -> None:
    if value is not None:
        raise _refuse(node, value)


def _check_bool(node: Any, value: Any, mode: ValueMode) -> None:
    if type(value) is not bool:
        raise _refuse(node, value)


def _check_int(node: Any, value: Any, mode: ValueMode) -> None:
    # A Python caller's IntEnum member is an int (it is sent as its value); a bool never is.
    if type(value) is not int and (
        mode != "python" or not isinstance(value, int) or isinstance(value, bool)
    ):
        raise _refuse(node, value)


def _check_float(node: Any, value: Any, mode: ValueMode) -> None:
    kind = type(value)
    if kind is not float and kind is not int:
        if mode == "python" and isinstance(value, int | float) and not isinstance(value, bool):
            return
        raise _refuse(node, value)


def _check_str(node: Any, value: Any, mode: ValueMode) -> None:
    if type(value) is not str and (mode != "python" or not isinstance(value, str)):
        raise _refuse(node, value)


def _check_bytes(node: Any, value: Any, mode: ValueMode) -> None:
    kind = type(value)
    if kind is bytes or (mode == "python" and kind is bytearray):
        return
    if mode == "json" and kind is str:
        return  # base64 text: msgspec decodes (and checks) it
    raise _refuse(node, value)


def _python_class(
    cls: type, *, exclude: type | None = None
) -> Callable[[Any, Any, ValueMode], None]:
    """A value that travels as text: a Python caller passes an instance of ``cls``."""

    def check(node: Any, value: Any, mode: ValueMode) -> None:
        if mode == "python":
            if not isinstance(value, cls) or (exclude is not None and isinstance(value, exclude)):
                raise _refuse(node, value)
            tz = getattr(node, "tz", None)
            if tz is not None and (value.tzinfo is not None) != tz:  # type: ignore[attr-defined]
                need = "a timezone-aware" if tz else "a naive"
                raise _Mismatch(f"expected {need} `{_text(node)}`, got {_zone(value)}")
        elif type(value) is not str and not (
            mode == "json" and cls is decimal.Decimal and type(value) in (int, float)
        ):
            raise _refuse(node, value)

    return check


def _zone(value: Any) -> str:
    return "a naive one" if value.tzinfo is None else "a timezone-aware one"


def _check_enum(node: mi.EnumType, value: Any, mode: ValueMode) -> None:
    if mode == "python":
        if not isinstance(value, node.cls):
            raise _refuse(node, value)
    elif type(value) is not str and type(value) is not int:
        raise _refuse(node, value)
    # Which value is a member: msgspec checks it (with the members in its message).


def _check_literal(node: mi.LiteralType, value: Any, mode: ValueMode) -> None:
    for allowed in node.values:
        if value == allowed and (
            type(value) is type(allowed)
            or (
                mode == "python"
                and isinstance(value, type(allowed))
                and not isinstance(value, bool)
            )
        ):
            return
    raise _Mismatch(f"expected `{_text(node)}`, got {_shown(value)}")


def _shown(value: Any) -> str:
    if isinstance(value, str | int) and not isinstance(value, bool):
        return f"{peer_text(value, _SHOWN_CHARS)} (`{_got(value)}`)"
    return f"`{_got(value)}`"


_SEQUENCES = (list, tuple)
_SETS = (set, frozenset)


def _check_collection(node: Any, value: Any, mode: ValueMode) -> None:
    if mode != "python":
        accepted: tuple[type, ...] = (list,)
    elif isinstance(node, mi.SetType | mi.FrozenSetType):
        accepted = _SETS
    else:
        accepted = _SEQUENCES
    if type(value) not in accepted:
        raise _refuse(node, value)
    item = node.item_type
    check = _CHECKS.get(type(item), _check_nothing)
    if check is _check_nothing:
        return
    for index, element in enumerate(value):
        try:
            check(item, element, mode)
        except _Mismatch as exc:
            exc.path.append(f"[{index}]")
            raise


def _check_tuple(node: mi.TupleType, value: Any, mode: ValueMode) -> None:
    if type(value) not in ((list,) if mode != "python" else _SEQUENCES):
        raise _refuse(node, value)
    if len(value) != len(node.item_types):
        raise _Mismatch(
            f"expected `{_text(node)}` ({len(node.item_types)} items), got {len(value)} items"
        )
    for index, (item, element) in enumerate(zip(node.item_types, value, strict=True)):
        try:
            _check(item, element, mode)
        except _Mismatch as exc:
            exc.path.append(f"[{index}]")
            raise


def _check_dict(node: mi.DictType, value: Any, mode: ValueMode) -> None:
    if type(value) is not dict and (mode != "python" or not isinstance(value, dict)):
        raise _refuse(node, value)
    key_type, value_type = node.key_type, node.value_type
    for key, element in value.items():
        try:
            _check(key_type, key, mode)
        except _Mismatch as exc:
            raise _Mismatch(f"a key: {exc.message()}") from None
        try:
            _check(value_type, element, mode)
        except _Mismatch as exc:
            exc.path.append(_key_path(key))
            raise


def _key_path(key: Any) -> str:
    """A path step: ``.name`` for a plain name, else the key through the bounded formatter
    (keys and field names may be the peer's)."""
    return f".{key}" if _plain_name(key) else f"[{peer_text(key, _SHOWN_CHARS)}]"


def _name(name: Any) -> str:
    return name if _plain_name(name) else peer_text(name, _SHOWN_CHARS)


def _plain_name(name: Any) -> bool:
    return (
        type(name) is str and len(name) <= _SHOWN_CHARS and name.isascii() and name.isidentifier()
    )


def _check_record(node: Any, value: Any, mode: ValueMode) -> None:
    """A dataclass, a ``msgspec.Struct``, a ``TypedDict`` or a ``NamedTuple``."""
    cls = record_class(node.cls)
    fields: tuple[mi.Field, ...] = node.fields
    if mode == "python":
        if isinstance(node, mi.TypedDictType):
            if not isinstance(value, dict):
                raise _refuse(node, value)
            _check_keys(node, value, by_encode_name=False)
            for field in fields:
                if field.name in value:
                    _check_field(field, value[field.name], mode)
            return
        if not isinstance(value, cls):
            raise _refuse(node, value)
        if isinstance(node, mi.DataclassType) and type(value) is not cls:
            # A subclass's own fields would be sent too, and are not the declared type's.
            declared = {f.name for f in fields}
            extra = [f.name for f in dataclasses.fields(value) if f.name not in declared]
            if extra:
                raise _unknown(node, extra)
        for field in fields:
            _check_field(field, getattr(value, field.name), mode)
        return
    if isinstance(node, mi.NamedTupleType) or (isinstance(node, mi.StructType) and node.array_like):
        if type(value) is not list:
            raise _refuse(node, value)
        required = sum(f.required for f in fields)
        tag = 1 if isinstance(node, mi.StructType) and node.tag is not None else 0
        if not required + tag <= len(value) <= len(fields) + tag:
            raise _Mismatch(
                f"expected `{_text(node)}` ({required}..{len(fields)} items), got {len(value)}"
            )
        for field, element in zip(fields, value[tag:], strict=False):
            _check_field(field, element, mode)
        return
    if type(value) is not dict:
        raise _refuse(node, value)
    if not isinstance(node, mi.StructType) or node.forbid_unknown_fields:
        _check_keys(node, value, by_encode_name=True)
    for field in fields:
        if field.encode_name in value:
            _check_field(field, value[field.encode_name], mode)
        elif field.required:
            raise _Mismatch(f"`{_text(node)}` is missing its required field `{field.name}`")


def _check_field(field: mi.Field, value: Any, mode: ValueMode) -> None:
    try:
        _check(field.type, value, mode)
    except _Mismatch as exc:
        exc.path.append(_key_path(field.name))
        raise


def _check_keys(node: Any, value: dict[Any, Any], *, by_encode_name: bool) -> None:
    names = {f.encode_name if by_encode_name else f.name for f in node.fields}
    tag_field = getattr(node, "tag_field", None)
    unknown = [k for k in value if k not in names and k != tag_field]
    if unknown:
        raise _unknown(node, unknown)
    if isinstance(node, mi.TypedDictType):
        for field in node.fields:
            if field.required and field.name not in value:
                raise _Mismatch(f"`{_text(node)}` is missing its required key `{field.name}`")


def _unknown(node: Any, names: list[Any]) -> _Mismatch:
    shown = ", ".join(f"`{_name(n)}`" for n in names[:_SHOWN_FIELDS])
    more = f" and {len(names) - _SHOWN_FIELDS} more" if len(names) > _SHOWN_FIELDS else ""
    known = ", ".join(f.name for f in node.fields) or "none"
    word = "field" if len(names) == 1 else "fields"
    return _Mismatch(f"`{_text(node)}` has no {word} {shown}{more} (its fields: {known})")


def _check_union(node: mi.UnionType, value: Any, mode: ValueMode) -> None:
    deepest: _Mismatch | None = None
    for member in node.types:
        try:
            _check(member, value, mode)
        except _Mismatch as exc:
            # A member the value has the shape of (it failed inside): its reason is the useful one.
            if exc.path and (deepest is None or len(exc.path) > len(deepest.path)):
                deepest = exc
            continue
        return
    if deepest is not None:
        raise deepest
    raise _refuse(node, value)


def _check_metadata(node: mi.Metadata, value: Any, mode: ValueMode) -> None:
    _check(node.type, value, mode)


_CHECKS: dict[type, Callable[[Any, Any, ValueMode], None]] = {
    mi.NoneType: _check_none,
    mi.BoolType: _check_bool,
    mi.IntType: _check_int,
    mi.FloatType: _check_float,
    mi.StrType: _check_str,
    mi.BytesType: _check_bytes,
    mi.ByteArrayType: _check_bytes,
    mi.MemoryViewType: _check_bytes,
    mi.DateTimeType: _python_class(datetime.datetime),
    mi.DateType: _python_class(datetime.date, exclude=datetime.datetime),
    mi.TimeType: _python_class(datetime.time),
    mi.TimeDeltaType: _python_class(datetime.timedelta),
    mi.UUIDType: _python_class(uuid.UUID),
    mi.DecimalType: _python_class(decimal.Decimal),
    mi.EnumType: _check_enum,
    mi.LiteralType: _check_literal,
    mi.ListType: _check_collection,
    mi.VarTupleType: _check_collection,
    mi.SetType: _check_collection,
    mi.FrozenSetType: _check_collection,
    mi.TupleType: _check_tuple,
    mi.DictType: _check_dict,
    mi.DataclassType: _check_record,
    mi.StructType: _check_record,
    mi.TypedDictType: _check_record,
    mi.NamedTupleType: _check_record,
    mi.UnionType: _check_union,
    mi.Metadata: _check_metadata,
}

# -- Python's words for a declared type


def _text(node: Any) -> str:
    kind = type(node)
    simple = _SIMPLE_NAMES.get(kind)
    if simple is not None:
        return simple
    if isinstance(node, mi.ListType | mi.SetType | mi.FrozenSetType):
        return f"{_COLLECTION_NAMES[kind]}[{_text(node.item_type)}]"
    if isinstance(node, mi.VarTupleType):
        return f"tuple[{_text(node.item_type)}, ...]"
    if isinstance(node, mi.TupleType):
        return f"tuple[{', '.join(_text(t) for t in node.item_types)}]"
    if isinstance(node, mi.DictType):
        return f"dict[{_text(node.key_type)}, {_text(node.value_type)}]"
    if isinstance(node, mi.UnionType):
        return " | ".join(_text(t) for t in node.types)
    if isinstance(node, mi.LiteralType):
        return f"Literal[{', '.join(repr(v) for v in node.values)}]"
    if isinstance(node, mi.Metadata):
        return _text(node.type)
    cls = getattr(node, "cls", None)
    if isinstance(cls, type):
        return cls.__qualname__
    if cls is not None and isinstance(typing.get_origin(cls), type):  # a generic: Box[int]
        arguments = ", ".join(type_text(a) for a in typing.get_args(cls))
        return f"{record_class(cls).__qualname__}[{arguments}]"
    return kind.__name__.removesuffix("Type")


_SIMPLE_NAMES: dict[type, str] = {
    mi.AnyType: "Any",
    mi.NoneType: "None",
    mi.BoolType: "bool",
    mi.IntType: "int",
    mi.FloatType: "float",
    mi.StrType: "str",
    mi.BytesType: "bytes",
    mi.ByteArrayType: "bytearray",
    mi.MemoryViewType: "memoryview",
    mi.DateTimeType: "datetime",
    mi.DateType: "date",
    mi.TimeType: "time",
    mi.TimeDeltaType: "timedelta",
    mi.UUIDType: "UUID",
    mi.DecimalType: "Decimal",
    mi.RawType: "msgspec.Raw",
}
_COLLECTION_NAMES: dict[type, str] = {
    mi.ListType: "list",
    mi.SetType: "set",
    mi.FrozenSetType: "frozenset",
}
