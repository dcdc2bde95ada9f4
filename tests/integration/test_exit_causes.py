"""Every engine exit has a named cause, in /admin/status's last_exit, the journal and
appliance_engine_restarts_total{reason}: killed by us (an admin restart), exited by
itself with its status, killed by a signal we did not send, failed to bind, failed to
load the model. (The OOM killer's case is covered by tests/unit/test_exits.py.)"""

from __future__ import annotations

import os
import signal
import sys
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
from tests.fakes.engine_proc import FAKE_ENGINE_PATH

pytestmark = pytest.mark.slow

FAKE = [sys.executable, FAKE_ENGINE_PATH, "--served-model-name", "{served_model_name}"]


def engine(app: Appliance, key: str, model: str) -> dict[str, Any]:
    """The model's first engine, as /admin/status shows it."""
    _, body = get_json(app.url + "/admin/status", headers={"Authorization": f"Bearer {key}"})
    return next(e for e in body["engines"] if e["model"] == model)


def restarts(app: Appliance, key: str, engine_id: int, reason: str) -> bool:
    req = urllib.request.Request(app.url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        text = r.read().decode()
    line = f'appliance_engine_restarts_total{{engine="{engine_id}",reason="{reason}"}} '
    return any(x.startswith(line) and float(x.split()[-1]) >= 1 for x in text.splitlines())


def test_each_exit_is_named(tmp_path: Path) -> None:
    cfg: dict[str, Any] = fake_engine_config(
        tmp_path,
        1,
        restart={"backoff_initial_s": 0.1, "backoff_max_s": 0.2, "max_restarts_per_hour": 3},
        health=STEADY_HEALTH,
    )
    cfg["models"] = [
        # Two: an admin restart never takes out a model's last serving engine.
        {"name": "chat", "cpu_engines": 2},
        # Its socket's directory does not exist (the last --uds wins): the bind fails, as
        # on a taken port.
        {
            "name": "nobind",
            "cpu_engines": 1,
            "command": [*FAKE, "--uds", "{uds}", "--uds", str(tmp_path / "missing" / "x.sock")],
        },
        # Exits 1 with vLLM-like words before it listens: the model did not load.
        {
            "name": "noload",
            "cpu_engines": 1,
            "command": [*FAKE, "--uds", "{uds}", "--exit-immediately", "1"],
        },
    ]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready(30)
        key = (tmp_path / "admin.key").read_text().strip()
        for model, eid, reason, words in [
            ("nobind", 2, "bind_failed", "failed to bind its address (status 1) while starting"),
            ("noload", 3, "load_failed", "failed to load the model (status 1) while starting"),
        ]:
            app.wait_for(lambda m=model: engine(app, key, m)["state"] == "FAILED", 30, model)
            assert engine(app, key, model)["last_exit"].startswith(words)
            assert f"(cause: {words.removesuffix(' while starting')})" in app.log()
            app.wait_for(lambda e=eid, r=reason: restarts(app, key, e, r), 20, "counted")

        # Exited by itself, with its status.
        app.wait_for(lambda: engine(app, key, "chat")["state"] == "READY", 20, "chat READY")
        app.engine_control(0, crash=3)
        words = "exited by itself with status 3 while serving"
        app.wait_for(
            lambda: (engine(app, key, "chat")["last_exit"] or "").startswith(words),
            20,
            "exit named",
        )
        app.wait_for(lambda: restarts(app, key, 0, "exited"), 20, "counted")
        assert "(cause: exited by itself with status 3)" in app.log()

        # Killed by a signal we did not send.
        app.wait_for(lambda: engine(app, key, "chat")["state"] == "READY", 20, "chat READY")
        os.kill(engine(app, key, "chat")["pid"], signal.SIGKILL)
        words = "killed by signal SIGKILL, which the supervisor did not send while serving"
        app.wait_for(
            lambda: (engine(app, key, "chat")["last_exit"] or "").startswith(words),
            20,
            "signal named",
        )
        app.wait_for(lambda: restarts(app, key, 0, "signal"), 20, "counted")

        # Killed by us: an admin's restart.
        app.wait_for(lambda: engine(app, key, "chat")["state"] == "READY", 20, "chat READY")
        req = urllib.request.Request(
            app.url + "/admin/engines/0/restart",
            method="POST",
            headers={"Authorization": f"Bearer {key}"},
        )
        with urllib.request.urlopen(req, timeout=10):
            pass
        app.wait_for(
            lambda: engine(app, key, "chat")["last_exit"] == "stopped by the supervisor (admin)",
            30,
            "admin stop named",
        )
        app.wait_for(lambda: restarts(app, key, 0, "admin"), 20, "counted")
