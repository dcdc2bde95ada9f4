"""LoRA adapters: what makes a folder an adapter, the flags an engine gets, and how the
gateway names and routes an adapter (issue 23)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from appliance.config import parse_config
from appliance.config.host import LocalHost
from appliance.config.lora import (
    AdapterError,
    adapter_rank,
    engine_rank,
    fitting_rank,
    lora_args,
    with_lora,
)
from appliance.errors import ConfigError
from appliance.gateway.admission.models import model_cards, resolve_named
from appliance.gateway.errors import GatewayError
from tests.fakes.lora_files import fake_adapter

CPU = {"device": "cpu"}


@pytest.mark.parametrize(
    ("config", "weights", "rank_or_error"),
    [
        ({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, True, 8),
        (
            {"r": 8, "lora_alpha": 16, "target_modules": "all", "rank_pattern": {"v": 32}},
            True,
            32,
        ),
        ({"r": 8, "lora_alpha": 16, "target_modules": [], "peft_type": "LORA"}, True, 8),
        ({"r": 8, "lora_alpha": 16, "target_modules": [], "peft_type": "IA3"}, True, "LORA"),
        ({"lora_alpha": 16, "target_modules": []}, True, "lacks r"),
        ({"r": 0, "lora_alpha": 16, "target_modules": []}, True, "positive integer"),
        ({"r": "8", "lora_alpha": 16, "target_modules": []}, True, "positive integer"),
        ({"r": 8, "lora_alpha": 16, "target_modules": []}, False, "no weights"),
        ([1, 2], True, "JSON object"),
        ("{not json", True, "cannot be read as JSON"),
    ],
)
def test_an_adapter_folder_is_read_or_named_as_bad(
    tmp_path: Path, config: Any, weights: bool, rank_or_error: int | str
) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "adapter_config.json").write_text(text)
    if weights:
        (tmp_path / "adapter_model.safetensors").write_bytes(b"\0")
    if isinstance(rank_or_error, int):
        assert adapter_rank(str(tmp_path)) == rank_or_error
    else:
        with pytest.raises(AdapterError, match=rank_or_error):
            adapter_rank(str(tmp_path))


@pytest.mark.parametrize(
    ("path", "error"),
    [("relative/folder", "absolute"), ("/no/such/folder", "no such folder"), ("/", "no adapter")],
)
def test_a_path_that_is_no_adapter_folder_says_why(path: str, error: str) -> None:
    with pytest.raises(AdapterError, match=error):
        adapter_rank(path)


@pytest.mark.parametrize(
    ("rank", "fits"), [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320), (513, None)]
)
def test_the_smallest_max_lora_rank_vllm_takes_is_chosen(rank: int, fits: int | None) -> None:
    assert fitting_rank(rank) == fits


@pytest.mark.parametrize(
    ("argv", "rank"),
    [
        (["--model", "m"], 0),
        (["--enable-lora"], 16),  # vLLM's default
        (["--enable-lora", "--max-lora-rank", "8"], 8),
        (["--enable-lora", "--max-lora-rank", "8", "--max-lora-rank=64"], 64),  # last wins
        (["--max-lora-rank", "8"], 0),  # not enabled
    ],
)
def test_an_engines_rank_is_read_from_its_whole_command_line(argv: list[str], rank: int) -> None:
    assert engine_rank(argv) == rank


def test_lora_args_size_the_rank_and_batch_and_name_the_configs_adapters() -> None:
    assert lora_args([("sql", "/a")], [8]) == [
        *("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"),
        *("--lora-modules", '{"name": "sql", "path": "/a"}'),
    ]
    # An admin's kept adapter of rank 20 (no module: loaded at run time) needs 32.
    assert lora_args([], [8, 20, 4, 4, 4]) == [
        *("--enable-lora", "--max-lora-rank", "32", "--max-loras", "4"),
    ]


def _served(tmp: Path, **model: Any) -> Any:
    fake_adapter(tmp / "sql", r=8)
    table = {"name": "chat", "adapters": [{"name": "sql", "path": str(tmp / "sql")}], **model}
    return parse_config({"engine": CPU, "models": [table, {"name": "plain"}]}).served


def test_an_engine_of_a_model_with_adapters_gets_lora_flags_and_the_runtime_env(
    tmp_path: Path,
) -> None:
    chat, plain = _served(tmp_path, extra_args=["--seed", "1"])
    env: dict[str, str] = {}
    argv, rank = with_lora(chat, ("vllm", "--model", "m", "--seed", "1"), env, kept=[12])
    assert argv == (
        *("vllm", "--model", "m", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"),
        *("--lora-modules", json.dumps({"name": "sql", "path": str(tmp_path / "sql")})),
        *("--seed", "1"),  # extra_args last
    )
    assert (rank, env) == (16, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    env = {}
    assert with_lora(plain, ("vllm",), env) == (("vllm",), 0)
    assert env == {}


def test_extra_args_win_and_a_models_own_command_gets_no_flags(tmp_path: Path) -> None:
    chat, _ = _served(tmp_path, extra_args=["--max-lora-rank", "64"])
    argv, rank = with_lora(chat, ("vllm", "--max-lora-rank", "64"), {})
    assert rank == 64 and argv[-2:] == ("--max-lora-rank", "64")
    (own,) = [
        m
        for m in _served(tmp_path, command=["fake", "--enable-lora", "--uds", "{uds}"])
        if m.adapters
    ]
    env: dict[str, str] = {}
    assert with_lora(own, ("fake", "--enable-lora"), env) == (("fake", "--enable-lora"), 16)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"


@pytest.mark.parametrize(
    ("r", "weights", "problem"),
    [
        (1024, True, "LoRA rank 1024 is above the largest vLLM serves (512)"),
        (8, False, "no weights"),
    ],
)
def test_check_config_names_a_bad_adapter_folder(
    tmp_path: Path, r: int, weights: bool, problem: str
) -> None:
    folder = fake_adapter(tmp_path / "a", r=r)
    if not weights:
        (folder / "adapter_model.safetensors").unlink()
    table = {"name": "a", "adapters": [{"name": "x", "path": str(folder)}]}
    with pytest.raises(ConfigError, match=re.escape(problem)):
        parse_config({"models": [table]}, host=LocalHost())


def test_an_adapter_name_routes_to_its_base_model_and_is_sent_as_itself(tmp_path: Path) -> None:
    models = [{"name": "chat", "aliases": ["gpt"]}, {"name": "plain"}]
    config = parse_config({"engine": CPU, "models": models})
    adapters = {"sql": "chat"}
    assert [
        (m.name, sent)
        for m, sent in [
            resolve_named(config, n, "chat", adapters) for n in ("chat", "gpt", "sql", "plain")
        ]
    ] == [
        ("chat", "chat"),
        ("chat", "chat"),  # an alias is sent as the canonical name
        ("chat", "sql"),
        ("plain", "plain"),
    ]
    with pytest.raises(GatewayError) as exc:
        resolve_named(config, "nope", "chat", adapters)
    assert exc.value.status == 404 and "chat, gpt, plain, sql" in str(exc.value)
    cards = model_cards(config.served, adapters, 7)
    assert [(c["id"], c.get("parent")) for c in cards] == [
        ("chat", None),
        ("gpt", None),
        ("plain", None),
        ("sql", "chat"),
    ]
