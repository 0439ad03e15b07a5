"""A fleet controller's configuration: :class:`FleetConfig`, its dial entries and its loader.

A controller of many executors (docs/design.md#fleets) has its own file shape, read by
:func:`load_fleet_config` into a :class:`FleetConfig` (schema in that function's docstring): an
``[executors]`` table with a ``keyring`` directory of per-executor keys
(``keys/<executor_id>.secret``, see :mod:`garcon_link.settings.keyring`) and optional
``[[executors.dial]]`` entries, and no top-level ``executor_id`` or secret.
:func:`~garcon_link.settings.config.load_config` refuses a file with ``[executors]``, and
:func:`load_fleet_config` one without. An executor id used as a file name obeys
:func:`~garcon_link.net.addresses.executor_id_problem`, which is stricter than ``executor_id`` in
a link's file: a worker keeps loading its config whatever printable id it has, but only a
file-name-safe id can be enrolled in a keyring.

The listen address, the dial URLs, ``[tls]``, ``[limits]``, ``controller_id`` and
``allow_insecure_development`` obey the rules of :mod:`garcon_link.settings.config`, checked by
the same helpers with the same message shape: a fleet controller dials each entry with a
:class:`~garcon_link.settings.config.LinkConfig` (:meth:`FleetConfig.dial_config`).
"""

from __future__ import annotations

import math
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..core.wire import Role
from ..errors import ConfigError
from ..limits import Limits
from ..net.addresses import executor_id_problem
from ._toml import (
    _check_keys,
    _get,
    _keyring_path,
    _load_limits,
    _refuse_gateway_roles,
    _resolve,
    _shown_role,
    _type_name,
)
from .config import (
    LinkConfig,
    _check_controller_id,
    _check_dial,
    _check_listen,
    _check_shared_types,
    _config_path,
    _format_url,
    _parse_dial,
    _parse_listen,
    _read_toml,
)
from .secrets import KEYGEN_HINT, Secret, Source, keyring_directory_problem, read_secret, refusal
from .tls import TlsConfig, _load_tls

__all__ = ["DialExecutor", "FleetConfig", "load_fleet_config"]

_DIAL_ENTRY = "[[executors.dial]]"
_MAX_MAX_EXECUTORS = 1_000_000
_MAX_FORGET_AFTER = 30 * 86400  # 30 days: an executor offline longer is gone, not starting


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
        forget_after: seconds an executor stays offline before it leaves the registry (> 0, at
            most 30 days).

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
        if not (math.isfinite(self.forget_after) and 0 < self.forget_after <= _MAX_FORGET_AFTER):
            raise refusal(
                src,
                "[executors] forget_after",
                f"must be a positive number of seconds, at most {_MAX_FORGET_AFTER} (30 days), "
                f"got {self.forget_after}",
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
    _refuse_gateway_roles(doc, source)
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
        _check_keys(
            connection, _FLEET_CONNECTION_KEYS, source, "[connection]", _FLEET_TOP_LEVEL_KEYS
        )
        listen_text = _get(connection, "listen", str, source, "[connection] listen")
        listen = _parse_listen(listen_text, source) if listen_text is not None else None

    _check_keys(executors, _EXECUTORS_KEYS, source, "[executors]", _FLEET_TOP_LEVEL_KEYS)
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
    return FleetConfig(
        listen=listen,
        keyring=keyring,
        dial=dial,
        tls=_load_tls(doc, source, _FLEET_TOP_LEVEL_KEYS),
        limits=_load_limits(doc, source, _FLEET_TOP_LEVEL_KEYS),
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
