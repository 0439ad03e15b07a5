"""Tests of garcon_link.rpc.values: strict values on the caller's and on the receiver's side.

One table of value x declared type, checked on both sides: the caller's check of the Python
value (``check_value``, what a facade call runs before sending) and the receiver's check of what
it decodes (``from_wire`` of the value as encoded: ``to_wire`` + CBOR). The receiver never trusts
the caller: the same table is sent over a real session by a raw call that skips the caller's
check, and what the receiver refuses comes back ``Rejected("INVALID_ARGUMENTS")``, the handler
not run. Then one test per stumble a newcomer hit (each fails on a tree without strict values).
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import typing
import uuid
from typing import Annotated, Any, Literal, Protocol, TypedDict

import anyio
import cbor2
import msgspec
import pytest
from rpcutil import open_pair, raw_call

import garcon_link as gl
from garcon_link.rpc.interface import service_spec, to_wire
from garcon_link.rpc.values import (
    JSON_VALUES,
    VALUES_METADATA_KEY,
    check_value,
    from_wire,
    type_text,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Rect:
    w: int
    h: int = 0


@dataclasses.dataclass
class Wider(Rect):
    depth: int = 0


class Point(TypedDict):
    x: int
    y: int


class Checked(msgspec.Struct):
    n: int


WHEN = datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC)
ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
OK = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One case: ``value`` passed where ``hint`` is declared; ``None`` means accepted, a text
    means refused with a message containing it. ``wire`` is the receiver's verdict where it
    differs from the caller's: the wire cannot tell some values apart (a datetime travels as its
    text), so there only the caller's check can refuse."""

    value: Any
    hint: Any
    caller: str | None
    wire: str | Literal["same"] | None = "same"

    @property
    def receiver(self) -> str | None:
        return self.caller if self.wire == "same" else self.wire

    def __str__(self) -> str:
        return f"{type(self.value).__name__}-as-{type_text(self.hint)}"


TABLE = [
    # bytes and text are never each other
    Row(b"abc", bytes, OK),
    Row(bytearray(b"abc"), bytes, OK),
    Row("aGVsbG8=", bytes, "expected `bytes`, got `str`"),
    Row(b"abc", str, "expected `str`, got `bytes`"),
    Row("abc", str, OK),
    # numbers: a bool is not an int, an int is a float, a float is not an int
    Row(3, int, OK),
    Row(True, int, "expected `int`, got `bool`"),
    Row(2.5, int, "expected `int`, got `float`"),
    Row(3, float, OK),
    Row("3", int, "expected `int`, got `str`"),
    # values that travel as text: the caller tells them from text, the receiver checks the text
    Row(WHEN, datetime.datetime, OK),
    Row(WHEN.isoformat(), datetime.datetime, "expected `datetime`, got `str`", wire=OK),
    Row(WHEN, str, "expected `str`, got `datetime`", wire=OK),
    Row("not a date", datetime.datetime, "expected `datetime`, got `str`", wire="Invalid RFC3339"),
    Row(WHEN, datetime.date, "expected `date`, got `datetime`", wire="Invalid RFC3339"),
    Row(WHEN.date(), datetime.date, OK),
    Row(datetime.timedelta(seconds=3), datetime.timedelta, OK),
    Row(ID, uuid.UUID, OK),
    Row(str(ID), uuid.UUID, "expected `UUID`, got `str`", wire=OK),
    Row(ID, str, "expected `str`, got `UUID`", wire=OK),
    Row(decimal.Decimal("1.5"), decimal.Decimal, OK),
    Row(1.5, decimal.Decimal, "expected `Decimal`, got `float`"),
    Row(decimal.Decimal("1.5"), str, "expected `str`, got `Decimal`", wire=OK),
    # containers, in Python's words
    Row([1, 2], list[int], OK),
    Row((1, 2), list[int], OK),
    Row({1, 2}, list[int], "expected `list[int]`, got `set`", wire=OK),
    Row({1, 2}, set[int], OK),
    Row([1, 2], set[int], "expected `set[int]`, got `list`", wire=OK),
    Row({1, 2}, int, "expected `int`, got `set`", wire="expected `int`, got `list`"),
    Row([1, "2"], list[int], "expected `int`, got `str` at `$[1]`"),
    Row((1, "a"), tuple[int, str], OK),
    Row((1, 2, 3), tuple[int, str], "expected `tuple[int, str]` (2 items), got 3 items"),
    Row({"a": 1}, dict[str, int], OK),
    Row({"a": "1"}, dict[str, int], "expected `int`, got `str` at `$.a`"),
    Row(None, int | None, OK),
    Row("x", int | None, "expected `int | None`, got `str`"),
    # enums and literals
    Row(Color.RED, Color, OK),
    Row("red", Color, "expected `Color`, got `str`", wire=OK),
    Row("nope", Color, "expected `Color`, got `str`", wire="Invalid enum value 'nope'"),
    Row("a", Literal["a", "b"], OK),
    Row("c", Literal["a", "b"], "expected `Literal['a', 'b']`, got 'c' (`str`)"),
    # records: no unknown field, no dict for a dataclass, every field checked
    Row(Rect(1, 2), Rect, OK),
    Row(Rect("1"), Rect, "expected `int`, got `str` at `$.w`"),  # type: ignore[arg-type]
    Row({"w": 1}, Rect, "expected `Rect`, got `dict`", wire=OK),
    Row(
        {"w": 1, "colour": 2},
        Rect,
        "expected `Rect`, got `dict`",
        wire="`Rect` has no field `colour` (its fields: w, h)",
    ),
    Row(Wider(1, 2, 3), Rect, "`Rect` has no field `depth` (its fields: w, h)"),
    Row({"x": 1, "y": 2}, Point, OK),
    Row({"x": 1, "y": 2, "z": 3}, Point, "`Point` has no field `z` (its fields: x, y)"),
    Row({"x": 1}, Point, "`Point` is missing its required key `y`"),
    Row(Checked(1), Checked, OK),
    Row({"n": 1, "extra": 2}, Checked, "expected `Checked`, got `dict`", wire=OK),
    Row([Rect(1), Rect("x")], list[Rect], "expected `int`, got `str` at `$[1].w`"),  # type: ignore[arg-type]
    Row(None, Rect | None, OK),
    # constraints are the worker's to check
    Row(3, Annotated[int, msgspec.Meta(ge=0)], OK),
    Row(-1, Annotated[int, msgspec.Meta(ge=0)], OK, wire=">= 0"),
    Row("3", Annotated[int, msgspec.Meta(ge=0)], "expected `int`, got `str`"),
    # Any takes what the wire carries
    Row({"any": [1, b"2"]}, Any, OK),
    Row(None, None, OK),
    Row(0, None, "expected `None`, got `int`"),
]


def _ids(row: Row) -> str:
    return str(row)


def _received(value: Any, hint: Any) -> Any:
    """What the receiver makes of ``value`` sent as a caller's encoding would send it."""
    return from_wire(cbor2.loads(cbor2.dumps(to_wire(value))), hint)


@pytest.mark.parametrize("row", TABLE, ids=_ids)
def test_the_caller_checks_the_python_value(row: Row) -> None:
    if row.caller is None:
        check_value(row.value, row.hint)
    else:
        with pytest.raises(TypeError) as info:
            check_value(row.value, row.hint)
        assert row.caller in str(info.value)


@pytest.mark.parametrize("row", TABLE, ids=_ids)
def test_the_receiver_checks_what_it_decodes(row: Row) -> None:
    expected = row.receiver
    if expected is None:
        received = _received(row.value, row.hint)
        if row.caller is None and row.hint is not Any:
            assert received == row.value or (
                isinstance(row.value, tuple) and list(row.value) == received
            )
    else:
        with pytest.raises(msgspec.ValidationError) as info:
            _received(row.value, row.hint)
        assert expected in str(info.value)


# ---------------------------------------------------------------------------------- end to end


def _interface(hint: Any) -> type:
    """An interface with one method ``take(v: hint) -> int``."""

    class Typed(Protocol):
        async def take(self, v: Any) -> int: ...

    Typed.take.__annotations__ = {"v": hint, "return": int}
    return Typed


class Counter:
    def __init__(self) -> None:
        self.runs = 0

    async def take(self, v: Any) -> int:
        self.runs += 1
        return self.runs


async def test_the_table_over_a_session_the_worker_never_trusts_the_caller() -> None:
    # An interface's hints are read without ``Annotated`` extras (they are not part of the
    # contract), so the constraint rows are the unit tables' only.
    rows = [(i, row) for i, row in enumerate(TABLE) if typing.get_origin(row.hint) is not Annotated]
    impls = {f"s{i}": Counter() for i, _ in rows}
    services = {
        name: gl.Service(impl, _interface(row.hint))
        for (name, impl), (_, row) in zip(impls.items(), rows, strict=True)
    }
    with anyio.fail_after(DEADLINE * 3):
        async with open_pair("worker-listens", services) as pair:
            for i, row in rows:
                name = f"s{i}"
                facade: Any = pair.executor.service(name, _interface(row.hint))
                if row.caller is None:
                    assert await facade.take(row.value) >= 1, row
                else:
                    with pytest.raises(gl.Rejected) as refused:
                        await facade.take(row.value)
                    assert refused.value.code == "INVALID_ARGUMENTS", row
                    assert row.caller in refused.value.message, row
                runs = impls[name].runs
                # The same value without the caller's check: the worker decides alone.
                if row.receiver is None:
                    assert await raw_call(pair.rpc, name, "take", to_wire([row.value])) == runs + 1
                else:
                    with pytest.raises(gl.Rejected) as info:
                        await raw_call(pair.rpc, name, "take", to_wire([row.value]))
                    assert info.value.code == "INVALID_ARGUMENTS", row
                    assert row.receiver in info.value.message, row
                    assert impls[name].runs == runs, row  # the handler did not run


def test_an_integer_past_a_floats_range_is_refused_where_a_float_goes() -> None:
    # The caller lets it through (an int is a float); the receiver refuses it, not a crash.
    check_value(10**400, float)
    with pytest.raises(msgspec.ValidationError, match="out of range"):
        from_wire(10**400, float)
    with pytest.raises(msgspec.ValidationError, match="out of range"):
        from_wire([10**400], list[float])


# ---------------------------------------------------------------------------------- the stumbles


class Lab(Protocol):
    async def checksum(self, data: bytes) -> int: ...
    async def area(self, r: Rect) -> int: ...
    async def stamp(self, when: str) -> str: ...
    async def total(self, n: int) -> int: ...


class LabImpl:
    def __init__(self) -> None:
        self.seen: list[Any] = []

    async def checksum(self, data: bytes) -> int:
        self.seen.append(data)
        return len(data)

    async def area(self, r: Rect) -> int:
        self.seen.append(r)
        return r.w * r.h

    async def stamp(self, when: str) -> str:
        self.seen.append(when)
        return when

    async def total(self, n: int) -> int:
        self.seen.append(n)
        return n


async def test_text_is_not_bytes_on_either_side() -> None:
    impl = LabImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"lab": gl.Service(impl, Lab)}) as pair:
            lab = pair.executor.service("lab", Lab)
            with pytest.raises(gl.Rejected, match="argument 'data': expected `bytes`, got `str`"):
                await lab.checksum("aGVsbG8=")  # type: ignore[arg-type]
            with pytest.raises(gl.Rejected, match="argument 'data': expected `bytes`, got `str`"):
                await raw_call(pair.rpc, "lab", "checksum", ["aGVsbG8="])
            assert impl.seen == []
            assert await lab.checksum(b"hello world") == 11


async def test_an_unknown_dataclass_field_is_refused_naming_it() -> None:
    impl = LabImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"lab": gl.Service(impl, Lab)}) as pair:
            with pytest.raises(gl.Rejected, match="`Rect` has no field `hieght`"):
                await raw_call(pair.rpc, "lab", "area", [{"w": 2, "hieght": 3}])
            lab = pair.executor.service("lab", Lab)
            with pytest.raises(gl.Rejected, match="expected `Rect`, got `dict`"):
                await lab.area({"w": 2, "hieght": 3})  # type: ignore[arg-type]
            assert impl.seen == []
            assert await lab.area(Rect(2, 3)) == 6


@pytest.mark.parametrize("value", [WHEN, ID, decimal.Decimal("1.25")], ids=type_text)
async def test_a_datetime_uuid_or_decimal_is_not_passed_as_str(value: Any) -> None:
    impl = LabImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"lab": gl.Service(impl, Lab)}) as pair:
            lab = pair.executor.service("lab", Lab)
            name = type(value).__name__
            with pytest.raises(gl.Rejected, match=f"expected `str`, got `{name}`"):
                await lab.stamp(value)
            assert impl.seen == []


async def test_a_set_is_named_a_set() -> None:
    impl = LabImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"lab": gl.Service(impl, Lab)}) as pair:
            lab = pair.executor.service("lab", Lab)
            with pytest.raises(gl.Rejected) as info:
                await lab.total({1, 2})  # type: ignore[arg-type]
            assert "expected `int`, got `set`" in info.value.message
            assert "array" not in info.value.message


# ---------------------------------------------------------------------------------- JSON clients


def test_a_json_client_sends_bytes_as_base64_text() -> None:
    assert from_wire("aGVsbG8=", bytes, mode="json") == b"hello"
    assert from_wire({"d": "aGk="}, dict[str, bytes], mode="json") == {"d": b"hi"}
    assert from_wire(1.5, decimal.Decimal, mode="json") == decimal.Decimal("1.5")
    with pytest.raises(msgspec.ValidationError, match="`Rect` has no field `x`"):
        from_wire({"w": 1, "x": 2}, Rect, mode="json")
    with pytest.raises(msgspec.ValidationError, match="expected `bytes`, got `int`"):
        from_wire(5, bytes, mode="json")


async def test_the_json_mark_is_call_metadata() -> None:
    impl = LabImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair("worker-listens", {"lab": gl.Service(impl, Lab)}) as pair:
            lab: Any = pair.executor.service("lab").with_options(
                metadata={VALUES_METADATA_KEY: JSON_VALUES}
            )
            assert await lab.checksum("aGVsbG8=") == 5
            assert impl.seen == [b"hello"]


def test_type_text_uses_python_names() -> None:
    assert type_text(set[int]) == "set[int]"
    assert type_text(dict[str, list[bytes]]) == "dict[str, list[bytes]]"
    assert type_text(Rect | None) == "Rect | None"
    assert type_text(tuple[int, ...]) == "tuple[int, ...]"


@dataclasses.dataclass
class Node:
    children: list[Node]


def test_a_caller_value_nested_too_deeply_is_refused_not_a_crash() -> None:
    deep = Node([])
    for _ in range(100_000):
        deep = Node([deep])
    with pytest.raises(TypeError, match="nested too deeply"):
        check_value(deep, Node)


def test_the_interface_spec_checks_each_argument() -> None:
    take = service_spec(_interface(bytes)).methods["take"]
    take.check_arguments([b"x"], {})
    with pytest.raises(TypeError, match="argument 'v': expected `bytes`, got `str`"):
        take.check_arguments(["x"], {})
    with pytest.raises(TypeError, match="argument 'v'"):
        take.check_arguments([], {"v": "x"})


def test_a_peers_names_and_values_are_bounded_and_escaped_in_messages() -> None:
    hostile = "\x1b[31m" + "x" * 100_000
    for wire, hint in [
        ({"w": 1, hostile: 2}, Rect),
        ({hostile: "1"}, dict[str, int]),
        ({b"\x00" * 100_000: "1"}, dict[bytes, int]),
        (hostile, Literal["a"]),
        ({"w": 1, **{f"f{i}": i for i in range(10_000)}}, Rect),
    ]:
        with pytest.raises(msgspec.ValidationError) as info:
            from_wire(wire, hint)
        message = str(info.value)
        assert len(message) < 300, message
        assert "\x1b" not in message and message.isprintable()
