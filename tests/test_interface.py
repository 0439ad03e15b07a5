"""Tests of garcon_link.rpc.interface, .manifest and .views: what is exposed, values, the contract.

No sockets here: interfaces are derived, arguments bound and converted, values round-tripped
through ``to_wire`` + CBOR + ``from_wire`` exactly as the RPC layer does.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import datetime
import enum
import importlib
import inspect
import pathlib
import sys
import typing
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any, Literal, Optional, Protocol

import cbor2
import msgspec
import pytest

import garcon_link as gl
from garcon_link.rpc.interface import (
    MethodKind,
    from_wire,
    omits_defaults,
    registration_problems,
    service_spec,
    to_wire,
    unsupported_hint,
)
from garcon_link.rpc.manifest import (
    MAX_SIGNATURE_CHARS,
    contract_hash,
    manifest_changes,
    manifest_result_hint,
)
from garcon_link.rpc.views import sync_service_spec, view_source


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Inner:
    name: str
    tags: list[str]


@dataclasses.dataclass
class Outer:
    inner: Inner
    color: Color
    when: datetime.datetime
    blob: bytes
    maybe: int | None = None


class Api(Protocol):
    async def unary(self, a: int, b: str = "x") -> list[int]: ...
    def stream(self, n: int) -> AsyncIterator[Inner]: ...
    def gen(self) -> AsyncGenerator[int, None]: ...
    def iterable(self) -> AsyncIterable[str]: ...
    @gl.oneway
    async def notify(self, text: str) -> None: ...
    def _sync_helper(self) -> int: ...
    async def _private(self) -> int: ...
    async def __dunder__(self) -> int: ...
    async def untyped(self, value, *rest, **extra): ...  # type: ignore[no-untyped-def]
    @staticmethod
    async def static() -> int: ...
    @classmethod
    async def klass(cls) -> int: ...

    attribute: int


class NotRuntime(Protocol):
    def go(self) -> None: ...


class Odd(Protocol):
    async def f(self, x: NotRuntime) -> None: ...


def roundtrip(value: Any, hint: Any) -> Any:
    """What the peer's handler receives: encode, CBOR, decode, convert."""
    return from_wire(cbor2.loads(cbor2.dumps(to_wire(value))), hint)


# ---------------------------------------------------------------------------------- specs


def test_method_kinds() -> None:
    spec = service_spec(Api)
    kinds = {name: m.kind for name, m in spec.methods.items()}
    assert kinds == {
        "unary": MethodKind.UNARY,
        "stream": MethodKind.STREAM,
        "gen": MethodKind.STREAM,
        "iterable": MethodKind.STREAM,
        "notify": MethodKind.ONEWAY,
        "untyped": MethodKind.UNARY,
    }
    assert spec.methods["stream"].result is Inner
    assert spec.methods["gen"].result is int
    assert spec.methods["unary"].result == list[int]
    assert spec.methods["notify"].result is None


def test_private_sync_static_and_attributes_are_never_exposed() -> None:
    methods = service_spec(Api).methods
    for name in ("_private", "__dunder__", "_sync_helper", "static", "klass", "attribute"):
        assert name not in methods


def test_signature_drops_self_and_keeps_defaults() -> None:
    unary = service_spec(Api).methods["unary"]
    assert list(unary.signature.parameters) == ["a", "b"]
    assert unary.signature.parameters["b"].default == "x"
    assert unary.hints == {"a": int, "b": str}
    assert "self" not in str(unary.signature)


def test_spec_is_cached() -> None:
    assert service_spec(Api) is service_spec(Api)


def test_plain_class_spec() -> None:
    class Impl:
        async def add(self, a: int, b: int) -> int:
            return a + b

        def _helper(self) -> None:
            pass

    assert set(service_spec(Impl).methods) == {"add"}


def test_a_plain_def_is_refused_with_the_fix() -> None:
    # Before: a public plain ``def`` silently vanished from the interface (its calls got
    # OPERATION_UNSUPPORTED, and a Protocol facade had no such attribute).
    class Sync(Protocol):
        async def fine(self) -> int: ...
        def blocking(self, n: int) -> int: ...
        async def gen(self):  # type: ignore[no-untyped-def]
            yield 1

    with pytest.raises(gl.ConfigError) as info:
        service_spec(Sync)
    text = str(info.value)
    assert "Sync.blocking is a plain `def`" in text
    assert "`async def blocking(self, n: int) -> int`" in text
    assert "anyio.to_thread.run_sync" in text
    assert "rename it `_blocking`" in text
    assert "Sync.gen is an async generator but is not annotated as a stream" in text
    assert "fine" not in text


def test_a_oneway_plain_def_is_still_served() -> None:
    class Notes(Protocol):
        @gl.oneway
        def note(self, text: str) -> None: ...

    assert service_spec(Notes).methods["note"].kind is MethodKind.ONEWAY


def test_not_a_class() -> None:
    with pytest.raises(TypeError, match="must be a class"):
        service_spec(42)  # type: ignore[arg-type]


def test_unresolvable_hints() -> None:
    class Broken:
        async def f(self, x: NoSuchType) -> int: ...  # type: ignore[name-defined, empty-body]  # noqa: F821

    with pytest.raises(TypeError, match=r"Broken\.f"):
        service_spec(Broken)


def test_manifest_and_contract_hash() -> None:
    manifest = {"api": service_spec(Api).manifest()}
    assert manifest["api"]["unary"] == {
        "kind": "unary",
        "signature": "(a: int, b: str = 'x') -> list[int]",
    }
    assert manifest["api"]["stream"]["kind"] == "stream"
    first = contract_hash(manifest)
    assert first == contract_hash(dict(reversed(list(manifest.items()))))
    assert len(first) == 64

    class Api2(Protocol):
        async def unary(self, a: int, b: str = "y") -> list[int]: ...

    class Api3(Protocol):
        async def unary(self, a: int, b: str = "x") -> list[int]: ...
        async def extra(self) -> None: ...

    class Api4(Protocol):  # only a return type differs
        async def unary(self, a: int, b: str = "x") -> list[str]: ...

    for other in (Api2, Api3):
        assert contract_hash({"api": service_spec(other).manifest()}) != first
    base = {"api": service_spec(Api3).manifest()}
    changed = {"api": service_spec(Api4).manifest()}
    assert contract_hash(changed) != contract_hash(base)
    assert manifest_changes(base, changed) == [
        "api.extra: unary () -> None  =>  (absent)",
        "api.unary: unary (a: int, b: str = 'x') -> list[int]  =>  "
        "unary (a: int, b: str = 'x') -> list[str]",
    ]
    assert manifest_changes(base, base) == []
    assert manifest_changes(base, {}) == ["api: service  =>  (absent)"]
    assert contract_hash({"renamed": service_spec(Api).manifest()}) != first


def test_a_changed_manifest_copy_leaves_the_next_one_alone() -> None:
    """manifest() is built once per spec (a facade asks for it each time one is made); what it
    returns is the caller's to change."""
    spec = service_spec(Api)
    first = spec.manifest()
    first["unary"]["signature"] = "(changed)"
    first["added"] = {"kind": "unary", "signature": "()"}
    del first["stream"]
    again = spec.manifest()
    assert again["unary"]["signature"] == "(a: int, b: str = 'x') -> list[int]"
    assert "added" not in again and again["stream"]["kind"] == "stream"
    assert again == spec.manifest() and again is not spec.manifest()


def test_manifest_does_not_depend_on_annotation_spelling() -> None:
    # This module uses ``from __future__ import annotations`` (string annotations); the same
    # interface compiled without it must have the same manifest, or a cosmetic change to the
    # worker's source would be refused as a contract change.
    namespace: dict[str, Any] = {"Protocol": Protocol, "Inner": Inner}
    exec(
        "class Same(Protocol):\n"
        "    async def put(self, inner: Inner, n: int = 1) -> list[int]: ...\n",
        namespace,
    )

    class Same(Protocol):
        async def put(self, inner: Inner, n: int = 1) -> list[int]: ...

    assert service_spec(namespace["Same"]).manifest() == service_spec(Same).manifest()

    class Streams(Protocol):
        def a(self) -> AsyncIterator[int]: ...
        def b(self) -> typing.AsyncIterator[int]: ...
        def c(self) -> AsyncGenerator[int, None]: ...
        def d(self) -> AsyncIterable[int]: ...

    signatures = {m["signature"] for m in service_spec(Streams).manifest().values()}
    assert signatures == {"() -> collections.abc.AsyncIterator[int]"}
    assert "'" not in service_spec(Same).manifest()["put"]["signature"]


# ---------------------------------------------------------------------------------- binding


def test_bind_caller_side() -> None:
    unary = service_spec(Api).methods["unary"]
    assert unary.bind((1,), {}) == ([1, "x"], {}) or unary.bind((1,), {}) == ([1], {})
    assert unary.bind((1,), {"b": "z"}) == ([1, "z"], {})
    with pytest.raises(TypeError):
        unary.bind((), {})
    with pytest.raises(TypeError):
        unary.bind((1, "a", 3), {})
    with pytest.raises(TypeError):
        unary.bind((1,), {"nope": 2})


def test_convert_arguments_validates_and_names_the_field() -> None:
    unary = service_spec(Api).methods["unary"]
    assert unary.convert_arguments([1], {"b": "q"}) == ([1, "q"], {})
    with pytest.raises(ValueError, match="'a'"):
        unary.convert_arguments(["1"], {})
    with pytest.raises(ValueError, match="'b'"):
        unary.convert_arguments([1, 2], {})
    with pytest.raises(ValueError, match="missing"):
        unary.convert_arguments([], {})
    with pytest.raises(ValueError, match="unexpected"):
        unary.convert_arguments([1], {"self": 1})
    with pytest.raises(ValueError):
        unary.convert_arguments([True], {})  # strict: a bool is not an int


class Bounded(Protocol):
    async def take(
        self,
        n: typing.Annotated[int, msgspec.Meta(ge=0)],
        tag: typing.Annotated[str, msgspec.Meta(max_length=3)] = "a",
    ) -> int: ...


def test_meta_constraints_of_parameters_are_enforced_and_name_the_field() -> None:
    take = service_spec(Bounded).methods["take"]
    assert take.convert_arguments([0], {}) == ([0], {})
    assert take.convert_arguments([1, "abc"], {}) == ([1, "abc"], {})
    for args, kwargs in (([-1], {}), ([], {"n": -1})):  # the positional fast path and bind
        with pytest.raises(ValueError, match=r"argument 'n': Expected `int` >= 0"):
            take.convert_arguments(args, kwargs)
    with pytest.raises(ValueError, match=r"argument 'tag': Expected `str` of length <= 3"):
        take.convert_arguments([1, "abcd"], {})
    with pytest.raises(ValueError, match=r"argument 'n'"):
        take.convert_arguments([-1], {}, mode="json")
    # The caller checks types, not constraints: the receiver refuses the value.
    take.check_arguments([-1], {})
    with pytest.raises(TypeError, match="argument 'n'"):
        take.check_arguments(["1"], {})


class BoundedResults(Protocol):
    async def one(self) -> typing.Annotated[int, msgspec.Meta(ge=0)]: ...
    def many(self) -> AsyncIterator[typing.Annotated[str, msgspec.Meta(max_length=2)]]: ...


def test_meta_constraints_of_results_and_stream_items_hold_for_the_caller() -> None:
    methods = service_spec(BoundedResults).methods
    assert from_wire(3, methods["one"].result) == 3
    with pytest.raises(msgspec.ValidationError, match=">= 0"):
        from_wire(-1, methods["one"].result)
    assert from_wire("ab", methods["many"].result) == "ab"
    with pytest.raises(msgspec.ValidationError, match="length <= 2"):
        from_wire("abc", methods["many"].result)

    class Plain(Protocol):
        async def one(self) -> int: ...
        def many(self) -> AsyncIterator[str]: ...

    assert service_spec(BoundedResults).manifest() == service_spec(Plain).manifest()
    for sync in (False, True):
        assert "Annotated" not in view_source(service_spec(BoundedResults), sync=sync)


def test_meta_constraints_leave_the_manifest_and_the_hint_checks_alone() -> None:
    class Plain(Protocol):
        async def take(self, n: int, tag: str = "a") -> int: ...

    assert service_spec(Bounded).manifest() == service_spec(Plain).manifest()

    class WrongTypes:
        async def take(self, n: str, tag: str = "a") -> int:
            return 0

    (problem,) = registration_problems(WrongTypes(), service_spec(Bounded))
    assert "WrongTypes.take is str, but the interface sends int" in problem


def test_an_unexpected_keyword_is_named_not_reported_as_a_missing_one() -> None:
    # Before: add(a=1, c=2) read "missing a required argument: 'b'" on both sides.
    add = service_spec(Calculator).methods["add"]
    expected = r"unexpected keyword argument 'c' \(accepted: a, b\)"
    with pytest.raises(ValueError, match=expected):
        add.convert_arguments([], {"a": 1, "c": 2})
    with pytest.raises(TypeError, match=expected):
        add.bind((), {"a": 1, "c": 2})

    class Flexible(Protocol):
        async def f(self, a: int, /, **extra: int) -> None: ...

    f = service_spec(Flexible).methods["f"]
    assert f.convert_arguments([1], {"c": 2}) == ([1], {"c": 2})
    with pytest.raises(ValueError, match="missing a required argument: 'a'"):
        f.convert_arguments([], {"c": 2})

    class PositionalOnly(Protocol):
        async def g(self, a: int, /) -> None: ...

    with pytest.raises(ValueError, match=r"unexpected keyword argument 'a' \(accepted: none\)"):
        service_spec(PositionalOnly).methods["g"].convert_arguments([], {"a": 1})


def test_convert_nested_field_is_named() -> None:
    class Takes(Protocol):
        async def put(self, outer: Outer) -> None: ...

    put = service_spec(Takes).methods["put"]
    good = to_wire(Outer(Inner("n", ["t"]), Color.RED, datetime.datetime.now(datetime.UTC), b"x"))
    (converted,), _ = put.convert_arguments([good], {})
    assert isinstance(converted, Outer) and isinstance(converted.inner, Inner)
    bad = dict(good, inner={"name": 5, "tags": []})
    with pytest.raises(ValueError, match=r"'outer'.*inner\.name"):
        put.convert_arguments([bad], {})


def test_varargs_are_converted() -> None:
    class Var(Protocol):
        async def f(self, *nums: int, **named: str) -> None: ...

    f = service_spec(Var).methods["f"]
    assert f.convert_arguments([1, 2], {"k": "v"}) == ([1, 2], {"k": "v"})
    with pytest.raises(ValueError, match="'nums'"):
        f.convert_arguments([1, "2"], {})
    with pytest.raises(ValueError, match="'named'"):
        f.convert_arguments([], {"k": 3})


def test_untyped_parameters_pass_through() -> None:
    untyped = service_spec(Api).methods["untyped"]
    assert untyped.convert_arguments([{"any": [1]}, 2, 3], {"k": b"v"}) == (
        [{"any": [1]}, 2, 3],
        {"k": b"v"},
    )


def test_unsupported_hint_is_a_value_error_not_a_crash() -> None:
    # A hint msgspec cannot convert to must fail the call (ValueError), not raise TypeError
    # out of the receiving session's dispatch loop.
    f = service_spec(Odd).methods["f"]
    with pytest.raises(ValueError, match="'x'"):
        f.convert_arguments([1], {})


# ---------------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        (3, int),
        (2.5, float),
        ("text", str),
        (True, bool),
        (None, None),
        (None, Optional[int]),  # noqa: UP045 - the spelling under test
        (7, int | None),
        (b"\x00\xffbytes", bytes),
        ([1, 2, 3], list[int]),
        ({"a": 1, "b": 2}, dict[str, int]),
        ((1, "x", b"y"), tuple[int, str, bytes]),
        ((1, 2, 3), tuple[int, ...]),
        ("b", Literal["a", "b"]),
        (Color.GREEN, Color),
        (Level.HIGH, Level),
        (Inner("n", ["a", "b"]), Inner),
        (
            Outer(
                Inner("deep", []),
                Color.RED,
                datetime.datetime(2024, 2, 29, 23, 59, 58, 123456, tzinfo=datetime.UTC),
                b"blob",
                maybe=None,
            ),
            Outer,
        ),
        ([Inner("a", []), Inner("b", ["c"])], list[Inner]),
        ({"k": [Color.RED]}, dict[str, list[Color]]),
        (datetime.date(2024, 1, 2), datetime.date),
        (
            datetime.datetime(
                2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2))
            ),
            datetime.datetime,
        ),
        (gl.ResourceRef("job", "box", b"\x01" * 16, "j1"), gl.ResourceRef),
    ],
)
def test_round_trip(value: Any, hint: Any) -> None:
    result = roundtrip(value, hint)
    assert result == value
    assert type(result) is type(value)


def test_any_passes_decoded_value_through() -> None:
    assert roundtrip({"x": [1, b"2"]}, Any) == {"x": [1, b"2"]}
    assert roundtrip(5, inspect.Parameter.empty) == 5


@pytest.mark.parametrize(
    ("wire", "hint"),
    [
        ("1", int),
        (1, str),
        (1.5, int),
        (True, int),
        ("c", Literal["a", "b"]),
        ("blue", Color),
        ({"name": "n"}, Inner),
        ([1, 2], tuple[int, int, int]),
        (5, None),
        ("not a date", datetime.datetime),
        ({"kind": "job"}, gl.ResourceRef),
    ],
)
def test_mismatches_raise_validation_error(wire: Any, hint: Any) -> None:
    with pytest.raises(msgspec.ValidationError):
        from_wire(wire, hint)


def test_to_wire_refuses_unsupported_values() -> None:
    with pytest.raises(TypeError):
        to_wire(object())
    with pytest.raises(TypeError):
        to_wire({1, 2, 3j})


def test_to_wire_plain_forms() -> None:
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert to_wire(when) == "2024-01-02T03:04:05Z"
    assert to_wire(Color.RED) == "red"
    assert to_wire(Inner("n", [])) == {"name": "n", "tags": []}
    assert to_wire(b"raw") == b"raw"
    assert to_wire(bytearray(b"raw")) == bytearray(b"raw")


class Sparse(msgspec.Struct, omit_defaults=True, tag=True, rename="camel"):
    the_n: int
    the_tags: list[str] = []
    maybe: int | msgspec.UnsetType = msgspec.UNSET


class Full(msgspec.Struct, tag="Sparse", rename="camel"):
    """What Sparse is without omit_defaults (its tag is Sparse's)."""

    the_n: int
    the_tags: list[str] = []
    maybe: int | msgspec.UnsetType = msgspec.UNSET


class SparseRow(msgspec.Struct, omit_defaults=True, array_like=True):
    a: int
    b: int = 0


@dataclasses.dataclass
class Holder:
    inner: list[Sparse]
    by_key: dict[str, Sparse]
    pair: tuple[Sparse, int]
    row: SparseRow | None = None


def test_with_defaults_writes_every_field_of_a_struct_that_omits_defaults() -> None:
    assert to_wire(Sparse(1)) == {"type": "Sparse", "theN": 1}  # msgspec's own encoding
    assert to_wire(Sparse(1), with_defaults=True) == to_wire(Full(1))
    assert to_wire(Sparse(1, ["t"], 3), with_defaults=True) == to_wire(Full(1, ["t"], 3))
    holder = Holder([Sparse(1)], {"k": Sparse(2)}, (Sparse(3), 4), SparseRow(5))
    assert to_wire(holder, with_defaults=True) == {
        "inner": [to_wire(Full(1))],
        "by_key": {"k": to_wire(Full(2))},
        "pair": [to_wire(Full(3)), 4],
        "row": [5, 0],
    }
    assert to_wire([1, "x", b"y", None], with_defaults=True) == [1, "x", b"y", None]


def test_omits_defaults_follows_the_declared_types() -> None:
    assert omits_defaults(Sparse) and omits_defaults(Holder) and omits_defaults(list[Sparse])
    assert omits_defaults(typing.Optional[dict[str, tuple[Sparse, ...]]])  # noqa: UP045
    assert not omits_defaults(Full) and not omits_defaults(Inner) and not omits_defaults(int)
    assert not omits_defaults(Any)

    class Api(Protocol):
        async def put(self, h: Holder) -> int: ...
        async def get(self, n: int) -> Sparse: ...
        def rows(self) -> AsyncIterator[SparseRow]: ...

    methods = service_spec(Api).methods
    assert methods["put"].args_with_defaults and not methods["put"].result_with_defaults
    assert not methods["get"].args_with_defaults and methods["get"].result_with_defaults
    assert methods["rows"].result_with_defaults


def test_oneway_marks_and_returns_the_function() -> None:
    async def f(self: object) -> None: ...

    assert gl.oneway(f) is f


# ---------------------------------------------------------------------------------- registration


class Calculator(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    async def where(self) -> str: ...


class RightCalculator:
    async def add(self, a: int, b: int) -> int:
        return a + b

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def where(self) -> str:
        return "."

    def helper(self) -> None:  # not in the interface: never exposed, never checked
        pass


class WrongCalculator:
    def add(self, a: int, b: int) -> int:  # sync
        return a + b

    async def count(self, n: int) -> list[int]:  # not a generator
        return list(range(n))

    # where: missing


def test_a_right_implementation_has_no_problems() -> None:
    assert registration_problems(RightCalculator(), service_spec(Calculator)) == []


def test_every_problem_of_a_wrong_implementation_is_listed_with_its_fix() -> None:
    problems = registration_problems(WrongCalculator(), service_spec(Calculator))
    assert len(problems) == 3, problems
    add, count, where = problems
    assert add.startswith("add: WrongCalculator.add is a plain `def`")
    assert "`async def add(self, a: int, b: int) -> int`" in add
    assert "anyio.to_thread.run_sync" in add
    assert count.startswith("count: the interface declares a stream")
    assert "`yield`s each item" in count
    assert where == (
        "where: WrongCalculator has no method 'where'; add `async def where(self) -> str`"
    )


def test_hints_that_contradict_the_interface_are_refused() -> None:
    class WrongTypes:
        async def add(self, x: str, b: int) -> str:  # renamed: compared by position
            return x

        async def count(self, n: int) -> AsyncIterator[int]:
            yield n

        async def where(self) -> bytes:
            return b"."

    add_param, add_result, where = registration_problems(WrongTypes(), service_spec(Calculator))
    assert add_param.startswith("add: parameter 'x' of ")
    assert "WrongTypes.add is str, but the interface sends int" in add_param
    assert "WrongTypes.add returns str, but the interface promises int" in add_result
    assert "`async def add(self, a: int, b: int) -> int`" in add_result
    assert "WrongTypes.where returns bytes, but the interface promises str" in where

    class Compatible:  # wider parameters, narrower results, the numeric tower, Any: accepted
        async def add(self, a: float, b: object) -> bool:
            return True

        async def count(self, n: complex) -> AsyncIterator[int]:
            yield 1

        async def where(self) -> Any:
            return "."

    assert registration_problems(Compatible(), service_spec(Calculator)) == []
    with pytest.raises(gl.ConfigError, match="the interface sends int"):
        gl.Service(WrongTypes(), Calculator)


def test_a_class_instead_of_an_instance() -> None:
    (problem,) = registration_problems(RightCalculator, service_spec(Calculator))
    assert problem == (
        "the target is the class RightCalculator itself; serve an instance: RightCalculator()"
    )


def test_kind_and_parameter_mismatches() -> None:
    class Gen:
        async def add(self, a: int, b: int) -> AsyncIterator[int]:
            yield a + b

        async def count(self) -> AsyncIterator[int]:  # a parameter missing
            yield 1

        async def where(self, **options: Any) -> str:  # **kwargs accepts anything
            return "."

    add, count = registration_problems(Gen(), service_spec(Calculator))
    assert "is an async generator, but the interface declares a unary call" in add
    assert "does not accept the interface's arguments (too many positional" in count
    assert "`def count(self, n: int) -> collections.abc.AsyncIterator[int]`" in count

    class Renamed:  # arguments arrive by position: a renamed parameter still fits
        async def add(self, x: int, y: int) -> int:
            return x + y

        async def count(self, n: int, step: int = 1) -> AsyncIterator[int]:
            yield n

        async def where(self, *args: Any) -> str:
            return "."

    assert registration_problems(Renamed(), service_spec(Calculator)) == []

    class Defaults(Protocol):
        async def f(self, a: int, b: int = 0, *, c: int = 0) -> None: ...

    class NoDefault:
        async def f(self, a: int, b: int, *, c: int = 0) -> None:
            pass

    (problem,) = registration_problems(NoDefault(), service_spec(Defaults))
    assert "missing a required argument: 'b'" in problem


class Unencodable(Protocol):
    async def path(self) -> pathlib.Path: ...
    async def takes(self, where: list[pathlib.PurePosixPath], ok: Outer) -> Outer: ...
    async def protocol_value(self, x: NotRuntime) -> None: ...
    def items(self) -> AsyncIterator[pathlib.Path]: ...


class UnencodableImpl:
    async def path(self) -> pathlib.Path:
        return pathlib.Path()

    async def takes(self, where: list[pathlib.PurePosixPath], ok: Outer) -> Outer:
        return ok

    async def protocol_value(self, x: NotRuntime) -> None:
        pass

    async def items(self) -> AsyncIterator[pathlib.Path]:
        yield pathlib.Path()


def test_unsupported_hints_are_found_before_any_call() -> None:
    # Before: a ``-> Path`` method ran, then its result failed to encode (UNENCODABLE_RESULT).
    problems = registration_problems(UnencodableImpl(), service_spec(Unencodable))
    assert len(problems) == 4, problems
    items, path, protocol_value, takes = problems
    assert path.startswith("path: the return type is unsupported: Path is not a type msgspec")
    assert "e.g. str for a path" in path
    assert items.startswith("items: the stream item type is unsupported")
    assert protocol_value.startswith("protocol_value: parameter 'x' has an unsupported type")
    assert takes.startswith("takes: parameter 'where' has an unsupported type")
    assert "(it contains PurePosixPath)" in takes
    for hint in (int, Outer, list[Inner], dict[str, Color], datetime.datetime | None, Any):
        assert unsupported_hint(hint) is None, hint


# ---------------------------------------------------------------------------------- manifest text


class Declared(Protocol):
    async def n(self, x: int) -> int: ...
    async def nested(self) -> list[dict[str, int | None]]: ...
    async def choice(self) -> Literal["a", "b"]: ...
    async def rest(self) -> tuple[int, ...]: ...
    def when(self) -> AsyncIterator[datetime.datetime]: ...
    async def inner(self) -> list[Inner]: ...
    async def bare(self): ...  # type: ignore[no-untyped-def]
    @gl.oneway
    async def note(self, text: str) -> None: ...


def test_the_result_hint_is_rebuilt_from_manifest_text_without_imports() -> None:
    manifest = service_spec(Declared).manifest()
    hints = {name: manifest_result_hint(entry) for name, entry in manifest.items()}
    assert hints == {
        "n": int,
        "nested": list[dict[str, int | None]],
        "choice": Literal["a", "b"],
        "rest": tuple[int, ...],
        "when": datetime.datetime,
        "inner": list[Any],  # a name it cannot rebuild is left unchecked
        "bare": Any,
        "note": None,
    }
    for signature in ("(x=<object at 0x1>) -> int", "-> int", "() -> __import__('os')", 7):
        assert manifest_result_hint({"kind": "unary", "signature": signature}) is Any
    # A hostile worker's manifest: text past the bound is not parsed at all; deep nesting
    # within it is refused by the parser, never a crash.
    huge = "(" + ", ".join(f"a{i}: int" for i in range(8_000)) + ") -> int"  # parses: int
    assert len(huge) > MAX_SIGNATURE_CHARS
    assert manifest_result_hint({"kind": "unary", "signature": huge}) is Any
    deep = "() -> " + "list[" * 1000 + "int" + "]" * 1000
    assert manifest_result_hint({"kind": "unary", "signature": deep}) is Any


# ------------------------------------------------------------------- a sync client's view


class _AsyncView(Protocol):
    async def add(self, a: int, b: int = 2) -> int: ...
    def count(self, n: int) -> AsyncIterator[int]: ...
    def pairs(self) -> AsyncGenerator[tuple[int, str], None]: ...
    @gl.oneway
    async def note(self, text: str) -> None: ...


class _SyncView(Protocol):
    def add(self, a: int, b: int = 2) -> int: ...
    def count(self, n: int) -> collections.abc.Iterator[int]: ...
    def pairs(self) -> collections.abc.Generator[tuple[int, str], None, None]: ...
    @gl.oneway
    def note(self, text: str) -> None: ...


def test_a_sync_view_has_the_async_interfaces_manifest() -> None:
    sync = sync_service_spec(_SyncView)
    assert sync.manifest() == service_spec(_AsyncView).manifest()
    assert {m.name: m.kind for m in sync.methods.values()} == {
        "add": MethodKind.UNARY,
        "count": MethodKind.STREAM,
        "pairs": MethodKind.STREAM,
        "note": MethodKind.ONEWAY,
    }
    assert sync.methods["pairs"].result == tuple[int, str]


def test_serving_still_refuses_a_sync_view() -> None:
    with pytest.raises(gl.ConfigError, match="plain `def`"):
        service_spec(_SyncView)


def test_a_sync_view_refuses_async_methods_and_async_streams() -> None:
    class Mixed(Protocol):
        def add(self, a: int) -> int: ...
        async def mul(self, a: int) -> int: ...
        def count(self) -> AsyncIterator[int]: ...

    with pytest.raises(gl.ConfigError) as refused:
        sync_service_spec(Mixed)
    text = str(refused.value)
    assert "Mixed.mul is `async def`" in text
    assert "Mixed.count returns an async iterator" in text
    assert "Mixed.add" not in text


def test_the_async_interface_is_refused_with_the_view_to_paste() -> None:
    with pytest.raises(gl.ConfigError) as refused:
        sync_service_spec(_AsyncView)
    text = str(refused.value)
    assert "_AsyncView is an async interface" in text
    assert "class _AsyncViewSync(Protocol):" in text
    assert "    def add(self, a: int, b: int = 2) -> int: ..." in text
    assert "    def count(self, n: int) -> Iterator[int]: ..." in text
    assert "    def pairs(self) -> Iterator[tuple[int, str]]: ..." in text
    assert "    @gl.oneway\n    def note(self, text: str) -> None: ..." in text


# --------------------------------------------------------------------------- views to paste

TYPING_FIXTURES = pathlib.Path(__file__).resolve().parent / "typing"


def _import_file(monkeypatch: pytest.MonkeyPatch, directory: pathlib.Path, name: str) -> Any:
    """Import ``directory/name.py`` as ``name``; forgotten again after the test."""
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.delitem(sys.modules, name, raising=False)  # restored (absent) after the test
    return importlib.import_module(name)


def test_the_printed_sync_view_pastes_as_is(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: the view in the message lacked its imports (Protocol, Iterator, gl, the types'
    # modules), so the pasted file failed with NameError.
    lab = _import_file(monkeypatch, TYPING_FIXTURES, "lab_interface")
    with pytest.raises(gl.ConfigError) as refused:
        sync_service_spec(lab.Lab)
    view = str(refused.value).split("\n\n", 1)[1]
    (tmp_path / "pasted_view.py").write_text(view, encoding="utf-8")
    pasted = _import_file(monkeypatch, tmp_path, "pasted_view")
    assert sync_service_spec(pasted.LabSync).manifest() == service_spec(lab.Lab).manifest()


def test_a_view_writes_enum_defaults_and_refuses_defaults_it_cannot_write() -> None:
    text = view_source(service_spec(_Painter), sync=False)
    assert f"shade: {__name__}.Color = {__name__}.Color.GREEN," in text
    assert "names: tuple[str, ...] = ('a',)" in text
    with pytest.raises(
        gl.ConfigError,
        match=r"_Odd.run, parameter 'at': its default datetime.date\(2020, 1, 2\) cannot",
    ):
        view_source(service_spec(_Odd), sync=True)
    with pytest.raises(
        gl.ConfigError, match=r"(?s)async interface .* cannot be printed here: _Odd"
    ):
        sync_service_spec(_Odd)  # the refusal still says what to do


class _Painter(Protocol):
    async def paint(self, shade: Color = Color.GREEN, names: tuple[str, ...] = ("a",)) -> int: ...


class _Odd(Protocol):
    async def run(self, at: datetime.date = datetime.date(2020, 1, 2)) -> int: ...
