"""Whole small binary frames read and written without wsproto's per-frame machinery.

A call's messages are small, whole, binary WebSocket frames, and wsproto spends more on each
(a buffer, a header object, a masker object, two generators, a message decoder and an event) than
the rest of the socket path together. :class:`FastFrames` handles exactly that case itself, and
only while wsproto holds no state the frame could depend on: the connection open, no event
queued, no partial frame buffered, no fragmented message under way, no extension (none is ever
negotiated: :mod:`.ws`). Everything else -- any other opcode, a reserved bit, a fragment, a
length in a longer form than needed, the wrong masking for the side, a frame split across reads
or a payload over :data:`FAST_LIMIT` -- goes to wsproto, which stays the one judge of framing and
its errors. Several whole frames in one read are taken one by one (:meth:`FastFrames.parse_at`);
what follows the last one taken (a part of a frame, or a frame of another kind) goes to wsproto.
The frames taken here are the ones wsproto would turn into one finished ``BytesMessage`` with the
same payload, and they leave its state as they found it.

Whole binary frames are *written* here at any size (:meth:`FastFrames.build`), each the bytes
wsproto would write for it but for the random masking key. For a large message that is most of
the cost of sending it: wsproto copies a payload four times on its way into a frame (more when
masking, a byte at a time through its tables in four strided passes over copies), where an
unmasked frame here is one copy and a masked one a copy masked in place. Masking costs about as
much as writing the frame to the socket (0.2-0.3 ms for a 256 KiB part): for a stream that
writes large frames a slice per loop turn (``FastFrames.of(ws, deferred=True)``), a large masked
frame is a :class:`MaskedFrame` instead, masked a slice at a time as each slice is written.

The checks read wsproto's own state (private attributes of wsproto 1.2 and 1.3);
:meth:`FastFrames.of` returns ``None`` -- wsproto for every frame -- if they are not where they
are expected.
"""

from __future__ import annotations

import os
from typing import Any

from wsproto import WSConnection
from wsproto.connection import ConnectionState

_XOR_TABLES = tuple(bytes(b ^ k for b in range(256)) for k in range(256))

__all__ = ["FAST_LIMIT", "KEY_POOL", "FastFrames", "MaskedFrame", "mask"]

FAST_LIMIT = 0xFFFF
"""The largest payload read here (the 2-byte length form); larger frames go to wsproto."""

KEY_POOL = 1024
"""Bytes of masking keys a client's connection draws from ``os.urandom`` at once (256 frames)."""

_BINARY_FIN = 0x82  # FIN, no reserved bit, opcode 2 (binary)
_MASKED = 0x80
_OPEN = ConnectionState.OPEN


def mask(payload: bytes, key: bytes) -> bytes:
    """``payload`` XOR the 4-byte ``key`` repeated (RFC 6455 masking; its own inverse)."""
    size = len(payload)
    if not size:
        return b""
    stream = (key * (size // 4 + 1))[:size]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(stream, "little")).to_bytes(
        size, "little"
    )


class FastFrames:
    """Reads and writes whole binary frames of up to :data:`FAST_LIMIT` bytes for one open
    wsproto connection, whenever wsproto's state allows (module docstring)."""

    __slots__ = (
        "_client",
        "_conn",
        "_decoder",
        "_deferred",
        "_handshake",
        "_key_at",
        "_keys",
        "_messages",
        "_proto",
    )

    def __init__(self, ws: WSConnection, conn: Any, deferred: bool = False) -> None:
        self._handshake: Any = ws.handshake
        self._deferred = deferred
        self._conn = conn
        self._proto: Any = conn._proto
        self._decoder: Any = self._proto._frame_decoder
        self._messages: Any = self._proto._message_decoder
        self._client: bool = conn.client
        # Masking keys (client side): drawn from os.urandom a pool at a time, four bytes per
        # frame, each used once -- one system call per KEY_POOL // 4 frames, not per frame.
        self._keys = b""
        self._key_at = 0

    @classmethod
    def of(cls, ws: WSConnection, *, deferred: bool = False) -> FastFrames | None:
        """For ``ws`` once its upgrade is done, or ``None`` (wsproto for every frame).
        ``deferred``: :meth:`frame` returns a large masked frame as a :class:`MaskedFrame`
        (only for a stream that takes one: :class:`~._asyncio_stream.AsyncioByteStream`)."""
        conn: Any = ws.connection
        if conn is None:
            return None
        try:
            proto = conn._proto
            probes = (
                ws.handshake._events,
                conn._events,
                conn._state,
                conn.client,
                proto._outbound_opcode,
                proto._frame_decoder.header,
                proto._frame_decoder.buffer.buffer,
                proto._message_decoder.opcode,
            )
            extensions = proto.extensions
        except AttributeError:
            return None
        del probes
        if extensions:
            return None
        return cls(ws, conn, deferred)

    def idle(self) -> bool:
        """Whether wsproto holds nothing: no event, byte or message under way (then its
        ``events()`` would yield nothing)."""
        decoder = self._decoder
        conn = self._conn
        return (
            conn._state is _OPEN
            and not conn._events
            and not self._handshake._events
            and decoder.header is None
            and not decoder.buffer.buffer
            and self._messages.opcode is None
        )

    def parse(self, data: bytes, limit: int) -> bytes | None:
        """The payload of ``data`` if it is exactly one whole binary frame of at most ``limit``
        (and :data:`FAST_LIMIT`) bytes, masked as the peer must, and wsproto is idle; else
        ``None``: hand ``data`` to wsproto."""
        size = len(data)
        if size < 2 or data[0] != _BINARY_FIN:
            return None
        second = data[1]
        length = second & 0x7F
        head = 2
        if length == 126:
            if size < 4:
                return None
            length = int.from_bytes(data[2:4], "big")
            if length <= 125:  # wsproto refuses a longer length form than needed
                return None
            head = 4
        elif length == 127:
            return None
        if length > limit:
            return None
        if self._client:
            if second & _MASKED or size != head + length:
                return None
        elif not second & _MASKED or size != head + 4 + length:
            return None
        decoder = self._decoder
        conn = self._conn
        if not (  # idle(), inline: this runs for every message read
            conn._state is _OPEN
            and not conn._events
            and not self._handshake._events
            and decoder.header is None
            and not decoder.buffer.buffer
            and self._messages.opcode is None
        ):
            return None
        if self._client:
            return data[head:]
        return mask(data[head + 4 :], data[head : head + 4])

    def parse_at(self, data: bytes, start: int, limit: int) -> tuple[bytes, int] | None:
        """The payload of the whole binary frame at ``data[start:]`` -- which may be followed by
        more bytes, the next frames -- and the offset where the frame ends, under the same
        conditions as :meth:`parse`; else ``None``: hand ``data[start:]`` to wsproto."""
        size = len(data) - start
        if size < 2 or data[start] != _BINARY_FIN:
            return None
        second = data[start + 1]
        length = second & 0x7F
        head = start + 2
        if length == 126:
            if size < 4:
                return None
            length = int.from_bytes(data[head : head + 2], "big")
            if length <= 125:  # wsproto refuses a longer length form than needed
                return None
            head += 2
        elif length == 127:
            return None
        if length > limit:
            return None
        if self._client:
            end = head + length
            if second & _MASKED or end > len(data) or not self.idle():
                return None
            return data[head:end], end
        end = head + 4 + length
        if not second & _MASKED or end > len(data) or not self.idle():
            return None
        return mask(data[head + 4 : end], data[head : head + 4]), end

    def frame(self, payload: bytes) -> bytes | bytearray | MaskedFrame | None:
        """:meth:`build`, but a large masked frame is a :class:`MaskedFrame` if ``deferred``
        (masked as it is written)."""
        if (
            self._deferred
            and len(payload) > FAST_LIMIT
            and self._client
            and self._conn._state is _OPEN
            and self._proto._outbound_opcode is None
        ):
            head = bytes((_BINARY_FIN, 127 | _MASKED)) + len(payload).to_bytes(8, "big")
            return MaskedFrame(head + os.urandom(4), payload)  # (a fresh key, as wsproto's)
        return self.build(payload)

    def build(self, payload: bytes) -> bytes | bytearray | None:
        """The frame of one whole binary message ``payload`` (masked with a fresh random key
        on the client side), or ``None``: let wsproto build it (the connection not open, or a
        message under way). The caller must not change the frame (a ``bytearray`` when
        large and masked)."""
        if self._conn._state is not _OPEN or self._proto._outbound_opcode is not None:
            return None
        size = len(payload)
        masked = _MASKED if self._client else 0
        if size <= 125:
            head = bytes((_BINARY_FIN, size | masked))
        elif size <= FAST_LIMIT:
            head = bytes((_BINARY_FIN, 126 | masked)) + size.to_bytes(2, "big")
        else:
            head = bytes((_BINARY_FIN, 127 | masked)) + size.to_bytes(8, "big")
            if masked:
                return _masked_frame(head, payload)
        if not masked:
            return head + payload
        # RFC 6455 5.3: a fresh, unpredictable key per frame (from os.urandom, as wsproto's).
        at = self._key_at
        if at >= len(self._keys):
            self._keys = os.urandom(KEY_POOL)
            at = 0
        self._key_at = at + 4
        key = self._keys[at : at + 4]
        return head + key + mask(payload, key)


def _masked_frame(head: bytes, payload: bytes) -> bytearray:
    """``head``, a fresh key and ``payload`` masked with it: one copy of the payload, masked in
    place a quarter at a time (each byte position modulo 4 through its key byte's table)."""
    key = os.urandom(4)
    frame = bytearray(head)
    frame += key
    start = len(frame)
    frame += payload
    _mask_into(frame, start, key)
    return frame


def _mask_into(out: bytearray, start: int, key: bytes) -> None:
    """Mask ``out[start:]`` in place with ``key`` from its first byte (four strided passes)."""
    for i in range(4):
        out[start + i :: 4] = out[start + i :: 4].translate(_XOR_TABLES[key[i]])


class MaskedFrame:
    """A masked frame not masked yet: its head (with the key) and the payload as given, masked
    a slice at a time by :meth:`slice` -- so the masking of a large frame is spread over the
    loop turns that write it, as its writing is (:class:`~._asyncio_stream.AsyncioByteStream`).

    Its bytes are those of :func:`_masked_frame` with the same key. Not a buffer: ``bytes(frame)``
    is the whole frame masked (one copy); ``prefix + frame`` (a frame written in front of it)
    is a :class:`MaskedFrame` with that prefix. The payload must not change until written.
    """

    __slots__ = ("_head", "_key", "_payload", "_size")

    def __init__(self, head: bytes, payload: bytes | bytearray | memoryview) -> None:
        self._head = head  # unmasked bytes first: any prefix, then the frame's head and key
        self._key = head[-4:]
        self._payload = memoryview(payload)
        self._size = len(head) + len(self._payload)

    def __len__(self) -> int:
        return self._size

    def __radd__(self, prefix: bytes) -> MaskedFrame:
        return MaskedFrame(bytes(prefix) + self._head, self._payload)

    def __bytes__(self) -> bytes:
        return bytes(self.slice(0, self._size))

    def slice(self, start: int, stop: int) -> bytearray:
        """Bytes ``start:stop`` of the frame, masked (a copy of that slice only)."""
        head = len(self._head)
        out = bytearray(self._head[start:stop])
        begin = max(start, head)
        if stop > begin:
            at = len(out)
            out += self._payload[begin - head : stop - head]
            phase = (begin - head) % 4
            _mask_into(out, at, self._key[phase:] + self._key[:phase])
        return out
