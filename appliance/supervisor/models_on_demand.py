"""Models on demand: the one owner of each model's load state (issue 23).

::

    gateway: want_model / model_used / load_model / unload_model ──► ModelsOnDemand (this task)
        every TICK_S, or at once when asked:  runners' states ─► model states
                                              policy.swap.decide(slot) ─► actions
        load:   Unpark ──► each engine's runner starts (or wakes) it
        drain:  Park   ──► each runner drains it, then stops it (or puts it to sleep)

A model's state (:class:`appliance.policy.swap.ModelState`, with its transition table)
is moved here only, from this task or the gateway's calls on the same loop; engines'
states stay their runners' (only a runner moves an engine). An ``always`` model is
loaded from the start and never parked; its last use is kept for the status all the
same. Every swap is said in the journal with its reason.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from appliance.config import Config, ServedModel
from appliance.control import LOAD_BUCKETS, GatewayLink, ModelResult, ModelStatus
from appliance.engine import EngineSpec, EngineState, trusts_remote_code
from appliance.policy.swap import Action, ModelSnap, ModelState, check_transition, decide, slots
from appliance.supervisor.commands import Park, Unpark
from appliance.supervisor.runner import EngineRunner

log = logging.getLogger("appliance.supervisor")

TICK_S = 0.25  # how soon a finished drain or a started engine moves its model on
UP = frozenset({EngineState.READY, EngineState.SUSPECT})
GONE = frozenset({EngineState.EXITED, EngineState.FAILED, EngineState.SLEEPING})


@dataclass
class _Model:
    served: ServedModel
    runners: list[EngineRunner]
    state: ModelState
    last_used: float  # monotonic
    used_wall: float | None = None  # time.time() of its last request
    waiting_since: float | None = None
    loaded_at: float | None = None
    left_at: float | None = None  # last chosen to leave its slot (policy.swap.turn_since)
    load_began: float | None = None
    how: str = "cold"
    sleep_asked: bool = False
    loads: dict[str, int] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    seconds: float = 0.0
    trusts_code: bool = False  # its engines run the repository's own code (fixed specs)


class ModelsOnDemand:
    def __init__(
        self,
        config: Callable[[], Config],
        runners: Sequence[EngineRunner],
        link: Callable[[], GatewayLink],
        device: str,
    ) -> None:
        self._config = config
        self._link = link
        now = time.monotonic()
        self._models: dict[str, _Model] = {}
        for m in config().served:
            mine = [r for r in runners if r.spec.model == m.name]
            state = ModelState.UNLOADED if m.on_demand else ModelState.LOADED
            trusts = any(trusts_remote_code(r.spec.argv) for r in mine)
            self._models[m.name] = _Model(m, mine, state, now, loaded_at=now, trusts_code=trusts)
        self._slots = slots(config().served, device)
        self._asked = asyncio.Event()

    # ---- the gateway's door (appliance.control.ModelDoor) -------------------------------
    def want_model(self, name: str) -> bool:
        """Called by the gateway for a request that passed every check. The model is
        wanted while such a request waits in the gateway's queue for it
        (:meth:`_wanted_since`), not from here: a request that leaves (its client gone,
        its wait over) stops wanting it, and one refused never wanted it. This only wakes
        the task, which finds the request queued by then (the gateway queues it without
        yielding in between; else the next tick does)."""
        m = self._models.get(name)
        if m is None or m.state is ModelState.LOADED:
            return True
        if not self._failed(m):  # FAILED: nothing to load until an admin restarts one
            self._asked.set()
        return False

    def model_used(self, name: str) -> None:
        """A request was admitted to one of the model's engines: its use, from which its
        idle unload and the swap's least recently used count. Not at its arrival: a
        request refused after it (every engine drained or FAILED, the box too hot, the
        queue full or its wait over) did not use the model, and a flood of refusals kept
        an idle model from being put away (issue 33's review)."""
        m = self._models.get(name)
        if m is not None:
            m.last_used, m.used_wall = time.monotonic(), time.time()

    def models(self) -> tuple[ModelStatus, ...]:
        return tuple(self._status(m) for m in self._models.values())

    async def load_model(self, name: str) -> ModelResult:
        m = self._models.get(name)
        if m is None or not m.served.on_demand:
            return self._refused(
                m, name, 'is always loaded (load = "always"); only on-demand models load'
            )
        if m.state is not ModelState.LOADED and m.waiting_since is None:
            m.waiting_since = time.monotonic()
            self._asked.set()
        return ModelResult(True, self._status(m).state, "")

    async def unload_model(self, name: str) -> ModelResult:
        m = self._models.get(name)
        if m is None or not m.served.on_demand:
            return self._refused(
                m, name, 'is always loaded (load = "always"); only on-demand models unload'
            )
        m.waiting_since = None
        if m.state in (ModelState.LOADED, ModelState.LOADING):
            self._put_away(m, "asked by an admin")
        elif m.state is ModelState.SLEEPING:
            self._unload_asleep(m, "asked by an admin")
        return ModelResult(True, self._status(m).state, "")

    def counts(self, spec: EngineSpec) -> bool:
        """Whether an engine counts for systemd's readiness and the all-FAILED exit: an
        always model's does; an on-demand model's only while the model is (being) loaded."""
        m = self._models.get(spec.model)
        if not spec.on_demand or m is None:
            return True
        return m.state in (ModelState.LOADING, ModelState.LOADED, ModelState.DRAINING)

    def _refused(self, m: _Model | None, name: str, why: str) -> ModelResult:
        if m is None:
            return ModelResult(False, "", f"no model is called '{name}'")
        return ModelResult(False, self._status(m).state, f"the model '{name}' {why}")

    def _status(self, m: _Model) -> ModelStatus:
        s = m.state
        return ModelStatus(
            name=m.served.name,
            load=m.served.load,
            state=s.shown,
            last_used=m.used_wall,
            detail=s.value if s.shown != s.value else "",
            loads=dict(m.loads),
            load_buckets=tuple(m.buckets),
            load_seconds_sum=m.seconds,
            trust_remote_code=m.trusts_code,
        )

    # ---- the task -------------------------------------------------------------------
    async def run(self, stopping: Callable[[], bool]) -> None:
        """Until the daemon stops: follow the engines, apply the policy."""
        if not self._slots:
            return  # no on-demand model: nothing to do, ever
        while not stopping():
            self.step(time.monotonic())
            self._asked.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._asked.wait(), TICK_S)

    def step(self, now: float) -> None:
        for m in self._models.values():
            if m.served.on_demand:
                self._follow(m, now)
        for slot in self._slots:
            snaps = [self._snap(self._models[n]) for n in slot]
            for action in decide(snaps, now):
                self._act(action, now)

    def follow(self, name: str) -> None:
        """An engine of ``name`` changed state: its model follows now (the runner's call,
        on this loop), so a model is LOADED before the waiters its engine admits run."""
        m = self._models.get(name)
        if m is not None and m.served.on_demand:
            self._follow(m, time.monotonic())
            self._asked.set()

    def _snap(self, m: _Model) -> ModelSnap:
        link = self._link()
        s = m.served
        return ModelSnap(
            name=s.name,
            state=m.state,
            inflight=sum(link.inflight(r.id) for r in m.runners),
            waiting_since=self._wanted_since(m, link),
            last_used=m.last_used,
            loaded_at=m.loaded_at,
            idle_unload_s=s.idle_unload_s,
            min_residency_s=s.min_residency_s,
            left_at=m.left_at,
        )

    def _wanted_since(self, m: _Model, link: GatewayLink) -> float | None:
        """Since when somebody wants ``m``: a request that found it not loaded (or an
        admin), or any request waiting in the gateway's queue for it, loaded or not
        when it came: a model put away while its requests wait (a swap) is wanted back
        for them. A model whose every engine is FAILED is wanted by an admin's load only:
        requests for it are refused at once (no_engine) until an admin restarts one."""
        queued = link.queued_since(m.served.name)
        if queued is None or self._failed(m):
            return m.waiting_since
        return queued if m.waiting_since is None else min(queued, m.waiting_since)

    def _follow(self, m: _Model, now: float) -> None:
        """Move the model on from what its engines' runners say."""
        states = [r.state for r in m.runners]
        if m.state is ModelState.LOADING and any(s in UP for s in states):
            self._loaded(m, now)
        elif (
            m.state is ModelState.LOADING
            and states
            and all(s is EngineState.FAILED for s in states)
        ):
            log.error("model %s: could not be loaded (every engine FAILED)", m.served.name)
            self._move(m, ModelState.UNLOADED)
            m.waiting_since = None
            for r in m.runners:  # an admin's restart leaves them down until the next load
                r.tell(Park(sleep=False))
        elif m.state is ModelState.DRAINING and not any(s in UP for s in states):
            self._move(m, ModelState.UNLOADING)  # drained: its engines are going down
        # Unloading from sleep: its engines are still SLEEPING until their runners stop
        # them, which is not gone yet.
        stopping_asleep = not m.sleep_asked and EngineState.SLEEPING in states
        if m.state is ModelState.UNLOADING and self._gone(m) and not stopping_asleep:
            asleep = m.sleep_asked and all(s is EngineState.SLEEPING for s in states)
            self._move(m, ModelState.SLEEPING if asleep else ModelState.UNLOADED)
            log.info("model %s: %s", m.served.name, "asleep" if asleep else "unloaded")

    @staticmethod
    def _failed(m: _Model) -> bool:
        return bool(m.runners) and all(r.state is EngineState.FAILED for r in m.runners)

    @staticmethod
    def _gone(m: _Model) -> bool:
        """Its engines are down (or asleep) and their GPUs seen free: the next model of
        the slot may start. A stopped engine's memory can outlive it for seconds (vLLM's
        EngineCore after its API server, vllm#55510); a model started meanwhile could not
        allocate its KV cache. The runner waits for it (bounded) and says so."""
        return all(r.state in GONE and not r.releasing for r in m.runners)

    def _loaded(self, m: _Model, now: float) -> None:
        took = now - (m.load_began or now)
        self._move(m, ModelState.LOADED)
        # Its load counts as a use (ModelSnap.last_used): the request that asked for it is
        # admitted only now (model_used), and one that left meanwhile must not leave a
        # model "idle" since its previous use, put away as soon as it is up.
        m.loaded_at, m.waiting_since, m.last_used = now, None, now
        m.loads[m.how] = m.loads.get(m.how, 0) + 1
        m.buckets[bisect.bisect_left(LOAD_BUCKETS, took)] += 1
        m.seconds += took
        log.info("model %s: loaded (%s) in %.1f s", m.served.name, m.how, took)
        self._link().engines_changed()  # its waiters may go now

    def _act(self, action: Action, now: float) -> None:
        m = self._models[action.model]
        if action.kind == "load":
            m.how = "wake" if m.state is ModelState.SLEEPING else "cold"
            m.load_began = now
            self._move(m, ModelState.LOADING)
            log.info("model %s: loading (%s; %s)", m.served.name, m.how, action.why)
            for r in m.runners:
                r.tell(Unpark())
        elif m.state is ModelState.SLEEPING:
            self._unload_asleep(m, action.why)
        elif action.kind == "drain" or m.state is ModelState.LOADED:
            self._put_away(m, action.why)
        elif m.state is ModelState.DRAINING:
            self._move(m, ModelState.UNLOADING)

    def _unload_asleep(self, m: _Model, why: str) -> None:
        """A sleeping model's engines are stopped: its weights leave host RAM."""
        m.sleep_asked = False
        log.info("model %s: unloading from sleep: %s", m.served.name, why)
        self._move(m, ModelState.UNLOADING)
        for r in m.runners:
            r.tell(Park(sleep=False))

    def _put_away(self, m: _Model, why: str) -> None:
        m.sleep_asked, m.left_at = m.served.swap == "sleep", time.monotonic()
        how = "put to sleep" if m.sleep_asked else "stopped"
        log.info("model %s: draining, then %s: %s", m.served.name, how, why)
        self._move(m, ModelState.DRAINING if m.state is ModelState.LOADED else ModelState.UNLOADING)
        for r in m.runners:
            r.tell(Park(sleep=m.sleep_asked))

    def _move(self, m: _Model, new: ModelState) -> None:
        check_transition(m.state, new)
        m.state = new
