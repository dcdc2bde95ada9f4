"""The role's optional monitoring files (tasks/monitoring.yml), converged on localhost.

With ``llm_appliance_prometheus_rules_dir`` and ``llm_appliance_grafana_dashboards_dir``
set, the role writes the alert rules unchanged and the dashboard with the datasource uid
and the thermal limits filled in (file provisioning asks no import questions), and a
second run changes nothing. Off by default: with the defaults nothing is written.
Bad values fail the variable checks before the host is touched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ansible.test_role_static import (
    ANSIBLE_PLAYBOOK,
    REPO,
    ROLE,
    _run,
    _validate,
    _write_playbook,
)

pytestmark = pytest.mark.skipif(
    ANSIBLE_PLAYBOOK is None,
    reason="ansible-core is not installed (pip install -r ansible/requirements-dev.txt)",
)

RULES = REPO / "monitoring" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "monitoring" / "grafana" / "llm-appliance.json"


def _converge(tmp: Path, extra_vars: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """The role's monitoring tasks (and its handlers) with its defaults and extra_vars."""
    assert ANSIBLE_PLAYBOOK is not None
    play = _write_playbook(
        tmp / "monitoring.yml",
        [
            {
                "name": "Install the llm_appliance monitoring files",
                "hosts": "localhost",
                "connection": "local",
                "gather_facts": False,
                "become": False,
                "vars_files": [str(ROLE / "defaults" / "main.yml")],
                "tasks": [
                    {
                        "name": "Run the role's monitoring tasks",
                        "ansible.builtin.include_role": {
                            "name": "llm_appliance",
                            "tasks_from": "monitoring.yml",
                        },
                    }
                ],
            }
        ],
    )
    return _run(
        [
            ANSIBLE_PLAYBOOK,
            "-i",
            "localhost,",
            str(play),
            "-e",
            json.dumps(
                {
                    "ansible_python_interpreter": sys.executable,
                    "llm_appliance_source_dir": str(REPO),
                    **extra_vars,
                }
            ),
        ],
        tmp,
        tmp,
    )


def _is_root() -> bool:
    return os.geteuid() == 0


def _recap(out: str) -> tuple[int, int]:
    m = re.search(r"localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=0\s+failed=0", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


@pytest.mark.skipif(not _is_root(), reason="the role writes root-owned files: run as root")
def test_rules_and_dashboard_land_filled_in_and_a_second_run_changes_nothing(
    tmp_path: Path,
) -> None:
    rules_dir, dash_dir = tmp_path / "rules", tmp_path / "dashboards"
    rules_dir.mkdir()
    dash_dir.mkdir()
    extra = {
        "llm_appliance_prometheus_rules_dir": str(rules_dir),
        "llm_appliance_grafana_dashboards_dir": str(dash_dir),
        "llm_appliance_grafana_datasource_uid": "prom-main",
        "llm_appliance_thermal_soft_limit_c": 75,
        "llm_appliance_thermal_hard_limit_c": 83,
    }
    first = _converge(tmp_path, extra)
    assert first.returncode == 0, first.stdout + first.stderr
    assert _recap(first.stdout)[1] == 2, first.stdout
    assert (rules_dir / "llm-appliance.yml").read_bytes() == RULES.read_bytes()
    installed = (dash_dir / "llm-appliance.json").read_text(encoding="utf-8")
    for placeholder in ("${DS_PROMETHEUS}", "${VAR_SOFT_LIMIT_C}", "${VAR_HARD_LIMIT_C}"):
        assert placeholder not in installed
    # Nothing else changed: putting the placeholders back gives the shipped file.
    original = DASHBOARD.read_text(encoding="utf-8")
    assert (
        installed.replace('"prom-main"', '"${DS_PROMETHEUS}"')
        .replace('"75"', '"${VAR_SOFT_LIMIT_C}"')
        .replace('"83"', '"${VAR_HARD_LIMIT_C}"')
        == original
    )
    doc = json.loads(installed)
    panel = next(p for p in doc["panels"] if p["type"] != "row")
    assert panel["datasource"] == {"type": "prometheus", "uid": "prom-main"}
    limits = {v["name"]: v["query"] for v in doc["templating"]["list"] if v["type"] == "constant"}
    assert limits == {"soft_limit_c": "75", "hard_limit_c": "83"}
    assert '"legendFormat": "engine {{engine}}"' in installed  # never templated by Ansible
    assert (rules_dir / "llm-appliance.yml").stat().st_mode & 0o777 == 0o644

    second = _converge(tmp_path, extra)
    assert second.returncode == 0, second.stdout + second.stderr
    assert _recap(second.stdout)[1] == 0, second.stdout


def test_off_by_default_nothing_is_written(tmp_path: Path) -> None:
    proc = _converge(tmp_path, {})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _recap(proc.stdout)[1] == 0, proc.stdout
    assert "skipping: [localhost]" in proc.stdout


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param(
            {"llm_appliance_prometheus_rules_dir": "prometheus/rules"},
            "llm_appliance_prometheus_rules_dir = prometheus/rules: must be",
            id="relative-rules-dir",
        ),
        pytest.param(
            {
                "llm_appliance_grafana_dashboards_dir": "/var/lib/grafana/dashboards",
                "llm_appliance_grafana_datasource_uid": "",
            },
            "llm_appliance_grafana_datasource_uid must name a datasource",
            id="dashboard-without-datasource",
        ),
    ],
)
def test_bad_monitoring_variables_fail_before_the_host_changes(
    tmp_path: Path, extra: dict[str, Any], expected: str
) -> None:
    proc = _validate(tmp_path, extra)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert expected in out, out
