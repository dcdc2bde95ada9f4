"""``[[models]]``: several models on one box, one table per model, ``[engine]`` the defaults.

A table names the model clients ask for, where it runs (its GPUs, or its CPU engines) and
which ``[engine]`` keys it sets for itself. What the rest of the appliance uses is the
resolved :class:`ServedModel`: the table merged over ``[engine]``, or, without any table,
``[engine]`` alone as one model on every GPU (exactly what a config meant before models
existed). Messages name the table by index and name: ``models[1] ("embed").gpus``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from appliance import paths
from appliance.config import on_demand
from appliance.config.fields import _coerce, _describe, _show, _unknown, check_bounds
from appliance.config.on_demand import Adapter, Load, Swap
from appliance.config.sections import MAX_GPUS, EngineConfig
from appliance.config.speculative import speculative_problem

Task = Literal["generate", "embed"]
TASKS: tuple[str, ...] = get_args(Task)
NAME_RE = re.compile(r"[a-z0-9._-]{1,64}")
# The [engine] keys a model's table may set for itself (contract, "Models").
MODEL_ENGINE_KEYS: tuple[str, ...] = (
    "max_model_len",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "max_inflight",
    "max_inflight_tokens",
    "extra_args",
    "env",
    "command",
    "startup_timeout_s",
    "stop_timeout_s",
    "cpu_kvcache_space_gib",
    "tool_call_parser",
    "reasoning_parser",
    "responses_store",
    "structured_outputs_backend",
    "scheduling",
    "allow_prompt_logprobs",
    "allowed_media_domains",
)
MODEL_KEYS: tuple[str, ...] = (
    "name",
    "aliases",
    "model",
    "task",
    "gpus",
    "tensor_parallel_size",
    "cpu_engines",
    "fallback",
    "speculative",
    *on_demand.KEYS,
)
# (default, type, what it does) of each model key: docs/configuration.md's [[models]].
MODEL_KEY_DOCS: Mapping[str, tuple[str, str, str]] = {
    "name": ("(required)", "a string", "What clients send as `model`; unique; a-z 0-9 . _ -."),
    "aliases": ("[]", "a list of strings", "More names for the model; unique across all."),
    "model": (
        "engine.model",
        "a string",
        'A local folder, a model id already in the local cache, or "packaged:NAME" '
        '("packaged:smollm2-135m-instruct", "packaged:all-minilm-l6-v2").',
    ),
    "task": (
        "the packaged model's, else generate",
        'one of "generate", "embed"',
        "`embed`: a pooling model, served on /v1/embeddings only (vLLM --runner pooling).",
    ),
    "gpus": (
        "[] (with one model: every GPU)",
        "a list of integers",
        "This model's GPUs; no GPU belongs to two models; needed with several models.",
    ),
    "tensor_parallel_size": (
        "1",
        "an integer",
        "GPUs per engine (vLLM --tensor-parallel-size); len(gpus) a multiple of it.",
    ),
    "cpu_engines": ("engine.cpu_engines", "an integer", "With device = cpu: its engines."),
    "fallback": (
        '""',
        "a model's name",
        "Another model (same task) that takes this model's requests none of its engines "
        "can admit now; one hop only.",
    ),
    "speculative": (
        "{}",
        "a table",
        "vLLM --speculative-config, e.g. "
        '{ method = "ngram", num_speculative_tokens = 4, prompt_lookup_max = 4 }.',
    ),
    **on_demand.KEY_DOCS,
}
# The context a packaged model supports, where it is below [engine].max_model_len's
# default: vLLM refuses a --max-model-len above what the model was trained for.
PACKAGED_CONTEXT: Mapping[str, int] = {"all-minilm-l6-v2": 256}


@dataclass(frozen=True)
class ModelConfig:
    """One ``[[models]]`` table as written (None / empty: not given, the default applies)."""

    name: str
    aliases: tuple[str, ...] = ()
    model: str | None = None  # None: [engine].model
    task: Task | None = None  # None: the packaged model's task, else "generate"
    gpus: tuple[int, ...] = ()
    tensor_parallel_size: int = 1
    cpu_engines: int | None = None  # None: [engine].cpu_engines
    fallback: str = ""
    speculative: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Any] = field(default_factory=dict)  # [engine] keys it sets
    # Models on demand (config/on_demand.py).
    load: Load = "always"
    idle_unload_s: float = 900.0
    swap: Swap = "stop"
    load_timeout_s: float = 300.0
    min_residency_s: float = 30.0
    adapters: tuple[Adapter, ...] = ()


@dataclass(frozen=True)
class ServedModel:
    """A model as the appliance serves it: its table merged over ``[engine]``."""

    name: str  # what clients send, and vLLM's --served-model-name
    aliases: tuple[str, ...]
    model: str  # "" = the packaged SmolLM2; "packaged:NAME"; a folder; a cached model id
    task: Task
    gpus: tuple[int, ...] | None  # None: every GPU found ([engine] alone, gpus = "auto")
    tensor_parallel_size: int
    cpu_engines: int
    fallback: str
    speculative: Mapping[str, Any]
    engine: EngineConfig  # [engine] with this model's overrides applied
    load: Load = "always"
    idle_unload_s: float = 900.0
    swap: Swap = "stop"
    load_timeout_s: float = 300.0
    min_residency_s: float = 30.0
    adapters: tuple[Adapter, ...] = ()

    @property
    def on_demand(self) -> bool:
        return self.load == "on_demand"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _packaged_task(model: str) -> str | None:
    name = paths.packaged_name(model)
    known = paths.PACKAGED_MODELS.get(name) if name is not None else None
    return known.task if known is not None else None


def _with_packaged_context(engine: EngineConfig, model: str, overridden: bool) -> EngineConfig:
    name = paths.packaged_name(model)
    context = PACKAGED_CONTEXT.get(name) if name is not None else None
    if context is None or overridden or engine.max_model_len <= context:
        return engine
    return dataclasses.replace(engine, max_model_len=context)


def implicit_name(e: EngineConfig) -> str:
    """The one model's name without [[models]]: served_model_name, else from the model."""
    if e.served_model_name:
        return e.served_model_name
    packaged = paths.packaged_name(e.model)
    if packaged is not None:
        return packaged
    if not e.model:
        return paths.PACKAGED_MODEL_NAME
    return Path(e.model.rstrip("/")).name.lower() or "model"


def serve(engine: EngineConfig, models: Sequence[ModelConfig]) -> tuple[ServedModel, ...]:
    """The models to serve: each table merged over ``engine``, or ``engine`` alone."""
    if not models:
        task: Any = _packaged_task(engine.model) or "generate"
        return (
            ServedModel(
                name=implicit_name(engine),
                aliases=(),
                model=engine.model,
                task=task,
                gpus=None if engine.gpus == "auto" else tuple(engine.gpus),
                tensor_parallel_size=1,
                cpu_engines=engine.cpu_engines,
                fallback="",
                speculative={},
                engine=_with_packaged_context(engine, engine.model, False),
            ),
        )
    out = []
    for m in models:
        model = engine.model if m.model is None else m.model
        merged = dataclasses.replace(engine, **m.overrides)
        out.append(
            ServedModel(
                name=m.name,
                aliases=m.aliases,
                model=model,
                task=m.task or _packaged_task(model) or "generate",  # type: ignore[arg-type]
                # One model without gpus takes every GPU, as [engine] alone does.
                gpus=m.gpus or (None if len(models) == 1 else ()),
                tensor_parallel_size=m.tensor_parallel_size,
                cpu_engines=engine.cpu_engines if m.cpu_engines is None else m.cpu_engines,
                fallback=m.fallback,
                speculative=m.speculative,
                engine=_with_packaged_context(merged, model, "max_model_len" in m.overrides),
                load=m.load,
                idle_unload_s=m.idle_unload_s,
                swap=m.swap,
                load_timeout_s=m.load_timeout_s,
                min_residency_s=m.min_residency_s,
                adapters=m.adapters,
            )
        )
    return tuple(out)


# ---- parsing ---------------------------------------------------------------------------


def parse_models(raw: Any, problems: list[str]) -> tuple[ModelConfig, ...]:
    """The ``[[models]]`` array of tables, every problem named in ``problems``."""
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        problems.append(
            "models: must be an array of tables (one [[models]] block per model), got " + _show(raw)
        )
        return ()
    if not raw:
        problems.append("models = []: give at least one [[models]] table, or none at all")
    return tuple(_parse_table(i, t, problems) for i, t in enumerate(raw))


def _where(i: int, table: Mapping[str, Any]) -> str:
    name = table.get("name")
    return f"models[{i}]" + (f" ({_show(name)})" if isinstance(name, str) and name else "")


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
            problems.append(_unknown(f"{where}.", key, [*MODEL_KEYS, *MODEL_ENGINE_KEYS]))
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
    ok, converted = _coerce(value, tp)
    if not ok:
        problems.append(f"{where}.{key} = {_show(value)}: must be {_describe(tp)}")
        return None
    bad = check_bounds(converted, f.metadata)
    if bad:
        problems.append(f"{where}.{key} = {_show(value)}: must be {bad}")
        return None
    return converted


def _name_problem(value: Any) -> str | None:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        return f"{_show(value)}: must be 1-64 characters of a-z 0-9 . _ -"
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
            problems.append(f"{path} = {_show(value)}: must be a string")
            return False
        if not _packaged_ok(path, value, problems):
            return False
        out[key] = value
    elif key == "task":
        if value not in TASKS:
            problems.append(f"{path} = {_show(value)}: must be one of {', '.join(TASKS)}")
            return False
        out[key] = value
    elif key == "gpus":
        return _parse_gpus(path, value, out, problems)
    elif key in ("tensor_parallel_size", "cpu_engines"):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_GPUS:
            problems.append(f"{path} = {_show(value)}: must be an integer from 1 to {MAX_GPUS}")
            return False
        out[key] = value
    elif key in on_demand.KEYS:
        return on_demand.parse_key(path, key, value, out, problems)
    elif key == "fallback":
        if not isinstance(value, str):
            problems.append(f"{path} = {_show(value)}: must be a model's name")
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
        problems.append(f"{path} = {_show(value)}: must be a list of names")
        return False
    for alias in value:
        bad = _name_problem(alias)
        if bad:
            problems.append(f"{path}: {bad}")
            return False
    out[key] = tuple(value)
    return True


def _packaged_ok(path: str, model: str, problems: list[str]) -> bool:
    name = paths.packaged_name(model)
    if name is not None and name not in paths.PACKAGED_MODELS:
        known = ", ".join(f'"packaged:{n}"' for n in paths.PACKAGED_MODELS)
        problems.append(f"{path} = {_show(model)}: no such packaged model; packaged: {known}")
        return False
    return True


def _parse_gpus(path: str, value: Any, out: dict[str, Any], problems: list[str]) -> bool:
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(g, int) and not isinstance(g, bool) for g in value)
    )
    if not ok:
        problems.append(f"{path} = {_show(value)}: must be a non-empty list of GPU indices")
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
    if isinstance(model, str) and not _packaged_ok(f"{path}.model", model, problems):
        return False
    out["speculative"] = dict(value)
    return True
