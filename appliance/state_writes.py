"""State files that cannot be written: said once per episode, counted, shown.

The daemon writes three files beside the keys file: ``usage.json`` (every 10 s),
``audit.log`` (per admin action) and ``keys.json`` (per key change through the admin
API). When one cannot be written (a full disk, a read-only remount, a broken
permission) the daemon keeps serving: the hot path never waits on these files. What an
operator needs then is one loud line, not one every 10 s, a figure to alert on, and a
place to see which file is failing now and since when. One :class:`WriteHealth` per file
keeps that:

- an *episode* starts at the first failed write: one ERROR line naming the file and the
  OS's reason (and another only if the reason changes); it ends at the next successful
  write, with one line saying so;
- every failed write counts (``appliance_state_write_errors_total{file}``), so a rate
  shows how often it is being tried;
- :meth:`WriteHealth.as_json` is the episode for ``/admin/status`` and ``/readyz``
  (``doctor`` reads the latter), None while the file is written fine.

The episode logic is the pure function :func:`step`; the class adds a lock (writes come
from worker threads and the event loop), the counter and the journal.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

STATE_FILES = ("usage.json", "audit.log", "keys.json")  # the metric's label values

Event = Literal["failing", "reason changed", "recovered"]


@dataclass(frozen=True)
class Failing:
    """An episode of failed writes: why (the last reason), since when, how many tries."""

    reason: str
    since: float  # wall clock of the episode's first failure
    last: float  # wall clock of its latest failure
    tries: int = 1


def step(
    failing: Failing | None, error: str | None, now: float
) -> tuple[Failing | None, Event | None]:
    """The next episode state after one write (``error`` None: it succeeded), and what to
    say about it (None: nothing new, which is the point: once per episode)."""
    if error is None:
        return None, ("recovered" if failing is not None else None)
    if failing is None:
        return Failing(error, now, now), "failing"
    changed = error != failing.reason
    nxt = replace(failing, reason=error, last=now, tries=failing.tries + 1)
    return nxt, ("reason changed" if changed else None)


def reason_of(exc: BaseException) -> str:
    """The OS's words for ``exc`` ("No space left on device"), else its message."""
    strerror = getattr(exc, "reason", None) or getattr(exc, "strerror", None)
    return str(strerror) if strerror else (str(exc) or type(exc).__name__)


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class WriteHealth:
    """Whether one state file is being written; thread-safe.

    ``file`` is the file's role (one of :data:`STATE_FILES`, the metric's label),
    ``path`` where it is, ``meanwhile`` what happens while it cannot be written (in the
    ERROR line). ``logger`` None: track and count only (the CLI, which prints its own
    one-line error). ``daemon`` False: a one-shot command, whose ERROR line promises no
    follow-up."""

    def __init__(
        self,
        file: str,
        path: Path | None,
        logger: logging.Logger | None,
        meanwhile: str,
        *,
        daemon: bool = True,
    ) -> None:
        self.file = file
        self.daemon = daemon
        self.path = path
        self.meanwhile = meanwhile
        self.errors_total = 0
        self._log = logger
        self._failing: Failing | None = None
        self._lock = threading.Lock()

    @property
    def failing(self) -> Failing | None:
        return self._failing

    def failed(self, exc: BaseException, now: float | None = None) -> None:
        self._note(reason_of(exc), time.time() if now is None else now)

    def succeeded(self, now: float | None = None) -> None:
        if self._failing is None:  # the common case: no lock, nothing to say
            return
        self._note(None, time.time() if now is None else now)

    def _note(self, error: str | None, now: float) -> None:
        with self._lock:
            before = self._failing
            self._failing, event = step(before, error, now)
            if error is not None:
                self.errors_total += 1
        if event is not None and self._log is not None:
            self._say(event, before)

    def _say(self, event: Event, before: Failing | None) -> None:
        assert self._log is not None
        where = self.path or self.file
        now = self._failing
        if event == "recovered" and before is not None:
            self._log.warning(
                "state file %s is written again (%d failed write(s) since %s)",
                where,
                before.tries,
                iso(before.since),
            )
        elif now is not None:
            tail = (
                " (said once: a line follows when it is written again; "
                f'appliance_state_write_errors_total{{file="{self.file}"}} counts the tries)'
                if self.daemon
                else ""
            )
            changed = "; the reason changed" if event == "reason changed" else ""
            self._log.error(
                "state file %s cannot be written (%s)%s; %s%s",
                where,
                now.reason,
                changed,
                self.meanwhile,
                tail,
            )

    def as_json(self) -> dict[str, Any] | None:
        """The episode in progress (None: the file is written fine)."""
        f = self._failing
        if f is None:
            return None
        return {
            "file": self.file,
            "error": f.reason,
            "since": iso(f.since),
            "last_failure": iso(f.last),
            "failures": f.tries,
        }
