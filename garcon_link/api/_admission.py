"""The gateway's admission of a caller's relayed request: is it granted, and does it frame.

A relayed request (:mod:`._relaying`, steps 1 and 3) names an executor, a service and a
method; a grant (:func:`~garcon_link.settings.grants.allows`) must allow its caller that service
on that executor, else ``Rejected("FORBIDDEN")``, nothing forwarded (an unknown and an ungranted
executor are refused alike). The verdicts are remembered (at most :data:`MAX_VERDICTS`, for the
grants in force: replacing them forgets every verdict), so a call repeated costs one lookup.
Its ``payload`` is then framed and checked to decode as a worker would decode it
(:func:`~garcon_link.api._framing.relay_arguments`), else ``Rejected("INVALID_ARGUMENTS")``.
Names are bounded (:data:`MAX_NAME_CHARS`), executor ids checked as a keyring checks them.
"""

from __future__ import annotations

from ..errors import Rejected
from ..limits import Limits
from ..logs import peer_text
from ..settings.grants import Grant, allows, sees
from ..settings.keyring import executor_id_problem
from ._framing import relay_arguments

__all__ = ["MAX_NAME_CHARS", "MAX_VERDICTS", "Admission"]

MAX_NAME_CHARS = 256
"""The longest service or method name a relayed request may carry."""
MAX_VERDICTS = 4096
"""Grant verdicts, by (caller, executor, service), the gateway remembers
(:meth:`Admission.allowed`); one more clears them all."""


class Admission:
    """The grants in force and the checks of a relayed request against them (module
    docstring); one per gateway.

    Attributes:
        grants: the grants in force (the gateway's ``grants`` sets them, checked).
    """

    __slots__ = ("_limits", "_verdicts", "_verdicts_of", "grants")

    def __init__(self, grants: tuple[Grant, ...], limits: Limits) -> None:
        self.grants = grants
        self._limits = limits
        # (caller, executor, service) -> whether a grant allows it, for the grants in
        # ``_verdicts_of`` (replacing ``grants`` forgets them); only well-formed names enter.
        self._verdicts: dict[tuple[str, str, str], bool] = {}
        self._verdicts_of: tuple[Grant, ...] = grants

    def check_visible(self, caller: str, executor: str) -> None:
        """Refuse a malformed executor id, and one no grant lets ``caller`` see."""
        problem = executor_id_problem(executor)
        if problem is not None:
            raise Rejected("INVALID_ARGUMENTS", f"executor id {peer_text(executor)}: {problem}")
        if not sees(self.grants, caller, executor):
            raise Rejected(
                "FORBIDDEN", f"caller {caller!r} has no grant for executor {peer_text(executor)}"
            )

    def admit(self, caller: str, executor: str, service: str, method: str, payload: bytes) -> bytes:
        """The grant and the framing of one relayed request (:mod:`._relaying`, steps 1 and 3):
        its ``args`` and ``kwargs`` items, or the refusal."""
        if len(method) > MAX_NAME_CHARS:
            raise Rejected(
                "INVALID_ARGUMENTS", f"service and method names are at most {MAX_NAME_CHARS} long"
            )
        verdict = (
            self._verdicts.get((caller, executor, service))
            if self.grants is self._verdicts_of
            else None
        )
        if verdict is None:
            verdict = self.allowed(caller, executor, service)
        if not verdict:
            raise Rejected(
                "FORBIDDEN",
                f"caller {caller!r} has no grant for {peer_text(service)} on executor "
                f"{peer_text(executor)}; nothing was forwarded",
            )
        # Framed, and refused if a worker's decoder would refuse them (text that is not UTF-8,
        # a bignum past its bound or around other than bytes, an array as a map key), so that
        # every call forwarded is one the worker reads; the bytes forwarded as they came.
        return relay_arguments(payload, self._limits.max_frame_bytes)

    def allowed(self, caller: str, executor: str, service: str) -> bool:
        """Whether a grant allows ``caller`` to call ``service`` on ``executor``, remembered
        (at most :data:`MAX_VERDICTS`) so that a call repeated costs one lookup.

        Raises:
            Rejected: ``INVALID_ARGUMENTS``: a malformed executor id or too long a name.
        """
        grants = self.grants
        if grants is not self._verdicts_of:
            self._verdicts.clear()
            self._verdicts_of = grants
        key = (caller, executor, service)
        verdict = self._verdicts.get(key)
        if verdict is not None:
            return verdict
        problem = executor_id_problem(executor)
        if problem is not None:
            raise Rejected("INVALID_ARGUMENTS", f"executor id {peer_text(executor)}: {problem}")
        if len(service) > MAX_NAME_CHARS:
            raise Rejected(
                "INVALID_ARGUMENTS", f"service and method names are at most {MAX_NAME_CHARS} long"
            )
        if len(self._verdicts) >= MAX_VERDICTS:
            self._verdicts.clear()
        verdict = self._verdicts[key] = allows(grants, caller, executor, service)
        return verdict
