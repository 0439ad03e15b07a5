"""Hostile input at the gateway: what a keyed, granted caller and a keyed executor can send.

A gateway is exposed to many callers, each holding a key, and forwards their arguments without
converting them (docs/guides/gateway.md#bounds). These fuzzers run one gateway, a well-behaved
executor ``box-1``, an executor ``box-2`` whose replies the test writes by hand, and a
well-behaved caller ``web-1``, all in one process over loopback, set up once per backend in a
blocking portal (a gateway per example would cost most of the run); each Hypothesis example then
drives them from the test's thread.

* **A hostile, granted caller** (``web-9``, a fresh session per example) sends raw envelopes of
  every kind a caller sends: the relay's ``call`` (unkeyed, keyed with metadata), ``stream``,
  ``notify``, ``describe``, ``executors`` and ``watch``, ``credit`` and ``cancel``, the
  internal ``$link`` ones, bodies in ``part`` envelopes with transfer ids of any kind; each with
  one field replaced by hostile CBOR (every major type, huge names and metadata, bignums, deep
  nesting, huge, negative and repeated ids and credits), cut or extended, or with arguments that
  do not frame, or frame but do not decode. After each example: the gateway logged nothing at
  ERROR or with a traceback, no line longer than :data:`LINE_BOUND`, at most
  :data:`WARNINGS_BOUND` warnings; box-1's worker saw no call it cannot parse (its
  ``malformed_envelopes`` did not grow: the gateway refused such a call itself); while the
  hostile caller is connected, its streams and calls in flight stay within its budget and its
  share of box-1, and it holds at most one watch (``gw.callers()``); once it left, the gateway
  holds nothing of it (no caller session, no stream, watch or pending call to box-1, no handler
  running there); the gateway's session to box-1 is the same one (its id
  unchanged) and ``web-1``'s next call through it succeeds.
* **A hostile executor** (box-2) answers a relayed unary call or stream of ``web-2`` with
  hostile replies: values that are not one CBOR item, items past credit, mutated results,
  errors, items, ends, credits, cancels, calls and notifications, replies for calls it never
  got. The call ends (a value, or a ``CallError``: never a hang, never another exception); a
  ``MALFORMED_REPLY`` is the gateway's verdict on box-2's reply, counted against box-2, not an
  unreadable answer of the gateway's; the gateway's pending calls to box-2 drain; nothing is
  logged at ERROR; box-1's session is unchanged and ``web-1``'s next call through it succeeds.

What these found, each fixed (run against the parent commit of the fixes, the explicit seeds
fail): arguments that frame by their heads but do not decode (text that is not UTF-8, a bignum
past its bound, an array as a map key) were forwarded, and box-1's worker dropped them as
malformed (the gateway now decodes them to check, and refuses ``INVALID_ARGUMENTS``); a relay
call whose id no CBOR head holds raised ``OverflowError`` on the direct path; an executor's
result that does not decode was passed on, counted a success, for the caller to find "the
gateway's outcome" unreadable; an integer past a float's range where a float goes (``describe``'s
``wait``) raised ``OverflowError`` in any worker's argument conversion (``rpc/values.py``). The
campaigns run after the fixes (``GARCON_FUZZ_SCALE=20`` with the derived seeds and with seed 2,
``GARCON_FUZZ_SCALE=10`` with seed 1: up to 2,200 examples per backend each) found nothing more.

Reproducible as tests/test_fuzz.py is: ``derandomize=True``, no database, no explain phase;
``GARCON_FUZZ_SCALE=N`` multiplies the example counts (:data:`EXAMPLES`) for a longer campaign and
``GARCON_FUZZ_SEED=<int>`` replaces the derived seed, e.g.
``GARCON_FUZZ_SCALE=20 GARCON_FUZZ_SEED=1 pytest tests/test_gateway_hostile.py --timeout=3000``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.from_thread
import cbor2
import pytest
from cbor_strategies import (
    CALL,
    CANCEL,
    CREDIT,
    END,
    ERROR,
    ITEM,
    NOTIFY,
    RESULT,
    F,
    Spliced,
    any_item,
    array_bytes,
    cbor_values,
    encode,
    fuzz_settings,
    head,
    hostile_scalars,
    huge_names,
    mutated_envelope,
    raw_items,
)
from hypothesis import example, given
from hypothesis import strategies as st
from test_gateway import GRANTS, LIMITS, Ident, IdentService, caller_config, enroll

import garcon_link as gl
from garcon_link.core.wire import MAX_BIGNUM_BYTES
from garcon_link.rpc.chunks import PART

pytestmark = [
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
    pytest.mark.timeout(120),
]

EXAMPLES = {"caller": 60, "executor": 50}
"""Examples per backend (``GARCON_FUZZ_SCALE`` multiplies them)."""
DEADLINE = 20.0
"""Seconds one example may take, at most, before it counts as a hang."""
FRAME = LIMITS.max_frame_bytes
BIG = 10**5000  # past Python's 4,300-digit int-to-str limit

HOSTILE_GRANTS = (
    *GRANTS,
    gl.Grant(callers=("web-9",), executors=("box-1",), services=("ident",)),
    gl.Grant(callers=("web-2",), executors=("box-2",)),
)


def fuzz(name: str) -> Callable[[F], F]:
    """Hypothesis settings for one fuzzer (as tests/test_fuzz.py's)."""
    return fuzz_settings(EXAMPLES[name])


# ------------------------------------------------------------------------------ the environment


class Held(Protocol):
    async def held(self) -> int: ...

    def items(self) -> AsyncIterator[int]: ...


class HeldService:
    """box-2's service: each call waits for ``release`` (the test answers it by hand first)."""

    def __init__(self) -> None:
        self.release = anyio.Event()
        self.started = anyio.Event()

    async def held(self) -> int:
        self.started.set()
        await self.release.wait()
        return 1

    async def items(self) -> AsyncIterator[int]:
        self.started.set()
        await self.release.wait()
        yield 1


LINE_BOUND = 600
"""The longest log line the library may build from a peer's values (tests/test_fuzz.py's bound;
the hostile names hold up to 300,000 characters)."""
WARNINGS_BOUND = 40
"""Warnings one example may cause at most: the peer's lines are rate-limited per reason."""


class CrashLog(logging.Handler):
    """Records our loggers' lines at ERROR or with a traceback (a peer's input caused them),
    lines longer than :data:`LINE_BOUND`, and counts the warnings."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.crashes: list[str] = []
        self.warnings = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception as exc:  # a peer value that cannot be printed
            self.crashes.append(f"unformattable log record {record.msg!r}: {exc!r}")
            return
        if len(text) > LINE_BOUND:
            self.crashes.append(f"a log line of {len(text)} chars: {text[:200]!r}")
        if record.levelno == logging.WARNING:
            self.warnings += 1
        if record.levelno >= logging.ERROR or record.exc_info:
            trace = self.format(record) if record.exc_info else text
            self.crashes.append(f"{record.name}: {trace[-6000:]}")


@dataclasses.dataclass
class Env:
    tmp: Path
    gw: gl.Gateway
    box: IdentService
    worker: gl.Worker
    held: HeldService
    held_worker: gl.Worker
    good: gl.GatewayFleet
    web2: gl.GatewayFleet
    log: CrashLog
    sentinels: int = 0


def _worker(tmp: Path, executor_id: str, url: str, services: dict[str, Any]) -> gl.Worker:
    secret = enroll(tmp / "keys", executor_id)
    config = gl.LinkConfig(
        executor_id=executor_id, role=gl.Role.WORKER, secret=secret, dial=url, limits=LIMITS
    )
    return gl.Worker(config, services)


@asynccontextmanager
async def environment(tmp: Path) -> AsyncIterator[Env]:
    crash_log = CrashLog()
    logger = logging.getLogger("garcon_link")
    logger.addHandler(crash_log)
    try:
        (tmp / "keys").mkdir(mode=0o700, exist_ok=True)
        (tmp / "callers").mkdir(mode=0o700, exist_ok=True)
        config = gl.GatewayConfig(
            fleet=gl.FleetConfig(listen=("127.0.0.1", 0), keyring=tmp / "keys", limits=LIMITS),
            callers=gl.CallersConfig(keyring=tmp / "callers", grants=HOSTILE_GRANTS),
        )
        async with gl.gateway(config) as gw, AsyncExitStack() as stack:
            box = IdentService("box-1")
            worker = await stack.enter_async_context(_worker(tmp, "box-1", gw.url, {"ident": box}))
            held = HeldService()
            held_worker = await stack.enter_async_context(
                _worker(tmp, "box-2", gw.url, {"held": held})
            )
            good = await stack.enter_async_context(
                gl.connect_gateway(caller_config(tmp, "web-1", gw.url), refresh_interval=60)
            )
            web2 = await stack.enter_async_context(
                gl.connect_gateway(caller_config(tmp, "web-2", gw.url), refresh_interval=60)
            )
            enroll(tmp / "callers", "web-9")
            await good.executor("box-1").wait_ready(10)
            await web2.executor("box-2").wait_ready(10)
            yield Env(tmp, gw, box, worker, held, held_worker, good, web2, crash_log)
    finally:
        logger.removeHandler(crash_log)


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[anyio.from_thread.BlockingPortal, Env]]:
    tmp = tmp_path_factory.mktemp(f"hostile-{request.param}")
    with (
        anyio.from_thread.start_blocking_portal(request.param) as portal,
        portal.wrap_async_context_manager(environment(tmp)) as state,
    ):
        yield portal, state


async def _until(check: Callable[[], bool], what: str) -> None:
    """Wait, bounded, until ``check()`` holds (polled: these are the public snapshots)."""
    with anyio.fail_after(DEADLINE):
        while not check():
            await anyio.sleep(0.005)


def _worker_counts(worker: gl.Worker) -> tuple[int, int]:
    """box-1's worker: envelopes it dropped as malformed or undecodable (a call among them is
    also refused), handlers running."""
    stats = worker.controllers().values()
    return sum(s.malformed_envelopes for s in stats), sum(s.incoming_calls for s in stats)


async def _unaffected(env: Env, session: str | None) -> None:
    """What every example must leave: box-1's session unchanged, web-1 served through it."""
    assert env.gw.fleet.executors()["box-1"].session == session
    ident = env.good.executor("box-1").service("ident", Ident)
    with anyio.fail_after(DEADLINE):
        assert await ident.whoami() == "box-1"
    assert not env.log.crashes, env.log.crashes
    assert env.log.warnings <= WARNINGS_BOUND, env.log.warnings


# ------------------------------------------------------------------- a hostile, granted caller

RELAY = "gateway"
ARGS = cbor2.dumps([["tag"], {}])


def relay_shapes(call_id: int, payload: bytes) -> dict[str, list[Any]]:
    """A valid envelope of every kind a caller sends the relay, naming ``call_id``."""
    return {
        "call": [CALL, call_id, RELAY, "call", ["box-1", "ident", "record", payload, None, 5.0],
                 {}, 0, 0],
        "keyed-call": [CALL, call_id, RELAY, "call",
                       ["box-1", "ident", "record", payload, b"k" * 16, 5], {}, 0, 0,
                       None, {"trace": "t"}],
        "stream": [CALL, call_id, RELAY, "stream", ["box-1", "ident", "count", cbor2.dumps(
            [[2], {}])], {}, 4, 1 << 20],
        "notify": [NOTIFY, RELAY, "notify", ["box-1", "ident", "note", payload], {}],
        "describe": [CALL, call_id, RELAY, "describe", ["box-1", 0.0], {}, 0, 0],
        "executors": [CALL, call_id, RELAY, "executors", [], {}, 0, 0],
        "watch": [CALL, call_id, RELAY, "watch", [], {}, 4, 1 << 20],
        "credit": [CREDIT, call_id, 4, 4096],
        "cancel": [CANCEL, call_id],
        # What any controller may send a worker's session: the manifest, its own inventory
        # (a worker's to send, not a caller's), its goodbye, the transfer ids it reads.
        "link-describe": [CALL, call_id, "$link", "describe", [], {}, 0, 0],
        "link-inventory": [NOTIFY, "$link", "inventory", [call_id, {"calc": {}}], {}],
        "link-draining": [NOTIFY, "$link", "draining", [], {}],
        "link-parts": [NOTIFY, "$link", "parts", [call_id], {}],
    }  # fmt: skip


def shape(kind: str, call_id: int = 1_000, payload: bytes = ARGS) -> bytes:
    """One of :func:`relay_shapes`, encoded."""
    return encode(relay_shapes(call_id, payload)[kind])


payloads: st.SearchStrategy[bytes] = st.one_of(
    st.just(ARGS),
    any_item,  # mostly not [args, kwargs]
    st.tuples(any_item, any_item).map(lambda two: array_bytes([Spliced(two[0]), Spliced(two[1])])),
    st.tuples(st.lists(cbor_values, max_size=3), st.dictionaries(st.text(max_size=5), cbor_values,
              max_size=3)).map(lambda v: encode(list(v))),
    raw_items.map(lambda raw: b"\x82\x81" + raw + b"\xa0"),  # a raw item as the one argument
)  # fmt: skip
"""A relayed call's ``payload``: well formed, framed with hostile contents, or not framed."""

# Arguments that frame (heads only) but that no worker decodes as plain data: text that is not
# UTF-8, an array as a map key, a bignum tag around a non-byte-string or past the bound.
UNDECODABLE = [
    b"\x82\x81\x62\xff\xfe\xa0",
    b"\x82\x80\xa1\x81\x00\x00",
    b"\x82\x81\xc2\x00\xa0",
    b"\x82\x81\xc2" + head(2, MAX_BIGNUM_BYTES * 8) + b"\x01" * (MAX_BIGNUM_BYTES * 8) + b"\xa0",
    b"\x82\x80\xa2\x61a\x00\x61a\x01",  # a duplicate keyword
    b"\x82" + b"\x81" * 63 + b"\x80\xa0",  # as deep as the gateway frames
]


@st.composite
def relay_envelope(draw: st.DrawFn, call_id: int) -> bytes:
    """One envelope a caller sends the relay, with one part made hostile."""
    payload = draw(payloads)
    envelope = relay_shapes(call_id, payload)[draw(st.sampled_from(sorted(relay_shapes(0, b""))))]
    op = draw(st.sampled_from(["element", "argument", "argument", "name", "cut", "extend",
                               "whole", "none"]))  # fmt: skip
    hostile = st.one_of(cbor_values, hostile_scalars, raw_items.map(Spliced))
    if op == "whole":
        return draw(any_item)
    if op == "argument" and envelope[0] in (CALL, NOTIFY):
        position = 4 if envelope[0] == CALL else 3
        arguments = list(envelope[position])
        if arguments:
            arguments[draw(st.integers(0, len(arguments) - 1))] = draw(hostile)
        else:
            arguments.append(draw(hostile))
        envelope[position] = Spliced(array_bytes(arguments))
    elif op == "name" and envelope[0] in (CALL, NOTIFY):
        name = draw(huge_names)
        if envelope[0] == CALL and len(envelope) == 10 and draw(st.booleans()):
            envelope[9] = {name: "v"} if draw(st.booleans()) else {"trace": name}
        else:
            position = 4 if envelope[0] == CALL else 3
            arguments = list(envelope[position])
            if arguments:
                arguments[draw(st.integers(0, min(2, len(arguments) - 1)))] = name
                envelope[position] = arguments
            else:
                envelope[draw(st.sampled_from([2, 3]))] = name
    elif op == "element":
        position = draw(st.one_of(st.just(1), st.integers(0, len(envelope) - 1)))
        envelope[position] = draw(hostile)
    elif op == "cut":
        envelope = envelope[: draw(st.integers(0, len(envelope) - 1))]
    elif op == "extend":
        envelope.append(draw(hostile))
    try:
        return array_bytes(envelope)
    except (cbor2.CBOREncodeError, TypeError, ValueError):
        return encode([CANCEL, call_id])


@st.composite
def in_parts(draw: st.DrawFn, body: bytes) -> list[bytes]:
    """``body`` sent as ``part`` envelopes: with a transfer id of any kind, cut anywhere."""
    transfer = draw(st.one_of(st.integers(1, 2**63), cbor_values, st.none()))
    cut = draw(st.integers(0, len(body)))
    flags = draw(st.sampled_from([(0, 1), (0, 2), (1, 1), (0, 0)]))
    out = []
    for flag, chunk in zip(flags, (body[:cut], body[cut:]), strict=True):
        parts = [PART, flag, chunk] if transfer is None else [PART, flag, transfer, chunk]
        try:
            out.append(encode(parts))
        except (cbor2.CBOREncodeError, TypeError, ValueError):
            out.append(encode([PART, flag, chunk]))
    return out


# Call ids: small ones (the hostile caller's own come first), repeated ones, huge and negative.
call_ids = st.one_of(
    st.integers(1_000, 1_010), st.sampled_from([0, -1, 2**64 - 1, 2**63, BIG, -BIG])
)


@st.composite
def caller_attack(draw: st.DrawFn) -> list[bytes]:
    bodies: list[bytes] = []
    for _ in range(draw(st.integers(1, 6))):
        call_id = draw(call_ids)
        how = draw(st.sampled_from(["relay", "relay", "relay", "parts", "undecodable", "rpc"]))
        if how == "relay":
            bodies.append(draw(relay_envelope(call_id)))
        elif how == "parts":
            bodies += draw(in_parts(draw(relay_envelope(call_id))))
        elif how == "undecodable":
            shape = draw(st.sampled_from(["call", "keyed-call", "notify"]))
            bodies.append(encode(relay_shapes(call_id, draw(st.sampled_from(UNDECODABLE)))[shape]))
        else:  # what tests/test_fuzz.py sends any worker, at the relay
            kinds = ["call", "stream-call", "metadata-call", "notify", "cancel", "credit",
                     "result", "error", "item", "part-call-head", "part-call-tail"]  # fmt: skip
            bodies.append(draw(mutated_envelope(1_000, kinds)))
    return bodies


async def hostile_caller(env: Env, bodies: list[bytes]) -> None:
    gw = env.gw
    session = gw.fleet.executors()["box-1"].session
    malformed, _ = _worker_counts(env.worker)
    env.log.crashes.clear()
    env.log.warnings = 0
    env.sentinels += 1
    sentinel = f"sentinel-{env.sentinels}"
    note = encode([NOTIFY, RELAY, "notify",
                   ["box-1", "ident", "note", cbor2.dumps([[sentinel], {}])], {}])  # fmt: skip
    config = caller_config(env.tmp, "web-9", gw.url)
    with anyio.fail_after(DEADLINE):
        async with gl.connect_gateway(config, refresh_interval=60) as hostile:
            await hostile.gateway.wait_ready(10)
            rpc = hostile.gateway.current_rpc
            assert rpc is not None
            transport = rpc.transport
            for body in (*bodies, note):
                if len(body) + 64 < FRAME:  # a larger one goes in parts: tested above
                    await transport.send(body)
            # Every hostile body was dispatched before the sentinel, unless the gateway ended
            # the hostile caller's session (which the caller sees).
            await _until(
                lambda: f"note:{sentinel}" in env.box.ledger or rpc.retired, "the sentinel"
            )
            # While it is there, it holds no more of the gateway's session to box-1 than its
            # share (the hostile streams it opened included).
            share = int(LIMITS.max_pending_calls * LIMITS.gateway_caller_share)
            assert gw.fleet.executors()["box-1"].pending <= share
            # Nor more streams and calls in flight than its sessions' budget, nor more than
            # one watch per session.
            held = gw.callers()["web-9"]
            assert held.streams <= held.in_flight <= min(held.budget, share), held
            assert held.watches <= max(held.sessions, 0) <= 1, held
    # The hostile caller left: the gateway holds nothing of it, and box-1 served only what
    # parses as a call.
    await _until(lambda: "web-9" not in gw.caller_sessions(), "the session's end")

    def holds(snap: gl.CallerSnapshot) -> tuple[int, int, int]:
        return (snap.streams, snap.watches, snap.in_flight)

    await _until(lambda: holds(gw.callers()["web-9"]) == (0, 0, 0), "its streams and watch")
    await _until(lambda: gw.fleet.executors()["box-1"].pending == 0, "box-1's calls")
    await _until(lambda: _worker_counts(env.worker)[1] == 0, "box-1's handlers")
    # A call whose arguments do not match its method's types is the worker's to refuse (the
    # gateway knows no types); one it cannot even decode, the gateway refuses itself.
    assert _worker_counts(env.worker)[0] == malformed, "forwarded what box-1 cannot parse"
    assert len(gw.callers()) <= 2 * 8
    await _unaffected(env, session)


@fuzz("caller")
@given(bodies=caller_attack())
@example(bodies=[shape("call", payload=payload) for payload in UNDECODABLE])
@example(bodies=[shape("notify", payload=payload) for payload in UNDECODABLE])
@example(bodies=[shape("call", BIG), shape("call")])
@example(bodies=[shape("call", 2**64 + 7)])  # an id no CBOR head holds
@example(bodies=[shape("call", 2**64 + 7, b"")])
@example(bodies=[shape("call", i) for i in (1_000, 1_000, 999, 1_001)])
# An integer past a float's range where a float goes (describe's ``wait``, a call's timeout).
@example(bodies=[encode([CALL, 1_000, RELAY, "describe", ["box-1", 10**400], {}, 0, 0])])
@example(
    bodies=[
        encode(
            [
                CALL,
                1_000,
                RELAY,
                "call",
                ["box-1", "ident", "record", ARGS, None, 10**400],
                {},
                0,
                0,
            ]
        )
    ]
)
@example(
    bodies=[
        shape("watch"),
        shape("watch", 1_001),
        encode([CREDIT, 1_000, BIG, -BIG]),
        encode([CREDIT, 1_001, 2**64 - 1, 2**64 - 1]),
    ]
)
@example(
    bodies=[
        shape("stream"),
        encode([CREDIT, 1_000, 2**63, 2**63]),
        encode([CANCEL, 1_000]),
        encode([CANCEL, 1_000]),
    ]
)
def test_a_hostile_caller_never_breaks_the_gateway(
    env: tuple[anyio.from_thread.BlockingPortal, Env], bodies: list[bytes]
) -> None:
    portal, state = env
    portal.call(hostile_caller, state, bodies)


# --------------------------------------------------------------------------- a hostile executor

REPLY_KINDS = ["result", "error", "item", "end", "credit", "cancel", "call", "notify"]


def _raw_value(kind: int, raw: bytes, call_id: int) -> list[bytes]:
    return [b"\x83" + encode(kind) + encode(call_id) + raw]


def _items(count: int, call_id: int) -> list[bytes]:
    return [encode([ITEM, call_id, 7])] * count


def _other_id(delta: int, kind: int, tail: list[Any], call_id: int) -> list[bytes]:
    return [encode([kind, call_id + delta, *tail])]


def _mutated(body: bytes, marker: bytes, call_id: int) -> list[bytes]:
    return [body.replace(marker, encode(call_id), 1)]


PLACEHOLDER = 0x1234_5678
"""The id a mutated reply is drawn for, re-pointed at the real one when sent."""


@st.composite
def executor_attack(draw: st.DrawFn) -> tuple[bool, list[Callable[[int], list[bytes]]]]:
    """Whether the relayed call is a stream, and the replies box-2 sends, each built from the
    id the gateway gave the call (known only once it arrives)."""
    stream = draw(st.booleans())
    replies: list[Callable[[int], list[bytes]]] = []
    for _ in range(draw(st.integers(1, 5))):
        how = draw(
            st.sampled_from(
                ["mutated", "mutated", "raw-value", "past-credit", "other-id", "receipt"]
            )
        )
        if how == "mutated":  # tests/cbor_strategies.py's mutations of each reply kind
            body = draw(mutated_envelope(PLACEHOLDER, REPLY_KINDS))
            replies.append(functools.partial(_mutated, body, encode(PLACEHOLDER)))
        elif how == "raw-value":  # a result or an item whose value is not one CBOR item
            raw = draw(st.one_of(raw_items, st.binary(max_size=20), any_item.map(lambda b: b + b)))
            replies.append(functools.partial(_raw_value, ITEM if stream else RESULT, raw))
        elif how == "receipt":  # an error carrying a cancel receipt, for this call or another
            receipt = draw(st.one_of(cbor_values, hostile_scalars))
            error: dict[str, Any] = {"outcome": "unknown", "code": "CANCELLED", "message": "m"}
            error["cancel"] = receipt
            delta = draw(st.sampled_from([0, 0, 1, -1]))
            try:
                encode(error)
            except (cbor2.CBOREncodeError, TypeError, ValueError):
                error["cancel"] = None
            replies.append(functools.partial(_other_id, delta, ERROR, [error]))
        elif how == "past-credit":
            replies.append(functools.partial(_items, draw(st.integers(9, 40))))
        else:  # replies for calls it never got
            delta = draw(st.sampled_from([1, 2, -1, 1_000, BIG]))
            kind = draw(st.sampled_from([RESULT, ITEM, END, ERROR]))
            tail: list[Any] = []
            if kind == ERROR:
                tail = [{"outcome": "failed", "code": "X", "message": "m"}]
            elif kind != END:
                tail = [5]
            replies.append(functools.partial(_other_id, delta, kind, tail))
    return stream, replies


Replies = list[Callable[[int], list[bytes]]]


async def hostile_executor(env: Env, stream: bool, replies: Replies) -> None:
    gw = env.gw
    session = gw.fleet.executors()["box-1"].session
    held = env.held
    held.release, held.started = anyio.Event(), anyio.Event()
    errors = gw.fleet.executors()["box-2"].errors
    env.log.crashes.clear()
    env.log.warnings = 0
    outcome: list[Any] = []
    facade = gl.with_options(env.web2.executor("box-2").service("held", Held), timeout=3.0)

    async def call() -> None:
        try:
            if stream:
                outcome.append([item async for item in facade.items()])
            else:
                outcome.append(await facade.held())
        except gl.CallError as exc:
            outcome.append(exc)

    with anyio.fail_after(DEADLINE):
        await env.web2.executor("box-2").wait_ready(10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await held.started.wait()
            rpc = env.held_worker.current_rpc
            assert rpc is not None
            call_id = rpc.last_incoming_id
            for reply in replies:
                for body in reply(call_id):
                    if len(body) + 64 < FRAME:
                        await rpc.transport.send(body)
            held.release.set()
    assert len(outcome) == 1, outcome  # it ended, as a value or an honest CallError
    ended = outcome[0]
    if isinstance(ended, gl.OutcomeUnknown) and ended.code == "MALFORMED_REPLY":
        # The gateway read box-2's reply as unreadable itself (counted against box-2), rather
        # than passing it on for the caller to find the gateway's answer unreadable.
        assert gw.fleet.executors()["box-2"].errors > errors, ended
        assert "gateway" not in ended.message, ended
    await _until(lambda: gw.fleet.executors()["box-2"].pending == 0, "box-2's calls")
    await _unaffected(env, session)


@fuzz("executor")
@given(attack=executor_attack())
# Seeds: a result whose value is a lone break, two items, text that is not UTF-8, a tag; items
# past credit; an item that declares more text than it holds; replies for calls never made;
# a value nested 64 deep, which a caller reads one level further down, inside its outcome.
@example(attack=(False, [functools.partial(_raw_value, RESULT, b"\xff")]))
@example(attack=(False, [functools.partial(_raw_value, RESULT, b"\x81" * 64 + b"\x05")]))
@example(attack=(False, [functools.partial(_raw_value, RESULT, b"\x05\x05")]))
@example(attack=(False, [functools.partial(_raw_value, RESULT, b"\x62\xff\xfe")]))
@example(attack=(False, [functools.partial(_raw_value, RESULT, b"\xc1\x00")]))
@example(attack=(True, [functools.partial(_items, 40)]))
@example(attack=(True, [functools.partial(_raw_value, ITEM, b"\x7a\xff\xff\xff\xff")]))
@example(
    attack=(
        False,
        [functools.partial(_other_id, 1, RESULT, [5]), functools.partial(_other_id, 7, END, [])],
    )
)
def test_a_hostile_executor_gives_the_caller_an_honest_outcome(
    env: tuple[anyio.from_thread.BlockingPortal, Env],
    attack: tuple[bool, list[Callable[[int], list[bytes]]]],
) -> None:
    portal, state = env
    portal.call(hostile_executor, state, *attack)
