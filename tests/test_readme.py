"""The README's example and the tutorial's run as written, and ``garcon-link init`` writes them.

Both mark their example blocks with HTML comments. The tutorial (docs/tutorial.md):
``<!-- example-file: NAME -->`` before a file's block, ``<!-- example-commands -->`` before the
shell commands and ``<!-- example-output -->`` before what ``python calc.py`` prints (and the
``sync-example-*`` blocks of *Scripts and notebooks*). The README: ``<!-- readme-commands -->``
(``garcon-link init`` writes the project, ``cd`` enters it), ``<!-- readme-file: calc.py -->``
(what init writes) and ``<!-- readme-output -->``. The tests run each command line through
``sh`` exactly as written, in an environment with no venv activated (the commands name the
checkout's ``.venv``: a stand-in checkout links it to the venv running the tests), changing only
the port of the project's files to a free one, and compare the controller's output. Every
child has a deadline and is killed in ``finally``.
"""

from __future__ import annotations

import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from projectutil import (
    DEADLINE,
    README,
    TUTORIAL,
    background,
    command_lines,
    free_port,
    readme_blocks,
    run_project,
    wait_line,
)

from garcon_link import _scaffold


def test_tutorial_example_files_are_the_init_scaffold() -> None:
    assert readme_blocks("example-file", TUTORIAL) == _scaffold.files()


def test_tutorial_example_runs_as_written(tmp_path: Path) -> None:
    files = readme_blocks("example-file", TUTORIAL)
    assert set(files) == {"calc.py", "worker.toml", "controller.toml"}
    commands = command_lines(readme_blocks("example-commands", TUTORIAL)[""])
    project = tmp_path / "project"
    output = _run_example(project, files, commands)
    assert output == readme_blocks("example-output", TUTORIAL)[""]
    assert stat.S_IMODE((project / "link.secret").stat().st_mode) == 0o600


def test_readme_example_is_what_init_writes() -> None:
    assert readme_blocks("readme-file") == {"calc.py": _scaffold.files()["calc.py"]}


def test_readme_example_runs_as_written_in_a_fresh_shell(tmp_path: Path) -> None:
    """The README's four lines, from a stand-in checkout: init, cd, the worker, the controller."""
    checkout = _checkout(tmp_path)
    commands = command_lines(readme_blocks("readme-commands")[""])
    assert [c.split()[0] for c in commands] == [
        ".venv/bin/garcon-link",
        "cd",
        "../.venv/bin/garcon-link",
        "../.venv/bin/python",
    ], commands
    env = _fresh_shell(checkout)
    cwd = checkout
    init, cd, worker, controller = commands
    printed = _run(init, cwd, env)
    # What init prints to do next is what the README says, in the same fresh shell.
    assert [line.split(": ", 1)[1].strip() for line in printed.splitlines()[1:]] == [
        f"{cd} && {worker}",
        f"{cd} && {controller}",
    ], printed
    cwd = cwd / shlex.split(cd)[1]
    port = str(free_port())
    for name in ("worker.toml", "controller.toml"):  # the only change: a free port
        path = cwd / name
        path.write_text(path.read_text("utf-8").replace("8765", port), encoding="utf-8")
    with background(worker, cwd, env) as worker_lines:
        wait_line(worker_lines, "executor-listening")
        output = _run(controller, cwd, env)
        wait_line(worker_lines, "executor-ready")
    assert output == readme_blocks("readme-output")[""]
    assert stat.S_IMODE((cwd / "link.secret").stat().st_mode) == 0o600


def test_installs_are_visible_to_type_checkers() -> None:
    """setuptools' default editable install is an import hook mypy and pyright cannot see
    ("Cannot find implementation or library stub" in a user's file): the Makefile and the
    tutorial install in compat mode (a plain .pth path entry)."""
    root = README.parent
    makefile = (root / "Makefile").read_text("utf-8")
    assert "EDITABLE := --config-settings editable_mode=compat" in makefile
    installs = [line for line in makefile.splitlines() if "pip install" in line and " -e " in line]
    assert len(installs) == 5  # .installed, -test, -docs, -bench and its fallback
    assert all("$(EDITABLE) -e " in line for line in installs), installs
    tutorial = TUTORIAL.read_text("utf-8")
    editable = [line for line in tutorial.splitlines() if "pip install" in line and "-e ." in line]
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


def test_tutorial_sync_example_runs_as_written(tmp_path: Path) -> None:
    """*Scripts and notebooks*: the sync client's script, against the example's worker."""
    files = {
        **readme_blocks("example-file", TUTORIAL),
        **readme_blocks("sync-example-file", TUTORIAL),
    }
    assert set(files) == {"calc.py", "worker.toml", "controller.toml", "script.py"}
    commands = command_lines(readme_blocks("example-commands", TUTORIAL)[""])
    assert commands[-1] == "../.venv/bin/python calc.py"
    commands[-1] = "../.venv/bin/python script.py"
    output = _run_example(tmp_path / "project", files, commands)
    assert output == readme_blocks("sync-example-output", TUTORIAL)[""]


def _run_example(project: Path, files: dict[str, str], commands: list[str]) -> str:
    """Write ``files`` into ``project`` (on a free port instead of 8765), run ``commands`` as a
    fresh shell would: no venv activated, nothing of this process's environment but a plain
    ``PATH``. ``project``'s parent stands in for the checkout: its ``.venv`` is the venv
    running the tests (``make test``'s ``.venv``, or ``unit-py``'s)."""
    checkout = _checkout(project.parent)
    project.mkdir()
    port = str(free_port())
    for name, content in files.items():
        (project / name).write_text(content.replace("8765", port), encoding="utf-8")
    return run_project(project, commands, _fresh_shell(checkout))


def _checkout(directory: Path) -> Path:
    """``directory`` as a stand-in checkout whose ``.venv`` is the venv running the tests."""
    if sys.prefix == sys.base_prefix or not (Path(sys.prefix) / "bin" / "garcon-link").exists():
        pytest.skip("the examples' commands need the tests to run in a venv with garcon-link")
    (directory / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return directory


def _fresh_shell(checkout: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(checkout), "LANG": "C.UTF-8"}


def _run(command: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["sh", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=DEADLINE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout
