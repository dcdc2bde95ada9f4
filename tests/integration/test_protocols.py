"""Every route a developer's tool calls, through the daemon, on fake engines (issue 22).

A box with a generate model on two engines ("chat") and an embedding model on one
("embed"); the fake engines speak vLLM 0.32's Responses, Messages, tokenizer and
scoring routes (tests/fakes/fake_protocols.py). Checked as a client sees it: each route
answers in its protocol's shape; a stored response is read, cancelled and continued on
the engine that made it, by the key that made it only, and is a clear 404 once that
engine restarted; Anthropic's routes take ``x-api-key`` and refuse in Anthropic's shape;
per-key usage rises by the engine's own counts from each protocol's answers and stream
events, on both relay paths (the splice: HTTP/1.1 streams; aiohttp's client: whole
answers and HTTP/1.0 streams); a route a model does not serve is the 400 naming its
routes; nothing else is relayed.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from appliance.gateway.wire.http1 import scan_chunks
from tests.fakes.appliance_proc import STEADY_HEALTH, Appliance, fake_engine_config, run_appliance

pytestmark = pytest.mark.slow

CHAT, EMBED = "chat", "embed"
CAP = 64  # gateway.max_tokens_cap


class Box:
    def __init__(self, app: Appliance, admin: str) -> None:
        self.app = app
        self.admin = admin
        self.port = int(app.config["gateway"]["port"])
        self.alice, self.alice_id = self.new_key("alice")
        self.bob, _ = self.new_key("bob")

    def new_key(self, name: str) -> tuple[str, str]:
        code, _, made = self.call(
            "POST", "/admin/keys", {"name": name, "scopes": ["user"]}, key=self.admin
        )
        assert code == 201, made
        return made["key"], made["id"]

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """A request over HTTP/1.1: (status, headers, the JSON body or the raw text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=20)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if headers is None:
            hdrs["Authorization"] = f"Bearer {key or self.alice}"
        conn.request(method, path, json.dumps(body) if body is not None else None, hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        try:
            doc: Any = json.loads(raw)
        except ValueError:
            doc = raw.decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, doc

    def raw_10(
        self, path: str, body: dict[str, Any], key: str, also: str = ""
    ) -> tuple[int, bytes]:
        """An HTTP/1.0 request (aiohttp's client path for its stream), ``also`` a header
        line more: status, body (read until the gateway closes)."""
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=20) as sock:
            sock.sendall(
                f"POST {path} HTTP/1.0\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{also}"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        head, _, rest = got.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            rest = b"".join(scan_chunks(rest)[1])
        return int(head.split()[1]), rest

    def tokens(self, key_id: str) -> tuple[float, float]:
        """The key's (prompt, completion) tokens, from /metrics."""
        _, _, text = self.call("GET", "/metrics", key=self.admin)
        found = []
        for kind in ("prompt", "completion"):
            m = re.search(
                rf'appliance_key_tokens_total{{key="{key_id}",kind="{kind}"}} (\S+)', text
            )
            found.append(float(m[1]) if m else 0.0)
        return found[0], found[1]

    def engines(self) -> list[dict[str, Any]]:
        code, _, body = self.call("GET", "/admin/status", key=self.admin)
        assert code == 200, body
        return list(body["engines"])

    def served(self, path: str) -> list[int]:
        """How many requests on ``path`` each chat engine answered."""
        out = []
        for e in self.engines():
            if e["model"] == CHAT:
                stats = self.app.engine_stats(e["id"]) or {}
                out.append(int(stats.get("requests_by_route", {}).get(path, 0)))
        return out


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("protocols")
    # A small cap: the fake engine generates every token a request allows.
    cfg: dict[str, Any] = fake_engine_config(
        tmp, 3, health=STEADY_HEALTH, gateway={"max_tokens_cap": CAP}
    )
    cfg["models"] = [
        {"name": CHAT, "cpu_engines": 2},
        {"name": EMBED, "task": "embed", "model": str(tmp), "cpu_engines": 1},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip())


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of an SSE body."""
    out = []
    for block in text.split("\n\n"):
        name = re.search(r"^event: (.*)$", block, re.M)
        data = re.search(r"^data: (.*)$", block, re.M)
        if data:
            out.append((name[1] if name else "", json.loads(data[1])))
    return out


# ---- Responses --------------------------------------------------------------------------
def test_responses_whole_and_streamed_count_the_engines_usage(box: Box) -> None:
    before = box.tokens(box.alice_id)
    code, _, whole = box.call(
        "POST", "/v1/responses", {"model": CHAT, "input": "a b c", "max_output_tokens": 3}
    )
    assert code == 200 and whole["object"] == "response", whole
    assert (
        whole["id"].startswith("resp_")
        and whole["output"][0]["content"][0]["text"] == " tok0 tok1 tok2"
    )
    usage = whole["usage"]
    body = {"model": CHAT, "input": "d e", "max_output_tokens": 4, "stream": True}
    code, _, text = box.call("POST", "/v1/responses", body)  # HTTP/1.1: the splice
    assert code == 200
    events = sse_events(text)
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    done = events[-1][1]["response"]
    assert events[-1][0] == "response.completed" and done["usage"]["output_tokens"] == 4
    code10, raw = box.raw_10("/v1/responses", body, box.alice)  # HTTP/1.0: aiohttp's client
    assert code10 == 200
    done10 = sse_events(raw.decode())[-1][1]["response"]["usage"]
    after = box.tokens(box.alice_id)
    prompt = usage["input_tokens"] + done["usage"]["input_tokens"] + done10["input_tokens"]
    assert after == (before[0] + prompt, before[1] + 3 + 4 + 4)


def test_an_http10_keep_alive_stream_ends_with_the_close(box: Box) -> None:
    """Neither a length nor chunks in HTTP/1.0: the close is the stream's end, keep-alive
    asked or not (the client read until the keep-alive timeout, 75 s, before)."""
    body = {"model": CHAT, "messages": [{"role": "user", "content": "x"}], "stream": True}
    code, raw = box.raw_10(
        "/v1/chat/completions", body, box.alice, also="Connection: keep-alive\r\n"
    )
    assert code == 200 and raw.endswith(b"data: [DONE]\n\n"), raw[-200:]


def test_a_missing_max_output_tokens_becomes_the_cap(box: Box) -> None:
    code, _, whole = box.call("POST", "/v1/responses", {"model": CHAT, "input": "x"})
    assert code == 200, whole
    assert whole["usage"]["output_tokens"] >= 1  # the fake generates what it was told


def test_a_stored_response_is_continued_read_and_cancelled_on_its_own_engine(box: Box) -> None:
    # Made side by side, so both engines make some (admission spreads what is in flight).
    made_before = box.served("/v1/responses")
    first = {"model": CHAT, "input": "one", "max_output_tokens": 30}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: box.call("POST", "/v1/responses", first), range(8)))
    assert all(code == 200 for code, _, _ in answers), answers
    made = [a - b for a, b in zip(box.served("/v1/responses"), made_before, strict=True)]
    assert all(m > 0 for m in made), made  # else this test would prove nothing
    ids = [doc["id"] for _, _, doc in answers]

    def follow(rid: str) -> tuple[int, Any]:
        body = {"model": CHAT, "input": "two", "previous_response_id": rid, "max_output_tokens": 1}
        code, _, nxt = box.call("POST", "/v1/responses", body)
        return code, nxt

    with ThreadPoolExecutor(8) as pool:
        follows = list(pool.map(follow, ids))
    # Any sent to the other engine would be that engine's 404.
    assert all(code == 200 and nxt["previous_response_id"] in ids for code, nxt in follows)
    for rid in ids:
        before = box.served(f"/v1/responses/{rid}")
        code, _, got = box.call("GET", f"/v1/responses/{rid}")
        assert code == 200 and got["id"] == rid
        code, _, cancel = box.call("POST", f"/v1/responses/{rid}/cancel")
        assert code == 400 and "synchronous" in cancel["error"]["message"]  # the engine's
        after = box.served(f"/v1/responses/{rid}")
        assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 1]


def test_another_keys_response_is_404_as_if_it_did_not_exist(box: Box) -> None:
    code, _, made = box.call(
        "POST", "/v1/responses", {"model": CHAT, "input": "secret", "max_output_tokens": 1}
    )
    assert code == 200
    rid = made["id"]
    for method, path, body in (
        ("GET", f"/v1/responses/{rid}", None),
        ("POST", f"/v1/responses/{rid}/cancel", None),
        ("POST", "/v1/responses", {"model": CHAT, "input": "x", "previous_response_id": rid}),
    ):
        code, _, err = box.call(method, path, body, key=box.bob)
        assert code == 404 and err["error"]["code"] == "response_not_found", (path, err)
    code, _, unknown = box.call("GET", "/v1/responses/resp_nosuch", key=box.bob)
    assert code == 404 and unknown["error"]["message"] == err["error"]["message"].replace(
        rid, "resp_nosuch"
    )


def test_a_client_cannot_choose_the_response_id(box: Box) -> None:
    body = {"model": CHAT, "input": "x", "max_output_tokens": 1, "request_id": "resp_mine"}
    code, _, made = box.call("POST", "/v1/responses", body)
    assert code == 200 and made["id"] != "resp_mine"


# ---- Messages ---------------------------------------------------------------------------
def test_messages_take_x_api_key_and_count_the_engines_usage(box: Box) -> None:
    before = box.tokens(box.alice_id)
    body = {"model": CHAT, "max_tokens": 3, "messages": [{"role": "user", "content": "hi there"}]}
    hdrs = {"x-api-key": box.alice, "anthropic-version": "2023-06-01"}
    code, _, whole = box.call("POST", "/v1/messages", body, headers=hdrs)
    assert code == 200 and whole["type"] == "message", whole
    code, _, text = box.call("POST", "/v1/messages", {**body, "stream": True}, headers=hdrs)
    assert code == 200
    events = sse_events(text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    delta = next(d for n, d in events if n == "message_delta")["usage"]
    code10, raw = box.raw_10("/v1/messages", {**body, "stream": True}, box.alice)
    assert code10 == 200 and sse_events(raw.decode())[-1][0] == "message_stop"
    after = box.tokens(box.alice_id)
    prompt = whole["usage"]["input_tokens"] + 2 * delta["input_tokens"]
    assert after == (before[0] + prompt, before[1] + 3 * 3)


def test_messages_above_the_cap_are_lowered_to_it_and_say_so(box: Box) -> None:
    """Claude Code asks max_tokens 32000 unless told: it gets the cap, visibly (the
    engine's own stop_reason, and the value sent in the head), streamed or not."""
    body = {"model": CHAT, "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
    hdrs = {"x-api-key": box.alice}
    code, head, whole = box.call("POST", "/v1/messages", body, headers=hdrs)
    assert code == 200, whole
    assert head.get("x-appliance-max-tokens") == str(CAP), head
    assert (whole["stop_reason"], whole["usage"]["output_tokens"]) == ("max_tokens", CAP)
    code, head, text = box.call("POST", "/v1/messages", {**body, "stream": True}, headers=hdrs)
    assert code == 200 and head.get("x-appliance-max-tokens") == str(CAP), head
    delta = next(d for n, d in sse_events(text) if n == "message_delta")
    assert (delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]) == ("max_tokens", CAP)
    # At the cap: sent as asked, nothing said. The OpenAI routes still refuse above it.
    code, head, _ = box.call("POST", "/v1/messages", {**body, "max_tokens": CAP}, headers=hdrs)
    assert code == 200 and "x-appliance-max-tokens" not in head, head
    chat = {"model": CHAT, "max_tokens": CAP + 1, "messages": body["messages"]}
    code, _, err = box.call("POST", "/v1/chat/completions", chat)
    assert code == 400 and err["error"]["param"] == "max_tokens", err


def test_messages_refusals_are_in_anthropics_shape(box: Box) -> None:
    body = {"model": CHAT, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({"anthropic-version": "2023-06-01"}, body, 401, "authentication_error"),
        ({"x-api-key": "sk-la-nope-nope"}, body, 401, "authentication_error"),
        ({"x-api-key": box.alice}, {**body, "max_tokens": None}, 400, "invalid_request_error"),
        ({"x-api-key": box.alice}, {**body, "model": "gpt-9"}, 404, "not_found_error"),
        ({"x-api-key": box.alice}, {**body, "model": EMBED}, 400, "invalid_request_error"),
    ]
    for headers, sent, status, kind in cases:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            code, _, err = box.call("POST", path, sent, headers=headers)
            if path.endswith("count_tokens") and sent.get("max_tokens", 0) is None:
                assert code == 200, err  # count_tokens needs no max_tokens
                continue
            assert (code, err["type"], err["error"]["type"]) == (status, "error", kind), err
            assert isinstance(err["error"]["message"], str) and "param" not in err


def test_count_tokens_answers_the_engines_count_and_charges_it(box: Box) -> None:
    # No model runs, but the tokenizer's work counts like a prompt's (issue 33): a key's
    # tpm bounds it (tests/integration/test_request_bounds.py).
    before = box.tokens(box.alice_id)
    body = {"model": CHAT, "messages": [{"role": "user", "content": "one two three"}]}
    code, _, got = box.call(
        "POST", "/v1/messages/count_tokens", body, headers={"x-api-key": box.alice}
    )
    assert code == 200 and got["input_tokens"] > 0
    assert box.tokens(box.alice_id) == (before[0] + got["input_tokens"], before[1])


def test_a_broken_messages_stream_ends_with_anthropics_error_event(box: Box) -> None:
    for e in box.engines():
        if e["model"] == CHAT:
            box.app.engine_control(e["id"], break_before_usage=True)
    try:
        before = box.tokens(box.alice_id)
        body = {
            "model": CHAT,
            "max_tokens": 3,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        code, _, text = box.call("POST", "/v1/messages", body, headers={"x-api-key": box.alice})
        assert code == 200
        name, data = sse_events(text)[-1]
        assert name == "error" and data == {
            "type": "error",
            "error": {"type": "api_error", "message": data["error"]["message"]},
        }
        after = box.tokens(box.alice_id)
        # No final count: the engine's prompt (message_start) and at least the 3 tokens.
        start = sse_events(text)[0][1]["message"]["usage"]["input_tokens"]
        assert after[0] == before[0] + start and after[1] >= before[1] + 3
    finally:
        for e in box.engines():
            if e["model"] == CHAT:
                box.app.engine_control(e["id"], break_before_usage=False)


# ---- tokenizer, scoring, and what is not relayed ----------------------------------------
def test_tokenize_and_detokenize_on_any_model(box: Box) -> None:
    for model in (CHAT, EMBED):
        code, _, tok = box.call("POST", "/tokenize", {"model": model, "prompt": "a b c"})
        assert code == 200 and tok["count"] == 3, tok
        code, _, text = box.call("POST", "/detokenize", {"model": model, "tokens": [1, 2]})
        assert code == 200 and text["prompt"] == "tok1 tok2"


def test_score_and_rerank_on_the_embedding_model_count_its_usage(box: Box) -> None:
    before = box.tokens(box.alice_id)
    total = 0
    for path in ("/score", "/v1/score"):
        code, _, got = box.call(
            "POST", path, {"model": EMBED, "queries": "q", "documents": ["a", "b c"]}
        )
        assert code == 200 and len(got["data"]) == 2, got
        total += got["usage"]["prompt_tokens"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        code, _, got = box.call(
            "POST", path, {"model": EMBED, "query": "q", "documents": ["a", "b"]}
        )
        assert code == 200 and len(got["results"]) == 2, got
        total += got["usage"]["prompt_tokens"]
    assert box.tokens(box.alice_id) == (before[0] + total, before[1])


def test_a_route_the_model_does_not_serve_is_400_naming_its_routes(box: Box) -> None:
    code, _, err = box.call("POST", "/rerank", {"model": CHAT, "query": "q", "documents": ["a"]})
    assert code == 400 and err["error"]["code"] == "model_wrong_route"
    assert "/v1/responses" in err["error"]["message"] and "/v1/messages" in err["error"]["message"]
    code, _, err = box.call("POST", "/v1/responses", {"model": EMBED, "input": "x"})
    assert code == 400 and "/v2/rerank" in err["error"]["message"]


def test_other_engine_routes_are_never_relayed(box: Box) -> None:
    for path in ("/pooling", "/classify", "/sleep", "/v1/foo", "/v1/responses/x/y", "/invocations"):
        code, _, err = box.call("POST", path, {"model": CHAT})
        assert code == 404 and err["error"]["code"] == "unknown_route", (path, err)
    code, _, _ = box.call("POST", "/tokenize", {"model": CHAT, "prompt": "x"}, headers={})
    assert code == 401  # the routes outside /v1 need a key too


# ---- last: restarts an engine -----------------------------------------------------------
def test_a_response_made_before_its_engine_restarted_is_a_404_that_says_so(box: Box) -> None:
    code, _, made = box.call(
        "POST", "/v1/responses", {"model": CHAT, "input": "x", "max_output_tokens": 1}
    )
    assert code == 200
    rid = made["id"]
    # Which engine made it: the one that answers the retrieve.
    before = box.served(f"/v1/responses/{rid}")
    assert box.call("GET", f"/v1/responses/{rid}")[0] == 200
    after = box.served(f"/v1/responses/{rid}")
    chat_ids = [e["id"] for e in box.engines() if e["model"] == CHAT]
    holder = chat_ids[[a - b for a, b in zip(after, before, strict=True)].index(1)]
    pid = next(e for e in box.engines() if e["id"] == holder)["pid"]
    code, _, _ = box.call("POST", f"/admin/engines/{holder}/restart", key=box.admin)
    assert code in (200, 202)
    box.app.wait_for(
        lambda: any(
            e["id"] == holder and e["pid"] not in (None, pid) and e["state"] == "READY"
            for e in box.engines()
        ),
        30,
        "the engine restarted",
    )
    for method, path, body in (
        ("GET", f"/v1/responses/{rid}", None),
        ("POST", "/v1/responses", {"model": CHAT, "input": "x", "previous_response_id": rid}),
    ):
        code, _, err = box.call(method, path, body)
        assert code == 404 and "has restarted since" in err["error"]["message"], err
