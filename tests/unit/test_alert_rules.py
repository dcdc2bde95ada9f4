"""The Prometheus alert rules, monitoring/prometheus/alerts.yml.

`promtool check rules` says they parse; `promtool test rules` runs
monitoring/prometheus/alerts_test.yml, where each alert meets input series that must make
it fire and others that must leave it silent. The rest checks what an operator reads when
one fires: a summary, and a runbook section in docs/runbook.md that exists.

promtool comes from Debian's prometheus package (scripts/test-deps unpacks it into a
cache folder); without it the promtool tests skip, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML (it comes with ansible-core) is missing")

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "monitoring" / "prometheus"
RULES = RULES_DIR / "alerts.yml"
RULE_TESTS = RULES_DIR / "alerts_test.yml"
RUNBOOK = REPO / "docs" / "runbook.md"
TOOLS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-appliance/tools"

# What the rules must watch (issue 14, item 2); a rule renamed or dropped fails here.
EXPECTED_ALERTS = {
    "LlmApplianceScrapeFailing",
    "LlmApplianceScrapeMissing",
    "LlmApplianceEngineFailed",
    "LlmApplianceEngineDown",
    "LlmApplianceAllEnginesDown",
    "LlmApplianceModelDown",
    "LlmApplianceEngineRestartsAboveBudget",
    "LlmApplianceKvBreakerOpen",
    "LlmApplianceGpuAtHardLimit",
    "LlmApplianceQueueSaturated",
    "LlmApplianceStateWriteFailing",
}


def _promtool() -> str:
    found = str(TOOLS / "promtool") if (TOOLS / "promtool").exists() else shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not available (scripts/test-deps fetches it as root)")
    return found


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _runbook_anchors() -> set[str]:
    lines = RUNBOOK.read_text(encoding="utf-8").splitlines()
    return {_github_anchor(line.lstrip("#")) for line in lines if line.startswith("#")}


def test_promtool_check_rules_is_clean() -> None:
    proc = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in proc.stdout, proc.stdout


def test_each_alert_fires_when_it_should_and_stays_silent_when_it_should_not() -> None:
    proc = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout


def test_a_rule_that_fires_too_early_fails_the_rule_tests(tmp_path: Path) -> None:
    """The silent cases have teeth: the hard-limit alert without its 5 minutes is caught."""
    rules = RULES.read_text(encoding="utf-8")
    hard = rules.index("alert: LlmApplianceGpuAtHardLimit")
    mutated = rules[:hard] + rules[hard:].replace("for: 5m", "for: 1m", 1)
    assert mutated != rules
    (tmp_path / "alerts.yml").write_text(mutated, encoding="utf-8")
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    proc = subprocess.run(
        [_promtool(), "test", "rules", RULE_TESTS.name],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0, proc.stdout
    assert "LlmApplianceGpuAtHardLimit" in proc.stdout + proc.stderr


def test_the_rules_are_the_expected_alerts() -> None:
    names = [rule["alert"] for rule in _rules()]
    assert sorted(names) == sorted(EXPECTED_ALERTS)


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_stays_silent() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))
    fires: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    assert EXPECTED_ALERTS - fires == set(), "alerts never shown to fire"
    assert EXPECTED_ALERTS - silent == set(), "alerts never shown to stay silent"


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section_that_exists() -> None:
    anchors = _runbook_anchors()
    for rule in _rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        notes = rule["annotations"]
        assert notes.get("summary") and notes.get("description"), name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/runbook.md", name
        assert anchor == name.lower(), name
        assert anchor in anchors, f"{name}: no section #{anchor} in docs/runbook.md"
