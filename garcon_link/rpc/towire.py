"""Values sent: :func:`to_wire` makes plain CBOR-encodable data of a Python value (msgspec
``to_builtins``: bytes stay bytes; datetimes become RFC 3339 text, enums their values,
dataclasses maps), every field written, a default too, where a declared type says a value may
leave one out (:func:`omits_defaults`). The way back is
:func:`~garcon_link.rpc.values.from_wire`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import msgspec
import msgspec.inspect

from .hints import type_nodes
from .values import record_class

__all__ = ["omits_defaults", "to_wire"]


_BUILTIN_TYPES = (bytes, bytearray)


def to_wire(value: Any, *, with_defaults: bool = False) -> Any:
    """Convert ``value`` to plain CBOR-encodable data.

    Args:
        value: what to send.
        with_defaults: also send the fields a ``msgspec.Struct`` declared ``omit_defaults=True``
            leaves out when they hold their default (:func:`omits_defaults` says when a declared
            type needs it). A receiver of another version may declare another default: the
            value sent is the sender's, never the receiver's guess.

    Raises:
        TypeError: a value of an unsupported type (the message names it).
    """
    if with_defaults:
        value = _every_field(value)
    return msgspec.to_builtins(value, builtin_types=_BUILTIN_TYPES)


def omits_defaults(hint: Any) -> bool:
    """Whether a value of ``hint`` may hold a ``msgspec.Struct`` declared ``omit_defaults=True``
    (then :func:`to_wire` needs ``with_defaults``). Made once per hint."""
    if hint is Any or hint is inspect.Parameter.empty or hint is None:
        return False
    try:
        return _omits_defaults_cached(hint)
    except TypeError:  # an unhashable hint: not cached
        return _omits_defaults(hint)


@functools.lru_cache(maxsize=1024)  # hints rebuilt from a peer's manifest vary: bounded
def _omits_defaults_cached(hint: Any) -> bool:
    return _omits_defaults(hint)


def _omits_defaults(hint: Any) -> bool:
    try:
        info = msgspec.inspect.type_info(hint)
    except Exception:  # not a type msgspec knows (a MethodSpec is never refused for it)
        return False
    return any(
        isinstance(node, msgspec.inspect.StructType)
        and record_class(node.cls).__struct_config__.omit_defaults
        for node in type_nodes(info)
    )


def _every_field(value: Any) -> Any:
    """``value`` with every ``msgspec.Struct`` written out as ``to_builtins`` would write it
    without ``omit_defaults`` (its tag, its encoded field names, ``UNSET`` fields left out);
    dataclasses and containers walked to reach the structs inside them. Only run when a
    declared type holds such a struct (:func:`omits_defaults`): plain values pass untouched."""
    if isinstance(value, msgspec.Struct):
        config = value.__struct_config__
        names = zip(value.__struct_fields__, value.__struct_encode_fields__, strict=True)
        pairs = [
            (encoded, _every_field(field_value))
            for name, encoded in names
            if (field_value := getattr(value, name)) is not msgspec.UNSET
        ]
        if config.array_like:
            items = [v for _, v in pairs]
            return [config.tag, *items] if config.tag_field is not None else items
        record = {config.tag_field: config.tag} if config.tag_field is not None else {}
        record.update(pairs)
        return record
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _every_field(field_value)
            for f in dataclasses.fields(value)
            if (field_value := getattr(value, f.name)) is not msgspec.UNSET
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [_every_field(item) for item in value]
    if isinstance(value, dict):
        return {key: _every_field(item) for key, item in value.items()}
    return value
