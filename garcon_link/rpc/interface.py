"""Service interfaces: what is callable, how values are converted, and the contract manifest.

A method's spec and its signature text (the contract) are derived here, from one reading of the
interface's hints. What is built from them reads the spec or its manifest, never the hints again:
a sync client's spec and the source printed from a spec (the sync view, the stub) are
:mod:`.views`'s; the manifest's hash, the changes between two, a spec rebuilt from a worker's
are :mod:`.manifest`'s. The value checks live in :mod:`.values`, the comparison of contracts in
:mod:`.contract`; the record types' listings in :mod:`.layouts`, the conversion of values sent
in :mod:`.towire`, what msgspec makes of a hint in :mod:`.hints`. This module re-exports their
public names.

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
  the fields of the record types the method reaches,
  :func:`~garcon_link.rpc.layouts.struct_layouts`, listed once per service,
  :func:`~garcon_link.rpc.layouts.record_table`) and its
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

Encoding is :func:`~garcon_link.rpc.towire.to_wire`: msgspec ``to_builtins`` (bytes stay
bytes; datetimes become RFC 3339 text, enums their values, dataclasses maps) -- then CBOR.
Every field is sent, a default too: a ``msgspec.Struct`` declared ``omit_defaults=True`` is
written out in full wherever a method's declared types can hold one
(:func:`~garcon_link.rpc.towire.omits_defaults`), since a peer of another version may declare
another default (the contract compares fields, :func:`~garcon_link.rpc.layouts.struct_layouts`,
but not their default values). Decoding is :func:`from_wire` (:mod:`garcon_link.rpc.values`).
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

from ..errors import ConfigError
from ..logs import peer_text
from .hints import unsupported_hint
from .layouts import (
    MAX_RECORD_TABLE,
    MAX_STRUCT_FIELDS,
    MAX_STRUCT_TEXT,
    UNSET_FIELD,
    record_table,
    struct_layouts,
)
from .towire import omits_defaults, to_wire
from .values import (
    Check,
    Convert,
    ValueMode,
    check_value,
    from_wire,
    python_check,
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
        one, and each method's ``"uses"`` referring to them
        (:func:`~garcon_link.rpc.layouts.record_table`). The
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
