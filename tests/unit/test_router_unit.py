"""The router's canonical unit, systemd/vllm-router.service: it parses, it is hardened
beyond ours (exposure <= 2: the router needs no GPU, no state, no file of its own), and
it runs what the role installs with the arguments the role writes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.test_systemd_unit import (
    _analyze,
    _hardening_lines,
    _one,
    _seconds,
    _service,
    needs_systemd_analyze,
)

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "vllm-router.service"
EXEC_START = "/opt/vllm-router/venv/bin/vllm-router"
MAX_EXPOSURE = 2.0


@pytest.fixture(scope="module")
def text() -> str:
    return UNIT.read_text(encoding="utf-8")


def test_lifecycle(text: str) -> None:
    service = _service(text)
    assert _one(service, "Type") == "exec"  # no sd_notify in the router
    assert _one(service, "Restart") == "on-failure"
    assert _seconds(_one(service, "RestartSec")) > 0
    assert _one(service, "ExecStart") == f"{EXEC_START} $VLLM_ROUTER_ARGS"
    assert _one(service, "EnvironmentFile") == "/etc/vllm-router/router.env"
    assert _one(service, "DynamicUser") == "yes"


def test_hardening_block_sorted(text: str) -> None:
    keys = [
        line.partition("=")[0]
        for line in _hardening_lines(text)
        if line and not line.startswith("#")
    ]
    assert keys == sorted(keys)
    for key in ("PrivateDevices", "MemoryDenyWriteExecute", "ProtectSystem", "PrivateUsers"):
        assert key in keys


def _verifiable_copy(tmp_path: Path, text: str) -> Path:
    stub = tmp_path / "vllm-router"
    stub.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    stub.chmod(0o755)
    copy = tmp_path / "vllm-router.service"
    copy.write_text(text.replace(f"ExecStart={EXEC_START} ", f"ExecStart={stub} "), "utf-8")
    return copy


@needs_systemd_analyze
def test_systemd_analyze_verify_is_silent(tmp_path: Path, text: str) -> None:
    result = _analyze("verify", "--man=no", str(_verifiable_copy(tmp_path, text)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@needs_systemd_analyze
def test_systemd_analyze_security_exposure_at_most_2(tmp_path: Path, text: str) -> None:
    unit = _verifiable_copy(tmp_path, text)
    result = _analyze("security", "--offline=yes", "--no-pager", str(unit))
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", result.stdout)
    assert match, result.stdout[-2000:]
    assert float(match.group(1)) <= MAX_EXPOSURE, result.stdout


ACCESS_UNIT = UNIT.with_name("vllm-router-access.service")


def test_access_unit_loads_the_table_before_the_router() -> None:
    service = _service(ACCESS_UNIT.read_text(encoding="utf-8"))
    assert _one(service, "Type") == "oneshot"
    assert _one(service, "RemainAfterExit") == "yes"
    assert _one(service, "ExecStart") == "/usr/sbin/nft -f /etc/vllm-router/access.nft"
    assert _one(service, "ExecReload") == _one(service, "ExecStart")
    assert "ExecStop" not in service  # a stopped unit leaves the table: closed, not open


@needs_systemd_analyze
def test_access_unit_verify_is_silent(tmp_path: Path) -> None:
    text = ACCESS_UNIT.read_text(encoding="utf-8")
    stub = tmp_path / "nft"
    stub.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    stub.chmod(0o755)
    copy = tmp_path / ACCESS_UNIT.name
    copy.write_text(text.replace("/usr/sbin/nft ", f"{stub} "), "utf-8")
    result = _analyze("verify", "--man=no", str(copy))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
