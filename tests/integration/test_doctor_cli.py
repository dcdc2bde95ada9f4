"""`llm-appliance doctor --json` on this very machine, as a person would run it: a real
process, the real NVML bindings, the engine venv set-up made (or its absence), and no
daemon running, so the gateway line is ✗ and the exit status says so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from appliance.telemetry import count_nvidia_gpus

CLI = [sys.executable, "-m", "appliance.cli"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed on return: nothing listens there


def test_doctor_json_on_this_machine(tmp_path: Path) -> None:
    port = _closed_port()
    config = tmp_path / "config.toml"
    config.write_text(
        f'[gateway]\nport = {port}\nkeys_file = "{tmp_path / "state" / "keys.json"}"\n'
    )
    proc = subprocess.run(
        [*CLI, "doctor", "--json", "--config", str(config)],
        env={**os.environ, "RUNTIME_DIRECTORY": str(tmp_path / "run")},
        capture_output=True,
        text=True,
        timeout=300,  # the engine venv's `import vllm` takes seconds, more on a busy box
        check=False,
    )
    doc = json.loads(proc.stdout)
    checks = {c["name"]: c for c in doc["checks"]}

    assert checks["config"]["status"] == "ok", checks["config"]
    assert checks["config"]["detail"].startswith(f"config ok ({config})")
    if count_nvidia_gpus() == 0 and not Path("/proc/driver/nvidia/version").exists():
        nvidia = checks["nvidia"]
        assert nvidia["symbol"] == "–" and nvidia["status"] == "na"
        assert "no NVIDIA driver" in nvidia["detail"] and "CPU" in nvidia["detail"]
    gateway = checks["gateway"]
    assert gateway["symbol"] == "✗"
    assert f"cannot reach http://127.0.0.1:{port}/readyz" in gateway["detail"]
    assert "is the service running?" in gateway["fix"]
    failed = [c["name"] for c in doc["checks"] if c["status"] == "fail"]
    assert doc["failed"] == failed and doc["ok"] is False
    assert all(c["fix"] for c in doc["checks"] if c["status"] == "fail")
    assert proc.returncode == 1, proc.stderr
