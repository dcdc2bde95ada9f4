"""The predictive thermal governor (``[thermal] governor = "predictive"``).

Same levels and budgets as the stepped governor (:mod:`appliance.policy.thermal`: level
*n* admits `admission_fraction` of the engine's budget, HARD admits nothing new), chosen
differently. It was tuned on the closed-loop simulator (``python -m bench.heat_sim``,
figures in docs/rehearse-heat.md), where the stepped governor showed two faults: it acts
only once a GPU is already above ``soft_limit_c`` (so every hot spell is minutes above
it), and it leaves a level after the hysteresis with no regard for how long the level
held, so a card whose load heats it past the soft limit at one level and cools it at
the next flips between the two every minute or two.

A pure function of the previous `PredictiveState`, one reading and the time (passed in,
monotonic seconds); every rule is a row in ``tests/unit/test_predictive.py``:

- **Trend.** The temperature's rate of change (°C/s), taken over at least
  `TREND_BASE_S` (NVML reads whole degrees: a 1 °C step between readings 1 s apart is
  not a GPU heating at 1 °C/s; on the simulator a per-reading rate made 130 level
  changes an hour), smoothed (`TREND_SMOOTHING`); the *predicted* temperature is the
  reading plus ``horizon_s`` times the rising part of that trend. A GPU heating
  towards the soft limit is acted on before it gets there.
- **Up at once, early.** The level taken is the stepped governor's level for the
  predicted temperature plus ``margin_c`` (so, at the defaults, 1 °C before each of the
  stepped thresholds), if that is above the present level. At ``hard_limit_c`` (the
  reading itself, not a prediction) the level is HARD, as with the stepped governor.
- **Slowdown reasons add nothing** while the temperature is known: the driver slowing
  its clocks *is* the cheap lever (tokens fall far less than watts; see
  docs/rehearse-heat.md), so it is no reason on its own to cut admission, which costs
  tokens one for one. With no temperature, a reason lifts a GPU to level 1 at least.
- **Down slowly.** One step down, only when the level has held ``hold_s``, the
  temperature is not rising, and the reading plus the margin is below the level's entry
  threshold minus ``hysteresis_c``. The hold is what caps level changes per hour. No
  hold leaving HARD (nothing is admitted there) nor for a GPU clearly cool (the reading
  plus the margin below ``soft_limit_c - hysteresis_c``): then it is one step per
  reading, as with the stepped governor, so a GPU that cooled gets its budget back in
  a few readings.
- **Unknown temperature** keeps the level (a missed reading never cools a GPU), and the
  trend is forgotten (rebuilt over the next `TREND_BASE_S`).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from appliance.policy.thermal import (
    HARD_LEVEL,
    ThermalPolicy,
    entry_c,
    has_slowdown,
    temperature_level,
)

TREND_SMOOTHING = 0.3  # weight of the newest rate in the smoothed trend
# The rate is taken over at least this long: NVML reads whole degrees, and a 1 °C step
# between two readings 1 s apart is not a GPU heating at 1 °C/s.
TREND_BASE_S = 30.0
DEFAULT_HORIZON_S = 30.0
DEFAULT_MARGIN_C = 1.0
DEFAULT_HOLD_S = 600.0


@dataclass(frozen=True, slots=True)
class PredictiveTuning:
    """The governor's knobs; the defaults are the ones the simulator favoured."""

    horizon_s: float = DEFAULT_HORIZON_S  # how far ahead the trend is followed
    margin_c: float = DEFAULT_MARGIN_C  # act this many °C before each stepped threshold
    hold_s: float = DEFAULT_HOLD_S  # a level is held at least this long before a step down


@dataclass(frozen=True, slots=True)
class PredictiveState:
    """What the governor remembers of one GPU between readings."""

    level: int = 0
    since_s: float = -math.inf  # when ``level`` was taken (monotonic seconds)
    last_c: float | None = None  # the reading the next rate is taken from
    last_s: float | None = None  # when it was taken
    trend_c_per_s: float = 0.0  # smoothed rate of change


def predicted_c(temperature_c: float, trend_c_per_s: float, tuning: PredictiveTuning) -> float:
    """The reading plus ``horizon_s`` of its rising trend (a falling trend counts 0)."""
    return temperature_c + tuning.horizon_s * max(trend_c_per_s, 0.0)


def govern_predictive(
    state: PredictiveState,
    temperature_c: float | None,
    throttle_reasons: Collection[str],
    now_s: float,
    policy: ThermalPolicy,
    tuning: PredictiveTuning = PredictiveTuning(),
) -> PredictiveState:
    """The GPU's state after this reading; its throttle level is ``.level``."""
    previous = min(max(state.level, 0), HARD_LEVEL)
    if temperature_c is None or math.isnan(temperature_c):
        level = max(previous, 1 if has_slowdown(throttle_reasons) else 0)
        since = state.since_s if level == previous else now_s
        return PredictiveState(level, since)
    trend = state.trend_c_per_s
    last_c, last_s = state.last_c, state.last_s
    if last_c is None or last_s is None:
        last_c, last_s = temperature_c, now_s
    elif now_s - last_s >= TREND_BASE_S:
        rate = (temperature_c - last_c) / (now_s - last_s)
        trend += TREND_SMOOTHING * (rate - trend)
        last_c, last_s = temperature_c, now_s
    ahead = predicted_c(temperature_c, trend, tuning) + tuning.margin_c
    if temperature_c >= policy.hard_limit_c:
        wanted = HARD_LEVEL
    else:
        wanted = min(temperature_level(ahead, policy), HARD_LEVEL - 1)
    level = previous
    if wanted > previous:
        level = wanted
    elif (
        wanted < previous
        and (
            now_s - state.since_s >= tuning.hold_s
            # HARD admits nothing: leaving it waits only for the hysteresis, as stepped's.
            or previous == HARD_LEVEL
            # Clearly cool (below the whole band): no flip-flop to guard against.
            or temperature_c + tuning.margin_c < policy.soft_limit_c - policy.hysteresis_c
        )
        and trend <= 0.0
        and temperature_c + tuning.margin_c < entry_c(previous, policy) - policy.hysteresis_c
    ):
        level = previous - 1
    since = state.since_s if level == previous else now_s
    return PredictiveState(level, since, last_c, last_s, trend)
