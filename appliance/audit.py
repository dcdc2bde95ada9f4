"""The audit trail: one JSON line per admin action, to the journal and to ``audit.log``.

An admin action is anything that changes who may use the box or what it serves: a key
created or revoked (admin API, ``llm-appliance keys``, the first admin key at a first
start), an engine drained, resumed or restarted (admin API), a reload (SIGHUP). Each is
one line::

    {"time": "2025-01-31T12:00:00.123Z", "action": "engine.drain", "target": "engine:1",
     "actor": "key:3f9a1c2e", "outcome": "refused", "detail": {"status": 409, ...}}

``outcome`` is ``ok``, ``refused`` (the action was not allowed or made no sense: 4xx,
an unknown id, a config that does not parse) or ``error`` (it could not be done: the
keys file unwritable, an engine that did not answer).

What is never recorded: a key's secret or its hash, request bodies, prompts, config
values (a reload names the keys that changed, never what they hold). Callers pass only
ids, names and key paths; this module does not look inside ``detail``.

Where: ``audit.log`` beside the keys file (``gateway.keys_file``; by default the state
directory ``/var/lib/llm-appliance``), because that is the one place that the daemon and
``sudo llm-appliance keys ...`` agree on from the config alone (``$STATE_DIRECTORY`` is
only set for the daemon). The file is opened for each line (admin actions are rare), so
the CLI and the daemon can both append, and a rotation by one is seen by the other.

Safety, as for the keys file (:mod:`appliance.fsutil`): the directory belongs to the
service account, so root running the CLI must not follow a planted symlink, block on a
FIFO or append to a hard link: the file is opened with O_NOFOLLOW|O_NONBLOCK and must be
a regular file with one link, owned by us (or, for root, by anyone: root keeps the
daemon's file the daemon's). It is kept 0600. Rotation is by size: over ``max_bytes`` it
is renamed to ``audit.log.1`` (older ones shift up to ``keep``) under an exclusive lock,
and a fresh file starts.

The journal: the daemon logs each line through the "appliance.audit" logger (its stderr
is the journal); the CLI, run from a shell, sends it to syslog (:func:`to_syslog`).

An audit write that fails never breaks the action it records: the journal line is
written first (the journal is the record that never waits on this disk), and the action
goes on. The file then:

- never keeps a broken line: a batch of whole lines is appended under the lock, and a
  write that fails part way (a full disk) is truncated back to the size it had, so a
  reader sees whole JSON lines only (a line cut by a crash earlier is ended before the
  next one, so it cannot swallow it);
- keeps what it could not write: up to :data:`MAX_PENDING` lines wait in memory, in order,
  and are written, before any newer line, by the next write that works: the next action,
  or a retry every :data:`RETRY_S` while the daemon's loop runs. Beyond the bound, newer
  lines are counted, not kept; when the file is written again an ``audit.lost`` line
  (``detail``: how many, first and last time, why) stands where they would have been.
  They are all in the journal. A CLI run (``keys create``) has no loop to retry from:
  what it could not write is in syslog only;
- is said once per episode (:mod:`appliance.state_writes`: one ERROR naming the file and
  the OS's reason, one line when it is written again), and counted in
  ``appliance_state_write_errors_total{file="audit.log"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import stat
import syslog
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from appliance.fsutil import SAFE_OPEN, owner_reference
from appliance.state_writes import WriteHealth

AUDIT_FILE = "audit.log"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_KEEP = 1
_OPEN_TRIES = 4  # a file rotated by another process between open and lock: open again
# Lines kept in memory while audit.log cannot be written: admin actions are rare (a few a
# day), so 1000 is days of them, and at ~300 bytes a line a bound of ~300 KB.
MAX_PENDING = 1000
RETRY_S = 10.0  # the daemon retries the waiting lines this often (and at every action)

Outcome = Literal["ok", "refused", "error"]

log = logging.getLogger("appliance.audit")


class AuditFileError(OSError):
    """audit.log is not a file we may append to (a link, a FIFO, someone else's file)."""


def audit_path(keys_file: Path) -> Path:
    """Where the audit log of the appliance whose keys file is ``keys_file`` lives."""
    return keys_file.with_name(AUDIT_FILE)


def audit_line(
    action: str, target: str, actor: str, outcome: Outcome, detail: dict[str, object]
) -> str:
    """One JSON line (no newline inside: json escapes control characters)."""
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    entry = {
        "time": now,
        "action": action,
        "target": target,
        "actor": actor,
        "outcome": outcome,
        "detail": detail,
    }
    return json.dumps(entry, default=str, separators=(",", ":"))


def to_syslog(line: str) -> None:
    """The journal for a command run from a shell, whose stderr is no journal: syslog
    (``/dev/log``, which journald reads), tagged ``llm-appliance``; silent without one."""
    syslog.openlog("llm-appliance", syslog.LOG_PID, syslog.LOG_AUTHPRIV)
    syslog.syslog(syslog.LOG_INFO, line)


class AuditLog:
    """Appends audit lines to ``path`` (None: the journal only) and sends each to the
    journal: by default the "appliance.audit" logger at INFO (the daemon's stderr is its
    journal), or ``journal`` (the CLI passes :func:`to_syslog`). Safe to share between
    threads; blocking I/O of a few microseconds per (rare) action."""

    def __init__(
        self,
        path: Path | None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        logger: logging.Logger | None = None,
        journal: Callable[[str], None] | None = None,
        one_shot: bool = False,
    ) -> None:
        """``one_shot``: a command that records one line and exits (the CLI): nothing
        retries, so the ERROR line says the journal has it and promises nothing more."""
        self.path = path
        self.max_bytes = max_bytes
        self.keep = max(1, keep)
        self._log = logger or log
        self._journal = journal or self._to_logger
        self.writes = WriteHealth(
            "audit.log",
            path,
            self._log,
            "this line is in the journal (syslog) only"
            if one_shot
            else f"audit lines go to the journal, and up to {MAX_PENDING} wait in memory for it",
            daemon=not one_shot,
        )
        self._mutex = threading.Lock()  # the waiting lines, and one batch written at a time
        self._pending: list[str] = []  # lines (no newline) not yet in the file, oldest first
        self._lost: list[str] = []  # times of lines beyond MAX_PENDING: counted, not kept
        self._retry: asyncio.TimerHandle | None = None

    def _to_logger(self, line: str) -> None:
        self._log.info("%s", line)

    @property
    def waiting(self) -> int:
        """Lines waiting in memory for the file (beyond them, lost ones are only counted)."""
        return len(self._pending)

    def record(
        self, action: str, target: str, actor: str, outcome: Outcome, **detail: object
    ) -> str:
        """Record one action; the line written. Never raises for the file's sake."""
        line = audit_line(action, target, actor, outcome, detail)
        try:
            self._journal(line)
        except Exception:  # the file still gets the line, and the action goes on
            self._log.exception("audit: cannot send a line to the journal")
        if self.path is not None:
            with self._mutex:
                if not self._flush([line]):
                    self._keep(line)
            self._retry_later()
        return line

    def flush(self) -> bool:
        """Write the lines waiting for the file; True when none is left waiting."""
        with self._mutex:
            return self._flush([])

    def close(self) -> None:
        """At the daemon's end: one last try, then say what never reached the file."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self.path is None or self.flush():
            return
        self._log.error(
            "audit: %d line(s) never reached %s (%s); they are in the journal",
            len(self._pending) + len(self._lost),
            self.path,
            self.writes.failing.reason if self.writes.failing else "?",
        )

    def _flush(self, new: list[str]) -> bool:
        """Append the waiting lines, the lost-lines marker and ``new`` as one batch; on
        failure nothing of it is in the file (the caller keeps ``new``). Holds _mutex."""
        if not (self._pending or self._lost or new):
            return True
        batch = [*self._pending, *self._lost_marker(), *new]
        try:
            self._append("".join(x + "\n" for x in batch).encode("utf-8"))
        except Exception as exc:  # the action itself must go on
            self.writes.failed(exc)
            return False
        if self._pending or self._lost:
            self._log.warning(
                "audit: %d waiting line(s) written to %s%s",
                len(self._pending),
                self.path,
                f"; {len(self._lost)} more could not be kept (an audit.lost line says so; "
                "the journal has them)"
                if self._lost
                else "",
            )
        self._pending, self._lost = [], []
        self.writes.succeeded()
        return True

    def _keep(self, line: str) -> None:
        """A line the file could not take: kept, or beyond the bound counted. Holds _mutex."""
        if len(self._pending) < MAX_PENDING:
            self._pending.append(line)
            return
        if not self._lost:
            self._log.error(
                "audit: %d lines wait for %s; newer ones go to the journal only (counted) "
                "until it is written again",
                MAX_PENDING,
                self.path,
            )
        self._lost.append(json.loads(line)["time"])

    def _lost_marker(self) -> list[str]:
        if not self._lost:
            return []
        failing = self.writes.failing
        why = failing.reason if failing is not None else "?"
        n, first, last = len(self._lost), self._lost[0], self._lost[-1]
        return [
            audit_line(
                "audit.lost",
                "audit.log",
                "appliance",
                "error",
                {"lines": n, "first": first, "last": last, "why": why},
            )
        ]

    def _retry_later(self) -> None:
        """While lines wait, retry every RETRY_S from the daemon's loop (none in a thread
        without one, or in the CLI: the next action there retries)."""
        if self._retry is not None or (not self._pending and not self._lost):
            return
        with contextlib.suppress(RuntimeError):
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(RETRY_S, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        self.flush()
        self._retry_later()

    # ---- the file ---------------------------------------------------------------------
    def _append(self, data: bytes) -> None:
        assert self.path is not None
        for _ in range(_OPEN_TRIES):
            fd = self._open(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = os.fstat(fd)
                if not _still_at(self.path, st):
                    continue  # rotated by someone else while we waited: the new file
                if st.st_size and st.st_size + len(data) > self.max_bytes:
                    self._rotate(self.path)
                    continue  # and append to the fresh file
                _append_whole(fd, data, st.st_size)
                return
            finally:
                os.close(fd)  # releases the lock
        raise AuditFileError(f"{self.path} kept changing under us")

    def _open(self, path: Path) -> int:
        ref = owner_reference(path)  # before open: a file we create must not choose
        # O_RDWR: the last byte is read to end a line a crash cut (_append_whole)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | SAFE_OPEN, 0o600)
        try:
            st = os.fstat(fd)
            euid = os.geteuid()
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise AuditFileError(f"{path} is not a plain file")
            if st.st_uid != euid and euid != 0:
                raise AuditFileError(f"{path} belongs to uid {st.st_uid}, not to us")
            os.fchmod(fd, 0o600)
            # root (`sudo llm-appliance keys ...`) creating the file leaves it the
            # service account's, so the daemon can still append.
            if euid == 0 and st.st_uid == 0 and ref is not None and ref != (0, 0):
                os.fchown(fd, *ref)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _rotate(self, path: Path) -> None:
        for i in range(self.keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if os.path.lexists(older):
                os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
        os.replace(path, path.with_name(f"{path.name}.1"))


def _still_at(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` still names the file we hold (a rotation renames it away)."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _append_whole(fd: int, data: bytes, size: int) -> None:
    """Append ``data`` (whole lines) to a file of ``size`` bytes, held under our lock, so
    that it ends with whole lines only: all of ``data``, or (a full disk part way) none of
    it, truncated back. A line left cut by a crash is ended first, so it does not swallow
    the next one."""
    if size and os.pread(fd, 1, size - 1) != b"\n":
        data = b"\n" + data
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        raise
