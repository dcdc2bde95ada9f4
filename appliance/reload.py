"""What a SIGHUP can change in a running daemon, and what needs a restart.

Engines keep running across a reload, so anything baked into an engine's command line or
the listening socket needs a restart; admission limits, policies and timers are read
from the current config on every use, so they change live. Which keys are live is said
on each field (``live=True`` in :mod:`appliance.config`); ``LIVE_KEYS`` is derived there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from appliance.config import LIVE_KEYS, SECTIONS, Config

__all__ = ["LIVE_KEYS", "changed_keys", "merge_live"]


def changed_keys(old: Config, new: Config) -> list[str]:
    out = []
    for name in SECTIONS:
        a: Any = getattr(old, name)
        b: Any = getattr(new, name)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                out.append(f"{name}.{f.name}")
    return out


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
    return dataclasses.replace(old, **sections, source=new.source), live, restart
