"""An engine's status copy is built once per change, not once per read (#24 item 2).

The gateway reads every engine's copy two or three times per request (admission's room,
routing, the relay's key): these tests check that a read between changes gives the very
same copy, and that every change a reader may act on (a crash, a new spawn's key, a new
health check's figures, a drain) shows in the next read.
"""

from __future__ import annotations

from appliance.engine import EngineState
from appliance.supervisor.commands import Drain
from tests.unit.test_engine_runner import CONFIG, running, until

S = EngineState
SLOW_CHECKS = {**CONFIG["health"], "interval_s": 30.0}  # no check during a test


async def test_reads_between_changes_give_the_same_copy() -> None:
    async with running(health=SLOW_CHECKS) as e:
        runner = e.runners[0]
        first = runner.status()
        assert runner.status() is first
        assert first.state is S.READY and first.pid == 4242


async def test_a_crash_and_the_new_spawn_show_in_the_next_read() -> None:
    async with running(health=SLOW_CHECKS) as e:
        runner, proc = e.runners[0], e.procs[0]
        before = runner.status()
        proc.crash(1)
        assert runner.status().pid is None  # read before the runner even noticed
        await until(lambda: proc.spawns == 2 and runner.state is S.READY, "READY again")
        after = runner.status()
        assert (after.api_key, after.restarts, after.state) == ("key-2", 1, S.READY)
        assert before.api_key == "key-1"  # a copy never changes under its reader


async def test_a_health_check_and_a_drain_show_in_the_next_read() -> None:
    async with running() as e:  # checks every 0.05 s
        runner = e.runners[0]
        seen = runner.status().generation_tokens
        await until(lambda: runner.status().generation_tokens != seen, "a new check's figures")
        await runner.ask(Drain(force=True))  # the only engine: forced
        assert runner.status().state is S.DRAINING
