"""Every relative link in the docs leads somewhere: the file exists, and an ``#anchor``
is a heading of the page it names (as GitHub makes anchors from headings).

The docs are split into pages by job (how-to, runbook, reference, journal); a section
moved to another page leaves links to its old place behind, and the alert rules and the
other pages link to sections by anchor. This finds every such link that leads nowhere.

Checked: README.md, every page under docs/, and the READMEs that link into docs/. Links
inside code (fenced blocks, inline code) are text, not links. Source only: milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
READMES = [REPO / "README.md", REPO / "bench" / "README.md", REPO / "ansible" / "README.md"]
PAGES = sorted([*READMES, *(REPO / "docs").rglob("*.md")])
INLINE_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+(\S+)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: links reduced to their text, lower case,
    punctuation dropped (word characters, hyphens and spaces stay), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced code blocks, with inline code taken out."""
    fence: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip()
        marker = stripped[:3]
        if marker in ("```", "~~~"):
            if fence is None:
                fence = marker
            elif marker == fence:
                fence = None
            continue
        if fence is None:
            yield re.sub(r"`[^`]*`", "", line)


def anchors(page: Path) -> set[str]:
    """The anchors a page has: one per heading (GitHub numbers repeats: x, x-1, x-2), and
    explicit ``<a id="...">`` ones."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in page.read_text(encoding="utf-8").splitlines():
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = marker if fence is None else (None if marker == fence else fence)
            continue
        if fence is not None:
            continue
        out.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading is None:
            continue
        base = github_anchor(heading.group(2).replace("`", ""))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> Iterator[str]:
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        yield from INLINE_LINK.findall(line)
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            yield definition.group(1)


def broken_links(page: Path) -> list[str]:
    out = []
    for target in links(page):
        if SCHEME.match(target) or target.startswith("<"):
            continue  # a URL elsewhere: not ours to check offline
        path, _, anchor = target.partition("#")
        dest = page if path == "" else (page.parent / path).resolve()
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target}: no heading with that anchor in {dest.name}")
    return out


def test_the_checker_knows_github_anchors() -> None:
    restart = "Restart reasons (`appliance_engine_restarts_total{reason}`, `status`)"
    assert github_anchor(restart.replace("`", "")) == (
        "restart-reasons-appliance_engine_restarts_totalreason-status"
    )
    sensors = 'The sensors file (`telemetry.source = "file:…"`)'
    assert github_anchor(sensors.replace("`", "")) == "the-sensors-file-telemetrysource--file"


def test_the_checker_finds_a_link_that_leads_nowhere(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n", encoding="utf-8")
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [gone](other.md#old-section) [self](#page)\n"
        "[missing](nowhere.md) `[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
        "[web](https://example.com/x.md)\n\n[ref]: other.md#nope\n",
        encoding="utf-8",
    )
    found = [b.split(":")[0] for b in broken_links(page)]
    assert found == ["other.md#old-section", "nowhere.md", "other.md#nope"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(REPO)}: links that lead nowhere"
