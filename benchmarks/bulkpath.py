"""``python -m benchmarks.bulkpath``: what garcon_link's own layers cost a 1 MiB body, no sockets.

The bulk figure of ``python -m benchmarks`` is mostly wsproto and the socket, and moves by a
quarter from run to run on a shared machine; this isolates the part that is ours. One process,
one thread, no event loop work but the sender's own checkpoints: a
:class:`~garcon_link.rpc.chunks.ChunkSender` issues each body in parts to a
:class:`~garcon_link.core.session.MessageSession` (the frames it retains), whose frames a
second session decodes (:func:`~garcon_link.core.wire.iter_packets`, as the socket reader
does), the parts parsed and reassembled (:class:`~garcon_link.rpc.chunks.Reassembler`); each
frame is acknowledged at once, so retention never waits. Not measured: WebSocket framing,
masking, the socket, the value's decoding.

Prints, per body: the median and range of the CPU time over ``--rounds`` rounds of
``--bodies`` bodies each, and the peak of memory allocated while one body crosses (tracemalloc,
in a separate pass: tracing slows everything down). Usage::

    python -m benchmarks.bulkpath [--size BYTES] [--bodies N] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from typing import Any

import anyio

from garcon_link.core.session import MessageSession
from garcon_link.core.wire import Message, encode_receipt, iter_packets
from garcon_link.limits import Limits
from garcon_link.rpc.chunks import ChunkSender, Reassembler, parse_part

MiB = 1 << 20


class _Loopback:
    """The sending session as the chunk sender's transport: each frame issued is decoded by
    the receiving side at once and acknowledged."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.out = MessageSession(limits)
        self.out.attach(0)
        self.into = MessageSession(limits)
        self.into.attach(0)
        self.out.receive(encode_receipt(0))  # the fence: frames flow from now on
        self.out.data_to_send()
        self.reassembler = Reassembler(limits.max_frame_bytes)
        self.bodies = 0

    async def send(self, body: Any) -> int:
        ordinal = self.out.send(body)
        for frame in self.out.data_to_send():
            for packet in iter_packets(frame, self.limits.max_frame_bytes, 1024):
                if isinstance(packet, Message):
                    part = parse_part(packet.body)
                    assert part is not None
                    if self.reassembler.feed(*part) is not None:
                        self.bodies += 1
        self.out.receive(encode_receipt(ordinal))
        return int(ordinal)

    def send_nowait(self, body: Any) -> int | None:
        return None

    def try_send(self, body: Any) -> int | None:
        return int(self.out.send(body))

    async def wait_retained_below(self, size: int) -> bool:
        return True

    @property
    def issued(self) -> int:
        return self.out.issued


async def _run(size: int, bodies: int, rounds: int) -> None:
    limits = Limits()
    transport = _Loopback(limits)
    sender = ChunkSender(
        transport,
        limits.bulk_chunk_bytes,
        limits.bulk_window_bytes,
        limits.max_frame_bytes,
        transfers=limits.bulk_transfers,
    )
    body = bytes(range(256)) * (size // 256)
    for _ in range(3):
        await sender.send(body)  # warm-up
    per_body: list[float] = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(bodies):
            await sender.send(body)
        per_body.append((time.process_time() - start) / bodies)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        await sender.send(body)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert transport.bodies == 3 + rounds * bodies + 1
    us = [t * 1e6 for t in per_body]
    print(
        f"{size} bytes in {sender.parts_sent // transport.bodies} parts: "
        f"{statistics.median(us):.0f} us CPU per body ({min(us):.0f}-{max(us):.0f}, "
        f"{rounds} rounds of {bodies}), {size / statistics.median(per_body) / 1e6:.0f} MB/s; "
        f"peak allocated while one crosses {peak / MiB:.2f} MiB"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bulkpath", description=__doc__)
    parser.add_argument("--size", type=int, default=MiB, help="body bytes (default 1 MiB)")
    parser.add_argument("--bodies", type=int, default=50, help="bodies per round (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    args = parser.parse_args(argv)
    anyio.run(_run, args.size, args.bodies, args.rounds)


if __name__ == "__main__":
    main()
