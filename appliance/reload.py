"""What a SIGHUP can change in a running daemon, and what needs a restart.

Engines keep running across a reload, so anything baked into an engine's command line or
the listening socket needs a restart; admission limits, policies and timers are read
from the current config on every use, so they change live.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from appliance.config import SECTIONS, Config

LIVE_KEYS: frozenset[str] = frozenset(
    {
        "gateway.max_tokens_cap",
        "gateway.max_queue",
        "gateway.queue_timeout_s",
        "gateway.metrics_public",
        "engine.max_inflight",
        "engine.startup_timeout_s",
        "engine.stop_timeout_s",
        "telemetry.interval_s",
        "thermal.soft_limit_c",
        "thermal.hard_limit_c",
        "thermal.hysteresis_c",
        "thermal.heat_restart_after_s",
        "thermal.heat_restore_after_s",
        "health.interval_s",
        "health.probe_timeout_s",
        "health.failures_to_restart",
        "restart.backoff_initial_s",
        "restart.backoff_max_s",
        "restart.max_restarts_per_hour",
        "restart.max_planned_restarts_per_hour",
        "restart.drain_timeout_s",
        "restart.degradation_restart",
        "degradation.window_s",
        "degradation.max_preemptions_per_min",
        "degradation.hang_s",
        "degradation.leak_kv_usage",
        "degradation.leak_hold_s",
        "degradation.slowdown_ratio",
        "degradation.rss_growth_ratio",
        "degradation.baseline_warmup_s",
    }
)


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
