"""README stays the front page and docs/ stays one site.

README.md: at most 300 lines, the ``<!-- ci:install -->`` and ``<!-- ci:test -->`` blocks that
``.ci/run`` executes, a test block that builds the site in strict mode, and links into docs/
that name existing pages and headings. docs/: every page is in mkdocs.yml's ``nav`` and every
``nav`` entry is a page. (``mkdocs build --strict`` checks the links between the pages.)
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"
README_MAX_LINES = 300
CI_MARKERS = ("<!-- ci:install -->", "<!-- ci:test -->")


def read_block_after(text: str, marker: str) -> str:
    """The first fenced block after the line holding ``marker``, as ``.ci/run`` reads it."""
    found, inside, lines = False, False, []
    for line in text.splitlines():
        if not found:
            found = marker in line
        elif line.startswith("```"):
            if inside:
                break
            inside = True
        elif inside:
            lines.append(line)
    return "\n".join(lines)


def heading_anchor(heading: str) -> str:
    """The id mkdocs (Python-Markdown's toc) gives a heading: code marks dropped, ASCII, lower
    case, punctuation but ``-`` and ``_`` removed, runs of spaces and dashes made one dash."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore")
    text = re.sub(r"[^\w\s-]", "", text.decode("ascii")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def page_anchors(page: Path) -> set[str]:
    """The ids of a page's headings (lines in fenced blocks are not headings)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(heading_anchor(m.group(1)))
    return anchors


def nav_pages(mkdocs_yml: str) -> list[str]:
    """The pages the ``nav`` of mkdocs.yml lists, in order."""
    nav = mkdocs_yml.split("\nnav:\n", 1)[1]
    nav = re.split(r"\n(?=\S)", nav, maxsplit=1)[0]  # up to the next top-level key
    return re.findall(r"(\S+\.md)\s*$", nav, flags=re.MULTILINE)


def broken_doc_links(text: str) -> list[str]:
    """Links into docs/ whose page does not exist, or whose anchor no heading of it makes."""
    broken = []
    for target in re.findall(r"\]\((docs/[^)\s]+)\)", text):
        path, _, anchor = target.partition("#")
        page = ROOT / path
        if not page.is_file() or (anchor and anchor not in page_anchors(page)):
            broken.append(target)
    return broken


def test_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_readme_holds_the_ci_blocks() -> None:
    readme = README.read_text()
    for marker in CI_MARKERS:
        assert readme.count(marker) == 1, marker
        assert read_block_after(readme, marker).strip(), marker


def test_ci_test_block_builds_the_site_strictly() -> None:
    """mkdocs 1.6's ``-q`` hides warnings from ``--strict``: the build must not be quiet."""
    block = read_block_after(README.read_text(), "<!-- ci:test -->")
    builds = [c.strip() for c in block.split("&&") if c.split()[:2] == ["mkdocs", "build"]]
    assert len(builds) == 1
    args = shlex.split(builds[0])[2:]
    assert "--strict" in args and not {"-q", "--quiet"} & set(args)


def test_readme_links_into_docs_resolve() -> None:
    readme = README.read_text()
    assert "](docs/" in readme
    assert broken_doc_links(readme) == []


def test_every_page_is_in_nav_and_every_nav_entry_is_a_page() -> None:
    listed = nav_pages(MKDOCS.read_text())
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages
    assert len(set(listed)) == len(listed)


def test_helpers_read_blocks_anchors_and_nav() -> None:
    text = "intro\n<!-- ci:test -->\n\n```bash\na && b\n```\n```\nnot this\n```\n"
    assert read_block_after(text, "<!-- ci:test -->") == "a && b"
    assert heading_anchor("What a `code_tests` score guarantees") == (
        "what-a-code_tests-score-guarantees"
    )
    assert heading_anchor("Routing replay (mixture-of-experts)") == (
        "routing-replay-mixture-of-experts"
    )
    yml = "site_name: x\nnav:\n  - Home: index.md\n  - Part:\n      - A: a.md\nextra: 1\n"
    assert nav_pages(yml) == ["index.md", "a.md"]
