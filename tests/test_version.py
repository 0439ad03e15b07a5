"""The version is written once, in ``garcon_link/version.py``; everything else reads it.

pyproject.toml declares the version dynamic and has setuptools read that attribute; setuptools
reads it without importing the package only when it is a plain string literal, which is checked
here too (an import at build time would need the dependencies in the build environment). The
installed metadata, the hello's ``package`` field and ``garcon-link --version`` all follow it,
and CHANGELOG.md has a section for it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

import garcon_link
from garcon_link import cli
from garcon_link.core.handshake import Handshake, derive_key
from garcon_link.core.wire import Role

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_INIT = ROOT / "garcon_link" / "version.py"
# PEP 440, the forms this project uses: release, optional pre-release, post and dev parts.
VERSION = re.compile(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?")


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))


def test_pyproject_reads_the_version_from_the_package() -> None:
    data = _pyproject()
    project = data["project"]
    assert isinstance(project, dict)
    assert "version" not in project
    assert "version" in project["dynamic"]
    tool = data["tool"]
    assert isinstance(tool, dict)
    assert tool["setuptools"]["dynamic"]["version"] == {"attr": "garcon_link.version.__version__"}


def test_the_version_is_one_string_literal_in_the_package() -> None:
    assignments = []
    for path in sorted((ROOT / "garcon_link").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
            ):
                assignments.append((path, node.value))
    assert [path for path, _ in assignments] == [PACKAGE_INIT]
    value = assignments[0][1]
    assert isinstance(value, ast.Constant)
    assert value.value == garcon_link.__version__
    assert VERSION.fullmatch(garcon_link.__version__)


def test_the_installed_metadata_has_the_package_version() -> None:
    # The Makefile reinstalls when garcon_link/version.py changes; after a change made by hand,
    # reinstall (make .venv/.installed-test) for this to hold.
    assert importlib.metadata.version("garcon-link") == garcon_link.__version__


def test_the_hello_and_the_command_line_say_the_package_version(
    capsys: pytest.CaptureFixture[str],
) -> None:
    handshake = Handshake(
        role=Role.WORKER,
        executor_id="box",
        key=derive_key(bytes(32)),
        runtime=bytes(16),
        nonce=bytes(32),
        resume=None,
    )
    assert handshake.local_hello.package == f"garcon-link {garcon_link.__version__}"
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"garcon-link {garcon_link.__version__}"


def test_the_changelog_has_a_section_for_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text("utf-8")
    sections = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert sections[0] == "Unreleased"
    assert garcon_link.__version__ in sections
