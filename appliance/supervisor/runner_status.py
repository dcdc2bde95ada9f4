"""The frozen copy of one engine that others read: :class:`appliance.control.EngineStatus`.

Built from what the runner's parts hold (its spec, its processes, what its checks
learned, its restarts); the state is passed in by the runner, its only holder.

:class:`StatusCopy` keeps the last copy and builds a new one only when something it
shows has changed: the gateway reads an engine's copy several times per request
(admission's room and routing read every engine's, the relay its key), far more often
than an engine changes (#24: that was 3 copies of 25 fields per request with 1 engine).
"""

from __future__ import annotations

import time
from typing import Any

from appliance.control import CommandResult, EngineStatus
from appliance.engine import EngineSpec, EngineState
from appliance.health import Observation
from appliance.policy.speculation import NO_FIGURES, SpecFigures
from appliance.supervisor.budget import RestartBook
from appliance.supervisor.commands import Command, ProcessHandle
from appliance.supervisor.inbox import Inbox
from appliance.supervisor.planned import PlannedRestart
from appliance.supervisor.watch import HealthWatch


class RunnerFace:
    """What others may read of a runner and ask of it (the runner's parts it reads are
    set by :class:`~appliance.supervisor.runner.EngineRunner`, which alone moves state)."""

    spec: EngineSpec
    _state: EngineState
    _process: ProcessHandle
    _book: RestartBook
    _health: HealthWatch
    _plan: PlannedRestart
    _inbox: Inbox

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def heat_reduced(self) -> bool:
        """Whether it runs with heat-reduced --max-num-batched-tokens."""
        return self._plan.batched_tokens is not None

    _copy: StatusCopy | None = None  # made at the first read, from the parts above

    def status(self) -> EngineStatus:
        """The same frozen copy until something in it changed (:class:`StatusCopy`)."""
        copy = self._copy
        if copy is None:
            copy = self._copy = StatusCopy(self.spec, self._process, self._book, self._health)
        return copy.of(self._state)

    async def ask(self, command: Command) -> CommandResult:
        """Hand ``command`` to the runner's task; its answer (the caller bounds the wait)."""
        return await self._inbox.ask(command)

    def tell(self, command: Command) -> None:
        """Hand ``command`` to the runner's task, wanting no answer."""
        self._inbox.tell(command)

    def open(self) -> None:
        self._health.open()

    async def close(self) -> None:
        await self._health.close()

    async def kill_now(self, timeout_s: float) -> None:
        """At exit, after run() returned: whatever happened, no engine process outlives us."""
        await self._process.kill_tree(timeout_s)


def engine_status(
    spec: EngineSpec,
    state: EngineState,
    process: ProcessHandle,
    book: RestartBook,
    observed: Observation | None,
    speculation: SpecFigures = NO_FIGURES,
) -> EngineStatus:
    obs = observed
    return EngineStatus(
        id=spec.id,
        gpu=spec.gpu,
        address=spec.address,
        state=state,
        api_key=process.api_key,
        served_model_name=spec.served_model_name,
        model=spec.model or spec.served_model_name,
        gpus=spec.gpus,
        task=spec.task,
        pid=process.pid,
        restarts=book.restarts,
        restarts_by_reason=dict(book.by_reason),
        last_restart_reason=book.last_reason,
        kv_cache_usage=obs.kv_cache_usage if obs else None,
        running=obs.running if obs else None,
        waiting=obs.waiting if obs else None,
        preemptions_total=obs.preemptions_total if obs else None,
        generation_tokens=obs.generation_tokens if obs else None,
        spec_drafts=obs.spec_drafts if obs else None,
        spec_draft_tokens=obs.spec_draft_tokens if obs else None,
        spec_accepted_tokens=obs.spec_accepted_tokens if obs else None,
        spec_acceptance_rate=speculation.acceptance_rate,
        spec_mean_accepted_length=speculation.mean_accepted_length,
        last_exit=process.last_exit,
    )


class StatusCopy:
    """One engine's frozen copy, rebuilt when what it shows changed, else the same one.

    What it shows comes from the state (passed in), the processes (pid, key, last exit),
    the restart book (its count moves with every booking) and the health watch (a new
    ``observed`` per check, and the speculation samples are taken with it). The
    speculation figures also age with the clock (a window of the last minute): the copy
    is rebuilt at least once a second for that.
    """

    __slots__ = ("_book", "_copy", "_health", "_key", "_process", "_spec")

    def __init__(
        self, spec: EngineSpec, process: ProcessHandle, book: RestartBook, health: HealthWatch
    ) -> None:
        self._spec = spec
        self._process = process
        self._book = book
        self._health = health
        self._key: tuple[Any, ...] = ()
        self._copy: EngineStatus | None = None

    def of(self, state: EngineState) -> EngineStatus:
        p, book, health = self._process, self._book, self._health
        key = (
            state,
            p.pid,
            p.api_key,
            p.last_exit,
            book.restarts,
            book.last_reason,
            health.observed,  # by identity: a new one per check
            int(time.monotonic()),
        )
        copy = self._copy
        if copy is None or key != self._key:
            copy = engine_status(self._spec, state, p, book, health.observed, health.spec_figures())
            self._copy, self._key = copy, key
        return copy
