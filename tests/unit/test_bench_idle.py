"""bench.idle's arithmetic: CPU milliseconds per second of wall time, and the table."""

from __future__ import annotations

import pytest

from bench.idle import CpuSample, cpu_ms_per_s, report, summary


def test_user_and_system_time_over_the_window_in_ms_per_second() -> None:
    before = CpuSample(t=100.0, user=2.0, system=1.0)
    after = CpuSample(t=130.0, user=2.15, system=1.09)
    assert cpu_ms_per_s(before, after) == pytest.approx(8.0)


def test_an_empty_window_is_refused() -> None:
    s = CpuSample(5.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        cpu_ms_per_s(s, s)


def test_summary_is_median_low_high() -> None:
    assert summary([9.0, 3.0, 4.0]) == (4.0, 3.0, 9.0)


def test_report_puts_both_sides_and_their_ratio_on_one_row() -> None:
    figures = {"2": {"HEAD": [4.0, 5.0, 6.0], "baseline": [10.0, 10.0, 12.0]}}
    text = report(figures, {"HEAD": "abc123", "baseline": "ed95ebd"})
    row = text.splitlines()[2]
    assert "5.00 (4.00–6.00)" in row and "10.00 (10.00–12.00)" in row and "0.50" in row
