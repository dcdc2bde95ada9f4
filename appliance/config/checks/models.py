"""Rules across ``[[models]]`` tables and ``[engine]``: unique names, one owner per GPU,
whole tensor-parallel groups, fallbacks that exist and do the same job, one name source.

Each message names the table (``models[1] ("embed")``) and says what would be right.
"""

from __future__ import annotations

import dataclasses

from appliance import paths
from appliance.config.checks import on_demand, sleep_ram
from appliance.config.checks.facts import HostFacts
from appliance.config.checks.parsers import check_parsers
from appliance.config.checks.sections import check_engine_keys
from appliance.config.schema import Config, ModelConfig, ServedModel
from appliance.config.words import label, show


def check_packaged(path: str, model: str, problems: list[str]) -> bool:
    """A ``packaged:NAME`` model at key ``path`` must be one set-up knows; False (and the
    problem named) when it is not. Any other model string is judged elsewhere."""
    name = paths.packaged_name(model)
    if name is not None and name not in paths.PACKAGED_MODELS:
        known = ", ".join(f'"packaged:{n}"' for n in paths.PACKAGED_MODELS)
        problems.append(f"{path} = {show(model)}: no such packaged model; packaged: {known}")
        return False
    return True


def check(cfg: Config, problems: list[str], host: HostFacts | None = None) -> None:
    """The rules across the models and [engine], in the order their problems are listed;
    those that read the host (adapter folders, sleeping weights) only with ``host``."""
    # [engine].model is every table's default, and the one model without tables.
    check_packaged("engine.model", cfg.engine.model, problems)
    # [engine]'s parsers are every generate model's default; an embed model ignores them,
    # unless it is the one model of a config without tables.
    alone_embed = not cfg.models and cfg.served[0].task == "embed"
    check_parsers(dataclasses.asdict(cfg.engine), "engine", problems, embed=alone_embed)
    if not cfg.models:
        return
    _check_engine_section(cfg, problems)
    _check_unique_names(cfg.models, problems)
    _check_gpus(cfg, problems)
    _check_fallbacks(cfg, problems)
    on_demand.check(cfg, problems, host)
    sleep_ram.check(cfg, problems, host)
    for i, (m, served) in enumerate(zip(cfg.models, cfg.served, strict=True)):
        _check_task(i, m, served, problems)
        check_parsers(m.overrides, label(i, m.name), problems, embed=served.task == "embed")
        if "command" in m.overrides or "env" in m.overrides:
            check_engine_keys(served.engine, label(i, m.name), problems)


def _check_engine_section(cfg: Config, problems: list[str]) -> None:
    e = cfg.engine
    if isinstance(e.gpus, list):
        problems.append(
            "engine.gpus: with [[models]] each model has its own `gpus`; remove engine.gpus"
        )
    if e.served_model_name:
        problems.append(
            "engine.served_model_name: with [[models]] each model's `name` (and "
            "`aliases`) is what clients send; remove engine.served_model_name"
        )


def _check_unique_names(models: tuple[ModelConfig, ...], problems: list[str]) -> None:
    owner: dict[str, int] = {}
    for i, m in enumerate(models):
        for n in (m.name, *m.aliases):
            if n in owner:
                j = owner[n]
                what = "the name" if n == models[j].name else "an alias"
                problems.append(
                    f"{label(i, m.name)}: {show(n)} is already {what} of "
                    f"{label(j, models[j].name)}; names and aliases must be unique"
                )
            else:
                owner[n] = i


def _check_gpus(cfg: Config, problems: list[str]) -> None:
    owner: dict[int, int] = {}
    several = len(cfg.models) > 1
    for i, m in enumerate(cfg.models):
        tp = m.tensor_parallel_size
        if not m.gpus:
            if several and cfg.engine.device != "cpu":
                problems.append(
                    f"{label(i, m.name)}.gpus: missing; with several models each needs its "
                    'GPUs, e.g. gpus = [0] (or set engine.device = "cpu")'
                )
            elif tp > 1 and cfg.engine.device != "cpu":
                problems.append(
                    f"{label(i, m.name)}.tensor_parallel_size = {tp}: give the model's gpus "
                    f"(a multiple of {tp} of them)"
                )
        elif len(m.gpus) % tp:
            problems.append(
                f"{label(i, m.name)}.gpus = {list(m.gpus)!r}: {len(m.gpus)} GPU(s) is not a "
                f"multiple of tensor_parallel_size = {tp} (each engine takes {tp})"
            )
        if m.gpus and cfg.engine.device == "cpu":
            problems.append(
                f'{label(i, m.name)}.gpus: a GPU list needs engine.device = "cuda" or '
                '"auto" (with device = "cpu" use cpu_engines)'
            )
        elif tp > 1 and cfg.engine.device == "cpu":
            problems.append(
                f"{label(i, m.name)}.tensor_parallel_size = {tp}: needs GPUs "
                '(engine.device = "cpu"); on CPU use cpu_engines'
            )
        for g in m.gpus:
            if g not in owner:
                owner[g] = i
                continue
            j = owner[g]
            problem = on_demand.shared_gpus_problem(i, m, j, cfg.models[j], g)
            if problem is not None:
                problems.append(problem)


def _check_fallbacks(cfg: Config, problems: list[str]) -> None:
    by_name = {n: i for i, m in enumerate(cfg.models) for n in (m.name, *m.aliases)}
    for i, m in enumerate(cfg.models):
        if not m.fallback:
            continue
        where = f"{label(i, m.name)}.fallback = {show(m.fallback)}"
        j = by_name.get(m.fallback)
        if j is None:
            problems.append(f"{where}: no model has that name; models: " + _names(cfg))
        elif j == i:
            problems.append(f"{where}: a model cannot fall back to itself")
        elif cfg.served[j].task != cfg.served[i].task:
            problems.append(
                f"{where}: {cfg.served[j].name} serves {cfg.served[j].task}, this model "
                f"{cfg.served[i].task}; a fallback must do the same job"
            )
        elif _fallback_target(cfg, j, by_name) == i:
            problems.append(
                f"{where}: {cfg.models[j].name} falls back to this model: a cycle "
                "(fallback is one hop; remove one of the two)"
            )


def _fallback_target(cfg: Config, i: int, by_name: dict[str, int]) -> int | None:
    fb = cfg.models[i].fallback
    return by_name.get(fb) if fb else None


def _names(cfg: Config) -> str:
    return ", ".join(m.name for m in cfg.models)


def _check_task(i: int, m: ModelConfig, served: ServedModel, problems: list[str]) -> None:
    # model = "" is the packaged SmolLM2, as much as "packaged:smollm2-135m-instruct" is.
    name = paths.packaged_name(served.model) if served.model else paths.PACKAGED_MODEL_NAME
    packaged = paths.PACKAGED_MODELS.get(name) if name is not None else None
    if packaged is not None and m.task is not None and m.task != packaged.task:
        model = served.model or paths.PACKAGED_PREFIX + packaged.name
        problems.append(
            f'{label(i, m.name)}.task = "{m.task}": {model} is a model for task = "{packaged.task}"'
        )
    if served.task == "embed" and served.speculative:
        problems.append(
            f"{label(i, m.name)}.speculative: speculative decoding is for generate models, "
            "not embeddings"
        )
