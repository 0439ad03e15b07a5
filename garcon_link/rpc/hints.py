"""What msgspec makes of a type hint: whether it can convert and encode values of it
(:func:`unsupported_hint`, which registration asks of every parameter and result), and every
node of its type description (:func:`type_nodes`, which the record layouts and the wire
conversion walk)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect

__all__ = ["type_nodes", "unsupported_hint"]


def unsupported_hint(hint: Any) -> str | None:
    """Why msgspec cannot convert to and encode values of ``hint`` (``None``: it can)."""
    if hint is Any or hint is inspect.Parameter.empty or hint is None:
        return None
    try:
        info = msgspec.inspect.type_info(hint)
    except TypeError as exc:
        return f"{_hint_text(hint)}: {exc}"
    for node in type_nodes(info):
        if isinstance(node, msgspec.inspect.CustomType):
            inner = node.cls.__qualname__
            where = "" if node is info else f" (it contains {inner})"
            return (
                f"{_hint_text(hint)}{where} is not a type msgspec can convert and encode; "
                "use a plain type (str, int, bytes, list, dict, a dataclass, an enum, ...)"
                + (" -- e.g. str for a path" if _is_path(node.cls) else "")
            )
    return None


def type_nodes(info: Any) -> Iterator[Any]:
    """Every node of a msgspec type description (``msgspec.inspect.type_info``), each once:
    the types, their fields and the types within them, to any depth."""
    seen: set[int] = set()
    stack: list[Any] = [info]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node, msgspec.inspect.Type | msgspec.inspect.Field):
            stack.extend(getattr(node, f) for f in node.__struct_fields__)
        elif isinstance(node, tuple):
            stack.extend(node)


def _is_path(cls: type) -> bool:
    import os

    return issubclass(cls, os.PathLike)


def _hint_text(hint: Any) -> str:
    return hint.__qualname__ if isinstance(hint, type) else repr(hint)
