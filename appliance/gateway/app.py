"""The gateway's aiohttp application: built by a factory, no module-level singletons.

The supervisor owns engines; the gateway sees them only through the door,
:mod:`appliance.control`: it reads frozen status snapshots (``ApplianceView``), asks for
engine commands (``EngineCommands``), and tells the supervisor how much work sits on
each engine through the link it implements (:class:`Gateway` is a ``GatewayLink``). It
never imports the supervisor. One middleware (:mod:`.middleware`) does, for every
request: authentication and scope, every refusal in its protocol's error shape, and the
request metrics. ``/healthz``, ``/readyz`` and ``/metrics`` are answered in :mod:`.probes`.

This module is the gateway's composition: :class:`Gateway` builds every part and hands
each the few others it uses; no part takes the Gateway itself, and nothing imports it
but the composition root (serve.py) and tests.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from appliance.audit import AuditLog
from appliance.control import Appliance, GpuStatus, ModelDoor, NoModels
from appliance.errors import ApplianceError
from appliance.gateway.accounting.book import UsageBook, usage_path
from appliance.gateway.admin.routes import Admin
from appliance.gateway.admission.adapter_work import AdapterWork
from appliance.gateway.admission.engine_owners import EngineOwners
from appliance.gateway.admission.fallback import FallbackRecorder, add_model_header
from appliance.gateway.admission.gate import Admission
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.http.middleware import GatewayMiddleware
from appliance.gateway.http.server import ConnectionLimits, GatewayRunner, ensure_fd_room
from appliance.gateway.keys import (
    KeysFileError,
    KeyStore,
    KeyWatcher,
    ensure_admin_key,
)
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.gateway.observe.model_metrics import ModelCollector
from appliance.gateway.observe.probes import Probes, Readiness
from appliance.gateway.observe.status_document import StatusDocument
from appliance.gateway.observe.ui import StatusPage
from appliance.gateway.protocols import ALL as ALL_ROUTES
from appliance.gateway.relay.engine_ways import EngineSessions, EngineWays
from appliance.gateway.relay.handlers import Relay
from appliance.gateway.relay.request_body import add_lowered_header
from appliance.gateway.wire.upstream_pool import UpstreamPool
from appliance.state_writes import WriteHealth

log = logging.getLogger("appliance.gateway")


class ListenError(ApplianceError):
    exit_code = 1


class Gateway:
    """Everything the HTTP side holds: keys, limits, admission, metrics, one client session."""

    def __init__(self, appliance: Appliance, audit: AuditLog | None = None) -> None:
        self.appliance = appliance
        self.audit = audit or AuditLog(None)  # None: audit lines go to the journal only
        cfg = appliance.config.gateway
        self.keys = KeyStore(Path(cfg.keys_file), logger=log)
        self.watcher = KeyWatcher(self.keys, logger=log, on_change=self.keys_changed)
        self.metrics = GatewayMetrics()
        self.ratelimiter = RateLimiter()
        # Tokens per key id (usage.json beside the keys file; the metric on our registry).
        self.usage = UsageBook(usage_path(self.keys.path), self.metrics.registry, self.ratelimiter)
        self.admission = Admission(
            lambda: appliance.config,
            appliance.engines,
            lambda: appliance.accepting,
            starting=lambda: appliance.starting,
            on_reject=lambda reason: self.metrics.rejections.labels(reason).inc(),
            heat_of=self._heat_of,
        )
        self.metrics.attach(appliance, self.admission)
        self.metrics.attach_state_files(self.state_files)
        self.fallbacks = FallbackRecorder(self.metrics.fallbacks)
        # Whose each TCP engine's connections must be (none for Unix sockets).
        self.owners = EngineOwners(appliance, self.admission)
        self.sessions = EngineSessions(self.owners.owner_of)  # whole answers' connections
        self.upstreams = UpstreamPool(self.owners.owner_of)  # streamed requests' connections
        self.adapter_work = AdapterWork()  # requests per LoRA adapter (its removal waits)
        # Models on demand: the supervisor's side of it, or none (unit tests' fakes).
        self.model_door: ModelDoor = appliance if isinstance(appliance, ModelDoor) else NoModels()
        self.metrics.registry.register(ModelCollector(self.model_door))
        self.relay = Relay(
            appliance,
            self.model_door,
            self.admission,
            self.ratelimiter,
            self.adapter_work,
            self.fallbacks,
            self.usage,
            self.metrics,
            EngineWays(
                lambda: appliance.config,
                self.sessions,
                self.upstreams,
                self.metrics.first_byte,
            ),
        )
        self.readiness = Readiness(
            appliance, self.keys, self.admission, self.model_door, self.state_files
        )
        self.status_document = StatusDocument(
            appliance, self.admission, self.keys, self.readiness, self.model_door, self.state_files
        )

    # ---- GatewayLink (called by the supervisor) ----------------------------------------
    def inflight(self, engine_id: int) -> int:
        return self.admission.inflight(engine_id)

    def adapter_requests(self, name: str) -> int:
        return self.adapter_work.count(name)

    def observe_kv(self, engine_id: int, usage: float | None) -> None:
        self.admission.observe_kv(engine_id, usage)

    def kv_tripped(self, engine_id: int) -> bool:
        return self.admission.kv_open(engine_id)

    def set_throttle(self, engine_id: int, level: int) -> None:
        self.admission.set_throttle(engine_id, level)

    def telemetry_read(self, gpus: tuple[GpuStatus, ...]) -> None:
        """A telemetry tick: the GPUs' energy since the last one goes to the keys whose
        tries ran on them then, once those tries have ended (accounting/energy.py)."""
        energy = {g.index: g.reading.energy_j for g in gpus}
        self.usage.energy_tick(
            energy, {e.id: e.telemetry_indexes for e in self.appliance.engines()}
        )

    def engines_changed(self) -> None:
        self.admission.kick()
        self.admission.refuse_failed()

    def queued_since(self, model: str) -> float | None:
        return self.admission.queued_since(model)

    def abandon(self, engine_id: int, why: str) -> int:
        return self.relay.abandon(engine_id, why)

    def shutdown_begun(self) -> None:
        self.admission.fail_waiters("shutting_down", "the server is shutting down")

    def keys_changed(self) -> None:
        """Other keys are in force (a reload, a revoke): a revoked or expired key's open
        requests end now (open_requests.py)."""
        self.relay.keys_changed(self.keys.records)

    def reload(self) -> None:
        self.watcher.reload_now()
        self.ratelimiter.forget({r.id for r in self.keys.records})

    # ---- helpers for handlers ------------------------------------------------------------
    def _heat_of(self, engine_ids: Sequence[int]) -> str:
        """The temperatures of the engines' GPUs (on CPU: their telemetry entries), in
        words, for a 503 about heat: read when one is refused, never per request."""
        status = self.appliance.status()
        said = []
        for e in status.engines:
            if e.id not in engine_ids:
                continue
            for index in e.telemetry_indexes:
                gpu = status.gpu(index)
                if gpu is not None and gpu.reading.temperature_c is not None:
                    said.append(f"GPU {index} at {gpu.reading.temperature_c:g} °C")
        return ", ".join(dict.fromkeys(said))

    def state_files(self) -> tuple[WriteHealth, ...]:
        """How the writes of each state file go (usage.json, audit.log, keys.json)."""
        return (self.usage.writes, self.audit.writes, self.keys.writes)

    async def on_startup(self, app: web.Application) -> None:
        self.watcher.start()
        self.usage.start()

    async def on_cleanup(self, app: web.Application) -> None:
        await self.watcher.stop()
        await self.usage.stop()
        self.audit.close()  # audit lines still waiting for a full disk: one last try
        self.upstreams.close()
        await self.sessions.close()


GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)


def create_app(appliance: Appliance, audit: AuditLog | None = None) -> web.Application:
    """The gateway's app over ``appliance``; ``app[GATEWAY]`` is its link for the supervisor
    (connected by :mod:`appliance.serve`, the only place that knows both sides)."""
    gw = Gateway(appliance, audit)
    app = web.Application(
        client_max_size=appliance.config.gateway.max_body_bytes,
        middlewares=[
            GatewayMiddleware(lambda: appliance.config, gw.keys, gw.adapter_work, gw.metrics)
        ],
        handler_args={},
    )
    app[GATEWAY] = gw
    r = app.router
    Probes(appliance, gw.readiness, gw.metrics.registry).add_routes(r)  # probes, /metrics
    r.add_get("/v1/models", gw.relay.models)
    for route in ALL_ROUTES:  # every protocol's routes (protocols/), and no others
        for path in route.client_paths:
            r.add_post(path, gw.relay.handler_for(route))
    r.add_get("/v1/responses/{response_id}", gw.relay.stored_response)
    r.add_post("/v1/responses/{response_id}/cancel", gw.relay.stored_response)
    Admin(
        appliance,
        gw.admission,
        gw.keys,
        gw.model_door,
        gw.audit,
        gw.status_document,
        gw.keys_changed,
    ).add_routes(r)
    StatusPage(  # /ui, / and /admin/history; its history sampler
        appliance,
        gw.status_document,
        gw.admission,
        gw.metrics,
        gw.keys,
        gw.usage,
        gw.audit.path,
    ).install(app)
    app.on_response_prepare.append(add_model_header)
    app.on_response_prepare.append(add_lowered_header)
    app.on_startup.append(gw.on_startup)
    app.on_cleanup.append(gw.on_cleanup)
    return app


def _ssl_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ListenError(f"gateway.tls_cert / gateway.tls_key cannot be loaded: {exc}") from None
    return ctx


async def _load_keys(gw: Gateway) -> None:
    """The keys in force at start, and the first admin key on a fresh box.

    A keys file that cannot be read or parsed (or a first admin key that cannot be
    written) does not stop the daemon: exit 1 would make systemd restart it into the same
    file, in a loop. It starts refusing every key (503 ``keys_file_error``, ``/readyz``
    503), says so in the journal, and the watcher puts the file in force once it is fixed.
    A corrupt file is never overwritten: no admin key is made over it."""
    if not gw.watcher.first_load():
        return
    try:
        created = await asyncio.to_thread(ensure_admin_key, gw.keys, log, gw.audit)
    except KeysFileError as exc:
        if gw.keys.signature is None:  # no file in force: an admin key not saved is no key
            gw.keys.apply(None, None)
        gw.watcher.refuse_all(str(exc))
        return
    if created is None and not gw.keys.records:
        log.warning("no API keys in %s: create one with `llm-appliance keys create`", gw.keys.path)


async def start_gateway(appliance: Appliance, audit: AuditLog | None = None) -> GatewayRunner:
    """The gateway, listening; its Gateway (the supervisor's link) is ``runner.app[GATEWAY]``."""
    g = appliance.config.gateway
    app = create_app(appliance, audit)
    gw = app[GATEWAY]
    await _load_keys(gw)
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
        auto_decompress=False,  # request bodies are never inflated (_refuse_encoded_body)
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
