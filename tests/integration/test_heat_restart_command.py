"""Heat restarts and an `engine.command` of one's own (issue 33, item 14): with no
`--max-num-batched-tokens` to halve, the engine gets no heat restart; the journal says
so once at start, and once when the GPU has been at the hard limit long enough, not at
every heat tick. `file:` telemetry stands in for NVML."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, run_appliance
from tests.integration.test_heat_and_degradation import status, write_sensors

pytestmark = pytest.mark.slow

AT_START = "engine.command: has no --max-num-batched-tokens argument, so thermal."
AT_HEAT = "no heat restart: its command has no --max-num-batched-tokens to halve"


def test_the_journal_says_once_that_heat_restarts_cannot_act(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60])
    cfg = fake_engine_config(
        tmp_path,
        1,
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 88, "heat_restart_after_s": 0.3},
        health=STEADY_HEALTH,
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        assert app.log().count(AT_START) == 1, app.log()
        write_sensors(sensors, [95])
        app.wait_for(lambda: AT_HEAT in app.log(), 10, "the heat restart's refusal")
        # More heat ticks later (each new reading seen in /admin/status is one), still
        # one line, and no restart.
        key = (tmp_path / "admin.key").read_text().strip()
        for temp in (96.0, 97.0, 98.0):
            write_sensors(sensors, [temp])
            app.wait_for(
                lambda t=temp: status(app, key)["gpus"][0]["temperature_c"] == t,
                10,
                f"the reading {temp}",
            )
        assert app.log().count(AT_HEAT) == 1, app.log()
        assert "restarting it with --max-num-batched-tokens" not in app.log()
