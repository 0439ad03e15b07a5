"""A :class:`~garcon_link.endpoint.link.WebSocketLink`'s arguments checked, and its TLS context.

Both run once, in the link's constructor, before anything is built: a combination of arguments
that makes no link is a :class:`~garcon_link.errors.ConfigError` there, and so is plain text off
loopback unless ``allow_insecure_development`` says otherwise.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import TypeAlias

from ..core.wire import Role
from ..errors import ConfigError
from ..net.addresses import DialTarget, is_loopback_host

__all__ = ["KeyLookup", "check_arguments", "tls_context"]

KeyLookup: TypeAlias = Callable[[str], bytes | None]
"""``executor_id -> secret`` (None: not enrolled). Called with a *claimed*, unauthenticated id."""


def check_arguments(
    role: Role,
    *,
    executor_id: str | None,
    secret: bytes | None,
    keys: KeyLookup | None,
    max_executors: int,
    listen: tuple[str, int] | None,
    dial: str | DialTarget | None,
    hosted: bool,
    controller_id: str | None,
) -> None:
    """Raise :class:`ConfigError` for a combination of :class:`WebSocketLink` arguments that
    makes no link."""
    if hosted:
        if listen is not None or dial is not None or keys is None or Role(role) is not Role.WORKER:
            raise ConfigError("hosted=True is for a worker-role link with keys=, no listen or dial")
    elif (listen is None) == (dial is None):
        raise ConfigError("a link needs exactly one of listen=(host, port) or dial=URL")
    if keys is not None:
        if (listen is None and not hosted) or executor_id is not None or secret is not None:
            raise ConfigError("keys= is for a listener, instead of executor_id and secret")
    elif executor_id is None or secret is None:
        raise ConfigError("a link needs executor_id and secret (or, listening, keys=)")
    if max_executors < 1:
        raise ConfigError("max_executors must be at least 1")
    if controller_id is not None and Role(role) is not Role.CONTROLLER:
        raise ConfigError("controller_id is a controller's; a worker has none")


def tls_context(
    dial: DialTarget | None,
    listen: tuple[str, int] | None,
    ssl_context: ssl.SSLContext | None,
    allow_insecure_development: bool,
) -> ssl.SSLContext | None:
    """The link's TLS context: a dialer's for ``wss://`` only (a default one unless given), a
    listener's as given. Plain text off loopback is refused unless allowed."""
    if dial is not None:
        if dial.tls and ssl_context is None:
            ssl_context = ssl.create_default_context()
        if not dial.tls:
            ssl_context = None
        host = dial.host
        insecure = not dial.tls
    elif listen is not None:
        host = listen[0]
        insecure = ssl_context is None
    else:  # hosted: the host link's listener applies its own rule
        host, insecure = "", False
    if insecure and not is_loopback_host(host) and not allow_insecure_development:
        raise ConfigError(
            f"plain-text ws:// to or on non-loopback address {host!r} is refused; use TLS "
            "(wss://, or a TLS terminator) or set allow_insecure_development"
        )
    return ssl_context
