"""docs/architecture.md's module table names every module of the gateway and the config.

The folder tree is the architecture diagram and the table is its legend: a module added
without a word in the table is a part a reader cannot place. A module counts as named
when its file name appears in backticks in the page (``stem``, ``stem.py`` or a path
ending in it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import appliance

PACKAGE = Path(appliance.__file__).resolve().parent
PAGE = PACKAGE.parent / "docs" / "architecture.md"


def named(text: str) -> set[str]:
    """Every name in backticks, and each path's last part without ``.py``."""
    out: set[str] = set()
    for quoted in re.findall(r"`([^`\n]+)`", text):
        for word in re.split(r"[\s,()]+", quoted):
            word = word.rstrip("/")
            out.add(word.removesuffix(".py"))
            out.add(word.rsplit("/", 1)[-1].removesuffix(".py"))
    return out


def test_named_reads_stems_paths_and_lists() -> None:
    assert {"splice", "pinned", "ui"} <= named("`gateway/wire/splice.py`, `pinned` and `ui/`")


@pytest.mark.parametrize("package", ["gateway", "config"])
def test_every_module_is_in_the_table(package: str) -> None:
    page = named(PAGE.read_text())
    root = PACKAGE / package
    missing = sorted(
        str(p.relative_to(PACKAGE))
        for p in root.rglob("*.py")
        if p.stem not in ("__init__", "__main__") and p.stem not in page
    )
    assert missing == []
