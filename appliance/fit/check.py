"""The fit check of a model as the config serves it, and of every model the config names.

``models fit``, ``check-config`` and ``doctor`` share it: the model's folder
(:mod:`appliance.config.model_places` finds it), its GPUs (``gpus``, or every GPU found),
its ``tensor_parallel_size``, ``max_model_len``, ``gpu_memory_utilization``,
``max_num_batched_tokens`` and ``--dtype`` / ``--kv-cache-dtype`` in ``extra_args``,
against each GPU's memory (NVML, or a size given for every GPU: ``--gpu-memory``).
A CPU config, or a box without GPUs and no size given, is not judged: the verdict says
why in a word, and nothing fails for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance.config.model_places import locate, named_models
from appliance.config.schema import Config, EngineConfig, ServedModel
from appliance.fit.estimate import DTYPE_BYTES, Fit, FitInput, estimate, gib
from appliance.fit.sources import FitSourceError, ModelFiles, model_files

KIB = 1024


@dataclass(frozen=True)
class GpuMemory:
    """Each GPU's memory: what NVML found (``found``), or one size for every GPU
    (``assumed``: --gpu-memory, which wins)."""

    found: Mapping[int, int] = dataclasses.field(default_factory=dict)
    assumed: int | None = None

    def gpus(self, wanted: Sequence[int] | None, at_least: int = 1) -> list[int]:
        """The GPUs a model gets: ``wanted``, else every GPU found, else (a size given
        for a box not here) as many as one engine needs."""
        if wanted is not None:
            return list(wanted)
        if self.found:
            return sorted(self.found)
        return list(range(at_least)) if self.assumed else []

    def of(self, gpu: int) -> int | None:
        return self.assumed if self.assumed is not None else self.found.get(gpu)

    @property
    def known(self) -> bool:
        return bool(self.found) or self.assumed is not None


@dataclass(frozen=True)
class Settings:
    """How an engine runs the model (the config's keys, or the command line's)."""

    context: int
    gpus: tuple[int, ...] | None  # None: every GPU
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.90
    max_num_batched_tokens: int = 8192
    dtype: str = ""  # --dtype in extra_args ("" or "auto": the model's)
    kv_dtype: str = ""  # --kv-cache-dtype ("" or "auto": the model's dtype)

    @classmethod
    def of_engine(
        cls, engine: EngineConfig, gpus: tuple[int, ...] | None, tensor_parallel: int = 1
    ) -> Settings:
        args = list(engine.extra_args)
        return cls(
            context=engine.max_model_len,
            gpus=gpus,
            tensor_parallel=tensor_parallel,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            dtype=_arg(args, "--dtype"),
            kv_dtype=_arg(args, "--kv-cache-dtype"),
        )

    @classmethod
    def of_model(cls, served: ServedModel) -> Settings:
        return cls.of_engine(served.engine, served.gpus, served.tensor_parallel_size)


def _arg(args: Sequence[str], flag: str) -> str:
    """The value of ``flag`` in an argument list (either spelling, the last one wins);
    "" when absent or "auto"."""
    value = ""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return "" if value == "auto" else value


@dataclass(frozen=True)
class Verdict:
    """The fit of one model: ``fit`` when judged, else ``skipped`` (why, in a few words)."""

    files: ModelFiles | None
    settings: Settings
    fit: Fit | None = None
    skipped: str = ""
    gpus: tuple[int, ...] = ()

    @property
    def fails(self) -> bool:
        return self.fit is not None and not self.fit.fits


def judge(files: ModelFiles, settings: Settings, memory: GpuMemory) -> Verdict:
    """The fit of the model in ``files`` run with ``settings`` on the GPUs in ``memory``."""
    if not memory.known:
        return Verdict(files, settings, skipped="no NVIDIA GPU here and no GPU size given")
    tp = max(1, settings.tensor_parallel)
    gpus = memory.gpus(settings.gpus, tp)
    if not gpus:
        return Verdict(files, settings, skipped="no GPUs assigned to it")
    if len(gpus) < tp:
        return Verdict(
            files,
            settings,
            skipped=f"tensor_parallel_size {tp} needs {tp} GPUs; it has {len(gpus)}",
            gpus=tuple(gpus),
        )
    sizes = [memory.of(g) for g in gpus]
    missing = [g for g, s in zip(gpus, sizes, strict=True) if s is None]
    if missing:
        found = ", ".join(map(str, sorted(memory.found))) or "none"
        return Verdict(
            files,
            settings,
            skipped=f"GPU {', '.join(map(str, missing))} not found (found: {found})",
            gpus=tuple(gpus),
        )
    shape = files.shape
    if settings.dtype and settings.dtype in DTYPE_BYTES:
        shape = dataclasses.replace(shape, dtype=settings.dtype)
    fin = FitInput(
        shape=shape,
        weight_bytes=files.weight_bytes,
        gpu_bytes=tuple(s for s in sizes if s is not None),
        context=settings.context,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel=tp,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        kv_dtype=settings.kv_dtype if settings.kv_dtype in DTYPE_BYTES else "",
        weights_estimated=files.weights_estimated,
    )
    return Verdict(files, settings, estimate(fin), gpus=tuple(gpus))


# ---- words ---------------------------------------------------------------------------


def size_of(n: int) -> str:
    return f"{n / KIB:.1f} KiB" if n >= KIB else f"{n} B"


def shape_line(files: ModelFiles) -> str:
    s = files.shape
    heads = f"MLA latent {s.kv_latent}" if s.kv_latent else f"{s.kv_heads} KV heads × {s.head_dim}"
    quant = f", {s.quantization} {s.weight_bits:g}-bit" if s.quantization else ""
    moe = f", {s.experts} experts" if s.experts else ""
    how = "estimated from config.json: no weight files" if files.weights_estimated else "files"
    return (
        f"{s.architecture or 'model'}: {s.layers} layers, {heads}, {s.dtype}{quant}{moe}; "
        f"weights {gib(files.weight_bytes)} ({how})"
    )


def summary(verdict: Verdict) -> str:
    """One line: fits (with the figures of the tightest GPU), does not fit (why), or
    skipped (why)."""
    fit = verdict.fit
    if fit is None:
        return f"fit check skipped: {verdict.skipped}"
    w, ctx = fit.worst, fit.input.context
    tp = fit.input.tensor_parallel
    over = f" over {tp} GPUs" if tp > 1 else ""
    where = f"{gib(w.budget)} of GPU ({gib(w.total)} × {fit.input.gpu_memory_utilization:g}){over}"
    if fit.input.shape.encoder_only and w.weights_fit:
        return f"fits: {gib(w.weights)} of weights per GPU in {where}; no KV cache (an encoder)"
    if not w.weights_fit:
        return (
            f"does not fit: {gib(w.weights)} of weights + {gib(w.runtime)} for vLLM's runtime "
            f"per GPU exceed {where}"
        )
    kv = f"KV cache {gib(w.kv_bytes)} = {w.kv_tokens:,} tokens ({size_of(fit.kv_per_token)} each)"
    if w.sequences < 1:
        return (
            f"does not fit: {gib(w.weights)} of weights per GPU leave {kv} in {where}: "
            f"not one sequence of max_model_len {ctx:,}"
        )
    return (
        f"fits: {gib(w.weights)} of weights per GPU, {kv}: "
        f"{w.sequences} sequence(s) of {ctx:,} at once, in {where}"
    )


def detail_lines(verdict: Verdict) -> list[str]:
    """Per GPU: budget, weights, runtime, KV cache; then what to try."""
    fit = verdict.fit
    if fit is None:
        return []
    out = []
    for gpu, g in zip(verdict.gpus, fit.gpus, strict=True):
        left = (
            f"{gib(g.kv_bytes)} left for the KV cache = {g.kv_tokens:,} tokens"
            if g.weights_fit
            else "nothing left for the KV cache"
        )
        out.append(
            f"GPU {gpu}: {gib(g.total)} × {fit.input.gpu_memory_utilization:g} = "
            f"{gib(g.budget)}: weights {gib(g.weights)}, runtime {gib(g.runtime)}, {left}"
        )
    out += [f"try: {s}" for s in fit.suggestions]
    return out


# ---- every model of a config -----------------------------------------------------------


@dataclass(frozen=True)
class ModelVerdict:
    """One model the config names (its key path and value) and its verdict; ``problem``
    when its files could not be read (check-config names that elsewhere)."""

    served: str
    key: str
    value: str
    verdict: Verdict | None
    problem: str = ""

    def line(self) -> str:
        v = self.verdict
        head = f"{self.key} = {self.value!r}" if self.value else f"{self.key} (the packaged model)"
        if v is None:
            return f"{head}: fit check skipped: {self.problem}"
        text = summary(v)
        if v.fit is not None and not v.fit.fits:
            text += "; try: " + "; or ".join(v.fit.suggestions)
        return f"{head}: {text}"


def check_config_models(
    config: Config, home: Path, env: Mapping[str, str], memory: GpuMemory
) -> list[ModelVerdict]:
    """The fit of every model the config serves (drafts ride along with their model:
    not judged on their own). A CPU config is skipped as a whole: []."""
    if config.engine.device == "cpu":
        return []
    out = []
    eenv = {**env, **config.engine.env}
    for named in named_models(config):
        served = config.model(named.served)
        if named.draft or served is None:
            continue
        settings = Settings.of_model(served)
        try:
            located = locate(named.value, home, eenv)
        except OSError as exc:
            out.append(ModelVerdict(served.name, named.key, named.value, None, str(exc)))
            continue
        if located.path is None or located.problem is not None:
            continue  # missing or not a model: check-config and doctor say so already
        try:
            files = model_files(located.path)
        except FitSourceError as exc:
            out.append(ModelVerdict(served.name, named.key, named.value, None, str(exc)))
            continue
        verdict = judge(files, settings, memory)
        out.append(ModelVerdict(served.name, named.key, named.value, verdict))
    return out
