"""Speculative decoding figures over a recent window: does speculation pay on an engine?

vLLM counts drafts (one per sequence per step that speculated), draft tokens (proposed)
and accepted tokens; all three only grow while one engine process lives. Over a window:

- **acceptance rate** = accepted / draft tokens: the share of proposals that were right;
- **mean accepted length** = 1 + accepted / drafts: tokens a step yields per sequence
  (vLLM's own "mean acceptance length": the 1 is the token the target model makes itself).

A restart starts the counters again at zero; a sample lower than an earlier one begins a
new run and the window counts from there. No speculation in the window: None, not 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecSample:
    t: float  # monotonic seconds
    drafts: float
    draft_tokens: float
    accepted_tokens: float


@dataclass(frozen=True, slots=True)
class SpecFigures:
    acceptance_rate: float | None  # 0..1
    mean_accepted_length: float | None  # >= 1


NO_FIGURES = SpecFigures(None, None)


def spec_figures(samples: Sequence[SpecSample], now: float, window_s: float) -> SpecFigures:
    """The figures over the samples of the last ``window_s`` seconds (oldest first)."""
    recent = [s for s in samples if s.t >= now - window_s]
    # Counters restart with the engine: measure only the run the newest sample is in.
    start = 0
    for i in range(1, len(recent)):
        if recent[i].draft_tokens < recent[i - 1].draft_tokens:
            start = i
    run = recent[start:]
    if len(run) < 2:
        return NO_FIGURES
    first, last = run[0], run[-1]
    drafts = last.drafts - first.drafts
    proposed = last.draft_tokens - first.draft_tokens
    accepted = last.accepted_tokens - first.accepted_tokens
    if drafts <= 0 or proposed <= 0:
        return NO_FIGURES
    return SpecFigures(accepted / proposed, 1.0 + accepted / drafts)
