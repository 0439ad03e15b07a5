"""``python -m garcon_link``: the ``garcon-link`` command line (see :mod:`garcon_link.cli`)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
