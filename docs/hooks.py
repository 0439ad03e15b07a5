"""mkdocs hook: every how-to guide is in the navigation without a nav edit.

``mkdocs.yml`` names the guides it wants in a given order under its "How-to guides" section; any
other ``docs/guides/*.md`` is appended to that section, sorted by file name, titled by its first
heading. ``tests/test_site.py`` imports :func:`add_guides` (it needs no mkdocs).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

HOWTO = "How-to guides"
GUIDES = "guides"
_HEADING = re.compile(r"^#\s+(.+?)\s*$", re.MULTILINE)


def _named(entries: Any) -> set[str]:
    """Every page path a nav (sub)tree names."""
    found: set[str] = set()
    if isinstance(entries, str):
        found.add(entries)
    elif isinstance(entries, list):
        for entry in entries:
            found |= _named(entry)
    elif isinstance(entries, dict):
        for value in entries.values():
            found |= _named(value)
    return found


def guide_title(path: Path) -> str:
    """A guide's first ``# heading`` (its file name when it has none)."""
    match = _HEADING.search(path.read_text("utf-8"))
    return match.group(1) if match else path.stem.replace("-", " ").capitalize()


def add_guides(nav: list[Any], docs_dir: Path) -> list[str]:
    """Append to the nav's How-to section every ``guides/*.md`` the nav does not name; return
    the pages added. A nav without that section is an error that names it."""
    for entry in nav:
        if isinstance(entry, dict) and HOWTO in entry:
            section = entry[HOWTO]
            break
    else:
        raise ValueError(f"mkdocs.yml: nav has no {HOWTO!r} section for docs/{GUIDES}/*.md")
    named = _named(nav)
    added = []
    for path in sorted((docs_dir / GUIDES).glob("*.md")):
        page = f"{GUIDES}/{path.name}"
        if page not in named:
            section.append({guide_title(path): page})
            added.append(page)
    return added


def on_config(config: Any) -> Any:
    if config.nav is not None:
        add_guides(config.nav, Path(config.docs_dir))
    return config


_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj):(?=<code>)")
_SHORT = re.compile(r"<code>~(?:[\w.]*\.)?(\w+)</code>")


def on_page_content(html: str, **_: Any) -> str:
    """Docstrings cite names with Sphinx roles (``:class:`Limits```), which Markdown renders as
    ``:class:`` before the code span: drop the role, keep the code; a ``~`` path shows its
    last name, as Sphinx does (``:meth:`~a.B.c``` reads ``c``)."""
    return _SHORT.sub(r"<code>\1</code>", _ROLE.sub("", html))
