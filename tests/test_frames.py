"""garcon_link.net._frames: whole small binary frames without wsproto's per-frame work.

What it must do: read exactly the frames wsproto would turn into one whole binary message with the
same payload, write frames wsproto reads back as that message, and leave everything else --
every other opcode, reserved bits, fragments, non-minimal lengths, wrong masking, split or shared
reads, wsproto mid-frame or mid-message, oversize payloads -- to wsproto (``None``).
"""

from __future__ import annotations

import itertools
import os
import struct
from collections import deque

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, Ping, Request

from garcon_link.limits import Limits
from garcon_link.net._frames import FAST_LIMIT, KEY_POOL, FastFrames, MaskedFrame, mask
from garcon_link.net.ws import WebSocket

SIZES = (0, 1, 3, 4, 5, 125, 126, 127, 1000, FAST_LIMIT)


def _pair() -> tuple[WSConnection, WSConnection]:
    client, server = WSConnection(ConnectionType.CLIENT), WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="localhost", target="/executor")))
    assert any(isinstance(e, Request) for e in server.events())
    client.receive_data(server.send(AcceptConnection()))
    assert any(isinstance(e, AcceptConnection) for e in client.events())
    return client, server


def _fast(ws: WSConnection) -> FastFrames:
    fast = FastFrames.of(ws)
    assert fast is not None
    return fast


def _messages(ws: WSConnection, data: bytes) -> list[bytes]:
    ws.receive_data(data)
    out = []
    for event in ws.events():
        assert isinstance(event, BytesMessage)
        assert event.frame_finished and event.message_finished
        out.append(bytes(event.data))
    return out


def _frame(first: int, payload: bytes, *, masked: bool, length_form: str = "minimal") -> bytes:
    """A frame written by hand (for the forms wsproto never writes)."""
    flag = 0x80 if masked else 0
    size = len(payload)
    if length_form == "minimal" and size <= 125:
        head = bytes((first, size | flag))
    elif length_form in ("minimal", "two") and size <= 0xFFFF:
        head = bytes((first, 126 | flag)) + struct.pack("!H", size)
    else:
        head = bytes((first, 127 | flag)) + struct.pack("!Q", size)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + mask(payload, key)


def test_mask_is_rfc_6455_masking_and_its_own_inverse() -> None:
    key = b"\x01\x02\x03\xff"
    payload = bytes(range(11))
    expected = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    assert mask(payload, key) == expected
    assert mask(expected, key) == payload
    assert mask(b"", key) == b""
    assert mask(b"\x00" * 9, b"\x00" * 4) == b"\x00" * 9  # leading zero bytes kept


@pytest.mark.parametrize("size", SIZES)
def test_frames_written_here_read_back_by_wsproto_and_here(size: int) -> None:
    payload = os.urandom(size)
    client, server = _pair()
    built = _fast(client).build(payload), _fast(server).build(payload)
    assert built[0] is not None and built[1] is not None
    to_server, to_client = bytes(built[0]), bytes(built[1])
    assert to_server[1] & 0x80 and not to_client[1] & 0x80  # only the client masks
    assert _fast(server).parse(to_server, FAST_LIMIT) == payload
    assert _fast(client).parse(to_client, FAST_LIMIT) == payload
    assert _messages(server, to_server) == [payload]
    assert _messages(client, to_client) == [payload]


@pytest.mark.parametrize("size", SIZES)
def test_frames_wsproto_writes_read_here_as_wsproto_reads_them(size: int) -> None:
    payload = os.urandom(size)
    client, server = _pair()
    fast_client, fast_server = _fast(client), _fast(server)
    assert fast_server.parse(client.send(BytesMessage(data=payload)), FAST_LIMIT) == payload
    assert fast_client.parse(server.send(BytesMessage(data=payload)), FAST_LIMIT) == payload
    # The state is as wsproto left it: it reads the next frames as usual.
    assert _messages(server, client.send(BytesMessage(data=b"next"))) == [b"next"]
    assert fast_server.parse(client.send(BytesMessage(data=b"again")), FAST_LIMIT) == b"again"


def test_a_masking_key_is_fresh_per_frame() -> None:
    client, _ = _pair()
    fast = _fast(client)
    frames = {fast.build(b"x" * 8) for _ in range(8)}
    assert len(frames) == 8


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(_frame(0x81, b"text", masked=True), id="text"),
        pytest.param(_frame(0x02, b"part", masked=True), id="first-fragment"),
        pytest.param(_frame(0x80, b"tail", masked=True), id="continuation"),
        pytest.param(_frame(0xC2, b"rsv1", masked=True), id="rsv1"),
        pytest.param(_frame(0x89, b"", masked=True), id="ping"),
        pytest.param(_frame(0x88, b"\x03\xe8", masked=True), id="close"),
        pytest.param(_frame(0x82, b"x" * 5, masked=True, length_form="two"), id="long-form-2"),
        pytest.param(_frame(0x82, b"x" * 300, masked=True, length_form="eight"), id="long-form-8"),
        pytest.param(_frame(0x82, b"unmasked", masked=False), id="unmasked-to-server"),
        pytest.param(_frame(0x82, b"x" * 10, masked=True)[:-1], id="truncated"),
        pytest.param(_frame(0x82, b"ab", masked=True) * 2, id="two-frames"),
        pytest.param(b"\x82", id="one-byte"),
        pytest.param(b"", id="empty"),
    ],
)
def test_the_server_leaves_every_other_frame_to_wsproto(frame: bytes) -> None:
    _, server = _pair()
    assert _fast(server).parse(frame, FAST_LIMIT) is None


def test_the_client_leaves_masked_frames_to_wsproto() -> None:
    client, _ = _pair()
    assert _fast(client).parse(_frame(0x82, b"masked", masked=True), FAST_LIMIT) is None


def test_payloads_over_the_limit_go_to_wsproto() -> None:
    client, server = _pair()
    fast = _fast(server)
    assert fast.parse(client.send(BytesMessage(data=b"x" * 11)), 10) is None
    assert fast.parse(client.send(BytesMessage(data=b"x" * 10)), 10) == b"x" * 10
    assert fast.parse(client.send(BytesMessage(data=b"x" * (FAST_LIMIT + 1))), 1 << 20) is None


@pytest.mark.parametrize("size", [FAST_LIMIT + 1, FAST_LIMIT + 2, FAST_LIMIT + 3, 256 * 1024 + 13])
def test_large_frames_written_here_are_what_wsproto_writes_and_reads(size: int) -> None:
    """Over FAST_LIMIT a frame takes the 8-byte length form: unmasked, byte for byte wsproto's
    frame; masked, wsproto's but for the random key. wsproto reads both as the payload, and
    its state is left as it was (it writes and reads the next frames as usual)."""
    payload = os.urandom(size)
    client, server = _pair()
    to_server = _fast(client).build(payload)
    to_client = _fast(server).build(payload)
    assert to_server is not None and to_client is not None
    assert to_client == server.send(BytesMessage(data=payload))
    reference = client.send(BytesMessage(data=payload))
    assert len(to_server) == len(reference) and to_server[:10] == reference[:10]
    assert to_server[10:14] != reference[10:14]  # a fresh key (2**-32 to be the same)
    assert bytes(to_server[14:]) == mask(payload, bytes(to_server[10:14]))
    assert _messages(server, bytes(to_server)) == [payload]
    assert _messages(client, bytes(to_client)) == [payload]
    assert _messages(server, client.send(BytesMessage(data=b"next"))) == [b"next"]
    assert _messages(client, bytes(_fast(server).build(b"again") or b"")) == [b"again"]


@pytest.mark.parametrize("size", [FAST_LIMIT + 1, FAST_LIMIT + 2, 256 * 1024 + 13])
def test_a_deferred_masked_frame_is_masked_slice_by_slice_into_the_same_frame(size: int) -> None:
    """With ``deferred``, a large client frame is a MaskedFrame: any cut of it into slices,
    each masked on its own, joins into one frame wsproto reads as the payload; a prefix written
    in front of it (a held frame) stays unmasked; small frames are built whole, masked at once."""
    payload = os.urandom(size)
    client, server = _pair()
    fast = FastFrames.of(client, deferred=True)
    assert fast is not None
    frame = fast.frame(payload)
    assert isinstance(frame, MaskedFrame)
    whole = bytes(frame)
    assert len(frame) == len(whole) == size + 14
    assert whole[14:] == mask(payload, whole[10:14])
    for step in (1, 3, 4, 7, 65536):
        cuts = range(0, len(frame), step) if step > 1 else (0, 1, 2, 13, 14, 15, len(frame))
        bounds = sorted({*cuts, len(frame)})
        slices = [frame.slice(a, b) for a, b in itertools.pairwise(bounds)]
        assert b"".join(slices) == whole
    held = server.send(BytesMessage(data=b"held"))  # a frame from the peer's side: any bytes
    prefixed = held + frame
    assert isinstance(prefixed, MaskedFrame)
    assert bytes(prefixed) == held + whole
    assert _messages(server, whole) == [payload]
    assert isinstance(fast.frame(b"x" * 200), bytes)  # small: masked at once


def test_nothing_is_taken_while_wsproto_holds_a_partial_frame_or_message() -> None:
    client, server = _pair()
    fast = _fast(server)
    assert fast.idle()
    whole = client.send(BytesMessage(data=b"x" * 40))
    server.receive_data(whole[:5])  # a partial frame in wsproto's buffer
    assert list(server.events()) == []
    assert not fast.idle()
    assert fast.parse(client.send(BytesMessage(data=b"later")), FAST_LIMIT) is None
    assert _messages(server, whole[5:]) == [b"x" * 40]
    assert fast.idle()
    # A fragmented message under way in wsproto.
    server.receive_data(client.send(BytesMessage(data=b"head", message_finished=False)))
    assert [bytes(e.data) for e in server.events()] == [b"head"]  # type: ignore[attr-defined]
    assert not fast.idle()
    assert fast.parse(client.send(BytesMessage(data=b"later")), FAST_LIMIT) is None


def test_a_message_under_way_is_written_by_wsproto() -> None:
    client, _ = _pair()
    fast = _fast(client)
    client.send(BytesMessage(data=b"head", message_finished=False))
    assert fast.build(b"more") is None


def test_before_the_upgrade_there_is_no_fast_path() -> None:
    assert FastFrames.of(WSConnection(ConnectionType.CLIENT)) is None


# ------------------------------------------------------------------------ several frames a read


def test_parse_at_takes_whole_frames_one_by_one_and_stops_at_a_part_or_another_kind() -> None:
    client, server = _pair()
    fast = _fast(server)
    first, second = (
        client.send(BytesMessage(data=b"one")),
        client.send(BytesMessage(data=b"2" * 300)),
    )
    ping = _frame(0x89, b"", masked=True)
    data = first + second + ping + first
    assert fast.parse_at(data, 0, FAST_LIMIT) == (b"one", len(first))
    assert fast.parse_at(data, len(first), FAST_LIMIT) == (b"2" * 300, len(first + second))
    assert fast.parse_at(data, len(first + second), FAST_LIMIT) is None  # a ping: wsproto's
    assert fast.parse_at(first + second[:-1], len(first), FAST_LIMIT) is None  # a part
    assert fast.parse_at(first, len(first), FAST_LIMIT) is None  # nothing left
    assert fast.parse_at(second, 0, 299) is None  # over the limit


class _Reads(anyio.abc.ByteStream):
    """Hands out ``chunks`` one read at a time, then end of stream; keeps what is sent."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = deque(chunks)
        self.sent = bytearray()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        if not self._chunks:
            raise anyio.EndOfStream
        return self._chunks.popleft()

    async def send(self, item: bytes) -> None:
        self.sent += item

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def _read_messages(chunks: list[bytes], *, fast: bool) -> tuple[list[bytes], int]:
    """What a listener's socket reads from ``chunks`` (a client's frames), with the fast
    frames or without (wsproto only), and how many bytes it sent back (pongs)."""

    async def run() -> tuple[list[bytes], int]:
        _, server = _pair()
        stream = _Reads(chunks)
        sock = WebSocket(stream, server, peer="test", limits=Limits(), fast_frames=fast)
        sock.authenticated()
        out = []
        with anyio.fail_after(5):
            while (message := await sock.receive_message()) is not None:
                out.append(message)
        return out, len(stream.sent)

    return anyio.run(run)


def test_several_frames_in_a_read_are_read_as_wsproto_reads_them() -> None:
    client, _ = _pair()
    payloads = [bytes([i]) * size for i, size in enumerate((0, 5, 125, 126, 1000, 7, FAST_LIMIT))]
    frames = [client.send(BytesMessage(data=p)) for p in payloads]
    ping = client.send(Ping(b"hi"))
    fragmented = client.send(BytesMessage(data=b"fr", message_finished=False)) + client.send(
        BytesMessage(data=b"ag")
    )
    data = b"".join(frames[:3]) + ping + b"".join(frames[3:]) + fragmented + frames[1]
    cut = len(frames[0]) + len(frames[1]) + 3  # a read ends inside the third frame
    for chunks in ([data], [data[:cut], data[cut:]], [data[:cut], data[cut:-2], data[-2:]]):
        fast_read = _read_messages(chunks, fast=True)
        assert fast_read == _read_messages(chunks, fast=False)
        assert fast_read[0] == [*payloads, b"frag", payloads[1]]
        assert fast_read[1] > 0  # the ping was answered


def test_masking_keys_stay_fresh_across_the_key_pool() -> None:
    # Keys come from os.urandom a pool at a time: frames on both sides of a refill, and of the
    # next, each get a key of their own (a repeat by chance: about 1 in 10**7).
    client, server = _pair()
    fast = _fast(client)
    count = 2 * KEY_POOL // 4 + 2
    frames = [fast.build(b"x" * 8) for _ in range(count)]
    keys = {bytes(frame[2:6]) for frame in frames if frame is not None}
    assert len(keys) == count
    assert all(_messages(server, bytes(frame or b"")) == [b"x" * 8] for frame in frames)
