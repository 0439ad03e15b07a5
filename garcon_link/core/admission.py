"""Admission and redial, as pure functions: :func:`decide` and :func:`backoff` (sans-IO).

:func:`decide` is the resume-or-fresh decision and the takeover rule for one verified
handshake: a function of the executor's slot as it is now (:class:`SlotView`) and of the
handshake (:class:`Offer`), answering :class:`Resume`, :class:`Fresh`, :class:`Refuse` or
:class:`Probe` (ping the attached socket, then ask again with the result). The link
(:mod:`garcon_link.endpoint.link`) only asks and obeys. :func:`backoff` is the dial loop's retry
delays, a generator tested without a clock.

The controller dimension: a listening worker holds one slot per controller (its
``controller_id``, or its runtime), so other controllers' sessions are in other slots and never
reach this slot's :func:`decide` -- a second controller is a fresh session in a slot of its own,
admitted at once, never probed or refused as a takeover. What other slots tell :func:`decide`
is :attr:`SlotView.full` -- they hold every place there is (``max_controllers``) -- and
:attr:`SlotView.evictable` -- one of them holds only a detached session (no socket, no admission
under way). A controller without a session here is then admitted in the place of the session
detached the longest (:data:`EVICT`; the link picks it with :func:`evictee`), and refused (1013)
only while every place has a socket (:data:`FULL`): a crashed controller's session cannot keep a
live newcomer out for its whole grace.

A draining worker (:attr:`SlotView.draining`) admits no new session: every fresh handshake is
refused with :data:`DRAINING` (4010), whatever the slot holds, while a resume of the session a
slot holds is admitted as ever -- a controller whose socket dropped mid-drain gets its calls'
real outcomes. Resume or fresh is known only here, after the handshake: the listener's ``503``
(before authentication) cannot tell them apart, so a drain does not use it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

from ..errors import FailureReason, HandshakeFailure
from ..limits import Limits

K = TypeVar("K")

__all__ = [
    "BUSY",
    "DRAINING",
    "EVICT",
    "FULL",
    "Decision",
    "Fresh",
    "Offer",
    "Probe",
    "Refuse",
    "Resume",
    "SlotKey",
    "SlotView",
    "backoff",
    "decide",
    "evictee",
    "places",
    "slot_key",
]


def backoff(limits: Limits, rng: random.Random | None = None) -> Iterator[float]:
    """Dial retry delays: ``0`` first, then full-jitter exponential, capped.

    The n-th non-immediate delay is uniform in ``[0, min(backoff_max, backoff_base * 2**n))``
    (AWS "full jitter"). Infinite; the caller starts a new generator to reset it.

    Args:
        limits: supplies ``backoff_base`` and ``backoff_max``.
        rng: source of jitter (inject a seeded one in tests).
    """
    rng = rng or random.Random()
    yield 0.0
    ceiling = limits.backoff_base
    while True:
        yield rng.uniform(0.0, ceiling)
        ceiling = min(limits.backoff_max, ceiling * 2)


# ---------------------------------------------------------------------------------- decide()

SlotKey: TypeAlias = tuple[str, str | bytes | None]
"""A link's slot: ``(executor_id, controller)``; the controller is None but on a listening
worker, where it is the ``controller_id`` or else the runtime (:func:`slot_key`; a str and bytes
never collide)."""


def slot_key(
    executor: str, controller_id: str | None, runtime: bytes, *, per_controller: bool
) -> SlotKey:
    """The slot a verified hello belongs to: the executor's one slot, or, on a listening worker
    (``per_controller``), the controller's -- its ``controller_id`` if it sent one, else its
    runtime (each process its own controller). Two hellos meet in one slot, where
    :func:`decide` resumes, probes or takes over, only if this says so."""
    if not per_controller:
        return (executor, None)
    return (executor, controller_id if controller_id is not None else runtime)


@dataclass(frozen=True, slots=True)
class SlotView:
    """What :func:`decide` needs to know of one executor's slot.

    Attributes:
        closing: the link is shutting down.
        session: the id of the slot's live (not retired) session, or None.
        peer_runtime: the runtime that session belongs to (None without a session).
        attached: a socket currently carries that session.
        admitting: another socket of this executor is being admitted (its decision, probe or
            takeover is under way).
        full: other slots (other controllers of a listening worker) hold every place for a
            session there is: a session in this slot would be one too many.
        evictable: (with ``full``) one of those other slots holds only a detached session: no
            socket carries it and none is being admitted for it.
        draining: the endpoint drains (a worker told to stop): it admits resumes only.
    """

    closing: bool = False
    session: bytes | None = None
    peer_runtime: bytes | None = None
    attached: bool = False
    admitting: bool = False
    full: bool = False
    evictable: bool = False
    draining: bool = False


@dataclass(frozen=True, slots=True)
class Offer:
    """What :func:`decide` needs to know of one verified handshake.

    Attributes:
        resume: both sides continue the session they advertised (:func:`decide_resume`).
        session: the session id the handshake settled on.
        runtime: the peer's runtime.
        taken_over: that runtime is one whose session another runtime of the same executor took
            over (the slot remembers the last few).
    """

    resume: bool
    session: bytes
    runtime: bytes
    taken_over: bool = False


@dataclass(frozen=True, slots=True)
class Resume:
    """Attach the socket to the slot's session; first detach the socket it has, if any."""

    supersede_attached: bool


@dataclass(frozen=True, slots=True)
class Fresh:
    """Start a fresh session; retire the slot's current one first, if any.

    ``taken_over``: the retired session belonged to another runtime, which is remembered and,
    if its socket is still attached, closed with 4009. ``evict_detached``: first retire the
    other controllers' session detached the longest (:func:`evictee`), to free its place."""

    retire_current: bool
    taken_over: bool
    evict_detached: bool = False


@dataclass(frozen=True, slots=True)
class Refuse:
    """Close the socket with ``reason``'s close code; the session (if any) is untouched."""

    reason: HandshakeFailure | FailureReason
    detail: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Ping the attached socket; call :func:`decide` again with the probe's result."""


Decision: TypeAlias = Resume | Fresh | Refuse | Probe

BUSY = Refuse(HandshakeFailure.SUPERSEDED, "another socket of this executor is being admitted")
"""The refusal while another socket of the same executor is being admitted."""

FULL = Refuse(
    HandshakeFailure.CONTROLLERS_FULL,
    "this worker holds sessions for max_controllers controllers; retry later",
)
"""The refusal of a controller without a session while the others hold every place, none of
them with a detached session alone (each has a socket or an admission under way)."""

DRAINING = Refuse(
    HandshakeFailure.DRAINING,
    "this worker is draining: it admits no new session; retry once it has restarted",
)
"""The refusal of every fresh handshake while the endpoint drains (resumes are admitted)."""

EVICT = Fresh(retire_current=False, taken_over=False, evict_detached=True)
"""A controller without a session, admitted in the place of another's detached session."""


def places(others: Iterable[tuple[bool, bool]], max_controllers: int) -> tuple[bool, bool]:
    """:attr:`SlotView.full` and :attr:`SlotView.evictable` for one slot of a listening worker.

    Args:
        others: each *other* slot as ``(holds a place, evictable)``: it holds a place with a
            session, a socket or an admission under way; it is evictable if it holds only a
            detached session (no socket, no admission).
        max_controllers: the places there are.

    Returns:
        ``(full, evictable)``: the others hold every place; and (only then) one of those is
        evictable.
    """
    held = [evictable for holds, evictable in others if holds]
    full = len(held) >= max_controllers
    return full, full and any(held)


def evictee(detached: Iterable[tuple[K, int]]) -> K | None:
    """Which detached session gives its place up: the one detached the longest.

    Args:
        detached: the other controllers' evictable sessions, each as ``(key, order)`` where
            ``order`` counts detachments (smaller: detached earlier); no clock is involved.

    Returns:
        The key of the earliest detached (the first of equals), or None if there is none.
    """
    best: tuple[K, int] | None = None
    for key, order in detached:
        if best is None or order < best[1]:
            best = (key, order)
    return None if best is None else best[0]


def decide(slot: SlotView, offer: Offer, *, probe_healthy: bool | None = None) -> Decision:
    """The resume-or-fresh decision and the takeover rule, as a pure function.

    Args:
        slot: the executor's slot as it is now.
        offer: the verified handshake.
        probe_healthy: the result of the probe a previous call asked for (None: not probed).

    Returns:
        ``Refuse(GOING_AWAY)`` while closing; ``Refuse(TAKEN_OVER)`` (4009) for a runtime that
        was taken over; :data:`BUSY` (4004) while another socket of the executor is being
        admitted (one admission at a time: a key holder cannot queue sockets); for a resume,
        ``Resume`` if the slot still holds that session, else ``Refuse(SUPERSEDED)`` (it
        changed during the handshake; the peer retries); for any fresh handshake while
        :attr:`~SlotView.draining`, :data:`DRAINING` (4010); for a fresh handshake into a slot
        without a session while the other slots are :attr:`~SlotView.full`, :data:`EVICT` if
        one of them is :attr:`~SlotView.evictable`, else :data:`FULL` (1013; a slot that holds
        a session keeps its place, so replacing it is never refused for room); for a fresh
        handshake from another runtime while a socket is attached, ``Probe`` and then
        ``Refuse(SUPERSEDED)`` (4004) if the attached socket answered or ``Fresh`` if it did
        not; else ``Fresh``.
    """
    if slot.closing:
        return Refuse(FailureReason.CLOSED, "shutting down")
    if offer.taken_over:
        return Refuse(
            HandshakeFailure.TAKEN_OVER, "another process with this executor id took over"
        )
    if slot.admitting:
        return BUSY
    if offer.resume:
        if slot.session is None or slot.session != offer.session:
            return Refuse(
                HandshakeFailure.SUPERSEDED, "session changed during the handshake; retry"
            )
        return Resume(supersede_attached=slot.attached)
    if slot.draining:
        return DRAINING
    if slot.session is None:
        if slot.full:
            return EVICT if slot.evictable else FULL
        return Fresh(retire_current=False, taken_over=False)
    other_runtime = slot.peer_runtime != offer.runtime
    if slot.attached and other_runtime:
        if probe_healthy is None:
            return Probe()
        if probe_healthy:
            return Refuse(HandshakeFailure.SUPERSEDED, "another peer holds a healthy session")
    return Fresh(retire_current=True, taken_over=other_runtime)
