"""TLS material of a link or a fleet controller: the ``[tls]`` table and the contexts built from it.

:class:`TlsConfig` holds PEM paths (certificate chain, private key, CA bundle) and checks their
shape on construction; the files are read only when a context is built
(:meth:`TlsConfig.server_context`, :meth:`TlsConfig.client_context`), so a missing or unloadable
file is refused then, naming it. Whether an endpoint needs TLS at all (plain text only on
loopback) and which part of it, is checked with its address in :mod:`.config`.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._toml import _check_keys, _get, _resolve, _type_name

__all__ = ["TlsConfig"]

_TLS_KEYS = ("cert", "key", "ca")


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


# --------------------------------------------------------------------------- loading


def _load_tls(
    doc: dict[str, Any], source: Path, top_level: tuple[str, ...] = ()
) -> TlsConfig | None:
    """The document's ``[tls]`` table (``None`` without one); ``top_level``: the document's
    top-level keys, for the hint of one written below ``[tls]``."""
    tls_table = _get(doc, "tls", dict, source, "[tls]")
    if tls_table is None:
        return None
    _check_keys(tls_table, _TLS_KEYS, source, "[tls]", top_level)
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
