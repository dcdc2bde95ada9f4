"""Degradation sampling: one engine's window of samples and the baseline it earned.

The rules are pure (:mod:`appliance.policy.degradation`); this keeps what they judge:
a sample per healthy check (vLLM's figures plus the RSS of the engine's process tree),
trimmed to ``degradation.window_s``, and the baseline learned since the engine became
READY. A restart starts both afresh.
"""

from __future__ import annotations

import collections
import functools

from appliance.config import DegradationConfig
from appliance.health import Observation
from appliance.policy.degradation import (
    EMPTY_BASELINE,
    Baseline,
    DegradationPolicy,
    EngineSample,
    Verdict,
    assess,
    learn_baseline,
)


@functools.lru_cache(maxsize=4)
def policy_of(config: DegradationConfig) -> DegradationPolicy:
    """``[degradation]`` as the detector's policy (built once per config, not per check)."""
    return DegradationPolicy(
        window_s=config.window_s,
        max_preemptions_per_min=config.max_preemptions_per_min,
        leak_kv_usage=config.leak_kv_usage,
        leak_hold_s=config.leak_hold_s,
        slowdown_ratio=config.slowdown_ratio,
        baseline_warmup_s=config.baseline_warmup_s,
        rss_growth_ratio=config.rss_growth_ratio,
        hang_s=config.hang_s,
    )


class DegradationWatch:
    """The samples and baseline of one engine; owned by its runner."""

    def __init__(self) -> None:
        self.samples: collections.deque[EngineSample] = collections.deque()
        self.baseline: Baseline = EMPTY_BASELINE

    def restart(self) -> None:
        """A new process: nothing of the old one's figures carries over."""
        self.samples.clear()
        self.baseline = EMPTY_BASELINE

    def clear(self) -> None:
        """A restart was asked for: its verdict must not be reached again meanwhile."""
        self.samples.clear()

    def judge(
        self,
        obs: Observation,
        rss_bytes: int | None,
        now: float,
        ready_since: float,
        config: DegradationConfig,
    ) -> Verdict:
        """Add this check's sample, learn, and say whether the engine is degraded."""
        self.samples.append(
            EngineSample(
                t=now,
                preemptions_total=obs.preemptions_total,
                generation_tokens_total=obs.generation_tokens,
                running=obs.running,
                waiting=obs.waiting,
                kv_cache_usage=obs.kv_cache_usage,
                rss_bytes=rss_bytes,
            )
        )
        policy = policy_of(config)
        while self.samples and self.samples[0].t < now - policy.window_s:
            self.samples.popleft()
        self.baseline = learn_baseline(self.samples, self.baseline, policy, ready_since, now)
        return assess(self.samples, self.baseline, policy, now)
