"""Service interfaces: what is callable, how values are converted, and the contract manifest.

An *interface* is a class (usually a ``typing.Protocol``) whose public methods define what a remote
peer may call. It is shared by both sides. From it we derive, once per interface:

* a :class:`MethodSpec` per public method: ``async def`` -> a unary call; a method annotated
  ``-> AsyncIterator[T]`` (or ``AsyncGenerator``/``AsyncIterable``) -> a stream of ``T``; a method
  decorated with :func:`oneway` -> a notification (no reply, no outcome). Names starting with ``_``
  are never exposed; neither is anything that is not one of those three kinds.
* the parameter and result type hints, used to **convert and validate values on the receiving
  side** with msgspec (dataclasses, enums, ``list``/``dict``/``tuple``/``Optional``/``Literal``,
  ``bytes``, ``datetime``, :class:`~garcon_link.resources.ResourceRef`, ...). A hint of ``Any`` or a
  missing hint passes the decoded value through unchanged.
* a manifest (service -> method -> kind and signature text) and its BLAKE3 *contract hash*, which
  a controller compares across session replacements.

Encoding is :func:`to_wire`: msgspec ``to_builtins`` (bytes stay bytes; datetimes become RFC 3339
text, enums their values, dataclasses maps) -- then CBOR.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import blake3
import msgspec

from .wire import encode_canonical

__all__ = [
    "MethodKind",
    "MethodSpec",
    "ServiceSpec",
    "contract_hash",
    "from_wire",
    "oneway",
    "service_spec",
    "to_wire",
]

F = TypeVar("F", bound=Callable[..., Any])

_ONEWAY_ATTR = "__garcon_link_oneway__"
_STREAM_ORIGINS = {
    collections.abc.AsyncIterator,
    collections.abc.AsyncGenerator,
    collections.abc.AsyncIterable,
}


def oneway(func: F) -> F:
    """Mark an interface method as a one-way notification: sent, never answered.

    The facade method returns once the notification is queued on the session; the handler's
    result and exceptions are discarded (exceptions are logged on the receiving side).
    """
    setattr(func, _ONEWAY_ATTR, True)
    return func


class MethodKind(enum.Enum):
    UNARY = "unary"
    STREAM = "stream"
    ONEWAY = "oneway"


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """One callable method of an interface."""

    name: str
    kind: MethodKind
    signature: inspect.Signature  # without ``self``
    hints: Mapping[str, Any]  # parameter name -> type hint
    result: Any  # unary: the return type; stream: the item type; oneway: None
    # Hints of the parameters when every one is plain positional-or-keyword: then a call with
    # exactly that many positional arguments binds without inspect.Signature.bind (hot path).
    _positional: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = self.signature.parameters.values()
        if all(p.kind in plain for p in params):
            hints = tuple(self.hints.get(p.name, Any) for p in params)
            object.__setattr__(self, "_positional", hints)

    def describe(self) -> str:
        return f"{self.kind.value} {self.name}{self.signature}"

    def bind(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """Bind call arguments to the signature (caller side).

        Raises:
            TypeError: the arguments do not fit the signature.
        """
        fast = self._positional
        if fast is not None and not kwargs and len(args) == len(fast):
            return list(args), {}
        bound = self.signature.bind(*args, **kwargs)
        return list(bound.args), dict(bound.kwargs)

    def convert_arguments(
        self, args: list[Any], kwargs: Mapping[str, Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """Validate and convert received arguments (receiving side).

        Raises:
            ValueError: with a message naming the offending argument.
        """
        fast = self._positional
        if fast is not None and not kwargs and len(args) == len(fast):
            names = self.signature.parameters
            return [
                _convert_argument(name, value, hint)
                for value, hint, name in zip(args, fast, names, strict=True)
            ], {}
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        for name, value in bound.arguments.items():
            hint = self.hints.get(name, Any)
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                bound.arguments[name] = tuple(_convert_argument(name, v, hint) for v in value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                bound.arguments[name] = {
                    k: _convert_argument(name, v, hint) for k, v in value.items()
                }
            else:
                bound.arguments[name] = _convert_argument(name, value, hint)
        return list(bound.args), dict(bound.kwargs)


def _convert_argument(name: str, value: Any, hint: Any) -> Any:
    """:func:`from_wire` for one received argument; failures name it (``ValueError``)."""
    try:
        return from_wire(value, hint)
    except msgspec.ValidationError as exc:
        raise ValueError(f"argument {name!r}: {exc}") from None
    except TypeError as exc:
        # msgspec cannot convert to this hint at all (e.g. a non-runtime Protocol): the call
        # fails, the receiving session does not.
        raise ValueError(f"argument {name!r}: cannot convert to {hint!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """The callable surface of one interface."""

    interface: type
    methods: Mapping[str, MethodSpec]

    def manifest(self) -> dict[str, dict[str, str]]:
        return {
            name: {"kind": m.kind.value, "signature": str(m.signature)}
            for name, m in sorted(self.methods.items())
        }


_spec_cache: dict[type, ServiceSpec] = {}


def service_spec(interface: type) -> ServiceSpec:
    """Derive (and cache) the :class:`ServiceSpec` of ``interface``.

    Raises:
        TypeError: ``interface`` is not a class, or its hints cannot be resolved.
    """
    cached = _spec_cache.get(interface)
    if cached is not None:
        return cached
    if not isinstance(interface, type):
        raise TypeError(f"an interface must be a class, got {interface!r}")
    methods: dict[str, MethodSpec] = {}
    for name in dir(interface):
        if name.startswith("_"):
            continue
        func = inspect.getattr_static(interface, name, None)
        if isinstance(func, staticmethod | classmethod) or not inspect.isfunction(func):
            continue
        spec = _method_spec(interface, name, func)
        if spec is not None:
            methods[name] = spec
    spec_ = ServiceSpec(interface=interface, methods=methods)
    _spec_cache[interface] = spec_
    return spec_


def _method_spec(interface: type, name: str, func: Callable[..., Any]) -> MethodSpec | None:
    try:
        hints = typing.get_type_hints(func)
    except Exception as exc:
        raise TypeError(
            f"cannot resolve type hints of {interface.__qualname__}.{name}: {exc}"
        ) from exc
    signature = inspect.signature(func)
    # The resolved hints, not their source text: the manifest (and so the contract hash) must
    # not change when only the spelling does, e.g. under ``from __future__ import annotations``.
    params = [
        p.replace(annotation=hints[p.name]) if p.name in hints else p
        for p in list(signature.parameters.values())[1:]  # drop self
    ]
    signature = signature.replace(parameters=params, return_annotation=inspect.Signature.empty)
    returns = hints.pop("return", Any)
    param_hints = {p.name: hints.get(p.name, Any) for p in params}
    if getattr(func, _ONEWAY_ATTR, False):
        return MethodSpec(name, MethodKind.ONEWAY, signature, param_hints, None)
    origin = typing.get_origin(returns)
    if origin in _STREAM_ORIGINS:
        item_args = typing.get_args(returns)
        item = item_args[0] if item_args else Any
        return MethodSpec(name, MethodKind.STREAM, signature, param_hints, item)
    if inspect.iscoroutinefunction(func):
        return MethodSpec(name, MethodKind.UNARY, signature, param_hints, returns)
    return None


def contract_hash(manifest: Mapping[str, Any]) -> str:
    """BLAKE3 hex digest of the canonical CBOR of a services manifest."""
    return blake3.blake3(encode_canonical(dict(manifest))).hexdigest()


_BUILTIN_TYPES = (bytes, bytearray)


def to_wire(value: Any) -> Any:
    """Convert ``value`` to plain CBOR-encodable data.

    Raises:
        TypeError: a value of an unsupported type (the message names it).
    """
    return msgspec.to_builtins(value, builtin_types=_BUILTIN_TYPES)


def from_wire(value: Any, hint: Any) -> Any:
    """Convert decoded wire data to ``hint`` (strictly; ``Any`` passes through).

    Raises:
        msgspec.ValidationError: the value does not fit the hint.
    """
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    if hint is None or hint is type(None):
        if value is not None:
            raise msgspec.ValidationError(f"Expected `null`, got `{type(value).__name__}`")
        return None
    return msgspec.convert(value, hint, strict=True)
