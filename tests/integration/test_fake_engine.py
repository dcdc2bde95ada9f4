"""The fake vLLM engine (tests/fakes/fake_engine.py) speaks vLLM's OpenAI server protocol.

Started as a real subprocess; checked with the official openai client, raw HTTP and
prometheus_client's parser, plus its process-tree behaviour for supervisor tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.fakes.engine_proc import (  # noqa: E402
    FAKE_ENGINE_PATH,
    FakeEngineHandle,
    fake_engine,
    free_port,
    http_status,
    pid_alive,
    start_fake_engine,
    stop_fake_engine,
)

KEY = "fake-engine-test-key"
MODEL = "smollm2"


def wait_for(cond, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


async def await_for(cond, within: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(interval)
    return bool(cond())


@pytest.fixture(scope="module")
def shared_engine() -> Iterator[FakeEngineHandle]:
    # Unknown vLLM flags must be ignored.
    with fake_engine(
        "--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager", api_key=KEY
    ) as e:
        yield e


@pytest.fixture
def eng(shared_engine: FakeEngineHandle) -> Iterator[FakeEngineHandle]:
    shared_engine.control(
        reset_stats=True,
        hang=False,
        fail_requests=False,
        health_status=200,
        token_delay_ms=2,
        kv_cache_usage=None,
        preemptions_per_request=0,
    )
    yield shared_engine
    # Leave it usable for the next test even if this one failed half-way.
    shared_engine.control(hang=False, fail_requests=False, health_status=200)


@pytest.fixture
def client(eng: FakeEngineHandle) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=eng.base_url, api_key=KEY, max_retries=0, timeout=10)
    yield c
    c.close()


@pytest.fixture
async def aclient(eng: FakeEngineHandle):
    c = openai.AsyncOpenAI(base_url=eng.base_url, api_key=KEY, max_retries=0, timeout=10)
    yield c
    await c.close()


def expected_text(n: int) -> str:
    return "".join(f" tok{i}" for i in range(n))


# --------------------------------------------------------------------------- plain HTTP


async def test_health_version_metrics_need_no_auth(eng: FakeEngineHandle) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{eng.url}/health") as r:
            assert r.status == 200
            assert await r.read() == b""
        async with s.get(f"{eng.url}/version") as r:
            assert r.status == 200
            assert (await r.json())["version"] == "0.32.0-fake"
        async with s.get(f"{eng.url}/metrics") as r:
            assert r.status == 200
            assert "vllm:num_requests_running" in await r.text()


async def test_v1_requires_bearer_key(eng: FakeEngineHandle) -> None:
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            async with s.get(f"{eng.base_url}/models", headers=headers) as r:
                assert r.status == 401
                assert "error" in await r.json()
        async with s.post(
            f"{eng.base_url}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        ) as r:
            assert r.status == 401
        async with s.get(f"{eng.base_url}/models", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
    assert eng.stats()["requests"] == 0


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "vllm"


def test_bad_key_raises_authentication_error(eng: FakeEngineHandle) -> None:
    c = openai.OpenAI(base_url=eng.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()
    c.close()


# --------------------------------------------------------------------------- openai client


def test_sync_chat_non_stream(client: openai.OpenAI, eng: FakeEngineHandle) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5
    )
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_text(5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    st = eng.stats()
    assert st["requests"] == 1
    assert st["generation_tokens"] == 5
    assert st["running"] == 0


def test_sync_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(4)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="a b c")
    assert r.choices[0].text == expected_text(16)
    assert r.usage is not None
    assert r.usage.prompt_tokens == 3
    assert r.usage.completion_tokens == 16


def test_sync_completions_stream(client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected_text(3)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_model_omitted_uses_served_model(eng: FakeEngineHandle) -> None:
    import json
    import urllib.request

    req = urllib.request.Request(
        f"{eng.base_url}/completions",
        data=json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        body = json.loads(r.read())
    assert body["model"] == MODEL
    assert body["choices"][0]["text"] == expected_text(2)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
    assert ei.value.status_code == 404


def test_bad_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)  # > max-model-len


async def test_async_chat_stream_and_non_stream(aclient: openai.AsyncOpenAI) -> None:
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == expected_text(6)

    r = await aclient.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert r.choices[0].message.content == expected_text(2)


async def test_async_completions_concurrent(
    aclient: openai.AsyncOpenAI, eng: FakeEngineHandle
) -> None:
    results = await asyncio.gather(
        *(aclient.completions.create(model=MODEL, prompt="p", max_tokens=8) for _ in range(8))
    )
    assert all(r.choices[0].text == expected_text(8) for r in results)
    stream = await aclient.completions.create(model=MODEL, prompt="p", max_tokens=3, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == expected_text(3)
    st = eng.stats()
    assert st["requests"] == 9
    assert st["running"] == 0
    assert st["generation_tokens"] == 8 * 8 + 3


def test_embeddings(client: openai.OpenAI) -> None:
    one = client.embeddings.create(model=MODEL, input="hello")
    again = client.embeddings.create(model=MODEL, input="hello")
    assert len(one.data) == 1
    assert len(one.data[0].embedding) == 8
    assert one.data[0].embedding == pytest.approx(again.data[0].embedding)
    many = client.embeddings.create(model=MODEL, input=["hello", "world"], encoding_format="float")
    assert [d.index for d in many.data] == [0, 1]
    assert many.data[0].embedding == pytest.approx(one.data[0].embedding, abs=1e-5)
    assert many.data[1].embedding != many.data[0].embedding
    assert many.usage.prompt_tokens == 2


# --------------------------------------------------------------------------- disconnects


async def test_disconnect_mid_stream_aborts(eng: FakeEngineHandle) -> None:
    eng.control(token_delay_ms=20)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        resp = await s.post(f"{eng.base_url}/completions", json=body)
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        line = await resp.content.readline()
        assert line.startswith(b"data: {")
        assert eng.stats()["running"] == 1
        resp.close()  # drop the connection mid-generation
    assert await await_for(lambda: eng.stats()["aborts"] == 1)
    assert await await_for(lambda: eng.stats()["running"] == 0)
    st = eng.stats()
    assert st["generation_tokens"] < 1000
    assert st["success"]["abort"] == 1


async def test_disconnect_non_stream_aborts(eng: FakeEngineHandle) -> None:
    eng.control(token_delay_ms=20)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
        with pytest.raises(asyncio.TimeoutError):
            await s.post(
                f"{eng.base_url}/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=0.2),
            )
    assert await await_for(lambda: eng.stats()["aborts"] == 1)
    assert eng.stats()["running"] == 0


# --------------------------------------------------------------------------- metrics


def scrape(eng: FakeEngineHandle) -> dict[str, dict[str, float]]:
    """{family name: {sample name + sorted labels: value}} from /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"{eng.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            key = smp.name + str(sorted(smp.labels.items()))
            out.setdefault(fam.name + "|" + fam.type, {})[key] = smp.value
    return out


def value(m: dict[str, dict[str, float]], family: str, kind: str, sample: str, **labels) -> float:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    return m[f"{family}|{kind}"][sample + str(sorted(labels.items()))]


def test_metrics_parse_and_count(client: openai.OpenAI, eng: FakeEngineHandle) -> None:
    eng.control(preemptions_per_request=3, kv_cache_usage=0.97)
    client.completions.create(model=MODEL, prompt="one two three", max_tokens=4)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    m = scrape(eng)
    assert value(m, "vllm:num_requests_running", "gauge", "vllm:num_requests_running") == 0
    assert value(m, "vllm:num_requests_waiting", "gauge", "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc", "gauge", "vllm:kv_cache_usage_perc") == 0.97
    assert value(m, "vllm:num_preemptions", "counter", "vllm:num_preemptions_total") == 6
    assert value(m, "vllm:generation_tokens", "counter", "vllm:generation_tokens_total") == 6
    assert value(m, "vllm:prompt_tokens", "counter", "vllm:prompt_tokens_total") >= 3
    assert (
        value(
            m,
            "vllm:request_success",
            "counter",
            "vllm:request_success_total",
            finished_reason="length",
        )
        == 2
    )
    assert (
        value(
            m,
            "vllm:time_to_first_token_seconds",
            "histogram",
            "vllm:time_to_first_token_seconds_count",
        )
        == 2
    )
    assert (
        value(
            m,
            "vllm:time_to_first_token_seconds",
            "histogram",
            "vllm:time_to_first_token_seconds_bucket",
            le="+Inf",
        )
        == 2
    )


async def test_running_gauge_during_generation(eng: FakeEngineHandle) -> None:
    eng.control(token_delay_ms=20)
    ac = openai.AsyncOpenAI(base_url=eng.base_url, api_key=KEY, max_retries=0)
    tasks = [
        asyncio.create_task(ac.completions.create(model=MODEL, prompt="x", max_tokens=15))
        for _ in range(3)
    ]
    try:
        assert await await_for(lambda: eng.stats()["running"] == 3, within=3)
        m = await asyncio.to_thread(scrape, eng)
        assert value(m, "vllm:num_requests_running", "gauge", "vllm:num_requests_running") == 3
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await ac.close()
    assert eng.stats()["running"] == 0


# --------------------------------------------------------------------------- fault knobs


def test_fail_requests_and_health_status(client: openai.OpenAI, eng: FakeEngineHandle) -> None:
    eng.control(fail_requests=True)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    eng.control(fail_requests=False, health_status=500)
    assert http_status(f"{eng.url}/health") == 500
    eng.control(health_status=200)
    assert http_status(f"{eng.url}/health") == 200
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_hang_keeps_health_ok_but_produces_nothing(eng: FakeEngineHandle) -> None:
    eng.control(hang=True)
    assert http_status(f"{eng.url}/health") == 200
    c = openai.OpenAI(base_url=eng.base_url, api_key=KEY, max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1)
    c.close()
    assert wait_for(lambda: eng.stats()["running"] == 0)
    eng.control(hang=False)


def test_control_rejects_unknown_keys(eng: FakeEngineHandle) -> None:
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as ei:
        eng.control(hnag=True)
    assert ei.value.code == 400


# --------------------------------------------------------------------------- processes


@contextlib.contextmanager
def engine_proc(*args: str, wait: bool = True, **kw) -> Iterator[tuple[subprocess.Popen, int]]:
    port = free_port()
    proc = start_fake_engine(port, KEY, *args, wait=wait, **kw)
    try:
        yield proc, port
    finally:
        stop_fake_engine(proc)


def test_spawned_child_survives_sigkill_of_parent() -> None:
    child = None
    with engine_proc("--spawn-child") as (proc, port):
        try:
            from tests.fakes.engine_proc import engine_stats

            st = engine_stats(port)
            child = st["child_pid"]
            assert st["pid"] == proc.pid
            assert isinstance(child, int)
            assert pid_alive(child)
            assert os.getpgid(child) == proc.pid  # same process group as the engine
            assert os.getsid(child) == os.getsid(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=5) == -signal.SIGKILL
            time.sleep(0.1)
            assert pid_alive(child), "the EngineCore imitation must outlive its parent"
        finally:
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
    assert child is not None
    assert wait_for(lambda: not pid_alive(child), timeout=5)


def test_sigterm_exits_zero_and_stops_child() -> None:
    with engine_proc("--spawn-child", stdout=subprocess.PIPE) as (proc, port):
        from tests.fakes.engine_proc import engine_stats

        child = engine_stats(port)["child_pid"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert wait_for(lambda: not pid_alive(child), timeout=5)
        text = out.decode()
        assert f"Uvicorn running on http://127.0.0.1:{port}" in text
        assert '"GET /fake/stats HTTP/1.1" 200' in text  # one access line per request


def test_crash_control_exits_1_leaving_child() -> None:
    with engine_proc("--spawn-child") as (proc, port):
        from tests.fakes.engine_proc import engine_control, engine_stats

        child = engine_stats(port)["child_pid"]
        with contextlib.suppress(Exception):
            engine_control(port, crash=True)
        assert proc.wait(timeout=5) == 1
        assert pid_alive(child)
    # engine_proc's cleanup killed the process group, child included.
    assert wait_for(lambda: not pid_alive(child), timeout=5)


def test_exit_immediately() -> None:
    proc = subprocess.run(
        [sys.executable, FAKE_ENGINE_PATH, "--port", str(free_port()), "--exit-immediately", "3"],
        capture_output=True,
        timeout=10,
    )
    assert proc.returncode == 3
    assert proc.stderr.strip()


def test_startup_delay_then_healthy_and_sigterm_during_startup() -> None:
    with engine_proc("--startup-delay", "0.6", wait=False) as (proc, port):
        t0 = time.monotonic()
        time.sleep(0.2)
        assert http_status(f"http://127.0.0.1:{port}/health", timeout=0.2) is None
        assert wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200)
        assert time.monotonic() - t0 >= 0.55
    with engine_proc("--startup-delay", "30", wait=False, stdout=subprocess.PIPE) as (proc, _):
        assert proc.stdout is not None
        for raw in proc.stdout:  # signal handlers are in place once it says it is loading
            if b"Loading model weights" in raw:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
