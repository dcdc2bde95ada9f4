"""docs/configuration.md is generated from the config's field docs and must not drift."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from appliance.config import SECTIONS, config_markdown
from appliance.reload import LIVE_KEYS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "run `python -m appliance.config --markdown > docs/configuration.md`"

FIELDS = [(name, f) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def test_configuration_md_is_up_to_date() -> None:
    assert DOC.exists(), f"docs/configuration.md is missing: {REGENERATE}"
    assert DOC.read_text(encoding="utf-8") == config_markdown(), (
        f"docs/configuration.md is stale: {REGENERATE}"
    )


@pytest.mark.parametrize(("section", "field"), FIELDS, ids=[f"{s}.{f.name}" for s, f in FIELDS])
def test_every_field_is_documented(section: str, field: dataclasses.Field[object]) -> None:
    doc = field.metadata.get("doc", "")
    assert isinstance(doc, str) and doc.strip(), f"{section}.{field.name} has no doc"
    assert f"| `{field.name}` |" in config_markdown()


def test_every_section_has_a_heading_and_live_keys_are_marked() -> None:
    text = config_markdown()
    for name in SECTIONS:
        assert f"## [{name}]" in text
    live_rows = [line for line in text.splitlines() if line.startswith("| `") and "| yes |" in line]
    assert len(live_rows) == len(LIVE_KEYS)
