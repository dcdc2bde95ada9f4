"""What the engines' runners must agree on: who may be taken out of service now.

Rules, shared by every runner and decided here only:

- one engine is in a planned restart (drain, stop, start) at a time: the next waits
  until it is READY again (or FAILED);
- an engine is never taken out for a planned restart while it is the last one serving
  (a box with a single engine has no choice, so it may);
- an admin's drain of the last engine serving needs ``force``: it stops the service.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from appliance.engine import EngineState

# (engine id, state) of every engine, read when a question is asked.
States = Callable[[], Iterable[tuple[int, EngineState]]]


class RestartCoordinator:
    def __init__(self, states: States) -> None:
        self._states = states
        self.restarting: int | None = None  # the engine in a planned restart

    def others_serving(self, engine_id: int) -> bool:
        """Whether an engine other than ``engine_id`` is READY."""
        return any(i != engine_id and s is EngineState.READY for i, s in self._states())

    def may_take_out(self, engine_id: int) -> str | None:
        """Why a planned restart of ``engine_id`` must wait, or None when it may begin."""
        if self.restarting is not None and self.restarting != engine_id:
            return f"engine{self.restarting} is restarting"
        others = [i for i, _ in self._states() if i != engine_id]
        if others and not self.others_serving(engine_id):
            return "it is the last engine serving"
        return None

    def begin(self, engine_id: int) -> None:
        self.restarting = engine_id

    def state_changed(self, engine_id: int, state: EngineState) -> None:
        if engine_id == self.restarting and state in (EngineState.READY, EngineState.FAILED):
            self.restarting = None  # its planned restart is over: the next may begin
