"""The heat loop: GPU readings, the thermal governor's levels, and heat restarts.

Every ``telemetry.interval_s`` the source is read (in a thread: NVML blocks), each
GPU's throttle level follows from its reading through the governor ``[thermal] governor``
names (:func:`appliance.policy.predictive.govern_predictive`, the default, or
:func:`appliance.policy.thermal.govern`, the stepped one), and each engine's level goes
to the gateway, which admits less to a hot GPU. When
``thermal.heat_restart_after_s`` is on, a GPU held at the hard limit that long
(:func:`appliance.policy.thermal.sustained_heat`) gets a word to its engine's runner to
restart with fewer batched tokens, and one cool for ``heat_restore_after_s`` a word to
restore them; the runner decides (it alone changes the engine). Each reading also goes
to the gateway as it is (``telemetry_read``), which shares the GPUs' energy among keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.config import Config
from appliance.control import GatewayLink, GpuStatus
from appliance.policy.predictive import PredictiveState, govern_predictive
from appliance.policy.thermal import ThermalPolicy, govern, sustained_heat
from appliance.supervisor.commands import HeatRestart
from appliance.supervisor.runner import EngineRunner
from appliance.telemetry import GpuReading, TelemetrySource

log = logging.getLogger("appliance.supervisor")


@dataclass(slots=True)
class LevelRun:
    """A telemetry entry's throttle level, unchanged since ``since`` (monotonic)."""

    level: int
    since: float


class HeatWatch:
    """GPU readings and throttle levels; the telemetry index of an engine is its GPU's
    index, else its id (:attr:`appliance.control.EngineStatus.telemetry_index`)."""

    def __init__(self, source: TelemetrySource, config: Callable[[], Config]) -> None:
        self.source = source
        self._config = config  # the config in force (a reload replaces it)
        self.readings: dict[int, GpuReading] = {}  # telemetry index -> last reading
        self.levels: dict[int, int] = {}  # telemetry index -> throttle level
        self._runs: dict[int, LevelRun] = {}  # telemetry index -> its level since when
        # telemetry index -> the predictive governor's memory (trend, when the level began)
        self._predictive: dict[int, PredictiveState] = {}
        self._nudged = asyncio.Event()  # a reload: read again now, at the new interval

    def gpus(self) -> tuple[GpuStatus, ...]:
        return tuple(GpuStatus(r, self.levels.get(i, 0)) for i, r in sorted(self.readings.items()))

    async def run(
        self,
        runners: Sequence[EngineRunner],
        link: Callable[[], GatewayLink],
        stopping: Callable[[], bool],
    ) -> None:
        """Read, govern, tell, every telemetry.interval_s until the daemon stops."""
        warned = False
        told_failed = False  # telemetry_read failed, said once until it works again
        while not stopping():
            read = False
            try:
                readings = await asyncio.to_thread(self.source.read)
                self.readings = {r.index: r for r in readings}
                warned = False
                read = True
            except Exception as exc:  # a failing sensor source never stops the daemon
                if not warned:
                    log.warning("GPU telemetry read failed: %s", exc)
                    warned = True
            self.govern(runners, link(), time.monotonic())
            if read:  # a failed read is no new figure: the next one covers both intervals
                try:
                    link().telemetry_read(self.gpus())
                    told_failed = False
                except Exception:  # energy per key failing never stops the governor
                    if not told_failed:
                        log.exception("sharing the GPUs' energy among keys failed")
                        told_failed = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), self._config().telemetry.interval_s)
            self._nudged.clear()

    def nudge(self) -> None:
        """Cut the current wait short (a reload may have changed telemetry.interval_s)."""
        self._nudged.set()

    def govern(self, runners: Sequence[EngineRunner], link: GatewayLink, now: float) -> None:
        """Thermal governor: one level per GPU from its reading; the gateway admits less."""
        thermal = self._config().thermal
        policy = ThermalPolicy.from_config(thermal)
        for index, reading in self.readings.items():
            old = self.levels.get(index, 0)
            if thermal.governor == "stepped":
                new = govern(reading.temperature_c, reading.throttle_reasons, old, policy)
            else:
                # A switch from stepped (a reload) starts from the level in force.
                state = self._predictive.get(index, PredictiveState(old, now))
                if state.level != old:
                    state = PredictiveState(old, now)
                state = govern_predictive(
                    state, reading.temperature_c, reading.throttle_reasons, now, policy
                )
                self._predictive[index] = state
                new = state.level
            if new != old:
                log.warning(
                    "gpu%d: throttle level %d -> %d (%s°C%s)",
                    index,
                    old,
                    new,
                    "?" if reading.temperature_c is None else f"{reading.temperature_c:.0f}",
                    ", " + ",".join(reading.throttle_reasons) if reading.throttle_reasons else "",
                )
            self.levels[index] = new
        for runner in runners:
            # A tensor-parallel engine is as hot as its hottest GPU.
            index = max(runner.telemetry_indexes, key=lambda i: self.levels.get(i, 0))
            level = self.levels.get(index, 0)
            link.set_throttle(runner.id, level)
            run = self._runs.get(index)
            if run is None or run.level != level:
                run = self._runs[index] = LevelRun(level, now)
            word = self._heat_word(runner.heat_reduced, index, run, now)
            if word is not None:
                runner.tell(word)

    def _heat_word(
        self, reduced: bool, index: int, run: LevelRun, now: float
    ) -> HeatRestart | None:
        """What to tell an engine (``reduced``: it runs heat-reduced) about its GPU's heat."""
        th = self._config().thermal
        if th.heat_restart_after_s <= 0:
            return None
        held_s = now - run.since
        # The run's first reading stands for all of it: every later one has its level.
        if not reduced and sustained_heat([(run.since, run.level)], now, th.heat_restart_after_s):
            return HeatRestart(reduce=True, gpu=index, held_s=held_s)
        if reduced and run.level == 0 and held_s >= th.heat_restore_after_s:
            return HeatRestart(reduce=False, gpu=index, held_s=held_s)
        return None
