"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.engine import EngineState
from appliance.supervisor.notify import (
    EXTEND_BY_S,
    EXTEND_EVERY_S,
    SystemdReporter,
    status_line,
)
from appliance.systemd import CHILD_ENV_DENYLIST, Notifier, child_environment
from appliance.telemetry import GpuReading


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)
    return sock


def _recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode("utf-8")


def _open_socket_of(notifier: Notifier) -> socket.socket | None:
    return notifier._sock


def _assert_nothing_pending(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


@pytest.fixture
def systemd_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify")
    sock = _receiver(path)
    try:
        yield sock, path
    finally:
        sock.close()


def test_messages_arrive_in_order_and_exactly(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, path = systemd_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}
    with Notifier.from_env(env) as notifier:
        assert notifier.enabled
        assert notifier.ready()
        assert notifier.status("2/2 engines ready")
        assert notifier.watchdog()
        assert notifier.extend_timeout(90)
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert notifier.reloading()
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert notifier.stopping()

    assert _recv(sock) == "READY=1"
    assert _recv(sock) == "STATUS=2/2 engines ready"
    assert _recv(sock) == "WATCHDOG=1"
    assert _recv(sock) == "EXTEND_TIMEOUT_USEC=90000000"
    reloading = _recv(sock).split("\n")
    assert reloading[0] == "RELOADING=1"
    key, _, value = reloading[1].partition("=")
    assert key == "MONOTONIC_USEC"
    assert before <= int(value) <= after
    assert len(reloading) == 2
    assert _recv(sock) == "STOPPING=1"
    _assert_nothing_pending(sock)


def test_abstract_namespace_socket() -> None:
    name = f"llm-appliance-test-{uuid.uuid4().hex}"
    sock = _receiver("\0" + name)
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert notifier.stopping()
        notifier.close()
        assert _recv(sock) == "READY=1"
        assert _recv(sock) == "STOPPING=1"
    finally:
        sock.close()


def test_status_is_one_line(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, path = systemd_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    notifier.status("engine 0: READY\n  engine 1: STARTING\r\n\nqueue 3\n")
    notifier.close()
    assert _recv(sock) == "STATUS=engine 0: READY engine 1: STARTING queue 3"


def test_extend_timeout_rounds_up_and_rejects_nonsense(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, path = systemd_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    notifier.extend_timeout(0.0000015)
    assert _recv(sock) == "EXTEND_TIMEOUT_USEC=2"
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            notifier.extend_timeout(bad)
    notifier.close()


def test_notify_sends_lines_as_one_datagram(systemd_socket: tuple[socket.socket, str]) -> None:
    sock, path = systemd_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.notify("READY=1", "STATUS=up")
    assert _recv(sock) == "READY=1\nSTATUS=up"
    with pytest.raises(ValueError):
        notifier.notify("STATUS=two\nlines")
    with pytest.raises(ValueError):
        notifier.notify("READY")
    notifier.close()


def test_no_notify_socket_is_a_silent_no_op(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="appliance.systemd")
    notifier = Notifier.from_env({"WATCHDOG_USEC": "30000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert not notifier.ready()
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.reloading()
    assert not notifier.extend_timeout(1)
    assert not notifier.stopping()
    notifier.close()
    assert caplog.records == []


def test_from_env_defaults_to_os_environ(
    monkeypatch: pytest.MonkeyPatch, systemd_socket: tuple[socket.socket, str]
) -> None:
    sock, path = systemd_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    notifier = Notifier.from_env()
    assert notifier.ready()
    notifier.close()
    assert _recv(sock) == "READY=1"


def test_watchdog_interval_is_half_of_watchdog_usec(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    _, path = systemd_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_env(env).watchdog_interval_s == 15.0


def test_watchdog_pid_mismatch_disables_watchdog(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, path = systemd_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}
    notifier = Notifier.from_env(env)
    assert notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert not notifier.watchdog()
    assert notifier.ready()  # everything else still works
    notifier.close()
    assert _recv(sock) == "READY=1"
    _assert_nothing_pending(sock)


@pytest.mark.parametrize("raw", ["", "0", "-5", "soon"])
def test_invalid_watchdog_usec_means_no_watchdog(
    raw: str, systemd_socket: tuple[socket.socket, str]
) -> None:
    _, path = systemd_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": raw})
    assert notifier.enabled
    assert notifier.watchdog_interval_s is None


@pytest.mark.parametrize("raw", ["relative/path", "vsock:2:1234", "@"])
def test_unsupported_notify_socket_disables(raw: str) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": raw, "WATCHDOG_USEC": "1000000"})
    assert not notifier.enabled
    assert notifier.watchdog_interval_s is None
    assert not notifier.ready()


def test_vanished_socket_does_not_raise_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="appliance.systemd")
    path = tmp_path / "notify"
    sock = _receiver(str(path))
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "2000000"})
    assert notifier.ready()
    assert _recv(sock) == "READY=1"

    sock.close()
    path.unlink()
    assert not notifier.watchdog()
    assert not notifier.status("still here")
    assert not notifier.stopping()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "could not notify systemd" in warnings[0].getMessage()

    # systemd came back (same path): sending works again, and a new outage warns again.
    sock = _receiver(str(path))
    try:
        assert notifier.watchdog()
        assert _recv(sock) == "WATCHDOG=1"
    finally:
        sock.close()
    path.unlink()
    assert not notifier.watchdog()
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2
    notifier.close()


def test_one_socket_reused_and_reopened_after_close(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, path = systemd_socket
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    notifier.ready()
    first = _open_socket_of(notifier)
    assert first is not None
    notifier.status("a")
    assert _open_socket_of(notifier) is first
    notifier.close()
    assert _open_socket_of(notifier) is None
    notifier.close()  # idempotent
    notifier.status("b")
    assert _open_socket_of(notifier) not in (None, first)
    notifier.close()
    assert [_recv(sock) for _ in range(3)] == ["READY=1", "STATUS=a", "STATUS=b"]


def test_child_environment_strips_systemd_keys() -> None:
    base = {
        "PATH": "/usr/bin",
        "HOME": "/var/lib/llm-appliance",
        "INVOCATION_ID": "abc",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "30000000",
        "WATCHDOG_PID": "42",
        "LISTEN_FDS": "1",
        "LISTEN_PID": "42",
        "LISTEN_FDNAMES": "gateway",
    }
    child = child_environment(base)
    assert child == {"PATH": "/usr/bin", "HOME": "/var/lib/llm-appliance", "INVOCATION_ID": "abc"}
    assert not CHILD_ENV_DENYLIST & child.keys()
    assert "NOTIFY_SOCKET" in base  # the input is not modified
    child["X"] = "1"
    assert "X" not in base


# --- the supervisor's reporter: a long stop is not cut by TimeoutStopSec ----------------


def _pending(sock: socket.socket) -> list[str]:
    """Every datagram waiting now (the sends are synchronous: nothing is in flight)."""
    sock.setblocking(False)
    got = []
    try:
        while True:
            got.append(sock.recv(4096).decode("utf-8"))
    except BlockingIOError:
        return got
    finally:
        sock.setblocking(True)


def test_a_stop_moves_systemds_deadline_at_once_and_until_it_ends(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    """STOPPING=1 comes with EXTEND_TIMEOUT_USEC, and the extension is renewed from the
    tick before it lapses for as long as the drain goes on (here 60 s of ticks)."""
    sock, path = systemd_socket
    reporter = SystemdReporter(Notifier.from_env({"NOTIFY_SOCKET": path}))
    reporter.tick(100.0, [EngineState.READY] * 2, True, "2/2 engines ready")
    assert _pending(sock) == ["READY=1", "STATUS=2/2 engines ready"]

    reporter.stopping(101.0)
    extend = f"EXTEND_TIMEOUT_USEC={int(EXTEND_BY_S * 1_000_000)}"
    assert _pending(sock) == ["STOPPING=1", extend]
    extended_at = [101.0]
    now = 101.0
    while now < 161.0:
        now += 0.5
        reporter.tick(now, [EngineState.DRAINING] * 2, False, "stopping", stopping=True)
        extended_at += [now for m in _pending(sock) if m == extend]
    gaps = [b - a for a, b in itertools.pairwise(extended_at)]
    assert len(extended_at) >= 60 / EXTEND_BY_S + 1
    assert all(EXTEND_EVERY_S <= gap < EXTEND_BY_S for gap in gaps), extended_at
    assert now - extended_at[-1] < EXTEND_BY_S  # still covered when the stop ends


def test_no_extension_once_ready_and_not_stopping(
    systemd_socket: tuple[socket.socket, str],
) -> None:
    sock, path = systemd_socket
    reporter = SystemdReporter(Notifier.from_env({"NOTIFY_SOCKET": path}))
    for i in range(40):
        reporter.tick(100.0 + i, [EngineState.READY], True, "1/1 engines ready")
    assert _pending(sock) == ["READY=1", "STATUS=1/1 engines ready"]


# --- the STATUS= line ---------------------------------------------------------------------
READY, STARTING, FAILED = EngineState.READY, EngineState.STARTING, EngineState.FAILED


def test_status_line_with_one_model_counts_engines() -> None:
    engines = [("engine0", READY, "chat"), ("engine1", STARTING, "chat")]
    line = status_line(engines, {0: GpuReading(0, temperature_c=64.2)}, 3, False)
    assert line == "1/2 engines ready; engine1 STARTING; gpu0 64°C; 3 in flight"


def test_status_line_with_several_models_counts_ready_engines_per_model() -> None:
    engines = [
        ("engine0", READY, "chat"),
        ("engine1", READY, "chat"),
        ("engine2", FAILED, "embed"),
    ]
    assert status_line(engines, {}, 0, False) == (
        "ready: chat 2/2, embed 0/1; engine2 FAILED; 0 in flight"
    )
    assert status_line(engines, {}, 0, True).startswith("stopping; ready: chat 2/2, embed 0/1;")
