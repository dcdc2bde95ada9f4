"""The runner's waits: until a new engine answers, the backoff, in-flight work draining.

Each runs inside the runner's task and answers the runner's inbox at every await (through
:meth:`Inbox.busy <appliance.supervisor.inbox.Inbox.busy>` and ``nap``), so an admin's
command is decided while the runner waits. None of them changes the engine's state: they
return what happened, and :class:`~appliance.supervisor.runner.EngineRunner` moves the
state.
"""

from __future__ import annotations

import asyncio
import logging
import time

from appliance.engine import EngineSpec, RestartReason
from appliance.supervisor.budget import RestartBook
from appliance.supervisor.commands import ProcessHandle, RunnerHost
from appliance.supervisor.inbox import Inbox
from appliance.supervisor.watch import HealthWatch

log = logging.getLogger("appliance.supervisor")

STARTUP_POLL_S = 0.5
DRAIN_POLL_S = 0.1
UNRESPONSIVE_GRACE_S = 2.0  # SIGTERM → SIGKILL for a hung engine (not engine.stop_timeout_s)


async def wait_ready(
    spec: EngineSpec, host: RunnerHost, proc: ProcessHandle, health: HealthWatch, inbox: Inbox
) -> RestartReason | None:
    """Until a real completion comes back: None, or why the start failed."""
    if not proc.started:
        return RestartReason.CRASH
    # Fixed for this start (a reload applies from the next one).
    allowed = host.config.engine_of(spec.model).startup_timeout_s
    deadline = time.monotonic() + allowed
    while not host.stopping:
        if proc.returncode is not None:
            await proc.wait()  # its last output read first: often the reason it exited
            return proc.log_exit("while starting")
        if time.monotonic() > deadline:
            log.error(
                "%s: not ready after %.0f s (engine.startup_timeout_s)",
                spec.name,
                allowed,
            )
            return RestartReason.STARTUP_TIMEOUT
        answered = await health.answered()
        if answered is False:
            return RestartReason.CRASH  # someone else's listener: named in the log
        if answered:
            return None
        await inbox.busy(proc.wait_exit(STARTUP_POLL_S))
    return None


async def back_off(
    spec: EngineSpec, host: RunnerHost, book: RestartBook, inbox: Inbox, reason: RestartReason
) -> None:
    """Wait before an unplanned restart, longer for each in a row (ends at a stop)."""
    cfg = host.config.restart
    delay = book.next_backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
    log.warning(
        "%s: restarting in %.1f s (reason: %s, failure %d in a row)",
        spec.name,
        delay,
        reason.value,
        book.consecutive_failures,
    )
    deadline = time.monotonic() + delay
    while not host.stopping and (left := deadline - time.monotonic()) > 0:
        await inbox.nap(left)


async def drain_inflight(spec: EngineSpec, host: RunnerHost, inbox: Inbox) -> None:
    """Let a draining engine's in-flight work finish (bounded by restart.drain_timeout_s)."""
    link = host.link
    deadline = time.monotonic() + host.config.restart.drain_timeout_s
    while link.inflight(spec.id) > 0 and not host.stopping:
        if time.monotonic() > deadline:
            log.warning(
                "%s: %d request(s) still running after %.0f s of draining; restarting anyway",
                spec.name,
                link.inflight(spec.id),
                host.config.restart.drain_timeout_s,
            )
            # Those not yet answering move to another engine now, not at the kill.
            link.abandon(spec.id, "the engine was restarted after draining")
            break
        await inbox.busy(asyncio.sleep(DRAIN_POLL_S))


def stop_grace_s(spec: EngineSpec, host: RunnerHost, reason: RestartReason | None) -> float:
    """How long SIGTERM may take before SIGKILL when the engine goes down for ``reason``."""
    timeout = 0.0 if host.fast_stop else host.config.engine_of(spec.model).stop_timeout_s
    if reason in (RestartReason.HUNG, RestartReason.STARTUP_TIMEOUT):
        # It has not answered for a while: it will not shut down gracefully either
        # (a SIGSTOPped tree does not even see SIGTERM), so kill it soon.
        timeout = min(timeout, UNRESPONSIVE_GRACE_S)
    return timeout


def give_up_hung_requests(spec: EngineSpec, host: RunnerHost) -> None:
    """A hung engine's requests would stay stuck until it dies: give them up now, so
    those with no byte sent yet are retried elsewhere at once."""
    moved = host.link.abandon(spec.id, "the engine stopped answering")
    if moved:
        log.warning(
            "%s: gave up %d request(s) on the hung engine; those not yet "
            "answering are retried on another engine",
            spec.name,
            moved,
        )


async def resources_free(
    spec: EngineSpec, host: RunnerHost, proc: ProcessHandle, inbox: Inbox
) -> None:
    """Until the stopped engine's port and GPU memory are free (bounded; said in the
    journal while it waits, and if it gives up)."""
    await inbox.busy(
        proc.wait_resources_free(
            lambda: [host.gpu_reading(g) for g in spec.gpus],
            lambda: host.stopping,
            host.config.telemetry.interval_s,
        )
    )
