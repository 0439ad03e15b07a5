"""``python -m tests.model``: explore the protocol within the given bounds; exit 1 on a finding."""

from __future__ import annotations

import argparse
import sys

from .controllers import CONTROLLERS_VERIFY
from .explorer import explore
from .network import CI, VERIFY, Bounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model", description=__doc__)
    parser.add_argument(
        "--preset",
        choices=("ci", "verify", "controllers"),
        default="ci",
        help="controllers: two controllers on one listening worker (tests/model/controllers.py), "
        "at the bound make verify explores; the bound flags are for the others",
    )
    for name in (
        "sends",
        "cuts",
        "restarts",
        "expiries",
        "dials",
        "worker-frames",
        "pool-bytes",
        "splits",
        "worker-sends",
    ):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument(
        "--copy",
        choices=("clone", "deepcopy", "replay"),
        default="clone",
        help="how a state is copied for each successor (the others: to measure)",
    )
    parser.add_argument("--no-liveness", action="store_true")
    args = parser.parse_args(argv)
    if args.preset == "controllers":
        result = explore(CONTROLLERS_VERIFY, liveness=not args.no_liveness, copy_mode=args.copy)
        if result.counterexample is not None:
            print(result.counterexample.render())
        print(result.summary())
        return 0 if result.counterexample is None else 1
    bounds = CI if args.preset == "ci" else VERIFY
    changes = {
        f: getattr(args, f)
        for f in (
            "sends",
            "cuts",
            "restarts",
            "expiries",
            "dials",
            "worker_frames",
            "pool_bytes",
            "splits",
            "worker_sends",
        )
        if getattr(args, f) is not None
    }
    if changes:
        bounds = Bounds(**{**bounds.__dict__, **changes})
    result = explore(bounds, liveness=not args.no_liveness, copy_mode=args.copy)
    if result.counterexample is not None:
        print(result.counterexample.render())
    print(result.summary())
    return 0 if result.counterexample is None else 1


if __name__ == "__main__":
    sys.exit(main())
