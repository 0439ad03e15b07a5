"""Hostile settings files (garcon_link.settings): whatever an operator's editor, a script or an
attacker with write access to a configuration leaves there, every loader answers with one
ConfigError line naming the file, never a traceback from tomllib.

The shapes: arrays and inline tables nested past any sensible depth (tomllib parses them by
recursion), dotted table names of many parts, and each of these for every loader (a link, a fleet,
a gateway, a gateway's caller).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import garcon_link as gl
from garcon_link.settings.callers import load_caller_config, load_gateway_config
from garcon_link.settings.config import MAX_CONFIG_DEPTH

LOADERS: list[Callable[[Path], Any]] = [
    gl.load_config,
    gl.load_fleet_config,
    load_gateway_config,
    load_caller_config,
]


def _refused(loader: Callable[[Path], Any], path: Path) -> str:
    with pytest.raises(gl.ConfigError) as info:
        loader(path)
    text = str(info.value)
    assert "\n" not in text and str(path) in text
    assert len(text) < 1_000
    return text


def _nested(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "1" + "]" * depth
    return "{a=" * depth + "1" + "}" * depth


# Depths: just past the bound, around tomllib's recursion limit, and far past it (the file is
# still small: 200 000 levels are 400 kB).
@pytest.mark.parametrize("depth", [MAX_CONFIG_DEPTH + 1, 400, 1_000, 200_000])
@pytest.mark.parametrize("kind", ["array", "inline"])
@pytest.mark.parametrize("where", ["top", "limits", "tls"])
@pytest.mark.parametrize("loader", LOADERS, ids=lambda f: f.__name__)
@pytest.mark.timeout(10)
def test_nesting_past_the_bound_is_one_line(
    tmp_path: Path, loader: Callable[[Path], Any], where: str, kind: str, depth: int
) -> None:
    value = _nested(depth, kind)
    text = {
        "top": f'executor_id = "box"\nrole = "worker"\nsecret = {value}\n',
        "limits": f'executor_id = "box"\nrole = "worker"\n[limits]\nmax_frame_bytes = {value}\n',
        "tls": f'executor_id = "box"\n[tls]\nca = {value}\n',
    }[where]
    path = tmp_path / "link.toml"
    path.write_text(text)
    path.chmod(0o600)
    message = _refused(loader, path)
    assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in message


@pytest.mark.parametrize("loader", LOADERS, ids=lambda f: f.__name__)
def test_nesting_within_the_bound_reaches_the_schema_checks(
    tmp_path: Path, loader: Callable[[Path], Any]
) -> None:
    path = tmp_path / "link.toml"
    path.write_text(f'executor_id = "box"\nsecret = {_nested(MAX_CONFIG_DEPTH - 1, "array")}\n')
    path.chmod(0o600)
    assert "nested deeper" not in _refused(loader, path)


@pytest.mark.parametrize(
    "shape",
    ["[{name}]\n", "[[{name}]]\n", "{name} = 1\n", "x = {{{name} = 1}}\n"],
)
@pytest.mark.parametrize("parts", [MAX_CONFIG_DEPTH + 1, 100, 200_000])
@pytest.mark.parametrize("loader", LOADERS, ids=lambda f: f.__name__)
@pytest.mark.timeout(10)
def test_a_dotted_name_of_many_parts_is_one_line_and_quick(
    tmp_path: Path, loader: Callable[[Path], Any], parts: int, shape: str
) -> None:
    # tomllib takes time quadratic in one dotted name's parts (20 000 parts: 5 s; a 16 MiB file
    # holds 8 million): such a name is refused before it is parsed.
    path = tmp_path / "link.toml"
    path.write_text(shape.format(name=".".join(["a"] * parts)))
    path.chmod(0o600)
    with cpu_deadline(2.0):
        message = _refused(loader, path)
    if parts > 2 * MAX_CONFIG_DEPTH + 1:
        assert "line 1 holds a dotted name of more than" in message
    else:
        assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in message


def test_dots_in_values_are_no_dotted_names(tmp_path: Path) -> None:
    # Addresses, versions and paths hold dots, separated by other characters: never refused as
    # a long name, however many there are in the file.
    path = tmp_path / "link.toml"
    hosts = ", ".join(f'"wss://10.0.{i // 250}.{i % 250}:8443/a.b"' for i in range(2_000))
    path.write_text(f'executor_id = "box"\nrole = "controller"\nunknown = [{hosts}]\n')
    path.chmod(0o600)
    message = _refused(gl.load_config, path)
    assert "unknown" in message and "dotted name" not in message


def test_rows_of_dots_in_comments_are_no_dotted_names(tmp_path: Path) -> None:
    # A separator drawn with dots, or an ellipsis, has no part before each dot: no name at all.
    path = tmp_path / "link.toml"
    rule = "." * (4 * MAX_CONFIG_DEPTH)
    path.write_text(f'# {rule}\nexecutor_id = "box"  # and so on {rule}\nrole = "controller"\n')
    path.chmod(0o600)
    message = _refused(gl.load_config, path)
    assert "dotted name" not in message


@contextlib.contextmanager
def cpu_deadline(seconds: float) -> Iterator[None]:
    """Fails the test if its block took ``seconds`` of this process's CPU time or more (CPU,
    not wall-clock: a busy machine does not make it fail)."""
    start = time.process_time()
    yield
    spent = time.process_time() - start
    assert spent < seconds, f"{spent:.2f}s of CPU"
