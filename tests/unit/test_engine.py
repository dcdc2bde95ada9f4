"""The engine lifecycle table, the engine command line, environment and helpers."""

from __future__ import annotations

import dataclasses
import itertools
import re
import urllib.parse
from collections.abc import Collection
from typing import Any

import pytest

from appliance.config import Config, parse_config
from appliance.endpoint import EngineAddress
from appliance.engine import (
    ALLOWED_TRANSITIONS,
    API_KEY_SLOT,
    EngineState,
    build_argv,
    build_env,
    check_transition,
    new_api_key,
    trusts_remote_code,
)
from appliance.engine_cpu import choose_cpu_dtype, cpu_core_sets, omp_bind
from appliance.errors import ConfigError, IllegalTransition

S = EngineState

# The lifecycle as documented (engine.py's diagram and the contract), written out here
# independently of the module's table.
EXPECTED_MOVES = {
    (S.STARTING, S.READY),  # answered a real completion
    (S.STARTING, S.STOPPING),  # startup timeout or shutdown
    (S.STARTING, S.EXITED),  # died while loading
    (S.READY, S.DRAINING),  # restart or admin drain
    (S.READY, S.STOPPING),  # hung, or fast shutdown
    (S.READY, S.EXITED),  # crashed
    (S.READY, S.SUSPECT),  # a failed health check: no new work
    (S.SUSPECT, S.READY),  # the next check passed
    (S.SUSPECT, S.DRAINING),  # admin drain or planned restart
    (S.SUSPECT, S.STOPPING),  # hung: failures_to_restart checks failed
    (S.SUSPECT, S.EXITED),  # crashed
    (S.DRAINING, S.READY),  # admin resume
    (S.DRAINING, S.STOPPING),  # drained
    (S.DRAINING, S.EXITED),  # crashed while draining
    (S.STOPPING, S.EXITED),  # its process tree is gone
    (S.EXITED, S.STARTING),  # restarted after backoff
    (S.EXITED, S.FAILED),  # restart budget spent
    (S.FAILED, S.STARTING),  # admin restart
    (S.FAILED, S.EXITED),  # admin restart, its on-demand model not loaded
    (S.DRAINING, S.SLEEPING),  # on demand, swap = "sleep": drained, then put to sleep
    (S.SLEEPING, S.READY),  # woken: its model is wanted again
    (S.SLEEPING, S.STOPPING),  # unloaded for good, or the daemon stops
    (S.SLEEPING, S.EXITED),  # died asleep
}
ALL_PAIRS = list(itertools.product(EngineState, repeat=2))


def test_lifecycle_has_the_contract_states() -> None:
    names = {s.value for s in EngineState}
    assert {"STARTING", "READY", "DRAINING", "STOPPING", "EXITED", "FAILED"} <= names
    assert all(s.name == s.value for s in EngineState)  # /admin/status shows capitals


def test_allowed_table_is_the_documented_lifecycle() -> None:
    table = {(a, b) for a, targets in ALLOWED_TRANSITIONS.items() for b in targets}
    assert table == EXPECTED_MOVES
    assert set(ALLOWED_TRANSITIONS) == set(EngineState)


@pytest.mark.parametrize(
    ("old", "new"), ALL_PAIRS, ids=[f"{a.value}->{b.value}" for a, b in ALL_PAIRS]
)
def test_transition_matrix(old: EngineState, new: EngineState) -> None:
    if (old, new) in EXPECTED_MOVES:
        check_transition(old, new)
    else:
        with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
            check_transition(old, new)


def test_only_ready_accepts_work() -> None:
    assert [s for s in EngineState if s.accepts_work] == [S.READY]


# ---------------------------------------------------------------------------------------
# build_argv
# ---------------------------------------------------------------------------------------

PY = "/opt/engine-venv/bin/python"
MODEL = "/var/lib/llm-appliance/models/SmolLM2-135M-Instruct"
KEY = "eng-secretkey"


SOCK = "/run/llm-appliance/engine0.sock"


def argv_for(
    cfg: Config,
    *,
    gpu: int | None,
    port: int | None = None,
    uds: str | None = None,
    cpu_flags: Collection[str] = (),
) -> tuple[str, ...]:
    """The spawned argv (the key filled in as a spawn does)."""
    address = EngineAddress(port=port) if port is not None else EngineAddress(uds=uds or SOCK)
    spec_argv = build_argv(
        dataclasses.replace(cfg.served[0], name="smol"),
        python=PY,
        model=MODEL,
        address=address,
        gpus=() if gpu is None else (gpu,),
        on_gpu=gpu is not None,
        cpu_flags=cpu_flags,
    )
    return tuple(a.replace(API_KEY_SLOT, KEY) for a in spec_argv)


def option(argv: tuple[str, ...], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("gpu", [0, None], ids=["gpu", "cpu"])
def test_argv_common_part(gpu: int | None) -> None:
    cfg = parse_config({"engine": {"max_model_len": 2048, "max_num_batched_tokens": 4096}})
    argv = argv_for(cfg, gpu=gpu)
    assert argv[:3] == (PY, "-m", "vllm.entrypoints.openai.api_server")
    assert option(argv, "--model") == MODEL
    assert option(argv, "--served-model-name") == "smol"
    # A Unix socket by default; vLLM then ignores --host and --port.
    assert option(argv, "--uds") == SOCK
    assert "--host" not in argv and "--port" not in argv
    # The key travels in the environment: a command line is readable by every user.
    assert "--api-key" not in argv and KEY not in argv
    assert option(argv, "--max-model-len") == "2048"
    assert option(argv, "--max-num-batched-tokens") == "4096"
    assert all(isinstance(a, str) for a in argv)


def test_argv_over_tcp_binds_loopback_on_its_port() -> None:
    argv = argv_for(parse_config({"engine": {"listen": "tcp"}}), gpu=0, port=8123)
    assert option(argv, "--host") == "127.0.0.1"
    assert option(argv, "--port") == "8123"
    assert "--uds" not in argv


@pytest.mark.parametrize(("util", "shown"), [(0.9, "0.9"), (0.5, "0.5"), (1, "1")])
def test_argv_on_gpu(util: float, shown: str) -> None:
    argv = argv_for(parse_config({"engine": {"gpu_memory_utilization": util}}), gpu=1)
    assert option(argv, "--gpu-memory-utilization") == shown
    assert "--enforce-eager" not in argv
    assert "--dtype" not in argv


def test_argv_on_cpu() -> None:
    argv = argv_for(Config(), gpu=None)
    assert option(argv, "--dtype") == "float32"  # no flags known: the dtype every CPU runs
    assert "--enforce-eager" in argv
    assert "--gpu-memory-utilization" not in argv


AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        (set(), "float32"),  # /proc/cpuinfo unreadable
        (AVX2, "float32"),  # this machine: bf16 is emulated, 5.5x slower prefill
        (AVX512, "float32"),  # AVX-512 without its BF16 extension: still emulated
        (AVX512 | {"avx512_bf16"}, "bfloat16"),  # Cooper Lake, Zen 4
        (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids
        (AVX2 | {"amx_bf16"}, "bfloat16"),
        ({"bf16", "asimd"}, "float32"),  # Arm's flag is not one of the x86 ones
    ],
    ids=["none", "avx2", "avx512", "avx512_bf16", "amx", "amx-only", "arm"],
)
def test_cpu_dtype_follows_the_processor(flags: set[str], dtype: str) -> None:
    argv = argv_for(Config(), gpu=None, cpu_flags=flags)
    assert option(argv, "--dtype") == dtype
    choice = choose_cpu_dtype(flags)
    assert choice.dtype == dtype and not choice.explicit
    # The reason names what decided it, on one line.
    assert ("avx512_bf16" in choice.reason) or ("amx_bf16" in choice.reason)
    assert "\n" not in choice.reason


@pytest.mark.parametrize(
    "extra",
    [["--dtype", "bfloat16"], ["--dtype=float16"], ["--seed", "1", "--dtype", "float32"]],
)
@pytest.mark.parametrize("flags", [AVX2, AVX512 | {"avx512_bf16"}], ids=["avx2", "bf16"])
def test_an_explicit_dtype_in_extra_args_wins(extra: list[str], flags: set[str]) -> None:
    argv = argv_for(parse_config({"engine": {"extra_args": extra}}), gpu=None, cpu_flags=flags)
    # Exactly the admin's --dtype, none of ours beside it.
    assert sum(a == "--dtype" or a.startswith("--dtype=") for a in argv) == 1
    assert argv[-len(extra) :] == tuple(extra)
    wanted = extra[-1].split("=")[-1]
    choice = choose_cpu_dtype(flags, extra)
    assert (choice.dtype, choice.explicit) == (wanted, True)
    assert "extra_args" in choice.reason


def test_gpu_engines_get_no_dtype_whatever_the_cpu() -> None:
    argv = argv_for(Config(), gpu=0, cpu_flags=AVX512 | {"avx512_bf16"})
    assert "--dtype" not in argv


@pytest.mark.parametrize("gpu", [0, None], ids=["gpu", "cpu"])
def test_extra_args_come_last(gpu: int | None) -> None:
    extra = ["--seed", "7", "--enable-prefix-caching"]
    argv = argv_for(parse_config({"engine": {"extra_args": extra}}), gpu=gpu)
    assert argv[-3:] == tuple(extra)
    assert argv[:-3] == argv_for(Config(), gpu=gpu)


@pytest.mark.parametrize(("gpu", "gpu_text"), [(3, "3"), (None, "")], ids=["gpu", "cpu"])
def test_command_override_substitutes_every_placeholder(gpu: int | None, gpu_text: str) -> None:
    command = [
        "{python}",
        "serve.py",
        "--model={model}",
        "--uds",
        "{uds}",
        "--port={port}",
        "--gpu={gpu}",
        "--api-key",
        "{api_key}",
        "--name",
        "{served_model_name}",
        "literal",
    ]
    cfg = parse_config({"engine": {"command": command, "extra_args": ["--ignored"]}})
    argv = argv_for(cfg, gpu=gpu, uds="/run/x/engine5.sock")
    assert argv == (
        PY,
        "serve.py",
        f"--model={MODEL}",
        "--uds",
        "/run/x/engine5.sock",
        "--port=",  # no port with listen = unix
        f"--gpu={gpu_text}",
        "--api-key",
        KEY,
        "--name",
        "smol",
        "literal",
    )
    assert not any("{" in a or "}" in a for a in argv)


def test_structured_output_is_compiled_by_guidance_and_no_media_is_fetched() -> None:
    # vLLM's own default (auto: xgrammar) compiles a schema with no time limit, and
    # fetches any http(s) media URL when --allowed-media-domains is absent (issue 33).
    argv = argv_for(Config(), gpu=None)
    assert option(argv, "--structured-outputs-config") == '{"backend":"guidance"}'
    assert option(argv, "--allowed-media-domains") == "media.invalid"
    assert argv[argv.index("--allowed-media-domains") + 2].startswith("--")  # one host only


def test_a_models_backend_and_media_hosts_reach_its_command_line() -> None:
    cfg = parse_config(
        {
            "models": [
                {
                    "name": "vl",
                    "structured_outputs_backend": "xgrammar",
                    "allowed_media_domains": ["images.example.com", "10.0.0.5"],
                }
            ]
        }
    )
    argv = argv_for(cfg, gpu=0)
    assert option(argv, "--structured-outputs-config") == '{"backend":"xgrammar"}'
    at = argv.index("--allowed-media-domains")
    assert argv[at + 1 : at + 3] == ("images.example.com", "10.0.0.5")


@pytest.mark.parametrize(
    "extra",
    [
        ["--structured-outputs-config", '{"backend":"outlines"}', "--allowed-media-domains", "a"],
        ['--structured-outputs-config={"backend":"auto"}', "--allowed-media-domains=a"],
        ["--structured-outputs-config.backend", "auto", "--allowed-media-domains", "a", "b"],
    ],
    ids=["spaced", "equals", "dotted"],
)
def test_the_admins_own_flags_in_extra_args_win(extra: list[str]) -> None:
    argv = argv_for(parse_config({"engine": {"extra_args": extra}}), gpu=None)
    assert argv[-len(extra) :] == tuple(extra)
    assert sum(a.startswith("--structured-outputs-config") for a in argv) == 1
    assert sum(a.startswith("--allowed-media-domains") for a in argv) == 1


@pytest.mark.parametrize(
    ("argv", "trusts"),
    [
        ([], False),
        (["--model", "/m", "--trust-remote-code"], True),
        (["--trust_remote_code"], True),  # vLLM takes underscores for dashes
        (["--trust-remote-code", "--no-trust-remote-code"], False),  # the last one wins
        (["--no-trust-remote-code", "--trust-remote-code"], True),
        (["--trust-remote-code-x"], False),
        (["--served-model-name", "trust-remote-code"], False),
    ],
)
def test_trusting_remote_code_is_read_from_the_whole_command_line(
    argv: list[str], trusts: bool
) -> None:
    assert trusts_remote_code(argv) is trusts


def test_a_pulled_models_extra_args_make_its_engines_trust_remote_code() -> None:
    trusting = parse_config({"engine": {"extra_args": ["--trust-remote-code"]}})
    assert trusts_remote_code(argv_for(trusting, gpu=0))
    assert not trusts_remote_code(argv_for(parse_config({}), gpu=0))


def test_an_embedding_model_gets_no_generation_flags() -> None:
    cfg = parse_config({"models": [{"name": "e", "model": "packaged:all-minilm-l6-v2"}]})
    argv = argv_for(cfg, gpu=None)
    assert "--structured-outputs-config" not in argv and "--allowed-media-domains" not in argv


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, "priority"),  # the default: the gateway sends each request's priority
        ({"engine": {"scheduling": "fcfs"}}, None),  # vLLM's own default: no flag
        (
            {"engine": {"scheduling": "fcfs"}, "models": [{"name": "m", "scheduling": "priority"}]},
            "priority",
        ),
        ({"models": [{"name": "m", "scheduling": "fcfs"}]}, None),
        ({"models": [{"name": "e", "model": "packaged:all-minilm-l6-v2"}]}, "priority"),
        # the admin's own flag wins, spaced or with '='
        ({"engine": {"extra_args": ["--scheduling-policy", "fcfs"]}}, "fcfs"),
        ({"engine": {"extra_args": ["--scheduling-policy=fcfs"]}}, None),
    ],
)
def test_the_scheduling_policy_reaches_the_command_line(
    config: dict[str, Any], expected: str | None
) -> None:
    argv = argv_for(parse_config(config), gpu=None)
    if expected is None:
        assert "--scheduling-policy" not in argv
    else:
        assert option(argv, "--scheduling-policy") == expected


def test_a_custom_command_gets_no_scheduling_flag() -> None:
    cfg = parse_config({"engine": {"command": ["serve", "{model}", "--uds", "{uds}"]}})
    assert argv_for(cfg, gpu=None) == ("serve", MODEL, "--uds", SOCK)


def test_scheduling_is_checked() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"engine": {"scheduling": "lifo"}})
    assert 'engine.scheduling = "lifo": must be one of "priority", "fcfs"' in str(info.value)


# ---------------------------------------------------------------------------------------
# build_env
# ---------------------------------------------------------------------------------------

BASE = {"PATH": "/usr/bin", "HOME": "/var/lib/llm-appliance", "LANG": "C.UTF-8"}


def env_for(
    cfg: Config,
    *,
    gpu: int | None,
    cpu_bind: str | None = None,
    preload: tuple[str, ...] = (),
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    return build_env(
        cfg.engine,
        BASE if base is None else base,
        gpus=() if gpu is None else (gpu,),
        cpu_bind=cpu_bind,
        engine_tag="boot1-0",
        preload=preload,
    )


def test_env_has_no_key_until_a_spawn_adds_one() -> None:
    assert "VLLM_API_KEY" not in env_for(Config(), gpu=None)


@pytest.mark.parametrize("gpu", [0, 1, 7])
def test_env_on_gpu_pins_one_gpu(gpu: int) -> None:
    env = env_for(Config(), gpu=gpu)
    assert env["CUDA_VISIBLE_DEVICES"] == str(gpu)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


@pytest.mark.parametrize(
    ("gib", "shown", "bind"),
    [(1.0, "1", "0-3"), (2.5, "2.5", "4-7"), (4, "4", None)],
)
def test_env_on_cpu_hides_gpus_and_binds_cores(gib: float, shown: str, bind: str | None) -> None:
    env = env_for(parse_config({"engine": {"cpu_kvcache_space_gib": gib}}), gpu=None, cpu_bind=bind)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["VLLM_CPU_KVCACHE_SPACE"] == shown
    if bind is None:
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    else:
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == bind


@pytest.mark.parametrize("gpu", [0, None], ids=["gpu", "cpu"])
def test_env_is_offline_tagged_and_keeps_the_base(gpu: int | None) -> None:
    base_before = dict(BASE)
    env = env_for(Config(), gpu=gpu, cpu_bind="0")
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["LLM_APPLIANCE_ENGINE"] == "boot1-0"
    assert env["PYTHONUNBUFFERED"] == "1"
    for key, value in BASE.items():
        assert env[key] == value
    assert base_before == BASE  # the base is not modified


def test_env_keeps_media_fetches_on_the_allowed_hosts() -> None:
    # vLLM 0.32 follows redirects by default: an allowed host's redirect could lead
    # anywhere. engine.env may still turn them on.
    assert env_for(Config(), gpu=None)["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    cfg = parse_config({"engine": {"env": {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"}}})
    assert env_for(cfg, gpu=None)["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "1"


@pytest.mark.parametrize(
    ("engine", "strict"),
    [
        ({}, "0"),  # guidance: tool calls constrained by a JSON schema it compiles
        ({"structured_outputs_backend": "xgrammar"}, None),  # vLLM's structural tags
        ({"extra_args": ["--structured-outputs-config.backend", "guidance"]}, None),  # theirs
        ({"env": {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "1"}}, "1"),
    ],
    ids=["guidance", "xgrammar", "admins-flag", "admins-env"],
)
def test_guidance_engines_constrain_tool_calls_by_json_schema(
    engine: dict[str, object], strict: str | None
) -> None:
    # vLLM 0.32's tool-call structural tags are xgrammar's; guidance answers them 400.
    env = env_for(parse_config({"engine": engine}), gpu=None)
    assert env.get("VLLM_ENFORCE_STRICT_TOOL_CALLING") == strict


def test_env_turns_on_vllms_response_store() -> None:
    # Without it vLLM 0.32 ignores store: true, and previous_response_id is its 404.
    assert env_for(Config(), gpu=None)["VLLM_ENABLE_RESPONSES_API_STORE"] == "1"


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
IOMP = "/var/lib/llm-appliance/engine-venv/lib/libiomp5.so"


def test_cpu_engine_preloads_the_libraries_found() -> None:
    env = env_for(Config(), gpu=None, preload=(TCMALLOC, IOMP))
    assert env["LD_PRELOAD"] == f"{TCMALLOC}:{IOMP}"


def test_no_library_found_means_no_ld_preload() -> None:
    assert "LD_PRELOAD" not in env_for(Config(), gpu=None, preload=())


def test_gpu_engine_preloads_nothing() -> None:
    assert "LD_PRELOAD" not in env_for(Config(), gpu=0, preload=(TCMALLOC,))


def test_engine_env_ld_preload_wins_over_ours() -> None:
    cfg = parse_config({"engine": {"env": {"LD_PRELOAD": "/opt/mine.so"}}})
    assert env_for(cfg, gpu=None, preload=(TCMALLOC, IOMP))["LD_PRELOAD"] == "/opt/mine.so"
    # An empty one turns preloading off.
    off = parse_config({"engine": {"env": {"LD_PRELOAD": ""}}})
    assert env_for(off, gpu=None, preload=(TCMALLOC,))["LD_PRELOAD"] == ""


def test_an_inherited_ld_preload_is_kept_after_ours() -> None:
    base = {**BASE, "LD_PRELOAD": f"/opt/audit.so {TCMALLOC}"}
    env = env_for(Config(), gpu=None, preload=(TCMALLOC,), base=base)
    assert env["LD_PRELOAD"] == f"{TCMALLOC}:/opt/audit.so"


def test_config_env_is_applied_last() -> None:
    cfg = parse_config(
        {"engine": {"env": {"HF_HUB_OFFLINE": "0", "OMP_NUM_THREADS": "2", "PATH": "/x"}}}
    )
    env = env_for(cfg, gpu=None, cpu_bind="0-1")
    assert env["HF_HUB_OFFLINE"] == "0"
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["PATH"] == "/x"


# ---------------------------------------------------------------------------------------
# new_api_key, cpu_core_split, served_name
# ---------------------------------------------------------------------------------------


def test_new_api_key_is_url_safe_never_dash_first_and_fresh() -> None:
    keys = [new_api_key() for _ in range(200)]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert re.fullmatch(r"[A-Za-z0-9_-]{32,}", key), key
        assert not key.startswith("-")
        assert urllib.parse.quote(key, safe="") == key


@pytest.mark.parametrize(
    ("cores", "engines", "expect"),
    [
        ([0, 1], 1, ["0-1"]),
        ([0, 1], 2, ["0", "1"]),
        (list(range(16)), 3, ["0-5", "6-10", "11-15"]),
        (list(range(16)), 2, ["0-7", "8-15"]),
        (list(range(8)), 8, [str(i) for i in range(8)]),
        ([0], 4, ["0", "0", "0", "0"]),
        ([0, 1, 2], 4, ["0", "1", "2", "0"]),
        ([0, 2, 3, 5], 2, ["0,2", "3,5"]),
        ([4, 5, 6, 7, 12, 13], 2, ["4-6", "7,12-13"]),
        ([3, 1, 2, 0], 2, ["0-1", "2-3"]),
        ([0, 1, 2, 3, 8, 9, 10, 11], 1, ["0-3,8-11"]),
    ],
)
def test_cpu_core_split(cores: list[int], engines: int, expect: list[str]) -> None:
    assert cpu_core_split(cores, engines) == expect


def cpu_core_split(cores: list[int], engines: int) -> list[str]:
    """The cores of each engine as VLLM_CPU_OMP_THREADS_BIND values."""
    return [omp_bind(s) for s in cpu_core_sets(cores, engines)]


def _expand(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


@pytest.mark.parametrize(
    ("n_cores", "engines"), [(n, e) for n in (1, 2, 3, 7, 16, 64) for e in range(1, 9) if e <= n]
)
def test_cpu_core_split_uses_every_core_once(n_cores: int, engines: int) -> None:
    cores = [c * 2 for c in range(n_cores)]  # every other core: non-contiguous affinity
    parts = cpu_core_split(cores, engines)
    assert len(parts) == engines
    used = [c for p in parts for c in _expand(p)]
    assert sorted(used) == cores
    sizes = [len(_expand(p)) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("configured", "model", "expect"),
    [
        ("chat", "/models/Qwen2.5-7B-Instruct", "chat"),
        ("", "/models/Qwen2.5-7B-Instruct", "qwen2.5-7b-instruct"),
        ("", "/models/Qwen2.5-7B-Instruct/", "qwen2.5-7b-instruct"),
        ("", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct"),
        ("", "gpt2", "gpt2"),
        ("", "/", "model"),
    ],
)
def test_served_name(configured: str, model: str, expect: str) -> None:
    cfg = parse_config({"engine": {"served_model_name": configured, "model": model}})
    assert cfg.served[0].name == expect
