"""A state file that cannot be written (issue #21, item 2), in process: the episode logic
(said once, counted every time, a line when it works again), atomic_write leaving the
good file alone on ENOSPC, audit.log never keeping half a line and keeping what it could
not write (bounded), usage kept and written later, a key change taken back, the admin
API's status for it, the metric, and the doctor's check."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from appliance import audit, fsutil
from appliance.audit import AuditLog
from appliance.doctor.result import Account
from appliance.doctor.state_files import check_state_writes
from appliance.gateway.accounting.book import UsageBook, read_usage
from appliance.gateway.admin.routes import keys_file_error
from appliance.gateway.admission.ratelimit import RateLimiter
from appliance.gateway.keys import KeysFileError, KeyStore
from appliance.gateway.observe.metrics import GatewayMetrics
from appliance.state_writes import Failing, WriteHealth, step

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
NO_SPACE = "No space left on device"


# ---- the episode, pure -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "error", "after", "event"),
    [
        (None, None, None, None),  # written fine, as always: nothing to say
        (None, NO_SPACE, Failing(NO_SPACE, 5.0, 5.0, 1), "failing"),
        (Failing(NO_SPACE, 1.0, 2.0, 2), NO_SPACE, Failing(NO_SPACE, 1.0, 5.0, 3), None),
        (
            Failing(NO_SPACE, 1.0, 2.0, 2),
            "Read-only file system",
            Failing("Read-only file system", 1.0, 5.0, 3),
            "reason changed",
        ),
        (Failing(NO_SPACE, 1.0, 2.0, 2), None, None, "recovered"),
    ],
)
def test_an_episode_is_said_when_it_starts_changes_or_ends_and_never_in_between(
    before: Failing | None, error: str | None, after: Failing | None, event: str | None
) -> None:
    assert step(before, error, 5.0) == (after, event)


def test_write_health_says_one_error_per_episode_and_counts_every_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.state")
    w = WriteHealth("usage.json", Path("/state/usage.json"), logger, "kept in memory")
    with caplog.at_level(logging.INFO, logger="test.state"):
        for _ in range(5):
            w.failed(ENOSPC, now=100.0)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "/state/usage.json" in errors[0] and NO_SPACE in errors[0]
    assert w.errors_total == 5
    assert w.as_json() == {
        "file": "usage.json",
        "error": NO_SPACE,
        "since": "1970-01-01T00:01:40Z",
        "last_failure": "1970-01-01T00:01:40Z",
        "failures": 5,
    }
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="test.state"):
        w.succeeded()
        w.succeeded()
    assert [r.getMessage() for r in caplog.records] == [
        "state file /state/usage.json is written again (5 failed write(s) since "
        "1970-01-01T00:01:40Z)"
    ]
    assert w.as_json() is None and w.errors_total == 5  # a counter never goes back


# ---- atomic_write on a full disk -------------------------------------------------------


def test_atomic_write_on_enospc_leaves_the_good_file_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = tmp_path / "keys.json"
    good.write_bytes(b'{"good": true}\n')

    def full(fd: int) -> None:
        raise ENOSPC

    monkeypatch.setattr(fsutil.os, "fsync", full)  # a real disk says so at fsync, or write
    with pytest.raises(fsutil.FileWriteError) as caught:
        fsutil.atomic_write(good, b"x" * 100_000)
    assert caught.value.errno == errno.ENOSPC and caught.value.reason == NO_SPACE
    assert str(good) in str(caught.value) and NO_SPACE in str(caught.value)
    assert good.read_bytes() == b'{"good": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json"]


# ---- audit.log -------------------------------------------------------------------------


def _entries(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class _Disk:
    """os.write for audit.py that fills up: ``room`` bytes fit, then ENOSPC (short
    writes first, as Linux gives them), until ``room`` is set to None (space back)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.room: int | None = None
        real = os.write

        def write(fd: int, data: Any) -> int:
            if self.room is None:
                return real(fd, data)
            if self.room == 0:
                raise OSError(errno.ENOSPC, NO_SPACE)
            n = real(fd, bytes(data)[: self.room])
            self.room -= n
            return n

        monkeypatch.setattr(audit.os, "write", write)


def test_an_audit_write_cut_short_by_a_full_disk_leaves_whole_lines_and_is_written_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(path)
    log.record("key.create", "key:a", "key:x", "ok")
    before = path.read_bytes()
    disk = _Disk(monkeypatch)
    disk.room = 40  # half a line fits, then the disk is full
    log.record("key.create", "key:b", "key:x", "ok")
    log.record("key.revoke", "key:a", "key:x", "ok")
    assert path.read_bytes() == before  # the half line was taken back
    assert log.waiting == 2 and log.writes.errors_total == 2
    assert log.writes.as_json() is not None

    disk.room = None  # space again: the next action writes what waited, in order
    log.record("engine.drain", "engine:0", "key:x", "ok")
    assert [e["target"] for e in _entries(path)] == ["key:a", "key:b", "key:a", "engine:0"]
    assert log.waiting == 0 and log.writes.as_json() is None


def test_audit_lines_beyond_the_bound_are_counted_and_a_line_says_how_many(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(audit, "MAX_PENDING", 2)
    path = tmp_path / "audit.log"
    disk = _Disk(monkeypatch)
    disk.room = 0
    log = AuditLog(path)
    with caplog.at_level(logging.INFO, logger="appliance.audit"):
        for i in range(5):
            log.record("engine.drain", f"engine:{i}", "key:x", "ok")
        assert log.waiting == 2
        disk.room = None
        assert log.flush()  # the daemon's retry
    got = _entries(path)
    assert [e["action"] for e in got] == ["engine.drain", "engine.drain", "audit.lost"]
    assert got[2]["detail"]["lines"] == 3 and got[2]["detail"]["why"] == NO_SPACE
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("cannot be written" in m for m in said) == 1  # one ERROR for the episode
    assert any("newer ones go to the journal only" in m for m in said)
    assert any("3 more could not be kept" in m for m in said)
    # Every line still reached the journal.
    assert sum(r.levelno == logging.INFO for r in caplog.records) == 5


def test_a_line_cut_by_a_crash_is_ended_so_the_next_line_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    path.write_bytes(b'{"time":"2025-01-01T00:00:00Z","act')  # a power cut mid-line
    AuditLog(path).record("engine.resume", "engine:0", "key:x", "ok")
    assert json.loads(path.read_text().splitlines()[1])["action"] == "engine.resume"


# ---- usage.json ------------------------------------------------------------------------


def test_usage_that_cannot_be_saved_stays_counted_is_said_once_and_is_written_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "usage.json"
    book = UsageBook(path, CollectorRegistry(), RateLimiter())
    book.add("k1", 10, 5, now=1000.0)
    book.save(now=1000.0)
    good = path.read_bytes()
    real = fsutil.atomic_write

    def full(p: Path, data: bytes, mode: int = 0o600) -> None:
        raise fsutil.FileWriteError(f"cannot write {p} ({NO_SPACE})", ENOSPC)

    monkeypatch.setattr("appliance.gateway.accounting.book.atomic_write", full)
    with caplog.at_level(logging.INFO, logger="appliance.gateway"):
        for i in range(4):  # four periodic saves while the disk is full
            book.add("k1", 1, 1, now=1000.0 + i)
            book.save(now=1000.0 + i)
    assert path.read_bytes() == good
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(path) in errors[0] and NO_SPACE in errors[0]
    assert book.writes.errors_total == 4

    monkeypatch.setattr("appliance.gateway.accounting.book.atomic_write", real)
    book.save(now=1010.0)  # the next periodic save, with space again
    counts = read_usage(path)
    assert counts is not None and counts.totals == {"k1": [14, 9]}
    assert book.writes.as_json() is None


# ---- keys.json -------------------------------------------------------------------------


def test_a_key_change_that_cannot_be_written_changes_neither_the_file_nor_the_keys_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = KeyStore(tmp_path / "keys.json")
    kept, _ = store.create(name="kept", scopes=["admin"])
    good = store.path.read_bytes()

    def full(p: Path, data: bytes, mode: int = 0o600) -> None:
        raise fsutil.FileWriteError(f"cannot write {p} ({NO_SPACE})", ENOSPC)

    monkeypatch.setattr(fsutil, "atomic_write", full)
    with pytest.raises(KeysFileError) as caught:
        store.create(name="new")
    assert caught.value.errno == errno.ENOSPC
    assert str(store.path) in str(caught.value) and NO_SPACE in str(caught.value)
    with pytest.raises(KeysFileError):
        store.revoke(kept.id)
    assert store.path.read_bytes() == good
    assert [r.name for r in store.records] == ["kept"]  # the new one taken back out,
    assert store.get(kept.id) is not None  # the revoked one put back
    assert store.writes.errors_total == 2


def test_the_admin_api_answers_507_for_a_full_disk_and_503_for_other_file_trouble() -> None:
    full = KeysFileError("cannot write /s/keys.json (No space left on device)")
    full.errno = errno.ENOSPC
    err = keys_file_error(full)
    assert (err.status, err.code, err.retry_after) == (507, "insufficient_storage", None)
    assert err.message == "cannot write /s/keys.json (No space left on device)"
    locked = keys_file_error(KeysFileError("keys file lock /s/keys.json.lock is held"))
    assert (locked.status, locked.code) == (503, "keys_file_error")


# ---- the metric --------------------------------------------------------------------------


def test_the_metric_has_a_series_per_state_file_from_each_files_count() -> None:
    metrics = GatewayMetrics()
    usage = WriteHealth("usage.json", None, None, "")
    metrics.attach_state_files(lambda: (usage,))
    usage.failed(ENOSPC)
    usage.failed(ENOSPC)
    text = generate_latest(metrics.registry).decode()
    assert 'appliance_state_write_errors_total{file="usage.json"} 2.0' in text
    assert 'appliance_state_write_errors_total{file="audit.log"} 0.0' in text
    assert 'appliance_state_write_errors_total{file="keys.json"} 0.0' in text


# ---- the doctor --------------------------------------------------------------------------

ME = Account("me", os.geteuid(), os.getegid())


def _vfs(free: int, *, rdonly: bool = False, inodes: int = 100) -> Any:
    return lambda _path: SimpleNamespace(
        f_bavail=free // 4096,
        f_frsize=4096,
        f_flag=os.ST_RDONLY if rdonly else 0,
        f_files=1000,
        f_favail=inodes,
    )


def test_doctor_takes_the_running_daemons_word_for_which_file_fails_and_why(
    tmp_path: Path,
) -> None:
    failing = [
        {"file": "usage.json", "error": NO_SPACE, "since": "2025-01-01T00:00:00Z", "failures": 3}
    ]
    readyz = {"status": "ready", "state_write_failures": failing}
    r = check_state_writes(tmp_path / "keys.json", readyz, ME, statvfs=_vfs(1 << 40))
    assert r.status == "fail" and "usage.json" in r.detail and NO_SPACE in r.detail
    assert "df -h" in r.fix
    readyz["state_write_failures"] = []
    r = check_state_writes(tmp_path / "keys.json", readyz, ME, statvfs=_vfs(0))
    assert r.status == "ok"  # the daemon's word over the disk's


def test_doctor_without_a_daemon_judges_free_space_and_the_file_system(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    assert check_state_writes(keys, None, ME, statvfs=_vfs(1 << 30)).status == "ok"
    full = check_state_writes(keys, None, ME, statvfs=_vfs(0))
    assert full.status == "fail" and "0 MiB free" in full.detail
    ro = check_state_writes(keys, None, ME, statvfs=_vfs(1 << 30, rdonly=True))
    assert ro.status == "fail" and "read-only" in ro.detail
    no_inode = check_state_writes(keys, None, ME, statvfs=_vfs(1 << 30, inodes=0))
    assert no_inode.status == "fail" and "inode" in no_inode.detail
    gone = check_state_writes(tmp_path / "nope" / "keys.json", None, ME, statvfs=_vfs(0))
    assert gone.status == "na"
