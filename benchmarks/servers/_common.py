"""What every benchmark server shares: its command line, the READY line and its watchdog."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from .. import eventloop

HOST = "127.0.0.1"


def parse_args(
    description: str,
    argv: list[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """Parse ``--port``, ``--loop`` and ``--max-seconds`` (plus the server's own options)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: any)")
    parser.add_argument("--loop", choices=eventloop.CHOICES, default="asyncio")
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=3600.0,
        help="exit after this long whatever happens (a bound for a forgotten server)",
    )
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def start_watchdog(max_seconds: float) -> None:
    """Exit the process when stdin closes (the harness is done or died) or after max_seconds.

    ``os._exit`` because the serving loop of a synchronous server cannot be interrupted
    cleanly from another thread, and there is nothing to flush: a benchmark server keeps no
    state.
    """

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        os._exit(0)

    def watch_clock() -> None:
        time.sleep(max_seconds)
        print(f"benchmark server: --max-seconds {max_seconds} passed, exiting", file=sys.stderr)
        os._exit(2)

    threading.Thread(target=watch_stdin, name="stdin-watchdog", daemon=True).start()
    threading.Thread(target=watch_clock, name="clock-watchdog", daemon=True).start()


def announce(port: int) -> None:
    """Tell the harness which port the server listens on."""
    print(f"READY {port}", flush=True)


def run_asyncio(main: Callable[[], Coroutine[Any, Any, None]], loop: str) -> None:
    """Run ``main()`` on the chosen event loop."""
    with asyncio.Runner(loop_factory=eventloop.factory(loop)) as runner:
        runner.run(main())
