"""Where a link goes: the one dial-URL parser, host and loopback rules, the executor-id rule.

A dial URL is ``ws[s]://host[:port]/executor[?executor=<id>]``. :func:`check_dial_url` is the one
parser: it returns the :class:`DialTarget` (what the socket layer dials) or a
:class:`DialUrlRefusal` (a problem and its fix, never echoing the URL, whose userinfo may hold a
password). Each caller words the refusal its way: :func:`parse_dial_url` (the link, given a URL
in code) and the configuration files (:mod:`garcon_link.settings.config`, which adds the file and
the field). Refused: whitespace or control characters, a scheme other than ``ws``/``wss``,
userinfo, a query other than one ``executor=<id>`` routing hint whose id passes
:func:`executor_id_problem`, a fragment, a path other than ``/executor``, a missing or invalid
host (:func:`host_problem`), a port outside 1-65535 (default 80 for ws, 443 for wss).

:func:`is_loopback_host` decides what plain text may reach: nothing is resolved.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from dataclasses import dataclass

from ..errors import ConfigError

__all__ = [
    "DEFAULT_PORTS",
    "EXECUTOR_PATH",
    "MAX_EXECUTOR_ID_CHARS",
    "ROUTING_PARAMETER",
    "DialTarget",
    "DialUrlRefusal",
    "check_dial_url",
    "executor_id_problem",
    "host_problem",
    "is_loopback_host",
    "parse_dial_url",
]

EXECUTOR_PATH = "/executor"
ROUTING_PARAMETER = "executor"
"""The one query parameter a dial URL may carry: the executor id, a hint for load balancers."""
DEFAULT_PORTS = {"ws": 80, "wss": 443}

MAX_EXECUTOR_ID_CHARS = 200
"""An executor id holds at most this many characters (config files and keyring file names)."""

# A keyring file name: ASCII letters, digits, '.', '_', '-' (checked after the leading-dot rule).
_KEYRING_ID = re.compile(r"[A-Za-z0-9._-]+")
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
_DIAL_FIX = 'use "wss://host:port/executor" (or ws:// on loopback)'
_HINT_FIX = "the only query a dial URL may carry is ?executor=<executor id>; remove anything else"


# --------------------------------------------------------------------------- executor ids


def executor_id_problem(value: object) -> str | None:
    """The one rule for an executor id used as a file name (``<keyring>/<executor_id>.secret``).

    Accepted: a ``str`` of 1 to :data:`MAX_EXECUTOR_ID_CHARS` characters drawn from ASCII
    letters, digits, ``.``, ``_`` and ``-`` that does not start with ``.`` -- so never ``/``, NUL,
    ``..``, a hidden file or a name that differs by Unicode normalization. The value may come from
    a peer before it is authenticated: this never raises, whatever it is given (bytes, a huge
    string, lone surrogates), and the problem text never echoes the value.

    This is stricter than a config file's own ``executor_id`` (printable, no whitespace): a worker
    whose id holds e.g. ``:`` or non-ASCII letters still loads its config, but cannot be enrolled
    in a keyring. A dial URL's routing hint obeys it too.

    Returns:
        A short problem text ("is empty", ...), or ``None`` when ``value`` is acceptable.
    """
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "is empty"
    if len(value) > MAX_EXECUTOR_ID_CHARS:
        return f"is longer than {MAX_EXECUTOR_ID_CHARS} characters"
    if value.startswith("."):
        return "starts with '.'"
    if _KEYRING_ID.fullmatch(value) is None:
        return "may only hold ASCII letters, digits, '.', '_' and '-'"
    return None


# --------------------------------------------------------------------------- hosts


def host_problem(host: str) -> str | None:
    """Return why ``host`` is not an IP address or a DNS name, or ``None`` if it is one."""
    if not host:
        return "the host is empty"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None
    name = host.removesuffix(".")
    labels = name.split(".")
    if len(name) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        return f"{host!r} is neither an IP address nor a valid host name"
    if labels[-1].isdigit():
        return f"{host!r} is not a valid IP address"
    return None


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ``::1``; brackets allowed).

    Nothing is resolved: other names are not loopback. An IPv4-mapped literal
    (``::ffff:127.0.0.1``) is not loopback on any Python version -- 3.13 started to call it
    loopback, earlier versions do not, and what plain text is allowed to reach must not depend on
    the interpreter; spell it ``127.0.0.1``.
    """
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return False
    return address.is_loopback


# --------------------------------------------------------------------------- dial URLs


@dataclass(frozen=True, slots=True)
class DialTarget:
    """A parsed dial URL: ``ws[s]://host[:port]/executor[?executor=<id>]``."""

    scheme: str
    host: str
    port: int
    executor_hint: str | None = None

    @property
    def tls(self) -> bool:
        return self.scheme == "wss"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.target}"

    @property
    def target(self) -> str:
        """The request target of the upgrade (path and routing hint)."""
        if self.executor_hint is None:
            return EXECUTOR_PATH
        return EXECUTOR_PATH + "?" + urllib.parse.urlencode({ROUTING_PARAMETER: self.executor_hint})


@dataclass(frozen=True, slots=True)
class DialUrlRefusal:
    """Why a dial URL is refused: ``problem`` and ``fix``, neither echoing the whole URL."""

    problem: str
    fix: str


def check_dial_url(url: str) -> DialTarget | DialUrlRefusal:
    """Parse a dial URL once: the :class:`DialTarget`, or the first rule it breaks (module
    docstring; the rules are checked in the order listed there)."""
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        return DialUrlRefusal("the URL contains whitespace or control characters", _DIAL_FIX)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        return DialUrlRefusal(f"not a valid URL ({exc})", _DIAL_FIX)
    if parts.scheme not in DEFAULT_PORTS:
        scheme = f"{parts.scheme!r}" if parts.scheme else "no scheme"
        return DialUrlRefusal(f"the scheme is {scheme}, not ws or wss", _DIAL_FIX)
    if "@" in parts.netloc:
        return DialUrlRefusal(
            "the URL carries userinfo (user:password@)",
            "remove it: peers authenticate with the link secret, never with URL credentials",
        )
    hint = None
    if "?" in url:
        found = _routing_hint(parts.query)  # the one query allowed: a routing hint
        if isinstance(found, DialUrlRefusal):
            return found
        hint = found
    if "#" in url:
        return DialUrlRefusal("the URL has a fragment (#...)", "remove the fragment")
    if parts.path != EXECUTOR_PATH:
        return DialUrlRefusal(
            f"the path is {parts.path or '(empty)'!r}, not {EXECUTOR_PATH!r}",
            f"end the URL with {EXECUTOR_PATH}",
        )
    host = parts.hostname or ""
    problem = host_problem(host)
    if problem is not None:
        return DialUrlRefusal(problem, _DIAL_FIX)
    try:
        port = parts.port
    except ValueError:
        return DialUrlRefusal("the port is not a number 1-65535", _DIAL_FIX)
    if port is None:
        port = DEFAULT_PORTS[parts.scheme]
    if not 1 <= port <= 65535:
        return DialUrlRefusal("the port is not a number 1-65535", _DIAL_FIX)
    return DialTarget(parts.scheme, host, port, hint)


def _routing_hint(query: str) -> str | DialUrlRefusal:
    """The executor id of a dial URL's query ``executor=<id>`` (a routing hint for a load
    balancer in front of several controller processes); nothing else is allowed."""
    try:
        fields = urllib.parse.parse_qs(query, strict_parsing=True, max_num_fields=2)
    except ValueError:
        return DialUrlRefusal("the URL's query is not executor=<id>", _HINT_FIX)
    values = fields.get(ROUTING_PARAMETER)
    if set(fields) != {ROUTING_PARAMETER} or values is None or len(values) != 1:
        return DialUrlRefusal("the URL's query is not executor=<id>", _HINT_FIX)
    problem = executor_id_problem(values[0])
    if problem is not None:
        return DialUrlRefusal(f"the routing hint executor={values[0]!r}: {problem}", _HINT_FIX)
    return values[0]


def parse_dial_url(url: str) -> DialTarget:
    """Parse a dial URL given in code (:func:`check_dial_url`).

    Raises:
        ConfigError: ``dial URL: <problem>; <fix>`` for any rule it breaks (module docstring).
    """
    found = check_dial_url(url)
    if isinstance(found, DialUrlRefusal):
        raise ConfigError(f"dial URL: {found.problem}; {found.fix}")
    return found
