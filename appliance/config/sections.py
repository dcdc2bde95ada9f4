"""The config's sections: one frozen dataclass per TOML table, each field with its default,
the sentence that documents it, its bounds and whether a SIGHUP applies it (``live``).

The defaults are the contract's. ``docs/configuration.md`` is generated from the field
docs (``python -m appliance.config --markdown``) and a test fails when it is stale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from appliance.config.field_spec import config_field as _f
from appliance.config.gateway_section import GatewayConfig as GatewayConfig  # re-exported

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
        "`interactive` key, 10 for a `batch` key; lower is served first), so a batch "
        "flood already inside the engine does not hold back an interactive request, and "
        "a client's own `priority` is replaced. `fcfs`: vLLM's first-come first-served; "
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
