"""``garcon-link worker``: building the served services from ``--service``/``--builtin``, serving
until a signal, the drain, and the event lines."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from ..api.registration import ServiceFactory, ServiceMap
from ..api.worker import Worker
from ..errors import HandshakeFailure
from ..rpc.resources import ServiceScope
from ..settings.config import LinkConfig
from ._exits import EXIT_OK, TakenOver, UsageError
from ._lifecycle import DEFAULT_DRAIN, StopSignals, run_until_signal
from ._output import _emit, _load, _setup_logging

log = logging.getLogger("garcon_link.cli")  # one logger for the whole command line


def import_attribute(module_name: str, attr: str, where: str) -> object:
    """Import ``module_name`` and follow the dotted ``attr`` in it; each failure is one
    :class:`UsageError` line starting with ``where`` (``--service ...``, ``stub``'s target).
    """
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"{where}: cannot import module {module_name!r}: {exc}") from exc
    except Exception as exc:
        raise UsageError(
            f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{where}: {module_name!r} has no attribute {attr!r}") from None
    return obj


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
    obj = import_attribute(module_name, attr, f"--service {text!r}")
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
        from ..services import builtin_services

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
    state_dir: str | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; then drain for up to ``drain`` seconds (a second signal
    ends the drain), print ``executor-stopping`` and close gracefully. Speaks systemd's notify
    protocol when ``NOTIFY_SOCKET`` is set: the worker's own (``gl.Worker(systemd=True)``,
    :mod:`garcon_link.api.systemd`), told the signal that stops it."""
    executor_id = config.executor_id
    with StopSignals() as signals:
        # The handlers exist from here on: only now may the watcher raise SIGTERM.
        if stop_on_stdin_eof:
            _StdinWatch.start()
        async with Worker(
            config, services, on_event=on_event, state_dir=state_dir, systemd=True
        ) as worker:

            def running() -> int:
                rpc = worker.current_rpc
                return rpc.statistics().incoming_calls if rpc is not None else 0

            await run_until_signal(
                signals,
                None,  # the worker beats systemd's watchdog itself
                what="executor",
                fields=f"executor={executor_id}",
                status=f"executor {executor_id}",
                drain=drain,
                # Not worker.aclose(drain=...): that drain is shielded, and a second signal
                # must end it.
                drain_for=worker._drain,
                running=running,
                stopped=worker.wait_stopped,
                reason_of=_reason,
                stopping=worker._stopping,
            )
            if worker.taken_over is not None:
                worker._stopping(f"executor {executor_id}: taken over by another process")
                _emit(f"executor-stopping executor={executor_id} reason=TAKEN_OVER")
                reason = worker.taken_over
                said = "" if reason == HandshakeFailure.TAKEN_OVER.description else f" ({reason})"
                raise TakenOver(
                    f"another process took over executor id {executor_id!r}{said}; two workers "
                    f"must not share one executor id: stop the other one, or give this worker "
                    f"an executor_id (and a key) of its own"
                )


def _reason(signum: int) -> str:
    return "stdin-closed" if _StdinWatch.closed else signal.Signals(signum).name


def _cmd_worker(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=False, json_lines=ns.log_json)
    services = build_services(
        ns.service or [],
        builtin=ns.builtin or [],
        root=ns.root,
        allow_special_mode_bits=ns.allow_special_mode_bits,
        spool_dir=ns.spool_dir,
    )
    config = _load(ns.config, "worker", "worker")
    on_event = _worker_events(warn_serves_nothing=not ns.service and not ns.builtin)
    anyio.run(
        _serve_until_signal,
        config,
        services,
        ns.stop_on_stdin_eof,
        on_event,
        ns.drain,
        ns.state_dir,
    )
    return EXIT_OK
