"""The NVIDIA driver, NVML and each GPU, as the doctor sees them.

:func:`probe_nvidia` reads NVML once (every query on its own, as the telemetry source
does, so a sensor a consumer card does not support is ``None``, not a failed check);
:func:`check_nvidia` judges what was read. "No NVIDIA driver at all" is not a fault on a
CPU box (–), but a driver that is loaded while NVML fails is (✗): then ``device =
"auto"`` would quietly run the engines on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from appliance.doctor.result import Result, fail, gib, na, ok
from appliance.policy.power_limit import clamp_limit_mw

T = TypeVar("T")

# The kernel module's version file: present whenever the NVIDIA driver is loaded.
DRIVER_PROC = Path("/proc/driver/nvidia/version")
# These NVML errors mean "no NVIDIA driver or library here", not "a broken one".
_NO_DRIVER = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
_NVML_FIXES = {
    "NVMLError_LibRmVersionMismatch": "the driver was upgraded but the old kernel module is "
    "still loaded: reboot (or reload the nvidia modules)",
    "NVMLError_NoPermission": "this account may not open /dev/nvidia*: run the doctor as "
    "root or as the service user, and check the device nodes' modes",
    "NVMLError_LibraryNotFound": "install the driver's NVML library (libnvidia-ml.so.1, "
    "package nvidia-utils or libnvidia-compute) matching the loaded kernel module",
}
_GENERIC_FIX = (
    "run `nvidia-smi`: it reports the same problem in NVIDIA's words; reinstall the driver "
    'if it fails too, or set engine.device = "cpu" to run without the GPUs'
)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None: the driver does not say (WDDM, some containers)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str | None = None
    memory_total: int | None = None
    memory_used: int | None = None
    temperature_c: float | None = None
    power_limit_w: float | None = None  # the limit in force (NVML's enforced limit)
    power_default_w: float | None = None  # the card's own default
    power_range_mw: tuple[int, int] | None = None  # what a limit may be set to
    persistence: bool | None = None
    processes: tuple[GpuProcess, ...] | None = None  # None: could not be listed


@dataclass(frozen=True)
class NvidiaProbe:
    error: str | None = None  # why NVML could not be used; None when it could
    error_kind: str = ""  # the NVMLError class name (or "bindings" when pynvml is missing)
    driver_version: str | None = None
    gpus: tuple[GpuInfo, ...] = ()

    @property
    def no_driver(self) -> bool:
        return self.error_kind in _NO_DRIVER


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def probe_nvidia(nvml: Any | None = None) -> NvidiaProbe:
    """What NVML says about the driver and every GPU. ``nvml``: the pynvml module (a fake
    in tests); None imports the real one."""
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError as exc:
            return NvidiaProbe(
                error=f"nvidia-ml-py is not installed ({exc})", error_kind="bindings"
            )
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return NvidiaProbe(error=str(exc), error_kind=type(exc).__name__)
    try:
        count = int(nvml.nvmlDeviceGetCount())
        version = _read(nvml, lambda: _text(nvml.nvmlSystemGetDriverVersion()))
        return NvidiaProbe(driver_version=version, gpus=tuple(_gpu(nvml, i) for i in range(count)))
    except nvml.NVMLError as exc:
        return NvidiaProbe(
            error=f"NVML cannot count the GPUs: {exc}", error_kind=type(exc).__name__
        )
    finally:
        with contextlib.suppress(nvml.NVMLError):  # nothing to undo: we are about to exit
            nvml.nvmlShutdown()


def _read(nvml: Any, fn: Callable[[], T]) -> T | None:
    """One NVML query; an NVMLError (NotSupported on consumer cards, ...) makes it None."""
    try:
        return fn()
    except nvml.NVMLError:
        return None


def _gpu(nvml: Any, index: int) -> GpuInfo:
    handle = _read(nvml, lambda: nvml.nvmlDeviceGetHandleByIndex(index))
    if handle is None:
        return GpuInfo(index)
    memory = _read(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    procs = _read(nvml, lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    persistence = _read(nvml, lambda: nvml.nvmlDeviceGetPersistenceMode(handle))
    limit_mw = _read(nvml, lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    default_mw = _read(nvml, lambda: nvml.nvmlDeviceGetPowerManagementDefaultLimit(handle))
    power_range = _read(nvml, lambda: nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle))
    temperature = _read(
        nvml, lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
    )
    name = _read(nvml, lambda: nvml.nvmlDeviceGetName(handle))
    return GpuInfo(
        index=index,
        name=None if name is None else _text(name),
        memory_total=None if memory is None else int(memory.total),
        memory_used=None if memory is None else int(memory.used),
        temperature_c=None if temperature is None else float(temperature),
        power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
        power_default_w=None if default_mw is None else default_mw / 1000.0,
        power_range_mw=None if power_range is None else (int(power_range[0]), int(power_range[1])),
        persistence=None if persistence is None else persistence == nvml.NVML_FEATURE_ENABLED,
        processes=None
        if procs is None
        else tuple(
            GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in procs
        ),
    )


# --- judging --------------------------------------------------------------------------------


def selected_gpus(gpus_setting: str | list[int], count: int) -> list[int]:
    """The GPUs the engines will use (as plan.py picks them), limited to those present."""
    if isinstance(gpus_setting, list):
        return [g for g in gpus_setting if g < count]
    return list(range(min(count, 8)))


def check_nvidia(
    probe: NvidiaProbe,
    *,
    device: str,
    gpus_setting: str | list[int] = "auto",
    gpu_memory_utilization: float = 0.9,
    driver_loaded: bool = False,
    describe_pid: Callable[[int], tuple[str, bool]] = lambda pid: (f"pid {pid}", False),
    power_limit_w: int = 0,
) -> list[Result]:
    """The "nvidia" line, then one line per GPU.

    ``device``: the config's engine.device; ``driver_loaded``: the kernel module is there
    (``/proc/driver/nvidia/version``); ``describe_pid(pid)`` -> (a label such as
    "python (pid 42)", whether it is one of the appliance's own processes);
    ``power_limit_w``: the config's thermal.power_limit_w, compared with the limit in force
    on the GPUs the engines use.
    """
    if probe.error is not None:
        return [_nvml_unusable(probe, device, driver_loaded)]
    count = len(probe.gpus)
    data = {"driver_version": probe.driver_version, "gpu_count": count}
    if count == 0:
        return [_no_gpu(probe, device, data)]
    head = f"driver {probe.driver_version or '?'}, {count} GPU(s)"
    if device == "cpu":
        lines = [ok("nvidia", f'{head}, not used (engine.device = "cpu")', **data)]
        return lines + [_gpu_line(g, None, describe_pid, 0) for g in probe.gpus]
    first = _nvidia_line(head, gpus_setting, count, data)
    used = set(selected_gpus(gpus_setting, count))
    budget = gpu_memory_utilization
    return [first] + [
        _gpu_line(
            g,
            budget if g.index in used else None,
            describe_pid,
            power_limit_w if g.index in used else 0,
        )
        for g in probe.gpus
    ]


def _no_gpu(probe: NvidiaProbe, device: str, data: dict[str, Any]) -> Result:
    """NVML works and sees no GPU: a failure only where the config asks for CUDA."""
    if device == "cuda":
        return fail(
            "nvidia",
            f"driver {probe.driver_version}, but NVML sees no GPU",
            'check `nvidia-smi`; set engine.device = "auto" or "cpu" to run on the CPU',
            **data,
        )
    return na("nvidia", "NVML works but sees no GPU: the engines run on the CPU", **data)


def _nvidia_line(
    head: str, gpus_setting: str | list[int], count: int, data: dict[str, Any]
) -> Result:
    """The "nvidia" line when GPUs are used: it fails if engine.gpus names absent ones."""
    missing = [g for g in gpus_setting if g >= count] if isinstance(gpus_setting, list) else []
    if missing:
        return fail(
            "nvidia",
            f"{head}, but engine.gpus = {gpus_setting!r} names GPU(s) {missing} that are not there",
            f'set engine.gpus to GPUs 0..{count - 1}, or to "auto"',
            **data,
        )
    return ok("nvidia", head, **data)


def _nvml_unusable(probe: NvidiaProbe, device: str, driver_loaded: bool) -> Result:
    why = f"NVML: {probe.error}"
    data = {"error": probe.error, "error_kind": probe.error_kind, "driver_loaded": driver_loaded}
    if device == "cpu":
        return na("nvidia", f'engine.device = "cpu": the GPUs are not used ({why})', **data)
    if probe.no_driver and not driver_loaded:
        if device == "cuda":
            return fail(
                "nvidia",
                f'engine.device = "cuda", but there is no NVIDIA driver ({why})',
                "install the NVIDIA driver (and nvidia-persistenced), or set "
                'engine.device = "auto"',
                **data,
            )
        return na("nvidia", f"no NVIDIA driver ({why}): the engines run on the CPU", **data)
    if probe.error_kind == "bindings":
        fix = "reinstall the appliance (its venv must have nvidia-ml-py): re-run the Ansible role"
    else:
        fix = _NVML_FIXES.get(probe.error_kind, _GENERIC_FIX)
    loaded = "the NVIDIA driver is loaded but " if driver_loaded else ""
    return fail("nvidia", f"{loaded}NVML cannot be used ({probe.error})", fix, **data)


def _power_part(g: GpuInfo, wanted_w: int) -> str:
    """The limit in force, the card's default when it differs, and whether
    thermal.power_limit_w (``wanted_w``; 0 = not set) is what is in force. Not a failure
    when it is not: `gpu-power restore` puts the default back whenever the service stops,
    and the unit sets it again at start."""
    if g.power_limit_w is None:
        return "power limit ?"
    text = f"power limit {g.power_limit_w:.0f} W"
    if g.power_default_w is not None and round(g.power_default_w) != round(g.power_limit_w):
        text += f" (card default {g.power_default_w:.0f} W)"
    if not wanted_w:
        return text
    want_mw = wanted_w * 1000
    if g.power_range_mw is not None:
        want_mw = clamp_limit_mw(wanted_w, *g.power_range_mw)[0]
    if round(g.power_limit_w) == round(want_mw / 1000):
        return text + " as thermal.power_limit_w sets it"
    return (
        text + f", not thermal.power_limit_w's {want_mw / 1000:.0f} W (the unit sets it at "
        "start: `systemctl restart llm-appliance`, or `sudo llm-appliance gpu-power apply`)"
    )


def _gpu_line(
    g: GpuInfo,
    utilization: float | None,
    describe_pid: Callable[[int], tuple[str, bool]],
    power_limit_w: int,
) -> Result:
    """One GPU; ``utilization``: engine.gpu_memory_utilization when an engine will use it;
    ``power_limit_w``: thermal.power_limit_w for a GPU an engine uses (0 otherwise)."""
    parts = [
        g.name or "unknown GPU",
        f"{gib(g.memory_total)} ({gib(g.memory_used)} used)",
        "temperature ?" if g.temperature_c is None else f"{g.temperature_c:.0f} °C",
        _power_part(g, power_limit_w),
        {True: "persistence on", False: "persistence off", None: "persistence ?"}[g.persistence],
    ]
    foreign = _foreign_processes(g, describe_pid)
    if g.processes is None:
        parts.append("its processes cannot be listed")
    elif foreign:
        parts.append("held by " + ", ".join(f"{label}: {gib(b)}" for label, b in foreign))
    data = _gpu_data(g, foreign, utilization)
    detail = ", ".join(parts)
    if g.persistence is False:
        # Not a fault: without it the driver is torn down and set up again around each
        # engine start, which costs seconds and can lose the device nodes under the unit.
        detail += " (`systemctl enable --now nvidia-persistenced` keeps the driver up)"
    if utilization is not None and foreign and g.memory_total:
        held = sum(b or 0 for _, b in foreign)
        unknown = any(b is None for _, b in foreign)
        if unknown or g.memory_total - held < utilization * g.memory_total:
            return fail(
                f"gpu{g.index}",
                detail,
                f"the engine needs {utilization:.0%} of this GPU's memory free at start: stop "
                "those processes (`nvidia-smi --query-compute-apps=pid,name,used_memory "
                "--format=csv`) or lower engine.gpu_memory_utilization",
                **data,
            )
    return ok(f"gpu{g.index}", detail, **data)


def _foreign_processes(
    g: GpuInfo, describe_pid: Callable[[int], tuple[str, bool]]
) -> list[tuple[str, int | None]]:
    """(label, bytes used) of each process on the GPU that is not the appliance's own."""
    foreign: list[tuple[str, int | None]] = []
    for p in g.processes or ():
        label, ours = describe_pid(p.pid)
        if not ours:
            foreign.append((label, p.used_bytes))
    return foreign


def _gpu_data(
    g: GpuInfo, foreign: list[tuple[str, int | None]], utilization: float | None
) -> dict[str, Any]:
    """The GPU line's machine-readable fields (``doctor --json``)."""
    return {
        "name": g.name,
        "memory_total_bytes": g.memory_total,
        "memory_used_bytes": g.memory_used,
        "temperature_c": g.temperature_c,
        "power_limit_w": g.power_limit_w,
        "power_default_w": g.power_default_w,
        "persistence": g.persistence,
        "foreign_processes": [{"process": label, "used_bytes": b} for label, b in foreign],
        "used_by_engines": utilization is not None,
    }


def gpu_memory_totals(probe: NvidiaProbe, gpus: Sequence[int]) -> list[int]:
    """Memory of the GPUs the engines use, where NVML told it."""
    by_index = {g.index: g for g in probe.gpus}
    return [
        t for i in gpus if (t := by_index[i].memory_total if i in by_index else None) is not None
    ]
