"""The supervisor: the one owner of engine processes (spawn, signal, reap).

Moved here from ``appliance/supervisor.py`` unchanged, so its history follows; the next
commits split it into modules of this package.
"""

from appliance.supervisor.core import (
    EngineRuntime,
    GatewayLink,
    Supervisor,
    backoff_delay,
    restart_allowed,
    serve,
)

__all__ = [
    "EngineRuntime",
    "GatewayLink",
    "Supervisor",
    "backoff_delay",
    "restart_allowed",
    "serve",
]
