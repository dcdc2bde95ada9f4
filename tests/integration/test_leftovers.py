"""Engines die with their supervisor, and a new life sweeps what an old one left.

As an operator meets it outside systemd (./scripts/run, tmux, a container without init):
`kill -9` of `serve` must not leave engines running, and a `serve` started again on the
same config must stop (and name) the engines a previous life left, never anyone else's.
The fake engine's --spawn-child stands for vLLM's EngineCore, which does not watch its
parent (see fake_engine.child_main).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from appliance.engine import INSTANCE_ENV, SUPERVISOR_ENV
from appliance.proctree import TAG_ENV
from tests.fakes.appliance_proc import alive, fake_engine_config, get_json, run_appliance
from tests.fakes.engine_proc import (
    FAKE_ENGINE_PATH,
    free_port,
    kill_group,
    stop_fake_engine,
    wait_healthy,
)
from tests.fakes.uds_http import uds_request

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
DEATH_S = 2.0  # the requirement: no engine process left this long after kill -9 of serve


def wait_gone(pids: set[int], within_s: float) -> set[int]:
    """Await the condition "none of ``pids`` alive" up to a deadline; what is left."""
    deadline = time.monotonic() + within_s
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def stream_forever(url: str, key: str, stop: threading.Event) -> None:
    """One long streaming completion through the gateway, until the daemon dies."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    with contextlib.suppress(openai.APIError):
        for _ in client.completions.create(model=MODEL, prompt="x", max_tokens=4000, stream=True):
            if stop.is_set():
                return


def test_sigkill_of_serve_under_load_leaves_no_engine_process(tmp_path: Path) -> None:
    cfg = fake_engine_config(tmp_path, 2, "--spawn-child", "--token-delay-ms", "50")
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        key = (tmp_path / "admin.key").read_text().strip()
        stop = threading.Event()
        streams = [
            threading.Thread(target=stream_forever, args=(app.url, key, stop), daemon=True)
            for _ in range(4)
        ]
        for t in streams:
            t.start()

        def both_streaming() -> bool:
            auth = {"Authorization": f"Bearer {key}"}
            _, body = get_json(app.url + "/admin/status", headers=auth)
            return bool(body) and all(e["inflight"] >= 1 for e in body["engines"])

        app.wait_for(both_streaming, 20, "requests streaming on both engines")
        pids = app.remember_tree()
        cores = {app.engine_stats(i)["child_pid"] for i in range(2)}  # type: ignore[index]
        assert cores <= pids and len(pids) >= 4  # 2 API servers + 2 "EngineCores"
        app.proc.send_signal(signal.SIGKILL)
        app.proc.wait(10)
        left = wait_gone(pids, DEATH_S)
        stop.set()
        assert left == set(), [(p, psutil.Process(p).cmdline()) for p in left]
    # Started again on the same config: nothing of the old life is in its way.
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        assert "left behind" not in app.log()


def old_engine(argv_tail: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A fake engine as a supervisor spawns one: its own session, an explicit environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLM_APPLIANCE_")}
    return subprocess.Popen(
        [sys.executable, FAKE_ENGINE_PATH, "--served-model-name", MODEL, *argv_tail],
        env={**base, "VLLM_API_KEY": "eng-old", **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def wait_listening(proc: subprocess.Popen[bytes], where: str) -> None:
    if not where.startswith("/"):
        wait_healthy(int(where), proc)
        return
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError):
            if uds_request(where, "GET", "/health")[0] == 200:
                return
        assert proc.poll() is None and time.monotonic() < deadline, f"no engine on {where}"
        time.sleep(0.05)


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_new_life_stops_an_older_versions_engines_and_nothing_else(
    tmp_path: Path, listen: str
) -> None:
    cfg = fake_engine_config(tmp_path, 2, "--spawn-child", engine={"listen": listen})
    run_dir = tmp_path / "run"  # where run_appliance has the daemon put engine sockets
    run_dir.mkdir(mode=0o700)
    port_base = cfg["engine"]["port_base"]
    addrs = [
        str(run_dir / f"engine{i}.sock") if listen == "unix" else str(port_base + i)
        for i in range(2)
    ]
    flag = "--uds" if listen == "unix" else "--port"
    # What an older version's supervisor left when it was killed: the tag only.
    orphans = [
        old_engine([flag, a, "--spawn-child"], {TAG_ENV: f"0badc0de-{i}"})
        for i, a in enumerate(addrs)
    ]
    # Not ours: another appliance's engine (its supervisor gone too; even its engine tag
    # is the same as an orphan's), and an untagged one.
    other = old_engine(
        ["--port", str(free_port())],
        {TAG_ENV: "0badc0de-0", INSTANCE_ENV: "f" * 16, SUPERVISOR_ENV: "1@0.00"},
    )
    stranger = old_engine(["--port", str(free_port())], {})
    bystanders = [other, stranger]
    try:
        for p, a in zip(orphans, addrs, strict=True):
            wait_listening(p, a)
        old_pids = {p.pid for p in orphans}
        old_pids |= {c.pid for p in orphans for c in psutil.Process(p.pid).children()}
        assert len(old_pids) == 4  # 2 API servers + their "EngineCores"
        with run_appliance(tmp_path, cfg) as app:
            app.wait_all_ready()
            lines = [line for line in app.log().splitlines() if "left behind" in line]
            assert len(lines) == 1, lines
            for pid in old_pids:
                assert f"pid {pid} " in lines[0], (pid, lines[0])
            assert alive(old_pids) == set()
            assert all(p.poll() is None for p in bystanders)
            for p in bystanders:
                assert f"pid {p.pid} " not in lines[0]
    finally:
        for p in orphans + bystanders:
            stop_fake_engine(p, timeout=1.0)
            kill_group(p.pid)  # their "EngineCores" too, should the sweep not have run
