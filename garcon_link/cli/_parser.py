"""The argument parser of ``garcon-link``: every command, its options and its help text."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from typing import Any, NoReturn

from .. import _scaffold
from ..limits import Limits
from ..settings.config import CONFIG_ENV_VAR
from ._call import REFUSED_DIALS, _cmd_call, _cmd_describe
from ._demo import _cmd_demo
from ._exits import EXIT_USAGE, exit_codes_help
from ._fleet import _cmd_fleet
from ._gateway import _cmd_gateway
from ._keys import _cmd_init, _cmd_keygen
from ._lifecycle import DEFAULT_DRAIN, drain_seconds
from ._stub import _cmd_stub
from ._worker import _cmd_worker


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
    from .. import __version__

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
        epilog=exit_codes_help(),
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
        epilog=exit_codes_help("demo"),
    )
    demo.set_defaults(func=_cmd_demo)

    worker = commands.add_parser(
        "worker",
        parents=[common],
        help="serve services until SIGINT/SIGTERM",
        description="Serve Python objects to a controller. Prints key=value lines: "
        "executor-listening (or executor-dialing), executor-ready per fresh session; on "
        "SIGINT/SIGTERM executor-draining (running=N), then executor-stopping (exit 0). Under "
        "systemd (NOTIFY_SOCKET set) it sends READY=1, STATUS=, WATCHDOG=1 and STOPPING=1.",
        epilog="--service NAME=module:attr: an object is served as is; a class is instantiated "
        "once with no arguments;\na function is a per-session factory: called with the "
        "session's ServiceScope, it returns an async\ncontext manager yielding the object "
        "served for that session. The current directory is importable.\n\n"
        + exit_codes_help("worker"),
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
        help="the directory the built-in services are confined to, as callers see it ('/'); "
        "required with --builtin",
    )
    worker.add_argument(
        "--allow-special-mode-bits",
        action="store_true",
        help="with --builtin files: let callers set setuid/setgid/sticky bits with an explicit "
        "mode (refused by default; a rewrite without mode always drops them)",
    )
    worker.add_argument(
        "--drain",
        type=drain_seconds,
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
        "--state-dir",
        metavar="DIR",
        help="keep keyed calls (and the process records of --builtin process) in DIR, so they "
        "survive a restart of this worker; one worker per DIR (default: the config's state_dir)",
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
        "       garcon-link keygen [-h] [-v] [--force] --keyring DIR --executor ID\n"
        "       garcon-link keygen [-h] [-v] [--force] --keyring DIR --caller ID",
        help="write a new secret file (mode 0600), or enroll an executor or caller in a keyring",
        description="Write 32 random bytes as 64 hex digits to PATH with mode 0600 and print "
        "PATH. Refuses to overwrite an existing file (exit 2) unless --force.\n\n"
        "With --keyring DIR --executor ID instead of PATH: enroll executor ID with a listening "
        "fleet controller by writing DIR/ID.secret (DIR is created with mode 0700 if missing) "
        "and print where it went; copy that file to the worker as its secret_file. ID may hold "
        "ASCII letters, digits, '.', '_' and '-', and must not start with '.'.\n\n"
        "With --keyring DIR --caller ID: enroll caller ID with a gateway (DIR is its [callers] "
        "keyring); copy DIR/ID.secret to the caller as its secret_file.",
        epilog=exit_codes_help("keygen"),
    )
    keygen.add_argument("path", nargs="?", metavar="PATH", help="the secret file to write")
    keygen.add_argument(
        "--keyring",
        metavar="DIR",
        help="a key directory: a fleet controller's [executors] keyring (with --executor) or a "
        "gateway's [callers] keyring (with --caller)",
    )
    keygen.add_argument(
        "--executor", metavar="ID", help="the executor to enroll in --keyring (its executor_id)"
    )
    keygen.add_argument(
        "--caller", metavar="ID", help="the gateway caller to enroll in --keyring (its caller_id)"
    )
    keygen.add_argument("--force", action="store_true", help="replace an existing file")
    keygen.set_defaults(func=_cmd_keygen)

    init = commands.add_parser(
        "init",
        parents=[common],
        help="write a starter project: worker/controller configs, a secret, calc.py",
        description="Write worker.toml and controller.toml (a matched pair on loopback), a fresh "
        "secret link.secret (mode 0600) and calc.py (the tutorial's example) into DIR, then print "
        "the two commands to run. DIR is created if missing; a non-empty DIR is refused (exit 2) "
        "unless --force.",
        epilog=exit_codes_help("init"),
    )
    init.add_argument("dir", metavar="DIR", help="the project directory ('.': the current one)")
    init.add_argument(
        "--port",
        type=int,
        default=_scaffold.DEFAULT_PORT,
        metavar="N",
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
        usage="garcon-link call [-h] [-v] [--log-json] [--timeout S] [--wait S]\n"
        "                        [--call-timeout S] [--executor ID]\n"
        "                        [CONFIG|-] SERVICE.METHOD [JSON_ARGS]",
        help="make one call and print its result as JSON",
        description="Connect with a controller config, wait until the executor is ready, call "
        "SERVICE.METHOD once and print the result as one JSON line (streams: one line per item; "
        "one-way methods: nothing). JSON_ARGS is a JSON array (positional) or object (keyword). "
        "bytes print as base64. If the config listens, call waits for the worker to dial in. "
        f"CONFIG omitted or '-': ${CONFIG_ENV_VAR}.",
        epilog=exit_codes_help("call"),
    )
    call.add_argument("operands", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    _add_ready_timeout(call)
    _add_executor_option(call, "call")
    call.add_argument(
        "--call-timeout",
        type=float,
        default=None,
        metavar="S",
        help="deadline of the call itself (default: call_timeout of the config's [limits], "
        f"{Limits().call_timeout:g} unless set); else exit 6. A stream has no deadline: it "
        "prints items until it ends (Ctrl-C stops it)",
    )
    call.set_defaults(func=_cmd_call)

    describe = commands.add_parser(
        "describe",
        parents=[common],
        help="print the services, methods and signatures the worker serves",
        description="Connect with a controller config, wait until the executor is ready and "
        "print one line per method: kind, SERVICE.METHOD and its signature (return type "
        "included); then the fields of the dataclasses, TypedDicts, Structs and enums the "
        "methods use (type, default as JSON), to write call's JSON_ARGS from. Through a gateway "
        '(a caller\'s config, role = "caller") the same, of the services the caller is '
        f"granted. CONFIG omitted or '-': ${CONFIG_ENV_VAR}.",
        epilog=exit_codes_help("describe"),
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
        help="print {executor_id, contract, versions, services, types} as one JSON object "
        "(types: per service, the fields and a JSON Schema of each method's parameters and "
        "result; through a gateway of the granted services, the contract being the hash of "
        'those, marked "contract_of": "granted")',
    )
    _add_executor_option(describe, "describe")
    _add_ready_timeout(describe)
    describe.set_defaults(func=_cmd_describe)

    stub = commands.add_parser(
        "stub",
        parents=[common],
        help="print an interface as a Protocol to paste, imports included (--sync: its sync view)",
        description="Import MODULE:ATTR (an interface class; the current directory is "
        "importable) and print a module declaring it as a Protocol with the same contract, "
        "imports included: with --sync its sync view (def methods, streams returning "
        "Iterator[T]) for connect_sync, else the async interface. Write it to a file and "
        "import it from there.",
        epilog=exit_codes_help("stub"),
    )
    stub.add_argument("target", metavar="MODULE:ATTR", help="the interface, e.g. lab:Lab")
    stub.add_argument(
        "--sync", action="store_true", help="print the sync view (class <Name>Sync) instead"
    )
    stub.set_defaults(func=_cmd_stub)

    fleet_cmd = commands.add_parser(
        "fleet",
        parents=[common],
        help="run a controller for many executors and show them live",
        description="Run a fleet controller ([executors]: a keyring listener and/or dial "
        "entries) until SIGINT/SIGTERM. On a terminal: a table of executors (availability, "
        "session, since, calls, errors) redrawn in place. Otherwise, or with --json, one line "
        f"per event. CONFIG omitted or '-': ${CONFIG_ENV_VAR}.",
        epilog=exit_codes_help("fleet"),
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

    gateway_cmd = commands.add_parser(
        "gateway",
        parents=[common],
        help="run a gateway: a fleet that callers share, each with its own key and grants",
        description='Run a gateway (role = "gateway": a listening fleet with [callers]) until '
        "SIGINT/SIGTERM. Executors and callers dial the same URL. On a terminal: the executors' "
        "table and the callers' table (caller, sessions, calls, errors, forbidden, bytes) "
        f"redrawn in place. Otherwise, or with --json, one line per event. CONFIG omitted or "
        f"'-': ${CONFIG_ENV_VAR}.",
        epilog=exit_codes_help("gateway"),
    )
    gateway_cmd.add_argument(
        "config",
        nargs="?",
        metavar="CONFIG",
        help=f"gateway TOML config; omitted or '-': ${CONFIG_ENV_VAR}",
    )
    gateway_cmd.add_argument(
        "--json", action="store_true", help="print one JSON object per event instead"
    )
    gateway_cmd.add_argument(
        "--drain",
        type=drain_seconds,
        default=DEFAULT_DRAIN,
        metavar="S",
        help="on SIGINT/SIGTERM, let relayed calls finish for up to S seconds while new ones "
        f"are refused (DRAINING); 0 stops at once (default {DEFAULT_DRAIN:g})",
    )
    gateway_cmd.set_defaults(func=_cmd_gateway)
    return parser


def _add_executor_option(command: argparse.ArgumentParser, verb: str) -> None:
    command.add_argument(
        "--executor",
        default=None,
        metavar="ID",
        help=f"the executor to {verb} (required with a fleet configuration, [executors], and "
        'with a gateway caller\'s, role = "caller")',
    )


def _add_ready_timeout(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the executor to be ready (default 10); else exit 3",
    )
    command.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="wait up to S seconds (instead of --timeout) for a worker that is starting; "
        f"without it, {REFUSED_DIALS} dials in a row that find nothing listening (connection "
        "refused, or the name does not resolve) end the command at once (exit 3)",
    )
