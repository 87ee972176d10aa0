"""The Layout page (docs/layout.md) matches the tree: every product module is named there, and
every path named there exists.

The Layout block is a tree: an entry line (indent under 8) names a file or folder relative to
the entry above it with a smaller indent; deeper-indented lines continue the entry's text. A
module ``rlframe/a/b.py`` counts as named when it has its own entry or its folder's entry text
mentions ``b.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlframe", "workers")
ENTRY_INDENT = 8
"""Lines indented less than this start an entry; deeper ones continue the previous entry."""
FILE_NAME = re.compile(r"(?<![\w.])([\w*-]+\.(?:py|yaml)|Dockerfile\.\w+)\b")
FOLDER_NAME = re.compile(r"(?<![\w/.])(\w+)/(?=[\s,;)]|$)")


@dataclass
class Entry:
    """One file or folder of the Layout tree and the text written next to it."""

    path: str
    indent: int
    text: str


LAYOUT_PAGE = ROOT / "docs" / "layout.md"


def read_layout_block() -> str:
    """The first fenced block of the Layout page."""
    return LAYOUT_PAGE.read_text().split("```", 2)[1]


def parse_entries(block: str) -> list[Entry]:
    """The block's entries, each with its path from the repository root."""
    entries: list[Entry] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent >= ENTRY_INDENT:
            entries[-1].text += " " + line.strip()
            continue
        name, _, text = line.strip().partition(" ")
        parents = [e for e in entries if e.indent < indent and e.path.endswith("/")]
        parent = parents[-1].path if parents and indent > 0 else ""
        entries.append(Entry(parent + name, indent, text.strip()))
    return entries


def list_modules() -> list[str]:
    """Every product module's path, package markers left out."""
    return sorted(
        str(p.relative_to(ROOT))
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py"
    )


def find_unnamed_modules(entries: list[Entry], modules: list[str]) -> list[str]:
    """Modules with neither an entry of their own nor a mention in their folder's entry."""
    paths = {e.path for e in entries}
    mentioned = {
        e.path + name for e in entries if e.path.endswith("/") for name in FILE_NAME.findall(e.text)
    }
    return [m for m in modules if m not in paths and m not in mentioned]


def find_missing_paths(entries: list[Entry]) -> list[str]:
    """Entries, and files or folders named in a folder's text, that the tree does not hold."""
    named = [e.path for e in entries]
    for e in entries:
        if e.path.endswith("/"):
            named += [e.path + n for n in FILE_NAME.findall(e.text)]
            named += [e.path + n + "/" for n in FOLDER_NAME.findall(e.text)]
    return [p for p in named if not any(ROOT.glob(p.rstrip("/")))]


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return parse_entries(read_layout_block())


def test_every_module_is_named_in_layout(entries: list[Entry]) -> None:
    assert find_unnamed_modules(entries, list_modules()) == []


def test_every_layout_path_exists(entries: list[Entry]) -> None:
    assert find_missing_paths(entries) == []


def test_layout_parser_reads_nesting() -> None:
    block = "top/       a\n  sub/     b.py, c.py\n  d.py     text\n                 more: e.py\n"
    parsed = parse_entries(block)
    assert [e.path for e in parsed] == ["top/", "top/sub/", "top/d.py"]
    assert find_unnamed_modules(parsed, ["top/sub/b.py", "top/d.py", "top/x.py"]) == ["top/x.py"]
