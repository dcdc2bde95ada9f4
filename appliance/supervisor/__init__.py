"""The supervisor: the one owner of engine processes (spawn, signal, reap).

=================  =========================================================================
``core``           :class:`Supervisor`: main loop, signals, stop, reload; the gateway's view
``stopping``       the stop's steps that need none of its flags: drain wait, release
``runner``         :class:`EngineRunner`: one engine's life; the only writer of its state
``inbox``          a runner's commands, answered from its own task at every await
``commands``       the commands, and the runner's seams (host, process, probe)
``watch``          one engine's health checks and degradation window
``planned``        the planned restart an engine was asked for (admin, heat, degradation)
``budget``         restart budgets and backoff (pure rules, one record per engine)
``coordination``   one planned restart at a time; never the last engine serving
``process``        spawn, environment, affinity, output relay, kill tree, port / GPU memory
``probe``          health checks over HTTP
``heat``           telemetry, throttle levels, heat restarts
``notify``         systemd: READY, EXTEND_TIMEOUT, STATUS, WATCHDOG
``boot``           telemetry source, socket directory, the plan
=================  =========================================================================

It never imports the gateway: the two meet only in :mod:`appliance.control`, and
:mod:`appliance.serve` connects them.
"""

from appliance.supervisor.budget import backoff_delay, restart_allowed
from appliance.supervisor.core import Supervisor
from appliance.supervisor.runner import EngineRunner

__all__ = ["EngineRunner", "Supervisor", "backoff_delay", "restart_allowed"]
