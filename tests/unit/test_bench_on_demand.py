"""bench.on_demand's pure parts: swaps counted per slot from loads (a round starts with
both models put away, so its first load is no swap), failed requests counted by status
and error code, TTFT summaries and tables, and the chart written from the JSON the bench
saves."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.on_demand import Asked, swap_figures
from bench.on_demand_report import chart, failure_lines, swap_table, ttft_summary, ttft_table


def test_swaps_are_loads_after_the_first_per_round_per_minute() -> None:
    args = argparse.Namespace(residency_s=5.0)
    rounds = [
        {"slot": "stop", "seconds": 30.0, "loads": 11, "asked": [Asked("stop-a", True, 0.5)]},
        {
            "slot": "stop",
            "seconds": 30.0,
            "loads": 1,
            "asked": [Asked("stop-b", False, 60.04, 503, "model_loading")],
        },
        {"slot": "sleep-r", "seconds": 60.0, "loads": 0, "asked": []},
    ]
    figs = swap_figures(args, rounds)
    assert set(figs) == {"stop", "sleep-r"}
    stop = figs["stop"]
    assert (stop["swaps"], stop["swaps_per_minute"], stop["residency_s"]) == (10, 10.0, 0.0)
    assert stop["answered"] == {"stop-a": 1, "stop-b": 0}
    assert stop["failed"] == {"stop-a": 0, "stop-b": 1}
    assert figs["sleep-r"]["residency_s"] == 5.0 and figs["sleep-r"]["swaps"] == 0
    assert stop["failures"] == {"stop-b": {"503 model_loading": [60.0]}}
    assert "| swap = stop  | 0               | 10.0 (10 in 1.0 min)" in swap_table(figs)
    assert failure_lines(figs) == ["- failed in stop: stop-b: 1 × 503 model_loading after 60 s"]


def test_ttft_summary_and_table() -> None:
    summary = ttft_summary({"real": {"loaded": [0.1, 0.3, 0.2], "unloaded, slot free": [30.0]}})
    assert summary["real"]["loaded"] == {"median_s": 0.2, "min_s": 0.1, "max_s": 0.3, "n": 3}
    table = ttft_table(summary)
    assert "real vLLM (CPU), swap = stop (s)" in table
    assert "0.200 (0.100–0.300)" in table and "asleep" not in table


def test_chart_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is missing")
    result = {
        "ttft": ttft_summary({"sleep": {"loaded": [0.01], "asleep, slot free": [0.5]}}),
        "swaps": swap_figures(
            argparse.Namespace(residency_s=5.0),
            [{"slot": "sleep", "seconds": 60.0, "loads": 30, "asked": []}],
        ),
    }
    chart(result, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
