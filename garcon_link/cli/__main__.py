"""``python -m garcon_link.cli``: the ``garcon-link`` command line (see :mod:`garcon_link.cli`)."""

from __future__ import annotations

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
