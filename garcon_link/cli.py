"""The ``garcon-link`` command line.

Commands
--------
``garcon-link demo``
    The whole story on loopback: a worker in a child process, a controller in this one, calls, a
    stream, a socket cut that resumes, a worker kill and restart, a graceful stop
    (SIGTERM drain; see :mod:`garcon_link.demo`).

``garcon-link worker [CONFIG|-] [--service NAME=module:attr ...] [--builtin NAMES --root DIR]``
    Serve services until SIGINT/SIGTERM (then exit 0). Prints one ``key=value`` line per event on
    stdout, flushed: ``executor-listening`` (or ``executor-dialing``), ``executor-ready`` for each
    fresh logical session, ``executor-stopping`` on a signal. With ``--stop-on-stdin-eof`` it also
    stops when its stdin is closed (a supervising parent that dies takes the worker with it).

    A signal first *drains* (``--drain S``, default 10 s, 0 to stop at once): it
    prints ``executor-draining executor=ID reason=SIGTERM seconds=S running=N``, refuses the
    controller's new calls with ``NotDispatched("DRAINING")`` while the ``N`` running calls
    finish and their replies are acknowledged (at most ``S`` seconds; a second signal cuts it
    short), then prints ``executor-stopping`` and closes (1001). A call still running then fails
    ``OutcomeUnknown`` for its caller.
    With no ``--service`` and no ``--builtin`` it warns on stderr (one line) that it serves
    nothing.

    ``attr`` may be a dotted path inside ``module``; the current directory is importable (as with
    ``python -m``). What it names decides how it is served:

    * an object (or a :class:`~garcon_link.Service` wrapping one with an explicit interface) is
      served as ``NAME`` for the life of the process;
    * a class is instantiated once, with no arguments, and served like an object;
    * a function is a *per-session factory*: called with the session's
      :class:`~garcon_link.ServiceScope`, it returns an async context manager that yields the
      object served as ``NAME`` for that logical session (closed when the session is retired).

    Services compose: objects and factories may be mixed; a fresh session enters every factory.

    ``--builtin process,files --root DIR`` adds the built-in services confined to ``DIR`` (see
    :mod:`garcon_link.services`); ``--allow-special-mode-bits`` lets file service callers set
    setuid, setgid and sticky bits with an explicit ``mode`` (refused by default);
    ``--spool-dir DIR`` spools the process service's output to disk under ``DIR`` instead of
    memory (bounded by ``ServiceLimits.disk_spool_bytes`` per stream).

``garcon-link keygen PATH [--force]``
    Write a new secret file (64 hex digits, mode 0600) and print its path. An existing file is
    never overwritten without ``--force``.

``garcon-link keygen --keyring DIR --executor ID [--force]``
    Enroll an executor with a listening fleet controller: write a new secret to
    ``DIR/ID.secret`` (mode 0600; ``DIR`` is created with mode 0700 if missing) and print where
    it went, never the secret. Copy the file to the worker as its ``secret_file``. ``ID`` must be
    a file-name-safe id (ASCII letters, digits, ``.``, ``_``, ``-``; not starting with ``.``).

``garcon-link init DIR [--port N] [--force]``
    Write a starter project into ``DIR`` (created if missing): ``worker.toml`` and
    ``controller.toml`` (a matched pair on loopback, port 8765 unless ``--port``), a fresh secret
    ``link.secret`` (mode 0600, as ``keygen`` writes it) and ``calc.py`` (README.md's example);
    then print the two commands to run. A non-empty ``DIR`` is refused (exit 2) unless
    ``--force``, which replaces files of the same names.

``garcon-link call [CONFIG|-] SERVICE.METHOD [JSON_ARGS]``
    Connect with a controller configuration, wait until the executor is ready (``--timeout``), make
    one call and print its result as one JSON line (a stream: one JSON line per item; a one-way
    method: nothing, once the worker has received it). ``JSON_ARGS`` is a JSON array (positional
    arguments) or object (keyword arguments). There is no interface class here: the call is built
    from the worker's manifest and the worker validates the arguments against its type hints.
    When the configuration listens (the worker dials in), ``call`` waits up to ``--timeout`` for
    the worker to dial. ``bytes`` in a result print as base64 text (standard alphabet, padded).

``garcon-link call CONFIG --executor ID SERVICE.METHOD [JSON_ARGS]``
    The same through a fleet controller's configuration (``[executors]``): the call goes to
    executor ``ID`` (with a single-executor configuration ``ID`` must be its ``executor_id``).

``garcon-link fleet [CONFIG|-] [--json]``
    Run a fleet controller (``[executors]``: a keyring listener and/or dial entries) until
    SIGINT/SIGTERM and show its executors: on a terminal a table redrawn in place (executor,
    availability, session, since, calls, errors); otherwise, or with ``--json``, one line per
    event (``joined``, ``ready``, ``reconnecting``, ``offline``, ``forgotten``, ``lost``).

``garcon-link describe [CONFIG|-] [--json] [--executor ID]``
    Connect like ``call`` and print what the worker serves, one method per line (grpcurl-style):
    ``unary  calc.add(a: int, b: int) -> int``; ``--json`` prints the executor id, the contract
    hash and the whole manifest as one JSON object instead.

CONFIG may be omitted (``call`` with one argument, or whose second argument is JSON) or given as
``-``: the path is then read from ``GARCON_LINK_CONFIG``.

Exit codes
----------
====  =========================================================================
0     success
1     any other failure (a link error such as a port in use, an OS error), and
      an unexpected internal error (a bug: ``error: internal error, ...``)
2     usage or configuration error (bad arguments, bad config, keygen or init
      refused)
3     ``NotDispatched``: definitely not executed (offline, not ready in time)
4     ``Rejected``: reached the worker and refused unexecuted (unknown method,
      invalid arguments, stale resource)
5     ``RemoteError``: executed and raised
6     ``OutcomeUnknown``: may have executed (timeout, continuity lost)
7     ``worker``: another process took over this executor id (two workers claim
      one id: an operator error, so the worker stops instead of redialing)
8     the other end refused us for a reason a redial will not heal: wrong secret
      or executor id (4001), protocol version (4002), role (4003); at once, not
      at ``--timeout``, with what to fix
130   interrupted (Ctrl-C); ``call`` says whether the call had been sent (it
      may then have run: the outcome is unknown) or not (it did not run)
====  =========================================================================

Every failure prints exactly one line on stderr, ``error: <what>``; a call's failure reads
``error: [outcome:code] message``. Tracebacks are not printed: ``-v`` (before or after the
command) adds the library's log, for ``RemoteError`` the remote traceback, and for an internal
error (an exception that is not a usage, configuration, link, call or OS error: a bug) its
traceback before the line. ``--log-json`` (before or after the command) writes those log lines as
JSON objects, one per line, with the ``gl_*`` fields of :mod:`garcon_link.logs`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib
import inspect
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import textwrap
import threading
import time
import tomllib
import traceback
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio

from . import _scaffold
from .api.controller import ExecutorInfo, RemoteExecutor, connect
from .api.fleet import Fleet, FleetEvent, fleet
from .api.registration import ServiceFactory, ServiceMap
from .api.worker import Worker
from .errors import (
    ConfigError,
    GarconLinkError,
    HandshakeError,
    NotDispatched,
    OutcomeUnknown,
    Rejected,
    RemoteError,
)
from .logs import JsonFormatter
from .rpc.interface import MethodKind, MethodSpec, manifest_method
from .rpc.resources import ServiceScope
from .settings.config import (
    CONFIG_ENV_VAR,
    FleetConfig,
    LinkConfig,
    load_config,
    load_fleet_config,
)
from .settings.keyring import enroll
from .settings.secrets import write_secret_file

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_NOT_DISPATCHED",
    "EXIT_OK",
    "EXIT_OTHER",
    "EXIT_OUTCOME_UNKNOWN",
    "EXIT_REJECTED",
    "EXIT_REFUSED",
    "EXIT_REMOTE_ERROR",
    "EXIT_TAKEN_OVER",
    "EXIT_USAGE",
    "CallInterrupted",
    "UsageError",
    "build_parser",
    "build_services",
    "describe_lines",
    "fleet_table",
    "dynamic_method",
    "exit_code_for",
    "jsonable",
    "main",
]

EXIT_OK = 0
EXIT_OTHER = 1
EXIT_USAGE = 2
EXIT_NOT_DISPATCHED = 3
EXIT_REJECTED = 4
EXIT_REMOTE_ERROR = 5
EXIT_OUTCOME_UNKNOWN = 6
EXIT_TAKEN_OVER = 7
EXIT_REFUSED = 8
EXIT_INTERRUPTED = 130

_EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    other failure (link or OS error; an internal error: -v shows why)
  2    usage or configuration error
  3    NotDispatched   not executed (offline, not ready within --timeout)
  4    Rejected        refused unexecuted (unknown method, bad arguments)
  5    RemoteError     executed and raised
  6    OutcomeUnknown  may have executed (timeout, continuity lost)
  7    worker: another process took over this executor id
  8    refused by the other end: wrong secret or executor id, role, version
  130  interrupted (call: the message says whether the call was sent)

Errors print one line on stderr, "error: [outcome:code] message", without a traceback.
"""

log = logging.getLogger(__name__)

DEFAULT_DRAIN = 10.0
"""Seconds ``garcon-link worker`` drains on a signal unless ``--drain`` says otherwise."""


def _drain_seconds(text: str) -> float:
    """``--drain``'s value: finite seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {text!r}")
    return value


class UsageError(Exception):
    """Bad command-line input (exit code 2)."""


class TakenOver(GarconLinkError):
    """A worker stopped because another process took over its executor id (exit code 7)."""


# --------------------------------------------------------------------------- output


def _emit(line: str) -> None:
    print(line, flush=True)


def _error_line(message: str) -> None:
    # One line, whatever the message holds.
    text = " ".join(message.split())
    print(f"error: {text}", file=sys.stderr, flush=True)


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
    print(json.dumps(jsonable(value), ensure_ascii=False), flush=True)


# --------------------------------------------------------------------------- failures


def exit_code_for(exc: BaseException) -> int:
    """The exit code for a failure (see the module docstring's table)."""
    if isinstance(exc, UsageError | ConfigError):
        return EXIT_USAGE
    if isinstance(exc, NotDispatched):
        return EXIT_NOT_DISPATCHED
    if isinstance(exc, Rejected):
        return EXIT_REJECTED
    if isinstance(exc, RemoteError):
        return EXIT_REMOTE_ERROR
    if isinstance(exc, OutcomeUnknown):
        return EXIT_OUTCOME_UNKNOWN
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, TakenOver):
        return EXIT_TAKEN_OVER
    if isinstance(exc, HandshakeError):
        return EXIT_REFUSED
    return EXIT_OTHER


def _leaf(exc: BaseException) -> BaseException:
    """The first meaningful exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not _is_cancellation(e)] or list(exc.exceptions)
        exc = inner[0]
    return exc


def _is_cancellation(exc: BaseException) -> bool:
    # Called after the event loop has ended: anyio.get_cancelled_exc_class() would raise
    # NoEventLoopError here, so name each backend's class instead (trio only if it was loaded).
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    cancelled = getattr(trio, "Cancelled", None)
    return isinstance(cancelled, type) and isinstance(exc, cancelled)


def _is_expected(exc: BaseException) -> bool:
    """A failure the one error line fully explains (anything else is a bug: -v shows it)."""
    return isinstance(exc, UsageError | GarconLinkError | OSError | KeyboardInterrupt)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, UsageError | GarconLinkError):
        return str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "interrupted"
    if isinstance(exc, OSError) and exc.strerror:
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror}{where}"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc}"
    return f"internal error, {type(exc).__name__}: {exc}"


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


def _load(path: str | None) -> LinkConfig:
    """Load CONFIG; ``None`` or ``-`` reads the path from ``GARCON_LINK_CONFIG``."""
    return load_config(None if path in (None, "-") else path)


def _load_any(path: str | None) -> LinkConfig | FleetConfig:
    """Load CONFIG as a fleet controller's configuration if it has ``[executors]``, else as one
    endpoint's (errors of either are reported by its own loader)."""
    given = None if path in (None, "-") else path
    source = given if given is not None else os.environ.get(CONFIG_ENV_VAR, "")
    try:
        with open(source, "rb") as file:
            fleet_file = "executors" in tomllib.load(file)
    except (OSError, ValueError):
        fleet_file = False  # the loader says what is wrong with it
    return load_fleet_config(given) if fleet_file else load_config(given)


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
    where = shlex.quote(str(directory))
    _emit(f"wrote {', '.join(written)} and {secret} (the shared secret, mode 0600)")
    _emit(
        f"start the worker:       cd {where} && garcon-link worker worker.toml "
        f"--service {_scaffold.SERVICE_ARG}"
    )
    _emit(f"then, in another shell: cd {where} && python calc.py")
    return EXIT_OK


# --------------------------------------------------------------------------- worker


def _import_target(text: str) -> tuple[str, object]:
    """Parse ``NAME=module:attr`` and import what it names."""
    name, sep, target = text.partition("=")
    module_name, colon, attr = target.partition(":")
    if not sep or not name or not colon or not module_name or not attr:
        raise UsageError(
            f"--service {text!r}: expected NAME=module:attr, e.g. calc=mypkg.calc:Calc"
        )
    if name.startswith(("_", "$")) or not name.isprintable() or any(c.isspace() for c in name):
        raise UsageError(f"--service {text!r}: invalid service name {name!r}")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(
            f"--service {text!r}: cannot import module {module_name!r}: {exc}"
        ) from exc
    except Exception as exc:
        raise UsageError(
            f"--service {text!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(
                f"--service {text!r}: {module_name!r} has no attribute {attr!r}"
            ) from None
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise UsageError(
                f"--service {text!r}: cannot instantiate {attr} with no arguments: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return name, obj


def _is_factory(obj: object) -> bool:
    return inspect.isfunction(obj) or inspect.ismethod(obj)


def build_services(
    specs: Sequence[str],
    *,
    builtin: Sequence[str] = (),
    root: str | None = None,
    allow_special_mode_bits: bool = False,
    spool_dir: str | None = None,
) -> ServiceMap | ServiceFactory:
    """Turn ``--service`` (and ``--builtin``/``--root``) arguments into what a Worker takes.

    Without factories this is a plain mapping (validated by the worker at start-up). With at least
    one factory, or built-in services, a per-session factory that enters every factory, merges the
    built-in services (``process``, ``files`` confined to ``root``) and adds the plain objects.

    ``allow_special_mode_bits`` lets the built-in file service's callers set setuid, setgid and
    sticky bits with an explicit ``mode`` (refused by default).

    Raises:
        UsageError: a malformed or duplicate argument, an import that fails, ``--builtin``
            without ``--root``, or ``--allow-special-mode-bits`` or ``--spool-dir`` without
            ``--builtin``.
        ConfigError: an unknown built-in name, or a ``--root`` or ``--spool-dir`` that is not a
            directory.
    """
    entries: dict[str, object] = {}
    builtin_factory: ServiceFactory | None = None
    if builtin:
        if root is None:
            raise UsageError("--builtin needs --root DIR (the directory the services may use)")
        from .services import builtin_services

        builtin_factory = builtin_services(
            builtin, root, allow_special_mode_bits=allow_special_mode_bits, spool_dir=spool_dir
        )
    elif spool_dir is not None:
        raise UsageError("--spool-dir is only meaningful with --builtin process")
    elif root is not None:
        raise UsageError("--root is only meaningful with --builtin")
    elif allow_special_mode_bits:
        raise UsageError("--allow-special-mode-bits is only meaningful with --builtin files")
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    for text in specs:
        name, obj = _import_target(text)
        if name in entries:
            raise UsageError(f"--service {text!r}: service {name!r} is given twice")
        entries[name] = obj
    if builtin_factory is None and not any(_is_factory(obj) for obj in entries.values()):
        return entries

    @contextlib.asynccontextmanager
    async def per_session(scope: ServiceScope) -> AsyncIterator[ServiceMap]:
        async with contextlib.AsyncExitStack() as stack:
            services: dict[str, object] = {}
            if builtin_factory is not None:
                provided = await stack.enter_async_context(builtin_factory(scope))
                clash = sorted(set(provided) & set(entries))
                if clash:
                    raise UsageError(f"--service names clash with --builtin: {', '.join(clash)}")
                services.update(provided)
            for name, obj in entries.items():
                if _is_factory(obj):
                    factory: Callable[[ServiceScope], Any] = obj  # type: ignore[assignment]
                    services[name] = await stack.enter_async_context(factory(scope))
                else:
                    services[name] = obj
            yield services

    return per_session


class _StdinWatch:
    """``--stop-on-stdin-eof``: a daemon thread reads stdin to EOF, then signals SIGTERM to this
    process, so the one signal path below handles it (a parent that dies closes our stdin).

    It is started only once the signal receiver is installed: stdin may be at EOF already, and
    a SIGTERM before that would kill the process by default (exit 143, no ``executor-stopping``).
    """

    closed = False

    @classmethod
    def start(cls) -> None:
        def watch() -> None:
            with contextlib.suppress(OSError):
                while os.read(0, 65536):
                    pass
            cls.closed = True
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="stdin-eof-watch", daemon=True).start()


def _worker_events(*, warn_serves_nothing: bool) -> Callable[[str], None]:
    """The worker's ``on_event``: print each event line; with ``warn_serves_nothing``, once the
    worker is up (so a failure to start stays one error line), warn that it serves nothing."""
    warned = False

    def on_event(line: str) -> None:
        nonlocal warned
        _emit(line)
        if (
            warn_serves_nothing
            and not warned
            and line.startswith(("executor-listening", "executor-dialing"))
        ):
            warned = True
            print(
                "warning: no --service or --builtin given: this worker serves nothing (only the "
                "internal describe); add --service NAME=module:attr",
                file=sys.stderr,
                flush=True,
            )

    return on_event


async def _serve_until_signal(
    config: LinkConfig,
    services: ServiceMap | ServiceFactory,
    stop_on_stdin_eof: bool = False,
    on_event: Callable[[str], None] = _emit,
    drain: float = DEFAULT_DRAIN,
) -> None:
    """Serve until SIGINT/SIGTERM; then drain for up to ``drain`` seconds (a second signal
    ends the drain), print ``executor-stopping`` and close gracefully."""
    try:
        receiver = anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
    except NotImplementedError:  # pragma: no cover - Windows: Ctrl-C raises KeyboardInterrupt
        async with Worker(config, services, on_event=on_event):
            await anyio.sleep_forever()
        return
    with receiver as signals:
        # The handlers exist from here on: only now may the watcher raise SIGTERM.
        if stop_on_stdin_eof:
            _StdinWatch.start()
        async with Worker(config, services, on_event=on_event) as worker:
            async with anyio.create_task_group() as tg:

                async def taken_over() -> None:
                    await worker.wait_stopped()
                    tg.cancel_scope.cancel()

                tg.start_soon(taken_over)
                reason = None
                async for signum in signals:
                    reason = "stdin-closed" if _StdinWatch.closed else signal.Signals(signum).name
                    tg.cancel_scope.cancel()
                    break
            if reason is not None:
                if drain > 0:
                    await _drain_until_signal(worker, config.executor_id, reason, drain, signals)
                _emit(f"executor-stopping executor={config.executor_id} reason={reason}")
            if worker.taken_over is not None:
                _emit(f"executor-stopping executor={config.executor_id} reason=TAKEN_OVER")
                raise TakenOver(
                    f"another process took over executor id {config.executor_id!r} "
                    f"({worker.taken_over}); two workers must not share one executor id"
                )


async def _drain_until_signal(
    worker: Worker, executor_id: str, reason: str, seconds: float, signals: AsyncIterator[int]
) -> None:
    """Drain ``worker`` (see :meth:`Worker.aclose`) for up to ``seconds``; another signal ends
    the drain at once (the worker is then closed as without one)."""
    rpc = worker.current_rpc
    running = rpc.statistics().incoming_calls if rpc is not None else 0
    _emit(
        f"executor-draining executor={executor_id} reason={reason} seconds={seconds:g} "
        f"running={running}"
    )
    async with anyio.create_task_group() as tg:

        async def second_signal() -> None:
            async for _ in signals:
                log.warning("a second signal: the drain is cut short")
                tg.cancel_scope.cancel()

        tg.start_soon(second_signal)
        # Not worker.aclose(drain=...): that drain is shielded, and a second signal must end it.
        await worker._drain(seconds)
        tg.cancel_scope.cancel()


def _cmd_worker(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=False, json_lines=ns.log_json)
    services = build_services(
        ns.service or [],
        builtin=ns.builtin or [],
        root=ns.root,
        allow_special_mode_bits=ns.allow_special_mode_bits,
        spool_dir=ns.spool_dir,
    )
    config = _load(ns.config)
    on_event = _worker_events(warn_serves_nothing=not ns.service and not ns.builtin)
    anyio.run(_serve_until_signal, config, services, ns.stop_on_stdin_eof, on_event, ns.drain)
    return EXIT_OK


# --------------------------------------------------------------------------- call


def dynamic_method(services: Mapping[str, Any], service: str, method: str) -> MethodSpec:
    """A :class:`MethodSpec` for ``service.method`` built from a worker's manifest.

    It accepts any arguments and passes them through untyped: the worker validates them. The
    result (a stream's items) is checked against the return type the manifest declares, as far
    as it can be rebuilt from its text (:func:`~garcon_link.interface.manifest_result_hint`): a
    ``-> int`` method that returns a string fails with ``RemoteError("INVALID_RESULT")``.

    Raises:
        Rejected: the manifest has no such service or method (``UNKNOWN_SERVICE`` /
            ``OPERATION_UNSUPPORTED``, as the worker itself would answer).
    """
    return manifest_method(services, service, method)


def _split_call_operands(operands: Sequence[str]) -> tuple[str | None, str, str | None]:
    """``[CONFIG] SERVICE.METHOD [JSON_ARGS]`` -> (config, target, json_args)."""
    if len(operands) == 1:
        return None, operands[0], None
    if len(operands) == 2:
        # A SERVICE.METHOD never starts with "[" or "{"; JSON_ARGS always does.
        if operands[1].lstrip().startswith(("[", "{")):
            return None, operands[0], operands[1]
        return operands[0], operands[1], None
    if len(operands) == 3:
        return operands[0], operands[1], operands[2]
    raise UsageError("call takes [CONFIG] SERVICE.METHOD [JSON_ARGS]")


def _parse_target(text: str) -> tuple[str, str]:
    service, dot, method = text.rpartition(".")
    if not dot or not service or not method:
        raise UsageError(f"{text!r}: expected SERVICE.METHOD, e.g. calc.add")
    return service, method


def _parse_arguments(text: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if text is None:
        return (), {}
    try:
        value = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer over Python's digit limit
        raise UsageError(f"JSON_ARGS is not valid JSON: {exc}") from None
    if isinstance(value, list):
        return tuple(value), {}
    if isinstance(value, dict):
        return (), value
    raise UsageError("JSON_ARGS must be a JSON array (positional) or object (keyword arguments)")


class _CallProgress:
    """How far ``call`` got, for the message of a Ctrl-C: once the request is handed to the link
    it may reach the worker and run, so an interruption after that cannot say it did not."""

    dispatched = False


class CallInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``call`` (exit 130); the message says whether the call was sent."""

    def __init__(self, dispatched: bool) -> None:
        super().__init__(
            "interrupted after the call was sent: it may have run on the worker (outcome unknown)"
            if dispatched
            else "interrupted before the call was sent: it did not run"
        )


@contextlib.asynccontextmanager
async def _open_executor(
    config: LinkConfig | FleetConfig, executor_id: str | None
) -> AsyncIterator[RemoteExecutor]:
    """The executor a command talks to: the single one of a LinkConfig, or ``executor_id``
    through a fleet controller's configuration."""
    if isinstance(config, LinkConfig):
        if executor_id is not None and executor_id != config.executor_id:
            raise UsageError(
                f"--executor {executor_id!r}: this configuration serves only {config.executor_id!r}"
            )
        async with connect(config) as executor:
            yield executor
        return
    if executor_id is None:
        raise UsageError("a fleet configuration ([executors]) needs --executor ID")
    async with fleet(config) as controller:
        try:
            executor = controller.executor(executor_id)
        except ValueError as exc:
            raise UsageError(f"--executor: {exc}") from None
        yield executor


async def _call(
    config: LinkConfig | FleetConfig,
    service: str,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    ready_timeout: float,
    call_timeout: float | None,
    progress: _CallProgress | None = None,
    executor_id: str | None = None,
) -> None:
    async with _open_executor(config, executor_id) as executor:
        try:
            await executor.wait_ready(timeout=ready_timeout)
        except TimeoutError as exc:
            raise NotDispatched("NOT_READY", str(exc)) from None
        info = await executor.info()
        spec = dynamic_method(info.services, service, method)
        rpc = executor.current_rpc
        if rpc is None:
            raise NotDispatched("OFFLINE", executor.last_error or "the executor went offline")
        if progress is not None:
            progress.dispatched = True
        timeout = config.limits.call_timeout if call_timeout is None else call_timeout
        if spec.kind is MethodKind.STREAM:
            stream = rpc.stream(service, spec, args, kwargs)
            try:
                async for item in stream:
                    _print_json(item)
            finally:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
        elif spec.kind is MethodKind.ONEWAY:
            await rpc.notify(service, spec, args, kwargs)
            # Delivery barrier: replies come back in order, so once this round trip completes
            # the worker has received the notification (closing earlier could retire it unsent).
            await rpc.describe_peer(timeout=timeout)
        else:
            _print_json(await rpc.call(service, spec, args, kwargs, timeout=timeout))


def _cmd_call(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    config_path, target, json_args = _split_call_operands(ns.operands)
    service, method = _parse_target(target)
    args, kwargs = _parse_arguments(json_args)
    if ns.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    config = _load_any(config_path)
    progress = _CallProgress()
    try:
        anyio.run(
            lambda: _call(
                config,
                service,
                method,
                args,
                kwargs,
                ready_timeout=ns.timeout,
                call_timeout=ns.call_timeout,
                progress=progress,
                executor_id=ns.executor,
            )
        )
    except BaseException as exc:
        leaf = _leaf(exc)
        if isinstance(leaf, KeyboardInterrupt):
            raise CallInterrupted(progress.dispatched) from None
        if ns.verbose and isinstance(leaf, RemoteError) and leaf.remote_traceback:
            print(leaf.remote_traceback.rstrip(), file=sys.stderr)
        raise
    return EXIT_OK


# --------------------------------------------------------------------------- describe


def describe_lines(services: Mapping[str, Any]) -> list[str]:
    """One line per method of a manifest: ``unary  calc.add(a: int, b: int) -> int``."""
    lines = []
    for service in sorted(services, key=str):
        methods = services[service]
        if not isinstance(methods, Mapping):
            continue
        for method in sorted(methods, key=str):
            entry = methods[method]
            if isinstance(entry, Mapping):
                kind, signature = entry.get("kind"), entry.get("signature")
                lines.append(f"{kind!s:<7}{service}.{method}{signature}")
    return lines


async def _describe_executor(
    config: LinkConfig | FleetConfig, *, ready_timeout: float, executor_id: str | None = None
) -> ExecutorInfo:
    async with _open_executor(config, executor_id) as executor:
        try:
            await executor.wait_ready(timeout=ready_timeout)
        except TimeoutError as exc:
            raise NotDispatched("NOT_READY", str(exc)) from None
        return await executor.info()


# --------------------------------------------------------------------------- fleet

_TABLE_COLUMNS = ("executor", "availability", "session", "since", "calls", "errors")
_REDRAW_INTERVAL = 1.0  # seconds between redraws of the terminal table (the "since" column)


def fleet_table(controller: Fleet, now: float | None = None) -> list[str]:
    """The lines of ``garcon-link fleet``'s table: a header, then one row per executor."""
    now = time.time() if now is None else now
    rows = [_TABLE_COLUMNS]
    for executor_id, snap in sorted(controller.executors().items()):
        rows.append(
            (
                executor_id,
                snap.availability,
                snap.session or "-",
                _ago(now - snap.since),
                str(snap.calls),
                str(snap.errors),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TABLE_COLUMNS))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def _event_json(event: FleetEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"event": event.kind, "executor": event.executor_id, "at": event.at}
    if event.kind == "lost":
        out["lost"] = event.lost
    return out


async def _run_fleet(config: LinkConfig | FleetConfig, *, as_json: bool, redraw: bool) -> None:
    try:
        receiver = anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM)
    except NotImplementedError:  # pragma: no cover - Windows: Ctrl-C raises KeyboardInterrupt
        receiver = None
    async with fleet(config) as controller, anyio.create_task_group() as tg:
        where = controller.url if _fleet_listens(config) else "dialing only"
        if as_json:
            _print_json({"event": "listening", "url": where})
        elif not redraw:
            _emit(f"fleet-listening url={where}")
        changed = anyio.Event()

        async def follow() -> None:
            nonlocal changed
            async for event in controller.events():
                if as_json:
                    _print_json(_event_json(event))
                elif not redraw:
                    extra = f" lost={event.lost}" if event.kind == "lost" else ""
                    _emit(f"executor={event.executor_id or '-'} event={event.kind}{extra}")
                changed.set()

        async def draw() -> None:
            nonlocal changed
            while True:
                lines = fleet_table(controller)
                sys.stdout.write("\x1b[H\x1b[J" + f"fleet on {where}\n" + "\n".join(lines) + "\n")
                sys.stdout.flush()
                changed = anyio.Event()
                with anyio.move_on_after(_REDRAW_INTERVAL):
                    await changed.wait()
                    await anyio.sleep(0.1)  # batch a burst of events into one redraw

        tg.start_soon(follow)
        if redraw:
            tg.start_soon(draw)
        if receiver is None:  # pragma: no cover
            await anyio.sleep_forever()
        else:
            with receiver as signals:
                async for _signum in signals:
                    break
        tg.cancel_scope.cancel()


def _fleet_listens(config: LinkConfig | FleetConfig) -> bool:
    return config.listen is not None


def _cmd_fleet(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=False, json_lines=ns.log_json)
    config = _load_any(ns.config)
    if isinstance(config, LinkConfig) and config.role.value != "controller":
        raise UsageError("fleet needs a controller configuration")
    redraw = not ns.json and sys.stdout.isatty()
    anyio.run(lambda: _run_fleet(config, as_json=ns.json, redraw=redraw))
    return EXIT_OK


def _cmd_describe(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    if ns.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    config = _load_any(ns.config)
    info = anyio.run(
        lambda: _describe_executor(config, ready_timeout=ns.timeout, executor_id=ns.executor)
    )
    if ns.json:
        _print_json(
            {
                "executor_id": info.executor_id,
                "contract": info.contract,
                "services": info.services,
            }
        )
    else:
        for line in describe_lines(info.services):
            print(line, flush=True)
    return EXIT_OK


# --------------------------------------------------------------------------- demo


def _cmd_demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo

    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    return run_demo(verbose=ns.verbose)


# --------------------------------------------------------------------------- parser


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps prose to the terminal (at most 100 columns); keeps indented blocks (the exit code
    table) as written. Paragraphs are separated by blank lines."""

    def __init__(self, prog: str) -> None:
        width = min(100, shutil.get_terminal_size().columns - 2)
        super().__init__(prog, width=max(width, 40))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.strip("\n").split("\n\n"):
            if any(line[:1].isspace() for line in paragraph.splitlines()):
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(
                    textwrap.fill(
                        " ".join(paragraph.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
        return "\n\n".join(paragraphs) + "\n"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``garcon-link`` (exposed for documentation and tests)."""
    from . import __version__

    common = _Parser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log to stderr: -v warnings, -vv info, -vvv debug",
    )
    common.add_argument(
        "--log-json",
        action="store_true",
        help="log lines as JSON objects, one per line (time, level, logger, message and the "
        "gl_* fields: gl_executor, gl_session, gl_peer, gl_close_code)",
    )
    parser = _Parser(
        prog="garcon-link",
        description="Resumable, authenticated WebSocket RPC to Python services in a worker.\n\n"
        "New here? 'garcon-link init DIR' writes a worker/controller pair and a service to start "
        "from, and prints the two commands that run it.",
        epilog=_EXIT_CODES_HELP,
    )
    parser.add_argument("--version", action="version", version=f"garcon-link {__version__}")
    # -v is accepted before the command too (garcon-link -v call ...); main() adds both counts.
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        dest="global_verbose",
        help="log to stderr: -v warnings, -vv info, -vvv debug (also after COMMAND)",
    )
    parser.add_argument(
        "--log-json",
        action="store_true",
        dest="global_log_json",
        help="log lines as JSON objects, one per line (also after COMMAND)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    demo = commands.add_parser(
        "demo",
        parents=[common],
        help="run the whole story on loopback (worker child process + controller)",
        description="A worker in a child process and a controller here, on loopback: calls, a "
        "stream, a socket cut that resumes, a worker kill and restart, a SIGTERM drain. Exit 0 "
        "only if every step behaved as promised.",
    )
    demo.set_defaults(func=_cmd_demo)

    worker = commands.add_parser(
        "worker",
        parents=[common],
        help="serve services until SIGINT/SIGTERM",
        description="Serve Python objects to a controller. Prints key=value lines: "
        "executor-listening (or executor-dialing), executor-ready per fresh session, "
        "executor-stopping on SIGINT/SIGTERM (exit 0).",
        epilog="--service NAME=module:attr: an object is served as is; a class is instantiated "
        "once with no arguments;\na function is a per-session factory: called with the "
        "session's ServiceScope, it returns an async\ncontext manager yielding the object "
        "served for that session. The current directory is importable.\n\n" + _EXIT_CODES_HELP,
    )
    worker.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help=f"worker TOML config; omitted or '-': ${CONFIG_ENV_VAR}",
    )
    worker.add_argument(
        "--service",
        action="append",
        metavar="NAME=module:attr",
        help="a service to expose (repeatable)",
    )
    worker.add_argument(
        "--builtin",
        action="append",
        metavar="NAMES",
        help="built-in services to expose: process, files (comma-separated, repeatable)",
    )
    worker.add_argument(
        "--root",
        metavar="DIR",
        help="with --builtin: the directory the services are confined to ('/' for callers)",
    )
    worker.add_argument(
        "--allow-special-mode-bits",
        action="store_true",
        help="with --builtin files: let callers set setuid/setgid/sticky bits with an explicit "
        "mode (refused by default; a rewrite without mode always drops them)",
    )
    worker.add_argument(
        "--drain",
        type=_drain_seconds,
        default=DEFAULT_DRAIN,
        metavar="S",
        help="on SIGINT/SIGTERM, let running calls finish for up to S seconds while new calls "
        f"are refused (DRAINING); 0 stops at once (default {DEFAULT_DRAIN:g})",
    )
    worker.add_argument(
        "--spool-dir",
        metavar="DIR",
        help="with --builtin process: spool process output to files under DIR (bounded per "
        "stream) instead of memory",
    )
    worker.add_argument(
        "--stop-on-stdin-eof",
        action="store_true",
        help="stop (exit 0) when stdin is closed: ties the worker's life to a parent process",
    )
    worker.set_defaults(func=_cmd_worker)

    keygen = commands.add_parser(
        "keygen",
        parents=[common],
        usage="garcon-link keygen [-h] [-v] [--force] PATH\n"
        "       garcon-link keygen [-h] [-v] [--force] --keyring DIR --executor ID",
        help="write a new secret file (mode 0600), or enroll an executor in a keyring",
        description="Write 32 random bytes as 64 hex digits to PATH with mode 0600 and print "
        "PATH. Refuses to overwrite an existing file (exit 2) unless --force.\n\n"
        "With --keyring DIR --executor ID instead of PATH: enroll executor ID with a listening "
        "fleet controller by writing DIR/ID.secret (DIR is created with mode 0700 if missing) "
        "and print where it went; copy that file to the worker as its secret_file. ID may hold "
        "ASCII letters, digits, '.', '_' and '-', and must not start with '.'.",
    )
    keygen.add_argument("path", nargs="?", metavar="PATH", help="the secret file to write")
    keygen.add_argument(
        "--keyring", metavar="DIR", help="a fleet controller's key directory (with --executor)"
    )
    keygen.add_argument(
        "--executor", metavar="ID", help="the executor to enroll in --keyring (its executor_id)"
    )
    keygen.add_argument("--force", action="store_true", help="replace an existing file")
    keygen.set_defaults(func=_cmd_keygen)

    init = commands.add_parser(
        "init",
        parents=[common],
        help="write a starter project: worker/controller configs, a secret, calc.py",
        description="Write worker.toml and controller.toml (a matched pair on loopback), a fresh "
        "secret link.secret (mode 0600) and calc.py (the README's example) into DIR, then print "
        "the two commands to run. DIR is created if missing; a non-empty DIR is refused (exit 2) "
        "unless --force.",
    )
    init.add_argument("dir", metavar="DIR")
    init.add_argument(
        "--port",
        type=int,
        default=_scaffold.DEFAULT_PORT,
        help=f"the loopback port the worker listens on (default {_scaffold.DEFAULT_PORT})",
    )
    init.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty DIR, replacing files of the same names (and the secret)",
    )
    init.set_defaults(func=_cmd_init)

    call = commands.add_parser(
        "call",
        parents=[common],
        usage="garcon-link call [-h] [-v] [--timeout S] [--call-timeout S]\n"
        "                        [--executor ID] [CONFIG|-] SERVICE.METHOD [JSON_ARGS]",
        help="make one call and print its result as JSON",
        description="Connect with a controller config, wait until the executor is ready, call "
        "SERVICE.METHOD once and print the result as one JSON line (streams: one line per item; "
        "one-way methods: nothing). JSON_ARGS is a JSON array (positional) or object (keyword). "
        "bytes print as base64. If the config listens, call waits for the worker to dial in. "
        f"CONFIG omitted or '-': ${CONFIG_ENV_VAR}.",
        epilog=_EXIT_CODES_HELP,
    )
    call.add_argument("operands", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    _add_ready_timeout(call)
    _add_executor_option(call, "call")
    call.add_argument(
        "--call-timeout",
        type=float,
        default=None,
        metavar="S",
        help="deadline of the call itself (default: the config's call_timeout); else exit 6",
    )
    call.set_defaults(func=_cmd_call)

    describe = commands.add_parser(
        "describe",
        parents=[common],
        help="print the services, methods and signatures the worker serves",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Connect with a controller config, wait until the executor is ready and "
        "print one line per method: kind, SERVICE.METHOD and its signature (return type "
        f"included). CONFIG omitted or '-': ${CONFIG_ENV_VAR}.",
        epilog=_EXIT_CODES_HELP,
    )
    describe.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help=f"controller TOML config; omitted or '-': ${CONFIG_ENV_VAR}",
    )
    describe.add_argument(
        "--json",
        action="store_true",
        help="print {executor_id, contract, services} as one JSON object",
    )
    _add_executor_option(describe, "describe")
    _add_ready_timeout(describe)
    describe.set_defaults(func=_cmd_describe)

    fleet_cmd = commands.add_parser(
        "fleet",
        parents=[common],
        help="run a controller for many executors and show them live",
        description="Run a fleet controller ([executors]: a keyring listener and/or dial "
        "entries) until SIGINT/SIGTERM. On a terminal: a table of executors (availability, "
        "session, since, calls, errors) redrawn in place. Otherwise, or with --json, one line "
        f"per event. CONFIG omitted or '-': ${CONFIG_ENV_VAR}.",
    )
    fleet_cmd.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help=f"fleet controller TOML config; omitted or '-': ${CONFIG_ENV_VAR}",
    )
    fleet_cmd.add_argument(
        "--json", action="store_true", help="print one JSON object per event instead"
    )
    fleet_cmd.set_defaults(func=_cmd_fleet)
    return parser


def _add_executor_option(command: argparse.ArgumentParser, verb: str) -> None:
    command.add_argument(
        "--executor",
        default=None,
        metavar="ID",
        help=f"the executor to {verb} (required with a fleet configuration, [executors])",
    )


def _add_ready_timeout(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the executor to be ready (default 10); else exit 3",
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``garcon-link`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = sys.argv[1:] if argv is None else argv
        ns, extra = parser.parse_known_args(args)
        # argparse takes a command's positional operands in one run: `call CONFIG --executor ID
        # SERVICE.METHOD` leaves the operands after the option over; they are still operands.
        if extra and getattr(ns, "operands", None) is not None:
            if any(arg.startswith("-") and not arg.lstrip("-")[:1].isdigit() for arg in extra):
                ns = parser.parse_args(args)  # an unknown option: argparse's own error
            ns.operands = [*ns.operands, *extra]
        elif extra:
            ns = parser.parse_args(args)  # argparse's own error for what it did not take
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    ns.verbose += ns.global_verbose
    ns.log_json = ns.log_json or ns.global_log_json
    handler: Callable[[argparse.Namespace], int] = ns.func
    try:
        return handler(ns)
    except SystemExit:
        raise
    except BaseException as exc:
        # Runs after the event loop ended: nothing here may need one (no anyio calls).
        leaf = _leaf(exc)
        if isinstance(leaf, SystemExit):
            raise leaf from None
        log.debug("command failed", exc_info=exc)
        text = _describe(leaf)
        if not _is_expected(leaf):
            if ns.verbose:
                traceback.print_exception(exc, file=sys.stderr)
            else:
                text += " (run with -v for the traceback)"
        _error_line(text)
        return exit_code_for(leaf)


if __name__ == "__main__":
    raise SystemExit(main())
