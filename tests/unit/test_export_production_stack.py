"""`llm-appliance export production-stack`: what each config becomes in the chart's
values, what the admin is told does not carry over, and that every key written is one
the chart has (tests/data/production-stack/values-0.1.12.yaml, a trimmed copy of the
chart's own values.yaml), for every TOML example in docs/ and the configs below."""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.cli import main
from appliance.config import SECTIONS, Config, EngineConfig, ServedModel, parse_config
from appliance.export.production_stack import (
    CARRIED,
    NOT_APPLICABLE,
    NOT_CARRIED,
    NOT_CARRIED_KEYS,
    export,
)
from appliance.export.yaml_out import dump

REPO = Path(__file__).resolve().parents[2]
CHART_SHAPE = REPO / "tests/data/production-stack/values-0.1.12.yaml"
CHAT = "packaged:smollm2-135m-instruct"
EMBED = "packaged:all-minilm-l6-v2"
# What every generate engine gets against one request's outsized work (engine.py's
# request_guard_args and request_guard_env), in the pod as on the box.
GUARD_ARGS = [
    "--structured-outputs-config",
    '{"backend":"guidance"}',
    "--allowed-media-domains",
    "media.invalid",
]
SCHEDULING_ARGS = ["--scheduling-policy", "priority"]  # engine.scheduling's default
GUARD_ENV = [
    {"name": "VLLM_ENFORCE_STRICT_TOOL_CALLING", "value": "0"},
    {"name": "VLLM_MEDIA_URL_ALLOW_REDIRECTS", "value": "0"},
]


def spec_of(raw: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    specs = export(parse_config(raw)).values["servingEngineSpec"]["modelSpec"]
    return specs[0] if name is None else next(s for s in specs if s["name"] == name)


def notes_of(raw: dict[str, Any]) -> str:
    return "\n".join(export(parse_config(raw)).notes)


# (id, config, model, {dotted key: value it must have}) -------------------------------
CASES: list[tuple[str, dict[str, Any], str | None, dict[str, Any]]] = [
    (
        "built-in default: the packaged model from the volume, one GPU",
        {},
        None,
        {
            "name": "smollm2-135m-instruct",
            "modelURL": "/data/SmolLM2-135M-Instruct",
            "pvcStorage": "50Gi",
            "replicaCount": 1,
            "requestGPU": 1,
            "vllmConfig.maxModelLen": 4096,
            "vllmConfig.gpuMemoryUtilization": 0.9,
            "vllmConfig.dtype": "auto",
            "vllmConfig.enablePrefixCaching": True,
        },
    ),
    (
        "four GPUs, two per engine: two replicas of two GPUs",
        {
            "models": [
                {
                    "name": "big",
                    "model": "/srv/m/Big-70B/",
                    "gpus": [0, 1, 2, 3],
                    "tensor_parallel_size": 2,
                }
            ]
        },
        None,
        {
            "modelURL": "/data/Big-70B",
            "replicaCount": 2,
            "requestGPU": 2,
            "vllmConfig.tensorParallelSize": 2,
        },
    ),
    (
        "a model id stays an id, no volume",
        {"models": [{"name": "qwen", "model": "Qwen/Qwen2.5-7B-Instruct", "gpus": [0]}]},
        None,
        {"modelURL": "Qwen/Qwen2.5-7B-Instruct", "pvcStorage": None},
    ),
    (
        "an embedding model runs as a pooling model",
        {
            "models": [
                {"name": "chat", "model": CHAT, "gpus": [0]},
                {"name": "embed", "model": EMBED, "task": "embed", "gpus": [1]},
            ]
        },
        "embed",
        {"vllmConfig.runner": "pooling", "vllmConfig.maxModelLen": 256},
    ),
    (
        "a chat model has no runner key (vLLM picks generate)",
        {"models": [{"name": "chat", "model": CHAT, "gpus": [0]}]},
        None,
        {"vllmConfig.runner": None},
    ),
    (
        "a model's own [engine] keys win",
        {
            "models": [
                {
                    "name": "chat",
                    "model": CHAT,
                    "gpus": [0],
                    "max_model_len": 2048,
                    "gpu_memory_utilization": 0.5,
                    "max_num_batched_tokens": 4096,
                }
            ]
        },
        None,
        {
            "vllmConfig.maxModelLen": 2048,
            "vllmConfig.gpuMemoryUtilization": 0.5,
            "vllmConfig.extraArgs": [
                "--served-model-name",
                "chat",
                "--max-num-batched-tokens",
                "4096",
                *GUARD_ARGS,
                *SCHEDULING_ARGS,
            ],
        },
    ),
    (
        "--dtype in extra_args becomes dtype; the other args follow ours",
        {"engine": {"extra_args": ["--dtype", "bfloat16", "--enforce-eager"]}},
        None,
        {
            "vllmConfig.dtype": "bfloat16",
            "vllmConfig.extraArgs": [
                "--served-model-name",
                "smollm2-135m-instruct",
                "--max-num-batched-tokens",
                "8192",
                *GUARD_ARGS,
                *SCHEDULING_ARGS,
                "--enforce-eager",
            ],
        },
    ),
    (
        "--dtype=X written as one argument",
        {"engine": {"extra_args": ["--dtype=float16"]}},
        None,
        {"vllmConfig.dtype": "float16"},
    ),
    (
        "CPU: no GPU asked, one replica per CPU engine, no GPU memory share",
        {
            "engine": {"device": "cpu"},
            "models": [{"name": "chat", "model": CHAT, "cpu_engines": 2}],
        },
        None,
        {"requestGPU": 0, "replicaCount": 2, "vllmConfig.gpuMemoryUtilization": None},
    ),
    (
        "engine.env becomes the container's env, beside the Responses API's store",
        {"engine": {"env": {"HF_HUB_OFFLINE": "1"}}},
        None,
        {
            "env": [
                {"name": "HF_HUB_OFFLINE", "value": "1"},
                {"name": "VLLM_ENABLE_RESPONSES_API_STORE", "value": "1"},
                *GUARD_ENV,
            ]
        },
    ),
    (
        "the tool-call and reasoning parsers go in extraArgs as our command line has them",
        {"engine": {"tool_call_parser": "hermes", "reasoning_parser": "qwen3"}},
        None,
        {
            "vllmConfig.extraArgs": [
                "--served-model-name",
                "smollm2-135m-instruct",
                "--max-num-batched-tokens",
                "8192",
                "--enable-auto-tool-choice",
                "--tool-call-parser",
                "hermes",
                "--reasoning-parser",
                "qwen3",
                *GUARD_ARGS,
                *SCHEDULING_ARGS,
            ],
        },
    ),
    (
        "responses_store = false: no store in the pod either; CPU: the KV cache's size",
        {"engine": {"device": "cpu", "responses_store": False, "cpu_kvcache_space_gib": 4}},
        None,
        {"env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"}, *GUARD_ENV]},
    ),
]


def _at(spec: dict[str, Any], dotted: str) -> Any:
    node: Any = spec
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


@pytest.mark.parametrize(
    ("raw", "model", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_model_spec(raw: dict[str, Any], model: str | None, want: dict[str, Any]) -> None:
    spec = spec_of(raw, model)
    assert {k: _at(spec, k) for k in want} == want


def test_speculative_config_goes_in_extra_args_as_vllm_reads_it() -> None:
    spec = spec_of(
        {
            "models": [
                {
                    "name": "chat",
                    "model": CHAT,
                    "gpus": [0],
                    "speculative": {
                        "method": "draft_model",
                        "model": CHAT,
                        "num_speculative_tokens": 3,
                    },
                }
            ]
        }
    )
    args = spec["vllmConfig"]["extraArgs"]
    assert json.loads(args[args.index("--speculative-config") + 1]) == {
        "method": "draft_model",
        "model": "/data/SmolLM2-135M-Instruct",
        "num_speculative_tokens": 3,
    }


def test_router_routes_by_prefix() -> None:
    assert export(Config()).values["routerSpec"] == {
        "enableRouter": True,
        "routingLogic": "prefixaware",
    }


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        ({}, "copy it onto the model's volume at /data/SmolLM2-135M-Instruct"),
        ({}, "gpus = auto: one replica written"),
        ({"models": [{"name": "q", "model": "Qwen/Q"}]}, "the pod downloads it at start"),
        ({"models": [{"name": "my_chat", "model": CHAT}]}, "rename the model"),
        ({"models": [{"name": "c", "model": CHAT, "aliases": ["gpt-4o"]}]}, 'aliases = ["gpt-4o"]'),
        ({"engine": {"device": "cpu"}}, "use a vLLM CPU image"),
        (
            {"engine": {"command": ["{python}", "-m", "x", "{model}", "--uds", "{uds}"]}},
            "runs `vllm serve`",
        ),
    ],
)
def test_notes_name_what_this_config_loses(raw: dict[str, Any], said: str) -> None:
    assert said in notes_of(raw)


# ---- every setting is carried, meaningless in a pod, or said (issue 33, item 15) -----------

EVERY_SETTING = [f.name for f in dataclasses.fields(ServedModel)] + [
    f"engine.{f.name}" for f in dataclasses.fields(EngineConfig)
]


@pytest.mark.parametrize("key", EVERY_SETTING)
def test_every_model_setting_is_carried_or_said_not_to_be(key: str) -> None:
    """A new field of ServedModel or EngineConfig fails here until the export says what
    becomes of it."""
    homes = [key in CARRIED, key in NOT_APPLICABLE, key in NOT_CARRIED_KEYS]
    assert homes.count(True) == 1, f"{key}: add it to CARRIED, NOT_APPLICABLE or NOT_CARRIED_KEYS"


def test_the_tables_name_no_setting_that_does_not_exist() -> None:
    assert set(CARRIED) | set(NOT_APPLICABLE) | set(NOT_CARRIED_KEYS) == set(EVERY_SETTING)


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ({"load": "on_demand"}, 'load = "on_demand": the chart runs every replica all the time'),
        ({"load": "on_demand", "idle_unload_s": 60}, "idle_unload_s = 60: not carried"),
        ({"fallback": "other"}, 'fallback = "other": not carried'),
        ({"max_inflight": 8}, "engine.max_inflight = 8: not carried"),
        ({"max_inflight_tokens": 9000}, "engine.max_inflight_tokens = 9000: not carried"),
        ({"startup_timeout_s": 1800}, "engine.startup_timeout_s = 1800: not carried"),
        ({"stop_timeout_s": 60}, "engine.stop_timeout_s = 60: not carried"),
    ],
)
def test_a_setting_that_cannot_carry_over_is_named_for_its_model(
    table: dict[str, Any], said: str
) -> None:
    other = {"name": "other", "model": CHAT, "gpus": [1]}
    raw = {"models": [{"name": "chat", "model": CHAT, "gpus": [0], **table}, other]}
    assert f"model chat: {said}" in notes_of(raw)


def test_defaults_say_nothing_about_settings_they_do_not_set() -> None:
    notes = notes_of({"models": [{"name": "chat", "model": CHAT, "gpus": [0]}]})
    assert not any(key in notes for key in NOT_CARRIED_KEYS if "." in key)
    assert "load =" not in notes and "fallback =" not in notes


# ---- the command ----------------------------------------------------------------------


def test_command_writes_values_and_says_what_does_not_carry_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "values.yaml"
    assert (
        main(
            [
                "export",
                "production-stack",
                "--config",
                str(_docs_example(_two_models_example())),
                "-o",
                str(out),
            ]
        )
        == 0
    )
    written = yaml.safe_load(out.read_text())
    assert [s["name"] for s in written["servingEngineSpec"]["modelSpec"]] == ["chat", "embed"]
    err = capsys.readouterr().err
    for what in ("heat governor", "drain-before-restart", "per-key", "fallback", "audit"):
        assert what in err
    assert err.count("not carried over:") == len(NOT_CARRIED)


def test_command_writes_to_stdout_without_o(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "production-stack", "--config", str(_docs_example(2))]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out) == export(parse_config(tomllib.loads(_docs_examples()[2]))).values


def test_a_missing_config_is_a_config_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", "production-stack", "--config", str(tmp_path / "nope.toml")]) == 2


# ---- every key the export writes is one the chart has ---------------------------------


def _docs_examples() -> list[str]:
    """The appliance configs among docs/'s TOML blocks (connect-your-tools.md also shows
    other programs' TOML, e.g. Codex's config)."""
    blocks = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        blocks += re.findall(r"```toml\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    ours = {*SECTIONS, "models"}
    return [b for b in blocks if set(tomllib.loads(b)) <= ours]


def _two_models_example() -> int:
    """The docs example with a chat model and an embedding model."""
    return next(i for i, b in enumerate(_docs_examples()) if 'name = "embed"' in b)


_WRITTEN: dict[int, Path] = {}


def _docs_example(i: int) -> Path:
    import tempfile

    if i not in _WRITTEN:
        f = Path(tempfile.mkdtemp()) / f"example{i}.toml"
        f.write_text(_docs_examples()[i])
        _WRITTEN[i] = f
    return _WRITTEN[i]


def _unknown_keys(value: Any, shape: Any, path: str) -> list[str]:
    """Paths in ``value`` that ``shape`` does not have; a list's items are checked against
    the shape's first item, and an empty list or map in the shape takes anything (the
    chart's ``env: []`` holds Kubernetes EnvVars)."""
    if isinstance(value, dict):
        if not isinstance(shape, dict):
            return [path]
        if not shape:
            return []
        return [
            p
            for k, v in value.items()
            for p in (
                [f"{path}.{k}"] if k not in shape else _unknown_keys(v, shape[k], f"{path}.{k}")
            )
        ]
    if isinstance(value, list):
        if not isinstance(shape, list):
            return [path]
        return (
            []
            if not shape
            else [
                p for i, v in enumerate(value) for p in _unknown_keys(v, shape[0], f"{path}[{i}]")
            ]
        )
    return []


SHAPE_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    *[(f"docs example {i}", tomllib.loads(b)) for i, b in enumerate(_docs_examples())],
    *[(c[0], c[1]) for c in CASES],
]


def test_the_docs_have_examples_to_check() -> None:
    assert len(_docs_examples()) >= 3


@pytest.mark.parametrize("raw", [c[1] for c in SHAPE_CONFIGS], ids=[c[0] for c in SHAPE_CONFIGS])
def test_every_key_written_is_one_the_chart_has(raw: dict[str, Any]) -> None:
    shape = yaml.safe_load(CHART_SHAPE.read_text())
    values = yaml.safe_load(dump(export(parse_config(raw)).values))
    assert _unknown_keys(values, shape, "") == []


def test_the_shape_check_catches_a_key_the_chart_lacks() -> None:
    shape = yaml.safe_load(CHART_SHAPE.read_text())
    bad = {"servingEngineSpec": {"modelSpec": [{"name": "x", "vllmConfig": {"maxLen": 1}}]}}
    assert _unknown_keys(bad, shape, "") == [".servingEngineSpec.modelSpec[0].vllmConfig.maxLen"]


# ---- the YAML emitter -----------------------------------------------------------------

TRICKY = [
    "on",
    "off",
    "yes",
    "no",
    "null",
    "~",
    "1e3",
    "0x10",
    "012",
    "#x",
    "a: b",
    "- x",
    "*ref",
    "&a",
    "!tag",
    "'q'",
    '"d"',
    "tab\there",
    "line\nbreak",
    "é ✓",
    "",
    " x ",
    "\\",
    "%YAML",
    "@x",
    "`x`",
    "{x}",
    "[x]",
    "|",
    ">",
]


def test_yaml_round_trips_through_pyyaml() -> None:
    value: dict[str, Any] = {
        "strings": TRICKY,
        "numbers": [0, -3, 2**40, 0.9, 1e-7, 12.5],
        "flags": [True, False, None],
        "empty": {"map": {}, "list": []},
        "items": [{"name": "a", "env": [{"name": "X", "value": "1"}]}, {"k": [1, [2, 3]]}],
        "yes": "key that YAML 1.1 reads as a boolean",
        "with space": 1,
        "9lives": 2,
    }
    assert yaml.safe_load(dump(value, ["a header"])) == value
