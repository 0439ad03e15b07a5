"""Link configuration: the TOML files, their schema and loaders, TLS material, every refusal rule.

Why one module of about 1,200 lines: the two file shapes (:class:`LinkConfig` and
:class:`FleetConfig`) are checked by the same rules, with the same type, key, address and TLS
helpers and the same message shape, so their schema and loaders read as one set of rules. The
secret policy (:mod:`garcon_link.settings.secrets`) and the dial-URL parser
(:mod:`garcon_link.net.addresses`) live apart: other modules use them too.

Schema. ``[tls]`` and ``[limits]`` are optional; every other table or key not listed
here is refused::

    executor_id = "build-box-1"         # required; 1-200 printable characters, no whitespace
    role = "worker"                     # required; "worker" or "controller"
    # controller_id = "scheduler"       # optional, a controller's only; same rules as executor_id
    secret_file = "link.secret"         # exactly one of secret_file / secret
    # secret = "..."                    # inline: >= 32 bytes (UTF-8, or 64+ hex digits)
    allow_insecure_development = false  # optional boolean, default false
    state_dir = "state"                 # optional, workers only; relative to the file's directory

    [connection]                        # required; exactly one of listen / dial
    listen = "127.0.0.1:8765"           # "host:port"; IPv6 as "[::1]:8765"; port 0 = ephemeral
    # dial = "wss://build-box-1.example:443/executor"
    # dial = ["wss://a.example/executor", "wss://b.example/executor"]   # a worker only: one
    #                                   # controller per URL, at most Limits.max_controllers

    [tls]                               # optional; paths relative to the config file's directory
    cert = "server.pem"                 # certificate chain (PEM); may also hold the key
    key = "server.key"                  # private key (PEM, unencrypted)
    ca = "ca.pem"                       # CA bundle: dialers verify the server against it

    [limits]                            # optional; keys are Limits field names
    heartbeat_interval = 2.0

Fleet controllers
-----------------
A controller of many executors (docs/design.md#fleets) has its own file shape, read by
:func:`load_fleet_config` into a :class:`FleetConfig` (schema in that function's docstring): an
``[executors]`` table with a ``keyring`` directory of per-executor keys
(``keys/<executor_id>.secret``, see :mod:`garcon_link.settings.keyring`) and optional
``[[executors.dial]]`` entries, and no top-level ``executor_id`` or secret. :func:`load_config`
refuses a file with ``[executors]``, and :func:`load_fleet_config` one without. An executor id
used as a file name obeys :func:`~garcon_link.net.addresses.executor_id_problem`, which is
stricter than ``executor_id`` here: a worker keeps loading its config whatever printable id it
has, but only a file-name-safe id can be enrolled in a keyring.

Secrets and dial URLs
---------------------
The secret (a file, or an inline ``secret``) is read and checked by
:mod:`garcon_link.settings.secrets`, which holds :class:`~garcon_link.settings.secrets.Secret`
and the policy for files that hold one; dial URLs are parsed by
:func:`~garcon_link.net.addresses.check_dial_url`, the parser the link uses, and this module
only words its refusals (file, field, fix). No message, repr or log line of this module contains
a secret or a dial URL's userinfo.

Refusals
--------
Every refusal is a :class:`~garcon_link.errors.ConfigError` whose message reads
``<file>: <field>: <problem>; <how to fix it>`` (``LinkConfig`` stands in for the file when the
configuration was built in code). Refused are:

* no path given and ``GARCON_LINK_CONFIG`` unset; a missing or unreadable config file; a file that
  is not UTF-8; a TOML syntax error (the message carries TOML's line and column);
* an unknown key at the top level or in ``[connection]``, ``[tls]`` or ``[limits]`` (the message
  lists the allowed keys); a value of the wrong type (e.g. ``allow_insecure_development = "yes"``);
* a missing ``executor_id`` or ``role``; an ``executor_id`` that is empty, longer than 200
  characters, unprintable or contains whitespace; a ``role`` other than worker/controller;
* neither or both of ``secret`` / ``secret_file``; a missing or unreadable secret file, or one
  that is not a regular file or exceeds 64 KiB; a secret shorter than 32 bytes; on POSIX a secret
  file, or a config file holding an inline ``secret``, whose mode grants anything to group or
  others (``st_mode & 0o077``) -- fix with ``chmod 600``; such a file inside a directory (or
  below one, along the path as given or its real path) that everyone may write without the
  sticky bit, or a sticky one (``/tmp``) where the directory or the path's entry in it belongs
  to another user: either lets someone else replace the secret (the message names the
  directory and the fix; the rule and what it leaves out:
  :func:`~garcon_link.settings.secrets.unsafe_directory`);
* neither or both of ``listen`` / ``dial``; a ``listen`` that is not ``host:port`` (unbracketed
  IPv6, missing or out-of-range port); a ``dial`` URL whose scheme is not ``ws``/``wss``, that
  carries userinfo, a query or a fragment, whose path is not exactly ``/executor``, whose host is
  missing or invalid, or whose port is invalid (default 80 for ws, 443 for wss);
* plain text off loopback without ``allow_insecure_development = true``: a ``ws://`` dial, or a
  listen without ``[tls]``, to/on an address that is not loopback. Loopback is 127.0.0.0/8, ``::1``
  and the name ``localhost``; nothing is resolved, so any other host name counts as non-loopback.
  ``wss://`` needs nothing extra;
* ``[tls]`` with a ``ws://`` dial (it would be silently unused); ``[tls]`` on a listener without
  ``cert``; ``key`` without ``cert``; TLS files that are missing or do not load (reported when a
  context is built, naming the file);
* ``[limits]`` values that :class:`~garcon_link.limits.Limits` refuses;
* a ``state_dir`` that is not a non-empty string, or one in a controller's file (only a worker
  keeps a state directory). Whether the directory can be created, locked and used is checked
  when the worker starts (:func:`~garcon_link.rpc.statedir.open_state_directory`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import ssl
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..core.wire import Role
from ..errors import ConfigError
from ..limits import Limits
from ..net.addresses import (
    EXECUTOR_PATH,
    MAX_EXECUTOR_ID_CHARS,
    DialTarget,
    DialUrlRefusal,
    check_dial_url,
    executor_id_problem,
    host_problem,
    is_loopback_host,
)
from .secrets import (
    KEYGEN_HINT,
    MIN_SECRET_BYTES,
    Secret,
    Source,
    decode_secret,
    keyring_directory_problem,
    read_secret,
    refusal,
    refuse_open_mode,
    refuse_unsafe_directory,
)

__all__ = [
    "CONFIG_ENV_VAR",
    "DialExecutor",
    "FleetConfig",
    "LinkConfig",
    "TlsConfig",
    "load_config",
    "load_fleet_config",
]

CONFIG_ENV_VAR = "GARCON_LINK_CONFIG"
"""Environment variable naming the config file when :func:`load_config` gets no path."""

_PORT_TEXT = re.compile(r"[0-9]{1,5}\Z")

_TOP_LEVEL_KEYS = (
    "executor_id",
    "role",
    "controller_id",
    "secret",
    "secret_file",
    "allow_insecure_development",
    "state_dir",
    "connection",
    "tls",
    "limits",
)
_CONNECTION_KEYS = ("listen", "dial")
_TLS_KEYS = ("cert", "key", "ca")


# --------------------------------------------------------------------------- messages


def _keyring_path(value: object, src: Source, field: str, example: str) -> Path:
    """``value`` (a keyring field as given: a path, a string, or anything a caller passed) as a
    :class:`Path`; anything else, or an empty string, is a one-line refusal naming ``field``."""
    if isinstance(value, Path):
        return value
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise refusal(src, field, f"expected a path, got {_type_name(value)}", example)
    return Path(value)


def _type_name(value: object) -> str:
    """Name the TOML type of ``value``. Only types are shown for bad values: one may be a secret."""
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (dict, "a table"),
        (list, "an array"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _shown_role(value: object) -> str:
    # A short string is echoed to show a typo ("Worker"); anything as long as a secret is not.
    if isinstance(value, str) and len(value) < MIN_SECRET_BYTES // 2:
        return repr(value)
    return _type_name(value)


# --------------------------------------------------------------------------- TLS


def _check_tls_file(path: Path, what: str) -> None:
    try:
        info = os.stat(path)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"[tls] {what}: file {path} does not exist; fix the path (relative paths are "
            "resolved against the config file's directory)"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"[tls] {what}: cannot access {path} ({exc.strerror or type(exc).__name__}); "
            "check the path and its permissions"
        ) from exc
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"[tls] {what}: {path} is not a regular file; point it at a PEM file")


def _no_key_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key; an empty
    # password makes it fail instead, and the failure is reported as a ConfigError.
    return b""


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS material for a link: certificate chain, private key and CA bundle (all PEM paths).

    A listener needs ``cert`` (``key`` may be omitted when the cert file also holds the key). A
    dialer needs nothing (the system CAs verify the server) but may set ``ca`` to trust a private
    CA, and ``cert``/``key`` to present a client certificate.

    Raises:
        ConfigError: a field is not a path, or ``key`` is set without ``cert``.
    """

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        for name in _TLS_KEYS:
            value: object = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                if not isinstance(value, str | os.PathLike) or not os.fspath(value):
                    raise ConfigError(
                        f"[tls] {name}: expected a path, got {_type_name(value)}; give a PEM path"
                    )
                object.__setattr__(self, name, Path(value))
        if self.key is not None and self.cert is None:
            raise ConfigError("[tls] key: a key without a cert is useless; add cert or drop key")

    def _load_chain(self, context: ssl.SSLContext) -> None:
        assert self.cert is not None
        _check_tls_file(self.cert, "cert")
        if self.key is not None:
            _check_tls_file(self.key, "key")
        try:
            context.load_cert_chain(self.cert, self.key, password=_no_key_password)
        except (ssl.SSLError, OSError, ValueError) as exc:
            files = f"{self.cert}" if self.key is None else f"{self.cert} and key {self.key}"
            raise ConfigError(
                f"[tls] cert: cannot load the certificate chain from {files} "
                f"({type(exc).__name__}: {exc}); check they are PEM, the key is unencrypted and "
                "matches the certificate"
            ) from exc

    def _ca_error(self, exc: Exception) -> ConfigError:
        return ConfigError(
            f"[tls] ca: cannot load CA certificates from {self.ca} "
            f"({type(exc).__name__}: {exc}); check it is a PEM bundle"
        )

    def server_context(self) -> ssl.SSLContext:
        """Build the listener's context (TLS 1.2+, the certificate chain loaded).

        When ``ca`` is set, a client that presents a certificate must chain to it
        (``CERT_OPTIONAL``); clients without one are still accepted -- the link's own handshake
        authenticates peers.

        Raises:
            ConfigError: ``cert`` is unset, or a file is missing or does not load (named).
        """
        if self.cert is None:
            raise ConfigError(
                "[tls] cert: a listener needs a certificate; set cert (and key) in [tls]"
            )
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._load_chain(context)
        if self.ca is not None:
            _check_tls_file(self.ca, "ca")
            try:
                context.load_verify_locations(cafile=self.ca)
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise self._ca_error(exc) from exc
            context.verify_mode = ssl.CERT_OPTIONAL
        return context

    def client_context(self) -> ssl.SSLContext:
        """Build the dialer's context (TLS 1.2+, server certificate and hostname verified).

        The server must chain to ``ca`` when it is set (only to ``ca``: a private CA pins the
        trust), otherwise to the system CAs. ``cert``/``key``, when set, are presented as a client
        certificate.

        Raises:
            ConfigError: a file is missing or does not load (named).
        """
        if self.ca is None:
            context = ssl.create_default_context()
        else:
            _check_tls_file(self.ca, "ca")
            try:
                context = ssl.create_default_context(cafile=self.ca)
            except (ssl.SSLError, OSError, ValueError) as exc:
                raise self._ca_error(exc) from exc
        if self.cert is not None:
            self._load_chain(context)
        return context


# --------------------------------------------------------------------------- addresses


def _format_url(host: str, port: int, *, tls: bool) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'wss' if tls else 'ws'}://{shown}:{port}{EXECUTOR_PATH}"


def _parse_listen(text: str, source: Path | None) -> tuple[str, int]:
    what = "[connection] listen"
    fix = 'write it as "host:port", e.g. "127.0.0.1:8765" or "[::1]:8765"'
    if text.startswith("["):
        end = text.find("]")
        host, rest = (text[1:end], text[end + 1 :]) if end > 0 else ("", "")
        if end < 0 or ":" not in host:
            raise refusal(source, what, "a bracketed host must be an IPv6 address", fix)
        if not rest.startswith(":"):
            raise refusal(source, what, "the port is missing", fix)
        port_text = rest[1:]
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise refusal(source, what, "the port is missing", fix)
        if ":" in host:
            raise refusal(source, what, "an IPv6 address must be in brackets", fix)
    if not _PORT_TEXT.match(port_text):
        raise refusal(source, what, f"the port {port_text!r} is not a number 0-65535", fix)
    return host, int(port_text)


def _parse_dial(url: str, source: Source, what: str = "[connection] dial") -> DialTarget:
    """A checked dial URL (:func:`~garcon_link.net.addresses.check_dial_url`, the parser the
    link uses), its refusal worded for this file and field. Messages never echo the whole URL."""
    found = check_dial_url(url)
    if isinstance(found, DialUrlRefusal):
        raise refusal(source, what, found.problem, found.fix)
    return found


def _check_dial(
    url: str,
    tls: TlsConfig | None,
    insecure: bool,
    source: Source,
    what: str = "[connection] dial",
) -> None:
    """A dial URL's rules: its syntax, ``[tls]`` with ``ws://`` (unused material), plain text to
    a non-loopback host without ``allow_insecure_development``."""
    target = _parse_dial(url, source, what)
    host, dial_tls = target.host, target.tls
    if tls is not None and not dial_tls:
        raise refusal(
            source,
            "[tls]",
            "TLS material is configured but the dial URL "
            f"{'' if what == '[connection] dial' else f'of {what} '}is plain ws://",
            "dial wss:// or remove [tls]",
        )
    if not dial_tls and not is_loopback_host(host) and not insecure:
        raise refusal(
            source,
            what,
            f"plain-text ws:// to non-loopback host {host!r} exposes the link's traffic",
            "dial wss:// instead, or set allow_insecure_development = true (development only)",
        )


def _check_listen(listen: object, tls: TlsConfig | None, insecure: bool, source: Source) -> None:
    """A listen address's rules: a ``(host, port)`` pair, ``[tls]`` with a cert, plain text only
    on loopback without ``allow_insecure_development``."""
    what = "[connection] listen"
    fix = 'e.g. listen = "127.0.0.1:8765" (in code: ("127.0.0.1", 8765))'
    if not (
        isinstance(listen, tuple)
        and len(listen) == 2
        and isinstance(listen[0], str)
        and isinstance(listen[1], int)
        and not isinstance(listen[1], bool)
    ):
        raise refusal(source, what, "expected a (host, port) pair", fix)
    host, port = listen
    problem = host_problem(host)
    if problem is not None:
        raise refusal(source, what, problem, fix)
    if not 0 <= port <= 65535:
        raise refusal(source, what, f"port {port} is outside 0-65535", fix)
    if tls is not None and tls.cert is None:
        raise refusal(
            source, "[tls] cert", "a listener with [tls] needs a certificate", "set cert and key"
        )
    if tls is None and not is_loopback_host(host) and not insecure:
        raise refusal(
            source,
            what,
            f"listening in plain text on non-loopback address {host!r} exposes the link's traffic",
            "add [tls] with cert and key, listen on 127.0.0.1, or set "
            "allow_insecure_development = true (development only)",
        )


# --------------------------------------------------------------------------- LinkConfig


def _check_shared_types(
    owner: str, src: Source, flag: object, tls: object, limits: object, where: object
) -> None:
    """The type checks LinkConfig and FleetConfig share (values typed ``object``: the
    annotations are promises a caller may break)."""
    if not isinstance(flag, bool):
        raise refusal(
            src,
            "allow_insecure_development",
            f"expected a boolean, got {_type_name(flag)}",
            "write true or false (unquoted)",
        )
    if tls is not None and not isinstance(tls, TlsConfig):
        raise refusal(src, "[tls]", f"expected TlsConfig, got {_type_name(tls)}", "use TlsConfig")
    if not isinstance(limits, Limits):
        raise refusal(
            src, "[limits]", f"expected Limits, got {_type_name(limits)}", "use Limits(...)"
        )
    if where is not None and not isinstance(where, Path):
        raise ConfigError(f"{owner}: source: expected a Path, got {_type_name(where)}")


def _check_controller_id(value: object, role: Role | str, src: Source) -> None:
    """``controller_id``: a controller's name for itself on every worker it talks to (a worker
    holds one session per controller; docs/design.md#many-controllers). Same rules as an
    ``executor_id``; None (the default) makes each process a controller of its own."""
    if value is None:
        return
    fix = 'use a short name such as "scheduler", or leave it out (each process is its own)'
    if not isinstance(value, str):
        raise refusal(src, "controller_id", f"expected a string, got {_type_name(value)}", fix)
    if role != Role.CONTROLLER and role != "controller":
        raise refusal(
            src,
            "controller_id",
            "only a controller has a controller_id",
            "remove it from the worker's configuration",
        )
    if not value or len(value) > MAX_EXECUTOR_ID_CHARS:
        raise refusal(
            src,
            "controller_id",
            f"must be 1-{MAX_EXECUTOR_ID_CHARS} characters, got {len(value)}",
            fix,
        )
    if not value.isprintable() or any(ch.isspace() for ch in value):
        raise refusal(src, "controller_id", "contains whitespace or unprintable characters", fix)


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """Everything one endpoint needs; loaded by :func:`load_config` or built in code.

    Exactly one of ``listen`` (``(host, port)``, port 0 binds an ephemeral port) and ``dial`` (a
    ``ws(s)://host[:port]/executor`` URL) is set. ``source`` is the file the config came from and
    is only used in messages. All rules of the module docstring are checked on construction.

    Raises:
        ConfigError: a field breaks a rule; the message names the field and the fix.
    """

    executor_id: str
    role: Role
    secret: Secret
    listen: tuple[str, int] | None = None
    dial: str | None = None
    allow_insecure_development: bool = False
    tls: TlsConfig | None = None
    limits: Limits = field(default_factory=Limits)
    source: Path | None = None
    state_dir: Path | None = None
    controller_id: str | None = None
    also_dial: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        src = self.source
        self._check_types()
        self._check_state_dir()
        _check_controller_id(self.controller_id, self.role, src)
        self._check_also_dial()
        ident = self.executor_id
        if not ident or len(ident) > MAX_EXECUTOR_ID_CHARS:
            raise refusal(
                src,
                "executor_id",
                f"must be 1-{MAX_EXECUTOR_ID_CHARS} characters, got {len(ident)}",
                'use a short name such as "build-box-1"',
            )
        if not ident.isprintable() or any(ch.isspace() for ch in ident):
            raise refusal(
                src,
                "executor_id",
                "contains whitespace or unprintable characters",
                'use a name such as "build-box-1"',
            )
        if (self.listen is None) == (self.dial is None):
            raise refusal(
                src,
                "[connection]",
                "exactly one of listen and dial must be set",
                'set listen = "127.0.0.1:8765" or dial = "wss://host:443/executor"',
            )
        if self.dial is not None:
            _check_dial(self.dial, self.tls, self.allow_insecure_development, src)
            hint = self.dial_target.executor_hint
            if hint is not None and hint != ident:
                raise refusal(
                    src,
                    "[connection] dial",
                    f"the routing hint executor={hint!r} is not this config's executor_id "
                    f"{ident!r}: a load balancer would send the session to the wrong place",
                    f"use ?executor={ident}",
                )
        else:
            _check_listen(self.listen, self.tls, self.allow_insecure_development, src)

    def _check_types(self) -> None:
        src = self.source
        # Values are typed ``object`` here: the annotations are promises the caller may break.
        ident: object = self.executor_id
        if not isinstance(ident, str):
            raise refusal(
                src, "executor_id", f"expected a string, got {_type_name(ident)}", "quote it"
            )
        role: object = self.role
        if not isinstance(role, Role):
            if role not in ("worker", "controller"):
                raise refusal(
                    src,
                    "role",
                    f"must be worker or controller, got {_shown_role(role)}",
                    'role = "worker"',
                )
            object.__setattr__(self, "role", Role(role))
        secret: object = self.secret
        if not isinstance(secret, Secret):
            raise refusal(
                src,
                "secret",
                f"expected a Secret, got {_type_name(secret)}",
                "wrap the bytes: Secret(value)",
            )
        dial: object = self.dial
        if dial is not None and not isinstance(dial, str):
            raise refusal(
                src, "[connection] dial", f"expected a string, got {_type_name(dial)}", "quote it"
            )
        _check_shared_types(
            "LinkConfig", src, self.allow_insecure_development, self.tls, self.limits, self.source
        )

    def _check_state_dir(self) -> None:
        value: object = self.state_dir
        if value is None:
            return
        src = self.source
        if not isinstance(value, str | os.PathLike):
            raise refusal(
                src, "state_dir", f"expected a path, got {_type_name(value)}", "quote the path"
            )
        text = os.fspath(value)
        if not isinstance(text, str) or not text or "\0" in text:
            raise refusal(src, "state_dir", "the path is empty or invalid", 'state_dir = "state"')
        if self.role is not Role.WORKER:
            raise refusal(
                src,
                "state_dir",
                "only a worker keeps a state directory",
                "remove state_dir from the controller's configuration",
            )
        object.__setattr__(self, "state_dir", Path(text))

    def _check_also_dial(self) -> None:
        """``also_dial``: a dialing worker's further controllers (``dial = [...]`` in a file);
        each URL obeys the rules of ``dial``, none twice, at most ``max_controllers`` in all."""
        src, more = self.source, self.also_dial
        if not isinstance(more, tuple) or not all(isinstance(url, str) for url in more):
            raise refusal(
                src, "[connection] dial", "expected a list of URL strings", 'dial = ["wss://..."]'
            )
        if not more:
            return
        if self.dial is None or self.role != Role.WORKER:
            raise refusal(
                src,
                "[connection] dial",
                "only a dialing worker dials several URLs (one controller each)",
                "a controller dials several workers as a fleet: [[executors.dial]] entries",
            )
        urls = (self.dial, *more)
        if len(urls) > self.limits.max_controllers:
            raise refusal(
                src,
                "[connection] dial",
                f"{len(urls)} URLs, more than max_controllers={self.limits.max_controllers}",
                "dial fewer controllers, or raise [limits] max_controllers",
            )
        if len(set(urls)) != len(urls):
            raise refusal(
                src, "[connection] dial", "a URL is listed twice", "list each controller once"
            )
        for url in more:
            _check_dial(url, self.tls, self.allow_insecure_development, src)
            hint = _parse_dial(url, src).executor_hint
            if hint is not None and hint != self.executor_id:
                raise refusal(
                    src,
                    "[connection] dial",
                    f"the routing hint executor={hint!r} of {url!r} is not this config's "
                    f"executor_id {self.executor_id!r}",
                    f"use ?executor={self.executor_id}",
                )

    @property
    def dial_urls(self) -> tuple[str, ...]:
        """Every URL this endpoint dials: ``dial`` and then ``also_dial`` (empty: it listens)."""
        return () if self.dial is None else (self.dial, *self.also_dial)

    @property
    def is_dialer(self) -> bool:
        """True when this endpoint dials (``dial`` is set), false when it listens."""
        return self.dial is not None

    @property
    def dial_target(self) -> DialTarget:
        """The dial URL, parsed (what the link dials). ``ValueError`` for a listener."""
        if self.dial is None:
            raise ValueError("this LinkConfig listens; it has no dial URL")
        return _parse_dial(self.dial, self.source)

    def _dial_parts(self) -> tuple[str, int, bool]:
        if self.dial is None:
            raise ValueError("this LinkConfig listens; it has no dial URL")
        target = _parse_dial(self.dial, self.source)
        return target.host, target.port, target.tls

    @property
    def dial_host(self) -> str:
        """Host of the dial URL (IPv6 without brackets). ``ValueError`` for a listener."""
        return self._dial_parts()[0]

    @property
    def dial_port(self) -> int:
        """Port of the dial URL; 80 for ws and 443 for wss when omitted. ``ValueError`` for a
        listener."""
        return self._dial_parts()[1]

    @property
    def dial_tls(self) -> bool:
        """True for ``wss://``, false for ``ws://``. ``ValueError`` for a listener."""
        return self._dial_parts()[2]

    @property
    def listen_url(self) -> str:
        """The URL peers dial, e.g. ``ws://127.0.0.1:8765/executor`` (``wss`` with ``[tls]``).

        With port 0 it shows port 0: the bound port is only known once listening.
        ``ValueError`` for a dialer.
        """
        if self.listen is None:
            raise ValueError("this LinkConfig dials; it has no listen address")
        host, port = self.listen
        return _format_url(host, port, tls=self.tls is not None)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context this endpoint needs, or ``None`` for plain text.

        A ``wss://`` dialer gets :meth:`TlsConfig.client_context` (system CAs without ``[tls]``);
        a listener with ``[tls]`` gets :meth:`TlsConfig.server_context`.

        Raises:
            ConfigError: a TLS file is missing or does not load.
        """
        try:
            if self.dial is not None:
                if not self.dial_tls:
                    return None
                return (self.tls or TlsConfig()).client_context()
            return self.tls.server_context() if self.tls is not None else None
        except ConfigError as exc:
            if self.source is None:
                raise
            raise ConfigError(f"{self.source}: {exc}") from exc


# --------------------------------------------------------------------------- FleetConfig

_DIAL_ENTRY = "[[executors.dial]]"
_MAX_MAX_EXECUTORS = 1_000_000


def _check_dial_executor(executor_id: object, url: object, source: Source, prefix: str) -> None:
    """A dial entry's own rules: its id is a keyring-safe name and its URL parses. ``prefix``
    names the entry in messages (``"[[executors.dial]] #2 "``)."""
    if not isinstance(executor_id, str):
        raise refusal(
            source, f"{prefix}id", f"expected a string, got {_type_name(executor_id)}", "quote it"
        )
    problem = executor_id_problem(executor_id)
    if problem is not None:
        raise refusal(
            source,
            f"{prefix}id",
            f"the executor id {problem}",
            "use ASCII letters, digits, '.', '_' and '-', not starting with '.' (e.g. \"box-1\"); "
            "rename the worker's executor_id to match",
        )
    if not isinstance(url, str):
        raise refusal(
            source, f"{prefix}url", f"expected a string, got {_type_name(url)}", "quote it"
        )
    _parse_dial(url, source, f"{prefix}url")


@dataclass(frozen=True, slots=True)
class DialExecutor:
    """One listening worker that a fleet controller dials (an ``[[executors.dial]]`` entry).

    ``executor_id`` must pass :func:`~garcon_link.net.addresses.executor_id_problem`; ``url`` is a
    ``ws(s)://host[:port]/executor`` URL checked like :class:`LinkConfig`'s ``dial``; ``secret``
    is that worker's own secret (loaded from the entry's ``secret_file``).

    Raises:
        ConfigError: a field breaks a rule (the plain-text rule is checked by
            :class:`FleetConfig`, which knows ``allow_insecure_development``).
    """

    executor_id: str
    url: str
    secret: Secret

    def __post_init__(self) -> None:
        _check_dial_executor(self.executor_id, self.url, "DialExecutor", "")
        secret: object = self.secret
        if not isinstance(secret, Secret):
            raise refusal(
                "DialExecutor",
                "secret",
                f"expected a Secret, got {_type_name(secret)}",
                "wrap the bytes: Secret(value)",
            )


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """A controller of many executors (docs/design.md#fleets); loaded by :func:`load_fleet_config`.

    It listens (``listen``, workers dial in and authenticate with their key in ``keyring``),
    dials listening workers (``dial`` entries), or both. ``listen`` and ``keyring`` go together.
    ``tls`` is the listener's certificate when listening, and the dialers' CA / client
    certificate for ``wss://`` entries. ``source`` is only used in messages.

    Attributes:
        listen: ``(host, port)`` to listen on, or ``None``.
        keyring: the key directory (``<keyring>/<executor_id>.secret``) of a listener, or
            ``None``. Checked (exists, is a safe directory) by :func:`load_fleet_config` and by
            :class:`~garcon_link.Keyring`, not here.
        dial: the listening workers to dial, ids unique.
        max_executors: how many executors the registry holds at once (1 to 1,000,000).
        forget_after: seconds an executor stays offline before it leaves the registry (> 0).

    Raises:
        ConfigError: a field breaks a rule; the message names the field and the fix.
    """

    listen: tuple[str, int] | None = None
    keyring: Path | None = None
    dial: tuple[DialExecutor, ...] = ()
    max_executors: int = 10_000
    forget_after: float = 3600.0
    tls: TlsConfig | None = None
    limits: Limits = field(default_factory=Limits)
    allow_insecure_development: bool = False
    source: Path | None = None
    controller_id: str | None = None

    def __post_init__(self) -> None:
        src: Source = self.source if self.source is not None else "FleetConfig"
        self._check_types(src)
        _check_controller_id(self.controller_id, Role.CONTROLLER, src)
        if (self.listen is None) != (self.keyring is None):
            raise refusal(
                src,
                "[executors] keyring" if self.keyring is None else "[connection] listen",
                "a listening controller needs a keyring and a keyring needs a listener",
                'set both [connection] listen = "0.0.0.0:8443" and [executors] keyring = "keys", '
                "or neither (and dial workers with [[executors.dial]] entries)",
            )
        if self.listen is None and not self.dial:
            raise refusal(
                src,
                "[connection] listen",
                "the controller neither listens nor dials",
                'set [connection] listen (and [executors] keyring = "keys"), or add '
                "[[executors.dial]] entries with id, url and secret_file",
            )
        if self.listen is not None:
            _check_listen(self.listen, self.tls, self.allow_insecure_development, src)
        # Listening, [tls] is the server's certificate: a ws:// entry does not leave it unused.
        dial_tls = self.tls if self.listen is None else None
        seen: dict[str, int] = {}
        for number, entry in enumerate(self.dial, start=1):
            prefix = f"{_DIAL_ENTRY} #{number} "
            if entry.executor_id in seen:
                raise refusal(
                    src,
                    f"{prefix}id",
                    f"executor {entry.executor_id!r} is already dialed by entry "
                    f"#{seen[entry.executor_id]}",
                    "give each entry its own executor id, or remove the duplicate",
                )
            seen[entry.executor_id] = number
            _check_dial(entry.url, dial_tls, self.allow_insecure_development, src, f"{prefix}url")
        if not 1 <= self.max_executors <= _MAX_MAX_EXECUTORS:
            raise refusal(
                src,
                "[executors] max_executors",
                f"must be 1-{_MAX_MAX_EXECUTORS}, got {self.max_executors}",
                "e.g. max_executors = 10000",
            )
        if len(self.dial) > self.max_executors:
            raise refusal(
                src,
                "[executors] max_executors",
                f"{len(self.dial)} executors are dialed but max_executors is {self.max_executors}",
                "raise max_executors or dial fewer workers",
            )
        if not (math.isfinite(self.forget_after) and self.forget_after > 0):
            raise refusal(
                src,
                "[executors] forget_after",
                f"must be a positive number of seconds, got {self.forget_after}",
                "e.g. forget_after = 3600",
            )

    def _check_types(self, src: Source) -> None:
        # Values are typed ``object`` here: the annotations are promises the caller may break.
        keyring: object = self.keyring
        if keyring is not None:
            path = _keyring_path(keyring, src, "[executors] keyring", 'e.g. keyring = "keys"')
            object.__setattr__(self, "keyring", path)
        dial: object = self.dial
        if isinstance(dial, list):
            dial = tuple(dial)
            object.__setattr__(self, "dial", dial)
        if not isinstance(dial, tuple) or not all(isinstance(e, DialExecutor) for e in dial):
            raise refusal(
                src, _DIAL_ENTRY, "expected a tuple of DialExecutor", "use (DialExecutor(...),)"
            )
        count: object = self.max_executors
        if not isinstance(count, int) or isinstance(count, bool):
            raise refusal(
                src,
                "[executors] max_executors",
                f"expected an integer, got {_type_name(count)}",
                "e.g. max_executors = 10000",
            )
        after: object = self.forget_after
        if not isinstance(after, int | float) or isinstance(after, bool):
            raise refusal(
                src,
                "[executors] forget_after",
                f"expected a number of seconds, got {_type_name(after)}",
                "e.g. forget_after = 3600",
            )
        object.__setattr__(self, "forget_after", float(after))
        _check_shared_types(
            "FleetConfig", src, self.allow_insecure_development, self.tls, self.limits, self.source
        )

    @property
    def listen_url(self) -> str:
        """The URL workers dial, e.g. ``wss://0.0.0.0:8443/executor``; ``ValueError`` when the
        controller does not listen. Port 0 shows as 0 (the bound port is known once listening)."""
        if self.listen is None:
            raise ValueError("this FleetConfig does not listen")
        host, port = self.listen
        return _format_url(host, port, tls=self.tls is not None)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The listener's TLS context (:meth:`TlsConfig.server_context`), or ``None`` when the
        controller does not listen or listens in plain text. Dialers get theirs from
        :meth:`dial_config`.

        Raises:
            ConfigError: a TLS file is missing or does not load.
        """
        if self.listen is None or self.tls is None:
            return None
        try:
            return self.tls.server_context()
        except ConfigError as exc:
            if self.source is None:
                raise
            raise ConfigError(f"{self.source}: {exc}") from exc

    def dial_config(self, entry: DialExecutor) -> LinkConfig:
        """The controller-role :class:`LinkConfig` that dials one ``dial`` entry.

        It shares this config's ``limits``, ``allow_insecure_development`` and ``source``;
        ``tls`` only for a ``wss://`` entry (a ``ws://`` dialer has no use for it).

        Raises:
            ConfigError: ``entry`` is not a :class:`DialExecutor`.
        """
        if not isinstance(entry, DialExecutor):
            raise ConfigError(
                f"FleetConfig.dial_config: expected a DialExecutor, got {_type_name(entry)}"
            )
        secure = _parse_dial(entry.url, self.source).tls
        return LinkConfig(
            executor_id=entry.executor_id,
            role=Role.CONTROLLER,
            secret=entry.secret,
            dial=entry.url,
            allow_insecure_development=self.allow_insecure_development,
            tls=self.tls if secure else None,
            limits=self.limits,
            source=self.source,
            controller_id=self.controller_id,
        )


# --------------------------------------------------------------------------- loading


def _check_keys(table: dict[str, Any], allowed: tuple[str, ...], path: Path, where: str) -> None:
    for key in table:
        if key not in allowed:
            prefix = f"{where} " if where else ""
            raise refusal(
                path,
                f"{prefix}{key}",
                "unknown key",
                f"remove it or fix its spelling; allowed keys{' in ' + where if where else ''}: "
                f"{', '.join(allowed)}",
            )


def _get(table: dict[str, Any], key: str, kind: type, path: Path, what: str) -> Any:
    """Return ``table[key]`` (``None`` if absent) after checking its TOML type."""
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = _type_name(kind())
        fixes = {
            bool: "write true or false (unquoted)",
            str: "quote the value",
            dict: f"make it a table: [{key}]",
        }
        raise refusal(
            path,
            what,
            f"expected {expected}, got {_type_name(value)}",
            fixes.get(kind, "fix the value"),
        )
    return value


def _resolve(base: Path, value: str, path: Path, what: str) -> Path:
    if not value:
        raise refusal(path, what, "the path is empty", "give a file path")
    candidate = Path(value).expanduser()
    return candidate if candidate.is_absolute() else base / candidate


def _load_limits(table: dict[str, Any], path: Path) -> Limits:
    kinds = {f.name: f.type for f in dataclasses.fields(Limits)}
    _check_keys(table, tuple(kinds), path, "[limits]")
    changes: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise refusal(
                path,
                f"[limits] {key}",
                f"expected a number, got {_type_name(value)}",
                "write a number (seconds or bytes, unquoted)",
            )
        if (
            kinds[key] in ("float", float)
            and isinstance(value, int)
            and not isinstance(value, bool)
        ):
            value = float(value)
        changes[key] = value
    try:
        return Limits().replace(**changes)
    except ConfigError as exc:
        raise ConfigError(f"{path}: [limits]: {exc}; fix the value in [limits]") from exc


def _load_tls(doc: dict[str, Any], source: Path) -> TlsConfig | None:
    tls_table = _get(doc, "tls", dict, source, "[tls]")
    if tls_table is None:
        return None
    _check_keys(tls_table, _TLS_KEYS, source, "[tls]")
    files: dict[str, Path | None] = {}
    for key in _TLS_KEYS:
        value = _get(tls_table, key, str, source, f"[tls] {key}")
        files[key] = (
            None if value is None else _resolve(source.parent, value, source, f"[tls] {key}")
        )
    try:
        return TlsConfig(**files)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def load_config(path: str | os.PathLike[str] | None = None) -> LinkConfig:
    """Load and validate a TOML link configuration (schema in the module docstring).

    Args:
        path: the config file; ``None`` reads the path from ``GARCON_LINK_CONFIG``. Relative
            ``secret_file`` and ``[tls]`` paths are resolved against the file's directory.

    Returns:
        A validated :class:`LinkConfig` whose ``source`` is the absolute path of the file.

    Raises:
        ConfigError: any refusal of the module docstring; the message names the file, the field
            and the fix, and never contains the secret.
    """
    source = _config_path(path, "load_config('link.toml')")
    document, mode = _read_toml(source)
    return _build(document, mode, source)


def _config_path(path: str | os.PathLike[str] | None, example: str) -> Path:
    """The absolute config path: ``path``, or ``GARCON_LINK_CONFIG`` when it is ``None``."""
    if path is None:
        from_env = os.environ.get(CONFIG_ENV_VAR, "")
        if not from_env:
            raise ConfigError(
                f"no configuration file given and {CONFIG_ENV_VAR} is not set; pass a path "
                f"({example}) or set {CONFIG_ENV_VAR}=/path/to/link.toml"
            )
        path = from_env
    return Path(os.path.abspath(os.fspath(path)))


def _read_toml(source: Path) -> tuple[dict[str, Any], int]:
    """Return the parsed document and the file's mode (from the same open file: no race)."""
    try:
        with open(source, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            document = tomllib.load(file)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{source}: configuration file not found; check the path (or {CONFIG_ENV_VAR})"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: TOML syntax error: {exc}; fix the syntax there") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source}: the file is not valid UTF-8 (byte {exc.start}); save it as UTF-8"
        ) from exc
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read the configuration file "
            f"({exc.strerror or type(exc).__name__}); check the path and its permissions"
        ) from exc
    return document, mode


def _build(doc: dict[str, Any], mode: int, source: Path) -> LinkConfig:
    if "executors" in doc:
        raise refusal(
            source,
            "[executors]",
            "this is a fleet configuration (one controller, many executors)",
            "load it with load_fleet_config() or run `garcon-link fleet CONFIG`",
        )
    _check_keys(doc, _TOP_LEVEL_KEYS, source, "")
    base = source.parent

    executor_id = _get(doc, "executor_id", str, source, "executor_id")
    if executor_id is None:
        raise refusal(source, "executor_id", "missing", 'add executor_id = "build-box-1"')
    role = _get(doc, "role", str, source, "role")
    if role is None:
        raise refusal(source, "role", "missing", 'add role = "worker" (or "controller")')
    if role not in ("worker", "controller"):
        raise refusal(
            source,
            "role",
            f"must be worker or controller, got {_shown_role(role)}",
            'role = "worker"',
        )
    insecure = _get(doc, "allow_insecure_development", bool, source, "allow_insecure_development")
    controller_id = doc.get("controller_id")
    _check_controller_id(controller_id, role, source)

    inline = _get(doc, "secret", str, source, "secret")
    secret_file = _get(doc, "secret_file", str, source, "secret_file")
    if (inline is None) == (secret_file is None):
        problem = "both are set" if inline is not None else "neither is set"
        raise refusal(
            source,
            "secret / secret_file",
            f"exactly one of secret and secret_file is required, {problem}",
            f'use secret_file = "link.secret" ({KEYGEN_HINT})',
        )
    if inline is not None:
        refuse_open_mode(mode, source, source, "secret")
        refuse_unsafe_directory(source, source, "secret")
        value = decode_secret(inline.encode("utf-8"))
        if len(value) < MIN_SECRET_BYTES:
            raise refusal(
                source,
                "secret",
                f"{len(value)} bytes is too short, at least {MIN_SECRET_BYTES} bytes are required",
                f"use secret_file instead and {KEYGEN_HINT}",
            )
        secret = Secret(value)
    else:
        secret = read_secret(
            _resolve(base, secret_file, source, "secret_file"), source, "secret_file"
        )

    connection = _get(doc, "connection", dict, source, "[connection]")
    if connection is None:
        raise refusal(
            source,
            "[connection]",
            "missing",
            'add a [connection] table with listen = "127.0.0.1:8765" or dial = "wss://..."',
        )
    _check_keys(connection, _CONNECTION_KEYS, source, "[connection]")
    listen_text = _get(connection, "listen", str, source, "[connection] listen")
    dial_value = connection.get("dial")
    also_dial: tuple[str, ...] = ()
    if isinstance(dial_value, list):
        if not dial_value or not all(isinstance(url, str) for url in dial_value):
            raise refusal(
                source,
                "[connection] dial",
                "expected a URL or a non-empty list of URLs",
                'dial = "wss://host/executor" or dial = ["wss://a/executor", "wss://b/executor"]',
            )
        dial: str | None = dial_value[0]
        also_dial = tuple(dial_value[1:])
    else:
        dial = _get(connection, "dial", str, source, "[connection] dial")
    listen = _parse_listen(listen_text, source) if listen_text is not None else None

    tls = _load_tls(doc, source)
    limits_table = _get(doc, "limits", dict, source, "[limits]")
    limits = Limits() if limits_table is None else _load_limits(limits_table, source)
    state_text = _get(doc, "state_dir", str, source, "state_dir")
    state_dir = None if state_text is None else _resolve(base, state_text, source, "state_dir")

    return LinkConfig(
        executor_id=executor_id,
        role=Role(role),
        secret=secret,
        listen=listen,
        dial=dial,
        allow_insecure_development=bool(insecure),
        tls=tls,
        limits=limits,
        source=source,
        state_dir=state_dir,
        controller_id=controller_id,
        also_dial=also_dial,
    )


# --------------------------------------------------------------------------- loading a fleet

_FLEET_TOP_LEVEL_KEYS = (
    "role",
    "controller_id",
    "allow_insecure_development",
    "connection",
    "executors",
    "tls",
    "limits",
)
_FLEET_CONNECTION_KEYS = ("listen",)
_EXECUTORS_KEYS = ("keyring", "max_executors", "forget_after", "dial")
_DIAL_KEYS = ("id", "url", "secret_file")


def load_fleet_config(path: str | os.PathLike[str] | None = None) -> FleetConfig:
    """Load and validate a fleet controller's TOML configuration.

    Schema (``[tls]``, ``[limits]`` and ``allow_insecure_development`` as for
    :func:`load_config`; ``[connection]`` and ``[[executors.dial]]`` are each optional, but one
    of them must be there)::

        role = "controller"             # required; a fleet is always a controller
        [connection]
        listen = "0.0.0.0:8443"         # workers dial in; needs [executors] keyring
        [executors]                     # required: it is what makes a fleet config
        keyring = "keys"                # relative to the config file; keys/<executor_id>.secret
        max_executors = 10000           # optional, 1-1000000
        forget_after = 3600             # optional, seconds offline before an executor is forgotten
        [[executors.dial]]              # optional, repeatable: a listening worker to dial
        id = "box-1"
        url = "ws://127.0.0.1:9001/executor"
        secret_file = "box-1.secret"    # relative to the config file; inline secret refused

    Top-level ``executor_id``, ``secret`` and ``secret_file`` are refused: the controller has no
    executor id of its own and each executor has its own key. The keyring directory is checked
    now (exists, is a directory, safe from other users); its files are read at each handshake.

    Args:
        path: the config file; ``None`` reads the path from ``GARCON_LINK_CONFIG``.

    Raises:
        ConfigError: ``<file>: <field>: <problem>; <fix>``, never containing a secret.
    """
    source = _config_path(path, "load_fleet_config('fleet.toml')")
    document, _ = _read_toml(source)
    return _build_fleet(document, source)


def _build_fleet(doc: dict[str, Any], source: Path) -> FleetConfig:
    executors = _get(doc, "executors", dict, source, "[executors]")
    if executors is None:
        raise refusal(
            source,
            "[executors]",
            "missing: this is not a fleet configuration",
            'add [executors] with keyring = "keys" (or load a single link with load_config())',
        )
    if "callers" in doc:
        raise refusal(
            source,
            "[callers]",
            "this is a gateway configuration (a fleet that admits callers)",
            'set role = "gateway" and load it with load_gateway_config(), or run '
            "`garcon-link gateway CONFIG`",
        )
    for key in ("executor_id", "secret", "secret_file"):
        if key in doc:
            raise refusal(
                source,
                key,
                "a fleet controller has no executor id or secret of its own",
                "remove it; each executor's key is keys/<id>.secret in the keyring (garcon-link "
                "keygen --keyring DIR --executor ID) and each [[executors.dial]] entry names its "
                "own secret_file",
            )
    _check_keys(doc, _FLEET_TOP_LEVEL_KEYS, source, "")
    role = _get(doc, "role", str, source, "role")
    if role is None:
        raise refusal(source, "role", "missing", 'add role = "controller"')
    if role != "controller":
        raise refusal(
            source,
            "role",
            f"a fleet configuration is a controller's, got {_shown_role(role)}",
            'set role = "controller"; a worker has its own config (load_config, garcon-link '
            "worker)",
        )
    insecure = _get(doc, "allow_insecure_development", bool, source, "allow_insecure_development")

    listen = None
    connection = _get(doc, "connection", dict, source, "[connection]")
    if connection is not None:
        if "dial" in connection:
            raise refusal(
                source,
                "[connection] dial",
                "a fleet controller dials workers through [[executors.dial]] entries",
                "move it to an [[executors.dial]] entry with id, url and secret_file",
            )
        _check_keys(connection, _FLEET_CONNECTION_KEYS, source, "[connection]")
        listen_text = _get(connection, "listen", str, source, "[connection] listen")
        listen = _parse_listen(listen_text, source) if listen_text is not None else None

    _check_keys(executors, _EXECUTORS_KEYS, source, "[executors]")
    keyring = None
    keyring_text = _get(executors, "keyring", str, source, "[executors] keyring")
    if keyring_text is not None:
        keyring = _resolve(source.parent, keyring_text, source, "[executors] keyring")
        found = keyring_directory_problem(keyring)
        if found is not None:
            raise refusal(source, "[executors] keyring", *found)
    max_executors = _get(executors, "max_executors", int, source, "[executors] max_executors")
    forget_after = executors.get("forget_after")
    if forget_after is not None and (
        not isinstance(forget_after, int | float) or isinstance(forget_after, bool)
    ):
        raise refusal(
            source,
            "[executors] forget_after",
            f"expected a number, got {_type_name(forget_after)}",
            "write a number of seconds (unquoted), e.g. forget_after = 3600",
        )
    dial_tables = _get(executors, "dial", list, source, _DIAL_ENTRY)
    dial = tuple(
        _load_dial_entry(table, number, source)
        for number, table in enumerate(dial_tables or (), start=1)
    )

    extra: dict[str, Any] = {}
    if max_executors is not None:
        extra["max_executors"] = max_executors
    if forget_after is not None:
        extra["forget_after"] = forget_after
    limits_table = _get(doc, "limits", dict, source, "[limits]")
    return FleetConfig(
        listen=listen,
        keyring=keyring,
        dial=dial,
        tls=_load_tls(doc, source),
        limits=Limits() if limits_table is None else _load_limits(limits_table, source),
        allow_insecure_development=bool(insecure),
        source=source,
        controller_id=_fleet_controller_id(doc, source),
        **extra,
    )


def _fleet_controller_id(doc: dict[str, Any], source: Path) -> str | None:
    value = doc.get("controller_id")
    _check_controller_id(value, Role.CONTROLLER, source)
    return cast("str | None", value)


def _load_dial_entry(table: object, number: int, source: Path) -> DialExecutor:
    prefix = f"{_DIAL_ENTRY} #{number}"
    if not isinstance(table, dict):
        raise refusal(
            source,
            prefix,
            f"expected a table, got {_type_name(table)}",
            "write each entry as [[executors.dial]] with id, url and secret_file",
        )
    if "secret" in table:
        raise refusal(
            source,
            f"{prefix} secret",
            "an inline secret is not accepted in a dial entry",
            f'put it in a file (mode 0600) and name it: secret_file = "box-1.secret" '
            f"({KEYGEN_HINT})",
        )
    _check_keys(table, _DIAL_KEYS, source, prefix)
    values: dict[str, str] = {}
    for key in _DIAL_KEYS:
        value = _get(table, key, str, source, f"{prefix} {key}")
        if value is None:
            raise refusal(
                source, f"{prefix} {key}", "missing", "each entry needs id, url and secret_file"
            )
        values[key] = value
    _check_dial_executor(values["id"], values["url"], source, f"{prefix} ")
    what = f"{prefix} secret_file"
    secret = read_secret(_resolve(source.parent, values["secret_file"], source, what), source, what)
    return DialExecutor(executor_id=values["id"], url=values["url"], secret=secret)
