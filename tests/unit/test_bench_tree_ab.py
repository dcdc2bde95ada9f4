"""bench.tree_ab's arithmetic: the rotation of trees, CPU per chunk raw and net, and the
per-round ratios to the first tree."""

from __future__ import annotations

import pytest

from bench._relay import rotation
from bench.tree_ab import Side, report, round_ratios


def test_every_tree_leads_one_round_in_turn() -> None:
    names = ["a", "b", "c"]
    assert [rotation(names, r)[0] for r in range(4)] == ["a", "b", "c", "a"]
    assert sorted(rotation(names, 2)) == names


def test_net_takes_off_the_rate_measured_while_the_other_trees_ran() -> None:
    # 0.1 CPU-s over 10 s of others' rounds: 10 ms/s in the background.
    s = Side(cpu=0.5, elapsed=10.0, events=10_000, idle_cpu=0.1, idle_s=10.0)
    assert s.raw() == pytest.approx(50.0)
    assert s.net() == pytest.approx(40.0)


def test_ratios_are_round_by_round_against_the_first_tree() -> None:
    sides = {"base": Side(per_round=[10.0, 20.0]), "new": Side(per_round=[12.0, 18.0])}
    assert round_ratios(sides, "base") == {
        "base": [1.0, 1.0],
        "new": pytest.approx([1.2, 0.9]),
    }


def test_report_gives_the_median_ratio_and_its_range_per_tree() -> None:
    sides = {
        "0:x": Side(cpu=1.0, elapsed=3.0, events=100_000, per_round=[10.0, 10.0, 10.0]),
        "1:y": Side(cpu=1.1, elapsed=3.0, events=100_000, per_round=[11.0, 9.0, 12.0]),
    }
    text, data = report({16: sides}, {"0:x": "aaaa", "1:y": "bbbb"})
    assert "1.100 (0.900–1.200)" in text.splitlines()[3]
    assert data["16"]["bbbb"]["raw"] == pytest.approx(11.0)
