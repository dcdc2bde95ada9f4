"""The gateway's aiohttp application: built by a factory, no module-level singletons.

The supervisor owns engines; the gateway reads its snapshots and tells it, through a
small link (:class:`Gateway` implements the supervisor's ``GatewayLink``), how much work
sits on each engine. One middleware does, for every request: authentication and scope,
turning every refusal into an OpenAI-shaped error, and the request metrics.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from appliance import __version__
from appliance.endpoint import EngineAddress
from appliance.engine import EngineState, RestartReason
from appliance.errors import ApplianceError
from appliance.gateway.admission import Admission
from appliance.gateway.errors import GatewayError, error_response
from appliance.gateway.keys import (
    KeysFileError,
    KeySpecError,
    KeyStore,
    KeyWatcher,
    ensure_admin_key,
    required_scope,
    validate_key_id,
)
from appliance.gateway.metrics import GatewayMetrics
from appliance.gateway.proxy import Relay
from appliance.gateway.ratelimit import RateLimiter
from appliance.gateway.server import BodyTimeout, ConnectionLimits, GatewayRunner, ensure_fd_room
from appliance.gateway.splice import UpstreamPool
from appliance.policy.thermal import HARD_LEVEL

if TYPE_CHECKING:
    from appliance.supervisor import Supervisor

log = logging.getLogger("appliance.gateway")

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway")
LOOP_STALL_S = 10.0  # a main loop that has not ticked for this long is not "alive"
BEARER = "bearer "


class ListenError(ApplianceError):
    exit_code = 1


class Gateway:
    """Everything the HTTP side holds: keys, limits, admission, metrics, one client session."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        cfg = supervisor.config.gateway
        self.keys = KeyStore(Path(cfg.keys_file))
        self.watcher = KeyWatcher(self.keys, logger=log)
        self.metrics = GatewayMetrics()
        self.ratelimiter = RateLimiter()
        self.admission = Admission(
            lambda: supervisor.config,
            supervisor.snapshots,
            lambda: supervisor.accepting,
            on_reject=lambda reason: self.metrics.rejections.labels(reason).inc(),
        )
        self.metrics.attach(supervisor, self.admission)
        # Non-streamed requests' engine connections: one client session per engine address
        # (a Unix socket needs a connector of its own), made on first use.
        self._sessions: dict[EngineAddress, aiohttp.ClientSession] = {}
        self.upstreams = UpstreamPool()  # streamed requests' engine connections
        self.relay = Relay(self)
        self._models: tuple[str, ...] = ()

    # ---- GatewayLink (called by the supervisor) ----------------------------------------
    def inflight(self, engine_id: int) -> int:
        return self.admission.inflight(engine_id)

    def observe_kv(self, engine_id: int, usage: float | None) -> None:
        self.admission.observe_kv(engine_id, usage)

    def kv_tripped(self, engine_id: int) -> bool:
        return self.admission.kv_tripped.get(engine_id, False)

    def set_throttle(self, engine_id: int, level: int) -> None:
        if self.admission.throttle_level.get(engine_id, 0) != level:
            self.admission.throttle_level[engine_id] = level
            self.admission.kick()

    def engines_changed(self) -> None:
        self.admission.kick()

    def abandon(self, engine_id: int, why: str) -> int:
        return self.relay.abandon(engine_id, why)

    def stopping(self) -> None:
        self.admission.fail_waiters("shutting_down", "the server is shutting down")

    def reload(self) -> None:
        self.watcher.reload_now()
        self.ratelimiter.forget({r.id for r in self.keys.records})

    # ---- helpers for handlers ------------------------------------------------------------
    def model_names(self) -> tuple[str, ...]:
        if not self._models:
            self._models = tuple(
                sorted({rt.spec.served_model_name for rt in self.supervisor.engines})
            )
        return self._models

    def has_other_engine(self, exclude: frozenset[int]) -> bool:
        return any(
            rt.state is EngineState.READY and rt.spec.id not in exclude
            for rt in self.supervisor.engines
        )

    def session_for(self, address: EngineAddress) -> aiohttp.ClientSession:
        session = self._sessions.get(address)
        if session is None:
            # Many concurrent requests: aiohttp's default of 100 connections would queue
            # them. Idle connections are dropped after 2 s, before vLLM's own 5 s close can
            # race a request sent on one (aiohttp does not retry a POST; splice.MAX_IDLE_S
            # likewise).
            session = aiohttp.ClientSession(
                connector=address.connector(limit=0, force_close=False, keepalive_timeout=2.0),
                trust_env=False,
                auto_decompress=False,
            )
            self._sessions[address] = session
        return session

    async def on_startup(self, app: web.Application) -> None:
        self.watcher.start()

    async def on_cleanup(self, app: web.Application) -> None:
        await self.watcher.stop()
        self.upstreams.close()
        for session in self._sessions.values():
            await session.close()


def _route_label(request: web.Request) -> str:
    """The route's pattern (bounded label values), or "unmatched" for unknown paths."""
    info = request.match_info
    resource = info.route.resource
    if info.http_exception is not None or resource is None:
        return "unmatched"
    return resource.canonical


def _authenticate(gw: Gateway, request: web.Request, scope: str) -> None:
    header = request.headers.get("Authorization", "")
    if not header[: len(BEARER)].lower() == BEARER:
        raise GatewayError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="missing_api_key",
            reason="auth",
        )
    record, reason = gw.keys.lookup(header[len(BEARER) :].strip())
    if record is None:
        message = "this API key has expired" if reason == "expired" else "invalid API key"
        raise GatewayError(401, message, code="invalid_api_key", reason="auth")
    if not record.allows(scope):
        raise GatewayError(
            403,
            f"this key lacks the '{scope}' scope needed for {request.path}",
            code="insufficient_scope",
            reason="scope",
        )
    request["key"] = record


@web.middleware
async def gateway_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    started = time.monotonic()
    route = _route_label(request)
    status = 500
    try:
        scope = required_scope(request.path)
        if scope is not None and not (
            scope == "metrics" and gw.supervisor.config.gateway.metrics_public
        ):
            _authenticate(gw, request, scope)
        resp: web.StreamResponse = await handler(request)
        status = request.get("status", resp.status)
        return resp
    except GatewayError as exc:
        status = exc.status
        return exc.response()
    except BodyTimeout as exc:  # the connection's body timer (gateway.server) ran out
        status = 408
        return exc.response()
    except web.HTTPException as exc:
        status = exc.status
        if exc.status == 413:
            limit = gw.supervisor.config.gateway.max_body_bytes
            return error_response(
                413, f"the request body is larger than {limit} bytes", code="request_too_large"
            )
        if exc.status == 404:
            return error_response(
                404, f"no such route: {request.method} {request.path}", code="unknown_route"
            )
        if exc.status == 405:
            return error_response(
                405,
                f"{request.method} is not allowed on {request.path}",
                code="method_not_allowed",
                headers={"Allow": exc.headers.get("Allow", "")},
            )
        return error_response(exc.status, exc.reason or "request refused")
    except asyncio.CancelledError:
        status = 499  # the client went away; the upstream request was closed with it
        raise
    except ConnectionError:
        status = 499
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        status = 500
        return error_response(
            500, "internal error in the gateway; see its log", code="internal_error"
        )
    finally:
        gw.metrics.requests.labels(route, str(status)).inc()
        gw.metrics.duration.labels(route).observe(time.monotonic() - started)


# ---- handlers ------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    sup = request.app[GATEWAY].supervisor
    if time.monotonic() - sup.last_tick > LOOP_STALL_S:
        return web.json_response({"status": "stalled"}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 only while some engine can take a new request now; else 503 and why not."""
    gw = request.app[GATEWAY]
    sup = gw.supervisor
    ready = [s.id for s in sup.snapshots() if s.state.accepts_work]
    admitting = [load.id for load in gw.admission.loads() if load.accepting]
    if sup.accepting and admitting:
        return web.json_response(
            {"status": "ready", "engines_ready": ready, "engines_admitting": admitting}
        )
    body: dict[str, Any] = {"status": "stopping" if not sup.accepting else "not admitting"}
    if sup.accepting:
        body["reasons"] = {str(e): why for e, why in not_admitting(gw).items()}
    body |= {"engines_ready": ready, "engines_admitting": admitting}
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


def not_admitting(gw: Gateway) -> dict[int, str]:
    """Why each engine takes no new request now, in words an operator can act on."""
    out: dict[int, str] = {}
    for snap in gw.supervisor.snapshots():
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


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    body = generate_latest(gw.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def status_document(gw: Gateway) -> dict[str, Any]:
    sup = gw.supervisor
    engines = []
    for rt in sup.engines:
        snap = rt.snapshot()
        key = snap.gpu if snap.gpu is not None else snap.id
        reading = sup.gpu_readings.get(key)
        obs = rt.last_observation
        engines.append(
            {
                "id": snap.id,
                "gpu": snap.gpu,
                "port": snap.port,  # null with engine.listen = "unix"
                "listen": str(snap.address),
                "state": snap.state.value,
                "pid": snap.pid,
                "inflight": gw.admission.inflight(snap.id),
                "inflight_tokens": gw.admission.inflight_tokens(snap.id),
                "restarts": snap.restarts,
                "restarts_by_reason": dict(rt.restarts_by_reason),
                "last_restart_reason": snap.last_restart_reason,
                "throttle_level": gw.admission.throttle_level.get(snap.id, 0),
                "temperature_c": reading.temperature_c if reading else None,
                "kv_cache_usage": obs.kv_cache_usage if obs else None,
                "kv_breaker_open": gw.admission.kv_tripped.get(snap.id, False),
                "requests_running": obs.running if obs else None,
                "model": snap.served_model_name,
            }
        )
    gpus = [
        {
            "index": r.index,
            "name": r.name,
            "temperature_c": r.temperature_c,
            "power_w": r.power_w,
            "power_limit_w": r.power_limit_w,
            "memory_used_bytes": r.memory_used_bytes,
            "memory_total_bytes": r.memory_total_bytes,
            "utilization": r.utilization,
            "sm_clock_mhz": r.sm_clock_mhz,
            "throttle_reasons": list(r.throttle_reasons),
            "throttle_level": sup.throttle_levels().get(r.index, 0),
        }
        for _, r in sorted(sup.gpu_readings.items())
    ]
    return {
        "version": __version__,
        "device": sup.plan.device if sup.plan else None,
        "uptime_s": round(time.time() - sup.started_at, 1),
        "accepting": sup.accepting,
        "ready": sup.ready,
        "queue_depth": gw.admission.queue_depth,
        "engines": engines,
        "gpus": gpus,
    }


async def admin_status(request: web.Request) -> web.Response:
    return web.json_response(status_document(request.app[GATEWAY]))


_ENGINE_ID_RE = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() takes "²" and "١"


def _engine_id(request: web.Request) -> int:
    """The engine a /admin/engines/{id}/... path names: 400 naming ``id`` unless it is a
    whole number in ASCII digits, 404 when no engine has it."""
    gw = request.app[GATEWAY]
    raw = request.match_info["id"]
    shown = raw if len(raw) <= 20 else raw[:17] + "..."
    if not _ENGINE_ID_RE.fullmatch(raw):
        raise GatewayError(
            400, f"id: engine ids are whole numbers in ASCII digits, got {shown!r}", param="id"
        )
    # int() refuses strings of over 4300 digits; no engine has an id that long anyway.
    if len(raw) > 9 or int(raw) >= len(gw.supervisor.engines):
        raise GatewayError(404, f"no engine {shown}", code="unknown_engine")
    return int(raw)


async def admin_restart(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    eid = _engine_id(request)
    if not gw.supervisor.request_restart(eid, RestartReason.ADMIN):
        raise GatewayError(
            409,
            f"engine {eid} is {gw.supervisor.engines[eid].state.value} and cannot be restarted now",
            code="engine_busy",
        )
    return web.json_response({"id": eid, "action": "restart", "accepted": True}, status=202)


async def admin_drain(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    eid = _engine_id(request)
    ok, why = gw.supervisor.drain(eid, force=request.query.get("force") == "true")
    if not ok:
        raise GatewayError(409, why, code="cannot_drain")
    return web.json_response({"id": eid, "state": gw.supervisor.engines[eid].state.value})


async def admin_resume(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    eid = _engine_id(request)
    ok, why = gw.supervisor.resume(eid)
    if not ok:
        raise GatewayError(409, why, code="cannot_resume")
    gw.admission.kick()
    return web.json_response({"id": eid, "state": gw.supervisor.engines[eid].state.value})


async def admin_keys_list(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({"keys": [r.public_dict() for r in gw.keys.records]})


async def admin_keys_create(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        body = await request.json()
    except (ValueError, RecursionError):
        raise GatewayError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    allowed = {"name", "scopes", "rpm", "tpm", "priority", "expires_days"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise GatewayError(
            400, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}", param=unknown[0]
        )
    name: Any = body.get("name")  # validated (with a message naming it) by create()
    try:
        record, secret = await asyncio.to_thread(
            gw.keys.create,
            name,
            body.get("scopes"),
            body.get("rpm"),
            body.get("tpm"),
            body.get("priority", "interactive"),
            body.get("expires_days"),
        )
    except KeySpecError as exc:
        raise GatewayError(400, str(exc), param=exc.field) from None
    except KeysFileError as exc:
        raise GatewayError(503, str(exc), code="keys_file_error", retry_after=5) from None
    return web.json_response({"key": secret, **record.public_dict()}, status=201)


async def admin_keys_delete(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        key_id = validate_key_id(request.match_info["id"])
    except KeySpecError as exc:
        raise GatewayError(400, str(exc), param=exc.field) from None
    try:
        removed = await asyncio.to_thread(gw.keys.revoke, key_id)
    except KeysFileError as exc:
        raise GatewayError(503, str(exc), code="keys_file_error", retry_after=5) from None
    if not removed:
        raise GatewayError(404, f"no key with id {key_id!r}", code="unknown_key")
    return web.json_response({"id": key_id, "revoked": True})


def create_app(supervisor: Supervisor) -> web.Application:
    gw = Gateway(supervisor)
    app = web.Application(
        client_max_size=supervisor.config.gateway.max_body_bytes,
        middlewares=[gateway_middleware],
        handler_args={},
    )
    app[GATEWAY] = gw
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", gw.relay.models)
    r.add_post("/v1/chat/completions", gw.relay.chat)
    r.add_post("/v1/completions", gw.relay.completions)
    r.add_post("/v1/embeddings", gw.relay.embeddings)
    r.add_get("/admin/status", admin_status)
    r.add_post("/admin/engines/{id}/restart", admin_restart)
    r.add_post("/admin/engines/{id}/drain", admin_drain)
    r.add_post("/admin/engines/{id}/resume", admin_resume)
    r.add_get("/admin/keys", admin_keys_list)
    r.add_post("/admin/keys", admin_keys_create)
    r.add_delete("/admin/keys/{id}", admin_keys_delete)
    app.on_startup.append(gw.on_startup)
    app.on_cleanup.append(gw.on_cleanup)
    supervisor.link = gw
    return app


def _ssl_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ListenError(f"gateway.tls_cert / gateway.tls_key cannot be loaded: {exc}") from None
    return ctx


async def start_gateway(supervisor: Supervisor) -> web.AppRunner:
    g = supervisor.config.gateway
    app = create_app(supervisor)
    gw = app[GATEWAY]
    try:
        gw.keys.load()
        created = await asyncio.to_thread(ensure_admin_key, gw.keys, log)
    except KeysFileError as exc:
        raise ListenError(f"{exc}; fix or remove the keys file") from None
    if created is None and not gw.keys.records:
        log.warning("no API keys in %s: create one with `llm-appliance keys create`", g.keys_file)
    ctx = _ssl_context(g.tls_cert, g.tls_key) if g.tls_cert else None
    # handler_cancellation: a client that disconnects cancels its handler, which closes
    # the upstream request, which makes vLLM abort the generation. GatewayRunner bounds
    # connections, request read times and the log lines clients can cause.
    runner = GatewayRunner(
        app,
        ConnectionLimits.from_config(g),
        access_log=None,
        shutdown_timeout=5.0,
        handler_cancellation=True,
    )
    fd_warning = ensure_fd_room(g.max_connections)
    if fd_warning:
        log.warning("%s", fd_warning)
    await runner.setup()
    site = web.TCPSite(runner, g.host, g.port, ssl_context=ctx, backlog=1024)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        from appliance.proctree import port_holder

        holder = port_holder(g.port, g.host)
        who = f" by {holder[1]} (pid {holder[0]})" if holder and holder[0] else ""
        raise ListenError(
            f"gateway cannot listen on {g.host}:{g.port}{who}: {exc.strerror}; "
            "stop that process or change gateway.port"
        ) from None
    log.info("gateway listening on %s://%s:%d", "https" if ctx else "http", g.host, g.port)
    return runner
