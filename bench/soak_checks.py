"""The chaos soak's checks, pure: how a request's end counts, whether the state files are
whole, whether the usage counted on a full disk was kept, the exit causes the journal
named. No I/O: tested by tables of cases (tests/unit/test_soak_checks.py)."""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence

KILLED = "on_killed_supervisor"
# "engine0: exited with signal SIGKILL while serving (cause: killed by ...)"; the words
# may hold parentheses, so the cause runs to the line's last ")" before the output tail.
_CAUSE = re.compile(r": exited with .+? \(cause: (.*)\)(?:; last output:)?$")


def connection_error_class(
    started_s: float, ended_s: float, down: Sequence[tuple[float, float | None]]
) -> str:
    """How a request that ended with a broken or refused connection counts: on the
    killed supervisor when its life met a window in which the supervisor was dead
    (``down``: (killed at, serving again at or None), seconds of the run); else lost."""
    for start, end in down:
        if ended_s >= start and (end is None or started_s <= end):
            return KILLED
    return "lost"


def state_file_problems(
    usage: bytes | None, audit: bytes | None, keys: bytes | None, keys_before: bytes
) -> list[str]:
    """What is damaged in the state files (None: the file is not there)."""
    problems = []
    if usage is None:
        problems.append("usage.json is missing")
    else:
        try:
            doc = json.loads(usage)
            if not isinstance(doc, dict) or not isinstance(doc.get("keys"), dict):
                problems.append("usage.json has no keys table")
        except ValueError:
            problems.append(f"usage.json is not JSON ({len(usage)} bytes)")
    if audit is not None:
        if audit and not audit.endswith(b"\n"):
            problems.append("audit.log ends in a half line")
        for n, line in enumerate(audit.splitlines(), 1):
            try:
                json.loads(line)
            except ValueError:
                problems.append(f"audit.log line {n} is not JSON")
    if keys != keys_before:
        size = "missing" if keys is None else f"{len(keys)} bytes"
        problems.append(f"keys.json changed ({size}, was {len(keys_before)} bytes)")
    return problems


def usage_kept(
    file_before: int, file_after: int, live_at_fill: int, live_at_free: int
) -> str | None:
    """None when every token counted while the disk was full is in usage.json after;
    else what is missing. ``file_*``: usage.json's token total when the disk was full and
    once written again; ``live_*``: the daemon's counters when it filled and was freed."""
    counted = live_at_free - live_at_fill
    written = file_after - file_before
    if written < counted:
        return (
            f"usage.json gained {written} tokens once written again; "
            f"{counted} were counted while the disk was full"
        )
    return None


def usage_total(raw: bytes | None) -> int:
    """Prompt + completion tokens over every key in a usage.json (0 when unreadable)."""
    try:
        keys = json.loads(raw or b"").get("keys", {})
        return sum(int(k["prompt_tokens"]) + int(k["completion_tokens"]) for k in keys.values())
    except (ValueError, AttributeError, KeyError, TypeError):
        return 0


def metric_sum(text: str, name: str) -> int:
    """The sum of a Prometheus counter's samples, every label set."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[-1])
    return int(total)


def exit_causes(journal: str) -> collections.Counter[str]:
    """The causes the daemon named for engine exits it did not ask for, counted."""
    found: collections.Counter[str] = collections.Counter()
    for line in journal.splitlines():
        if m := _CAUSE.search(line):
            found[m.group(1)] += 1
    return found


def window_counts(ended: dict[str, list[float]], start: float, end: float) -> dict[str, int]:
    """Requests by class that ended within [start, end] (seconds of the run)."""
    return {cls: sum(1 for t in ts if start <= t <= end) for cls, ts in ended.items()}
