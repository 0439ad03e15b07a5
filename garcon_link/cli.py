"""The ``garcon-link`` command line (placeholder until the CLI issue lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``garcon-link`` console script."""
    args = sys.argv[1:] if argv is None else argv
    print(f"garcon-link {' '.join(args)}: not yet available")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
