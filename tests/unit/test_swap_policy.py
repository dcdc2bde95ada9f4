"""The swap policy (``policy/swap.py``) by table, and the model lifecycle's transitions."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from appliance.policy.swap import (
    ALLOWED,
    Action,
    IllegalModelTransition,
    ModelSnap,
    ModelState,
    check_transition,
    decide,
)

S = ModelState
NOW = 1000.0


def snap(name: str, state: ModelState = S.UNLOADED, **kw: object) -> ModelSnap:
    base = ModelSnap(
        name=name,
        state=state,
        inflight=0,
        waiting_since=None,
        last_used=NOW - 5,
        loaded_at=NOW - 100 if state is S.LOADED else None,
        idle_unload_s=900,
        min_residency_s=30,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


CASES: list[tuple[str, list[ModelSnap], list[tuple[str, str]]]] = [
    ("nothing wanted, nothing to do", [snap("a"), snap("b", S.LOADED)], []),
    (
        "a wanted model in a free slot is loaded",
        [snap("a", waiting_since=NOW - 1)],
        [("load", "a")],
    ),
    (
        "the longest waiting goes first",
        [snap("a", waiting_since=NOW - 1), snap("b", waiting_since=NOW - 3)],
        [("load", "b")],
    ),
    (
        "a model put away for another waits behind it, whatever its queue's age",
        [
            snap("a", waiting_since=NOW - 20, left_at=NOW - 2),
            snap("b", waiting_since=NOW - 5),
        ],
        [("load", "b")],
    ),
    (
        "a model that left long ago is first again by its wait",
        [
            snap("a", waiting_since=NOW - 20, left_at=NOW - 30),
            snap("b", waiting_since=NOW - 5),
        ],
        [("load", "a")],
    ),
    (
        "the holder past its residency is drained for the wanted one",
        [snap("a", waiting_since=NOW - 1), snap("b", S.LOADED)],
        [("drain", "b")],
    ),
    (
        "within its minimum residency the holder stays",
        [snap("a", waiting_since=NOW - 1), snap("b", S.LOADED, loaded_at=NOW - 10)],
        [],
    ),
    (
        "a holder with work in flight is drained, not stopped",
        [snap("a", waiting_since=NOW - 1), snap("b", S.LOADED, inflight=3)],
        [("drain", "b")],
    ),
    (
        "a drained holder with nothing in flight is put away",
        [snap("a", waiting_since=NOW - 1), snap("b", S.DRAINING)],
        [("unload", "b")],
    ),
    (
        "a draining holder with work in flight waits",
        [snap("a", waiting_since=NOW - 1), snap("b", S.DRAINING, inflight=1)],
        [],
    ),
    (
        "a swap under way is not doubled",
        [snap("a", waiting_since=NOW - 1), snap("b", S.UNLOADING)],
        [],
    ),
    (
        "a sleeping model does not hold the slot",
        [snap("a", waiting_since=NOW - 1), snap("b", S.SLEEPING)],
        [("load", "a")],
    ),
    (
        "a sleeping model wanted is woken (loaded)",
        [snap("a", S.SLEEPING, waiting_since=NOW - 1)],
        [("load", "a")],
    ),
    (
        "idle past idle_unload_s: put away",
        [snap("a", S.LOADED, last_used=NOW - 901)],
        [("unload", "a")],
    ),
    ("idle, but work in flight: stays", [snap("a", S.LOADED, last_used=NOW - 901, inflight=1)], []),
    (
        "idle_unload_s = 0: never for idleness",
        [snap("a", S.LOADED, last_used=0, idle_unload_s=0)],
        [],
    ),
    (
        "asleep past idle_unload_s since it left the slot: unloaded fully",
        [snap("a", S.SLEEPING, last_used=NOW - 2000, left_at=NOW - 901)],
        [("unload", "a")],
    ),
    (
        "asleep for less than idle_unload_s: stays asleep, however old its last use",
        [snap("a", S.SLEEPING, last_used=NOW - 2000, left_at=NOW - 10)],
        [],
    ),
    (
        "asleep and wanted: woken, not unloaded",
        [snap("a", S.SLEEPING, left_at=NOW - 2000, waiting_since=NOW - 1)],
        [("load", "a")],
    ),
    (
        "asleep with idle_unload_s = 0: stays asleep",
        [snap("a", S.SLEEPING, left_at=0, idle_unload_s=0)],
        [],
    ),
]


@pytest.mark.parametrize(("slot", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(slot: list[ModelSnap], expected: list[tuple[str, str]]) -> None:
    actions = decide(slot, NOW)
    assert [(a.kind, a.model) for a in actions] == expected
    assert all(a.why for a in actions)  # the journal says why


def test_the_least_recently_used_holder_goes() -> None:
    # Several holders (a slot could hold several small models): the LRU one is chosen.
    slot = [
        snap("a", waiting_since=NOW - 1),
        snap("b", S.LOADED, last_used=NOW - 50),
        snap("c", S.LOADED, last_used=NOW - 200),
    ]
    [action] = decide(slot, NOW)
    assert action == Action("drain", "c", action.why)
    assert "to make room for a" in action.why and "least recently used" in action.why


def test_a_holder_that_requests_wait_for_goes_after_an_idle_one() -> None:
    # a's requests queue without being admitted (its engine restarting, hot or full): its
    # last admission is older than idle b's, yet b is the one that makes room.
    slot = [
        snap("a", S.LOADED, last_used=NOW - 200, waiting_since=NOW - 100),
        snap("b", S.LOADED, last_used=NOW - 50),
        snap("c", waiting_since=NOW - 10),
    ]
    [action] = decide(slot, NOW)
    assert action == Action("drain", "b", action.why)


MOVES = {
    (S.UNLOADED, S.LOADING),
    (S.LOADING, S.LOADED),
    (S.LOADING, S.UNLOADED),  # its engines could not start
    (S.LOADING, S.UNLOADING),  # an admin's unload while loading
    (S.LOADED, S.DRAINING),
    (S.LOADED, S.UNLOADING),
    (S.LOADED, S.UNLOADED),
    (S.DRAINING, S.LOADED),
    (S.DRAINING, S.UNLOADING),
    (S.DRAINING, S.UNLOADED),
    (S.UNLOADING, S.UNLOADED),
    (S.UNLOADING, S.SLEEPING),
    (S.SLEEPING, S.LOADING),  # woken
    (S.SLEEPING, S.UNLOADING),
    (S.SLEEPING, S.UNLOADED),
}


@pytest.mark.parametrize(("old", "new"), list(itertools.product(ModelState, repeat=2)))
def test_lifecycle_transitions(old: ModelState, new: ModelState) -> None:
    assert {(a, b) for a, bs in ALLOWED.items() for b in bs} == MOVES
    if (old, new) in MOVES:
        check_transition(old, new)
    else:
        with pytest.raises(IllegalModelTransition):
            check_transition(old, new)


def test_status_names_are_the_contract_s() -> None:
    assert {s.shown for s in ModelState} == {"loaded", "loading", "sleeping", "unloaded"}
