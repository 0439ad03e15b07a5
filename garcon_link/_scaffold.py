"""The starter project of ``garcon-link init`` (and of the examples of README.md and the tutorial).

One source for all: ``tests/test_readme.py`` checks that the tutorial's ``calc.py``,
``worker.toml`` and ``controller.toml`` blocks (docs/tutorial.md) and the README's ``calc.py``
are exactly what :func:`files` writes for the default port, so they and ``init`` cannot drift
apart.

The pair listens and dials plain ``ws://`` on loopback, which the configuration allows without
``allow_insecure_development`` (it refuses plain text off loopback); a deployment adds ``[tls]``
(docs/guides/deployment.md).
"""

from __future__ import annotations

__all__ = [
    "CALC_PY",
    "DEFAULT_PORT",
    "EXECUTOR_ID",
    "SECRET_FILE",
    "SERVICE_ARG",
    "controller_toml",
    "files",
    "worker_toml",
]

DEFAULT_PORT = 8765
EXECUTOR_ID = "calc-box"
SECRET_FILE = "link.secret"
SERVICE_ARG = "calc=calc:CalculatorImpl"

CALC_PY = """\
# calc.py -- the contract (shared), the worker's implementation, and a controller
from collections.abc import AsyncIterator
from typing import Protocol

import anyio

import garcon_link as gl


class Calculator(Protocol):
    async def add(self, a: int, b: int) -> int: ...
    def count(self, n: int) -> AsyncIterator[int]: ...  # a stream


class CalculatorImpl:  # served: garcon-link worker worker.toml --service calc=calc:CalculatorImpl
    async def add(self, a: int, b: int) -> int:
        return a + b

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i


async def main() -> None:
    async with gl.connect(gl.load_config("controller.toml")) as executor:
        await executor.wait_ready(timeout=10)
        calc = executor.service("calc", Calculator)  # a stable facade, typed as Calculator
        print(await calc.add(1, 2))  # 3
        print([i async for i in calc.count(3)])  # [0, 1, 2]


if __name__ == "__main__":  # the worker imports this module: only `python calc.py` runs main()
    anyio.run(main)
"""


def worker_toml(port: int = DEFAULT_PORT) -> str:
    """The worker's configuration: listen on loopback, plain ``ws://``."""
    return (
        f'executor_id = "{EXECUTOR_ID}"       # the worker\'s name, the same on both sides\n'
        'role = "worker"\n'
        f'secret_file = "{SECRET_FILE}"    # written by: garcon-link keygen {SECRET_FILE}\n'
        "\n"
        "[connection]\n"
        f'listen = "127.0.0.1:{port}"      # plain ws:// is allowed on loopback only;'
        " elsewhere add [tls]\n"
    )


def controller_toml(port: int = DEFAULT_PORT) -> str:
    """The controller's configuration: dial the worker on loopback."""
    return (
        f'executor_id = "{EXECUTOR_ID}"\n'
        'role = "controller"\n'
        f'secret_file = "{SECRET_FILE}"    # the same secret file as the worker\'s\n'
        "\n"
        "[connection]\n"
        f'dial = "ws://127.0.0.1:{port}/executor"\n'
    )


def files(port: int = DEFAULT_PORT) -> dict[str, str]:
    """File name -> content of the starter project (the secret is written separately)."""
    return {
        "worker.toml": worker_toml(port),
        "controller.toml": controller_toml(port),
        "calc.py": CALC_PY,
    }
