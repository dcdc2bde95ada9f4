"""Models on demand in ``check-config``: the five keys, the impossible layouts named by
key path, and the slots (which on-demand models take turns)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance.config import parse_config
from appliance.config.host import LocalHost
from appliance.config.schema import Adapter
from appliance.errors import ConfigError
from appliance.policy.swap import slots
from appliance.reload import merge_live
from tests.fakes.lora_files import fake_adapter

OD = {"load": "on_demand"}


def problems_of(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, host=LocalHost())  # adapter folders are looked at
    return info.value.problems


BAD: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "load unknown",
        {"models": [{"name": "a", "load": "lazy"}]},
        ['("a").load = "lazy"', "always"],
    ),
    ("swap unknown", {"models": [{"name": "a", "swap": "pause"}]}, ['.swap = "pause"', "sleep"]),
    ("idle negative", {"models": [{"name": "a", "idle_unload_s": -1}]}, ["idle_unload_s = -1"]),
    ("load timeout 0", {"models": [{"name": "a", "load_timeout_s": 0}]}, ["load_timeout_s = 0"]),
    (
        "an always model's GPU shared",
        {"models": [{"name": "a", "gpus": [0]}, {"name": "b", "gpus": [0], **OD}]},
        ['models[1] ("b").gpus: GPU 0 is already given to models[0] ("a")'],
    ),
    (
        "on-demand GPU sets overlap unequally",
        {"models": [{"name": "a", "gpus": [0], **OD}, {"name": "b", "gpus": [0, 1], **OD}]},
        ['models[1] ("b").gpus = [0, 1]: overlaps models[0] ("a")', "identical GPU sets"],
    ),
    (
        "sleep on CPU",
        {"engine": {"device": "cpu"}, "models": [{"name": "a", "swap": "sleep", **OD}]},
        ['models[0] ("a").swap = "sleep": vLLM has no sleep mode on CPU'],
    ),
    (
        "adapter named like a model's alias",
        {
            "models": [
                {"name": "a", "gpus": [0], "adapters": [{"name": "b2", "path": "/"}]},
                {"name": "b", "aliases": ["b2"], "gpus": [1]},
            ]
        },
        ['models[0] ("a").adapters[0].name = "b2": already a name of models[1] ("b")'],
    ),
    (
        "adapter folder missing",
        {"models": [{"name": "a", "adapters": [{"name": "x", "path": "/no/such/adapter"}]}]},
        ['.adapters[0].path = "/no/such/adapter": no such folder'],
    ),
    (
        "adapter folder without adapter_config.json",
        {"models": [{"name": "a", "adapters": [{"name": "x", "path": "/"}]}]},
        ['.adapters[0].path = "/": not a LoRA adapter (no adapter_config.json'],
    ),
    (
        "adapter not a table",
        {"models": [{"name": "a", "adapters": ["x"]}]},
        ["models[0] (\"a\").adapters = ['x']: must be a list of { name, path } tables"],
    ),
]


@pytest.mark.parametrize(("raw", "parts"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_layouts_are_named(raw: dict[str, Any], parts: list[str]) -> None:
    problems = problems_of(raw)
    assert any(all(part in p for part in parts) for p in problems), problems


def test_defaults_keep_every_model_always() -> None:
    m = parse_config({"models": [{"name": "a"}]}).served[0]
    assert (m.load, m.idle_unload_s, m.swap, m.load_timeout_s, m.adapters) == (
        "always",
        900.0,
        "stop",
        300.0,
        (),
    )


def test_on_demand_models_on_the_same_gpus_form_one_slot(tmp_path: Path) -> None:
    fake_adapter(tmp_path)
    cfg = parse_config(
        {
            "models": [
                {"name": "a", "gpus": [0, 1], "tensor_parallel_size": 2, **OD, "swap": "sleep"},
                {"name": "b", "gpus": [1, 0], "tensor_parallel_size": 2, **OD},
                {"name": "c", "gpus": [2], **OD, "idle_unload_s": 0},
                {"name": "d", "gpus": [3], "adapters": [{"name": "sql", "path": str(tmp_path)}]},
            ]
        }
    )
    assert slots(cfg.served, "cuda") == (("a", "b"), ("c",))
    assert cfg.served[3].adapters == (Adapter("sql", str(tmp_path)),)


def test_on_cpu_every_on_demand_model_takes_turns() -> None:
    cfg = parse_config(
        {
            "engine": {"device": "cpu"},
            "models": [{"name": "a"}, {"name": "b", **OD}, {"name": "c", **OD}],
        }
    )
    assert slots(cfg.served, "cpu") == (("b", "c"),)


def test_a_reload_that_changes_load_or_swap_needs_a_restart() -> None:
    old = parse_config({"models": [{"name": "a", "gpus": [0]}]})
    new = parse_config({"models": [{"name": "a", "gpus": [0], **OD, "idle_unload_s": 60}]})
    merged, live, restart = merge_live(old, new)
    assert merged.served[0].load == "always"  # kept until the restart
    assert live == []
    assert restart == ["models.a.load", "models.a.idle_unload_s"]
