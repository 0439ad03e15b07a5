"""The one place where every call's outcome is counted and told to the hooks (both sides).

A caller's call ends at the endpoint's :meth:`CallObserver.call` (a facade call, with its
session lookup and retries) or its stream's end; a handler ends in the session's dispatcher,
which tells :meth:`CallObserver.server_ended` the one reply it decided; a refusal is told to
:meth:`CallObserver.refused`. Counters and per-call hooks sit here and nowhere else.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..errors import CallError, NotDispatched, Outcome, Rejected
from ..limits import Limits
from .envelopes import metadata_problem
from .hooks import CallEnd, CallHook, CallInfo, CallKind, CallSide
from .interface import MethodKind, MethodSpec

__all__ = ["HOOK_FAILED", "CallObserver", "CallStatistics", "Observed", "end_of", "server_refusal"]

log = logging.getLogger("garcon_link.rpc")  # the name users configure (README)

T = TypeVar("T")

_KIND: dict[MethodKind, CallKind] = {
    MethodKind.UNARY: "unary",
    MethodKind.STREAM: "stream",
    MethodKind.ONEWAY: "notify",
}


def end_of(exc: BaseException) -> tuple[Outcome, str, bool]:
    """``(outcome, code, cancelled)`` of a call that raised ``exc``.

    An allow-listed remote exception (:func:`register_exception`) carries its
    :class:`RemoteError` as ``__cause__``; a cancellation (any ``BaseException`` that is not an
    ``Exception``) may have left after its request was sent: ``UNKNOWN``/``CANCELLED``.
    """
    if isinstance(exc, CallError):
        return exc.outcome, exc.code, False
    cause = exc.__cause__
    if isinstance(cause, CallError):
        return cause.outcome, cause.code, False
    if not isinstance(exc, Exception):
        return Outcome.UNKNOWN, "CANCELLED", True
    return Outcome.UNKNOWN, "LOCAL_ERROR", False


@dataclass(frozen=True, slots=True)
class CallStatistics:
    """Calls ended so far, by side, outcome label and code (see :meth:`CallObserver.statistics`).

    Attributes:
        client: ``{(label, code): count}`` for the calls this endpoint made; ``label`` is
            :attr:`garcon_link.rpc.hooks.CallEnd.label` (``"ok"``, ``"cancelled"`` or an outcome's
            value), ``code`` is ``None`` for ``"ok"``.
        server: the same for the peer's calls this endpoint served, refusals included (calls
            refused without running: ``rejected``/``not_dispatched`` with their code).
    """

    client: Mapping[tuple[str, str | None], int]
    server: Mapping[tuple[str, str | None], int]

    def total(self, side: CallSide, label: str | None = None) -> int:
        """Calls of ``side`` ended with ``label`` (all labels when ``None``)."""
        counts = self.client if side == "client" else self.server
        return sum(n for (lab, _), n in counts.items() if label is None or lab == label)


class Observed:
    """A call being observed by hooks: what ``call_ended`` needs.

    ``states`` holds one entry per hook whose ``call_started`` ran, in order; ``refusal`` is
    the error a server-side hook refused the call with (:func:`server_refusal`), else ``None``.
    """

    __slots__ = ("done", "info", "refusal", "started", "states")

    def __init__(
        self,
        info: CallInfo,
        states: list[object],
        started: float,
        refusal: CallError | None = None,
    ) -> None:
        self.info = info
        self.states = states
        self.started = started
        self.refusal = refusal
        self.done = False


HOOK_FAILED = "HOOK_FAILED"
"""The code of a call refused because a server-side hook's ``call_started`` failed."""


def server_refusal(exc: Exception) -> CallError:
    """What a server-side ``call_started`` that raised ``exc`` refuses the call with.

    A :class:`~garcon_link.errors.Rejected` (any code; ``StaleResource`` too) is the refusal
    itself. Anything else is a hook that failed: the call is refused ``Rejected("HOOK_FAILED")``
    (fail closed: a hook may be a gate, and a gate that breaks must not let calls through); its
    message names only the exception's type, the traceback is logged on this side.
    """
    if isinstance(exc, Rejected):
        return exc
    return Rejected(
        HOOK_FAILED,
        f"a server-side call hook failed ({type(exc).__name__}); the call did not run",
    )


class CallObserver:
    """The one place where every call's outcome is counted and told to the hooks.

    One per endpoint (a :class:`~garcon_link.api.controller.RemoteExecutor`, a
    :class:`~garcon_link.api.worker.Worker`), shared by all its sessions, so its counters survive
    session replacement. Client side: :meth:`call` wraps one facade call (session lookup,
    retries and all); streams use :meth:`stream_started`/:meth:`stream_ended`. Server side: the
    session's :class:`ExecutorRpc` calls :meth:`server_started`/:meth:`server_ended` around each
    handler and :meth:`refused` for each call refused without running. With no hook registered
    the only work per call is one dictionary update (and one truth test of ``hooks``).

    Args:
        hooks: the endpoint's :class:`~garcon_link.rpc.hooks.CallHook` objects, in call order
            (``call_ended`` runs in the reverse order).
        limits: for the metadata bounds.
        executor: the executor id hooks are told (``None`` when not known).
    """

    __slots__ = (
        "_client",
        "_server",
        "_warned",
        "executor",
        "hooks",
        "incoming_peak",
        "limits",
        "oneway_refused",
        "pending_peak",
    )

    def __init__(
        self,
        hooks: Sequence[CallHook] = (),
        limits: Limits | None = None,
        executor: str | None = None,
    ) -> None:
        self.hooks = tuple(hooks)
        self.limits = limits or Limits()
        self.executor = executor
        self._client: dict[tuple[str, str | None], int] = {}
        self._server: dict[tuple[str, str | None], int] = {}
        self._warned: set[tuple[int, str]] = set()
        # The most calls pending / handlers running at once on any session of the endpoint.
        self.pending_peak = 0
        self.incoming_peak = 0
        self.oneway_refused = 0
        """The peer's one-way calls (notifications) of a method served here that were refused
        without running (their arguments or metadata failed the contract's checks)."""

    def statistics(self) -> CallStatistics:
        return CallStatistics(
            client=types.MappingProxyType(dict(self._client)),
            server=types.MappingProxyType(dict(self._server)),
        )

    # -- counting and hooks

    @staticmethod
    def _count(
        counts: dict[tuple[str, str | None], int],
        outcome: Outcome | None,
        code: str | None,
        cancelled: bool,
    ) -> None:
        # The key is CallEnd.label's, without building a CallEnd when no hook needs one.
        key = ("cancelled" if cancelled else "ok" if outcome is None else outcome.value, code)
        counts[key] = counts.get(key, 0) + 1

    def _start(self, info: CallInfo) -> Observed:
        states: list[object] = []
        server = info.side == "server"
        for index, hook in enumerate(self.hooks):
            try:
                states.append(hook.call_started(info))
            except Exception as exc:
                if server:
                    # The call is refused: the hooks after this one are not started, the
                    # ones before it are ended (with the refusal) as for any call.
                    if not isinstance(exc, Rejected):
                        self._hook_failed(index, hook, "call_started", refused=True)
                    return Observed(info, states, time.monotonic(), server_refusal(exc))
                self._hook_failed(index, hook, "call_started")
                states.append(None)
        return Observed(info, states, time.monotonic())

    def _end(self, observed: Observed, end: CallEnd) -> None:
        if observed.done:
            return
        observed.done = True
        for index in range(len(observed.states) - 1, -1, -1):
            hook = self.hooks[index]
            try:
                hook.call_ended(observed.info, observed.states[index], end)
            except Exception:
                self._hook_failed(index, hook, "call_ended")

    def _hook_failed(self, index: int, hook: CallHook, method: str, refused: bool = False) -> None:
        """Log a hook that raised, once per hook and method (and per consequence)."""
        key = (index, f"{method} refused" if refused else method)
        if key in self._warned:
            return
        self._warned.add(key)
        if refused:
            log.warning(
                "call hook %r raised in call_started: the call is refused %s (logged once)",
                hook,
                HOOK_FAILED,
                exc_info=True,
            )
        else:
            log.warning(
                "call hook %r raised in %s (ignored from now on)", hook, method, exc_info=True
            )

    def check_metadata(self, metadata: Mapping[str, str]) -> None:
        """Raise ``NotDispatched("INVALID_METADATA")`` for metadata over the bounds."""
        problem = metadata_problem(
            metadata, self.limits.max_metadata_entries, self.limits.max_metadata_bytes
        )
        if problem is not None:
            raise NotDispatched("INVALID_METADATA", problem)

    # -- client side

    async def call(
        self,
        service: str,
        spec: MethodSpec,
        metadata: Mapping[str, str] | None,
        run: Callable[[Mapping[str, str] | None], Awaitable[T]],
    ) -> T:
        """Run one call, ``run(metadata)``, counting its outcome and telling the hooks."""
        observed = None
        if self.hooks:
            metadata = dict(metadata) if metadata else {}  # the hooks may add to it
            info = CallInfo("client", service, spec.name, _KIND[spec.kind], self.executor, metadata)
            observed = self._start(info)
        try:
            if metadata:
                self.check_metadata(metadata)
            value = await run(metadata or None)
        except BaseException as exc:
            self.client_ended(observed, *end_of(exc))
            raise
        if observed is None:
            counts = self._client
            counts[_OK] = counts.get(_OK, 0) + 1
        else:
            self.client_ended(observed, None, None, False)
        return value

    def stream_started(
        self, service: str, spec: MethodSpec, metadata: Mapping[str, str] | None
    ) -> Observed | None:
        """A stream's first iteration: the hooks' handle (``None`` without hooks). The metadata
        to send is then the handle's ``info.metadata`` (hooks may have added to it); the caller
        validates it (:meth:`check_metadata`) and ends the stream with :meth:`client_ended`."""
        if not self.hooks:
            return None
        sent = dict(metadata) if metadata else {}
        return self._start(CallInfo("client", service, spec.name, "stream", self.executor, sent))

    def client_ended(
        self, observed: Observed | None, outcome: Outcome | None, code: str | None, cancelled: bool
    ) -> None:
        """A client call or stream ended (the stream's handle may be ``None``: no hooks)."""
        if observed is None:
            self._count(self._client, outcome, code, cancelled)
            return
        if observed.done:
            return
        end = CallEnd(outcome, code, time.monotonic() - observed.started, cancelled)
        self._count(self._client, outcome, code, cancelled)
        self._end(observed, end)

    # -- server side

    def server_started(
        self,
        service: str,
        spec: MethodSpec,
        metadata: Mapping[str, str],
        kind: CallKind | None = None,
    ) -> Observed | None:
        """A handler starts (in its own task); ``kind`` overrides the method's (a notification
        may name a unary method)."""
        if not self.hooks:
            return None
        kind = kind or _KIND[spec.kind]
        return self._start(CallInfo("server", service, spec.name, kind, self.executor, metadata))

    def server_ended(
        self, observed: Observed | None, error: CallError | None, cancelled: bool
    ) -> None:
        """A handler ended: ``error`` is what its caller is told (``None``: it succeeded)."""
        if observed is None and error is None and not cancelled:  # (every call's path)
            counts = self._server
            counts[_OK] = counts.get(_OK, 0) + 1
            return
        if error is None:
            outcome: Outcome | None = None
            code = None
        else:
            outcome, code = error.outcome, error.code
        if observed is None:
            self._count(self._server, outcome, code, cancelled)
            return
        end = CallEnd(outcome, code, time.monotonic() - observed.started, cancelled)
        self._count(self._server, outcome, code, cancelled)
        self._end(observed, end)

    def refused(self, error: CallError) -> None:
        """A peer's call refused without running (no hooks: no handler ran)."""
        self._count(self._server, error.outcome, error.code, False)

    def refused_oneway(self, error: CallError) -> None:
        """A peer's one-way call refused without running: counted as :meth:`refused` and in
        :attr:`oneway_refused` (no reply tells the caller)."""
        self.oneway_refused += 1
        self._count(self._server, error.outcome, error.code, False)


_OK: tuple[str, str | None] = ("ok", None)
