"""A typed stand-in for the supervisor's side of the door (``appliance.control``'s
``ApplianceView`` and ``EngineCommands``): fixed engines and config, commands that say
"no". Gateway parts take it where the daemon passes the supervisor; no cast needed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from appliance.config import Config
from appliance.control import ApplianceStatus, CommandResult, EngineStatus
from appliance.engine_cpu import CpuDtype


@dataclass
class OneBox:
    config: Config
    engine_list: tuple[EngineStatus, ...] = ()
    accepting: bool = True
    starting: bool = False
    started_at: float = 0.0
    last_tick: float = field(default_factory=time.monotonic)
    device: str | None = "cpu"
    cpu_dtype: CpuDtype | None = None

    def engines(self) -> tuple[EngineStatus, ...]:
        return self.engine_list

    def engine(self, engine_id: int) -> EngineStatus:
        return self.engine_list[engine_id]

    def status(self) -> ApplianceStatus:
        return ApplianceStatus(
            started_at=self.started_at,
            device=self.device,
            cpu_dtype=self.cpu_dtype,
            accepting=self.accepting,
            ready=any(e.state.accepts_work for e in self.engine_list),
            engines=self.engine_list,
            gpus=(),
        )

    async def restart(self, engine_id: int) -> CommandResult:
        return CommandResult(False, self.engine(engine_id).state, "not in this test")

    async def drain(self, engine_id: int, *, force: bool = False) -> CommandResult:
        return CommandResult(False, self.engine(engine_id).state, "not in this test")

    async def resume(self, engine_id: int) -> CommandResult:
        return CommandResult(False, self.engine(engine_id).state, "not in this test")

    async def check_listener(self, engine_id: int) -> CommandResult:
        return CommandResult(True, self.engine(engine_id).state)
