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
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from appliance.engine import EngineState
from appliance.gateway.models import candidates
from appliance.policy.thermal import HARD_LEVEL

if TYPE_CHECKING:
    from appliance.gateway.app import Gateway

LOOP_STALL_S = 10.0  # a main loop that has not ticked for this long is not "alive"
# What clients and /readyz are told while the keys file cannot be used; the journal (and
# check-config, doctor) name the file and the problem.
KEYS_UNUSABLE = (
    "the server's keys file cannot be used, so no API key can be checked until the "
    "admin fixes it (the server's journal says what is wrong)"
)


class Probes:
    """The probe routes over one gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/health", self.readyz)  # what routers in front of vLLM probe
        r.add_get("/metrics", self.metrics)

    async def healthz(self, request: web.Request) -> web.Response:
        appliance = self.gw.appliance
        if time.monotonic() - appliance.last_tick > LOOP_STALL_S:
            return web.json_response({"status": "stalled"}, status=503)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """200 only while some engine can take a new request now and keys can be checked;
        else 503 and why not. Either way the body says which models are ready or down."""
        gw = self.gw
        accepting = gw.appliance.accepting
        keys_problem = gw.keys.problem
        ready = [s.id for s in gw.appliance.engines() if s.state.accepts_work]
        loads = gw.admission.loads()
        admitting = [load.id for load in loads if load.accepting]
        models = models_ready(gw, set(admitting))
        # State files failing to be written (a full disk): which, why, since when, no path
        # (this route has no key); `doctor` reads it. Serving goes on: it is no 503.
        writes = [f for w in gw.state_files() if (f := w.as_json()) is not None]
        if accepting and admitting and keys_problem is None:
            return web.json_response(
                {
                    "status": "ready",
                    "engines_ready": ready,
                    "engines_admitting": admitting,
                    "models": models,
                    "state_write_failures": writes,
                }
            )
        body: dict[str, Any] = {"status": "stopping"}
        if accepting:
            body["status"] = "keys file unusable" if keys_problem is not None else "not admitting"
            if keys_problem is not None:
                body["keys"] = KEYS_UNUSABLE
            body["reasons"] = {str(e): why for e, why in not_admitting(gw).items()}
        body |= {"engines_ready": ready, "engines_admitting": admitting, "models": models}
        body["state_write_failures"] = writes
        return web.json_response(body, status=503, headers={"Retry-After": "5"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.gw.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def models_ready(gw: Gateway, admitting: set[int]) -> dict[str, str]:
    """Each served model: "ready" while one of its engines admits new work, else "down";
    an on-demand model put away says so ("unloaded", "sleeping", "loading"): it is not
    down, its next request loads it."""
    engines = gw.appliance.engines()
    away = {m.name: m.state for m in gw.model_door.models() if m.load == "on_demand"}
    return {
        m.name: (
            "ready"
            if any(e.id in admitting for e in candidates(m.name, engines))
            else _put_away(away.get(m.name))
        )
        for m in gw.appliance.config.served
    }


def _put_away(state: str | None) -> str:
    """A model not admitting: "down", unless it is an on-demand one put away (a loaded
    one that admits nothing is down like any other)."""
    return "down" if state in (None, "loaded") else str(state)


def not_admitting(gw: Gateway) -> dict[int, str]:
    """Why each engine takes no new request now, in words an operator can act on."""
    out: dict[int, str] = {}
    for snap in gw.appliance.engines():
        if snap.state is not EngineState.READY:
            out[snap.id] = {
                "STARTING": "starting (loading the model)",
                "SUSPECT": "failed its last health check",
                "DRAINING": "draining",
            }.get(snap.state.value, snap.state.value.lower())
        elif gw.admission.kv_tripped.get(snap.id, False):
            out[snap.id] = "KV cache breaker open (KV cache nearly full)"
        elif gw.admission.throttle_level.get(snap.id, 0) >= HARD_LEVEL:
            out[snap.id] = "throttled by heat (GPU at the hard limit)"
    return out
