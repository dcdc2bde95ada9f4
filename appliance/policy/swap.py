"""Models on demand: a model's lifecycle, and which model of a slot to load or put away.

A slot is the GPUs (on CPU: the cores) that on-demand models take turns on
(:func:`slots`); one of them holds it at a time. A model's
life, one enum with a table of allowed moves, as an engine's::

    UNLOADED ──► LOADING ──► LOADED ──► DRAINING ──► UNLOADING ──► UNLOADED
        ▲           │  ▲        │                        │
        │           │  │        └────────────────────────┤ (idle, nothing in flight)
        └───────────┘  └─────── SLEEPING ◄───────────────┘ (swap = "sleep")
       (load failed)       (woken)

:func:`decide` is the whole policy, a pure function of a snapshot of one slot:

1. a LOADED model idle for its ``idle_unload_s`` (nothing in flight, nobody waiting for
   it) is put away: it frees the slot before anyone asks; a SLEEPING one (``swap =
   "sleep"``) nobody wants, asleep for its ``idle_unload_s`` (since it left the slot), is
   unloaded fully, so its weights do not stay in host RAM for good;
2. a model somebody waits for, in a slot nobody else holds, is loaded (the one waiting
   longest first, its wait counted from no earlier than when it last left the slot:
   :func:`turn_since`);
3. otherwise the least recently used holder that has been loaded for its
   ``min_residency_s`` is drained: it takes no new work, its requests finish, and once
   nothing is in flight it is put away. Within the residency it stays, so two models
   wanted in turn swap at most once per residency instead of on every request (a swap
   storm costs a cold start each time);
4. a DRAINING model with nothing in flight is put away.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from appliance.config.schema import ServedModel


class ModelState(enum.Enum):
    UNLOADED = "unloaded"  # no engine running (or planned only)
    LOADING = "loading"  # engines starting, or waking
    LOADED = "loaded"  # some engine READY: takes requests
    DRAINING = "draining"  # chosen to go: no new work, in-flight work finishes
    UNLOADING = "unloading"  # engines being stopped or put to sleep
    SLEEPING = "sleeping"  # engines asleep (swap = "sleep"): weights in host RAM

    @property
    def shown(self) -> str:
        """What /admin/status says: loaded, loading, sleeping or unloaded (contract). A
        model on its way out still holds its GPUs, so it shows as loaded until it is not."""
        return "loaded" if self in (ModelState.DRAINING, ModelState.UNLOADING) else self.value


def slots(served: Sequence[ServedModel], device: str) -> tuple[tuple[str, ...], ...]:
    """The on-demand models that take turns, as groups of names: by identical GPU sets,
    or on ``device`` = "cpu" all of them in one group (on cores of their own beside the
    ``always`` models'). check-config has refused overlapping sets that are not equal
    (:mod:`appliance.config.checks.on_demand`)."""
    groups: dict[object, list[str]] = {}
    for m in served:
        if m.load != "on_demand":
            continue
        key = "cpu" if device == "cpu" else tuple(sorted(m.gpus or ()))
        groups.setdefault(key, []).append(m.name)
    return tuple(tuple(g) for g in groups.values())


_S = ModelState
ALLOWED: Mapping[ModelState, frozenset[ModelState]] = {
    _S.UNLOADED: frozenset({_S.LOADING}),
    _S.LOADING: frozenset({_S.LOADED, _S.UNLOADED, _S.UNLOADING}),
    _S.LOADED: frozenset({_S.DRAINING, _S.UNLOADING, _S.UNLOADED}),
    _S.DRAINING: frozenset({_S.LOADED, _S.UNLOADING, _S.UNLOADED}),
    _S.UNLOADING: frozenset({_S.UNLOADED, _S.SLEEPING}),
    _S.SLEEPING: frozenset({_S.LOADING, _S.UNLOADING, _S.UNLOADED}),
}
# Holding the slot: its engines run (or are on their way up or down).
HOLDING = frozenset({_S.LOADING, _S.LOADED, _S.DRAINING, _S.UNLOADING})


class IllegalModelTransition(RuntimeError):
    pass


def check_transition(old: ModelState, new: ModelState) -> None:
    if new not in ALLOWED[old]:
        raise IllegalModelTransition(f"model state {old.value} -> {new.value} is not allowed")


@dataclass(frozen=True)
class ModelSnap:
    """One on-demand model of a slot, as the policy reads it."""

    name: str
    state: ModelState
    inflight: int  # requests on its engines now
    waiting_since: float | None  # a request (or an admin) has wanted it since; None: nobody
    last_used: float  # monotonic time of its last request (its load, if none since)
    loaded_at: float | None  # when it last became LOADED
    idle_unload_s: float  # 0: never put away for idleness
    min_residency_s: float
    left_at: float | None = None  # when it was last chosen to leave the slot (drained)


@dataclass(frozen=True)
class Action:
    kind: Literal["load", "drain", "unload"]
    model: str
    why: str  # for the journal: why this swap happens


def decide(slot: Sequence[ModelSnap], now: float) -> list[Action]:
    """What to do now in one slot (see the module docstring); [] while nothing is due."""
    out = [_idle(m, now) for m in slot]
    actions = [a for a in out if a is not None]
    for m in slot:
        if m.state is _S.DRAINING and m.inflight == 0:
            actions.append(Action("unload", m.name, "drained"))
    if actions:
        return actions
    wanted = sorted(
        (m for m in slot if m.waiting_since is not None and m.state not in HOLDING),
        key=turn_since,
    )
    if not wanted:
        return []
    first = wanted[0]
    holders = [m for m in slot if m.state in HOLDING]
    if not holders:
        return [Action("load", first.name, "requested")]
    if any(m.state is not _S.LOADED for m in holders):
        return []  # a swap is under way: let it finish
    ready = [m for m in holders if now - (m.loaded_at or now) >= m.min_residency_s]
    if not ready:
        return []  # the minimum residency damps swap storms: the wanted model waits
    # Least recently used, but never one that requests wait for while an idle one is
    # there: a holder whose requests queue unadmitted (its engine restarting, hot, full)
    # has a stale last_used (it moves on admission), not a lack of use.
    victim = min(ready, key=lambda m: (m.waiting_since is not None, m.last_used))
    idle_s = now - victim.last_used
    return [
        Action(
            "drain",
            victim.name,
            f"to make room for {first.name} (least recently used: last request {idle_s:.0f} s ago)",
        )
    ]


def turn_since(m: ModelSnap) -> float:
    """Since when a wanted model has waited for its turn: since it was first wanted, but
    never since before it last left the slot. Fairness: under a steady load a model
    drained to make room for another still has requests queued from while it held the
    slot; counted from their arrival, they would win it back at once, ahead of the
    model it made room for, which would never be served."""
    since = m.waiting_since if m.waiting_since is not None else 0.0
    return since if m.left_at is None else max(since, m.left_at)


def _idle(m: ModelSnap, now: float) -> Action | None:
    if m.state is _S.SLEEPING and m.waiting_since is None and m.idle_unload_s > 0:
        asleep_s = now - (m.left_at if m.left_at is not None else m.last_used)
        if asleep_s >= m.idle_unload_s:
            return Action("unload", m.name, f"asleep for {asleep_s:.0f} s")
        return None
    if m.state is not _S.LOADED or m.inflight or m.waiting_since is not None:
        return None
    if m.idle_unload_s <= 0 or now - m.last_used < m.idle_unload_s:
        return None
    return Action("unload", m.name, f"idle for {now - m.last_used:.0f} s")
