"""Models on demand with ``swap = "sleep"``, on fake GPUs (issue 23).

The daemon sees one fake GPU through the GPU check's fake pynvml (a state directory
and a ``pynvml`` shim first on PYTHONPATH: tests/gpu_check/fake_nvml.py). Models "a"
and "b" take turns on GPU 0; their fake engines hold 40 % of its memory while awake
(``--gpu-share``) and give it back asleep (tests/fakes/fake_sleep.py), and a wake
takes 0.5 s. What is asserted is what a user and an operator see: answers, model
states, GPU memory in /admin/status, metrics and the journal.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    REPO,
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
)
from tests.fakes.http_json import call_json
from tests.gpu_check.fake_nvml import FAKE_DIR_ENV, default_gpu, write_shim, write_state

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]


class Box:
    def __init__(self, app: Appliance, key: str, nvml: Path) -> None:
        self.app, self.key, self.nvml = app, key, nvml

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        return call_json(self.app.url, self.key, method, path, body)

    def chat(self, model: str) -> tuple[int, Any]:
        body = {"model": model, "messages": MSGS, "max_tokens": 2}
        return self.call("POST", "/v1/chat/completions", body)

    def status(self) -> dict[str, Any]:
        code, body = self.call("GET", "/admin/status")
        assert code == 200, body
        return dict(body)

    def state(self, model: str) -> str:
        return str({m["name"]: m for m in self.status()["models"]}[model]["state"])

    def engine(self, model: str) -> dict[str, Any]:
        (e,) = [e for e in self.status()["engines"] if e["model"] == model]
        return dict(e)

    def engine_state(self, model: str) -> str:
        return str(self.engine(model)["state"])

    def a_loaded_b_asleep(self) -> None:
        for model in ("b", "a"):
            code, body = self.chat(model)
            assert code == 200, body
        self.wait(lambda: self.state("b") == "sleeping", "b asleep")

    def gpu_memory_gib(self) -> float:
        return float(self.status()["gpus"][0]["memory_used_bytes"]) / 2**30

    def wait(self, cond: Any, what: str, timeout: float = 60) -> None:
        self.app.wait_for(cond, timeout, what)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("on_demand_sleep")
    nvml = tmp / "nvml"
    write_state(nvml, [default_gpu(0)])
    write_shim(nvml)
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        2,
        health=STEADY_HEALTH,
        telemetry={"source": "nvml", "interval_s": 0.2},
        # Heat restarts on (the heat test): 1 s at the hard limit; never restored here.
        thermal={"heat_restart_after_s": 1, "heat_restore_after_s": 3600},
    )
    cfg["engine"]["device"] = "cuda"
    fake_gpu = [*cfg["engine"]["command"], "--gpu-share", "0.4", "--wake-delay-s", "0.5"]
    fake_gpu += ["--max-num-batched-tokens", "8192"]  # what a heat restart halves
    on_demand = {"load": "on_demand", "swap": "sleep", "gpus": [0], "min_residency_s": 0}
    cfg["models"] = [
        {"name": "a", **on_demand, "command": fake_gpu},
        {"name": "b", **on_demand, "command": fake_gpu},
    ]
    env = {FAKE_DIR_ENV: str(nvml), "PYTHONPATH": f"{nvml}:{REPO}"}
    with run_appliance(tmp, cfg, env) as app:
        app.wait_for(lambda: (tmp / "admin.key").exists(), 120, "the first admin key")
        b = Box(app, (tmp / "admin.key").read_text().strip(), nvml)
        # admin.key is written before the gateway listens, and until the start sweep is
        # over a request gets 503 starting: /readyz says both are past.
        b.wait(lambda: get_json(app.url + "/readyz")[0] == 200, "the daemon started")
        yield b


def test_a_box_of_on_demand_models_none_loaded_is_ready(box: Box) -> None:
    # Nothing runs, yet a request would load its model: /readyz (and /health, which
    # vllm-router waits on) say 200 and list the models as unloaded.
    box.wait(lambda: get_json(box.app.url + "/readyz")[0] == 200, "/readyz 200 (daemon started)")
    for path in ("/readyz", "/health"):
        code, body = box.call("GET", path)
        assert code == 200, (path, body)
        assert body["models"] == {"a": "unloaded", "b": "unloaded"}, body
        assert body["engines_admitting"] == [], body


def test_a_model_put_to_sleep_frees_its_gpu_memory_and_wakes_on_request(box: Box) -> None:
    idle_gib = box.gpu_memory_gib()
    code, body = box.chat("a")
    assert code == 200 and body["model"] == "a", body
    box.wait(lambda: box.gpu_memory_gib() > idle_gib + 30, "a's memory held")

    code, body = box.chat("b")  # a is drained and put to sleep; b starts cold
    assert code == 200 and body["model"] == "b", body
    assert box.state("a") == "sleeping"
    assert box.engine_state("a") == "SLEEPING"
    log = box.app.log()
    assert "model a: draining, then put to sleep: to make room for b" in log
    assert "model a: asleep" in log

    code, body = box.chat("a")  # b goes to sleep; a is woken, not started again
    assert code == 200 and body["model"] == "a", body
    assert box.state("b") == "sleeping"
    assert "model a: loading (wake;" in box.app.log()
    code, text = box.call("GET", "/metrics")
    assert 'appliance_model_loads_total{how="wake",model="a"} 1.0' in text
    # One engine's memory held (a's), the sleeping one's given back.
    assert box.gpu_memory_gib() < idle_gib + 0.4 * 80 + 1


def test_the_sleep_routes_exist_only_on_the_engines_socket(box: Box) -> None:
    for path in ("/sleep", "/wake_up", "/is_sleeping"):
        code, _ = box.call("POST" if path != "/is_sleeping" else "GET", path)
        assert code in (404, 405), path


def test_an_engine_that_crashes_while_waking_is_started_again_and_answers(box: Box) -> None:
    box.a_loaded_b_asleep()
    box.app.engine_control(box.engine("b")["id"], crash_on_wake=True)
    code, body = box.chat("b")  # a goes to sleep; b's wake dies halfway; b starts cold
    assert code == 200 and body["model"] == "b", body
    assert box.state("b") == "loaded"
    assert "could not wake" in box.app.log()
    assert box.engine("b")["state"] == "READY"


def test_heat_while_asleep_neither_wakes_nor_restarts_the_engine(box: Box) -> None:
    box.a_loaded_b_asleep()
    b = box.engine("b")
    write_state(box.nvml, [{**default_gpu(0), "temperature_c": 95}])  # the hard limit
    try:
        told = f"engine{b['id']}: GPU 0 at the hard limit"
        box.wait(lambda: told in box.app.log(), "b's engine told of the heat")
        now = box.engine("b")
        assert now["state"] == "SLEEPING", now  # asleep: kept for its next load
        assert (now["pid"], now["restarts"]) == (b["pid"], b["restarts"]), now
        assert box.state("b") == "sleeping"
    finally:
        write_state(box.nvml, [default_gpu(0)])
    box.wait(lambda: box.engine("a")["throttle_level"] == 0, "GPU 0 cool again")
    code, body = box.chat("b")  # woken on request as ever
    assert code == 200 and body["model"] == "b", body
    # (Restarted with halved batches once woken only while another engine serves: the
    # last engine serving is never taken out, and on this slot b is the only one.)
