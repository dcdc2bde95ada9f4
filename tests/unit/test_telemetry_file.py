"""FileSource (``file:`` telemetry), NoneSource and open_source's spec parsing."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from appliance.telemetry import (
    FileSource,
    GpuReading,
    NoneSource,
    TelemetryError,
    TelemetrySource,
    open_source,
)
from appliance.telemetry import file as file_module
from appliance.telemetry.file import WARN_AGAIN_S

FILE_LOGGER = "appliance.telemetry.file"

CONTRACT_EXAMPLE = {
    "gpus": [
        {
            "index": 0,
            "temperature_c": 64,
            "power_w": 310,
            "power_limit_w": 450,
            "memory_used_bytes": 0,
            "memory_total_bytes": 25757220864,
            "utilization": 0.9,
            "throttle_reasons": [],
            "energy_j": 123456.5,
        }
    ]
}

EXAMPLE_READING = GpuReading(
    index=0,
    temperature_c=64.0,
    power_w=310.0,
    power_limit_w=450.0,
    memory_used_bytes=0,
    memory_total_bytes=25757220864,
    utilization=0.9,
    energy_j=123456.5,
)

# The last good reading handed on while the file is bad: its energy counter unknown (a
# gap, not "nothing used"), the rest kept for the governor.
STALE_READING = dataclasses.replace(EXAMPLE_READING, energy_j=None)


def write(path: Path, doc: Any) -> None:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))


def gpu(index: int, temperature: float, **more: Any) -> dict[str, Any]:
    return {"index": index, "temperature_c": temperature, **more}


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == FILE_LOGGER and r.levelno == logging.WARNING
    ]


@pytest.fixture
def sensors(tmp_path: Path) -> Path:
    path = tmp_path / "sensors.json"
    write(path, CONTRACT_EXAMPLE)
    return path


# -- the format -----------------------------------------------------------------------------


def test_contract_example_is_read_with_missing_keys_as_none(sensors: Path) -> None:
    source = open_source(f"file:{sensors}")
    assert isinstance(source, FileSource)
    assert isinstance(source, TelemetrySource)
    assert source.read() == [EXAMPLE_READING]
    source.close()


def test_optional_fields_and_float_byte_counts(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    write(
        path,
        {
            "gpus": [
                gpu(
                    0,
                    71.5,
                    sm_clock_mhz=2520,
                    name="NVIDIA GeForce RTX 4090",
                    uuid="GPU-1",
                    memory_total_bytes=2.5e10,
                    throttle_reasons=["sw_thermal_slowdown", "sw_power_cap"],
                    some_future_key={"ignored": True},
                )
            ]
        },
    )
    (reading,) = FileSource(path).read()
    assert reading.temperature_c == 71.5
    assert reading.sm_clock_mhz == 2520
    assert reading.name == "NVIDIA GeForce RTX 4090"
    assert reading.uuid == "GPU-1"
    assert reading.memory_total_bytes == 25_000_000_000
    assert isinstance(reading.memory_total_bytes, int)
    assert reading.throttle_reasons == ("sw_thermal_slowdown", "sw_power_cap")
    assert reading.power_w is None


def test_entries_sorted_index_defaults_to_position_bad_entries_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.json"
    write(
        path,
        {
            "gpus": [
                gpu(3, 50),
                {"temperature_c": 41},  # no index: its position, 1
                "not an object",
                gpu(-1, 99),
                {"index": "two", "temperature_c": 99},
                gpu(3, 99),  # duplicate: first wins
                gpu(0, 40),
            ]
        },
    )
    readings = FileSource(path).read()
    assert [(r.index, r.temperature_c) for r in readings] == [(0, 40.0), (1, 41.0), (3, 50.0)]
    assert len(warnings(caplog)) == 4


def test_file_is_re_read_on_every_read(sensors: Path) -> None:
    source = FileSource(sensors)
    assert source.read()[0].temperature_c == 64.0
    write(sensors, {"gpus": [gpu(0, 82), gpu(1, 60)]})
    assert [r.temperature_c for r in source.read()] == [82.0, 60.0]
    write(sensors, {"gpus": []})
    assert source.read() == []


# -- a file being rewritten, missing or broken ------------------------------------------------


@pytest.mark.parametrize(
    "broken",
    [
        "",  # truncated by a non-atomic writer
        '{"gpus": [{"index": 0, "temperature_c": 8',  # half written
        "not json at all",
        '["a", "list"]',
        '{"gpus": {"index": 0}}',
        '{"GPUs": []}',
        b"\xff\xfe\x00garbage",
    ],
)
def test_broken_file_keeps_last_good_readings(
    sensors: Path, caplog: pytest.LogCaptureFixture, broken: str | bytes
) -> None:
    source = FileSource(sensors)
    assert source.read() == [EXAMPLE_READING]
    if isinstance(broken, bytes):
        sensors.write_bytes(broken)
    else:
        sensors.write_text(broken)
    for _ in range(5):
        assert source.read() == [STALE_READING]
    assert len(warnings(caplog)) == 1  # once per distinct problem, not per interval


def test_missing_file_keeps_last_good_and_recovery_is_logged(
    sensors: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=FILE_LOGGER)
    source = FileSource(sensors)
    source.read()
    sensors.unlink()
    for _ in range(3):
        assert source.read() == [STALE_READING]
    assert len(warnings(caplog)) == 1
    assert "keeping the last good readings" in warnings(caplog)[0]

    write(sensors, {"gpus": [gpu(0, 77)]})
    assert source.read()[0].temperature_c == 77.0
    assert any("readable again" in r.getMessage() for r in caplog.records)

    sensors.unlink()  # the same problem soon again: not warned again (no flood)
    assert source.read()[0].temperature_c == 77.0
    assert len(warnings(caplog)) == 1


def test_same_problem_is_warned_again_after_a_while(
    sensors: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_module, "RETRY_DELAY_S", 0.0)
    now = [1000.0]
    source = FileSource(sensors, clock=lambda: now[0])
    for step in range(30):  # a writer caught mid-write over and over
        sensors.write_text('{"gpus": [' if step % 2 else json.dumps(CONTRACT_EXAMPLE))
        assert source.read() == [STALE_READING if step % 2 else EXAMPLE_READING]
        now[0] += 1.0
    assert len(warnings(caplog)) == 1
    now[0] += WARN_AGAIN_S
    sensors.write_text('{"gpus": [')
    source.read()
    assert len(warnings(caplog)) == 2


def test_distinct_problems_each_warn_once(sensors: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = FileSource(sensors)
    for broken in ["", "{", "", "{", "[1]", "[1]"]:
        sensors.write_text(broken)
        assert source.read() == [STALE_READING]
    sensors.unlink()
    source.read()
    assert len(warnings(caplog)) == 4  # empty / unterminated / wrong shape / missing


def test_file_invalid_at_open_starts_with_no_readings(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"gpus": [')
    source = FileSource(path)
    assert source.read() == []
    write(path, CONTRACT_EXAMPLE)
    assert source.read() == [EXAMPLE_READING]


def test_unopenable_file_at_open_is_a_telemetry_error(tmp_path: Path) -> None:
    with pytest.raises(TelemetryError, match="cannot be read"):
        open_source(f"file:{tmp_path / 'nope.json'}")
    with pytest.raises(TelemetryError):
        FileSource(tmp_path)  # a directory


def test_non_atomic_writer_never_breaks_a_reader(
    sensors: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer rewriting the file in pieces: every read is one of the good states."""
    monkeypatch.setattr(file_module, "RETRY_DELAY_S", 0.0005)
    states = [{"gpus": [gpu(0, t), gpu(1, t + 1)]} for t in (60, 85)]
    texts = [json.dumps(s) for s in states]
    write(sensors, texts[0])
    source = FileSource(sensors)
    good = [source.read()]
    write(sensors, texts[1])
    good.append(source.read())
    broken_reads = 0
    parse = source._parse

    def counting_parse(text: str) -> list[GpuReading]:
        nonlocal broken_reads
        try:
            return parse(text)
        except Exception:
            broken_reads += 1
            raise

    monkeypatch.setattr(source, "_parse", counting_parse)
    stop = threading.Event()

    def writer() -> None:
        n = 0
        while not stop.is_set():
            text = texts[n % 2]
            with sensors.open("w") as f:  # truncate, then write in pieces
                for i in range(0, len(text), 7):
                    f.write(text[i : i + 7])
                    f.flush()
                    time.sleep(0.0001)
            n += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            assert source.read() in good
            time.sleep(0.0002)
    finally:
        stop.set()
        thread.join()
    assert broken_reads > 0  # the race really happened


# -- bad field values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature_c", "hot"),
        ("temperature_c", True),
        ("temperature_c", [64]),
        ("temperature_c", math.nan),
        ("power_w", -5),
        ("power_w", {"w": 300}),
        ("power_limit_w", "450"),
        ("memory_used_bytes", 1.5),
        ("memory_used_bytes", -1),
        ("memory_total_bytes", "24GiB"),
        ("utilization", 90),
        ("utilization", -0.1),
        ("utilization", False),
        ("sm_clock_mhz", "fast"),
        ("name", 4090),
        ("uuid", ["GPU-1"]),
        ("energy_j", -1),
        ("energy_j", "12 kJ"),
        ("energy_j", math.inf),
    ],
)
def test_wrong_field_type_is_none_for_that_field_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, value: Any
) -> None:
    path = tmp_path / "s.json"
    entry = dict(CONTRACT_EXAMPLE["gpus"][0])
    entry[field] = value
    write(path, {"gpus": [entry, gpu(1, 50)]})
    source = FileSource(path)
    for _ in range(3):
        first, second = source.read()
        assert getattr(first, field) is None
        expected = {
            name: getattr(EXAMPLE_READING, name) for name in GpuReading.__slots__ if name != field
        }
        assert {name: getattr(first, name) for name in expected} == expected
        assert second.temperature_c == 50.0
    assert len(warnings(caplog)) == 1
    assert field in warnings(caplog)[0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("hw_slowdown", ()),
        ({"hw_slowdown": True}, ()),
        (["hw_slowdown", 3, None, "sw_power_cap"], ("hw_slowdown", "sw_power_cap")),
        (None, ()),
    ],
)
def test_bad_throttle_reasons(tmp_path: Path, value: Any, expected: tuple[str, ...]) -> None:
    path = tmp_path / "s.json"
    write(path, {"gpus": [gpu(0, 60, throttle_reasons=value)]})
    (reading,) = FileSource(path).read()
    assert reading.throttle_reasons == expected
    assert reading.temperature_c == 60.0


def test_explicit_null_is_unknown_without_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.json"
    write(path, {"gpus": [{"index": 0, "temperature_c": None, "power_w": None, "name": None}]})
    assert FileSource(path).read() == [GpuReading(index=0)]
    assert warnings(caplog) == []


def test_energy_is_read_as_written_and_a_counter_reset_as_the_lower_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """energy_j is cumulative; the source hands on what the file says, a lower value (a
    writer that started over) too: the consumer of the counter judges resets
    (accounting/energy.py), the source never invents a value."""
    path = tmp_path / "s.json"
    source = FileSource(path_with(path, 1000.0))
    assert [r.energy_j for r in source.read()] == [1000.0, None]
    write(path, {"gpus": [gpu(0, 60, energy_j=1500), gpu(1, 60, energy_j=7)]})
    assert [r.energy_j for r in source.read()] == [1500.0, 7.0]
    write(path, {"gpus": [gpu(0, 60, energy_j=20), gpu(1, 60, energy_j=9)]})
    assert [r.energy_j for r in source.read()] == [20.0, 9.0]
    assert warnings(caplog) == []


def test_while_the_file_is_bad_the_energy_is_unknown_not_unchanged(tmp_path: Path) -> None:
    """A writer stuck mid-write for some ticks: the last good readings came back with
    their old energy_j, so the gap read as no energy used and the next good reading
    charged the whole gap to the keys of one tick (accounting/energy.py)."""
    path = tmp_path / "s.json"
    source = FileSource(path_with(path, 0.0))
    assert [r.energy_j for r in source.read()] == [0.0, None]
    write(path, '{"gpus":[{"index":0,"ene')
    for _ in range(3):
        stale = source.read()
        assert [(r.temperature_c, r.energy_j) for r in stale] == [(60.0, None), (60.0, None)]
    write(path, {"gpus": [gpu(0, 61, energy_j=6000.0)]})
    assert [(r.temperature_c, r.energy_j) for r in source.read()] == [(61.0, 6000.0)]


def path_with(path: Path, energy_j: float) -> Path:
    write(path, {"gpus": [gpu(0, 60, energy_j=energy_j), gpu(1, 60)]})
    return path


# -- none source and spec parsing -------------------------------------------------------------


def test_none_source_reads_nothing() -> None:
    source = open_source("none")
    assert isinstance(source, NoneSource)
    assert isinstance(source, TelemetrySource)
    assert source.read() == []
    source.close()
    source.close()


@pytest.mark.parametrize("spec", ["", "NVML", "file:", "gpu", "file", "nvml:0"])
def test_unknown_specs_are_telemetry_errors(spec: str) -> None:
    with pytest.raises(TelemetryError):
        open_source(spec)


def test_reading_is_frozen() -> None:
    reading = GpuReading(index=0)
    with pytest.raises(AttributeError):
        reading.temperature_c = 1.0  # type: ignore[misc]
