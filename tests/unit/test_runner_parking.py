"""An on-demand engine's runner, parked and unparked (models on demand, issue 23).

In-process, with test_engine_runner's fake process, probe and host, and a fake sleeper
for vLLM's /sleep and /wake_up: what the runner does when its model is put away by
stop or by sleep, woken, crashes asleep, or is told of heat while asleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

from appliance.config import parse_config
from appliance.endpoint import EngineAddress
from appliance.engine import EngineSpec, EngineState
from appliance.supervisor.commands import Nudge, Park, Restart, Unpark
from appliance.supervisor.heat import HeatWatch
from appliance.supervisor.inbox import Inbox
from appliance.supervisor.runner import EngineRunner
from appliance.telemetry import GpuReading
from tests.unit.test_engine_runner import CONFIG, FakeHost, FakeProbe, FakeProcess, until

S = EngineState


class FakeSleeper:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.wake_fails = False

    async def sleep(self, api_key: str, timeout_s: float) -> str | None:
        self.calls.append("sleep")
        return None

    async def wake_up(self, api_key: str, timeout_s: float) -> str | None:
        self.calls.append("wake_up")
        return "POST /wake_up: HTTP 500" if self.wake_fails else None


class Waits:
    """Whether the runner's task waits with no time limit: down, or asleep, until a
    command comes (or its engine exits). Nothing else wakes it then: no backoff, no
    health check, no timer of any kind. Seen from the inbox's naps, the only way the
    runner's task waits for time to pass or for a command."""

    def __init__(self, inbox: Inbox) -> None:
        self._nap = inbox.nap
        self.untimed = False

    async def nap(self, timeout_s: float | None, *until: asyncio.Future[Any]) -> bool:
        if timeout_s is not None:
            return await self._nap(timeout_s, *until)
        self.untimed = True
        try:
            return await self._nap(timeout_s, *until)
        finally:
            self.untimed = False


@dataclass
class One:
    host: FakeHost
    runner: EngineRunner
    proc: FakeProcess
    sleeper: FakeSleeper
    waits: Waits

    async def settled(self, what: str) -> None:
        """Until the runner has done all it does by itself: every command told before is
        carried out (the Nudge is answered after them), and it waits with no time limit.
        What it has not done by then it does not do until told."""
        await self.runner.ask(Nudge())
        await until(lambda: self.waits.untimed, what)


class SlowToFree(FakeProcess):
    """A GPU engine whose memory is not seen free after its stop until ``freed`` is set
    (on a shared slot the other model, started meanwhile, holds the GPU's memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.freed = asyncio.Event()
        self.freeing = False  # the runner waits for the memory now

    async def wait_resources_free(self, *args: object, **kwargs: object) -> None:
        self.freeing = True
        await self.freed.wait()
        self.freed.clear()
        self.freeing = False


@contextlib.asynccontextmanager
async def parked_engine(proc: FakeProcess | None = None, **sections: object) -> AsyncIterator[One]:
    host = FakeHost(parse_config({**CONFIG, **sections}))
    proc, sleeper = proc or FakeProcess(), FakeSleeper()
    argv = ("python", "-m", "vllm", "--max-num-batched-tokens", "8192")
    spec = EngineSpec(0, 0, EngineAddress(uds="/x/e0"), argv, "t-0", on_demand=True, gpus=(0,))
    runner = EngineRunner(spec, host, proc, FakeProbe(), sleeper=sleeper)
    host.runners = [runner]
    waits = Waits(runner._inbox)
    with mock.patch.object(runner._inbox, "nap", waits.nap):
        task = asyncio.create_task(runner.run())
        try:
            yield One(host, runner, proc, sleeper, waits)
        finally:
            host.stopping = True
            runner.tell(Nudge())
            await asyncio.wait_for(task, 5)


async def test_an_on_demand_engine_is_not_started_until_its_model_is_loaded() -> None:
    async with parked_engine() as e:
        await e.settled("down until its model is loaded")
        assert (e.proc.spawns, e.runner.state) == (0, S.EXITED)
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        assert e.proc.spawns == 1


async def test_put_away_by_stop_it_drains_stops_and_stays_down_uncounted() -> None:
    async with parked_engine() as e:
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        e.runner.tell(Park(sleep=False))
        await until(lambda: e.runner.state is S.EXITED, "stopped")
        await e.settled("down, no backoff and restart to come")
        assert e.proc.spawns == 1 and len(e.proc.kills) == 1
        assert S.DRAINING in [s for _, s in e.host.seen]  # drained before it went
        assert e.runner.status().restarts == 0  # an unload is not a restart


async def test_put_away_and_wanted_back_before_its_stop_ends_is_no_restart() -> None:
    # Two models wanted in turn on one GPU without a residency: this engine's model is
    # loaded again while its runner still waits for the GPU's memory after the stop.
    # Each such turn was booked as a crash restart (with a backoff), until the engine
    # was FAILED and its model never loaded again.
    restart = {**CONFIG["restart"], "max_restarts_per_hour": 1}
    proc = SlowToFree()
    async with parked_engine(proc, restart=restart) as e:
        e.runner.tell(Unpark())
        for turn in range(1, 4):
            await until(lambda t=turn: e.proc.spawns == t and e.runner.state is S.READY, "up")
            e.runner.tell(Park(sleep=False))
            await until(lambda: proc.freeing, "stopped, waiting for its GPU memory")
            e.runner.tell(Unpark())
            proc.freed.set()
        await until(lambda: e.proc.spawns == 4 and e.runner.state is S.READY, "up again")
        assert e.runner.status().restarts == 0


async def test_stopped_its_engine_says_it_is_releasing_until_its_gpu_memory_is_free() -> None:
    # What its model's owner waits for before the next model of the slot may start: the
    # engine is EXITED at once, but its GPU memory is not free yet.
    proc = SlowToFree()
    async with parked_engine(proc) as e:
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        assert not e.runner.releasing
        e.runner.tell(Park(sleep=False))
        await until(lambda: proc.freeing, "stopped, waiting for its GPU memory")
        assert e.runner.state is S.EXITED and e.runner.releasing
        proc.freed.set()
        await until(lambda: not e.runner.releasing, "its GPU memory seen free")


async def test_an_admin_restart_of_a_failed_parked_engine_leaves_it_down_until_loaded() -> None:
    # Its model could not be loaded (every engine FAILED) and was parked; an admin fixed
    # the cause and restarted it: no longer FAILED (requests may load it again), but not
    # started before its model is loaded, with a fresh crash budget.
    restart = {**CONFIG["restart"], "max_restarts_per_hour": 1}
    async with parked_engine(restart=restart) as e:
        e.runner.tell(Unpark())
        for spawns in (1, 2):
            await until(lambda n=spawns: e.proc.spawns == n and e.runner.state is S.READY, "up")
            e.proc.crash()
        await until(lambda: e.runner.state is S.FAILED, "FAILED")
        e.runner.tell(Park(sleep=False))
        assert (await e.runner.ask(Restart())).ok
        await until(lambda: e.runner.state is S.EXITED, "down, no longer FAILED")
        await e.settled("down until its model is loaded")
        assert e.proc.spawns == 2
        e.runner.tell(Unpark())
        await until(lambda: e.proc.spawns == 3 and e.runner.state is S.READY, "loaded")
        e.proc.crash()  # the budget is fresh: restarted, not FAILED
        await until(lambda: e.proc.spawns == 4 and e.runner.state is S.READY, "restarted")


async def test_put_to_sleep_and_woken_it_is_never_restarted() -> None:
    async with parked_engine() as e:
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        e.runner.tell(Park(sleep=True))
        await until(lambda: e.runner.state is S.SLEEPING, "asleep")
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "woken")
        assert e.sleeper.calls == ["sleep", "wake_up"]
        assert (e.proc.spawns, e.proc.kills) == (1, [])


async def test_a_failed_wake_restarts_the_engine() -> None:
    async with parked_engine() as e:
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        e.runner.tell(Park(sleep=True))
        await until(lambda: e.runner.state is S.SLEEPING, "asleep")
        e.sleeper.wake_fails = True
        e.runner.tell(Unpark())
        await until(lambda: e.proc.spawns == 2 and e.runner.state is S.READY, "started again")


async def test_a_crash_while_asleep_waits_for_the_next_load() -> None:
    async with parked_engine() as e:
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        e.runner.tell(Park(sleep=True))
        await until(lambda: e.runner.state is S.SLEEPING, "asleep")
        e.proc.crash(1)
        await until(lambda: e.runner.state is S.EXITED, "gone")
        await e.settled("down until its model is loaded")
        assert e.proc.spawns == 1  # not restarted while its model is put away
        e.runner.tell(Unpark())
        await until(lambda: e.proc.spawns == 2 and e.runner.state is S.READY, "loaded again")


async def test_heat_while_asleep_restarts_it_only_once_woken() -> None:
    thermal = {"heat_restart_after_s": 30, "heat_restore_after_s": 60}
    async with parked_engine(thermal=thermal) as e:
        e.runner.tell(Unpark())
        await until(lambda: e.runner.state is S.READY, "started")
        e.runner.tell(Park(sleep=True))
        await until(lambda: e.runner.state is S.SLEEPING, "asleep")
        heat = HeatWatch(source=None, config=lambda: e.host.config)  # type: ignore[arg-type]
        heat.readings = {0: GpuReading(0, temperature_c=95.0)}  # the hard limit
        for now in (100.0, 131.0):
            heat.govern([e.runner], e.host.link, now)
            await e.runner.ask(Nudge())
        await e.settled("asleep until its model is loaded")
        assert (e.runner.state, e.proc.spawns) == (S.SLEEPING, 1)  # asleep: no restart
        e.runner.tell(Unpark())
        await until(lambda: e.proc.spawns == 2 and e.runner.state is S.READY, "restarted")
        assert e.proc.batched == [None, 4096]
        assert e.runner.status().restarts_by_reason == {"heat": 1}
