"""One executor's view of a link (what a fleet member's ``executor.link`` offers).

A fleet's listening controller serves many executors on one
:class:`~garcon_link.endpoint.link.WebSocketLink`; each fleet member sees it through an
:class:`ExecutorLink`, which reports and disconnects only its own executor's session. The view
reads the link through :class:`ViewedLink`, the part of the link's public surface it needs, so
this module does not import the link (which re-exports the view).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..errors import HandshakeError, LinkError
from ..net.ws import LinkStatistics
from .transport import SessionTransport

__all__ = ["ExecutorLink", "ViewedLink"]


class ViewedLink(Protocol):
    """What :class:`ExecutorLink` reads of a :class:`~garcon_link.endpoint.link.WebSocketLink`."""

    @property
    def last_error(self) -> str | None: ...

    @property
    def refusal(self) -> HandshakeError | None: ...

    @property
    def last_dial_error(self) -> str | None: ...

    @property
    def url(self) -> str: ...

    def session(self, executor_id: str) -> SessionTransport | None: ...

    def on_refusal(self, listener: Callable[[HandshakeError], None]) -> Callable[[], None]: ...

    def on_dial_failed(self, listener: Callable[[LinkError], None]) -> Callable[[], None]: ...

    def statistics(self) -> LinkStatistics: ...

    async def disconnect(self, executor_id: str | None = None) -> None: ...


class ExecutorLink:
    """One executor's view of a link: what a fleet member's ``executor.link`` offers.

    The link itself may serve many executors (a listening fleet controller); this view
    disconnects and reports only ``executor_id``'s session. Counters are the link's.
    """

    def __init__(self, link: ViewedLink, executor_id: str) -> None:
        self._link = link
        self.executor_id = executor_id

    @property
    def transport(self) -> SessionTransport | None:
        """The executor's current logical session, if any."""
        return self._link.session(self.executor_id)

    @property
    def last_error(self) -> str | None:
        return self._link.last_error

    @property
    def refusal(self) -> HandshakeError | None:
        """The link's latest refusal that a redial will not heal (a dialing link only)."""
        return self._link.refusal

    def on_refusal(self, listener: Callable[[HandshakeError], None]) -> Callable[[], None]:
        return self._link.on_refusal(listener)

    @property
    def last_dial_error(self) -> str | None:
        """Why the link's latest dial failed (``None`` for a listening link, or once a dial
        attached a socket)."""
        return self._link.last_dial_error

    def on_dial_failed(self, listener: Callable[[LinkError], None]) -> Callable[[], None]:
        return self._link.on_dial_failed(listener)

    @property
    def url(self) -> str:
        return self._link.url

    def statistics(self) -> LinkStatistics:
        return self._link.statistics()

    async def disconnect(self) -> None:
        """Drop the executor's attached socket abruptly (as a network loss would)."""
        await self._link.disconnect(self.executor_id)
