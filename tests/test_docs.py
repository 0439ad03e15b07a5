"""docs/design.md is the design the code refers to, and what it states about the wire is true.

* Nothing in the repository cites a design document outside it by section number, nor an issue
  tracker by issue number: a reader has only the repository. References go to a heading of
  docs/design.md instead (``docs/design.md#session``).
* Every such link names a heading that exists (as GitHub derives anchors from headings), and so
  does every ``#anchor`` link inside docs/design.md.
* Its close-code table lists exactly ``wire.CloseCode``; its envelope table lists exactly the
  kinds of ``garcon_link.envelopes``; every ``Limits.<field>`` it names is a field.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from garcon_link.core.wire import CloseCode
from garcon_link.limits import Limits
from garcon_link.rpc import envelopes

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"

# What is scanned for references: the package, the tests, the benchmarks, the examples and the
# top-level documents. Generated benchmark results (JSON) are data, not prose.
SCANNED_DIRS = ("garcon_link", "tests", "benchmarks", "examples", "docs")
SCANNED_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini"}
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml")

OUTSIDE_DESIGN = re.compile(r"DESIGN\s*\u00a7")
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)
DESIGN_LINK = re.compile(r"docs/design\.md#([A-Za-z0-9_-]*)")
LOCAL_LINK = re.compile(r"\]\(#([A-Za-z0-9_-]*)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def scanned_files(root: Path = ROOT) -> list[Path]:
    files = [root / name for name in SCANNED_FILES if (root / name).is_file()]
    for folder in SCANNED_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in SCANNED_SUFFIXES and "__pycache__" not in path.parts:
                files.append(path)
    return files


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of ``markdown`` (headings inside fenced code blocks are not headings;
    a repeated heading gets ``-1``, ``-2``, ... as on GitHub)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match is None:
            continue
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def hits(pattern: re.Pattern[str], root: Path = ROOT) -> list[str]:
    found = []
    for path in scanned_files(root):
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The body rows of the first table under ``heading`` (cells stripped, backticks removed)."""
    lines = markdown.splitlines()
    start = lines.index(heading)
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table under {heading!r}"
    return rows[2:]  # after the header and its separator


def test_design_document_exists_with_its_sections() -> None:
    found = anchors(DESIGN.read_text("utf-8"))
    for anchor in ("layers", "wire", "handshake", "outcomes", "session", "transport", "link"):
        assert anchor in found


def test_anchor_derivation() -> None:
    assert github_anchor("Worker-scoped services") == "worker-scoped-services"
    assert github_anchor("`part` envelopes: the rules") == "part-envelopes-the-rules"
    assert anchors("# A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_no_reference_to_a_design_document_outside_the_repository() -> None:
    assert hits(OUTSIDE_DESIGN) == []


def test_no_issue_numbers() -> None:
    assert hits(ISSUE_NUMBER) == []


def test_every_link_to_the_design_names_one_of_its_headings() -> None:
    found = anchors(DESIGN.read_text("utf-8"))
    links = hits(DESIGN_LINK)
    assert links, "nothing links to docs/design.md"
    broken = []
    for path in scanned_files():
        for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            for anchor in DESIGN_LINK.findall(line):
                if anchor not in found:
                    broken.append(f"{path.relative_to(ROOT)}:{number}: #{anchor}")
    assert broken == [], f"headings of docs/design.md: {sorted(found)}"


def test_links_inside_the_design_name_its_headings() -> None:
    text = DESIGN.read_text("utf-8")
    assert set(LOCAL_LINK.findall(text)) <= anchors(text)


def test_the_close_code_table_is_the_code() -> None:
    rows = table_rows(DESIGN.read_text("utf-8"), "### Close codes")
    assert {int(code): name for code, name, _meaning in rows} == {
        int(member): member.name for member in CloseCode
    }
    assert [int(code) for code, _name, _meaning in rows] == sorted(int(m) for m in CloseCode)


ENVELOPE_NAMES = {
    "call": envelopes.CALL,
    "result": envelopes.RESULT,
    "error": envelopes.ERROR,
    "cancel": envelopes.CANCEL,
    "notify": envelopes.NOTIFY,
    "stream_item": envelopes.ITEM,
    "stream_end": envelopes.END,
    "credit": envelopes.CREDIT,
    "part": envelopes.PART,
}


def test_the_envelope_table_is_the_code() -> None:
    rows = table_rows(DESIGN.read_text("utf-8"), "### RPC envelopes")
    assert {name: int(kind) for kind, name, *_ in rows} == ENVELOPE_NAMES
    for kind, name, shape in rows:
        assert shape.startswith(f"[{kind}, "), (name, shape)
    assert len(ENVELOPE_NAMES) == len(set(ENVELOPE_NAMES.values()))


@pytest.mark.parametrize(
    ("envelope", "kind"),
    [
        (envelopes.Call(1, "s", "m", [], {}, 1, 1), envelopes.CALL),
        (envelopes.Result(1, None), envelopes.RESULT),
        (envelopes.Cancel(1), envelopes.CANCEL),
    ],
)
def test_envelope_kinds_are_what_the_encoder_writes(envelope: object, kind: int) -> None:
    assert envelope.wire()[0] == kind  # type: ignore[attr-defined]


def test_every_limits_field_the_design_names_exists() -> None:
    named = set(re.findall(r"Limits\.([a-z_]+)(?![a-z_(])", DESIGN.read_text("utf-8")))
    assert named
    assert named <= {f.name for f in dataclasses.fields(Limits)}
