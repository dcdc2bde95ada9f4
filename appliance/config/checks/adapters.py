"""A model's LoRA ``adapters`` (issue 23): names that are model names of their own, and
folders vLLM can load at a rank it serves.

A name clash is a rule of the config alone. Whether a folder is an adapter is read from
the folder (:func:`appliance.config.lora.adapter_rank`), so it is asked of the
:class:`~appliance.config.checks.facts.HostFacts` the caller gives (without one, no folder
is judged: parsing never reads the disk itself).
"""

from __future__ import annotations

from appliance.config.checks.facts import HostFacts
from appliance.config.lora import MAX_LORA_RANKS, AdapterError
from appliance.config.schema import Config
from appliance.config.words import label


def check(cfg: Config, i: int, problems: list[str], host: HostFacts | None = None) -> None:
    """The adapters of the model at index ``i``: each name unique among every model's
    names and the adapters before it; each folder, with ``host``, an adapter whose rank
    vLLM serves."""
    m = cfg.models[i]
    taken = {n: label(j, o.name) for j, o in enumerate(cfg.models) for n in (o.name, *o.aliases)}
    for j, a in enumerate(m.adapters):
        where = f"{label(i, m.name)}.adapters[{j}]"
        if a.name in taken:
            problems.append(
                f'{where}.name = "{a.name}": already a name of {taken[a.name]}; adapter '
                "names are model names and must be unique"
            )
        taken[a.name] = where
        if host is None:
            continue
        try:
            rank = host.adapter_rank(a.path)
        except AdapterError as exc:
            problems.append(f'{where}.path = "{a.path}": {exc}')
            continue
        if rank > MAX_LORA_RANKS[-1]:
            problems.append(
                f'{where}.path = "{a.path}": LoRA rank {rank} is above the largest vLLM '
                f"serves ({MAX_LORA_RANKS[-1]})"
            )
