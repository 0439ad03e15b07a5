"""Gateway and caller configuration: ``[callers]`` of a gateway, and a caller's own file.

A **gateway** (docs/guides/gateway.md) is a fleet (:class:`~garcon_link.FleetConfig`) that also
admits callers on its listener. Its file is a fleet file with ``role = "gateway"`` and a
``[callers]`` table, read by :func:`load_gateway_config`::

    role = "gateway"
    [connection]
    listen = "0.0.0.0:8443"            # executors and callers dial the same /executor
    [executors]
    keyring = "keys"                   # keys/<executor_id>.secret
    [callers]
    keyring = "callers"                # callers/<caller_id>.secret (garcon-link keygen
                                       #   --keyring callers --caller ID)
    max_callers = 64                   # optional, 1-4096: caller sessions held at once
    [[callers.grant]]                  # repeatable; no grant, no access (settings/grants.py)
    callers = ["web-*"]
    executors = ["device-*"]
    services = ["calc"]                # optional; absent = every service

A **caller**'s file, read by :func:`load_caller_config`::

    role = "caller"
    caller_id = "web-1"                # 1-200 of [A-Za-z0-9._-], not starting with "."
    secret_file = "web-1.secret"       # the file the gateway holds as callers/web-1.secret
    [connection]
    dial = "wss://gateway.example/executor"
    # [tls], [limits] and allow_insecure_development as for load_config

Caller keys obey the executor keyring's rules exactly (:mod:`garcon_link.settings.keyring`:
ids checked before any file is touched, bounded file sizes, read at each handshake and every
``key_recheck_interval``: add = enroll, delete = revoke). Refusals read ``<file>: <field>:
<problem>; <fix>`` as every refusal of the settings room.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.wire import Role
from ..errors import ConfigError
from ..limits import Limits
from ..net.addresses import executor_id_problem
from ._toml import (
    _check_keys,
    _get,
    _keyring_path,
    _load_limits,
    _resolve,
    _shown_role,
    _type_name,
)
from .config import LinkConfig, _config_path, _read_toml
from .fleet import FleetConfig, _build_fleet
from .grants import Grant, check_grant_count, check_patterns
from .secrets import KEYGEN_HINT, Secret, Source, keyring_directory_problem, read_secret, refusal
from .tls import TlsConfig, _load_tls

__all__ = [
    "MAX_MAX_CALLERS",
    "CallerConfig",
    "CallersConfig",
    "GatewayConfig",
    "load_caller_config",
    "load_gateway_config",
]

MAX_MAX_CALLERS = 4096
"""The largest ``max_callers``."""
DEFAULT_MAX_CALLERS = 64

_CALLERS_KEYS = ("keyring", "max_callers", "grant")
_GRANT_KEYS = ("callers", "executors", "services")
_CALLER_TOP_LEVEL_KEYS = (
    "role",
    "caller_id",
    "secret_file",
    "allow_insecure_development",
    "connection",
    "tls",
    "limits",
)


def _check_caller_id(value: object, src: Source, what: str = "caller_id") -> str:
    fix = 'use ASCII letters, digits, ".", "_" and "-", not starting with "." (e.g. "web-1")'
    if value is None:
        raise refusal(
            src,
            what,
            "missing: a caller is known to its gateway by its id",
            'add caller_id = "web-1", the name of its key file in the gateway\'s [callers] keyring',
        )
    if not isinstance(value, str):
        raise refusal(src, what, f"expected a string, got {_type_name(value)}", fix)
    problem = executor_id_problem(value)
    if problem is not None:
        raise refusal(src, what, f"the caller id {problem}", fix)
    return value


@dataclass(frozen=True, slots=True)
class CallersConfig:
    """A gateway's ``[callers]`` table (module docstring).

    Attributes:
        keyring: the directory of caller keys (``<keyring>/<caller_id>.secret``).
        grants: the ``[[callers.grant]]`` entries, at most
            :data:`~garcon_link.settings.grants.MAX_GRANTS`.
        max_callers: caller sessions held at once (1 to :data:`MAX_MAX_CALLERS`); the next
            caller is refused with 1013 until one leaves.

    Raises:
        ConfigError: a field breaks a rule; the message names the field and the fix.
    """

    keyring: Path
    grants: tuple[Grant, ...] = ()
    max_callers: int = DEFAULT_MAX_CALLERS
    source: Path | None = None

    def __post_init__(self) -> None:
        src: Source = self.source if self.source is not None else "CallersConfig"
        keyring: object = self.keyring
        path = _keyring_path(keyring, src, "[callers] keyring", 'e.g. keyring = "callers"')
        object.__setattr__(self, "keyring", path)
        grants: object = self.grants
        if isinstance(grants, list):
            grants = tuple(grants)
            object.__setattr__(self, "grants", grants)
        if not isinstance(grants, tuple) or not all(isinstance(g, Grant) for g in grants):
            raise refusal(src, "[[callers.grant]]", "expected a tuple of Grant", "(Grant(...),)")
        check_grant_count(len(grants), src)
        count: object = self.max_callers
        if (
            not isinstance(count, int)
            or isinstance(count, bool)
            or not 1 <= count <= MAX_MAX_CALLERS
        ):
            raise refusal(
                src,
                "[callers] max_callers",
                f"must be an integer 1-{MAX_MAX_CALLERS}, got {count!r}",
                f"e.g. max_callers = {DEFAULT_MAX_CALLERS}",
            )


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """A gateway: a fleet (:class:`~garcon_link.FleetConfig`, which must listen) plus its
    callers (:class:`CallersConfig`); loaded by :func:`load_gateway_config`.

    Raises:
        ConfigError: the fleet does not listen (callers dial the gateway's listener).
    """

    fleet: FleetConfig
    callers: CallersConfig

    def __post_init__(self) -> None:
        if not isinstance(self.fleet, FleetConfig) or not isinstance(self.callers, CallersConfig):
            raise ConfigError("GatewayConfig: expected a FleetConfig and a CallersConfig")
        if self.fleet.listen is None:
            raise refusal(
                self.fleet.source or "GatewayConfig",
                "[connection] listen",
                "a gateway must listen: its callers dial it",
                'set [connection] listen = "0.0.0.0:8443" and [executors] keyring = "keys"',
            )
        executors = self.fleet.keyring
        if executors is not None and _same_directory(executors, self.callers.keyring):
            raise refusal(
                self.callers.source or self.fleet.source or "GatewayConfig",
                "[callers] keyring",
                f"{self.callers.keyring} is the same directory as [executors] keyring: an "
                "executor's key would admit it as a caller, and a caller's as an executor",
                'give callers a directory of their own, e.g. keyring = "callers"',
            )

    @property
    def limits(self) -> Limits:
        return self.fleet.limits


def _same_directory(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is missing: the keyring checks name that
        return os.path.abspath(a) == os.path.abspath(b)


@dataclass(frozen=True, slots=True)
class CallerConfig:
    """A program that calls executors through a gateway (module docstring).

    Attributes:
        caller_id: its id, the name of its key file in the gateway's caller keyring.
        secret: its key.
        dial: the gateway's ``ws(s)://host[:port]/executor`` URL.

    Raises:
        ConfigError: a field breaks a rule; the message names the field and the fix.
    """

    caller_id: str
    secret: Secret
    dial: str
    tls: TlsConfig | None = None
    limits: Limits = field(default_factory=Limits)
    allow_insecure_development: bool = False
    source: Path | None = None

    def __post_init__(self) -> None:
        src: Source = self.source if self.source is not None else "CallerConfig"
        _check_caller_id(self.caller_id, src)
        if not isinstance(self.secret, Secret):
            raise refusal(
                src,
                "secret",
                f"expected a Secret, got {_type_name(self.secret)}",
                "wrap the bytes: Secret(value)",
            )
        self.link_config()  # the dial URL, TLS and plain-text rules, worded by LinkConfig

    @property
    def role(self) -> str:
        return "caller"

    def link_config(self) -> LinkConfig:
        """The controller-role link that dials the gateway: the caller claims its
        ``caller_id`` as the executor id of its handshake, and proves it with its key."""
        return LinkConfig(
            executor_id=self.caller_id,
            role=Role.CONTROLLER,
            secret=self.secret,
            dial=self.dial,
            allow_insecure_development=self.allow_insecure_development,
            tls=self.tls,
            limits=self.limits,
            source=self.source,
        )


def load_gateway_config(path: str | os.PathLike[str] | None = None) -> GatewayConfig:
    """Load and validate a gateway's TOML configuration (schema in the module docstring).

    Raises:
        ConfigError: ``<file>: <field>: <problem>; <fix>``, never containing a secret.
    """
    source = _config_path(path, "load_gateway_config('gateway.toml')")
    document, _ = _read_toml(source)
    role = _get(document, "role", str, source, "role")
    if role != "gateway":
        raise refusal(
            source,
            "role",
            f"a gateway configuration has role gateway, got {_shown_role(role)}",
            'set role = "gateway" (a fleet without callers is role = "controller")',
        )
    callers_table = _get(document, "callers", dict, source, "[callers]")
    if callers_table is None:
        raise refusal(
            source,
            "[callers]",
            "missing: a gateway admits callers",
            'add [callers] with keyring = "callers" and [[callers.grant]] entries',
        )
    fleet_doc = {k: v for k, v in document.items() if k != "callers"}
    fleet_doc["role"] = "controller"
    fleet = _build_fleet(fleet_doc, source)
    return GatewayConfig(fleet=fleet, callers=_load_callers(callers_table, source))


def _load_callers(table: dict[str, Any], source: Path) -> CallersConfig:
    _check_keys(table, _CALLERS_KEYS, source, "[callers]")
    keyring_text = _get(table, "keyring", str, source, "[callers] keyring")
    if keyring_text is None:
        raise refusal(
            source,
            "[callers] keyring",
            "missing",
            'add keyring = "callers" (enroll: garcon-link keygen --keyring callers --caller ID)',
        )
    keyring = _resolve(source.parent, keyring_text, source, "[callers] keyring")
    found = keyring_directory_problem(keyring, "caller")
    if found is not None:
        raise refusal(source, "[callers] keyring", *found)
    max_callers = _get(table, "max_callers", int, source, "[callers] max_callers")
    if isinstance(table.get("grant"), dict):
        raise refusal(
            source,
            "[[callers.grant]]",
            "written as one table, [callers.grant]",
            "write each grant as [[callers.grant]] (double brackets: a list of grants)",
        )
    tables = _get(table, "grant", list, source, "[[callers.grant]]") or []
    check_grant_count(len(tables), source)
    grants = []
    for number, entry in enumerate(tables, start=1):
        prefix = f"[[callers.grant]] #{number}"
        if not isinstance(entry, dict):
            raise refusal(
                source,
                prefix,
                f"expected a table, got {_type_name(entry)}",
                "write each entry as [[callers.grant]] with callers and executors",
            )
        _check_keys(entry, _GRANT_KEYS, source, prefix)
        for key in ("callers", "executors"):
            if key not in entry:
                raise refusal(
                    source,
                    f"{prefix} {key}",
                    "missing",
                    'each grant needs callers and executors, e.g. callers = ["web-*"]',
                )
        grants.append(
            Grant(
                callers=entry["callers"],
                executors=entry["executors"],
                services=_grant_services(entry, source, prefix),
                source=source,
                number=number,
            )
        )
    return CallersConfig(
        keyring=keyring,
        grants=tuple(grants),
        max_callers=DEFAULT_MAX_CALLERS if max_callers is None else max_callers,
        source=source,
    )


def _grant_services(entry: dict[str, Any], source: Path, prefix: str) -> tuple[str, ...]:
    """A grant's ``services``: absent means every service; present, it must name at least one
    pattern (an empty list or a false value is refused, never read as "every service")."""
    if "services" not in entry:
        return ()
    value = entry["services"]
    if isinstance(value, list) and not value:
        raise refusal(
            source,
            f"{prefix} services",
            "the list is empty",
            'name at least one service pattern, e.g. services = ["calc"] (remove the field to '
            "grant every service)",
        )
    patterns = check_patterns(value, source, f"{prefix} services", required=True)
    for pattern in patterns:
        if pattern.startswith("$"):
            raise refusal(
                source,
                f"{prefix} services",
                f"{pattern!r} names an internal service ($...), which no grant covers: the "
                "gateway answers those itself",
                'remove it; name the services callers may call, e.g. services = ["calc"]',
            )
    return patterns


def load_caller_config(path: str | os.PathLike[str] | None = None) -> CallerConfig:
    """Load and validate a caller's TOML configuration (schema in the module docstring).

    Raises:
        ConfigError: ``<file>: <field>: <problem>; <fix>``, never containing a secret.
    """
    source = _config_path(path, "load_caller_config('caller.toml')")
    document, _ = _read_toml(source)
    return _build_caller(document, source)


def is_caller_document(path: str | os.PathLike[str]) -> bool:
    """Whether the TOML file at ``path`` says ``role = "caller"`` (False if it does not
    read: the loader that is used next reports why)."""
    try:
        document, _ = _read_toml(Path(os.path.abspath(os.fspath(path))))
    except ConfigError:
        return False
    return document.get("role") == "caller"


def _build_caller(doc: dict[str, Any], source: Path) -> CallerConfig:
    role = _get(doc, "role", str, source, "role")
    if role != "caller":
        raise refusal(
            source,
            "role",
            f"a caller configuration has role caller, got {_shown_role(role)}",
            'set role = "caller"',
        )
    if "secret" in doc:
        raise refusal(
            source,
            "secret",
            "an inline secret is not accepted in a caller's file",
            f'put it in a file (mode 0600) and name it: secret_file = "web-1.secret" '
            f"({KEYGEN_HINT})",
        )
    _check_keys(doc, _CALLER_TOP_LEVEL_KEYS, source, "")
    caller_id = _check_caller_id(doc.get("caller_id"), source)
    secret_file = _get(doc, "secret_file", str, source, "secret_file")
    if secret_file is None:
        raise refusal(
            source,
            "secret_file",
            "missing",
            'add secret_file = "web-1.secret": the file the gateway holds as '
            "callers/<caller_id>.secret",
        )
    secret = read_secret(
        _resolve(source.parent, secret_file, source, "secret_file"), source, "secret_file"
    )
    connection = _get(doc, "connection", dict, source, "[connection]")
    if connection is None:
        raise refusal(
            source, "[connection]", "missing", 'add [connection] dial = "wss://gateway/executor"'
        )
    _check_keys(connection, ("dial",), source, "[connection]", _CALLER_TOP_LEVEL_KEYS)
    dial = _get(connection, "dial", str, source, "[connection] dial")
    if dial is None:
        raise refusal(
            source,
            "[connection] dial",
            "missing: a caller dials its gateway",
            'add dial = "wss://gateway.example/executor"',
        )
    insecure = _get(doc, "allow_insecure_development", bool, source, "allow_insecure_development")
    return CallerConfig(
        caller_id=caller_id,
        secret=secret,
        dial=dial,
        tls=_load_tls(doc, source, _CALLER_TOP_LEVEL_KEYS),
        limits=_load_limits(doc, source, _CALLER_TOP_LEVEL_KEYS),
        allow_insecure_development=bool(insecure),
        source=source,
    )
