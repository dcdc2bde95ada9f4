"""One engine's runner: the only code that changes that engine's state.

::

    spawn ─► wait ready ─► watch (health, degradation, planned restarts) ─► stop tree ─┐
      ▲                                                                                │
      └──────────────────────────── backoff (unplanned) ◄──────────────────────────────┘

One task per engine runs :meth:`EngineRunner.run`; only it writes the state (a write
from another task raises, as an illegal transition does). Others read a frozen copy and
ask through its inbox (:mod:`commands <appliance.supervisor.commands>`), answered at
every await, so an asker waits for a decision, never for a slow engine. Its parts:
processes (:class:`ProcessHandle`), checks (:class:`HealthWatch`), restarts and budgets
(:class:`RestartBook`), the restart asked for (:class:`PlannedRestart`), on-demand
parking (:class:`Parking`), LoRA adapters (:class:`EngineAdapters`); waits that change
no state are in :mod:`~appliance.supervisor.waits`. Every move of the state is here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from appliance.control import CommandResult
from appliance.engine import EngineSpec, EngineState, RestartReason, check_transition
from appliance.errors import IllegalTransition
from appliance.health import Verdict
from appliance.supervisor import waits
from appliance.supervisor.budget import PLANNED_REASONS, RestartBook
from appliance.supervisor.commands import (
    WATCHED,
    AskedChecks,
    CheckNow,
    Command,
    Drain,
    HeatRestart,
    Nudge,
    Park,
    Probe,
    ProcessHandle,
    Restart,
    Resume,
    RunnerHost,
    Sleeper,
    SyncAdapters,
    Unpark,
)
from appliance.supervisor.engine_adapters import EngineAdapters
from appliance.supervisor.inbox import Inbox
from appliance.supervisor.parking import Parking
from appliance.supervisor.planned import PlannedRestart
from appliance.supervisor.runner_status import RunnerFace
from appliance.supervisor.waits import UNRESPONSIVE_GRACE_S
from appliance.supervisor.watch import HealthWatch

__all__ = ["KV_POLL_S", "RESTARTABLE", "STABLE_AFTER_S", "UNRESPONSIVE_GRACE_S", "EngineRunner"]

log = logging.getLogger("appliance.supervisor")

STABLE_AFTER_S = 60.0  # READY this long resets the crash backoff
KV_POLL_S = 0.5  # KV usage reads while an engine's KV breaker is open
RESTARTABLE = frozenset(EngineState) - {EngineState.STOPPING}  # an admin's: not going down
STOPPABLE = WATCHED | {EngineState.STARTING, EngineState.SLEEPING}


class EngineRunner(RunnerFace):
    """Starts, watches and restarts one engine, from one task; see the module docstring."""

    def __init__(
        self,
        spec: EngineSpec,
        host: RunnerHost,
        process: ProcessHandle,
        probe: Probe,
        sleeper: Sleeper | None = None,
        lora: EngineAdapters | None = None,
    ) -> None:
        self.spec = spec
        self._host = host
        self._process = process  # its processes, key and output
        self._inbox = Inbox(self._obey)  # commands, answered by this runner's task
        config = lambda: host.config  # noqa: E731  (the config in force, at each use)
        self._health = HealthWatch(process, probe, self._inbox, config)  # what checks learned
        self._book = RestartBook()  # its restarts and both budgets
        self._plan = PlannedRestart(spec, self._book, config)  # restart asked for, batch size
        self._task: asyncio.Task[Any] | None = None  # the one task allowed to change state
        self._state = EngineState.EXITED  # where it is in its life
        self._ready_since: float | None = None
        self._asked = AskedChecks()  # the gateway's CheckNow askers, for the next check
        self._parking = Parking(spec, sleeper)  # on demand: down until its model is loaded
        self.releasing = False  # stopped, its port or GPU memory not yet seen free
        self._lora = lora or EngineAdapters(spec, None, None)  # synced before READY
        # The telemetry entries of its GPUs, fixed by the spec: the heat loop asks every
        # reading, and needs no whole status copy for it.
        self.telemetry_indexes = self.status().telemetry_indexes

    # ---- what others may read and ask -----------------------------------------------
    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def state(self) -> EngineState:
        return self._state

    # status, ask, tell, open, close, kill_now: RunnerFace (runner_status.py)

    # ---- commands, carried out by the runner's task ----------------------------------
    def _answer(self, ok: bool, message: str = "") -> CommandResult:
        return CommandResult(ok, self._state, message)

    def _obey(self, command: Command) -> CommandResult:
        match command:
            case Drain(force=force):
                return self._drain(force)
            case Resume():
                return self._resume()
            case Restart(reason=reason):
                return self._restart(reason)
            case HeatRestart():
                # Only a READY engine is restarted for heat; then its next nap acts. A
                # sleeping one keeps the word until it is woken.
                hot = self._state in (EngineState.READY, EngineState.SLEEPING)
                if hot and self._plan.heat(command):
                    self._inbox.wake()
            case Park() | Unpark():
                self._parking.obey(command)
                self._inbox.wake()
            case SyncAdapters():
                self._lora.obey(command, self._state in WATCHED)
                self._inbox.wake()
            case Nudge():
                self._inbox.wake()
            case CheckNow(done=done):
                if not self._asked.add(done, self._state):
                    return self._answer(False, f"engine {self.id} is {self._state.value}")
                self._inbox.wake()  # the check that starts next answers it
        return self._answer(True)

    def _drain(self, force: bool) -> CommandResult:
        """An admin's drain: no new work until resumed; in-flight work finishes."""
        if self._state is EngineState.DRAINING:
            return self._answer(True)
        if self._state not in (EngineState.READY, EngineState.SUSPECT):
            return self._answer(
                False, f"engine {self.id} is {self._state.value}; only a READY engine drains"
            )
        if not force and not self._host.coordinator.others_serving(self.id):
            return self._answer(
                False,
                f"engine {self.id} is the last engine serving: draining it stops the "
                "service for every user; add ?force=true to drain it anyway",
            )
        self._set_state(EngineState.DRAINING)
        return self._answer(True)

    def _resume(self) -> CommandResult:
        if self._state is not EngineState.DRAINING or self._plan.requested is not None:
            return self._answer(
                False, f"engine {self.id} is {self._state.value}; only a drained engine resumes"
            )
        self._set_state(EngineState.READY)
        return self._answer(True)

    def _restart(self, reason: RestartReason) -> CommandResult:
        if self._state not in RESTARTABLE:
            return self._answer(
                False, f"engine {self.id} is {self._state.value} and cannot be restarted now"
            )
        self._plan.requested = reason
        self._inbox.wake()
        return self._answer(True)

    # ---- the life of the engine ------------------------------------------------------
    def _set_state(self, new: EngineState) -> None:
        if asyncio.current_task() is not self._task:
            raise IllegalTransition(
                f"{self.spec.name}: state {new.value} set outside the engine's runner task"
            )
        old = self._state
        if old is new:
            return
        check_transition(old, new)
        self._state = new
        self._ready_since = time.monotonic() if new is EngineState.READY else None
        log.info("%s: %s -> %s", self.spec.name, old.value, new.value)
        self._host.state_changed(self.id, new)

    async def run(self) -> None:
        """Start, watch and restart the engine until the daemon stops (the runner's task)."""
        self._task = asyncio.current_task()
        try:
            while not self._host.stopping:
                if self._state is EngineState.FAILED:
                    await self._inbox.nap(None)  # down until an admin asks for a restart
                    if self._host.stopping or self._plan.requested is None:
                        continue
                    if self._parking.parked:  # an admin's restart while its model is not
                        self._book.fresh_budget()  # loaded: down, not FAILED, until it is
                        self._set_state(EngineState.EXITED)
                if self._parking.parked:  # its model is not loaded: down until it is
                    await self._inbox.nap(None)
                    continue
                reason = await self._start_and_watch()
                await self._stop(reason)
                if self._host.stopping or reason is None:
                    break
                if reason is RestartReason.UNLOAD or self._parking.down():
                    continue  # put away (no restart, if wanted back at once), or died asleep
                if self._book_restart(reason) and reason not in PLANNED_REASONS:
                    await waits.back_off(self.spec, self._host, self._book, self._inbox, reason)
        finally:
            self._inbox.close(
                lambda: self._answer(
                    False, f"engine {self.id} is {self._state.value}; the daemon is stopping"
                )
            )

    def _book_restart(self, reason: RestartReason) -> bool:
        """Count the restart; False when the crash budget is spent (the engine is FAILED)."""
        limit = self._host.config.restart.max_restarts_per_hour
        if self._book.book(reason, time.monotonic(), limit):
            return True
        log.error(
            "%s: more than %d restarts within an hour; FAILED until an "
            "admin restarts it (last reason: %s)",
            *(self.spec.name, limit, reason.value),
        )
        self._set_state(EngineState.FAILED)
        return False

    async def _start_and_watch(self) -> RestartReason | None:
        """Spawn, wait until ready, watch. The reason it must go down, or None to stop."""
        if self._state is EngineState.FAILED:
            self._book.fresh_budget()  # an admin's restart: a new budget, no backoff
        self._plan.started()
        self._health.degradation.restart()
        self._inbox.clear()
        if self._process.port_taken():
            self._set_state(EngineState.STARTING)
            return RestartReason.CRASH
        self._process.remove_stale_socket()
        self._set_state(EngineState.STARTING)
        await self._inbox.busy(self._process.spawn(self._plan.batched_tokens))
        host, inbox = self._host, self._inbox
        reason = await waits.wait_ready(self.spec, host, self._process, self._health, inbox)
        if reason is not None or self._host.stopping:
            return None if self._host.stopping else reason
        await self._lora.sync(self._process.api_key, self._inbox)  # its adapters, then READY
        self._set_state(EngineState.READY)
        return await self._watch()

    async def _watch(self) -> RestartReason | None:
        """Watch a READY engine until it dies, hangs, or a restart or stop is asked for."""
        exited = asyncio.ensure_future(self._process.wait())
        last_check = time.monotonic()
        try:
            while True:
                # From the config each time round: a reload's health.interval_s applies to
                # engines already running (the reload nudges this loop).
                next_check = last_check + self._host.config.health.interval_s
                # While its KV breaker is open the engine gets nothing new: read its KV
                # usage often, so it is back in service soon after the pressure falls,
                # not up to a whole health interval later.
                kv_poll = self._host.link.kv_tripped(self.id)
                timeout = max(0.0, next_check - time.monotonic())
                if kv_poll:
                    timeout = min(timeout, KV_POLL_S)
                woken = await self._inbox.nap(timeout, exited)
                if exited.done():
                    return self._process.log_exit("while serving")
                if self._host.stopping:
                    return None
                if self._lora.stale:
                    await self._lora.sync(self._process.api_key, self._inbox)
                if self._parking.asked and (reason := await self._put_away(exited)):
                    return reason
                if self._plan.requested is not None and (reason := await self._planned()):
                    return reason
                if time.monotonic() < next_check and not self._asked.pending:
                    if kv_poll and not woken:
                        usage = await self._health.kv_usage()
                        self._host.link.observe_kv(self.id, usage)
                    continue
                last_check = time.monotonic()
                if reason := await self._check():
                    return reason
        finally:
            exited.cancel()
            self._lora.drop_askers()
            self._asked.answer(self._answer(False, "it is going down"), self._asked.take())

    async def _planned(self) -> RestartReason | None:
        """The restart asked for, once the coordinator lets this engine go (drained
        first); None while it must wait (said once)."""
        reason = self._plan.requested
        assert reason is not None
        why = self._host.coordinator.may_take_out(self.id)
        if why is not None:
            if not self._plan.wait_logged:
                log.info("%s: %s restart waits: %s", self.spec.name, reason.value, why)
                self._plan.wait_logged = True
            return None
        self._host.coordinator.begin(self.id)
        log.info("%s: %s restart: draining first", self.spec.name, reason.value)
        await self._drain_for_restart()
        return reason

    async def _put_away(self, exited: asyncio.Future[int]) -> RestartReason | None:
        """Its model is put away: drained, then stopped (UNLOAD) or asleep until
        unparked and woken (None: watch on); a failed sleep or wake stops it instead."""
        parking, host, key, inbox = self._parking, self._host, self._process.api_key, self._inbox
        sleep = parking.take()
        await self._drain_for_restart()
        if not sleep or not await parking.sleep(host, key, inbox):
            return RestartReason.UNLOAD
        self._set_state(EngineState.SLEEPING)
        until = await parking.until_wanted(host, exited, inbox)
        if until == "gone":
            return None  # it exited, or the daemon stops: the watch sees either at the top
        if until == "stop":
            return RestartReason.UNLOAD  # asleep too long: stopped, weights freed
        if not await parking.wake(host, key, inbox):
            return RestartReason.CRASH
        await self._lora.sync(key, inbox)  # changed while asleep: synced before READY
        self._set_state(EngineState.READY)
        return None

    async def _check(self) -> RestartReason | None:
        """One health pass, and what the runner does about it: the reason to replace the
        engine, or None."""
        if (
            self._state is EngineState.READY
            and self._ready_since is not None
            and time.monotonic() - self._ready_since > STABLE_AFTER_S
        ):
            self._book.consecutive_failures = 0
        health = self._host.config.health
        asked = self._asked.take()
        out = await self._health.check(self._ready_since)
        down = out.verdict is None  # its listener is lost, or it exited
        self._asked.answer(self._answer(not down, "it is going down" if down else ""), asked)
        if out.listener_lost:
            return RestartReason.CRASH  # named in the log, and no check was sent to it
        if out.verdict is None or out.observation is None:
            return None  # it exited: the watch sees that at the top
        self._host.link.observe_kv(self.id, out.observation.kv_cache_usage)
        self._mark_suspect(out.verdict)
        if out.verdict is Verdict.SUSPECT:
            log.warning(
                "%s: health check failed (%d/%d): %s",
                self.spec.name,
                self._health.history.consecutive_failures,
                health.failures_to_restart,
                out.observation.detail,
            )
        elif out.verdict is Verdict.HUNG:
            log.error(
                "%s: hung (%s) and no tokens flowing; replacing it",
                self.spec.name,
                out.observation.detail,
            )
            return RestartReason.HUNG
        elif out.degradation is not None:
            failures = self._health.history.consecutive_failures
            if self._plan.degraded(out.degradation, failures):
                self._health.degradation.clear()  # its verdict must not come again meanwhile
        return None

    def _mark_suspect(self, verdict: Verdict) -> None:
        """A failed check takes a READY engine out of routing at once; a good one puts it
        back. Only a DRAINING engine (drained or being restarted) is left as it is."""
        if verdict is Verdict.HEALTHY and self._state is EngineState.SUSPECT:
            self._set_state(EngineState.READY)
        elif verdict is not Verdict.HEALTHY and self._state is EngineState.READY:
            self._set_state(EngineState.SUSPECT)  # state_changed tells the gateway

    async def _drain_for_restart(self) -> None:
        """Stop routing to it and let in-flight work finish (bounded)."""
        if self._state in (EngineState.READY, EngineState.SUSPECT):
            self._set_state(EngineState.DRAINING)
        await waits.drain_inflight(self.spec, self._host, self._inbox)

    async def _stop(self, reason: RestartReason | None) -> None:
        """Take the engine down: SIGTERM its tree, SIGKILL what stays, wait for its port."""
        # Asleep, it gave its GPU memory back already; what the GPU holds now is the model
        # that took its place, which must not hold this one UNLOADING for the whole wait.
        asleep = self._state is EngineState.SLEEPING
        if self._state in STOPPABLE:
            self._set_state(EngineState.STOPPING)
        host = self._host
        if reason is RestartReason.HUNG:
            waits.give_up_hung_requests(self.spec, host)
        timeout = waits.stop_grace_s(self.spec, host, reason)
        why = reason.value if reason is not None else "the daemon is stopping"
        await self._inbox.busy(self._process.kill_tree(timeout, why))
        self.releasing = not host.stopping  # before EXITED: its model's owner reads both
        if self._state is not EngineState.FAILED:
            self._set_state(EngineState.EXITED)
        if host.stopping:
            return
        if not asleep:
            await waits.resources_free(self.spec, host, self._process, self._inbox)
        self.releasing = False
