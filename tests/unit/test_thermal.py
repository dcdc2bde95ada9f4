"""The thermal governor: tables of (reading, previous level) -> level, and its helpers.

The default policy (80 / 87 / 5) puts the level entries at 80, 82.33, 84.67 and 87 °C,
so leaving a level needs 75, 77.33, 79.67 and 82 °C respectively.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from appliance.config import ThermalConfig
from appliance.policy.thermal import (
    HARD_LEVEL,
    SLOWDOWN_REASONS,
    ThermalPolicy,
    admission_fraction,
    entry_c,
    govern,
    scale_budget,
    sustained_heat,
    temperature_level,
)

P = ThermalPolicy(soft_limit_c=80.0, hard_limit_c=87.0, hysteresis_c=5.0)
NO: tuple[str, ...] = ()


def test_default_policy_comes_from_config() -> None:
    assert ThermalPolicy.from_config(ThermalConfig()) == P


@pytest.mark.parametrize(
    ("level", "celsius"),
    [
        (0, -math.inf),
        (1, 80.0),
        (2, 80 + 7 / 3),
        (3, 80 + 14 / 3),
        (4, 87.0),
        (9, 87.0),
    ],
)
def test_entry_thresholds_split_the_band_evenly(level: int, celsius: float) -> None:
    assert entry_c(level, P) == pytest.approx(celsius)


# -- going up: temperature alone ------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [
        (-10.0, 0),
        (20.0, 0),
        (79.99, 0),
        (80.0, 1),  # exactly soft: already throttled
        (82.33, 1),
        (82.34, 2),
        (84.66, 2),
        (84.67, 3),
        (86.99, 3),
        (87.0, 4),  # exactly hard: nothing new
        (95.0, 4),
        (150.0, 4),
    ],
)
def test_level_from_cool(temperature: float, expected: int) -> None:
    assert govern(temperature, NO, 0, P) == expected
    assert temperature_level(temperature, P) == expected


@pytest.mark.parametrize(
    ("previous", "temperature", "expected"),
    [
        (0, 90.0, 4),  # up several levels at once
        (1, 85.0, 3),
        (2, 83.0, 2),  # same level: stays
        (2, 85.0, 3),
        (3, 87.0, 4),
    ],
)
def test_up_is_immediate(previous: int, temperature: float, expected: int) -> None:
    assert govern(temperature, NO, previous, P) == expected


# -- going down: hysteresis, one step per reading -------------------------------------------


@pytest.mark.parametrize(
    ("previous", "temperature", "expected"),
    [
        (1, 79.0, 1),  # below soft but not below soft - 5
        (1, 75.0, 1),  # exactly soft - 5: not below
        (1, 74.99, 0),
        (2, 80.0, 2),  # level 1's band, but above 82.33 - 5
        (2, 77.34, 2),
        (2, 77.3, 1),
        (3, 80.0, 3),  # above 84.67 - 5 = 79.67
        (3, 79.6, 2),
        (4, 86.0, 4),  # just below hard: still HARD
        (4, 82.0, 4),  # exactly hard - 5: not below
        (4, 81.9, 3),
        (4, 30.0, 3),  # far cooler: still one step per reading
        (3, 30.0, 2),
    ],
)
def test_down_needs_hysteresis_and_steps_one(
    previous: int, temperature: float, expected: int
) -> None:
    assert govern(temperature, NO, previous, P) == expected


@pytest.mark.parametrize(
    ("hysteresis", "previous", "temperature", "expected"),
    [
        (0.0, 1, 79.99, 0),  # no hysteresis: any reading below the entry drops
        (0.0, 1, 80.0, 1),
        (10.0, 1, 70.5, 1),
        (10.0, 1, 69.9, 0),
    ],
)
def test_hysteresis_width(
    hysteresis: float, previous: int, temperature: float, expected: int
) -> None:
    policy = ThermalPolicy(80.0, 87.0, hysteresis)
    assert govern(temperature, NO, previous, policy) == expected


def run(
    temperatures: Sequence[float | None],
    policy: ThermalPolicy = P,
    reasons: Sequence[tuple[str, ...]] | None = None,
) -> list[int]:
    level, out = 0, []
    for i, t in enumerate(temperatures):
        level = govern(t, reasons[i] if reasons else NO, level, policy)
        out.append(level)
    return out


def test_noisy_readings_at_a_boundary_do_not_flap() -> None:
    noisy = [79.6, 80.4, 79.2, 80.9, 79.5, 80.1, 78.8, 79.9]
    assert run(noisy) == [0, 1, 1, 1, 1, 1, 1, 1]
    hot_noise = [86.8, 87.2, 86.5, 87.1, 85.9, 86.9]
    assert run([75.0, *hot_noise])[1:] == [3, 4, 4, 4, 4, 4]


def test_heat_up_then_cool_down_trace() -> None:
    temps = [60, 81, 83, 85, 88, 86, 83, 81.5, 78, 76, 74, 74, 74, 60]
    assert run(temps) == [0, 1, 2, 3, 4, 4, 4, 3, 2, 1, 0, 0, 0, 0]


# -- slowdown reasons -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "reasons", "previous", "expected"),
    [
        (50.0, ("hw_slowdown",), 0, 1),
        (50.0, ("hw_thermal_slowdown",), 0, 1),
        (50.0, ("sw_thermal_slowdown",), 0, 1),
        (50.0, ("hw_power_brake_slowdown",), 0, 1),
        (81.0, ("sw_thermal_slowdown",), 0, 2),
        (86.0, ("hw_power_brake_slowdown",), 0, 4),  # level 3 + 1 = HARD
        (90.0, ("hw_slowdown",), 0, 4),  # capped
        (50.0, ("hw_slowdown", "hw_thermal_slowdown"), 0, 1),  # one step, however many reasons
        (50.0, ("sw_power_cap",), 0, 0),  # a power cap is normal under load
        (50.0, ("gpu_idle", "applications_clocks_setting"), 0, 0),
        (81.0, ("sw_thermal_slowdown",), 2, 2),  # persists: no ratchet
        (81.0, (), 2, 2),  # cleared: held by hysteresis (77.33)
        (77.0, (), 2, 1),
        (50.0, (), 1, 0),  # cleared on a cool GPU: drops
    ],
)
def test_slowdown_reasons_add_one(
    temperature: float, reasons: tuple[str, ...], previous: int, expected: int
) -> None:
    assert govern(temperature, reasons, previous, P) == expected


def test_flickering_slowdown_reason_does_not_flap() -> None:
    temps = [81.0] * 6
    reasons = [("hw_slowdown",), (), ("hw_slowdown",), (), (), ()]
    assert run(temps, reasons=reasons) == [2, 2, 2, 2, 2, 2]


def test_reasons_accept_any_collection() -> None:
    assert govern(50.0, frozenset({"hw_slowdown"}), 0, P) == 1
    assert govern(50.0, ["sw_thermal_slowdown"], 0, P) == 1
    assert {
        "hw_slowdown",
        "hw_thermal_slowdown",
        "sw_thermal_slowdown",
        "hw_power_brake_slowdown",
    } == SLOWDOWN_REASONS


# -- sensors missing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "reasons", "previous", "expected"),
    [
        (None, (), 0, 0),
        (None, (), 3, 3),  # a missed reading never cools a GPU
        (None, (), 4, 4),
        (None, ("hw_slowdown",), 0, 1),  # slowdown still honoured
        (None, ("hw_slowdown",), 2, 2),  # but without ratcheting up each reading
        (math.nan, (), 3, 3),
        (math.nan, ("sw_thermal_slowdown",), 0, 1),
    ],
)
def test_unknown_temperature_holds(
    temperature: float | None, reasons: tuple[str, ...], previous: int, expected: int
) -> None:
    assert govern(temperature, reasons, previous, P) == expected


def test_sensor_gap_in_a_trace() -> None:
    assert run([85.0, None, None, 70.0, None, 70.0]) == [3, 3, 3, 2, 2, 1]


@pytest.mark.parametrize(
    ("previous", "temperature", "expected"),
    [
        (-3, 50.0, 0),
        (-3, 81.0, 1),
        (9, 50.0, 3),  # clamped to HARD, then one step down
        (9, None, 4),
    ],
)
def test_out_of_range_previous_is_clamped(
    previous: int, temperature: float | None, expected: int
) -> None:
    assert govern(temperature, NO, previous, P) == expected


@pytest.mark.parametrize(
    ("soft", "hard", "hysteresis"),
    [
        (80.0, 80.0, 5.0),
        (87.0, 80.0, 5.0),
        (80.0, 87.0, -1.0),
        (math.nan, 87.0, 5.0),
        (80.0, math.inf, 5.0),
        (80.0, 87.0, math.nan),
    ],
)
def test_bad_policy_is_refused(soft: float, hard: float, hysteresis: float) -> None:
    with pytest.raises(ValueError):
        ThermalPolicy(soft, hard, hysteresis)


def test_other_band() -> None:
    policy = ThermalPolicy(60.0, 90.0, 0.0)  # entries 60, 70, 80, 90
    assert run([59.9, 60, 69.9, 70, 79.9, 80, 90, 89.9, 79.9, 69.9, 59.9], policy) == [
        0,
        1,
        1,
        2,
        2,
        3,
        4,
        3,
        2,
        1,
        0,
    ]


# -- admission ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "fraction"),
    [
        (0, 1.0),
        (1, 0.75),
        (2, 0.5),
        (3, 0.25),
        (4, 0.0),
        (-1, 1.0),
        (7, 0.0),
    ],
)
def test_admission_fraction(level: int, fraction: float) -> None:
    assert admission_fraction(level) == fraction


@pytest.mark.parametrize(
    ("budget", "level", "expected"),
    [
        (64, 0, 64),
        (64, 1, 48),
        (64, 2, 32),
        (64, 3, 16),
        (64, HARD_LEVEL, 0),
        (8192, 3, 2048),
        (1, 3, 1),
        (3, 3, 1),
        (2, 2, 1),
        (0, 0, 0),
        (5, 9, 0),
    ],
)
def test_scale_budget(budget: int, level: int, expected: int) -> None:
    assert scale_budget(budget, level) == expected


# -- sustained heat -------------------------------------------------------------------------

H = HARD_LEVEL


@pytest.mark.parametrize(
    ("history", "now", "hold_s", "max_gap_s", "expected"),
    [
        ([], 100.0, 10.0, math.inf, False),
        ([(0.0, H), (10.0, H), (20.0, H)], 20.0, 20.0, math.inf, True),
        ([(0.0, H), (10.0, H), (20.0, H)], 20.0, 20.1, math.inf, False),
        ([(0.0, H), (10.0, H), (20.0, H)], 30.0, 30.0, math.inf, True),  # held up to now
        ([(0.0, H), (10.0, 3), (20.0, H)], 30.0, 15.0, math.inf, False),  # broken at 10
        ([(0.0, H), (10.0, 3), (20.0, H)], 35.0, 15.0, math.inf, True),
        ([(0.0, H), (10.0, H), (20.0, 3)], 20.0, 5.0, math.inf, False),  # cooled now
        ([(5.0, H)], 5.0, 0.0, math.inf, True),
        ([(0.0, H), (100.0, H)], 100.0, 50.0, 10.0, False),  # gap in readings
        ([(0.0, H), (100.0, H)], 100.0, 50.0, math.inf, True),
        ([(0.0, H), (10.0, H)], 100.0, 50.0, 20.0, False),  # readings stopped
        ([(0.0, H), (10.0, H), (50.0, 0)], 20.0, 15.0, math.inf, True),  # future ignored
    ],
)
def test_sustained_heat(
    history: list[tuple[float, int]], now: float, hold_s: float, max_gap_s: float, expected: bool
) -> None:
    assert sustained_heat(history, now, hold_s, max_gap_s) is expected
