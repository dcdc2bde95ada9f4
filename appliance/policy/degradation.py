"""The degradation detector: is an engine that still answers quietly getting worse?

Pure functions over a window of `EngineSample`s (one per scrape of an engine's
``/metrics`` plus the RSS of its process tree, oldest first) and a `Baseline` the
engine earned after warm-up. No I/O and no clock: ``now`` is passed in.

Reasons a `Verdict` can carry, checked in this order (the first that holds wins, since
one restart cures them all and the most certain diagnosis is the most useful one):

``hang``
    Work is present (``running + waiting >= 1``) in every sample of the last
    ``hang_s`` seconds and ``vllm:generation_tokens_total`` did not move
    (vllm#39863: a hung engine still answers ``/health``).
``kv_leak``
    ``vllm:kv_cache_usage_perc >= leak_kv_usage`` while ``running <= leak_max_running``
    in every sample of the last ``leak_hold_s`` seconds: blocks held by nobody.
``preemption_storm``
    ``vllm:num_preemptions_total`` rises faster than ``max_preemptions_per_min`` over
    the window (vllm#16985, #25538: thrash under KV pressure).
``rss_growth``
    Every RSS reading in the window is above ``rss_growth_ratio`` times the baseline.
``slowdown``
    Generated tokens per second per running request over the busy part of the window
    fell below ``slowdown_ratio`` times the baseline (vllm#44175).

Rules that keep noise from restarting engines:

- **Missing metrics never trigger.** A ``None`` field breaks a "held for N seconds" run
  and is skipped by the rate checks; a check without enough data says "healthy".
- **Conditions must hold over time**, never on one sample: run checks need
  ``min_samples`` samples spanning their hold time; rate checks need ``min_samples``
  samples covering ``min_coverage`` of the window.
- **Counters can reset** (the engine restarted): a decrease is a reset, and the new
  value counts as the increase since it (Prometheus' ``increase()`` rule), never as a
  negative rate.
- **Batching lowers per-request speed.** The slowdown check is skipped while the window
  runs more than ``slowdown_load_factor`` times the baseline's concurrent requests: a
  batch of 60 measured against a baseline learned at 5 would be a false alarm, and
  trouble under heavy load shows up as preemptions or a hang instead.

Baseline learning (`learn_baseline`): nothing before ``baseline_warmup_s`` after the
engine started, and no sample from the warm-up itself (first requests compile and
warm caches). Throughput is learned only from windows where requests were running,
folded in with an exponential moving average of time constant ``baseline_tau_s``
(time-based, so calling it more often does not make it faster), and never from a
window that is itself a slowdown (a degrading engine must not drag its own baseline
down). RSS is a low-water mark: the lowest RSS seen after warm-up, so slow growth is
never absorbed into the baseline. The caller starts from `EMPTY_BASELINE` every time
an engine (re)starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Literal

Reason = Literal["preemption_storm", "kv_leak", "slowdown", "rss_growth", "hang"]
REASONS: tuple[Reason, ...] = ("hang", "kv_leak", "preemption_storm", "rss_growth", "slowdown")


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One scrape of an engine's /metrics plus process stats; ``None`` = not available."""

    t: float  # monotonic seconds
    preemptions_total: float | None
    generation_tokens_total: float | None
    running: float | None
    waiting: float | None
    kv_cache_usage: float | None  # 0..1
    rss_bytes: int | None  # whole engine process tree


@dataclass(frozen=True, slots=True)
class DegradationPolicy:
    """Thresholds of the detector; see the module docstring for each reason."""

    window_s: float = 60.0
    max_preemptions_per_min: float = 30.0
    leak_kv_usage: float = 0.9
    leak_max_running: int = 1
    leak_hold_s: float = 30.0
    slowdown_ratio: float = 0.35  # tokens/s per running request below this x baseline
    slowdown_load_factor: float = 2.0  # skip slowdown above this x baseline concurrency
    baseline_warmup_s: float = 60.0
    baseline_tau_s: float = 600.0  # EWMA time constant of the throughput baseline
    rss_growth_ratio: float = 1.5  # vs baseline RSS
    hang_s: float = 30.0  # no token progress while work is present
    min_samples: int = 3
    min_coverage: float = 0.5  # share of the window rate checks need data for

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError("window_s must be > 0")
        for name in ("hang_s", "leak_hold_s"):
            if not 0 <= getattr(self, name) <= self.window_s:
                raise ValueError(f"{name} must be between 0 and window_s ({self.window_s:g})")
        if self.min_samples < 2:
            raise ValueError("min_samples must be >= 2 (a rate needs two samples)")
        if not self.baseline_tau_s > 0:
            raise ValueError("baseline_tau_s must be > 0")
        if not 0 < self.min_coverage <= 1:
            raise ValueError("min_coverage must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Baseline:
    """What this engine looked like when healthy, learned after warm-up."""

    tokens_per_s_per_request: float | None
    rss_bytes: int | None
    samples: int  # windows folded into the throughput baseline
    running: float | None = None  # mean concurrent requests of those windows
    updated_at: float | None = None  # when the throughput baseline last moved


EMPTY_BASELINE = Baseline(tokens_per_s_per_request=None, rss_bytes=None, samples=0)


@dataclass(frozen=True, slots=True)
class Verdict:
    degraded: bool
    reason: Reason | None
    detail: str


HEALTHY = Verdict(degraded=False, reason=None, detail="")


@dataclass(frozen=True, slots=True)
class Throughput:
    """Generation speed over the busy part of a window."""

    per_request: float  # generated tokens per second per running request
    mean_running: float
    span_s: float  # seconds of the window with requests running on both ends


def _increase(before: float, after: float) -> float:
    """Counter increase between two readings; a decrease is a reset to zero in between."""
    return after - before if after >= before else after


def _window(samples: Sequence[EngineSample], start: float, now: float) -> list[EngineSample]:
    return [s for s in samples if start <= s.t <= now]


def _enough(pairs: int, span_s: float, policy: DegradationPolicy) -> bool:
    return pairs + 1 >= policy.min_samples and span_s >= policy.min_coverage * policy.window_s


def preemption_rate(window: Sequence[EngineSample], policy: DegradationPolicy) -> float | None:
    """Preemptions per minute over ``window``, or None without enough data."""
    total = span = 0.0
    pairs = 0
    for a, b in pairwise(window):
        dt = b.t - a.t
        if a.preemptions_total is None or b.preemptions_total is None or dt <= 0:
            continue
        total += _increase(a.preemptions_total, b.preemptions_total)
        span += dt
        pairs += 1
    if not _enough(pairs, span, policy):
        return None
    return total / span * 60.0


def throughput(window: Sequence[EngineSample], policy: DegradationPolicy) -> Throughput | None:
    """Tokens/s per running request over pairs of samples both with requests running."""
    tokens = request_s = span = 0.0
    pairs = 0
    for a, b in pairwise(window):
        dt = b.t - a.t
        if (
            a.generation_tokens_total is None
            or b.generation_tokens_total is None
            or a.running is None
            or b.running is None
            or a.running < 1
            or b.running < 1
            or dt <= 0
        ):
            continue
        tokens += _increase(a.generation_tokens_total, b.generation_tokens_total)
        request_s += dt * (a.running + b.running) / 2.0
        span += dt
        pairs += 1
    if not _enough(pairs, span, policy):
        return None
    return Throughput(per_request=tokens / request_s, mean_running=request_s / span, span_s=span)


def _held(
    window: Sequence[EngineSample], holds: Callable[[EngineSample], bool]
) -> tuple[int, float]:
    """(samples, seconds) of the run of newest samples for which ``holds`` is true."""
    count = 0
    first = last = 0.0
    for s in reversed(window):
        if not holds(s):
            break
        if count == 0:
            last = s.t
        first = s.t
        count += 1
    return count, last - first


def _hang(window: Sequence[EngineSample], policy: DegradationPolicy) -> Verdict | None:
    if not window:
        return None
    newest = window[-1].generation_tokens_total

    def stuck(s: EngineSample) -> bool:
        return (
            s.running is not None
            and s.generation_tokens_total is not None
            and s.generation_tokens_total == newest
            and s.running + (s.waiting or 0.0) >= 1
        )

    count, held_s = _held(window, stuck)
    if count >= policy.min_samples and held_s >= policy.hang_s:
        return Verdict(
            True,
            "hang",
            f"no generated token for {held_s:.0f}s while requests were running or waiting "
            f"({count} samples; limit {policy.hang_s:g}s)",
        )
    return None


def _kv_leak(window: Sequence[EngineSample], policy: DegradationPolicy) -> Verdict | None:
    def leaking(s: EngineSample) -> bool:
        return (
            s.kv_cache_usage is not None
            and s.running is not None
            and s.kv_cache_usage >= policy.leak_kv_usage
            and s.running <= policy.leak_max_running
        )

    count, held_s = _held(window, leaking)
    if count >= policy.min_samples and held_s >= policy.leak_hold_s:
        return Verdict(
            True,
            "kv_leak",
            f"KV cache usage >= {policy.leak_kv_usage:.0%} with <= {policy.leak_max_running} "
            f"running for {held_s:.0f}s ({count} samples)",
        )
    return None


def _preemption_storm(window: Sequence[EngineSample], policy: DegradationPolicy) -> Verdict | None:
    rate = preemption_rate(window, policy)
    if rate is not None and rate > policy.max_preemptions_per_min:
        return Verdict(
            True,
            "preemption_storm",
            f"{rate:.1f} preemptions/min over the last {policy.window_s:g}s "
            f"(limit {policy.max_preemptions_per_min:g})",
        )
    return None


def _rss_growth(
    window: Sequence[EngineSample], baseline: Baseline, policy: DegradationPolicy
) -> Verdict | None:
    if not baseline.rss_bytes:
        return None
    known = [s for s in window if s.rss_bytes is not None]
    if not _enough(len(known) - 1, known[-1].t - known[0].t if known else 0.0, policy):
        return None
    lowest = min(s.rss_bytes for s in known if s.rss_bytes is not None)
    if lowest > policy.rss_growth_ratio * baseline.rss_bytes:
        return Verdict(
            True,
            "rss_growth",
            f"RSS >= {lowest / 2**20:.0f} MiB throughout the last {policy.window_s:g}s, "
            f"{lowest / baseline.rss_bytes:.2f}x the baseline "
            f"{baseline.rss_bytes / 2**20:.0f} MiB (limit {policy.rss_growth_ratio:g}x)",
        )
    return None


def _slowdown(
    window: Sequence[EngineSample], baseline: Baseline, policy: DegradationPolicy
) -> Verdict | None:
    base = baseline.tokens_per_s_per_request
    if not base:
        return None
    measured = throughput(window, policy)
    if measured is None:
        return None
    if baseline.running is not None and measured.mean_running > policy.slowdown_load_factor * max(
        baseline.running, 1.0
    ):
        return None
    if measured.per_request < policy.slowdown_ratio * base:
        return Verdict(
            True,
            "slowdown",
            f"{measured.per_request:.2f} tokens/s per running request "
            f"({measured.mean_running:.1f} running) vs baseline {base:.2f} "
            f"(limit {policy.slowdown_ratio:g}x)",
        )
    return None


def assess(
    samples: Sequence[EngineSample], baseline: Baseline, policy: DegradationPolicy, now: float
) -> Verdict:
    """The engine's verdict from the samples of the last ``window_s`` seconds (oldest first)."""
    window = _window(samples, now - policy.window_s, now)
    return (
        _hang(window, policy)
        or _kv_leak(window, policy)
        or _preemption_storm(window, policy)
        or _rss_growth(window, baseline, policy)
        or _slowdown(window, baseline, policy)
        or HEALTHY
    )


def learn_baseline(
    samples: Sequence[EngineSample],
    previous: Baseline,
    policy: DegradationPolicy,
    started_at: float,
    now: float,
) -> Baseline:
    """``previous`` updated with the current window (see the module docstring).

    Returns ``previous`` itself when there is nothing to learn yet.
    """
    warm_from = started_at + policy.baseline_warmup_s
    if now < warm_from:
        return previous
    window = _window(samples, max(warm_from, now - policy.window_s), now)
    learned = _learn_throughput(window, previous, policy, now)
    rss = _lowest_rss(window, previous.rss_bytes, policy)
    if learned is previous and rss == previous.rss_bytes:
        return previous
    return replace(learned, rss_bytes=rss)


def _learn_throughput(
    window: Sequence[EngineSample], previous: Baseline, policy: DegradationPolicy, now: float
) -> Baseline:
    """The throughput baseline: the first healthy window sets it, later ones not slowed
    down move it by an exponential average; ``previous`` itself when nothing is learned."""
    measured = throughput(window, policy)
    if measured is None or measured.per_request <= 0:
        return previous
    tokens, running = previous.tokens_per_s_per_request, previous.running
    if tokens is None or running is None:
        tokens, running = measured.per_request, measured.mean_running
    elif measured.per_request >= policy.slowdown_ratio * tokens:
        updated = previous.updated_at
        elapsed = now - updated if updated is not None else policy.window_s
        alpha = 1.0 - math.exp(-max(elapsed, 0.0) / policy.baseline_tau_s)
        tokens += alpha * (measured.per_request - tokens)
        running += alpha * (measured.mean_running - running)
    else:
        return previous  # a slow window teaches nothing: it may be the degradation itself
    return replace(
        previous,
        tokens_per_s_per_request=tokens,
        running=running,
        samples=previous.samples + 1,
        updated_at=now,
    )


def _lowest_rss(
    window: Sequence[EngineSample], previous: int | None, policy: DegradationPolicy
) -> int | None:
    """The lowest RSS seen in windows with enough samples: the engine's healthy size."""
    known = [s.rss_bytes for s in window if s.rss_bytes is not None]
    if len(known) < policy.min_samples:
        return previous
    lowest = min(known)
    return lowest if previous is None else min(previous, lowest)
