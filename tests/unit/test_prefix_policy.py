"""route_by_prefix(): a table of snapshots, what each engine holds of the request's
prompt, and the engine that should take it (policy/prefix.py gives the rules)."""

from __future__ import annotations

import pytest

from appliance.policy.prefix import BALANCE_ABS, BALANCE_REL, PREFIX_MIN_SHARE, route_by_prefix
from appliance.policy.routing import EngineLoad


def E(  # a table row
    id: int,
    inflight: int = 0,
    out: int = 0,
    *,
    max_inflight: int = 64,
    level: int = 0,
    accepting: bool = True,
) -> EngineLoad:
    return EngineLoad(id, accepting, inflight, out, max_inflight, 100_000, level)


BLOCKS = 40  # the request's prompt: 40 blocks

CASES: list[tuple[str, list[EngineLoad], dict[int, int], int | None]] = [
    ("no engine with room", [E(0, 64), E(1, 64)], {0: 40}, None),
    ("nothing held: least-loaded", [E(0, 2, 900), E(1, 1, 100)], {}, 1),
    ("the holder, though busier", [E(0, 3, 9000), E(1, 0, 0)], {0: 40}, 0),
    ("the longest holder", [E(0), E(1), E(2)], {0: 20, 1: 39, 2: 25}, 1),
    ("equal holders: the lighter", [E(0, 2, 800), E(1, 2, 300)], {0: 30, 1: 30}, 1),
    ("holds less than half: by load", [E(0, 1, 500), E(1)], {0: 19}, 1),
    ("holds exactly half: the holder", [E(0, 1, 500), E(1)], {0: 20}, 0),
    # balance: both thresholds exceeded -> least-loaded; one alone is not enough
    ("8 more than an idle engine: kept", [E(0, 8), E(1, 0)], {0: 40}, 0),
    ("9 more than an idle engine: moved", [E(0, 9), E(1, 0)], {0: 40}, 1),
    ("27 vs 18: 9 more but not over 1.5x: kept", [E(0, 27), E(1, 18)], {0: 40}, 0),
    ("28 vs 18: both passed: moved", [E(0, 28), E(1, 18)], {0: 40}, 1),
    # heat and draining always win
    ("hotter holder loses", [E(0, 0, 0, level=1), E(1, 3, 5000)], {0: 40}, 1),
    (
        "holder as hot as the best keeps it",
        [E(0, 1, 100, level=1), E(1, 3, 5000, level=1), E(2, 0, level=2)],
        {1: 40},
        1,
    ),
    ("draining (not accepting) holder loses", [E(0, accepting=False), E(1, 3)], {0: 40}, 1),
    ("full holder loses", [E(0, 64), E(1, 3)], {0: 40}, 1),
    (
        "a hot longest holder gives way to a cool shorter one",
        [E(0, level=2), E(1, 2, 900), E(2, 0, 0)],
        {0: 40, 1: 30},
        1,
    ),
]


@pytest.mark.parametrize(
    ("engines", "matched", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_route_by_prefix(
    engines: list[EngineLoad], matched: dict[int, int], expected: int | None
) -> None:
    assert route_by_prefix(engines, 10, matched, BLOCKS) == expected


def test_a_prompt_of_no_whole_block_is_placed_by_load() -> None:
    assert route_by_prefix([E(0, 3, 900), E(1)], 10, {0: 0}, 0) == 1


def test_the_thresholds_are_those_documented() -> None:
    # docs/operations.md names them: change both together.
    assert (PREFIX_MIN_SHARE, BALANCE_ABS, BALANCE_REL) == (0.5, 8, 1.5)


def test_thresholds_can_be_passed() -> None:
    engines = [E(0, 3), E(1, 0)]
    assert route_by_prefix(engines, 10, {0: 40}, BLOCKS) == 0
    assert route_by_prefix(engines, 10, {0: 40}, BLOCKS, balance_abs=2, balance_rel=1.0) == 1
    assert route_by_prefix(engines, 10, {0: 10}, BLOCKS, min_share=0.25) == 0
