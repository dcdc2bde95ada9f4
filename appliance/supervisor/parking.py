"""An on-demand engine's parking: whether its model is loaded, and the sleep-mode calls.

The runner keeps the engine's state; this keeps what its on-demand model asked of it
(:class:`~appliance.supervisor.commands.Park` / ``Unpark``, from
:mod:`~appliance.supervisor.models_on_demand`) and makes vLLM's sleep and wake calls,
answering the inbox meanwhile. An engine of an ``always`` model is never parked.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from appliance.engine import EngineSpec
from appliance.supervisor.commands import Park, RunnerHost, Sleeper, Unpark
from appliance.supervisor.inbox import Inbox

log = logging.getLogger("appliance.supervisor")


class Parking:
    def __init__(self, spec: EngineSpec, sleeper: Sleeper | None) -> None:
        self.spec = spec
        self.parked = spec.on_demand  # planned, not spawned, until its model is loaded
        self.asked: Park | None = None  # a park the watch has not acted on yet
        self._sleeper = sleeper

    def obey(self, command: Park | Unpark) -> None:
        self.parked = isinstance(command, Park)
        self.asked = command if isinstance(command, Park) else None

    def down(self) -> bool:
        """Parked now (a method: the runner asks again after awaits that may change it)."""
        return self.parked

    def take(self) -> bool:
        """The park asked for, taken: True to sleep, False to stop."""
        sleep = self.asked is not None and self.asked.sleep and self._sleeper is not None
        self.asked = None
        return sleep

    async def sleep(self, host: RunnerHost, api_key: str, inbox: Inbox) -> bool:
        """Level-1 sleep; False (said) when the engine would not: it is stopped instead."""
        assert self._sleeper is not None
        timeout = host.config.engine_of(self.spec.model).startup_timeout_s
        failed = await inbox.busy(self._sleeper.sleep(api_key, timeout))
        if failed is not None:
            log.warning("%s: could not sleep (%s); stopping it instead", self.spec.name, failed)
        return failed is None

    async def until_wanted(
        self, host: RunnerHost, exited: asyncio.Future[int], inbox: Inbox
    ) -> Literal["wake", "stop", "gone"]:
        """Asleep until unparked ("wake"), asked to stop for good (a park without sleep:
        asleep too long, "stop"), or until it exits or the daemon stops ("gone")."""
        while self.parked and not exited.done() and not host.stopping:
            if self.asked is not None and not self.asked.sleep:
                self.asked = None
                return "stop"
            await inbox.nap(None, exited)
        return "gone" if exited.done() or host.stopping else "wake"

    async def wake(self, host: RunnerHost, api_key: str, inbox: Inbox) -> bool:
        assert self._sleeper is not None
        timeout = host.config.engine_of(self.spec.model).startup_timeout_s
        failed = await inbox.busy(self._sleeper.wake_up(api_key, timeout))
        if failed is not None:
            log.error("%s: could not wake (%s); restarting it", self.spec.name, failed)
        return failed is None
