"""Us: garcon_link serving the benchmark service (implemented in ``benchmarks/ours.py``)."""

from __future__ import annotations

import sys

from .. import ours
from ._common import announce, parse_args, run_asyncio, start_watchdog


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    reason = ours.unavailable_reason()
    if reason is not None:
        print(f"not available: {reason}", file=sys.stderr)
        raise SystemExit(3)
    start_watchdog(args.max_seconds)

    async def serve() -> None:
        await ours.serve(args.port, announce)

    run_asyncio(serve, args.loop)


if __name__ == "__main__":
    main()
