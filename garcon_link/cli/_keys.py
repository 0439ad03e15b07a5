"""``garcon-link keygen`` and ``garcon-link init``: secret files, keyring enrollment, the starter
project."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from .. import _scaffold
from ..settings.keyring import enroll
from ..settings.secrets import write_secret_file
from ._exits import EXIT_OK, UsageError
from ._output import _emit, _setup_logging

# --------------------------------------------------------------------------- keygen


def _cmd_keygen(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    if ns.executor is not None and ns.caller is not None:
        raise UsageError("keygen takes --executor ID or --caller ID, not both")
    who = ns.executor if ns.executor is not None else ns.caller
    flag = "--executor" if ns.caller is None else "--caller"
    if ns.keyring is None and who is None:
        if ns.path is None:
            raise UsageError("keygen needs PATH, or --keyring DIR --executor ID (or --caller ID)")
        path = write_secret_file(ns.path, force=ns.force)
        _emit(str(path))
        return EXIT_OK
    if ns.keyring is None:
        raise UsageError(f"keygen {flag} needs --keyring too (--keyring DIR {flag} ID)")
    if who is None:
        raise UsageError(
            "keygen --keyring needs --executor too (--keyring DIR --executor ID), or --caller ID "
            "for a gateway's caller"
        )
    if ns.path is not None:
        raise UsageError(f"keygen takes either PATH or --keyring DIR {flag} ID, not both")
    path = enroll(
        ns.keyring, who, force=ns.force, kind="executor" if ns.caller is None else "caller"
    )
    peer = "worker" if ns.caller is None else "caller"
    _emit(f"enrolled {who}: {path} (mode 0600); copy it to the {peer} as its secret_file")
    return EXIT_OK


# --------------------------------------------------------------------------- init


def _cmd_init(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    if not 0 < ns.port < 65536:
        raise UsageError(f"--port {ns.port}: expected a port number from 1 to 65535")
    directory = Path(ns.dir)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: not a directory; give a new or empty directory")
    if directory.is_dir() and any(directory.iterdir()) and not ns.force:
        raise UsageError(
            f"{directory}: the directory is not empty; give a new or empty directory, or pass "
            "--force to write the starter files there (replacing files of the same names)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"{directory}: cannot create the directory ({exc.strerror or type(exc).__name__}); "
            "give a path where you may create one"
        ) from None
    secret = write_secret_file(directory / _scaffold.SECRET_FILE, force=ns.force)
    written = []
    for name, content in _scaffold.files(ns.port).items():
        path = directory / name
        path.write_text(content, encoding="utf-8")
        written.append(str(path))
    # Already there (init .): no "cd . &&" before the commands.
    here = directory.resolve() == Path.cwd().resolve()
    cd = "" if here else f"cd {shlex.quote(str(directory))} && "
    garcon_link, python = (_program(name, directory) for name in ("garcon-link", "python"))
    _emit(f"wrote {', '.join(written)} and {secret} (the shared secret, mode 0600)")
    _emit(
        f"start the worker:       {cd}{garcon_link} worker worker.toml "
        f"--service {_scaffold.SERVICE_ARG}"
    )
    _emit(f"then, in another shell: {cd}{python} calc.py")
    return EXIT_OK


def _bin_dir() -> Path:
    """The directory of the programs running this command: the ``garcon-link`` script's as it
    was started (a venv's ``bin``, through whatever link it was named by), else the
    interpreter's (``python -m garcon_link``)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.name == "garcon-link":
        return Path(os.path.abspath(script.parent))
    return Path(os.path.abspath(os.path.dirname(sys.executable)))


def _program(name: str, directory: Path) -> str:
    """How a shell in ``directory`` runs this installation's ``name`` (``garcon-link`` or
    ``python``): the plain name when ``PATH`` finds it there first (an activated venv), else
    its path, relative to ``directory`` when that is shorter (``../.venv/bin/python`` in a
    fresh shell, where a plain ``python`` could not import garcon_link)."""
    bin_dir = _bin_dir()
    program = bin_dir / name
    found = shutil.which(name)
    try:
        on_path = found is not None and os.path.samefile(os.path.dirname(found), bin_dir)
    except OSError:
        on_path = False
    if on_path or not program.is_file():
        return name
    absolute = str(program)
    relative = os.path.relpath(absolute, os.path.abspath(directory))
    return shlex.quote(relative if len(relative) < len(absolute) else absolute)
