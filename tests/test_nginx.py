"""A real TLS terminator: nginx terminates ``wss://`` and proxies the WebSocket to a plain worker.

nginx runs as a non-daemon child (``nginx -p TMP -c nginx.conf -g 'daemon off;'``) with a trustme
certificate for ``localhost``; it proxies ``/executor`` (upgrade headers passed, a long
``proxy_read_timeout``) to a worker listening in plain text on loopback. The controller dials
``wss://localhost:PORT/executor`` trusting only the trustme CA. What each test proves:

* calls and streams work through the terminator, and the worker sees nginx as its peer;
* ``nginx -s reload`` (old nginx workers end their connections after ``worker_shutdown_timeout``)
  and a SIGKILLed nginx worker process cut the connection mid-stream; the controller redials,
  the *same* logical session resumes (no fresh session, never ``offline``) and the stream
  delivers every item once, in order; the stream's generator started once.

Skipped with a reason when the nginx binary is absent outside CI; in CI (``CI=true``) a missing
nginx fails the test (``.ci/run`` installs it). Runs on both anyio backends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import pytest
import trustme
from faultutil import (
    Ledger,
    LedgerService,
    checksum,
    controller_config,
    wait_for,
    worker_config,
)

import garcon_link as gl
from garcon_link.testing import free_tcp_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 30.0
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
)

LIMITS = gl.Limits(
    heartbeat_interval=0.1,
    heartbeat_timeout=1.0,
    detached_grace=15.0,
    replay_inactivity=10.0,
    backoff_base=0.01,
    backoff_max=0.1,
    connect_timeout=2.0,
    handshake_timeout=3.0,
    close_timeout=0.3,
)

NGINX_CONF = """\
{user}worker_processes 1;
worker_shutdown_timeout 1s;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;

    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}
    upstream garcon_worker {{
{upstream}
    }}
    server {{
        listen 127.0.0.1:{port} ssl;
        server_name localhost;
        ssl_certificate {tmp}/server.pem;
        ssl_certificate_key {tmp}/server.key;
        ssl_protocols TLSv1.2 TLSv1.3;

        location = /executor {{
            proxy_pass http://garcon_worker;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_buffering off;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


def _require_nginx() -> str:
    if NGINX is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nginx is required in CI (.ci/run installs it); it is not on PATH")
        pytest.skip("nginx is not installed (apt-get install nginx-light); CI runs this test")
    return NGINX


@dataclass
class Nginx:
    binary: str
    prefix: Path
    port: int
    process: anyio.abc.Process

    def _args(self) -> list[str]:
        return [self.binary, "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf")]

    async def reload(self) -> None:
        result = await anyio.run_process([*self._args(), "-s", "reload"], check=False)
        assert result.returncode == 0, result.stderr.decode(errors="replace")

    def worker_pids(self) -> list[int]:
        """The nginx worker processes (children of the master)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == self.process.pid:
                pids.append(int(entry.name))
        return pids

    def error_log(self) -> str:
        try:
            return (self.prefix / "error.log").read_text()[-3000:]
        except OSError:
            return ""


@asynccontextmanager
async def nginx_in_front_of(tmp_path: Path, *ports: int, balance: str = "") -> AsyncIterator[Nginx]:
    """nginx terminating TLS in front of ``ports`` (one upstream server each), balanced by the
    ``balance`` directive (e.g. ``hash $arg_executor consistent;``)."""
    binary = _require_nginx()
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "server.pem")
    for pem in cert.cert_chain_pems[1:]:
        with (tmp_path / "server.pem").open("ab") as chain:
            chain.write(pem.bytes())
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    port = free_tcp_port()
    user = "user root;\n" if os.geteuid() == 0 else ""
    (tmp_path / "nginx.conf").write_text(
        NGINX_CONF.format(
            user=user,
            tmp=tmp_path,
            port=port,
            upstream="\n".join(
                [f"        {balance}"] * bool(balance)
                + [f"        server 127.0.0.1:{p};" for p in ports]
            ),
        )
    )
    with (tmp_path / "nginx.out").open("wb") as out:
        process = await anyio.open_process(
            [binary, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
        )
    nginx = Nginx(binary, tmp_path, port, process)
    try:
        with anyio.fail_after(10):
            while True:  # until nginx accepts connections (bounded by the deadline)
                if process.returncode is not None:
                    raise RuntimeError(
                        f"nginx exited with {process.returncode}: "
                        + (tmp_path / "nginx.out").read_text()
                        + nginx.error_log()
                    )
                try:
                    probe = await anyio.connect_tcp("127.0.0.1", port)
                except OSError:
                    await anyio.sleep(0.05)
                    continue
                await probe.aclose()
                break
        yield nginx
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(
                    signal.SIGQUIT if hasattr(signal, "SIGQUIT") else signal.SIGTERM
                )
                with anyio.move_on_after(3):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                with anyio.move_on_after(5):
                    await process.wait()
            await process.aclose()


@asynccontextmanager
async def through_nginx(
    tmp_path: Path,
) -> AsyncIterator[tuple[gl.RemoteExecutor, gl.Worker, LedgerService, Nginx, list[str]]]:
    service = LedgerService()
    async with (
        gl.Worker(worker_config(LIMITS), {"ledger": service}) as worker,
        nginx_in_front_of(tmp_path, worker.link.listen_address[1]) as nginx,
        gl.connect(
            controller_config(
                LIMITS,
                f"wss://localhost:{nginx.port}/executor",
                tls=gl.TlsConfig(ca=tmp_path / "ca.pem"),
            )
        ) as executor,
    ):
        history: list[str] = []
        executor.on_availability_changed(history.append)
        try:
            await executor.wait_ready(10)
        except TimeoutError:
            raise AssertionError("not ready through nginx:\n" + nginx.error_log()) from None
        yield executor, worker, service, nginx, history


async def test_calls_and_streams_through_nginx(tmp_path: Path) -> None:
    with anyio.fail_after(DEADLINE):
        async with through_nginx(tmp_path) as (executor, _worker, service, _nginx, history):
            ledger = executor.service("ledger", Ledger)
            payload = os.urandom(200_000)  # several TLS records and WebSocket frames
            assert await ledger.apply("big", payload) == checksum("big", payload)
            assert [i async for i in ledger.numbers("s", 1000)] == list(range(1000))
            assert service.ledger["big"] == 1 and service.ledger["s"] == 1
            assert history == ["ready"]


async def _reload(nginx: Nginx) -> None:
    await nginx.reload()


async def _kill_worker_process(nginx: Nginx) -> None:
    pids = nginx.worker_pids()
    assert pids, "no nginx worker process found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(_reload, id="nginx-reload"),
        pytest.param(_kill_worker_process, id="kill-worker"),
    ],
)
async def test_terminator_cut_mid_stream_resumes_with_nothing_lost(
    tmp_path: Path, fault: Callable[[Nginx], Awaitable[None]]
) -> None:
    n = 3000
    with anyio.fail_after(DEADLINE):
        async with through_nginx(tmp_path) as (executor, worker, service, nginx, history):
            ledger = executor.service("ledger", Ledger)
            session = (await executor.info()).session_id
            resumed_before = executor.link.statistics().resumed
            items: list[int] = []
            async for item in ledger.numbers("through-cut", n):
                items.append(item)
                if len(items) == 300:
                    await fault(nginx)
                    # Hold the consumer until the session resumed on a new connection, so the
                    # cut certainly falls inside the stream (the producer waits for credit).
                    await wait_for(
                        lambda: executor.link.statistics().resumed > resumed_before,
                        15,
                        "the session to resume through nginx:\n" + nginx.error_log(),
                    )
            assert items == list(range(n))
            assert service.ledger["through-cut"] == 1
            # The same logical session, resumed; never offline; the worker saw one session.
            assert (await executor.info()).session_id == session
            assert "offline" not in history
            assert worker.link.statistics().fresh_sessions == 1
            assert await ledger.apply("after", b"x") == checksum("after", b"x")
