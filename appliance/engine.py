"""An engine: what it is (spec), where it is in its life (state), and how it is started.

The lifecycle is one enum with an explicit table of allowed moves, so "is it serving?"
has one answer and an impossible move is a bug that raises instead of a flag quietly
out of step with another flag::

        ┌──────────── EXITED ◄─────────────────────────┐
        │ (spawn)       │ (restart budget spent)       │ (process gone)
        ▼               ▼                              │
    STARTING ──► READY ◄──► DRAINING ──► STOPPING ─────┘
        │         ▲  │                      ▲
        │ (a check │  │ (a failed check)     │   (crash, hang, restart, shutdown)
        │  passes) │  ▼                      │
        │        SUSPECT ───────────────────┤
        └───────────────────────────────────┘
    FAILED ──(admin restart)──► STARTING | EXITED (on demand: its model not loaded)
    DRAINING ──► SLEEPING ──► READY (woken) | STOPPING | EXITED   (swap = "sleep")

SUSPECT is a READY engine that failed its last health check: it gets no new work at
once (a frozen engine would otherwise be offered requests until it is declared hung,
several checks later), goes back to READY on the next good check, and is replaced only
after ``health.failures_to_restart`` failed checks in a row, as before.

Only an engine's runner moves its state; everyone else reads
:class:`appliance.control.EngineStatus` copies.
Building the command line is a pure function here, so it is tested without processes;
what a CPU engine gets (its cores, its dtype, its preloaded libraries) is engine_cpu.py's.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from appliance.config import EngineConfig, ServedModel
from appliance.endpoint import EngineAddress
from appliance.engine_cpu import choose_cpu_dtype, ld_preload
from appliance.errors import IllegalTransition

# Stands for the engine key in an argv built before the key exists: each spawn gets a
# new key (a key that leaked from one run is worthless to the next), so a command using
# the {api_key} placeholder is completed at spawn time by :meth:`EngineSpec.argv_with_key`.
API_KEY_SLOT = "\x00api_key\x00"


class EngineState(enum.Enum):
    STARTING = "STARTING"  # process spawned, model loading, not yet answering a probe
    READY = "READY"  # answers a real completion; takes new work
    SUSPECT = "SUSPECT"  # failed its last health check; no new work until one passes
    DRAINING = "DRAINING"  # alive, takes no new work; in-flight work finishes
    STOPPING = "STOPPING"  # SIGTERM sent to its process tree
    EXITED = "EXITED"  # no process; will be (re)started after backoff
    FAILED = "FAILED"  # restart budget spent; stays down until an admin restarts it
    SLEEPING = "SLEEPING"  # on demand, swap = "sleep": vLLM asleep, GPU memory freed

    @property
    def accepts_work(self) -> bool:
        return self is EngineState.READY


ALLOWED_TRANSITIONS: Mapping[EngineState, frozenset[EngineState]] = {
    EngineState.STARTING: frozenset({EngineState.READY, EngineState.STOPPING, EngineState.EXITED}),
    EngineState.READY: frozenset(
        {EngineState.SUSPECT, EngineState.DRAINING, EngineState.STOPPING, EngineState.EXITED}
    ),
    EngineState.SUSPECT: frozenset(
        {EngineState.READY, EngineState.DRAINING, EngineState.STOPPING, EngineState.EXITED}
    ),
    EngineState.DRAINING: frozenset(
        {EngineState.READY, EngineState.STOPPING, EngineState.EXITED, EngineState.SLEEPING}
    ),
    # Woken (READY), stopped while asleep, or died asleep.
    EngineState.SLEEPING: frozenset({EngineState.READY, EngineState.STOPPING, EngineState.EXITED}),
    EngineState.STOPPING: frozenset({EngineState.EXITED}),
    EngineState.EXITED: frozenset({EngineState.STARTING, EngineState.FAILED}),
    # An admin's restart: started at once, or (its on-demand model not loaded) down
    # until the model is next loaded.
    EngineState.FAILED: frozenset({EngineState.STARTING, EngineState.EXITED}),
}


def check_transition(old: EngineState, new: EngineState) -> None:
    if new not in ALLOWED_TRANSITIONS[old]:
        raise IllegalTransition(f"engine state {old.value} -> {new.value} is not allowed")


class RestartReason(enum.Enum):
    """Why an engine was (re)started; the label of appliance_engine_restarts_total."""

    CRASH = "crash"  # it could not be started, or what listens at its address is not it
    EXITED = "exited"  # the process exited by itself (its status in last_exit)
    SIGNAL = "signal"  # killed by a signal the supervisor did not send
    OOM = "oom"  # killed by SIGKILL while an OOM kill counter rose: the OOM killer
    BIND_FAILED = "bind_failed"  # it could not bind its address
    LOAD_FAILED = "load_failed"  # it could not load the model (vLLM's EngineCore failed)
    HUNG = "hung"  # alive but no token came back and none were flowing
    STARTUP_TIMEOUT = "startup_timeout"
    DEGRADED = "degraded"  # the degradation detector's verdict
    HEAT = "heat"  # sustained heat: restarted with fewer batched tokens (or restored)
    ADMIN = "admin"  # POST /admin/engines/{id}/restart
    UNLOAD = "unload"  # its on-demand model was put away: a stop, never counted as a restart


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to launch engine ``id``; fixed for the life of the daemon."""

    id: int
    gpu: int | None  # its first CUDA index, or None on CPU
    address: EngineAddress
    argv: tuple[str, ...]  # may hold API_KEY_SLOT: see argv_with_key
    tag: str  # LLM_APPLIANCE_ENGINE value inherited by its whole tree
    env: Mapping[str, str] = field(default_factory=dict)  # VLLM_API_KEY added per spawn
    served_model_name: str = ""
    # CPU engines: the cores its whole process tree is pinned to (None: not pinned).
    cpus: tuple[int, ...] | None = None
    model: str = ""  # the served model's name ([[models]] name, or the one model's)
    gpus: tuple[int, ...] = ()  # all its CUDA indices (tensor parallel: several)
    task: str = "generate"  # "generate" | "embed"
    on_demand: bool = False  # its model loads on demand: planned, spawned when loaded
    lora_rank: int = 0  # its --max-lora-rank (0: LoRA off): what adapters it can take

    @property
    def name(self) -> str:
        return f"engine{self.id}"

    @property
    def port(self) -> int | None:
        return self.address.port

    def argv_with_key(self, api_key: str) -> tuple[str, ...]:
        return tuple(a.replace(API_KEY_SLOT, api_key) for a in self.argv)

    def env_with_key(self, api_key: str) -> dict[str, str]:
        # The key travels in the environment: a command line is readable by every local
        # user (ps, /proc/N/cmdline), another user's environment is not.
        return {**self.env, "VLLM_API_KEY": api_key}


# Which appliance an engine belongs to, beside its per-engine tag (LLM_APPLIANCE_ENGINE):
# a supervisor that starts again finds what its previous life left by these (see
# appliance.supervisor.leftovers). Engines of older versions carry the tag only.
INSTANCE_ENV = "LLM_APPLIANCE_INSTANCE"
SUPERVISOR_ENV = "LLM_APPLIANCE_SUPERVISOR"


def instance_id(keys_file: str) -> str:
    """The appliance's identity: its keys file's absolute path, hashed. The keys file is
    its state (one per appliance, fixed across restarts, whatever --config names it), and
    two appliances sharing one would share their users too, so they are one appliance."""
    path = os.path.realpath(os.path.expanduser(keys_file))
    return hashlib.sha256(path.encode()).hexdigest()[:16]


def lineage_env(instance: str, supervisor_pid: int, supervisor_started: float) -> dict[str, str]:
    """What each engine's environment says of who started it: the appliance, and the
    supervisor process (pid and start time, so a reused pid is not taken for it)."""
    return {INSTANCE_ENV: instance, SUPERVISOR_ENV: f"{supervisor_pid}@{supervisor_started:.2f}"}


def new_api_key() -> str:
    """A per-spawn engine key: URL-safe and never starting with '-' (argv would eat it)."""
    return "eng-" + secrets.token_urlsafe(32)


def build_argv(
    served: ServedModel,
    *,
    python: str,
    model: str,
    address: EngineAddress,
    gpus: Sequence[int],
    on_gpu: bool,
    cpu_flags: Collection[str] = (),
    speculative_json: str = "",
) -> tuple[str, ...]:
    """The engine's command line: vLLM's OpenAI server, or the model's `command` override.

    ``served`` is the model with its [engine] keys merged; ``model`` the resolved path or
    id. The engine key is not in it (it goes in the environment); a `command` that asks
    for it with {api_key} gets :data:`API_KEY_SLOT`, filled in at each spawn. ``cpu_flags``
    (a CPU engine's processor flags) pick its dtype: see :func:`choose_cpu_dtype`.
    ``speculative_json`` is the model's --speculative-config with local paths resolved.
    """
    e = served.engine
    if e.command:
        return _custom_command(served, python, model, address, gpus)
    # The key goes in the environment (VLLM_API_KEY), not here: any local user can read
    # a command line.
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served.name,
        *_listen_args(address),
        "--max-model-len",
        str(e.max_model_len),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        # One access-log line per request would drown the journal at LLM request rates;
        # the gateway counts requests in its metrics instead.
        "--disable-uvicorn-access-log",
        *_model_args(served, speculative_json),
        *_device_args(e, on_gpu, cpu_flags),
        *scheduling_args(e),
        *e.extra_args,
    ]
    return tuple(argv)


def scheduling_args(e: EngineConfig) -> list[str]:
    """vLLM's priority scheduler when ``scheduling`` asks for it (the gateway then sends
    each request's ``priority``); vLLM's own default is fcfs. The admin's own
    --scheduling-policy in extra_args wins."""
    if e.scheduling != "priority" or _sets(e.extra_args, "--scheduling-policy"):
        return []
    return ["--scheduling-policy", "priority"]


def _listen_args(address: EngineAddress) -> list[str]:
    """Where vLLM listens: a Unix socket, else 127.0.0.1 and the engine's port (vLLM
    ignores --host/--port when --uds is given)."""
    if address.uds is not None:
        return ["--uds", address.uds]
    return ["--host", "127.0.0.1", "--port", str(address.port)]


def _custom_command(
    served: ServedModel, python: str, model: str, address: EngineAddress, gpus: Sequence[int]
) -> tuple[str, ...]:
    """The model's `command`, its placeholders filled in (the key stays a slot)."""
    values = {
        "python": python,
        "model": model,
        "uds": address.uds or "",
        "port": "" if address.port is None else str(address.port),
        "gpu": ",".join(map(str, gpus)),
        "api_key": API_KEY_SLOT,
        "served_model_name": served.name,
    }
    return tuple(arg.format(**values) for arg in served.engine.command)


def _model_args(served: ServedModel, speculative_json: str) -> list[str]:
    """What the model's own keys add: its runner, tensor parallelism, speculation, and
    its tool-call and reasoning parsers (generate models only: a pooling runner has no
    chat to parse, and [engine]'s parsers are every generate model's default)."""
    args = []
    e = served.engine
    if served.task == "embed":
        args += ["--runner", "pooling"]  # vLLM 0.32: serves /v1/embeddings, not chat
    else:
        if e.tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", e.tool_call_parser]
        if e.reasoning_parser:
            args += ["--reasoning-parser", e.reasoning_parser]
        args += request_guard_args(e)
    if served.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(served.tensor_parallel_size)]
    if speculative_json:
        args += ["--speculative-config", speculative_json]
    return args


# A host under the reserved .invalid domain (RFC 6761): it never resolves, so naming it
# alone in --allowed-media-domains makes the engine fetch no http(s) media at all.
NO_MEDIA_HOST = "media.invalid"


def request_guard_args(e: EngineConfig) -> list[str]:
    """What bounds the work one request can make a generate engine do (docs/security.md),
    each left to the admin's own flag in extra_args when there is one:

    - the structured-output backend (``structured_outputs_backend``): vLLM's default picks
      xgrammar, whose schema compile has no time limit, so one small schema could keep
      every structured request waiting until a restart;
    - the hosts it may fetch media from (``allowed_media_domains``): vLLM fetches any
      http(s) URL when the flag is absent (an empty list means "all" there), so with
      none allowed it gets the one host that never resolves. The gateway refuses such
      URLs first (protocols/media.py); this is the engine's own line behind it.
    """
    args = []
    if _our_backend(e):
        backend = json.dumps({"backend": e.structured_outputs_backend}, separators=(",", ":"))
        args += ["--structured-outputs-config", backend]
    if not _sets(e.extra_args, "--allowed-media-domains"):
        args += ["--allowed-media-domains", *(e.allowed_media_domains or [NO_MEDIA_HOST])]
    return args


def request_guard_env(e: EngineConfig) -> dict[str, str]:
    """The environment that goes with :func:`request_guard_args`."""
    # A media URL on an allowed host must not redirect the engine's fetch to one that
    # is not (vLLM 0.32 follows redirects unless told not to).
    env = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
    if _our_backend(e) and e.structured_outputs_backend == "guidance":
        # vLLM 0.32 constrains tool calls (tool_choice "required", a named tool, strict
        # tools) with xgrammar's structural tags, which its guidance backend cannot read
        # (a 400 "Invalid grammar specification: 'triggers'"). Off, they are constrained
        # by a JSON schema of the tools instead, which guidance compiles.
        env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
    return env


def _our_backend(e: EngineConfig) -> bool:
    """Whether the engine runs with our --structured-outputs-config (not the admin's)."""
    return not e.command and not _sets(e.extra_args, "--structured-outputs-config")


def _sets(extra_args: Sequence[str], flag: str) -> bool:
    """Whether ``extra_args`` sets ``flag`` (``--flag v``, ``--flag=v``, ``--flag.key v``)."""
    return any(a == flag or a.startswith((flag + "=", flag + ".")) for a in extra_args)


TRUST_REMOTE_CODE = "--trust-remote-code"


def trusts_remote_code(argv: Sequence[str]) -> bool:
    """Whether an engine started with ``argv`` runs its model repository's own Python
    (vLLM's ``--trust-remote-code``, from ``extra_args`` or a model's own ``command``):
    what `status` marks. vLLM takes underscores for dashes and the last of
    ``--trust-remote-code`` and ``--no-trust-remote-code``."""
    trusts = False
    for arg in argv:
        flag = arg.replace("_", "-")
        if flag == TRUST_REMOTE_CODE:
            trusts = True
        elif flag == "--no-" + TRUST_REMOTE_CODE[2:]:
            trusts = False
    return trusts


def _device_args(e: EngineConfig, on_gpu: bool, cpu_flags: Collection[str]) -> list[str]:
    if on_gpu:
        return ["--gpu-memory-utilization", f"{e.gpu_memory_utilization:g}"]
    # CPU: the dtype the processor computes natively (an explicit one in extra_args
    # wins: argparse would take the last, but one --dtype reads better in `ps`); eager
    # mode starts in ~35 s instead of ~2 min of torch.compile that is not cached
    # between starts on these machines.
    dtype = choose_cpu_dtype(cpu_flags, e.extra_args)
    return [*([] if dtype.explicit else ["--dtype", dtype.dtype]), "--enforce-eager"]


def build_env(
    engine: EngineConfig,
    base: Mapping[str, str],
    *,
    gpus: Sequence[int],
    cpu_bind: str | None,
    engine_tag: str,
    preload: Sequence[str] = (),
) -> dict[str, str]:
    """The engine's environment, built explicitly from a cleaned base.

    ``preload`` (CPU engines only): the libraries found for LD_PRELOAD (see
    :func:`appliance.plan.cpu_preload_libs`); an LD_PRELOAD in engine.env replaces them.

    ``base`` must already lack systemd's variables (NOTIFY_SOCKET, WATCHDOG_*): an engine
    that pinged our watchdog or sent READY for us would lie to systemd.
    ``engine_tag`` is inherited by every process vLLM forks, which is how the supervisor
    finds an engine's whole tree even after its API server died and orphaned the rest.
    """
    env = dict(base)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",  # nothing is fetched from a hub at run time
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",  # engine lines reach the journal as they happen
            "LLM_APPLIANCE_ENGINE": engine_tag,
            # The Responses API's store (store: true, previous_response_id, retrieve,
            # cancel): off in vLLM 0.32 unless set, and then store is silently ignored.
            # Its store is in the engine's memory, unbounded (docs/api.md): the model's
            # responses_store turns it off (the gateway reads the same key).
            "VLLM_ENABLE_RESPONSES_API_STORE": "1" if engine.responses_store else "0",
        }
    )
    env.update(request_guard_env(engine))
    if gpus:
        # NVML numbers GPUs by PCI bus; CUDA by default fastest-first. Pin CUDA to the
        # same order so an engine's GPUs pair with those GPUs' temperatures.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{engine.cpu_kvcache_space_gib:g}"
        if cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if preload:
            env["LD_PRELOAD"] = ld_preload(preload, env.get("LD_PRELOAD", ""))
    env.update(engine.env)
    return env


def with_batched_tokens(argv: tuple[str, ...], tokens: int | None) -> tuple[str, ...]:
    """``argv`` with ``--max-num-batched-tokens`` set to ``tokens`` (None: unchanged)."""
    if tokens is None or "--max-num-batched-tokens" not in argv:
        return argv
    i = argv.index("--max-num-batched-tokens")
    return (*argv[: i + 1], str(tokens), *argv[i + 2 :])
