"""What a caller learns of an executor through a gateway: ``GatewayExecutor.info()`` and
``garcon-link describe CALLER.toml`` (docs/guides/gateway.md).

In one process over loopback, with the helpers of tests/test_gateway.py. What the tests prove:

* the gateway's ``describe`` answer carries the type descriptions of the granted services only:
  a type used only by a service the caller may not see never reaches it, on the wire or in
  ``info()``; ``info().contract`` is the hash of the granted manifest, the executor's own only
  when every service is granted;
* the caller checks and bounds what a gateway sends as a controller does a worker's: a huge,
  deep or overlong description becomes a note, one of a service not in the manifest is dropped;
* version skew both ways: an older gateway (no types) gives empty types; a caller that predates
  types reads the answer of a newer gateway as before (same relay contract, one more key);
* the command line prints the type lines, and ``--json`` has ``contract`` and ``types``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.from_thread
import cbor2
import pytest
from test_cli import run_cli
from test_gateway import DEADLINE, LIMITS, caller, caller_config, enroll, running_gateway
from test_gateway_watch import OldGatewayRelay, fake_gateway

import garcon_link as gl
from garcon_link.api.relay import RELAY_SERVICE, GatewayRelay
from garcon_link.core.wire import encode_canonical
from garcon_link.rpc.interface import service_spec
from garcon_link.rpc.manifest import contract_hash
from garcon_link.rpc.typedoc import service_type_description

pytestmark = pytest.mark.timeout(60)


@dataclass
class Rect:
    w: float
    h: float = 1.0


@dataclass
class Hidden:
    code: str


class Lab(Protocol):
    async def area(self, r: Rect) -> float: ...


class Vault(Protocol):
    async def open(self, h: Hidden) -> str: ...


class LabService:
    async def area(self, r: Rect) -> float:
        return r.w * r.h


class VaultService:
    async def open(self, h: Hidden) -> str:
        return h.code


GRANTS = (
    gl.Grant(callers=("web-*",), executors=("box-*",), services=("lab",)),
    gl.Grant(callers=("ops",), executors=("*",)),
)


@asynccontextmanager
async def lab_device(tmp_path: Path, executor_id: str, url: str) -> AsyncIterator[gl.Worker]:
    """A worker serving ``lab`` (types: Rect) and ``vault`` (types: Hidden)."""
    secret = enroll(tmp_path / "keys", executor_id)
    config = gl.LinkConfig(
        executor_id=executor_id, role=gl.Role.WORKER, secret=secret, dial=url, limits=LIMITS
    )
    services = {"lab": gl.Service(LabService(), Lab), "vault": gl.Service(VaultService(), Vault)}
    async with gl.Worker(config, services) as worker:
        yield worker


@pytest.mark.anyio
async def test_a_caller_gets_the_types_of_its_granted_services_only(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path, GRANTS) as gw, lab_device(tmp_path, "box-1", gw.url):
            direct = gw.fleet.executor("box-1")
            await direct.wait_ready(10)
            own = await direct.info()
            assert set(own.types) == {"lab", "vault"}
            async with caller(tmp_path, "web-1", gw.url) as web:
                box = web.executor("box-1")
                await box.wait_ready(10)
                info = await box.info()
                assert set(info.services) == set(info.types) == {"lab"}
                assert info.types["lab"] == own.types["lab"]
                assert f"{__name__}.Rect" in json.dumps(info.types)
                assert info.versions == {"lab": own.versions["lab"]}
                # The hash of what the caller sees, never the executor's own.
                assert info.contract == contract_hash({"lab": own.services["lab"]})
                assert info.contract != own.contract
                assert (info.executor_id, info.instance_id, info.state_id) == ("box-1", b"", None)
                with pytest.raises(gl.Rejected) as refused:
                    await web.executor("zz-1").info()  # no grant names it
                assert refused.value.code == "FORBIDDEN"
            # On the wire: the gateway's answer names nothing of the service not granted.
            config = caller_config(tmp_path, "web-2", gw.url)
            async with gl.RemoteExecutor(config.link_config(), limits=LIMITS) as session:
                await session.wait_ready(10)
                answer = await session.service(RELAY_SERVICE, GatewayRelay).describe("box-1", 5)
                raw = cbor2.dumps(answer)
                assert b"lab" in raw and b"Rect" in raw
                assert b"vault" not in raw and b"Hidden" not in raw
            async with caller(tmp_path, "ops", gw.url) as ops:
                info = await ops.executor("box-1").info()
                assert info.contract == own.contract and info.types == own.types
                with pytest.raises(gl.NotDispatched) as offline:
                    await ops.executor("box-9").info()  # granted, never connected
                assert offline.value.code == "OFFLINE"


class BeforeTypesRelay(Protocol):
    """The relay's ``describe`` as a caller that predates type descriptions declares it."""

    async def describe(self, executor: str, wait: float) -> dict[str, Any]: ...


@pytest.mark.anyio
async def test_a_caller_older_than_types_reads_a_newer_gateways_answer(tmp_path: Path) -> None:
    """The relay's contract is unchanged (the facade of the older declaration raises no
    ``CONTRACT_CHANGED``), and its answer has the keys an older caller reads, plus ``types``,
    which it does not look up."""
    with anyio.fail_after(DEADLINE):
        async with running_gateway(tmp_path, GRANTS) as gw, lab_device(tmp_path, "box-1", gw.url):
            config = caller_config(tmp_path, "web-1", gw.url)
            async with gl.RemoteExecutor(config.link_config(), limits=LIMITS) as session:
                await session.wait_ready(10)
                answer = await session.service(RELAY_SERVICE, BeforeTypesRelay).describe("box-1", 5)
            assert set(answer) == {
                "executor_id",
                "availability",
                "since",
                "services",
                "manifest",
                "types",
            }
            assert answer["availability"] == "ready" and set(answer["manifest"]) == {"lab"}


LAB_MANIFEST = {"lab": service_spec(Lab).manifest()}


class DescribingRelay:
    """A gateway's relay (played by a worker) whose ``describe`` answers ``answer``."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    async def describe(self, executor: str, wait: float) -> dict[str, Any]:
        return {"executor_id": executor, **self.answer}

    async def executors(self) -> list[dict[str, Any]]:
        return []


async def _info_from(tmp_path: Path, answer: dict[str, Any]) -> gl.ExecutorInfo:
    relay = DescribingRelay(answer)
    async with (
        fake_gateway(tmp_path, relay, OldGatewayRelay) as config,
        gl.connect_gateway(config) as fleet,
    ):
        await fleet.gateway.wait_ready(10)
        return await fleet.executor("box-1").info()


@pytest.mark.anyio
async def test_an_older_gateway_gives_empty_types(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        info = await _info_from(
            tmp_path,
            {"availability": "ready", "services": {"lab": "v"}, "manifest": LAB_MANIFEST},
        )
    assert info.services == LAB_MANIFEST and info.types == {}
    assert info.contract == contract_hash(LAB_MANIFEST)


def _deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.anyio
async def test_a_hostile_gateways_types_are_bounded_as_a_workers(tmp_path: Path) -> None:
    manifest = {"lab": LAB_MANIFEST["lab"], "deep": {}, "many": {}, "odd": {}}
    hostile = {
        "lab": {"types": [], "schema": {"blob": "x" * 70_000}},
        "deep": {"types": [], "schema": _deep(40)},
        "many": {"types": [{"name": f"T{i}"} for i in range(65)]},
        "odd": ["not", "a", "map"],
        "unlisted": {"types": [{"name": "Smuggled"}]},  # a service the manifest does not name
    }
    with anyio.fail_after(DEADLINE):
        info = await _info_from(
            tmp_path,
            {"availability": "ready", "services": {}, "manifest": manifest, "types": hostile},
        )
        assert set(info.types) == {"lab", "deep", "many", "odd"}
        assert "over Limits.type_description_bytes (65536)" in info.types["lab"]["note"]
        assert "type_description_depth (32)" in info.types["deep"]["note"]
        assert "65 types, over Limits.described_types (64)" in info.types["many"]["note"]
        assert info.types["odd"] == {"note": "dropped: not a map"}
        assert info.contract == contract_hash(manifest)
        # Types that are no map at all: none, and the manifest stands.
        info = await _info_from(
            tmp_path,
            {"availability": "ready", "services": {}, "manifest": manifest, "types": [1, 2]},
        )
        assert info.types == {} and info.services == manifest
        # A manifest a controller would not install: refused, not shown.
        with pytest.raises(gl.OutcomeUnknown) as malformed:
            await _info_from(
                tmp_path, {"availability": "ready", "services": {}, "manifest": {"lab": 7}}
            )
        assert malformed.value.code == "MALFORMED_REPLY"


def test_describe_through_a_gateway_prints_the_types(tmp_path: Path) -> None:
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(running_gateway(tmp_path, GRANTS)) as gateway,
        portal.wrap_async_context_manager(lab_device(tmp_path, "box-1", gateway.url)),
    ):
        own = portal.call(_own_info, gateway)
        enroll(tmp_path / "callers", "web-1")
        toml = tmp_path / "web-1.toml"
        toml.write_text(
            'role = "caller"\ncaller_id = "web-1"\n'
            'secret_file = "callers/web-1.secret"\n'
            f'[connection]\ndial = "{gateway.url}"\n',
            encoding="utf-8",
        )
        text = run_cli("describe", str(toml), "--executor", "box-1")
        as_json = run_cli("describe", str(toml), "--executor", "box-1", "--json")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines() == [
        f"unary  lab.area(r: {__name__}.Rect) -> float",
        "",
        f"dataclass {__name__}.Rect",
        "  w: float",
        "  h: float = 1.0",
    ]
    assert as_json.returncode == 0, as_json.stderr
    described = json.loads(as_json.stdout)
    assert set(described) == {
        "executor_id",
        "contract",
        "contract_of",
        "versions",
        "services",
        "types",
    }
    assert described["contract_of"] == "granted"
    assert described["contract"] == contract_hash({"lab": own.services["lab"]})
    assert set(described["types"]) == {"lab"} and "Hidden" not in as_json.stdout


async def _own_info(gateway: gl.Gateway) -> gl.ExecutorInfo:
    direct = gateway.fleet.executor("box-1")
    await direct.wait_ready(10)
    return await direct.info()


@pytest.mark.anyio
async def test_the_gateway_keeps_its_describe_answer_within_a_frame(tmp_path: Path) -> None:
    """Types that, with a whole manifest, would be over the gateway's frame: those past the
    budget (a frame less a manifest and a margin) are notes, and the answer still goes."""
    sizes = [
        len(encode_canonical(service_type_description(service_spec(p), LIMITS)))
        for p in (Lab, Vault)
    ]
    budget = sum(sizes) - 1  # room for lab's, not for vault's after it
    limits = LIMITS.replace(max_manifest_bytes=LIMITS.max_frame_bytes - 64 * 1024 - budget)
    with anyio.fail_after(DEADLINE):
        async with (
            running_gateway(tmp_path, GRANTS, limits=limits) as gw,
            lab_device(tmp_path, "box-1", gw.url),
            caller(tmp_path, "ops", gw.url) as ops,
        ):
            box = ops.executor("box-1")
            await box.wait_ready(10)
            info = await box.info()
    assert info.types["lab"] == service_type_description(service_spec(Lab), LIMITS)
    assert info.types["vault"] == {
        "note": "dropped: over what one describe answer of a gateway holds"
    }
