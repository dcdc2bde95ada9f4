"""The config's schema: one frozen dataclass per TOML table, the ``[[models]]`` tables and
the models served, and :class:`Config`, the whole of it.

Each section field has its default, the sentence that documents it, its bounds and
whether a SIGHUP applies it (``live``); the ``[[models]]`` keys have their docs in
:data:`MODEL_KEY_DOCS`. The defaults are the contract's. ``docs/configuration.md`` is
generated from these docs (``python -m appliance.config --markdown``) and a test fails
when it is stale.

This module only declares: reading TOML into it is :mod:`appliance.config.parse`, the
rules across keys are :mod:`appliance.config.checks`, and neither is imported here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from appliance import paths
from appliance.config.field_spec import config_field as _f

COMMAND_PLACEHOLDERS = frozenset(
    {"python", "model", "uds", "port", "gpu", "api_key", "served_model_name"}
)
MAX_GPUS = 8
# The supervisor's own variables: the tree tag finds an engine's processes, systemd's
# socket must never reach an engine, and GPU pinning is engine i -> GPU i.
RESERVED_ENGINE_ENV = frozenset(
    {
        "LLM_APPLIANCE_ENGINE",
        "NOTIFY_SOCKET",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "VLLM_API_KEY",
    }
)

Device = Literal["auto", "cuda", "cpu"]
Listen = Literal["unix", "tcp"]
# vLLM 0.32's structured-output backends (vllm/config/structured_outputs.py).
StructuredBackend = Literal["guidance", "xgrammar", "auto", "outlines", "lm-format-enforcer"]
Scheduling = Literal["priority", "fcfs"]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = _f(
        "127.0.0.1",
        "Address the gateway listens on. A non-loopback address needs "
        "`allow_lan = true` (and should use TLS).",
    )
    port: int = _f(8080, "TCP port of the gateway.", lo=1, hi=65535)
    allow_lan: bool = _f(False, "Allow `host` to be a non-loopback address.")
    tls_cert: str = _f("", "PEM certificate file; with `tls_key` the gateway serves HTTPS.")
    tls_key: str = _f("", "PEM private key file for `tls_cert`.")
    keys_file: str = _f(
        "/var/lib/llm-appliance/keys.json",
        "API keys file (hashes only, mode 0600). Created with one admin key on "
        "first start when missing or empty.",
    )
    max_body_bytes: int = _f(1048576, "Largest request body accepted; larger gets 413.", lo=1024)
    max_tokens_cap: int = _f(
        4096,
        "Largest `max_tokens` a request may ask for; larger is "
        "refused with 400 (never silently clamped), except on `/v1/messages`, where it "
        "is lowered to this value and the answer says so (`X-Appliance-Max-Tokens`; "
        "Claude Code asks for 32000). A chat request without "
        "`max_tokens` (or with null) is sent to the engine with this value, never "
        "more than the context leaves.",
        lo=1,
        live=True,
    )
    max_n: int = _f(
        16,
        "Largest `n` (answers per prompt) a request may ask for; larger gets 400. "
        "Each answer is counted in the request's token cost.",
        lo=1,
        hi=16384,
        live=True,
    )
    max_best_of: int = _f(
        16,
        "Largest `best_of` a request may ask for; larger gets 400. Counted like `n` "
        "(vLLM 0.32 ignores it, other engines generate that many sequences).",
        lo=1,
        hi=16384,
        live=True,
    )
    max_prompts: int = _f(
        2048,
        "Longest list of prompts (`/v1/completions` `prompt`) or inputs "
        "(`/v1/embeddings` `input`) one request may carry; longer gets 400. Every "
        "prompt is counted in the request's token cost.",
        lo=1,
        live=True,
    )
    max_answer_bytes: int = _f(
        33554432,
        "Largest non-streamed answer the gateway relays (it holds each one whole); "
        "larger gets 502 and should be streamed. The default (32 MiB) holds the "
        "longest plain-text answer the other limits allow many times over, and a "
        "full batch of float embeddings of a small model.",
        lo=65536,
        live=True,
    )
    max_queue: int = _f(
        256,
        "Requests waiting for an engine beyond this get 503 with Retry-After.",
        lo=0,
        live=True,
    )
    queue_timeout_s: float = _f(
        30.0,
        "Longest a request waits in the queue before 503.",
        lo=0,
        lo_open=True,
        live=True,
    )
    queue_aging_s: float = _f(
        10.0,
        "A queued request too large for the room any engine has now lets smaller ones "
        "behind it go first, for at most this long; after that nobody passes it, so "
        "it is not starved. 0 = strict arrival order.",
        lo=0,
        live=True,
    )
    key_token_share: float = _f(
        0.5,
        "While another key that holds less of a model waits for it, a key that already "
        "holds this share of the model's in-flight token budget (`max_inflight_tokens` "
        "summed over its engines) takes no more: its further requests wait until it "
        "holds less. A key with nothing in flight may always run one request, and with "
        "nobody else waiting a key may use the whole budget. 1 = no bound.",
        lo=0,
        hi=1,
        lo_open=True,
        live=True,
    )
    prefix_routing: bool = _f(
        True,
        "Keep a conversation on the engine that holds its prompt's beginning in its prefix "
        "cache, with no client hint: a request whose prompt begins with what an engine "
        "was sent before goes there, unless that engine is hotter, draining, full or far "
        "more loaded than the least-loaded one (docs/keys.md). `X-Session-Id`, "
        "`prompt_cache_key`, Anthropic `metadata.user_id` and `user` pin a conversation "
        "whatever this says. false: least-loaded only.",
        live=True,
    )
    stall_timeout_s: float = _f(
        60.0,
        "A streamed answer whose client reads none of it for this long (the gateway's "
        "buffer for it full, nothing taken from it since) is ended: the engine stops "
        "generating it, its slot and token budget go to others, and the client's "
        "connection is closed. A slow reader that keeps reading is never cut.",
        lo=0,
        lo_open=True,
        live=True,
    )
    stored_responses_per_key: int = _f(
        10000,
        "Stored responses (Responses API, `store`) the gateway remembers per key, of the "
        "100,000 it remembers in all: a key that stores more forgets its own least "
        "recently made or used first, so one key cannot push out every other key's. A "
        "forgotten one reads as 404; vLLM keeps it in the engine's memory until the "
        "engine restarts.",
        lo=1,
        hi=100000,
        live=True,
    )
    metrics_public: bool = _f(
        False,
        "false: /metrics needs a key with scope `metrics` or "
        "`admin`; true: anyone who can reach the gateway may read it.",
        live=True,
    )
    max_connections: int = _f(
        1024,
        "Client connections open at once. One more is answered 503 and closed at once; "
        "the open ones carry on. Each takes a file descriptor: serve raises its soft "
        "open-files limit to fit, up to the hard limit (the unit's LimitNOFILE).",
        lo=1,
        hi=100_000,
    )
    header_timeout_s: float = _f(
        10.0,
        "A connection must send a complete request head (request line and headers) "
        "within this of opening, or of the first byte of a later request; else 408 and "
        "it is closed. Answers are not timed as such: long streams to slow readers go "
        "on (a client that stops reading is `stall_timeout_s`'s). An "
        "idle keep-alive connection is closed after 75 s.",
        lo=0,
        hi=3600,
        lo_open=True,
    )
    body_timeout_s: float = _f(
        30.0,
        "A request body must be complete within this of its head; else 408 and the "
        "connection is closed.",
        lo=0,
        hi=3600,
        lo_open=True,
    )


@dataclass(frozen=True)
class EngineConfig:
    python: str = _f("", 'The engine venv\'s python. "" = the one `llm-appliance setup` made.')
    model: str = _f(
        "",
        "Model to serve: a local folder or a model id already in the local "
        'cache. "" = the packaged SmolLM2-135M-Instruct that set-up converted. '
        "Nothing is downloaded at run time.",
    )
    served_model_name: str = _f(
        "", 'Model name clients use. "" = derived from the model (the folder\'s name, lower-case).'
    )
    device: Device = _f(
        "auto",
        "`auto` uses the NVIDIA GPUs NVML finds, else the CPU; "
        "`cuda` requires GPUs; `cpu` never uses them.",
    )
    gpus: Literal["auto"] | list[int] = _f(
        "auto",
        '`"auto"` = every GPU NVML finds, or a '
        "list of GPU indices like `[0, 1]`; one engine "
        "per GPU.",
    )
    cpu_engines: int = _f(
        1,
        "With device = cpu: how many engines; the cores are split between them, and "
        "each engine's processes are pinned to its share (unless engine.env sets "
        "VLLM_CPU_OMP_THREADS_BIND).",
        lo=1,
        hi=MAX_GPUS,
    )
    listen: Listen = _f(
        "unix",
        "Where engines listen. `unix`: a socket in the service's private runtime "
        "directory (0700), which no other local user can reach, squat or impersonate. "
        "`tcp`: 127.0.0.1:port_base+i, reachable by every local user; the supervisor "
        "then checks that the listener belongs to the engine's own process tree before "
        "it sends the engine key or marks it READY.",
    )
    port_base: int = _f(
        8100, "With listen = tcp: engine i listens on 127.0.0.1:port_base+i.", lo=1024, hi=65535
    )
    max_model_len: int = _f(4096, "vLLM `--max-model-len`.", lo=16)
    max_num_batched_tokens: int = _f(8192, "vLLM `--max-num-batched-tokens`.", lo=16)
    gpu_memory_utilization: float = _f(
        0.90, "vLLM `--gpu-memory-utilization` (GPU only).", lo=0, hi=1, lo_open=True
    )
    max_inflight: int = _f(
        64,
        "Requests admitted to one engine at once; more wait in the "
        "gateway's queue. The thermal governor lowers it on a hot GPU.",
        lo=1,
        live=True,
    )
    max_inflight_tokens: int = _f(
        131072,
        "Tokens admitted to one engine at once (each request counts its prompt estimate "
        "plus max_tokens); the thermal governor lowers it with max_inflight.",
        lo=1,
        live=True,
    )
    extra_args: list[str] = _f([], "Appended to the vLLM command line.")
    env: dict[str, str] = _f({}, "Added to each engine's environment.")
    command: list[str] = _f(
        [],
        "Replaces the whole engine command. Placeholders: {python} {model} {uds} "
        "{port} {gpu} {served_model_name}; it must contain {uds} with listen = unix "
        "and {port} with listen = tcp. The engine key is in the environment "
        "(VLLM_API_KEY); {api_key} also works but puts it on a command line that "
        "every local user can read (check-config warns).",
    )
    startup_timeout_s: float = _f(
        900.0, "Longest an engine may take to become ready.", lo=1, live=True
    )
    stop_timeout_s: float = _f(
        20.0,
        "After SIGTERM, how long an engine's process tree may take to exit before SIGKILL.",
        lo=0.1,
        live=True,
    )
    cpu_kvcache_space_gib: float = _f(
        1.0,
        "With device = cpu: KV cache per engine in GiB (`VLLM_CPU_KVCACHE_SPACE`).",
        lo=0,
        lo_open=True,
    )
    tool_call_parser: str = _f(
        "",
        "vLLM `--enable-auto-tool-choice --tool-call-parser NAME`: lets clients send `tools` "
        'with `tool_choice` "auto" (or "required", or a named tool); NAME must fit the '
        'model\'s chat template (e.g. "hermes" for ChatML tool calls). "" = off: such a '
        "request is a 400 that names this key. check-config lists vLLM 0.32's names.",
    )
    reasoning_parser: str = _f(
        "",
        "vLLM `--reasoning-parser NAME`: the model's thinking goes in `reasoning` apart "
        'from the answer; for reasoning models only (e.g. "deepseek_r1", "qwen3"). "" = '
        "off. check-config lists vLLM 0.32's names.",
    )
    responses_store: bool = _f(
        True,
        "Keep Responses API answers in the engine's memory (`store`, "
        "`previous_response_id`, retrieve, cancel; vLLM's "
        "`VLLM_ENABLE_RESPONSES_API_STORE`). vLLM never evicts them: each stored answer "
        "stays in the engine's RAM until it restarts. false: nothing is kept, and a "
        "request that reads a stored response is a 400.",
    )
    structured_outputs_backend: StructuredBackend = _f(
        "guidance",
        "What compiles `response_format`, `structured_outputs` and the schemas of "
        '`tool_choice` "required" or a named tool (vLLM `--structured-outputs-config`). '
        "`guidance` (llguidance) compiles as it generates, in milliseconds for the "
        "schemas that stall xgrammar (the engine then also gets "
        "VLLM_ENFORCE_STRICT_TOOL_CALLING=0: vLLM 0.32's tool-call constraints are "
        "xgrammar's own). vLLM's default, `auto`, picks xgrammar, whose compile has no "
        "time limit: one small schema can keep structured output waiting for everyone "
        "until the engine restarts (docs/security.md). An extra_args entry that sets "
        "--structured-outputs-config wins.",
    )
    scheduling: Scheduling = _f(
        "priority",
        "How the engine orders the requests it holds (vLLM `--scheduling-policy`). "
        "`priority`: each request the gateway sends carries a `priority` (0 for an "
        "`interactive` key, 10 for a `batch` key; lower is served first), so an interactive "
        "request takes the next place that frees in the engine's running batch, ahead of "
        "a batch flood waiting inside it (vLLM does not push a running request out for "
        "it), and a client's own `priority` is replaced. `fcfs`: vLLM's first-come first-served; "
        "no priority is sent and a client's own is removed. An extra_args entry that sets "
        "--scheduling-policy, or a custom `command`, decides the engine's flag.",
    )
    allow_prompt_logprobs: bool = _f(
        False,
        "Let clients ask for `prompt_logprobs` (and `echo` with `logprobs` on "
        "/v1/completions): a log-probability for every prompt token, which costs the "
        "engine memory and time far beyond what the request is charged (a 3k-token "
        "prompt with 20 logprobs: 1.9 GB and a minute on CPU). false: such a request is "
        "a 400 naming the field.",
    )
    allowed_media_domains: list[str] = _f(
        [],
        "Hosts whose http(s) media URLs (images, audio, video, files) the engine may "
        "fetch for a multimodal model (vLLM `--allowed-media-domains`, exact host "
        "names; redirects are not followed). [] = only inline `data:` URLs: any other "
        "media URL is a 400, and the engine fetches nothing.",
    )


@dataclass(frozen=True)
class TelemetryConfig:
    source: str = _f(
        "nvml",
        "`nvml`, `none`, or `file:/path/sensors.json` (re-read every "
        "interval; stands in for NVML without hardware).",
    )
    interval_s: float = _f(1.0, "How often GPUs are read.", lo=0.05, hi=3600, live=True)


Governor = Literal["predictive", "stepped"]


@dataclass(frozen=True)
class ThermalConfig:
    soft_limit_c: float = _f(
        80.0,
        "Above this a GPU is admitted less work, step by step.",
        lo=20,
        hi=120,
        live=True,
    )
    hard_limit_c: float = _f(
        87.0, "At or above this a GPU is admitted nothing new.", lo=20, hi=130, live=True
    )
    hysteresis_c: float = _f(
        5.0,
        "A throttle level drops only below its limit minus this.",
        lo=0,
        hi=30,
        live=True,
    )
    governor: Governor = _f(
        "predictive",
        "How a GPU's temperature becomes its throttle level (same levels and budgets "
        "either way). `predictive`: acts on the temperature's trend 1 °C before each "
        "threshold and holds a level at least 600 s before stepping down while near "
        "the band (simulated: 98 % less time above soft_limit_c in a hot room than no "
        "governor, at most 4 level changes an hour). "
        "`stepped`: acts at the thresholds themselves, a slowdown reason adds a level, "
        "down one step per reading below a level's threshold minus hysteresis_c. "
        "Compared on the heat simulator: docs/rehearse-heat.md.",
        live=True,
    )
    power_limit_w: int = _f(
        0,
        "0 = each GPU keeps its own power limit. Otherwise the power limit (W) set on "
        "every GPU the appliance uses when it starts, clamped to the card's allowed "
        "range, and the card's default restored when it stops: by `llm-appliance "
        "gpu-power apply|restore`, run as root by the unit (ExecStartPre=+ / "
        "ExecStopPost=+); the daemon itself never changes a GPU setting. A lower limit "
        "costs little throughput: a published RTX 4090 measurement at 70 % of its "
        "limit drew 300 W instead of 390 W for 93.4 % of the tokens/s. Takes effect at "
        "the next start. See docs/rehearse-heat.md.",
        lo=0,
        hi=2000,
    )
    heat_restart_after_s: float = _f(
        0.0,
        "0 = off. A GPU at the hard limit this long gets its engine drained and restarted "
        "with --max-num-batched-tokens halved (smaller batches, lower power); restored "
        "the same way after heat_restore_after_s at level 0. Pays off when a card "
        "cannot cool at full batch (poor airflow, hot room); otherwise the admission "
        "throttle alone is cheaper than a restart. An engine whose `command` (engine's "
        "or a model's) has no `--max-num-batched-tokens` argument gets no heat "
        "restart: check-config warns, and the journal says so at start.",
        lo=0,
        live=True,
    )
    heat_restore_after_s: float = _f(
        900.0,
        "How long a GPU with a heat-reduced engine must stay cool before the full "
        "batch size is restored.",
        lo=1,
        live=True,
    )


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = _f(2.0, "How often each engine is checked.", lo=0.05, hi=3600, live=True)
    probe_timeout_s: float = _f(
        10.0,
        "A real 1-token completion must answer within this (`/health` and `/metrics` "
        "get at most 5 s of it: they do no inference).",
        lo=0.05,
        hi=3600,
        live=True,
    )
    failures_to_restart: int = _f(
        3,
        "Consecutive failed checks, with no token progress, "
        "before an engine counts as hung and is replaced.",
        lo=1,
        hi=100,
        live=True,
    )


@dataclass(frozen=True)
class RestartConfig:
    backoff_initial_s: float = _f(
        2.0,
        "Wait before the first restart after a failure; doubles per consecutive failure.",
        lo=0,
        live=True,
    )
    backoff_max_s: float = _f(300.0, "Longest wait between restarts.", lo=0, live=True)
    max_restarts_per_hour: int = _f(
        6,
        "More unplanned restarts (any reason but heat, degraded and admin: the engine "
        "exited, was killed, failed to start, hung) than this within an hour "
        "leave the engine FAILED.",
        lo=0,
        live=True,
    )
    max_planned_restarts_per_hour: int = _f(
        6,
        "Heat and degradation restarts allowed per engine within an hour, counted apart "
        "from crashes: past it the engine keeps serving as it is (logged) instead of being "
        "restarted again. Admin restarts are never refused by it.",
        lo=0,
        live=True,
    )
    drain_timeout_s: float = _f(
        120.0,
        "Longest wait for in-flight work before a restart or shutdown goes ahead.",
        lo=0,
        live=True,
    )
    degradation_restart: bool = _f(
        True,
        "Drain and restart engines the degradation detector flags.",
        live=True,
    )


@dataclass(frozen=True)
class DegradationConfig:
    window_s: float = _f(
        60.0,
        "Window of engine samples the degradation detector judges.",
        lo=1,
        hi=3600,
        live=True,
    )
    max_preemptions_per_min: float = _f(
        30.0,
        "More vLLM preemptions per minute than this over the window: preemption storm.",
        lo=0,
        lo_open=True,
        live=True,
    )
    hang_s: float = _f(
        30.0,
        "Work present but no token generated for this long: hang. At most window_s.",
        lo=1,
        live=True,
    )
    leak_kv_usage: float = _f(
        0.9,
        "KV cache usage at or above this while at most one "
        "request runs, for leak_hold_s: leaked KV blocks.",
        lo=0,
        hi=1,
        lo_open=True,
        live=True,
    )
    leak_hold_s: float = _f(
        30.0,
        "How long the KV-leak condition must hold. At most window_s.",
        lo=1,
        live=True,
    )
    slowdown_ratio: float = _f(
        0.35,
        "Tokens/s per running request below this fraction of "
        "the engine's own learned baseline: slowdown.",
        lo=0,
        hi=1,
        lo_open=True,
        live=True,
    )
    rss_growth_ratio: float = _f(
        1.5,
        "Engine process-tree RSS above this multiple of its "
        "baseline for the whole window: memory growth.",
        lo=1,
        lo_open=True,
        live=True,
    )
    baseline_warmup_s: float = _f(
        60.0,
        "Seconds after an engine is ready before its baseline is learned.",
        lo=0,
        live=True,
    )


SECTIONS: dict[str, type[Any]] = {
    "gateway": GatewayConfig,
    "engine": EngineConfig,
    "telemetry": TelemetryConfig,
    "thermal": ThermalConfig,
    "health": HealthConfig,
    "restart": RestartConfig,
    "degradation": DegradationConfig,
}

# "section.key" of every field marked live: what a reload (SIGHUP) applies in place.
LIVE_KEYS: frozenset[str] = frozenset(
    f"{name}.{f.name}"
    for name, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
    if f.metadata["live"]
)


# ---- [[models]] ------------------------------------------------------------------------
# Several models on one box, one table per model, [engine] the defaults. A table names the
# model clients ask for, where it runs (its GPUs, or its CPU engines) and which [engine]
# keys it sets for itself. What the rest of the appliance uses is the resolved
# ServedModel: the table merged over [engine], or, without any table, [engine] alone as
# one model on every GPU (exactly what a config meant before models existed).

# A model's name, and each of its aliases and adapters' names: what clients send as
# `model` (adapters' names also stand in a URL path: config/lora.py good_name).
NAME_RE = re.compile(r"[a-z0-9._-]{1,64}")
Load = Literal["always", "on_demand"]
Swap = Literal["stop", "sleep"]
LOADS: tuple[str, ...] = get_args(Load)
SWAPS: tuple[str, ...] = get_args(Swap)
# A model's keys for models on demand (issue 23).
ON_DEMAND_KEYS: tuple[str, ...] = (
    "load",
    "idle_unload_s",
    "swap",
    "load_timeout_s",
    "min_residency_s",
    "adapters",
)

Task = Literal["generate", "embed"]
TASKS: tuple[str, ...] = get_args(Task)
# The [engine] keys a model's table may set for itself (contract, "Models").
MODEL_ENGINE_KEYS: tuple[str, ...] = (
    "max_model_len",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "max_inflight",
    "max_inflight_tokens",
    "extra_args",
    "env",
    "command",
    "startup_timeout_s",
    "stop_timeout_s",
    "cpu_kvcache_space_gib",
    "tool_call_parser",
    "reasoning_parser",
    "responses_store",
    "structured_outputs_backend",
    "scheduling",
    "allow_prompt_logprobs",
    "allowed_media_domains",
)
MODEL_KEYS: tuple[str, ...] = (
    "name",
    "aliases",
    "model",
    "task",
    "gpus",
    "tensor_parallel_size",
    "cpu_engines",
    "fallback",
    "speculative",
    *ON_DEMAND_KEYS,
)
# (default, type, what it does) of each model key: docs/configuration.md's [[models]].
MODEL_KEY_DOCS: Mapping[str, tuple[str, str, str]] = {
    "name": ("(required)", "a string", "What clients send as `model`; unique; a-z 0-9 . _ -."),
    "aliases": ("[]", "a list of strings", "More names for the model; unique across all."),
    "model": (
        "engine.model",
        "a string",
        'A local folder, a model id already in the local cache, or "packaged:NAME" '
        '("packaged:smollm2-135m-instruct", "packaged:all-minilm-l6-v2").',
    ),
    "task": (
        "the packaged model's, else generate",
        'one of "generate", "embed"',
        "`embed`: a pooling model, served on /v1/embeddings only (vLLM --runner pooling).",
    ),
    "gpus": (
        "[] (with one model: every GPU)",
        "a list of integers",
        "This model's GPUs; no GPU belongs to two models; needed with several models.",
    ),
    "tensor_parallel_size": (
        "1",
        "an integer",
        "GPUs per engine (vLLM --tensor-parallel-size); len(gpus) a multiple of it.",
    ),
    "cpu_engines": ("engine.cpu_engines", "an integer", "With device = cpu: its engines."),
    "fallback": (
        '""',
        "a model's name",
        "Another model (same task) that takes this model's requests none of its engines "
        "can admit now; one hop only.",
    ),
    "speculative": (
        "{}",
        "a table",
        "vLLM --speculative-config, e.g. "
        '{ method = "ngram", num_speculative_tokens = 4, prompt_lookup_max = 4 }.',
    ),
    # Models on demand (issue 23).
    "load": (
        '"always"',
        'one of "always", "on_demand"',
        "`on_demand`: started by its first request (or the admin's load), put away when "
        "idle or when another on-demand model on the same GPUs (on CPU: any) is wanted.",
    ),
    "idle_unload_s": (
        "900",
        "a number",
        'on_demand: put away after this long without a request; with `swap = "sleep"`, '
        "asleep this long more without being wanted: unloaded fully (weights leave host "
        "RAM); 0 = never for idleness.",
    ),
    "swap": (
        '"stop"',
        'one of "stop", "sleep"',
        "How an on-demand model is put away: `stop` ends its engines, `sleep` (GPU only) "
        "is vLLM sleep level 1: weights kept in host RAM, GPU memory freed, fast wake.",
    ),
    "load_timeout_s": (
        "300",
        "a number",
        "A request waits this long for its model to load, then 503 naming the model.",
    ),
    "min_residency_s": (
        "30",
        "a number",
        "on_demand: once loaded, it is not swapped out for another model of its slot for "
        "this long (damps swap storms; idle unload and the admin's unload still apply).",
    ),
    "adapters": (
        "[]",
        "a list of tables",
        '[{ name = "sql", path = "/srv/lora/sql" }]: LoRA adapters, each a folder with '
        "adapter_config.json (its rank read from it), served as a model name of its own "
        "on the model's engines (vLLM --enable-lora); the admin adds more at run time. "
        "Only root and the service account may be able to change the folder (security.md).",
    ),
}
# The context a packaged model supports, where it is below [engine].max_model_len's
# default: vLLM refuses a --max-model-len above what the model was trained for.
PACKAGED_CONTEXT: Mapping[str, int] = {"all-minilm-l6-v2": 256}


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter a model's table names: served as the model name ``name``."""

    name: str
    path: str


@dataclass(frozen=True)
class ModelConfig:
    """One ``[[models]]`` table as written (None / empty: not given, the default applies)."""

    name: str
    aliases: tuple[str, ...] = ()
    model: str | None = None  # None: [engine].model
    task: Task | None = None  # None: the packaged model's task, else "generate"
    gpus: tuple[int, ...] = ()
    tensor_parallel_size: int = 1
    cpu_engines: int | None = None  # None: [engine].cpu_engines
    fallback: str = ""
    speculative: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # [engine] keys it sets
    # Models on demand (issue 23): policy/swap.py takes the turns.
    load: Load = "always"
    idle_unload_s: float = 900.0
    swap: Swap = "stop"
    load_timeout_s: float = 300.0
    min_residency_s: float = 30.0
    adapters: tuple[Adapter, ...] = ()


@dataclass(frozen=True)
class ServedModel:
    """A model as the appliance serves it: its table merged over ``[engine]``."""

    name: str  # what clients send, and vLLM's --served-model-name
    aliases: tuple[str, ...]
    model: str  # "" = the packaged SmolLM2; "packaged:NAME"; a folder; a cached model id
    task: Task
    gpus: tuple[int, ...] | None  # None: every GPU found ([engine] alone, gpus = "auto")
    tensor_parallel_size: int
    cpu_engines: int
    fallback: str
    speculative: Mapping[str, Any]
    engine: EngineConfig  # [engine] with this model's overrides applied
    load: Load = "always"
    idle_unload_s: float = 900.0
    swap: Swap = "stop"
    load_timeout_s: float = 300.0
    min_residency_s: float = 30.0
    adapters: tuple[Adapter, ...] = ()

    @property
    def on_demand(self) -> bool:
        return self.load == "on_demand"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _packaged_task(model: str) -> str | None:
    name = paths.packaged_name(model)
    known = paths.PACKAGED_MODELS.get(name) if name is not None else None
    return known.task if known is not None else None


def _with_packaged_context(engine: EngineConfig, model: str, overridden: bool) -> EngineConfig:
    name = paths.packaged_name(model)
    context = PACKAGED_CONTEXT.get(name) if name is not None else None
    if context is None or overridden or engine.max_model_len <= context:
        return engine
    return dataclasses.replace(engine, max_model_len=context)


def implicit_name(e: EngineConfig) -> str:
    """The one model's name without [[models]]: served_model_name, else from the model."""
    if e.served_model_name:
        return e.served_model_name
    packaged = paths.packaged_name(e.model)
    if packaged is not None:
        return packaged
    if not e.model:
        return paths.PACKAGED_MODEL_NAME
    return Path(e.model.rstrip("/")).name.lower() or "model"


def serve(engine: EngineConfig, models: Sequence[ModelConfig]) -> tuple[ServedModel, ...]:
    """The models to serve: each table merged over ``engine``, or ``engine`` alone."""
    if not models:
        task: Any = _packaged_task(engine.model) or "generate"
        return (
            ServedModel(
                name=implicit_name(engine),
                aliases=(),
                model=engine.model,
                task=task,
                gpus=None if engine.gpus == "auto" else tuple(engine.gpus),
                tensor_parallel_size=1,
                cpu_engines=engine.cpu_engines,
                fallback="",
                speculative={},
                engine=_with_packaged_context(engine, engine.model, False),
            ),
        )
    out = []
    for m in models:
        model = engine.model if m.model is None else m.model
        merged = dataclasses.replace(engine, **m.overrides)
        out.append(
            ServedModel(
                name=m.name,
                aliases=m.aliases,
                model=model,
                task=m.task or _packaged_task(model) or "generate",  # type: ignore[arg-type]
                # One model without gpus takes every GPU, as [engine] alone does.
                gpus=m.gpus or (None if len(models) == 1 else ()),
                tensor_parallel_size=m.tensor_parallel_size,
                cpu_engines=engine.cpu_engines if m.cpu_engines is None else m.cpu_engines,
                fallback=m.fallback,
                speculative=m.speculative,
                engine=_with_packaged_context(merged, model, "max_model_len" in m.overrides),
                load=m.load,
                idle_unload_s=m.idle_unload_s,
                swap=m.swap,
                load_timeout_s=m.load_timeout_s,
                min_residency_s=m.min_residency_s,
                adapters=m.adapters,
            )
        )
    return tuple(out)


# ---- the whole config -----------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The whole config: every section, and the models."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    models: tuple[ModelConfig, ...] = ()  # the [[models]] tables as written
    source: str = field(default="", metadata={"internal": True})
    # What is served: the tables merged over [engine] (or [engine] alone). Derived once
    # here, so every reader (and a reload's dataclasses.replace) sees the same merge.
    served: tuple[ServedModel, ...] = field(
        init=False, repr=False, compare=False, metadata={"internal": True}
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "served", serve(self.engine, self.models))

    def model(self, name: str) -> ServedModel | None:
        """The served model called ``name`` (its name or an alias), or None."""
        for m in self.served:
            if name in m.names:
                return m
        return None

    def engine_of(self, model: str) -> EngineConfig:
        """The [engine] keys in force for ``model`` (its overrides applied)."""
        found = self.model(model)
        return self.engine if found is None else found.engine

    def summary(self) -> str:
        e, g = self.engine, self.gateway
        scheme = "https" if g.tls_cert else "http"
        if self.models:
            what = "models: " + "; ".join(_model_summary(m, e.device) for m in self.served)
        else:
            engines = (
                f"{e.cpu_engines} cpu engine(s)"
                if e.device == "cpu"
                else f"gpus={e.gpus if e.gpus == 'auto' else ','.join(map(str, e.gpus))}"
            )
            what = f"{engines} model={e.model or 'packaged SmolLM2-135M-Instruct'}"
        return (
            f"config ok ({self.source or 'built-in defaults'}): device={e.device} {what} "
            f"gateway={scheme}://{g.host}:{g.port} telemetry={self.telemetry.source}"
        )


def _model_summary(m: ServedModel, device: str) -> str:
    where = (
        f"{m.cpu_engines} cpu engine(s)"
        if device == "cpu"
        else f"gpus={'auto' if m.gpus is None else ','.join(map(str, m.gpus))}"
    )
    tp = f" tp={m.tensor_parallel_size}" if m.tensor_parallel_size > 1 else ""
    model = m.model or "packaged SmolLM2-135M-Instruct"
    return f"model {m.name} ({m.task}): {where}{tp} model={model}"
