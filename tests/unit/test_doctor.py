"""`llm-appliance doctor`, the GPU and engine checks, each against a faked machine: the
scripted pynvml, engine "venvs" that are tiny scripts, model folders in temp dirs, a
foreign process on an engine port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pynvml as real_pynvml
import pytest

from appliance.config import Config, parse_config
from appliance.doctor import engine as engine_mod
from appliance.doctor.engine import (
    check_engine_venv,
    check_model,
    check_ports,
    check_socket_dir,
    probe_venv,
)
from appliance.doctor.gpu import check_nvidia, probe_nvidia
from appliance.doctor.host import is_appliance_process
from appliance.doctor.result import Account, Result, fail
from appliance.proctree import TAG_ENV, port_holder

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # tests/ is not on sys.path by default (no rootdir conftest)
    sys.path.insert(0, _ROOT)

from tests.fakes.fake_pynvml import (  # noqa: E402
    FakeGpu,
    FakeNvml,
    LibraryNotFound,
    NotSupported,
)

GIB = 2**30
ME = Account.current()
STRANGER = Account("stranger", 65534, 65534, frozenset({65534}), "/nonexistent")


def _by_name(results: list[Result]) -> dict[str, Result]:
    return {r.name: r for r in results}


# --- Result -------------------------------------------------------------------------------


def test_a_failed_check_must_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="without saying what to do"):
        Result("x", "fail", "broken")
    assert fail("x", "broken", "fix it").to_json()["symbol"] == "✗"


# --- NVIDIA -------------------------------------------------------------------------------


def test_no_driver_on_a_cpu_box_is_not_applicable_with_the_reason() -> None:
    probe = probe_nvidia(FakeNvml(init_error=LibraryNotFound).module)
    [line] = check_nvidia(probe, device="auto", driver_loaded=False)
    assert line.status == "na"
    assert "no NVIDIA driver" in line.detail and "CPU" in line.detail


def test_no_driver_when_the_config_wants_cuda_is_a_failure() -> None:
    probe = probe_nvidia(FakeNvml(init_error=LibraryNotFound).module)
    [line] = check_nvidia(probe, device="cuda", driver_loaded=False)
    assert line.status == "fail" and "install the NVIDIA driver" in line.fix


def test_a_loaded_driver_whose_nvml_fails_is_a_failure_not_a_quiet_cpu_fallback() -> None:
    nvml = FakeNvml(init_error=real_pynvml.NVMLError_LibRmVersionMismatch)
    [line] = check_nvidia(probe_nvidia(nvml.module), device="auto", driver_loaded=True)
    assert line.status == "fail"
    assert "driver is loaded" in line.detail and "reboot" in line.fix


def test_each_gpu_shows_name_memory_temperature_power_limit_and_persistence() -> None:
    nvml = FakeNvml(
        [
            FakeGpu(temperature_c=41, memory_total=24 * GIB, memory_used=GIB // 2),
            FakeGpu(name="NVIDIA RTX A6000", power_limit_mw=300_000, persistence_mode=0),
        ],
        driver_version="570.124.06",
    )
    lines = _by_name(check_nvidia(probe_nvidia(nvml.module), device="auto"))
    assert lines["nvidia"].status == "ok"
    assert lines["nvidia"].detail == "driver 570.124.06, 2 GPU(s)"
    gpu0, gpu1 = lines["gpu0"], lines["gpu1"]
    assert gpu0.status == gpu1.status == "ok"
    assert "NVIDIA GeForce RTX 4090" in gpu0.detail and "24.0 GiB (512 MiB used)" in gpu0.detail
    assert "41 °C" in gpu0.detail and "power limit 450 W" in gpu0.detail
    assert "persistence on" in gpu0.detail
    assert "NVIDIA RTX A6000" in gpu1.detail and "power limit 300 W" in gpu1.detail
    assert "persistence off" in gpu1.detail and "nvidia-persistenced" in gpu1.detail
    assert nvml.refcount == 0  # NVML shut down again


def test_the_power_limit_in_force_is_compared_with_the_config() -> None:
    nvml = FakeNvml(
        [
            FakeGpu(power_limit_mw=300_000),  # as configured
            FakeGpu(),  # the card's default: not applied (the service is stopped)
            FakeGpu(power_limit_mw=250_000, power_constraints_mw=(100_000, 250_000)),  # clamped
            FakeGpu(power_limit_mw=320_000),  # not one of the engines' GPUs
        ]
    )
    lines = _by_name(
        check_nvidia(
            probe_nvidia(nvml.module), device="auto", gpus_setting=[0, 1, 2], power_limit_w=300
        )
    )
    assert all(lines[f"gpu{i}"].status == "ok" for i in range(4))
    assert "power limit 300 W (card default 450 W) as thermal.power_limit_w sets it" in (
        lines["gpu0"].detail
    )
    assert "power limit 450 W, not thermal.power_limit_w's 300 W" in lines["gpu1"].detail
    assert "gpu-power apply" in lines["gpu1"].detail
    assert "power limit 250 W (card default 450 W) as thermal.power_limit_w" in (
        lines["gpu2"].detail
    )
    assert "power limit 320 W (card default 450 W), " in lines["gpu3"].detail
    assert "thermal.power_limit_w" not in lines["gpu3"].detail
    assert lines["gpu0"].data["power_default_w"] == 450


def test_a_sensor_the_card_does_not_support_is_unknown_not_a_failure() -> None:
    nvml = FakeNvml([FakeGpu(power_limit_mw=NotSupported, persistence_mode=NotSupported)])
    [_, gpu0] = check_nvidia(probe_nvidia(nvml.module), device="auto")
    assert gpu0.status == "ok"
    assert "power limit ?" in gpu0.detail and "persistence ?" in gpu0.detail


def test_another_process_holding_the_memory_an_engine_needs_is_named() -> None:
    nvml = FakeNvml([FakeGpu(memory_total=24 * GIB, processes=[(4242, 8 * GIB), (77, 20 * GIB)])])

    def describe(pid: int) -> tuple[str, bool]:
        return (f"python (pid {pid})", pid == 77)  # 77 is one of our engines

    [_, gpu0] = check_nvidia(
        probe_nvidia(nvml.module), device="auto", gpu_memory_utilization=0.9, describe_pid=describe
    )
    assert gpu0.status == "fail"
    assert "python (pid 4242): 8.0 GiB" in gpu0.detail and "pid 77" not in gpu0.detail
    assert "nvidia-smi --query-compute-apps" in gpu0.fix


def test_a_small_foreign_process_that_leaves_room_is_reported_but_passes() -> None:
    nvml = FakeNvml([FakeGpu(memory_total=24 * GIB, processes=[(4242, GIB // 4)])])
    [_, gpu0] = check_nvidia(
        probe_nvidia(nvml.module),
        device="auto",
        gpu_memory_utilization=0.5,
        describe_pid=lambda pid: (f"pid {pid}", False),
    )
    assert gpu0.status == "ok" and "held by pid 4242: 256 MiB" in gpu0.detail


def test_foreign_memory_on_a_gpu_no_engine_uses_is_not_a_failure() -> None:
    nvml = FakeNvml([FakeGpu(), FakeGpu(memory_total=24 * GIB, processes=[(9, 23 * GIB)])])
    lines = _by_name(
        check_nvidia(
            probe_nvidia(nvml.module),
            device="auto",
            gpus_setting=[0],
            describe_pid=lambda pid: (f"pid {pid}", False),
        )
    )
    assert lines["gpu1"].status == "ok" and lines["gpu1"].data["used_by_engines"] is False


def test_engine_gpus_naming_a_missing_gpu_fails() -> None:
    nvml = FakeNvml([FakeGpu()])
    lines = _by_name(check_nvidia(probe_nvidia(nvml.module), device="auto", gpus_setting=[0, 1]))
    assert lines["nvidia"].status == "fail" and "[1]" in lines["nvidia"].detail


# --- the engine venv ---------------------------------------------------------------------


def _fake_venv(tmp: Path, vllm_body: str, torch_body: str | None = None) -> Path:
    """A "venv python": a shell script that runs this interpreter with stub vllm (and
    torch) packages first on the path."""
    site = tmp / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(textwrap.dedent(vllm_body))
    if torch_body is not None:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(textwrap.dedent(torch_body))
    python = tmp / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


CPU_TORCH = """
    import types
    __version__ = "2.13.0+cpu"
    version = types.SimpleNamespace(cuda=None)
"""
CUDA_TORCH = """
    import types
    __version__ = "2.13.0"
    version = types.SimpleNamespace(cuda="12.8")
"""


def _venv_config(python: Path) -> Config:
    return parse_config({"engine": {"python": str(python)}})


def _probe(python: str) -> engine_mod.VenvProbe:
    return probe_venv(python, env=dict(os.environ), timeout_s=30)


def test_a_missing_engine_venv_fails_with_the_setup_command(tmp_path: Path) -> None:
    config = parse_config({})
    line = check_engine_venv(config, tmp_path, device="cpu", probe=_probe)
    assert line.status == "fail"
    assert str(tmp_path / "engine-venv" / "bin" / "python") in line.detail
    assert "llm-appliance setup --device cpu" in line.fix


def test_the_engine_python_reports_vllm_and_its_build(tmp_path: Path) -> None:
    # vLLM logs to stdout while it imports; the answer is found after that.
    python = _fake_venv(tmp_path, 'print("INFO platform cpu")\n__version__ = "0.32.0"\n', CPU_TORCH)
    line = check_engine_venv(_venv_config(python), tmp_path, device="cpu", probe=_probe)
    assert line.status == "ok", line
    assert line.detail.startswith("vLLM 0.32.0 (vllm, CPU build; torch 2.13.0+cpu)")
    assert line.data["vllm_version"] == "0.32.0" and line.data["build"] == "cpu"


def test_a_cuda_build_on_a_cpu_box_fails(tmp_path: Path) -> None:
    python = _fake_venv(tmp_path, '__version__ = "0.32.0"\n', CUDA_TORCH)
    line = check_engine_venv(_venv_config(python), tmp_path, device="cpu", probe=_probe)
    assert line.status == "fail" and "CUDA build" in line.detail
    assert "the engines run on CPU" in line.detail
    assert "--device cpu" in line.fix


def test_an_engine_python_that_cannot_import_vllm_fails_with_the_error(tmp_path: Path) -> None:
    python = _fake_venv(tmp_path, 'raise ImportError("libcudart.so.12: cannot open")\n')
    line = check_engine_venv(_venv_config(python), tmp_path, device="cpu", probe=_probe)
    assert line.status == "fail" and "libcudart.so.12" in line.detail


def test_an_engine_python_that_hangs_is_given_up_on(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 60\n")
    python.chmod(0o755)
    answer = probe_venv(str(python), env=dict(os.environ), timeout_s=0.5)
    assert answer.answer is None and "within 0 s" in str(answer.problem)
    line = check_engine_venv(_venv_config(python), tmp_path, device="cpu", probe=lambda _: answer)
    assert line.status == "fail" and "import vllm" in line.fix


# --- the model ----------------------------------------------------------------------------


def _model(folder: Path, weights_bytes: int = 1024) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(weights_bytes)  # sparse: its size counts, no disk is used
    return folder


def test_the_packaged_model_missing_fails_with_the_setup_command(tmp_path: Path) -> None:
    line = check_model(parse_config({}), tmp_path, device="cpu", account=ME, env={})
    assert line.status == "fail" and "llm-appliance setup" in line.fix


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every account may enter (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="doctor-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_a_model_the_service_account_cannot_read_is_named(open_dir: Path) -> None:
    model = _model(open_dir / "m")
    model.chmod(0o755)
    (model / "config.json").chmod(0o644)
    config = parse_config({"engine": {"model": str(model)}})
    assert check_model(config, open_dir, device="cpu", account=STRANGER, env={}).status == "ok"
    (model / "model.safetensors").chmod(0o600)
    line = check_model(config, open_dir, device="cpu", account=STRANGER, env={})
    assert line.status == "fail"
    assert line.detail.endswith(
        "stranger cannot read " + f"{model}/model.safetensors (0600, owner {ME.name})"
    )
    assert line.fix == f"chown -R {STRANGER.chown_spec} {model} (or make it world-readable)"


def test_model_size_against_the_gpu_budget(tmp_path: Path) -> None:
    big = _model(tmp_path / "big", weights_bytes=30 * GIB)
    small = _model(tmp_path / "small", weights_bytes=2 * GIB)
    for model, status in ((big, "fail"), (small, "ok")):
        config = parse_config({"engine": {"model": str(model), "gpu_memory_utilization": 0.9}})
        line = check_model(
            config, tmp_path, device="cuda", account=ME, env={}, gpu_totals=[24 * GIB, 48 * GIB]
        )
        assert line.status == status, line
        assert "GPU budget 21.6 GiB (24.0 GiB × 0.9)" in line.detail
    assert "19.6 GiB left for the KV cache" in line.detail


def test_a_model_id_is_looked_up_in_the_local_cache_only(tmp_path: Path) -> None:
    config = parse_config({"engine": {"model": "HuggingFaceTB/SmolLM2-360M-Instruct"}})
    missing = check_model(config, tmp_path, device="cpu", account=ME, env={"HOME": str(tmp_path)})
    assert missing.status == "fail" and "never downloaded" in missing.fix
    repo = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-360M-Instruct"
    _model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    found = check_model(
        config, tmp_path, device="cpu", account=ME, env={"HF_HUB_CACHE": str(tmp_path / "hub")}
    )
    assert found.status == "ok" and found.data["path"].endswith("snapshots/abc123")


def test_an_engine_venv_the_unit_cannot_see_fails_under_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_mod, "HIDDEN_BY_UNIT", (str(tmp_path),))
    python = _fake_venv(tmp_path, '__version__ = "0.32.0"\n', CPU_TORCH)
    config = _venv_config(python)
    line = check_engine_venv(config, tmp_path, device="cpu", probe=_probe, under_unit=True)
    assert line.status == "fail" and "ProtectHome" in line.detail
    assert check_engine_venv(config, tmp_path, device="cpu", probe=_probe).status == "ok"


def test_a_model_the_unit_cannot_see_fails_under_systemd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_mod, "HIDDEN_BY_UNIT", (str(tmp_path),))
    config = parse_config({"engine": {"model": str(_model(tmp_path / "m"))}})
    line = check_model(config, tmp_path, device="cpu", account=ME, env={}, under_unit=True)
    assert line.status == "fail" and "ProtectHome" in line.detail
    plain = check_model(config, tmp_path, device="cpu", account=ME, env={}, under_unit=False)
    assert plain.status == "ok"


# --- engine sockets and ports -------------------------------------------------------------


def test_socket_dir_absent_is_not_applicable(tmp_path: Path) -> None:
    assert check_socket_dir(tmp_path / "nope", ME).status == "na"


def test_socket_dir_open_to_others_or_someone_elses_fails(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    line = check_socket_dir(d, ME)
    assert line.status == "fail" and "0755" in line.detail and "chmod 700" in line.fix
    d.chmod(0o700)
    other = check_socket_dir(d, STRANGER)
    assert other.status == "fail" and "not stranger" in other.detail


def test_socket_dir_of_ours_lists_the_engine_sockets(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "engine0.sock"))
        line = check_socket_dir(d, ME)
    assert line.status == "ok" and "engine0.sock" in line.detail and "0700" in line.detail


@pytest.fixture
def listener() -> Iterator[int]:
    """A foreign process (this test's own) listening on a port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_foreign_process_on_an_engine_port_is_named(listener: int) -> None:
    free = _free_port()
    line = check_ports([listener, free], holder=port_holder, is_ours=is_appliance_process)
    assert line.status == "fail"
    assert f"{listener} held by" in line.detail and f"(pid {os.getpid()})" in line.detail
    assert f"free: {free}" in line.detail
    assert "engine.port_base" in line.fix


def test_a_port_held_by_our_own_engine_passes() -> None:
    code = (
        "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); time.sleep(60)"
    )
    env = {**os.environ, TAG_ENV: "doctor-test-0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        line = check_ports([port], holder=port_holder, is_ours=is_appliance_process)
    finally:
        proc.kill()
        proc.wait()
    assert line.status == "ok" and f"{port} (engine, pid {proc.pid})" in line.detail
