"""route() and session_key(): tables of snapshots and the engine each should pick."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.policy.routing import (
    MAX_SESSION_KEY_CHARS,
    EngineLoad,
    has_room,
    route,
    session_key,
)


def E(  # a table row
    id: int,
    inflight: int = 0,
    out: int = 0,
    *,
    max_inflight: int = 8,
    budget: int = 10_000,
    level: int = 0,
    accepting: bool = True,
) -> EngineLoad:
    return EngineLoad(
        id=id,
        accepting=accepting,
        inflight=inflight,
        outstanding_tokens=out,
        max_inflight=max_inflight,
        token_budget=budget,
        throttle_level=level,
    )


# -- eligibility and the best engine --------------------------------------------------------

CASES: list[tuple[str, list[EngineLoad], int, int | None]] = [
    ("no engines", [], 10, None),
    ("one idle engine", [E(0)], 10, 0),
    ("fewest outstanding tokens", [E(0, 1, 500), E(1, 1, 100)], 10, 1),
    ("fewest outstanding, whatever the order", [E(0, 1, 100), E(1, 1, 500)], 10, 0),
    ("cooler wins over lighter", [E(0, 0, 0, level=1), E(1, 3, 9000)], 50, 1),
    (
        "hotter still used when the cool one is full",
        [E(0, 8, 100, level=0), E(1, 0, 0, level=2)],
        10,
        1,
    ),
    ("not accepting is skipped", [E(0, accepting=False), E(1, 2, 800)], 10, 1),
    ("sequence budget full is skipped", [E(0, 8, 0), E(1, 2, 800)], 10, 1),
    ("token budget exceeded is skipped", [E(0, 1, 950, budget=1000), E(1, 2, 1500)], 60, 1),
    ("token budget exactly met is room", [E(0, 1, 900, budget=1000)], 100, 0),
    ("token budget one over is no room", [E(0, 1, 900, budget=1000)], 101, None),
    ("idle engine takes a request bigger than its budget", [E(0, 0, 0, budget=100)], 5000, 0),
    (
        "busy engine does not take a request bigger than its budget",
        [E(0, 1, 10, budget=100)],
        5000,
        None,
    ),
    ("idle rule never waives the sequence budget", [E(0, 0, 0, max_inflight=0)], 1, None),
    ("hard-throttled (not accepting) idle engine", [E(0, accepting=False)], 1, None),
    ("all full: caller queues", [E(0, 8, 10), E(1, 8, 10)], 1, None),
    ("tie on tokens: fewer in flight", [E(0, 3, 100), E(1, 1, 100)], 1, 1),
    ("full tie: snapshot order", [E(0, 1, 100), E(1, 1, 100)], 1, 0),
    (
        "level beats tokens across three",
        [E(0, 1, 10, level=2), E(1, 4, 600, level=1), E(2, 2, 300, level=1)],
        1,
        2,
    ),
    (
        "lowered budgets (governor) apply",
        [E(0, 2, 200, max_inflight=2, level=1), E(1, 5, 700)],
        1,
        1,
    ),
]


@pytest.mark.parametrize(
    ("engines", "cost", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_route_picks(engines: list[EngineLoad], cost: int, expected: int | None) -> None:
    assert route(engines, cost) == expected


# -- session affinity -----------------------------------------------------------------------

TWO = [E(0, 2, 1000), E(1, 2, 1400)]  # best is 0; 1 is within 20 % + 256 (1456)

AFFINITY_CASES: list[
    tuple[str, list[EngineLoad], str | None, Mapping[str, int] | None, int | None]
] = [
    ("sticky engine close enough is kept", TWO, "s", {"s": 1}, 1),
    ("sticky engine that is also best", TWO, "s", {"s": 0}, 0),
    ("boundary: exactly best*1.2 + 256", [E(0, 2, 1000), E(1, 2, 1456)], "s", {"s": 1}, 1),
    ("boundary: one token past", [E(0, 2, 1000), E(1, 2, 1457)], "s", {"s": 1}, 0),
    ("slack matters when the best is idle", [E(0), E(1, 1, 256)], "s", {"s": 1}, 1),
    ("past slack when the best is idle", [E(0), E(1, 1, 257)], "s", {"s": 1}, 0),
    (
        "sticky engine hotter: the cooler one",
        [E(0, 2, 1000), E(1, 2, 1000, level=1)],
        "s",
        {"s": 1},
        0,
    ),
    (
        "sticky engine not accepting",
        [E(0, 2, 1000), E(1, 2, 1000, accepting=False)],
        "s",
        {"s": 1},
        0,
    ),
    ("sticky engine full", [E(0, 2, 1000), E(1, 8, 1000)], "s", {"s": 1}, 0),
    ("unknown session", TWO, "other", {"s": 1}, 0),
    ("no session", TWO, None, {"s": 1}, 0),
    ("no affinity map", TWO, "s", None, 0),
    ("affinity to an engine not in the snapshot", TWO, "s", {"s": 7}, 0),
    ("nobody can take it: None even with affinity", [E(0, 8), E(1, 8)], "s", {"s": 1}, None),
]


@pytest.mark.parametrize(
    ("engines", "session", "affinity", "expected"),
    [c[1:] for c in AFFINITY_CASES],
    ids=[c[0] for c in AFFINITY_CASES],
)
def test_route_affinity(
    engines: list[EngineLoad],
    session: str | None,
    affinity: Mapping[str, int] | None,
    expected: int | None,
) -> None:
    assert route(engines, 10, session, affinity) == expected


@pytest.mark.parametrize(
    ("closeness", "slack", "expected"),
    [
        (0.0, 0, 0),  # strict: only an engine as light as the best is kept
        (0.4, 0, 1),  # 1400 <= 1000 * 1.4
        (0.39, 0, 0),
        (0.0, 400, 1),  # 1400 <= 1000 + 400
        (0.0, 399, 0),
    ],
)
def test_route_closeness_and_slack(closeness: float, slack: int, expected: int) -> None:
    assert route(TWO, 10, "s", {"s": 1}, closeness=closeness, slack_tokens=slack) == expected


def test_route_does_not_touch_its_inputs() -> None:
    engines = (E(0, 2, 1000), E(1, 2, 1400))
    affinity = {"s": 1}
    assert route(engines, 10, "s", affinity) == 1
    assert affinity == {"s": 1}
    assert engines == (E(0, 2, 1000), E(1, 2, 1400))


# -- invariants over generated snapshots ----------------------------------------------------

loads = st.builds(
    EngineLoad,
    id=st.integers(0, 7),
    accepting=st.booleans(),
    inflight=st.integers(0, 10),
    outstanding_tokens=st.integers(0, 5000),
    max_inflight=st.integers(0, 10),
    token_budget=st.integers(0, 5000),
    throttle_level=st.integers(0, 4),
)


@given(
    st.lists(loads, max_size=8),
    st.integers(0, 6000),
    st.sampled_from([None, "a", "b"]),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 7)),
)
def test_route_invariants(
    engines: list[EngineLoad], cost: int, session: str | None, affinity: dict[str, int]
) -> None:
    chosen = route(engines, cost, session, affinity)
    eligible = [e for e in engines if has_room(e, cost)]
    if chosen is None:
        assert not eligible
        return
    picked = [e for e in eligible if e.id == chosen]
    assert picked, "the chosen engine must be eligible"
    coolest = min(e.throttle_level for e in eligible)
    assert any(e.throttle_level == coolest for e in picked), "never a hotter engine"


# -- session_key ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("user", "header", "expected"),
    [
        (None, None, None),
        ("alice", None, "alice"),
        (None, "conv-1", "conv-1"),
        ("alice", "conv-1", "conv-1"),  # the header is set on purpose for this
        ("alice", "", "alice"),  # an empty header falls back to user
        ("alice", "   ", "alice"),  # so does a blank one
        ("  bob  ", None, "bob"),
        ("", "", None),
        (" ", None, None),
        ("x" * 1000, None, "x" * MAX_SESSION_KEY_CHARS),
    ],
)
def test_session_key(user: str | None, header: str | None, expected: str | None) -> None:
    assert session_key(user, header) == expected


@pytest.mark.parametrize(
    ("user", "header", "cache_key", "anthropic_user", "expected"),
    [
        (None, None, "codex-conv", None, "codex-conv"),  # Codex's prompt_cache_key
        (None, None, None, "user_x_session_1", "user_x_session_1"),  # Claude Code's
        ("alice", None, "codex-conv", None, "codex-conv"),  # asked for caching: over user
        ("alice", None, None, "user_x_session_1", "user_x_session_1"),
        (None, "conv-1", "codex-conv", "user_x", "conv-1"),  # the header still first
        ("alice", None, " ", "", "alice"),  # blank hints fall through
        (None, None, "k" * 1000, None, "k" * MAX_SESSION_KEY_CHARS),
    ],
)
def test_session_key_reads_every_hint(
    user: str | None,
    header: str | None,
    cache_key: str | None,
    anthropic_user: str | None,
    expected: str | None,
) -> None:
    assert session_key(user, header, cache_key, anthropic_user) == expected
