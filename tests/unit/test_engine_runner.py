"""An engine's runner, in-process, against a fake process and a fake health probe.

The runner (``appliance/supervisor/runner.py``) is the only code that moves its engine's
state, from its own task; everything else asks through its inbox. These tests drive it
as the supervisor and the gateway do (commands, a crash, a hang, heat) and watch what
it does: the states it passes through, when it spawns and kills, what it answers. No
subprocess, no HTTP: a crash is a future set, a hung engine a probe that fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from appliance.config import Config, parse_config
from appliance.control import CommandResult, NoGateway
from appliance.endpoint import EngineAddress
from appliance.engine import EngineSpec, EngineState, RestartReason
from appliance.errors import IllegalTransition
from appliance.health import Observation
from appliance.supervisor.commands import CheckNow, Drain, Nudge, Restart, Resume
from appliance.supervisor.coordination import RestartCoordinator
from appliance.supervisor.heat import HeatWatch
from appliance.supervisor.runner import UNRESPONSIVE_GRACE_S, EngineRunner
from appliance.telemetry import GpuReading

S = EngineState
BACKOFF_S = 0.2
CONFIG: dict[str, dict[str, Any]] = {
    "health": {"interval_s": 0.05, "failures_to_restart": 2},
    "restart": {"backoff_initial_s": BACKOFF_S, "backoff_max_s": 1.0, "drain_timeout_s": 30},
    "engine": {"stop_timeout_s": 20},
}


class FakeLink(NoGateway):
    def __init__(self) -> None:
        self.busy = 0  # requests in flight on every engine
        self.abandoned: list[tuple[int, str]] = []

    def inflight(self, engine_id: int) -> int:
        return self.busy

    def abandon(self, engine_id: int, why: str) -> int:
        self.abandoned.append((engine_id, why))
        return 0


class FakeHost:
    """The supervisor around the runners: config, link, stop flag, coordinator."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.link = FakeLink()
        self.stopping = False
        self.fast_stop = False
        self.runners: list[EngineRunner] = []
        self.coordinator = RestartCoordinator(lambda: ((r.id, r.state) for r in self.runners))
        self.seen: list[tuple[int, EngineState]] = []

    def gpu_reading(self, index: int) -> GpuReading | None:
        return None

    def state_changed(self, engine_id: int, state: EngineState) -> None:
        self.coordinator.state_changed(engine_id, state)
        self.seen.append((engine_id, state))


class FakeProcess:
    """An engine process: spawned, crashed (a future set) or killed, nothing real."""

    def __init__(self) -> None:
        self.api_key = ""
        self.started = False
        self.spawned_at: list[float] = []
        self.batched: list[int | None] = []
        self.kills: list[float] = []  # the grace each kill gave
        self.exits: list[str] = []
        self._exit: asyncio.Future[int] | None = None
        self.listener: bool | None = True  # who listens where it should: ours
        self.listener_checks = 0

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit is not None and self._exit.done() else None

    @property
    def pid(self) -> int | None:
        return 4242 if self.started and self.returncode is None else None

    @property
    def spawns(self) -> int:
        return len(self.spawned_at)

    def crash(self, code: int = 1) -> None:
        assert self._exit is not None
        self._exit.set_result(code)

    def port_taken(self) -> bool:
        return False

    def remove_stale_socket(self) -> None:
        pass

    async def spawn(self, batched_tokens: int | None) -> None:
        self.spawned_at.append(time.monotonic())
        self.batched.append(batched_tokens)
        self.api_key = f"key-{self.spawns}"
        self._exit = asyncio.get_running_loop().create_future()
        self.started = True

    async def wait(self) -> int:
        assert self._exit is not None
        return await asyncio.shield(self._exit)

    async def wait_exit(self, timeout_s: float) -> None:
        assert self._exit is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._exit), timeout_s)

    def log_exit(self, when: str) -> RestartReason:
        self.exits.append(when)
        return RestartReason.EXITED

    def exit_reason(self) -> str:
        return "exited with status 1: ValueError: bad argument"

    @property
    def last_exit(self) -> str | None:
        return None

    async def listener_is_ours(self) -> bool | None:
        self.listener_checks += 1
        return self.listener

    async def remember_tree(self) -> None:
        pass

    async def sample_tree(self) -> int | None:
        return None

    async def kill_tree(self, timeout_s: float, why: str = "") -> None:
        self.kills.append(timeout_s)
        if self._exit is not None and not self._exit.done():
            self._exit.set_result(-15)

    async def wait_resources_free(
        self,
        readings: Callable[[], Sequence[GpuReading | None]],
        stopping: Callable[[], bool],
        poll_s: float,
    ) -> None:
        pass


class FakeProbe:
    """Health checks: a real token each time while ``healthy``; none (and a failed probe)
    otherwise, which is how a hung engine looks. ``gate`` holds a check in flight."""

    def __init__(self) -> None:
        self.healthy = True
        self.checks = 0
        self.gate: asyncio.Event | None = None
        self._tokens = 0.0

    def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def observe(self, api_key: str, timeout_s: float) -> Observation:
        self.checks += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.healthy:
            self._tokens += 1
            return Observation(True, True, self._tokens, 0.0)
        return Observation(True, False, self._tokens, 1.0, "probe: TimeoutError after 1 s")

    async def kv_usage(self, timeout_s: float) -> float | None:
        return None


class Engines:
    def __init__(self, host: FakeHost, n: int) -> None:
        self.host = host
        self.procs = [FakeProcess() for _ in range(n)]
        self.probes = [FakeProbe() for _ in range(n)]
        argv = ("python", "-m", "vllm", "--max-num-batched-tokens", "8192")
        specs = [
            EngineSpec(i, None, EngineAddress(uds=f"/x/e{i}"), argv, f"t-{i}") for i in range(n)
        ]
        host.runners = [
            EngineRunner(s, host, p, q)
            for s, p, q in zip(specs, self.procs, self.probes, strict=True)
        ]
        self.runners: Sequence[EngineRunner] = host.runners

    def states(self, engine_id: int = 0) -> list[EngineState]:
        return [s for i, s in self.host.seen if i == engine_id]


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def running(n: int = 1, **sections: dict[str, Any]) -> AsyncIterator[Engines]:
    host = FakeHost(parse_config({**CONFIG, **sections}))
    engines = Engines(host, n)
    tasks = [asyncio.create_task(r.run()) for r in engines.runners]
    try:
        for r in engines.runners:
            await until(lambda r=r: r.state is S.READY, f"engine{r.id} READY")  # type: ignore[misc]
        yield engines
    finally:
        host.stopping = True
        for r in engines.runners:
            r.tell(Nudge())
        await asyncio.wait_for(asyncio.gather(*tasks), 5)


# ---- failures ----------------------------------------------------------------------------
async def test_a_crash_is_followed_by_a_backoff_then_a_new_start() -> None:
    async with running() as e:
        runner, proc = e.runners[0], e.procs[0]
        crashed_at = time.monotonic()
        proc.crash(1)
        await until(lambda: proc.spawns == 2 and runner.state is S.READY, "READY again")
        assert proc.exits == ["while serving"]
        assert proc.spawned_at[1] - crashed_at >= BACKOFF_S
        assert e.states() == [S.STARTING, S.READY, S.STOPPING, S.EXITED, S.STARTING, S.READY]
        status = runner.status()
        assert (status.restarts, status.restarts_by_reason) == (1, {"exited": 1})
        assert status.api_key == "key-2"  # a new key per spawn


async def test_a_spent_crash_budget_leaves_it_failed_until_an_admin_restarts_it() -> None:
    async with running(restart={**CONFIG["restart"], "max_restarts_per_hour": 1}) as e:
        runner, proc = e.runners[0], e.procs[0]
        proc.crash()
        await until(lambda: proc.spawns == 2 and runner.state is S.READY, "restarted once")
        proc.crash()
        await until(lambda: runner.state is S.FAILED, "FAILED")
        assert (await runner.ask(Restart())).ok
        await until(lambda: proc.spawns == 3 and runner.state is S.READY, "READY after admin")


async def test_a_hang_verdict_kills_it_soon_and_gives_up_its_requests() -> None:
    async with running() as e:
        runner, proc, probe = e.runners[0], e.procs[0], e.probes[0]
        probe.healthy = False
        await until(lambda: runner.state is S.SUSPECT, "SUSPECT after one failed check")
        await until(lambda: bool(proc.kills), "killed as hung")
        probe.healthy = True
        await until(lambda: proc.spawns == 2 and runner.state is S.READY, "READY again")
        assert proc.kills[0] <= UNRESPONSIVE_GRACE_S  # not engine.stop_timeout_s (20 s)
        assert e.host.link.abandoned == [(0, "the engine stopped answering")]
        assert runner.status().restarts_by_reason == {"hung": 1}


# ---- commands ----------------------------------------------------------------------------
async def test_a_drain_command_makes_it_draining_until_resumed() -> None:
    async with running() as e:
        runner, probe = e.runners[0], e.probes[0]
        refused = await runner.ask(Drain())
        assert (refused.ok, refused.state) == (False, S.READY)
        assert "last engine serving" in refused.message and "?force=true" in refused.message
        drained = await runner.ask(Drain(force=True))
        assert (drained.ok, drained.state) == (True, S.DRAINING)
        checks = probe.checks
        await until(lambda: probe.checks >= checks + 2, "two more health checks")
        assert runner.state is S.DRAINING  # good checks do not put it back: only resume does
        resumed = await runner.ask(Resume())
        assert (resumed.ok, resumed.state) == (True, S.READY)
        assert not (await runner.ask(Resume())).ok  # only a drained engine resumes


async def test_with_another_engine_serving_a_drain_needs_no_force() -> None:
    async with running(2) as e:
        assert (await e.runners[0].ask(Drain())).state is S.DRAINING
        assert not (await e.runners[1].ask(Drain())).ok  # now engine 1 is the last


async def test_a_planned_restart_drains_first_and_does_not_back_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "appliance.supervisor")
    async with running() as e:
        runner, proc, link = e.runners[0], e.procs[0], e.host.link
        link.busy = 1  # a request in flight
        assert (await runner.ask(Restart())).ok
        await until(lambda: runner.state is S.DRAINING, "DRAINING")
        assert proc.spawns == 1 and not proc.kills  # it waits for the request
        link.busy = 0
        await until(lambda: proc.spawns == 2 and runner.state is S.READY, "READY again")
        assert runner.status().restarts_by_reason == {"admin": 1}
        assert "restarting in" not in caplog.text  # planned: no backoff
        assert "engine0: admin restart: draining first" in caplog.text


async def test_commands_are_answered_while_a_health_check_is_in_flight() -> None:
    async with running() as e:
        runner, probe = e.runners[0], e.probes[0]
        probe.gate = asyncio.Event()
        checks = probe.checks
        await until(lambda: probe.checks > checks, "a check in flight")
        result = await asyncio.wait_for(runner.ask(Drain(force=True)), 1.0)
        assert (result.ok, result.state) == (True, S.DRAINING)
        probe.gate.set()


async def test_a_stopped_runner_refuses_commands_at_once() -> None:
    async with running() as e:
        runner = e.runners[0]
    result = await asyncio.wait_for(runner.ask(Drain(force=True)), 1.0)
    assert not result.ok and "stopping" in result.message


# ---- nobody else moves its state -----------------------------------------------------------
async def test_its_state_cannot_be_written_from_outside_its_task() -> None:
    async with running() as e:
        runner = e.runners[0]
        assert getattr(EngineRunner, "state").fset is None  # noqa: B009
        with pytest.raises(AttributeError):
            runner.state = S.DRAINING  # type: ignore[misc]
        with pytest.raises(IllegalTransition, match="outside the engine's runner task"):
            runner._set_state(S.DRAINING)
        assert runner.state is S.READY
        classes = EngineRunner.__mro__[:-1]  # its own and RunnerFace's (runner_status.py)
        public = {n for c in classes for n in vars(c) if not n.startswith("_")}
        readers = {"id", "state", "heat_reduced", "status"}
        askers = {"ask", "tell"}
        lifetime = {"run", "open", "close", "kill_now"}
        assert public == readers | askers | lifetime


# ---- heat: the heat loop's word, the runner's restart ----------------------------------------
async def test_sustained_heat_restarts_it_with_half_the_batched_tokens() -> None:
    thermal = {"heat_restart_after_s": 30, "heat_restore_after_s": 60}
    async with running(thermal=thermal) as e:
        runner, proc, host = e.runners[0], e.procs[0], e.host
        heat = HeatWatch(source=None, config=lambda: host.config)  # type: ignore[arg-type]
        heat.readings = {0: GpuReading(0, temperature_c=95.0)}  # level 4: the hard limit

        async def govern(now: float) -> None:
            heat.govern(e.runners, host.link, now)
            await runner.ask(Nudge())  # answered after the heat loop's word: it was heard

        await govern(100.0)
        await govern(129.0)
        assert not runner.heat_reduced  # not yet 30 s at the hard limit
        await govern(130.0)
        assert runner.heat_reduced
        await until(lambda: proc.spawns == 2 and runner.state is S.READY, "restarted")
        assert proc.batched == [None, 4096]
        heat.readings = {0: GpuReading(0, temperature_c=40.0)}
        for t in (200.0, 201.0, 202.0, 203.0):  # one level down per reading: 0 from 203 s
            await govern(t)
        await govern(262.0)
        assert runner.heat_reduced  # not yet 60 s cool
        await govern(263.0)
        assert not runner.heat_reduced
        await until(lambda: proc.spawns == 3 and runner.state is S.READY, "restored")
        assert proc.batched == [None, 4096, None]
        assert runner.status().restarts_by_reason == {"heat": 2}


# ---- the gateway's word: a connection to its TCP port was someone else's ----------------
async def check_listener(runner: EngineRunner) -> CommandResult:
    """As ``Supervisor.check_listener`` asks: the answer comes once the check is done."""
    done: asyncio.Future[CommandResult] = asyncio.get_running_loop().create_future()
    taken = await runner.ask(CheckNow(done))
    return await asyncio.wait_for(done, 5) if taken.ok else taken


async def test_a_check_asked_for_runs_at_once_and_answers_when_done() -> None:
    """Health checks every 10 minutes: the gateway's ask is not left until then."""
    async with running(health={"interval_s": 600}) as e:
        runner, proc = e.runners[0], e.procs[0]
        before = proc.listener_checks
        result = await asyncio.wait_for(check_listener(runner), 5)
        assert (result.ok, result.state) == (True, S.READY)
        assert proc.listener_checks == before + 1


async def test_a_check_that_finds_someone_else_listening_replaces_the_engine() -> None:
    async with running(health={"interval_s": 600}) as e:
        runner, proc = e.runners[0], e.procs[0]
        proc.listener = False
        result = await asyncio.wait_for(check_listener(runner), 5)
        assert not result.ok and result.message == "it is going down"
        assert runner.state is not S.READY  # out of service before the asker hears
        await until(lambda: proc.kills != [], "the engine's tree killed")
        # Not READY again while the port is someone else's.
        assert S.STOPPING in e.states()


async def test_a_drained_engine_is_checked_and_a_stopped_one_answers_at_once() -> None:
    async with running(health={"interval_s": 600}) as e:
        runner = e.runners[0]
        assert (await runner.ask(Drain(force=True))).ok
        drained = await asyncio.wait_for(check_listener(runner), 5)
        assert drained.ok  # a drained engine is still watched: its check ran
    stopped = await asyncio.wait_for(check_listener(runner), 1)
    assert not stopped.ok and "stopping" in stopped.message
