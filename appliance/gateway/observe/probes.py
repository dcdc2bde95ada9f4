"""What monitoring asks the gateway: ``/healthz``, ``/readyz``, ``/health`` and ``/metrics``.

``/healthz`` says whether the appliance's main loop still ticks; ``/readyz`` whether a
new request can be served now (and, if not, why, per engine); ``/health`` is the same
answer as ``/readyz`` under the path load balancers in front of vLLM probe: vllm-router
waits for ``GET /health`` to say 200 before it starts, whatever its
``--health-check-endpoint`` (measured, docs/several-boxes.md), and vLLM's own /health
means "this server can serve", so a box that drains, is too hot or is starting must
say 503 there too. ``/metrics`` is the gateway's Prometheus registry. Access (open
routes, or the ``metrics`` scope) is the middleware's business (app.py), not these
handlers'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from appliance.control import ApplianceView, ModelDoor
from appliance.engine import EngineState
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.models import candidates
from appliance.gateway.keys import KeyStore
from appliance.policy.thermal import HARD_LEVEL
from appliance.state_writes import WriteHealth

StateFiles = Callable[[], tuple[WriteHealth, ...]]  # how each state file's writes go

LOOP_STALL_S = 10.0  # a main loop that has not ticked for this long is not "alive"
# What clients and /readyz are told while the keys file cannot be used; the journal (and
# check-config, doctor) name the file and the problem.
KEYS_UNUSABLE = (
    "the server's keys file cannot be used, so no API key can be checked until the "
    "admin fixes it (the server's journal says what is wrong)"
)


class Probes:
    """The probe routes: the main loop's tick, the readiness verdict, the registry."""

    def __init__(
        self, appliance: ApplianceView, readiness: Readiness, registry: CollectorRegistry
    ) -> None:
        self._appliance = appliance
        self._readiness = readiness
        self._registry = registry

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/health", self.readyz)  # what routers in front of vLLM probe
        r.add_get("/metrics", self.metrics)

    async def healthz(self, request: web.Request) -> web.Response:
        if time.monotonic() - self._appliance.last_tick > LOOP_STALL_S:
            return web.json_response({"status": "stalled"}, status=503)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """200 while a new request can be served, else 503 and why not
        (:class:`Readiness`, which ``/admin/status`` and ``llm-appliance status`` carry too)."""
        code, body = self._readiness.verdict()
        headers = {"Retry-After": "5"} if code != 200 else None
        return web.json_response(body, status=code, headers=headers)

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class Readiness:
    """The one verdict on whether the box can serve, from the parts that decide it."""

    def __init__(
        self,
        appliance: ApplianceView,
        keys: KeyStore,
        admission: Admission,
        model_door: ModelDoor,
        state_files: StateFiles,
    ) -> None:
        self._appliance = appliance
        self._keys = keys
        self._admission = admission
        self._model_door = model_door
        self._state_files = state_files

    def verdict(self) -> tuple[int, dict[str, Any]]:
        """The one verdict on whether the box can serve: (200 or 503, /readyz's body).

        200 while keys can be checked and a new request can be served: some engine admits it
        now, or (nothing admitting) every model is an on-demand one put away that its next
        request loads; else 503 and why not. Either way the body says which models are
        ready, down or put away. ``/admin/status`` carries the same verdict (``ready`` and
        ``readiness``), so `llm-appliance status` never says ready where /readyz says 503,
        nor DOWN for a model put away."""
        accepting = self._appliance.accepting
        keys_problem = self._keys.problem
        ready = [s.id for s in self._appliance.engines() if s.state.accepts_work]
        loads = self._admission.loads()
        admitting = [load.id for load in loads if load.accepting]
        models = self.models_ready(set(admitting))
        # State files failing to be written (a full disk): which, why, since when, no path
        # (this route has no key); `doctor` reads it. Serving goes on: it is no 503.
        writes = [f for w in self._state_files() if (f := w.as_json()) is not None]
        if accepting and keys_problem is None and (admitting or loadable(models)):
            return 200, {
                "status": "ready",
                "engines_ready": ready,
                "engines_admitting": admitting,
                "models": models,
                "state_write_failures": writes,
            }
        body: dict[str, Any] = {"status": "starting" if self._appliance.starting else "stopping"}
        if accepting:
            body["status"] = "keys file unusable" if keys_problem is not None else "not admitting"
            if keys_problem is not None:
                body["keys"] = KEYS_UNUSABLE
            body["reasons"] = {str(e): why for e, why in self.not_admitting().items()}
        body |= {"engines_ready": ready, "engines_admitting": admitting, "models": models}
        body["state_write_failures"] = writes
        return 503, body

    def models_ready(self, admitting: set[int]) -> dict[str, str]:
        """Each served model's word for /readyz (:func:`model_word`)."""
        engines = self._appliance.engines()
        door = {m.name: m for m in self._model_door.models() if m.load == "on_demand"}
        out: dict[str, str] = {}
        for m in self._appliance.config.served:
            mine = candidates(m.name, engines)
            od = door.get(m.name)
            out[m.name] = model_word(
                any(e.id in admitting for e in mine),
                [e.state for e in mine],
                None if od is None else (od.detail or od.state),
            )
        return out

    def not_admitting(self) -> dict[int, str]:
        """Why each engine takes no new request now, in words an operator can act on."""
        out: dict[int, str] = {}
        for snap in self._appliance.engines():
            if snap.state is not EngineState.READY:
                out[snap.id] = {
                    "STARTING": "starting (loading the model)",
                    "SUSPECT": "failed its last health check",
                    "DRAINING": "draining",
                }.get(snap.state.value, snap.state.value.lower())
            elif self._admission.kv_open(snap.id):
                out[snap.id] = "KV cache breaker open (KV cache nearly full)"
            elif self._admission.throttle(snap.id) >= HARD_LEVEL:
                out[snap.id] = "throttled by heat (GPU at the hard limit)"
        return out


PUT_AWAY = frozenset({"unloaded", "sleeping", "loading", "unloading"})


def model_word(admits: bool, engines: Sequence[EngineState], on_demand: str | None) -> str:
    """ "ready" while one of its engines admits new work, else "down"; but an on-demand
    model put away (``on_demand``: its lifecycle's name, None for an ``always`` model)
    is not down, its next request loads it: "unloaded", "sleeping", "loading", or
    "unloading" while a swap or an unload drains it. An on-demand model that is loaded
    yet admits nothing is down like any other, and so is one whose every engine is
    FAILED (a request cannot load it: the restart budget is spent)."""
    if admits:
        return "ready"
    if engines and all(s is EngineState.FAILED for s in engines):
        return "down"
    word = "unloading" if on_demand == "draining" else on_demand
    return word if word in PUT_AWAY else "down"


def loadable(models: Mapping[str, str]) -> bool:
    """Nothing admits, yet the box can serve: every model is put away (none down), so
    a request loads the one it names. A box of on-demand models only, none loaded yet,
    is ready; one whose always model is down is not, whatever else is put away."""
    return bool(models) and all(word in PUT_AWAY for word in models.values())
