"""check-config: host RAM too small for the weights that models on demand put to sleep.

vLLM's sleep level 1 (``swap = "sleep"``) moves a model's weights from the GPU into host
RAM. Every such model can be asleep at once (idle unload, or an admin's unload, puts even
the last holder of a slot to sleep), each engine of it holding its own copy; if their sum
is more than the host has, the layout cannot work and ``check-config`` says so, naming the
models, their sizes and the RAM.

A model's size is the size of its weight files (``*.safetensors``, else ``*.bin``) when
its folder is on this host (a local path or a prepared ``packaged:`` model); a model id
in the local cache, or a folder without such files, has no known size and is not
counted (the message says so when the known ones alone are too many). The host's RAM is
its ``MemTotal``, asked once per check; unknown: no check. Both are asked of the
:class:`~appliance.config.checks.facts.HostFacts` the caller gives (the real host's reads
are :mod:`appliance.config.host`); without one there is no check.
"""

from __future__ import annotations

from collections.abc import Sequence

from appliance.config.checks.facts import HostFacts
from appliance.config.schema import Config, ServedModel

GIB = 1024**3


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def ram_problem(asleep: Sequence[tuple[str, int, int | None]], mem_total: int | None) -> str | None:
    """Why ``asleep`` — (model, engines, bytes of weights or None: unknown) — cannot all
    sleep in ``mem_total`` bytes of host RAM; None when they can, or when it is unknown."""
    known = [(name, engines, size) for name, engines, size in asleep if size is not None]
    total = sum(engines * size for _, engines, size in known)
    if mem_total is None or not known or total <= mem_total:
        return None
    parts = [
        f"{name} {gib(size)}" + (f" × {engines} engines" if engines > 1 else "")
        for name, engines, size in known
    ]
    unknown = [name for name, _, size in asleep if size is None]
    note = f" (size unknown, not counted: {', '.join(unknown)})" if unknown else ""
    names = ", ".join(f'"{name}"' for name, _, _ in known)
    return (
        f'models ({names}) with swap = "sleep": asleep, their weights sit in host RAM, '
        f"{' + '.join(parts)} = {gib(total)}{note}, but this host has {gib(mem_total)} "
        "(MemTotal); all of them can be asleep at once (idle unload or an admin's unload), "
        'so use swap = "stop" for some of them, or add RAM'
    )


def check(cfg: Config, problems: list[str], host: HostFacts | None = None) -> None:
    """The sleeping models' weights against the RAM of ``host`` (None: no check)."""
    sleepers = [m for m in cfg.served if m.on_demand and m.swap == "sleep"]
    if not sleepers or host is None:
        return
    asleep = [(m.name, _engines(m), host.weights_bytes(m.model)) for m in sleepers]
    problem = ram_problem(asleep, host.mem_total())
    if problem is not None:
        problems.append(problem)


def _engines(m: ServedModel) -> int:
    """Engines of the model, each with its own copy asleep (unknown GPUs: at least one)."""
    return max(1, len(m.gpus) // m.tensor_parallel_size) if m.gpus else 1
