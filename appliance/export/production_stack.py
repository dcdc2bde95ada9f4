"""``llm-appliance export production-stack``: the same models as Helm values for vLLM
production-stack, the vLLM project's Kubernetes chart (``helm/values.yaml``, chart
``vllm-stack``), and a list of what does not carry over.

The mapping is a pure function of the config (:func:`export`), so every case is a table
row in tests/unit/test_export_production_stack.py; every key it writes is checked
against a trimmed copy of the chart's own values.yaml (tests/data/production-stack/).

Choices the chart forces, said once here:

- A model's weights: the pod runs ``vllm serve <modelURL>``. A folder on this box (or a
  packaged model, which set-up prepared into a folder) has no meaning in a pod, so it
  becomes ``/data/<folder name>`` on the model's volume (``pvcStorage``; the chart
  mounts it at /data) and a note says to copy it there. A model id stays an id: the pod
  downloads it, which the appliance never does (a note says so).
- ``enablePrefixCaching: true``: the chart passes ``--no-enable-prefix-caching`` unless
  it is set, while our engines run with vLLM's default (on).
- ``runner: "pooling"`` (the chart's own key, it becomes ``--runner pooling``) for an
  ``embed`` model; the model's name (``--served-model-name``: the chart would serve it
  under its path), batch tokens, the tool-call and reasoning parsers and speculative
  decoding go in ``extraArgs`` as our command line has them (:mod:`appliance.engine`),
  and so do the model's extra_args; the Responses API's store and the CPU KV cache go in
  ``env`` as our engines get them.
- Every setting of a model is either carried, meaningless in a pod, or named in a note
  when the config sets it (:data:`CARRIED`, :data:`NOT_APPLICABLE`,
  :data:`NOT_CARRIED_KEYS`; a test holds every field of ServedModel and EngineConfig to
  one of them).
- ``repository``, ``tag``, ``requestCPU`` and ``requestMemory`` are required by the
  chart and unknown here: the upstream image and starting sizes, with a note.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config, EngineConfig, ServedModel
from appliance.engine import request_guard_args, request_guard_env, scheduling_args

CHART = "vllm-stack (github.com/vllm-project/production-stack, helm/)"
IMAGE = ("vllm/vllm-openai", "latest")  # the vLLM project's own image
REQUEST_CPU = 4
REQUEST_MEMORY = "16Gi"
VOLUME = "50Gi"  # a model volume's size when the weights must be copied onto one
ROUTING_LOGIC = "prefixaware"  # closest to vllm-router's cache_aware in front of boxes
K8S_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")

# What the appliance does that the chart does not, and what to put there instead.
NOT_CARRIED: tuple[str, ...] = (
    "the heat governor (admitting less to a hot GPU): Kubernetes does not route by GPU "
    "temperature; export DCGM metrics (dcgm-exporter) and alert on "
    "DCGM_FI_DEV_GPU_TEMP, and leave headroom in gpuMemoryUtilization and replicas",
    "drain-before-restart and restarts on degradation: set readiness and liveness "
    "probes (servingEngineSpec.readinessProbe/livenessProbe), a PodDisruptionBudget, "
    "and a terminationGracePeriodSeconds long enough for in-flight requests",
    "per-key API keys, rpm/tpm limits, priorities and usage: the chart has one shared "
    "vllmApiKey; put an API gateway in front of the router (LiteLLM proxy, Envoy AI "
    "Gateway, Kong) for per-user keys, limits and usage",
    "fallback between models and model aliases: the same gateway in front (LiteLLM's "
    "fallbacks and model_name aliases)",
    "the audit trail (who asked what, when): the gateway's request logs",
    "the gateway's request refusals (prompt_logprobs and echo with logprobs unless "
    "allow_prompt_logprobs, media URLs outside allowed_media_domains): the chart's "
    "router passes every request body to vLLM; the engines' --allowed-media-domains "
    "and structured-output backend do carry over",
    "the gateway's admission queue (max_inflight, max_inflight_tokens, max_queue, "
    "queue_timeout_s): vLLM queues inside the engine; vllmConfig.maxNumSeqs caps a "
    "replica's batch",
    "the appliance's [gateway], [thermal], [health], [degradation], [restart] and "
    "[telemetry] sections: the chart has none of them (the notes above say what stands in)",
)


# Every setting of a served model, by its field in ServedModel and EngineConfig (the
# model's [engine] keys): how it reaches the values (CARRIED), why it has no meaning in
# a pod (NOT_APPLICABLE), or, when this config sets it, the note that says it does not
# carry over and what to use instead (NOT_CARRIED_KEYS). A test checks that every field
# is in exactly one of the three, so a new setting cannot be dropped without a word.
CARRIED: Mapping[str, str] = {
    "name": "name, and --served-model-name in extraArgs",
    "model": "modelURL (a folder: on the model's volume)",
    "task": 'vllmConfig.runner = "pooling" for embed',
    "gpus": "replicaCount",
    "tensor_parallel_size": "vllmConfig.tensorParallelSize, requestGPU",
    "cpu_engines": "replicaCount (device = cpu)",
    "speculative": "--speculative-config in extraArgs",
    "engine": "its keys, each below",
    "engine.model": "modelURL (through the model's model)",
    "engine.served_model_name": "name (through the model's name)",
    "engine.device": "requestGPU (0 on cpu)",
    "engine.gpus": "replicaCount (through the model's gpus)",
    "engine.cpu_engines": "replicaCount (through the model's cpu_engines)",
    "engine.max_model_len": "vllmConfig.maxModelLen",
    "engine.max_num_batched_tokens": "--max-num-batched-tokens in extraArgs",
    "engine.gpu_memory_utilization": "vllmConfig.gpuMemoryUtilization",
    "engine.extra_args": "vllmConfig.extraArgs (--dtype: vllmConfig.dtype)",
    "engine.env": "env",
    "engine.cpu_kvcache_space_gib": "env VLLM_CPU_KVCACHE_SPACE (device = cpu)",
    "engine.tool_call_parser": "--enable-auto-tool-choice --tool-call-parser in extraArgs",
    "engine.reasoning_parser": "--reasoning-parser in extraArgs",
    "engine.responses_store": "env VLLM_ENABLE_RESPONSES_API_STORE",
    "engine.structured_outputs_backend": "--structured-outputs-config in extraArgs (and "
    "env VLLM_ENFORCE_STRICT_TOOL_CALLING for guidance)",
    "engine.allowed_media_domains": "--allowed-media-domains in extraArgs, env "
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
    "engine.scheduling": "--scheduling-policy in extraArgs (the chart's router sends no "
    "priority: every request is vLLM's default 0)",
}
NOT_APPLICABLE: Mapping[str, str] = {
    "engine.listen": "how the gateway reaches an engine on this box; the chart's router "
    "reaches its pods by their Service",
    "engine.port_base": "as engine.listen",
}
NOT_CARRIED_KEYS: Mapping[str, str] = {
    "aliases": "not carried (see fallback and aliases)",
    "fallback": "not carried: the chart's router has no fallback between models (see "
    "fallback and aliases)",
    "load": "the chart runs every replica all the time; to free the GPU when idle, scale "
    "replicaCount to 0 by hand or with an autoscaler (KEDA)",
    "idle_unload_s": "not carried (no models on demand in the chart; see load)",
    "swap": "not carried (no models on demand in the chart; see load)",
    "load_timeout_s": "not carried (no models on demand in the chart; see load)",
    "min_residency_s": "not carried (no models on demand in the chart; see load)",
    "adapters": "not carried: give the chart's LoRA support (loraAdapters, with "
    "--enable-lora in extraArgs) the same folders on the volume",
    "engine.command": "replaces vLLM's command line here; the chart runs `vllm serve`",
    "engine.python": "not carried: the pod runs the image's own vLLM",
    "engine.max_inflight": "not carried (the gateway's admission, see below); "
    "vllmConfig.maxNumSeqs caps a replica's batch",
    "engine.max_inflight_tokens": "not carried (the gateway's admission, see below)",
    "engine.startup_timeout_s": "not carried: give the pod a startupProbe (or the "
    "readinessProbe's initialDelaySeconds) as long",
    "engine.stop_timeout_s": "not carried: set terminationGracePeriodSeconds as long",
    "engine.allow_prompt_logprobs": "not carried: the chart's router refuses nothing, so "
    "prompt_logprobs reach vLLM whatever this says",
}


@dataclass(frozen=True)
class Export:
    """Helm values (plain structures, ready for :func:`appliance.export.yaml_out.dump`)
    and the notes for stderr: this config's own, then what never carries over."""

    values: dict[str, Any]
    notes: tuple[str, ...]


def export(config: Config) -> Export:
    """The production-stack values for ``config``'s models, and what does not carry."""
    specs: list[dict[str, Any]] = []
    notes: list[str] = []
    for m in config.served:
        spec, model_notes = model_spec(m, config.engine.device)
        specs.append(spec)
        notes += [f"model {m.name}: {n}" for n in model_notes]
    values = {
        "servingEngineSpec": {"enableEngine": True, "modelSpec": specs},
        "routerSpec": {"enableRouter": True, "routingLogic": ROUTING_LOGIC},
    }
    notes.append(
        f"the image ({IMAGE[0]}:{IMAGE[1]}), requestCPU ({REQUEST_CPU}) and requestMemory "
        f"({REQUEST_MEMORY}) are starting points: pin the tag to your engine venv's vLLM "
        "version and size the requests for your models"
    )
    return Export(values, (*notes, *(f"not carried over: {n}" for n in NOT_CARRIED)))


def model_spec(m: ServedModel, device: str) -> tuple[dict[str, Any], list[str]]:
    """One ``servingEngineSpec.modelSpec[]`` entry, and the notes about this model."""
    notes: list[str] = []
    on_cpu = device == "cpu"
    url, volume_note = model_url(m.model)
    spec: dict[str, Any] = {
        "name": m.name,
        "repository": IMAGE[0],
        "tag": IMAGE[1],
        "modelURL": url,
        "replicaCount": _replicas(m, on_cpu, notes),
        "requestCPU": REQUEST_CPU,
        "requestMemory": REQUEST_MEMORY,
        "requestGPU": 0 if on_cpu else m.tensor_parallel_size,
    }
    if url.startswith("/data/"):
        spec["pvcStorage"] = VOLUME
    if volume_note:
        notes.append(volume_note)
    spec["vllmConfig"] = vllm_config(m, on_cpu)
    env = container_env(m, on_cpu)
    if env:
        spec["env"] = [{"name": k, "value": v} for k, v in sorted(env.items())]
    notes += _model_notes(m, on_cpu)
    notes += unset_notes(m)
    return spec, notes


def model_url(model: str) -> tuple[str, str]:
    """(modelURL, a note on where the pod finds the weights)."""
    packaged = paths.packaged_name(model) if model else paths.PACKAGED_MODEL_NAME
    if packaged is not None:
        folder = paths.PACKAGED_MODELS[packaged].folder
        where = f"/data/{folder.name}"
        return where, (
            f"packaged:{packaged} is a folder `llm-appliance setup` prepared "
            f"(<appliance home>/{folder}); copy it onto the model's volume at {where}"
        )
    if model.startswith(("/", "./", "../", "~")):
        where = f"/data/{Path(model.rstrip('/')).name}"
        return where, f"{model} is a folder on this box; copy it onto the model's volume at {where}"
    return model, (
        f"{model} is a model id: the pod downloads it at start (the appliance never "
        "does); to stay offline, put it on the volume and set modelURL to its folder"
    )


def vllm_config(m: ServedModel, on_cpu: bool) -> dict[str, Any]:
    """``vllmConfig``: the chart's own keys where it has one, else ``extraArgs``."""
    e = m.engine
    dtype, extra = _take_dtype(e.extra_args)
    out: dict[str, Any] = {
        "enablePrefixCaching": True,
        "maxModelLen": e.max_model_len,
        "dtype": dtype,
        "tensorParallelSize": m.tensor_parallel_size,
    }
    if not on_cpu:
        out["gpuMemoryUtilization"] = e.gpu_memory_utilization
    if m.task == "embed":
        out["runner"] = "pooling"
    # The chart runs `vllm serve <modelURL>`, which would serve the model under its path:
    # clients (and the chart's router, which reads /v1/models) must see its name.
    args = [
        "--served-model-name",
        m.name,
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
    ]
    if m.task != "embed":  # as our command line has them (appliance/engine.py)
        if e.tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", e.tool_call_parser]
        if e.reasoning_parser:
            args += ["--reasoning-parser", e.reasoning_parser]
        args += request_guard_args(e)
    args += scheduling_args(e)
    if m.speculative:
        args += ["--speculative-config", speculative(m)]
    out["extraArgs"] = [*args, *extra]
    return out


def container_env(m: ServedModel, on_cpu: bool) -> dict[str, str]:
    """The container's environment: what our engines get from the model's keys (the
    Responses API's store, the CPU KV cache), then engine.env's, which wins as it does
    on the box (appliance/engine.py build_env)."""
    env = request_guard_env(m.engine)
    if m.task != "embed" and m.engine.responses_store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"  # vLLM's default is off
    if on_cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{m.engine.cpu_kvcache_space_gib:g}"
    return env | dict(m.engine.env)


def unset_notes(m: ServedModel) -> list[str]:
    """A note for each setting of NOT_CARRIED_KEYS this model sets (not its default)."""
    engine_defaults = EngineConfig()
    notes = []
    for key, why in NOT_CARRIED_KEYS.items():
        section, _, name = key.rpartition(".")
        if section:
            value, default = getattr(m.engine, name), getattr(engine_defaults, name)
        else:
            value, default = getattr(m, name), _SERVED_DEFAULTS.get(name)
        if value != default and (value or default):
            notes.append(f"{key} = {_shown(value)}: {why}")
    return notes


def _shown(value: Any) -> str:
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    name = getattr(value, "name", None)  # a LoRA adapter
    return str(name) if isinstance(name, str) else str(value)


# ServedModel's defaults (fields with none: a model that does not set them has them empty).
_SERVED_DEFAULTS: Mapping[str, Any] = {
    f.name: f.default
    for f in dataclasses.fields(ServedModel)
    if f.default is not dataclasses.MISSING
} | {"aliases": (), "fallback": ""}


def speculative(m: ServedModel) -> str:
    """The model's --speculative-config JSON; a packaged or local draft model points at
    the volume, as the model itself does."""
    spec = dict(m.speculative)
    draft = spec.get("model")
    if isinstance(draft, str) and draft:
        spec["model"] = model_url(draft)[0]
    return json.dumps(spec, separators=(",", ":"), sort_keys=True)


def _take_dtype(extra_args: Sequence[str]) -> tuple[str, list[str]]:
    """(the --dtype in extra_args, else "auto" as our GPU engines get; the rest)."""
    dtype, rest = "auto", []
    args = list(extra_args)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--dtype" and i + 1 < len(args):
            dtype, i = args[i + 1], i + 2
            continue
        if a.startswith("--dtype="):
            dtype = a.partition("=")[2]
        else:
            rest.append(a)
        i += 1
    return dtype, rest


def _replicas(m: ServedModel, on_cpu: bool, notes: list[str]) -> int:
    if on_cpu:
        return m.cpu_engines
    if m.gpus is None:
        notes.append(
            "gpus = auto: one replica written; set replicaCount to the GPUs you give it "
            f"divided by tensor_parallel_size ({m.tensor_parallel_size})"
        )
        return 1
    return max(1, len(m.gpus) // m.tensor_parallel_size)


def _model_notes(m: ServedModel, on_cpu: bool) -> list[str]:
    notes = []
    if not set(m.name) <= K8S_NAME_CHARS:
        notes.append(
            f"the chart names Kubernetes objects after the model, which refuse '.' and '_' "
            f"in {m.name!r}: rename the model (clients send that name)"
        )
    if on_cpu:
        notes.append(
            "device = cpu: requestGPU 0; use a vLLM CPU image (the vllm/vllm-openai image "
            "needs a GPU); the KV cache's size is in env (VLLM_CPU_KVCACHE_SPACE)"
        )
    return notes
