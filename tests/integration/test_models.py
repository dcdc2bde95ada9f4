"""Several models on one box, end to end through the daemon with fake engines.

Two ``[[models]]`` on CPU, one fake engine each: "chat" (generate, alias "gpt-4o-mini")
and "embed" (embed, alias "text-embedding-3-small"). A fake engine answers only the
name it was started with (``--served-model-name``; any other name is its 404), so a
request that reaches the wrong model's engine, or an alias not rewritten, cannot pass
unseen. ``file:`` telemetry heats one engine (CPU engine i is sensors entry i).

One daemon for the module: each test puts back what it changed (resume, cool down).
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.fakes.appliance_proc import (
    STEADY_HEALTH,
    Appliance,
    fake_engine_config,
    get_json,
    run_appliance,
)

pytestmark = pytest.mark.slow

CHAT, CHAT_ALIAS = "chat", "gpt-4o-mini"
EMBED, EMBED_ALIAS = "embed", "text-embedding-3-small"
QUEUE_TIMEOUT_S = 1
MSGS = [{"role": "user", "content": "hi"}]


def write_sensors(path: Path, temps: list[float]) -> None:
    gpus = [
        {
            "index": i,
            "temperature_c": t,
            "power_w": 100,
            "power_limit_w": 450,
            "memory_used_bytes": 0,
            "memory_total_bytes": 1 << 34,
            "utilization": 0.5,
            "throttle_reasons": [],
        }
        for i, t in enumerate(temps)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)


class Box:
    def __init__(self, app: Appliance, key: str, sensors: Path) -> None:
        self.app = app
        self.key = key
        self.sensors = sensors

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10
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
                return r.status, dict(r.headers), json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), json.loads(e.read() or b"null")

    def chat(self, model: str = CHAT) -> tuple[int, dict[str, str], Any]:
        return self.call(
            "POST", "/v1/chat/completions", {"model": model, "messages": MSGS, "max_tokens": 2}
        )

    def embed(self, model: str = EMBED) -> tuple[int, dict[str, str], Any]:
        return self.call("POST", "/v1/embeddings", {"model": model, "input": "hello"})

    def engines(self) -> list[dict[str, Any]]:
        code, _, body = self.call("GET", "/admin/status")
        assert code == 200, body
        return list(body["engines"])

    def engine_of(self, model: str) -> dict[str, Any]:
        (engine,) = [e for e in self.engines() if e["model"] == model]
        return engine

    def metrics(self) -> str:
        req = urllib.request.Request(
            self.app.url + "/metrics", headers={"Authorization": f"Bearer {self.key}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            return str(r.read().decode())

    def routes_served(self, model: str) -> dict[str, int]:
        stats = self.app.engine_stats(self.engine_of(model)["id"])
        assert stats is not None
        return dict(stats["requests_by_route"])

    def wait_state(self, model: str, state: str, timeout: float = 20) -> None:
        self.app.wait_for(
            lambda: self.engine_of(model)["state"] == state, timeout, f"{model} engine {state}"
        )


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("models")
    sensors = tmp / "sensors.json"
    write_sensors(sensors, [50, 50])
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        2,  # [engine]'s cpu_engines: each model sets its own; the helpers count 2
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
        gateway={"queue_timeout_s": QUEUE_TIMEOUT_S},
        health=STEADY_HEALTH,
    )
    # The embedding engine takes 2 s to come up, so a killed one stays down long
    # enough for its requests to time out in the queue.
    slow_start = [*cfg["engine"]["command"], "--startup-delay", "2"]
    cfg["models"] = [
        {"name": CHAT, "aliases": [CHAT_ALIAS], "cpu_engines": 1},
        {
            "name": EMBED,
            "aliases": [EMBED_ALIAS],
            "task": "embed",
            "model": str(tmp),  # any folder: the fake engine loads nothing
            "cpu_engines": 1,
            "command": slow_start,
        },
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip(), sensors)


def test_v1_models_lists_every_name_and_alias(box: Box) -> None:
    code, _, body = box.call("GET", "/v1/models")
    assert code == 200
    assert [m["id"] for m in body["data"]] == [CHAT, CHAT_ALIAS, EMBED, EMBED_ALIAS]
    assert {m["owned_by"] for m in body["data"]} == {"llm-appliance"}


def test_requests_go_to_the_engine_of_the_model_named_by_name_or_alias(box: Box) -> None:
    for name in (CHAT, CHAT_ALIAS):
        code, _, body = box.chat(name)
        assert code == 200, body
        assert body["model"] == CHAT  # the alias was rewritten: the engine knows "chat" only
    code, _, body = box.call(
        "POST", "/v1/completions", {"model": CHAT_ALIAS, "prompt": "hi", "max_tokens": 2}
    )
    assert code == 200 and body["model"] == CHAT, body
    for name in (EMBED, EMBED_ALIAS):
        code, _, body = box.embed(name)
        assert code == 200, body
        assert body["model"] == EMBED and len(body["data"]) == 1
    # Each engine got its own model's work only.
    assert "/v1/embeddings" not in box.routes_served(CHAT)
    assert "/v1/chat/completions" not in box.routes_served(EMBED)
    stats = box.app.engine_stats(box.engine_of(CHAT)["id"])
    assert stats is not None and stats["last_request"]["body"]["model"] == CHAT


def test_an_unknown_model_is_404_naming_the_models_served(box: Box) -> None:
    code, _, body = box.call(
        "POST", "/v1/chat/completions", {"model": "gpt-9", "messages": MSGS, "max_tokens": 2}
    )
    assert code == 404
    err = body["error"]
    assert (err["type"], err["code"]) == ("not_found_error", "model_not_found")
    assert err["param"] == "model"
    for name in (CHAT, CHAT_ALIAS, EMBED, EMBED_ALIAS):
        assert name in err["message"]


def test_a_route_the_model_does_not_serve_is_400_naming_its_routes(box: Box) -> None:
    code, _, body = box.chat(EMBED_ALIAS)
    assert code == 400
    err = body["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "model_wrong_route",
        "model",
    )
    assert "'embed'" in err["message"] and "/v1/embeddings" in err["message"]
    code, _, body = box.embed(CHAT)
    assert code == 400 and body["error"]["code"] == "model_wrong_route"
    assert "/v1/chat/completions" in body["error"]["message"]
    assert "/v1/completions" in body["error"]["message"]


def test_status_and_metrics_carry_model_and_gpus(box: Box) -> None:
    engines = box.engines()
    assert sorted(e["model"] for e in engines) == [CHAT, EMBED]
    assert all(e["gpus"] == [] and e["gpu"] is None for e in engines)
    assert box.chat(CHAT_ALIAS)[0] == 200
    assert box.call("POST", "/v1/embeddings", {"model": "nope", "input": "x"})[0] == 404
    text = box.metrics()
    for e in engines:
        assert f'appliance_engine_info{{engine="{e["id"]}",gpus="",model="{e["model"]}"}} 1.0' in (
            text
        )
    assert (
        'appliance_requests_total{model="chat",route="/v1/chat/completions",status="200"}' in text
    )
    assert 'appliance_requests_total{model="",route="/v1/embeddings",status="404"}' in text
    assert 'appliance_time_to_first_token_seconds_count{model="chat"' in text
    assert f'model="{CHAT_ALIAS}"' not in text  # an alias is never a label value


def test_readyz_lists_each_model(box: Box) -> None:
    code, body = get_json(box.app.url + "/readyz")
    assert code == 200 and body["models"] == {CHAT: "ready", EMBED: "ready"}, body


def test_a_drained_model_gets_503_naming_it_while_the_other_serves(box: Box) -> None:
    eid = box.engine_of(EMBED)["id"]
    code, _, body = box.call("POST", f"/admin/engines/{eid}/drain")
    assert code == 200, body
    try:
        box.wait_state(EMBED, "DRAINING")
        # Refused at once, naming the drain: a drained engine takes nothing until an
        # admin resumes it, so waiting for it would only end in queue_timeout.
        code, headers, body = box.embed(EMBED_ALIAS)
        assert code == 503, body
        assert body["error"]["code"] == "no_engine"
        assert f"'{EMBED}'" in body["error"]["message"]
        assert "drained by an admin" in body["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        assert box.chat()[0] == 200  # the other model goes on serving
        code, ready = get_json(box.app.url + "/readyz")
        assert code == 200 and ready["models"] == {CHAT: "ready", EMBED: "down"}
    finally:
        box.call("POST", f"/admin/engines/{eid}/resume")
    box.wait_state(EMBED, "READY")
    assert box.embed()[0] == 200


def test_a_killed_models_engine_503s_its_requests_while_the_other_serves(box: Box) -> None:
    engine = box.engine_of(EMBED)
    os.kill(engine["pid"], signal.SIGKILL)
    box.app.wait_for(
        lambda: box.engine_of(EMBED)["state"] != "READY", 10, "the embed engine noticed dead"
    )
    code, headers, body = box.embed()
    # Restarting (2 s start-up): the request waits its queue_timeout_s, then 503.
    assert code == 503, body
    assert f"'{EMBED}'" in body["error"]["message"] and "Retry-After" in headers
    assert box.chat()[0] == 200
    box.wait_state(EMBED, "READY")
    assert box.embed()[0] == 200


def test_heat_on_one_models_engine_never_moves_its_work_to_the_other(box: Box) -> None:
    chat_id = box.engine_of(CHAT)["id"]
    embed_routes = box.routes_served(EMBED)
    temps = [50.0, 50.0]
    temps[chat_id] = 95.0  # past the hard limit: the chat engine takes nothing new
    write_sensors(box.sensors, temps)
    try:
        box.app.wait_for(
            lambda: box.engine_of(CHAT)["throttle_level"] == 4, 10, "chat engine at level 4"
        )
        code, headers, body = box.chat(CHAT_ALIAS)
        # The cool embedding engine is no place for a chat request: it waits, then 503.
        assert code == 503, body
        assert f"'{CHAT}'" in body["error"]["message"] and "Retry-After" in headers
        assert box.embed()[0] == 200
        code, ready = get_json(box.app.url + "/readyz")
        assert code == 200 and ready["models"] == {CHAT: "down", EMBED: "ready"}
        after = box.routes_served(EMBED)
        assert after.get("/v1/chat/completions", 0) == embed_routes.get("/v1/chat/completions", 0)
    finally:
        write_sensors(box.sensors, [50, 50])
    box.app.wait_for(
        lambda: box.engine_of(CHAT)["throttle_level"] == 0, 10, "chat engine cooled down"
    )
    assert box.chat()[0] == 200


def test_the_openai_client_gets_embeddings_by_alias_base64_and_float(box: Box) -> None:
    c = openai.OpenAI(base_url=box.app.url + "/v1", api_key=box.key, max_retries=0, timeout=10)
    with c:
        # The client asks for base64 by default and decodes it; ask for floats too.
        r = c.embeddings.create(model=EMBED_ALIAS, input=["alpha", "beta"])
        f = c.embeddings.create(model=EMBED, input="alpha", encoding_format="float")
    assert r.model == EMBED and [d.index for d in r.data] == [0, 1]
    assert all(len(d.embedding) == 8 for d in r.data)
    assert r.data[0].embedding != r.data[1].embedding
    assert f.data[0].embedding == pytest.approx(r.data[0].embedding, abs=1e-5)
