"""What an operator does to a running daemon, and what they must see: reloads that keep
the config, live keys that are live, a /readyz that tells the truth, restart budgets
that tell crashes from planned restarts, and a drain that will not stop the service
by accident."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
)
from tests.integration.test_heat_and_degradation import status, write_sensors

pytestmark = pytest.mark.slow


def admin_key(tmp: Path) -> str:
    return (tmp / "admin.key").read_text().strip()


def post(app: Appliance, key: str, path: str) -> tuple[int, Any]:
    req = urllib.request.Request(
        app.url + path, data=b"", headers={"Authorization": f"Bearer {key}"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_reload_whose_config_file_is_gone_keeps_the_running_config(tmp_path: Path) -> None:
    """Under the unit the config comes from $LLM_APPLIANCE_CONFIG: if that file is missing
    at SIGHUP (an editor's rename, a half-finished deploy), the reload is refused; it
    must not put every default back in force."""
    cfg = fake_engine_config(tmp_path, 1, gateway={"queue_timeout_s": 2})
    with run_appliance(tmp_path, cfg, config_via_env=True) as app:
        app.wait_all_ready()
        config = tmp_path / "config.toml"
        moved = config.rename(tmp_path / "config.toml.swp")
        app.signal(signal.SIGHUP)
        app.wait_for(lambda: "reload refused" in app.log(), 10, "the reload refused")
        assert f"{config}: no such file" in app.log()
        assert "reload applied" not in app.log()
        # The file back with one live change: that reload is applied.
        moved.write_text(moved.read_text().replace("queue_timeout_s = 2", "queue_timeout_s = 3"))
        moved.rename(config)
        app.signal(signal.SIGHUP)
        app.wait_for(
            lambda: "reload applied: gateway.queue_timeout_s" in app.log(), 10, "reload applied"
        )


def test_health_interval_changed_by_reload_applies_to_running_engines(tmp_path: Path) -> None:
    """health.interval_s is live: after a SIGHUP that shortens it, a frozen engine is out
    of routing within the new interval, not the old one."""
    cfg = fake_engine_config(
        tmp_path,
        2,
        health={"interval_s": 60, "probe_timeout_s": 1.0, "failures_to_restart": 100},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = admin_key(tmp_path)
        config = tmp_path / "config.toml"
        config.write_text(config.read_text().replace("interval_s = 60", "interval_s = 0.5"))
        app.signal(signal.SIGHUP)
        app.wait_for(lambda: "reload applied: health.interval_s" in app.log(), 10, "applied")
        stats = app.engine_stats(0)
        assert stats is not None
        os.kill(int(stats["pid"]), signal.SIGSTOP)
        try:
            # Old interval: up to 60 s. New: 0.5 s + the 1 s probe timeout.
            app.wait_for(
                lambda: status(app, key)["engines"][0]["state"] == "SUSPECT",
                5,
                "engine0 checked at the new interval",
            )
        finally:
            os.kill(int(stats["pid"]), signal.SIGCONT)


def test_readyz_is_503_with_the_reason_while_heat_lets_no_engine_admit(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60, 60])
    cfg = fake_engine_config(
        tmp_path, 2, telemetry={"source": f"file:{sensors}", "interval_s": 0.1}
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        write_sensors(sensors, [95, 60])
        # One GPU at the hard limit: the other engine still admits, so the service is ready.
        app.wait_for(
            lambda: get_json(app.url + "/readyz")[1].get("engines_admitting") == [1],
            10,
            "engine 0 stops admitting",
        )
        assert get_json(app.url + "/readyz")[0] == 200
        write_sensors(sensors, [95, 96])
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 503, 10, "readyz 503")
        code, body = get_json(app.url + "/readyz")
        assert code == 503 and body["status"] == "not admitting"
        assert body["reasons"] == {
            "0": "throttled by heat (GPU at the hard limit)",
            "1": "throttled by heat (GPU at the hard limit)",
        }
        assert body["engines_ready"] == [0, 1] and body["engines_admitting"] == []
        write_sensors(sensors, [60, 60])
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 30, "readyz 200 again")


def test_heat_restarts_do_not_spend_the_crash_budget_and_have_their_own(tmp_path: Path) -> None:
    """A hot afternoon must not leave an engine FAILED: heat restarts are budgeted apart
    (restart.max_planned_restarts_per_hour) from crashes (max_restarts_per_hour)."""
    import psutil

    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [60])
    cfg = fake_engine_config(
        tmp_path,
        1,
        "--max-num-batched-tokens",
        "8192",
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"heat_restart_after_s": 1, "heat_restore_after_s": 1},
        restart={"max_restarts_per_hour": 1, "max_planned_restarts_per_hour": 2},
    )

    def batched() -> str | None:
        stats = app.engine_stats(0)
        if stats is None:
            return None
        argv = psutil.Process(stats["pid"]).cmdline()
        return argv[argv.index("--max-num-batched-tokens") + 1]

    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = admin_key(tmp_path)
        write_sensors(sensors, [95])
        app.wait_for(lambda: batched() == "4096", 20, "heat restart with half the batch")
        write_sensors(sensors, [50])
        app.wait_for(lambda: batched() == "8192", 20, "restored once cool")
        # Two planned restarts: the third (hot again) is refused, the engine keeps serving.
        write_sensors(sensors, [95])
        app.wait_for(lambda: "heat restart not done" in app.log(), 20, "planned budget spent")
        engine = status(app, key)["engines"][0]
        assert engine["state"] == "READY" and engine["restarts_by_reason"] == {"heat": 2}
        assert batched() == "8192"
        # The crash budget (1) is untouched by the two heat restarts: a crash restarts.
        write_sensors(sensors, [60])
        app.engine_control(0, crash=True)
        app.wait_for(
            lambda: status(app, key)["engines"][0]["restarts_by_reason"].get("exited") == 1,
            20,
            "crash restart",
        )
        app.wait_for(lambda: status(app, key)["engines"][0]["state"] == "READY", 20, "READY")


def test_draining_the_last_serving_engine_needs_force(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 2, health=STEADY_HEALTH)
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = admin_key(tmp_path)
        assert post(app, key, "/admin/engines/0/drain") == (200, {"id": 0, "state": "DRAINING"})
        code, body = post(app, key, "/admin/engines/1/drain")
        assert code == 409 and body["error"]["code"] == "cannot_drain"
        assert "last engine serving" in body["error"]["message"]
        assert "?force=true" in body["error"]["message"]
        assert status(app, key)["engines"][1]["state"] == "READY"
        assert get_json(app.url + "/readyz")[0] == 200
        code, body = post(app, key, "/admin/engines/1/drain?force=true")
        assert (code, body) == (200, {"id": 1, "state": "DRAINING"})
        assert get_json(app.url + "/readyz")[0] == 503
        assert post(app, key, "/admin/engines/1/resume")[0] == 200
