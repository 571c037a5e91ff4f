"""The front door stays small and its links lead somewhere (#50 item 8): README.md fits in
350 lines, and every relative link of README.md and the pages it leads to names a file
that exists, and a heading of it when the link has an anchor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 350
PAGES = sorted(
    {REPO / "README.md", REPO / "bench" / "README.md", REPO / "tests" / "README.md"}
    | set((REPO / "docs").glob("*.md"))
)
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) outside code spans; an image's ![alt](target) too.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def prose(text: str) -> list[str]:
    """The document's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = _LINK.sub(lambda m: m.group(0)[1 : m.group(0).index("]")], heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated one gets GitHub's ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text()):
        heading = _HEADING.match(line)
        if heading is None:
            continue
        anchor = slug(heading[2])
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The page's link targets that are neither URLs nor mail addresses."""
    targets = []
    for line in prose(page.read_text()):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                targets.append(target)
    return targets


def test_the_readme_fits_in_350_lines() -> None:
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_the_checker_sees_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    """The checker itself: a page with a good link, a missing file and a missing anchor."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n## Schema registry values (`avro-registry`)\n\n"
        "[ok](#schema-registry-values-avro-registry) [gone](nowhere.md) [bad](#no-such)\n"
        "`[not a link](in-code.md)`\n```\n[fenced](fenced.md)\n# not a heading\n```\n"
    )
    assert relative_links(page) == [
        "#schema-registry-values-avro-registry",
        "nowhere.md",
        "#no-such",
    ]
    assert anchors(page) == {"a-page", "schema-registry-values-avro-registry"}
    assert slug("10. The map") == "10-the-map"
    assert slug("Commit→visible latency") == "commitvisible-latency"
