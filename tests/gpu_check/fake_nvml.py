"""The fake `pynvml` the GPU check uses on a machine without an NVIDIA GPU.

The daemon, `doctor` and the check itself are separate processes, and each must see the
same GPUs, with the memory the stand-in engines "took" and lose when they die. So the
fake's state lives in a directory (``$GPU_CHECK_FAKE_NVML``):

- ``state.json``: the GPUs' sensors, written by the check (it may change them while the
  daemon runs), and an optional ``fault`` (see :data:`FAULTS`);
- ``procs/<pid>.json``: ``{"pid", "gpu", "share"}``, written by a stand-in engine's
  memory holder (tests/fakes/fake_engine.py ``--gpu-share``) when it takes its share.

``pynvml.py`` in that directory (:func:`write_shim`), put first on a process's
PYTHONPATH, replaces the module with ``tests/fakes/fake_pynvml.FakeNvml`` whose sensors
are refreshed from these files before every call. A holder's memory counts while its
process lives, as the driver's accounting does: a SIGKILLed engine's memory is released
once it is gone (a zombie holds none).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAKE_DIR_ENV = "GPU_CHECK_FAKE_NVML"
# Broken fakes, to prove the check fails (GPU_CHECK_FAULT, comma-separated):
# wrong-gpu: each engine's memory shows up on the next GPU, not the one it was given;
# leak: a dead engine's memory is never released.
FAULTS = ("wrong-gpu", "leak")
GIB = 1024**3

_SHIM = '''"""pynvml for the GPU check without a GPU: see tests/gpu_check/fake_nvml.py."""
from tests.gpu_check.fake_nvml import install_from_env

install_from_env()
'''


def default_gpu(index: int) -> dict[str, Any]:
    """An H100-like fake GPU, idle and cool (raw NVML units: mW, bytes, MHz, percent)."""
    return {
        "name": "NVIDIA H100 80GB HBM3 (fake)",
        "temperature_c": 41 + 3 * index,
        "power_mw": 72_000,
        "power_limit_mw": 700_000,
        "memory_base": 600 * 1024**2,  # driver and context, with no engine
        "memory_total": 80 * GIB,
        "utilization_pct": 0,
        "sm_clock_mhz": 1980,
        "clock_reasons": 0,
    }


def write_state(directory: Path, gpus: list[dict[str, Any]], fault: str = "") -> None:
    """(Re)write the fake's state atomically; the fake re-reads it on every call."""
    (directory / "procs").mkdir(parents=True, exist_ok=True)
    tmp = directory / ".state.json.tmp"
    tmp.write_text(json.dumps({"gpus": gpus, "fault": fault, "driver_version": "570.124.06"}))
    tmp.replace(directory / "state.json")


def write_shim(directory: Path) -> Path:
    """``pynvml.py`` in ``directory``: put the directory first on PYTHONPATH."""
    path = directory / "pynvml.py"
    path.write_text(_SHIM)
    return path


def _alive(pid: int) -> bool:
    """Running and not a zombie: a dead process's GPU memory is released by the driver."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _holders(directory: Path, fault: set[str]) -> list[dict[str, Any]]:
    out = []
    for path in (directory / "procs").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if "leak" in fault or _alive(int(record["pid"])):
                out.append(record)
    return out


def refresh(fake: Any, directory: Path) -> None:
    """Copy the state files into ``fake`` (a FakeNvml) before a call."""
    state = json.loads((directory / "state.json").read_text())
    fault = set(filter(None, str(state.get("fault", "")).split(",")))
    holders = _holders(directory, fault)
    count = len(fake.gpus)
    fake.driver_version = state.get("driver_version", fake.driver_version)
    for i, (gpu, doc) in enumerate(zip(fake.gpus, state["gpus"], strict=True)):
        on = [h for h in holders if (int(h["gpu"]) + ("wrong-gpu" in fault)) % count == i]
        total = int(doc["memory_total"])
        procs = tuple((int(h["pid"]), int(float(h["share"]) * total)) for h in on)
        for key in ("name", "temperature_c", "power_mw", "power_limit_mw", "sm_clock_mhz"):
            setattr(gpu, key, doc[key])
        gpu.clock_reasons = int(doc["clock_reasons"])
        gpu.memory_total = total
        gpu.memory_used = int(doc["memory_base"]) + sum(b for _, b in procs)
        gpu.processes = procs
        gpu.utilization_pct = int(doc["utilization_pct"]) if not procs else 35


def _real_pynvml(skip: Path) -> types.ModuleType:
    """nvidia-ml-py itself (its error classes and constants), found past the shim."""
    path = [p for p in sys.path if Path(p or ".").resolve() != skip.resolve()]
    spec = importlib.machinery.PathFinder.find_spec("pynvml", path)
    if spec is None or spec.loader is None:
        raise ImportError("the GPU check's fake pynvml needs nvidia-ml-py for its constants")
    module = importlib.util.module_from_spec(spec)
    # It sets its NVMLError_* classes on sys.modules[__name__] while it loads.
    sys.modules["pynvml"] = module
    spec.loader.exec_module(module)
    return module


def _refreshing(fn: Callable[..., Any], fake: Any, directory: Path) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        refresh(fake, directory)
        return fn(*args, **kwargs)

    return call


def build(directory: Path) -> types.ModuleType:
    """The fake module, its sensors read from ``directory`` before every call."""
    from tests.fakes.fake_pynvml import FakeGpu, FakeNvml

    state = json.loads((directory / "state.json").read_text())
    fake = FakeNvml(gpus=[FakeGpu() for _ in state["gpus"]])
    refresh(fake, directory)
    module = fake.module
    for name in FakeNvml._FUNCTIONS:
        setattr(module, name, _refreshing(getattr(module, name), fake, directory))
    return module


def install_from_env() -> None:
    """Called by the shim while ``import pynvml`` runs: leave the fake in sys.modules,
    which is what that import statement then returns."""
    directory = Path(os.environ[FAKE_DIR_ENV])
    _real_pynvml(directory)  # in sys.modules: what fake_pynvml imports as _real
    sys.modules["pynvml"] = build(directory)
