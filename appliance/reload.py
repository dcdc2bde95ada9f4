"""What a SIGHUP can change in a running daemon, and what needs a restart.

Engines keep running across a reload, so anything baked into an engine's command line or
the listening socket needs a restart; admission limits, policies and timers are read
from the current config on every use, so they change live. Which keys are live is said
on each field (``live=True`` in :mod:`appliance.config`); ``LIVE_KEYS`` is derived there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from appliance.config import LIVE_KEYS, SECTIONS, Config, ModelConfig

__all__ = ["LIVE_KEYS", "changed_keys", "merge_live"]


def changed_keys(old: Config, new: Config) -> list[str]:
    out = []
    for name in SECTIONS:
        a: Any = getattr(old, name)
        b: Any = getattr(new, name)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                out.append(f"{name}.{f.name}")
    _, live, restart = _merge_models(old.models, new.models)
    return out + live + restart


def _merge_models(
    old: tuple[ModelConfig, ...], new: tuple[ModelConfig, ...]
) -> tuple[tuple[ModelConfig, ...], list[str], list[str]]:
    """(models in force, live keys applied, keys needing a restart) for [[models]].

    A model's own keys (its name, GPUs, task, ...) shape its engines: a restart. Its
    overrides of live [engine] keys apply like [engine]'s own.
    """
    if old == new:
        return old, [], []
    if [m.name for m in old] != [m.name for m in new]:
        return old, [], ["models"]
    merged, live, restart = [], [], []
    for a, b in zip(old, new, strict=True):
        fixed_a = dataclasses.replace(a, overrides={})
        if fixed_a != dataclasses.replace(b, overrides={}):
            restart += [
                f"models.{a.name}.{f.name}"
                for f in dataclasses.fields(a)
                if f.name != "overrides" and getattr(a, f.name) != getattr(b, f.name)
            ]
        overrides = dict(a.overrides)
        for key in sorted(set(a.overrides) | set(b.overrides)):
            if a.overrides.get(key) == b.overrides.get(key):
                continue
            if f"engine.{key}" not in LIVE_KEYS:
                restart.append(f"models.{a.name}.{key}")
            else:
                live.append(f"models.{a.name}.{key}")
                if key in b.overrides:
                    overrides[key] = b.overrides[key]
                else:
                    overrides.pop(key, None)
        merged.append(dataclasses.replace(a, overrides=overrides))
    return tuple(merged), live, restart


def merge_live(old: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """(config in force, keys applied live, keys that need a restart and were not applied)."""
    live, restart = [], []
    sections: dict[str, Any] = {}
    for name in SECTIONS:
        a: Any = getattr(old, name)
        b: Any = getattr(new, name)
        updates = {}
        for f in dataclasses.fields(a):
            key = f"{name}.{f.name}"
            if getattr(a, f.name) == getattr(b, f.name):
                continue
            if key in LIVE_KEYS:
                updates[f.name] = getattr(b, f.name)
                live.append(key)
            else:
                restart.append(key)
        sections[name] = dataclasses.replace(a, **updates)
    models, models_live, models_restart = _merge_models(old.models, new.models)
    merged = dataclasses.replace(old, **sections, models=models, source=new.source)
    return merged, live + models_live, restart + models_restart
