"""Handshake: hello/proof transcript, keyed-BLAKE3 proofs, resume decision (sans-IO).

Theory of operation
-------------------
Before a socket carries session packets both ends prove knowledge of the shared secret and agree on
whether they continue an existing logical session (*resume*) or start a fresh one. There is no
initiator: as soon as the socket is open each side sends its :class:`Hello` (one canonical CBOR map
per WebSocket message, docs/design.md#handshake)::

    {"t": "hello", "protocol": 1, "package": str, "role": "controller" | "worker",
     "executor": str, "runtime": bytes16, "peer_runtime": bytes16 | null,
     "session": bytes32 | null, "received": uint64, "nonce": bytes32}

plus, in a controller's hello only, an optional ``"controller": str`` (1..200 characters): the
controller's configured ``controller_id``. A listening worker holds one logical session per
controller (docs/design.md#many-controllers) and tells controllers apart by it, or by ``runtime``
when it is absent (the default: two processes are two controllers). A hello without it is
byte-for-byte the version-1 hello, so the published test vector is unchanged; being in the hello,
it is in the transcript and so covered by both proofs.

``runtime`` is the sender's per-process random id; ``session``/``peer_runtime``/``received``
advertise the logical session it currently holds (a :class:`ResumeOffer`), or null/null/0 when it
holds none; ``nonce`` is 32 fresh random bytes per handshake. On the peer's valid hello each side
answers with ``{"t": "proof", "mac": bytes32}`` and then waits for the peer's proof.

This object only turns bytes into bytes and decisions: it owns no socket, reads no clock (the
adapter enforces the 5 s deadline and maps it to ``TIMEOUT``) and draws no randomness (``runtime``
and ``nonce`` are passed in). It does not log; the adapter logs the closure cause of every failure.
The adapter must send :meth:`Handshake.hello_frame` before feeding any peer frame to
:meth:`Handshake.receive`, so that the peer always sees our hello before our proof.

The hello does not depend on the key: a listener that serves many executors may build its
handshake without one (``key=None``), send its hello, and only then look the claimed executor's
key up (:meth:`Handshake.set_key`), so that looking a key up -- found or not -- happens at the same
point of the exchange and the hello goes out after the same work for every claimed id.

Transcript and MAC rule
-----------------------
``K = blake3(secret, derive_key_context="garcon-link 1 handshake")`` (:func:`derive_key`, 32 bytes;
the secret must be at least 32 bytes). For a ``purpose``::

    transcript(purpose) = canonical_cbor(
        ["garcon-link/1", purpose, [controller_hello, worker_hello]])
    mac(purpose) = blake3(transcript(purpose), key=K)        (32 bytes)

The hellos are the wire maps re-encoded from the *parsed* values (deterministic CBOR as cbor2
``canonical=True`` writes it: shortest heads, definite lengths, map keys sorted shortest first),
ordered by role -- not by arrival -- so both sides build identical bytes whatever order the frames
crossed in. Every handshake frame must itself be in that encoding (``MALFORMED`` otherwise): this
rules out duplicate map keys, indefinite lengths and other encodings two parsers could read
differently, so what the peer MACed is exactly what we parsed. A proof is ``mac(sender's role)``;
we verify the peer's proof with ``mac(peer's role)`` using a constant-time compare. Consequences:

- a wrong secret fails (``AUTH_FAILED``);
- a *reflected* proof (ours sent back to us) fails, because its purpose is our role, not the
  peer's;
- a proof recorded from another handshake fails, because our fresh nonce is in the transcript;
- any change to either hello in transit (roles, version, executor, runtimes, resume position,
  nonces) makes both proofs fail.

Resume rule
-----------
After both proofs verified, with ``L`` our hello and ``P`` the peer's::

    resume = L.session is not None and L.session == P.session
             and L.peer_runtime == P.runtime and P.peer_runtime == L.runtime

i.e. both advertise the same session and each still talks to the very process (runtime) it held
that session with. The rule is symmetric in ``L`` and ``P``, so both sides reach the same decision
from the same two hellos. ``session_id`` is the shared id when resuming, otherwise
``mac("session")``: both sides derive the same fresh id without another round trip, nobody without
``K`` can predict it, and the purpose differs from both proof purposes so it is never a valid
proof. Whether the advertised ``received`` positions are replayable is the session layer's
decision (``RESUME_REFUSED``), made on :attr:`HandshakeResult.peer`.

State machine
-------------
::

    AWAIT_HELLO --valid peer hello / send our proof--> AWAIT_PROOF
    AWAIT_PROOF --peer proof verifies / result set---> DONE
    any state   --refused frame / raise HandshakeError-> FAILED

``hello_frame()`` may be called in every state but FAILED and always returns the same bytes. Any
frame in DONE is refused (``UNEXPECTED``): after the handshake frames belong to the session. A
failure is sticky (a broken machine stays broken): the state becomes FAILED and every later call
raises the same exception object again. Only :class:`~garcon_link.errors.HandshakeError` (incl.
:class:`~garcon_link.errors.AuthenticationError`) escapes :meth:`Handshake.receive`; decoder
errors are mapped here with ``raise ... from``, and so is *any other* exception raised while a
peer frame is processed (``MALFORMED``, "unexpected ... while processing the peer's frame",
chained ``from`` it): whatever a peer sends fails this handshake, never the caller. Invalid
*local* arguments (short secret, wrong runtime length, ...) are programming errors and raise
:class:`ValueError` at construction.

Hostile input
-------------
Nothing a peer sends costs more than a bounded amount of work before it is refused. The size is
checked before decoding; the decoder refuses every semantic tag, bignums included
(``decode_item(..., bignums=False)``: the grammar has no integer beyond ``2**64-1``), so every
integer reaching the checks below fits 64 bits (plus sign) and no tag makes cbor2 build or
compute anything; then the frame must re-encode to itself (deterministic encoding, at most
8 KiB). Error details describe peer values with :func:`~garcon_link.logs.peer_text`, which
never raises and renders a bounded, escaped prefix (a few dozen characters here).

Failure reasons (:class:`~garcon_link.errors.HandshakeFailure`) and their close codes
-------------------------------------------------------------------------------------
====================  ======  ===========================================================
reason                code    raised when
====================  ======  ===========================================================
``OVERSIZE``          1009    a frame is over ``max_frame_bytes`` (checked before decoding)
``MALFORMED``         4008    not exactly one CBOR item in deterministic encoding; not a
                              map; unknown or missing key; a value of the wrong type, length
                              or range (a bignum anywhere); a bad proof shape; any other
                              exception while processing a peer frame
``UNEXPECTED``        4008    a proof before the peer's hello; a second hello; any frame
                              after DONE
``VERSION_MISMATCH``  4002    the peer's ``protocol`` is a (64-bit) integer other than 1 (checked
                              before the other keys, so a future version is named as such)
``ROLE_CONFLICT``     4003    both hellos claim the same role (including a reflected hello)
``EXECUTOR_MISMATCH`` 4003    the peer names another ``executor`` than ours
``AUTH_FAILED``       4001    the peer's proof does not verify: wrong secret, reflected proof,
                              tampered transcript (raised as ``AuthenticationError``)
====================  ======  ===========================================================

``TIMEOUT``, ``SUPERSEDED`` and ``RESUME_REFUSED`` are decided by the adapter and the session
layer, not here.

Test vector
-----------
``tests/test_handshake.py::test_published_vector`` fixes a secret (``bytes(range(32))``), two
runtimes, two nonces and one resume offer, writes both hello maps out literally and pins the hex of
the derived key, the canonical transcript, both proofs and the fresh session id. Any other
implementation of this protocol must reproduce those bytes exactly.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass
from typing import Any, TypeGuard

import blake3

from ..errors import AuthenticationError, HandshakeError, HandshakeFailure, MalformedFrame
from ..logs import peer_text
from ..version import __version__
from .wire import MAX_ORDINAL, Role, decode_item, encode_canonical

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "KEY_BYTES",
    "KEY_CONTEXT",
    "MAC_BYTES",
    "MAX_NAME_CHARS",
    "MIN_SECRET_BYTES",
    "NONCE_BYTES",
    "PROOF_LABEL",
    "PROTOCOL_VERSION",
    "RUNTIME_BYTES",
    "SESSION_ID_BYTES",
    "SESSION_PURPOSE",
    "Handshake",
    "HandshakeResult",
    "HandshakeState",
    "Hello",
    "ResumeOffer",
    "compute_mac",
    "decide_resume",
    "derive_key",
    "listener_offer",
    "peek_hello",
    "transcript",
]

PROTOCOL_VERSION = 1
PROOF_LABEL = "garcon-link/1"
KEY_CONTEXT = "garcon-link 1 handshake"

MIN_SECRET_BYTES = 32
KEY_BYTES = 32
RUNTIME_BYTES = 16
SESSION_ID_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_NAME_CHARS = 200
DEFAULT_MAX_FRAME_BYTES = 8 * 1024

SESSION_PURPOSE = "session"
_PURPOSES = frozenset({Role.CONTROLLER.value, Role.WORKER.value, SESSION_PURPOSE})

_HELLO_KEYS = frozenset(
    {
        "t",
        "protocol",
        "package",
        "role",
        "executor",
        "runtime",
        "peer_runtime",
        "session",
        "received",
        "nonce",
    }
)
_OPTIONAL_HELLO_KEYS = frozenset({"controller"})
_PROOF_KEYS = frozenset({"t", "mac"})


class HandshakeState(enum.Enum):
    """Where a :class:`Handshake` is; see the module docstring for the transitions."""

    AWAIT_HELLO = "await_hello"
    AWAIT_PROOF = "await_proof"
    DONE = "done"
    FAILED = "failed"


def derive_key(secret: bytes) -> bytes:
    """Derive the 32-byte handshake key ``K`` from the shared secret.

    Args:
        secret: the configured secret, at least 32 bytes.

    Returns:
        ``blake3(secret, derive_key_context=KEY_CONTEXT)``, 32 bytes.

    Raises:
        ValueError: the secret is shorter than 32 bytes.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret must be at least {MIN_SECRET_BYTES} bytes")
    return blake3.blake3(bytes(secret), derive_key_context=KEY_CONTEXT).digest()


# -- value checks shared by local construction (ValueError) and peer input (MALFORMED) -------------


def _check_key(key: object) -> None:
    if type(key) is not bytes or len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes (use derive_key)")


def _is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (CBOR has distinct booleans; Python's bool is an int)."""
    return type(value) is int


def _check_text(name: str, value: object, *, allow_empty: bool) -> None:
    if type(value) is not str:
        raise ValueError(f"{name} must be a text string, not {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{name} is longer than {MAX_NAME_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not encodable as UTF-8") from None


def _check_bytes(name: str, value: object, length: int, *, nullable: bool) -> None:
    if value is None and nullable:
        return
    if type(value) is not bytes:
        raise ValueError(f"{name} must be a byte string, not {type(value).__name__}")
    if len(value) != length:
        raise ValueError(f"{name} must be {length} bytes, not {len(value)}")


def _check_received(value: object) -> None:
    if not _is_int(value):
        raise ValueError(f"received must be an integer, not {type(value).__name__}")
    if not 0 <= value <= MAX_ORDINAL:
        raise ValueError("received must be in 0 .. 2**64-1")


@dataclass(frozen=True, slots=True)
class Hello:
    """One side's hello. Constructing it validates every field (:class:`ValueError` otherwise).

    Attributes:
        protocol: the sender's protocol version (:data:`PROTOCOL_VERSION`).
        package: free-form implementation name and version, at most 200 characters.
        role: the sender's role.
        executor: the executor id both sides are configured with; 1..200 characters.
        runtime: the sender's per-process runtime id, 16 bytes.
        peer_runtime: runtime of the peer the sender's current session was held with, or None.
        session: the sender's current logical session id (32 bytes), or None.
        received: highest ordinal the sender accepted in its current session (0 when none).
        nonce: 32 fresh random bytes for this handshake.
        controller: a controller's ``controller_id`` (1..200 characters), or None (a worker's
            hello, or a controller known by its runtime); absent from the wire map when None.
    """

    protocol: int
    package: str
    role: Role
    executor: str
    runtime: bytes
    peer_runtime: bytes | None
    session: bytes | None
    received: int
    nonce: bytes
    controller: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.protocol) or self.protocol < 0:
            raise ValueError("protocol must be a non-negative integer")
        _check_text("package", self.package, allow_empty=True)
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, not {type(self.role).__name__}")
        _check_text("executor", self.executor, allow_empty=False)
        _check_bytes("runtime", self.runtime, RUNTIME_BYTES, nullable=False)
        _check_bytes("peer_runtime", self.peer_runtime, RUNTIME_BYTES, nullable=True)
        _check_bytes("session", self.session, SESSION_ID_BYTES, nullable=True)
        _check_received(self.received)
        _check_bytes("nonce", self.nonce, NONCE_BYTES, nullable=False)
        if self.controller is not None:
            _check_text("controller", self.controller, allow_empty=False)
            if self.role is not Role.CONTROLLER:
                raise ValueError("only a controller's hello names a controller")

    def to_wire(self) -> dict[str, Any]:
        """The hello as the plain map that is sent and MACed."""
        wire: dict[str, Any] = {
            "t": "hello",
            "protocol": self.protocol,
            "package": self.package,
            "role": self.role.value,
            "executor": self.executor,
            "runtime": self.runtime,
            "peer_runtime": self.peer_runtime,
            "session": self.session,
            "received": self.received,
            "nonce": self.nonce,
        }
        if self.controller is not None:
            wire["controller"] = self.controller
        return wire

    @classmethod
    def from_wire(cls, obj: object) -> Hello:
        """Parse a decoded hello map strictly.

        ``"t"`` and ``"protocol"`` are checked before the key set, so a peer speaking a future
        version with different keys is refused as ``VERSION_MISMATCH``, not ``MALFORMED``.

        Args:
            obj: the decoded CBOR item.

        Returns:
            The validated hello.

        Raises:
            HandshakeError: ``VERSION_MISMATCH`` for an integer ``protocol`` other than 1;
                ``MALFORMED`` for anything else that is not exactly a version-1 hello.
        """
        if type(obj) is not dict:
            raise HandshakeError(HandshakeFailure.MALFORMED, "a hello must be a CBOR map")
        kind = obj.get("t")
        if type(kind) is not str or kind != "hello":
            raise HandshakeError(HandshakeFailure.MALFORMED, f"not a hello (t={peer_text(kind)})")
        if "protocol" not in obj:
            raise HandshakeError(HandshakeFailure.MALFORMED, "hello without a protocol version")
        protocol = obj["protocol"]
        if not _is_int(protocol):
            raise HandshakeError(
                HandshakeFailure.MALFORMED,
                f"protocol must be an integer, not {peer_text(protocol)}",
            )
        if protocol != PROTOCOL_VERSION:
            raise HandshakeError(
                HandshakeFailure.VERSION_MISMATCH,
                f"peer speaks protocol {peer_text(protocol)}, we speak {PROTOCOL_VERSION}",
            )
        keys = set(obj)
        if not _HELLO_KEYS <= keys <= _HELLO_KEYS | _OPTIONAL_HELLO_KEYS:
            unknown = sorted(peer_text(k, 30) for k in keys - _HELLO_KEYS - _OPTIONAL_HELLO_KEYS)[
                :5
            ]
            missing = sorted(_HELLO_KEYS - keys)
            parts = []
            if unknown:
                parts.append(f"unknown key(s) {', '.join(unknown)}")
            if missing:
                parts.append(f"missing key(s) {', '.join(missing)}")
            raise HandshakeError(HandshakeFailure.MALFORMED, "hello has " + "; ".join(parts))
        role = obj["role"]
        if type(role) is not str or role not in (Role.CONTROLLER.value, Role.WORKER.value):
            raise HandshakeError(HandshakeFailure.MALFORMED, f"unknown role {peer_text(role)}")
        if "controller" in obj and obj["controller"] is None:
            # Absent means none; a null would re-encode without the key and so MAC differently.
            raise HandshakeError(HandshakeFailure.MALFORMED, "controller must be a text string")
        try:
            return cls(
                protocol=protocol,
                package=obj["package"],
                role=Role(role),
                executor=obj["executor"],
                runtime=obj["runtime"],
                peer_runtime=obj["peer_runtime"],
                session=obj["session"],
                received=obj["received"],
                nonce=obj["nonce"],
                controller=obj.get("controller"),
            )
        except ValueError as exc:
            raise HandshakeError(HandshakeFailure.MALFORMED, f"hello: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ResumeOffer:
    """What a side advertises about the logical session it currently holds.

    Attributes:
        session_id: the session's id, 32 bytes.
        peer_runtime: runtime id (16 bytes) of the peer the session was held with.
        received: highest inbound ordinal accepted in that session, 0 .. 2**64-1.
    """

    session_id: bytes
    peer_runtime: bytes
    received: int

    def __post_init__(self) -> None:
        _check_bytes("session_id", self.session_id, SESSION_ID_BYTES, nullable=False)
        _check_bytes("peer_runtime", self.peer_runtime, RUNTIME_BYTES, nullable=False)
        _check_received(self.received)


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    """The outcome of a verified handshake.

    Attributes:
        local: the hello we sent.
        peer: the peer's verified hello (``peer.received`` is where replay to it resumes).
        resume: True when both sides continue ``session_id``; False for a fresh session.
        session_id: the logical session's id, 32 bytes, identical on both sides.
    """

    local: Hello
    peer: Hello
    resume: bool
    session_id: bytes


def transcript(purpose: str, a: Hello, b: Hello) -> bytes:
    """The canonical bytes that are MACed for ``purpose``.

    Args:
        purpose: ``"controller"``, ``"worker"`` (a proof by that role) or ``"session"``.
        a: one hello.
        b: the other hello; the two must have different roles. Argument order does not matter:
            the transcript orders them controller first.

    Raises:
        ValueError: unknown purpose or equal roles.
    """
    if purpose not in _PURPOSES:
        raise ValueError(f"unknown MAC purpose {purpose!r}")
    if a.role is b.role:
        raise ValueError("a transcript needs one controller hello and one worker hello")
    controller, worker = (a, b) if a.role is Role.CONTROLLER else (b, a)
    return encode_canonical([PROOF_LABEL, purpose, [controller.to_wire(), worker.to_wire()]])


def compute_mac(key: bytes, purpose: str, a: Hello, b: Hello) -> bytes:
    """Keyed BLAKE3 of :func:`transcript`; 32 bytes. ``key`` is the output of :func:`derive_key`."""
    return blake3.blake3(transcript(purpose, a, b), key=key).digest()


def decide_resume(local: Hello, peer: Hello) -> bool:
    """The resume rule: same advertised session and runtimes that cross-match. Symmetric."""
    return (
        local.session is not None
        and local.session == peer.session
        and local.peer_runtime == peer.runtime
        and peer.peer_runtime == local.runtime
    )


def listener_offer(peer: Hello, held: ResumeOffer | None, runtime: bytes) -> ResumeOffer | None:
    """The resume offer a listener may put in its hello, given the dialer's unverified hello.

    Args:
        peer: the dialer's hello (not yet authenticated).
        held: the session the listener holds for the executor ``peer`` claims, or None.
        runtime: the listener's own runtime id.

    Returns:
        ``held`` if the dialer's hello already names it -- the same session id, ``runtime`` as its
        ``peer_runtime`` and ``held.peer_runtime`` as its ``runtime``: then the resume rule holds
        for the two hellos -- else None, exactly as for an executor the listener does not know.
    """
    if (
        held is not None
        and peer.session == held.session_id
        and peer.peer_runtime == runtime
        and peer.runtime == held.peer_runtime
    ):
        return held
    return None


def _frame_kind(obj: object) -> str | None:
    """The ``"t"`` of a decoded frame if it is a map with a text ``"t"``, else None."""
    if type(obj) is dict:
        kind = obj.get("t")
        if type(kind) is str:
            return kind
    return None


def _parse_proof(obj: object) -> bytes:
    if type(obj) is not dict or set(obj) != _PROOF_KEYS or obj["t"] != "proof":
        raise HandshakeError(
            HandshakeFailure.MALFORMED, 'a proof must be exactly {"t": "proof", "mac": bytes32}'
        )
    mac = obj["mac"]
    if type(mac) is not bytes or len(mac) != MAC_BYTES:
        raise HandshakeError(
            HandshakeFailure.MALFORMED,
            f"proof mac must be {MAC_BYTES} bytes, not {peer_text(mac)}",
        )
    return mac


def _decode_frame(data: bytes, max_frame_bytes: int) -> object:
    """One handshake frame's CBOR item, refused unless small and deterministically encoded."""
    size = len(data)
    if size > max_frame_bytes:  # before decoding anything
        raise HandshakeError(HandshakeFailure.OVERSIZE, f"{size} bytes > {max_frame_bytes}")
    try:
        # No bignums: every integer of the grammar fits 64 bits, so nothing larger is ever
        # built, compared or described (a 4,300-digit one cannot even be printed).
        obj = decode_item(data, max_frame_bytes, bignums=False)
    except MalformedFrame as exc:
        raise HandshakeError(HandshakeFailure.MALFORMED, str(exc)) from exc
    # Only the deterministic encoding is accepted: it rules out duplicate map keys and other
    # encodings two parsers could read differently (the MAC covers the re-encoded values).
    if encode_canonical(obj) != data:
        raise HandshakeError(
            HandshakeFailure.MALFORMED, "frame is not deterministically encoded CBOR"
        )
    return obj


def peek_hello(data: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Hello:
    """The peer's hello, parsed and checked but not yet authenticated.

    A listener that serves many executors reads the executor id the dialer *claims* here, builds
    its :class:`Handshake` (its resume offer from :func:`listener_offer`, no key yet) and sends
    its own hello -- echoing the claimed id, so nothing of its own identity leaves before the
    peer has proved its key -- then looks up that executor's key (:meth:`Handshake.set_key`) and
    feeds the same frame to :meth:`Handshake.receive`, which checks it again. Nothing in the
    result may be trusted until the handshake is DONE.

    Raises:
        HandshakeError: the frame is not a well-formed hello (``OVERSIZE``, ``MALFORMED``,
            ``UNEXPECTED`` for a proof, ``VERSION_MISMATCH``). Nothing else, for any input.
    """
    try:
        obj = _decode_frame(
            data if type(data) is bytes else memoryview(data).tobytes(), max_frame_bytes
        )
        if _frame_kind(obj) == "proof":
            raise HandshakeError(HandshakeFailure.UNEXPECTED, "proof before the peer's hello")
        return Hello.from_wire(obj)
    except HandshakeError:
        raise
    except Exception as exc:
        raise HandshakeError(
            HandshakeFailure.MALFORMED,
            f"unexpected {type(exc).__name__} while processing the peer's frame",
        ) from exc


class Handshake:
    """One side of one handshake on one socket (sans-IO, single-use).

    Args:
        role: our role.
        executor_id: the executor id both sides must be configured with.
        key: the 32-byte handshake key from :func:`derive_key`, or None to give it later with
            :meth:`set_key` (the hello does not depend on it; :meth:`receive` needs it).
        runtime: our runtime id, 16 bytes (per process start; generated by the adapter).
        nonce: 32 fresh random bytes for this handshake (generated by the adapter).
        resume: the logical session we hold, or None.
        package: implementation name sent in the hello; default ``"garcon-link <version>"``.
        max_frame_bytes: largest handshake frame accepted (8 KiB by default).
        controller: our ``controller_id`` (a controller's hello only; None: known by runtime).

    Raises:
        ValueError: an argument is out of range, or our own hello would exceed the frame limit.
    """

    def __init__(
        self,
        *,
        role: Role,
        executor_id: str,
        key: bytes | None,
        runtime: bytes,
        nonce: bytes,
        resume: ResumeOffer | None,
        package: str | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        controller: str | None = None,
    ) -> None:
        if key is not None:
            _check_key(key)
        if not _is_int(max_frame_bytes) or max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be a positive integer")
        if package is None:
            package = f"garcon-link {__version__}"
        self._local = Hello(
            protocol=PROTOCOL_VERSION,
            package=package,
            role=Role(role),
            executor=executor_id,
            runtime=runtime,
            peer_runtime=resume.peer_runtime if resume is not None else None,
            session=resume.session_id if resume is not None else None,
            received=resume.received if resume is not None else 0,
            nonce=nonce,
            controller=controller,
        )
        self._key: bytes | None = key
        self._max_frame_bytes = max_frame_bytes
        self._hello_frame = encode_canonical(self._local.to_wire())
        if len(self._hello_frame) > max_frame_bytes:
            raise ValueError(
                f"our hello is {len(self._hello_frame)} bytes, over the {max_frame_bytes}-byte "
                "handshake frame limit"
            )
        self._state = HandshakeState.AWAIT_HELLO
        self._peer: Hello | None = None
        self._result: HandshakeResult | None = None
        self._error: HandshakeError | None = None

    def __repr__(self) -> str:
        # Never the key.
        return (
            f"<Handshake role={self._local.role.value} executor={self._local.executor!r} "
            f"state={self._state.name}>"
        )

    @property
    def state(self) -> HandshakeState:
        """The current state."""
        return self._state

    @property
    def local_hello(self) -> Hello:
        """The hello we send."""
        return self._local

    @property
    def peer_hello(self) -> Hello | None:
        """The peer's hello once it was accepted (still set after a later failure, for logs)."""
        return self._peer

    @property
    def result(self) -> HandshakeResult | None:
        """The verified outcome; not None exactly when the state is DONE."""
        return self._result if self._state is HandshakeState.DONE else None

    @property
    def error(self) -> HandshakeError | None:
        """The stored failure once the state is FAILED."""
        return self._error

    def hello_frame(self) -> bytes:
        """Our hello as one canonical CBOR item; send it as soon as the socket is open.

        Raises:
            HandshakeError: the stored failure, once the handshake failed.
        """
        if self._error is not None:
            raise self._error
        return self._hello_frame

    def set_key(self, key: bytes) -> None:
        """Give the key of a handshake built with ``key=None``; before the first :meth:`receive`.

        Raises:
            ValueError: not 32 bytes, or the handshake already has a key.
        """
        if self._key is not None:
            raise ValueError("the handshake already has a key")
        _check_key(key)
        self._key = key

    def receive(self, data: bytes) -> bytes | None:
        """Feed one binary WebSocket message from the peer.

        Args:
            data: the whole message.

        Returns:
            Our proof frame (send it) when ``data`` was the peer's valid hello; None when it was
            the peer's valid proof (the state is now DONE and :attr:`result` is set).

        Raises:
            AuthenticationError: the peer's proof did not verify.
            HandshakeError: the frame was refused; ``reason`` says why (module docstring table).
                Sticky: every later call raises the same object. Nothing else is raised: any
                other exception while processing the frame becomes ``MALFORMED``.
            RuntimeError: no key yet (:meth:`set_key`): a programming error, not the peer's.
        """
        if self._error is not None:
            raise self._error
        if self._key is None:
            raise RuntimeError("the handshake has no key: call set_key() before receive()")
        try:
            return self._receive(data if type(data) is bytes else memoryview(data).tobytes())
        except HandshakeError as exc:
            self._fail(exc)
            raise
        except Exception as exc:
            # Whatever a peer frame provokes is that peer's failure, never the caller's: a bug
            # or a library error reached through hostile input fails this handshake like a
            # malformed frame (and stays failed).
            error = HandshakeError(
                HandshakeFailure.MALFORMED,
                f"unexpected {type(exc).__name__} while processing the peer's frame",
            )
            self._fail(error)
            raise error from exc

    def _fail(self, error: HandshakeError) -> None:
        self._error = error
        self._state = HandshakeState.FAILED

    def _receive(self, data: bytes) -> bytes | None:
        if self._state is HandshakeState.DONE:
            raise HandshakeError(HandshakeFailure.UNEXPECTED, "frame after the handshake completed")
        obj = _decode_frame(data, self._max_frame_bytes)
        kind = _frame_kind(obj)
        if self._state is HandshakeState.AWAIT_HELLO:
            if kind == "proof":
                raise HandshakeError(HandshakeFailure.UNEXPECTED, "proof before the peer's hello")
            return self._on_hello(Hello.from_wire(obj))
        if kind == "hello":
            raise HandshakeError(HandshakeFailure.UNEXPECTED, "second hello")
        self._on_proof(_parse_proof(obj))
        return None

    def _on_hello(self, peer: Hello) -> bytes:
        local = self._local
        if peer.role is local.role:
            raise HandshakeError(
                HandshakeFailure.ROLE_CONFLICT, f"both sides are {local.role.value}"
            )
        if peer.executor != local.executor:
            raise HandshakeError(
                HandshakeFailure.EXECUTOR_MISMATCH,
                f"peer expects executor {peer_text(peer.executor)}, we are {local.executor!r}",
            )
        self._peer = peer
        self._state = HandshakeState.AWAIT_PROOF
        assert self._key is not None  # receive() checks it
        mac = compute_mac(self._key, local.role.value, local, peer)
        return encode_canonical({"t": "proof", "mac": mac})

    def _on_proof(self, mac: bytes) -> None:
        local, peer = self._local, self._peer
        assert peer is not None  # AWAIT_PROOF is entered only with the peer's hello
        assert self._key is not None  # receive() checks it
        expected = compute_mac(self._key, peer.role.value, local, peer)
        if not hmac.compare_digest(mac, expected):
            raise AuthenticationError("wrong secret, reflected proof or tampered transcript")
        resume = decide_resume(local, peer)
        if resume:
            assert local.session is not None
            session_id = local.session
        else:
            session_id = compute_mac(self._key, SESSION_PURPOSE, local, peer)
        self._result = HandshakeResult(local=local, peer=peer, resume=resume, session_id=session_id)
        self._state = HandshakeState.DONE
