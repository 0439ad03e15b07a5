"""Facades are typed as their interface: mypy --strict (and pyright) on user files.

The fixture files under tests/typing/ are copied to a directory *outside the repository* and
checked there, with ``MYPYPATH`` removed: the package must be visible to the type checkers the
way the tutorial installs it (a plain or ``editable_mode=compat`` install puts a path entry they
follow; setuptools' default editable install is an import hook they cannot see).

``facade_ok.py`` uses ``executor.service("calc", Calc)`` (a Protocol), ``gl.with_options``,
``gl.peer`` and ``gl.Service[Calc](impl, Calc)`` correctly; ``sync_ok.py`` does the same with the
sync client (``gl.connect_sync`` and a sync view of the interface). Both must produce no diagnostics
at all; nor may ``lab_sync.py`` and ``lab_async.py``, the views ``garcon-link stub`` prints of
``lab_interface.py``'s interface (imports included). ``facade_bad.py`` and ``sync_bad.py`` mark
every line that must produce an error with ``# E: <message prefix>`` and every ``reveal_type`` with
``# N: <note>``; the test requires exactly those diagnostics, so a facade typed as ``Any`` (no
errors, ``Revealed type is "Any"``) fails it, and so does a signature mypy refuses for Protocols.
Notes that detail the error on their line (a Protocol's conflicting members) are not counted.
``gl.Service[Calc](WrongImpl(), Calc)`` must be rejected; plain ``gl.Service(WrongImpl(), Calc)``
cannot be (mypy infers ``T`` from the target), which the ``Service`` docstring says.

pyright checks the same files when it is installed (the ``test`` extra installs it; it runs on the
machine's Node.js; skipped, saying which is missing, without either): no error in the ``_ok``
files, and errors on exactly the ``E`` lines of the ``_bad`` ones (its messages differ from
mypy's, so only the lines are compared).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mypy import api as mypy_api

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "typing"
OK = ("facade_ok.py", "sync_ok.py", "lab_sync.py", "lab_async.py")
BAD = ("facade_bad.py", "sync_bad.py")
# Written by ``garcon-link stub`` from lab_interface.py (the interface they import) in user_dir.
STUBS = {"lab_sync.py": ["--sync"], "lab_async.py": []}

_DIAGNOSTIC = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): (?P<level>error|note): (?P<text>.*)$")
_EXPECTATION = re.compile(r"#\s*(?P<level>[EN]):\s*(?P<text>.*)$")

Diagnostics = dict[str, list[tuple[int, str, str]]]


def _normalise(text: str) -> str:
    # mypy spells builtins either "builtins.int" or "int" depending on the version.
    return text.replace("builtins.", "")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture files, copied where a user's project would be: outside the repository."""
    directory = tmp_path_factory.mktemp("user_project")
    assert ROOT not in directory.parents
    for name in (*OK, *BAD, "lab_interface.py"):
        if name not in STUBS:
            shutil.copy(FIXTURES / name, directory / name)
    for name, options in STUBS.items():
        # What a user does: print the view where the interface's module is, paste it as a file.
        printed = subprocess.run(
            [sys.executable, "-m", "garcon_link.cli", "stub", "lab_interface:Lab", *options],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert printed.returncode == 0, printed.stderr
        (directory / name).write_text(printed.stdout, encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def diagnostics(user_dir: Path) -> Diagnostics:
    """Run mypy --strict once over the fixture files; diagnostics per file name."""
    old_cwd = Path.cwd()
    old_path = os.environ.pop("MYPYPATH", None)
    os.chdir(user_dir)
    try:
        stdout, stderr, _status = mypy_api.run(
            [
                "--strict",
                "--warn-unreachable",
                "--no-incremental",
                "--show-error-codes",
                "--no-pretty",
                "--no-error-summary",
                *OK,
                *BAD,
            ]
        )
    finally:
        os.chdir(old_cwd)
        if old_path is not None:
            os.environ["MYPYPATH"] = old_path
    assert not stderr, stderr
    found: Diagnostics = {name: [] for name in OK + BAD}
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


def _expected(name: str) -> dict[int, tuple[str, str]]:
    expected: dict[int, tuple[str, str]] = {}
    source = (FIXTURES / name).read_text().splitlines()
    for number, line in enumerate(source, start=1):
        match = _EXPECTATION.search(line)
        if match:
            level = "error" if match["level"] == "E" else "note"
            expected[number] = (level, _normalise(match["text"].strip()))
    return expected


@pytest.mark.parametrize("name", OK)
def test_correct_use_type_checks(diagnostics: Diagnostics, name: str) -> None:
    assert diagnostics[name] == []
    assert set(diagnostics) == set(OK + BAD)


@pytest.mark.parametrize("name", BAD)
def test_wrong_use_is_rejected(diagnostics: Diagnostics, name: str) -> None:
    expected = _expected(name)
    assert len(expected) >= 7
    actual = diagnostics[name]
    by_line = {line: (level, text) for line, level, text in actual}
    assert len(by_line) == len(actual), f"more than one diagnostic on a line: {actual}"
    assert sorted(by_line) == sorted(expected), actual
    for line, (level, prefix) in expected.items():
        got_level, got_text = by_line[line]
        assert got_level == level, (line, got_text)
        assert got_text.startswith(prefix), (line, got_text, prefix)


def test_the_wrong_call_is_an_argument_type_error(diagnostics: Diagnostics) -> None:
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


def test_a_sync_facade_call_is_typed_without_await(diagnostics: Diagnostics) -> None:
    texts = [text for _, level, text in diagnostics["sync_bad.py"] if level == "error"]
    assert any(
        'Argument 1 to "add" of "CalcSync" has incompatible type "str"; expected "int"' in t
        and "[arg-type]" in t
        for t in texts
    )
    notes = [text for _, level, text in diagnostics["sync_bad.py"] if level == "note"]
    assert 'Revealed type is "int"' in notes  # calc.add(1, 2), no await: an int, no coroutine
    assert all("Any" not in n and "Coroutine" not in n for n in notes)


def _pyright() -> str | None:
    beside = Path(sys.executable).parent / "pyright"
    return str(beside) if beside.exists() else shutil.which("pyright")


@pytest.fixture(scope="module")
def pyright_errors(user_dir: Path) -> dict[str, set[int]]:
    """Lines pyright reports an error on, per fixture file (skipped without pyright)."""
    pyright = _pyright()
    if pyright is None:
        pytest.skip("pyright is not installed (pip install pyright, or the test extra)")
    if shutil.which("node") is None:
        # pyright's package would download a Node.js build of its own, which CI cannot.
        pytest.skip("pyright is installed but Node.js is not on PATH (apt-get install nodejs)")
    # Not MYPYPATH; and the bundled pyright, never another version fetched from npm.
    unwanted = {"MYPYPATH", "PYRIGHT_PYTHON_FORCE_VERSION", "PYRIGHT_PYTHON_PYLANCE_VERSION"}
    env = {k: v for k, v in os.environ.items() if k not in unwanted}
    done = subprocess.run(
        [pyright, "--pythonpath", sys.executable, "--outputjson", *OK, *BAD],
        cwd=user_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright did not run: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    errors: dict[str, set[int]] = {name: set() for name in OK + BAD}
    for diagnostic in report["generalDiagnostics"]:
        if diagnostic["severity"] == "error":
            name = Path(diagnostic["file"]).name
            # pyright counts lines from 0.
            errors.setdefault(name, set()).add(diagnostic["range"]["start"]["line"] + 1)
    return errors


@pytest.mark.parametrize("name", OK)
def test_pyright_accepts_correct_use(pyright_errors: dict[str, set[int]], name: str) -> None:
    assert pyright_errors[name] == set()


@pytest.mark.parametrize("name", BAD)
def test_pyright_rejects_wrong_use(pyright_errors: dict[str, set[int]], name: str) -> None:
    wanted = {line for line, (level, _) in _expected(name).items() if level == "error"}
    assert pyright_errors[name] == wanted
