"""The overflow fallback decision as a table: each reason, the fallback full too, refusals."""

from __future__ import annotations

import pytest

from appliance.policy.fallback import ModelRoom, choose_fallback, why_not_now

OPEN = ModelRoom(ready=1, hot=0, kv_tripped=0, can_admit=True)
DOWN = ModelRoom(ready=0, hot=0, kv_tripped=0, can_admit=False)
HOT = ModelRoom(ready=2, hot=2, kv_tripped=0, can_admit=False)
KV = ModelRoom(ready=2, hot=0, kv_tripped=2, can_admit=False)
FULL = ModelRoom(ready=2, hot=0, kv_tripped=0, can_admit=False)
MIXED = ModelRoom(ready=2, hot=1, kv_tripped=1, can_admit=False)
ONE_HOT_ONE_OPEN = ModelRoom(ready=2, hot=1, kv_tripped=0, can_admit=True)


@pytest.mark.parametrize(
    ("primary", "fallback", "allowed", "expect"),
    [
        pytest.param(OPEN, OPEN, True, None, id="primary can admit: stays"),
        pytest.param(ONE_HOT_ONE_OPEN, OPEN, True, None, id="one engine hot, the other open"),
        pytest.param(DOWN, OPEN, True, "down", id="no READY engine (restarting, drained)"),
        pytest.param(HOT, OPEN, True, "heat", id="every engine at the hard limit"),
        pytest.param(KV, OPEN, True, "kv", id="every engine behind the KV breaker"),
        pytest.param(FULL, OPEN, True, "full", id="every engine at its budget"),
        pytest.param(MIXED, OPEN, True, "full", id="a mix of heat and KV is capacity"),
        pytest.param(FULL, FULL, True, None, id="fallback full too: queue for the primary"),
        pytest.param(DOWN, DOWN, True, None, id="fallback down too: queue, 503 on timeout"),
        pytest.param(DOWN, None, True, None, id="no fallback configured"),
        pytest.param(DOWN, OPEN, False, None, id="refused by header or key"),
    ],
)
def test_choose_fallback(
    primary: ModelRoom, fallback: ModelRoom | None, allowed: bool, expect: str | None
) -> None:
    assert choose_fallback(primary, fallback, allowed=allowed) == expect


def test_one_hop_only_the_fallback_room_is_asked() -> None:
    # B's own fallback C never enters the decision: the function has no place for it,
    # and B unable to admit means the request stays with A whatever C could do.
    assert choose_fallback(DOWN, FULL, allowed=True) is None
    assert why_not_now(FULL) == "full"
