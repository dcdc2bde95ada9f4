"""Policies: pure functions of a snapshot, so every decision is a row in a table test.

- `routing.route(engine_loads, cost) -> engine id | None`: which engine takes a request.
- `thermal.govern(temperature, reasons, previous_level, policy) -> level`: how much a
  GPU may be given (the stepped governor); `predictive.govern_predictive(state,
  temperature, reasons, now, policy) -> state`: the same levels, chosen early on the
  trend and held (the default governor).
- `degradation.assess(samples, baseline, policy, now) -> Verdict`: whether an engine
  should be drained and restarted.
- `fallback.choose_fallback(primary_room, fallback_room, allowed) -> reason | None`:
  whether a request goes to its model's fallback model now, and why.
- `speculation.spec_figures(samples, now, window_s) -> SpecFigures`: acceptance rate and
  mean accepted length of speculative decoding over a recent window.

None of them does I/O or reads a clock; time is always passed in. The supervisor and
the gateway own the state (previous levels, sample windows, baselines, affinity maps)
and feed it back in.
"""

from __future__ import annotations

from appliance.policy.degradation import (
    EMPTY_BASELINE,
    HEALTHY,
    Baseline,
    DegradationPolicy,
    EngineSample,
    Reason,
    Verdict,
    assess,
    learn_baseline,
)
from appliance.policy.routing import EngineLoad, has_room, route, session_key
from appliance.policy.thermal import (
    HARD_LEVEL,
    SLOWDOWN_REASONS,
    ThermalPolicy,
    admission_fraction,
    entry_c,
    govern,
    scale_budget,
    sustained_heat,
)

__all__ = [
    "EMPTY_BASELINE",
    "HARD_LEVEL",
    "HEALTHY",
    "SLOWDOWN_REASONS",
    "Baseline",
    "DegradationPolicy",
    "EngineLoad",
    "EngineSample",
    "Reason",
    "ThermalPolicy",
    "Verdict",
    "admission_fraction",
    "assess",
    "entry_c",
    "govern",
    "has_room",
    "learn_baseline",
    "route",
    "scale_budget",
    "session_key",
    "sustained_heat",
]
