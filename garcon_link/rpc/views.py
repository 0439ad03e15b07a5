"""Views of an interface: a sync client's spec of it, and a spec printed back as source.

A *sync client's* view of an interface is the one place plain ``def`` is right: the blocking
client (:mod:`garcon_link.api.sync`) is typed by a Protocol of ``def`` methods, streams returning
``Iterator[T]``; :func:`sync_service_spec` derives its spec
(:func:`~garcon_link.rpc.interface.derive_spec` with ``sync=True``), whose manifest is the async
interface's (so it is compared with the worker's). Serving is unchanged:
:func:`~garcon_link.rpc.interface.service_spec` refuses such an interface.

:func:`view_source` prints a spec as the source of a module that declares it as a ``Protocol``
(the async interface, or its sync view), with the imports its hints need: ``garcon-link stub``
prints it, and a sync client given an async interface is shown the sync view to write. It is
printed from the spec, so the view's manifest is the spec's.
"""

from __future__ import annotations

import ast
import collections.abc
import enum
import inspect
import re
import reprlib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .interface import MethodKind, MethodSpec, ServiceSpec, _def_text, derive_spec

__all__ = ["sync_service_spec", "sync_view_source", "view_source"]


_sync_spec_cache: dict[type, ServiceSpec] = {}


def sync_service_spec(interface: type) -> ServiceSpec:
    """Derive (and cache) the spec of a *sync view* of an interface, for a sync client.

    The sync client (:mod:`garcon_link.api.sync`) is typed by a Protocol of plain ``def`` methods:
    ``def add(self, a: int) -> int`` is a unary call, ``def count(self, n: int) ->
    Iterator[int]`` (or ``Iterable``/``Generator``) a stream of ``int``, a
    :func:`~garcon_link.rpc.interface.oneway` ``def`` a notification. Its manifest is the one the
    async interface has (a stream's return reads ``AsyncIterator[T]`` in both), so it can be
    compared with a worker's. Used only to call, never to serve:
    :func:`~garcon_link.rpc.interface.service_spec` still refuses plain ``def`` methods.

    Raises:
        TypeError: ``interface`` is not a class, or its hints cannot be resolved.
        ConfigError: a public method is ``async def`` (or annotated as an async stream); when
            every method is, the message shows the sync view to write instead.
    """
    cached = _sync_spec_cache.get(interface)
    if cached is not None:
        return cached
    spec_, problems = derive_spec(interface, sync=True)
    if problems:
        name = interface.__qualname__
        async_spec, async_problems = derive_spec(interface)
        if not spec_.methods and not async_problems:
            try:
                view = sync_view_source(async_spec)
            except ConfigError as exc:  # a default that cannot be written as source
                view = f"(it cannot be printed here: {exc})"
            raise ConfigError(
                f"{name} is an async interface (its methods are `async def`): a sync client "
                "takes a sync view of it, with the same contract (checked against the worker's "
                "manifest):\n\n" + view
            )
        raise ConfigError(
            f"interface {name} cannot be used by a sync client:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    _sync_spec_cache[interface] = spec_
    return spec_


def sync_view_source(spec: ServiceSpec) -> str:
    """The source of a sync Protocol with the contract of ``spec`` (an async interface's), with
    the imports it needs: pasted into a file as is, it imports, type-checks, and a sync client
    accepts it (its manifest is ``spec``'s). See :func:`view_source`."""
    return view_source(spec, sync=True)


def view_source(spec: ServiceSpec, *, sync: bool) -> str:
    """The source of a module that declares ``spec``'s interface as a ``Protocol``.

    ``sync``: its sync view, ``class <Name>Sync(Protocol)`` with ``def`` methods and streams
    returning ``Iterator[T]``, for :func:`garcon_link.connect_sync`; else the async interface,
    ``async def`` methods and streams returning ``AsyncIterator[T]``. Either way the class has
    ``spec``'s manifest (so its contract), and the module starts with the imports its hints
    need: names from ``typing`` and ``collections.abc`` are imported bare, ``ResourceRef`` and
    :func:`~garcon_link.rpc.interface.oneway` come from ``garcon_link as gl``, any other type is
    written ``module.Name`` under ``import module`` (bare when it is defined in ``__main__``,
    where the view is pasted).

    Raises:
        ConfigError: a parameter's default cannot be written as source that recreates it (a
            value that is not a literal or an enum member); the message names it.
    """
    interface = spec.interface
    imports = _ViewImports()
    imports.typing.add("Protocol")
    lines = []
    for method in sorted(spec.methods.values(), key=lambda m: m.name):
        returns = method.signature.return_annotation
        if method.kind is MethodKind.STREAM:
            stream: Any = collections.abc.Iterator if sync else collections.abc.AsyncIterator
            items = typing.get_args(returns)  # the bare item type (the signature's)
            returns = stream[items[0] if items else Any]
        signature = _source_signature(interface, method, returns, imports)
        if method.kind is MethodKind.ONEWAY:
            imports.gl = True
            lines.append("    @gl.oneway")
        asynchronous = not sync and method.kind is not MethodKind.STREAM
        keyword = "async def" if asynchronous else "def"
        lines.append(f"    {_def_text(keyword, method.name, signature)}: ...")
    name = f"{interface.__name__}Sync" if sync else interface.__name__
    what = "The sync view" if sync else "The interface"
    doc = f'    """{what} of {interface.__module__}.{interface.__qualname__} (same contract)."""'
    body = [f"class {name}(Protocol):", doc, *([""] if lines else []), *lines]
    return "\n".join([*imports.lines(), "", "", *body]) + "\n"


@dataclass(frozen=True, slots=True)
class _SourceText:
    """Text that ``inspect.Signature`` prints as is (an annotation's or a default's source)."""

    text: str

    def __repr__(self) -> str:
        return self.text


@dataclass(slots=True)
class _ViewImports:
    """The imports a view's annotations and defaults need, gathered while writing them."""

    typing: set[str] = field(default_factory=set)
    abc: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)
    gl: bool = False

    def annotation(self, hint: Any) -> str:
        """The source of ``hint``, noting what it needs imported."""
        self._note_modules(hint)
        if hint is None or hint is type(None):
            text = "None"
        elif _is_class(hint):
            module = hint.__module__
            text = hint.__qualname__ if module == "builtins" else f"{module}.{hint.__qualname__}"
        else:
            text = repr(hint)  # a generic alias, a union, a typing form: names qualified
        text = _TYPING_NAME.sub(lambda m: self._bare(self.typing, m), text)
        text = _ABC_NAME.sub(lambda m: self._bare(self.abc, m), text)
        if _GL_NAME.search(text):
            self.gl = True
            text = _GL_NAME.sub("gl.", text)
        return _MAIN_NAME.sub("", text)

    def default(self, where: str, value: Any) -> str:
        """The source of a parameter's default (a literal or an enum member).

        Raises:
            ConfigError: it is neither; ``where`` names the parameter.
        """
        if isinstance(value, enum.Enum):
            self._note_modules(type(value))
            return f"{self.annotation(type(value))}.{value.name}"
        text = repr(value)
        try:
            again = ast.literal_eval(text)
            same = type(again) is type(value) and again == value and repr(again) == text
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            same = False
        if not same:
            raise ConfigError(
                f"{where}: its default {reprlib.repr(value)} cannot be written as source (only a "
                "literal or an enum member can); write this method of the view by hand"
            )
        return text

    def lines(self) -> list[str]:
        stdlib = sorted(m for m in self.modules if m.partition(".")[0] in _STDLIB)
        others = sorted(m for m in self.modules if m.partition(".")[0] not in _STDLIB)
        first = [f"import {m}" for m in stdlib]
        if self.abc:
            first.append(f"from collections.abc import {', '.join(sorted(self.abc))}")
        first.append(f"from typing import {', '.join(sorted(self.typing))}")
        second = sorted(
            [("garcon_link", "import garcon_link as gl")] * self.gl
            + [(m, f"import {m}") for m in others]
        )
        return first + (["", *(line for _, line in second)] if second else [])

    @staticmethod
    def _bare(names: set[str], match: re.Match[str]) -> str:
        names.add(match.group(1))
        return match.group(1)

    def _note_modules(self, hint: Any) -> None:
        stack, seen = [hint], 0
        while stack and seen < 10_000:  # a hint is finite; the count only bounds a cycle
            node = stack.pop()
            seen += 1
            stack.extend(typing.get_args(node))
            origin = typing.get_origin(node)
            if origin is not None:
                if origin is not types.UnionType:  # ``X | Y`` is written without an import
                    stack.append(origin)
            elif _is_class(node) and node.__module__ not in _IMPLICIT_MODULES:
                self.modules.add(node.__module__)


def _is_class(hint: Any) -> typing.TypeGuard[type]:
    """A plain class, not a parametrised generic (``list[int]`` is not one)."""
    return isinstance(hint, type) and typing.get_origin(hint) is None


_TYPING_NAME = re.compile(r"\btyping\.([A-Za-z_][A-Za-z0-9_]*)")


_ABC_NAME = re.compile(r"\bcollections\.abc\.([A-Za-z_][A-Za-z0-9_]*)")


_GL_NAME = re.compile(r"\bgarcon_link\.rpc\.resources\.")


_MAIN_NAME = re.compile(r"\b__main__\.")


# Modules whose names a view writes bare (from-imported, or builtins) or not at all.
_IMPLICIT_MODULES = frozenset(
    {"builtins", "typing", "collections.abc", "__main__", "garcon_link.rpc.resources"}
)


_STDLIB = frozenset(sys.stdlib_module_names)


def _source_signature(
    interface: type, method: MethodSpec, returns: Any, imports: _ViewImports
) -> inspect.Signature:
    """``method``'s signature, returning ``returns``, with annotations and defaults as source."""
    params = []
    for p in method.signature.parameters.values():
        if p.annotation is not inspect.Parameter.empty:
            p = p.replace(annotation=_SourceText(imports.annotation(p.annotation)))
        if p.default is not inspect.Parameter.empty:
            where = f"{interface.__qualname__}.{method.name}, parameter {p.name!r}"
            p = p.replace(default=_SourceText(imports.default(where, p.default)))
        params.append(p)
    if returns is not inspect.Signature.empty and returns is not None:
        returns = _SourceText(imports.annotation(returns))
    return method.signature.replace(parameters=params, return_annotation=returns)
