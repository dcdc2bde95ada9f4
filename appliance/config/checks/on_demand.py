"""Models on demand (issue 23): the layouts that could never work, named by check-config.

An ``always`` model's GPUs shared, on-demand models whose GPU sets overlap without being
equal (no turn order could hold both: :func:`shared_gpus_problem`, asked by
:mod:`appliance.config.checks.models`, which knows each GPU's owner), ``sleep`` on CPU
(vLLM refuses sleep mode there), and the adapters' names and folders
(:mod:`appliance.config.checks.adapters`). Which models take turns at run time, and how,
is the swap policy's (:mod:`appliance.policy.swap`).
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.config.checks import adapters
from appliance.config.checks.facts import HostFacts
from appliance.config.schema import Config, ModelConfig, ServedModel
from appliance.config.words import label


def check(cfg: Config, problems: list[str], host: HostFacts | None = None) -> None:
    """Every impossible on-demand layout, by key path (the GPU overlap rules are in
    :mod:`appliance.config.checks.models`, which knows the owners); each adapter's folder
    only with ``host`` to look at it."""
    for i, m in enumerate(cfg.models):
        if m.swap == "sleep" and cfg.engine.device == "cpu":
            problems.append(
                f'{label(i, m.name)}.swap = "sleep": vLLM has no sleep mode on CPU '
                '(engine.device = "cpu"); use swap = "stop"'
            )
        adapters.check(cfg, i, problems, host)


def shared_gpus_problem(i: int, m: ModelConfig, j: int, other: ModelConfig, gpu: int) -> str | None:
    """Why models ``i`` and ``j`` may not both hold ``gpu`` (None: they take turns on it)."""
    if m.load == "on_demand" and other.load == "on_demand":
        if set(m.gpus) == set(other.gpus):
            return None
        return (
            f"{label(i, m.name)}.gpus = {list(m.gpus)!r}: overlaps {label(j, other.name)}'s "
            f"{list(other.gpus)!r} without being the same GPUs; on-demand models take turns "
            "only on identical GPU sets"
        )
    return (
        f"{label(i, m.name)}.gpus: GPU {gpu} is already given to {label(j, other.name)}; no "
        'GPU belongs to two models (only models with load = "on_demand" and the same gpus '
        "take turns on them)"
    )


def sleep_on_cpu(served: Sequence[ServedModel], device: str) -> list[str]:
    """check-config names swap = "sleep" with engine.device = "cpu"; with "auto" the box
    decides at start (``device``, asked by :mod:`appliance.plan`): vLLM has no sleep mode
    on CPU."""
    return [
        f'models ("{m.name}").swap = "sleep": this box has no NVIDIA GPU and vLLM has no '
        'sleep mode on CPU; use swap = "stop"'
        for m in served
        if device == "cpu" and m.load == "on_demand" and m.swap == "sleep"
    ]
