"""GPU readings from a JSON file (``source = "file:/path/sensors.json"``).

This is how thermal behaviour is run and tested without hardware: a test or an
operator's script writes the file, and the daemon re-reads it on every interval.
Format (every key but ``index`` optional; a missing key is an unknown sensor)::

    {"gpus": [{"index": 0, "temperature_c": 64, "power_w": 310, "power_limit_w": 450,
               "memory_used_bytes": 0, "memory_total_bytes": 25757220864,
               "utilization": 0.9, "throttle_reasons": [], "sm_clock_mhz": 2520,
               "name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-...", "energy_j": 1234567.0}]}

``energy_j`` is cumulative, like NVML's total energy counter (joules since some start the
writer chooses); a value lower than the last one is a counter reset. An entry without
``index`` takes its position in the list. Unknown keys are ignored.

Why it is forgiving: writers rarely replace the file atomically, so a read can see it
missing, empty or half-written. Such a read tries once more after a short pause (the
writer is usually done by then); if it still fails it keeps the **last good readings**
(for the governor: the last temperature known is better than none) but with ``energy_j``
unknown: the old counter value would read as no energy used in the gap, and the next
good reading would charge the whole gap to one tick. It logs one warning per distinct
problem (at most every `WARN_AGAIN_S`, not once per interval: a writer that keeps getting
caught mid-write must not flood the journal); when the file parses again after a
warning, an info line says so. A field of the
wrong type (or out of range, e.g. utilization outside 0..1, a NaN) becomes ``None``
for that field with a warning, never a crash; an entry that is not an object, or whose
index is bad or repeated, is skipped.

The one hard failure is at open: a path that cannot be opened at all (typo, no
permission, a directory) raises `TelemetryError`, so a misconfigured daemon says so at
start instead of running without thermal protection. `check_sensors_file` is the
strict check for ``check-config``: the content must parse too.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.telemetry.base import GpuReading, TelemetryError

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20  # a sensors file is a few hundred bytes; refuse absurd ones
RETRY_DELAY_S = 0.02  # a read that catches a writer mid-rewrite tries once more after this
WARN_AGAIN_S = 600.0  # the same file problem is warned about at most this often


class _BadFile(Exception):
    """The file's content cannot be used this time; ``key`` groups repeats."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _read_text(path: Path) -> str:
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise _BadFile("too-large", f"is larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadFile("not-utf8", f"is not UTF-8: {exc}") from exc


def _gpu_entries(text: str) -> list[Any]:
    """The ``gpus`` list of the file's text; _BadFile when it is not of that form."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadFile(f"json:{exc.msg}", f"is not valid JSON ({exc})") from exc
    gpus = doc.get("gpus") if isinstance(doc, dict) else None
    if not isinstance(gpus, list):
        raise _BadFile("shape", 'is not of the form {"gpus": [...]}')
    return gpus


def check_sensors_file(path: str | os.PathLike[str]) -> None:
    """TelemetryError when ``path`` cannot serve as a sensors file now: it cannot be read
    (missing, no permission, a directory), is too large or not UTF-8, is not JSON, or not
    of the form ``{"gpus": [...]}``. For ``check-config``; the daemon forgives a bad read
    after start (above). Entries are not judged: the daemon skips a bad one, warning."""
    where = Path(path).expanduser()
    try:
        _gpu_entries(_read_text(where))
    except OSError as exc:
        raise TelemetryError(f"telemetry file {where} cannot be read: {exc}") from exc
    except _BadFile as exc:
        raise TelemetryError(f"telemetry file {where} {exc}") from exc


class FileSource:
    """Readings re-read from a JSON file on every `read()`."""

    def __init__(
        self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._path = Path(path).expanduser()
        self._clock = clock
        self._lock = threading.Lock()
        self._last_good: list[GpuReading] = []
        self._file_warned: dict[str, float] = {}  # problem key -> when last warned
        self._spell_warned = False  # a warning was logged since the last good read
        self._field_warned: set[tuple[object, ...]] = set()
        try:
            text = self._read_text()
        except OSError as exc:
            raise TelemetryError(f"telemetry file {self._path} cannot be read: {exc}") from exc
        except _BadFile as exc:
            self._warn_file(exc)
            return
        try:
            self._last_good = self._parse(text)
        except _BadFile as exc:
            self._warn_file(exc)

    @property
    def path(self) -> Path:
        return self._path

    def __repr__(self) -> str:
        return f"FileSource({str(self._path)!r})"

    def read(self) -> list[GpuReading]:
        with self._lock:
            try:
                readings = self._read_once_or_twice()
            except OSError as exc:
                self._warn_file(_BadFile(f"os:{type(exc).__name__}", f"cannot be read: {exc}"))
            except _BadFile as exc:
                self._warn_file(exc)
            else:
                if self._spell_warned:
                    self._spell_warned = False
                    log.info("telemetry file %s is readable again", self._path)
                self._last_good = readings
                return list(readings)
            # Stale: the energy counter is unknown for this tick (a gap, not zero use).
            return [
                r if r.energy_j is None else dataclasses.replace(r, energy_j=None)
                for r in self._last_good
            ]

    def close(self) -> None:
        return None

    # -- reading the file ----------------------------------------------------------

    def _read_once_or_twice(self) -> list[GpuReading]:
        try:
            return self._parse(self._read_text())
        except (_BadFile, FileNotFoundError):
            # Most likely caught a writer mid-rewrite; it finishes within microseconds.
            time.sleep(RETRY_DELAY_S)
            return self._parse(self._read_text())

    def _read_text(self) -> str:
        return _read_text(self._path)

    def _warn_file(self, exc: _BadFile) -> None:
        now = self._clock()
        last = self._file_warned.get(exc.key)
        if last is None or now - last >= WARN_AGAIN_S:
            self._file_warned[exc.key] = now
            self._spell_warned = True
            log.warning("telemetry file %s %s; keeping the last good readings", self._path, exc)

    def _warn_field(self, key: tuple[object, ...], message: str) -> None:
        if key not in self._field_warned:
            self._field_warned.add(key)
            log.warning("telemetry file %s: %s", self._path, message)

    def _parse(self, text: str) -> list[GpuReading]:
        readings: dict[int, GpuReading] = {}
        for position, entry in enumerate(_gpu_entries(text)):
            if not isinstance(entry, dict):
                self._warn_field(
                    ("entry", position, type(entry).__name__),
                    f"gpus[{position}] is not an object; skipped",
                )
                continue
            raw_index = entry.get("index", position)
            index = _integer(raw_index)
            if index is None or index < 0:
                self._warn_field(
                    ("index", position, repr(raw_index)),
                    f"gpus[{position}].index = {raw_index!r} is not a GPU index; skipped",
                )
                continue
            if index in readings:
                self._warn_field(
                    ("duplicate", index), f"GPU index {index} appears twice; the first one is used"
                )
                continue
            readings[index] = self._reading(index, entry)
        return [readings[i] for i in sorted(readings)]

    # -- fields --------------------------------------------------------------------

    def _bad_field(self, index: int, field: str, value: Any, expected: str) -> None:
        self._warn_field(
            ("field", index, field, type(value).__name__),
            f"GPU {index}: {field} = {value!r} is not {expected}; reported as unknown",
        )

    def _float(
        self,
        index: int,
        entry: dict[str, Any],
        field: str,
        low: float | None = None,
        high: float | None = None,
    ) -> float | None:
        if entry.get(field) is None:
            return None
        value = entry[field]
        result = _number(value)
        if (
            result is None
            or (low is not None and result < low)
            or (high is not None and result > high)
        ):
            expected = "a finite number"
            if low is not None and high is not None:
                expected += f" in {low:g}..{high:g}"
            elif low is not None:
                expected += f" >= {low:g}"
            self._bad_field(index, field, value, expected)
            return None
        return result

    def _int(self, index: int, entry: dict[str, Any], field: str) -> int | None:
        if entry.get(field) is None:
            return None
        value = entry[field]
        result = _integer(value)
        if result is None or result < 0:
            self._bad_field(index, field, value, "a non-negative integer")
            return None
        return result

    def _str(self, index: int, entry: dict[str, Any], field: str) -> str | None:
        value = entry.get(field)
        if value is None or isinstance(value, str):
            return value
        self._bad_field(index, field, value, "a string")
        return None

    def _reasons(self, index: int, entry: dict[str, Any]) -> tuple[str, ...]:
        value = entry.get("throttle_reasons")
        if value is None:
            return ()
        if not isinstance(value, list):
            self._bad_field(index, "throttle_reasons", value, "a list of strings")
            return ()
        names = tuple(item for item in value if isinstance(item, str))
        if len(names) != len(value):
            self._bad_field(index, "throttle_reasons", value, "a list of strings (others dropped)")
        return names

    def _reading(self, index: int, entry: dict[str, Any]) -> GpuReading:
        return GpuReading(
            index=index,
            temperature_c=self._float(index, entry, "temperature_c"),
            power_w=self._float(index, entry, "power_w", low=0),
            power_limit_w=self._float(index, entry, "power_limit_w", low=0),
            memory_used_bytes=self._int(index, entry, "memory_used_bytes"),
            memory_total_bytes=self._int(index, entry, "memory_total_bytes"),
            utilization=self._float(index, entry, "utilization", low=0, high=1),
            sm_clock_mhz=self._int(index, entry, "sm_clock_mhz"),
            throttle_reasons=self._reasons(index, entry),
            name=self._str(index, entry, "name"),
            uuid=self._str(index, entry, "uuid"),
            energy_j=self._float(index, entry, "energy_j", low=0),
        )
