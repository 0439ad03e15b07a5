"""What every command shares: its lines on stdout and stderr, JSON output, the log setup of
``-v``/``--log-json``, and loading CONFIG."""

from __future__ import annotations

import base64
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..logs import JsonFormatter
from ..settings.callers import CallerConfig, load_caller_config
from ..settings.config import CONFIG_ENV_VAR, LinkConfig, load_config, read_document
from ..settings.fleet import FleetConfig, load_fleet_config
from ._exits import StdoutClosed, UsageError

# --------------------------------------------------------------------------- output


def _emit(line: str) -> None:
    """Print one line of output on stdout, at once.

    Raises:
        StdoutClosed: nobody reads stdout any more (a closed pipe).
    """
    try:
        print(line, flush=True)
    except BrokenPipeError as exc:
        raise StdoutClosed from exc


def _error_line(
    message: str, *, json_lines: bool = False, exc: BaseException | None = None
) -> None:
    """The command's one error line on stderr, whatever the message holds: ``error: <message>``;
    with ``json_lines`` (``--log-json``) a JSON object shaped as the log lines
    (:class:`~garcon_link.logs.JsonFormatter`: level ``ERROR``, logger ``garcon_link.cli``,
    ``message`` the same ``error: ...`` text), with ``exc``'s traceback as ``exception``."""
    text = f"error: {' '.join(message.split())}"
    if json_lines:
        exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        record = logging.LogRecord(_CLI_LOGGER, logging.ERROR, __file__, 0, text, None, exc_info)
        text = JsonFormatter().format(record)
    print(text, file=sys.stderr, flush=True)


_CLI_LOGGER = "garcon_link.cli"
"""The logger the command line's own lines name (its error line with ``--log-json``)."""


def _stderr_text(text: str, *, json_lines: bool) -> None:
    """A multi-line text for stderr (a remote traceback under ``-v``): as it is, or with
    ``json_lines`` as one JSON log line (level ``ERROR``, logger ``garcon_link.cli``)."""
    if json_lines:
        record = logging.LogRecord(_CLI_LOGGER, logging.ERROR, __file__, 0, text, None, None)
        text = JsonFormatter().format(record)
    print(text, file=sys.stderr, flush=True)


def jsonable(value: Any) -> Any:
    """Convert a decoded wire value to JSON-encodable data.

    ``bytes`` become base64 text; map keys become text (bytes keys base64); tuples and sets become
    lists; anything else unknown is shown by ``str()``.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {_json_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    return str(value)


def _json_key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, bytes | bytearray):
        return base64.b64encode(bytes(key)).decode("ascii")
    return json.dumps(jsonable(key)) if not isinstance(key, int | float | bool) else str(key)


def _print_json(value: Any) -> None:
    _emit(json.dumps(jsonable(value), ensure_ascii=False))


# --------------------------------------------------------------------------- logging


def _setup_logging(verbosity: int, *, quiet_by_default: bool, json_lines: bool = False) -> None:
    """``-v`` WARNING, ``-vv`` INFO, ``-vvv`` DEBUG; without ``-v`` the worker logs WARNING and
    the other commands log nothing (their one error line says what went wrong). ``json_lines``
    (``--log-json``): one JSON object per line (:class:`garcon_link.logs.JsonFormatter`)."""
    if verbosity <= 0:
        level = logging.CRITICAL + 1 if quiet_by_default else logging.WARNING
    else:
        level = {1: logging.WARNING, 2: logging.INFO}.get(verbosity, logging.DEBUG)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(level)


# --------------------------------------------------------------------------- config


def _given(path: str | None, example: str) -> str | None:
    """CONFIG as the loaders take it: ``None`` (or ``-``) reads ``GARCON_LINK_CONFIG``. Neither
    given: a usage error showing ``example``, the command with a CONFIG."""
    given = None if path in (None, "-") else path
    if given is None and not os.environ.get(CONFIG_ENV_VAR, ""):
        raise UsageError(
            f"no CONFIG given and {CONFIG_ENV_VAR} is not set; name the configuration file, "
            f"e.g. `{example}`, or set {CONFIG_ENV_VAR}=/path/to/it.toml"
        )
    return given


_ROLE_FILES = {"worker": "worker.toml", "controller": "controller.toml"}


def _require_role(config: LinkConfig, role: str, command: str) -> None:
    """Refuse a configuration of the other role, naming the file, the command and the fix."""
    if config.role.value == role:
        return
    source = config.source if config.source is not None else "the configuration"
    raise ConfigError(
        f'{source}: role: role = "{config.role.value}" is a {config.role.value}\'s '
        f'configuration, and `garcon-link {command}` needs a {role}\'s (role = "{role}"); '
        f"give it the {role}'s file instead (`garcon-link init DIR` writes a matching "
        f"{_ROLE_FILES[role]})"
    )


def _load(path: str | None, role: str, command: str) -> LinkConfig:
    """Load CONFIG for ``command``, which needs a configuration of ``role``; ``None`` or ``-``
    reads the path from ``GARCON_LINK_CONFIG``."""
    config = load_config(_given(path, f"garcon-link {command} {_ROLE_FILES[role]}"))
    _require_role(config, role, command)
    return config


def _shape(given: str | None) -> str:
    """``"fleet"`` (``[executors]``), ``"caller"`` (``role = "caller"``) or ``"link"``: which
    loader reads CONFIG (a file that does not read is the plain loader's to report)."""
    source = given if given is not None else os.environ.get(CONFIG_ENV_VAR, "")
    if not source:
        return "link"
    try:  # the loaders' own reader: a regular file, bounded, never blocking
        document = read_document(source)
    except ConfigError:
        return "link"
    if document.get("role") == "caller":
        return "caller"
    return "fleet" if "executors" in document else "link"


def _load_any(path: str | None, command: str, example: str) -> LinkConfig | FleetConfig:
    """Load CONFIG as a fleet controller's configuration if it has ``[executors]``, else as one
    controller's (errors of either are reported by its own loader). ``example`` is ``command``
    with a CONFIG, for the message when none is given."""
    given = _given(path, example)
    if _shape(given) == "fleet":
        return load_fleet_config(given)
    config = load_config(given)
    _require_role(config, "controller", command)
    return config


def _load_caller_or_any(
    path: str | None, command: str, example: str
) -> LinkConfig | FleetConfig | CallerConfig:
    """:func:`_load_any`, or a gateway caller's configuration (``role = "caller"``)."""
    given = _given(path, example)
    if _shape(given) == "caller":
        return load_caller_config(given)
    return _load_any(given, command, example)
