"""README.md's *Example* runs as written, and ``garcon-link init`` writes the same project.

The README marks its example blocks with HTML comments: ``<!-- example-file: NAME -->`` before
a file's block, ``<!-- example-commands -->`` before the shell commands and
``<!-- example-output -->`` before what ``python calc.py`` prints. The test writes the files
into a temporary directory (changing only the port, to a free one), runs each command line
through ``sh`` exactly as written with ``garcon-link`` and ``python`` on ``PATH`` as small shims
to this interpreter (so the code under test is this checkout's), and compares the controller's
output. Every child has a deadline and is killed in ``finally``.
"""

from __future__ import annotations

import stat
from pathlib import Path

from projectutil import (
    README,
    command_lines,
    free_port,
    readme_blocks,
    run_project,
    shim_path,
)

from garcon_link import _scaffold


def test_readme_example_files_are_the_init_scaffold() -> None:
    assert readme_blocks("example-file") == _scaffold.files()


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    files = readme_blocks("example-file")
    assert set(files) == {"calc.py", "worker.toml", "controller.toml"}
    commands = command_lines(readme_blocks("example-commands")[""])
    expected = readme_blocks("example-output")[""]
    project = tmp_path / "project"
    project.mkdir()
    port = str(free_port())
    for name, content in files.items():
        (project / name).write_text(content.replace("8765", port), encoding="utf-8")
    output = run_project(project, commands, shim_path(tmp_path))
    assert output == expected
    assert stat.S_IMODE((project / "link.secret").stat().st_mode) == 0o600


def test_installs_are_visible_to_type_checkers() -> None:
    """setuptools' default editable install is an import hook mypy and pyright cannot see
    ("Cannot find implementation or library stub" in a user's file): the Makefile and the
    README install in compat mode (a plain .pth path entry)."""
    root = README.parent
    makefile = (root / "Makefile").read_text("utf-8")
    assert "EDITABLE := --config-settings editable_mode=compat" in makefile
    installs = [line for line in makefile.splitlines() if "pip install" in line and " -e " in line]
    assert len(installs) == 3
    assert all("$(EDITABLE) -e " in line for line in installs), installs
    readme = README.read_text("utf-8")
    editable = [line for line in readme.splitlines() if "pip install" in line and "-e ." in line]
    assert editable
    assert all("--config-settings editable_mode=compat" in line for line in editable), editable
