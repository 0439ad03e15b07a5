"""Floor: raw wsproto over anyio sockets, answering all that one receive brought with one send."""

from __future__ import annotations

from .wsproto_anyio import main as _main


def main(argv: list[str] | None = None) -> None:
    _main(argv, coalesce=True, description=__doc__)


if __name__ == "__main__":
    main()
