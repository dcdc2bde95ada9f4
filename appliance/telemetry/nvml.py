"""GPU readings from NVML (`nvidia-ml-py`, imported as `pynvml`).

Why it is shaped like this:

- **Each sensor is read on its own.** Consumer cards do not support every NVML query
  (an RTX 4090 answers ``NotSupported`` for some), drivers differ, and one failing
  query must not cost us the temperature the thermal governor needs. Any
  ``NVMLError`` from one sensor makes that field ``None``; it is logged once per
  GPU, sensor and error code, not every interval.
- **A GPU that falls off the bus** (``GpuIsLost``, or no handle any more) yields an
  all-``None`` reading for its index, one warning, and the other GPUs keep reporting.
  Its handle is re-acquired lazily on later reads (by UUID when we know it, so a
  re-enumeration cannot silently swap GPUs); ``InvalidArgument`` from a sensor is
  taken as a stale handle and also triggers a re-acquire on the next read.
- **`pynvml` is looked up when a source is opened**, not when this module is imported,
  so the daemon imports cleanly on machines without the library and tests can install
  a fake with ``monkeypatch.setitem(sys.modules, "pynvml", fake)``.
- **Clock event reasons** use the new ``nvmlDeviceGetCurrentClocksEventReasons`` and
  fall back to the deprecated ``...ClocksThrottleReasons`` when the Python binding
  lacks the new name or the driver lacks the symbol (``FunctionNotFound``). Bits are
  decoded with the library's own constants into stable snake_case names.

NVML init/shutdown is reference counted (by the driver library and by pynvml), so
`count_nvidia_gpus()` may run while an `NvmlSource` is open.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from appliance.telemetry.base import GpuReading, TelemetryError

log = logging.getLogger(__name__)

T = TypeVar("T")

# (our name, pynvml constant suffix, bit value used only if the library lacks both
# nvmlClocksEventReason<suffix> and nvmlClocksThrottleReason<suffix>).
_REASONS: tuple[tuple[str, str, int], ...] = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
    ("board_limit", "BoardLimit", 0x200),
    ("reliability", "Reliability", 0x400),
)


def reason_table(nvml: Any) -> tuple[tuple[str, int], ...]:
    """(name, bit) pairs for clock event reasons, taken from the library's constants."""
    table: list[tuple[str, int]] = []
    for name, suffix, fallback in _REASONS:
        bit: Any = getattr(nvml, f"nvmlClocksEventReason{suffix}", None)
        if bit is None:
            bit = getattr(nvml, f"nvmlClocksThrottleReason{suffix}", fallback)
        table.append((name, int(bit)))
    return tuple(table)


def decode_clock_reasons(mask: int, table: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """Bitmask -> names in table order; bits we do not know become ``unknown_0x...``."""
    names = [name for name, bit in table if bit and mask & bit]
    rest = mask
    for _, bit in table:
        rest &= ~bit
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"unknown_0x{bit:x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


def _import_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise TelemetryError(f"NVML bindings are not installed (nvidia-ml-py): {exc}") from exc


def _text(value: Any) -> str:
    """Name/UUID: bytes in older pynvml releases, str in newer ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def count_nvidia_gpus() -> int:
    """How many GPUs NVML sees; 0 when there is no library, no driver or no GPU."""
    try:
        nvml = _import_pynvml()
    except TelemetryError:
        return 0
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        log.debug("NVML not available, counting 0 GPUs: %s", exc)
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as exc:
        log.warning("NVML initialised but could not count GPUs: %s", exc)
        return 0
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


class _GpuLost(Exception):
    """Internal: a sensor call said the GPU is gone; abandon this GPU's reading."""


@dataclass(slots=True)
class _Device:
    index: int
    handle: Any = None
    name: str | None = None
    uuid: str | None = None
    lost: bool = False  # warned as lost; cleared (with an info line) when it answers again
    stale: bool = False  # a call said InvalidArgument: the handle may be stale
    fresh: bool = False  # handle acquired during the current read


class NvmlSource:
    """Telemetry from NVML; one reading per GPU NVML enumerated at open."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml: Any = _import_pynvml() if nvml is None else nvml
        self._error: type[BaseException] = self._nvml.NVMLError
        self._lock = threading.Lock()
        self._closed = False
        self._inits = 0
        self._needs_reinit = False
        self._reported: set[tuple[int, str, object]] = set()
        try:
            self._nvml.nvmlInit()
        except self._error as exc:
            raise TelemetryError(f"NVML could not be initialised: {exc}") from exc
        self._inits = 1
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
        except self._error as exc:
            self.close()
            raise TelemetryError(f"NVML could not count GPUs: {exc}") from exc
        self._reasons = reason_table(self._nvml)
        self._reason_fns: list[Callable[[Any], Any]] = [
            fn
            for fn in (
                getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None),
                getattr(self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
            )
            if fn is not None
        ]
        # An nvidia-ml-py older than the energy counter lacks the call: energy is unknown.
        self._energy_fn: Callable[[Any], Any] | None = getattr(
            self._nvml, "nvmlDeviceGetTotalEnergyConsumption", None
        )
        self._devices = [_Device(index=i) for i in range(count)]
        for device in self._devices:
            self._acquire(device)
            device.fresh = False
        log.info(
            "NVML telemetry: %d GPU(s): %s",
            count,
            ", ".join(f"{d.index}={d.name or '?'}" for d in self._devices) or "none",
        )

    @property
    def gpu_count(self) -> int:
        """GPUs enumerated at open (lost ones included)."""
        return len(self._devices)

    def __repr__(self) -> str:
        return f"NvmlSource(gpus={len(self._devices)})"

    # -- error classification --------------------------------------------------------

    def _is(self, exc: BaseException, class_name: str) -> bool:
        cls = getattr(self._nvml, class_name, None)
        return isinstance(cls, type) and isinstance(exc, cls)

    def _code(self, exc: BaseException) -> object:
        return getattr(exc, "value", type(exc).__name__)

    # -- handles -----------------------------------------------------------------------

    def _acquire(self, device: _Device) -> bool:
        """Get (or re-get) the device handle and its static name/UUID; False if lost."""
        nvml = self._nvml
        try:
            by_uuid = getattr(nvml, "nvmlDeviceGetHandleByUUID", None)
            if device.uuid is not None and by_uuid is not None:
                handle = by_uuid(device.uuid)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(device.index)
        except self._error as exc:
            self._note_global(exc)
            device.handle = None
            self._mark_lost(device, f"no handle ({exc})")
            return False
        device.handle = handle
        device.stale = False
        device.fresh = True
        try:
            if device.name is None:
                name = self._sensor(device, "name", lambda: nvml.nvmlDeviceGetName(handle))
                device.name = None if name is None else _text(name)
            if device.uuid is None:
                uuid = self._sensor(device, "uuid", lambda: nvml.nvmlDeviceGetUUID(handle))
                device.uuid = None if uuid is None else _text(uuid)
        except _GpuLost as lost:
            device.handle = None
            self._mark_lost(device, f"GPU is lost ({lost})")
            return False
        return True

    def _mark_lost(self, device: _Device, why: str) -> None:
        if not device.lost:
            device.lost = True
            log.warning(
                "GPU %d (%s) cannot be read: %s; reporting it as unknown until it answers",
                device.index,
                device.uuid or device.name or "?",
                why,
            )

    def _note_global(self, exc: BaseException) -> None:
        if self._is(exc, "NVMLError_Uninitialized"):
            self._needs_reinit = True

    # -- reading -----------------------------------------------------------------------

    def _sensor(self, device: _Device, what: str, fn: Callable[[], T]) -> T | None:
        """One NVML query; an NVMLError makes it None (or abandons a lost GPU)."""
        try:
            return fn()
        except self._error as exc:
            if self._is(exc, "NVMLError_GpuIsLost"):
                raise _GpuLost(f"{what}: {exc}") from exc
            if self._is(exc, "NVMLError_InvalidArgument"):
                device.stale = True
                if not device.fresh:
                    return None  # an old handle: re-acquired and retried, logged only if fresh
            self._note_global(exc)
            key = (device.index, what, self._code(exc))
            if key not in self._reported:
                self._reported.add(key)
                level = logging.INFO if self._is(exc, "NVMLError_NotSupported") else logging.WARNING
                log.log(
                    level,
                    "GPU %d: %s unavailable (%s); reported as unknown",
                    device.index,
                    what,
                    exc,
                )
            return None

    def _reasons_mask(self, handle: Any) -> int | None:
        while self._reason_fns:
            fn = self._reason_fns[0]
            try:
                return int(fn(handle))
            except self._error as exc:
                if self._is(exc, "NVMLError_FunctionNotFound") and len(self._reason_fns) > 1:
                    self._reason_fns.pop(0)  # driver lacks the new symbol: use the old one
                    continue
                raise
        return None

    def _read_device(self, device: _Device) -> GpuReading:
        try:
            reading = self._read_with_retry(device)
        finally:
            device.fresh = False
        if reading is None:
            return self._unknown(device)
        if device.stale:
            device.handle = None  # still InvalidArgument on a fresh handle: re-acquire next time
        if device.lost:
            device.lost = False
            log.info("GPU %d answers again", device.index)
        return reading

    def _read_with_retry(self, device: _Device) -> GpuReading | None:
        if device.handle is None and not self._acquire(device):
            return None
        reading = self._read_sensors(device)
        if reading is not None and device.stale and not device.fresh:
            # InvalidArgument from a handle held over from earlier reads: most likely
            # stale (GPU reset). Re-acquire and read again now rather than report unknowns.
            device.handle = None
            if not self._acquire(device):
                return None
            reading = self._read_sensors(device)
        return reading

    @staticmethod
    def _unknown(device: _Device) -> GpuReading:
        return GpuReading(index=device.index, name=device.name, uuid=device.uuid)

    def _read_sensors(self, device: _Device) -> GpuReading | None:
        """All sensors of one GPU, each on its own; None when the GPU is lost."""
        nvml = self._nvml
        h = device.handle
        try:
            temperature = self._sensor(
                device,
                "temperature",
                lambda: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            )
            power = self._sensor(device, "power", lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
            power_limit = self._sensor(
                device, "power limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
            )
            memory = self._sensor(device, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(h))
            utilization = self._sensor(
                device,
                "utilization",
                lambda: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100.0,
            )
            sm_clock = self._sensor(
                device, "SM clock", lambda: int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))
            )
            mask = self._sensor(device, "clock event reasons", lambda: self._reasons_mask(h))
            procs = self._sensor(
                device, "processes", lambda: nvml.nvmlDeviceGetComputeRunningProcesses(h)
            )
            # Millijoules since the driver loaded (Volta and later; NotSupported elsewhere:
            # then energy is unknown and no key is charged any).
            energy_fn = self._energy_fn
            energy = (
                None
                if energy_fn is None
                else self._sensor(device, "energy", lambda: energy_fn(h) / 1000.0)
            )
        except _GpuLost as lost:
            device.handle = None
            self._mark_lost(device, f"GPU is lost ({lost})")
            return None
        return GpuReading(
            index=device.index,
            temperature_c=temperature,
            power_w=power,
            power_limit_w=power_limit,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization=utilization,
            sm_clock_mhz=sm_clock,
            throttle_reasons=() if mask is None else decode_clock_reasons(mask, self._reasons),
            name=device.name,
            uuid=device.uuid,
            pids=None if procs is None else tuple(int(p.pid) for p in procs),
            energy_j=energy,
        )

    def _reinit(self) -> bool:
        """NVML was shut down under us (someone else's unpaired nvmlShutdown): re-init."""
        try:
            self._nvml.nvmlInit()
        except self._error as exc:
            key = (-1, "reinit", self._code(exc))
            if key not in self._reported:
                self._reported.add(key)
                log.warning("NVML re-initialisation failed: %s", exc)
            return False
        self._inits += 1
        self._needs_reinit = False
        for device in self._devices:
            device.handle = None
        log.info("NVML re-initialised")
        return True

    def read(self) -> list[GpuReading]:
        with self._lock:
            if self._closed:
                return []
            if self._needs_reinit and not self._reinit():
                return [GpuReading(index=d.index, name=d.name, uuid=d.uuid) for d in self._devices]
            return [self._read_device(d) for d in self._devices]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._inits > 0:
                self._inits -= 1
                try:
                    self._nvml.nvmlShutdown()
                except self._error as exc:
                    log.debug("nvmlShutdown failed: %s", exc)
