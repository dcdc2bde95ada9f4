"""Tokens per key, as an operator and a client see them (issue 14, item 3).

A daemon with one fake engine (which answers like vLLM 0.32: a usage event only with
``include_usage``, the ``system_fingerprint`` moving onto it). Checked: a client that did
not ask for usage gets the engine's stream byte for byte as the engine sends it without
include_usage; one that asked gets the usage event; streamed and whole answers are counted
per key id from the engine's own numbers (``keys usage --json``, the metric); the counts
survive a restart; an engine killed mid-stream still counts the tokens relayed; a corrupt
usage file is set aside and the daemon starts.

Issue 20, item 3, on both relay paths (the splice: HTTP/1.1 streams; aiohttp's client:
whole answers and HTTP/1.0 streams): a client gone before its answer is counted; a
stream cut before its usage event is charged at least what the engine did; an engine
writing JSON with spaces gets exact counts and its usage event taken out.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from appliance.gateway.wire.http1 import scan_chunks
from tests.fakes.appliance_proc import (
    REPO,
    Appliance,
    fake_engine_config,
    run_appliance,
    write_config,
)

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def start(tmp: Path) -> contextlib.AbstractContextManager[Appliance]:
    cfg = fake_engine_config(tmp, 1, health={"interval_s": 2.0, "failures_to_restart": 100})
    return run_appliance(tmp, cfg)


def admin_key(tmp: Path) -> str:
    return (tmp / "admin.key").read_text().strip()


def raw_post(
    app: Appliance, key: str, body: dict[str, Any], version: str = "1.1"
) -> tuple[int, bytes]:
    """POST over a raw socket: (status, the body as the client's HTTP library gives it)."""
    data = json.dumps(body).encode()
    port = int(app.config["gateway"]["port"])
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(
            f"POST {CHAT} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Connection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    if b"transfer-encoding: chunked" in head.lower():
        _, payloads, _ = scan_chunks(rest)
        rest = b"".join(payloads)
    return status, rest


def engine_stream(app: Appliance, body: dict[str, Any]) -> bytes:
    """The same request straight to the engine (its own key), de-chunked."""
    status = admin_status(app)
    pid = status["engines"][0]["pid"]
    key = psutil.Process(pid).environ()["VLLM_API_KEY"]
    code, raw = app.engine_request(
        0,
        "POST",
        CHAT,
        json.dumps(body).encode(),
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=20,
    )
    assert code == 200, raw
    return raw.encode() if isinstance(raw, str) else json.dumps(raw).encode()


def admin_status(app: Appliance) -> dict[str, Any]:
    port = int(app.config["gateway"]["port"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(
        "GET",
        "/admin/status",
        headers={"Authorization": f"Bearer {admin_key(app.log_path.parent)}"},
    )
    doc: dict[str, Any] = json.loads(conn.getresponse().read())
    conn.close()
    return doc


def metrics(app: Appliance) -> str:
    port = int(app.config["gateway"]["port"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(
        "GET", "/metrics", headers={"Authorization": f"Bearer {admin_key(app.log_path.parent)}"}
    )
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def same_answer(a: bytes) -> bytes:
    """A stream with its per-request id and timestamp taken out."""
    a = re.sub(rb"chatcmpl-[0-9a-f]+", b"ID", a)
    return re.sub(rb'"created":( ?)\d+', rb'"created":\g<1>0', a)  # compact or with spaces


def keys_usage(tmp: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "keys",
            "usage",
            "--config",
            str(tmp / "config.toml"),
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def key_id(tmp: Path) -> str:
    keys = json.loads((tmp / "keys.json").read_text())
    records = keys["keys"] if isinstance(keys, dict) else keys
    return str(records[0]["id"])


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 5,
        **fields,
    }


@pytest.fixture
def running(tmp_path: Path) -> Iterator[tuple[Appliance, str, str]]:
    ctx = start(tmp_path)
    with ctx as app:
        app.wait_all_ready()
        app.engine_control(0, token_delay_ms=0)
        yield app, admin_key(tmp_path), served_model(app)


def served_model(app: Appliance) -> str:
    port = int(app.config["gateway"]["port"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(
        "GET", "/v1/models", headers={"Authorization": f"Bearer {admin_key(app.log_path.parent)}"}
    )
    name = str(json.loads(conn.getresponse().read())["data"][0]["id"])
    conn.close()
    return name


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_client_that_did_not_ask_gets_the_engines_stream_byte_for_byte(
    running: tuple[Appliance, str, str], version: str
) -> None:
    app, key, model = running
    body = chat(model, stream=True)
    status, through = raw_post(app, key, body, version)
    assert status == 200
    direct = engine_stream(app, body)
    assert b'"usage"' not in through
    assert b'"system_fingerprint"' in through  # back on the finishing event
    assert same_answer(through) == same_answer(direct)


def test_a_client_that_asked_gets_the_usage_event(running: tuple[Appliance, str, str]) -> None:
    app, key, model = running
    body = chat(model, stream=True, stream_options={"include_usage": True})
    status, through = raw_post(app, key, body)
    assert status == 200
    assert same_answer(through) == same_answer(engine_stream(app, body))
    assert b'"choices":[],"usage":{"prompt_tokens"' in through


def test_counts_per_key_from_the_engine_survive_a_restart(tmp_path: Path) -> None:
    ctx = start(tmp_path)
    with ctx as app:
        app.wait_all_ready()
        app.engine_control(0, token_delay_ms=0)
        key, model = admin_key(tmp_path), served_model(app)
        raw_post(app, key, chat(model, stream=True))  # 5 tokens, usage stripped
        raw_post(app, key, chat(model, stream=True, stream_options={"include_usage": True}))
        status, answer = raw_post(app, key, chat(model))  # not streamed
        assert status == 200
        prompt = json.loads(answer)["usage"]["prompt_tokens"]
        kid = key_id(tmp_path)
        text = metrics(app)
        assert f'appliance_key_tokens_total{{key="{kid}",kind="completion"}} 15.0' in text
        assert f'appliance_key_tokens_total{{key="{kid}",kind="prompt"}} {3.0 * prompt}' in text
        app.signal(signal.SIGTERM)
        assert app.wait_exit(30) == 0
    doc = keys_usage(tmp_path, "--since", "24h")
    assert doc["keys"] == [
        {
            "id": kid,
            "name": doc["keys"][0]["name"],
            "prompt_tokens": 3 * prompt,
            "completion_tokens": 15,
            "total_tokens": 3 * prompt + 15,
            "energy_wh": None,  # telemetry "none": no energy known, which is not 0
        }
    ]
    ctx2 = start(tmp_path)  # same state directory: the counts go on from there
    with ctx2 as app:
        app.wait_all_ready()
        app.engine_control(0, token_delay_ms=0)
        raw_post(app, admin_key(tmp_path), chat(served_model(app)))
        app.signal(signal.SIGTERM)
        assert app.wait_exit(30) == 0
    assert keys_usage(tmp_path)["keys"][0]["completion_tokens"] == 20


def test_an_engine_killed_mid_stream_counts_what_was_relayed(tmp_path: Path) -> None:
    ctx = start(tmp_path)
    with ctx as app:
        app.wait_all_ready()
        app.engine_control(0, token_delay_ms=50)
        key, model = admin_key(tmp_path), served_model(app)
        body = json.dumps(chat(model, stream=True, max_tokens=1000)).encode()
        port = int(app.config["gateway"]["port"])
        sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        sock.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while got.count(b"tok") < 5:
            got += sock.recv(65536)
        psutil.Process(admin_status(app)["engines"][0]["pid"]).kill()
        while b"engine_error" not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        sock.close()
        relayed = got.count(b" tok")
        kid = key_id(tmp_path)
        app.wait_for(
            lambda: (
                f'appliance_key_tokens_total{{key="{kid}",kind="completion"}} {float(relayed)}'
                in metrics(app)
            ),
            10,
            "the relayed tokens counted",
        )


def test_a_corrupt_usage_file_is_set_aside_and_the_daemon_starts(tmp_path: Path) -> None:
    (tmp_path / "usage.json").write_text("{ this is not json")
    ctx = start(tmp_path)
    with ctx as app:
        app.wait_all_ready()
        assert "not a usage file" in app.log()
        aside = list(tmp_path.glob("usage.json.corrupt-*"))
        assert len(aside) == 1 and aside[0].read_text() == "{ this is not json"


# ---- issue 20, item 3: every token counted on every path ---------------------------------
DENSE = "a " * 3000  # a token a word for many tokenizers: ~1 per 2 characters
DENSE_PROMPT = 3000 + 4 + 2  # as the fake engine counts it: words, 4 a message, 2 a chat
PATHS = {"whole answer": (False, "1.1"), "splice": (True, "1.1"), "http/1.0": (True, "1.0")}


def tokens_of(app: Appliance, kid: str, kind: str) -> float:
    m = re.search(rf'appliance_key_tokens_total{{key="{kid}",kind="{kind}"}} (\S+)', metrics(app))
    return float(m[1]) if m else 0.0


def send(app: Appliance, key: str, body: dict[str, Any], version: str) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", int(app.config["gateway"]["port"])), 20)
    sock.sendall(
        f"POST {CHAT} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def stat(app: Appliance, name: str) -> Any:
    stats = app.engine_stats(0)
    return None if stats is None else stats[name]


@pytest.mark.parametrize("path", PATHS)
def test_a_client_gone_before_its_answer_is_counted(tmp_path: Path, path: str) -> None:
    """The engine took the request and was aborted when the client left: the key is
    counted the prompt's upper bound (never below the engine's count), and a whole answer
    the max_tokens it was allowed. Before, none of the three moved the counts."""
    stream, version = PATHS[path]
    cfg = fake_engine_config(tmp_path, 1, health={"interval_s": 600, "probe_timeout_s": 5})
    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        app.engine_control(0, first_token_delay_ms=60_000)  # prefill never ends
        key, model, kid = admin_key(tmp_path), served_model(app), key_id(tmp_path)
        body = {
            **chat(model, stream=stream, max_tokens=40),
            "messages": [{"role": "user", "content": DENSE}],
        }
        sock = send(app, key, body, version)
        app.wait_for(lambda: stat(app, "running") == 1, 20, "the engine working on it")
        sock.close()
        app.wait_for(lambda: stat(app, "aborts") == 1, 20, "the engine aborting it")
        app.wait_for(lambda: tokens_of(app, kid, "prompt") > 0, 20, "the request counted")
        assert tokens_of(app, kid, "prompt") >= DENSE_PROMPT
        assert tokens_of(app, kid, "completion") == (0 if stream else 40)


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_a_stream_cut_before_its_usage_event_is_charged_at_least_what_the_engine_did(
    running: tuple[Appliance, str, str], version: str
) -> None:
    """Before, the prompt was the admission estimate: about half of this one."""
    app, key, model = running
    app.engine_control(0, break_before_usage=True)
    body = {**chat(model, stream=True), "messages": [{"role": "user", "content": DENSE}]}
    status, through = raw_post(app, key, body, version)
    assert status == 200 and b" tok4" in through and b"engine_error" in through
    kid = key_id(app.log_path.parent)
    app.wait_for(lambda: tokens_of(app, kid, "prompt") > 0, 10, "the stream counted")
    assert tokens_of(app, kid, "prompt") >= DENSE_PROMPT
    assert tokens_of(app, kid, "completion") == 5  # the 5 token events relayed


def test_a_cut_stream_whose_events_may_hold_several_tokens_is_charged_for_them(
    running: tuple[Appliance, str, str],
) -> None:
    """vLLM puts ``stream_interval`` tokens in one event (the fake does too): 100 tokens
    came in 26 events. Counted one per event, the key paid 26 (on real vLLM: 1 for 385
    made); each event now counts the interval's worth, within max_tokens: all 100."""
    app, key, model = running
    app.engine_control(0, break_before_usage=True)
    body = chat(model, stream=True, max_tokens=100, stream_interval=4)
    status, through = raw_post(app, key, body)
    assert status == 200 and b" tok0 tok1 tok2 tok3" not in through  # the first goes alone
    assert b" tok1 tok2 tok3 tok4" in through and b"engine_error" in through
    kid = key_id(app.log_path.parent)
    app.wait_for(lambda: tokens_of(app, kid, "completion") > 0, 10, "the stream counted")
    assert tokens_of(app, kid, "completion") == 100


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_an_engine_writing_json_with_spaces_is_counted_exactly_and_stripped(
    running: tuple[Appliance, str, str], version: str
) -> None:
    """Another OpenAI-compatible server as engine.command: its usage event must not reach
    a client that did not ask, and its own counts are the ones kept."""
    app, key, model = running
    app.engine_control(0, json_spaces=True)
    body = chat(model, stream=True)
    status, through = raw_post(app, key, body, version)
    assert status == 200
    direct = engine_stream(app, body)
    assert b'"finish_reason": "length"' in direct and b'"usage"' not in direct
    assert b'"usage"' not in through
    assert same_answer(through) == same_answer(direct)
    kid = key_id(app.log_path.parent)
    app.wait_for(lambda: tokens_of(app, kid, "completion") > 0, 10, "the stream counted")
    assert tokens_of(app, kid, "prompt") == 2 + 4 + 2  # "hi there", as the engine said
    assert tokens_of(app, kid, "completion") == 5


# ---- energy per key (issue 37, item 4) ------------------------------------------------------


def write_sensors(path: Path, temperature_c: float, energy_j: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"gpus": [{"index": 0, "temperature_c": temperature_c, "energy_j": energy_j}]})
    )
    tmp.replace(path)


def new_key(app: Appliance, name: str) -> str:
    port = int(app.config["gateway"]["port"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(
        "POST",
        "/admin/keys",
        json.dumps({"name": name}),
        {"Authorization": f"Bearer {admin_key(app.log_path.parent)}"},
    )
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 201, body
    return str(body["key"])


def test_gpu_energy_is_shared_among_keys_by_their_tokens(tmp_path: Path) -> None:
    """The `file:` source's cumulative energy_j, a daemon with one fake engine (telemetry
    entry 0), two keys sending the same request 3:1. Readings are taken at the telemetry
    ticks the test chooses (an hour apart, and one more at each reload that changes
    telemetry.interval_s), so the requests all fall between two of them: the 36 J the
    "GPU" used in between (a figure any GPU can use between two reloads: more in less
    time than that is no figure, accounting/energy.py) are the keys' 27 J and 9 J, in
    ``keys usage --json`` (kept across the stop) and the counter in /metrics as read."""
    sensors = tmp_path / "sensors.json"
    write_sensors(sensors, 40, 1000.0)
    cfg = fake_engine_config(
        tmp_path,
        1,
        health={"interval_s": 2.0, "failures_to_restart": 100},
        telemetry={"source": f"file:{sensors}", "interval_s": 3600},
    )

    def tick(temperature_c: float, energy_j: float, interval_s: float) -> None:
        """A reading now: a reload that changes the interval reads at once; the new
        temperature says when it was taken."""
        write_sensors(sensors, temperature_c, energy_j)
        cfg["telemetry"]["interval_s"] = interval_s
        write_config(tmp_path / "config.toml", cfg)
        app.signal(signal.SIGHUP)
        app.wait_for(
            lambda: (
                f'appliance_gpu_temperature_celsius{{gpu="0"}} {temperature_c:.1f}' in metrics(app)
            ),
            10,
            f"the reading at {temperature_c} C",
        )

    with run_appliance(tmp_path, cfg) as app:
        app.wait_all_ready()
        app.engine_control(0, token_delay_ms=0)
        model = served_model(app)
        key_a, key_b = new_key(app, "a"), new_key(app, "b")
        tick(41, 1000.0, 3599)  # the count starts here
        for key in (key_a, key_a, key_a, key_b):
            assert raw_post(app, key, chat(model))[0] == 200
        tick(42, 1000.0 + 36.0, 3600)  # 36 J since
        assert 'appliance_gpu_energy_joules_total{gpu="0"} 1036.0' in metrics(app)
        app.signal(signal.SIGTERM)
        assert app.wait_exit(30) == 0
    rows = {r["name"]: r for r in keys_usage(tmp_path)["keys"]}
    assert rows["a"]["total_tokens"] == 3 * rows["b"]["total_tokens"] > 0
    assert rows["a"]["energy_wh"] == pytest.approx(27 / 3600)
    assert rows["b"]["energy_wh"] == pytest.approx(9 / 3600)
