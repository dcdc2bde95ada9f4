"""What an engine's runner can be asked, and what it needs from around it.

Commands go into a runner's inbox; the runner's own task carries them out, so a
command never changes an engine from the asker's task. ``ask`` awaits the answer
(:class:`appliance.control.CommandResult`); ``tell`` does not.

The three Protocols are the runner's seams: the supervisor is its :class:`RunnerHost`,
:class:`~appliance.supervisor.process.EngineProcess` its :class:`ProcessHandle` and
:class:`~appliance.supervisor.probe.HttpProbe` its :class:`Probe`; tests give it fakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from appliance.config import Config
from appliance.control import CommandResult, GatewayLink
from appliance.engine import EngineState, RestartReason
from appliance.health import Observation
from appliance.supervisor.coordination import RestartCoordinator
from appliance.telemetry import GpuReading


@dataclass(frozen=True, slots=True)
class Drain:
    """An admin's drain: no new work until resumed (the last engine serving: ``force``)."""

    force: bool = False


@dataclass(frozen=True, slots=True)
class Resume:
    """An admin's resume of a drained engine."""


@dataclass(frozen=True, slots=True)
class Restart:
    """A planned restart, drained first (an admin's; degradation asks from inside)."""

    reason: RestartReason = RestartReason.ADMIN


@dataclass(frozen=True, slots=True)
class HeatRestart:
    """The heat loop's word: the engine's GPU has been at the hard limit for ``held_s``
    (``reduce``: restart it with fewer batched tokens) or cool for ``held_s`` (restore)."""

    reduce: bool
    gpu: int  # the telemetry index, for the log
    held_s: float


@dataclass(frozen=True, slots=True)
class Nudge:
    """Look again now: the config was reloaded, or the daemon is stopping."""


@dataclass(frozen=True, slots=True)
class CheckNow:
    """The gateway's word: a connection to the engine's TCP port reached someone else's
    socket. Run the next check (its listener first) now; ``done`` gets its answer."""

    done: asyncio.Future[CommandResult] = field(compare=False)


@dataclass(frozen=True, slots=True)
class Park:
    """Its on-demand model is put away (models_on_demand.py): drain, then stop the engine
    or, with ``sleep``, put it to sleep; it stays down (not restarted) until unparked."""

    sleep: bool = False


@dataclass(frozen=True, slots=True)
class Unpark:
    """Its on-demand model is wanted: start the engine, or wake it."""


@dataclass(frozen=True, slots=True)
class SyncAdapters:
    """Its model's LoRA adapters changed (an admin's add or remove, adapters.py): make the
    engine serve exactly those wanted now. ``done`` gets, once the engine is synced (or at
    once when it is not running: it is synced before it is next READY), the adapters it
    could not load or unload and why."""

    done: asyncio.Future[dict[str, str]] | None = field(default=None, compare=False)


Command = Drain | Resume | Restart | HeatRestart | Nudge | CheckNow | Park | Unpark | SyncAdapters


WATCHED = frozenset({EngineState.READY, EngineState.SUSPECT, EngineState.DRAINING})


class AskedChecks:
    """The askers (:class:`CheckNow`) waiting for a runner's next check."""

    def __init__(self) -> None:
        self._waiting: list[asyncio.Future[CommandResult]] = []

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    def add(self, done: asyncio.Future[CommandResult], state: EngineState) -> bool:
        """Wait for the next check; False (not added) when the engine in ``state`` is not
        being watched, so no check is coming soon."""
        if state not in WATCHED:
            return False
        self._waiting.append(done)
        return True

    def take(self) -> list[asyncio.Future[CommandResult]]:
        """The askers the check starting now answers (later ones wait for the next)."""
        taken, self._waiting = self._waiting, []
        return taken

    def answer(self, result: CommandResult, asked: list[asyncio.Future[CommandResult]]) -> None:
        for done in asked:
            if not done.done():
                done.set_result(result)


class RunnerHost(Protocol):
    """What a runner reads of the supervisor around it."""

    @property
    def config(self) -> Config: ...
    @property
    def link(self) -> GatewayLink: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def fast_stop(self) -> bool: ...
    @property
    def coordinator(self) -> RestartCoordinator: ...
    def gpu_reading(self, index: int) -> GpuReading | None: ...
    def state_changed(self, engine_id: int, state: EngineState) -> None: ...


class ProcessHandle(Protocol):
    """An engine's processes (see :class:`appliance.supervisor.process.EngineProcess`)."""

    @property
    def api_key(self) -> str: ...
    @property
    def started(self) -> bool: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def pid(self) -> int | None: ...
    def port_taken(self) -> bool: ...
    def remove_stale_socket(self) -> None: ...
    async def spawn(self, batched_tokens: int | None) -> None: ...
    async def wait(self) -> int: ...
    async def wait_exit(self, timeout_s: float) -> None: ...
    def log_exit(self, when: str) -> RestartReason: ...
    def exit_reason(self) -> str: ...
    @property
    def last_exit(self) -> str | None: ...
    async def listener_is_ours(self) -> bool | None: ...
    async def remember_tree(self) -> None: ...
    async def sample_tree(self) -> int | None: ...
    async def kill_tree(self, timeout_s: float, why: str = "") -> None: ...
    async def wait_resources_free(
        self,
        readings: Callable[[], Sequence[GpuReading | None]],
        stopping: Callable[[], bool],
        poll_s: float,
    ) -> None: ...


class Sleeper(Protocol):
    """vLLM's sleep mode on the engine's own socket (level 1); None: done, else why not."""

    async def sleep(self, api_key: str, timeout_s: float) -> str | None: ...
    async def wake_up(self, api_key: str, timeout_s: float) -> str | None: ...


class AdapterClient(Protocol):
    """vLLM's LoRA routes on the engine's own socket (VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    what it serves (name -> folder, or why it could not be read), load, unload (None:
    done, else why not, in the engine's words)."""

    async def served_adapters(self, api_key: str, timeout_s: float) -> dict[str, str] | str: ...
    async def load_adapter(
        self, api_key: str, name: str, path: str, timeout_s: float
    ) -> str | None: ...
    async def unload_adapter(self, api_key: str, name: str, timeout_s: float) -> str | None: ...


class Probe(Protocol):
    """How a runner checks its engine (see :class:`appliance.supervisor.probe.HttpProbe`)."""

    def open(self) -> None: ...
    async def close(self) -> None: ...
    async def observe(self, api_key: str, timeout_s: float) -> Observation: ...
    async def kv_usage(self, timeout_s: float) -> float | None: ...
