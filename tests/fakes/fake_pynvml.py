"""A scripted stand-in for `pynvml`, with the real library's error classes and constants.

Tests install it in place of the real module::

    fake = FakeNvml([FakeGpu(temperature_c=64), FakeGpu(temperature_c=71)])
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)

`fake.module` is a real `types.ModuleType` named ``pynvml``: it carries the real
``NVMLError`` hierarchy (so ``except pynvml.NVMLError_NotSupported`` in the code under
test catches what the fake raises), the real ``NVML_*`` and clock-reason constants, the
real ctypes structs for memory and utilisation, and fake ``nvml*`` functions that read
the `FakeGpu` list. Anything about a GPU can be changed between reads: plain values,
or an NVMLError class/instance to raise from that one sensor (``NotSupported``), or
``lost=True`` (every call on it raises ``GpuIsLost``, as when it falls off the bus).

Faithful details that matter to callers: calls before ``nvmlInit`` (or after the last
``nvmlShutdown``) raise ``Uninitialized``; init/shutdown are reference counted; an
out-of-range index or a stale handle raises ``InvalidArgument``; an unknown UUID raises
``NotFound``; name and UUID come back as ``str`` (current nvidia-ml-py) or ``bytes``
(older releases, ``strings_as_bytes=True``).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any, Literal

import pynvml as _real  # the real library: error classes, constants and structs only

NVMLError = _real.NVMLError
NotSupported = _real.NVMLError_NotSupported
GpuIsLost = _real.NVMLError_GpuIsLost
Uninitialized = _real.NVMLError_Uninitialized
InvalidArgument = _real.NVMLError_InvalidArgument
NotFound = _real.NVMLError_NotFound
LibraryNotFound = _real.NVMLError_LibraryNotFound
DriverNotLoaded = _real.NVMLError_DriverNotLoaded
FunctionNotFound = _real.NVMLError_FunctionNotFound
NoPermission = _real.NVMLError_NoPermission
Unknown = _real.NVMLError_Unknown

# A sensor value, or the NVMLError (class or instance) that reading it raises.
Scripted = Any

# pynvml's clock event reason bits, named as the appliance decodes them.
REASON_BITS: dict[str, int] = {
    "gpu_idle": _real.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": _real.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": _real.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": _real.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": _real.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": _real.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": _real.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": _real.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": _real.nvmlClocksEventReasonDisplayClockSetting,
}


def reasons(*names: str) -> int:
    """Bitmask for reason names, e.g. ``reasons("sw_power_cap", "hw_slowdown")``."""
    mask = 0
    for name in names:
        mask |= REASON_BITS[name]
    return mask


def _value(scripted: Scripted) -> Any:
    """Return the scripted value, or raise the scripted error (a fresh one per call)."""
    if isinstance(scripted, type) and issubclass(scripted, BaseException):
        raise scripted()
    if isinstance(scripted, BaseException):
        raise scripted
    return scripted


@dataclass
class FakeGpu:
    """One device's scripted sensors (raw NVML units: mW, percent, bytes, MHz)."""

    name: Scripted = "NVIDIA GeForce RTX 4090"
    uuid: str | None = None  # None: "GPU-fake-<index>" assigned by FakeNvml
    temperature_c: Scripted = 45
    power_mw: Scripted = 120_000
    power_limit_mw: Scripted = 450_000  # enforced, and the power management limit
    # The power-limit range and default (an RTX 4090: 150..600 W, 450 W by default), and
    # what setting a limit raises (NoPermission when not root, NotSupported).
    power_constraints_mw: Scripted = (150_000, 600_000)
    power_default_mw: Scripted = 450_000
    set_power_error: Scripted = None
    memory_used: Scripted = 1_073_741_824
    memory_total: Scripted = 25_757_220_864
    utilization_pct: Scripted = 0
    sm_clock_mhz: Scripted = 2520
    clock_reasons: Scripted = 0
    persistence_mode: Scripted = _real.NVML_FEATURE_ENABLED
    # Compute processes holding memory on it: (pid, used bytes or None when not known).
    processes: Scripted = ()
    # NVML's total energy counter: millijoules since the driver loaded (NotSupported on
    # cards before Volta).
    energy_mj: Scripted = 3_600_000
    lost: bool = False  # fell off the bus: every call on it raises GpuIsLost
    handle_error: Scripted = None  # raised by nvmlDeviceGetHandleBy* when set
    generation: int = 0  # bump (reset_gpu) to make old handles stale


@dataclass(frozen=True)
class FakeHandle:
    index: int
    generation: int


ReasonsApi = Literal["event", "throttle-only", "event-not-in-driver"]


@dataclass
class FakeNvml:
    """The fake library's state; install ``.module`` as ``sys.modules["pynvml"]``.

    ``reasons_api``: ``"event"`` (current bindings and driver), ``"throttle-only"``
    (older nvidia-ml-py without ``nvmlDeviceGetCurrentClocksEventReasons``),
    ``"event-not-in-driver"`` (new binding, old driver: the new call raises
    ``FunctionNotFound``).
    """

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    init_error: Scripted = None
    count_error: Scripted = None
    shutdown_error: Scripted = None
    strings_as_bytes: bool = False
    driver_version: Scripted = "570.124.06"
    reasons_api: ReasonsApi = "event"
    refcount: int = 0
    init_calls: int = 0
    shutdown_calls: int = 0
    calls: list[tuple[str, int | None]] = field(default_factory=list)
    module: types.ModuleType = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid is None:
                gpu.uuid = f"GPU-fake-{i:04d}"
        self.module = self._build_module()

    # -- scripting helpers ---------------------------------------------------------

    def install(self, monkeypatch: Any) -> types.ModuleType:
        """``monkeypatch.setitem(sys.modules, "pynvml", ...)`` and return the module."""
        monkeypatch.setitem(sys.modules, "pynvml", self.module)
        return self.module

    def reset_gpu(self, index: int) -> None:
        """Simulate a GPU reset: handles taken before now answer InvalidArgument."""
        self.gpus[index].generation += 1

    def count(self, call: str, index: int | None = None) -> int:
        """How many times ``call`` (for GPU ``index``, if given) was made."""
        return sum(1 for c, i in self.calls if c == call and (index is None or i == index))

    # -- library behaviour ---------------------------------------------------------

    def _check_init(self) -> None:
        if self.refcount <= 0:
            raise Uninitialized()

    def _gpu(self, handle: Any, call: str) -> FakeGpu:
        self._check_init()
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.gpus):
            raise InvalidArgument()
        self.calls.append((call, handle.index))
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise GpuIsLost()
        if handle.generation != gpu.generation:
            raise InvalidArgument()
        return gpu

    def _string(self, value: str) -> str | bytes:
        return value.encode() if self.strings_as_bytes else value

    def nvmlInit(self) -> None:
        self.init_calls += 1
        _value(self.init_error)
        self.refcount += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.nvmlInit()

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        _value(self.shutdown_error)
        self._check_init()
        self.refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        _value(self.count_error)
        return len(self.gpus)

    def _handle(self, index: int) -> FakeHandle:
        gpu = self.gpus[index]
        _value(gpu.handle_error)
        if gpu.lost:
            raise GpuIsLost()
        return FakeHandle(index, gpu.generation)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check_init()
        self.calls.append(("nvmlDeviceGetHandleByIndex", index))
        if not 0 <= index < len(self.gpus):
            raise InvalidArgument()
        return self._handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._check_init()
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == text:
                self.calls.append(("nvmlDeviceGetHandleByUUID", i))
                return self._handle(i)
        self.calls.append(("nvmlDeviceGetHandleByUUID", None))
        raise NotFound()

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._string(_value(self._gpu(handle, "nvmlDeviceGetName").name))

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        uuid = self._gpu(handle, "nvmlDeviceGetUUID").uuid
        assert uuid is not None
        return self._string(uuid)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTemperature")
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise InvalidArgument()
        return int(_value(gpu.temperature_c))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(_value(self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return int(_value(self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw))

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        return int(_value(self._gpu(handle, "nvmlDeviceGetPowerManagementLimit").power_limit_mw))

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: Any) -> list[int]:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerManagementLimitConstraints")
        low, high = _value(gpu.power_constraints_mw)
        return [int(low), int(high)]  # the real binding returns [min, max]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPowerManagementDefaultLimit")
        return int(_value(gpu.power_default_mw))

    def nvmlDeviceSetPowerManagementLimit(self, handle: Any, limit_mw: int) -> None:
        gpu = self._gpu(handle, "nvmlDeviceSetPowerManagementLimit")
        _value(gpu.set_power_error)
        low, high = _value(gpu.power_constraints_mw)
        if not low <= limit_mw <= high:
            raise InvalidArgument()  # as the driver answers a limit outside the range
        gpu.power_limit_mw = int(limit_mw)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        used = int(_value(gpu.memory_used))
        total = int(_value(gpu.memory_total))
        return _real.c_nvmlMemory_t(total=total, free=max(total - used, 0), used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return _real.c_nvmlUtilization_t(gpu=int(_value(gpu.utilization_pct)), memory=0)

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        if clock_type != _real.NVML_CLOCK_SM:
            raise NotSupported()
        return int(_value(gpu.sm_clock_mhz))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        if self.reasons_api == "event-not-in-driver":
            raise FunctionNotFound()
        return int(_value(gpu.clock_reasons))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(_value(gpu.clock_reasons))

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._check_init()
        return self._string(_value(self.driver_version))

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        return int(_value(self._gpu(handle, "nvmlDeviceGetPersistenceMode").persistence_mode))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        gpu = self._gpu(handle, "nvmlDeviceGetComputeRunningProcesses")
        # The real binding returns friendly objects with these two attributes (and more).
        return [
            types.SimpleNamespace(pid=pid, usedGpuMemory=used)
            for pid, used in _value(gpu.processes)
        ]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEnergyConsumption")
        return int(_value(gpu.energy_mj))

    # -- the module ------------------------------------------------------------------

    _FUNCTIONS = (
        "nvmlInit",
        "nvmlInitWithFlags",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetPowerManagementLimitConstraints",
        "nvmlDeviceGetPowerManagementDefaultLimit",
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlSystemGetDriverVersion",
        "nvmlDeviceGetPersistenceMode",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetTotalEnergyConsumption",
    )
    _REAL_PREFIXES = ("NVML_", "NVMLError", "nvmlClocksEventReason", "nvmlClocksThrottleReason")
    _REAL_NAMES = ("c_nvmlMemory_t", "c_nvmlUtilization_t", "nvmlExceptionClass")

    def _build_module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml", "Fake pynvml (tests/fakes/fake_pynvml.py).")
        for name in dir(_real):
            if name.startswith(self._REAL_PREFIXES) or name in self._REAL_NAMES:
                setattr(module, name, getattr(_real, name))
        for name in self._FUNCTIONS:
            setattr(module, name, getattr(self, name))
        if self.reasons_api == "throttle-only":
            delattr(module, "nvmlDeviceGetCurrentClocksEventReasons")
            for name in [n for n in vars(module) if n.startswith("nvmlClocksEventReason")]:
                delattr(module, name)
        module.fake = self  # type: ignore[attr-defined]
        return module
