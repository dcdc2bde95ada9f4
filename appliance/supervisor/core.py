"""The supervisor: the one owner of engine processes (spawn, signal, reap).

Shape (one asyncio loop, one process)::

    main loop tick ──► signals queued by handlers ──► stop / fast stop / reload
        │          └─► systemd: WATCHDOG=1 (from this tick only), STATUS=, EXTEND_TIMEOUT
        ├── engine task × N: spawn ─► wait ready ─► watch health ─► stop tree ─► backoff ─┐
        │        ▲                                                                       │
        │        └───────────────────────────────────────────────────────────────────────┘
        ├── telemetry task: GPU readings every interval (in a thread; NVML blocks)
        └── HTTP listener (the gateway), reading :meth:`Supervisor.engines` snapshots

Signal handlers only put the signal on a queue; the main loop acts on it, so nothing
complicated ever runs inside a handler. Engine tasks are the only code that moves an
engine's state, through :meth:`EngineRuntime.set_state`, which checks the transition.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
from aiohttp import web

from appliance import endpoint, paths, proctree
from appliance.config import Config, config_warnings, load_config
from appliance.engine import (
    EngineSnapshot,
    EngineSpec,
    EngineState,
    RestartReason,
    check_transition,
    new_api_key,
    with_batched_tokens,
)
from appliance.errors import EXIT_NO_ENGINE, EXIT_OK, ApplianceError, ConfigError
from appliance.health import HealthHistory, Observation, Verdict, assess, observe, read_kv_usage
from appliance.plan import EnginePlan, plan_engines, usable_cores
from appliance.policy.degradation import (
    EMPTY_BASELINE,
    Baseline,
    DegradationPolicy,
    EngineSample,
    learn_baseline,
)
from appliance.policy.degradation import assess as assess_degradation
from appliance.policy.thermal import HARD_LEVEL, ThermalPolicy, govern
from appliance.reload import merge_live
from appliance.systemd import Notifier, child_environment
from appliance.telemetry import GpuReading, TelemetryError, TelemetrySource, open_source

log = logging.getLogger("appliance.supervisor")

STABLE_AFTER_S = 60.0  # READY this long resets the crash backoff
KV_POLL_S = 0.5  # KV usage reads while an engine's KV breaker is open
UNRESPONSIVE_GRACE_S = 2.0  # SIGTERM → SIGKILL for a hung engine (not engine.stop_timeout_s)
STARTUP_POLL_S = 0.5
EXTEND_EVERY_S = 5.0
EXTEND_BY_S = 30.0
GPU_MEMORY_WAIT_S = 60.0
PORT_FREE_WAIT_S = 30.0
OUTPUT_TAIL_LINES = 30
# Restarts we chose (drained first): not failures, so they neither back off nor spend
# the crash budget (restart.max_restarts_per_hour).
PLANNED_REASONS = frozenset({RestartReason.ADMIN, RestartReason.DEGRADED, RestartReason.HEAT})


def backoff_delay(consecutive_failures: int, initial_s: float, max_s: float) -> float:
    """initial, 2×initial, 4×initial, … capped at max (consecutive_failures starts at 1)."""
    if consecutive_failures <= 0:
        return 0.0
    return float(min(max_s, initial_s * (2 ** min(consecutive_failures - 1, 32))))


def restart_allowed(restart_times: list[float], now: float, max_per_hour: int) -> bool:
    """Whether one more restart fits the budget of the last hour."""
    recent = [t for t in restart_times if now - t < 3600.0]
    return len(recent) < max_per_hour


StartHttp = Callable[["Supervisor"], Awaitable[web.AppRunner]]


class GatewayLink(Protocol):
    """What the supervisor tells the gateway and asks of it (implemented by Gateway)."""

    def inflight(self, engine_id: int) -> int: ...
    def observe_kv(self, engine_id: int, usage: float | None) -> None: ...
    def kv_tripped(self, engine_id: int) -> bool: ...
    def set_throttle(self, engine_id: int, level: int) -> None: ...
    def engines_changed(self) -> None: ...
    def abandon(self, engine_id: int, why: str) -> int: ...
    def stopping(self) -> None: ...
    def reload(self) -> None: ...


class _NoGateway:
    def inflight(self, engine_id: int) -> int:
        return 0

    def observe_kv(self, engine_id: int, usage: float | None) -> None:
        pass

    def kv_tripped(self, engine_id: int) -> bool:
        return False

    def set_throttle(self, engine_id: int, level: int) -> None:
        pass

    def engines_changed(self) -> None:
        pass

    def abandon(self, engine_id: int, why: str) -> int:
        return 0

    def stopping(self) -> None:
        pass

    def reload(self) -> None:
        pass


@dataclass
class EngineRuntime:
    """Mutable per-engine record. Owned by the supervisor; others see EngineSnapshot."""

    spec: EngineSpec
    state: EngineState = EngineState.EXITED
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    restarts_by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    restart_times: list[float] = field(default_factory=list)  # unplanned: the crash budget
    planned_times: list[float] = field(default_factory=list)  # heat and degradation
    planned_refused: bool = False  # the planned budget said no (logged once)
    consecutive_failures: int = 0
    last_restart_reason: str | None = None
    health: HealthHistory = field(default_factory=HealthHistory)
    ready_since: float | None = None
    output_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=OUTPUT_TAIL_LINES)
    )
    requested: RestartReason | None = None  # a planned restart asked for (admin, degraded)
    relay_task: asyncio.Task[None] | None = None
    last_observation: Observation | None = None
    samples: collections.deque[EngineSample] = field(default_factory=collections.deque)
    baseline: Baseline = EMPTY_BASELINE
    held: bool = False  # drained by an admin: stays DRAINING until resumed
    wait_logged: bool = False
    batched_tokens: int | None = None  # heat-reduced --max-num-batched-tokens, or None
    members: proctree.Members = field(default_factory=dict)  # its tree, last seen whole
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    listeners: list[Callable[[EngineRuntime, EngineState], None]] = field(default_factory=list)
    api_key: str = ""  # this spawn's engine key (new at every spawn)
    # Health checks and metrics reads: a session whose connector reaches this engine only.
    session: aiohttp.ClientSession | None = None

    def set_state(self, new: EngineState) -> None:
        old = self.state
        if old is new:
            return
        check_transition(old, new)
        self.state = new
        self.ready_since = time.monotonic() if new is EngineState.READY else None
        log.info("%s: %s -> %s", self.spec.name, old.value, new.value)
        for listener in self.listeners:
            listener(self, old)

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            id=self.spec.id,
            gpu=self.spec.gpu,
            address=self.spec.address,
            state=self.state,
            api_key=self.api_key,
            pid=self.process.pid if self.process and self.process.returncode is None else None,
            restarts=self.restarts,
            last_restart_reason=self.last_restart_reason,
            served_model_name=self.spec.served_model_name,
        )


class Supervisor:
    def __init__(
        self,
        config: Config,
        *,
        config_arg: str | None = None,
        notifier: Notifier | None = None,
        env: Mapping[str, str] | None = None,
        home: Path | None = None,
    ) -> None:
        self.config = config
        self._config_arg = config_arg
        self.notifier = notifier or Notifier.from_env()
        self._env = dict(os.environ if env is None else env)
        self._home = home or paths.appliance_home(self._env)
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._stop_event = asyncio.Event()
        self._fast_stop = False
        self._stop_task: asyncio.Task[None] | None = None
        self._exit_code = EXIT_OK
        self.engines: list[EngineRuntime] = []
        self.plan: EnginePlan | None = None
        self.gpu_readings: dict[int, GpuReading] = {}
        self.telemetry: TelemetrySource | None = None
        self.accepting = False  # the gateway refuses new requests while False
        self.started_at = time.time()
        self.last_tick = time.monotonic()
        self.link: GatewayLink = _NoGateway()
        self.levels: dict[int, int] = {}  # telemetry index -> thermal throttle level
        self._hard_since: dict[int, float] = {}  # telemetry index -> at HARD since
        self._cool_since: dict[int, float] = {}  # telemetry index -> at level 0 since
        self._ready_sent = False
        self._last_extend = 0.0
        self._last_status = ""
        self._restarting: int | None = None  # the engine in a planned restart (one at a time)
        self._tasks: list[asyncio.Task[None]] = []
        self._socket_dir: Path | None = None
        self._own_socket_dir = False  # made by us (mkdtemp): removed at exit

    # ---- views for the gateway and status ------------------------------------------
    def snapshots(self) -> list[EngineSnapshot]:
        return [rt.snapshot() for rt in self.engines]

    @property
    def ready(self) -> bool:
        return self.accepting and any(rt.state is EngineState.READY for rt in self.engines)

    @property
    def stopping(self) -> bool:
        return self._stop_event.is_set()

    # ---- entry point ----------------------------------------------------------------
    async def run(self, start_http: StartHttp | None = None) -> int:
        """Run until stopped; return the exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        proctree.become_subreaper()
        runner = None
        try:
            self.plan = self._make_plan()
            self.engines = [EngineRuntime(spec) for spec in self.plan.specs]
            for rt in self.engines:
                rt.listeners.append(self._on_state_change)
            log.info(
                "plan: %d %s engine(s) serving %r from %s",
                len(self.engines),
                self.plan.device,
                self.plan.served_model_name,
                self.plan.model,
            )
            for rt in self.engines:
                rt.session = aiohttp.ClientSession(
                    connector=rt.spec.address.connector(limit=0), trust_env=False
                )
            if start_http is not None:
                runner = await start_http(self)
            self.accepting = True
            self._tasks.append(asyncio.create_task(self._telemetry_loop(), name="telemetry"))
            for rt in self.engines:
                self._tasks.append(asyncio.create_task(self._engine_loop(rt), name=rt.spec.name))
            await self._main_loop()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            await self._shutdown_tasks()
            if runner is not None:
                await runner.cleanup()
            for rt in self.engines:
                if rt.session is not None:
                    await rt.session.close()
            self._remove_socket_dir()
            if self.telemetry is not None:
                self.telemetry.close()
            self.notifier.close()
        return self._exit_code

    def _make_plan(self) -> EnginePlan:
        self.telemetry = self._open_telemetry()
        gpu_count = 0
        if self.config.engine.device != "cpu":
            from appliance.telemetry import count_nvidia_gpus

            gpu_count = count_nvidia_gpus()
        if self.config.engine.listen == "unix":
            self._socket_dir, self._own_socket_dir = endpoint.private_socket_dir(self._env)
            log.info("engine sockets in %s (private to this service)", self._socket_dir)
        return plan_engines(
            self.config,
            gpu_count=gpu_count,
            cores=usable_cores(),
            home=self._home,
            base_env=child_environment(self._env),
            socket_dir=self._socket_dir,
        )

    def _remove_socket_dir(self) -> None:
        if self._socket_dir is None:
            return
        for rt in self.engines:
            if rt.spec.address.uds is not None:
                endpoint.remove_stale_socket(rt.spec.address.uds)
        if self._own_socket_dir:
            with contextlib.suppress(OSError):
                self._socket_dir.rmdir()

    def _open_telemetry(self) -> TelemetrySource:
        source = self.config.telemetry.source
        try:
            return open_source(source)
        except TelemetryError as exc:
            if source == "nvml":
                # The default on a machine with no NVIDIA driver: not an error.
                log.info("GPU telemetry off: NVML unavailable (%s)", exc)
            else:
                log.error(
                    "telemetry.source = %r cannot be used (%s); GPU telemetry off", source, exc
                )
            return open_source("none")

    # ---- main loop ------------------------------------------------------------------
    def _tick_interval(self) -> float:
        interval = 0.5
        wd = self.notifier.watchdog_interval_s
        return min(interval, wd) if wd else interval

    async def _main_loop(self) -> None:
        last_watchdog = 0.0
        while True:
            try:
                sig = await asyncio.wait_for(self._signals.get(), self._tick_interval())
            except TimeoutError:
                sig = None
            if sig is not None:
                self._dispatch_signal(sig)
            now = time.monotonic()
            self.last_tick = now
            wd = self.notifier.watchdog_interval_s
            if wd is not None and now - last_watchdog >= wd:
                # From this tick only: if the loop stalls, systemd notices and restarts us.
                self.notifier.watchdog()
                last_watchdog = now
            self._update_systemd(now)
            # Belt and braces for admission: waiters normally get slots on release or
            # state change; a tick-driven kick bounds any missed wake-up to one tick.
            self.link.engines_changed()
            if self._stop_task is not None and self._stop_task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    self._stop_task.result()
                return
            if (
                self._stop_task is None
                and self.engines
                and all(rt.state is EngineState.FAILED for rt in self.engines)
            ):
                log.error(
                    "no engine could be started (all %d FAILED); exiting with status %d",
                    len(self.engines),
                    EXIT_NO_ENGINE,
                )
                self._exit_code = EXIT_NO_ENGINE
                self._begin_stop(fast=False)

    def _dispatch_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if sig == signal.SIGHUP:
            log.info("SIGHUP: reloading")
            self.reload()
        elif self._stop_task is None:
            log.info(
                "%s: stopping gracefully (drain up to %.0f s)",
                name,
                self.config.restart.drain_timeout_s,
            )
            self._begin_stop(fast=False)
        elif sig == signal.SIGINT:
            log.warning("second SIGINT: stopping at once")
            self._fast_stop = True
            self._stop_event.set()
            for rt in self.engines:
                rt.wake.set()

    def _begin_stop(self, fast: bool) -> None:
        self._fast_stop = fast
        self.accepting = False
        self.notifier.stopping()
        self.link.stopping()
        self._stop_task = asyncio.create_task(self._stop(), name="stop")

    async def _stop(self) -> None:
        deadline = time.monotonic() + self.config.restart.drain_timeout_s
        while not self._fast_stop and time.monotonic() < deadline:
            busy = sum(self.link.inflight(rt.spec.id) for rt in self.engines)
            if busy == 0:
                break
            await asyncio.sleep(0.1)
        self._stop_event.set()
        for rt in self.engines:
            rt.wake.set()
        await asyncio.gather(
            *(t for t in self._tasks if t.get_name().startswith("engine")), return_exceptions=True
        )

    async def _shutdown_tasks(self) -> None:
        self._stop_event.set()
        for rt in self.engines:
            rt.wake.set()
        engine_tasks = [t for t in self._tasks if t.get_name().startswith("engine")]
        if engine_tasks:
            await asyncio.wait(engine_tasks, timeout=self.config.engine.stop_timeout_s + 15)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Whatever happened above, no engine process may outlive us.
        for rt in self.engines:
            await self._kill_tree(rt, timeout_s=0.5 if self._fast_stop else 5.0)

    def reload(self) -> None:
        self.notifier.reloading()
        try:
            new = load_config(self._config_arg, self._env, require_file=bool(self.config.source))
        except ConfigError as exc:
            log.error(
                "reload refused; the running config stays in force:\n  %s",
                "\n  ".join(exc.problems),
            )
        else:
            self.config, live, restart = merge_live(self.config, new)
            if live:
                log.info("reload applied: %s", ", ".join(live))
                for rt in self.engines:
                    rt.wake.set()  # engine loops re-read their timers now
            if restart:
                log.warning(
                    "reload: these keys changed but need a restart "
                    "(systemctl restart llm-appliance): %s",
                    ", ".join(restart),
                )
        try:
            self.link.reload()
        except Exception:  # a failing key reload must not take the daemon down
            log.exception("reloading keys failed")
        if self._ready_sent:
            self.notifier.ready()

    # ---- systemd --------------------------------------------------------------------
    def _update_systemd(self, now: float) -> None:
        states = [rt.state for rt in self.engines]
        loading = any(s is EngineState.STARTING for s in states)
        settled = all(s in (EngineState.READY, EngineState.FAILED) for s in states)
        if not self._ready_sent and self.accepting and settled:
            self.notifier.ready()
            self._ready_sent = True
        elif (
            not self._ready_sent
            and (loading or not settled)
            and now - self._last_extend >= EXTEND_EVERY_S
        ):
            # Models load for minutes; keep systemd's start timeout from firing meanwhile.
            self.notifier.extend_timeout(EXTEND_BY_S)
            self._last_extend = now
        status = self.status_line()
        if status != self._last_status:
            self.notifier.status(status)
            self._last_status = status

    def status_line(self) -> str:
        n_ready = sum(rt.state is EngineState.READY for rt in self.engines)
        parts = [f"{n_ready}/{len(self.engines)} engines ready"]
        if self.stopping or self._stop_task is not None:
            parts[0] = "stopping; " + parts[0]
        odd = [
            f"{rt.spec.name} {rt.state.value}"
            for rt in self.engines
            if rt.state is not EngineState.READY
        ]
        if odd:
            parts.append(", ".join(odd))
        temps = [
            f"gpu{i} {r.temperature_c:.0f}°C"
            for i, r in sorted(self.gpu_readings.items())
            if r.temperature_c is not None
        ]
        if temps:
            parts.append(", ".join(temps))
        busy = sum(self.link.inflight(rt.spec.id) for rt in self.engines)
        parts.append(f"{busy} in flight")
        return "; ".join(parts)

    # ---- telemetry ------------------------------------------------------------------
    async def _telemetry_loop(self) -> None:
        assert self.telemetry is not None
        warned = False
        while not self.stopping:
            try:
                readings = await asyncio.to_thread(self.telemetry.read)
                self.gpu_readings = {r.index: r for r in readings}
                warned = False
            except Exception as exc:  # a failing sensor source never stops the daemon
                if not warned:
                    log.warning("GPU telemetry read failed: %s", exc)
                    warned = True
            self._govern()
            await asyncio.sleep(self.config.telemetry.interval_s)

    def throttle_levels(self) -> dict[int, int]:
        return dict(self.levels)

    def _govern(self) -> None:
        """Thermal governor: one level per GPU from its reading; the gateway admits less."""
        policy = ThermalPolicy.from_config(self.config.thermal)
        for index, reading in self.gpu_readings.items():
            old = self.levels.get(index, 0)
            new = govern(reading.temperature_c, reading.throttle_reasons, old, policy)
            if new != old:
                log.warning(
                    "gpu%d: throttle level %d -> %d (%s°C%s)",
                    index,
                    old,
                    new,
                    "?" if reading.temperature_c is None else f"{reading.temperature_c:.0f}",
                    ", " + ",".join(reading.throttle_reasons) if reading.throttle_reasons else "",
                )
            self.levels[index] = new
        now = time.monotonic()
        for rt in self.engines:
            key = rt.spec.gpu if rt.spec.gpu is not None else rt.spec.id
            level = self.levels.get(key, 0)
            self.link.set_throttle(rt.spec.id, level)
            if level >= HARD_LEVEL:
                self._hard_since.setdefault(key, now)
            else:
                self._hard_since.pop(key, None)
            if level == 0:
                self._cool_since.setdefault(key, now)
            else:
                self._cool_since.pop(key, None)
            self._heat_restart(rt, key, now)

    def _may_plan_restart(self, rt: EngineRuntime, reason: RestartReason, now: float) -> bool:
        """Whether a heat or degradation restart fits restart.max_planned_restarts_per_hour."""
        limit = self.config.restart.max_planned_restarts_per_hour
        if restart_allowed(rt.planned_times, now, limit):
            rt.planned_refused = False
            return True
        if not rt.planned_refused:
            log.warning(
                "%s: %s restart not done: %d planned restarts within the last hour "
                "(restart.max_planned_restarts_per_hour); it keeps serving as it is",
                rt.spec.name,
                reason.value,
                limit,
            )
            rt.planned_refused = True
        return False

    def _heat_restart(self, rt: EngineRuntime, key: int, now: float) -> None:
        """Sustained heat: restart with half the batched tokens; restore once cool."""
        th = self.config.thermal
        if th.heat_restart_after_s <= 0 or rt.requested is not None:
            return
        if rt.state is not EngineState.READY:
            return
        hot_for = now - self._hard_since.get(key, now)
        cool_for = now - self._cool_since.get(key, now)
        full = self.config.engine.max_num_batched_tokens
        if rt.batched_tokens is None and hot_for >= th.heat_restart_after_s:
            if "--max-num-batched-tokens" not in rt.spec.argv:
                return  # a `command` override: nothing we can halve
            if not self._may_plan_restart(rt, RestartReason.HEAT, now):
                return
            rt.batched_tokens = max(16, full // 2)
            log.warning(
                "%s: GPU %d at the hard limit for %.0f s; restarting it with "
                "--max-num-batched-tokens %d",
                rt.spec.name,
                key,
                hot_for,
                rt.batched_tokens,
            )
            rt.requested = RestartReason.HEAT
            rt.wake.set()
        elif rt.batched_tokens is not None and cool_for >= th.heat_restore_after_s:
            if not self._may_plan_restart(rt, RestartReason.HEAT, now):
                return
            log.info(
                "%s: GPU %d cool for %.0f s; restoring --max-num-batched-tokens %d",
                rt.spec.name,
                key,
                cool_for,
                full,
            )
            rt.batched_tokens = None
            rt.requested = RestartReason.HEAT
            rt.wake.set()

    # ---- engines --------------------------------------------------------------------
    def request_restart(self, engine_id: int, reason: RestartReason) -> bool:
        """Ask for a planned (drained) restart; False when the engine can't take one now."""
        rt = self.engines[engine_id]
        if rt.state not in (
            EngineState.READY,
            EngineState.SUSPECT,
            EngineState.DRAINING,
            EngineState.FAILED,
            EngineState.STARTING,
            EngineState.EXITED,
        ):
            return False
        rt.requested = reason
        rt.wake.set()
        return True

    def _on_state_change(self, rt: EngineRuntime, old: EngineState) -> None:
        if rt.spec.id == self._restarting and rt.state in (EngineState.READY, EngineState.FAILED):
            self._restarting = None  # its planned restart is over: the next may begin
        self.link.engines_changed()

    def _may_take_out(self, rt: EngineRuntime) -> str | None:
        """Why a planned restart of ``rt`` must wait, or None when it may go ahead.

        One engine restarts at a time, and an engine is never taken out while it is the
        last one serving (a box with a single engine has no choice, so it may).
        """
        if self._restarting is not None and self._restarting != rt.spec.id:
            return f"engine{self._restarting} is restarting"
        others = [e for e in self.engines if e is not rt]
        if others and not any(e.state is EngineState.READY for e in others):
            return "it is the last engine serving"
        return None

    def _degradation_policy(self) -> DegradationPolicy:
        d = self.config.degradation
        return DegradationPolicy(
            window_s=d.window_s,
            max_preemptions_per_min=d.max_preemptions_per_min,
            leak_kv_usage=d.leak_kv_usage,
            leak_hold_s=d.leak_hold_s,
            slowdown_ratio=d.slowdown_ratio,
            baseline_warmup_s=d.baseline_warmup_s,
            rss_growth_ratio=d.rss_growth_ratio,
            hang_s=d.hang_s,
        )

    async def _check_degradation(self, rt: EngineRuntime, obs: Observation, pid: int) -> None:
        now = time.monotonic()
        rss, members = await asyncio.to_thread(proctree.tree_snapshot, pid)
        rt.members.update(members)
        rt.samples.append(
            EngineSample(
                t=now,
                preemptions_total=obs.preemptions_total,
                generation_tokens_total=obs.generation_tokens,
                running=obs.running,
                waiting=obs.waiting,
                kv_cache_usage=obs.kv_cache_usage,
                rss_bytes=rss,
            )
        )
        policy = self._degradation_policy()
        while rt.samples and rt.samples[0].t < now - policy.window_s:
            rt.samples.popleft()
        started = rt.ready_since if rt.ready_since is not None else now
        rt.baseline = learn_baseline(rt.samples, rt.baseline, policy, started, now)
        verdict = assess_degradation(rt.samples, rt.baseline, policy, now)
        if not verdict.degraded or rt.requested is not None:
            return
        if not self.config.restart.degradation_restart:
            if rt.health.consecutive_failures == 0:
                log.warning(
                    "%s: degraded (%s: %s); restart.degradation_restart = false, so it keeps "
                    "serving",
                    rt.spec.name,
                    verdict.reason,
                    verdict.detail,
                )
            return
        if self._may_plan_restart(rt, RestartReason.DEGRADED, now):
            log.warning(
                "%s: degraded (%s: %s); draining it for a restart",
                rt.spec.name,
                verdict.reason,
                verdict.detail,
            )
            rt.requested = RestartReason.DEGRADED
            rt.samples.clear()

    def drain(self, engine_id: int, force: bool = False) -> tuple[bool, str]:
        """Stop routing new work to an engine until resume(); in-flight work finishes.

        The last engine serving is drained only with ``force``: that stops the service.
        """
        rt = self.engines[engine_id]
        if rt.state is EngineState.DRAINING:
            rt.held = True
            return True, ""
        if rt.state not in (EngineState.READY, EngineState.SUSPECT):
            return False, f"engine {engine_id} is {rt.state.value}; only a READY engine drains"
        serving = [e for e in self.engines if e is not rt and e.state is EngineState.READY]
        if not serving and not force:
            return False, (
                f"engine {engine_id} is the last engine serving: draining it stops the "
                "service for every user; add ?force=true to drain it anyway"
            )
        rt.held = True
        rt.set_state(EngineState.DRAINING)
        return True, ""

    def resume(self, engine_id: int) -> tuple[bool, str]:
        rt = self.engines[engine_id]
        if rt.state is not EngineState.DRAINING or rt.requested is not None:
            return False, f"engine {engine_id} is {rt.state.value}; only a drained engine resumes"
        rt.held = False
        rt.set_state(EngineState.READY)
        return True, ""

    async def _engine_loop(self, rt: EngineRuntime) -> None:
        """Start, watch and restart one engine until the daemon stops."""
        while not self.stopping:
            if rt.state is EngineState.FAILED:
                # Stays down until an admin asks for a restart.
                await rt.wake.wait()
                rt.wake.clear()
                if self.stopping or rt.requested is None:
                    continue
            reason = await self._start_and_watch(rt)
            await self._stop_engine(rt, reason)
            if self.stopping or reason is None:
                break
            now = time.monotonic()
            planned = reason in PLANNED_REASONS
            if planned:
                # Budgeted apart (checked when asked for, _may_plan_restart): a hot
                # afternoon must not spend the budget that stops a crash loop.
                if reason is not RestartReason.ADMIN:
                    rt.planned_times.append(now)
            else:
                if not restart_allowed(
                    rt.restart_times, now, self.config.restart.max_restarts_per_hour
                ):
                    log.error(
                        "%s: more than %d restarts within an hour; FAILED until an "
                        "admin restarts it (last reason: %s)",
                        rt.spec.name,
                        self.config.restart.max_restarts_per_hour,
                        reason.value,
                    )
                    rt.set_state(EngineState.FAILED)
                    continue
                rt.restart_times.append(now)
            rt.restarts += 1
            rt.restarts_by_reason[reason.value] += 1
            rt.last_restart_reason = reason.value
            if not planned:
                rt.consecutive_failures += 1
                delay = backoff_delay(
                    rt.consecutive_failures,
                    self.config.restart.backoff_initial_s,
                    self.config.restart.backoff_max_s,
                )
                log.warning(
                    "%s: restarting in %.1f s (reason: %s, failure %d in a row)",
                    rt.spec.name,
                    delay,
                    reason.value,
                    rt.consecutive_failures,
                )
                await self._sleep_unless_stopped(rt, delay)

    async def _sleep_unless_stopped(self, rt: EngineRuntime, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), delay)

    async def _start_and_watch(self, rt: EngineRuntime) -> RestartReason | None:
        """Spawn, wait until ready, watch. The reason it must go down, or None to stop."""
        if rt.state is EngineState.FAILED:
            # An admin restart of a FAILED engine gets a fresh budget and no backoff.
            rt.restart_times.clear()
            rt.consecutive_failures = 0
        rt.requested = None
        rt.wait_logged = False
        rt.samples.clear()
        rt.baseline = EMPTY_BASELINE
        rt.wake.clear()
        port = rt.spec.address.port
        if port is not None and not proctree.port_is_free(port):
            log.error(
                "%s: port %d is already in use by %s; not starting there and "
                "not killing it: stop that process or change engine.port_base",
                rt.spec.name,
                port,
                endpoint.describe_listener(port),
            )
            rt.set_state(EngineState.STARTING)
            return RestartReason.CRASH
        if rt.spec.address.uds is not None:
            endpoint.remove_stale_socket(rt.spec.address.uds)
        rt.set_state(EngineState.STARTING)
        await self._spawn(rt)
        reason = await self._wait_ready(rt)
        if reason is not None or self.stopping:
            return None if self.stopping else reason
        rt.held = False
        rt.set_state(EngineState.READY)
        return await self._watch(rt)

    async def _spawn(self, rt: EngineRuntime) -> None:
        spec = rt.spec
        # A new key per spawn: a key that leaked (a command line, a core dump) is
        # worthless once the engine it belonged to is gone.
        rt.api_key = new_api_key()
        argv = with_batched_tokens(spec.argv_with_key(rt.api_key), rt.batched_tokens)
        log.info(
            "%s: starting on %s, listening on %s: %s",
            spec.name,
            f"GPU {spec.gpu}" if spec.gpu is not None else "CPU",
            spec.address,
            " ".join(argv).replace(rt.api_key, "***"),
        )
        # Output goes through a pipe of our own rather than asyncio's subprocess pipes:
        # vLLM's orphaned children keep the write end open after the API server dies, and
        # asyncio's Process.wait() waits for its pipes to close, so a crash would go
        # unnoticed for as long as an orphan lives.
        rfd, wfd = os.pipe()
        try:
            rt.process = await asyncio.create_subprocess_exec(
                *argv,
                env=spec.env_with_key(rt.api_key),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=wfd,
                stderr=wfd,
                start_new_session=True,
            )
        except OSError as exc:
            os.close(rfd)
            log.error("%s: cannot start %s: %s", spec.name, spec.argv[0], exc)
            rt.process = None
            return
        finally:
            os.close(wfd)
        if spec.cpus:
            # Set before the child gets far: the interpreter needs a few ms to start and
            # vLLM's first children come seconds later, so the whole tree inherits it.
            try:
                os.sched_setaffinity(rt.process.pid, spec.cpus)
            except OSError as exc:
                log.warning("%s: cannot pin to cores %s: %s", spec.name, spec.cpus, exc)
        rt.relay_task = asyncio.create_task(self._relay_output(rt, rfd), name=f"relay-{spec.name}")

    async def _relay_output(self, rt: EngineRuntime, fd: int) -> None:
        """Copy the engine tree's output to ours, line by line, prefixed and key-redacted."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
        )
        prefix = f"[{rt.spec.name}] "
        out = sys.stdout
        try:
            while True:
                try:
                    raw = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    continue  # an over-long line: drop it rather than stop relaying
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").rstrip()
                line = line.replace(rt.api_key, "***")
                rt.output_tail.append(line)
                out.write(prefix + line + "\n")
                out.flush()
        finally:
            transport.close()

    async def _wait_ready(self, rt: EngineRuntime) -> RestartReason | None:
        assert rt.session is not None
        proc = rt.process
        if proc is None:
            return RestartReason.CRASH
        deadline = time.monotonic() + self.config.engine.startup_timeout_s
        while not self.stopping:
            if proc.returncode is not None:
                self._log_exit(rt, proc.returncode, "while starting")
                return RestartReason.CRASH
            if time.monotonic() > deadline:
                log.error(
                    "%s: not ready after %.0f s (engine.startup_timeout_s)",
                    rt.spec.name,
                    self.config.engine.startup_timeout_s,
                )
                return RestartReason.STARTUP_TIMEOUT
            owner = await self._listener_is_ours(rt, proc.pid)
            if owner is False:
                return RestartReason.CRASH
            obs = await self._observe(rt) if owner else None
            if obs is not None and obs.health_ok and obs.probe_ok:
                rt.health = HealthHistory(0, obs.generation_tokens)
                rt.last_observation = obs
                _, rt.members = await asyncio.to_thread(proctree.tree_snapshot, proc.pid)
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), STARTUP_POLL_S)
        return None

    def _mark_suspect(self, rt: EngineRuntime, verdict: Verdict) -> None:
        """A failed check takes a READY engine out of routing at once; a good one puts it
        back. Only a DRAINING engine (drained or being restarted) is left as it is."""
        if verdict is Verdict.HEALTHY and rt.state is EngineState.SUSPECT:
            rt.set_state(EngineState.READY)
        elif verdict is not Verdict.HEALTHY and rt.state is EngineState.READY:
            rt.set_state(EngineState.SUSPECT)  # _on_state_change tells the gateway

    async def _observe(self, rt: EngineRuntime) -> Observation:
        assert rt.session is not None
        return await observe(
            rt.session,
            rt.spec.address.base_url,
            rt.api_key,
            rt.spec.served_model_name,
            self.config.health.probe_timeout_s,
        )

    async def _listener_is_ours(self, rt: EngineRuntime, root_pid: int) -> bool | None:
        """Before the engine key goes anywhere: who listens where the engine should.

        A Unix socket in our private directory can only be the engine's. A TCP port can
        be bound by any local process while the engine is still importing, so the
        listener's socket must be one the engine's own processes hold. True: ours;
        None: nobody listens yet; False: someone else does (logged; never sent a key).
        """
        port = rt.spec.address.port
        if port is None:
            return True
        pids = await asyncio.to_thread(proctree.tree_pids, root_pid)
        ours = await asyncio.to_thread(endpoint.tcp_listener_is_ours, port, pids)
        if ours is False:
            who = await asyncio.to_thread(endpoint.describe_listener, port)
            log.error(
                "%s: port %d is held by %s, not by the engine's own processes: nothing "
                "was sent to it and the engine is not used; stop that process or use "
                'engine.listen = "unix"',
                rt.spec.name,
                port,
                who,
            )
        return ours

    def _log_exit(self, rt: EngineRuntime, code: int, when: str) -> None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        tail = "\n    ".join(list(rt.output_tail)[-10:])
        log.error(
            "%s: exited with %s %s%s",
            rt.spec.name,
            how,
            when,
            f"; last output:\n    {tail}" if tail else "",
        )

    async def _watch(self, rt: EngineRuntime) -> RestartReason | None:
        """Watch a READY engine until it dies, hangs, or a restart or stop is asked for."""
        assert rt.session is not None and rt.process is not None
        proc = rt.process
        exited = asyncio.ensure_future(proc.wait())
        last_check = time.monotonic()
        try:
            while True:
                # From the config each time round: a reload's health.interval_s applies to
                # engines already running (reload() wakes this loop).
                next_check = last_check + self.config.health.interval_s
                # While its KV breaker is open the engine gets nothing new: read its KV
                # usage often, so it is back in service soon after the pressure falls,
                # not up to a whole health interval later.
                kv_poll = self.link.kv_tripped(rt.spec.id)
                timeout = max(0.0, next_check - time.monotonic())
                if kv_poll:
                    timeout = min(timeout, KV_POLL_S)
                wake = asyncio.ensure_future(rt.wake.wait())
                done, _ = await asyncio.wait(
                    {exited, wake},
                    timeout=timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                wake.cancel()
                rt.wake.clear()
                if exited in done:
                    self._log_exit(rt, proc.returncode or 0, "while serving")
                    return RestartReason.CRASH
                if self.stopping:
                    return None
                if rt.requested is not None:
                    wait = self._may_take_out(rt)
                    if wait is None:
                        self._restarting = rt.spec.id
                        reason = rt.requested
                        log.info("%s: %s restart: draining first", rt.spec.name, reason.value)
                        await self._drain(rt)
                        return reason
                    if not rt.wait_logged:
                        log.info("%s: %s restart waits: %s", rt.spec.name, rt.requested.value, wait)
                        rt.wait_logged = True
                if time.monotonic() < next_check:
                    if kv_poll and not done:
                        usage = await read_kv_usage(
                            rt.session, rt.spec.address.base_url, self.config.health.probe_timeout_s
                        )
                        self.link.observe_kv(rt.spec.id, usage)
                    continue
                last_check = time.monotonic()
                if (
                    rt.state is EngineState.READY
                    and rt.ready_since is not None
                    and time.monotonic() - rt.ready_since > STABLE_AFTER_S
                ):
                    rt.consecutive_failures = 0
                if await self._listener_is_ours(rt, proc.pid) is not True:
                    return RestartReason.CRASH  # named in the log; nothing was sent to it
                obs = await self._observe(rt)
                if proc.returncode is not None:
                    continue  # handled at the top: it crashed, it did not hang
                rt.last_observation = obs
                self.link.observe_kv(rt.spec.id, obs.kv_cache_usage)
                verdict, rt.health = assess(obs, rt.health, self.config.health.failures_to_restart)
                self._mark_suspect(rt, verdict)
                if verdict is Verdict.HEALTHY:
                    await self._check_degradation(rt, obs, proc.pid)
                if verdict is Verdict.SUSPECT:
                    log.warning(
                        "%s: health check failed (%d/%d): %s",
                        rt.spec.name,
                        rt.health.consecutive_failures,
                        self.config.health.failures_to_restart,
                        obs.detail,
                    )
                elif verdict is Verdict.HUNG:
                    log.error(
                        "%s: hung (%s) and no tokens flowing; replacing it",
                        rt.spec.name,
                        obs.detail,
                    )
                    return RestartReason.HUNG
        finally:
            exited.cancel()

    async def _drain(self, rt: EngineRuntime) -> None:
        """Stop routing to it and let in-flight work finish (bounded)."""
        if rt.state in (EngineState.READY, EngineState.SUSPECT):
            rt.set_state(EngineState.DRAINING)
        deadline = time.monotonic() + self.config.restart.drain_timeout_s
        while self.link.inflight(rt.spec.id) > 0 and not self.stopping:
            if time.monotonic() > deadline:
                log.warning(
                    "%s: %d request(s) still running after %.0f s of draining; restarting anyway",
                    rt.spec.name,
                    self.link.inflight(rt.spec.id),
                    self.config.restart.drain_timeout_s,
                )
                # Those not yet answering move to another engine now, not at the kill.
                self.link.abandon(rt.spec.id, "the engine was restarted after draining")
                break
            await asyncio.sleep(0.1)

    async def _stop_engine(self, rt: EngineRuntime, reason: RestartReason | None = None) -> None:
        """Take an engine down: SIGTERM its tree, SIGKILL what stays, wait for its port."""
        if rt.state in (
            EngineState.STARTING,
            EngineState.READY,
            EngineState.SUSPECT,
            EngineState.DRAINING,
        ):
            rt.set_state(EngineState.STOPPING)
        timeout = 0.0 if self._fast_stop else self.config.engine.stop_timeout_s
        if reason in (RestartReason.HUNG, RestartReason.STARTUP_TIMEOUT):
            # It has not answered for a while: it will not shut down gracefully either
            # (a SIGSTOPped tree does not even see SIGTERM), so kill it soon.
            timeout = min(timeout, UNRESPONSIVE_GRACE_S)
        if reason is RestartReason.HUNG:
            # Its requests would stay stuck until it dies: give them up now, so those
            # with no byte sent yet are retried elsewhere at once.
            moved = self.link.abandon(rt.spec.id, "the engine stopped answering")
            if moved:
                log.warning(
                    "%s: gave up %d request(s) on the hung engine; those not yet "
                    "answering are retried on another engine",
                    rt.spec.name,
                    moved,
                )
        await self._kill_tree(rt, timeout)
        if rt.state is not EngineState.FAILED:
            rt.set_state(EngineState.EXITED)
        if self.stopping:
            return
        await self._wait_resources_free(rt)

    async def _kill_tree(self, rt: EngineRuntime, timeout_s: float) -> None:
        proc = rt.process
        root = proc.pid if proc is not None else None
        if proc is not None and proc.returncode is not None:
            # The API server is gone: what is left has no clients and nothing to finish
            # gracefully, and vLLM's orphaned EngineCore takes 10-20 s to obey SIGTERM.
            timeout_s = min(timeout_s, 1.0)
        result = await asyncio.to_thread(
            proctree.kill_tree, rt.spec.tag, root, timeout_s, dict(rt.members)
        )
        rt.members.clear()
        if proc is not None:
            with contextlib.suppress(TimeoutError, ProcessLookupError):
                await asyncio.wait_for(proc.wait(), 5.0)
        if result.killed:
            log.warning("%s: %d process(es) needed SIGKILL", rt.spec.name, result.killed)
        if result.left:
            log.error("%s: %d process(es) survived SIGKILL", rt.spec.name, result.left)

    async def _wait_resources_free(self, rt: EngineRuntime) -> None:
        port = rt.spec.address.port
        deadline = time.monotonic() + PORT_FREE_WAIT_S
        while port is not None and not proctree.port_is_free(port):
            if time.monotonic() > deadline or proctree.port_holder(port) is not None:
                break  # someone else's now: reported when we try to start
            await asyncio.sleep(0.2)
        gpu = rt.spec.gpu
        if gpu is None:
            return
        # vLLM's orphans used to keep GPU memory after the API server died (vllm#55510);
        # a new engine started before it is released fails to allocate its KV cache.
        deadline = time.monotonic() + GPU_MEMORY_WAIT_S
        while time.monotonic() < deadline and not self.stopping:
            r = self.gpu_readings.get(gpu)
            if r is None or r.memory_used_bytes is None or r.memory_total_bytes is None:
                return
            if r.memory_used_bytes < 0.1 * r.memory_total_bytes:
                return
            await asyncio.sleep(self.config.telemetry.interval_s)
        log.warning(
            "%s: GPU %d memory still in use after %.0f s; starting anyway",
            rt.spec.name,
            gpu,
            GPU_MEMORY_WAIT_S,
        )


async def serve(config: Config, config_arg: str | None = None) -> int:
    from appliance.gateway.app import start_gateway

    for warning in config_warnings(config):
        log.warning("config: %s", warning)
    supervisor = Supervisor(config, config_arg=config_arg)
    try:
        return await supervisor.run(start_http=start_gateway)
    except ApplianceError as exc:
        log.error("%s", exc)
        return exc.exit_code
