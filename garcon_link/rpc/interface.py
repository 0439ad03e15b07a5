"""Service interfaces: what is callable, how values are converted, and the contract manifest.

A method's spec and its signature text (the contract) are derived here, from one reading of the
interface's hints. What is built from them reads the spec or its manifest, never the hints again:
a sync client's spec and the source printed from a spec (the sync view, the stub) are
:mod:`.views`'s; the manifest's hash, the changes between two, a spec rebuilt from a worker's
are :mod:`.manifest`'s. The value checks live in :mod:`.values`, the comparison of contracts in
:mod:`.contract`.

An *interface* is a class (usually a ``typing.Protocol``) whose public methods define what a remote
peer may call. It is shared by both sides. From it we derive, once per interface:

* a :class:`MethodSpec` per public method: ``async def`` -> a unary call; a method annotated
  ``-> AsyncIterator[T]`` (or ``AsyncGenerator``/``AsyncIterable``) -> a stream of ``T``; a method
  decorated with :func:`oneway` -> a notification (no reply, no outcome). Names starting with ``_``
  are never exposed; neither is anything that is not one of those three kinds.
* the parameter and result type hints, which **check values on both sides**: the caller checks
  its Python values before sending (:meth:`MethodSpec.check_arguments`), the receiving side
  checks and converts what it decoded (:meth:`MethodSpec.convert_arguments`), both strictly and
  without coercion (:mod:`garcon_link.rpc.values`: ``str`` is never ``bytes``, a dataclass map
  with an unknown field is refused, ...). Dataclasses, enums, ``list``/``dict``/``tuple``/
  ``set``/``Optional``/``Literal``, ``bytes``, ``datetime``, ``UUID``, ``Decimal``,
  :class:`~garcon_link.rpc.resources.ResourceRef`, ... A hint of ``Any`` or a missing hint passes
  the decoded value through unchanged.
* a manifest (service -> method -> kind and signature text, *including the return type*, and
  the fields of the record types the method reaches, :func:`struct_layouts`, listed once per
  service, :func:`record_table`) and its
  BLAKE3 *contract hash*, which a controller compares across session replacements: changing
  ``-> int`` to ``-> str`` is a contract change, reported as the list of methods that changed
  (:func:`~garcon_link.rpc.manifest.manifest_changes`).

Plain ``def`` methods are refused, not run in a thread. A public method that is neither
``async def``, nor declared a stream, nor :func:`oneway` makes :func:`service_spec` raise
:class:`~garcon_link.errors.ConfigError` naming it and the fix: make it ``async def`` and wrap
blocking work in ``await anyio.to_thread.run_sync(...)``, or rename it with a leading ``_`` if it
is not meant to be called remotely. (Running them in worker threads would hide a blocking call
behind a thread limit nobody sized; the explicit ``to_thread`` call keeps that decision, and its
limiter, in the handler.) So a worker refuses such a service at start-up, and a controller's
``executor.service(name, Interface)`` at facade creation -- never a silent
``OPERATION_UNSUPPORTED`` or ``AttributeError`` at call time. An async generator function must be
annotated ``-> AsyncIterator[T]`` to be a stream; one that is not is refused the same way.

A *sync client's* view of an interface is the one place plain ``def`` is right (``def``
methods, streams returning ``Iterator[T]``); :mod:`.views` derives its spec, whose manifest is the
async interface's. Serving is unchanged: :func:`service_spec` refuses such an interface.

Registration (:class:`~garcon_link.api.registration.Service` and a worker's services map) also
checks, with :func:`registration_problems`, that the implementation fits the interface -- every
method present, ``async def`` where the interface says unary, an async generator function where it
says stream, the parameters accepted, no plain-class hint contradicting the interface's (``str``
where it sends ``int``) -- and that every parameter and return hint is one msgspec can convert and
encode (a ``Path``, or a ``Protocol`` used as a value type, is not). All problems are reported in
one ``ConfigError``.

Encoding is :func:`to_wire`: msgspec ``to_builtins`` (bytes stay bytes; datetimes become RFC 3339
text, enums their values, dataclasses maps) -- then CBOR. Every field is sent, a default too: a
``msgspec.Struct`` declared ``omit_defaults=True`` is written out in full wherever a method's
declared types can hold one (:func:`omits_defaults`), since a peer of another version may
declare another default (the contract compares fields, :func:`struct_layouts`, but not their
default values). Decoding is
:func:`from_wire` (:mod:`garcon_link.rpc.values`).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

from ..errors import ConfigError
from ..logs import peer_text
from .values import (
    Check,
    Convert,
    ValueMode,
    check_value,
    from_wire,
    python_check,
    record_class,
    record_hints,
    wire_convert,
)

__all__ = [
    "MAX_RECORD_TABLE",
    "MAX_STRUCT_FIELDS",
    "MAX_STRUCT_TEXT",
    "UNSET_FIELD",
    "MethodKind",
    "MethodSpec",
    "ServiceSpec",
    "derive_spec",
    "from_wire",
    "omits_defaults",
    "oneway",
    "record_table",
    "registration_problems",
    "service_spec",
    "struct_layouts",
    "to_wire",
    "unsupported_hint",
]

F = TypeVar("F", bound=Callable[..., Any])

_ONEWAY_ATTR = "__garcon_link_oneway__"
_STREAM_ORIGINS = {
    collections.abc.AsyncIterator,
    collections.abc.AsyncGenerator,
    collections.abc.AsyncIterable,
}
# A sync client's view of a stream (garcon_link.sync): the same wire behaviour, a plain iterator.
_SYNC_STREAM_ORIGINS = {
    collections.abc.Iterator,
    collections.abc.Generator,
    collections.abc.Iterable,
}


def oneway(func: F) -> F:
    """Mark an interface method as a one-way notification: sent, never answered.

    The facade method returns once the notification is queued on the session; the handler's
    result and exceptions are discarded (exceptions are logged on the receiving side). Arguments
    the receiver refuses (types, constraints) are counted there (``oneway_refused`` in its
    statistics) and logged, at most once per ``Limits.log_interval``; the caller is not told.
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
    signature: inspect.Signature  # without ``self``; its return annotation is the declared one
    hints: Mapping[str, Any]  # parameter name -> type hint
    result: Any  # unary: the return type; stream: the item type; oneway: None
    # Hints of the parameters when every one is plain positional-or-keyword: then a call with
    # exactly that many positional arguments binds without inspect.Signature.bind (hot path),
    # and is checked (caller) or converted (receiver, a Python peer's values) by functions made
    # once per parameter.
    _positional: tuple[Any, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _names: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _checks: tuple[Check | None, ...] = field(default=(), init=False, repr=False, compare=False)
    _converts: tuple[Convert | None, ...] = field(default=(), init=False, repr=False, compare=False)
    # Whether the arguments / the result (each stream item) may hold a ``msgspec.Struct`` that
    # leaves its defaults out: then they are sent ``to_wire(..., with_defaults=True)``.
    args_with_defaults: bool = field(default=False, init=False, repr=False, compare=False)
    result_with_defaults: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "args_with_defaults", any(omits_defaults(h) for h in self.hints.values())
        )
        object.__setattr__(self, "result_with_defaults", omits_defaults(self.result))
        plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = self.signature.parameters.values()
        if all(p.kind in plain for p in params):
            hints = tuple(self.hints.get(p.name, Any) for p in params)
            object.__setattr__(self, "_positional", hints)
            object.__setattr__(self, "_names", tuple(p.name for p in params))
            object.__setattr__(self, "_checks", tuple(python_check(h) for h in hints))
            object.__setattr__(self, "_converts", tuple(wire_convert(h) for h in hints))

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
        bound = _bind(self.signature, args, kwargs)
        return list(bound.args), dict(bound.kwargs)

    def check_arguments(self, args: list[Any], kwargs: Mapping[str, Any]) -> None:
        """Check bound arguments against the declared types (caller side, before sending).

        Strict, with no coercion (:func:`garcon_link.rpc.values.check_value`).

        Raises:
            TypeError: with a message naming the offending argument and what it should be.
        """
        fast = self._positional
        if fast is not None and not kwargs and len(args) == len(fast):
            for value, check, name in zip(args, self._checks, self._names, strict=True):
                if check is not None:
                    try:
                        check(value)
                    except TypeError as exc:
                        raise TypeError(f"argument {name!r}: {exc}") from None
            return
        if not self.hints or all(h is Any for h in self.hints.values()):
            return  # a manifest's method, or an untyped one: the receiver validates
        bound = _bind(self.signature, args, kwargs)
        for name, value in bound.arguments.items():
            hint = self.hints.get(name, Any)
            if hint is Any:
                continue
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                for v in value:
                    _check_argument(name, v, hint)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                for v in value.values():
                    _check_argument(name, v, hint)
            else:
                _check_argument(name, value, hint)

    def convert_arguments(
        self, args: list[Any], kwargs: Mapping[str, Any], *, mode: ValueMode = "wire"
    ) -> tuple[list[Any], dict[str, Any]]:
        """Validate and convert received arguments (receiving side).

        Args:
            args: positional arguments as decoded.
            kwargs: keyword arguments as decoded.
            mode: ``"wire"`` (a Python peer) or ``"json"`` (a JSON client: bytes may be base64
                text; :mod:`garcon_link.rpc.values`).

        Raises:
            ValueError: with a message naming the offending argument.
        """
        fast = self._positional
        if fast is not None and not kwargs and len(args) == len(fast):
            names = self._names
            if mode == "wire":
                return [
                    value if convert is None else _converted(name, value, convert)
                    for value, convert, name in zip(args, self._converts, names, strict=True)
                ], {}
            return [
                _convert_argument(name, value, hint, mode)
                for value, hint, name in zip(args, fast, names, strict=True)
            ], {}
        try:
            bound = _bind(self.signature, args, kwargs)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        for name, value in bound.arguments.items():
            hint = self.hints.get(name, Any)
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                bound.arguments[name] = tuple(_convert_argument(name, v, hint, mode) for v in value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                bound.arguments[name] = {
                    k: _convert_argument(name, v, hint, mode) for k, v in value.items()
                }
            else:
                bound.arguments[name] = _convert_argument(name, value, hint, mode)
        return list(bound.args), dict(bound.kwargs)


def _bind(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> inspect.BoundArguments:
    """``signature.bind``, except that an unexpected keyword is named as such.

    ``bind`` reports a missing argument first, so ``add(a=1, c=2)`` would read "missing a
    required argument: 'b'" although the mistake is ``c``.

    Raises:
        TypeError: the arguments do not fit; the message names what is wrong.
    """
    params = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unexpected = [
            name
            for name in kwargs
            if name not in params or params[name].kind is inspect.Parameter.POSITIONAL_ONLY
        ]
        if unexpected:
            accepted = [
                p.name
                for p in params.values()
                if p.kind
                in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            ]
            named = ", ".join(peer_text(name) for name in unexpected[:3])  # the peer's names
            more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
            raise TypeError(
                f"got an unexpected keyword argument {named}{more} "
                f"(accepted: {', '.join(accepted) or 'none'})"
            )
    return signature.bind(*args, **kwargs)


def _check_argument(name: str, value: Any, hint: Any) -> None:
    """:func:`~garcon_link.rpc.values.check_value` for one argument; failures name it."""
    try:
        check_value(value, hint)
    except TypeError as exc:
        raise TypeError(f"argument {name!r}: {exc}") from None


def _converted(name: str, value: Any, convert: Convert) -> Any:
    """``convert(value)`` for one received argument; failures name it (``ValueError``)."""
    try:
        return convert(value)
    except msgspec.ValidationError as exc:
        raise ValueError(f"argument {name!r}: {exc}") from None
    except TypeError as exc:
        raise ValueError(f"argument {name!r}: cannot convert: {exc}") from None


def _convert_argument(name: str, value: Any, hint: Any, mode: ValueMode = "wire") -> Any:
    """:func:`from_wire` for one received argument; failures name it (``ValueError``)."""
    try:
        return from_wire(value, hint, mode=mode)
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
    # The manifest, built at the first manifest() (a facade asks for it each time it is made).
    _manifest: dict[str, dict[str, Any]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def manifest(self) -> dict[str, dict[str, Any]]:
        """``{method: {"kind", "signature"[, "uses"][, "records"]}}``: the record types the
        methods reach listed once, in ``"records"`` of the first method (by name) that uses
        one, and each method's ``"uses"`` referring to them (:func:`record_table`). The
        mapping and each entry are fresh copies a caller may change; ``"records"`` and
        ``"uses"`` are shared: read them."""
        built = self._manifest
        if built is None:
            built = {}
            names = sorted(self.methods)
            table, uses = record_table(
                [(self.methods[n].hints.values(), self.methods[n].result) for n in names]
            )
            for name, used in zip(names, uses, strict=True):
                m = self.methods[name]
                entry: dict[str, Any] = {"kind": m.kind.value, "signature": str(m.signature)}
                if used:
                    entry["uses"] = used
                built[name] = entry
            if table:  # on the first method that uses one
                holder = next(n for n, used in zip(names, uses, strict=True) if used)
                built[holder]["records"] = table
            object.__setattr__(self, "_manifest", built)  # frozen: set once, like a cache
        return {name: dict(entry) for name, entry in built.items()}


_spec_cache: dict[type, ServiceSpec] = {}


def service_spec(interface: type) -> ServiceSpec:
    """Derive (and cache) the :class:`ServiceSpec` of ``interface``.

    Raises:
        TypeError: ``interface`` is not a class, or its hints cannot be resolved.
        ConfigError: a public method is a plain ``def`` (or an unannotated async generator);
            the message lists each one and how to fix it.
    """
    cached = _spec_cache.get(interface)
    if cached is not None:
        return cached
    spec_, problems = derive_spec(interface)
    if problems:
        raise ConfigError(
            f"interface {interface.__qualname__} cannot be served as written:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    _spec_cache[interface] = spec_
    return spec_


def derive_spec(interface: type, *, sync: bool = False) -> tuple[ServiceSpec, list[str]]:
    """The spec of ``interface`` and the problems of the methods it had to leave out.

    ``sync``: derive a sync client's view (:func:`~garcon_link.rpc.views.sync_service_spec`)."""
    if not isinstance(interface, type):
        raise TypeError(f"an interface must be a class, got {interface!r}")
    methods: dict[str, MethodSpec] = {}
    problems: list[str] = []
    for name in dir(interface):
        if name.startswith("_"):
            continue
        func = inspect.getattr_static(interface, name, None)
        if isinstance(func, staticmethod | classmethod) or not inspect.isfunction(func):
            continue
        spec = _method_spec(interface, name, func, sync=sync)
        if isinstance(spec, MethodSpec):
            methods[name] = spec
        else:
            problems.append(spec)
    return ServiceSpec(interface=interface, methods=methods), problems


def _method_spec(
    interface: type, name: str, func: Callable[..., Any], *, sync: bool = False
) -> MethodSpec | str:
    """The spec of one public method, or why it cannot be exposed (with the fix).

    ``sync``: as a sync client sees it (plain ``def``; streams return ``Iterator[T]``)."""
    try:
        hints = typing.get_type_hints(func)
        # With ``Annotated`` kept: the receiver enforces ``msgspec.Meta`` constraints of the
        # parameters (the worker) and of the result or stream items (the caller). The signature
        # (so the manifest and the contract hash) keeps bare types.
        constrained = typing.get_type_hints(func, include_extras=True)
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
    # The declared return type stays in the signature: it is part of the manifest, so changing
    # ``-> int`` to ``-> str`` changes the contract hash.
    returns = hints.pop("return", Any)
    signature = signature.replace(
        parameters=params,
        return_annotation=(
            inspect.Signature.empty
            if "return" not in func.__annotations__
            else None
            if returns is type(None)  # "-> None", as written, not "-> NoneType"
            else returns
        ),
    )
    param_hints = {p.name: constrained.get(p.name, Any) for p in params}
    checked = constrained.get("return", Any)
    where = f"{interface.__qualname__}.{name}"
    if sync:
        return _sync_method_spec(where, func, signature, param_hints, returns, checked)
    if getattr(func, _ONEWAY_ATTR, False):
        return MethodSpec(name, MethodKind.ONEWAY, signature, param_hints, None)
    origin = typing.get_origin(returns)
    if origin in _STREAM_ORIGINS or returns in _STREAM_ORIGINS:
        return _stream_spec(name, signature, param_hints, returns, checked)
    if inspect.iscoroutinefunction(func):
        return MethodSpec(name, MethodKind.UNARY, signature, param_hints, checked)
    if inspect.isasyncgenfunction(func):
        return (
            f"{where} is an async generator but is not annotated as a stream: "
            f"annotate it `-> AsyncIterator[T]` (T: the item type)"
        )
    return (
        f"{where} is a plain `def`, which cannot be called remotely: make it "
        f"`{_def_text('async def', name, signature)}` (wrap blocking work in "
        f"`await anyio.to_thread.run_sync(...)`), or rename it `_{name}` if it is not meant to "
        "be called remotely"
    )


def _sync_method_spec(
    where: str,
    func: Callable[..., Any],
    signature: inspect.Signature,
    param_hints: dict[str, Any],
    returns: Any,
    checked: Any,
) -> MethodSpec | str:
    name = func.__name__
    origin = typing.get_origin(returns)
    if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        return (
            f"{where} is `async def`; a sync client's interface declares `def {name}(...)` "
            "(use garcon_link.connect for the async interface)"
        )
    if getattr(func, _ONEWAY_ATTR, False):
        return MethodSpec(name, MethodKind.ONEWAY, signature, param_hints, None)
    if origin in _STREAM_ORIGINS or returns in _STREAM_ORIGINS:
        return f"{where} returns an async iterator; a sync client's stream returns `Iterator[T]`"
    if origin in _SYNC_STREAM_ORIGINS or returns in _SYNC_STREAM_ORIGINS:
        return _stream_spec(name, signature, param_hints, returns, checked)
    return MethodSpec(name, MethodKind.UNARY, signature, param_hints, checked)


def _stream_spec(
    name: str,
    signature: inspect.Signature,
    param_hints: dict[str, Any],
    returns: Any,
    checked: Any,
) -> MethodSpec:
    """A stream of the item type ``returns`` declares, its return spelled ``AsyncIterator[T]``
    (``checked``: the same with its ``Annotated`` constraints, which the items are held to).

    One spelling for every stream (typing or collections.abc, ``AsyncGenerator[T, None]`` or
    ``AsyncIterable[T]``, and a sync client's ``Iterator[T]``): the wire behaviour is the same,
    so the contract must be too."""
    item_args = typing.get_args(returns)
    item = item_args[0] if item_args else Any
    stream_of: Any = collections.abc.AsyncIterator
    signature = signature.replace(return_annotation=stream_of[item])
    checked_args = typing.get_args(_bare(checked))
    checked_item = checked_args[0] if checked_args else item
    return MethodSpec(name, MethodKind.STREAM, signature, param_hints, checked_item)


def registration_problems(target: object, spec: ServiceSpec) -> list[str]:
    """What keeps ``target`` from being served under ``spec`` (empty: nothing).

    Checks, per method of the interface: the implementation exists and is callable; it is an
    ``async def`` for a unary call, an async generator function for a stream (an ``async def``
    or plain ``def`` for a one-way method); it accepts the interface's parameters; where both
    sides annotate a parameter or a unary result with a plain class, the two do not contradict
    each other (``str`` where the interface sends ``int``); and each parameter and result hint is
    one msgspec can convert and encode. Every line names the
    method and says how to fix it.
    """
    if isinstance(target, type):
        # Its methods would be unbound functions: every call would miss ``self``.
        return [
            f"the target is the class {target.__qualname__} itself; serve an instance: "
            f"{target.__qualname__}()"
        ]
    problems: list[str] = []
    owner = type(target).__qualname__
    for name, method in sorted(spec.methods.items()):
        keyword = "def" if method.kind is MethodKind.STREAM else "async def"
        wanted = _def_text(keyword, name, method.signature)
        impl = getattr(target, name, None)
        if impl is None or not callable(impl):
            problems.append(f"{name}: {owner} has no method {name!r}; add `{wanted}`")
        else:
            problems.extend(_implementation_problems(owner, method, impl, wanted))
        for param, hint in method.hints.items():
            why = unsupported_hint(hint)
            if why:
                problems.append(f"{name}: parameter {param!r} has an unsupported type: {why}")
        why = unsupported_hint(method.result) if method.kind is not MethodKind.ONEWAY else None
        if why:
            what = "stream item" if method.kind is MethodKind.STREAM else "return"
            problems.append(f"{name}: the {what} type is unsupported: {why}")
    return problems


def _def_text(keyword: str, name: str, signature: inspect.Signature) -> str:
    """``async def add(self, a: int) -> int``: a method header with ``self`` put back."""
    text = str(signature)
    return f"{keyword} {name}(self{', ' if not text.startswith('()') else ''}{text[1:]}"


def _implementation_problems(
    owner: str, method: MethodSpec, impl: Callable[..., Any], wanted: str
) -> list[str]:
    name = method.name
    func = inspect.unwrap(getattr(impl, "__func__", impl))
    if method.kind is MethodKind.STREAM:
        if not inspect.isasyncgenfunction(func):
            return [
                f"{name}: the interface declares a stream, but {owner}.{name} is not an async "
                f"generator function; write it as `async def {name}(...)` that `yield`s each item"
            ]
    elif method.kind is MethodKind.UNARY:
        if inspect.isasyncgenfunction(func):
            return [
                f"{name}: {owner}.{name} is an async generator, but the interface declares a "
                f"unary call; declare a stream in the interface (`-> AsyncIterator[T]`) or "
                f"return one value from `{wanted}`"
            ]
        if not inspect.iscoroutinefunction(func):
            return [
                f"{name}: {owner}.{name} is a plain `def`, but the interface declares "
                f"`{wanted}`; make it `async def` (wrap blocking work in "
                "`await anyio.to_thread.run_sync(...)`)"
            ]
    try:
        actual = inspect.signature(impl)
    except (TypeError, ValueError):  # a builtin without a signature: accept it
        return []
    # The receiving side binds arguments to the *interface's* signature and passes every
    # positional-or-keyword one by position, keyword-only ones by name: so the implementation
    # must accept that with every parameter given, and with only the required ones.
    positional, keywords, required_pos, required_kw = 0, [], 0, []
    for p in method.signature.parameters.values():
        required = p.default is inspect.Parameter.empty
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            positional += 1
            required_pos += required
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            keywords.append(p.name)
            if required:
                required_kw.append(p.name)
    for count, names in ((positional, keywords), (required_pos, required_kw)):
        try:
            actual.bind(*range(count), **dict.fromkeys(names))
        except TypeError as exc:
            return [
                f"{name}: {owner}.{name}{actual} does not accept the interface's arguments "
                f"({exc}); match the interface: `{wanted}`"
            ]
    return _hint_conflicts(owner, method, func, actual, wanted)


# PEP 484's numeric tower: where a float is accepted, an int is too (and both where a complex is).
_ACCEPTS = {float: (int,), complex: (int, float)}


def _plain(hint: object) -> typing.TypeGuard[type]:
    """A plain class (``typing.Any`` is a class too since Python 3.11: not one)."""
    return isinstance(hint, type) and hint is not Any


def _bare(hint: Any) -> Any:
    """``hint`` without an outer ``Annotated[...]`` (its constraints)."""
    return typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint


def _accepts(wider: type, narrower: type) -> bool:
    try:
        return issubclass(narrower, wider) or narrower in _ACCEPTS.get(wider, ())
    except TypeError:  # a Protocol that is not runtime-checkable, ...: cannot tell, accept
        return True


def _hint_conflicts(
    owner: str,
    method: MethodSpec,
    func: Callable[..., Any],
    actual: inspect.Signature,
    wanted: str,
) -> list[str]:
    """Parameter and return hints of the implementation that contradict the interface's.

    Only plain classes on both sides are compared (``int`` against ``str``); generics, unions and
    ``Any`` are left to a type checker (``gl.Service[Interface](impl, Interface)``). A parameter
    must accept what the interface sends (the interface's class, or a subclass of it, is an
    instance of the implementation's); a unary result must be what the interface promises.
    Arguments arrive as the receiving side binds them (positional ones by position), so a
    parameter is compared with the implementation's parameter that receives it.
    """
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable annotations: nothing to compare
        return []
    positional_kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    receivers = iter([p.name for p in actual.parameters.values() if p.kind in positional_kinds])
    problems: list[str] = []
    for p in method.signature.parameters.values():
        if p.kind in positional_kinds:
            receiver = next(receivers, None)
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            receiver = p.name
        else:
            continue
        declared = _bare(method.hints.get(p.name))
        got = hints.get(receiver) if receiver is not None else None
        if _plain(declared) and _plain(got) and not _accepts(got, declared):
            problems.append(
                f"{method.name}: parameter {receiver!r} of {owner}.{method.name} is "
                f"{got.__qualname__}, but the interface sends {declared.__qualname__}; "
                f"match the interface: `{wanted}`"
            )
    got = hints.get("return")
    declared = _bare(method.result)
    if (
        method.kind is MethodKind.UNARY
        and _plain(declared)
        and _plain(got)
        and not _accepts(declared, got)
    ):
        problems.append(
            f"{method.name}: {owner}.{method.name} returns {got.__qualname__}, but the "
            f"interface promises {declared.__qualname__}; match the interface: `{wanted}`"
        )
    return problems


def unsupported_hint(hint: Any) -> str | None:
    """Why msgspec cannot convert to and encode values of ``hint`` (``None``: it can)."""
    if hint is Any or hint is inspect.Parameter.empty or hint is None:
        return None
    try:
        info = msgspec.inspect.type_info(hint)
    except TypeError as exc:
        return f"{_hint_text(hint)}: {exc}"
    for node in _type_nodes(info):
        if isinstance(node, msgspec.inspect.CustomType):
            inner = node.cls.__qualname__
            where = "" if node is info else f" (it contains {inner})"
            return (
                f"{_hint_text(hint)}{where} is not a type msgspec can convert and encode; "
                "use a plain type (str, int, bytes, list, dict, a dataclass, an enum, ...)"
                + (" -- e.g. str for a path" if _is_path(node.cls) else "")
            )
    return None


def _type_nodes(info: Any) -> Iterator[Any]:
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
      ``forbid_unknown_fields`` ignores one: :func:`from_wire` refuses the rest);
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
    for node in _type_nodes(info):
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
        for node in _type_nodes(info)
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
