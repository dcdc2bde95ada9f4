"""What the chaos soak counts and reports: every request's end by class (:class:`Tally`),
the per-second timeline for the chart, the latencies after each event, the faults'
table and the exit causes the daemon's journals named."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import StatePoller, p99_per_bin, per_bin
from bench.soak_checks import KILLED, connection_error_class, exit_causes, window_counts
from bench.soak_faults import FaultRecord

CLASSES = ("ok", "refused", "disconnected", KILLED, "lost")


@dataclass
class Tally:
    classes: collections.Counter[str] = field(default_factory=collections.Counter)
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    lost_examples: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    # (second of run, latency) of ok requests, to show what each chaos event did
    timeline: list[tuple[float, float]] = field(default_factory=list)
    t0: float = 0.0  # when the load started (monotonic)
    # second of run at which each request ended, by class: the timeline's counts
    ended: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in CLASSES})
    # (killed at, serving again at) of each supervisor SIGKILL, seconds of the run
    down: list[tuple[float, float | None]] = field(default_factory=list)

    def add(self, cls: str, reason: str = "", example: str = "") -> None:
        self.classes[cls] += 1
        self.ended[cls].append(time.monotonic() - self.t0)
        if reason:
            self.reasons[f"{cls}: {reason}"] += 1
        if cls == "lost" and len(self.lost_examples) < 10:
            self.lost_examples.append(example)

    def cut(self, started: float, reason: str, example: str) -> None:
        """A connection that broke or was refused: on the killed supervisor when that
        was dead meanwhile, else lost."""
        now = time.monotonic() - self.t0
        self.add(connection_error_class(started - self.t0, now, self.down), reason, example)

    def note(self, what: str) -> None:
        self.events.append((time.monotonic() - self.t0, what))
        print(f"[soak] {time.monotonic() - self.t0:6.1f} s  {what}", flush=True)


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def fault_table(records: list[FaultRecord], tally: Tally) -> list[dict[str, Any]]:
    """Each fault with what the requests that ended in its window did."""
    out = []
    for rec in records:
        until = rec.until_s if rec.until_s is not None else rec.at_s
        rec.requests = window_counts(tally.ended, rec.at_s, until)
        out.append(dataclasses.asdict(rec))
    return out


def exit_cause_counts(journals: list[Path]) -> dict[str, int]:
    counts: collections.Counter[str] = collections.Counter()
    for path in journals:
        with contextlib.suppress(OSError):
            counts += exit_causes(path.read_text(errors="replace"))
    return dict(counts)


def timeline(tally: Tally, poller: StatePoller, duration_s: float) -> dict[str, Any]:
    """Per second: requests by class, p99 of the OK ones; engine states; chaos events."""
    # The flood and the last requests may end a little after the deadline.
    end = max([duration_s, *(t for ts in tally.ended.values() for t in ts)])
    return {
        "bin_s": 1.0,
        "duration_s": round(end, 3),
        "counts": {c: per_bin(tally.ended[c], end) for c in CLASSES},
        "p99_ms": p99_per_bin(tally.timeline, end),
        "states": poller.samples(),
        "markers": [
            {"at_s": round(at, 1), "label": what.split(" (pid")[0]} for at, what in tally.events
        ],
    }


def after_events(tally: Tally, window_s: float = 15.0) -> list[dict[str, Any]]:
    """p50/p99 of ok latencies in the window after each chaos event, vs the whole run."""
    out = []
    for at, what in tally.events:
        lat = [lat for t, lat in tally.timeline if at <= t < at + window_s]
        out.append(
            {
                "event": what,
                "at_s": round(at, 1),
                "ok": len(lat),
                "p50_s": round(percentile(lat, 0.5), 3),
                "p99_s": round(percentile(lat, 0.99), 3),
            }
        )
    return out
