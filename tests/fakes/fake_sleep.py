"""vLLM's sleep mode on the fake engine: ``POST /sleep``, ``POST /wake_up``,
``GET /is_sleeping``, registered only with ``VLLM_SERVER_DEV_MODE=1`` (as vLLM 0.32's
``entrypoints/launchers/api_server/routers.py`` does: the development routers,
``entrypoints/serve/dev/sleep/api_router.py``).

Asleep, the engine's GPU memory is given back: with ``--gpu-share`` its fake EngineCore
is told (SIGUSR1; SIGUSR2 to take it back) and answers on its pipe once done, so
``/sleep`` answers only once the memory is free, as vLLM's does: on a GPU the child
frees its torch allocation (scripts/gpu-check), on the fake pynvml its record says share
0. A wake takes ``--wake-delay-s`` and takes the memory back. A request while asleep is
refused (503), as the appliance must never send one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

from aiohttp import web

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class SleepMode:
    def __init__(self, engine: Any, wake_delay_s: float) -> None:
        self.engine = engine
        self.wake_delay_s = wake_delay_s
        self.sleeping = False
        self.level = 0
        self.sleeps = 0
        self.wakes = 0
        self.crash_on_wake = False  # POST /fake/control {"crash_on_wake": true}

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(DEV_MODE_ENV, "0") not in ("", "0")

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/sleep", self.sleep)
        r.add_post("/wake_up", self.wake_up)
        r.add_get("/is_sleeping", self.is_sleeping)

    async def sleep(self, request: web.Request) -> web.Response:
        level = int(request.query.get("level", "1"))
        if not 0 <= level <= 2:
            return web.json_response({"error": "level must be 0..2"}, status=422)
        self.sleeping, self.level = True, level
        self.sleeps += 1
        await self._hold(False)
        return web.json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        if self.sleeping:
            if self.crash_on_wake:  # dies while copying the weights back
                await asyncio.sleep(self.wake_delay_s / 2)
                print("ERROR fake engine crashing while waking", file=sys.stderr, flush=True)
                os._exit(1)
            await asyncio.sleep(self.wake_delay_s)  # weights copied back from host RAM
            await self._hold(True)
            self.sleeping = False
            self.wakes += 1
        return web.json_response({"status": "awake", "tags": None})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleeping})

    async def _hold(self, held: bool) -> None:
        """The fake EngineCore takes its memory back (or gives it back); until it says so."""
        child = self.engine.child
        if child is None or float(self.engine.args.gpu_share) <= 0:
            return
        os.kill(child.pid, signal.SIGUSR2 if held else signal.SIGUSR1)
        await self.engine.gpu_held()
