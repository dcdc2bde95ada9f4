"""What the supervisor sets up before any engine starts: telemetry, sockets, the plan.

The plan itself is pure (:func:`appliance.plan.plan_engines`); this gathers the
machine's facts for it (GPU count, usable cores), opens the telemetry source, and
makes the private directory for engine sockets. Before the plan, the files the engines
will load (models, the engine python, the caches) are judged as check-config judges
them (:mod:`appliance.config.model_places`).

Telemetry: ``nvml`` on a machine without NVIDIA's driver is the normal CPU case (no GPU
telemetry, logged at INFO). A ``file:`` source that cannot be opened at start (a typo,
a file not written yet, no permission) is a config error, exit 2, which systemd does
not restart: running on without readings would throttle no GPU, silently.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import endpoint
from appliance.config import Config
from appliance.config.model_places import trust_problems
from appliance.engine import EngineSpec
from appliance.errors import ConfigError, EngineSetupError
from appliance.plan import EnginePlan, plan_engines, usable_cores
from appliance.systemd import child_environment
from appliance.telemetry import TelemetryError, TelemetrySource, check_sensors_file, open_source

log = logging.getLogger("appliance.supervisor")

FILE_SOURCE_FIX = (
    "write the file before starting the service (and let the service user read it), "
    'or set telemetry.source = "none" to run without thermal protection'
)


def open_telemetry(config: Config) -> TelemetrySource:
    """The configured source; none (logged) when NVML is unavailable. ConfigError when a
    ``file:`` source cannot be opened."""
    source = config.telemetry.source
    try:
        return open_source(source)
    except TelemetryError as exc:
        if source != "nvml":
            raise ConfigError(
                [f"telemetry.source = {source!r} cannot be used ({exc}); {FILE_SOURCE_FIX}"],
                config.source,
            ) from None
        # The default on a machine with no NVIDIA driver: not an error.
        log.info("GPU telemetry off: NVML unavailable (%s)", exc)
        return open_source("none")


def check_telemetry_source(config: Config) -> tuple[list[str], list[str]]:
    """check-config's look at a ``file:`` source: (problems, warnings). Stricter than a
    start (the content must parse too); a file this user may not read is a warning, since
    the daemon reads it as the service user."""
    source = config.telemetry.source
    if not source.startswith("file:"):
        return [], []
    try:
        check_sensors_file(source.removeprefix("file:"))
    except TelemetryError as exc:
        if isinstance(exc.__cause__, PermissionError):
            return [], [
                f"telemetry.source = {source!r}: cannot check it as this user ({exc}); run "
                "check-config as the service user or root"
            ]
        return [f"telemetry.source = {source!r} cannot be used ({exc}); {FILE_SOURCE_FIX}"], []
    return [], []


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
    config: Config,
    gpus: int,
    env: Mapping[str, str],
    home: Path,
    sockets: SocketDir,
    kept: Mapping[str, Sequence[int]] | None = None,
) -> EnginePlan:
    """``kept``: per model, the ranks of the LoRA adapters the admin added (adapters.py).

    Every model, the engine python and the caches are judged first as check-config
    judges them: one another local account could change is refused before any engine
    loads it (exit 3, each problem named with its key and the fix)."""
    untrusted = trust_problems(config, home, child_environment(env))
    if untrusted:
        raise EngineSetupError("; ".join(untrusted))
    return plan_engines(
        config,
        gpu_count=gpus,
        cores=usable_cores(),
        home=home,
        base_env=child_environment(env),
        socket_dir=sockets.path,
        kept=kept,
    )
