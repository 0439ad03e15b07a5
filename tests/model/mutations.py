"""Seeded bugs: each is one edit of the library's real source, applied for the length of a test.

A mutant is compiled from the function's own source with one fragment replaced (the fragment
must occur exactly once, so a mutation that no longer matches the code fails loudly instead of
silently testing nothing) in the function's module namespace, and installed in place of the
original; :func:`mutated` restores it afterwards.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from garcon_link.core import admission, handshake
from garcon_link.core.session import MessageSession
from garcon_link.endpoint.transport import PreReadinessBuffer

from .controllers import ControllerBounds
from .network import Bounds

__all__ = ["MUTATIONS", "Mutation", "mutated"]


@dataclass(frozen=True)
class Mutation:
    """One known failure mode, as a source edit of ``owner.name``."""

    label: str
    why: str
    owner: Any  # a class or a module
    name: str
    old: str
    new: str
    bounds: Bounds | ControllerBounds  # small bounds within which the explorer finds it


MUTATIONS = [
    Mutation(
        "no replay",
        "attach queues nothing: frames lost with a socket are never re-sent",
        MessageSession,
        "attach",
        "self._to_send = deque(self._retained)",
        "self._to_send = deque()",
        Bounds(sends=1, cuts=1, restarts=0, expiries=0, dials=2),
    ),
    Mutation(
        "double delivery",
        "an inbound duplicate (a replayed frame) is delivered again instead of suppressed",
        MessageSession,
        "receive",
        "elif ordinal <= accepted:\n                    duplicates += 1",
        "elif ordinal <= accepted:\n                    bodies.append(packet.body)",
        Bounds(sends=1, cuts=1, restarts=0, expiries=0, dials=2),
    ),
    Mutation(
        "missing fence",
        "attach does not force the trailing receipt: the peer's replay fence never comes",
        MessageSession,
        "attach",
        "self._receipt_due = True  # the trailing receipt: the peer's replay fence",
        "self._receipt_due = False",
        Bounds(sends=0, cuts=0, restarts=0, expiries=0, dials=1),
    ),
    Mutation(
        "receipt beyond delivered",
        "a receipt acknowledges one more message than was delivered",
        MessageSession,
        "data_to_send",
        "out.append(encode_receipt(self._accepted))",
        "out.append(encode_receipt(self._accepted + 1))",
        Bounds(sends=0, cuts=0, restarts=0, expiries=0, dials=1),
    ),
    Mutation(
        "eviction off by one",
        "a receipt through n evicts only the frames before n",
        MessageSession,
        "_confirm",
        "while retained and retained[0][0] <= through:",
        "while retained and retained[0][0] < through:",
        Bounds(sends=1, cuts=0, restarts=0, expiries=0, dials=1),
    ),
    Mutation(
        "written undercounted",
        "offered counts only the first frame of a batch: a written frame counts as never written",
        MessageSession,
        "data_to_send",
        "self._offered = max(self._offered, queue[-1][0])",
        "self._offered = max(self._offered, queue[0][0])",
        Bounds(sends=2, cuts=0, restarts=0, expiries=0, dials=1),
    ),
    Mutation(
        "replace without retiring",
        "takeover: a fresh session replaces the slot's session without retiring it",
        admission,
        "decide",
        "return Fresh(retire_current=True, taken_over=other_runtime)",
        "return Fresh(retire_current=False, taken_over=other_runtime)",
        Bounds(sends=0, cuts=0, restarts=1, expiries=0, dials=2),
    ),
    Mutation(
        "same runtime taken over",
        "takeover: a fresh session from the same runtime marks that runtime as taken over",
        admission,
        "decide",
        "return Fresh(retire_current=True, taken_over=other_runtime)",
        "return Fresh(retire_current=True, taken_over=True)",
        Bounds(sends=0, cuts=2, restarts=0, expiries=1, dials=3),
    ),
    Mutation(
        "resume keeps the old socket",
        "a resume while a (half-open) socket is attached does not supersede that socket",
        admission,
        "decide",
        "return Resume(supersede_attached=slot.attached)",
        "return Resume(supersede_attached=False)",
        Bounds(sends=0, cuts=1, restarts=0, expiries=0, dials=2),
    ),
    Mutation(
        "pre-fence payloads carried over",
        "an attachment keeps what one cut before its fence left in the pre-readiness buffer: the "
        "peer evicted those (acknowledged) and its next replay fills the bound beside them",
        PreReadinessBuffer,
        "attach",
        "return self.release()",
        "return []",
        Bounds(sends=2, cuts=1, restarts=0, expiries=0, dials=2, splits=1, worker_sends=0),
    ),
    Mutation(
        "one slot for every controller",
        "a listening worker files every controller's hello in one slot: a second controller's "
        "handshake meets the first one's session (refused while it answers, else taking it over)",
        admission,
        "slot_key",
        "return (executor, controller_id if controller_id is not None else runtime)",
        "return (executor, None)",
        ControllerBounds(sends=0, cuts=0, restarts=0, dials=0, connected=False),
    ),
    Mutation(
        "a detached session keeps its place",
        "with every place held, a crashed controller's detached session is never given up: the "
        "restarted controller is refused (1013) for as long as the session waits",
        admission,
        "places",
        "return full, full and any(held)",
        "return full, False",
        ControllerBounds(sends=0, cuts=0, restarts=1, dials=1),
    ),
    Mutation(
        "a live session evicted",
        "with every place held, a newcomer is admitted in the place of a session whose socket "
        "is still attached",
        admission,
        "places",
        "return full, full and any(held)",
        "return full, full",
        ControllerBounds(sends=0, cuts=0, restarts=1, dials=1),
    ),
    Mutation(
        "diverging session ids",
        "each side derives the fresh session id from its own role: the two ids differ",
        handshake.Handshake,
        "_on_proof",
        "session_id = compute_mac(self._key, SESSION_PURPOSE, local, peer)",
        "session_id = compute_mac(self._key, local.role.value, local, peer)",
        Bounds(sends=0, cuts=0, restarts=0, expiries=0, dials=1),
    ),
]


@contextmanager
def mutated(mutation: Mutation) -> Iterator[None]:
    """Install ``mutation`` for the duration of the ``with`` block."""
    original = getattr(mutation.owner, mutation.name)
    func = inspect.unwrap(original)
    source = textwrap.dedent(inspect.getsource(func))
    if source.count(mutation.old) != 1:
        raise AssertionError(
            f"mutation {mutation.label!r}: {mutation.old!r} is not in {func.__qualname__} "
            "exactly once (the code changed: update the mutation)"
        )
    namespace = dict(vars(sys.modules[func.__module__]))
    exec(
        compile(source.replace(mutation.old, mutation.new), f"<{mutation.label}>", "exec"),
        namespace,
    )
    setattr(mutation.owner, mutation.name, namespace[func.__name__])
    try:
        yield
    finally:
        setattr(mutation.owner, mutation.name, original)
