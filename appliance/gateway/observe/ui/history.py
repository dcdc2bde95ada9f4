"""The status page's memory: one sample every ``interval_s`` for an hour, and the last
events, in a bounded ring in the gateway's memory.

A page opened now draws the last hour from here, so the history lives in the daemon,
not in a tab. Each entry gets a sequence number, one counter for samples and events, so
a page that polls asks only for what is newer than the last number it has (``after``):
a poll costs what changed since, not the hour. :func:`sample_of` is pure (two moments'
figures in, one compact sample out); the task that calls it is :mod:`.sampler`.

A sample, kept small because an hour of them goes to every page that opens::

    {"t": 1738324800.0,                       # epoch seconds
     "gpus": [[0, 64.0, 310.0, 1980, 0]],      # index, °C, W, SM MHz, throttle level
     "queue": [3, 1],                          # waiting: interactive, batch
     "rejected": 0,                            # admission rejections in the interval
     "ttft_s": 0.081,                          # mean time to first token in the interval
     "tokens_per_s": 412.5}                    # completion tokens served per second
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, TypeVar

from appliance.control import ApplianceStatus
from appliance.gateway.observe.ui.events import Event

SAMPLE_INTERVAL_S = 2.0
HOUR_S = 3600.0
T = TypeVar("T")
MAX_EVENTS = 200  # the time line's length: an hour of a busy box's restarts and heat steps


@dataclass(frozen=True, slots=True)
class Figures:
    """The gateway's own running totals at one moment (each only grows), so that two
    moments give a rate over the interval between them."""

    queued_interactive: int
    queued_batch: int
    rejections: float
    ttft_sum_s: float
    ttft_count: float
    completion_tokens: int


def _rate(new: float, old: float, dt: float) -> float:
    return max(new - old, 0.0) / dt if dt > 0 else 0.0


def _opt(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def sample_of(
    t: float,
    status: ApplianceStatus,
    now: Figures,
    before: Figures | None,
    dt: float,
) -> dict[str, Any]:
    """One sample at ``t``: the GPUs as ``status`` shows them, and the gateway's rates
    over the ``dt`` seconds since ``before`` (None: the first sample, no rate yet)."""
    gpus = [
        [
            g.index,
            _opt(g.reading.temperature_c, 1),
            _opt(g.reading.power_w, 1),
            g.reading.sm_clock_mhz,
            g.throttle_level,
        ]
        for g in status.gpus
    ]
    ttft: float | None = None
    rejected, tokens = 0.0, 0.0
    if before is not None:
        answered = now.ttft_count - before.ttft_count
        if answered > 0:
            ttft = round((now.ttft_sum_s - before.ttft_sum_s) / answered, 4)
        rejected = max(now.rejections - before.rejections, 0.0)
        tokens = _rate(now.completion_tokens, before.completion_tokens, dt)
    return {
        "t": round(t, 3),
        "gpus": gpus,
        "queue": [now.queued_interactive, now.queued_batch],
        "rejected": int(rejected),
        "ttft_s": ttft,
        "tokens_per_s": round(tokens, 1),
    }


class History:
    """The ring: samples for an hour at the sampling interval, and the last events."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S, span_s: float = HOUR_S) -> None:
        self.interval_s = interval_s
        self.samples: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=max(1, int(span_s / interval_s))
        )
        self.events: collections.deque[tuple[int, Event]] = collections.deque(maxlen=MAX_EVENTS)
        self.seq = 0

    def add_sample(self, sample: dict[str, Any]) -> None:
        self.seq += 1
        self.samples.append((self.seq, sample))

    def add_events(self, events: list[Event]) -> None:
        for event in events:
            self.seq += 1
            self.events.append((self.seq, event))

    def after(self, seq: int) -> tuple[list[dict[str, Any]], list[dict[str, object]]]:
        """Samples and events newer than ``seq`` (0: all that are kept), oldest first."""
        return _newer(self.samples, seq), [e.as_json() for e in _newer(self.events, seq)]


def _newer(ring: collections.deque[tuple[int, T]], seq: int) -> list[T]:
    """The entries after ``seq``: walked from the newest end, so a poll that is up to
    date touches one or two entries, not the hour."""
    out: list[T] = []
    for n, item in reversed(ring):
        if n <= seq:
            break
        out.append(item)
    out.reverse()
    return out
