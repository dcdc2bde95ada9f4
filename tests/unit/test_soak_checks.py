"""The chaos soak's checks (bench/soak_checks.py): how a broken connection counts, what
makes a state file damaged, whether the usage counted on a full disk was kept, the exit
causes read back from the journal. Tables of cases, no I/O."""

from __future__ import annotations

import json

import pytest

from bench.soak_checks import (
    KILLED,
    connection_error_class,
    exit_causes,
    metric_sum,
    state_file_problems,
    usage_kept,
    usage_total,
    window_counts,
)

DOWN = [(100.0, 104.0)]  # the supervisor was SIGKILLed at 100 s, served again at 104 s


@pytest.mark.parametrize(
    ("started", "ended", "down", "expected"),
    [
        (95.0, 100.0, DOWN, KILLED),  # in flight when it was killed
        (101.0, 101.0, DOWN, KILLED),  # refused while it was dead
        (104.0, 104.5, DOWN, KILLED),  # sent the moment it came back
        (50.0, 60.0, DOWN, "lost"),  # a connection that broke long before
        (105.0, 106.0, DOWN, "lost"),  # after the new life served: no excuse
        (99.0, 99.9, DOWN, "lost"),  # ended just before the kill
        (200.0, 201.0, [(190.0, None)], KILLED),  # still dead
        (50.0, 60.0, [], "lost"),  # no supervisor kill at all
    ],
)
def test_a_broken_connection_counts_on_the_killed_supervisor_only_in_its_window(
    started: float, ended: float, down: list[tuple[float, float | None]], expected: str
) -> None:
    assert connection_error_class(started, ended, down) == expected


USAGE = json.dumps(
    {"format": 1, "keys": {"a": {"prompt_tokens": 5, "completion_tokens": 7, "hours": {}}}}
).encode()
AUDIT = b'{"action": "key.create"}\n{"action": "key.revoke"}\n'
KEYS = b'{"keys": []}\n'


@pytest.mark.parametrize(
    ("usage", "audit", "keys", "expected"),
    [
        (USAGE, AUDIT, KEYS, []),
        (USAGE, None, KEYS, []),  # no admin action yet: no audit.log, nothing damaged
        (USAGE, b"", KEYS, []),
        (None, AUDIT, KEYS, ["usage.json is missing"]),
        (USAGE[:-5], AUDIT, KEYS, [f"usage.json is not JSON ({len(USAGE) - 5} bytes)"]),
        (b"[]", AUDIT, KEYS, ["usage.json has no keys table"]),
        (
            USAGE,
            AUDIT[:-3],
            KEYS,
            ["audit.log ends in a half line", "audit.log line 2 is not JSON"],
        ),
        (USAGE, AUDIT + b"oops\n", KEYS, ["audit.log line 3 is not JSON"]),
        (USAGE, AUDIT, b'{"keys": [1]}\n', ["keys.json changed (14 bytes, was 13 bytes)"]),
        (USAGE, AUDIT, None, ["keys.json changed (missing, was 13 bytes)"]),
    ],
)
def test_state_file_damage_is_named(
    usage: bytes | None, audit: bytes | None, keys: bytes | None, expected: list[str]
) -> None:
    assert state_file_problems(usage, audit, keys, KEYS) == expected


@pytest.mark.parametrize(
    ("file_before", "file_after", "live_fill", "live_free", "missing"),
    [
        (100, 160, 120, 170, False),  # 50 counted while full, 60 written after: kept
        (100, 150, 120, 170, False),  # exactly what was counted
        (100, 100, 120, 170, True),  # the file never caught up
        (100, 140, 120, 170, True),  # part of it lost
        (100, 100, 120, 120, False),  # nothing counted while full: nothing to keep
    ],
)
def test_usage_counted_on_a_full_disk_must_be_in_the_file_after(
    file_before: int, file_after: int, live_fill: int, live_free: int, missing: bool
) -> None:
    verdict = usage_kept(file_before, file_after, live_fill, live_free)
    assert (verdict is not None) == missing
    if missing:
        assert f"{live_free - live_fill} were counted while the disk was full" in str(verdict)


def test_usage_and_metric_totals() -> None:
    assert usage_total(USAGE) == 12
    assert usage_total(b"{ not json") == 0
    assert usage_total(None) == 0
    text = (
        "# TYPE appliance_key_tokens_total counter\n"
        'appliance_key_tokens_total{key="a",kind="prompt"} 5.0\n'
        'appliance_key_tokens_total{key="a",kind="completion"} 7.0\n'
        'appliance_key_tokens_created{key="a",kind="prompt"} 1.7e9\n'
    )
    assert metric_sum(text, "appliance_key_tokens_total") == 12


def test_exit_causes_are_read_from_the_journal() -> None:
    journal = "\n".join(
        [
            "2026-01-01 ERROR engine0: exited with signal SIGKILL while serving (cause: killed"
            " by signal SIGKILL, likely the kernel's OOM killer (its OOM kill count rose))",
            "2026-01-01 ERROR engine1: exited with status 3 while serving (cause: exited by"
            " itself with status 3); last output:",
            "    some output (cause: not a cause)",
            "2026-01-01 ERROR engine1: exited with signal SIGKILL while serving (cause: killed"
            " by signal SIGKILL, which the supervisor did not send)",
        ]
    )
    assert dict(exit_causes(journal)) == {
        "killed by signal SIGKILL, likely the kernel's OOM killer (its OOM kill count rose)": 1,
        "exited by itself with status 3": 1,
        "killed by signal SIGKILL, which the supervisor did not send": 1,
    }


def test_requests_are_counted_in_a_fault_window() -> None:
    ended = {"ok": [1.0, 10.0, 12.0, 30.0], KILLED: [10.5, 11.0], "lost": []}
    assert window_counts(ended, 10.0, 12.0) == {"ok": 2, KILLED: 2, "lost": 0}
