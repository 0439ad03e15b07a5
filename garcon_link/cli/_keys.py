"""``garcon-link keygen`` and ``garcon-link init``: secret files, keyring enrollment, the starter
project."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .. import _scaffold
from ..settings.keyring import enroll
from ..settings.secrets import write_secret_file
from ._exits import EXIT_OK, UsageError
from ._output import _emit, _setup_logging

# --------------------------------------------------------------------------- keygen


def _cmd_keygen(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    if ns.keyring is None and ns.executor is None:
        if ns.path is None:
            raise UsageError("keygen needs PATH, or --keyring DIR --executor ID")
        path = write_secret_file(ns.path, force=ns.force)
        _emit(str(path))
        return EXIT_OK
    if ns.keyring is None or ns.executor is None:
        given, missing = (
            ("--keyring", "--executor")
            if ns.executor is None
            else (
                "--executor",
                "--keyring",
            )
        )
        raise UsageError(f"keygen {given} needs {missing} too (--keyring DIR --executor ID)")
    if ns.path is not None:
        raise UsageError("keygen takes either PATH or --keyring DIR --executor ID, not both")
    path = enroll(ns.keyring, ns.executor, force=ns.force)
    _emit(f"enrolled {ns.executor}: {path} (mode 0600); copy it to the worker as its secret_file")
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
    directory.mkdir(parents=True, exist_ok=True)
    secret = write_secret_file(directory / _scaffold.SECRET_FILE, force=ns.force)
    written = []
    for name, content in _scaffold.files(ns.port).items():
        path = directory / name
        path.write_text(content, encoding="utf-8")
        written.append(str(path))
    # Already there (init .): no "cd . &&" before the commands.
    here = directory.resolve() == Path.cwd().resolve()
    cd = "" if here else f"cd {shlex.quote(str(directory))} && "
    _emit(f"wrote {', '.join(written)} and {secret} (the shared secret, mode 0600)")
    _emit(
        f"start the worker:       {cd}garcon-link worker worker.toml "
        f"--service {_scaffold.SERVICE_ARG}"
    )
    _emit(f"then, in another shell: {cd}python calc.py")
    return EXIT_OK
