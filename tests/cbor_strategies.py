"""Hypothesis strategies for hostile CBOR: values of every major type, raw encodings cbor2 would
never write, and mutations of valid frames (hello, proof, packet sequences, RPC envelopes).

Two families:

* **Values** (:data:`cbor_values`): Python objects cbor2 can encode -- integers small, at every
  head-width edge, beyond 64 bits and beyond Python's 4,300-digit ``str()`` limit; bignum tags
  with magnitudes around :data:`~garcon_link.core.wire.MAX_BIGNUM_BYTES`; every tag cbor2 knows
  and some it does not; floats incl. NaN, infinities and -0.0; simple values and ``undefined``;
  short and long text and byte strings; arrays and maps (with odd keys: bytes, floats, null,
  arrays) nested around the decoder's depth limits. :func:`encode` turns one into bytes,
  canonically or not.
* **Nested parts** (:func:`nested_parts`): an envelope wrapped in ``part`` envelopes several
  levels deep, each level in one of the encodings a decoder accepts for a part, sent as one
  message or as the body of a transfer in several parts.
* **Raw items** (:data:`raw_items`): byte strings for what no encoder of values produces:
  indefinite lengths, non-shortest heads, declared lengths far beyond the data, truncations,
  lone breaks, reserved additional-info values and nesting far past any limit.

The frame strategies start from a *valid* frame and replace one part with one of the above:
:func:`mutated_hello` and :func:`mutated_proof` (handshake), :func:`mutated_packets` (a session
message), :func:`mutated_envelope` (an RPC envelope). A replaced part is spliced in as raw bytes
when it is a raw item, so the rest of the frame stays well-formed and the mutation reaches the
layer behind the decoder.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

import cbor2
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st

from garcon_link.core.wire import MAX_BIGNUM_BYTES, encode_message, encode_receipt

F = TypeVar("F", bound=Callable[..., Any])

SCALE = int(os.environ.get("GARCON_FUZZ_SCALE", "1"))
"""Multiplies every fuzzer's example count, for a longer campaign."""
SEED = os.environ.get("GARCON_FUZZ_SEED")
"""Replaces the seed Hypothesis derives from each test (``derandomize``) for another campaign."""


def fuzz_settings(examples: int) -> Callable[[F], F]:
    """Hypothesis settings for one fuzzer: ``examples`` x :data:`SCALE` examples, reproducible
    by default (:data:`SEED` for another run), no deadline and no example database."""

    def decorate(test: F) -> F:
        configured = settings(
            max_examples=examples * SCALE,
            derandomize=SEED is None,
            database=None,
            deadline=None,
            # No "explain" phase: it re-runs and parses source, which is slow and (CPython
            # 3.11.7) can fail with "AST constructor recursion depth mismatch" after a
            # RecursionError elsewhere in the run.
            phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.function_scoped_fixture,  # anyio_backend: a plain string
            ],
        )(test)
        return seed(int(SEED))(configured) if SEED is not None else configured

    return decorate


__all__ = [
    "KNOWN_TAGS",
    "PART_HEAD",
    "PART_HEADS",
    "any_item",
    "array_bytes",
    "cbor_values",
    "encode",
    "envelope_shapes",
    "head",
    "hostile_scalars",
    "huge_ints",
    "huge_names",
    "map_bytes",
    "mutated_envelope",
    "nested_parts",
    "mutated_hello",
    "mutated_packets",
    "mutated_proof",
    "raw_items",
    "Spliced",
]

# Every tag cbor2 6.x decodes itself (garcon_link.core.wire refuses them all in plain mode) and some
# it does not (24: embedded CBOR reaches the tag hook; large numbers; the self-describe tag).
KNOWN_TAGS = [0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261]
KNOWN_TAGS += [1004, 43000, 55799]
OTHER_TAGS = [6, 24, 32, 33, 34, 64, 1001, 9999, 2**32, 2**64 - 1]


def head(major: int, value: int, width: int | None = None) -> bytes:
    """A CBOR head; ``width`` forces an argument of 1/2/4/8 bytes (possibly non-shortest)."""
    if width is None:
        if value < 24:
            return bytes([major << 5 | value])
        width = next(w for w in (1, 2, 4, 8) if value < 1 << (8 * w))
    info = {1: 24, 2: 25, 4: 26, 8: 27}[width]
    return bytes([major << 5 | info]) + value.to_bytes(width, "big")


def encode(value: Any, canonical: bool = True) -> bytes:
    """cbor2's encoding of ``value``."""
    return cbor2.dumps(value, canonical=canonical)


# -- values ---------------------------------------------------------------------------------------

EDGE_INTS = [
    0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
    2**64, -1, -24, -25, -(2**63), -(2**64), -(2**64) - 1, 2**8184 - 1, 2**8192, -(2**8192),
]  # fmt: skip

huge_ints = st.builds(
    lambda digits, sign: sign * (10 ** (digits - 1) + 7),
    st.integers(min_value=4200, max_value=6000),
    st.sampled_from([1, -1]),
)
"""Integers around and beyond Python's 4,300-digit int-to-str limit (bignums of ~2 KiB)."""

ints = st.one_of(
    st.integers(min_value=-30, max_value=30),
    st.sampled_from(EDGE_INTS),
    st.integers(min_value=-(2**70), max_value=2**70),
    huge_ints,
)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308]),
)
WORDS = ["hello", "proof", "controller", "worker", "t", "mac", "calc", "add", "count", "$link"]
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(WORDS),
    st.integers(min_value=190, max_value=210).map(lambda n: "x" * n),
    st.integers(min_value=1, max_value=6000).map(lambda n: "\u00e9" * n),
)
blobs = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([15, 16, 17, 31, 32, 33]).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
    st.integers(min_value=1, max_value=6000).map(lambda n: b"\xab" * n),
)
simple_values = st.one_of(
    st.just(cbor2.undefined),
    st.sampled_from([0, 19, 32, 255]).map(cbor2.CBORSimpleValue),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, blobs, simple_values)

huge_names = st.builds(
    lambda n, piece: (piece * (n // len(piece) + 1))[:n],
    st.integers(min_value=1_000, max_value=300_000),
    st.sampled_from(["x", "calc'\n", "\u20ac\x00\\", "\U0001f600 ", "%s%d{}"]),
)
"""Huge text for a name field (service, method, kind, id, code, details, metadata key, executor
id): quotes, line breaks, control and non-ASCII characters and format directives repeated."""

bignum_tags = st.builds(
    cbor2.CBORTag,
    st.sampled_from([2, 3]),
    st.one_of(
        st.binary(max_size=12),
        st.sampled_from([MAX_BIGNUM_BYTES - 1, MAX_BIGNUM_BYTES, MAX_BIGNUM_BYTES + 1]).map(
            lambda n: b"\x01" + bytes(n - 1)
        ),
        st.text(max_size=4),
        st.integers(0, 5),
    ),
)

hashable_keys = st.one_of(
    texts, ints, st.binary(max_size=8), floats, st.none(), st.booleans(), st.tuples(ints, texts)
)


def nested(depth: int, leaf: Any = 0) -> Any:
    """``depth`` arrays around ``leaf``."""
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


deep_values = st.one_of(
    st.integers(min_value=58, max_value=70).map(nested),  # around the plain walk's 64 levels
    st.integers(min_value=395, max_value=405).map(nested),  # around cbor2's 400
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(hashable_keys, children, max_size=4),
        st.builds(cbor2.CBORTag, st.sampled_from(KNOWN_TAGS + OTHER_TAGS), children),
    )


cbor_values: st.SearchStrategy[Any] = st.one_of(
    st.recursive(st.one_of(scalars, bignum_tags), _containers, max_leaves=12),
    deep_values,
)
"""Values of every CBOR major type, hostile sizes and depths included."""


# -- raw items ------------------------------------------------------------------------------------


@st.composite
def _indefinite(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["array", "map", "bytes", "text", "unterminated"]))
    if kind == "array":
        items = draw(st.lists(cbor_values.map(encode), max_size=3))
        return b"\x9f" + b"".join(items) + b"\xff"
    if kind == "map":
        pairs = draw(st.lists(st.tuples(texts, cbor_values), max_size=3))
        return b"\xbf" + b"".join(encode(k) + encode(v) for k, v in pairs) + b"\xff"
    if kind == "bytes":
        chunks = draw(st.lists(st.binary(max_size=8), max_size=3))
        return b"\x5f" + b"".join(encode(c) for c in chunks) + b"\xff"
    if kind == "text":
        pieces = draw(st.lists(st.text(max_size=8), max_size=3))
        return b"\x7f" + b"".join(encode(p) for p in pieces) + b"\xff"
    return draw(st.sampled_from([b"\x9f", b"\xbf", b"\x5f", b"\x7f", b"\x9f\x01"]))


@st.composite
def _non_shortest(draw: st.DrawFn) -> bytes:
    major = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6]))
    value = draw(st.integers(min_value=0, max_value=23))
    width = draw(st.sampled_from([1, 2, 4, 8]))
    tail = {2: b"\x00" * value, 3: b"a" * value, 4: b"\x00" * value, 5: b"\x00\x00" * value}
    return head(major, value, width) + tail.get(major, b"\x00" if major == 6 else b"")


@st.composite
def _declared_too_long(draw: st.DrawFn) -> bytes:
    major = draw(st.sampled_from([2, 3, 4, 5]))
    length = draw(st.sampled_from([1000, 2**16, 2**31, 2**40, 2**63, 2**64 - 1]))
    return head(major, length) + draw(st.binary(max_size=16))


@st.composite
def _truncated(draw: st.DrawFn) -> bytes:
    data = encode(draw(cbor_values))
    return data[: draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))]


raw_items: st.SearchStrategy[bytes] = st.one_of(
    _indefinite(),
    _non_shortest(),
    _declared_too_long(),
    _truncated(),
    st.sampled_from(
        [
            b"\xff",  # a lone break
            b"\x1c",  # reserved additional information
            b"\x3d",
            b"\xfc",
            b"\xf8\x10",  # a simple value in two bytes that fits one
            b"\xf9\x7e\x00",  # half-precision NaN
            b"\xf9\x7c\x00",  # half-precision infinity
            b"\x81" * 100_000 + b"\x00",  # nesting far past every limit
            b"\x9f" * 100_000,
            b"\xd8\x18" * 50_000 + b"\x00",  # tag 24 (unknown to cbor2) 50,000 deep
            b"\xc2" + head(2, MAX_BIGNUM_BYTES * 8) + b"\x01" * (MAX_BIGNUM_BYTES * 8),
        ]
    ),
    cbor_values.map(lambda v: encode(v, canonical=False)),
)
"""Encodings cbor2 never writes for a value, and nonsense."""

any_item: st.SearchStrategy[bytes] = st.one_of(
    cbor_values.map(encode), cbor_values.map(lambda v: encode(v, False)), raw_items
)
"""One CBOR item (or an attempt at one) as bytes."""


# -- splicing raw items into valid frames ---------------------------------------------------------


class Spliced:
    """A raw item that :func:`map_bytes`/:func:`array_bytes` write as is, in place of a value."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Spliced({self.data[:40]!r}{'...' if len(self.data) > 40 else ''})"


def _item(value: Any) -> bytes:
    return value.data if isinstance(value, Spliced) else encode(value)


def map_bytes(mapping: dict[Any, Any]) -> bytes:
    """A map in deterministic order (cbor2's canonical key order) whose values may be
    :class:`Spliced` raw items; a canonical map when none is."""
    pairs = sorted(
        ((encode(k), _item(v)) for k, v in mapping.items()), key=lambda p: (len(p[0]), p[0])
    )
    return head(5, len(pairs)) + b"".join(k + v for k, v in pairs)


def array_bytes(items: list[Any]) -> bytes:
    """An array whose items may be :class:`Spliced` raw items."""
    return head(4, len(items)) + b"".join(_item(i) for i in items)


hostile_scalars: st.SearchStrategy[Any] = st.one_of(
    huge_ints,
    huge_ints,
    bignum_tags,
    st.sampled_from(EDGE_INTS),
    deep_values,
    st.integers(min_value=100_000, max_value=2_000_000).map(lambda n: "x" * n),
    st.integers(min_value=100_000, max_value=2_000_000).map(lambda n: b"x" * n),
    huge_names,
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0]),
    simple_values,
    st.builds(cbor2.CBORTag, st.sampled_from(KNOWN_TAGS + OTHER_TAGS), scalars),
)
"""The classes that broke things before: weighted up so that short campaigns reach them."""

replacement_values: st.SearchStrategy[Any] = st.one_of(
    cbor_values, hostile_scalars, hostile_scalars, raw_items.map(Spliced)
)
"""What replaces one part of a valid frame: a hostile scalar half of the time, else any value or
raw bytes."""


# -- handshake frames -----------------------------------------------------------------------------


@st.composite
def mutated_hello(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """``valid`` (a hello map) with one to three keys replaced, added or removed."""
    hello: dict[Any, Any] = dict(valid)
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):
        op = draw(st.sampled_from(["replace", "replace", "replace", "add", "delete"]))
        if op == "replace":
            hello[draw(st.sampled_from(sorted(valid)))] = draw(replacement_values)
        elif op == "add":
            hello[draw(hashable_keys)] = draw(replacement_values)
        else:
            hello.pop(draw(st.sampled_from(sorted(valid))), None)
    try:
        return map_bytes(hello)
    except (cbor2.CBOREncodeError, TypeError, ValueError):  # a key cbor2 cannot encode
        return encode(valid)


@st.composite
def mutated_proof(draw: st.DrawFn) -> bytes:
    """A proof map with its mac (or its shape) replaced."""
    proof: dict[Any, Any] = {"t": "proof", "mac": bytes(32)}
    op = draw(st.sampled_from(["mac", "mac", "t", "add", "whole"]))
    if op == "whole":
        return draw(any_item)
    if op == "add":
        proof[draw(hashable_keys)] = draw(replacement_values)
    else:
        proof[op] = draw(replacement_values)
    try:
        return map_bytes(proof)
    except (cbor2.CBOREncodeError, TypeError, ValueError):
        return encode(proof)


# -- session packets ------------------------------------------------------------------------------


@st.composite
def mutated_packets(draw: st.DrawFn, offered: int = 3, bound: int = 1024) -> bytes:
    """One WebSocket message for a session that accepted nothing and offered ``offered`` frames:
    a valid sequence (messages 1..n, receipts <= offered) with one mutation applied. Mutations
    replace a packet by an arbitrary item or a packet with one field replaced, insert, duplicate
    or truncate, or repeat a packet up to just past ``bound`` times."""
    n = draw(st.integers(min_value=0, max_value=5))
    packets = [encode_message(i, draw(st.binary(max_size=12))) for i in range(1, n + 1)]
    packets.insert(
        draw(st.integers(0, len(packets))), encode_receipt(draw(st.integers(0, offered)))
    )
    op = draw(
        st.sampled_from(
            ["field", "field", "field", "item", "insert", "duplicate", "truncate", "repeat", "none"]
        )
    )
    index = draw(st.integers(min_value=0, max_value=len(packets) - 1))
    if op == "field":
        shape = draw(st.sampled_from(["message", "receipt"]))
        value = draw(replacement_values)
        if shape == "message":
            fields: list[Any] = [0, index + 1, b"body"]
            fields[draw(st.integers(0, 2))] = value
        else:
            fields = [1, 0]
            fields[draw(st.integers(0, 1))] = value
        packets[index] = array_bytes(fields)
    elif op == "item":
        packets[index] = draw(any_item)
    elif op == "insert":
        packets.insert(index, draw(any_item))
    elif op == "duplicate":
        packets.insert(index, packets[index])
    elif op == "repeat":
        packets[index:index] = [packets[index]] * draw(
            st.sampled_from([bound - 2, bound - 1, bound, bound + 1, 2 * bound])
        )
    data = b"".join(packets)
    if op == "truncate":
        data = data[: draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))]
    return data


# -- RPC envelopes --------------------------------------------------------------------------------

CALL, RESULT, ERROR, CANCEL, NOTIFY, ITEM, END, CREDIT, PART = range(9)


def envelope_shapes(call_id: int) -> dict[str, list[Any]]:
    """A valid envelope of every kind naming ``call_id`` (a ``calc`` service is assumed).

    The ``part`` shapes (garcon_link.rpc.chunks) carry a ``call`` or a ``result`` naming ``call_id``
    cut in two: a first part (more follow), the last part, and an abort."""
    call = cbor2.dumps([CALL, call_id, "calc", "add", [2, 3], {}, 0, 0])
    result = cbor2.dumps([RESULT, call_id, 5])
    return {
        "part-call-head": [PART, 0, call[:4]],
        "part-call-tail": [PART, 1, call[4:]],
        "part-result-head": [PART, 0, result[:2]],
        "part-result-tail": [PART, 1, result[2:]],
        "part-abort": [PART, 2, b""],
        "call": [CALL, call_id, "calc", "add", [2, 3], {}, 0, 0],
        "stream-call": [CALL, call_id, "calc", "count", [3], {}, 16, 1 << 20],
        "metadata-call": [CALL, call_id, "calc", "add", [2, 3], {}, 0, 0, None, {"k": "v"}],
        "metadata-notify": [NOTIFY, "calc", "note", ["text"], {}, {"k": "v"}],
        "result": [RESULT, call_id, 5],
        "error": [ERROR, call_id, {"outcome": "failed", "code": "X", "message": "m"}],
        "cancel": [CANCEL, call_id],
        "notify": [NOTIFY, "calc", "note", ["text"], {}],
        "item": [ITEM, call_id, 1],
        "end": [END, call_id],
        "credit": [CREDIT, call_id, 4, 4096],
    }


@st.composite
def mutated_envelope(draw: st.DrawFn, call_id: int, kinds: list[str]) -> bytes:
    """A valid envelope of one of ``kinds`` naming ``call_id``, with one part changed: an element
    replaced (inside the error body too), the array cut or extended, or the whole item replaced."""
    envelope = list(envelope_shapes(call_id)[draw(st.sampled_from(kinds))])
    op = draw(
        st.sampled_from(["element", "element", "element", "body", "cut", "extend", "whole", "name"])
    )
    if op == "whole":
        return draw(any_item)
    if op == "name":  # a huge name where the dispatch reads one
        name = draw(huge_names)
        if envelope[0] == ERROR:
            body: dict[Any, Any] = dict(envelope[2])
            body[draw(st.sampled_from(["code", "message", "details", "remote_type"]))] = name
            envelope[2] = body
        elif envelope[0] in (CALL, NOTIFY) and len(envelope) in (6, 10) and draw(st.booleans()):
            key_or_value = draw(st.booleans())
            envelope[-1] = {name: "v"} if key_or_value else {"k": name}  # metadata
        else:
            fields = {CALL: [0, 1, 2, 3], NOTIFY: [0, 1, 2]}.get(envelope[0], [0, 1])
            envelope[draw(st.sampled_from(fields))] = name  # kind, id / stream id, names
        return encode(envelope)
    if op == "cut":
        envelope = envelope[: draw(st.integers(0, len(envelope) - 1))]
    elif op == "extend":
        envelope.append(draw(replacement_values))
    elif op == "body" and envelope[0] == ERROR:
        body = dict(envelope[2])
        body[draw(st.sampled_from(["outcome", "code", "message", "remote_type", "traceback"]))] = (
            draw(replacement_values)
        )
        envelope[2] = Spliced(map_bytes(body))
    else:
        # The kind and the id steer the dispatch: each is replaced as often as all others.
        position = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, len(envelope) - 1)))
        envelope[min(position, len(envelope) - 1)] = draw(replacement_values)
    try:
        return array_bytes(envelope)
    except (cbor2.CBOREncodeError, TypeError, ValueError):
        return encode(envelope_shapes(call_id)["cancel"])


# -- nested parts ---------------------------------------------------------------------------------

PART_HEAD = bytes((0x83, PART))
"""How a part begins in the encoding garcon_link.chunks writes (and its reassembler checks)."""
PART_HEADS = (PART_HEAD, bytes((0x84, PART)))
"""How a part begins, without and with a transfer id (both checked before a body is joined)."""


def _wrapped(flags: int, chunk: bytes, encoding: str) -> bytes:
    """``[8, flags, chunk]`` in one of the encodings a CBOR decoder reads as a part."""
    if encoding == "canonical":
        return PART_HEAD + bytes((flags,)) + head(2, len(chunk)) + chunk
    if encoding == "wide-chunk-head":  # still read without a copy (any head width)
        return PART_HEAD + bytes((flags,)) + head(2, len(chunk), 8) + chunk
    if encoding == "indefinite-chunk":
        return PART_HEAD + bytes((flags, 0x5F)) + encode(chunk) + b"\xff"
    if encoding == "wide-flags":
        return PART_HEAD + head(0, flags, 1) + encode(chunk)
    if encoding == "wide-array-head":
        return head(4, 3, 1) + bytes((PART, flags)) + encode(chunk)
    if encoding == "wide-kind":
        return b"\x83" + head(0, PART, 2) + bytes((flags,)) + encode(chunk)
    if encoding == "with-transfer":  # [8, flags, transfer, chunk]
        return bytes((0x84, PART, flags)) + head(0, 7) + head(2, len(chunk)) + chunk
    assert encoding == "bignum-kind"  # tag 2: an integer decode_item admits
    return b"\x83\xc2\x41" + bytes((PART, flags)) + encode(chunk)


PART_ENCODINGS = [
    "canonical",
    "canonical",
    "wide-chunk-head",
    "indefinite-chunk",
    "wide-flags",
    "wide-array-head",
    "wide-kind",
    "bignum-kind",
    "with-transfer",
]


@st.composite
def nested_parts(draw: st.DrawFn, inner: list[bytes]) -> tuple[list[bytes], bytes]:
    """One attack with nested parts: ``(messages, body)``.

    ``body`` is one of ``inner`` (valid envelopes the receiver would act on) or junk, wrapped in
    1 to 8 levels of ``part`` (each level's flags and encoding drawn; the outermost is final).
    ``messages`` are the session message bodies that carry it: ``body`` alone (a transfer of
    one part), or ``body`` cut into 2 or 3 non-empty canonical parts (a transfer whose body is
    a part). A receiver that keeps to the rules refuses either as one violation and never
    unwraps a level, so it feeds each message to its reassembler once and nothing more."""
    body = draw(st.one_of(st.sampled_from(inner), st.binary(min_size=1, max_size=64)))
    levels = draw(st.integers(1, 8))
    for level in range(levels):
        flags = 1 if level == levels - 1 else draw(st.sampled_from([1, 1, 1, 0, 2]))
        body = _wrapped(flags, body, draw(st.sampled_from(PART_ENCODINGS)))
    count = draw(st.sampled_from([1, 1, 2, 3]))
    if count == 1:
        return [body], body
    cuts = draw(st.sets(st.integers(1, len(body) - 1), min_size=count - 1, max_size=count - 1))
    bounds = [0, *sorted(cuts), len(body)]
    pieces = [body[bounds[k] : bounds[k + 1]] for k in range(count)]
    messages = [PART_HEAD + b"\x00" + head(2, len(p)) + p for p in pieces[:-1]]
    messages.append(PART_HEAD + b"\x01" + head(2, len(pieces[-1])) + pieces[-1])
    return messages, body
