"""What the supervisor sets up before any engine starts: telemetry, sockets, the plan.

The plan itself is pure (:func:`appliance.plan.plan_engines`); this gathers the
machine's facts for it (GPU count, usable cores), opens the telemetry source (falling
back to none, logged), and makes the private directory for engine sockets.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import endpoint
from appliance.config import Config
from appliance.engine import EngineSpec
from appliance.plan import EnginePlan, plan_engines, usable_cores
from appliance.systemd import child_environment
from appliance.telemetry import TelemetryError, TelemetrySource, open_source

log = logging.getLogger("appliance.supervisor")


def open_telemetry(config: Config) -> TelemetrySource:
    """The configured source, or none (logged) when it cannot be used."""
    source = config.telemetry.source
    try:
        return open_source(source)
    except TelemetryError as exc:
        if source == "nvml":
            # The default on a machine with no NVIDIA driver: not an error.
            log.info("GPU telemetry off: NVML unavailable (%s)", exc)
        else:
            log.error("telemetry.source = %r cannot be used (%s); GPU telemetry off", source, exc)
        return open_source("none")


@dataclass
class SocketDir:
    """Where engine sockets live (None with engine.listen = "tcp"), and whether it is ours
    to remove at exit (made by mkdtemp rather than given by systemd)."""

    path: Path | None = None
    own: bool = False

    @classmethod
    def make(cls, config: Config, env: Mapping[str, str]) -> SocketDir:
        if config.engine.listen != "unix":
            return cls()
        path, own = endpoint.private_socket_dir(env)
        log.info("engine sockets in %s (private to this service)", path)
        return cls(path, own)

    def remove(self, specs: Sequence[EngineSpec]) -> None:
        if self.path is None:
            return
        for spec in specs:
            if spec.address.uds is not None:
                endpoint.remove_stale_socket(spec.address.uds)
        if self.own:
            with contextlib.suppress(OSError):
                self.path.rmdir()


def gpu_count(config: Config) -> int:
    """NVIDIA GPUs to plan for (none asked for with engine.device = "cpu")."""
    if config.engine.device == "cpu":
        return 0
    from appliance.telemetry import count_nvidia_gpus

    return count_nvidia_gpus()


def make_plan(
    config: Config, gpus: int, env: Mapping[str, str], home: Path, sockets: SocketDir
) -> EnginePlan:
    return plan_engines(
        config,
        gpu_count=gpus,
        cores=usable_cores(),
        home=home,
        base_env=child_environment(env),
        socket_dir=sockets.path,
    )
