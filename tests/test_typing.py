"""The facade is typed as its interface: mypy --strict on the fixture files under tests/typing/.

``facade_ok.py`` uses ``executor.service("calc", Calc)`` (a Protocol), ``gl.with_options``,
``gl.peer`` and ``gl.Service[Calc](impl, Calc)`` correctly and must produce no diagnostics at
all. ``facade_bad.py`` marks every line that must produce an error with ``# E: <message
prefix>`` and every ``reveal_type`` with ``# N: <note>``; the test requires exactly those
diagnostics, so a facade typed as ``Any`` (no errors, ``Revealed type is "Any"``) fails it, and
so does a signature mypy refuses for Protocols. Notes that detail the error on their line (a
Protocol's conflicting members) are not counted. ``gl.Service[Calc](WrongImpl(), Calc)`` must be
rejected; plain ``gl.Service(WrongImpl(), Calc)`` cannot be (mypy infers ``T`` from the target),
which the ``Service`` docstring says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "typing"

_DIAGNOSTIC = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): (?P<level>error|note): (?P<text>.*)$")
_EXPECTATION = re.compile(r"#\s*(?P<level>[EN]):\s*(?P<text>.*)$")


def _normalise(text: str) -> str:
    # mypy spells builtins either "builtins.int" or "int" depending on the version.
    return text.replace("builtins.", "")


@pytest.fixture(scope="module")
def diagnostics() -> dict[str, list[tuple[int, str, str]]]:
    """Run mypy --strict once over both fixture files; diagnostics per file name."""
    import os

    old_cwd = Path.cwd()
    old_path = os.environ.get("MYPYPATH")
    os.chdir(ROOT)
    os.environ["MYPYPATH"] = str(ROOT)  # the package is an editable install mypy cannot see
    try:
        stdout, stderr, _status = mypy_api.run(
            [
                "--strict",
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--show-error-codes",
                "--no-pretty",
                "--no-error-summary",
                str(FIXTURES / "facade_ok.py"),
                str(FIXTURES / "facade_bad.py"),
            ]
        )
    finally:
        os.chdir(old_cwd)
        if old_path is None:
            os.environ.pop("MYPYPATH", None)
        else:
            os.environ["MYPYPATH"] = old_path
    assert not stderr, stderr
    found: dict[str, list[tuple[int, str, str]]] = {"facade_ok.py": [], "facade_bad.py": []}
    for line in stdout.splitlines():
        match = _DIAGNOSTIC.match(line)
        assert match, f"unparsed mypy output: {line!r}"
        name = Path(match["path"]).name
        entry = (int(match["line"]), match["level"], _normalise(match["text"]))
        previous = found.get(name, [])
        if entry[1] == "note" and previous and previous[-1][:2] == (entry[0], "error"):
            continue  # the detail of the error just before it (e.g. a Protocol's conflicts)
        found.setdefault(name, []).append(entry)
    return found


def test_correct_use_type_checks(diagnostics: dict[str, list[tuple[int, str, str]]]) -> None:
    assert diagnostics["facade_ok.py"] == []
    assert set(diagnostics) == {"facade_ok.py", "facade_bad.py"}


def test_wrong_use_is_rejected(diagnostics: dict[str, list[tuple[int, str, str]]]) -> None:
    expected: dict[int, tuple[str, str]] = {}
    source = (FIXTURES / "facade_bad.py").read_text().splitlines()
    for number, line in enumerate(source, start=1):
        match = _EXPECTATION.search(line)
        if match:
            level = "error" if match["level"] == "E" else "note"
            expected[number] = (level, _normalise(match["text"].strip()))
    assert len(expected) >= 7
    actual = diagnostics["facade_bad.py"]
    by_line = {line: (level, text) for line, level, text in actual}
    assert len(by_line) == len(actual), f"more than one diagnostic on a line: {actual}"
    assert sorted(by_line) == sorted(expected), actual
    for line, (level, prefix) in expected.items():
        got_level, got_text = by_line[line]
        assert got_level == level, (line, got_text)
        assert got_text.startswith(prefix), (line, got_text, prefix)


def test_the_wrong_call_is_an_argument_type_error(
    diagnostics: dict[str, list[tuple[int, str, str]]],
) -> None:
    texts = [text for _, level, text in diagnostics["facade_bad.py"] if level == "error"]
    assert any(
        'Argument 1 to "add" of "Calc" has incompatible type "str"; expected "int"' in t
        and "[arg-type]" in t
        for t in texts
    )
    assert any(
        'Argument 1 to "Service" has incompatible type "WrongImpl"; expected "Calc"' in t
        for t in texts
    )
    notes = [text for _, level, text in diagnostics["facade_bad.py"] if level == "note"]
    assert 'Revealed type is "facade_bad.Calc"' in notes
    assert all("Any" not in n for n in notes)
