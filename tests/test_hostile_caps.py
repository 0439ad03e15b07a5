"""Call metadata and idempotency keys at and just over their caps, through a gateway
(garcon_link.api.gateway, the caller's garcon_link.api.relay).

At a cap a call goes through both hops and reaches the executor intact (the gateway adds nothing
that would take it over); one over, it is refused before anything is sent, naming the cap:
``NotDispatched("INVALID_METADATA")`` for metadata (entries, bytes, a key's characters, text that
is not UTF-8), a ``ValueError`` naming the key's bounds for an idempotency key.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from test_gateway import Ident, one_device_two_callers

import garcon_link as gl

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LIMITS = gl.Limits()
ENTRIES, BYTES = LIMITS.max_metadata_entries, LIMITS.max_metadata_bytes


def _at_caps() -> dict[str, str]:
    """``ENTRIES`` entries of exactly ``BYTES`` UTF-8 bytes of keys and values together, the
    values not ASCII (two bytes a character) where they can be."""
    keys = [f"k{i:02d}" for i in range(ENTRIES)]
    room = BYTES - sum(len(k) for k in keys)
    each, extra = divmod(room, ENTRIES)
    values = ["\u00e9" * (each // 2) + "x" * (each % 2) for _ in keys]
    values[-1] += "x" * extra
    metadata = dict(zip(keys, values, strict=True))
    assert sum(len(k) + len(v.encode()) for k, v in metadata.items()) == BYTES
    return metadata


OVER: list[tuple[str, dict[str, str], str]] = [
    ("entries", {**_at_caps(), "k99": ""}, f"at most {ENTRIES}"),
    ("bytes", {**_at_caps(), "k00": _at_caps()["k00"] + "x"}, f"exceeds {BYTES} bytes"),
    ("key-chars", {"K": "v"}, "is not 1-64 characters"),
    ("key-length", {"k" * 65: "v"}, "is not 1-64 characters"),
    ("lone-surrogate-value", {"k": "\ud800"}, "not UTF-8"),
    ("lone-surrogate-key", {"\ud800": "v"}, "is not 1-64 characters"),
]


async def test_metadata_at_its_caps_crosses_the_gateway_intact_and_one_over_is_refused(
    tmp_path: Path,
) -> None:
    with anyio.fail_after(40):
        async with one_device_two_callers(tmp_path) as (_, service, first, _second):
            ident = first.executor("box-1").service("ident", Ident)
            at_caps = _at_caps()
            assert await gl.with_options(ident, metadata=at_caps).metadata() == at_caps
            for name, metadata, why in OVER:
                before = list(service.ledger)
                with pytest.raises(gl.NotDispatched) as info:
                    await gl.with_options(ident, metadata=metadata).record(name)
                assert info.value.code == "INVALID_METADATA", name
                assert why in str(info.value), name
                assert service.ledger == before  # nothing reached the executor


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("", "1 to 128 bytes"),
        (b"", "1 to 128 bytes"),
        ("k" * 129, "1 to 128 bytes"),
        ("\u00e9" * 64 + "x", "1 to 128 bytes"),  # 129 bytes of UTF-8 in 65 characters
        (b"k" * 129, "1 to 128 bytes"),
        ("\ud800", "UTF-8"),
    ],
)
def test_an_idempotency_key_over_its_cap_is_a_value_error_naming_the_cap(
    key: str | bytes, why: str
) -> None:
    from garcon_link.rpc.idempotency import normalize_key

    with pytest.raises(ValueError, match=why) as info:
        normalize_key(key)
    assert type(info.value) is ValueError  # not a codec's error escaping from below


async def test_an_idempotency_key_at_its_cap_runs_once_through_the_gateway(tmp_path: Path) -> None:
    with anyio.fail_after(40):
        async with one_device_two_callers(tmp_path) as (_, service, first, _second):
            ident = first.executor("box-1").service("ident", Ident)
            keyed = gl.with_options(ident, idempotency_key="\u00e9" * 64)  # 128 bytes of UTF-8
            assert await keyed.record("once") == await keyed.record("once")
            assert service.ledger.count("once") == 1
