"""Every bound of garcon_link in one frozen value object.

No buffer in the library is unbounded: each one is sized by a field below, and each field is
checked *before* memory is allocated (a frame's declared size before reading it, a send's encoded
size before an ordinal is assigned). Times are in seconds (floats), sizes in bytes.

Tests and benchmarks shrink the time bounds (``Limits(heartbeat_interval=0.05, ...)``) instead of
sleeping; :meth:`Limits.replace` returns a validated copy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError

__all__ = ["Limits"]

MiB = 1024 * 1024


def _doc(
    text: str,
    *,
    maximum: float | None = None,
    minimum: float | None = None,
    unit: str | None = None,
) -> dict[str, Any]:
    """A field's metadata: its documentation, bounds beyond "positive and finite", and the unit
    of a float that is not seconds (``"per second"``; ``""`` for a fraction)."""
    meta: dict[str, Any] = {"doc": text}
    if unit is not None:
        meta["unit"] = unit
    if maximum is not None:
        meta["max"] = maximum
    if minimum is not None:
        meta["min"] = minimum
    return meta


_SPANS = {60: "a minute", 600: "10 minutes", 3600: "an hour", 86400: "a day", 604800: "a week"}


def _span(seconds: float) -> str:
    """``seconds`` in words: ``an hour``, ``30 days``, ``30 s``."""
    if seconds in _SPANS:
        return _SPANS[int(seconds)]
    if seconds % 86400 == 0:
        return f"{int(seconds) // 86400} days"
    return f"{_number(seconds)} s"


def _seconds(text: str, *, maximum: float, minimum: float | None = None) -> dict[str, Any]:
    """A duration's metadata (:func:`_doc`): every duration has a maximum, which its
    documentation states (a longer one would read as "never", and is refused at load)."""
    return _doc(f"{text} At most {_span(maximum)}.", maximum=maximum, minimum=minimum)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds of one endpoint. All fields are keyword arguments with safe defaults."""

    max_retained_frames: int = field(
        default=4096,
        metadata=_doc("Outbound frames kept until a cumulative receipt covers them."),
    )
    max_retained_bytes: int = field(
        default=32 * MiB,
        metadata=_doc("Encoded bytes of retained outbound frames; a full store makes send wait."),
    )
    max_inbound_buffer_payloads: int = field(
        default=4096,
        metadata=_doc(
            "Inbound payloads buffered before the peer's replay fence on one attachment "
            "(pre-readiness); at least the peer's `max_retained_frames`, so its replay fits."
        ),
    )
    max_inbound_buffer_bytes: int = field(
        default=32 * MiB,
        metadata=_doc(
            "Bytes of inbound payloads buffered before the replay fence on one attachment; "
            "at least the peer's `max_retained_bytes`, so its replay fits."
        ),
    )
    max_frame_bytes: int = field(
        default=16 * MiB,
        metadata=_doc("Largest WebSocket message accepted or sent; larger is refused (1009)."),
    )
    detached_grace: float = field(
        default=30.0,
        metadata=_seconds(
            "How long a logical session survives without a socket before retirement.",
            maximum=86_400,
        ),
    )
    replay_inactivity: float = field(
        default=30.0,
        metadata=_seconds(
            "Replay deadline, refreshed only by replay progress (not by heartbeats).", maximum=3_600
        ),
    )
    handshake_timeout: float = field(
        default=5.0,
        metadata=_seconds(
            "Whole handshake deadline, from socket open to verified proof and admission (a "
            "takeover probe included).",
            maximum=600,
        ),
    )
    max_handshake_frame_bytes: int = field(
        default=8 * 1024,
        metadata=_doc("Largest handshake frame (hello or proof)."),
    )
    heartbeat_interval: float = field(
        default=5.0,
        metadata=_seconds(
            "A socket's dialer pings after this long without an inbound frame (its listener "
            "after 1.5 times as long): an idle socket carries one ping and pong per interval.",
            maximum=3_600,
        ),
    )
    heartbeat_timeout: float = field(
        default=15.0,
        metadata=_seconds(
            "Close the socket (resumably) after this long without any inbound frame.",
            maximum=86_400,
        ),
    )
    takeover_probe_timeout: float = field(
        default=2.0,
        metadata=_seconds(
            "How long the attached socket may take to answer a probe before takeover; below "
            "handshake_timeout, which the probe runs under.",
            maximum=600,
        ),
    )
    connect_timeout: float = field(
        default=5.0,
        metadata=_seconds("TCP (and TLS) connect deadline of one dial attempt.", maximum=600),
    )
    backoff_base: float = field(
        default=0.25,
        metadata=_seconds(
            "First non-immediate dial backoff ceiling; doubles per failed attempt.", maximum=3_600
        ),
    )
    backoff_max: float = field(
        default=30.0,
        metadata=_seconds("Ceiling of the full-jitter exponential dial backoff.", maximum=86_400),
    )
    backoff_reset_after: float = field(
        default=10.0,
        metadata=_seconds(
            "A socket that stayed attached this long resets the backoff.", maximum=86_400
        ),
    )
    max_unauthenticated_sockets: int = field(
        default=64,
        metadata=_doc(
            "Sockets still in HTTP upgrade or handshake; past it the oldest one waiting for its "
            "peer is evicted (while every one waits in the handshake line, connections wait in "
            "the kernel's backlog instead)."
        ),
    )
    handshake_steps_per_turn: int = field(
        default=4,
        metadata=_doc(
            "Handshake steps (answering an upgrade request, a hello, a proof with the admission "
            "or resume it leads to) a listener runs per event-loop turn, alongside the turn's "
            "authenticated traffic; the others wait for later turns (asyncio), at most a tenth "
            "of handshake_timeout. A reconnect storm then delays established sessions by this "
            "many steps' work per turn at most. Lost authenticated sockets' teardowns wait in "
            "a line of their own, as many per turn.",
            maximum=1024,
        ),
    )
    handshake_seconds_per_turn: float = field(
        default=0.0002,
        metadata=_seconds(
            "Time a listener spends per event-loop turn on handshake steps, and as much on "
            "teardowns: fewer than handshake_steps_per_turn (at least one) go through when the "
            "steps it measured take longer.",
            maximum=1.0,
        ),
    )
    handshake_busy_share: float = field(
        default=0.8,
        metadata=_doc(
            "While several handshakes wait their turn, a listener lets the next steps through "
            "only once its event loop's thread has been on the CPU at most this fraction of the "
            "time since the last ones went through: a storm of reconnects gets what the "
            "established sessions leave, up to this share, and lasts longer (a lone handshake "
            "is never held, nor the line while seven eighths of max_unauthenticated_sockets "
            "are open, and each step still waits at most a tenth of handshake_timeout; past "
            "that cap the listener evicts no socket waiting in this line, and stops accepting "
            "while every one does). 1: no hold.",
            maximum=1.0,
            minimum=0.1,
            unit="",
        ),
    )
    max_authenticated_sockets: int = field(
        default=4,
        metadata=_doc(
            "Sockets attached to a session at once, beyond one per executor a keyring listener "
            "serves (one per controller a listening worker serves); past it an upgrade is "
            "answered 503. A socket still being admitted counts as "
            "unauthenticated; at most this many detached sockets wait for the peer's close frame "
            "(others are closed without waiting)."
        ),
    )
    max_controllers: int = field(
        default=16,
        metadata=_doc(
            "Controllers a worker holds a logical session for at once (one each; a controller "
            "is its controller_id, by default its runtime); the next one takes the place of the "
            "session detached the longest (EVICTED), or is refused (1013) when every place has "
            "a live socket. At most 4096.",
            maximum=4096,
        ),
    )
    receipt_interval: int = field(
        default=64,
        metadata=_doc("At most this many inbound messages are accepted between two receipts."),
    )
    receipt_bytes: int = field(
        default=256 * 1024,
        metadata=_doc(
            "A receipt is sent at once (not after receipt_delay) once this many inbound body "
            "bytes were accepted since the last one: a bulk transfer's pacing waits for it."
        ),
    )
    receipt_delay: float = field(
        default=0.005,
        metadata=_seconds(
            "How long a lone, non-urgent receipt waits to share a message with frames.", maximum=60
        ),
    )
    delivery_queue: int = field(
        default=256,
        metadata=_doc("Payloads queued for the consumer task; a full queue pauses the reader."),
    )
    max_pending_calls: int = field(
        default=256,
        metadata=_doc("Outgoing calls awaiting a reply per session; excess is OVERLOADED."),
    )
    max_incoming_calls: int = field(
        default=256,
        metadata=_doc("Incoming calls and streams executing per session; excess is OVERLOADED."),
    )
    call_timeout: float = field(
        default=120.0,
        metadata=_seconds(
            "Default deadline of one call; expiry raises OutcomeUnknown('TIMEOUT').",
            maximum=604_800,
        ),
    )
    stalled_call_report: float = field(
        default=5.0,
        metadata=_seconds(
            "A controller whose session lost its socket logs one WARNING when calls still wait "
            "for replies after this long (the worker unreachable, the last dial error), rather "
            "than only when detached_grace ends them; at most once per executor per "
            "log_interval.",
            maximum=86_400,
        ),
    )
    dispatch_deadline: float = field(
        default=0.0,
        metadata=_seconds(
            "How long a call waits for a reconnecting executor; 0 fails at once.", maximum=86_400
        ),
    )
    stream_window_items: int = field(
        default=256,
        metadata=_doc("Stream credit granted by a consumer, in items."),
    )
    stream_window_bytes: int = field(
        default=8 * MiB,
        metadata=_doc("Stream credit granted by a consumer, in encoded bytes."),
    )
    scope_cleanup_timeout: float = field(
        default=2.0,
        metadata=_seconds(
            "Best-effort wait for a retired session's service scope to close.", maximum=3_600
        ),
    )
    close_timeout: float = field(
        default=2.0,
        metadata=_seconds(
            "How long a closing socket waits for the peer's close frame.", maximum=600
        ),
    )
    # hostile-input bounds (codec)
    max_packets_per_message: int = field(
        default=1024,
        metadata=_doc(
            "Session packets in one inbound WebSocket message; more retires the session (4008). "
            "The writer never coalesces more."
        ),
    )
    # hostile-input bounds (rpc)
    max_queued_refusals: int = field(
        default=1024,
        metadata=_doc(
            "Refused calls whose error reply waits for retention capacity; at this many the "
            "socket reader pauses until they drain."
        ),
    )
    # hostile-input bounds (link)
    max_message_fragments: int = field(
        default=1024,
        metadata=_doc(
            "Frames (fragments) one WebSocket message may span; more is refused (1009). Our "
            "writer sends one frame per message; 1,024 lets a 16 MiB message arrive in 16 KiB "
            "pieces."
        ),
    )
    max_handshake_frames: int = field(
        default=16,
        metadata=_doc(
            "Frames of any kind (data, ping, pong) a socket may send before it is authenticated; "
            "one more closes it (4008). A handshake needs two (hello and proof)."
        ),
    )
    frame_rate: int = field(
        default=20_000,
        metadata=_doc(
            "Sustained inbound frames per second of one authenticated socket (control frames "
            "included); beyond it (and the burst) the socket is read more slowly, never closed."
        ),
    )
    frame_burst: int = field(
        default=4096,
        metadata=_doc(
            "Frames an authenticated socket may send at once above frame_rate (the token "
            "bucket's size); must exceed max_handshake_frames."
        ),
    )
    max_upgrade_headers: int = field(
        default=100,
        metadata=_doc("Header fields of an HTTP upgrade request; more is refused (400)."),
    )
    max_total_retained_bytes: int = field(
        default=1024 * 1024 * 1024,
        metadata=_doc(
            "Retention across all sessions of a link or fleet; full is back-pressure (each "
            "session may still hold one frame beyond it)."
        ),
    )
    key_recheck_interval: float = field(
        default=5.0,
        metadata=_seconds(
            "A keyring listener re-reads an attached executor's key this often: how long a "
            "revoked executor stays attached.",
            maximum=3_600,
        ),
    )
    log_interval: float = field(
        default=60.0,
        metadata=_seconds(
            "What a peer makes us log is logged at most once per this many seconds per peer and "
            "reason (the rest counted, the next line says how many); unauthenticated failures "
            "log at INFO plus one WARNING summary per interval.",
            maximum=86_400,
        ),
    )
    max_log_lines: int = field(
        default=100,
        metadata=_doc(
            "Lines one such rate-limited log writes per log_interval, all peers together: many "
            "addresses or sessions buy no more lines."
        ),
    )
    # idempotency keys (worker side, one table per worker process; docs/design.md#idempotency)
    idempotency_max_entries: int = field(
        default=10_000,
        metadata=_doc(
            "Calls remembered by idempotency key, running or finished; finished ones are evicted "
            "oldest first, and a table full of running ones refuses new keys (OVERLOADED)."
        ),
    )
    idempotency_max_bytes: int = field(
        default=64 * MiB,
        metadata=_doc(
            "Bytes of remembered keyed calls (keys, names and recorded replies); evicts finished "
            "entries oldest first."
        ),
    )
    idempotency_max_age: float = field(
        default=3600.0,
        metadata=_seconds(
            "A finished keyed call is forgotten this long after it finished; the same key then "
            "runs again.",
            maximum=2_592_000,
        ),
    )
    state_write_timeout: float = field(
        default=10.0,
        metadata=_seconds(
            "With a state directory, how long a keyed call waits for its journal entry to be "
            "committed before it is refused unrun (NotDispatched STATE_UNAVAILABLE), and for its "
            "outcome before its reply is sent unrecorded (a restart then answers "
            "WORKER_RESTARTED).",
            maximum=3_600,
        ),
    )
    cancel_grace: float = field(
        default=1.0,
        metadata=_seconds(
            "After a call's timeout sends cancel, how long the caller waits for the worker's "
            "answer (its result, or whether the handler had started) before OutcomeUnknown.",
            maximum=3_600,
        ),
    )
    # call metadata (garcon_link.hooks)
    max_metadata_entries: int = field(
        default=16,
        metadata=_doc(
            "Entries of a call's metadata (a text-to-text map sent with the call): more is "
            "NotDispatched(INVALID_METADATA) for the caller, Rejected(INVALID_METADATA) from a "
            "peer."
        ),
    )
    max_metadata_bytes: int = field(
        default=4096,
        metadata=_doc(
            "UTF-8 bytes of a call's metadata keys and values together; bounded like "
            "max_metadata_entries."
        ),
    )

    # type descriptions in the manifest (garcon_link.rpc.typedoc): documentation, not contract
    described_types: int = field(
        default=64,
        metadata=_doc(
            "Named types (dataclass, TypedDict, msgspec.Struct, NamedTuple, enum) a worker "
            "describes per service for `describe`, nearest to the methods first; the rest are "
            "counted, not described. A controller drops a description that lists more."
        ),
    )
    type_description_bytes: int = field(
        default=64 * 1024,
        metadata=_doc(
            "Largest type description of one service (encoded CBOR): a worker sends a larger one "
            "without its JSON Schema, or not at all; a controller drops a larger one it "
            "receives. Either way `describe` says so and the contract is unaffected."
        ),
    )
    type_description_depth: int = field(
        default=32,
        metadata=_doc(
            "Deepest nesting of maps and arrays in one service's type description (its JSON "
            "Schema included); bounded like type_description_bytes."
        ),
    )
    type_descriptions_total_bytes: int = field(
        default=1 * MiB,
        metadata=_doc(
            "Largest sum of the type descriptions of all a worker's services in one describe "
            "answer (encoded CBOR): the services past it, in name order, are sent with a note "
            "instead, as are those that would take the answer over max_frame_bytes; a "
            "controller keeps descriptions up to this sum and a note for the rest. `describe` "
            "says which were left out; the contract is unaffected."
        ),
    )

    # bulk transfers in parts (garcon_link.chunks)
    bulk_chunk_bytes: int = field(
        default=256 * 1024,
        metadata=_doc(
            "An envelope body longer than this (a call's arguments, a result, a stream item, a "
            "notification) is sent as parts of about this size (below 1.5 times), so small calls "
            "interleave with it instead of waiting for the whole transfer."
        ),
    )
    bulk_window_bytes: int = field(
        default=1 * MiB,
        metadata=_doc(
            "A transfer in parts sends its next part only while fewer than this many bytes of "
            "ours await the peer's receipts: at most about this much bulk is ahead of a small "
            "call (one chunk while small messages are sent alongside)."
        ),
    )
    bulk_transfers: int = field(
        default=4,
        metadata=_doc(
            "Transfers in parts one direction of a session runs at once, taking turns part by "
            "part (a further one waits for a slot). This side tells its peer its own count, "
            "and each sends at most the smaller of its own and the peer's; a peer sending one "
            "more has it refused. A receiver holds up to this many partial bodies (each up to "
            "max_frame_bytes), plus one from a peer that does not number its transfers.",
            maximum=64,
        ),
    )

    # contracts (garcon_link.rpc.contract)
    max_manifest_bytes: int = field(
        default=1 * MiB,
        metadata=_doc(
            "Canonical CBOR bytes of a worker's services manifest, as described for a new "
            "session or announced on a running one when it adds or removes a service: a larger "
            "description is refused (the session is not installed), a larger announcement "
            "dropped (the manifest stays as it was)."
        ),
    )

    # the gateway (garcon_link.api.gateway, and a caller's garcon_link.api.relay)
    gateway_forbidden_rate: float = field(
        default=50.0,
        metadata=_doc(
            "FORBIDDEN answers per second a gateway gives one caller once its burst "
            "(gateway_forbidden_burst) is spent; each answer past it waits its turn, so a caller "
            "asking for what no grant allows slows itself down, not the gateway.",
            maximum=1_000_000,
            unit="per second",
        ),
    )
    gateway_forbidden_burst: int = field(
        default=100,
        metadata=_doc(
            "FORBIDDEN answers a gateway gives one caller at once, before "
            "gateway_forbidden_rate paces them.",
            maximum=1_000_000,
        ),
    )
    gateway_forbidden_delay: float = field(
        default=1.0,
        metadata=_seconds(
            "The longest pause before one paced FORBIDDEN answer (the pause holds one of the "
            "caller's own handler slots); keep it well below the callers' call timeouts.",
            maximum=30.0,
        ),
    )
    gateway_caller_share: float = field(
        default=0.25,
        metadata=_doc(
            "The fraction of a gateway's session to one executor (max_pending_calls calls and "
            "streams in flight) one caller may hold; past it the caller's next call to that "
            "executor is NotDispatched(OVERLOADED), not forwarded. At least one call each.",
            maximum=1.0,
            unit="",
        ),
    )
    gateway_contended_window: int = field(
        default=16,
        metadata=_doc(
            "Calls and streams in flight to one executor that the callers active on it share "
            "evenly while there are two or more (each gets this divided by their number, at "
            "least one, at most its gateway_caller_share); past it a caller's next call there "
            "is NotDispatched(OVERLOADED), not forwarded. A lone caller keeps its whole share. "
            "A call waits at the executor behind about this many of the other callers' calls.",
            maximum=1_000_000,
        ),
    )
    gateway_active_window: float = field(
        default=0.5,
        metadata=_seconds(
            "Seconds a caller still counts as active on an executor (for "
            "gateway_contended_window) after its last call or stream there ended: a caller "
            "making one call after another stays active between them.",
            maximum=60.0,
        ),
    )
    gateway_stream_window_items: int = field(
        default=8,
        metadata=_doc(
            "Stream credit, in items, a gateway keeps granted the executor of each relayed "
            "stream while its caller is the only one active there (the caller grants the "
            "gateway its own stream_window_items): what one stream may have queued on the "
            "executor's session ahead of other callers' replies. Beside other callers it is "
            "scaled by the caller's share now over its whole share (at least 1), and grows "
            "back as they go idle.",
            maximum=1_000_000,
        ),
    )
    gateway_refresh_interval: float = field(
        default=5.0,
        metadata=_seconds(
            "A gateway caller's (gl.connect_gateway) seconds between two snapshots of the "
            "executors it may see, from a gateway without watch (a current one pushes each "
            "change); each costs the gateway one entry per such executor.",
            minimum=0.01,
            maximum=3600.0,
        ),
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"Limits.{f.name} must be a number, got {value!r}")
            if f.type == "int" and not isinstance(value, int):
                raise ConfigError(f"Limits.{f.name} must be an integer, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"Limits.{f.name} must be finite, got {value!r}")
            minimum = 0 if f.name == "dispatch_deadline" else None
            if minimum is not None:
                if value < minimum:
                    raise ConfigError(f"Limits.{f.name} must be >= 0, got {value!r}")
            elif value <= 0:
                raise ConfigError(f"Limits.{f.name} must be > 0, got {value!r}")
            low, high = f.metadata.get("min"), f.metadata.get("max")
            if low is not None and value < low:
                raise ConfigError(
                    f"Limits.{f.name} must be at least {_number(low)}, got {value!r} "
                    f"(default {f.default!r})"
                )
            if high is not None and value > high:
                seconds = f.type == "float" and "unit" not in f.metadata
                within = f" ({_span(high)})" if seconds else ""
                raise ConfigError(
                    f"Limits.{f.name} must be at most {_number(high)}{within}, got {value!r} "
                    f"(default {f.default!r})"
                )
        if self.max_frame_bytes > self.max_retained_bytes:
            raise ConfigError(
                "Limits.max_frame_bytes must not exceed max_retained_bytes "
                f"({self.max_frame_bytes} > {self.max_retained_bytes}): a maximal frame must fit"
            )
        if self.max_handshake_frame_bytes > self.max_frame_bytes:
            raise ConfigError("Limits.max_handshake_frame_bytes must not exceed max_frame_bytes")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                "Limits.heartbeat_timeout must exceed heartbeat_interval "
                f"({self.heartbeat_timeout} <= {self.heartbeat_interval})"
            )
        if self.takeover_probe_timeout >= self.handshake_timeout:
            # Admission, the probe included, runs under the handshake deadline: a probe as long
            # as the deadline would end every takeover in a timeout.
            raise ConfigError(
                "Limits.takeover_probe_timeout must be below handshake_timeout "
                f"({self.takeover_probe_timeout} >= {self.handshake_timeout})"
            )
        if self.log_interval < 1.0:
            # Below a second the rate limit of peer-triggered log lines would not limit much:
            # max_log_lines per interval would again grow with the attacker's rate.
            raise ConfigError(
                f"Limits.log_interval must be at least 1 second, got {self.log_interval!r}"
            )
        if self.backoff_base > self.backoff_max:
            raise ConfigError("Limits.backoff_base must not exceed backoff_max")
        if self.max_packets_per_message < 2:
            raise ConfigError(
                "Limits.max_packets_per_message must be >= 2 (a frame and its receipt share a "
                f"message), got {self.max_packets_per_message!r}"
            )
        if self.max_queued_refusals <= self.max_pending_calls:
            # A peer configured alike (at most max_pending_calls calls out, each refused at most
            # once) must never meet it: at the bound the reader pauses, and the receipts that
            # would drain the backlog then wait unread.
            raise ConfigError(
                "Limits.max_queued_refusals must exceed max_pending_calls "
                f"({self.max_queued_refusals} <= {self.max_pending_calls})"
            )
        if self.bulk_chunk_bytes < 1024:
            # The first part holds the envelope's head (a call's id is read from it).
            raise ConfigError(
                f"Limits.bulk_chunk_bytes must be at least 1024, got {self.bulk_chunk_bytes!r}"
            )
        if self.max_handshake_frames >= self.frame_burst:
            raise ConfigError(
                "Limits.max_handshake_frames must be below frame_burst "
                f"({self.max_handshake_frames} >= {self.frame_burst}): an unauthenticated socket "
                "gets a strictly smaller share of the loop than an authenticated one"
            )

    def replace(self, **changes: Any) -> Limits:
        """Return a validated copy with ``changes`` applied.

        Raises:
            ConfigError: an unknown field name or an invalid value.
        """
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"unknown Limits field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Return ``{field name: documentation}`` for every bound (used by docs and the CLI)."""
        return {f.name: str(f.metadata.get("doc", "")) for f in fields(cls)}
