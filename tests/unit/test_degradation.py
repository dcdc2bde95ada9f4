"""The degradation detector and baseline learning, as tables of synthetic scrape series.

Series are sampled every 2 s. With the default policy the window is 60 s, rate checks
need 30 s of data (min_coverage 0.5), run checks need 3 samples spanning their hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

import pytest

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
    preemption_rate,
    throughput,
)

P = DegradationPolicy()
MiB = 2**20
DT = 2.0

Field = float | None | Callable[[float], float | None]


def S(
    t: float,
    pre: float | None = 0.0,
    gen: float | None = 0.0,
    run: float | None = 0.0,
    wait: float | None = 0.0,
    kv: float | None = 0.1,
    rss: int | None = 1000 * MiB,
) -> EngineSample:
    return EngineSample(
        t=t,
        preemptions_total=pre,
        generation_tokens_total=gen,
        running=run,
        waiting=wait,
        kv_cache_usage=kv,
        rss_bytes=rss,
    )


def _at(value: Field, t: float) -> float | None:
    return value(t) if callable(value) else value


def series(
    t0: float,
    t1: float,
    *,
    pre: Field = 0.0,
    gen: Field = 0.0,
    run: Field = 0.0,
    wait: Field = 0.0,
    kv: Field = 0.1,
    rss: Callable[[float], int | None] | int | None = 1000 * MiB,
    dt: float = DT,
) -> list[EngineSample]:
    """Samples every ``dt`` from t0 to t1 inclusive; each field a constant or f(t)."""
    out = []
    for i in range(round((t1 - t0) / dt) + 1):
        t = t0 + i * dt
        out.append(
            EngineSample(
                t=t,
                preemptions_total=_at(pre, t),
                generation_tokens_total=_at(gen, t),
                running=_at(run, t),
                waiting=_at(wait, t),
                kv_cache_usage=_at(kv, t),
                rss_bytes=rss(t) if callable(rss) else rss,
            )
        )
    return out


def rate(per_s: float, start: float = 0.0) -> Callable[[float], float]:
    return lambda t: start + per_s * t


def when(
    cond: Callable[[float], bool], yes: float | None, no: float | None
) -> Callable[[float], float | None]:
    return lambda t: yes if cond(t) else no


BASE = Baseline(
    tokens_per_s_per_request=10.0, rss_bytes=1000 * MiB, samples=5, running=4.0, updated_at=0.0
)


class Load(TypedDict):
    run: Field
    gen: Field


BUSY = Load(run=4.0, gen=rate(40.0))  # healthy: 10 tokens/s for each of 4 requests
NOW = 60.0


def verdict(
    samples: list[EngineSample],
    baseline: Baseline = BASE,
    policy: DegradationPolicy = P,
    now: float = NOW,
) -> Reason | None:
    v = assess(samples, baseline, policy, now)
    assert v.degraded is (v.reason is not None)
    assert bool(v.detail) is v.degraded
    return v.reason


def test_healthy_busy_engine() -> None:
    assert assess(series(0, 60, **BUSY), BASE, P, NOW) == HEALTHY


def test_no_samples_is_healthy() -> None:
    assert assess([], BASE, P, NOW) == HEALTHY
    assert assess([], EMPTY_BASELINE, P, NOW) == HEALTHY


# -- preemption storm -----------------------------------------------------------------------

PREEMPTION_CASES: list[tuple[str, list[EngineSample], Reason | None]] = [
    ("31/min", series(0, 60, pre=rate(31 / 60), **BUSY), "preemption_storm"),
    ("exactly 30/min is allowed", series(0, 60, pre=rate(0.5), **BUSY), None),
    ("29/min", series(0, 60, pre=rate(29 / 60), **BUSY), None),
    ("fast but only 10 s of data", series(50, 60, pre=rate(5.0), **BUSY), None),
    ("fast for 30 s of data: enough", series(30, 60, pre=rate(1.0), **BUSY), "preemption_storm"),
    (
        "one burst of 20 in a quiet minute",
        series(0, 60, pre=when(lambda t: t >= 30, 20.0, 0.0), **BUSY),
        None,
    ),
    (
        "counter reset mid-window is not a storm",
        series(0, 60, pre=lambda t: 5000.0 + t / 60 if t < 30 else (t - 30) / 60, **BUSY),
        None,
    ),
    (
        "counter reset does not hide a storm after it",
        series(0, 60, pre=lambda t: 5000.0 if t < 10 else (t - 10), **BUSY),
        "preemption_storm",
    ),
    ("metric missing", series(0, 60, pre=None, **BUSY), None),
    (
        "metric missing most of the window",
        series(0, 60, pre=when(lambda t: t >= 40, 100.0, None), **BUSY),
        None,
    ),
    (
        "storm older than the window is forgotten",
        series(-100, -2, pre=rate(10.0), **BUSY) + series(0, 60, pre=1000.0, **BUSY),
        None,
    ),
]


@pytest.mark.parametrize(
    ("samples", "expected"), [c[1:] for c in PREEMPTION_CASES], ids=[c[0] for c in PREEMPTION_CASES]
)
def test_preemption_storm(samples: list[EngineSample], expected: Reason | None) -> None:
    assert verdict(samples) == expected


def test_preemption_rate_counts_a_reset_as_a_restart_from_zero() -> None:
    samples = [S(0, pre=100.0), S(10, pre=110.0), S(20, pre=3.0), S(30, pre=4.0)]
    assert preemption_rate(samples, P) == pytest.approx((10 + 3 + 1) / 30 * 60)


# -- KV leak --------------------------------------------------------------------------------

LEAK_CASES: list[tuple[str, list[EngineSample], Reason | None]] = [
    ("KV full with nothing running", series(0, 60, kv=0.95, run=0.0), "kv_leak"),
    ("KV full with one running", series(0, 60, kv=0.95, run=1.0, gen=rate(10)), "kv_leak"),
    ("KV full with two running is real use", series(0, 60, kv=0.95, run=2.0, gen=rate(20)), None),
    ("KV at exactly the threshold", series(0, 60, kv=0.9, run=0.0), "kv_leak"),
    ("KV just under", series(0, 60, kv=0.89, run=0.0), None),
    ("held exactly 30 s", series(0, 60, kv=when(lambda t: t >= 30, 0.95, 0.2)), "kv_leak"),
    ("held 28 s", series(0, 60, kv=when(lambda t: t >= 32, 0.95, 0.2)), None),
    (
        "one noisy low reading breaks the run",
        series(0, 60, kv=when(lambda t: t == 40, 0.5, 0.95)),
        None,
    ),
    (
        "one noisy high reading does not trigger",
        series(0, 60, kv=when(lambda t: t == 60, 0.99, 0.2)),
        None,
    ),
    (
        "KV metric missing in the newest sample",
        series(0, 60, kv=when(lambda t: t == 60, None, 0.95)),
        None,
    ),
    ("running metric missing", series(0, 60, kv=0.95, run=None), None),
    ("only two samples, 30 s apart", [S(30, kv=0.95), S(60, kv=0.95)], None),
    (
        "three samples spanning 30 s are enough",
        [S(30, kv=0.95), S(45, kv=0.95), S(60, kv=0.95)],
        "kv_leak",
    ),
]


@pytest.mark.parametrize(
    ("samples", "expected"), [c[1:] for c in LEAK_CASES], ids=[c[0] for c in LEAK_CASES]
)
def test_kv_leak(samples: list[EngineSample], expected: Reason | None) -> None:
    assert verdict(samples) == expected


# -- hang -----------------------------------------------------------------------------------

HANG_CASES: list[tuple[str, list[EngineSample], Reason | None]] = [
    ("requests running, no token for 60 s", series(0, 60, run=2.0, gen=500.0), "hang"),
    ("only waiting requests, no token", series(0, 60, run=0.0, wait=3.0, gen=500.0), "hang"),
    ("idle engine makes no tokens: fine", series(0, 60, run=0.0, wait=0.0, gen=500.0), None),
    ("tokens flowing", series(0, 60, run=2.0, gen=rate(20)), None),
    ("stuck exactly 30 s", series(0, 60, run=2.0, gen=lambda t: min(t, 30.0) * 20), "hang"),
    ("stuck 28 s", series(0, 60, run=2.0, gen=lambda t: min(t, 32.0) * 20), None),
    (
        "one token of progress resets it",
        series(0, 60, run=2.0, gen=when(lambda t: t >= 40, 501.0, 500.0)),
        None,
    ),
    (
        "idle for a moment in between",
        series(0, 60, run=when(lambda t: t == 40, 0.0, 2.0), gen=500.0),
        None,
    ),
    (
        "counter reset (restart) is not a hang",
        series(0, 60, run=2.0, gen=when(lambda t: t >= 40, 0.0, 500.0)),
        None,
    ),
    ("tokens metric missing", series(0, 60, run=2.0, gen=None), None),
    ("running metric missing", series(0, 60, run=None, wait=3.0, gen=500.0), None),
    ("waiting metric missing, running known", series(0, 60, run=1.0, wait=None, gen=500.0), "hang"),
]


@pytest.mark.parametrize(
    ("samples", "expected"), [c[1:] for c in HANG_CASES], ids=[c[0] for c in HANG_CASES]
)
def test_hang(samples: list[EngineSample], expected: Reason | None) -> None:
    # No baseline: a window with (almost) no tokens would otherwise also be a slowdown.
    assert verdict(samples, EMPTY_BASELINE) == expected


def test_a_near_hang_is_still_a_slowdown() -> None:
    one_token = series(0, 60, run=2.0, gen=when(lambda t: t >= 40, 501.0, 500.0))
    assert verdict(one_token) == "slowdown"


# -- RSS growth -----------------------------------------------------------------------------

RSS_CASES: list[tuple[str, list[EngineSample], Baseline, Reason | None]] = [
    ("1.6x throughout", series(0, 60, rss=1600 * MiB, **BUSY), BASE, "rss_growth"),
    ("exactly 1.5x is allowed", series(0, 60, rss=1500 * MiB, **BUSY), BASE, None),
    ("1.2x", series(0, 60, rss=1200 * MiB, **BUSY), BASE, None),
    (
        "one low reading: not throughout",
        series(0, 60, rss=lambda t: 1000 * MiB if t == 20 else 1600 * MiB, **BUSY),
        BASE,
        None,
    ),
    (
        "one spike",
        series(0, 60, rss=lambda t: 3000 * MiB if t == 60 else 1000 * MiB, **BUSY),
        BASE,
        None,
    ),
    ("high for only 10 s", series(50, 60, rss=1600 * MiB, **BUSY), BASE, None),
    (
        "missing readings are skipped, rest high",
        series(0, 60, rss=lambda t: None if t % 4 else 1600 * MiB, **BUSY),
        BASE,
        "rss_growth",
    ),
    ("RSS unknown", series(0, 60, rss=None, **BUSY), BASE, None),
    (
        "no RSS baseline yet",
        series(0, 60, rss=5000 * MiB, **BUSY),
        Baseline(10.0, None, 5, 4.0, 0.0),
        None,
    ),
]


@pytest.mark.parametrize(
    ("samples", "baseline", "expected"), [c[1:] for c in RSS_CASES], ids=[c[0] for c in RSS_CASES]
)
def test_rss_growth(
    samples: list[EngineSample], baseline: Baseline, expected: Reason | None
) -> None:
    assert verdict(samples, baseline) == expected


# -- slowdown -------------------------------------------------------------------------------

SLOW_CASES: list[tuple[str, list[EngineSample], Baseline, Reason | None]] = [
    ("3 tok/s per request vs 10", series(0, 60, run=4.0, gen=rate(12)), BASE, "slowdown"),
    ("exactly 0.35x is allowed", series(0, 60, run=4.0, gen=rate(14)), BASE, None),
    ("0.4x", series(0, 60, run=4.0, gen=rate(16)), BASE, None),
    ("healthy", series(0, 60, **BUSY), BASE, None),
    (
        "much busier than the baseline: batching, not degradation",
        series(0, 60, run=9.0, gen=rate(27)),
        BASE,
        None,
    ),
    ("twice as busy is still compared", series(0, 60, run=8.0, gen=rate(24)), BASE, "slowdown"),
    ("idle engine is not slow", series(0, 60, run=0.0, gen=100.0), BASE, None),
    (
        "slow, but busy only 20 s of the window",
        series(0, 60, run=when(lambda t: t >= 40, 4.0, 0.0), gen=lambda t: max(t - 40, 0) * 12),
        BASE,
        None,
    ),
    ("no baseline yet", series(0, 60, run=4.0, gen=rate(12)), EMPTY_BASELINE, None),
    (
        "baseline without a load figure still compares",
        series(0, 60, run=4.0, gen=rate(12)),
        Baseline(10.0, None, 1),
        "slowdown",
    ),
    (
        "counter reset in a healthy window",
        series(0, 60, run=4.0, gen=lambda t: 40 * t if t < 30 else 40 * (t - 30)),
        BASE,
        None,
    ),
    ("tokens metric missing", series(0, 60, run=4.0, gen=None), BASE, None),
    ("running metric missing", series(0, 60, run=None, gen=rate(12)), BASE, None),
]


@pytest.mark.parametrize(
    ("samples", "baseline", "expected"), [c[1:] for c in SLOW_CASES], ids=[c[0] for c in SLOW_CASES]
)
def test_slowdown(samples: list[EngineSample], baseline: Baseline, expected: Reason | None) -> None:
    assert verdict(samples, baseline) == expected


def test_throughput_is_per_running_request() -> None:
    measured = throughput(series(0, 60, run=lambda t: 2.0 if t < 30 else 6.0, gen=rate(40)), P)
    assert measured is not None
    assert measured.span_s == 60
    # 40 tok/s over 60 s = 2400 tokens; request-seconds: 2*28 + (2+6)/2*2 + 6*30 = 244
    assert measured.per_request == pytest.approx(2400 / 244)
    assert measured.mean_running == pytest.approx(244 / 60)


# -- several at once, and the window --------------------------------------------------------


def test_most_certain_reason_wins() -> None:
    hang_and_leak = series(0, 60, run=1.0, gen=500.0, kv=0.95, rss=5000 * MiB)
    assert verdict(hang_and_leak) == "hang"
    leak_and_storm = series(0, 60, run=1.0, gen=rate(10), kv=0.95, pre=rate(1.0))
    assert verdict(leak_and_storm) == "kv_leak"
    storm_and_slow = series(0, 60, run=4.0, gen=rate(4), pre=rate(1.0), rss=5000 * MiB)
    assert verdict(storm_and_slow) == "preemption_storm"
    rss_and_slow = series(0, 60, run=4.0, gen=rate(4), rss=5000 * MiB)
    assert verdict(rss_and_slow) == "rss_growth"


def test_samples_after_now_and_before_the_window_are_ignored() -> None:
    old_hang = series(0, 60, run=2.0, gen=500.0)
    assert verdict(old_hang, now=200.0) is None
    assert verdict(old_hang, now=20.0) is None  # only 20 s of it is "before now"
    assert verdict(old_hang, now=30.0) == "hang"


def test_verdict_detail_names_the_numbers() -> None:
    v = assess(series(0, 60, pre=rate(1.0), **BUSY), BASE, P, NOW)
    assert v == Verdict(True, "preemption_storm", v.detail)
    assert "60.0 preemptions/min" in v.detail


def test_policy_is_configurable() -> None:
    strict = DegradationPolicy(
        max_preemptions_per_min=5.0, hang_s=10.0, leak_kv_usage=0.5, leak_max_running=0
    )
    assert verdict(series(0, 60, pre=rate(0.1), **BUSY), policy=strict) == "preemption_storm"
    assert verdict(series(0, 60, run=2.0, gen=lambda t: min(t, 50) * 20), policy=strict) == ("hang")
    assert verdict(series(0, 60, kv=0.6, run=0.0), policy=strict) == "kv_leak"
    assert verdict(series(0, 60, kv=0.6, run=1.0, gen=rate(10)), policy=strict) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_s": 0.0},
        {"hang_s": 61.0},
        {"leak_hold_s": -1.0},
        {"min_samples": 1},
        {"min_coverage": 0.0},
        {"min_coverage": 1.5},
        {"baseline_tau_s": 0.0},
    ],
)
def test_bad_policy_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DegradationPolicy(**kwargs)  # type: ignore[arg-type]


# -- baseline learning ----------------------------------------------------------------------

STARTED = 1000.0
WARM = STARTED + P.baseline_warmup_s  # 1060


def busy(
    t0: float, t1: float, per_request: float, running: float = 4.0, rss: int = 1000 * MiB
) -> list[EngineSample]:
    return series(t0, t1, run=running, gen=rate(per_request * running), rss=rss)


@pytest.mark.parametrize(
    ("now", "learns"),
    [
        (STARTED + 10, False),
        (WARM - 0.1, False),
        (WARM + 20, False),  # warm, but only 20 s of post-warm-up data (needs 30)
        (WARM + 30, True),
        (WARM + 300, True),
    ],
)
def test_no_baseline_before_warm_up(now: float, learns: bool) -> None:
    samples = busy(STARTED, now, 10.0)
    learned = learn_baseline(samples, EMPTY_BASELINE, P, STARTED, now)
    if learns:
        assert learned.tokens_per_s_per_request == pytest.approx(10.0)
        assert learned.samples == 1
        assert learned.updated_at == now
    else:
        assert learned.tokens_per_s_per_request is None
        assert learned.samples == 0


def test_before_warm_up_the_same_baseline_comes_back() -> None:
    samples = busy(STARTED, WARM - 1, 10.0)
    assert learn_baseline(samples, EMPTY_BASELINE, P, STARTED, WARM - 1) is EMPTY_BASELINE


def test_warm_up_samples_are_not_learned_from() -> None:
    slow_start = busy(STARTED, WARM - 2, 1.0)  # compiling, cold caches
    steady = busy(WARM, WARM + 40, 10.0)
    learned = learn_baseline(slow_start + steady, EMPTY_BASELINE, P, STARTED, WARM + 40)
    assert learned.tokens_per_s_per_request == pytest.approx(10.0)
    assert learned.running == pytest.approx(4.0)


def test_idle_windows_teach_rss_but_not_speed() -> None:
    idle = series(WARM, WARM + 60, run=0.0, gen=100.0, rss=900 * MiB)
    learned = learn_baseline(idle, EMPTY_BASELINE, P, STARTED, WARM + 60)
    assert learned.tokens_per_s_per_request is None
    assert learned.samples == 0
    assert learned.rss_bytes == 900 * MiB


@pytest.mark.parametrize(
    ("measured", "elapsed", "low", "high"),
    [
        (20.0, 2.0, 10.0, 10.05),  # one fast window barely moves it: alpha ~ 0.0033
        (5.0, 2.0, 9.98, 10.0),  # nor does a slowish (not degraded) one
        (20.0, 600.0, 16.3, 16.4),  # a whole time constant: 1 - 1/e of the way
        (3.0, 600.0, 10.0, 10.0),  # a slowdown window is never learned from
    ],
)
def test_baseline_is_a_slow_time_based_average(
    measured: float, elapsed: float, low: float, high: float
) -> None:
    previous = Baseline(10.0, 1000 * MiB, 5, 4.0, updated_at=2000.0)
    now = 2000.0 + elapsed
    learned = learn_baseline(busy(now - 60, now, measured), previous, P, STARTED, now)
    assert learned.tokens_per_s_per_request is not None
    assert low <= learned.tokens_per_s_per_request <= high
    if measured < P.slowdown_ratio * 10.0:
        assert learned is previous
    else:
        assert learned.samples == 6


def test_baseline_is_stable_under_steady_load_and_follows_a_lasting_change() -> None:
    baseline, t = EMPTY_BASELINE, WARM + 60
    for _ in range(300):  # ten minutes of scrapes every 2 s at a steady 10 tok/s
        baseline = learn_baseline(busy(t - 60, t, 10.0), baseline, P, STARTED, t)
        t += 2.0
    assert baseline.tokens_per_s_per_request == pytest.approx(10.0)
    assert baseline.samples == 300
    for _ in range(1800):  # one hour at 14 tok/s (e.g. a lighter mix of prompts)
        baseline = learn_baseline(busy(t - 60, t, 14.0), baseline, P, STARTED, t)
        t += 2.0
    assert baseline.tokens_per_s_per_request == pytest.approx(14.0, rel=0.01)


def test_rss_baseline_is_a_low_water_mark() -> None:
    previous = Baseline(10.0, 1000 * MiB, 5, 4.0, 2000.0)
    grown = learn_baseline(busy(2000, 2060, 10.0, rss=1400 * MiB), previous, P, STARTED, 2060)
    assert grown.rss_bytes == 1000 * MiB  # growth is never absorbed
    shrunk = learn_baseline(busy(2000, 2060, 10.0, rss=800 * MiB), previous, P, STARTED, 2060)
    assert shrunk.rss_bytes == 800 * MiB


def test_rss_baseline_needs_enough_readings() -> None:
    two = [S(WARM + 10, rss=900 * MiB), S(WARM + 20, rss=900 * MiB)]
    assert learn_baseline(two, EMPTY_BASELINE, P, STARTED, WARM + 20) is EMPTY_BASELINE


def test_learned_baseline_then_detects_a_slowdown() -> None:
    baseline, t = EMPTY_BASELINE, WARM + 60
    samples = busy(STARTED, t, 10.0)
    baseline = learn_baseline(samples, baseline, P, STARTED, t)
    assert assess(busy(t - 60, t, 10.0), baseline, P, t) == HEALTHY
    slow = busy(t, t + 60, 2.0)
    assert assess(slow, baseline, P, t + 60).reason == "slowdown"
    assert learn_baseline(slow, baseline, P, STARTED, t + 60) is baseline


def test_zero_speed_is_never_a_baseline() -> None:
    stalled = series(WARM, WARM + 60, run=4.0, gen=100.0)
    learned = learn_baseline(stalled, EMPTY_BASELINE, P, STARTED, WARM + 60)
    assert learned.tokens_per_s_per_request is None
    assert learned.samples == 0
