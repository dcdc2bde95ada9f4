"""NvmlSource and count_nvidia_gpus against the scripted fake pynvml (real error types)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pynvml as real_pynvml
import pytest

from appliance.telemetry import (
    GpuReading,
    NvmlSource,
    TelemetryError,
    TelemetrySource,
    count_nvidia_gpus,
    open_source,
)
from appliance.telemetry.nvml import decode_clock_reasons, reason_table

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # tests/ is not on sys.path by default (no rootdir conftest)
    sys.path.insert(0, _ROOT)

from tests.fakes.fake_pynvml import (  # noqa: E402
    DriverNotLoaded,
    FakeGpu,
    FakeNvml,
    FunctionNotFound,
    GpuIsLost,
    LibraryNotFound,
    NoPermission,
    NotSupported,
    Unknown,
    reasons,
)

NVML_LOGGER = "appliance.telemetry.nvml"


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(
            name="NVIDIA GeForce RTX 4090",
            uuid="GPU-aaaa",
            temperature_c=64,
            power_mw=310_500,
            power_limit_mw=450_000,
            memory_used=2_147_483_648,
            memory_total=25_757_220_864,
            utilization_pct=87,
            sm_clock_mhz=2520,
            clock_reasons=reasons("sw_power_cap", "hw_slowdown"),
            processes=((4242, 2_000_000_000), (4343, None)),
            energy_mj=123_456_789,
        ),
        FakeGpu(name="NVIDIA GeForce RTX 4090", uuid="GPU-bbbb", temperature_c=51),
    ]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    nvml = FakeNvml(two_gpus())
    nvml.install(monkeypatch)
    return nvml


def install(monkeypatch: pytest.MonkeyPatch, **kwargs: object) -> FakeNvml:
    nvml = FakeNvml(**kwargs)  # type: ignore[arg-type]
    nvml.install(monkeypatch)
    return nvml


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NVML_LOGGER and r.levelno == level]


# -- decoding -----------------------------------------------------------------------------


def test_readings_are_decoded_into_si_units_and_reason_names(fake: FakeNvml) -> None:
    source = open_source("nvml")
    assert isinstance(source, NvmlSource)
    assert isinstance(source, TelemetrySource)
    first, second = source.read()
    assert first == GpuReading(
        index=0,
        temperature_c=64.0,
        power_w=310.5,
        power_limit_w=450.0,
        memory_used_bytes=2_147_483_648,
        memory_total_bytes=25_757_220_864,
        utilization=0.87,
        sm_clock_mhz=2520,
        throttle_reasons=("sw_power_cap", "hw_slowdown"),
        name="NVIDIA GeForce RTX 4090",
        uuid="GPU-aaaa",
        pids=(4242, 4343),
        energy_j=123_456.789,
    )
    assert second.index == 1
    assert second.pids == ()
    assert second.temperature_c == 51.0
    assert second.throttle_reasons == ()
    source.close()


def test_readings_follow_the_hardware_between_reads(fake: FakeNvml) -> None:
    source = NvmlSource()
    assert source.read()[0].temperature_c == 64.0
    fake.gpus[0].temperature_c = 86
    fake.gpus[0].clock_reasons = reasons("sw_thermal_slowdown", "hw_thermal_slowdown")
    reading = source.read()[0]
    assert reading.temperature_c == 86.0
    assert reading.throttle_reasons == ("sw_thermal_slowdown", "hw_thermal_slowdown")


@pytest.mark.parametrize(
    ("bit_name", "expected"),
    [
        ("nvmlClocksEventReasonGpuIdle", "gpu_idle"),
        ("nvmlClocksEventReasonApplicationsClocksSetting", "applications_clocks_setting"),
        ("nvmlClocksEventReasonSwPowerCap", "sw_power_cap"),
        ("nvmlClocksEventReasonHwSlowdown", "hw_slowdown"),
        ("nvmlClocksEventReasonSyncBoost", "sync_boost"),
        ("nvmlClocksEventReasonSwThermalSlowdown", "sw_thermal_slowdown"),
        ("nvmlClocksEventReasonHwThermalSlowdown", "hw_thermal_slowdown"),
        ("nvmlClocksEventReasonHwPowerBrakeSlowdown", "hw_power_brake_slowdown"),
        ("nvmlClocksEventReasonDisplayClockSetting", "display_clock_setting"),
    ],
)
def test_each_reason_bit_of_the_real_library_has_its_name(bit_name: str, expected: str) -> None:
    table = reason_table(real_pynvml)
    assert decode_clock_reasons(getattr(real_pynvml, bit_name), table) == (expected,)


def test_reason_table_from_the_deprecated_throttle_constants_is_the_same() -> None:
    class OldBindings:
        pass

    for name in dir(real_pynvml):
        if name.startswith("nvmlClocksThrottleReason"):
            setattr(OldBindings, name, getattr(real_pynvml, name))
    assert reason_table(OldBindings) == reason_table(real_pynvml)


def test_unknown_reason_bits_are_named_not_dropped() -> None:
    table = reason_table(real_pynvml)
    mask = real_pynvml.nvmlClocksEventReasonGpuIdle | (1 << 40)
    assert decode_clock_reasons(mask, table) == ("gpu_idle", "unknown_0x10000000000")
    assert decode_clock_reasons(0, table) == ()


def test_older_bindings_without_the_event_reasons_call_use_the_throttle_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = install(
        monkeypatch,
        gpus=[FakeGpu(clock_reasons=reasons("hw_slowdown"))],
        reasons_api="throttle-only",
    )
    assert not hasattr(nvml.module, "nvmlDeviceGetCurrentClocksEventReasons")
    assert NvmlSource().read()[0].throttle_reasons == ("hw_slowdown",)
    assert nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 1


def test_driver_without_the_event_reasons_symbol_falls_back_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml = install(
        monkeypatch,
        gpus=[FakeGpu(clock_reasons=reasons("sw_power_cap"))],
        reasons_api="event-not-in-driver",
    )
    source = NvmlSource()
    for _ in range(3):
        assert source.read()[0].throttle_reasons == ("sw_power_cap",)
    assert nvml.count("nvmlDeviceGetCurrentClocksEventReasons") == 1
    assert nvml.count("nvmlDeviceGetCurrentClocksThrottleReasons") == 3


def test_name_and_uuid_as_bytes_from_older_bindings_become_str(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, gpus=[FakeGpu(name="Tesla T4", uuid="GPU-cccc")], strings_as_bytes=True)
    reading = NvmlSource().read()[0]
    assert (reading.name, reading.uuid) == ("Tesla T4", "GPU-cccc")


# -- one sensor failing ---------------------------------------------------------------------


def test_not_supported_sensor_is_none_and_the_rest_still_read(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=NVML_LOGGER)
    fake.gpus[0].power_mw = NotSupported
    fake.gpus[0].sm_clock_mhz = NotSupported
    source = NvmlSource()
    for _ in range(3):
        first, second = source.read()
        assert first.power_w is None
        assert first.sm_clock_mhz is None
        assert first.temperature_c == 64.0
        assert first.power_limit_w == 450.0
        assert first.memory_total_bytes == 25_757_220_864
        assert first.throttle_reasons == ("sw_power_cap", "hw_slowdown")
        assert second.power_w == 120.0
    infos = messages(caplog, logging.INFO)
    assert sum("power unavailable" in m for m in infos) == 1  # once, not per interval
    assert sum("SM clock unavailable" in m for m in infos) == 1
    assert messages(caplog, logging.WARNING) == []


def test_energy_counter_not_supported_is_unknown_said_once_and_can_come_back(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    """Cards before Volta have no total energy counter: energy is unknown (no key is
    charged any), said once at INFO, and the other sensors read on."""
    caplog.set_level(logging.DEBUG, logger=NVML_LOGGER)
    fake.gpus[0].energy_mj = NotSupported
    source = NvmlSource()
    for _ in range(3):
        first, second = source.read()
        assert first.energy_j is None
        assert first.temperature_c == 64.0
        assert second.energy_j == 3600.0
    assert sum("energy unavailable" in m for m in messages(caplog, logging.INFO)) == 1
    assert messages(caplog, logging.WARNING) == []
    fake.gpus[0].energy_mj = 5_000
    assert source.read()[0].energy_j == 5.0


def test_energy_counter_reset_is_read_as_it_is(fake: FakeNvml) -> None:
    """A driver reload restarts NVML's counter from 0: the reading says so; the split
    (accounting/energy.py) takes a lower value as a reset, never as negative use."""
    source = NvmlSource()
    fake.gpus[0].energy_mj = 9_000_000
    assert source.read()[0].energy_j == 9000.0
    fake.gpus[0].energy_mj = 250
    assert source.read()[0].energy_j == 0.25


def test_bindings_without_the_energy_call_read_energy_as_unknown(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(fake.module, "nvmlDeviceGetTotalEnergyConsumption")
    first, second = NvmlSource().read()
    assert (first.energy_j, second.energy_j) == (None, None)
    assert first.temperature_c == 64.0


@pytest.mark.parametrize("error", [NoPermission, Unknown, NotSupported])
def test_any_nvml_error_on_one_sensor_is_none_for_that_sensor_only(
    fake: FakeNvml, error: type[Exception]
) -> None:
    fake.gpus[0].memory_used = error
    fake.gpus[0].utilization_pct = error
    fake.gpus[0].clock_reasons = error
    reading = NvmlSource().read()[0]
    assert reading.memory_used_bytes is None
    assert reading.memory_total_bytes is None
    assert reading.utilization is None
    assert reading.throttle_reasons == ()
    assert reading.temperature_c == 64.0
    assert reading.power_w == 310.5


def test_a_sensor_can_come_back(fake: FakeNvml) -> None:
    source = NvmlSource()
    fake.gpus[0].temperature_c = NotSupported
    assert source.read()[0].temperature_c is None
    fake.gpus[0].temperature_c = 70
    assert source.read()[0].temperature_c == 70.0


def test_name_not_supported_leaves_name_none(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, gpus=[FakeGpu(name=NotSupported, temperature_c=40)])
    reading = NvmlSource().read()[0]
    assert reading.name is None
    assert reading.temperature_c == 40.0


# -- a GPU going away -----------------------------------------------------------------------


def test_lost_gpu_reads_as_unknown_and_the_others_keep_working(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    source = NvmlSource()
    assert source.read()[1].temperature_c == 51.0
    fake.gpus[1].lost = True
    for _ in range(4):
        first, second = source.read()
        assert first.temperature_c == 64.0
        assert second == GpuReading(index=1, name="NVIDIA GeForce RTX 4090", uuid="GPU-bbbb")
    lost_warnings = [m for m in messages(caplog, logging.WARNING) if "GPU 1" in m]
    assert len(lost_warnings) == 1  # once, not per interval
    assert "lost" in lost_warnings[0]

    fake.gpus[1].lost = False  # back (e.g. after a reset): handle re-acquired by UUID
    caplog.clear()
    caplog.set_level(logging.INFO, logger=NVML_LOGGER)
    assert source.read()[1].temperature_c == 51.0
    assert any("GPU 1 answers again" in m for m in messages(caplog, logging.INFO))
    assert fake.count("nvmlDeviceGetHandleByUUID", 1) >= 1


def test_gpu_lost_already_at_open_does_not_stop_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpus = two_gpus()
    gpus[0].handle_error = GpuIsLost
    install(monkeypatch, gpus=gpus)
    source = NvmlSource()
    first, second = source.read()
    assert first == GpuReading(index=0)
    assert second.temperature_c == 51.0
    gpus[0].handle_error = None
    assert source.read()[0].temperature_c == 64.0  # handle opened lazily, by index


def test_stale_handle_after_a_reset_is_reacquired_within_the_same_read(
    fake: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    source = NvmlSource()
    source.read()
    fake.reset_gpu(0)  # old handles now answer InvalidArgument
    assert source.read()[0].temperature_c == 64.0
    assert messages(caplog, logging.WARNING) == []
    assert source.read()[0].temperature_c == 64.0


def test_nvml_shut_down_under_us_is_reinitialised(fake: FakeNvml) -> None:
    source = NvmlSource()
    fake.refcount = 0  # someone else's unpaired nvmlShutdown
    assert source.read()[0].temperature_c is None
    assert source.read()[0].temperature_c == 64.0
    source.close()
    assert fake.refcount == 0


# -- opening, counting, closing -----------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "text"),
    [(DriverNotLoaded, "Driver Not Loaded"), (LibraryNotFound, "Library Not Found")],
)
def test_init_failure_is_a_telemetry_error_and_counts_zero_gpus(
    monkeypatch: pytest.MonkeyPatch, error: type[Exception], text: str
) -> None:
    install(monkeypatch, init_error=error)
    with pytest.raises(TelemetryError, match=text):
        open_source("nvml")
    assert count_nvidia_gpus() == 0


def test_missing_bindings_are_a_telemetry_error_and_count_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with pytest.raises(TelemetryError, match="nvidia-ml-py"):
        NvmlSource()
    assert count_nvidia_gpus() == 0


def test_count_failure_after_init_shuts_down_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = install(monkeypatch, count_error=Unknown)
    with pytest.raises(TelemetryError, match="count"):
        NvmlSource()
    assert nvml.refcount == 0
    assert nvml.shutdown_calls == 1
    assert count_nvidia_gpus() == 0
    assert nvml.refcount == 0


def test_count_nvidia_gpus_counts_and_shuts_down(fake: FakeNvml) -> None:
    assert count_nvidia_gpus() == 2
    assert fake.refcount == 0
    assert fake.shutdown_calls == 1


def test_count_nvidia_gpus_while_a_source_is_open(fake: FakeNvml) -> None:
    source = NvmlSource()
    assert count_nvidia_gpus() == 2
    assert source.read()[0].temperature_c == 64.0  # NVML init is reference counted
    source.close()
    assert fake.refcount == 0


def test_close_shuts_nvml_down_once_and_tolerates_errors(fake: FakeNvml) -> None:
    source = NvmlSource()
    source.close()
    source.close()
    assert fake.shutdown_calls == 1
    assert fake.refcount == 0
    assert source.read() == []

    fake.shutdown_error = Unknown
    other = NvmlSource()
    other.close()  # must not raise
    assert fake.shutdown_calls == 2


def test_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, gpus=[])
    source = NvmlSource()
    assert source.read() == []
    assert source.gpu_count == 0
    assert count_nvidia_gpus() == 0


def test_the_fake_raises_the_real_librarys_error_classes(fake: FakeNvml) -> None:
    fake.gpus[0].temperature_c = NotSupported
    module = fake.module
    module.nvmlInit()
    handle = module.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(real_pynvml.NVMLError_NotSupported):
        module.nvmlDeviceGetTemperature(handle, real_pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(real_pynvml.NVMLError_InvalidArgument):
        module.nvmlDeviceGetHandleByIndex(7)
    fake.gpus[1].lost = True
    with pytest.raises(real_pynvml.NVMLError_GpuIsLost):
        module.nvmlDeviceGetHandleByIndex(1)
    assert real_pynvml.NVMLError(real_pynvml.NVML_ERROR_FUNCTION_NOT_FOUND).__class__ is (
        FunctionNotFound
    )
    module.nvmlShutdown()
    with pytest.raises(real_pynvml.NVMLError_Uninitialized):
        module.nvmlDeviceGetCount()
