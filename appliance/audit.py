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
written first, the failure is logged once (until a write succeeds again), and the action
goes on.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import syslog
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from appliance.fsutil import SAFE_OPEN, owner_reference

AUDIT_FILE = "audit.log"
DEFAULT_MAX_BYTES = 10 * 1024 * 1024
DEFAULT_KEEP = 1
_OPEN_TRIES = 4  # a file rotated by another process between open and lock: open again

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
    journal), or ``journal`` (the CLI passes :func:`to_syslog`). Safe to share; blocking
    I/O of a few microseconds per (rare) action."""

    def __init__(
        self,
        path: Path | None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        keep: int = DEFAULT_KEEP,
        logger: logging.Logger | None = None,
        journal: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = max(1, keep)
        self._log = logger or log
        self._journal = journal or self._to_logger
        self._failing = False  # a failure is logged once, until a write succeeds again

    def _to_logger(self, line: str) -> None:
        self._log.info("%s", line)

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
            try:
                self._append((line + "\n").encode("utf-8"))
            except Exception as exc:  # the action itself must go on
                self._failed(exc)
            else:
                if self._failing:
                    self._failing = False
                    self._log.warning("audit: %s is written again", self.path)
        return line

    def _failed(self, exc: BaseException) -> None:
        if self._failing:
            return
        self._failing = True
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        self._log.error(
            "audit: cannot append to %s (%s); audit lines go to the journal only until it is fixed",
            self.path,
            why,
        )

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
                _write_all(fd, data)
                return
            finally:
                os.close(fd)  # releases the lock
        raise AuditFileError(f"{self.path} kept changing under us")

    def _open(self, path: Path) -> int:
        ref = owner_reference(path)  # before open: a file we create must not choose
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | SAFE_OPEN, 0o600)
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
