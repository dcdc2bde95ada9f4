"""The gateway's side of a refused TCP engine connection (gateway/engine_owners.py):
the engine leaves routing at once, the supervisor is asked once, and routing follows
its answer."""

from __future__ import annotations

import asyncio
import logging

import pytest

from appliance.config import parse_config
from appliance.control import CommandResult, EngineStatus
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState
from appliance.gateway.admission.engine_owners import EngineOwners
from appliance.gateway.admission.gate import Admission

READY = EngineState.READY


class Supervisor:
    """Just what EngineOwners reads and asks; its check answers when ``verdict`` is set."""

    def __init__(self, engines: list[EngineStatus]) -> None:
        self._engines = engines
        self.asked: list[int] = []
        self.verdict: asyncio.Future[CommandResult] | None = None

    def engines(self) -> tuple[EngineStatus, ...]:
        return tuple(self._engines)

    def engine(self, engine_id: int) -> EngineStatus:
        return self._engines[engine_id]

    async def check_listener(self, engine_id: int) -> CommandResult:
        self.asked.append(engine_id)
        assert self.verdict is not None
        return await self.verdict


def setup() -> tuple[Supervisor, Admission, EngineOwners]:
    engines = [
        EngineStatus(i, None, EngineAddress(port=9000 + i), READY, "k", pid=100 + i)
        for i in range(2)
    ]
    sup = Supervisor(engines)
    adm = Admission(lambda: parse_config({}), sup.engines, lambda: True)
    return sup, adm, EngineOwners(sup, adm)  # type: ignore[arg-type]


def accepting(adm: Admission) -> list[int]:
    return [e.id for e in adm.loads() if e.accepting]


async def test_unix_socket_engines_have_no_owner_to_check() -> None:
    _, _, owners = setup()
    assert owners.owner_of(EngineAddress(uds="/run/x/engine0.sock")) is None


async def test_a_refusal_takes_the_engine_out_until_the_supervisor_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup, adm, owners = setup()
    sup.verdict = asyncio.get_running_loop().create_future()
    owner = owners.owner_of(EngineAddress(port=9000))
    assert owner is not None and owner.pid() == 100  # the gateway's EngineStatus.pid
    with caplog.at_level(logging.ERROR, "appliance.gateway"):
        owner.on_foreign("port 9000 is answered by nc (pid 7) of uid 65534")
        owner.on_foreign("port 9000 is answered by nc (pid 7) of uid 65534")  # a 2nd request
    assert accepting(adm) == [1]  # out of routing at once
    assert caplog.text.count("engine0: a new connection to 127.0.0.1:9000 did not reach") == 1
    checks = list(owners._checks)
    assert len(checks) == 1
    sup.verdict.set_result(CommandResult(True, READY))  # its own listener after all
    await asyncio.wait_for(asyncio.gather(*checks), 5)
    assert sup.asked == [0]  # asked once
    assert accepting(adm) == [0, 1]  # back in routing on the supervisor's word
