"""The predictive thermal governor: tables of (state, reading, time) -> level.

Defaults (80 / 87 / 5, margin 1, horizon 30 s, hold 600 s): with no trend it takes the
stepped levels 1 °C early, i.e. level 1 at 79, 2 at 81.33, 3 at 83.67, HARD at 87 (the
reading itself). Leaving a level needs the reading + 1 below its entry minus 5: 74,
76.33, 78.67 °C for levels 1, 2, 3, and 81 for HARD.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from appliance.policy.predictive import (
    PredictiveState,
    PredictiveTuning,
    govern_predictive,
)
from appliance.policy.thermal import HARD_LEVEL, ThermalPolicy

P = ThermalPolicy(soft_limit_c=80.0, hard_limit_c=87.0, hysteresis_c=5.0)
T = PredictiveTuning()
NO: tuple[str, ...] = ()
LONG_AGO = -1000.0  # a level held longer than the hold


def level_after(
    temperature: float | None,
    previous: int = 0,
    since: float = LONG_AGO,
    last_c: float | None = None,
    trend: float = 0.0,
    reasons: tuple[str, ...] = NO,
    now: float = 0.0,
) -> int:
    # ``last_c``: a reading TREND_BASE_S (30 s) ago, so this reading takes a new rate.
    state = PredictiveState(previous, since, last_c, None if last_c is None else now - 30, trend)
    return govern_predictive(state, temperature, reasons, now, P).level


def test_default_tuning() -> None:
    assert (T.horizon_s, T.margin_c, T.hold_s) == (30.0, 1.0, 600.0)


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        (50.0, 0),
        (78.99, 0),
        (79.0, 1),  # 1 °C before soft
        (81.33, 1),
        (81.34, 2),
        (83.67, 3),
        (86.99, 3),  # a prediction never reaches HARD: only the reading does
        (87.0, HARD_LEVEL),
        (95.0, HARD_LEVEL),
    ],
)
def test_steady_reading_takes_the_stepped_level_one_degree_early(
    temperature: float, expected: int
) -> None:
    assert level_after(temperature) == expected


@pytest.mark.parametrize(
    ("temperature", "last_c", "expected"),
    [
        # a reading 30 s earlier; trend = 0.3 x the rate; ahead = T + 30 x trend + 1
        (75.5, 75.5, 0),  # flat: 76.5
        (76.5, 66.5, 1),  # 1/3 °C/s: 76.5 + 3 + 1 = 80.5, level 1 (flat: 0)
        (79.0, 69.0, 2),  # 79 + 3 + 1 = 83: level 2 (flat: 1)
        (77.0, 87.0, 0),  # falling: the trend counts 0
    ],
)
def test_a_rising_trend_acts_before_the_reading_gets_there(
    temperature: float, last_c: float, expected: int
) -> None:
    assert level_after(temperature, last_c=last_c) == expected


def test_the_rate_is_taken_over_thirty_seconds_at_least() -> None:
    state = PredictiveState()
    seen = []
    for second, temp in [(0, 60.0), (1, 61.0), (10, 63.0), (30, 69.0), (45, 70.0), (60, 78.0)]:
        state = govern_predictive(state, temp, NO, float(second), P)
        seen.append((state.last_c, round(state.trend_c_per_s, 3)))
    # The 1 °C in 1 s is no rate; over 0..30 s: 0.3 °C/s -> 0.09; over 30..60: 0.3 again
    # -> 0.09 + 0.3 * (0.3 - 0.09) = 0.153. Readings between keep the baseline.
    assert seen == [
        (60.0, 0.0),
        (60.0, 0.0),
        (60.0, 0.0),
        (69.0, 0.09),
        (69.0, 0.09),
        (78.0, 0.153),
    ]
    assert state.last_s == 60.0


@pytest.mark.parametrize(
    ("previous", "temperature", "since", "trend", "expected"),
    [
        (1, 73.9, 0.0, 0.0, 0),  # clearly cool (73.9 + 1 < 75): down at once, no hold
        (1, 74.0, LONG_AGO, 0.0, 1),  # 74 + 1 = 75: not below 80 - 5
        (1, 73.99, LONG_AGO, 0.0, 0),
        (2, 75.0, 0.0, 0.0, 2),  # near the band, held 0 s of 600: stays
        (2, 75.0, -599.0, 0.0, 2),
        (2, 75.0, -600.0, 0.0, 1),  # held 600 s: one step
        (2, 75.0, LONG_AGO, 0.01, 2),  # still rising: stays
        (2, 76.4, LONG_AGO, 0.0, 2),  # 77.4 is not below 82.33 - 5
        (3, 78.6, LONG_AGO, 0.0, 2),
        (HARD_LEVEL, 81.0, 0.0, 0.0, HARD_LEVEL),  # 82 is not below 87 - 5
        (HARD_LEVEL, 80.9, 0.0, 0.0, 3),  # HARD is left without the hold
        (3, 60.0, 0.0, 0.0, 2),  # cool: one step per reading, as stepped
    ],
)
def test_down_needs_the_hold_near_the_band_and_steps_one(
    previous: int, temperature: float, since: float, trend: float, expected: int
) -> None:
    assert level_after(temperature, previous, since=since, trend=trend) == expected


@pytest.mark.parametrize(
    ("temperature", "reasons", "previous", "expected"),
    [
        (50.0, ("hw_slowdown",), 0, 0),  # the driver's own lever: no admission cut
        (78.9, ("sw_thermal_slowdown",), 0, 0),
        (79.0, ("hw_thermal_slowdown",), 0, 1),  # the temperature's level, no more
        (82.0, ("sw_thermal_slowdown",), 0, 2),  # (stepped: 1 + 1 at 82)
        (50.0, ("sw_power_cap",), 0, 0),
        (None, ("hw_slowdown",), 0, 1),  # no temperature: the reason is all there is
        (None, (), 3, 3),  # a missed reading never cools a GPU
        (math.nan, (), 2, 2),
    ],
)
def test_slowdown_reasons_and_unknown_temperatures(
    temperature: float | None, reasons: tuple[str, ...], previous: int, expected: int
) -> None:
    assert level_after(temperature, previous, reasons=reasons) == expected


def test_an_unknown_temperature_forgets_the_trend() -> None:
    state = PredictiveState(1, 0.0, 70.0, 0.0, 0.5)
    after = govern_predictive(state, None, NO, 1.0, P)
    assert (after.level, after.since_s, after.last_c, after.trend_c_per_s) == (1, 0.0, None, 0)


def run(temperatures: Sequence[float], every_s: float) -> list[int]:
    state, out = PredictiveState(), []
    for i, temp in enumerate(temperatures):
        state = govern_predictive(state, temp, NO, i * every_s, P)
        out.append(state.level)
    return out


def test_a_card_that_flips_between_two_levels_is_held() -> None:
    # One reading every 120 s. Level 2 is taken at 120 s; the reading allows level 1
    # again from 480 s (75 + 1 < 77.33), but the level is held until 600 s after it
    # began (720 s).
    temps = [79.0, 82.0, 79.0, 77.0, 75.0, 75.0, 75.0, 75.0, 75.0]
    assert run(temps, 120.0) == [1, 2, 2, 2, 2, 2, 1, 1, 1]
