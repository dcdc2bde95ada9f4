"""The gateway as a developer meets it: the official ``openai`` client, sync and async.

One daemon for the whole module (two fake engines), so the set stays fast. Tests that
change an engine's knobs (token delay, injected failures) put them back when done, and
the test that crashes an engine waits for its replacement before it returns.

Health checks are rare and lenient here (one every ten minutes, ``failures_to_restart =
100``) so an engine that is told to fail requests stays READY and keeps being routed to:
that is what the failover test needs (a failed check would make it SUSPECT, out of
routing, at once), and it keeps the fake's ``last_request`` from being overwritten by
probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.fakes.appliance_proc import Appliance, fake_engine_config, get_json, run_appliance

pytestmark = pytest.mark.slow

FAST_TOKEN_MS = 2.0


@dataclass
class Gw:
    app: Appliance
    admin_key: str
    user_key: str
    model: str

    @property
    def base_url(self) -> str:
        return self.app.url + "/v1"

    def client(self, **kw: Any) -> OpenAI:
        kw.setdefault("timeout", 15.0)
        return OpenAI(base_url=self.base_url, api_key=self.user_key, max_retries=0, **kw)

    def aclient(self, **kw: Any) -> AsyncOpenAI:
        kw.setdefault("timeout", 15.0)
        return AsyncOpenAI(base_url=self.base_url, api_key=self.user_key, max_retries=0, **kw)

    def stats(self, i: int) -> dict[str, Any]:
        s = self.app.engine_stats(i)
        assert s is not None, f"engine {i} does not answer /fake/stats"
        return s

    def metric(self, name: str) -> float:
        """The sum of every sample of ``name`` (no labels) on /metrics."""
        req = urllib.request.Request(
            self.app.url + "/metrics", headers={"Authorization": f"Bearer {self.admin_key}"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def status(self) -> dict[str, Any]:
        code, body = get_json(
            self.app.url + "/admin/status",
            headers={"Authorization": f"Bearer {self.admin_key}"},
        )
        assert code == 200, body
        return body  # type: ignore[no-any-return]

    def wait_all_ready(self, timeout: float = 20.0) -> None:
        self.app.wait_for(
            lambda: all(e["state"] == "READY" for e in self.status()["engines"]),
            timeout,
            "every engine READY",
        )

    @contextlib.contextmanager
    def knobs(self, **knobs: Any) -> Iterator[None]:
        """Set fake-engine knobs on every engine; back to fast and healthy afterwards."""
        for i in range(2):
            self.app.engine_control(i, **knobs)
        try:
            yield
        finally:
            for i in range(2):
                self.app.engine_control(
                    i, token_delay_ms=FAST_TOKEN_MS, fail_requests=False, hang=False
                )


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    tmp = tmp_path_factory.mktemp("gw_openai")
    cfg = fake_engine_config(tmp, 2, health={"interval_s": 600, "failures_to_restart": 100})
    with run_appliance(tmp, cfg) as app:
        app.wait_ready()
        admin = (tmp / "admin.key").read_text().strip()
        req = urllib.request.Request(
            app.url + "/admin/keys",
            data=json.dumps({"name": "openai-tests", "scopes": ["user"]}).encode(),
            headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 201
            user_key = json.loads(r.read())["key"]
        code, models = get_json(
            app.url + "/v1/models", headers={"Authorization": f"Bearer {admin}"}
        )
        assert code == 200, models
        g = Gw(app, admin, user_key, models["data"][0]["id"])
        g.wait_all_ready()
        yield g


def chat_messages(text: str = "hello there") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- plain calls ----------------------------------------------------------------------


def test_models_list(gw: Gw) -> None:
    with gw.client() as c:
        page = c.models.list()
    assert [m.id for m in page.data] == [gw.model]
    assert page.data[0].object == "model"
    # The admin key that first start wrote works with the client too (admin allows /v1).
    with OpenAI(base_url=gw.base_url, api_key=gw.admin_key, max_retries=0, timeout=10) as c:
        assert [m.id for m in c.models.list().data] == [gw.model]


def test_chat_completion_not_streamed(gw: Gw) -> None:
    with gw.client() as c:
        r = c.chat.completions.create(model=gw.model, messages=chat_messages(), max_tokens=4)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == " tok0 tok1 tok2 tok3"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_chat_completion_streamed(gw: Gw) -> None:
    with gw.client() as c:
        stream = c.chat.completions.create(
            model=gw.model,
            messages=chat_messages(),
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == " tok0 tok1 tok2 tok3 tok4"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_completions_streamed_and_not(gw: Gw) -> None:
    with gw.client() as c:
        r = c.completions.create(model=gw.model, prompt="once upon a time", max_tokens=3)
        assert r.choices[0].text == " tok0 tok1 tok2"
        assert r.usage is not None and r.usage.completion_tokens == 3
        parts = [
            ch.choices[0].text
            for ch in c.completions.create(
                model=gw.model, prompt="once upon a time", max_tokens=3, stream=True
            )
            if ch.choices
        ]
    assert "".join(parts) == " tok0 tok1 tok2"


def test_embeddings_on_a_chat_model_is_400_naming_its_routes(gw: Gw) -> None:
    # The one model here generates; embeddings are an embed model's (test_models.py).
    with gw.client() as c, pytest.raises(openai.BadRequestError) as err:
        c.embeddings.create(model=gw.model, input="alpha")
    assert err.value.code == "model_wrong_route" and "/v1/chat/completions" in err.value.message


async def test_async_client_stream_and_not_concurrently(gw: Gw) -> None:
    async with gw.aclient() as c:

        async def plain(i: int) -> str:
            r = await c.chat.completions.create(
                model=gw.model, messages=chat_messages(f"hi {i}"), max_tokens=3
            )
            return r.choices[0].message.content or ""

        async def streamed(i: int) -> str:
            stream = await c.chat.completions.create(
                model=gw.model, messages=chat_messages(f"hi {i}"), max_tokens=3, stream=True
            )
            return "".join([ch.choices[0].delta.content or "" async for ch in stream])

        async def completion() -> str:
            r = await c.completions.create(model=gw.model, prompt="x", max_tokens=2)
            return r.choices[0].text

        results = await asyncio.gather(
            *(plain(i) for i in range(8)), *(streamed(i) for i in range(8)), completion()
        )
        models = await c.models.list()
    assert results[:16] == [" tok0 tok1 tok2"] * 16
    assert results[16] == " tok0 tok1"
    assert [m.id for m in models.data] == [gw.model]
    # Both engines took part: the router spreads concurrent work.
    assert all(gw.stats(i)["requests"] > 0 for i in range(2))


# ---- streaming is passed through as produced ----------------------------------------


def test_stream_chunks_arrive_as_the_engine_produces_them(gw: Gw) -> None:
    with gw.knobs(token_delay_ms=50), gw.client() as c:
        started = time.monotonic()
        arrivals: list[float] = []
        for ch in c.chat.completions.create(
            model=gw.model, messages=chat_messages(), max_tokens=10, stream=True
        ):
            if ch.choices and ch.choices[0].delta.content:
                arrivals.append(time.monotonic() - started)
    assert len(arrivals) == 10
    # Tokens come every 50 ms: the first must not wait for the last (buffering would
    # deliver all ten together at ~0.5 s), and they must trickle in, not in one burst.
    assert arrivals[-1] - arrivals[0] >= 0.3, arrivals
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert sum(g >= 0.02 for g in gaps) >= 5, gaps


async def test_async_stream_chunks_arrive_as_produced(gw: Gw) -> None:
    with gw.knobs(token_delay_ms=50):
        async with gw.aclient() as c:
            started = time.monotonic()
            stream = await c.completions.create(
                model=gw.model, prompt="x", max_tokens=8, stream=True
            )
            arrivals = [time.monotonic() - started async for ch in stream if ch.choices]
    assert len(arrivals) >= 8
    assert arrivals[-1] - arrivals[0] >= 0.25, arrivals


# ---- the client's key stays at the gateway ---------------------------------------------


def test_engine_never_sees_the_client_key(gw: Gw) -> None:
    with gw.client() as c:
        for _ in range(3):  # a health probe may overwrite last_request in between
            marker = f"marker-{time.monotonic_ns()}"
            r = c.chat.completions.create(
                model=gw.model, messages=chat_messages(marker), max_tokens=2
            )
            assert r.choices[0].message.content == " tok0 tok1"
            seen = [gw.stats(i)["last_request"] for i in range(2)]
            if any(marker in json.dumps(s) for s in seen):
                break
    # The request reached an engine, so the gateway sent that engine's own key; the
    # client's key is not it: an engine refuses the client's key outright.
    assert any(marker in json.dumps(s) for s in seen), seen
    assert all(gw.user_key not in json.dumps(s) for s in seen)
    for i in range(2):
        for headers in ({"Authorization": f"Bearer {gw.user_key}"}, {}):
            code, body = gw.app.engine_request(i, "GET", "/v1/models", headers=headers)
            assert (code, body) == (401, {"error": "Unauthorized"}), (i, headers)


# ---- the client goes away: the engine aborts -----------------------------------------


def _aborts(gw: Gw) -> int:
    return sum(gw.stats(i)["aborts"] for i in range(2))


def _wait_aborted(gw: Gw, before: int, within: float = 2.0) -> float:
    started = time.monotonic()
    deadline = started + within
    while time.monotonic() < deadline:
        stats = [gw.stats(i) for i in range(2)]
        if sum(s["aborts"] for s in stats) > before and all(s["running"] == 0 for s in stats):
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(
        f"no abort within {within} s: aborts {before} -> {_aborts(gw)}, running "
        f"{[gw.stats(i)['running'] for i in range(2)]}"
    )


def _wait_slots_free(gw: Gw) -> None:
    gw.app.wait_for(
        lambda: all(e["inflight"] == 0 for e in gw.status()["engines"]), 5, "gateway slots free"
    )


def test_disconnect_mid_stream_aborts_the_generation(gw: Gw) -> None:
    with gw.knobs(token_delay_ms=50), gw.client() as c:
        before = _aborts(gw)
        stream = c.chat.completions.create(
            model=gw.model, messages=chat_messages(), max_tokens=400, stream=True
        )
        got = 0
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                got += 1
                if got == 3:
                    break
        assert sum(e["inflight"] for e in gw.status()["engines"]) == 1
        stream.close()
        _wait_aborted(gw, before)
    # The gateway gave the slot back too (the engine may see the hang-up first).
    _wait_slots_free(gw)


async def test_async_disconnect_mid_stream_aborts_the_generation(gw: Gw) -> None:
    with gw.knobs(token_delay_ms=50):
        before = _aborts(gw)
        async with gw.aclient() as c:
            stream = await c.completions.create(
                model=gw.model, prompt="x", max_tokens=400, stream=True
            )
            async for _ in stream:
                break
            await stream.close()
        await asyncio.to_thread(_wait_aborted, gw, before)


def test_client_timeout_on_unstreamed_request_aborts_the_generation(gw: Gw) -> None:
    with gw.knobs(token_delay_ms=50), gw.client(timeout=0.4) as c:
        before = _aborts(gw)
        with pytest.raises(openai.APITimeoutError):
            c.chat.completions.create(model=gw.model, messages=chat_messages(), max_tokens=400)
        _wait_aborted(gw, before)
    _wait_slots_free(gw)


# ---- engine failures -----------------------------------------------------------------


def test_failing_engine_is_failed_over_before_the_first_byte(gw: Gw) -> None:
    failovers = gw.metric("appliance_failovers_total")
    failed = gw.stats(0)["failed"]
    with gw.knobs(), gw.client() as c:
        gw.app.engine_control(0, fail_requests=True)
        # Idle engines tie, and ties go to engine 0: every request tries it first.
        for _ in range(3):
            r = c.chat.completions.create(model=gw.model, messages=chat_messages(), max_tokens=2)
            assert r.choices[0].message.content == " tok0 tok1"
        parts = [
            ch.choices[0].delta.content or ""
            for ch in c.chat.completions.create(
                model=gw.model, messages=chat_messages(), max_tokens=2, stream=True
            )
            if ch.choices
        ]
        assert "".join(parts) == " tok0 tok1"
    assert gw.stats(0)["failed"] > failed  # engine 0 really was tried and failed
    assert gw.metric("appliance_failovers_total") >= failovers + 1
    ok = f'appliance_requests_total{{model="{gw.model}",route="/v1/chat/completions",status="200"}}'
    assert gw.metric(ok) > 0


def test_engine_crash_mid_stream_ends_with_a_clean_error(gw: Gw) -> None:
    with gw.knobs(token_delay_ms=150), gw.client(timeout=10.0) as c:
        stream = c.chat.completions.create(
            model=gw.model, messages=chat_messages(), max_tokens=100, stream=True
        )
        it = iter(stream)
        while True:
            ch = next(it)
            if ch.choices and ch.choices[0].delta.content:
                break
        # Which engine streams it: the gateway's count (health probes are not in it).
        serving = [e["id"] for e in gw.status()["engines"] if e["inflight"] > 0]
        assert len(serving) == 1, serving
        gw.app.engine_control(serving[0], crash=True)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in it:
                pass
        waited = time.monotonic() - started
    assert not isinstance(info.value, openai.APITimeoutError)
    assert waited < 3.0, f"the client waited {waited:.1f} s for the broken stream to end"
    # The gateway's error event, not a dropped connection.
    assert isinstance(info.value.body, dict) and info.value.body.get("code") == "engine_error"
    gw.wait_all_ready()
    with gw.client() as c:
        r = c.chat.completions.create(model=gw.model, messages=chat_messages(), max_tokens=2)
    assert r.choices[0].message.content == " tok0 tok1"
