"""Link configuration: the TOML file of one endpoint, its schema and loader, every refusal rule.

The rules a link's file and a fleet controller's file share live here too: the listen address and
dial URL checks, ``controller_id``, the types of the shared fields, and finding and reading the
file. :mod:`garcon_link.settings.fleet` (:class:`~garcon_link.settings.fleet.FleetConfig`) reads
its file with them, so both shapes are checked by one set of rules with one message shape. The
``[tls]`` table is read by :mod:`garcon_link.settings.tls`, every table's keys and values by
:mod:`garcon_link.settings._toml`. The secret policy (:mod:`garcon_link.settings.secrets`) and
the dial-URL parser (:mod:`garcon_link.net.addresses`) live apart: other modules use them too.

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
:func:`~garcon_link.settings.fleet.load_fleet_config` (:mod:`garcon_link.settings.fleet`).
:func:`load_config` refuses a file with ``[executors]``, and ``load_fleet_config`` one without.

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

import os
import re
import ssl
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.wire import Role
from ..errors import ConfigError
from ..limits import Limits
from ..net.addresses import (
    EXECUTOR_PATH,
    MAX_EXECUTOR_ID_CHARS,
    DialTarget,
    DialUrlRefusal,
    check_dial_url,
    host_problem,
    is_loopback_host,
)
from ._toml import (
    _check_keys,
    _get,
    _load_limits,
    _refuse_gateway_roles,
    _resolve,
    _shown_role,
    _type_name,
)
from .secrets import (
    KEYGEN_HINT,
    MIN_SECRET_BYTES,
    Secret,
    Source,
    decode_secret,
    read_secret,
    refusal,
    refuse_open_mode,
    refuse_unsafe_directory,
)
from .tls import TlsConfig, _load_tls

MAX_CONFIG_BYTES = 16 * 1024 * 1024
"""The largest configuration file the loaders read (a fleet's ``[[executors.dial]]`` list is
the long part of a file)."""

MAX_CONFIG_DEPTH = 32
"""The deepest nesting of tables and arrays a configuration file may hold (the loaders' own
tables are at most four deep); a deeper file is refused in one line, whatever the depth at which
the TOML parser itself would give up."""

__all__ = [
    "CONFIG_ENV_VAR",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "LinkConfig",
    "TlsConfig",
    "load_config",
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


# --------------------------------------------------------------------------- loading


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


def read_document(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed TOML document at ``path``, read as every loader reads its file (a regular
    file of at most :data:`MAX_CONFIG_BYTES`, never blocking), before any schema check: for a
    caller that must choose a loader.

    Raises:
        ConfigError: the file does not read or parse (one line naming it).
    """
    return _read_toml(Path(os.path.abspath(os.fspath(path))))[0]


def _read_toml(source: Path) -> tuple[dict[str, Any], int]:
    """Return the parsed document and the file's mode (from the same open file: no race).

    Only a regular file of at most :data:`MAX_CONFIG_BYTES` is read: it is opened without
    blocking (a FIFO without a writer would hang the loader) and its size is checked before a
    byte is read (``/dev/zero`` would never end)."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            info = os.fstat(fd)
            mode = info.st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(
                    f"{source}: not a regular file; point the configuration at a TOML file"
                )
            if info.st_size > MAX_CONFIG_BYTES:
                raise ConfigError(
                    f"{source}: the configuration file is larger than {MAX_CONFIG_BYTES} bytes; "
                    "point the configuration at a TOML file"
                )
            data = file.read(MAX_CONFIG_BYTES + 1)
            if len(data) > MAX_CONFIG_BYTES:  # grew while read
                raise ConfigError(
                    f"{source}: the configuration file is larger than {MAX_CONFIG_BYTES} bytes; "
                    "point the configuration at a TOML file"
                )
            text = data.decode("utf-8")
            _refuse_long_dotted_names(text, source)
            document = tomllib.loads(text)
    except RecursionError:  # tomllib parses nested arrays and inline tables by recursion
        raise _too_deep(source) from None
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
    if _depth(document) > MAX_CONFIG_DEPTH:
        raise _too_deep(source)
    return document, mode


# Runs of what a dotted name is made of (bare and quoted parts, dots, blanks): tomllib takes
# time quadratic in the parts of one dotted name (20 000 parts: 5 s), so a name of more parts
# than any table here could have is refused before parsing. Maximal runs, found in linear time;
# in a run, only a dot that ends a part counts (a row of dots in a comment is no name), and a
# value's dots are parted by other characters (":/,").
_NAME_RUN = re.compile(r"[A-Za-z0-9_\-.\"' \t]+")
_PART_DOT = re.compile(r"[A-Za-z0-9_\-\"'][ \t]*\.")
_MAX_NAME_DOTS = 2 * MAX_CONFIG_DEPTH


def _refuse_long_dotted_names(text: str, source: Path) -> None:
    if text.count(".") <= _MAX_NAME_DOTS:
        return
    for run in _NAME_RUN.finditer(text):
        name = run.group()
        if name.count(".") > _MAX_NAME_DOTS and len(_PART_DOT.findall(name)) > _MAX_NAME_DOTS:
            line = text.count("\n", 0, run.start()) + 1
            raise ConfigError(
                f"{source}: line {line} holds a dotted name of more than {_MAX_NAME_DOTS + 1} "
                f"parts, far deeper than the {MAX_CONFIG_DEPTH} levels a configuration may nest; "
                "fix the file"
            )


def _too_deep(source: Path) -> ConfigError:
    return ConfigError(
        f"{source}: tables or arrays nested deeper than {MAX_CONFIG_DEPTH} levels; a "
        "configuration file is a few tables deep, fix the file"
    )


def _depth(document: dict[str, Any]) -> int:
    """The nesting depth of tables and arrays in ``document`` (itself 1), walked without
    recursion and stopping past :data:`MAX_CONFIG_DEPTH`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_CONFIG_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _build(doc: dict[str, Any], mode: int, source: Path) -> LinkConfig:
    _refuse_gateway_roles(doc, source)
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
    _check_keys(connection, _CONNECTION_KEYS, source, "[connection]", _TOP_LEVEL_KEYS)
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

    tls = _load_tls(doc, source, _TOP_LEVEL_KEYS)
    limits = _load_limits(doc, source, _TOP_LEVEL_KEYS)
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
