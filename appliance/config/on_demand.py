"""Models on demand (issue 23): a model's ``load``, ``idle_unload_s``, ``swap``,
``load_timeout_s`` and ``adapters`` keys, the checks across models, and the slots.

A **slot** is where on-demand models take turns: the on-demand models that name the same
``gpus`` (on a CPU box: every on-demand model, on cores of their own beside the
``always`` models'). One model of a slot is loaded at a time; which one is the swap
policy's choice (:mod:`appliance.policy.swap`). Layouts that could never work are named
by ``check-config``: an ``always`` model's GPUs shared, on-demand models whose GPU sets
overlap without being equal (no turn order could hold both), ``sleep`` on CPU (vLLM
refuses sleep mode there), adapters whose names clash or whose folders are not adapters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from appliance.config.fields import _show
from appliance.config.lora import ADAPTER_CONFIG as ADAPTER_CONFIG  # tests, ansible
from appliance.config.lora import (
    MAX_LORA_RANKS,
    NAME_RULE,
    AdapterError,
    adapter_rank,
    good_name,
)

if TYPE_CHECKING:
    from appliance.config.document import Config
    from appliance.config.models import ModelConfig

Load = Literal["always", "on_demand"]
Swap = Literal["stop", "sleep"]
LOADS: tuple[str, ...] = get_args(Load)
SWAPS: tuple[str, ...] = get_args(Swap)
KEYS: tuple[str, ...] = (
    "load",
    "idle_unload_s",
    "swap",
    "load_timeout_s",
    "min_residency_s",
    "adapters",
)
IDLE_UNLOAD_MAX_S = 7 * 86400  # a week; 0 = never put away for idleness
LOAD_TIMEOUT_BOUNDS = (1.0, 3600.0)
BOUNDS: Mapping[str, tuple[float, float]] = {
    "idle_unload_s": (0.0, float(IDLE_UNLOAD_MAX_S)),
    "load_timeout_s": LOAD_TIMEOUT_BOUNDS,
    "min_residency_s": (0.0, 3600.0),
}

# (default, type, what it does): docs/configuration.md's [[models]] rows.
KEY_DOCS: Mapping[str, tuple[str, str, str]] = {
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


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str


def parse_key(path: str, key: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    """One of the five keys into ``out``; False (and the problem named) when it is bad."""
    if key == "load" or key == "swap":
        allowed = LOADS if key == "load" else SWAPS
        if value not in allowed:
            problems.append(f"{path} = {_show(value)}: must be one of {', '.join(allowed)}")
            return False
        out[key] = value
        return True
    if key == "adapters":
        return _parse_adapters(path, value, out, problems)
    low, high = BOUNDS[key]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not low <= value <= high:
        problems.append(f"{path} = {_show(value)}: must be a number from {low:g} to {high:g} (s)")
        return False
    out[key] = float(value)
    return True


def _parse_adapters(path: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        problems.append(f"{path} = {_show(value)}: must be a list of {{ name, path }} tables")
        return False
    adapters = []
    for j, table in enumerate(value):
        name, folder = table.get("name"), table.get("path")
        extra = sorted(set(table) - {"name", "path"})
        if extra:
            problems.append(f"{path}[{j}].{extra[0]}: unknown key; an adapter has name and path")
            return False
        if not isinstance(name, str) or not good_name(name):
            problems.append(f"{path}[{j}].name = {_show(name)}: {NAME_RULE}")
            return False
        if not isinstance(folder, str) or not folder:
            problems.append(f"{path}[{j}].path = {_show(folder)}: must be the adapter's folder")
            return False
        adapters.append(Adapter(name, folder))
    out["adapters"] = tuple(adapters)
    return True


# ---- across models ---------------------------------------------------------------------


def _label(i: int, m: ModelConfig) -> str:
    return f'models[{i}] ("{m.name}")'


def check(cfg: Config, problems: list[str]) -> None:
    """Every impossible on-demand layout, by key path (the GPU overlap rules are in
    model_checks._check_gpus, which knows the owners)."""
    for i, m in enumerate(cfg.models):
        if m.swap == "sleep" and cfg.engine.device == "cpu":
            problems.append(
                f'{_label(i, m)}.swap = "sleep": vLLM has no sleep mode on CPU '
                '(engine.device = "cpu"); use swap = "stop"'
            )
        _check_adapters(cfg, i, m, problems)


def _check_adapters(cfg: Config, i: int, m: ModelConfig, problems: list[str]) -> None:
    taken = {n: f"{_label(j, o)}" for j, o in enumerate(cfg.models) for n in (o.name, *o.aliases)}
    for j, a in enumerate(m.adapters):
        where = f"{_label(i, m)}.adapters[{j}]"
        if a.name in taken:
            problems.append(
                f'{where}.name = "{a.name}": already a name of {taken[a.name]}; adapter '
                "names are model names and must be unique"
            )
        taken[a.name] = where
        try:
            rank = adapter_rank(a.path)
        except AdapterError as exc:
            problems.append(f'{where}.path = "{a.path}": {exc}')
            continue
        if rank > MAX_LORA_RANKS[-1]:
            problems.append(
                f'{where}.path = "{a.path}": LoRA rank {rank} is above the largest vLLM '
                f"serves ({MAX_LORA_RANKS[-1]})"
            )


def shared_gpus_problem(i: int, m: ModelConfig, j: int, other: ModelConfig, gpu: int) -> str | None:
    """Why models ``i`` and ``j`` may not both hold ``gpu`` (None: they take turns on it)."""
    if m.load == "on_demand" and other.load == "on_demand":
        if set(m.gpus) == set(other.gpus):
            return None
        return (
            f"{_label(i, m)}.gpus = {list(m.gpus)!r}: overlaps {_label(j, other)}'s "
            f"{list(other.gpus)!r} without being the same GPUs; on-demand models take turns "
            "only on identical GPU sets"
        )
    return (
        f"{_label(i, m)}.gpus: GPU {gpu} is already given to {_label(j, other)}; no GPU "
        'belongs to two models (only models with load = "on_demand" and the same gpus '
        "take turns on them)"
    )


def slots(served: Sequence[Any], device: str) -> tuple[tuple[str, ...], ...]:
    """The on-demand models that take turns, as groups of names: by identical GPU sets,
    or on ``device`` = "cpu" all of them in one group. Each ``served`` item is a
    :class:`~appliance.config.models.ServedModel`."""
    groups: dict[Any, list[str]] = {}
    for m in served:
        if m.load != "on_demand":
            continue
        key = "cpu" if device == "cpu" else tuple(sorted(m.gpus or ()))
        groups.setdefault(key, []).append(m.name)
    return tuple(tuple(g) for g in groups.values())


def sleep_on_cpu(served: Sequence[Any], device: str) -> list[str]:
    """check-config names swap = "sleep" with engine.device = "cpu"; with "auto" the box
    decides at start (``device``): vLLM has no sleep mode on CPU."""
    return [
        f'models ("{m.name}").swap = "sleep": this box has no NVIDIA GPU and vLLM has no '
        'sleep mode on CPU; use swap = "stop"'
        for m in served
        if device == "cpu" and m.load == "on_demand" and m.swap == "sleep"
    ]
