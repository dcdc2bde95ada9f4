"""The stop sequence's steps that need none of the supervisor's flags.

The supervisor owns the stop: its signal handlers decide, its flags (``stopping``,
``fast_stop``, the stop task) say where the stop is, and it alone tells runners to stop.
The steps here only wait, count or close what they are handed:

    first SIGTERM/SIGINT ──► drain: wait for in-flight work (bounded, unless fast)
        ──► runners told to stop ──► tasks.shut_down ──► release: sockets, telemetry, systemd
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from appliance.control import GatewayLink
from appliance.engine import EngineState
from appliance.errors import EXIT_NO_ENGINE
from appliance.supervisor.boot import SocketDir
from appliance.supervisor.heat import HeatWatch
from appliance.supervisor.notify import SystemdReporter
from appliance.supervisor.runner import EngineRunner

log = logging.getLogger("appliance.supervisor")

STOP_POLL_S = 0.1


def in_flight(link: GatewayLink, runners: Sequence[EngineRunner]) -> int:
    """Requests the gateway is serving, over all engines."""
    return sum(link.inflight(r.id) for r in runners)


async def drain(
    link: GatewayLink,
    runners: Sequence[EngineRunner],
    timeout_s: float,
    fast: Callable[[], bool],
) -> None:
    """Until nothing is in flight, ``timeout_s`` has passed, or a fast stop is asked."""
    deadline = time.monotonic() + timeout_s
    while not fast() and time.monotonic() < deadline:
        if in_flight(link, runners) == 0:
            return
        await asyncio.sleep(STOP_POLL_S)


def none_started(states: Sequence[EngineState]) -> bool:
    """Whether every engine ended FAILED (then the daemon exits, and this says why)."""
    if not states or not all(s is EngineState.FAILED for s in states):
        return False
    log.error(
        "no engine could be started (all %d FAILED); exiting with status %d",
        len(states),
        EXIT_NO_ENGINE,
    )
    return True


async def release(
    runners: Sequence[EngineRunner],
    sockets: SocketDir,
    heat: HeatWatch | None,
    reporter: SystemdReporter,
) -> None:
    """The last step, once every task has ended: client sessions, sockets, telemetry."""
    for r in runners:
        await r.close()
    sockets.remove([r.spec for r in runners])
    if heat is not None:
        heat.source.close()
    reporter.notifier.close()
