"""The documentation site's sources are complete: read as files, without mkdocs installed.

* The API reference (docs/reference/*.md) has a ``::: garcon_link.NAME`` line for every name of
  ``garcon_link.__all__``, and none for a name that is not public.
* Every page the nav of mkdocs.yml names exists, and every page under docs/ is in the nav
  (the how-to guides, docs/guides/*.md, are added by docs/hooks.py when the nav does not name
  them: that hook is tested here on a toy tree).
* The README's links into docs/ name files that exist.

Whether the site builds (mkdocs build --strict: links, anchors, docstrings) is ``make docs``,
which ``make test`` runs beside the tests.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import garcon_link

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
API_PAGE = "docs/reference/api.md"
DIRECTIVE = re.compile(r"^::: garcon_link\.(\w+)\s*$", re.MULTILINE)
NAV_PAGE = re.compile(r"^\s*- (?:[^:\n]+:\s*)?([\w./-]+\.md)\s*$")


def documented_names() -> dict[str, list[str]]:
    """Each name with a ``::: garcon_link.NAME`` line -> the reference pages that have one."""
    found: dict[str, list[str]] = {}
    for page in sorted((DOCS / "reference").glob("*.md")):
        for name in DIRECTIVE.findall(page.read_text("utf-8")):
            found.setdefault(name, []).append(str(page.relative_to(ROOT)))
    return found


def nav_pages(text: str) -> list[str]:
    """The page paths the ``nav:`` of an mkdocs.yml names (relative to docs/)."""
    lines = text.splitlines()
    start = lines.index("nav:")
    pages = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break  # the next top-level key
        match = NAV_PAGE.match(line)
        if match:
            pages.append(match.group(1))
    return pages


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_a_reference_entry() -> None:
    documented = documented_names()
    missing = [name for name in garcon_link.__all__ if name not in documented]
    assert not missing, "\n".join(
        f"{API_PAGE}: add the line `::: garcon_link.{name}` (and a blank line after it) under "
        f"the section it belongs to, so the site documents gl.{name}"
        for name in missing
    )


def test_no_reference_entry_for_a_name_that_is_not_public() -> None:
    extra = {
        name: pages for name, pages in documented_names().items() if name not in garcon_link.__all__
    }
    assert not extra, "\n".join(
        f"{', '.join(pages)}: remove the line `::: garcon_link.{name}` ({name} is not in "
        f"garcon_link.__all__)"
        for name, pages in extra.items()
    )


def test_every_page_the_nav_names_exists() -> None:
    pages = nav_pages(MKDOCS.read_text("utf-8"))
    assert "reference/api.md" in pages
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, "\n".join(
        f"mkdocs.yml names docs/{page} in its nav, which does not exist: write the page or "
        f"remove its nav line"
        for page in missing
    )


def test_every_page_is_in_the_nav() -> None:
    named = set(nav_pages(MKDOCS.read_text("utf-8")))
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    left_out = [p for p in pages if p not in named and not p.startswith("guides/")]
    assert not left_out, "\n".join(
        f"mkdocs.yml: add `- Title: {page}` to the nav section it belongs to "
        f"(only docs/guides/*.md are added by docs/hooks.py)"
        for page in left_out
    )


def test_the_hook_adds_every_guide_the_nav_does_not_name(tmp_path: Path) -> None:
    hooks = load_hooks()
    guides = tmp_path / "guides"
    guides.mkdir()
    (guides / "named.md").write_text("# Named\n", "utf-8")
    (guides / "zeta.md").write_text("Intro.\n\n# Zeta: a new guide\n", "utf-8")
    (guides / "alpha.md").write_text("no heading\n", "utf-8")
    nav: list[Any] = [
        {"Home": "index.md"},
        {"How-to guides": [{"Named": "guides/named.md"}]},
        {"Reference": [{"API": "reference/api.md"}]},
    ]
    added = hooks.add_guides(nav, tmp_path)
    assert added == ["guides/alpha.md", "guides/zeta.md"]
    assert nav[1] == {
        "How-to guides": [
            {"Named": "guides/named.md"},
            {"Alpha": "guides/alpha.md"},
            {"Zeta: a new guide": "guides/zeta.md"},
        ]
    }
    assert hooks.add_guides(nav, tmp_path) == []  # once named, never twice


def test_the_real_nav_gets_every_guide() -> None:
    hooks = load_hooks()
    nav: list[Any] = [{"How-to guides": []}]
    hooks.add_guides(nav, DOCS)
    listed = {page for entry in nav[0]["How-to guides"] for page in entry.values()}
    assert listed == {f"guides/{p.name}" for p in (DOCS / "guides").glob("*.md")}


def test_the_readme_links_into_docs_name_files_that_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#\s]*)", (ROOT / "README.md").read_text("utf-8"))
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
