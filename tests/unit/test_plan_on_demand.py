"""plan_engines with models on demand: their engines are planned (never spawned here),
sleep-mode engines get vLLM's flag and development env, and on CPU the on-demand models
share one set of cores beside the always-loaded ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.errors import ConfigError
from tests.unit.test_plan_models import home, plan  # noqa: F401  (the fixture)

OD = {"load": "on_demand"}


def test_sleep_mode_engines_start_with_its_flag_and_env(home: Path) -> None:  # noqa: F811
    raw = {
        "models": [
            {"name": "a", "gpus": [0], **OD, "swap": "sleep"},
            {"name": "b", "gpus": [0], **OD},
            {"name": "c", "gpus": [1]},
        ]
    }
    a, b, c = plan(raw, home, gpus=2).specs
    assert (a.on_demand, b.on_demand, c.on_demand) == (True, True, False)
    assert "--enable-sleep-mode" in a.argv and a.env["VLLM_SERVER_DEV_MODE"] == "1"
    for other in (b, c):  # stop, or always loaded: no development routes at all
        assert "--enable-sleep-mode" not in other.argv
        assert "VLLM_SERVER_DEV_MODE" not in other.env
    assert (a.gpus, b.gpus) == ((0,), (0,))  # they take turns on GPU 0


def test_on_cpu_on_demand_models_take_turns_on_one_share_of_the_cores(home: Path) -> None:  # noqa: F811
    raw = {
        "engine": {"device": "cpu"},
        "models": [{"name": "chat"}, {"name": "a", **OD}, {"name": "b", **OD}],
    }
    chat, a, b = plan(raw, home, cores=[0, 1, 2, 3]).specs
    assert chat.cpus == (0, 1)
    assert a.cpus == b.cpus == (2, 3)


def test_sleep_on_a_box_without_a_gpu_is_refused_at_start(home: Path) -> None:  # noqa: F811
    raw = {"models": [{"name": "a", **OD, "swap": "sleep"}]}
    with pytest.raises(ConfigError) as info:
        plan(raw, home, gpus=0)
    assert 'models ("a").swap = "sleep": this box has no NVIDIA GPU' in info.value.problems[0]
