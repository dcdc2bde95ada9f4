"""The status page's time line: events found by comparing two status snapshots, and
events read from audit lines. Pure functions (no I/O, no clock): table-tested.

The supervisor does not publish a stream of events; it publishes snapshots
(:class:`appliance.control.ApplianceStatus`). What changed between two of them is the
event: an engine's state (a drain, a restart's STOPPING/STARTING, a failure), its restart
count (with the supervisor's reason), a GPU's throttle level (a heat step up or down).
A change quicker than the sampler's interval can be missed; the audit trail's own lines
(drains, resumes, restarts asked for, key changes, reloads) are read as they are written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from appliance.control import ApplianceStatus, EngineStatus, GpuStatus

MAX_TEXT = 200  # an event's words are cut here: a time line entry stays one line


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the time line: when (epoch seconds), what kind, and in words."""

    t: float
    kind: str  # "state" | "restart" | "heat" | "audit"
    text: str

    def as_json(self) -> dict[str, object]:
        return {"t": round(self.t, 3), "kind": self.kind, "text": self.text}


def _engine_events(t: float, old: EngineStatus, new: EngineStatus) -> list[Event]:
    out = []
    if new.restarts > old.restarts:
        why = new.last_restart_reason or "no reason given"
        out.append(Event(t, "restart", f"engine {new.id} restarted ({why})"))
    if new.state is not old.state:
        text = f"engine {new.id} {new.state.value} (was {old.state.value})"
        if new.state.value in ("EXITED", "FAILED") and new.last_exit:
            text += f": {new.last_exit}"
        out.append(Event(t, "state", text[:MAX_TEXT]))
    return out


def _gpu_event(t: float, old: GpuStatus, new: GpuStatus) -> Event | None:
    if new.throttle_level == old.throttle_level:
        return None
    way = "up" if new.throttle_level > old.throttle_level else "down"
    temp = new.reading.temperature_c
    at = f" at {temp:.0f} °C" if temp is not None else ""
    return Event(
        t,
        "heat",
        f"GPU {new.index} throttle {way}: level {old.throttle_level} → {new.throttle_level}{at}",
    )


def diff_events(t: float, old: ApplianceStatus | None, new: ApplianceStatus) -> list[Event]:
    """What changed from ``old`` to ``new`` (None: nothing to compare yet), seen at ``t``.
    Engines and GPUs are matched by id and index; one that appears or goes is no event
    (a reload that changes the engine count says so in the audit trail)."""
    if old is None:
        return []
    out: list[Event] = []
    before = {e.id: e for e in old.engines}
    for e in new.engines:
        if (prev := before.get(e.id)) is not None:
            out += _engine_events(t, prev, e)
    gpus = {g.index: g for g in old.gpus}
    for g in new.gpus:
        if (prev_g := gpus.get(g.index)) is not None and (ev := _gpu_event(t, prev_g, g)):
            out.append(ev)
    return out


def _when(stamp: object) -> float | None:
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def audit_event(line: str) -> Event | None:
    """One audit line (:func:`appliance.audit.audit_line`) as an event; None for a line
    that is not one (a line cut by a crash, a hand edit). Words come from the line's own
    fields; a key's name is shown as it is (the page renders every text as text)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict) or (t := _when(entry.get("time"))) is None:
        return None
    action, target = str(entry.get("action", "?")), str(entry.get("target", "?"))
    text = f"{action} {target} by {entry.get('actor', '?')}: {entry.get('outcome', '?')}"
    detail = entry.get("detail")
    if isinstance(detail, dict):
        if isinstance(name := detail.get("name"), str):
            text += f" (name {name})"
        if isinstance(message := detail.get("message"), str):
            text += f": {message}"
        elif detail.get("force") is True:
            text += " (forced)"
    return Event(t, "audit", text[:MAX_TEXT])
