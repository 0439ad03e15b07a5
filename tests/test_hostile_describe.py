"""Hostile and oversized type descriptions in a worker's ``describe`` answer
(garcon_link.rpc.typedoc): the total over all services is bounded, and whatever a worker sends
as ``types`` leaves the controller with a bounded, renderable description and never an error.

Each service's description is bounded on its own (``type_description_bytes``); these tests are
about many of them together (``type_descriptions_total_bytes`` and the describe answer's frame)
and about every CBOR shape in the ``types`` field a hostile worker chooses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest
from cbor_strategies import cbor_values, fuzz_settings, huge_names
from hypothesis import given
from hypothesis import strategies as st
from rpcutil import open_pair

import garcon_link as gl
from garcon_link.api.registration import registry_from
from garcon_link.core.wire import encode_canonical
from garcon_link.rpc.interface import service_spec
from garcon_link.rpc.typedoc import (
    checked_type_descriptions,
    registry_type_descriptions,
    service_type_description,
    type_description_lines,
)

LIMITS = gl.Limits()


def _wide_service(i: int, fields: int = 100) -> gl.Service[Any]:
    """A service whose one method takes a dataclass of ``fields`` long-named fields: a type
    description of about 60 KB, under ``type_description_bytes`` (64 KiB) on its own."""
    record = dataclasses.make_dataclass(
        f"Wide{i}", [(f"f{i}_{j}_" + "n" * 180, int) for j in range(fields)]
    )

    async def take(self: Any, v: Any) -> int:
        return i

    take.__annotations__ = {"v": record, "return": int}
    interface = type(f"WideApi{i}", (), {"take": take})
    return gl.Service(type(f"WideImpl{i}", (), {"take": take})(), interface)


def _size(service: gl.Service[Any], limits: gl.Limits = LIMITS) -> int:
    interface: Any = service.interface
    description = service_type_description(service_spec(interface), limits)
    return len(encode_canonical(description))


def _whole(description: Any) -> bool:
    return isinstance(description, dict) and "types" in description and "note" not in description


# ------------------------------------------------------------------------------ the worker side


def test_a_worker_sends_descriptions_up_to_the_total_and_a_note_for_each_past_it() -> None:
    services = {f"svc{i:02d}": _wide_service(100 + i) for i in range(6)}
    size = _size(services["svc00"])
    assert 50_000 < size <= LIMITS.type_description_bytes  # each one within its own bound
    limits = LIMITS.replace(type_descriptions_total_bytes=3 * size)  # exactly three fit
    sent = registry_type_descriptions(registry_from(services), limits)
    assert list(sent) == sorted(services)
    assert [_whole(sent[name]) for name in sorted(services)] == [True] * 3 + [False] * 3
    assert sum(len(encode_canonical(d)) for d in sent.values()) <= 3 * size + 3 * 200
    for name in sorted(services)[3:]:
        assert "Limits.type_descriptions_total_bytes" in sent[name]["note"]
    # One byte less: the third is left out too (the bound is inclusive, and counted exactly).
    sent = registry_type_descriptions(
        registry_from(services), LIMITS.replace(type_descriptions_total_bytes=3 * size - 1)
    )
    assert [_whole(sent[name]) for name in sorted(services)] == [True] * 2 + [False] * 4


def test_a_worker_keeps_its_describe_answer_within_its_frame() -> None:
    services = {f"svc{i:02d}": _wide_service(200 + i) for i in range(8)}
    limits = LIMITS.replace(max_frame_bytes=256 * 1024)  # four descriptions and the manifest
    sent = registry_type_descriptions(registry_from(services), limits)
    answer = {"services": registry_from(services).manifest(), "types": sent}
    assert len(encode_canonical(answer)) < limits.max_frame_bytes
    left_out = [name for name, d in sent.items() if not _whole(d)]
    assert left_out and left_out == sorted(left_out) and left_out[-1] == "svc07"
    assert "Limits.max_frame_bytes (262144)" in sent["svc07"]["note"]


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_a_worker_of_many_services_each_near_its_bound_still_becomes_ready() -> None:
    # 30 descriptions of about 60 KB each and their manifest are over a 1 MiB frame together:
    # without a total the describe answer is refused by its own worker (RESULT_TOO_LARGE), the
    # session is never installed, and the executor never becomes ready.
    services = {f"svc{i:02d}": _wide_service(300 + i) for i in range(30)}
    limits = LIMITS.replace(max_frame_bytes=1024 * 1024)
    with anyio.fail_after(20):
        async with open_pair("worker-listens", services, limits=limits) as pair:
            info = await pair.executor.info()
            assert set(info.types) == set(services)
            whole = [name for name in sorted(info.types) if _whole(info.types[name])]
            assert whole == sorted(info.types)[: len(whole)] and 0 < len(whole) < 30
            lines = type_description_lines(info.types)
            assert "(svc29: types not described: the describe answer would be over" in "\n".join(
                lines
            )
            # A service whose description was left out is served as any other.
            facade: Any = pair.executor.service("svc29", services["svc29"].interface)
            interface: Any = services["svc29"].interface
            record = interface.take.__annotations__["v"]
            fields = {f.name: 1 for f in dataclasses.fields(record)}
            assert await facade.take(record(**fields)) == 329


# ------------------------------------------------------------------------------ the controller side


def _described(size_hint: int) -> dict[str, Any]:
    """A well-formed description of about ``size_hint`` encoded bytes."""
    return {"types": [{"name": "x" * size_hint, "kind": "dataclass", "fields": []}]}


def test_a_controller_keeps_descriptions_up_to_the_total_and_notes_the_rest() -> None:
    one = _described(30_000)
    size = len(encode_canonical(one))
    received = {f"s{i:03d}": one for i in range(200)}  # 6 MB, each within its own bound
    services: dict[str, Any] = {name: {} for name in received}
    limits = LIMITS.replace(type_descriptions_total_bytes=4 * size)
    kept = checked_type_descriptions(received, services, limits)
    assert [_whole(kept[name]) for name in services][:5] == [True] * 4 + [False]
    assert sum(_whole(d) for d in kept.values()) == 4
    assert kept["s199"] == {
        "note": "dropped: with the services before it, over "
        f"Limits.type_descriptions_total_bytes ({4 * size})"
    }
    # One byte less: the fourth no longer fits.
    kept = checked_type_descriptions(
        received, services, LIMITS.replace(type_descriptions_total_bytes=4 * size - 1)
    )
    assert sum(_whole(d) for d in kept.values()) == 3
    # A dropped description costs nothing of the total: the small one after it is kept.
    mixed = {"a": _described(70_000), "b": one}
    kept = checked_type_descriptions(
        mixed, {"a": {}, "b": {}}, limits.replace(type_descriptions_total_bytes=size)
    )
    assert "note" in kept["a"] and kept["b"] == one


@given(received=st.one_of(cbor_values, st.dictionaries(st.text(max_size=3), cbor_values)))
@fuzz_settings(300)
def test_any_types_field_leaves_a_bounded_description_and_printable_lines(received: Any) -> None:
    services: dict[str, Any] = {name: {} for name in ("", "a", "b", "ab")}
    limits = LIMITS.replace(type_descriptions_total_bytes=4096, type_description_bytes=2048)
    kept = checked_type_descriptions(received, services, limits)
    assert set(kept) <= set(services)
    whole = [d for d in kept.values() if "note" not in d]
    assert sum(len(encode_canonical(d)) for d in whole) <= 4096
    for line in type_description_lines(kept):
        assert isinstance(line, str) and len(line) <= 2_000


@given(name=huge_names, where=st.sampled_from(["service", "type", "field", "kind", "note", "doc"]))
@fuzz_settings(40)
def test_huge_names_in_every_field_of_a_description_are_cut_when_shown(
    name: str, where: str
) -> None:
    entry: dict[str, Any] = {
        "name": "T",
        "kind": "dataclass",
        "fields": [{"name": "f", "type": "int"}],
    }
    description: dict[str, Any] = {"types": [entry]}
    service = "svc"
    if where == "service":
        service = name
    elif where == "type":
        entry["name"] = name
    elif where == "field":
        entry["fields"][0]["name"] = name
    elif where == "kind":
        entry["kind"] = name
    elif where == "doc":
        entry["doc"] = name
    else:
        description["note"] = name
    limits = LIMITS.replace(type_description_bytes=2 * 1024 * 1024)
    kept = checked_type_descriptions({service: description}, {service: {}}, limits)
    lines = type_description_lines(kept)
    assert lines and all(len(line) <= 1_000 for line in lines)
