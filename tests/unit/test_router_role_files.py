"""The Ansible role ``llm_appliance_router``'s own files, read as YAML: its defaults are
the ones its argument specs declare, and the router version it installs is the one the
tests run. No ansible-playbook, no network: what renders the role's templates and runs
its variable checks is tests/ansible/test_router_role.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.router_proc import ROUTER_VERSION

yaml = pytest.importorskip("yaml", reason="PyYAML (it comes with ansible-core) is missing")

ROLE = Path(__file__).resolve().parents[2] / "ansible" / "roles" / "llm_appliance_router"


def test_defaults_match_the_argument_specs() -> None:
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta/argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    assert {k: v["default"] for k, v in options.items()} == defaults


def test_router_version_is_the_one_the_tests_run() -> None:
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    assert defaults["llm_appliance_router_version"] == ROUTER_VERSION
