"""`llm-appliance status` and `/readyz` give one verdict (issue 33, item 10), end to end
with fake engines: a model on demand put away is not DOWN while /readyz is 200, and a
box whose every GPU is at the hard limit (`file:` telemetry) is NOT READY in `status`
while /readyz is 503 `not admitting`, with the same reasons."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.cli import main
from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, get_json, run_appliance
from tests.integration.test_heat_and_degradation import write_sensors

pytestmark = pytest.mark.slow


def _status(url: str, key: str, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, Any]]:
    """`status`'s table and its --json document, as a person runs them."""
    assert main(["status", "--url", url, "--key", key]) == 0
    table = capsys.readouterr().out
    assert main(["status", "--url", url, "--key", key, "--json"]) == 0
    return table, json.loads(capsys.readouterr().out)


def test_a_model_put_away_is_not_down_in_status_when_readyz_is_200(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg: dict[str, Any] = fake_engine_config(tmp_path, 2, health=STEADY_HEALTH)
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "embed", "cpu_engines": 1, "load": "on_demand"},
    ]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 30, "readyz 200")
        code, readyz = get_json(app.url + "/readyz")
        assert code == 200 and readyz["models"] == {"chat": "ready", "embed": "unloaded"}
        table, doc = _status(app.url, key, capsys)
        lines = table.splitlines()
        assert "DOWN" not in table, table
        assert ": ready," in lines[0] and "NOT READY" not in table
        assert "model chat: ready, 1/1 engines READY" in lines
        assert "model embed: unloaded (put away, its next request loads it), 0/1 engines READY" in (
            lines
        )
        assert doc["ready"] is True
        assert doc["readiness"]["models"] == readyz["models"]


def test_status_is_not_ready_with_the_reason_when_heat_stops_admission(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60])
    cfg = fake_engine_config(
        tmp_path,
        1,
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 88, "hysteresis_c": 5},
        health=STEADY_HEALTH,
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        write_sensors(sensors, [88])
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 503, 10, "readyz 503")
        _, readyz = get_json(app.url + "/readyz")
        assert readyz["status"] == "not admitting"
        table, doc = _status(app.url, key, capsys)
        lines = table.splitlines()
        assert ": NOT READY (not admitting)," in lines[0], table
        assert lines[1] == "engine 0: throttled by heat (GPU at the hard limit)"
        assert doc["ready"] is False
        assert doc["readiness"]["status"] == "not admitting"
        assert doc["readiness"]["reasons"] == readyz["reasons"]
        write_sensors(sensors, [60])
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 30, "readyz 200 again")
        table, doc = _status(app.url, key, capsys)
        assert doc["ready"] is True and ": ready," in table.splitlines()[0]


def test_a_model_that_trusts_remote_code_is_marked_in_status_and_its_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: a model whose engines run with --trust-remote-code (the line `models pull
    --trust-remote-code` prints, here in the model's own command) is marked in `status`
    and in its --json; the other model is not."""
    cfg: dict[str, Any] = fake_engine_config(tmp_path, 2, health=STEADY_HEALTH)
    trusting = [*cfg["engine"]["command"], "--trust-remote-code"]
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "coder", "cpu_engines": 1, "command": trusting},
    ]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        table, doc = _status(app.url, key, capsys)
        trusts = {m["name"]: m["trust_remote_code"] for m in doc["models"]}
        assert trusts == {"chat": False, "coder": True}
        assert (
            "model coder: trusts remote code (--trust-remote-code): its engines run the "
            "Python code that came with the model"
        ) in table.splitlines()
        assert "model chat: trusts" not in table
