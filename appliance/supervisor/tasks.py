"""The supervisor's tasks: the telemetry loop and one task per engine runner.

They start together once the gateway listens. At exit the runners get a bounded time to
stop their engines, every task left is cancelled, and then, whatever happened above,
each engine's process tree is killed: no engine process outlives the daemon.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

from appliance.config import Config
from appliance.supervisor.runner import EngineRunner

# Beyond the longest engine.stop_timeout_s, what the runners get to finish at exit.
STOP_MARGIN_S = 15


class SupervisorTasks:
    """The tasks the supervisor started, and the order in which they end."""

    def __init__(self) -> None:
        self._all: list[asyncio.Task[None]] = []
        self._runners: list[asyncio.Task[None]] = []

    def start(
        self,
        telemetry: Coroutine[Any, Any, None],
        runners: Sequence[EngineRunner],
        models: Coroutine[Any, Any, None] | None = None,
    ) -> None:
        self._all.append(asyncio.create_task(telemetry, name="telemetry"))
        if models is not None:  # models on demand: their loads and swaps
            self._all.append(asyncio.create_task(models, name="models"))
        self._runners = [asyncio.create_task(r.run(), name=r.spec.name) for r in runners]
        self._all += self._runners

    async def runners_done(self) -> None:
        """Until every runner's task has returned (each stops its engine first)."""
        await asyncio.gather(*self._runners, return_exceptions=True)

    async def shut_down(
        self, runners: Sequence[EngineRunner], config: Config, kill_timeout_s: float
    ) -> None:
        """The runners told to stop: wait for them (bounded), cancel the rest, kill trees."""
        if self._runners:
            longest = max(m.engine.stop_timeout_s for m in config.served)
            await asyncio.wait(self._runners, timeout=longest + STOP_MARGIN_S)
        for t in self._all:
            t.cancel()
        await asyncio.gather(*self._all, return_exceptions=True)
        # Whatever happened above, no engine process may outlive us.
        for r in runners:
            await r.kill_now(kill_timeout_s)
