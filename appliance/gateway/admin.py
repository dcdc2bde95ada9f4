"""The /admin routes (scope admin): the status document, engine commands, keys.

Engine commands go through the door (:class:`appliance.control.EngineCommands`): the
handler asks, the engine's runner answers from its own task, and the handler turns the
answer into a status code (200 done, 202 restart asked for, 409 refused). The wait for
an answer is bounded: a runner answers at its next await, even in the middle of a health
check, so the bound only ever catches a bug.

Every command and every key change is recorded once in the audit trail
(:mod:`appliance.audit`), whatever its end: the acting key's id, the target, and ok,
refused (4xx) or error; never a secret or a request body.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from appliance import __version__
from appliance.audit import Outcome
from appliance.control import CommandResult, EngineStatus, GpuStatus, ModelResult, ModelStatus
from appliance.fsutil import NO_SPACE
from appliance.gateway.admin_adapters import (
    PATH_SHOWN,
    adapter_body,
    adapter_json,
    json_object,
    refuse_unless,
    shown,
)
from appliance.gateway.errors import GatewayError
from appliance.gateway.keys import KeyRecord, KeysFileError, KeySpecError, validate_key_id
from appliance.gateway.probes import readiness

if TYPE_CHECKING:
    from appliance.gateway.app import Gateway

COMMAND_WAIT_S = 10.0  # longest an admin request waits for an engine's runner to answer
# An adapter's add waits for every engine's load (adapters.py: 120 s), a remove also for
# the requests queued for it (at most 65 s more).
ADAPTER_WAIT_S = 200.0
_ENGINE_ID_RE = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() takes "²" and "١"
KEY_FIELDS = frozenset(
    {
        "name",
        "scopes",
        "rpm",
        "tpm",
        "priority",
        "expires_days",
        "fallback",
        "max_inflight",
        "models",
    }
)


def _engine_json(gw: Gateway, e: EngineStatus, gpu: GpuStatus | None) -> dict[str, Any]:
    adm = gw.admission
    return {
        "id": e.id,
        "gpu": e.gpus[0] if e.gpus else e.gpu,  # the first of "gpus", kept for old readers
        "gpus": list(e.gpus),
        "port": e.port,  # null with engine.listen = "unix"
        "listen": str(e.address),
        "state": e.state.value,
        "pid": e.pid,
        "inflight": adm.inflight(e.id),
        "inflight_tokens": adm.inflight_tokens(e.id),
        "restarts": e.restarts,
        "restarts_by_reason": dict(e.restarts_by_reason),
        "last_restart_reason": e.last_restart_reason,
        "throttle_level": adm.throttle_level.get(e.id, 0),
        "temperature_c": gpu.reading.temperature_c if gpu else None,
        "kv_cache_usage": e.kv_cache_usage,
        "kv_breaker_open": adm.kv_tripped.get(e.id, False),
        "requests_running": e.running,
        "model": e.model or e.served_model_name,
        # speculative decoding over the last minute (null without speculation)
        "spec_acceptance_rate": e.spec_acceptance_rate,
        "spec_mean_accepted_length": e.spec_mean_accepted_length,
        "last_exit": e.last_exit,  # why its process last exited, one line (null: never)
    }


def _model_json(m: ModelStatus) -> dict[str, Any]:
    out: dict[str, Any] = {"name": m.name, "load": m.load, "state": m.state}
    out["last_used"] = round(m.last_used, 3) if m.last_used is not None else None
    out["trust_remote_code"] = m.trust_remote_code  # its engines run the repository's code
    if m.detail:
        out["detail"] = m.detail  # draining, unloading: on its way out
    return out


def _gpu_json(g: GpuStatus) -> dict[str, Any]:
    r = g.reading
    return {
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
        "throttle_level": g.throttle_level,
    }


TOP_KEYS = 10


def _keys_inflight(gw: Gateway) -> list[dict[str, Any]]:
    """[{"id", "name", "inflight"}] of the keys with requests in flight, most first."""
    out = []
    for key_id, n in gw.admission.top_keys(TOP_KEYS):
        record = gw.keys.get(key_id)
        out.append({"id": key_id, "name": record.name if record else None, "inflight": n})
    return out


def status_document(gw: Gateway) -> dict[str, Any]:
    """GET /admin/status, which `llm-appliance status --json` prints as it is."""
    status = gw.appliance.status()
    # /readyz's own verdict (probes.readiness), so `status` and /readyz never disagree:
    # a box whose engines are READY but too hot to admit is not ready, and a model on
    # demand put away is not down.
    code, verdict = readiness(gw)
    return {
        "version": __version__,
        "device": status.device,
        # CPU engines: {"dtype", "reason"} (null on GPU or with engine.command).
        "cpu_dtype": status.cpu_dtype.as_json() if status.cpu_dtype else None,
        "uptime_s": round(time.time() - status.started_at, 1),
        "accepting": status.accepting,
        "ready": code == 200,
        # /readyz's word ("ready", "not admitting", "starting", ...), each model's word
        # (ready, down, unloaded, sleeping, loading, unloading) and why engines admit
        # nothing (engine id -> reason), as /readyz says them.
        "readiness": {
            "status": verdict["status"],
            "models": verdict["models"],
            "reasons": verdict.get("reasons", {}),
        },
        "queue_depth": gw.admission.queue_depth,
        # The keys with the most requests in flight (at most TOP_KEYS): who holds the box.
        "keys_inflight": _keys_inflight(gw),
        "engines": [_engine_json(gw, e, status.gpu(e.telemetry_index)) for e in status.engines],
        "gpus": [_gpu_json(g) for g in status.gpus],
        # Every configured model and its load state (models on demand): loaded, loading,
        # sleeping or unloaded, and its last request (unix time; null: none yet).
        "models": [_model_json(m) for m in status.models],
        # LoRA adapters served as models: the config's and the admin's (kept).
        "adapters": [adapter_json(a) for a in gw.model_door.adapters()],
        # State files (usage.json, audit.log, keys.json) failing to be written now: which,
        # why, since when (empty while all are written fine). Serving goes on meanwhile.
        "state_write_failures": [
            {**failing, "path": str(w.path)}
            for w in gw.state_files()
            if (failing := w.as_json()) is not None
        ],
    }


async def _answer(ask: Awaitable[CommandResult]) -> CommandResult:
    """The runner's answer, within COMMAND_WAIT_S (a command not answered by then is
    dropped unanswered: the runner skips a command whose asker stopped waiting)."""
    try:
        return await asyncio.wait_for(ask, COMMAND_WAIT_S)
    except TimeoutError:
        raise GatewayError(
            503,
            "the engine's supervisor did not answer in time; try again",
            code="engine_busy",
            retry_after=5,
        ) from None


def keys_file_error(exc: KeysFileError) -> GatewayError:
    """A key change that could not be written (the file is unchanged): 507
    ``insufficient_storage`` when the disk or quota is full, since retrying cannot help
    until an admin frees space; else 503 ``keys_file_error`` (a lock held, a corrupt file:
    worth a retry). The message names the file and the OS's reason."""
    if exc.errno in NO_SPACE:
        return GatewayError(507, str(exc), code="insufficient_storage")
    return GatewayError(503, str(exc), code="keys_file_error", retry_after=5)


@dataclass
class _Entry:
    """What one audited admin request did, filled in as the handler learns it."""

    target: str
    detail: dict[str, object] = field(default_factory=dict)


def _actor(request: web.Request) -> str:
    record = request.get("key")  # set by the auth middleware; /admin always has one
    return f"key:{record.id}" if record is not None else "unknown"


class Admin:
    """The /admin handlers of one gateway."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/admin/status", self.status)
        r.add_post("/admin/engines/{id}/restart", self.restart)
        r.add_post("/admin/engines/{id}/drain", self.drain)
        r.add_post("/admin/engines/{id}/resume", self.resume)
        r.add_post("/admin/models/{name}/load", self.model_load)
        r.add_post("/admin/models/{name}/unload", self.model_unload)
        r.add_post("/admin/models/{name}/adapters", self.adapter_add)
        r.add_delete("/admin/models/{name}/adapters/{adapter}", self.adapter_remove)
        r.add_get("/admin/keys", self.keys_list)
        r.add_post("/admin/keys", self.keys_create)
        r.add_delete("/admin/keys/{id}", self.keys_delete)

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(status_document(self.gw))

    @contextlib.contextmanager
    def _audited(self, request: web.Request, action: str, target: str) -> Iterator[_Entry]:
        """Record ``action`` once however the handler ends: ok, refused (a 4xx) or error.
        A refusal records its status, code and field, never the message (it may quote
        what the client sent)."""
        entry = _Entry(target)
        outcome: Outcome = "error"
        try:
            yield entry
            outcome = "ok"
        except GatewayError as exc:
            outcome = "refused" if exc.status < 500 else "error"
            entry.detail |= {"status": exc.status, "code": exc.code, "param": exc.param}
            raise
        except asyncio.CancelledError:
            entry.detail["code"] = "client_gone"  # the command may still have been done
            raise
        finally:
            entry.detail["remote"] = request.remote
            self.gw.audit.record(action, entry.target, _actor(request), outcome, **entry.detail)

    @staticmethod
    def _engine_target(request: web.Request) -> str:
        """``engine:<id>``; a path id that is no engine id is not copied into the trail (an
        admin may have pasted a key there by mistake)."""
        raw = request.match_info["id"]
        return f"engine:{raw}" if _ENGINE_ID_RE.fullmatch(raw) and len(raw) <= 9 else "engine:?"

    def _engine_id(self, request: web.Request) -> int:
        """The engine a /admin/engines/{id}/... path names: 400 naming ``id`` unless it is
        a whole number in ASCII digits, 404 when no engine has it."""
        raw = request.match_info["id"]
        shown = raw if len(raw) <= 20 else raw[:17] + "..."
        if not _ENGINE_ID_RE.fullmatch(raw):
            raise GatewayError(
                400, f"id: engine ids are whole numbers in ASCII digits, got {shown!r}", param="id"
            )
        # int() refuses strings of over 4300 digits; no engine has an id that long anyway.
        if len(raw) > 9 or int(raw) >= len(self.gw.appliance.engines()):
            raise GatewayError(404, f"no engine {shown}", code="unknown_engine")
        return int(raw)

    async def restart(self, request: web.Request) -> web.Response:
        with self._audited(request, "engine.restart", self._engine_target(request)) as entry:
            eid = self._engine_id(request)
            result = await _answer(self.gw.appliance.restart(eid))
            if not result.ok:
                entry.detail["message"] = result.message  # the supervisor's words
                raise GatewayError(409, result.message, code="engine_busy")
        self.gw.admission.drained.discard(eid)  # coming back by itself: requests wait
        return web.json_response({"id": eid, "action": "restart", "accepted": True}, status=202)

    async def drain(self, request: web.Request) -> web.Response:
        force = request.query.get("force") == "true"
        with self._audited(request, "engine.drain", self._engine_target(request)) as entry:
            entry.detail["force"] = force
            eid = self._engine_id(request)
            result = await _answer(self.gw.appliance.drain(eid, force=force))
            if not result.ok:
                entry.detail["message"] = result.message
                raise GatewayError(409, result.message, code="cannot_drain")
        # Drained by an admin: its model's requests are refused at once while every one
        # of its engines is (admission.py), those waiting too.
        self.gw.admission.drained.add(eid)
        self.gw.admission.refuse_failed()
        return web.json_response({"id": eid, "state": result.state.value})

    async def resume(self, request: web.Request) -> web.Response:
        with self._audited(request, "engine.resume", self._engine_target(request)) as entry:
            eid = self._engine_id(request)
            result = await _answer(self.gw.appliance.resume(eid))
            if not result.ok:
                entry.detail["message"] = result.message
                raise GatewayError(409, result.message, code="cannot_resume")
        self.gw.admission.drained.discard(eid)
        self.gw.admission.kick()
        return web.json_response({"id": eid, "state": result.state.value})

    async def model_load(self, request: web.Request) -> web.Response:
        return await self._model_command(request, "load")

    async def model_unload(self, request: web.Request) -> web.Response:
        return await self._model_command(request, "unload")

    async def _model_command(self, request: web.Request, action: str) -> web.Response:
        """Load or unload an on-demand model: 202 once asked (it happens in the
        background: /admin/status shows the model's state), 404 for no such model, 409
        for a model that is always loaded."""
        raw = request.match_info["name"]
        served = self.gw.appliance.config.model(raw)
        name = served.name if served is not None else None
        with self._audited(request, f"model.{action}", f"model:{name or '?'}") as entry:
            if name is None:
                raise GatewayError(404, "no model has that name", code="model_not_found")
            door = self.gw.model_door
            ask = door.load_model(name) if action == "load" else door.unload_model(name)
            result: ModelResult = await asyncio.wait_for(ask, COMMAND_WAIT_S)
            if not result.ok:
                entry.detail["message"] = result.message
                raise GatewayError(409, result.message, code="model_always_loaded")
        if action == "load":
            self.gw.admission.kick()
        body = {"model": name, "action": action, "accepted": True, "state": result.state}
        return web.json_response(body, status=202)

    async def adapter_add(self, request: web.Request) -> web.Response:
        """Add a LoRA adapter to a model at run time: loaded on each of its running
        engines, kept across restarts. 200 once every engine serves it; 4xx naming why
        not (a bad folder, a name taken, a rank the engines cannot take)."""
        model = request.match_info["name"]
        with self._audited(request, "model.adapter.add", f"model:{shown(model)}") as entry:
            name, path = await adapter_body(request)
            entry.detail |= {"adapter": shown(name), "path": shown(path, PATH_SHOWN)}
            result = await asyncio.wait_for(
                self.gw.model_door.add_adapter(model, name, path), ADAPTER_WAIT_S
            )
            refuse_unless(result)
        self.gw.admission.kick()
        return web.json_response({"model": model, "adapter": name, "added": True})

    async def adapter_remove(self, request: web.Request) -> web.Response:
        """Unload an adapter the admin added from every engine of its model, and forget it."""
        model, name = request.match_info["name"], request.match_info["adapter"]
        with self._audited(request, "model.adapter.remove", f"model:{shown(model)}") as entry:
            entry.detail["adapter"] = shown(name)
            result = await asyncio.wait_for(
                self.gw.model_door.remove_adapter(model, name), ADAPTER_WAIT_S
            )
            refuse_unless(result)
        return web.json_response({"model": model, "adapter": name, "removed": True})

    async def keys_list(self, request: web.Request) -> web.Response:
        return web.json_response({"keys": [r.public_dict() for r in self.gw.keys.records]})

    async def keys_create(self, request: web.Request) -> web.Response:
        with self._audited(request, "key.create", "key") as entry:
            record, secret = await self._create_key(request)
            entry.target = f"key:{record.id}"
            entry.detail |= {"name": record.name, "scopes": sorted(record.scopes)}
        return web.json_response({"key": secret, **record.public_dict()}, status=201)

    async def _create_key(self, request: web.Request) -> tuple[KeyRecord, str]:
        body = await json_object(request, KEY_FIELDS)
        name: Any = body.get("name")  # validated (with a message naming it) by create()
        try:
            record, secret = await asyncio.to_thread(
                self.gw.keys.create,
                name,
                body.get("scopes"),
                body.get("rpm"),
                body.get("tpm"),
                body.get("priority", "interactive"),
                body.get("expires_days"),
                body.get("fallback"),
                body.get("max_inflight"),
                body.get("models"),
            )
        except KeySpecError as exc:
            raise GatewayError(400, str(exc), param=exc.field) from None
        except KeysFileError as exc:
            raise keys_file_error(exc) from None
        return record, secret

    async def keys_delete(self, request: web.Request) -> web.Response:
        # The target is the id only once it is one: a secret pasted as an id stays out.
        with self._audited(request, "key.revoke", "key:?") as entry:
            try:
                key_id = validate_key_id(request.match_info["id"])
            except KeySpecError as exc:
                raise GatewayError(400, str(exc), param=exc.field) from None
            entry.target = f"key:{key_id}"
            try:
                removed = await asyncio.to_thread(self.gw.keys.revoke, key_id)
            except KeysFileError as exc:
                raise keys_file_error(exc) from None
            if not removed:
                raise GatewayError(404, f"no key with id {key_id!r}", code="unknown_key")
            self.gw.keys_changed()  # its open requests end now, not when they finish
        return web.json_response({"id": key_id, "revoked": True})
