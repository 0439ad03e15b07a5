"""The hop's own floor for ``python -m benchmarks.relay``: what a third process costs anything.

The raw wsproto echo of ``python -m benchmarks --only wsproto`` (``servers/wsproto_anyio.py``,
``clients/wsproto_anyio.py``) is measured three ways, in the same run as the gateway:

* ``direct``: client -> echo server;
* ``bytes``: client -> a byte-forwarding proxy child -> echo server. The proxy is two
  ``asyncio.Protocol`` sockets per connection, each ``data_received`` written to the other's
  transport, nothing else (:class:`_BytePipe`);
* ``ws``: client -> a wsproto-level relay child -> echo server. It parses the frames of each
  side (its own handshake with each) and forwards each whole message as a new frame to the other
  (:class:`_WsRelay`): the least a relay that reads messages does.

``bytes / direct`` is the hop itself on this machine (kernel, two more wake-ups, a third busy
process on the cores); a gateway's ratio over it is what the gateway adds beyond that.

The proxy child is ``python -m benchmarks.relayfloor {bytes,ws} UPSTREAM_PORT``: it prints
``READY port`` and exits when its stdin closes.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Ping, Request

from .clients.wsproto_anyio import connect
from .servers._common import HOST, announce, start_watchdog

KINDS = ("bytes", "ws")


# ------------------------------------------------------------------------ proxy child


class _BytePipe(asyncio.Protocol):
    """One side of a byte-forwarding connection: what it reads, the other side writes."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _BytePipe | None = None
        self.early: list[bytes] = []  # read before the other side connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is not None and other.transport is not None:
            other.transport.write(data)
        else:
            self.early.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


class _WsSide(asyncio.Protocol):
    """One side of a wsproto-level relay: each whole binary message read here is sent to the
    other side as a new message; pings answered; a close closes both."""

    def __init__(self, role: ConnectionType) -> None:
        self.ws = WSConnection(role)
        self.transport: asyncio.Transport | None = None
        self.other: _WsSide | None = None
        self.open = False
        self.queued: list[bytes] = []  # messages for this side before its handshake ended
        self._parts: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def send(self, message: bytes) -> None:
        if self.open and self.transport is not None:
            self.transport.write(self.ws.send(BytesMessage(data=message)))
        else:
            self.queued.append(message)

    def _opened(self) -> None:
        self.open = True
        for message in self.queued:
            self.send(message)
        self.queued.clear()

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.ws.receive_data(data)
        for event in self.ws.events():
            if isinstance(event, BytesMessage):
                self._parts.append(bytes(event.data))
                if event.message_finished:
                    parts = self._parts
                    message = parts[0] if len(parts) == 1 else b"".join(parts)
                    parts.clear()
                    assert self.other is not None
                    self.other.send(message)
            elif isinstance(event, Request):
                self.transport.write(self.ws.send(AcceptConnection()))
                self._opened()
            elif isinstance(event, AcceptConnection):
                self._opened()
            elif isinstance(event, Ping):
                self.transport.write(self.ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


async def _serve(kind: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    dials: set[asyncio.Task[None]] = set()  # referenced until done

    def start(dial: Coroutine[Any, Any, None]) -> None:
        task = loop.create_task(dial)
        dials.add(task)
        task.add_done_callback(dials.discard)

    def accepted() -> asyncio.Protocol:
        if kind == "bytes":
            down = _BytePipe()

            async def dial() -> None:
                up = _BytePipe()
                up.other, down.other = down, up
                await loop.create_connection(lambda: up, HOST, upstream_port)
                assert up.transport is not None
                for data in down.early:
                    up.transport.write(data)
                down.early.clear()

            start(dial())
            return down
        ws_down = _WsSide(ConnectionType.SERVER)

        async def ws_dial() -> None:
            up = _WsSide(ConnectionType.CLIENT)
            up.other, ws_down.other = ws_down, up
            transport, _ = await loop.create_connection(lambda: up, HOST, upstream_port)
            transport.write(up.ws.send(Request(host=f"{HOST}:{upstream_port}", target="/")))

        start(ws_dial())
        return ws_down

    server = await loop.create_server(accepted, HOST, 0)
    announce(server.sockets[0].getsockname()[1])
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in KINDS:
        raise SystemExit(f"usage: python -m benchmarks.relayfloor {{{','.join(KINDS)}}} PORT")
    start_watchdog(3600.0)
    asyncio.run(_serve(args[0], int(args[1])))


# ------------------------------------------------------------------------ measuring


def cpu_seconds(pid: int | None) -> float:
    """The CPU time (user and system) process ``pid`` has used so far (``/proc``); 0 for
    ``None``."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@asynccontextmanager
async def _child(
    command: list[str], what: str, stderr: int | None = None
) -> AsyncIterator[tuple[int, int]]:
    """A child announcing ``READY port``: the port and its pid. At the end its stdin is closed
    and it is given 60 s to exit (a child under callgrind writes its dump then), else killed."""
    process = await anyio.open_process(command, stdin=subprocess.PIPE, stderr=stderr)
    try:
        assert process.stdout is not None
        buffer = b""
        with anyio.fail_after(60):
            while b"\n" not in buffer.partition(b"READY ")[2]:
                try:
                    buffer += await process.stdout.receive()
                except anyio.EndOfStream:
                    raise RuntimeError(f"{what} exited before it was ready") from None
        yield int(buffer.partition(b"READY ")[2].split(b"\n")[0]), process.pid
    finally:
        if process.stdin is not None:
            await process.stdin.aclose()
            with anyio.move_on_after(60):
                await process.wait()
        if process.returncode is None:
            process.kill()
        await process.wait()
        await process.aclose()


async def measure(
    payload: bytes,
    latency: Callable[[Callable[[], Awaitable[Any]], int], Awaitable[dict[str, float]]],
    throughput: Callable[[Callable[[], Awaitable[Any]], float], Awaitable[float]],
    calls: int,
    seconds: float,
) -> dict[str, float]:
    """p50/p99 and calls/s with 64 in flight of the raw wsproto echo, direct and through each
    proxy of :data:`KINDS` (``{arrangement}_p50_us``, ...), measured with the same ``latency``
    and ``throughput`` as the gateway; then the ratios."""
    out: dict[str, float] = {}
    python = sys.executable
    server = [python, "-m", "benchmarks.servers.wsproto_anyio", "--port", "0"]
    async with _child(server, "the wsproto echo server") as (port, _):
        for arrangement in ("direct", *KINDS):
            async with AsyncExitStack() as stack:
                target, pid = port, None
                if arrangement != "direct":
                    proxy = [python, "-m", "benchmarks.relayfloor", arrangement, str(port)]
                    target, pid = await stack.enter_async_context(
                        _child(proxy, f"the {arrangement} proxy")
                    )
                client = await stack.enter_async_context(connect(target))

                async def call(client: Any = client, through: str = arrangement) -> None:
                    if await client.call(payload) != payload:
                        raise RuntimeError(f"wrong echo through {through}")

                figures = await latency(call, calls)
                out[f"{arrangement}_p50_us"] = figures["p50_us"]
                out[f"{arrangement}_p99_us"] = figures["p99_us"]
                used, start = cpu_seconds(pid), time.perf_counter()
                rate = await throughput(call, seconds)
                wall = time.perf_counter() - start
                out[f"{arrangement}_calls_per_s_64"] = rate
                if pid is not None:  # the proxy's CPU time per call forwarded, 64 in flight
                    calls_made = rate * wall
                    cpu = cpu_seconds(pid) - used
                    out[f"{arrangement}_proxy_cpu_us_per_call_64"] = cpu * 1e6 / calls_made
    for kind in KINDS:
        out[f"{kind}_p50_factor"] = out[f"{kind}_p50_us"] / out["direct_p50_us"]
        out[f"{kind}_calls_per_s_ratio"] = (
            out[f"{kind}_calls_per_s_64"] / out["direct_calls_per_s_64"]
        )
    return out


async def instructions(payload: bytes, calls: int) -> dict[str, float]:
    """Instructions per sequential call forwarded by each proxy of :data:`KINDS` (valgrind's
    callgrind over the whole proxy child, instrumentation on from its start): two runs, after
    ``calls`` and after ``3 * calls`` calls (each after 50 unmeasured), their difference over
    ``2 * calls`` (start-up and shutdown cancel out); ``{kind}_instructions_per_call``."""
    out: dict[str, float] = {}
    python = sys.executable
    server = [python, "-m", "benchmarks.servers.wsproto_anyio", "--port", "0"]
    with tempfile.TemporaryDirectory(prefix="garcon-link-relayfloor-") as tmp:
        async with _child(server, "the wsproto echo server") as (port, _):
            for kind in KINDS:
                totals = []
                for count in (calls, 3 * calls):
                    dump = Path(tmp) / f"{kind}.{count}"
                    proxy = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={dump}"]
                    proxy += [python, "-m", "benchmarks.relayfloor", kind, str(port)]
                    what = f"the {kind} proxy under callgrind"
                    async with (
                        _child(proxy, what, subprocess.DEVNULL) as (target, _),
                        connect(target) as client,
                    ):
                        for _ in range(50 + count):
                            if await client.call(payload) != payload:
                                raise RuntimeError(f"wrong echo through {kind}")
                    # _child closed its stdin: the proxy exited and callgrind wrote its dump.
                    text = dump.read_text(errors="replace")
                    found = re.search(r"^(?:totals|summary):\s+(\d+)", text, re.M)
                    if found is None:
                        raise RuntimeError(f"no totals in {dump}")
                    totals.append(int(found.group(1)))
                out[f"{kind}_instructions_per_call"] = (totals[1] - totals[0]) / (2 * calls)
    return out


if __name__ == "__main__":
    main()
