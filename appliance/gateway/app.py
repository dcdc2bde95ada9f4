"""The gateway's aiohttp application: built by a factory, no module-level singletons.

The supervisor owns engines; the app only reads its snapshots (``app[SUPERVISOR]``).
"""

from __future__ import annotations

import logging
import ssl
import time
from typing import TYPE_CHECKING

from aiohttp import web

from appliance.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.supervisor import Supervisor

log = logging.getLogger("appliance.gateway")

SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor")

LOOP_STALL_S = 10.0  # a main loop that has not ticked for this long is not "alive"


class ListenError(ApplianceError):
    exit_code = 1


async def healthz(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    if time.monotonic() - sup.last_tick > LOOP_STALL_S:
        return web.json_response({"status": "stalled"}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    ready = [s.id for s in sup.snapshots() if s.state.accepts_work]
    if sup.ready:
        return web.json_response({"status": "ready", "engines_ready": ready})
    reason = "stopping" if not sup.accepting else "no engine ready"
    return web.json_response(
        {"status": reason, "engines_ready": ready}, status=503, headers={"Retry-After": "5"}
    )


def create_app(supervisor: Supervisor) -> web.Application:
    app = web.Application(client_max_size=supervisor.config.gateway.max_body_bytes)
    app[SUPERVISOR] = supervisor
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
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
    runner = web.AppRunner(create_app(supervisor), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    ctx = _ssl_context(g.tls_cert, g.tls_key) if g.tls_cert else None
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
