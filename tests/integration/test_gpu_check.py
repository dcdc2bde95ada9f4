"""`scripts/gpu-check --out DIR` run as an operator runs it, against the fake pynvml
(forced with GPU_CHECK_FAKE=1, so a CI box with a GPU gets the same figures): every check
holds, one ✓ line each, and the JSON carries the figures behind them; and a broken fake
(an engine's memory on the wrong GPU, a dead engine's memory never released) makes the
lines that judge those fail, clearly and without hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKS = ("placement", "telemetry", "restart", "doctor", "heat", "cleanup", "swap", "sleep")
GIB = 1024**3

pytestmark = pytest.mark.slow


def _gpu_check(out: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu-check"), "--out", str(out)],
        env={**os.environ, "PYTHON": sys.executable, "GPU_CHECK_FAKE": "1", **env},
        capture_output=True,
        text=True,
        timeout=240,  # the fake check takes seconds; a hang must not take the suite with it
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line[:2] in ("✓ ", "✗ ")]
    return proc, lines


def _figures(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "gpu-check.json").read_text())
    return doc


def test_every_gpu_check_holds_against_the_fake(tmp_path: Path) -> None:
    proc, lines = _gpu_check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no NVIDIA GPU here" in proc.stdout.splitlines()[0]
    assert "fake pynvml" in proc.stdout.splitlines()[0]
    assert [line.split(":")[0] for line in lines] == [f"✓ {name}" for name in CHECKS]
    assert "PASS in" in proc.stdout.splitlines()[-1]
    assert (tmp_path / "gpu-check.txt").read_text().splitlines()[1:-1] == lines

    doc = _figures(tmp_path)
    assert doc["ok"] is True and doc["mode"] == "fake" and doc["elapsed_s"] > 0
    checks = doc["checks"]
    assert [e.split(" (")[0] for e in checks["placement"]["engines"]] == [
        "engine 0 on GPU [0]",
        "engine 1 on GPU [1]",
    ]
    assert all("its processes: 24.0 GiB" in e for e in checks["placement"]["engines"])
    gpu0 = checks["telemetry"]["gpus"]["0"]
    assert (gpu0["temperature_c"], gpu0["power_w"], gpu0["power_limit_w"]) == (41, 72, 700)
    # The fake's 0.6 GiB base plus the engine's 30 % of 80 GiB.
    assert gpu0["memory_used_bytes"] == 600 * 1024**2 + int(0.3 * 80 * GIB)
    restart = checks["restart"]
    assert restart["restarts"] == 1
    # The new engine started only once NVML showed the old one's memory free.
    assert 0 < restart["released_s"] <= restart["starting_s"] + 0.25
    assert restart["starting_s"] < restart["ready_s"]
    assert checks["doctor"]["driver_version"] == "570.124.06"
    heat = checks["heat"]
    assert heat["soft_limit_c"] == 39 and heat["levels_hot"] == [1, 1]
    assert checks["cleanup"]["exit_code"] == 0 and checks["cleanup"]["left"] == []
    assert checks["cleanup"]["memory_used"] == {"0": 600 * 1024**2, "1": 600 * 1024**2}
    # Two on-demand models taking turns on GPU 0, each 55 % of its 80 GiB: the next one
    # loading only once NVML shows the last one's memory back, and both answering; with
    # swap = "sleep" the first is asleep (its memory given back) and later woken.
    for line, how in (("swap", ["cold", "cold"]), ("sleep", ["cold", "wake"])):
        turns = checks[line]["turns"]
        a, b = f"{line}-a", f"{line}-b"
        assert [(t["from"], t["to"], t["how"]) for t in turns] == [(a, b, how[0]), (b, a, how[1])]
        for t in turns:
            assert t["held_bytes"] == int(0.55 * 80 * GIB) and t["on_gpu"] and t["in_order"]
            assert 0 < t["released_s"] <= t["loading_s"] + 0.25 < t["loaded_s"] + 0.25
        assert checks[line]["exit_code"] == 0


def test_a_broken_fake_fails_the_checks_it_breaks(tmp_path: Path) -> None:
    proc, lines = _gpu_check(tmp_path, GPU_CHECK_FAULT="wrong-gpu,leak")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "broken on purpose: wrong-gpu,leak" in proc.stdout.splitlines()[0]
    by_name = {line[2:].split(":")[0]: line for line in lines}
    assert list(by_name) == list(CHECKS)
    assert by_name["placement"].startswith("✗ placement: engine 0's 24.0 GiB not on GPU 0")
    assert "holds memory of engine(s) [1]" in by_name["placement"]
    assert by_name["restart"].startswith(
        "✗ restart: GPU 0 memory never released: 24.6 GiB in use 10 s after SIGKILL"
    )
    assert by_name["cleanup"].startswith("✗ cleanup: GPU 0 memory not back")
    assert by_name["swap"] == "✗ swap: not run: the first daemon did not clean up"
    assert by_name["sleep"] == "✗ sleep: not run: the first daemon did not clean up"
    assert "FAIL in" in proc.stdout.splitlines()[-1]
    doc = _figures(tmp_path)
    assert doc["ok"] is False and doc["checks"]["restart"]["released_s"] is None


def test_the_swap_check_fails_when_the_models_memory_is_not_on_their_gpu(
    tmp_path: Path,
) -> None:
    proc, lines = _gpu_check(tmp_path, GPU_CHECK_FAULT="wrong-gpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    by_name = {line[2:].split(":")[0]: line for line in lines}
    assert by_name["cleanup"].startswith("✓ cleanup")
    for line in ("swap", "sleep"):
        assert by_name[line].startswith(
            f"✗ {line}: {line}-a's memory not on GPU 0; {line}-b's memory not on GPU 0; "
            f"{line}-a (0.0 GiB) → {line}-b"
        )
