"""The thermal governor: GPU temperature and clock-event reasons in, a throttle level out.

A pure function of one reading and the previous level (no I/O, no clock), so every rule
below is a row in ``tests/unit/test_thermal.py``.

Levels and what each admits (`admission_fraction`; the caller scales an engine's
``max_inflight`` and token budget with `scale_budget`)::

    level      0      1      2      3      4 (HARD_LEVEL)
    admits   100 %   75 %   50 %   25 %   nothing new (work in flight finishes)

Entry thresholds (`entry_c`): level 1 at ``soft_limit_c``; levels 2 and 3 split the band
``soft..hard`` evenly in three; level 4 at ``hard_limit_c``. With the defaults (80, 87):
80, 82.33, 84.67, 87 °C. A temperature exactly on a threshold is in the higher level.

Rules of `govern`, and the choices behind them:

- **Up at once.** The level the temperature calls for is taken immediately, several
  steps at a time if need be: heat is the urgent direction.
- **Slowdown reasons add one.** A hardware or software thermal/power slowdown reason
  (`SLOWDOWN_REASONS`) raises the temperature's level by one, capped at HARD: the GPU
  is already losing clocks, so it should be given less. Power *caps* (``sw_power_cap``)
  are normal operation under load and do not count.
- **Down slowly (hysteresis).** A level is left downwards only when the temperature is
  below *that level's* entry threshold minus ``hysteresis_c``, and then by **one step
  per reading**: a GPU that cools fast still takes a few readings to get its full
  budget back, so admission rises gently instead of jumping from nothing to everything.
- The hysteresis applies to the level as a whole, including a step that a slowdown
  reason added: when the reason clears, the level falls back only once the temperature
  is below the level's entry threshold minus the hysteresis. NVML's reasons flicker
  from one reading to the next; this keeps the level from flapping with them.
- **Unknown temperature** (sensor unsupported, NaN, GPU lost): the previous level is
  kept (a missed reading never cools a GPU), and a slowdown reason still lifts a cool
  GPU to at least level 1. Without temperatures there is no hysteresis to decide a
  fall, so a level held this way stays until a temperature is read again.

`sustained_heat` tells the supervisor a GPU has been at HARD for long enough that
restarting its engine with fewer batched tokens may pay off.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from appliance.config import ThermalConfig

HARD_LEVEL = 4
STEPPED_LEVELS = 3  # levels 1..3 split the soft..hard band
SLOWDOWN_REASONS = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
)
_FRACTIONS = (1.0, 0.75, 0.5, 0.25, 0.0)


@dataclass(frozen=True, slots=True)
class ThermalPolicy:
    """The thresholds of ``[thermal]``; see the module docstring for the levels."""

    soft_limit_c: float
    hard_limit_c: float
    hysteresis_c: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.soft_limit_c) and math.isfinite(self.hard_limit_c)):
            raise ValueError("thermal limits must be finite")
        if self.hard_limit_c <= self.soft_limit_c:
            raise ValueError(
                f"hard_limit_c ({self.hard_limit_c:g}) must be above "
                f"soft_limit_c ({self.soft_limit_c:g})"
            )
        if not self.hysteresis_c >= 0:
            raise ValueError(f"hysteresis_c ({self.hysteresis_c:g}) must be >= 0")

    @classmethod
    def from_config(cls, config: ThermalConfig) -> ThermalPolicy:
        return cls(config.soft_limit_c, config.hard_limit_c, config.hysteresis_c)


def entry_c(level: int, policy: ThermalPolicy) -> float:
    """The temperature at which ``level`` starts (level 0: minus infinity)."""
    if level <= 0:
        return -math.inf
    if level >= HARD_LEVEL:
        return policy.hard_limit_c
    band = policy.hard_limit_c - policy.soft_limit_c
    return policy.soft_limit_c + band * (level - 1) / STEPPED_LEVELS


def temperature_level(temperature_c: float, policy: ThermalPolicy) -> int:
    """The level a temperature alone calls for, without hysteresis or slowdown reasons."""
    for level in range(HARD_LEVEL, 0, -1):
        if temperature_c >= entry_c(level, policy):
            return level
    return 0


def has_slowdown(throttle_reasons: Collection[str]) -> bool:
    return not SLOWDOWN_REASONS.isdisjoint(throttle_reasons)


def govern(
    temperature_c: float | None,
    throttle_reasons: Collection[str],
    previous_level: int,
    policy: ThermalPolicy,
) -> int:
    """The GPU's throttle level after this reading (0..`HARD_LEVEL`)."""
    previous = min(max(previous_level, 0), HARD_LEVEL)
    bump = 1 if has_slowdown(throttle_reasons) else 0
    if temperature_c is None or math.isnan(temperature_c):
        return max(previous, bump)
    wanted = min(temperature_level(temperature_c, policy) + bump, HARD_LEVEL)
    if wanted >= previous:
        return wanted
    if temperature_c < entry_c(previous, policy) - policy.hysteresis_c:
        return previous - 1
    return previous


def admission_fraction(level: int) -> float:
    """Share of an engine's budget admitted at ``level``: 1.0, 0.75, 0.5, 0.25, 0.0.

    Out-of-range levels are clamped (below 0 = cool, above HARD = HARD).
    """
    return _FRACTIONS[min(max(level, 0), HARD_LEVEL)]


def scale_budget(budget: int, level: int) -> int:
    """``budget`` (sequences or tokens) at ``level``: 0 at HARD, else at least 1."""
    if level >= HARD_LEVEL or budget <= 0:
        return 0
    return max(1, math.floor(budget * admission_fraction(level)))


def sustained_heat(
    history: Sequence[tuple[float, int]],
    now: float,
    hold_s: float,
    max_gap_s: float = math.inf,
) -> bool:
    """True when the level has been HARD continuously for at least ``hold_s`` up to ``now``.

    ``history`` is ``(monotonic time, level)`` per reading, oldest first. "Continuously"
    means every reading from the start of the run to the newest is HARD; the run starts
    at its first HARD reading (the conservative end: the level may have risen any time
    after the reading before). With ``max_gap_s``, a gap longer than that between two
    readings, or between the newest reading and ``now``, breaks the run: missing
    readings are not evidence of heat. Readings stamped after ``now`` are ignored.
    """
    since: float | None = None
    later = now
    for t, level in reversed(history):
        if t > now:
            continue
        if level < HARD_LEVEL or later - t > max_gap_s:
            break
        since = later = t
    return since is not None and now - since >= hold_s
