"""What every telemetry source hands the supervisor: one `GpuReading` per GPU.

The thermal governor, the metrics endpoint and `/admin/status` only ever see
`GpuReading`s, so NVML, a JSON file (thermal tests without hardware) and "no
telemetry" (CPU boxes) are interchangeable behind `TelemetrySource`.

Every sensor field is optional: a reading with ``None`` means "this sensor could not
be read this time" (unsupported, GPU lost, bad value in the file), never "zero".
Consumers must treat ``None`` as unknown, not as cool or idle.

`TelemetryError` is raised only when a source cannot be used at all (NVML does not
initialise, the sensors file cannot be opened at start). Once a source is open,
`read()` does not raise for sensor trouble; it degrades to ``None`` fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU's sensors at one moment; ``None`` = unknown this time."""

    index: int
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    utilization: float | None = None  # 0..1
    sm_clock_mhz: int | None = None
    # Decoded clock event ("throttle") reasons, e.g. ("hw_slowdown", "sw_power_cap").
    throttle_reasons: tuple[str, ...] = ()
    name: str | None = None
    uuid: str | None = None
    # Pids of the compute processes holding its memory (NVML's list): who to name when
    # the memory an engine left is not freed.
    pids: tuple[int, ...] | None = None
    # Energy the GPU used since its driver loaded (NVML's total energy counter), in joules:
    # cumulative, so per-interval use is a difference of two readings; it restarts from 0
    # when the driver reloads (a counter reset, never a negative use).
    energy_j: float | None = None


class TelemetryError(Exception):
    """The telemetry source cannot be used at all (e.g. NVML init failed)."""


@runtime_checkable
class TelemetrySource(Protocol):
    """A blocking source of readings; the daemon calls `read` via `asyncio.to_thread`."""

    def read(self) -> list[GpuReading]:
        """Current readings, one per GPU; never raises for a sensor that fails."""
        ...

    def close(self) -> None:
        """Release the source; safe to call more than once."""
        ...


class NoneSource:
    """No telemetry (``source = "none"``): no readings, so no thermal throttling."""

    def read(self) -> list[GpuReading]:
        return []

    def close(self) -> None:
        return None

    def __repr__(self) -> str:
        return "NoneSource()"
