"""``garcon-link call`` and ``garcon-link describe``: one call (or the manifest) of one executor,
reached alone or through a fleet configuration."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Protocol

import anyio

from ..api.controller import ExecutorInfo, RemoteExecutor, connect
from ..api.fleet import fleet
from ..api.relay import RELAY_SERVICE, GatewayExecutor, connect_gateway
from ..core.wire import CloseCode
from ..errors import ConfigError, HandshakeFailure, NotDispatched, RemoteError
from ..logs import peer_message
from ..rpc.interface import MethodKind, MethodSpec
from ..rpc.manifest import manifest_method
from ..rpc.typedoc import type_description_lines
from ..rpc.values import JSON_VALUES, VALUES_METADATA_KEY
from ..settings.callers import CallerConfig
from ..settings.config import LinkConfig
from ..settings.fleet import FleetConfig
from ..settings.keyring import KEY_SUFFIX, executor_id_problem
from ._exits import EXIT_OK, UsageError, _leaf
from ._output import _emit, _load_caller_or_any, _print_json, _setup_logging, _stderr_text

# --------------------------------------------------------------------------- call


def dynamic_method(services: Mapping[str, Any], service: str, method: str) -> MethodSpec:
    """A :class:`MethodSpec` for ``service.method`` built from a worker's manifest.

    It accepts any arguments and passes them through untyped: the worker validates them. The
    result (a stream's items) is checked against the return type the manifest declares, as far
    as it can be rebuilt from its text (:func:`~garcon_link.rpc.manifest.manifest_result_hint`): a
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
    except RecursionError:
        raise UsageError(
            "JSON_ARGS nests arrays or objects too deeply to read; no call takes such a value, "
            "so check the brackets"
        ) from None
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
    """Ctrl-C or SIGTERM during ``call`` (exit 130); the message says whether the call was
    sent."""

    def __init__(self, dispatched: bool, how: str = "interrupted") -> None:
        super().__init__(
            f"{how} after the call was sent: it may have run on the worker (outcome unknown)"
            if dispatched
            else f"{how} before the call was sent: it did not run"
        )


class _Termination:
    """What :func:`_sigterm_as_interrupt` saw: a SIGTERM that interrupted the command, and
    whether the command's outcome is settled (a later SIGTERM then changes nothing)."""

    def __init__(self) -> None:
        self.received = False
        self.settled = False

    def on_sigterm(self, _signum: int, _frame: object) -> None:
        if self.settled:
            return  # the outcome is known (printed, or about to be): nothing left to interrupt
        self.received = True
        signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def _sigterm_as_interrupt(*, ignore_after: bool) -> Iterator[_Termination]:
    """While inside, SIGTERM (``timeout``, ``kill``, a supervisor) interrupts ``call`` as Ctrl-C
    does, so that its one line says whether the call was sent. Entered before anything of the
    command can take time (the log setup, loading CONFIG, the event loop), so no ``--timeout``
    can end the command before it is in place; the caller marks the outcome settled once the
    event loop has ended. On the way out the previous handler is put back, or, with
    ``ignore_after`` (the process exits next: ``garcon-link call`` itself), SIGTERM is ignored
    (``SIG_IGN``, which the interpreter's finalization leaves alone) so that a late SIGTERM can
    neither kill the process by signal between the outcome and the exit nor change its exit
    status."""
    termination = _Termination()
    try:
        previous = signal.signal(signal.SIGTERM, termination.on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield termination
        return
    try:
        yield termination
    finally:
        termination.settled = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_after else previous)


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


REFUSED_DIALS = 3
"""Dials in a row that find nothing (connection refused, name not resolved) after which ``call``
and ``describe`` give up without ``--wait``: the first retry is immediate and the next two
follow within the first backoff steps, so the command ends in well under a second."""


def _dial_field(config: LinkConfig | FleetConfig, executor_id: str | None) -> str | None:
    """Where the dialed address comes from, for the message of an unreachable executor."""
    source = config.source.name if config.source is not None else "the configuration"
    if isinstance(config, LinkConfig):
        if config.dial is None:
            return None
        return f"[connection] dial = {json.dumps(config.dial)} in {source}"
    for entry in config.dial:
        if entry.executor_id == executor_id:
            return (
                f"url = {json.dumps(entry.url)} of the [[executors.dial]] entry with "
                f"id = {json.dumps(entry.executor_id)} in {source}"
            )
    return None


FULL = f"code={CloseCode.TRY_AGAIN_LATER.value}"
"""How a refusal of a peer whose places are all taken reads in a link error (``closed by peer
code=1013 cause='... max_controllers=N ...'``)."""


VERIFY_FAILED = "CERTIFICATE_VERIFY_FAILED"
"""How a dial whose TLS peer's certificate did not verify reads in a link error."""


_HANDSHAKE_MISMATCHES = (
    HandshakeFailure.AUTH_FAILED,
    HandshakeFailure.EXECUTOR_MISMATCH,
    HandshakeFailure.ROLE_CONFLICT,
)
"""Refusals of a handshake that reached the other end: what a configuration that listens (the
worker dials in) meets with the wrong secret, executor id or role; a dialer is told at once."""


def _not_ready_hint(why: str, peer: str) -> str:
    """What to do about an executor not ready in time, given the causes the link reported."""
    if FULL in why:
        return (
            f"the {peer} runs, but every session place it has is taken (the bound named in the "
            f"cause): retry once another program has disconnected, or raise that bound in the "
            f"{peer}'s configuration"
        )
    if any(reason.description in why for reason in _HANDSHAKE_MISMATCHES):
        return (
            f"a {peer} got through, and the handshake failed: both ends need the same secret "
            f"(secret_file) and executor_id, and opposite roles"
        )
    if HandshakeFailure.SUPERSEDED.description in why:
        return (
            f"the {peer} runs, and another process with this controller_id holds a live session "
            f"with it: give each program that runs at the same time its own controller_id, or "
            f"none (one id takes the place over only once its old process stops answering)"
        )
    if VERIFY_FAILED in why:
        return (
            f"the {peer} answers with TLS, but its certificate does not verify: set [tls] ca to "
            f"the CA file that signed it (a private CA), and check that the certificate names "
            f"the host or IP address of [connection] dial"
        )
    return f"is the {peer} running?"


def _enrollment_hint(config: LinkConfig | FleetConfig, executor_id: str | None) -> str | None:
    """For an executor a fleet configuration waits for in vain: that it has no key file in the
    keyring (so no worker can ever join as it), with the command that enrolls it."""
    if not isinstance(config, FleetConfig) or config.keyring is None or executor_id is None:
        return None
    if executor_id_problem(executor_id) is not None:
        return None  # never a file name: the keyring refuses such an id before any lookup
    if any(entry.executor_id == executor_id for entry in config.dial):
        return None
    key = config.keyring / f"{executor_id}{KEY_SUFFIX}"
    if key.exists():
        return None
    return (
        f"no worker can join as {executor_id!r}: {key} does not exist; enroll it with "
        f"`garcon-link keygen --keyring {config.keyring} --executor {executor_id}` and give the "
        f"worker that file as its secret_file"
    )


def _refused_draining(executor: RemoteExecutor) -> bool:
    """Whether the other end refused our new session because it drains (4010) and has not
    gone since."""
    return executor.refused_for_drain()


def _draining(executor: RemoteExecutor, peer: str) -> NotDispatched:
    """The one error of ``call`` and ``describe`` against a draining worker (or gateway)."""
    who = "the gateway" if peer == "gateway" else f"executor {executor.executor_id!r}"
    return NotDispatched(
        "DRAINING",
        f"{who} is draining: the {peer} was told to stop and refuses new calls and sessions; "
        f"call again once it has restarted (--wait S waits up to S seconds for that)",
    )


def _certificate_hint(config: LinkConfig | FleetConfig, field: str, peer: str) -> str:
    """What to check when the {peer}'s TLS certificate does not verify: it runs and answers with
    TLS, so not whether it runs, but the trust store, the name and the validity dates."""
    source = config.source.name if config.source is not None else "the configuration"
    tls = config.tls
    trust = (
        f"[tls] ca = {json.dumps(str(tls.ca))} in {source} must be the CA file that signed it"
        if tls is not None and tls.ca is not None
        else f"without [tls] ca in {source} the system's trust store is used: set it to the CA "
        "file that signed it (a private CA)"
    )
    return (
        f"the {peer} answers with TLS, but its certificate does not verify: {trust}; the "
        f"certificate must name the host or IP address of {field}; and it must be within its "
        "validity dates (expired, or not yet valid: check both machines' clocks)"
    )


async def _ready(
    executor: RemoteExecutor,
    config: LinkConfig | FleetConfig,
    executor_id: str | None,
    *,
    ready_timeout: float,
    wait: float | None,
    peer: str = "worker",
) -> None:
    """Wait until ``executor`` is ready: up to ``ready_timeout``, giving up after
    :data:`REFUSED_DIALS` refused dials; or, given ``wait``, up to ``wait`` whatever the dials
    find (a worker that is starting). ``peer`` is what was dialed (``"gateway"`` for a
    caller), as the messages name it."""
    try:
        await executor.wait_ready(
            timeout=ready_timeout if wait is None else wait,
            refused_dials=REFUSED_DIALS if wait is None else None,
        )
    except TimeoutError as exc:
        if executor.availability == "draining" or _refused_draining(executor):
            raise _draining(executor, peer) from None
        hint = _enrollment_hint(config, executor_id) or _not_ready_hint(str(exc), peer)
        raise NotDispatched("NOT_READY", f"{exc}; {hint}") from None
    except NotDispatched as exc:
        if exc.code == "DRAINING":  # a draining worker refused our new session (4010)
            raise _draining(executor, peer) from None
        if exc.code != "UNREACHABLE":
            raise
        field = _dial_field(config, executor_id) or "the dial address"
        if VERIFY_FAILED in exc.message:  # something of ours answers there: no --wait helps
            raise NotDispatched(
                "UNREACHABLE", f"{exc.message}; {_certificate_hint(config, field, peer)}"
            ) from None
        raise NotDispatched(
            "UNREACHABLE",
            f"{exc.message}; check {field} and that the {peer} runs there (garcon-link "
            f"{peer}), or pass --wait S to wait for a {peer} that is starting",
        ) from None


@contextlib.asynccontextmanager
async def _open_through_gateway(
    config: CallerConfig, executor_id: str | None, *, ready_timeout: float, wait: float | None
) -> AsyncIterator[GatewayExecutor]:
    """``executor_id`` through the gateway a caller's configuration dials, once ready."""
    if executor_id is None:
        raise UsageError('a caller configuration (role = "caller") needs --executor ID')
    async with connect_gateway(config) as gateway:
        try:
            executor = gateway.executor(executor_id)
        except ValueError as exc:
            raise UsageError(f"--executor: {exc}") from None
        await _ready(
            gateway.gateway,
            config.link_config(),
            None,
            ready_timeout=ready_timeout,
            wait=wait,
            peer="gateway",
        )
        if not gateway.gateway.offers(RELAY_SERVICE):
            where = f" in {config.source}" if config.source is not None else ""
            raise ConfigError(
                f"{config.dial}: not a gateway (it serves no {RELAY_SERVICE!r} service: a "
                f"worker?); point [connection] dial{where} at a gateway (garcon-link gateway)"
            )
        await _executor_ready(
            executor, ready_timeout if wait is None else wait, fail_draining=wait is None
        )
        yield executor


NOTICE_AFTER = 1.0
"""Seconds ``call`` and ``describe`` wait for an executor through a gateway before saying, in
one line on stderr, what they wait for (and going on waiting)."""


async def _executor_ready(
    executor: GatewayExecutor, timeout: float, *, fail_draining: bool = False
) -> None:
    """``executor.wait_ready(timeout)``, asked in slices of :data:`NOTICE_AFTER`; after the
    first, one stderr line says what the gateway reports of it. The gateway refuses
    (``FORBIDDEN``) an executor none of the caller's grants names, at once: one still waited for
    is named by a grant, and the gateway does not have it ready (an id it has never seen reads as
    ``offline``, like one that left). ``fail_draining`` (no ``--wait``): an executor the gateway
    reports ``draining`` (its worker was told to stop) ends the wait at once, ``DRAINING``."""
    started = anyio.current_time()
    noticed = timeout <= NOTICE_AFTER  # a wait this short says nothing before its end
    while True:
        remaining = timeout - (anyio.current_time() - started)
        if remaining <= 0:
            raise NotDispatched(
                "NOT_READY",
                f"executor {executor.executor_id!r} not ready within {timeout:g}s through the "
                f"gateway (it is {executor.availability}); is the worker connected to the "
                "gateway?",
            )
        try:
            await executor.wait_ready(min(remaining, NOTICE_AFTER))
            return
        except TimeoutError:
            pass
        state = executor.availability
        if fail_draining and state == "draining":
            raise NotDispatched(
                "DRAINING",
                f"executor {executor.executor_id!r} is draining at the gateway: its worker was "
                "told to stop and refuses new calls; call again once it has restarted (--wait S "
                "waits up to S seconds for that)",
            )
        if not noticed:
            noticed = True
            what = (
                "not connected to the gateway"
                if state in ("offline", "disposed")
                else f"{state} at the gateway"
            )
            print(
                f"waiting for executor {executor.executor_id!r}: {what} (a grant of yours names "
                f"it); waiting up to {timeout:g}s in all",
                file=sys.stderr,
                flush=True,
            )


async def _call_through_gateway(
    config: CallerConfig,
    service: str,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    ready_timeout: float,
    call_timeout: float | None,
    progress: _CallProgress | None,
    executor_id: str | None,
    wait: float | None,
) -> None:
    async with _open_through_gateway(
        config, executor_id, ready_timeout=ready_timeout, wait=wait
    ) as executor:
        spec = dynamic_method(executor.manifest(), service, method)
        session = await executor.rpc_for_call(0)
        if progress is not None:
            progress.dispatched = True
        timeout = config.limits.call_timeout if call_timeout is None else call_timeout
        metadata = {VALUES_METADATA_KEY: JSON_VALUES}
        if spec.kind is MethodKind.STREAM:
            await _print_stream(session.stream(service, spec, args, kwargs, metadata))
        else:
            result = await session.call(
                service, spec, args, kwargs, timeout=timeout, metadata=metadata
            )
            if spec.kind is not MethodKind.ONEWAY:
                _print_json(result)


def _describe_through_gateway(config: CallerConfig, ns: argparse.Namespace) -> int:
    async def describe() -> ExecutorInfo:
        async with _open_through_gateway(
            config, ns.executor, ready_timeout=ns.timeout, wait=ns.wait
        ) as executor:
            return await executor.info()

    _print_description(anyio.run(describe), ns.json, granted=True)
    return EXIT_OK


class _RemoteItems(Protocol):
    """A remote stream as the CLI prints it (``RemoteStream``, or a relayed one)."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def aclose(self) -> None: ...


async def _print_stream(stream: _RemoteItems) -> None:
    """Print each item of a remote stream as a JSON line; close it however the loop ends."""
    try:
        async for item in stream:
            _print_json(item)
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()


async def _call(
    config: LinkConfig | FleetConfig | CallerConfig,
    service: str,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    ready_timeout: float,
    call_timeout: float | None,
    progress: _CallProgress | None = None,
    executor_id: str | None = None,
    wait: float | None = None,
) -> None:
    if isinstance(config, CallerConfig):
        await _call_through_gateway(
            config,
            service,
            method,
            args,
            kwargs,
            ready_timeout=ready_timeout,
            call_timeout=call_timeout,
            progress=progress,
            executor_id=executor_id,
            wait=wait,
        )
        return
    async with _open_executor(config, executor_id) as executor:
        await _ready(executor, config, executor_id, ready_timeout=ready_timeout, wait=wait)
        info = await executor.info()
        spec = dynamic_method(info.services, service, method)
        rpc = executor.current_rpc
        if rpc is None:
            raise NotDispatched("OFFLINE", executor.last_error or "the executor went offline")
        if progress is not None:
            progress.dispatched = True
        timeout = config.limits.call_timeout if call_timeout is None else call_timeout
        # JSON has no bytes: the worker reads base64 text where bytes are declared.
        metadata = {VALUES_METADATA_KEY: JSON_VALUES}
        if spec.kind is MethodKind.STREAM:
            await _print_stream(rpc.stream(service, spec, args, kwargs, metadata))
        elif spec.kind is MethodKind.ONEWAY:
            await rpc.notify(service, spec, args, kwargs, metadata)
            # Delivery barrier: replies come back in order, so once this round trip completes
            # the worker has received the notification (closing earlier could retire it unsent).
            await rpc.describe_peer(timeout=timeout)
        else:
            result = await rpc.call(service, spec, args, kwargs, timeout=timeout, metadata=metadata)
            _print_json(result)


def _cmd_call(ns: argparse.Namespace) -> int:
    progress = _CallProgress()
    termination = _Termination()
    try:
        # First: from here on a SIGTERM says whether the call was sent (_sigterm_as_interrupt).
        with _sigterm_as_interrupt(ignore_after=ns.program) as termination:
            _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
            config_path, target, json_args = _split_call_operands(ns.operands)
            service, method = _parse_target(target)
            args, kwargs = _parse_arguments(json_args)
            _check_waits(ns)
            config = _load_caller_or_any(
                config_path, "call", f"garcon-link call controller.toml {target} '[...]'"
            )
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
                        wait=ns.wait,
                    )
                )
            finally:
                termination.settled = True  # the outcome is known: a later SIGTERM is too late
    except BaseException as exc:
        leaf = _leaf(exc)
        if isinstance(leaf, KeyboardInterrupt):
            how = "terminated (SIGTERM)" if termination.received else "interrupted"
            raise CallInterrupted(progress.dispatched, how) from None
        if ns.verbose and isinstance(leaf, RemoteError) and leaf.remote_traceback:
            _stderr_text(leaf.remote_traceback.rstrip(), json_lines=ns.log_json)
        raise
    return EXIT_OK


# --------------------------------------------------------------------------- describe


DESCRIBE_LINE_CHARS = 1000
"""The longest line ``describe`` prints for one method (the manifest is the worker's text)."""


def describe_lines(services: Mapping[str, Any]) -> list[str]:
    """One line per method of a manifest: ``unary  calc.add(a: int, b: int) -> int``.

    The names and signatures are the worker's: each line is escaped to printable ASCII (a
    control character cannot reach the terminal) and cut at :data:`DESCRIBE_LINE_CHARS`."""
    lines = []
    for service in sorted(services, key=str):
        methods = services[service]
        if not isinstance(methods, Mapping):
            continue
        for method in sorted(methods, key=str):
            entry = methods[method]
            if isinstance(entry, Mapping):
                kind, signature = entry.get("kind"), entry.get("signature")
                line = f"{kind!s:<7}{service}.{method}{signature}"
                lines.append(peer_message(line, DESCRIBE_LINE_CHARS))
    return lines


async def _describe_executor(
    config: LinkConfig | FleetConfig,
    *,
    ready_timeout: float,
    executor_id: str | None = None,
    wait: float | None = None,
) -> ExecutorInfo:
    async with _open_executor(config, executor_id) as executor:
        await _ready(executor, config, executor_id, ready_timeout=ready_timeout, wait=wait)
        return await executor.info()


def _check_waits(ns: argparse.Namespace) -> None:
    if ns.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {ns.timeout:g}; e.g. --timeout 10")
    if ns.wait is not None and ns.wait <= 0:
        raise UsageError(f"--wait must be > 0, got {ns.wait:g}; e.g. --wait 30")


def _cmd_describe(ns: argparse.Namespace) -> int:
    _setup_logging(ns.verbose, quiet_by_default=True, json_lines=ns.log_json)
    _check_waits(ns)
    config = _load_caller_or_any(ns.config, "describe", "garcon-link describe controller.toml")
    if isinstance(config, CallerConfig):
        return _describe_through_gateway(config, ns)
    info = anyio.run(
        lambda: _describe_executor(
            config, ready_timeout=ns.timeout, executor_id=ns.executor, wait=ns.wait
        )
    )
    _print_description(info, ns.json)
    return EXIT_OK


def _print_description(info: ExecutorInfo, as_json: bool, *, granted: bool = False) -> None:
    """What ``describe`` prints of ``info``: one line per method then the types' fields, or,
    ``as_json``, one object. ``granted``: through a gateway, where the services are those the
    caller is granted and ``contract`` the hash of that manifest (``"contract_of": "granted"``
    says so; the executor's own hash covers every service it serves)."""
    if as_json:
        _print_json(
            {
                "executor_id": info.executor_id,
                "contract": info.contract,
                **({"contract_of": "granted"} if granted else {}),
                "versions": dict(info.versions),
                "services": info.services,
                "types": info.types,
            }
        )
        return
    for line in describe_lines(info.services):
        _emit(line)
    types = type_description_lines(info.types)
    for line in ["", *types] if types else []:
        _emit(line)
