"""The device side: dials out to the controller and offers the built-in services.

The device needs no inbound port: it dials the controller's ``/executor`` URL (its config has
``[connection] dial = ...``) and keeps redialling with backoff when the network drops.

    python worker.py worker.toml --root /srv/device-work

Runs until SIGINT/SIGTERM. Equivalent command line:
``garcon-link worker worker.toml --builtin process,files --root /srv/device-work``.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import anyio

import garcon_link as gl
from garcon_link.services import builtin_services


async def serve(config_path: Path, root: Path) -> None:
    config = gl.load_config(config_path)
    services = builtin_services(["process", "files"], root)
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with gl.Worker(config, services, on_event=lambda line: print(line, flush=True)):
            async for signum in signals:
                print(f"worker-stopping signal={signal.Signals(signum).name}", flush=True)
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="worker TOML config (role = worker, dial)")
    parser.add_argument("--root", type=Path, required=True, help="directory served as '/'")
    args = parser.parse_args()
    anyio.run(serve, args.config, args.root)


if __name__ == "__main__":
    main()
