"""What a CPU engine runs on: its share of the cores, its dtype, its preloaded libraries.

Pure functions of what the caller read once (the usable cores, /proc/cpuinfo's flags,
the supervisor's own LD_PRELOAD): the plan splits the cores and picks the dtype, the
command line and environment (engine.py) carry them to vLLM's CPU backend.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


def cpu_core_sets(cores: Sequence[int], engines: int) -> list[tuple[int, ...]]:
    """Split the usable cores into contiguous sets, one per engine (empty: no cores known).

    With fewer cores than engines, engines share cores round-robin rather than fail: a
    2-core laptop asked for 4 engines is still useful for testing.
    """
    cores = sorted(cores)
    if not cores:
        return [()] * engines
    if engines > len(cores):
        return [(cores[i % len(cores)],) for i in range(engines)]
    per, extra = divmod(len(cores), engines)
    out, start = [], 0
    for i in range(engines):
        n = per + (1 if i < extra else 0)
        out.append(tuple(cores[start : start + n]))
        start += n
    return out


def omp_bind(cores: Sequence[int]) -> str:
    """A core set as a VLLM_CPU_OMP_THREADS_BIND value ("0-3", "4,6"; none: "all")."""
    return _ranges(cores) if cores else "all"


def _ranges(cores: Sequence[int]) -> str:
    parts: list[str] = []
    run_start = prev = cores[0]
    for c in [*cores[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(run_start) if run_start == prev else f"{run_start}-{prev}")
        if c is not None:
            run_start = prev = c
    return ",".join(parts)


# x86 CPU flags (as /proc/cpuinfo spells them) that run bfloat16 matmuls in hardware.
# Without one, vLLM's CPU kernels emulate bf16: on a 2-core AVX2 box prefill was 5-9x
# slower than float32 (TTFT p50 3.3 s vs 0.58 s at one stream) and eight streams got a
# quarter of float32's tokens/s (docs/decisions/0009-cpu-engines-float32-without-native-bf16.md).
BF16_CPU_FLAGS: tuple[str, ...] = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuDtype:
    """The CPU engine's dtype and why: shown in the start log, /admin/status and doctor."""

    dtype: str  # "bfloat16" | "float32", or what engine.extra_args says
    reason: str  # one line
    explicit: bool = False  # engine.extra_args sets --dtype: the command line gets none of ours

    def as_json(self) -> dict[str, str]:
        return {"dtype": self.dtype, "reason": self.reason}


def dtype_in_args(args: Sequence[str]) -> str | None:
    """The value of ``--dtype`` in an argument list (either spelling; the last wins, as
    in argparse), or None when the list does not set it."""
    found: str | None = None
    for i, arg in enumerate(args):
        if arg == "--dtype" and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith("--dtype="):
            found = arg.split("=", 1)[1]
    return found


def choose_cpu_dtype(cpu_flags: Collection[str], extra_args: Sequence[str] = ()) -> CpuDtype:
    """bfloat16 where the processor computes it natively, float32 otherwise.

    ``cpu_flags`` are the processor's feature flags (/proc/cpuinfo's ``flags``, read once
    by the caller); an explicit ``--dtype`` in ``extra_args`` wins over both.
    """
    explicit = dtype_in_args(extra_args)
    if explicit is not None:
        return CpuDtype(explicit, "engine.extra_args sets --dtype", explicit=True)
    native = [f for f in BF16_CPU_FLAGS if f in cpu_flags]
    if native:
        return CpuDtype("bfloat16", f"the CPU has {'/'.join(native)}: bfloat16 runs natively")
    return CpuDtype(
        "float32",
        "the CPU has neither avx512_bf16 nor amx_bf16: bfloat16 would be emulated "
        "(several times slower), float32 runs natively",
    )


def ld_preload(libs: Sequence[str], inherited: str = "") -> str:
    """``libs`` first, then whatever the supervisor's own LD_PRELOAD held (no repeats)."""
    entries = [*libs, *(e for e in inherited.replace(" ", ":").split(":") if e)]
    return ":".join(dict.fromkeys(entries))
