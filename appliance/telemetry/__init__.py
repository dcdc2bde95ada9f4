"""GPU telemetry: where the supervisor's temperatures, power and clocks come from.

``[telemetry] source`` picks one of three interchangeable sources, all of which give
`GpuReading`s (see `base`):

- ``"nvml"``: the real GPUs through NVML (`nvml.NvmlSource`);
- ``"file:/path/sensors.json"``: a JSON file re-read every interval, to run and test
  thermal behaviour without hardware (`file.FileSource`);
- ``"none"``: no readings at all (CPU machines, or an operator who opts out).

`open_source` raises `TelemetryError` when the chosen source cannot be used; the
caller decides whether that is fatal. `check_sensors_file` is ``check-config``'s
stricter look at a ``file:`` source (its content must parse too). `count_nvidia_gpus`
answers ``device = "auto"``.
"""

from __future__ import annotations

from appliance.telemetry.base import GpuReading, NoneSource, TelemetryError, TelemetrySource
from appliance.telemetry.file import FileSource, check_sensors_file
from appliance.telemetry.nvml import NvmlSource, count_nvidia_gpus

__all__ = [
    "FileSource",
    "GpuReading",
    "NoneSource",
    "NvmlSource",
    "TelemetryError",
    "TelemetrySource",
    "check_sensors_file",
    "count_nvidia_gpus",
    "open_source",
]

FILE_PREFIX = "file:"


def open_source(spec: str) -> TelemetrySource:
    """Open the source named by ``[telemetry] source``: ``nvml``, ``none`` or ``file:PATH``."""
    if spec == "nvml":
        return NvmlSource()
    if spec == "none":
        return NoneSource()
    if spec.startswith(FILE_PREFIX):
        path = spec[len(FILE_PREFIX) :]
        if not path:
            raise TelemetryError('telemetry source "file:" needs a path: file:/path/sensors.json')
        return FileSource(path)
    raise TelemetryError(
        f"unknown telemetry source {spec!r}; expected nvml, none or file:/path/sensors.json"
    )
