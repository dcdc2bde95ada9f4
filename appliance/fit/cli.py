"""`llm-appliance models fit NAME_OR_PATH [--gpu-memory SIZE] [--gpus LIST] [--context N]`.

NAME_OR_PATH is a model the config serves (by name or alias: its own gpus, tensor
parallelism and limits apply), or anything a config's ``model`` may be: a folder, a model
id in the local Hugging Face cache, ``packaged:NAME`` (then ``[engine]``'s settings).
The options override what the config says. GPU sizes come from NVML; ``--gpu-memory``
gives one size for every GPU instead (a box without GPUs, or another box).

Exit 0: the weights and at least one sequence of the context fit every GPU. Exit 2: they
do not; the numbers and what to try follow. Exit 1: nothing to judge (no such model, no
GPU size known).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from appliance import paths
from appliance.config import load_config
from appliance.config.model_places import locate
from appliance.fit.check import GpuMemory, Settings, Verdict, detail_lines, judge, shape_line
from appliance.fit.check import summary as summary_line
from appliance.fit.sources import (
    FitSourceError,
    model_files,
    nvml_gpu_memory,
    parse_gpus,
    parse_size,
)

EXIT_FITS = 0
EXIT_CANNOT = 1
EXIT_DOES_NOT_FIT = 2


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of 1 or more, got {text!r}")
    return value


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a share above 0 and at most 1, got {text!r}")
    return value


def gpu_memory(option: str | None, nvml: Any | None = None) -> GpuMemory:
    """--gpu-memory for every GPU when given, else what NVML finds (maybe nothing)."""
    if option:
        return GpuMemory(assumed=parse_size(option))
    return GpuMemory(found=nvml_gpu_memory(nvml) or {})


def _settings(args: argparse.Namespace) -> tuple[str, Settings]:
    """The model as written (to locate) and how it would run: the config's model of
    that name, else [engine]'s settings; the options win."""
    config = load_config(args.config)
    served = config.model(args.model)
    if served is not None:
        model, settings = served.model, Settings.of_model(served)
    else:
        engine = config.engine
        gpus = None if engine.gpus == "auto" else tuple(engine.gpus)
        model, settings = args.model, Settings.of_engine(engine, gpus)
        if os.path.isdir(args.model) and not args.model.startswith(("/", ".", "~")):
            model = "./" + args.model  # a relative folder, not a model id
    changes: dict[str, Any] = {}
    if args.gpus:
        changes["gpus"] = tuple(parse_gpus(args.gpus))
    if args.context:
        changes["context"] = args.context
    if args.tensor_parallel_size:
        changes["tensor_parallel"] = args.tensor_parallel_size
    if args.gpu_memory_utilization:
        changes["gpu_memory_utilization"] = args.gpu_memory_utilization
    return model, dataclasses.replace(settings, **changes)


def _fail(message: str) -> int:
    print(f"llm-appliance models fit: {message}", file=sys.stderr)
    return EXIT_CANNOT


def cmd_fit(args: argparse.Namespace) -> int:
    try:
        model, settings = _settings(args)
        memory = gpu_memory(args.gpu_memory)
    except FitSourceError as exc:
        return _fail(str(exc))
    located = locate(model, paths.appliance_home(), os.environ)
    if located.path is None or located.problem is not None:
        return _fail(f"{args.model}: {located.problem}")
    try:
        files = model_files(located.path)
    except FitSourceError as exc:
        return _fail(str(exc))
    verdict = judge(files, settings, memory)
    if verdict.fit is None:
        hint = " (pass --gpu-memory SIZE, e.g. 24GiB)" if not memory.known else ""
        return _fail(f"{args.model}: cannot judge: {verdict.skipped}{hint}")
    if args.json:
        print(json.dumps(as_json(verdict), indent=2))
    else:
        print(f"{located.path}: {shape_line(files)}")
        for line in detail_lines(verdict):
            print(f"  {line}")
        print(summary_line(verdict))
    return EXIT_FITS if not verdict.fails else EXIT_DOES_NOT_FIT


def as_json(verdict: Verdict) -> dict[str, Any]:
    fit = verdict.fit
    assert fit is not None and verdict.files is not None
    return {
        "path": str(verdict.files.path),
        "fits": fit.fits,
        "context": fit.input.context,
        "tensor_parallel_size": fit.input.tensor_parallel,
        "weight_bytes": verdict.files.weight_bytes,
        "weights_estimated": verdict.files.weights_estimated,
        "kv_bytes_per_token": fit.kv_per_token,
        "gpus": [
            {
                "index": gpu,
                "total_bytes": g.total,
                "budget_bytes": g.budget,
                "weight_bytes": g.weights,
                "runtime_bytes": g.runtime,
                "kv_cache_bytes": max(0, g.kv_bytes),
                "kv_cache_tokens": g.kv_tokens,
                "sequences": g.sequences,
            }
            for gpu, g in zip(verdict.gpus, fit.gpus, strict=True)
        ],
        "suggestions": list(fit.suggestions),
    }


def add_fit_parser(actions: Any, common: argparse.ArgumentParser) -> None:
    """`models fit` under the ``models`` command."""
    p = actions.add_parser(
        "fit",
        parents=[common],
        help="whether a model's weights and one sequence of its context fit each GPU",
    )
    p.add_argument(
        "model",
        metavar="NAME_OR_PATH",
        help="a model the config serves (its name), a model folder, a cached model id, "
        "or packaged:NAME",
    )
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="each GPU's memory, e.g. 24GiB (default: what NVML finds on this box)",
    )
    p.add_argument(
        "--gpus", metavar="LIST", help="the GPUs, e.g. 0,1 (default: the config's, else all)"
    )
    p.add_argument(
        "--context",
        type=_positive,
        metavar="N",
        help="tokens of one sequence (default: the config's max_model_len)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive,
        metavar="N",
        help="GPUs per engine (default: the config's tensor_parallel_size, else 1)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=_share,
        metavar="F",
        help="share of each GPU vLLM may use (default: the config's, 0.90)",
    )
    p.add_argument("--json", action="store_true", help="the figures as JSON")
    p.set_defaults(func=cmd_fit)
