"""Live keys on a real daemon: one SIGHUP, and the running service behaves by the new
values without a restart (the same engine process throughout).

One daemon for several keys keeps this short: the gateway's metrics_public, max_n,
max_queue and queue_timeout_s, thermal.hard_limit_c with the same sensor reading, and
restart.drain_timeout_s and engine.stop_timeout_s at shutdown.
``tests/unit/test_live_keys.py`` covers every live key without a daemon;
``test_operator_paths.py`` shows health.interval_s.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    Appliance,
    fake_engine_config,
    run_appliance,
    write_config,
)
from tests.integration.test_heat_and_degradation import status, write_sensors

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
# Between soft (80) and hard (87): level 3 (the default predictive governor acts 1 °C
# before each threshold: 84 + 1 >= 84.67); at or above a hard limit of 83: 4.
HOT_C = 84.0


def chat(app: Appliance, key: str, timeout: float = 10, **fields: Any) -> tuple[int, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    req = urllib.request.Request(
        app.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics_status(app: Appliance) -> int:
    """GET /metrics without a key (the answer is Prometheus text, not JSON)."""
    try:
        with urllib.request.urlopen(app.url + "/metrics", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def ask_and_forget(app: Appliance, key: str, **fields: Any) -> None:
    """A request whose answer nobody waits for: the daemon may stop under it."""
    with contextlib.suppress(OSError, ValueError):  # cut off by the shutdown
        chat(app, key, timeout=60, **fields)


def reload_applied(app: Appliance) -> list[str]:
    lines = [line for line in app.log().splitlines() if "reload applied: " in line]
    return lines[-1].split("reload applied: ", 1)[1].split(", ") if lines else []


def test_a_sighup_puts_new_limits_in_force(tmp_path: Path) -> None:
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [HOT_C])
    cfg = fake_engine_config(
        tmp_path,
        1,
        gateway={"metrics_public": False, "max_queue": 0, "queue_timeout_s": 30},
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
        restart={"drain_timeout_s": 60},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        pid = app.engine_stats(0)["pid"]  # type: ignore[index]
        # Before: the running config's behaviour.
        assert metrics_status(app) == 401
        app.wait_for(lambda: status(app, key)["engines"][0]["throttle_level"] == 3, 10, "level 3")
        assert chat(app, key, n=2, max_tokens=1)[0] == 200

        cfg["gateway"].update(metrics_public=True, max_n=1, max_queue=4, queue_timeout_s=0.5)
        cfg["thermal"]["hard_limit_c"] = 83
        cfg["restart"]["drain_timeout_s"] = 1
        cfg["engine"]["stop_timeout_s"] = 1
        write_config(tmp_path / "config.toml", cfg)
        app.signal(signal.SIGHUP)
        app.wait_for(lambda: reload_applied(app), 10, "reload applied")
        assert sorted(reload_applied(app)) == [
            "engine.stop_timeout_s",
            "gateway.max_n",
            "gateway.max_queue",
            "gateway.metrics_public",
            "gateway.queue_timeout_s",
            "restart.drain_timeout_s",
            "thermal.hard_limit_c",
        ]

        # After, with the same engine process and the same sensor reading.
        assert metrics_status(app) == 200  # was 401
        code, body = chat(app, key, n=2, max_tokens=1)
        assert (code, body["error"]["param"]) == (400, "n")  # was 200
        app.wait_for(
            lambda: status(app, key)["engines"][0]["throttle_level"] == 4, 10, "level 4 at 84°C"
        )
        # At level 4 nothing is admitted: the request waits in the queue (max_queue 0 would
        # refuse it at once with queue_full) and gives up after 0.5 s, not 30.
        started = time.monotonic()
        code, body = chat(app, key, max_tokens=1)
        assert (code, body["error"]["code"]) == (503, "queue_timeout")
        assert time.monotonic() - started < 5
        assert app.engine_stats(0)["pid"] == pid  # type: ignore[index]

        # Shutdown with a 30 s answer in flight drains for 1 s, not 60, and the engine
        # (which would wait for that answer) gets 1 s after SIGTERM, not 5.
        write_sensors(sensors, [60])
        app.wait_for(lambda: status(app, key)["engines"][0]["throttle_level"] == 0, 10, "cool")
        app.engine_control(0, token_delay_ms=300)
        threading.Thread(target=ask_and_forget, args=(app, key), kwargs={"max_tokens": 100}).start()
        app.wait_for(lambda: status(app, key)["engines"][0]["inflight"] == 1, 10, "in flight")
        started = time.monotonic()
        app.signal(signal.SIGTERM)
        assert app.wait_exit(25) == 0
        assert time.monotonic() - started < 15
        assert "stopping gracefully (drain up to 1 s)" in app.log()
        assert "ignored SIGTERM for 1 s; sending SIGKILL" in app.log()
