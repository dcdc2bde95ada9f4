"""The task that feeds the status page's history: every ``interval_s`` one status
snapshot, one sample, the events since the last snapshot, and the audit trail's new lines.

It runs with the app (started and stopped by :class:`.routes.StatusPage`) whether or not
a page is open, so a page opened now still shows the last hour. Its cost is one snapshot
and a few counters every 2 s, and a ``stat`` of ``audit.log``: nothing per request.

The audit trail is read from its file, not from the daemon's :class:`AuditLog`, because
``sudo llm-appliance keys create`` writes the same file from another process: the page's
time line shows key changes made either way. The file is read from where it was last
left (from its last :data:`TAIL_BYTES` at start); a rotation (a new inode, or a file
shorter than where we were) starts it over. It is opened as audit.py opens it: no
symlink followed, no FIFO blocked on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from appliance.control import ApplianceStatus
from appliance.gateway.observe.ui.events import audit_event, diff_events
from appliance.gateway.observe.ui.history import Figures, History, sample_of

log = logging.getLogger("appliance.gateway.observe.ui")

TAIL_BYTES = 64 * 1024  # what is read of audit.log at start: its last ~200 lines
READ_MAX = 256 * 1024  # at most this much new text per interval (a burst of key changes)


class AuditTail:
    """The lines appended to ``path`` since the last call (blocking: run in a thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inode: int | None = None
        self._offset = 0

    def read_new(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return []  # no file yet (no action so far), or not one we may read
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return []
            piece = False
            if st.st_ino != self._inode or st.st_size < self._offset:
                # At start: its tail, from one byte early, to see whether that byte ends
                # a line (else the first line read is a piece of one, and is dropped).
                piece = self._inode is None and st.st_size > TAIL_BYTES
                self._inode = st.st_ino
                self._offset = st.st_size - TAIL_BYTES - 1 if piece else 0
            if st.st_size == self._offset:
                return []
            data = os.pread(fd, min(st.st_size - self._offset, READ_MAX), self._offset)
            start = data.find(b"\n") + 1 if piece else 0
        finally:
            os.close(fd)
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        if end == 0 and len(data) == READ_MAX:
            end = len(data)  # no line end in READ_MAX bytes: no audit line; skip it
        self._offset += end
        return data[start:end].decode("utf-8", "replace").splitlines() if end > start else []


class Sampler:
    """Feeds ``history`` from ``status`` and ``figures`` every ``history.interval_s``."""

    def __init__(
        self,
        history: History,
        status: Callable[[], ApplianceStatus],
        figures: Callable[[], Figures],
        audit_file: Path | None,
    ) -> None:
        self.history = history
        self._status = status
        self._figures = figures
        self._audit = AuditTail(audit_file) if audit_file is not None else None
        self._last: tuple[float, ApplianceStatus, Figures] | None = None
        self._task: asyncio.Task[None] | None = None

    def tick(self, now: float) -> None:
        """One sample and the events since the last one (pure but for the reads)."""
        status, figures = self._status(), self._figures()
        last = self._last
        before, dt = (last[2], now - last[0]) if last else (None, 0.0)
        self.history.add_events(diff_events(now, last[1] if last else None, status))
        self.history.add_sample(sample_of(now, status, figures, before, dt))
        self._last = (now, status, figures)

    async def read_audit(self) -> None:
        if self._audit is None:
            return
        lines = await asyncio.to_thread(self._audit.read_new)
        self.history.add_events([e for line in lines if (e := audit_event(line))])

    async def _run(self) -> None:
        while True:
            try:
                self.tick(time.time())
                await self.read_audit()
            except Exception:  # the page's history must never take the gateway down
                log.exception("status page: a history sample failed; trying again")
            await asyncio.sleep(self.history.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ui-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
