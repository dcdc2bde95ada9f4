"""The power limit through the canonical unit, under a real systemd (PID 1), on the fake NVML.

`thermal.power_limit_w = 300` with two fake GPUs (450 W by default, 150..600 W allowed):
`systemctl start` runs `gpu-power apply` as root (ExecStartPre=-+) and both GPUs are at
300 W while the daemon itself runs as the service account; `systemctl stop` runs
`gpu-power restore` (ExecStopPost=-+) and they are back at 450 W; a daemon killed with
SIGKILL gets its restore before systemd restarts it, and the restart applies the limit
again. Each change is in the journal and in audit.log.

The fake NVML: a drop-in puts ``/srv/fake-nvml`` first on ``PYTHONPATH`` for the whole
unit (the two privileged commands and the daemon), where a ``pynvml.py`` stands in for
the real one with `tests/fakes/fake_pynvml.py`. Its state (each GPU's limit, and who set
it) lives in a JSON file, so what apply sets, restore and the test see; like the real
driver, it refuses a limit from anyone but root (``NoPermission``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import write_config
from tests.fakes.systemd_container import (
    CLI,
    CONFIG,
    STATE,
    UNIT_NAME,
    InstalledAppliance,
    fake_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FAKE_DIR = "/srv/fake-nvml"
FAKE_STATE = f"{FAKE_DIR}/state.json"
FAKE_PYNVML = Path(__file__).resolve().parents[1] / "fakes" / "fake_pynvml.py"

# A pynvml that is the fake one, its GPUs and their limits kept in FAKE_STATE.
SHIM = r"""
import importlib.util, json, os, sys

_here = os.path.dirname(os.path.abspath(__file__))
for _dir in sys.path:
    _path = os.path.join(_dir or ".", "pynvml.py")
    if os.path.abspath(_dir or ".") != _here and os.path.exists(_path):
        break
else:
    raise ImportError("the real pynvml is not installed")
_spec = importlib.util.spec_from_file_location("pynvml", _path)
_real = importlib.util.module_from_spec(_spec)
# Before it runs: it adds its error classes to sys.modules["pynvml"]; and fake_pynvml
# imports it for them.
sys.modules["pynvml"] = _real
_spec.loader.exec_module(_real)
sys.path.insert(0, _here)
import fake_pynvml

_STATE = os.path.join(_here, "state.json")
with open(_STATE) as f:
    _state = json.load(f)
_fake = fake_pynvml.FakeNvml([fake_pynvml.FakeGpu(**g) for g in _state["gpus"]])
_set = _fake.nvmlDeviceSetPowerManagementLimit


def _set_and_keep(handle, limit_mw):
    if os.geteuid() != 0:
        raise fake_pynvml.NoPermission()  # as the driver answers anyone but root
    _set(handle, limit_mw)
    with open(_STATE) as f:
        state = json.load(f)
    state["gpus"][handle.index]["power_limit_mw"] = int(limit_mw)
    state["sets"].append({"gpu": handle.index, "mw": int(limit_mw), "euid": os.geteuid()})
    with open(_STATE + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(_STATE + ".tmp", _STATE)
    os.chmod(_STATE, 0o644)


_fake.module.nvmlDeviceSetPowerManagementLimit = _set_and_keep
sys.modules["pynvml"] = _fake.module
"""


def fake_state(app: InstalledAppliance) -> dict[str, Any]:
    return json.loads(app.box.path(FAKE_STATE).read_text())


def limits_w(app: InstalledAppliance) -> list[float]:
    return [g.get("power_limit_mw", 450_000) / 1000 for g in fake_state(app)["gpus"]]


def wait_for(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)
    return value


def test_the_unit_applies_and_restores_the_limit_as_root(
    installed_appliance: InstalledAppliance,
) -> None:
    app = installed_appliance
    box = app.box
    box.run(["systemctl", "stop", UNIT_NAME], timeout=200)
    box.run(["mkdir", "-p", FAKE_DIR], check=True)
    box.write(f"{FAKE_DIR}/fake_pynvml.py", FAKE_PYNVML.read_text())
    box.write(f"{FAKE_DIR}/pynvml.py", SHIM)
    gpus = [{"uuid": f"GPU-fake-{i:04d}", "memory_used": 0} for i in range(2)]
    box.write(FAKE_STATE, json.dumps({"gpus": gpus, "sets": []}))
    cfg = fake_config()
    cfg["engine"].update({"device": "cuda", "gpus": [0, 1]})
    cfg["thermal"] = {"power_limit_w": 300}
    box.path(CONFIG).parent.mkdir(parents=True, exist_ok=True)
    write_config(box.path(CONFIG), cfg)
    box.path(CONFIG).chmod(0o644)
    app.facts["config"] = "gpu-power"  # other tests write their own config again
    app.set_drop_in(f"[Service]\nEnvironment=PYTHONPATH={FAKE_DIR}\n")
    try:
        cursor = box.journal_cursor()
        r = box.run(["systemctl", "start", UNIT_NAME], timeout=120)
        journal = box.journal("-u", UNIT_NAME, "-o", "cat", after=cursor)
        assert r.returncode == 0, journal[-4000:]

        assert limits_w(app) == [300, 300], journal[-4000:]
        assert {(s["gpu"], s["mw"], s["euid"]) for s in fake_state(app)["sets"]} == {
            (0, 300_000, 0),
            (1, 300_000, 0),
        }
        main_pid = app.state()["MainPID"]
        uid = box.run(["ps", "-o", "uid=", "-p", main_pid], check=True).stdout.strip()
        service_uid = box.run(["id", "-u", "llm-appliance"], check=True).stdout.strip()
        assert uid == service_uid != "0", f"the daemon runs as uid {uid}"
        assert "gpu0 (GPU-fake-0000): power limit 450 W -> 300 W" in journal
        assert '"action":"gpu.power_limit"' in journal
        audit = box.path(f"{STATE}/audit.log").read_text()
        assert audit.count('"action":"gpu.power_limit"') == 2, audit
        # The daemon, unprivileged, reads the limit in force.
        status = box.run(
            [
                "runuser",
                "-u",
                "llm-appliance",
                "--",
                "env",
                f"PYTHONPATH={FAKE_DIR}",
                CLI,
                "doctor",
                "--config",
                CONFIG,
            ],
            timeout=120,
        )
        assert "power limit 300 W (card default 450 W) as thermal.power_limit_w" in (
            status.stdout
        ), status.stdout + status.stderr

        # A crash: systemd runs ExecStopPost (restore) before the restart (apply).
        before = len(fake_state(app)["sets"])
        box.run(
            ["systemctl", "kill", "--kill-whom=main", "--signal=SIGKILL", UNIT_NAME],
            check=True,
        )
        wait_for(
            lambda: int(app.state()["NRestarts"]) >= 1 and app.state()["ActiveState"] == "active",
            120,
            "the restart after SIGKILL",
        )
        after = [(s["gpu"], s["mw"]) for s in fake_state(app)["sets"][before:]]
        assert sorted(after[:2]) == [(0, 450_000), (1, 450_000)], after
        assert sorted(after[2:]) == [(0, 300_000), (1, 300_000)], after

        cursor = box.journal_cursor()
        box.run(["systemctl", "stop", UNIT_NAME], check=True, timeout=200)
        assert limits_w(app) == [450, 450]
        journal = box.journal("-u", UNIT_NAME, "-o", "cat", after=cursor)
        assert "power limit 300 W -> 450 W (the card's default)" in journal
        assert not box.path("/run/llm-appliance-gpu-power.json").exists()
    finally:
        box.run(["systemctl", "stop", UNIT_NAME], timeout=200)
        box.run(["systemctl", "reset-failed", UNIT_NAME])
        app.set_drop_in(None)
