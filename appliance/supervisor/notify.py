"""What systemd hears from the main loop's tick: READY, EXTEND_TIMEOUT, STATUS, WATCHDOG.

- ``READY=1`` once the gateway listens and every engine is READY or FAILED (a reload
  sends ``RELOADING=1`` then ``READY=1`` again, once READY was sent);
- ``EXTEND_TIMEOUT_USEC`` every few seconds before that: models load for minutes, and
  systemd's start timeout must not fire meanwhile;
- ``STOPPING=1`` when a stop begins, then ``EXTEND_TIMEOUT_USEC`` at once and every few
  seconds until the process exits: a drain (up to ``restart.drain_timeout_s``) and the
  engines' stop may outlast ``TimeoutStopSec``, and systemd must not kill the service
  in the middle of it. The stop bounds itself; the extensions come from the tick, so a
  stop whose loop is stuck still runs out of time;
- ``STATUS=`` the one-line summary of :func:`status_line` (ready engines per model when
  there are several), when it changes;
- ``WATCHDOG=1`` from the tick only, so a stalled loop is noticed and restarted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from appliance.engine import EngineState
from appliance.systemd import Notifier
from appliance.telemetry import GpuReading

EXTEND_EVERY_S = 5.0
EXTEND_BY_S = 30.0


def status_line(
    engines: Sequence[tuple[str, EngineState, str]],
    readings: Mapping[int, GpuReading],
    in_flight: int,
    stopping: bool,
) -> str:
    """``2/2 engines ready; gpu0 64°C; 3 in flight``, and what is not READY, if any.

    ``engines``: (name, state, model) each. With several models the count is per model,
    ``ready: chat 1/1, embed 0/1; ...``, so one model down shows at a glance.
    """
    parts = [_ready_counts(engines)]
    if stopping:
        parts[0] = "stopping; " + parts[0]
    odd = [f"{name} {state.value}" for name, state, _ in engines if state is not EngineState.READY]
    if odd:
        parts.append(", ".join(odd))
    temps = [
        f"gpu{i} {r.temperature_c:.0f}°C"
        for i, r in sorted(readings.items())
        if r.temperature_c is not None
    ]
    if temps:
        parts.append(", ".join(temps))
    parts.append(f"{in_flight} in flight")
    return "; ".join(parts)


def _ready_counts(engines: Sequence[tuple[str, EngineState, str]]) -> str:
    """``2/2 engines ready`` for one model; ``ready: chat 1/1, embed 0/1`` for several
    (models in the order their first engine comes: the config's)."""
    per_model: dict[str, list[bool]] = {}
    for _, state, model in engines:
        per_model.setdefault(model, []).append(state is EngineState.READY)
    if len(per_model) <= 1:
        n_ready = sum(state is EngineState.READY for _, state, _ in engines)
        return f"{n_ready}/{len(engines)} engines ready"
    counts = (f"{model} {sum(ready)}/{len(ready)}" for model, ready in per_model.items())
    return "ready: " + ", ".join(counts)


class SystemdReporter:
    """The tick's messages to systemd, each sent when it is due (see the module docstring)."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.ready_sent = False
        self._last_extend = 0.0
        self._last_watchdog = 0.0
        self._last_status = ""

    def tick_interval(self, most_s: float) -> float:
        """The main loop's tick: ``most_s``, or shorter where systemd's watchdog wants it."""
        wd = self.notifier.watchdog_interval_s
        return min(most_s, wd) if wd else most_s

    def stopping(self, now: float) -> None:
        """A stop has begun: ``STOPPING=1``, and the stop deadline moved at once."""
        self.notifier.stopping()
        self._extend(now)

    def _extend(self, now: float) -> None:
        self.notifier.extend_timeout(EXTEND_BY_S)
        self._last_extend = now

    def tick(
        self,
        now: float,
        states: Sequence[EngineState],
        accepting: bool,
        status: str,
        *,
        stopping: bool = False,
    ) -> None:
        wd = self.notifier.watchdog_interval_s
        if wd is not None and now - self._last_watchdog >= wd:
            # From this tick only: if the loop stalls, systemd notices and restarts us.
            self.notifier.watchdog()
            self._last_watchdog = now
        loading = any(s is EngineState.STARTING for s in states)
        settled = all(s in (EngineState.READY, EngineState.FAILED) for s in states)
        starting = not self.ready_sent and (loading or not settled)
        if not self.ready_sent and accepting and settled:
            self.notifier.ready()
            self.ready_sent = True
        elif (starting or stopping) and now - self._last_extend >= EXTEND_EVERY_S:
            # Models load for minutes, a drain may too: keep systemd's start or stop
            # timeout from firing meanwhile.
            self._extend(now)
        if status != self._last_status:
            self.notifier.status(status)
            self._last_status = status

    def reloaded(self) -> None:
        """After a reload: READY=1 again, if the start had sent it."""
        if self.ready_sent:
            self.notifier.ready()
