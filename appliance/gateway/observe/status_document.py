"""GET /admin/status's document (what `llm-appliance status --json` prints as it is) and
the status page reads: engines, GPUs, models, adapters, the keys holding the box, the
readiness verdict, and the state files that fail to be written."""

from __future__ import annotations

import time
from typing import Any

from appliance import __version__
from appliance.control import (
    AdapterStatus,
    ApplianceView,
    EngineStatus,
    GpuStatus,
    ModelDoor,
    ModelStatus,
)
from appliance.gateway.admission.gate import Admission
from appliance.gateway.keys import KeyStore
from appliance.gateway.observe.probes import Readiness, StateFiles


def _engine_json(adm: Admission, e: EngineStatus, gpu: GpuStatus | None) -> dict[str, Any]:
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
        "throttle_level": adm.throttle(e.id),
        "temperature_c": gpu.reading.temperature_c if gpu else None,
        "kv_cache_usage": e.kv_cache_usage,
        "kv_breaker_open": adm.kv_open(e.id),
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
        "energy_j": r.energy_j,
        "throttle_reasons": list(r.throttle_reasons),
        "throttle_level": g.throttle_level,
    }


def adapter_json(a: AdapterStatus) -> dict[str, Any]:
    return {"name": a.name, "model": a.model, "path": a.path, "source": a.source}


TOP_KEYS = 10


def _keys_inflight(adm: Admission, keys: KeyStore) -> list[dict[str, Any]]:
    """[{"id", "name", "inflight"}] of the keys with requests in flight, most first."""
    out = []
    for key_id, n in adm.top_keys(TOP_KEYS):
        record = keys.get(key_id)
        out.append({"id": key_id, "name": record.name if record else None, "inflight": n})
    return out


class StatusDocument:
    """GET /admin/status's document, from the parts it reports on."""

    def __init__(
        self,
        appliance: ApplianceView,
        admission: Admission,
        keys: KeyStore,
        readiness: Readiness,
        model_door: ModelDoor,
        state_files: StateFiles,
    ) -> None:
        self._appliance = appliance
        self._admission = admission
        self._keys = keys
        self._readiness = readiness
        self._model_door = model_door
        self._state_files = state_files

    def build(self) -> dict[str, Any]:
        """GET /admin/status, which `llm-appliance status --json` prints as it is."""
        status = self._appliance.status()
        # /readyz's own verdict (probes.Readiness), so `status` and /readyz never disagree:
        # a box whose engines are READY but too hot to admit is not ready, and a model on
        # demand put away is not down.
        code, verdict = self._readiness.verdict()
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
            "queue_depth": self._admission.queue_depth,
            # The keys with the most requests in flight (at most TOP_KEYS): who holds the box.
            "keys_inflight": _keys_inflight(self._admission, self._keys),
            "engines": [
                _engine_json(self._admission, e, status.gpu(e.telemetry_index))
                for e in status.engines
            ],
            "gpus": [_gpu_json(g) for g in status.gpus],
            # Every configured model and its load state (models on demand): loaded, loading,
            # sleeping or unloaded, and its last request (unix time; null: none yet).
            "models": [_model_json(m) for m in status.models],
            # LoRA adapters served as models: the config's and the admin's (kept).
            "adapters": [adapter_json(a) for a in self._model_door.adapters()],
            # State files (usage.json, audit.log, keys.json) failing to be written now: which,
            # why, since when (empty while all are written fine). Serving goes on meanwhile.
            "state_write_failures": [
                {**failing, "path": str(w.path)}
                for w in self._state_files()
                if (failing := w.as_json()) is not None
            ],
        }
