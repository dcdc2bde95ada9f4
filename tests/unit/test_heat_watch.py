"""The heat loop re-reads its interval at a reload, not after the wait already running."""

from __future__ import annotations

import asyncio
import dataclasses

from appliance.config import Config
from appliance.control import GatewayLink
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
    link: GatewayLink = None  # type: ignore[assignment]  # no readings: never called
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
