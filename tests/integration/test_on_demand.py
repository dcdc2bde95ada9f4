"""Models on demand (issue 23), end to end through the daemon with fake engines on CPU.

One daemon: "chat" is always loaded; "a", "b", "slow" and "broken" load on demand and,
on a CPU box, take turns on one share of the cores (one loaded at a time). "a" streams
slowly (a long stream can be watched finishing before "a" is put away); "b" is put away
after 4 s idle; "slow" takes 4 s to start (longer than its load_timeout_s); "broken"
exits as soon as it starts. What is asserted is what a user sees: answers, 503s naming
the model, /admin/status, /metrics, the journal and the audit trail.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
RESIDENCY_S = 3


class Box:
    def __init__(self, app: Appliance, key: str, audit: Path, notify: socket.socket) -> None:
        self.app, self.key, self.audit, self.notify = app, key, audit, notify
        self.notified: list[str] = []

    def systemd_heard(self) -> list[str]:
        with contextlib.suppress(BlockingIOError):
            while True:
                self.notified += self.notify.recv(4096).decode().split("\n")
        return self.notified

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 60
    ) -> tuple[int, dict[str, str], Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.app.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                try:
                    return r.status, dict(r.headers), json.loads(raw) if raw else None
                except ValueError:
                    return r.status, dict(r.headers), raw.decode()
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, dict(e.headers), json.loads(raw or b"null")
            except ValueError:
                return e.code, dict(e.headers), raw.decode(errors="replace")

    def chat(
        self, model: str, max_tokens: int = 2, timeout: float = 60, **extra: Any
    ) -> tuple[int, dict[str, str], Any]:
        body = {"model": model, "messages": MSGS, "max_tokens": max_tokens, **extra}
        return self.call("POST", "/v1/chat/completions", body, timeout)

    def models(self) -> dict[str, dict[str, Any]]:
        code, _, body = self.call("GET", "/admin/status")
        assert code == 200, body
        return {m["name"]: m for m in body["models"]}

    def state(self, model: str) -> str:
        return str(self.models()[model]["state"])

    def wait_state(self, model: str, state: str, timeout: float = 60) -> None:
        self.app.wait_for(lambda: self.state(model) == state, timeout, f"{model} {state}")

    def metric(self, name: str, **labels: str) -> float:
        code, _, text = self.call("GET", "/metrics")
        assert code == 200
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in str(text).splitlines():
            m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
            if m and ",".join(sorted(m.group(1).split(","))) == want:
                return float(m.group(2))
        return 0.0

    def loads(self, model: str) -> float:
        return self.metric("appliance_model_loads_total", model=model, how="cold")


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("on_demand")
    cfg: dict[str, Any] = fake_engine_config(
        tmp, 5, health=STEADY_HEALTH, restart={"max_restarts_per_hour": 2, "drain_timeout_s": 30}
    )
    command = cfg["engine"]["command"]
    on_demand = {"load": "on_demand", "min_residency_s": RESIDENCY_S, "load_timeout_s": 30}
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "a", **on_demand, "command": [*command, "--token-delay-ms", "40"]},
        {"name": "b", **on_demand, "idle_unload_s": 4},
        {
            "name": "slow",
            **on_demand,
            "load_timeout_s": 1,
            "command": [*command, "--startup-delay", "4"],
        },
        {
            "name": "broken",
            **on_demand,
            "load_timeout_s": 600,  # never waited out: it fails at once (no_engine)
            "command": [*command, "--exit-immediately", "3"],
        },
    ]
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp / "notify.sock"))
    notify.setblocking(False)
    try:
        with run_appliance(tmp, cfg, env={"NOTIFY_SOCKET": str(tmp / "notify.sock")}) as app:
            app.wait_ready()
            yield Box(app, (tmp / "admin.key").read_text().strip(), tmp / "audit.log", notify)
    finally:
        notify.close()


def test_every_model_is_listed_and_on_demand_ones_start_unloaded(box: Box) -> None:
    code, _, body = box.call("GET", "/v1/models")
    assert code == 200
    assert [m["id"] for m in body["data"]] == ["chat", "a", "b", "slow", "broken"]
    models = box.models()
    assert {n: (m["load"], m["state"]) for n, m in models.items()} == {
        "chat": ("always", "loaded"),
        "a": ("on_demand", "unloaded"),
        "b": ("on_demand", "unloaded"),
        "slow": ("on_demand", "unloaded"),
        "broken": ("on_demand", "unloaded"),
    }
    assert box.metric("appliance_model_loaded", model="a") == 0
    assert box.metric("appliance_model_loaded", model="chat") == 1
    # Put away is not down: /readyz says so (and the ModelDown alert stays silent).
    code, _, body = box.call("GET", "/readyz")
    assert code == 200 and body["models"]["a"] == "unloaded", body
    assert body["models"]["chat"] == "ready"


def test_systemd_hears_ready_while_on_demand_models_are_unloaded(box: Box) -> None:
    box.app.wait_for(lambda: "READY=1" in box.systemd_heard(), 30, "READY=1")
    assert box.state("a") == "unloaded"
    # The status line counts the engines that should run: "1/1 engines ready", not the
    # unloaded models' engines as EXITED.
    statuses = [m for m in box.systemd_heard() if m.startswith("STATUS=")]
    assert statuses and not any("EXITED" in m for m in statuses), statuses


def test_a_request_loads_its_model_and_is_answered(box: Box) -> None:
    code, _, body = box.chat("a")
    assert code == 200, body
    assert body["model"] == "a"
    assert box.state("a") == "loaded"
    assert box.models()["a"]["last_used"] is not None
    assert box.loads("a") == 1
    assert box.metric("appliance_model_loaded", model="a") == 1
    assert "model a: loaded (cold)" in box.app.log()


def test_the_gateway_never_relays_an_engines_development_routes(box: Box) -> None:
    for path in ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/reset_prefix_cache"):
        code, _, body = box.call("POST", path, {})
        assert code == 404, (path, body)
        code, _, _ = box.call("GET", path)
        assert code in (404, 405), path


def test_a_long_stream_finishes_before_its_model_is_swapped_out(box: Box) -> None:
    box.wait_state("a", "loaded")
    result: dict[str, Any] = {}

    def stream() -> None:  # about 2.4 s of tokens on "a"
        result["answer"] = box.chat("a", max_tokens=60, stream=True)

    t = threading.Thread(target=stream)
    t.start()
    box.app.wait_for(lambda: box.app.log().count("model a: loaded") >= 1, 10, "a loaded")
    code, _, body = box.chat("b")  # b must wait until a's stream is done and a is gone
    t.join(60)
    assert code == 200, body
    assert body["model"] == "b"
    s_code, _, s_body = result["answer"]
    assert s_code == 200
    assert (
        str(s_body).count('"finish_reason":"length"')
        + str(s_body).count('"finish_reason": "length"')
        == 1
    ), "a's stream ended before its last token"
    log = box.app.log()
    assert "model a: draining, then stopped: to make room for b (least recently used" in log
    assert log.index("model a: unloaded") < log.index("model b: loaded")
    assert box.state("a") == "unloaded"


def test_the_minimum_residency_damps_a_swap_storm(box: Box) -> None:
    before = box.loads("a") + box.loads("b")
    answers: list[int] = []

    def client(model: str) -> None:
        for _ in range(8):
            answers.append(box.chat(model)[0])

    threads = [threading.Thread(target=client, args=(m,)) for m in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [200] * 16
    swaps = box.loads("a") + box.loads("b") - before
    # Without the residency each request would swap (16 loads); with it each model
    # serves its client's requests in a run.
    assert swaps <= 4, swaps


def test_an_idle_model_is_put_away(box: Box) -> None:
    assert box.chat("b")[0] == 200
    box.wait_state("b", "unloaded", timeout=30)
    assert re.search(r"model b: draining, then stopped: idle for \d+ s", box.app.log())


def test_admin_load_and_unload_are_audited(box: Box) -> None:
    code, _, body = box.call("POST", "/admin/models/a/load")
    assert code == 202, body
    box.wait_state("a", "loaded")
    code, _, body = box.call("POST", "/admin/models/a/unload")
    assert code == 202, body
    box.wait_state("a", "unloaded")
    code, _, body = box.call("POST", "/admin/models/chat/unload")
    assert code == 409 and "always loaded" in body["error"]["message"]
    code, _, body = box.call("POST", "/admin/models/nope/load")
    assert code == 404
    lines = [json.loads(x) for x in box.audit.read_text().splitlines()]
    actions = [(x["action"], x["target"], x["outcome"]) for x in lines]
    assert ("model.load", "model:a", "ok") in actions
    assert ("model.unload", "model:a", "ok") in actions
    assert ("model.unload", "model:chat", "refused") in actions


def test_a_request_waits_at_most_load_timeout_s_then_503_naming_the_model(box: Box) -> None:
    code, headers, body = box.chat("slow")
    assert code == 503, body
    assert "the model 'slow' is not loaded" in body["error"]["message"]
    assert body["error"]["code"] == "model_loading"
    assert "Retry-After" in headers
    box.wait_state("slow", "loaded")  # it goes on loading; then it answers
    assert box.chat("slow")[0] == 200
    assert box.call("POST", "/admin/models/slow/unload")[0] == 202
    box.wait_state("slow", "unloaded")


def test_a_model_whose_engine_dies_while_starting_503s_and_frees_the_slot(box: Box) -> None:
    # Its engine exits at start until the crash budget is spent (FAILED): the request
    # waiting for its load is refused then, not after load_timeout_s (600 s), and so is
    # every later one, at once, without another load tried or logged.
    code, _, body = box.chat("broken", timeout=120)
    assert code == 503 and body["error"]["code"] == "no_engine", body
    assert "model 'broken'" in body["error"]["message"]
    box.wait_state("broken", "unloaded")
    assert "model broken: could not be loaded" in box.app.log()
    tries = box.app.log().count("model broken: loading")
    for _ in range(3):
        code, headers, body = box.chat("broken", timeout=10)
        assert (code, body["error"]["code"]) == (503, "no_engine"), body
        assert "model 'broken'" in body["error"]["message"] and "Retry-After" in headers
    assert box.app.log().count("model broken: loading") == tries
    assert box.chat("chat")[0] == 200  # the always model never noticed
    assert box.chat("a")[0] == 200  # and the slot is free for the others
