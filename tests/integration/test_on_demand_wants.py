"""Who may make an on-demand model load (issue 33 item 3), with fake engines on CPU.

"a" and "b" load on demand and take turns on the cores; "a" stays at least
``RESIDENCY_S`` once loaded, so a request for "b" that arrives then must wait for the
swap. A model is wanted only by a request that passed every check and still waits:

- a key past its rpm gets 429 for "b": "b" is not loaded, "a" not put away;
- a request for "b" whose client leaves before the swap: "b" is not loaded after it left;
- a load a request starts is counted to its key (``appliance_key_model_loads_total``).

A request refused with 503 did not use its model: a flood of refusals does not keep it
from its idle unload.

Then, with ``swap = "sleep"`` on a fake GPU: a model asleep for its ``idle_unload_s`` is
unloaded fully (its engine stopped), so its weights do not stay in host RAM for good.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
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
RESIDENCY_S = 4.0


class Box:
    def __init__(self, app: Appliance, key: str) -> None:
        self.app, self.key = app, key

    def chat(self, model: str, key: str | None = None, timeout: float = 60) -> tuple[int, Any]:
        body = {"model": model, "messages": MSGS, "max_tokens": 2}
        return call_json(
            self.app.url, key or self.key, "POST", "/v1/chat/completions", body, timeout
        )

    def state(self, model: str) -> str:
        code, body = call_json(self.app.url, self.key, "GET", "/admin/status", timeout=5)
        assert code == 200, body
        return str({m["name"]: m for m in body["models"]}[model]["state"])

    def engine_states(self, model: str) -> list[str]:
        code, body = call_json(self.app.url, self.key, "GET", "/admin/status", timeout=5)
        assert code == 200, body
        return [e["state"] for e in body["engines"] if e["model"] == model]

    def new_key(self, **fields: Any) -> tuple[str, str]:
        code, doc = call_json(
            self.app.url, self.key, "POST", "/admin/keys", {"name": "u", **fields}
        )
        assert code == 201, doc
        return doc["key"], doc["id"]

    def metric(self, name: str, **labels: str) -> float:
        code, text = call_json(self.app.url, self.key, "GET", "/metrics", timeout=5)
        assert code == 200
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in str(text).splitlines():
            m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
            if m and ",".join(sorted(m.group(1).split(","))) == want:
                return float(m.group(2))
        return 0.0

    def fresh_a(self) -> float:
        """ "a" loaded just now (its residency begins); when."""
        if self.state("a") != "unloaded":
            assert call_json(self.app.url, self.key, "POST", "/admin/models/a/unload")[0] in (
                200,
                202,
            )
            self.app.wait_for(lambda: self.state("a") == "unloaded", 60, "a unloaded")
        code, body = self.chat("a")
        assert code == 200, body
        return time.monotonic()

    def past_residency(self, since: float) -> None:
        """Until "a"'s residency is over and the swap policy has had a few ticks: what
        nobody wants is not loaded by then (nothing to wait for but time)."""
        time.sleep(max(0.0, since + RESIDENCY_S + 1.5 - time.monotonic()))


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("on_demand_wants")
    cfg: dict[str, Any] = fake_engine_config(tmp, 2, health=STEADY_HEALTH)
    on_demand = {"load": "on_demand", "min_residency_s": RESIDENCY_S, "load_timeout_s": 30}
    cfg["models"] = [{"name": "a", **on_demand}, {"name": "b", **on_demand}]
    with run_appliance(tmp, cfg) as app:
        app.wait_for(lambda: (tmp / "admin.key").exists(), 60, "the first admin key")
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 60, "the daemon started")
        yield Box(app, (tmp / "admin.key").read_text().strip())


def test_requests_refused_by_rate_never_load_a_model(box: Box) -> None:
    limited, limited_id = box.new_key(rpm=1)
    since = box.fresh_a()
    assert box.chat("a", limited)[0] == 200  # its one request this minute
    for _ in range(3):
        code, body = box.chat("b", limited)
        assert code == 429, body
    box.past_residency(since)
    assert box.state("b") == "unloaded" and box.state("a") == "loaded"
    assert (
        box.metric("appliance_key_model_loads_total", key_id=limited_id, model="b", how="cold") == 0
    )


def test_a_request_that_left_no_longer_wants_its_model(box: Box) -> None:
    since = box.fresh_a()
    # Waits for "a"'s residency to end, but its client gives up after 1 s.
    with pytest.raises(TimeoutError):
        box.chat("b", timeout=1)
    box.past_residency(since)
    assert box.state("b") == "unloaded" and box.state("a") == "loaded"


def test_a_load_is_counted_to_the_key_whose_request_started_it(box: Box) -> None:
    key, key_id = box.new_key()
    box.fresh_a()
    code, body = box.chat("b", key)  # waits out "a"'s residency, then "b" loads
    assert code == 200, body
    assert box.metric("appliance_key_model_loads_total", key_id=key_id, model="b", how="cold") == 1
    assert f"model b: a cold load asked for by key {key_id}" in box.app.log()


@pytest.fixture(scope="module")
def asleep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    """Two on-demand models with swap = "sleep" taking turns on one fake GPU."""
    tmp = tmp_path_factory.mktemp("on_demand_asleep")
    nvml = tmp / "nvml"
    write_state(nvml, [default_gpu(0)])
    write_shim(nvml)
    cfg: dict[str, Any] = fake_engine_config(
        tmp, 2, health=STEADY_HEALTH, telemetry={"source": "nvml", "interval_s": 0.2}
    )
    cfg["engine"]["device"] = "cuda"
    fake_gpu = [*cfg["engine"]["command"], "--gpu-share", "0.4", "--wake-delay-s", "0.2"]
    on_demand = {"load": "on_demand", "swap": "sleep", "gpus": [0], "min_residency_s": 0}
    cfg["models"] = [
        {"name": "a", **on_demand, "idle_unload_s": 3, "command": fake_gpu},
        {"name": "b", **on_demand, "idle_unload_s": 600, "command": fake_gpu},
    ]
    env = {FAKE_DIR_ENV: str(nvml), "PYTHONPATH": f"{nvml}:{REPO}"}
    with run_appliance(tmp, cfg, env) as app:
        app.wait_for(lambda: (tmp / "admin.key").exists(), 120, "the first admin key")
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 60, "the daemon started")
        yield Box(app, (tmp / "admin.key").read_text().strip())


def test_a_model_asleep_for_its_idle_unload_s_is_unloaded_fully(asleep: Box) -> None:
    assert asleep.chat("a")[0] == 200
    assert asleep.chat("b")[0] == 200  # "a" is put to sleep (idle, or to make room)
    asleep.app.wait_for(lambda: "model a: asleep" in asleep.app.log(), 60, "a asleep")
    # Its idle_unload_s later: its engine stopped, not asleep any more (its weights
    # leave host RAM), while "b" holds the GPU.
    asleep.app.wait_for(lambda: asleep.state("a") == "unloaded", 30, "a unloaded from sleep")
    asleep.app.wait_for(lambda: asleep.engine_states("a") == ["EXITED"], 30, "a's engine stopped")
    assert "model a: unloading from sleep: asleep for" in asleep.app.log()
    assert asleep.state("b") == "loaded"
    # Wanted again: a cold load, answered.
    assert asleep.chat("a")[0] == 200


IDLE_S = 3.0


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    """One on-demand model put away after ``IDLE_S`` without a use."""
    tmp = tmp_path_factory.mktemp("on_demand_idle")
    cfg: dict[str, Any] = fake_engine_config(tmp, 1, health=STEADY_HEALTH)
    cfg["models"] = [
        {"name": "c", "load": "on_demand", "idle_unload_s": IDLE_S, "min_residency_s": 0}
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_for(lambda: (tmp / "admin.key").exists(), 60, "the first admin key")
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 60, "the daemon started")
        yield Box(app, (tmp / "admin.key").read_text().strip())


def test_refused_requests_do_not_keep_a_model_in_use(idle: Box) -> None:
    """A request refused with 503 did not use its model: a flood of them (here: its only
    engine drained, so each is refused at once) neither moves the model's ``last_used``
    nor keeps it from its idle unload (before: every refusal marked it used, and it
    stayed loaded for as long as the refusals came)."""
    code, body = idle.chat("c")  # loads it; its one use
    assert code == 200, body

    def model() -> dict[str, Any]:
        code, doc = call_json(idle.app.url, idle.key, "GET", "/admin/status", timeout=5)
        assert code == 200, doc
        return dict({m["name"]: m for m in doc["models"]}["c"])

    used = model()["last_used"]
    code, doc = call_json(idle.app.url, idle.key, "GET", "/admin/status", timeout=5)
    (eid,) = [e["id"] for e in doc["engines"] if e["model"] == "c"]
    code, body = call_json(idle.app.url, idle.key, "POST", f"/admin/engines/{eid}/drain?force=true")
    assert code == 200, body

    put_away = "model c: draining, then stopped: idle for"

    def refused_until_put_away() -> bool:
        if put_away in idle.app.log():
            return True
        code, body = idle.chat("c")
        if code == 200:  # came just after the put-away: it loaded "c" again
            assert put_away in idle.app.log(), body
            return True
        assert code == 503 and body["error"]["code"] == "no_engine", body
        assert model()["last_used"] == used  # refused: not a use
        return False

    # Refused again and again (several a second) until it is put away for idleness.
    idle.app.wait_for(refused_until_put_away, IDLE_S + 20, "c put away while refusals came")
