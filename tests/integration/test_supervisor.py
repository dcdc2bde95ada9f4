"""The supervisor as an admin meets it: a real daemon, real signals, fake engines.

Each test starts `llm-appliance serve` with engines replaced by the fake engine (which
imitates vLLM's API, metrics and its habit of leaving an EngineCore child behind) and
checks what can be seen from outside: readiness, engine processes, exit statuses, the
systemd notify datagrams.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from appliance.engine_cpu import cpu_core_sets
from tests.fakes.appliance_proc import (
    alive,
    fake_engine_config,
    get_json,
    run_appliance,
)

pytestmark = pytest.mark.slow


def test_ready_then_sigterm_leaves_no_engine_process(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 2, "--spawn-child")
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        pids = app.remember_tree()
        children = {app.engine_stats(i)["child_pid"] for i in range(2)}  # type: ignore[index]
        assert children <= pids and len(pids) >= 4  # 2 API servers + 2 EngineCores
        app.signal(signal.SIGTERM)
        assert app.wait_exit() == 0
        assert alive(pids) == set()
        assert "engine0: STOPPING -> EXITED" in app.log()
        assert " on uvloop; " in app.log()  # the default loop where uvloop is installed


def test_sigkill_of_api_server_removes_orphan_and_restarts(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 2, "--spawn-child")
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        before = app.engine_stats(0)
        assert before is not None
        api_pid, core_pid = before["pid"], before["child_pid"]
        os.kill(api_pid, signal.SIGKILL)
        app.wait_for(
            lambda: (s := app.engine_stats(0)) is not None and s["pid"] != api_pid,
            20,
            "engine0 replaced",
        )
        # The orphaned "EngineCore" of the killed server must be gone, not left holding
        # (GPU) memory next to the new engine.
        app.wait_for(lambda: not alive({core_pid}), 5, "orphan EngineCore gone")
        assert "engine0: exited with signal SIGKILL while serving" in app.log()
        # Engine 1 was never touched.
        assert app.engine_stats(1)["pid"] != api_pid  # type: ignore[index]
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 10, "readyz 200")


def test_cpu_engine_trees_are_pinned_to_their_own_cores(tmp_path: Path) -> None:
    """Each CPU engine, and the children it starts, runs only on its share of the cores."""
    cfg = fake_engine_config(tmp_path, 2, "--spawn-child")
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        expect = cpu_core_sets(sorted(os.sched_getaffinity(0)), 2)
        for i in range(2):
            stats = app.engine_stats(i)
            assert stats is not None
            for pid in (stats["pid"], stats["child_pid"]):
                assert tuple(sorted(os.sched_getaffinity(pid))) == expect[i], (i, pid)
        # Restarted engines are pinned again.
        old = app.engine_stats(1)["pid"]  # type: ignore[index]
        os.kill(old, signal.SIGKILL)
        app.wait_for(
            lambda: (s := app.engine_stats(1)) is not None and s["pid"] != old,
            20,
            "engine1 replaced",
        )
        new = app.engine_stats(1)["pid"]  # type: ignore[index]
        assert tuple(sorted(os.sched_getaffinity(new))) == expect[1]


def test_sigstopped_engine_is_detected_and_replaced(tmp_path: Path) -> None:
    # A long stop_timeout_s: a hung engine must not get it (it cannot act on SIGTERM).
    cfg = fake_engine_config(tmp_path, 1, engine={"stop_timeout_s": 120})
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        stopped = app.engine_stats(0)["pid"]  # type: ignore[index]
        os.kill(stopped, signal.SIGSTOP)
        try:
            app.wait_for(
                lambda: (s := app.engine_stats(0)) is not None and s["pid"] != stopped,
                30,
                "stopped engine replaced",
            )
        finally:
            if alive({stopped}):
                os.kill(stopped, signal.SIGCONT)
        assert "hung" in app.log()
        assert "ignored SIGTERM for 2 s; sending SIGKILL" in app.log()
        assert not alive({stopped})


def test_requests_stuck_on_a_frozen_engine_move_at_the_verdict_not_at_the_kill(
    tmp_path: Path,
) -> None:
    """Work waiting on a SIGSTOPped engine is given up the moment it is declared hung.

    Non-streamed answers not yet begun are retried on the other engine and succeed; a
    stream already under way ends with an error event. Both happen before the frozen
    tree's SIGTERM grace runs out (the kill), which is what the log order shows.
    """
    import threading

    import openai

    cfg = fake_engine_config(tmp_path, 2, "--token-delay-ms", "20", engine={"stop_timeout_s": 120})
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0, timeout=60)
        results: list[str] = []
        lock = threading.Lock()

        def ask(i: int) -> None:
            try:
                if i % 4 == 3:
                    stream = client.completions.create(
                        model="smollm2-135m-instruct", prompt="x", max_tokens=100, stream=True
                    )
                    n = sum(1 for _ in stream)
                    out = f"stream ok {n}"
                else:
                    r = client.completions.create(
                        model="smollm2-135m-instruct", prompt="x", max_tokens=100
                    )
                    out = "ok" if r.choices[0].text else "empty"
            except openai.APIError as exc:
                out = f"error {type(exc).__name__}: {exc}"
            with lock:
                results.append(out)

        frozen = app.engine_stats(0)["pid"]  # type: ignore[index]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        # 100 tokens × 20 ms: every request is still on its engine when engine 0 freezes.
        app.wait_for(
            lambda: (s := app.engine_stats(0)) is not None and s["running"] >= 2, 5, "work on e0"
        )
        os.kill(frozen, signal.SIGSTOP)
        try:
            for th in threads:
                th.join(60)
            app.wait_for(lambda: not alive({frozen}), 30, "frozen engine killed")
        finally:
            if alive({frozen}):
                os.kill(frozen, signal.SIGCONT)
        log = app.log()
        assert len(results) == 8
        # Every non-streamed request was answered (the stuck ones by engine 1) ...
        plain = [r for r in results if not r.startswith(("stream", "error"))]
        assert plain == ["ok"] * len(plain) and len(plain) >= 5, results
        # ... a stream cut on the frozen engine got an error, never a silent truncation.
        for r in results:
            if r.startswith("stream ok "):
                assert int(r.split()[-1]) >= 100, results  # whole, from engine 1
            else:
                assert r == "ok" or r.startswith("error APIError"), results
        moved = log.index("the engine stopped answering); retrying on another engine")
        assert "gave up" in log and "on the hung engine" in log
        assert moved < log.index("ignored SIGTERM for 2 s; sending SIGKILL"), log[-3000:]


def test_hung_engine_that_still_answers_health_is_replaced(tmp_path: Path) -> None:
    # vllm#39863: /health says 200 while no token ever comes back.
    cfg = fake_engine_config(tmp_path, 1)
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        pid = app.engine_stats(0)["pid"]  # type: ignore[index]
        app.engine_control(0, hang=True)
        app.wait_for(
            lambda: (s := app.engine_stats(0)) is not None and s["pid"] != pid,
            30,
            "hung engine replaced",
        )
        assert "hung" in app.log()


def test_engine_that_exits_at_once_backs_off_then_fails_and_daemon_exits_3(tmp_path: Path) -> None:
    cfg = fake_engine_config(
        tmp_path,
        2,
        "--exit-immediately",
        "7",
        restart={"max_restarts_per_hour": 2, "backoff_initial_s": 0.2, "backoff_max_s": 0.4},
    )
    with run_appliance(tmp_path, cfg) as app:
        code = app.wait_exit(60)
        log = app.log()
    assert code == 3, log[-3000:]
    assert "exited with status 7 while starting" in log
    assert "restarting in 0.2 s" in log and "restarting in 0.4 s" in log  # backoff doubles
    assert "engine0: EXITED -> FAILED" in log and "engine1: EXITED -> FAILED" in log
    assert "no engine could be started" in log


def test_notify_messages_in_order_and_children_do_not_inherit_socket(tmp_path: Path) -> None:
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.2)
    messages: list[str] = []

    def drain() -> None:
        while True:
            try:
                messages.append(sock.recv(4096).decode())
            except TimeoutError:
                return

    def lines() -> list[str]:
        return [line for m in messages for line in m.split("\n")]

    def drain_until(cond: Any, what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            drain()
            if cond(lines()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} from the daemon: {lines()}")

    cfg = fake_engine_config(tmp_path, 2, "--startup-delay", "1")
    env = {"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "2000000"}
    try:
        with run_appliance(tmp_path, cfg, env=env) as app:
            env["WATCHDOG_PID"] = str(app.proc.pid)
            app.wait_all_ready()
            drain_until(
                lambda flat: (
                    "READY=1" in flat
                    and "WATCHDOG=1" in flat[flat.index("READY=1") :]
                    and any(m.startswith("STATUS=2/2 engines ready") for m in flat)
                ),
                "READY, then a watchdog ping and STATUS=2/2",
            )
            for i in range(2):
                engine_env = psutil.Process(app.engine_stats(i)["pid"]).environ()  # type: ignore[index]
                assert "NOTIFY_SOCKET" not in engine_env
                assert "WATCHDOG_USEC" not in engine_env
            app.signal(signal.SIGHUP)
            drain_until(
                lambda flat: (
                    "RELOADING=1" in flat and "READY=1" in flat[flat.index("RELOADING=1") :]
                ),
                "RELOADING then READY after SIGHUP",
            )
            app.signal(signal.SIGTERM)
            assert app.wait_exit() == 0
            drain()
    finally:
        sock.close()
    flat = [line for m in messages for line in m.split("\n")]
    ready = flat.index("READY=1")
    # Engines took a second to load: the start timeout was extended before READY.
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in flat[:ready])
    assert any(m.startswith("STATUS=0/2 engines ready") for m in flat[:ready])
    assert any(m.startswith("STATUS=2/2 engines ready") for m in flat)
    assert "WATCHDOG=1" in flat[ready:]
    reloading = flat.index("RELOADING=1")
    assert reloading > ready and "READY=1" in flat[reloading:]
    stopping = flat.index("STOPPING=1")
    assert stopping > reloading
    # The stop moves systemd's stop deadline at once: a drain outlasting TimeoutStopSec
    # is not killed (issue 16, item 8).
    assert flat[stopping + 1].startswith("EXTEND_TIMEOUT_USEC=")


def test_sighup_keeps_engines_running(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1)
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        pid = app.engine_stats(0)["pid"]  # type: ignore[index]
        cfg_path = tmp_path / "config.toml"
        cfg_path.write_text(
            cfg_path.read_text().replace("port_base", "max_inflight = 3\nport_base")
        )
        app.signal(signal.SIGHUP)
        app.wait_for(lambda: "reload applied: engine.max_inflight" in app.log(), 5, "reload")
        assert app.engine_stats(0)["pid"] == pid  # type: ignore[index]
        cfg_path.write_text(cfg_path.read_text().replace("max_inflight = 3", "max_inflight = 0"))
        app.signal(signal.SIGHUP)
        app.wait_for(lambda: "reload refused" in app.log(), 5, "bad reload refused")
        assert "engine.max_inflight = 0: must be >= 1" in app.log()
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 10, "readyz 200")


def test_second_sigint_stops_at_once(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1, "--spawn-child", "--token-delay-ms", "200")
    with run_appliance(tmp_path, cfg) as app:
        app.wait_ready()
        pids = app.remember_tree()
        app.signal(signal.SIGINT)
        # The second SIGINT must come after the first was acted on, or it is not second.
        app.wait_for(lambda: "SIGINT: stopping gracefully" in app.log(), 10, "first SIGINT")
        app.signal(signal.SIGINT)
        started = time.monotonic()
        assert app.wait_exit(15) == 0
        assert time.monotonic() - started < 10
        assert "second SIGINT" in app.log()
        assert alive(pids) == set()


def test_foreign_process_on_engine_port_is_named_not_killed(tmp_path: Path) -> None:
    cfg = fake_engine_config(
        tmp_path,
        1,
        engine={"listen": "tcp"},
        restart={"max_restarts_per_hour": 1, "backoff_initial_s": 0.1},
    )
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", cfg["engine"]["port_base"]))
    squatter.listen()
    try:
        with run_appliance(tmp_path, cfg) as app:
            code = app.wait_exit(30)
            log = app.log()
        assert code == 3
        assert f"port {cfg['engine']['port_base']} is already in use by" in log
        assert f"(pid {os.getpid()})" in log
        assert squatter.fileno() != -1  # still ours, still listening
    finally:
        squatter.close()


def test_bad_config_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1, engine={"max_inflight": -1, "devcie": "cpu"})
    with run_appliance(tmp_path, cfg) as app:
        code = app.wait_exit()
        log = app.log()
    assert code == 2
    assert "engine.max_inflight = -1: must be >= 1" in log
    assert "engine.devcie: unknown key (did you mean 'device'?)" in log
    assert "starting on" not in log


def test_missing_engine_venv_names_the_setup_command(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1)
    del cfg["engine"]["command"]  # the real vLLM command line, from an empty set-up home
    with run_appliance(tmp_path, cfg, env={"LLM_APPLIANCE_HOME": str(tmp_path / "empty")}) as app:
        code = app.wait_exit()
        log = app.log()
    assert code == 3
    assert "llm-appliance setup" in log and "engine venv" in log


def test_gateway_port_taken_is_named(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 1)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", cfg["gateway"]["port"]))
    squatter.listen()
    try:
        with run_appliance(tmp_path, cfg) as app:
            code = app.wait_exit()
            log = app.log()
        assert code == 1
        assert f"cannot listen on 127.0.0.1:{cfg['gateway']['port']}" in log
        assert "starting on" not in log
    finally:
        squatter.close()


def test_missing_config_file_is_exit_2(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "check-config",
            "--config",
            str(tmp_path / "nope.toml"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert out.returncode == 2
    assert "no such file" in out.stderr


def _engine_state(app: Any, key: str, i: int) -> str | None:
    code, body = get_json(app.url + "/admin/status", headers={"Authorization": f"Bearer {key}"})
    return body["engines"][i]["state"] if code == 200 else None


def test_a_frozen_engine_gets_no_new_work_from_its_first_failed_check(tmp_path: Path) -> None:
    """SIGSTOP one of two engines: it is out of routing (SUSPECT) after one failed check,
    not after failures_to_restart of them; SIGCONT before the verdict brings it back
    with nothing restarted."""
    import openai

    interval, probe = 1.0, 3.0
    cfg = fake_engine_config(
        tmp_path,
        2,
        health={"interval_s": interval, "probe_timeout_s": probe, "failures_to_restart": 6},
    )
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()  # engine 0 READY before the freeze, or it never turns SUSPECT
        key = (tmp_path / "admin.key").read_text().strip()
        client = openai.OpenAI(base_url=app.url + "/v1", api_key=key, max_retries=0, timeout=60)
        stats = app.engine_stats(0)
        assert stats is not None
        frozen_pid = int(stats["pid"])
        os.kill(frozen_pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            # A check that started just before the freeze ends well; the next one starts
            # up to interval_s later and fails after probe_timeout_s. The wait allows a
            # loaded machine some slack; the log line proves it was the first failure.
            app.wait_for(
                lambda: _engine_state(app, key, 0) == "SUSPECT",
                2 * (probe + interval) + 2.0,
                "engine0 SUSPECT",
            )
            suspect_after = time.monotonic() - frozen_at
            assert "engine0: health check failed (1/6)" in app.log()
            # Every request from now on goes to engine1: one sent to the frozen engine
            # could not be answered before SIGCONT (or the hung verdict, 6 checks away).
            for _ in range(10):
                r = client.completions.create(
                    model="smollm2-135m-instruct", prompt="x", max_tokens=3, timeout=2.5
                )
                assert r.choices[0].text
            assert _engine_state(app, key, 0) == "SUSPECT"
            req = urllib.request.Request(
                app.url + "/metrics", headers={"Authorization": f"Bearer {key}"}
            )
            with urllib.request.urlopen(req, timeout=5) as resp:
                metrics = resp.read().decode()
            assert 'appliance_engine_state{engine="0",state="SUSPECT"} 1.0' in metrics
        finally:
            os.kill(frozen_pid, signal.SIGCONT)
        app.wait_for(
            lambda: _engine_state(app, key, 0) == "READY", probe + interval + 2.0, "READY again"
        )
        code, body = get_json(app.url + "/admin/status", headers={"Authorization": f"Bearer {key}"})
        assert code == 200
        engine0 = body["engines"][0]
        assert engine0["restarts"] == 0 and engine0["pid"] == frozen_pid
        assert "hung" not in app.log()
        print(f"\n[suspect] engine0 out of routing {suspect_after:.1f} s after SIGSTOP")
