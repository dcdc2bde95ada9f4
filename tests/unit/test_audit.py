"""The audit log file: one JSON line per record, 0600, appended, rotated by size, never
through a planted link, and never an exception into the action it records."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from appliance.audit import AuditLog, audit_path


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_record_is_one_json_line_with_the_fields_and_the_same_line_reaches_the_journal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = AuditLog(tmp_path / "audit.log")
    with caplog.at_level(logging.INFO, logger="appliance.audit"):
        line = log.record("engine.drain", "engine:1", "key:ab12cd34", "refused", status=409)
    (entry,) = lines(tmp_path / "audit.log")
    assert entry["action"] == "engine.drain"
    assert entry["target"] == "engine:1"
    assert entry["actor"] == "key:ab12cd34"
    assert entry["outcome"] == "refused"
    assert entry["detail"] == {"status": 409}
    assert isinstance(entry["time"], str) and entry["time"].endswith("Z")
    assert [r.getMessage() for r in caplog.records if r.name == "appliance.audit"] == [line]


def test_a_newline_in_a_name_stays_inside_one_line(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.log")
    log.record("key.create", "key:1", "cli:root", "ok", name='evil\n{"action":"forged"}')
    assert len((tmp_path / "audit.log").read_text().splitlines()) == 1


def test_the_file_is_0600_and_appended_to_never_truncated(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    path.write_text('{"earlier": "line"}\n')
    os.chmod(path, 0o644)
    AuditLog(path).record("config.reload", "config", "signal:SIGHUP", "ok")
    AuditLog(path).record("engine.resume", "engine:0", "key:x", "ok")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [e.get("action", "earlier") for e in lines(path)] == [
        "earlier",
        "config.reload",
        "engine.resume",
    ]


def test_over_max_bytes_the_file_is_rotated_to_dot_1_and_a_fresh_one_starts(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.log"
    one = len(AuditLog(None).record("engine.restart", "engine:0", "key:x", "ok")) + 1
    log = AuditLog(path, max_bytes=2 * one + 10)  # two lines fit, a third does not
    for i in range(6):
        log.record("engine.restart", f"engine:{i}", "key:x", "ok")
    assert [e["target"] for e in lines(path.with_name("audit.log.1"))] == ["engine:2", "engine:3"]
    assert [e["target"] for e in lines(path)] == ["engine:4", "engine:5"]
    assert not path.with_name("audit.log.2").exists()  # keep=1: one old file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_keep_shifts_older_files_up(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(path, max_bytes=1, keep=3)  # every line after the first rotates
    for i in range(5):
        log.record("engine.drain", f"engine:{i}", "key:x", "ok")
    got = [lines(path.with_name(n))[0]["target"] for n in ("audit.log.3", "audit.log.2")]
    assert got == ["engine:1", "engine:2"]
    assert lines(path.with_name("audit.log.1"))[0]["target"] == "engine:3"
    assert lines(path)[0]["target"] == "engine:4"
    assert not path.with_name("audit.log.4").exists()


def test_a_planted_symlink_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "audit.log").symlink_to(victim)
    with caplog.at_level(logging.INFO, logger="appliance.audit"):
        AuditLog(tmp_path / "audit.log").record("key.revoke", "key:1", "cli:root", "ok")
    assert victim.read_text() == "precious\n"
    assert any(r.levelno == logging.ERROR for r in caplog.records)


def test_a_hard_link_or_a_fifo_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.link(victim, tmp_path / "audit.log")
    AuditLog(tmp_path / "audit.log").record("key.revoke", "key:1", "cli:root", "ok")
    assert victim.read_text() == "precious\n"

    fifo = tmp_path / "fifo" / "audit.log"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    AuditLog(fifo).record("key.revoke", "key:1", "cli:root", "ok")  # does not block


def test_a_write_failure_never_raises_and_is_logged_once_until_it_works_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-such-dir" / "audit.log"
    log = AuditLog(missing)
    with caplog.at_level(logging.INFO, logger="appliance.audit"):
        for _ in range(3):
            log.record("engine.resume", "engine:0", "key:x", "ok")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and str(missing) in errors[0].getMessage()
    # The journal still got every line.
    assert sum(r.levelno == logging.INFO for r in caplog.records) == 3

    missing.parent.mkdir()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="appliance.audit"):
        log.record("engine.resume", "engine:0", "key:x", "ok")
    # The three lines that waited in memory come first, in order, then the new one.
    assert len(lines(missing)) == 4
    assert any("written again" in r.getMessage() for r in caplog.records)


def test_the_log_lives_beside_the_keys_file(tmp_path: Path) -> None:
    assert audit_path(tmp_path / "keys.json") == tmp_path / "audit.log"
