"""What the check itself reads from NVML, apart from the daemon: to judge the daemon's
figures against the driver's own, and to time when memory is released. Read only:
nothing here (or anywhere in the check) sets a GPU's power limit, clocks or modes."""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    memory_used: int
    memory_total: int
    temperature_c: float
    power_w: float | None
    mem_clock_mhz: int | None
    processes: dict[int, int | None]  # pid -> used bytes (None: not told)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlView:
    """An open NVML (the real library, or the check's fake module)."""

    def __init__(self, nvml: types.ModuleType) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        self.count = int(nvml.nvmlDeviceGetCount())
        self.driver = _text(nvml.nvmlSystemGetDriverVersion())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()

    def _maybe(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except self.nvml.NVMLError:
            return None

    def sample(self, index: int) -> GpuSample:
        nvml = self.nvml
        h = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(h)
        procs = self._maybe(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(h)) or []
        power = self._maybe(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        return GpuSample(
            index=index,
            name=_text(nvml.nvmlDeviceGetName(h)),
            memory_used=int(memory.used),
            memory_total=int(memory.total),
            temperature_c=float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            power_w=power,
            mem_clock_mhz=self._maybe(
                lambda: int(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM))
            ),
            processes={
                int(p.pid): None if p.usedGpuMemory is None else int(p.usedGpuMemory) for p in procs
            },
        )

    def samples(self) -> list[GpuSample]:
        return [self.sample(i) for i in range(self.count)]

    def wait_until(
        self, index: int, done: Callable[[GpuSample], bool], timeout_s: float, poll_s: float = 0.05
    ) -> tuple[GpuSample, float | None]:
        """Poll GPU ``index`` until ``done``; (last sample, wall time it held or None)."""
        deadline = time.monotonic() + timeout_s
        while True:
            sample = self.sample(index)
            if done(sample):
                return sample, time.time()
            if time.monotonic() > deadline:
                return sample, None
            time.sleep(poll_s)
