"""Parsing the ``[[models]]`` array of tables into :class:`~appliance.config.schema.ModelConfig`.

Each table's own keys (its name, where it runs, models on demand, adapters) and the
``[engine]`` keys it may set for itself are checked as they are read; every problem is
named, the table by index and name: ``models[1] ("embed").gpus``. The rules across
tables are :mod:`appliance.config.checks.models`, run after.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from appliance.config.checks.models import check_packaged
from appliance.config.checks.speculative import speculative_problem
from appliance.config.fields import check_bounds, coerce, describe, unknown_key
from appliance.config.lora import NAME_RULE, good_name
from appliance.config.schema import (
    LOADS,
    MAX_GPUS,
    MODEL_ENGINE_KEYS,
    MODEL_KEYS,
    NAME_RE,
    ON_DEMAND_KEYS,
    SWAPS,
    TASKS,
    Adapter,
    EngineConfig,
    ModelConfig,
)
from appliance.config.words import label, show

IDLE_UNLOAD_MAX_S = 7 * 86400  # a week; 0 = never put away for idleness
LOAD_TIMEOUT_BOUNDS = (1.0, 3600.0)
# The on-demand keys that are numbers of seconds: (lowest, highest) allowed.
BOUNDS: Mapping[str, tuple[float, float]] = {
    "idle_unload_s": (0.0, float(IDLE_UNLOAD_MAX_S)),
    "load_timeout_s": LOAD_TIMEOUT_BOUNDS,
    "min_residency_s": (0.0, 3600.0),
}


def parse_models(raw: Any, problems: list[str]) -> tuple[ModelConfig, ...]:
    """The ``[[models]]`` array of tables, every problem named in ``problems``."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        problems.append(
            "models: must be an array of tables (one [[models]] block per model), got " + show(raw)
        )
        return ()
    if not raw:
        problems.append("models = []: give at least one [[models]] table, or none at all")
    return tuple(_parse_table(i, t, problems) for i, t in enumerate(raw))


def _where(i: int, table: Mapping[str, Any]) -> str:
    name = table.get("name")
    return label(i, name) if isinstance(name, str) and name else f"models[{i}]"


def _parse_table(i: int, table: Mapping[str, Any], problems: list[str]) -> ModelConfig:
    where = _where(i, table)
    values: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    engine_fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for key, value in table.items():
        if key in MODEL_KEYS:
            ok = _parse_model_key(where, key, value, values, problems)
            if not ok:
                values.pop(key, None)
        elif key in MODEL_ENGINE_KEYS:
            converted = _parse_override(where, key, value, engine_fields[key], problems)
            if converted is not None:
                overrides[key] = converted
        elif key in engine_fields:
            problems.append(
                f"{where}.{key}: an [engine] key that a model cannot set for itself; set "
                f"engine.{key}, or one of: {', '.join(MODEL_ENGINE_KEYS)}"
            )
        else:
            problems.append(unknown_key(f"{where}.", key, [*MODEL_KEYS, *MODEL_ENGINE_KEYS]))
    if "name" not in table:
        problems.append(f"{where}.name: missing; every model needs a name ([a-z0-9._-])")
    # A bad name is named once, above; later messages still call the table by it.
    raw_name = table.get("name")
    values.pop("name", None)
    name = raw_name if isinstance(raw_name, str) else f"model{i}"
    return ModelConfig(name=name, overrides=overrides, **values)


def _parse_override(
    where: str, key: str, value: Any, f: dataclasses.Field[Any], problems: list[str]
) -> Any:
    tp = typing.get_type_hints(EngineConfig)[key]
    ok, converted = coerce(value, tp)
    if not ok:
        problems.append(f"{where}.{key} = {show(value)}: must be {describe(tp)}")
        return None
    bad = check_bounds(converted, f.metadata)
    if bad:
        problems.append(f"{where}.{key} = {show(value)}: must be {bad}")
        return None
    return converted


def _name_problem(value: Any) -> str | None:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        return f"{show(value)}: must be 1-64 characters of a-z 0-9 . _ -"
    return None


def _parse_model_key(
    where: str, key: str, value: Any, out: dict[str, Any], problems: list[str]
) -> bool:
    """Check one of a model's own keys; put the value in ``out``; False when it is bad."""
    path = f"{where}.{key}"
    if key in ("name", "aliases"):
        return _parse_names(path, key, value, out, problems)
    if key == "model":
        if not isinstance(value, str):
            problems.append(f"{path} = {show(value)}: must be a string")
            return False
        if not check_packaged(path, value, problems):
            return False
        out[key] = value
    elif key == "task":
        if value not in TASKS:
            problems.append(f"{path} = {show(value)}: must be one of {', '.join(TASKS)}")
            return False
        out[key] = value
    elif key == "gpus":
        return _parse_gpus(path, value, out, problems)
    elif key in ("tensor_parallel_size", "cpu_engines"):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GPUS:
            problems.append(f"{path} = {show(value)}: must be an integer from 1 to {MAX_GPUS}")
            return False
        out[key] = value
    elif key in ON_DEMAND_KEYS:
        return _parse_on_demand_key(path, key, value, out, problems)
    elif key == "fallback":
        if not isinstance(value, str):
            problems.append(f"{path} = {show(value)}: must be a model's name")
            return False
        out[key] = value
    else:  # speculative
        return _parse_speculative(path, value, out, problems)
    return True


def _parse_names(path: str, key: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    """A model's ``name`` (one name) or ``aliases`` (a list of them)."""
    if key == "name":
        bad = _name_problem(value)
        if bad:
            problems.append(f"{path} = {bad}")
            return False
        out[key] = value
        return True
    if not isinstance(value, list):
        problems.append(f"{path} = {show(value)}: must be a list of names")
        return False
    for alias in value:
        bad = _name_problem(alias)
        if bad:
            problems.append(f"{path}: {bad}")
            return False
    out[key] = tuple(value)
    return True


def _parse_gpus(path: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(g, int) and not isinstance(g, bool) for g in value)
    )
    if not ok:
        problems.append(f"{path} = {show(value)}: must be a non-empty list of GPU indices")
        return False
    if len(set(value)) != len(value) or any(g < 0 or g >= 64 for g in value):
        problems.append(f"{path} = {value!r}: indices must be distinct and 0..63")
        return False
    out["gpus"] = tuple(value)
    return True


def _parse_speculative(path: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    problem = speculative_problem(path, value)
    if problem is not None:
        problems.append(problem)
        return False
    model = value.get("model")
    if isinstance(model, str) and not check_packaged(f"{path}.model", model, problems):
        return False
    out["speculative"] = dict(value)
    return True


def _parse_on_demand_key(
    path: str, key: str, value: Any, out: dict[str, Any], problems: list[str]
) -> bool:
    """One of the on-demand keys into ``out``; False (and the problem named) when it is bad."""
    if key == "load" or key == "swap":
        allowed = LOADS if key == "load" else SWAPS
        if value not in allowed:
            problems.append(f"{path} = {show(value)}: must be one of {', '.join(allowed)}")
            return False
        out[key] = value
        return True
    if key == "adapters":
        return _parse_adapters(path, value, out, problems)
    low, high = BOUNDS[key]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not low <= value <= high:
        problems.append(f"{path} = {show(value)}: must be a number from {low:g} to {high:g} (s)")
        return False
    out[key] = float(value)
    return True


def _parse_adapters(path: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        problems.append(f"{path} = {show(value)}: must be a list of {{ name, path }} tables")
        return False
    adapters = []
    for j, table in enumerate(value):
        name, folder = table.get("name"), table.get("path")
        extra = sorted(set(table) - {"name", "path"})
        if extra:
            problems.append(f"{path}[{j}].{extra[0]}: unknown key; an adapter has name and path")
            return False
        if not isinstance(name, str) or not good_name(name):
            problems.append(f"{path}[{j}].name = {show(name)}: {NAME_RULE}")
            return False
        if not isinstance(folder, str) or not folder:
            problems.append(f"{path}[{j}].path = {show(folder)}: must be the adapter's folder")
            return False
        adapters.append(Adapter(name, folder))
    out["adapters"] = tuple(adapters)
    return True
