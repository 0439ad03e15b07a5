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
    nothing. Under systemd (``NOTIFY_SOCKET`` set) it speaks the notify protocol: ``READY=1``
    once it listens or dials, ``STOPPING=1`` when the drain starts, ``WATCHDOG=1`` when the unit
    sets ``WatchdogSec=`` (:mod:`garcon_link.api.systemd`; docs/guides/supervision.md).

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

``garcon-link keygen --keyring DIR --caller ID [--force]``
    Enroll a caller with a gateway: the same, in the gateway's ``[callers] keyring``; copy the
    file to the caller as its ``secret_file``.

``garcon-link init DIR [--port N] [--force]``
    Write a starter project into ``DIR`` (created if missing): ``worker.toml`` and
    ``controller.toml`` (a matched pair on loopback, port 8765 unless ``--port``), a fresh secret
    ``link.secret`` (mode 0600, as ``keygen`` writes it) and ``calc.py`` (the example of the
    README and the tutorial); then print the two commands to run. A non-empty ``DIR`` is
    refused (exit 2) unless ``--force``, which replaces files of the same names.

``garcon-link call [CONFIG|-] SERVICE.METHOD [JSON_ARGS]``
    Connect with a controller configuration, wait until the executor is ready (``--timeout``), make
    one call and print its result as one JSON line (a stream: one JSON line per item; a one-way
    method: nothing, once the worker has received it). ``JSON_ARGS`` is a JSON array (positional
    arguments) or object (keyword arguments). There is no interface class here: the call is built
    from the worker's manifest and the worker validates the arguments against its type hints.
    When the configuration listens (the worker dials in), ``call`` waits up to ``--timeout`` for
    the worker to dial. When it dials and 3 dials in a row find nothing (connection refused, or
    the host name does not resolve), ``call`` stops at once with ``NotDispatched("UNREACHABLE")``
    naming the address and the configuration field that holds it; ``--wait S`` instead waits up
    to ``S`` seconds for a worker that is starting (``describe`` alike). ``bytes`` in a result
    print as base64 text (standard alphabet, padded).

``garcon-link call CONFIG --executor ID SERVICE.METHOD [JSON_ARGS]``
    The same through a fleet controller's configuration (``[executors]``): the call goes to
    executor ``ID`` (with a single-executor configuration ``ID`` must be its ``executor_id``).
    With a gateway caller's configuration (``role = "caller"``) the call goes to executor ``ID``
    through the gateway (``describe`` alike).

``garcon-link fleet [CONFIG|-] [--json]``
    Run a fleet controller (``[executors]``: a keyring listener and/or dial entries) until
    SIGINT/SIGTERM and show its executors: on a terminal a table redrawn in place (executor,
    availability, session, since, calls, errors); otherwise, or with ``--json``, one line per
    event (``joined``, ``ready``, ``reconnecting``, ``offline``, ``forgotten``, ``lost``).

``garcon-link gateway [CONFIG|-] [--json] [--drain S]``
    Run a gateway (``role = "gateway"``: a listening fleet with ``[callers]``, docs/guides/
    gateway.md) until SIGINT/SIGTERM: executors and callers dial its one URL. On a terminal the
    executors' table and the callers' table (caller, sessions, calls, errors, forbidden, bytes)
    redrawn in place; otherwise, or with ``--json``, one line per executor event. A signal
    drains as for ``worker`` (``--drain S``, default 10 s): new relayed calls are refused
    ``NotDispatched("DRAINING")`` and the callers told, while the relayed calls in flight
    finish (``gateway-draining reason=SIGTERM seconds=S running=N``, a second signal cuts it
    short), then ``gateway-stopping`` and exit 0. It speaks systemd's notify protocol as
    ``worker`` does (:mod:`garcon_link.cli._lifecycle`).

``garcon-link describe [CONFIG|-] [--json] [--executor ID]``
    Connect like ``call`` and print what the worker serves, one method per line (grpcurl-style):
    ``unary  calc.add(a: int, b: int) -> int``; then, after a blank line, the fields of the
    named types the methods use (``dataclass lab.Rect``, ``  w: float``, ``  label: str = "x"``;
    :mod:`garcon_link.rpc.typedoc`). ``--json`` prints the executor id, the contract hash, the
    whole manifest and the type descriptions (with a JSON Schema per method) as one JSON object
    instead. Through a gateway, the same of the services the caller is granted, the contract
    being the hash of that manifest (``"contract_of": "granted"``).

``garcon-link stub MODULE:ATTR [--sync]``
    Import the interface class ``MODULE:ATTR`` (the current directory is importable) and print a
    module declaring it as a ``Protocol`` with the same contract, its imports first, to paste into
    a file: with ``--sync`` its sync view (``class <Name>Sync``: ``def`` methods, streams returning
    ``Iterator[T]``) for :func:`~garcon_link.connect_sync`, else the async interface. A parameter
    default that is neither a literal nor an enum member cannot be written: exit 2, naming it.

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
3     ``NotDispatched``: definitely not executed (offline, unreachable, the worker
      draining, not ready in time)
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
JSON objects, one per line, with the ``gl_*`` fields of :mod:`garcon_link.logs`, and the error
line too (level ``ERROR``, logger ``garcon_link.cli``, ``message`` the ``error: ...`` text; the
``-v`` traceback in its ``exception``), so every line on stderr parses.

This package is the command line's face: :func:`main` and the names in ``__all__``. Each command
group has its own module (``_worker.py``; ``_call.py``, with ``describe``; ``_fleet.py``;
``_gateway.py``; ``_keys.py``, with ``init``; ``_stub.py``; ``_demo.py``), and they share
``_exits.py`` (exit codes, and how a failure becomes one line and one code), ``_output.py``
(output lines, the log setup, loading CONFIG) and ``_parser.py`` (the argument parser).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable

from ._call import CallInterrupted, describe_lines, dynamic_method
from ._exits import (
    EXIT_INTERRUPTED,
    EXIT_NOT_DISPATCHED,
    EXIT_OK,
    EXIT_OTHER,
    EXIT_OUTCOME_UNKNOWN,
    EXIT_REFUSED,
    EXIT_REJECTED,
    EXIT_REMOTE_ERROR,
    EXIT_TAKEN_OVER,
    EXIT_USAGE,
    StdoutClosed,
    UsageError,
    _describe,
    _is_expected,
    _leaf,
    exit_code_for,
)
from ._fleet import fleet_table
from ._output import _error_line, jsonable
from ._parser import build_parser
from ._worker import build_services

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


log = logging.getLogger(__name__)


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
    ns.program = argv is None  # the process itself (it exits next), not a caller of main()
    handler: Callable[[argparse.Namespace], int] = ns.func
    if ns.program:
        return _run(handler, ns)
    # A caller of main() gets the root logger back as it was (a command sets its handler and
    # level for the process it is).
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        return _run(handler, ns)
    finally:
        for added in root.handlers[:]:
            if added not in handlers:
                root.removeHandler(added)
        for kept in handlers:
            if kept not in root.handlers:
                root.addHandler(kept)
        root.setLevel(level)


def _run(handler: Callable[[argparse.Namespace], int], ns: argparse.Namespace) -> int:
    """Run a command's ``handler``; a failure is one error line on stderr and an exit code."""
    try:
        return handler(ns)
    except SystemExit:
        raise
    except BaseException as exc:
        # Runs after the event loop ended: nothing here may need one (no anyio calls).
        leaf = _leaf(exc)
        if isinstance(leaf, SystemExit):
            raise leaf from None
        if isinstance(leaf, StdoutClosed):
            # stdout goes to /dev/null so that the interpreter's own flush at exit does not
            # fail on the pipe again. A command whose output was read and cut short (call,
            # describe piped into head) ends quietly; a worker or fleet says why it stopped.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            if ns.command in ("call", "describe"):
                return EXIT_OTHER
        log.debug("command failed", exc_info=exc)
        text = _describe(leaf, ns.command)
        json_lines = bool(ns.log_json)
        shown: BaseException | None = None  # a traceback -v shows, inside the JSON line
        if not _is_expected(leaf):
            if ns.verbose and json_lines:
                shown = exc
            elif ns.verbose:
                traceback.print_exception(exc, file=sys.stderr)
            else:
                text += " (run with -v for the traceback)"
        _error_line(text, json_lines=json_lines, exc=shown)
        return exit_code_for(leaf)
