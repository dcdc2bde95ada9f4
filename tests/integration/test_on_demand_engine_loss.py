"""An on-demand model's engine drained or killed is answered as an always-loaded model's
(issue 33 item 11), with fake engines on CPU.

"chat" is always loaded and "od" loads on demand, one engine each. For both:

- its only engine drained by an admin (``?force=true``): a request gets 503 at once,
  naming the drain, with Retry-After (before: "od"'s request waited its whole
  load_timeout_s, then 503 ``model_loading``; "chat"'s its queue_timeout_s), and so does
  one already waiting when the drain came; after the resume it is served;
- its engine killed (SIGKILL): a request right after is served once the engine is back
  (it waits in the queue; it is never a 502 for the dead socket).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.appliance_proc import (
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
)
from tests.fakes.http_json import call_json

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
QUEUE_TIMEOUT_S = 20
LOAD_TIMEOUT_S = 60


class Box:
    def __init__(self, app: Appliance, key: str) -> None:
        self.app, self.key = app, key

    def call(
        self, method: str, path: str, body: Any = None, timeout: float = 90
    ) -> tuple[int, Any]:
        return call_json(self.app.url, self.key, method, path, body, timeout)

    def chat(self, model: str, timeout: float = 90) -> tuple[int, Any]:
        body = {"model": model, "messages": MSGS, "max_tokens": 2}
        return self.call("POST", "/v1/chat/completions", body, timeout)

    def engine(self, model: str) -> dict[str, Any]:
        code, body = self.call("GET", "/admin/status", timeout=5)
        assert code == 200, body
        (e,) = [e for e in body["engines"] if e["model"] == model]
        return dict(e)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("on_demand_engine_loss")
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        1,
        health=STEADY_HEALTH,
        gateway={"queue_timeout_s": QUEUE_TIMEOUT_S},
        restart={"backoff_initial_s": 0.5, "backoff_max_s": 1},
    )
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "od", "cpu_engines": 1, "load": "on_demand", "load_timeout_s": LOAD_TIMEOUT_S},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_for(lambda: (tmp / "admin.key").exists(), 60, "the first admin key")
        app.wait_for(lambda: get_json(app.url + "/readyz")[0] == 200, 60, "the daemon started")
        b = Box(app, (tmp / "admin.key").read_text().strip())
        code, body = b.chat("od")  # loaded
        assert code == 200, body
        yield b


@pytest.mark.parametrize("model", ["chat", "od"])
def test_a_model_whose_only_engine_is_drained_is_refused_at_once(box: Box, model: str) -> None:
    eid = box.engine(model)["id"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        code, body = box.call("POST", f"/admin/engines/{eid}/drain?force=true")
        assert code == 200, body
        try:
            began = time.monotonic()
            code, body = box.chat(model)
            assert code == 503, body
            assert time.monotonic() - began < QUEUE_TIMEOUT_S / 2, body  # no queue or load wait
            assert body["error"]["code"] == "no_engine", body
            message = body["error"]["message"]
            assert f"'{model}'" in message and "drained" in message, message
            assert f"/admin/engines/{eid}/resume" in message, message
        finally:
            code, body = box.call("POST", f"/admin/engines/{eid}/resume")
            assert code == 200, body
        assert box.chat(model)[0] == 200
        # One already waiting when the last engine is drained is refused then too.
        box.app.engine_control(eid, first_token_delay_ms=3000)
        try:
            busy = pool.submit(box.chat, model)
            box.app.wait_for(lambda: box.engine(model)["inflight"] == 1, 10, "one running")
            code, body = box.call("POST", f"/admin/engines/{eid}/drain?force=true")
            assert code == 200, body
            code, body = box.chat(model)
            assert code == 503 and "drained" in body["error"]["message"], body
            assert busy.result(30)[0] == 200  # what was running finishes
        finally:
            box.app.engine_control(eid, first_token_delay_ms=0)
            box.call("POST", f"/admin/engines/{eid}/resume")
        assert box.chat(model)[0] == 200


@pytest.mark.parametrize("model", ["chat", "od"])
def test_a_request_right_after_its_engine_is_killed_is_served(box: Box, model: str) -> None:
    engine = box.engine(model)
    os.kill(engine["pid"], signal.SIGKILL)
    code, body = box.chat(model)  # at once: the daemon may not have noticed yet
    assert code == 200, body
    box.app.wait_for(lambda: box.engine(model)["state"] == "READY", 30, "engine back")
    assert box.engine(model)["restarts"] == engine["restarts"] + 1
