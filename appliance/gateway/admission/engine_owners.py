"""Whose a TCP engine's connections must be, and what the gateway does when one is not.

With ``engine.listen = "tcp"`` any local process can bind an engine's port the moment
the engine dies (seen: 14 ms after a SIGKILL), before the supervisor has noticed. So
every new relay connection to a TCP engine is checked before its first byte
(:class:`appliance.endpoint.EngineOwner`): it must reach a socket of the engine's own
process tree (the API server's pid is the gateway's ``EngineStatus.pid``). A connection
that does not is closed unsent; the request goes to another engine by the relay's usual
retry rule. The engine is then out of routing here (``Admission.unverified``) until the
supervisor, asked through ``EngineCommands.check_listener``, has checked it: its own
listener check decides whether the engine is replaced or back in service.

A Unix-socket engine has no owner to check (its address is private): nothing here runs
for it.
"""

from __future__ import annotations

import asyncio
import logging

from appliance import proctree
from appliance.control import Appliance, CommandResult
from appliance.endpoint import EngineAddress, EngineOwner
from appliance.gateway.admission.gate import Admission

log = logging.getLogger("appliance.gateway")

# The supervisor's check is one health pass (bounded by health.probe_timeout_s); past
# this the engine goes back to what its state says, and the next refusal asks again.
CHECK_WAIT_S = 60.0


class EngineOwners:
    """The :class:`EngineOwner` of each TCP engine address, for the relay's connections."""

    def __init__(self, appliance: Appliance, admission: Admission) -> None:
        self._appliance = appliance
        self._admission = admission
        self._owners: dict[EngineAddress, EngineOwner] = {}
        self._checks: set[asyncio.Task[None]] = set()  # held until done

    def owner_of(self, address: EngineAddress) -> EngineOwner | None:
        """The owner a connection to ``address`` must reach (None for a Unix socket)."""
        if address.port is None:
            return None
        owner = self._owners.get(address)
        if owner is None:
            owner = EngineOwner(
                pid=lambda: self._pid(address),
                tree=proctree.tree_pids,
                on_foreign=lambda why: self._refused(address, why),
            )
            self._owners[address] = owner
        return owner

    def _engine_id(self, address: EngineAddress) -> int | None:
        return next((e.id for e in self._appliance.engines() if e.address == address), None)

    def _pid(self, address: EngineAddress) -> int | None:
        engine_id = self._engine_id(address)
        return None if engine_id is None else self._appliance.engine(engine_id).pid

    def _refused(self, address: EngineAddress, why: str) -> None:
        """A connection to ``address`` was not the engine's: out of routing, logged once,
        and the supervisor asked to check it now."""
        engine_id = self._engine_id(address)
        if engine_id is None or self._admission.unverified(engine_id):
            return  # said already; its check is under way
        self._admission.set_unverified(engine_id, True)
        log.error(
            "engine%d: a new connection to %s did not reach the engine's own processes "
            "(%s); it was closed before the request was written, the request goes to "
            "another engine, and engine%d takes no new work until the supervisor has "
            "checked it",
            engine_id,
            address,
            why,
            engine_id,
        )
        task = asyncio.get_running_loop().create_task(self._check(engine_id))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(self, engine_id: int) -> None:
        """Ask the supervisor for its check; routing follows the engine's state after."""
        result: CommandResult | None = None
        try:
            result = await asyncio.wait_for(self._appliance.check_listener(engine_id), CHECK_WAIT_S)
        except TimeoutError:
            pass
        finally:
            self._admission.set_unverified(engine_id, False)
        if result is None:
            log.warning(
                "engine%d: no check from the supervisor within %.0f s", engine_id, CHECK_WAIT_S
            )
        elif result.ok:
            log.warning(
                "engine%d: the supervisor found its own listener; back in routing", engine_id
            )
        else:
            log.warning("engine%d: not back in routing: %s", engine_id, result.message)
