"""Each example runs as one command, exits 0 and says what it did (bounded by a timeout)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

EXPECTED = {
    "gateway": [
        "enrolled guest: callers/guest.secret (mode 0600); copy it to the caller",
        '$ garcon-link call web-1.toml --executor device-1 sensors.whoami\n  "device-1"   (exit 0)',
        "error: [rejected:FORBIDDEN] caller 'guest' has no grant for executor 'device-1'   "
        "(exit 4)",
        "21.5   (exit 0)",
        "web-2 sees ['device-1']",
        "(resumed); whoami x3 -> ['device-1', 'device-1', 'device-1']",
        "keyed bump() retried on a new session -> 1; device-1 ran it 1 time(s)",
        "gateway: ok",
    ],
    "kvstore": [
        "executor-listening url=ws://127.0.0.1:",
        "kv.get('color')           -> 'blue'",
        "kv.delete('size')         -> True",
        "v3 delete size",
        "v4 set    color = 'green'",
        "kvstore: ok",
    ],
    "controller_dials": [
        "executor-listening url=ws://127.0.0.1:",
        "-> 'Hello, Ada! (call #1 on this worker)'",
        "-> [5, 4, 3, 2, 1, 0]",
        '"Hello, Grace! (call #2 on this worker)"   (exit 0)',
        "executor-stopping executor=greeter-1 reason=SIGTERM   (exit 0)",
        "controller_dials: ok",
    ],
    "device_executor": [
        "stale edit refused: VERSION_MISMATCH",
        "durable-started id=firmware-build",
        "run.py: controller killed (SIGKILL) mid-build; starting a new one",
        "start(id='firmware-build') again -> the same process",
        "'build step 1' .. 'build step 200'; exit 0; runs.log says it ran 1 time(s)",
        "example-ok",
    ],
    "fleet": [
        "enrolled device-1: keys/device-1.secret (mode 0600)",
        "await fleet.map(whoami) -> {'device-1': 'device-1', 'device-2': 'device-2', "
        "'device-3': 'device-3'}",
        "(4004, backing off); device-1 still answers 'device-1'",
        "device-3 whoami()        -> NotDispatched [not_dispatched:OFFLINE]",
        "device-1, device-2       -> {'device-1': 'device-1', 'device-2': 'device-2'}",
        "fleet: ok",
    ],
    "rolling_upgrade": [
        "enrolled 20 workers: keys/box-00.secret .. keys/box-19.secret",
        "box-00 (v2)  scale(1.5) via the v1 facade -> Rejected [rejected:CONTRACT_CHANGED] "
        "calc.scale: the worker's contract is incompatible with this interface's "
        "(result float  =>  'str' (wider)); nothing was sent",
        "fleet.pick('calc', 'mul') over 40 picks -> box-00\n",
        "upgraded 20/20:",
        "ledger: v2 scale handlers that ran for a v1 caller: 0",
        "rolling_upgrade: ok",
    ],
    "worker_dials": [
        "executor-dialing url=ws://127.0.0.1:",
        "[4/4] package: ok",
        "NotDispatched [not_dispatched:OFFLINE]",
        "(same facade, fresh session)",
        "worker_dials: ok",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name / "run.py")],
        capture_output=True,
        text=True,
        timeout=90,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    for fragment in EXPECTED[name]:
        assert fragment in done.stdout, f"{fragment!r} missing from:\n{done.stdout}"
    # The secret lived in a temporary workspace that is gone now.
    workspace = re.search(r"keygen (\S+)/link\.secret", done.stdout)
    assert workspace is not None
    assert not Path(workspace.group(1)).exists()


def test_no_secret_is_committed_with_the_examples() -> None:
    assert "*.secret" in (EXAMPLES / ".gitignore").read_text(encoding="utf-8").splitlines()
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "--", str(EXAMPLES)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=EXAMPLES,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        tracked = []
    assert not [path for path in tracked if path.endswith(".secret")]
    for config in EXAMPLES.rglob("*.toml"):
        text = config.read_text(encoding="utf-8")
        # A pair shares link.secret; a fleet device has its own key, and a gateway's caller
        # too; a fleet controller has a keyring of them instead of a secret.
        assert re.search(
            r"^secret_file = \"(link|(keys|callers)/[\w.-]+)\.secret\"", text, re.MULTILINE
        ) or re.search(r"^keyring = \"keys\"", text, re.MULTILINE), config
        assert not re.search(r"^secret\s*=", text, re.MULTILINE), config


# -------------------------------------------------------------------- reference pages in sync


LIMITS_PAGE = EXAMPLES.parent / "docs" / "reference" / "limits.md"
CLI_PAGE = EXAMPLES.parent / "docs" / "reference" / "cli.md"


def _shown(name: str, value: int | float, unit: str = "s") -> str:
    if isinstance(value, float):
        return f"{value:g} {unit}".rstrip()
    if name.endswith("_bytes"):
        for unit, size in (("MiB", 1024 * 1024), ("KiB", 1024)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
    return f"{value:,}"


def render_limits_table() -> str:
    """The ``[limits]`` table of docs/reference/limits.md, from ``Limits.describe()`` and the
    defaults."""
    import dataclasses

    from garcon_link import Limits

    docs = Limits.describe()
    defaults = Limits()
    rows = ["| `[limits]` key | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(Limits):
        shown = _shown(f.name, getattr(defaults, f.name), f.metadata.get("unit", "s"))
        rows.append(f"| `{f.name}` | {shown} | {docs[f.name]} |")
    return "\n".join(rows)


def test_limits_page_table_matches_the_code() -> None:
    text = LIMITS_PAGE.read_text(encoding="utf-8")
    begin, end = "<!-- limits-table:begin -->\n", "\n<!-- limits-table:end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)]
    assert table == render_limits_table(), (
        "docs/reference/limits.md: the [limits] table differs from Limits; regenerate it with "
        "`.venv/bin/python tests/test_examples.py`"
    )


def test_cli_page_exit_codes_match_the_cli() -> None:
    from garcon_link import cli

    text = CLI_PAGE.read_text(encoding="utf-8")
    for code, name in [
        (cli.EXIT_NOT_DISPATCHED, "NotDispatched"),
        (cli.EXIT_REJECTED, "Rejected"),
        (cli.EXIT_REMOTE_ERROR, "RemoteError"),
        (cli.EXIT_OUTCOME_UNKNOWN, "OutcomeUnknown"),
    ]:
        assert f"| {code} | `{name}`" in text


def write_limits_table() -> None:
    """Regenerate the ``[limits]`` table of docs/reference/limits.md:
    ``python tests/test_examples.py``."""
    text = LIMITS_PAGE.read_text(encoding="utf-8")
    begin, end = "<!-- limits-table:begin -->\n", "\n<!-- limits-table:end -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    LIMITS_PAGE.write_text(head + begin + render_limits_table() + end + tail, encoding="utf-8")


if __name__ == "__main__":
    write_limits_table()
