"""The appliance's configuration: TOML in, frozen dataclasses out, loaded once at the edge.

Every key is optional; the defaults are the contract's. Validation collects *every*
problem before failing, and each message names the key path, the value it saw and what
is allowed, because the person reading it is an admin at a terminal (or Ansible's
``validate:``), not a developer. Unknown keys are errors too: a typo such as
``max_infligth`` must not silently leave the default in force.

Each field carries a ``doc`` in its metadata; ``docs/configuration.md`` is generated
from those (``python -m appliance.config --markdown``) and a test fails when it is stale.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import string
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from appliance.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/llm-appliance/config.toml")
CONFIG_ENV = "LLM_APPLIANCE_CONFIG"
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


def _f(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    live: bool = False,
) -> Any:
    """A config field: its default, the sentence that documents it, numeric bounds, and
    ``live``: a SIGHUP puts a new value in force in the running daemon.

    Mark a field live only when every use of it reads the running config at the time of
    use (never a copy made at start-up): tests/unit/test_live_keys.py checks each one.
    """
    meta = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "live": live}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


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
        "refused with 400 (never silently clamped). A chat request without "
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
        "it is closed. Answers are never timed: long streams to slow readers go on. An "
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


@dataclass(frozen=True)
class TelemetryConfig:
    source: str = _f(
        "nvml",
        "`nvml`, `none`, or `file:/path/sensors.json` (re-read every "
        "interval; stands in for NVML without hardware).",
    )
    interval_s: float = _f(1.0, "How often GPUs are read.", lo=0.05, hi=3600, live=True)


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
    heat_restart_after_s: float = _f(
        0.0,
        "0 = off. A GPU at the hard limit this long gets its engine drained and restarted "
        "with --max-num-batched-tokens halved (smaller batches, lower power); restored "
        "the same way after heat_restore_after_s at level 0. Pays off when a card "
        "cannot cool at full batch (poor airflow, hot room); otherwise the admission "
        "throttle alone is cheaper than a restart.",
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
        "More unplanned restarts (crash, hung, startup_timeout) than this within an hour "
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


@dataclass(frozen=True)
class Config:
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    source: str = field(default="", metadata={"internal": True})

    def summary(self) -> str:
        e, g = self.engine, self.gateway
        engines = (
            f"{e.cpu_engines} cpu engine(s)"
            if e.device == "cpu"
            else f"gpus={e.gpus if e.gpus == 'auto' else ','.join(map(str, e.gpus))}"
        )
        scheme = "https" if g.tls_cert else "http"
        return (
            f"config ok ({self.source or 'built-in defaults'}): device={e.device} "
            f"{engines} model={e.model or 'packaged SmolLM2-135M-Instruct'} "
            f"gateway={scheme}://{g.host}:{g.port} telemetry={self.telemetry.source}"
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


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _describe(tp: Any) -> str:
    """What a type allows, in the words of a TOML user."""
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(_show(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_describe(get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return "a table of string values"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    return str(tp)


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted) for a TOML value against a field type; no implicit string parsing."""
    origin = get_origin(tp)
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        # TOML integers are unbounded; one too big for a float is just out of range.
        ok = ok and abs(value) <= sys.float_info.max and math.isfinite(value)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if origin is Literal:
        return value in get_args(tp) and isinstance(value, str | int), value
    if origin is list:
        (item,) = get_args(tp)
        if not isinstance(value, list):
            return False, value
        out = []
        for v in value:
            ok, c = _coerce(v, item)
            if not ok:
                return False, value
            out.append(c)
        return True, out
    if origin is dict:
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        )
        return ok, dict(value) if ok else value
    if origin in (typing.Union, types.UnionType):
        for alt in get_args(tp):
            ok, c = _coerce(value, alt)
            if ok:
                return True, c
        return False, value
    raise TypeError(f"unsupported config type {tp!r}")  # a bug in this module, not in input


def _unknown(path: str, key: str, allowed: list[str]) -> str:
    near = difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"{path}{key}: unknown key{hint}; allowed keys: {', '.join(allowed)}"


def _build_section(name: str, cls: type[Any], raw: Any, problems: list[str]) -> Any:
    if not isinstance(raw, dict):
        problems.append(f"[{name}]: must be a table, got {_show(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in fields:
            problems.append(_unknown(f"{name}.", key, list(fields)))
            continue
        tp, meta = hints[key], fields[key].metadata
        ok, converted = _coerce(value, tp)
        if not ok:
            problems.append(f"{name}.{key} = {_show(value)}: must be {_describe(tp)}")
            continue
        lo, hi, lo_open = meta.get("lo"), meta.get("hi"), meta.get("lo_open")
        if isinstance(converted, (int, float)) and not isinstance(converted, bool):
            if lo is not None and (converted <= lo if lo_open else converted < lo):
                rel = ">" if lo_open else ">="
                bound = f"{rel} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
                problems.append(f"{name}.{key} = {_show(value)}: must be {bound}")
                continue
            if hi is not None and converted > hi:
                low = f"{'>' if lo_open else '>='} {lo:g} and " if lo is not None else ""
                problems.append(f"{name}.{key} = {_show(value)}: must be {low}<= {hi:g}")
                continue
        values[key] = converted
    return cls(**values)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_command_listens(e: EngineConfig, problems: list[str]) -> None:
    """A custom command must tell its engine where to listen, or nothing can reach it."""
    need = "uds" if e.listen == "unix" else "port"
    if e.command and not any("{" + need + "}" in arg for arg in e.command):
        problems.append(
            f"engine.command: has no {{{need}}} placeholder, so the engine cannot know "
            f'where to listen with engine.listen = "{e.listen}" (add "--{need}", '
            f'"{{{need}}}"'
            + (', or set engine.listen = "tcp" and use {port})' if need == "uds" else ")")
        )


def _cross_check(cfg: Config, problems: list[str]) -> None:
    g, e, t, th, r = cfg.gateway, cfg.engine, cfg.telemetry, cfg.thermal, cfg.restart
    if not _is_loopback(g.host) and not g.allow_lan:
        problems.append(
            f"gateway.host = {_show(g.host)}: a non-loopback address needs "
            "gateway.allow_lan = true (and should use tls_cert/tls_key)"
        )
    if bool(g.tls_cert) != bool(g.tls_key):
        problems.append("gateway.tls_cert / gateway.tls_key: set both for HTTPS, or neither")
    if g.keys_file == "":
        problems.append('gateway.keys_file = "": must be a file path')
    if isinstance(e.gpus, list):
        if not e.gpus:
            problems.append('engine.gpus = []: must be "auto" or a non-empty list of GPU indices')
        elif len(set(e.gpus)) != len(e.gpus) or any(i < 0 or i >= 64 for i in e.gpus):
            problems.append(f"engine.gpus = {e.gpus!r}: indices must be distinct and 0..63")
        elif len(e.gpus) > MAX_GPUS:
            problems.append(f"engine.gpus = {e.gpus!r}: at most {MAX_GPUS} GPUs")
        if e.device == "cpu":
            problems.append(
                'engine.gpus: a GPU list needs engine.device = "cuda" or "auto" '
                '(with device = "cpu" use engine.cpu_engines)'
            )
    gpu_engines = len(e.gpus) if isinstance(e.gpus, list) else MAX_GPUS
    # With device = "auto" the machine decides: GPUs if it has them, else CPU engines.
    count = {"cpu": e.cpu_engines, "cuda": gpu_engines}.get(
        e.device, max(gpu_engines, e.cpu_engines)
    )
    if e.port_base + count - 1 > 65535:
        problems.append(f"engine.port_base = {e.port_base}: engine ports would pass 65535")
    elif e.listen == "tcp" and e.port_base <= g.port < e.port_base + count:
        problems.append(
            f"gateway.port = {g.port}: collides with engine ports "
            f"{e.port_base}..{e.port_base + count - 1} (engine.port_base)"
        )
    _check_command_listens(e, problems)
    for i, arg in enumerate(e.command):
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(arg) if f is not None]
        except ValueError as exc:
            problems.append(
                f"engine.command[{i}] = {_show(arg)}: {exc} (write a literal brace as {{{{ or }}}})"
            )
            continue
        for name in names:
            if name not in COMMAND_PLACEHOLDERS:
                problems.append(
                    f"engine.command[{i}] = {_show(arg)}: unknown placeholder "
                    f"{{{name}}}; allowed: "
                    + " ".join(f"{{{p}}}" for p in sorted(COMMAND_PLACEHOLDERS))
                )
    for key in e.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            problems.append(f"engine.env.{key}: not a valid environment variable name")
        elif key in RESERVED_ENGINE_ENV or key.startswith("WATCHDOG_"):
            problems.append(
                f"engine.env.{key}: set by the supervisor and not overridable "
                f"(reserved: {', '.join(sorted(RESERVED_ENGINE_ENV))}, WATCHDOG_*)"
            )
    if not (t.source in ("nvml", "none") or (t.source.startswith("file:") and len(t.source) > 5)):
        problems.append(
            f'telemetry.source = {_show(t.source)}: must be one of "nvml", '
            '"none", "file:/path/sensors.json"'
        )
    if th.hard_limit_c <= th.soft_limit_c:
        problems.append(
            f"thermal.hard_limit_c = {th.hard_limit_c:g}: must be above "
            f"thermal.soft_limit_c ({th.soft_limit_c:g})"
        )
    d = cfg.degradation
    for name in ("hang_s", "leak_hold_s"):
        if getattr(d, name) > d.window_s:
            problems.append(
                f"degradation.{name} = {getattr(d, name):g}: must be <= "
                f"degradation.window_s ({d.window_s:g})"
            )
    if r.backoff_max_s < r.backoff_initial_s:
        problems.append(
            f"restart.backoff_max_s = {r.backoff_max_s:g}: must be >= "
            f"restart.backoff_initial_s ({r.backoff_initial_s:g})"
        )


def _placeholders(arg: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(arg) if f is not None}
    except ValueError:
        return set()  # a config problem of its own, named by _cross_check


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but unwise, each with what to do instead.

    ``check-config`` prints them after its summary (still exit 0) and ``serve`` logs them
    at WARNING when it starts: they are choices an admin may make on purpose, so they
    never stop the service.
    """
    warnings: list[str] = []
    g, e = cfg.gateway, cfg.engine
    if not _is_loopback(g.host) and not g.tls_cert:
        warnings.append(
            f"gateway.host = {_show(g.host)} (allow_lan = true) without tls_cert/tls_key: "
            "API keys, prompts and answers cross the network in clear text, readable "
            "and replayable by anyone on the path; set gateway.tls_cert and "
            "gateway.tls_key (docs/security.md)"
        )
    for i, arg in enumerate(e.command):
        if "api_key" in _placeholders(arg):
            warnings.append(
                f"engine.command[{i}] = {_show(arg)}: {{api_key}} puts the engine key on a "
                "command line, which every local user can read (ps, /proc/PID/cmdline); "
                "remove it: the engine gets its key in VLLM_API_KEY"
            )
    return warnings


def parse_config(raw: Mapping[str, Any], source: str = "") -> Config:
    """Validate a parsed TOML document; raise ConfigError naming every problem."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            problems.append(
                _unknown("", name, [f"[{s}]" for s in SECTIONS]).replace(
                    f"{name}:", f"[{name}]:", 1
                )
            )
            continue
        sections[name] = _build_section(name, SECTIONS[name], value, problems)
    cfg = Config(**sections, source=source)
    _cross_check(cfg, problems)
    if problems:
        raise ConfigError(problems, source)
    return cfg


def resolve_config_path(
    explicit: str | None, env: Mapping[str, str] | None = None
) -> tuple[Path | None, bool]:
    """(path, must_exist): --config must exist; the env var and the default may be absent."""
    env = os.environ if env is None else env
    if explicit:
        return Path(explicit), True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), False
    return DEFAULT_CONFIG_PATH, False


def load_config(
    explicit: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    require_file: bool = False,
) -> Config:
    """The config from --config, $LLM_APPLIANCE_CONFIG or the default path.

    A missing env/default file means the built-in defaults, except with ``require_file``
    (a reload of a daemon that runs from a file: a file renamed away by an editor or a
    half-finished deploy must not silently put every default back in force).
    """
    path, must_exist = resolve_config_path(explicit, env)
    if path is None or not path.exists():
        if must_exist:
            raise ConfigError([f"--config {path}: no such file"], str(path))
        if require_file:
            raise ConfigError([f"{path}: no such file (the running config came from a file)"])
        return Config()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot be read ({exc})"], str(path)) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML ({exc})"], str(path)) from None
    return parse_config(raw, str(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return f"{value:g}" if value != int(value) else f"{value:.1f}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def config_markdown() -> str:
    """docs/configuration.md, generated from the field docs so it never drifts."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m appliance.config --markdown`; do not edit by hand. -->",
        "",
        "The config is TOML. `llm-appliance` reads `--config PATH`, else "
        f"`${CONFIG_ENV}`, else `{DEFAULT_CONFIG_PATH}`; with none present the built-in "
        "defaults below apply. Every key is optional. Unknown keys and bad values are "
        "errors: `llm-appliance check-config` names each one (key, value, what is allowed) "
        "and exits 2.",
        "",
        "The *live* column says what puts a changed key in force. **yes**: "
        "`systemctl reload llm-appliance` (SIGHUP) applies it while the engines keep "
        "running, from its next use on (a start, drain or queue wait already under way may "
        "finish with the limit it began with). **no, restart**: only `systemctl restart "
        "llm-appliance` does; a reload leaves it as it was and logs that it needs a "
        "restart.",
        "",
    ]
    for name, cls in SECTIONS.items():
        lines += [
            f"## [{name}]",
            "",
            "| key | default | type | live (SIGHUP) | what it does |",
            "|---|---|---|---|---|",
        ]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            live = "yes" if f.metadata["live"] else "no, restart"
            doc = f.metadata["doc"].replace("|", "\\|")
            lines.append(
                f"| `{f.name}` | `{_toml_value(default)}` | {_describe(hints[f.name])} "
                f"| {live} | {doc} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - documentation generator
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(config_markdown())
    else:
        sys.exit("usage: python -m appliance.config --markdown")
