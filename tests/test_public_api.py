"""Guards the public surface: ``garcon_link.__all__`` is exactly the curated list.

Adding or removing a public name is a deliberate change: update ``EXPECTED`` in the same commit.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import garcon_link

EXPECTED = [
    "AuthenticationError",
    "Availability",
    "CallEnd",
    "CallError",
    "CallHook",
    "CallInfo",
    "CallerConfig",
    "CallerSnapshot",
    "CallersConfig",
    "ConfigError",
    "DialExecutor",
    "ExecutorInfo",
    "ExecutorSnapshot",
    "Fleet",
    "FleetConfig",
    "FleetEvent",
    "GarconLinkError",
    "Gateway",
    "GatewayConfig",
    "GatewayExecutor",
    "GatewayFleet",
    "Grant",
    "HandshakeError",
    "Keyring",
    "Limits",
    "LinkConfig",
    "LinkError",
    "NotDispatched",
    "Outcome",
    "OutcomeUnknown",
    "PayloadTooLarge",
    "ProtocolError",
    "Rejected",
    "RemoteError",
    "RemoteExecutor",
    "ResourceRef",
    "Role",
    "Secret",
    "Service",
    "ServiceScope",
    "SessionFailed",
    "StaleResource",
    "SyncExecutor",
    "TlsConfig",
    "Worker",
    "WorkerScope",
    "__version__",
    "call_metadata",
    "connect",
    "connect_gateway",
    "connect_sync",
    "current_scope",
    "fleet",
    "gateway",
    "generate_secret",
    "load_caller_config",
    "load_config",
    "load_fleet_config",
    "load_gateway_config",
    "oneway",
    "peer",
    "register_exception",
    "serve",
    "unregister_exception",
    "with_options",
    "write_secret_file",
]


def test_all_is_exactly_the_curated_sorted_list() -> None:
    assert sorted(EXPECTED) == EXPECTED
    assert list(garcon_link.__all__) == EXPECTED


def test_all_has_no_duplicates() -> None:
    assert len(set(garcon_link.__all__)) == len(garcon_link.__all__)


@pytest.mark.parametrize("name", EXPECTED)
def test_every_name_is_importable(name: str) -> None:
    module = importlib.import_module("garcon_link")
    assert getattr(module, name) is not None
    namespace: dict[str, object] = {}
    exec(f"from garcon_link import {name}", namespace)
    assert namespace[name] is getattr(module, name)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from garcon_link import *", namespace)
    exported = {k for k in namespace if k != "__builtins__"}
    assert exported == set(EXPECTED)


def test_names_used_in_examples_are_public() -> None:
    # The names the README and docs/ use in examples must stay reachable as ``gl.<name>``.
    for name in (
        "load_config",
        "LinkConfig",
        "serve",
        "connect",
        "RemoteExecutor",
        "Outcome",
        "NotDispatched",
        "Rejected",
        "StaleResource",
        "OutcomeUnknown",
        "RemoteError",
        "CallError",
        "GarconLinkError",
        "ConfigError",
        "LinkError",
        "AuthenticationError",
        "ProtocolError",
    ):
        assert name in garcon_link.__all__, name


def test_exception_tree() -> None:
    gl = garcon_link
    assert issubclass(gl.CallError, gl.GarconLinkError)
    for sub in (gl.NotDispatched, gl.Rejected, gl.OutcomeUnknown, gl.RemoteError):
        assert issubclass(sub, gl.CallError)
    assert issubclass(gl.StaleResource, gl.Rejected)
    assert issubclass(gl.AuthenticationError, gl.LinkError)
    assert issubclass(gl.ProtocolError, gl.LinkError)
    assert issubclass(gl.ConfigError, gl.GarconLinkError)
    assert {o.name for o in gl.Outcome} == {"NOT_DISPATCHED", "REJECTED", "UNKNOWN", "FAILED"}


def test_public_callables_are_documented() -> None:
    for name in garcon_link.__all__:
        obj = getattr(garcon_link, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name} has no docstring"


def test_version_is_a_string() -> None:
    assert isinstance(garcon_link.__version__, str)
    assert garcon_link.__version__.count(".") >= 2


def test_the_declared_license_has_its_file_and_the_metadata_is_complete() -> None:
    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text("utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (root / "LICENSE").read_text("utf-8")
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    classifiers = project["classifiers"]
    for version in ("3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert "Typing :: Typed" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # PEP 639: the expression


def test_library_logs_stay_silent_until_the_application_configures_logging() -> None:
    emit = (
        "import logging, sys, garcon_link\n"
        "if sys.argv[1] == 'configured':\n"
        "    logging.basicConfig()\n"
        "logging.getLogger('garcon_link.link').warning('dial failed')\n"
    )
    for mode, expected in (("bare", ""), ("configured", "WARNING:garcon_link.link:dial failed\n")):
        done = subprocess.run(
            [sys.executable, "-c", emit, mode],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr == expected, (mode, done.stderr)


def test_help_starts_with_a_short_usage() -> None:
    """``help(garcon_link)`` opens with how to use it (connect, call, where the docs are)."""
    doc = garcon_link.__doc__
    assert doc is not None
    lines = doc.strip().splitlines()
    assert 10 <= len(lines) <= 25, len(lines)
    text = "\n".join(lines)
    for needed in ("gl.serve(", "gl.connect(", "wait_ready", "executor.service(", "docs/"):
        assert needed in text, needed


def _public_signatures() -> list[tuple[str, inspect.Signature]]:
    found = []
    for name in garcon_link.__all__:
        obj = getattr(garcon_link, name)
        members = inspect.getmembers(obj) if inspect.isclass(obj) else [("", obj)]
        for member, value in members:
            if (member.startswith("_") and member != "__init__") or not callable(value):
                continue
            try:
                found.append((f"{name}.{member}".rstrip("."), inspect.signature(value)))
            except (TypeError, ValueError):
                continue
    return found


def test_public_signatures_show_readable_defaults() -> None:
    """A default reads as a value (``UNSET``), never as ``<object object at 0x...>``; anyio's
    own ``task_status`` convention is left as anyio writes it."""
    unreadable = [
        f"{where}({parameter.name}={parameter.default!r})"
        for where, signature in _public_signatures()
        for parameter in signature.parameters.values()
        if parameter.default is not inspect.Parameter.empty
        and " at 0x" in repr(parameter.default)
        and parameter.name != "task_status"
    ]
    assert unreadable == []
    assert "timeout: 'float | Unset | None' = UNSET" in str(
        inspect.signature(garcon_link.with_options)
    )
