"""The planned restart an engine has been asked for, and why (owned by its runner).

Three things ask for a planned restart (drained first, one engine at a time): an admin,
the degradation detector, and the heat loop. Heat and degradation restarts must also
fit ``restart.max_planned_restarts_per_hour``; a refusal is logged once, and the engine
keeps serving as it is. A heat restart halves ``--max-num-batched-tokens`` (smaller
batches, less power); once the GPU has been cool long enough, another restores it. An
engine whose ``command`` has no such flag gets none (said once in the journal).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from appliance.config import Config
from appliance.config.checks.advice import BATCHED_TOKENS_FLAG
from appliance.engine import EngineSpec, RestartReason
from appliance.policy.degradation import Verdict as DegradationVerdict
from appliance.supervisor.budget import RestartBook
from appliance.supervisor.commands import HeatRestart

log = logging.getLogger("appliance.supervisor")

HEAT_MIN_BATCHED_TOKENS = 16


class PlannedRestart:
    """What restart is asked for (``requested``) and the batch size the next spawn gets."""

    def __init__(self, spec: EngineSpec, book: RestartBook, config: Callable[[], Config]) -> None:
        self._spec = spec
        self._book = book
        self._config = config  # the config in force (a reload replaces it)
        self.requested: RestartReason | None = None
        self.wait_logged = False  # "restart waits" said for this request
        self.batched_tokens: int | None = None  # heat-reduced batch size, or None
        self.no_flag_logged = False  # "no heat restart: no flag to halve" said

    def started(self) -> None:
        """A new spawn: whatever was asked for is being done."""
        self.requested = None
        self.wait_logged = False

    def _may_plan(self, reason: RestartReason) -> bool:
        """Whether a heat or degradation restart fits restart.max_planned_restarts_per_hour."""
        limit = self._config().restart.max_planned_restarts_per_hour
        allowed, first_refusal = self._book.may_plan(time.monotonic(), limit)
        if first_refusal:
            log.warning(
                "%s: %s restart not done: %d planned restarts within the last hour "
                "(restart.max_planned_restarts_per_hour); it keeps serving as it is",
                self._spec.name,
                reason.value,
                limit,
            )
        return allowed

    def heat(self, word: HeatRestart) -> bool:
        """The heat loop's word about a READY engine: True when it asked for a restart."""
        if self.requested is not None:
            return False
        full = self._config().engine_of(self._spec.model).max_num_batched_tokens
        if word.reduce and self.batched_tokens is None:
            if BATCHED_TOKENS_FLAG not in self._spec.argv:
                # A `command` override: nothing to halve. Said once per engine (the
                # start's config warning says it too; this covers a reload that turned
                # heat restarts on), never once per heat tick.
                if not self.no_flag_logged:
                    self.no_flag_logged = True
                    log.warning(
                        "%s: GPU %d at the hard limit for %.0f s; no heat restart: its "
                        "command has no %s to halve (thermal.heat_restart_after_s)",
                        self._spec.name,
                        word.gpu,
                        word.held_s,
                        BATCHED_TOKENS_FLAG,
                    )
                return False
            if not self._may_plan(RestartReason.HEAT):
                return False
            self.batched_tokens = max(HEAT_MIN_BATCHED_TOKENS, full // 2)
            log.warning(
                "%s: GPU %d at the hard limit for %.0f s; restarting it with "
                "--max-num-batched-tokens %d",
                self._spec.name,
                word.gpu,
                word.held_s,
                self.batched_tokens,
            )
        elif not word.reduce and self.batched_tokens is not None:
            if not self._may_plan(RestartReason.HEAT):
                return False
            log.info(
                "%s: GPU %d cool for %.0f s; restoring --max-num-batched-tokens %d",
                self._spec.name,
                word.gpu,
                word.held_s,
                full,
            )
            self.batched_tokens = None
        else:
            return False
        self.requested = RestartReason.HEAT
        return True

    def degraded(self, verdict: DegradationVerdict, failures: int) -> bool:
        """The detector's verdict (``failures``: failed health checks in a row): True when
        it asked for a restart."""
        if not verdict.degraded or self.requested is not None:
            return False
        if not self._config().restart.degradation_restart:
            if failures == 0:
                log.warning(
                    "%s: degraded (%s: %s); restart.degradation_restart = false, so it keeps "
                    "serving",
                    self._spec.name,
                    verdict.reason,
                    verdict.detail,
                )
            return False
        if not self._may_plan(RestartReason.DEGRADED):
            return False
        log.warning(
            "%s: degraded (%s: %s); draining it for a restart",
            self._spec.name,
            verdict.reason,
            verdict.detail,
        )
        self.requested = RestartReason.DEGRADED
        return True
