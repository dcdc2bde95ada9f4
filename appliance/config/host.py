"""What the checks need to know of this host, read from it: its RAM, the size of a model's
weights, and whether a folder is a LoRA adapter (and its rank).

:class:`LocalHost` is the :class:`~appliance.config.checks.facts.HostFacts` that
:func:`appliance.config.load.load_config` gives the checks; parsing itself reads none of
this (a test gives a fake instead). A model's size is the size of its weight files
(``*.safetensors``, else ``*.bin``) when its folder is on this host (a local path or a
prepared ``packaged:`` model); the host's RAM is ``MemTotal`` in ``/proc/meminfo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance import paths
from appliance.config.lora import adapter_rank

MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class LocalHost:
    """This host's facts, read when a check asks (``meminfo``: where MemTotal is)."""

    meminfo: Path = MEMINFO

    def mem_total(self) -> int | None:
        return mem_total(self.meminfo)

    def weights_bytes(self, model: str) -> int | None:
        return weights_bytes(model_folder(model))

    def adapter_rank(self, path: str) -> int:
        return adapter_rank(path)


def model_folder(model: str) -> Path | None:
    """The model's folder on this host, or None (a model id: no size known here)."""
    packaged = paths.packaged_name(model)
    if not model or packaged is not None:
        try:
            return paths.packaged_model(
                paths.appliance_home(), packaged or paths.PACKAGED_MODEL_NAME
            )
        except KeyError:  # an unknown packaged name: another check says so
            return None
    folder = Path(model).expanduser()
    return folder if folder.is_dir() else None


def weights_bytes(folder: Path | None) -> int | None:
    """The size of the weights vLLM would load from ``folder`` (safetensors when there
    are any, else .bin files); None when there are none or the folder is unreadable."""
    if folder is None:
        return None
    try:
        for pattern in ("*.safetensors", "*.bin"):
            files = [f for f in folder.glob(pattern) if f.is_file()]
            if files:
                return sum(f.stat().st_size for f in files)
    except OSError:
        return None
    return None


def mem_total(meminfo: Path = MEMINFO) -> int | None:
    """The host's RAM in bytes (``MemTotal``), or None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
