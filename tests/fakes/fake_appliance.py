"""A typed stand-in for the supervisor's side of the door (``appliance.control``'s
``ApplianceView`` and ``EngineCommands``) that gateway parts and whole gateway apps are
built over in tests: fixed config and engines, commands answered as a test says."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from appliance.config import Config
from appliance.control import ApplianceStatus, CommandResult, EngineStatus, GpuStatus
from appliance.engine import EngineState
from appliance.engine_cpu import CpuDtype


class FakeAppliance:
    """The door's members and nothing else (``__slots__``: no attribute may be added or
    read beyond them). Commands answer with what ``_answers`` holds (None: never)."""

    __slots__ = (
        "_accepting",
        "_answers",
        "_asked",
        "_config",
        "_cpu_dtype",
        "_device",
        "_engines",
        "_starting",
    )
    __slots__ += ("_gpus", "_last_tick")

    def __init__(self, config: Config, engines: list[EngineStatus]) -> None:
        self._config = config
        self._engines = engines
        self._accepting = True
        self._starting = False
        self._last_tick = time.monotonic()
        self._gpus: tuple[GpuStatus, ...] = ()
        self._cpu_dtype: CpuDtype | None = None
        self._device: str | None = "cpu"
        self._answers: dict[str, CommandResult | None] = {}
        self._asked: list[tuple[str, int, dict[str, Any]]] = []

    @property
    def config(self) -> Config:
        return self._config

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def starting(self) -> bool:
        return self._starting

    @property
    def last_tick(self) -> float:
        return self._last_tick

    @property
    def started_at(self) -> float:
        return 1_700_000_000.0

    def engines(self) -> tuple[EngineStatus, ...]:
        return tuple(self._engines)

    def engine(self, engine_id: int) -> EngineStatus:
        return self._engines[engine_id]

    def status(self) -> ApplianceStatus:
        return ApplianceStatus(
            started_at=self.started_at,
            device=self._device,
            cpu_dtype=self._cpu_dtype,
            accepting=self._accepting,
            ready=self._accepting and any(e.state is EngineState.READY for e in self._engines),
            engines=self.engines(),
            gpus=self._gpus,
        )

    async def _command(self, name: str, engine_id: int, **kw: Any) -> CommandResult:
        self._asked.append((name, engine_id, kw))
        answer = self._answers.get(name)
        if answer is None:
            await asyncio.Event().wait()  # a runner that never answers
        assert answer is not None
        return answer

    async def restart(self, engine_id: int) -> CommandResult:
        return await self._command("restart", engine_id)

    async def drain(self, engine_id: int, *, force: bool = False) -> CommandResult:
        return await self._command("drain", engine_id, force=force)

    async def resume(self, engine_id: int) -> CommandResult:
        return await self._command("resume", engine_id)

    async def check_listener(self, engine_id: int) -> CommandResult:
        return await self._command("check_listener", engine_id)
