"""Restart budgets and backoff: pure rules, and the one record of an engine's restarts.

Two budgets, so a hot afternoon never spends the budget that stops a crash loop:

- **unplanned** restarts (every reason but those below: the engine exited, was killed,
  failed to start, hung, or timed out starting) count against
  ``restart.max_restarts_per_hour``; past it the engine is FAILED until an admin
  restarts it. Each one in a row also waits longer first (:func:`backoff_delay`);
- **planned** restarts the supervisor chose (heat, degradation) count against
  ``restart.max_planned_restarts_per_hour``, checked when they are asked for; they are
  drained first and never back off. An admin's restart spends neither budget.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from appliance.engine import RestartReason

PLANNED_REASONS = frozenset({RestartReason.ADMIN, RestartReason.DEGRADED, RestartReason.HEAT})
HOUR_S = 3600.0


def backoff_delay(consecutive_failures: int, initial_s: float, max_s: float) -> float:
    """initial, 2×initial, 4×initial, … capped at max (consecutive_failures starts at 1)."""
    if consecutive_failures <= 0:
        return 0.0
    return float(min(max_s, initial_s * (2 ** min(consecutive_failures - 1, 32))))


def restart_allowed(restart_times: list[float], now: float, max_per_hour: int) -> bool:
    """Whether one more restart fits the budget of the last hour."""
    recent = [t for t in restart_times if now - t < HOUR_S]
    return len(recent) < max_per_hour


@dataclass
class RestartBook:
    """One engine's restarts: what /admin/status counts, and both budgets' history.

    Written by the engine's runner only.
    """

    restarts: int = 0
    by_reason: collections.Counter[str] = field(default_factory=collections.Counter)
    last_reason: str | None = None
    unplanned_times: list[float] = field(default_factory=list)  # the crash budget's
    planned_times: list[float] = field(default_factory=list)  # heat and degradation
    planned_refused: bool = False  # the planned budget said no (logged once)
    consecutive_failures: int = 0  # unplanned, in a row: the backoff's exponent

    def book(self, reason: RestartReason, now: float, per_hour: int) -> bool:
        """Count a restart; False, counting nothing, when it is unplanned and the last
        hour already had ``per_hour`` of those (the engine is then FAILED)."""
        if reason in PLANNED_REASONS:
            # Budgeted apart (checked when asked for, may_plan): a hot afternoon must not
            # spend the budget that stops a crash loop. An admin's spends neither.
            if reason is not RestartReason.ADMIN:
                self.planned_times.append(now)
        elif not restart_allowed(self.unplanned_times, now, per_hour):
            return False
        else:
            self.unplanned_times.append(now)
        self.restarts += 1
        self.by_reason[reason.value] += 1
        self.last_reason = reason.value
        return True

    def next_backoff(self, initial_s: float, max_s: float) -> float:
        """One more unplanned restart in a row: how long to wait before it."""
        self.consecutive_failures += 1
        return backoff_delay(self.consecutive_failures, initial_s, max_s)

    def may_plan(self, now: float, per_hour: int) -> tuple[bool, bool]:
        """(whether a heat or degradation restart fits the planned budget now, whether
        this is the first refusal since the last yes: the caller logs only that one)."""
        if restart_allowed(self.planned_times, now, per_hour):
            self.planned_refused = False
            return True, False
        first = not self.planned_refused
        self.planned_refused = True
        return False, first

    def fresh_budget(self) -> None:
        """An admin's restart of a FAILED engine: a new crash budget, and no backoff."""
        self.unplanned_times.clear()
        self.consecutive_failures = 0
