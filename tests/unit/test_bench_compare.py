"""bench.direct_vs_gateway.compare: the figures the real-engine benchmarks report."""

from __future__ import annotations

import pytest

from bench._common import Result
from bench.direct_vs_gateway import (
    Measure,
    Round,
    Rounds,
    Samples,
    compare,
    daemon_cpu_per_event,
    merged,
    round_ratios,
)

PER_REQUEST = Measure(
    "clients", "req/s", "req_s", "latency", lambda ok, s: len(ok) / s, lambda r: r.total
)


def results(n_ok: int, n_failed: int, total_s: float, events: int = 10) -> list[Result]:
    return [Result(True, 0.0, total_s, total_s, events) for _ in range(n_ok)] + [
        Result(False, 0.0, 0.0, total_s, 0, status=503) for _ in range(n_failed)
    ]


def test_rates_count_answered_requests_only_and_the_ratio_is_gateway_over_direct() -> None:
    samples: Samples = {
        (4, "direct"): (results(40, 0, 0.1), 10.0),
        (4, "gateway"): (results(36, 2, 0.2), 10.0),
    }
    table, figures = compare([4], samples, PER_REQUEST)
    assert figures == {"4": {"ratio": pytest.approx(0.9), "req_s": [4.0, 3.6]}}
    row = dict(zip(table.headers, table.rows[0], strict=True))
    assert row["requests direct / gw"] == "40 / 38"
    assert row["failed"] == "0 / 2"
    assert row["latency p50 direct / gw (ms)"] == "100.00 / 200.00"


def test_a_path_that_measured_nothing_has_no_rate_rather_than_a_crash() -> None:
    samples: Samples = {(1, "direct"): ([], 0.0), (1, "gateway"): (results(1, 0, 0.1), 1.0)}
    table, figures = compare([1], samples, PER_REQUEST)
    assert table.rows[0][3] == "nan"
    assert figures["1"]["req_s"][1] == 1.0


def test_rounds_merge_and_give_their_ratio_round_by_round() -> None:
    rounds: Rounds = {
        (8, "direct"): [Round(results(10, 0, 0.1), 1.0, 0.1), Round(results(20, 0, 0.1), 1.0, 0.1)],
        (8, "gateway"): [Round(results(9, 1, 0.1), 1.0, 0.4), Round(results(21, 0, 0.1), 1.0, 0.5)],
    }
    assert round_ratios(rounds, 8, PER_REQUEST) == [pytest.approx(0.9), pytest.approx(1.05)]
    samples = merged(rounds)
    assert len(samples[(8, "gateway")][0]) == 31 and samples[(8, "gateway")][1] == 2.0
    assert compare([8], samples, PER_REQUEST)[1]["8"]["ratio"] == pytest.approx(1.0)
    # 0.9 s of CPU in the gateway rounds, 0.1 s/s of it background, over 30 events of 10 each
    raw, net = daemon_cpu_per_event(rounds, 8)
    assert (raw, net) == (pytest.approx(0.9e6 / 300), pytest.approx(0.7e6 / 300))
