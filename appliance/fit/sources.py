"""Where the fit check's figures come from: a model folder (config.json and the weight
files' sizes), NVML (each GPU's memory) and sizes as people write them ("24GiB").

The weights are what vLLM loads: the safetensors files (only those the index names when
there is one, so a folder that carries both Mistral's consolidated file and the Hugging
Face shards counts one copy), else the PyTorch files, else a GGUF file; each file once,
through the hub cache's links. A folder with a config.json and no weights is estimated
from the shape (:meth:`appliance.fit.estimate.ModelShape.estimated_weight_bytes`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.fit.estimate import GIB, ModelShape, ShapeError, shape_from_config

CONFIG_MAX_BYTES = 4 * 1024 * 1024
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)


class FitSourceError(ValueError):
    """A model folder or an option the fit check cannot use; the message says why."""


@dataclass(frozen=True)
class ModelFiles:
    """A model folder's shape and weight bytes."""

    path: Path
    shape: ModelShape
    weight_bytes: int
    weights_estimated: bool  # no weight files: estimated from config.json


def parse_size(text: str) -> int:
    """Bytes in "24GiB", "24 GiB", "24G" (GiB: GPU memory is counted in powers of two),
    "24GB" (10^9), "25757220864" (bytes) or "24" (GiB)."""
    m = _SIZE_RE.fullmatch(text)
    if m is None:
        raise FitSourceError(
            f"--gpu-memory {text!r}: give a size such as 24GiB, 24GB, 80GiB or 25757220864"
        )
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if not unit:  # a plain byte count (NVML's figure pasted), else GiB
        factor = 1 if "." not in m.group(1) and number >= 1024**2 else GIB
    elif unit == "B":
        factor = 1
    else:  # K, Ki, KiB: powers of two (as GPU memory is counted); KB: powers of ten
        power = "KMGT".index(unit[0]) + 1
        factor = 1000**power if unit.endswith("B") and "I" not in unit else 1024**power
    size = int(number * factor)
    if size < GIB // 4:
        raise FitSourceError(f"--gpu-memory {text!r}: that is less than a quarter GiB")
    return size


def parse_gpus(text: str) -> list[int]:
    """ "0,1" -> [0, 1]."""
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        gpus = []
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise FitSourceError(f"--gpus {text!r}: give GPU indexes such as 0 or 0,1")
    return gpus


def read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        with path.open("rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise FitSourceError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        doc = json.loads(raw[:CONFIG_MAX_BYTES])
    except ValueError as exc:
        raise FitSourceError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FitSourceError(f"{path}: not a JSON object")
    return doc


def _indexed(folder: Path) -> set[str] | None:
    """The shard files model.safetensors.index.json names, or None without an index."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return {str(v) for v in weight_map.values()}
    return None


def _sum_once(paths: Iterable[Path]) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def weight_files(folder: Path) -> list[Path]:
    """The files vLLM would load the weights from (see the module's docstring)."""
    safetensors = sorted(folder.glob("*.safetensors"))
    if safetensors:
        named = _indexed(folder)
        if named is not None:
            return [p for p in safetensors if p.name in named]
        shards = [p for p in safetensors if not p.name.startswith("consolidated")]
        return shards or safetensors
    for pattern in ("*.bin", "*.pt", "*.pth", "*.gguf"):
        found = [p for p in sorted(folder.glob(pattern)) if not p.name.startswith("training_")]
        if found:
            return found
    return []


def model_files(path: Path) -> ModelFiles:
    """The shape and weight bytes of the model at ``path`` (a folder with config.json)."""
    if path.is_file():
        raise FitSourceError(
            f"{path}: a single file; the fit check reads a Hugging Face folder (config.json)"
        )
    if not (path / "config.json").is_file():
        raise FitSourceError(f"{path} has no config.json (not a Hugging Face model folder)")
    try:
        shape = shape_from_config(read_config_json(path))
    except ShapeError as exc:
        raise FitSourceError(f"{path}/config.json: {exc}") from None
    size = _sum_once(weight_files(path))
    if size:
        return ModelFiles(path, shape, size, False)
    return ModelFiles(path, shape, shape.estimated_weight_bytes(), True)


def nvml_gpu_memory(nvml: Any | None = None) -> dict[int, int] | None:
    """Each GPU's total memory by index, from NVML; None without NVML (no library, no
    driver, no GPU). ``nvml``: the pynvml module (a fake in tests); None imports it."""
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        out = {}
        for i in range(int(nvml.nvmlDeviceGetCount())):
            with contextlib.suppress(nvml.NVMLError):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                out[i] = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        return out or None
    except nvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
