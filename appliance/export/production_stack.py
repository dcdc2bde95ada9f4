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
  under its path), batch tokens and speculative decoding go in ``extraArgs`` as our
  command line has them (:mod:`appliance.engine`), and so do the model's extra_args.
- ``repository``, ``tag``, ``requestCPU`` and ``requestMemory`` are required by the
  chart and unknown here: the upstream image and starting sizes, with a note.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config, ServedModel

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
    "the gateway's admission queue (max_inflight, max_queue, queue_timeout_s): vLLM "
    "queues inside the engine; vllmConfig.maxNumSeqs caps a replica's batch",
)


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
    if m.engine.env:
        spec["env"] = [{"name": k, "value": v} for k, v in sorted(m.engine.env.items())]
    notes += _model_notes(m, on_cpu)
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
    if m.speculative:
        args += ["--speculative-config", speculative(m)]
    out["extraArgs"] = [*args, *extra]
    return out


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
    if m.engine.command:
        notes.append("its `command` replaces vLLM's command line here; the chart runs `vllm serve`")
    if on_cpu:
        notes.append(
            "device = cpu: requestGPU 0; use a vLLM CPU image (the vllm/vllm-openai image "
            "needs a GPU), and set VLLM_CPU_KVCACHE_SPACE in env for the KV cache"
        )
    if m.aliases:
        notes.append(f"aliases {', '.join(m.aliases)}: not carried (see fallback and aliases)")
    return notes
