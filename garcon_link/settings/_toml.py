"""Reading a settings file's TOML tables: keys checked, values typed, paths resolved, limits read.

Every file shape of the settings room -- a link (:mod:`.config`), a fleet controller
(:mod:`.fleet`), the ``[tls]`` table (:mod:`.tls`), a gateway's callers and a caller
(:mod:`.callers`) -- reads its tables with these helpers, so an unknown key, a value of the wrong
type, an empty path or a bad ``[limits]`` value is refused with the same message shape
everywhere (``<file>: <field>: <problem>; <fix>``, :func:`~garcon_link.settings.secrets.refusal`).
Only the type of a bad value is shown, never the value: it may be a secret.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..limits import Limits
from .secrets import MIN_SECRET_BYTES, Source, refusal

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


def _refuse_gateway_roles(doc: dict[str, Any], source: Path) -> None:
    """Refuse a gateway's or a caller's file given to the worker/controller/fleet loaders, in
    one line that names the command and loader that read it (rather than its first key those
    loaders do not know)."""
    role = doc.get("role")
    if role == "caller":
        raise refusal(
            source,
            "role",
            'role = "caller" is a gateway caller\'s configuration',
            "call through the gateway with `garcon-link call CONFIG --executor ID` (in code: "
            "gl.connect_gateway(gl.load_caller_config(...)))",
        )
    if role == "gateway":
        raise refusal(
            source,
            "role",
            'role = "gateway" is a gateway\'s own configuration',
            "run it with `garcon-link gateway CONFIG` (in code: gl.load_gateway_config); to call "
            'through it, write a caller\'s configuration (role = "caller", caller_id, '
            "secret_file, dial)",
        )


# --------------------------------------------------------------------------- tables


_SUGGESTED_KEY_CHARS = 100
"""The longest unknown key a close allowed one is looked for (a longer one is no typo)."""


_TABLES = frozenset({"connection", "tls", "limits", "executors", "callers"})
"""Names of tables, never suggested as top-level keys to move."""


def _suggestion(
    key: str, allowed: tuple[str, ...], where: str, top_level: tuple[str, ...] = ()
) -> str:
    """``did you mean 'x'?`` for a misspelt key: the closest allowed one; for a key of
    ``top_level`` written in a table (TOML puts every key below ``[connection]`` in that table),
    to move it up; or the ``[limits]`` field closest to a key written in another table; else
    empty."""
    if len(key) > _SUGGESTED_KEY_CHARS:
        return ""
    import difflib  # only for a file with a misspelt key: not on every start (0.4 ms)

    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    if close:
        return f"did you mean {close[0]!r}?"
    if where and key in top_level and key not in _TABLES:
        return (
            f"{key!r} is a top-level key: move it above the first [table] line (every key "
            f"below {where} belongs to that table)"
        )
    if where == "[limits]":
        return ""
    fields = tuple(field.name for field in dataclasses.fields(Limits))
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.75)
    if close:
        return f"{close[0]!r} is a [limits] field: move it under [limits]"
    return ""


def _check_keys(
    table: dict[str, Any],
    allowed: tuple[str, ...],
    path: Path,
    where: str,
    top_level: tuple[str, ...] = (),
) -> None:
    """Refuse the first key of ``table`` not in ``allowed``, with a hint: ``top_level`` are the
    document's top-level keys, for a key written in table ``where`` that belongs above it."""
    for key in table:
        if key not in allowed:
            prefix = f"{where} " if where else ""
            fix = _suggestion(key, allowed, where, top_level) or "remove it or fix its spelling"
            raise refusal(
                path,
                f"{prefix}{key}",
                "unknown key",
                f"{fix}; allowed keys{' in ' + where if where else ''}: {', '.join(allowed)}",
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


def _load_limits(doc: dict[str, Any], path: Path, top_level: tuple[str, ...] = ()) -> Limits:
    """The document's ``[limits]`` table as :class:`Limits` (the defaults when it has none);
    ``top_level``: the document's top-level keys (:func:`_check_keys`)."""
    table = _get(doc, "limits", dict, path, "[limits]")
    if table is None:
        return Limits()
    kinds = {f.name: f.type for f in dataclasses.fields(Limits)}
    _check_keys(table, tuple(kinds), path, "[limits]", top_level)
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
