"""A hostile worker's ``describe`` answer, field by field, at a listening controller
(garcon_link.api.controller's install of a fresh session): every field of a wrong type or of a
huge size is refused in one line (``last_error``, the session not installed) or kept within its
bound, within bounded memory, and a proper answer after it is installed as usual.

The worker is :func:`test_hostile.hostile_worker`'s raw one: it answers the controller's
``describe`` call by hand.
"""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

import anyio
import pytest
from faultutil import EXECUTOR_ID
from test_hostile import DEADLINE, OUTCOME_WAIT, hostile_worker

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

MEMORY_BOUND = 16 * 1024 * 1024  # far below what the hostile values would allocate
HUGE = 64 * 1024 * 1024


def _answer(**changed: Any) -> dict[str, Any]:
    return {
        "executor_id": EXECUTOR_ID,
        "instance_id": os.urandom(16),
        "services": {},
        "contract": "c" * 64,
    } | changed


# Values a worker chooses for each field: an int that bytes() would turn into HUGE zero bytes,
# text where bytes go and the reverse, maps, lists, huge text and bignums.
HOSTILE: list[tuple[str, Any]] = [
    ("instance_id", HUGE),
    ("instance_id", 2**40),
    ("instance_id", -1),
    ("instance_id", [1] * 1000),
    ("instance_id", "text"),
    ("instance_id", {"a": 1}),
    ("instance_id", None),
    ("instance_id", b"x" * 100_000),
    ("executor_id", "x" * 1_000_000),
    ("executor_id", {"a": [1]}),
    ("executor_id", 10**5000),
    ("executor_id", b"bytes"),
    ("worker_instance_id", 7),
    ("state_id", "x" * 100),
    ("inventory", 10**5000),
    ("inventory", "1"),
    ("services", [1, 2]),
    ("services", "x" * 1000),
]


@pytest.mark.parametrize(
    ("field", "value"),
    HOSTILE,
    ids=[f"{f}-{type(v).__name__}-{i}" for i, (f, v) in enumerate(HOSTILE)],
)
async def test_a_hostile_describe_field_is_refused_in_one_line_within_bounded_memory(
    field: str, value: Any
) -> None:
    with anyio.fail_after(DEADLINE):
        async with hostile_worker() as (executor, raw, call):
            tracemalloc.start()
            try:
                await raw.send_envelope([1, call[1], _answer(**{field: value})])
                with anyio.move_on_after(OUTCOME_WAIT):
                    while executor.last_error is None and executor.availability != "ready":
                        await anyio.sleep(0.01)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < MEMORY_BOUND, f"peak {peak} bytes"
            if executor.availability == "ready":
                info = await executor.info()
                assert isinstance(info.executor_id, str) and len(info.executor_id) <= 200
                assert isinstance(info.instance_id, bytes) and len(info.instance_id) <= 64
            else:
                why = executor.last_error
                assert why is not None and "describe failed" in why
                assert "\n" not in why and len(why) < 1_000
