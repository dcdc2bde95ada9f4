"""The supervisor: the one owner of engine processes, and the coordinator of their runners.

Shape (one asyncio loop, one process)::

    main loop tick ──► signals queued by handlers ──► handle_term / handle_int / handle_hup
        │          └─► systemd: WATCHDOG=1 (from this tick only), STATUS=, EXTEND_TIMEOUT
        ├── runner × N (runner.py): spawn ─► wait ready ─► watch ─► stop tree ─► backoff ─┐
        │        ▲    its inbox: drain, resume, restart, heat, nudge                      │
        │        └────────────────────────────────────────────────────────────────────────┘
        ├── heat loop (heat.py): GPU readings every interval (in a thread; NVML blocks)
        └── the gateway (connected by appliance.serve): reads status snapshots and asks
            for engine commands through appliance.control, never this module

Signal handlers only put the signal on a queue; the main loop calls one small method
per signal, so nothing complicated ever runs inside a handler. Each engine's runner is
the only code that moves that engine's state: the supervisor reads the runners' states
and tells them things (a nudge after a reload, or at stop), and never sets one.
A reload's reading and merging is in reloading.py; the tasks' start and end in tasks.py;
the stop's steps that need none of its flags (drain wait, release) in stopping.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from appliance import paths, proctree
from appliance.audit import AuditLog
from appliance.config import Config
from appliance.control import (
    AdapterResult,
    AdapterStatus,
    ApplianceStatus,
    CommandResult,
    EngineStatus,
    GatewayLink,
    Listening,
    ModelResult,
    ModelStatus,
    NoGateway,
    StartHttp,
)
from appliance.engine import EngineSpec, EngineState, instance_id, lineage_env
from appliance.errors import EXIT_NO_ENGINE, EXIT_OK
from appliance.plan import EnginePlan
from appliance.supervisor import leftovers, stopping
from appliance.supervisor.adapters import AdapterBook
from appliance.supervisor.adapters_file import adapters_path
from appliance.supervisor.boot import SocketDir, gpu_count, make_plan, open_telemetry
from appliance.supervisor.commands import CheckNow, Drain, Nudge, Restart, Resume
from appliance.supervisor.coordination import RestartCoordinator
from appliance.supervisor.engine_adapters import EngineAdapters
from appliance.supervisor.heat import HeatWatch
from appliance.supervisor.models_on_demand import ModelsOnDemand
from appliance.supervisor.notify import SystemdReporter, status_line
from appliance.supervisor.probe import HttpProbe
from appliance.supervisor.process import EngineProcess
from appliance.supervisor.reloading import audit_reload, reload_keys, reread_config
from appliance.supervisor.runner import EngineRunner
from appliance.supervisor.tasks import SupervisorTasks
from appliance.systemd import Notifier
from appliance.telemetry import GpuReading

log = logging.getLogger("appliance.supervisor")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TICK_S = 0.5


class Supervisor:
    """Owns the runners, the heat loop and the signals. Implements the gateway's side of
    the door (:class:`appliance.control.Appliance`) and the runners' host
    (:class:`appliance.supervisor.commands.RunnerHost`)."""

    def __init__(
        self,
        config: Config,
        *,
        config_arg: str | None = None,
        notifier: Notifier | None = None,
        env: Mapping[str, str] | None = None,
        home: Path | None = None,
        audit: AuditLog | None = None,
    ) -> None:
        self.config = config
        self._audit = audit or AuditLog(None)  # reloads are admin actions: audited
        self._config_arg = config_arg
        self._env = dict(os.environ if env is None else env)
        self._home = home or paths.appliance_home(self._env)
        self._reporter = SystemdReporter(notifier or Notifier.from_env())
        self._signals: asyncio.Queue[int] = asyncio.Queue()  # what the handlers record
        self._handlers: dict[int, Callable[[], None]] = {
            signal.SIGHUP: self.handle_hup,
            signal.SIGTERM: self.handle_term,
            signal.SIGINT: self.handle_int,
        }
        self._link: GatewayLink = NoGateway()
        self.plan: EnginePlan | None = None
        self._runners: list[EngineRunner] = []
        self._processes: list[EngineProcess] = []
        # Which appliance this is, in every engine's environment: see leftovers.py.
        self._instance = instance_id(config.gateway.keys_file)
        self._heat: HeatWatch | None = None
        self._models: ModelsOnDemand | None = None  # each model's load state
        # LoRA adapters: the config's and the admin's (kept beside the keys file).
        self._adapters = AdapterBook(
            lambda: self.config,
            adapters_path(config.gateway.keys_file),
            lambda name: self._link.adapter_requests(name),
        )
        self._sockets = SocketDir()
        self.coordinator = RestartCoordinator(lambda: ((r.id, r.state) for r in self._runners))
        self._tasks = SupervisorTasks()
        # Stopping: the stop task drains, then runners stop (second SIGINT: at once).
        self._stop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._fast_stop = False
        self._exit_code = EXIT_OK
        self.accepting = False  # the gateway refuses new requests while False
        self._started = False  # the start sweep is over (accepting may go False again)
        self.started_at = time.time()
        self.last_tick = time.monotonic()

    # ---- the gateway's view and commands (appliance.control.Appliance) ----------------
    def engines(self) -> tuple[EngineStatus, ...]:
        return tuple(r.status() for r in self._runners)

    def engine(self, engine_id: int) -> EngineStatus:
        return self._runners[engine_id].status()

    @property
    def ready(self) -> bool:
        return self.accepting and any(r.state is EngineState.READY for r in self._runners)

    def status(self) -> ApplianceStatus:
        plan = self.plan
        return ApplianceStatus(
            started_at=self.started_at,
            device=plan.device if plan else None,
            cpu_dtype=plan.cpu_dtype if plan else None,
            accepting=self.accepting,
            ready=self.ready,
            engines=self.engines(),
            gpus=self._heat.gpus() if self._heat else (),
            models=self.models(),
        )

    async def restart(self, engine_id: int) -> CommandResult:
        return await self._runners[engine_id].ask(Restart())

    async def drain(self, engine_id: int, *, force: bool = False) -> CommandResult:
        return await self._runners[engine_id].ask(Drain(force))

    async def resume(self, engine_id: int) -> CommandResult:
        return await self._runners[engine_id].ask(Resume())

    async def check_listener(self, engine_id: int) -> CommandResult:
        done: asyncio.Future[CommandResult] = asyncio.get_running_loop().create_future()
        taken = await self._runners[engine_id].ask(CheckNow(done))
        return await done if taken.ok else taken

    # ---- models on demand (appliance.control.ModelDoor) --------------------------------
    def want_model(self, name: str) -> bool:
        return self._models.want_model(name) if self._models else True

    def model_used(self, name: str) -> None:
        if self._models:
            self._models.model_used(name)

    def models(self) -> tuple[ModelStatus, ...]:
        return self._models.models() if self._models else ()

    async def load_model(self, name: str) -> ModelResult:
        assert self._models is not None
        return await self._models.load_model(name)

    async def unload_model(self, name: str) -> ModelResult:
        assert self._models is not None
        return await self._models.unload_model(name)

    def adapter_names(self) -> Mapping[str, str]:
        return self._adapters.names()

    def adapters(self) -> tuple[AdapterStatus, ...]:
        return self._adapters.adapters()

    async def add_adapter(self, model: str, name: str, path: str) -> AdapterResult:
        return await self._adapters.add(model, name, path)

    async def remove_adapter(self, model: str, name: str) -> AdapterResult:
        return await self._adapters.remove(model, name)

    # ---- the runners' host (commands.RunnerHost) --------------------------------------
    @property
    def link(self) -> GatewayLink:
        return self._link

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def starting(self) -> bool:  # the gateway's view (control.ApplianceView)
        return not self._started and self._stop_task is None and not self._stopping

    @property
    def fast_stop(self) -> bool:
        return self._fast_stop

    def gpu_reading(self, index: int) -> GpuReading | None:
        return self._heat.readings.get(index) if self._heat else None

    def state_changed(self, engine_id: int, state: EngineState) -> None:
        self.coordinator.state_changed(engine_id, state)
        if self._models is not None:  # its model follows at once (before waiters go)
            self._models.follow(self._runners[engine_id].spec.model)
        self._link.engines_changed()

    # ---- entry point ----------------------------------------------------------------
    async def run(self, start_http: StartHttp | None = None) -> int:
        """Run until stopped; the exit status. ``start_http`` starts the gateway once the
        engines are planned and returns its link (see appliance.serve)."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)
        proctree.become_subreaper()
        http: Listening | None = None
        try:
            heat = self._prepare()
            if start_http is not None:
                # First: a second `serve` of this appliance fails here on the gateway's
                # port, before the sweep could take a running supervisor's engines.
                http = await start_http()
                self._link = http.link
            await leftovers.sweep(
                self._processes, self._instance, heat.source, lambda: self._stopping
            )
            self.accepting = self._started = True
            telemetry = heat.run(self._runners, lambda: self._link, lambda: self._stopping)
            assert self._models is not None
            models = self._models.run(lambda: self._stopping or self._stop_task is not None)
            self._tasks.start(telemetry, self._runners, models)
            await self._main_loop()
        finally:
            for sig in SIGNALS:
                loop.remove_signal_handler(sig)
            await self._shutdown_tasks()
            if http is not None:
                await http.close()
            await stopping.release(self._runners, self._sockets, self._heat, self._reporter)
        return self._exit_code

    def _prepare(self) -> HeatWatch:
        """Telemetry, the plan, one runner per engine (each with its own client session)."""
        self._heat = HeatWatch(open_telemetry(self.config), lambda: self.config)
        gpus = gpu_count(self.config)
        self._sockets = SocketDir.make(self.config, self._env)
        kept = self._adapters.kept_ranks()
        self.plan = plan = make_plan(self.config, gpus, self._env, self._home, self._sockets, kept)
        me = psutil.Process()
        lineage = lineage_env(self._instance, me.pid, me.create_time())
        self._processes = [EngineProcess(spec, lineage) for spec in plan.specs]
        self._runners = [
            self._runner(spec, process)
            for spec, process in zip(plan.specs, self._processes, strict=True)
        ]
        self._adapters.attach(self._runners)
        self._models = ModelsOnDemand(
            lambda: self.config, self._runners, lambda: self._link, plan.device
        )
        log.info("plan: %d %s engine(s): %s", len(self._runners), plan.device, plan.summary())
        if plan.cpu_note:
            log.info("plan: %s", plan.cpu_note)
        for r in self._runners:
            r.open()
        return self._heat

    # ---- main loop and signals ------------------------------------------------------
    def _runner(self, spec: EngineSpec, process: EngineProcess) -> EngineRunner:
        # The probe reaches a TCP engine only on connections checked to be its tree's.
        probe = HttpProbe(spec, lambda: process.pid)
        lora = EngineAdapters(spec, lambda: self._adapters.wanted(spec.model), probe)
        return EngineRunner(spec, self, process, probe, sleeper=probe, lora=lora)

    async def _main_loop(self) -> None:
        tick_s = self._reporter.tick_interval(TICK_S)
        while True:
            try:
                sig = await asyncio.wait_for(self._signals.get(), tick_s)
            except TimeoutError:
                sig = None
            if sig is not None:
                self._handlers[sig]()
            now = time.monotonic()
            self.last_tick = now
            # An engine whose on-demand model is put away is down by design: it neither
            # holds back READY=1 nor counts as failed to start.
            states = [r.state for r in self._counted()]
            begun = self._stop_task is not None
            self._reporter.tick(now, states, self.accepting, self.status_line(), stopping=begun)
            # Belt and braces for admission: waiters normally get slots on release or
            # state change; a tick-driven kick bounds any missed wake-up to one tick.
            self._link.engines_changed()
            if self._stop_task is not None and self._stop_task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    self._stop_task.result()
                return
            if self._stop_task is None and stopping.none_started(states):
                self._exit_code = EXIT_NO_ENGINE
                self._begin_stop(fast=False)

    def handle_hup(self) -> None:
        log.info("SIGHUP: reloading")
        self.reload()

    def handle_term(self) -> None:
        if self._stop_task is None:
            self._stop_gracefully("SIGTERM")

    def handle_int(self) -> None:
        if self._stop_task is None:
            self._stop_gracefully("SIGINT")
        else:
            log.warning("second SIGINT: stopping at once")
            self._fast_stop = True
            self._stop_runners()

    def _stop_gracefully(self, name: str) -> None:
        drain_s = self.config.restart.drain_timeout_s
        log.info("%s: stopping gracefully (drain up to %.0f s)", name, drain_s)
        self._begin_stop(fast=False)

    # ---- stop -----------------------------------------------------------------------
    def _begin_stop(self, fast: bool) -> None:
        self._fast_stop = fast
        self.accepting = False
        self._reporter.stopping(time.monotonic())
        self._link.shutdown_begun()
        self._stop_task = asyncio.create_task(self._stop(), name="stop")

    def _stop_runners(self) -> None:
        self._stopping = True
        for r in self._runners:
            r.tell(Nudge())  # each sees the stop at its next nap

    async def _stop(self) -> None:
        """Let in-flight work finish (up to restart.drain_timeout_s), then stop engines."""
        drain_s = self.config.restart.drain_timeout_s
        await stopping.drain(self._link, self._runners, drain_s, lambda: self._fast_stop)
        self._stop_runners()
        await self._tasks.runners_done()

    async def _shutdown_tasks(self) -> None:
        self._stop_runners()
        kill_timeout_s = 0.5 if self._fast_stop else 5.0
        await self._tasks.shut_down(self._runners, self.config, kill_timeout_s)

    # ---- reload and the status line -------------------------------------------------
    def reload(self) -> None:
        self._reporter.notifier.reloading()
        done = reread_config(self.config, self._config_arg, self._env)
        self.config = done.config
        if done.applied:
            for r in self._runners:
                r.tell(Nudge())  # runners re-read their timers now
            if self._heat is not None:
                self._heat.nudge()  # and the telemetry loop its interval
        reload_keys(self._link, done)
        audit_reload(self._audit, done)
        self._reporter.reloaded()

    def _counted(self) -> list[EngineRunner]:
        """The runners whose engines should run now: an on-demand model's engines are
        down by design while it is put away (not "not ready", not "failed to start")."""
        models = self._models
        return [r for r in self._runners if models is None or models.counts(r.spec)]

    def status_line(self) -> str:
        return status_line(
            [(r.spec.name, r.state, r.spec.model) for r in self._counted()],
            self._heat.readings if self._heat else {},
            stopping.in_flight(self._link, self._runners),
            self._stopping or self._stop_task is not None,
        )
