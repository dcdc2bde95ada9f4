"""The canonical unit, systemd/llm-appliance.service: it parses, it is hardened, it fits.

`systemd-analyze verify` exits 0 even on "Unknown key" and "Failed to parse", so its
stderr must be empty too. It also insists that ExecStart's binary exists, so it runs on
a copy whose ExecStart names a stub in tmp_path (same arguments).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "llm-appliance.service"
EXEC_START = "/opt/llm-appliance/venv/bin/llm-appliance"
MAX_EXPOSURE = 2.5
DRAIN_TIMEOUT_S = 120  # [restart] drain_timeout_s default (CONTRACT.md)
ENGINE_STOP_S = 30  # SIGTERM..SIGKILL of an engine's process tree
STARTUP_TIMEOUT_S = 900  # [engine] startup_timeout_s default (CONTRACT.md)

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed"
)

_SPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0}


def _entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in file order."""
    section = ""
    out: list[tuple[str, str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {raw!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def _service(text: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for section, key, value in _entries(text):
        if section == "Service":
            values.setdefault(key, []).append(value)
    return values


def _one(values: dict[str, list[str]], key: str) -> str:
    assert key in values, f"{key}= missing"
    assert len(values[key]) == 1, f"{key}= set more than once"
    return values[key][0]


def _seconds(span: str) -> float:
    """A systemd time span ("180s", "20min", "2min 30s", "90") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span)
    assert parts and "".join(n + u for n, u in parts) == span.replace(" ", ""), span
    return sum(float(n) * _SPAN_UNITS[u or "s"] for n, u in parts)


@pytest.fixture(scope="module")
def text() -> str:
    return UNIT.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def service(text: str) -> dict[str, list[str]]:
    return _service(text)


def _hardening_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# --- Hardening"))
    block: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("["):
            break
        block.append(line)
    return block


def test_lifecycle_settings(service: dict[str, list[str]]) -> None:
    assert _one(service, "Type") == "notify"
    assert _one(service, "NotifyAccess") == "main"
    assert _one(service, "KillMode") == "mixed"
    assert _seconds(_one(service, "WatchdogSec")) > 0
    assert _one(service, "Restart") == "on-failure"
    assert _seconds(_one(service, "RestartSec")) > 0
    assert set(_one(service, "RestartPreventExitStatus").split()) == {"2", "3"}
    assert _one(service, "ExecStart") == f"{EXEC_START} serve"
    assert _one(service, "ExecReload") == "/bin/kill -HUP $MAINPID"


def test_only_the_power_limit_runs_privileged(service: dict[str, list[str]]) -> None:
    """'+' (full privileges) on exactly two commands: gpu-power apply before the daemon,
    restore after it (also after a crash); the daemon itself runs unprivileged. '-': their
    failure does not fail the start (a failed ExecStartPre= would be restarted even for a
    bad config, which RestartPreventExitStatus= only stops for the main process)."""
    privileged = [
        (key, value)
        for key, values in service.items()
        for value in values
        if key.startswith("Exec") and value.startswith(("+", "!", "-+", "+-", "@+"))
    ]
    assert sorted(privileged) == [
        ("ExecStartPre", f"-+{EXEC_START} gpu-power apply"),
        ("ExecStopPost", f"-+{EXEC_START} gpu-power restore"),
    ]
    assert _one(service, "ExecStart") == f"{EXEC_START} serve"
    assert _one(service, "User") == "llm-appliance"
    assert _one(service, "CapabilityBoundingSet") == ""


def test_timeouts_cover_drain_and_model_loading(service: dict[str, list[str]]) -> None:
    assert _seconds(_one(service, "TimeoutStopSec")) > DRAIN_TIMEOUT_S + ENGINE_STOP_S
    assert _seconds(_one(service, "TimeoutStartSec")) > STARTUP_TIMEOUT_S


def test_identity_and_directories(service: dict[str, list[str]]) -> None:
    assert _one(service, "User") == "llm-appliance"
    assert _one(service, "Group") == "llm-appliance"
    assert _one(service, "StateDirectory") == "llm-appliance"
    assert _one(service, "StateDirectoryMode") == "0700"
    assert _one(service, "RuntimeDirectory") == "llm-appliance"
    assert _one(service, "ConfigurationDirectory") == "llm-appliance"
    assert _one(service, "UMask") == "0077"
    assert "LLM_APPLIANCE_CONFIG=/etc/llm-appliance/config.toml" in service["Environment"]
    assert _one(service, "LimitNOFILE") == "65536"


def test_gpu_stays_reachable(service: dict[str, list[str]]) -> None:
    assert "PrivateDevices" not in service, "PrivateDevices hides /dev/nvidia*"
    assert "ProcSubset" not in service, "NVML reads /proc/driver/nvidia"
    assert "PrivateNetwork" not in service, "the gateway serves the LAN"
    assert "IPAddressDeny" not in service, "LAN clients must reach the gateway"
    assert _one(service, "MemoryDenyWriteExecute") == "no"
    assert _one(service, "DevicePolicy") == "closed"
    allowed = {value.split()[0] for value in service["DeviceAllow"]}
    assert {"char-nvidiactl", "char-nvidia-uvm", "char-nvidia"} <= allowed


def test_hardening_block_sorted_and_exceptions_commented(text: str) -> None:
    block = _hardening_lines(text)
    keys = [line.partition("=")[0] for line in block if line and not line.startswith("#")]
    assert keys, "no hardening block"
    assert keys == sorted(keys)
    for key in (
        "CapabilityBoundingSet",
        "NoNewPrivileges",
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "SystemCallFilter",
        "RestrictAddressFamilies",
    ):
        assert key in keys
    for i, line in enumerate(block):
        if line.startswith(("DeviceAllow=", "MemoryDenyWriteExecute=")):
            assert block[i - 1].startswith("#"), f"GPU exception without a comment: {line}"


def _verifiable_copy(tmp_path: Path, text: str) -> Path:
    stub = tmp_path / "llm-appliance"
    stub.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    stub.chmod(0o755)
    assert f"ExecStart={EXEC_START} " in text
    copy = tmp_path / "llm-appliance.service"
    for key in ("ExecStart=", "ExecStartPre=-+", "ExecStopPost=-+"):
        text = text.replace(f"{key}{EXEC_START} ", f"{key}{stub} ")
    copy.write_text(text, "utf-8")
    return copy


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEMD_")}
    env["SYSTEMD_COLORS"] = "0"
    env["SYSTEMD_PAGER"] = "cat"
    return subprocess.run(
        [SYSTEMD_ANALYZE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


@needs_systemd_analyze
def test_systemd_analyze_verify_is_silent(tmp_path: Path, text: str) -> None:
    unit = _verifiable_copy(tmp_path, text)
    result = _analyze("verify", "--man=no", str(unit))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@needs_systemd_analyze
def test_systemd_analyze_verify_would_catch_a_bad_key(tmp_path: Path, text: str) -> None:
    """The check above is worth something: a typo'd key does reach stderr."""
    unit = _verifiable_copy(tmp_path, text.replace("KillMode=mixed", "KillMode=mixed\nKilMode=x"))
    result = _analyze("verify", "--man=no", str(unit))
    assert "KilMode" in result.stderr


@needs_systemd_analyze
def test_systemd_analyze_security_exposure(tmp_path: Path, text: str) -> None:
    unit = _verifiable_copy(tmp_path, text)
    result = _analyze("security", "--offline=yes", "--no-pager", str(unit))
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert match, result.stdout[-2000:]
    exposure = float(match.group(1))
    assert exposure <= MAX_EXPOSURE, result.stdout
