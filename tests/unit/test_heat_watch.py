"""The heat loop re-reads its interval at a reload, not after the wait already running."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from appliance.config import Config
from appliance.control import EngineStatus, GatewayLink, GpuStatus, NoGateway
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.policy.thermal import HARD_LEVEL
from appliance.supervisor.heat import HeatWatch
from appliance.telemetry import GpuReading


class CountingSource:
    """Counts reads (made in a worker thread) and wakes the test at a given count."""

    def __init__(self) -> None:
        self.reads = 0
        self.target = 1
        self.reached = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def read(self) -> list[GpuReading]:
        self.reads += 1
        if self.reads >= self.target:
            self._loop.call_soon_threadsafe(self.reached.set)
        return []

    def close(self) -> None:
        pass


def with_interval(config: Config, seconds: float) -> Config:
    return dataclasses.replace(
        config, telemetry=dataclasses.replace(config.telemetry, interval_s=seconds)
    )


async def test_a_reload_shortening_the_interval_applies_at_once() -> None:
    config = with_interval(Config(), 3600.0)  # the wait under way would last an hour
    source = CountingSource()
    heat = HeatWatch(source, lambda: config)
    stop = False
    link: GatewayLink = NoGateway()
    task = asyncio.create_task(heat.run([], lambda: link, lambda: stop))
    await asyncio.wait_for(source.reached.wait(), 2)
    source.reached.clear()
    source.target = 4
    config = with_interval(config, 0.05)  # what merge_live does at SIGHUP
    heat.nudge()  # what the coordinator's reload does
    await asyncio.wait_for(source.reached.wait(), 2)  # not an hour
    stop = True
    heat.nudge()
    await asyncio.wait_for(task, 2)


class TensorParallelRunner:
    """What the heat loop reads of a runner: one engine over GPUs 0 and 1."""

    id = 0
    heat_reduced = False

    def __init__(self) -> None:
        self.told: list[object] = []
        self.telemetry_indexes = self.status().telemetry_indexes

    def status(self) -> EngineStatus:
        return EngineStatus(
            id=0,
            gpu=0,
            address=EngineAddress(uds="/run/x/engine0.sock"),
            state=EngineState.READY,
            api_key="k",
            gpus=(0, 1),
        )

    def tell(self, command: object) -> None:
        self.told.append(command)


class ThrottleLink:
    def __init__(self) -> None:
        self.levels: dict[int, int] = {}

    def set_throttle(self, engine_id: int, level: int) -> None:
        self.levels[engine_id] = level


def test_a_tensor_parallel_engine_is_as_hot_as_its_hottest_gpu() -> None:
    config = Config()
    heat = HeatWatch(CountingSource.__new__(CountingSource), lambda: config)
    # GPU 0 cool, GPU 1 (the engine's second) at the hard limit.
    heat.readings = {0: GpuReading(0, temperature_c=50.0), 1: GpuReading(1, temperature_c=95.0)}
    link = ThrottleLink()
    runner = TensorParallelRunner()
    heat.govern([runner], link, now=0.0)  # type: ignore[list-item, arg-type]
    assert link.levels == {0: HARD_LEVEL}
    heat.readings = {0: GpuReading(0, temperature_c=95.0), 1: GpuReading(1, temperature_c=50.0)}
    heat.govern([runner], link, now=1.0)  # type: ignore[list-item, arg-type]
    # Now GPU 0 is the hot one: the engine is still at the hard limit.
    assert link.levels == {0: HARD_LEVEL}


def with_governor(config: Config, governor: str) -> Config:
    return dataclasses.replace(
        config, thermal=dataclasses.replace(config.thermal, governor=governor)
    )


def test_the_governor_is_the_one_thermal_governor_names() -> None:
    config = Config()
    heat = HeatWatch(CountingSource.__new__(CountingSource), lambda: config)
    link = ThrottleLink()
    runner = TensorParallelRunner()
    heat.readings = {0: GpuReading(0, temperature_c=82.0), 1: GpuReading(1, temperature_c=50.0)}
    heat.govern([runner], link, now=0.0)  # type: ignore[list-item, arg-type]
    assert link.levels == {0: 2}  # predictive (the default): 1 °C early, 82 + 1 >= 82.33
    config = with_governor(config, "stepped")  # a reload
    heat.readings = {0: GpuReading(0, temperature_c=77.0), 1: GpuReading(1, temperature_c=50.0)}
    heat.govern([runner], link, now=1.0)  # type: ignore[list-item, arg-type]
    assert link.levels == {0: 1}  # stepped: 77 < 82.33 - 5, one step down per reading
    config = with_governor(config, "predictive")
    heat.govern([runner], link, now=2.0)  # type: ignore[list-item, arg-type]
    # predictive from the level in force (1), just taken: held, 77 + 1 is not below 75
    assert link.levels == {0: 1}


class EnergySource:
    """GPU 0's energy counter rising 100 J a read; the third read fails."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> list[GpuReading]:
        self.reads += 1
        if self.reads == 3:
            raise OSError("sensor source hiccup")
        return [GpuReading(0, temperature_c=50.0, energy_j=100.0 * self.reads)]

    def close(self) -> None:
        pass


class ReadingsLink(NoGateway):
    def __init__(self) -> None:
        self.seen: list[tuple[GpuStatus, ...]] = []
        self.enough = asyncio.Event()

    def telemetry_read(self, gpus: tuple[GpuStatus, ...]) -> None:
        self.seen.append(gpus)
        if len(self.seen) >= 3:
            self.enough.set()


async def test_each_reading_goes_to_the_gateway_once_and_a_failed_read_does_not() -> None:
    """The gateway shares GPU energy among keys per telemetry tick (energy per key): it
    gets every reading as read, and nothing for a read that failed (the next reading's
    difference covers both intervals)."""
    config = with_interval(Config(), 0.01)
    heat = HeatWatch(EnergySource(), lambda: config)
    link = ReadingsLink()
    stop = False
    task = asyncio.create_task(heat.run([], lambda: link, lambda: stop))
    await asyncio.wait_for(link.enough.wait(), 5)
    stop = True
    heat.nudge()
    await asyncio.wait_for(task, 2)
    energies = [[g.reading.energy_j for g in gpus] for gpus in link.seen[:3]]
    assert energies == [[100.0], [200.0], [400.0]]


class FailingLink(NoGateway):
    """A gateway whose energy accounting raises at every telemetry tick."""

    def __init__(self) -> None:
        self.throttled = 0
        self.enough = asyncio.Event()

    def set_throttle(self, engine_id: int, level: int) -> None:
        self.throttled += 1
        if self.throttled >= 5:
            self.enough.set()

    def telemetry_read(self, gpus: tuple[GpuStatus, ...]) -> None:
        raise RuntimeError("bug in accounting")


async def test_a_failing_telemetry_read_never_stops_the_governor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """telemetry_read raised out of the loop: the heat task died, and with it the thermal
    governor, for good. Now it is said once and the loop goes on governing."""
    config = with_interval(Config(), 0.01)
    heat = HeatWatch(EnergySource(), lambda: config)
    link = FailingLink()
    stop = False
    runner = TensorParallelRunner()
    with caplog.at_level(logging.ERROR, "appliance.supervisor"):
        task = asyncio.create_task(heat.run([runner], lambda: link, lambda: stop))  # type: ignore[list-item]
        await asyncio.wait_for(link.enough.wait(), 5)
        assert not task.done()
        stop = True
        heat.nudge()
        await asyncio.wait_for(task, 2)
    failed = [r for r in caplog.records if "energy among keys failed" in r.getMessage()]
    assert len(failed) == 1  # once per episode, not per tick
