"""Models on demand with ``swap = "stop"`` on a fake GPU: the next model of a slot starts
only once the last one's GPU memory is seen free (issue 23).

On a real GPU vLLM's EngineCore can hold its memory for seconds after the API server
exits (vllm#55510); a model started meanwhile cannot allocate its KV cache. Here the
daemon sees one fake GPU (the GPU check's fake pynvml, as in test_on_demand_sleep.py):
"a" and "b" take turns on it, and the test holds memory on it by hand (a holder record
for a process of its own, as an orphaned EngineCore would) while "a" is put away for
"b". What is asserted is what an operator sees: engine states, pids and the journal.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    REPO,
    STEADY_HEALTH,
    fake_engine_config,
    get_json,
    run_appliance,
)
from tests.fakes.http_json import call_json
from tests.gpu_check.fake_nvml import FAKE_DIR_ENV, default_gpu, write_shim, write_state

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]


def test_the_next_model_starts_only_once_the_last_ones_gpu_memory_is_free(
    tmp_path: Path,
) -> None:
    nvml = tmp_path / "nvml"
    write_state(nvml, [default_gpu(0)])
    write_shim(nvml)
    cfg: dict[str, Any] = fake_engine_config(
        tmp_path, 2, health=STEADY_HEALTH, telemetry={"source": "nvml", "interval_s": 0.2}
    )
    cfg["engine"]["device"] = "cuda"
    fake_gpu = [*cfg["engine"]["command"], "--gpu-share", "0.4"]
    on_demand = {"load": "on_demand", "swap": "stop", "gpus": [0], "min_residency_s": 0}
    cfg["models"] = [
        {"name": name, **on_demand, "load_timeout_s": 120, "command": fake_gpu}
        for name in ("a", "b")
    ]
    env = {FAKE_DIR_ENV: str(nvml), "PYTHONPATH": f"{nvml}:{REPO}"}
    holder = subprocess.Popen(["sleep", "600"])
    try:
        with run_appliance(tmp_path, cfg, env) as app:
            app.wait_for(lambda: (tmp_path / "admin.key").exists(), 120, "the first admin key")
            key = (tmp_path / "admin.key").read_text().strip()
            # /readyz: until the start sweep is over a request gets 503 starting.
            app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 60, "started")

            def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
                return call_json(app.url, key, method, path, body)

            def engine(model: str) -> dict[str, Any]:
                (e,) = [
                    e for e in call("GET", "/admin/status")[1]["engines"] if e["model"] == model
                ]
                return dict(e)

            chat = {"messages": MSGS, "max_tokens": 2}
            assert call("POST", "/v1/chat/completions", {"model": "a", **chat})[0] == 200
            # What outlives a's engine: 30 % of the GPU, held by a process of the test's.
            record = {"pid": holder.pid, "gpu": 0, "share": 0.3}
            (nvml / "procs" / f"{holder.pid}.json").write_text(json.dumps(record))

            answers: list[tuple[int, Any]] = []
            b = threading.Thread(
                target=lambda: answers.append(
                    call("POST", "/v1/chat/completions", {"model": "b", **chat})
                )
            )
            b.start()
            a_name = f"engine{engine('a')['id']}"
            waiting = f"{a_name}: waiting for GPU 0 memory to be freed"
            app.wait_for(lambda: waiting in app.log(), 60, "a stopped, its memory still held")
            assert engine("a")["state"] == "EXITED"
            # The slot is still a's: without the wait, b would be loading within a tick
            # (0.25 s) of a's EXITED. A non-event needs a window: ten of those ticks.
            for _ in range(5):
                e = engine("b")
                assert (e["state"], e["pid"]) == ("EXITED", None), e
                assert "model b: loading" not in app.log() and not answers
                time.sleep(0.5)
            holder.kill()
            holder.wait()
            b.join(120)
            assert answers and answers[0][0] == 200, answers
            log = app.log()
            assert log.index(waiting) < log.index("model a: unloaded")
            assert log.index("model a: unloaded") < log.index("model b: loading")
    finally:
        holder.kill()
        holder.wait()
