"""The sharing benches' arithmetic and entry points: bench.fairness (a colleague's request
behind one key's flood) and bench.priority (an interactive request behind a batch flood
on real vLLM): which flood streams the colleague passed, the flood's rate while it still
had streams waiting, and the tables' rows; both modules answer ``--help``."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from bench import fairness, priority
from bench._common import Result
from tests.fakes.appliance_proc import REPO


def stream(start: float, ttft: float, total: float = 1.0, ok: bool = True) -> Result:
    return Result(ok, start, ttft, total, events=22 if ok else 0)


def test_the_colleague_passed_the_flood_streams_whose_first_token_came_after_its_own() -> None:
    flood = [stream(0.0, 0.05), stream(0.0, 1.05), stream(0.0, 2.05), stream(0.0, 3.05)]
    colleague = stream(0.5, 0.6)  # its first token at 1.1 s
    assert fairness.passed(flood, colleague) == 2


def test_a_stream_that_never_got_a_token_counts_as_passed() -> None:
    flood = [stream(0.0, 0.0, ok=False)]
    assert fairness.passed(flood, stream(0.5, 0.5)) == 1


def test_the_busy_rate_leaves_out_the_tail_the_flood_could_not_fill() -> None:
    # 10 streams on 4 slots: the last 4 ends are its tail (fewer than 4 left to run).
    ends = [0.8, 0.9, 1.0, 1.1, 1.7, 2.0, 2.2, 2.5, 3.0, 3.6]
    assert fairness.steady_rate(ends, 4) == pytest.approx(6 / 2.0)
    assert fairness.steady_rate(ends, 2) == pytest.approx(8 / 2.5)
    assert math.isnan(fairness.steady_rate(ends[:3], 4))


def test_flood_lengths_spread_evenly_around_the_mean_the_same_every_run() -> None:
    got = fairness.lengths(40, 20, 0.3)
    assert len(got) == 40 and min(got) == 14 and max(got) == 26
    assert sum(got) / len(got) == pytest.approx(20, abs=0.2)
    assert got == fairness.lengths(40, 20, 0.3) and got != sorted(got)
    assert fairness.lengths(3, 20, 0.0) == [20, 20, 20]


def run(tree: str, scenario: str, ttft: float | None, by: int | None, s: float) -> fairness.Run:
    return fairness.Run(tree, scenario, 0, 40, 0, s, 4.0, ttft, ttft is not None, by, 36)


def test_the_fairness_table_has_a_row_per_tree_and_scenario_that_ran() -> None:
    runs = [
        run("this tree", "flood alone", None, None, 10.0),
        run("this tree", "flood + colleague", 0.5, 30, 11.0),
        run("this tree", "flood + colleague", 0.7, 29, 11.0),
        run("this tree", "flood + colleague", 0.6, 31, 11.0),
        run("6adf404", "flood + colleague", 9.6, 0, 10.0),
    ]
    rows = fairness.table(runs, ["this tree", "6adf404"]).rows
    assert [r[:2] for r in rows] == [
        ["this tree", "flood alone"],
        ["this tree", "flood + colleague"],
        ["6adf404", "flood + colleague"],
    ]
    assert rows[0][2] == "–" and rows[0][4] == "4.00"
    assert rows[1][2] == "0.60 (0.50–0.70)" and rows[1][3] == "30 (29–31)"
    assert rows[2][2] == "9.60" and rows[2][3] == "0"


def prun(policy: str, r: int, ttft: float, end: float, failed: int = 0) -> priority.Run:
    return priority.Run(policy, r, ttft, ttft + 1.0, end, failed)


def test_priority_rounds_alternate_which_daemon_goes_first() -> None:
    assert [priority.order(r)[0] for r in range(3)] == ["priority", "fcfs", "priority"]


def test_the_priority_table_gives_median_and_range_per_scheduling() -> None:
    runs = [
        prun("priority", 0, 1.5, 30.0),
        prun("fcfs", 0, 4.0, 28.0),
        prun("fcfs", 1, 5.0, 29.0, failed=1),
        prun("priority", 1, 1.7, 31.0),
        prun("priority", 2, 1.6, 32.0),
        prun("fcfs", 2, 3.6, 27.0),
    ]
    rows = priority.table(runs).rows
    assert rows[0] == [
        "priority",
        "1,600 (1,500–1,700)",
        "1,500 1,700 1,600",
        "31.0 (30.0–32.0)",
        "0",
    ]
    assert rows[1][0] == "fcfs" and rows[1][1] == "4,000 (3,600–5,000)" and rows[1][4] == "1"
    assert priority.ratio_line(runs) == "fcfs / priority, median interactive TTFT: 2.50x"


def test_a_spread_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError):
        priority.spread([])


@pytest.mark.parametrize("module", ["bench.fairness", "bench.priority"])
def test_the_bench_answers_help(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    ).stdout
    assert "--json" in out and "--rounds" in out
