"""README.md's *Example* runs as written, and ``garcon-link init`` writes the same project.

The README marks its example blocks with HTML comments: ``<!-- example-file: NAME -->`` before
a file's block, ``<!-- example-commands -->`` before the shell commands and
``<!-- example-output -->`` before what ``python calc.py`` prints. The test writes the files
into a temporary directory (changing only the port, to a free one), runs each command line
through ``sh`` exactly as written, in an environment with no venv activated (the commands name
the checkout's ``.venv``: a stand-in checkout links it to the venv running the tests), and
compares the controller's output. Every child has a deadline and is killed in ``finally``.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest
from projectutil import (
    README,
    command_lines,
    free_port,
    readme_blocks,
    run_project,
)

from garcon_link import _scaffold


def test_readme_example_files_are_the_init_scaffold() -> None:
    assert readme_blocks("example-file") == _scaffold.files()


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    files = readme_blocks("example-file")
    assert set(files) == {"calc.py", "worker.toml", "controller.toml"}
    commands = command_lines(readme_blocks("example-commands")[""])
    project = tmp_path / "project"
    output = _run_example(project, files, commands)
    assert output == readme_blocks("example-output")[""]
    assert stat.S_IMODE((project / "link.secret").stat().st_mode) == 0o600


def test_installs_are_visible_to_type_checkers() -> None:
    """setuptools' default editable install is an import hook mypy and pyright cannot see
    ("Cannot find implementation or library stub" in a user's file): the Makefile and the
    README install in compat mode (a plain .pth path entry)."""
    root = README.parent
    makefile = (root / "Makefile").read_text("utf-8")
    assert "EDITABLE := --config-settings editable_mode=compat" in makefile
    installs = [line for line in makefile.splitlines() if "pip install" in line and " -e " in line]
    assert len(installs) == 4  # .installed, -test, -bench and its fallback
    assert all("$(EDITABLE) -e " in line for line in installs), installs
    readme = README.read_text("utf-8")
    editable = [line for line in readme.splitlines() if "pip install" in line and "-e ." in line]
    assert editable
    assert all("--config-settings editable_mode=compat" in line for line in editable), editable


def test_ci_finds_the_other_pythons_and_says_when_one_is_absent(tmp_path: Path) -> None:
    """.ci/run runs the suite under 3.12 and 3.13 where pyenv (or PATH) has them."""
    script = README.parent / ".ci" / "run"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    text = script.read_text("utf-8")
    assert "for version in 3.12 3.13; do" in text
    assert 'make unit-py PY="$python"' in text
    function = text[text.index("find_python() {") : text.index("\n}\n", text.index("find_python"))]
    fake = tmp_path / "versions" / "3.12.7" / "bin"
    fake.mkdir(parents=True)
    (fake / "python3").write_text("#!/bin/sh\n")
    probe = f'{function}\n}}\nfor v in 3.12 3.99; do echo "$v=[$(find_python $v)]"; done\n'
    done = subprocess.run(
        ["bash", "-c", probe],
        env={"PYENV_ROOT": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"3.12=[{fake / 'python3'}]", "3.99=[]"]


def test_readme_sync_example_runs_as_written(tmp_path: Path) -> None:
    """*Scripts and notebooks*: the sync client's script, against the example's worker."""
    files = {**readme_blocks("example-file"), **readme_blocks("sync-example-file")}
    assert set(files) == {"calc.py", "worker.toml", "controller.toml", "script.py"}
    commands = command_lines(readme_blocks("example-commands")[""])
    assert commands[-1] == "../.venv/bin/python calc.py"
    commands[-1] = "../.venv/bin/python script.py"
    output = _run_example(tmp_path / "project", files, commands)
    assert output == readme_blocks("sync-example-output")[""]


def _run_example(project: Path, files: dict[str, str], commands: list[str]) -> str:
    """Write ``files`` into ``project`` (on a free port instead of 8765), run ``commands`` as a
    fresh shell would: no venv activated, nothing of this process's environment but a plain
    ``PATH``. ``project``'s parent stands in for the checkout: its ``.venv`` is the venv
    running the tests (``make test``'s ``.venv``, or ``unit-py``'s)."""
    if sys.prefix == sys.base_prefix or not (Path(sys.prefix) / "bin" / "garcon-link").exists():
        pytest.skip("the README's commands need the tests to run in a venv with garcon-link")
    checkout = project.parent
    (checkout / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    project.mkdir()
    port = str(free_port())
    for name, content in files.items():
        (project / name).write_text(content.replace("8765", port), encoding="utf-8")
    fresh_shell = {"PATH": "/usr/bin:/bin", "HOME": str(checkout), "LANG": "C.UTF-8"}
    return run_project(project, commands, fresh_shell)
