"""Overflow fallback and speculative decoding's figures, end to end through the daemon
with fake engines.

Two ``[[models]]`` on CPU, one fake engine each: "chat" (fallback "small") and "small"
(no fallback; its engine exports speculative decoding counters, ``--fake-spec-decode``).
A fake engine answers only the name it was started with, so a fallback whose body still
named "chat" would be the small engine's 404, not a silent pass. ``file:`` telemetry
heats one engine (CPU engine i is sensors entry i); the fake engine's knob trips the KV
breaker.

One daemon for the module: each test puts back what it changed (cool down, resume).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, run_appliance
from tests.integration.test_models import Box, write_sensors

pytestmark = pytest.mark.slow

CHAT, SMALL = "chat", "small"
QUEUE_TIMEOUT_S = 1
HOT, COOL = 95.0, 50.0


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("fallback")
    sensors = tmp / "sensors.json"
    write_sensors(sensors, [COOL, COOL])
    cfg: dict[str, Any] = fake_engine_config(
        tmp,
        2,
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
        gateway={"queue_timeout_s": QUEUE_TIMEOUT_S},
        health=STEADY_HEALTH,
    )
    spec = [*cfg["engine"]["command"], "--fake-spec-decode"]
    cfg["models"] = [
        {"name": CHAT, "cpu_engines": 1, "fallback": SMALL},
        {"name": SMALL, "cpu_engines": 1, "command": spec},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip(), sensors)


def chat(
    box: Box, headers: dict[str, str] | None = None, key: str | None = None, stream: bool = False
) -> tuple[int, dict[str, str], Any]:
    """A chat request for "chat" over http.client (HTTP/1.1: a stream takes the splice
    path); the body parsed (a stream: its events' JSON objects)."""
    url = urllib.parse.urlsplit(box.app.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    body = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    if stream:
        body["stream"] = True
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps(body),
        {
            "Authorization": f"Bearer {key or box.key}",
            "Content-Type": "application/json",
            **(headers or {}),
        },
    )
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    if stream and resp.status == 200:
        events = [
            json.loads(line[6:])
            for line in raw.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return resp.status, dict(resp.headers), events
    return resp.status, dict(resp.headers), json.loads(raw)


def fallbacks(box: Box, reason: str) -> float:
    prefix = f'appliance_fallbacks_total{{from="{CHAT}",reason="{reason}",to="{SMALL}"}} '
    for line in box.metrics().splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


def small_last_model(box: Box) -> str:
    stats = box.app.engine_stats(box.engine_of(SMALL)["id"])
    assert stats is not None
    return str(stats["last_request"]["body"]["model"])


@contextlib.contextmanager
def chat_hot(box: Box) -> Iterator[None]:
    temps = [COOL, COOL]
    temps[box.engine_of(CHAT)["id"]] = HOT  # past the hard limit: admits nothing new
    write_sensors(box.sensors, temps)
    try:
        box.app.wait_for(
            lambda: box.engine_of(CHAT)["throttle_level"] == 4, 10, "chat engine at level 4"
        )
        yield
    finally:
        write_sensors(box.sensors, [COOL, COOL])
        box.app.wait_for(
            lambda: box.engine_of(CHAT)["throttle_level"] == 0, 10, "chat engine cooled down"
        )


def assert_served_by_small(code: int, headers: dict[str, str], body: Any) -> None:
    assert code == 200, body
    assert headers.get("X-Appliance-Model") == SMALL
    models = {e["model"] for e in body} if isinstance(body, list) else {body["model"]}
    assert models == {SMALL}  # never disguised as the model asked for


def test_a_model_serving_itself_says_nothing(box: Box) -> None:
    code, headers, body = chat(box)
    assert code == 200 and body["model"] == CHAT
    assert "X-Appliance-Model" not in headers


def test_heat_at_the_hard_limit_sends_new_requests_to_the_fallback(box: Box) -> None:
    before = fallbacks(box, "heat")
    with chat_hot(box):
        assert_served_by_small(*chat(box))
        assert small_last_model(box) == SMALL  # the forwarded body names the fallback
        assert_served_by_small(*chat(box, stream=True))
        assert fallbacks(box, "heat") == before + 2
    # Cool again: chat answers its own requests, without the header.
    code, headers, body = chat(box)
    assert code == 200 and body["model"] == CHAT and "X-Appliance-Model" not in headers
    log = box.app.log()
    assert log.count("chat -> small: fallback (heat)") >= 1
    assert "chat: serving its own requests again" in log


def test_the_kv_breaker_on_the_model_sends_requests_to_the_fallback(box: Box) -> None:
    chat_id = box.engine_of(CHAT)["id"]
    before = fallbacks(box, "kv")
    box.app.engine_control(chat_id, kv_cache_usage=0.97)
    try:
        box.app.wait_for(
            lambda: box.engine_of(CHAT)["kv_breaker_open"], 10, "chat engine's KV breaker open"
        )
        assert_served_by_small(*chat(box))
        assert fallbacks(box, "kv") == before + 1
    finally:
        box.app.engine_control(chat_id, kv_cache_usage=None)
    box.app.wait_for(
        lambda: not box.engine_of(CHAT)["kv_breaker_open"], 10, "chat engine's KV breaker closed"
    )
    assert chat(box)[2]["model"] == CHAT


def assert_queued_then_503(code: int, headers: dict[str, str], body: Any, started: float) -> None:
    assert code == 503, body
    assert body["error"]["code"] == "queue_timeout" and f"'{CHAT}'" in body["error"]["message"]
    assert "X-Appliance-Model" not in headers
    assert time.monotonic() - started >= QUEUE_TIMEOUT_S * 0.9  # it waited in chat's queue


def test_a_request_refusing_fallback_queues_for_its_own_model(box: Box) -> None:
    with chat_hot(box):
        started = time.monotonic()
        assert_queued_then_503(*chat(box, {"X-Appliance-Fallback": "never"}), started)
        # Any other value is ignored: served by the fallback.
        assert_served_by_small(*chat(box, {"X-Appliance-Fallback": "sometimes"}))


def test_a_no_fallback_key_queues_for_its_own_model(box: Box) -> None:
    code, _, created = box.call("POST", "/admin/keys", {"name": "strict", "fallback": False})
    assert code in (200, 201), created
    assert created["fallback"] is False
    code, _, bad = box.call("POST", "/admin/keys", {"name": "x", "fallback": "no"})
    assert code == 400 and bad["error"]["param"] == "fallback"
    with chat_hot(box):
        started = time.monotonic()
        assert_queued_then_503(*chat(box, key=created["key"]), started)
        assert_served_by_small(*chat(box))  # the same moment, a key that allows it


def test_a_key_limited_to_its_model_never_reaches_the_fallback(box: Box) -> None:
    # issue 35: a key limited to models uses no fallback model outside its list.
    code, _, created = box.call("POST", "/admin/keys", {"name": "scoped", "models": [CHAT]})
    assert code == 201, created
    with chat_hot(box):
        started = time.monotonic()
        assert_queued_then_503(*chat(box, key=created["key"]), started)
        assert_served_by_small(*chat(box))  # the same moment, a key without a limit


def test_fallback_down_too_queues_for_the_model_and_503s_as_before(box: Box) -> None:
    small_id = box.engine_of(SMALL)["id"]
    code, _, body = box.call("POST", f"/admin/engines/{small_id}/drain")
    assert code == 200, body
    try:
        box.wait_state(SMALL, "DRAINING")
        with chat_hot(box):
            started = time.monotonic()
            assert_queued_then_503(*chat(box), started)
    finally:
        box.call("POST", f"/admin/engines/{small_id}/resume")
    box.wait_state(SMALL, "READY")


def test_a_model_without_fallback_is_unchanged(box: Box) -> None:
    """small has no fallback: hot, its requests wait for it, never going to chat."""
    small_id = box.engine_of(SMALL)["id"]
    chat_routes = box.routes_served(CHAT).get("/v1/chat/completions", 0)
    temps = [COOL, COOL]
    temps[small_id] = HOT
    write_sensors(box.sensors, temps)
    try:
        box.app.wait_for(
            lambda: box.engine_of(SMALL)["throttle_level"] == 4, 10, "small engine at level 4"
        )
        code, headers, body = box.chat(SMALL)
        assert code == 503 and body["error"]["code"] == "queue_timeout", body
        assert "X-Appliance-Model" not in headers
        assert box.routes_served(CHAT).get("/v1/chat/completions", 0) == chat_routes
    finally:
        write_sensors(box.sensors, [COOL, COOL])
    box.app.wait_for(
        lambda: box.engine_of(SMALL)["throttle_level"] == 0, 10, "small engine cooled down"
    )


def test_speculative_decoding_figures_reach_metrics_and_status(box: Box) -> None:
    small_id = str(box.engine_of(SMALL)["id"])
    for _ in range(3):
        assert box.chat(SMALL)[0] == 200
    # The health checks' probes generate too, so the last minute has samples to compare.
    box.app.wait_for(
        lambda: box.engine_of(SMALL)["spec_acceptance_rate"] is not None,
        10,
        "an acceptance rate for the speculating engine",
    )
    engine = box.engine_of(SMALL)
    assert engine["spec_acceptance_rate"] == pytest.approx(0.75)  # the fake's 3 of 4
    assert engine["spec_mean_accepted_length"] is not None
    plain = box.engine_of(CHAT)
    assert plain["spec_acceptance_rate"] is None and plain["spec_mean_accepted_length"] is None
    assert "last_exit" in plain
    text = box.metrics()
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        series = [
            line
            for line in text.splitlines()
            if line.startswith(f"appliance_engine_spec_{name}_total{{")
        ]
        # Only the engine that speculates reports them.
        assert [s.split("}")[0] + "}" for s in series] == [
            f'appliance_engine_spec_{name}_total{{engine="{small_id}"}}'
        ]
        assert float(series[0].split()[-1]) > 0


def test_a_key_settles_a_fallback_against_what_it_was_charged(tmp_path: Path) -> None:
    """tpm is charged on the model the request names (here its 2048-token context) and
    settled against that charge when the fallback (a 256-token context) served it: the
    key pays what was used, neither the gap between the two estimates nor less."""
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, [HOT, COOL])  # chat (engine 0) past the hard limit throughout
    cfg: dict[str, Any] = fake_engine_config(
        tmp_path,
        2,
        telemetry={"source": f"file:{sensors}", "interval_s": 0.1},
        thermal={"soft_limit_c": 80, "hard_limit_c": 87, "hysteresis_c": 5},
        health=STEADY_HEALTH,
    )
    cfg["models"] = [
        {"name": CHAT, "cpu_engines": 1, "fallback": SMALL, "max_model_len": 2048},
        {"name": SMALL, "cpu_engines": 1, "max_model_len": 256},
    ]
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        box = Box(app, (tmp_path / "admin.key").read_text().strip(), sensors)
        box.app.wait_for(
            lambda: box.engine_of(CHAT)["throttle_level"] == 4, 10, "chat engine at level 4"
        )
        code, _, created = box.call("POST", "/admin/keys", {"name": "metered", "tpm": 3000})
        assert code in (200, 201), created
        ask = {"model": CHAT, "messages": [{"role": "user", "content": "hi"}]}  # no max_tokens
        for _ in range(2):  # charged 2048 each; used ~256: the second fits in what is left
            box.key = created["key"]
            code, headers, body = box.call("POST", "/v1/chat/completions", ask)
            assert code == 200, body
            assert headers.get("X-Appliance-Model") == SMALL
            assert body["usage"]["total_tokens"] <= 256
