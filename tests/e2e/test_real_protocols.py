"""The protocol routes (issue 22) on real vLLM 0.32 on CPU, as plain HTTP clients see them.

One daemon for the module, two engines: SmolLM2 as ``chat`` with ``tool_call_parser =
"hermes"`` and all-MiniLM-L6-v2 as ``embed``. SmolLM2-135M-Instruct's chat template is
ChatML and renders no tools at all (so the model never sees them and never calls one);
no vLLM parser is made for it, and hermes, which reads ChatML's ``<tool_call>`` markup,
is the nearest fit: what is proven is that the engine starts with the flags and answers
``tool_choice: "auto"``. The refusal on a model without a parser is the gateway's, before
any engine: tests/integration/test_protocol_tools.py proves it on fake engines (a third
real engine would cost ~40 s and ~1.9 GB here for a check that never reaches it).

Each test asserts what the client gets and, where the engine counts tokens, that the
key's usage rose by exactly the engine's own counts (the usage in its answer or events).
With a 135M model the answers are poor: only their shape is asserted, never their sense,
except the ranking (MiniLM is a real embedding model) and the JSON schema (enforced by
vLLM's structured output, so any model's answer fits it).
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.e2e.conftest import RealAppliance, missing_setup, serving
from tests.e2e.test_real_models import EMBED_MODEL, missing_embedding_model
from tests.e2e.test_real_vllm import engine_metrics, wait_until
from tests.fakes.appliance_proc import real_engine_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CHAT, EMBED = "chat", "embed"
TIMEOUT_S = 240  # a CPU engine beside other tests' engines can be slow to answer


class Client:
    """A user key's view of the daemon, over plain HTTP/1.1."""

    def __init__(self, real: RealAppliance) -> None:
        self.real = real
        self.port = int(real.app.config["gateway"]["port"])
        code, _, made = self.call(
            "POST", "/admin/keys", {"name": "protocols", "scopes": ["user"]}, real.admin_key
        )
        assert code == 201, made
        self.key, self.key_id = made["key"], made["id"]

    def call(
        self, method: str, path: str, body: Any = None, key: str | None = None
    ) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_S)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key or self.key}"}
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        try:
            doc: Any = json.loads(raw)
        except ValueError:
            doc = raw.decode()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, doc

    def post(self, path: str, body: dict[str, Any]) -> Any:
        code, _, doc = self.call("POST", path, body)
        assert code == 200, (path, code, doc)
        return doc

    def tokens(self) -> tuple[float, float]:
        """The key's (prompt, completion) tokens counted so far, from /metrics."""
        _, _, text = self.call("GET", "/metrics", key=self.real.admin_key)
        found = []
        for kind in ("prompt", "completion"):
            m = re.search(
                rf'appliance_key_tokens_total{{key="{self.key_id}",kind="{kind}"}} (\S+)', text
            )
            found.append(float(m[1]) if m else 0.0)
        return found[0], found[1]


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of an SSE body."""
    out = []
    for block in text.split("\n\n"):
        name = re.search(r"^event: (.*)$", block, re.M)
        data = re.search(r"^data: (.*)$", block, re.M)
        if data and data[1].strip() != "[DONE]":
            out.append((name[1] if name else "", json.loads(data[1])))
    return out


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    reason = missing_setup() or missing_embedding_model()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-protocols")
    cfg = real_engine_config(tmp, 1)
    cfg["models"] = [
        {"name": CHAT, "model": "packaged:smollm2-135m-instruct", "tool_call_parser": "hermes"},
        {"name": EMBED, "model": f"packaged:{EMBED_MODEL}"},
    ]
    with serving(tmp, cfg, engines=2) as real:
        print(f"\n[e2e] chat + embed engines READY after {real.timings['all_ready_s']:.1f} s")
        yield Client(real)


# ---- Responses ---------------------------------------------------------------------------
def test_responses_whole_streamed_continued_retrieved_and_cancelled(box: Client) -> None:
    before = box.tokens()
    first = box.post(
        "/v1/responses",
        {"model": CHAT, "input": "Name a colour.", "max_output_tokens": 8, "temperature": 0},
    )
    # Cut by max_output_tokens, vLLM says "incomplete" (the fake says so too).
    assert first["object"] == "response" and first["status"] in ("completed", "incomplete")
    assert first["id"].startswith("resp_")
    text = "".join(
        part.get("text", "")
        for item in first["output"]
        if item.get("type") == "message"
        for part in item["content"]
    )
    assert text, first["output"]
    code, _, stream = box.call(
        "POST",
        "/v1/responses",
        {
            "model": CHAT,
            "input": "And another one?",
            "previous_response_id": first["id"],
            "max_output_tokens": 8,
            "stream": True,
        },
    )
    assert code == 200, stream
    events = sse_events(stream)
    kinds = [e["type"] for _, e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds, kinds
    done = events[-1][1]["response"]
    assert done["previous_response_id"] == first["id"]
    # The continuation's prompt holds the first exchange: longer than its own words.
    assert done["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    after = box.tokens()
    used = (first["usage"], done["usage"])
    assert after[0] - before[0] == sum(u["input_tokens"] for u in used)
    assert after[1] - before[1] == sum(u["output_tokens"] for u in used)

    code, _, got = box.call("GET", f"/v1/responses/{first['id']}")
    assert code == 200 and got["id"] == first["id"] and got["status"] == first["status"], got
    code, _, cancel = box.call("POST", f"/v1/responses/{done['id']}/cancel")
    # vLLM cancels background responses only; a finished one is its 400, relayed.
    assert code == 400 and "synchronous" in cancel["error"]["message"], cancel
    assert box.tokens() == after  # reading a stored response counts nothing again


# ---- Messages ----------------------------------------------------------------------------
def test_messages_whole_and_streamed_and_count_tokens(box: Client) -> None:
    before = box.tokens()
    asked = {
        "model": CHAT,
        "max_tokens": 8,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Say hi."}],
    }
    whole = box.post("/v1/messages", asked)
    assert whole["type"] == "message" and whole["role"] == "assistant", whole
    assert whole["content"][0]["type"] == "text" and whole["content"][0]["text"]
    code, _, stream = box.call("POST", "/v1/messages", {**asked, "stream": True})
    assert code == 200, stream
    events = sse_events(stream)
    kinds = [e["type"] for _, e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "content_block_delta" in kinds
    start = events[0][1]["message"]["usage"]
    final = next(e for _, e in events if e["type"] == "message_delta")["usage"]
    after = box.tokens()
    prompt = whole["usage"]["input_tokens"] + final.get("input_tokens", start["input_tokens"])
    assert after[0] - before[0] == prompt
    assert after[1] - before[1] == whole["usage"]["output_tokens"] + final["output_tokens"]

    counted = box.post(
        "/v1/messages/count_tokens", {k: asked[k] for k in asked if k != "max_tokens"}
    )
    assert counted["input_tokens"] == whole["usage"]["input_tokens"], counted
    # count_tokens runs no model but is not free against tpm (issue 33): its count is
    # charged as prompt tokens.
    assert box.tokens() == (after[0] + counted["input_tokens"], after[1])


# ---- tokenizer, scoring ------------------------------------------------------------------
def test_tokenize_and_detokenize_round_trip(box: Client) -> None:
    text = "The appliance relays every route."
    tokens = box.post("/tokenize", {"model": CHAT, "prompt": text})
    assert tokens["count"] == len(tokens["tokens"]) > 3, tokens
    back = box.post("/detokenize", {"model": CHAT, "tokens": tokens["tokens"]})
    assert back["prompt"] == text


def test_score_and_rerank_put_the_relevant_document_first(box: Client) -> None:
    query = "How do I reset my password?"
    relevant = "To reset your password, open settings and choose 'forgot password'."
    unrelated = "The quarterly revenue of the company rose by eight percent."
    scored = box.post("/score", {"model": EMBED, "text_1": query, "text_2": [unrelated, relevant]})
    by_index = {d["index"]: d["score"] for d in scored["data"]}
    assert by_index[1] > by_index[0], scored
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = box.post(
            path, {"model": EMBED, "query": query, "documents": [unrelated, relevant]}
        )
        assert ranked["results"][0]["index"] == 1, (path, ranked)
        assert ranked["results"][0]["relevance_score"] > ranked["results"][1]["relevance_score"]


# ---- structured output and tools ---------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_chat_with_a_json_schema_answers_json_that_fits_it(box: Client) -> None:
    answer = box.post(
        "/v1/chat/completions",
        {
            "model": CHAT,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 80,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
        },
    )
    content = answer["choices"][0]["message"]["content"]
    assert answer["choices"][0]["finish_reason"] == "stop", answer
    jsonschema.validate(json.loads(content), SCHEMA)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_tools_with_auto_choice_answer_on_the_model_with_a_parser(box: Client) -> None:
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = box.post(
        "/v1/chat/completions",
        {"model": CHAT, "messages": asked, "tools": [WEATHER_TOOL], "max_tokens": 16},
    )
    message = chat["choices"][0]["message"]
    assert message["role"] == "assistant" and (message["content"] or message["tool_calls"])
    function = {"type": "function", **WEATHER_TOOL["function"]}
    responses = box.post(
        "/v1/responses",
        {
            "model": CHAT,
            "input": "What is the weather in Paris?",
            "tools": [function],
            "tool_choice": "auto",
            "max_output_tokens": 16,
        },
    )
    assert responses["status"] in ("completed", "incomplete") and responses["output"], responses


# ---- accounting --------------------------------------------------------------------------
def test_a_stream_left_early_is_counted_at_least_what_vllm_made(box: Client) -> None:
    """With the request's own ``stream_interval`` vLLM puts many tokens in one event: a
    client that leaves after two token events has had 41 tokens and more made, not 2.
    The key is counted at least what the engine made (it was counted 1 for 385 before)."""
    engine = next(e["id"] for e in box.real.status()["engines"] if e["model"] == CHAT)
    made_before = engine_metrics(box.real, engine).get("vllm:generation_tokens_total", 0.0)
    before = box.tokens()
    body = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}],
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "stream_interval": 40,
    }
    conn = http.client.HTTPConnection("127.0.0.1", box.port, timeout=TIMEOUT_S)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {box.key}"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    assert resp.status == 200
    token_events = 0
    while token_events < 2:  # the first token goes alone, then 40 at a time
        line = resp.readline()
        assert line, "the stream ended before its second token event"
        if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
            token_events += 1
    conn.close()
    wait_until(
        lambda: engine_metrics(box.real, engine).get("vllm:num_requests_running", 1.0) == 0,
        30,
        "the engine stopping the request the client left",
    )
    wait_until(lambda: box.tokens()[1] > before[1], 10, "the stream counted for the key")
    made = engine_metrics(box.real, engine)["vllm:generation_tokens_total"] - made_before
    counted = box.tokens()[1] - before[1]
    print(f"\n[e2e] a stream left after 2 events: {made:.0f} tokens made, {counted:.0f} counted")
    assert made >= 41, made
    assert counted >= made, (counted, made)
