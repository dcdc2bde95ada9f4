"""Speculative decoding figures over a window, as a table of counter histories."""

from __future__ import annotations

import pytest

from appliance.policy.speculation import NO_FIGURES, SpecFigures, SpecSample, spec_figures


def s(t: float, drafts: float, proposed: float, accepted: float) -> SpecSample:
    return SpecSample(t, drafts, proposed, accepted)


@pytest.mark.parametrize(
    ("samples", "expect"),
    [
        pytest.param([], NO_FIGURES, id="no samples"),
        pytest.param([s(100, 10, 40, 20)], NO_FIGURES, id="one sample: no change to measure"),
        pytest.param(
            [s(50, 0, 0, 0), s(100, 10, 40, 20)],
            SpecFigures(0.5, 3.0),
            id="half the proposals accepted, two per draft",
        ),
        pytest.param(
            [s(39, 0, 0, 0), s(50, 10, 40, 40), s(100, 20, 80, 40)],
            SpecFigures(0.0, 1.0),
            id="only the last minute counts: nothing accepted in it",
        ),
        pytest.param(
            [s(60, 5, 20, 10), s(100, 5, 20, 10)],
            NO_FIGURES,
            id="no drafts in the window (a chat with nothing to look up): none, not zero",
        ),
        pytest.param(
            [s(50, 100, 400, 300), s(70, 2, 8, 2), s(100, 12, 48, 22)],
            SpecFigures(0.5, 3.0),
            id="a restart resets the counters: only the new run is measured",
        ),
    ],
)
def test_spec_figures(samples: list[SpecSample], expect: SpecFigures) -> None:
    assert spec_figures(samples, now=100.0, window_s=60.0) == expect
