"""Deciding which engines to run: device, GPUs, cores, ports, python and model.

Pure given its inputs (detected GPU count, usable cores, set-up home), so every case —
GPU, CPU, ``command`` override, a missing venv — is tested without hardware.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import paths
from appliance.config import Config
from appliance.endpoint import EngineAddress, socket_path
from appliance.engine import (
    EngineSpec,
    build_argv,
    build_env,
    cpu_core_sets,
    omp_bind,
    served_name,
)
from appliance.errors import ConfigError, EngineSetupError

SETUP_HINT = "run `llm-appliance setup` (or `scripts/setup` in a checkout) to create it"


@dataclass(frozen=True)
class EnginePlan:
    device: str  # "cuda" | "cpu"
    python: str
    model: str
    served_model_name: str
    specs: tuple[EngineSpec, ...]
    boot_id: str


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def _uses(config: Config, placeholder: str) -> bool:
    return any("{" + placeholder + "}" in a for a in config.engine.command)


def resolve_python_and_model(config: Config, home: Path) -> tuple[str, str]:
    """The engine python and model, checked to exist where we can tell."""
    e = config.engine
    python = e.python or str(paths.engine_python(home))
    # vLLM gets the argv without a shell: expand ~ here or it reaches vLLM literally.
    model = str(Path(e.model).expanduser()) if e.model else str(paths.packaged_model(home))
    need_python = not e.command or _uses(config, "python")
    need_model = not e.command or _uses(config, "model")
    if need_python and not Path(python).exists():
        where = "engine.python" if e.python else f"the engine venv (expected {python})"
        raise EngineSetupError(
            f"{where} does not exist: {SETUP_HINT}"
            if not e.python
            else f"engine.python = {e.python!r} does not exist; fix the path or "
            f'set it to "" and {SETUP_HINT}'
        )
    if need_model:
        if not e.model and not (Path(model) / "config.json").exists():
            raise EngineSetupError(
                f"the packaged model is not prepared (expected {model}/config.json): {SETUP_HINT}"
            )
        if e.model and _looks_like_path(e.model) and not Path(e.model).expanduser().exists():
            raise EngineSetupError(
                f"engine.model = {e.model!r}: no such folder (models are "
                "never downloaded at run time)"
            )
    return python, model


def engine_address(config: Config, engine_id: int, socket_dir: Path | None) -> EngineAddress:
    if config.engine.listen == "tcp":
        return EngineAddress(port=config.engine.port_base + engine_id)
    if socket_dir is None:
        raise ValueError('engine.listen = "unix" needs the private socket directory')
    return EngineAddress(uds=socket_path(socket_dir, engine_id))


def plan_engines(
    config: Config,
    *,
    gpu_count: int,
    cores: Sequence[int],
    home: Path,
    base_env: Mapping[str, str],
    socket_dir: Path | None = None,
) -> EnginePlan:
    """The engines to run; ``socket_dir`` holds their sockets with engine.listen = unix."""
    e = config.engine
    if e.device == "cuda" and gpu_count == 0:
        raise ConfigError(
            ['engine.device = "cuda": no NVIDIA GPU found through NVML (use "auto" or "cpu")'],
            config.source,
        )
    device = "cpu" if e.device == "cpu" or (e.device == "auto" and gpu_count == 0) else "cuda"
    gpus: list[int | None]
    if device == "cuda":
        if isinstance(e.gpus, list):
            missing = [g for g in e.gpus if g >= gpu_count]
            if missing:
                raise ConfigError(
                    [
                        f"engine.gpus = {e.gpus!r}: GPU(s) {missing} not present "
                        f"(NVML sees {gpu_count}: 0..{gpu_count - 1})"
                    ],
                    config.source,
                )
            gpus = list(e.gpus)
        else:
            gpus = list(range(min(gpu_count, 8)))
        binds: list[str | None] = [None] * len(gpus)
        core_sets: list[tuple[int, ...]] = [()] * len(gpus)
    else:
        gpus = [None] * e.cpu_engines
        core_sets = cpu_core_sets(cores, e.cpu_engines)
        binds = [omp_bind(s) for s in core_sets]
    python, model = resolve_python_and_model(config, home)
    name = (
        served_name(config, model)
        if e.model
        else (e.served_model_name or paths.PACKAGED_MODEL_NAME)
    )
    boot_id = secrets.token_hex(4)
    specs = []
    for i, gpu in enumerate(gpus):
        address = engine_address(config, i, socket_dir)
        tag = f"{boot_id}-{i}"
        argv = build_argv(
            config,
            python=python,
            model=model,
            address=address,
            gpu=gpu,
            served_model_name=name,
            on_gpu=device == "cuda",
        )
        env = build_env(config, base_env, gpu=gpu, cpu_bind=binds[i], engine_tag=tag)
        # Pin a CPU engine's whole tree to its own cores, unless engine.env overrides the
        # OMP binding (then the admin has their own layout). Unpinned, a starting engine is
        # stuck behind its neighbour: at import, MKL hops onto every allowed core in turn
        # to count them, and on a core where the other engine's OpenMP threads spin it can
        # wait minutes to run (seen here: a restart never became READY).
        pinned = binds[i] is not None and env.get("VLLM_CPU_OMP_THREADS_BIND") == binds[i]
        specs.append(
            EngineSpec(
                id=i,
                gpu=gpu,
                address=address,
                argv=argv,
                tag=tag,
                env=env,
                served_model_name=name,
                cpus=core_sets[i] if pinned and core_sets[i] else None,
            )
        )
    return EnginePlan(device, python, model, name, tuple(specs), boot_id)


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))
