"""What a model refuses of a body before admission (issue 33), and an engine's refusal
in the gateway's shape: pure functions, tested as tables.

- prompt logprobs (``prompt_logprobs``, ``echo`` with logprobs) are a 400 naming the
  field unless the model's ``allow_prompt_logprobs`` is true;
- media URLs: only ``data:`` unless the model's ``allowed_media_domains`` lists the host;
- an engine's 4xx body (vLLM's integer code, its exception name as the type, FastAPI's
  ``detail``, the older ``object: error``) comes back with a string code, in Anthropic's
  shape on its routes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from aiohttp import web

from appliance.config import ServedModel, parse_config
from appliance.gateway.errors import engine_refusal
from appliance.gateway.protocols import ROUTES
from appliance.gateway.protocols.media import media_urls, url_allowed
from appliance.gateway.protocols.refusals import model_refusal

MSGS = [{"role": "user", "content": "hi"}]
PNG = "data:image/png;base64,iVBORw0KGgo="


def model(**engine: Any) -> ServedModel:
    served = parse_config({"models": [{"name": "chat"}]}).served[0]
    return dataclasses.replace(served, engine=dataclasses.replace(served.engine, **engine))


# ---- prompt logprobs ---------------------------------------------------------------------
LOGPROBS: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("chat prompt_logprobs", "chat", {"messages": MSGS, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat prompt_logprobs 0", "chat", {"messages": MSGS, "prompt_logprobs": 0},
     "prompt_logprobs"),
    ("chat prompt_logprobs -1 (all)", "chat", {"messages": MSGS, "prompt_logprobs": -1},
     "prompt_logprobs"),
    ("chat prompt_logprobs null", "chat", {"messages": MSGS, "prompt_logprobs": None}, None),
    # vLLM's chat defaults top_logprobs to 0: echo alone asks for them
    ("chat echo", "chat", {"messages": MSGS, "echo": True}, "echo"),
    ("chat echo, top_logprobs null", "chat",
     {"messages": MSGS, "echo": True, "top_logprobs": None}, None),
    ("chat logprobs of the answer", "chat",
     {"messages": MSGS, "logprobs": True, "top_logprobs": 5}, None),
    ("completions prompt_logprobs", "completions", {"prompt": "x", "prompt_logprobs": 20},
     "prompt_logprobs"),
    ("completions echo with logprobs", "completions",
     {"prompt": "x", "echo": True, "logprobs": 0}, "echo"),
    ("completions echo alone", "completions", {"prompt": "x", "echo": True}, None),
    # vLLM's pydantic reads echo leniently: these are all true to it
    ("completions echo 1 with logprobs", "completions",
     {"prompt": "x", "echo": 1, "logprobs": 20}, "echo"),
    ("completions echo 'yes' with logprobs", "completions",
     {"prompt": "x", "echo": "yes", "logprobs": 20}, "echo"),
    ("chat echo 'true'", "chat", {"messages": MSGS, "echo": "true"}, "echo"),
    ("chat echo 1.0", "chat", {"messages": MSGS, "echo": 1.0}, "echo"),
    # and these false
    ("chat echo 'false'", "chat", {"messages": MSGS, "echo": "false"}, None),
    ("chat echo 0", "chat", {"messages": MSGS, "echo": 0}, None),
    ("completions echo false", "completions",
     {"prompt": "x", "echo": False, "logprobs": 20}, None),
    ("completions logprobs of the answer", "completions", {"prompt": "x", "logprobs": 5}, None),
    ("responses has none", "responses", {"input": "x", "prompt_logprobs": 5}, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "field"), [r[1:] for r in LOGPROBS], ids=[r[0] for r in LOGPROBS]
)
def test_prompt_logprobs_are_refused_unless_allowed(
    route: str, body: dict[str, Any], field: str | None
) -> None:
    got = model_refusal(ROUTES[route], body, model(), tables=True)
    if field is None:
        assert got is None
        return
    assert got is not None and got.status == 400
    assert (got.code, got.param) == ("prompt_logprobs_not_allowed", field)
    assert "models.chat.allow_prompt_logprobs = true" in got.message
    assert model_refusal(ROUTES[route], body, model(allow_prompt_logprobs=True), True) is None


def test_without_tables_the_logprobs_refusal_names_the_engine_key() -> None:
    served = parse_config({}).served[0]
    got = model_refusal(ROUTES["chat"], {"prompt_logprobs": 1}, served, tables=False)
    assert got is not None and "engine.allow_prompt_logprobs" in got.message


# ---- media URLs --------------------------------------------------------------------------
def image_part(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_with(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}]}


MEDIA: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("chat data url", "chat", chat_with(image_part(PNG)), None),
    ("chat DATA url", "chat", chat_with(image_part("DATA:image/png;base64,AAAA")), None),
    ("chat http image", "chat", chat_with(image_part("http://10.0.0.1/x.png")),
     "messages[0].content[1].image_url.url"),
    ("chat https image, simple form", "chat",
     chat_with({"image_url": "https://example.com/a.png"}), "messages[0].content[1].image_url"),
    ("chat file url", "chat", chat_with(image_part("file:///etc/passwd")),
     "messages[0].content[1].image_url.url"),
    ("chat audio url", "chat",
     chat_with({"type": "audio_url", "audio_url": {"url": "http://a/b.wav"}}),
     "messages[0].content[1].audio_url.url"),
    ("chat video url", "chat",
     chat_with({"type": "video_url", "video_url": {"url": "https://a/b.mp4"}}),
     "messages[0].content[1].video_url.url"),
    ("chat text that is a URL", "chat",
     {"messages": [{"role": "user", "content": "see http://example.com"}]}, None),
    ("chat: a schema is not media", "chat",
     {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"examples": [{"url": "http://example.com"}]}}}}, None),
    ("responses input_image", "responses",
     {"input": [{"role": "user", "content": [
         {"type": "input_image", "image_url": "http://169.254.169.254/latest"}]}]},
     "input[0].content[0].image_url"),
    ("responses input_file", "responses",
     {"input": [{"role": "user", "content": [
         {"type": "input_file", "file_url": "https://example.com/a.pdf"}]}]},
     "input[0].content[0].file_url"),
    ("responses text input", "responses", {"input": "http://example.com"}, None),
    ("messages url source", "messages",
     {"max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}]},
     "messages[0].content[0].source.url"),
    ("messages base64 source", "messages",
     {"max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                      "data": "AAAA"}}]}]}, None),
    ("messages image in a tool result", "messages",
     {"max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "tool_result", "tool_use_id": "t", "content": [
             {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]},
     "messages[0].content[0].content[0].source.url"),
    ("count_tokens url source", "count_tokens",
     {"messages": [{"role": "user", "content": [
         {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     "messages[0].content[0].source.url"),
    ("tokenize chat messages", "tokenize", chat_with(image_part("http://x/y.png")),
     "messages[0].content[1].image_url.url"),
    ("rerank image document", "rerank",
     {"query": "q", "documents": [{"content": [image_part("http://x/y.png")]}]},
     "documents[0].content[0].image_url.url"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "where"), [r[1:] for r in MEDIA], ids=[r[0] for r in MEDIA]
)
def test_media_urls_other_than_data_are_refused(
    route: str, body: dict[str, Any], where: str | None
) -> None:
    got = model_refusal(ROUTES[route], body, model(), tables=True)
    if where is None:
        assert got is None
        return
    assert got is not None and got.status == 400
    assert (got.code, got.param) == ("media_url_not_allowed", where)
    assert "data: URL" in got.message and "models.chat.allowed_media_domains" in got.message


HOSTS = ("images.example.com", "10.0.0.5")


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("https://images.example.com/a.png", True),
        ("http://IMAGES.example.com:8080/a.png?x=1", True),  # the host alone, as vLLM compares
        ("http://10.0.0.5/a.png", True),
        ("https://example.com/a.png", False),
        ("https://images.example.com.evil.net/a.png", False),
        ("https://evil.net/images.example.com/a.png", False),
        ("https://user@evil.net/a.png", False),
        ("ftp://images.example.com/a.png", False),
        ("file://images.example.com/etc/passwd", False),
        ("//images.example.com/a.png", False),
        ("http://[::1/a.png", False),  # not a URL: the engine would refuse it too
        (PNG, True),
    ],
)
def test_listed_hosts_pass_by_host_name(url: str, allowed: bool) -> None:
    assert url_allowed(url, HOSTS) is allowed
    body = chat_with(image_part(url))
    got = model_refusal(ROUTES["chat"], body, model(allowed_media_domains=list(HOSTS)), True)
    assert (got is None) is allowed
    if got is not None:
        assert "images.example.com, 10.0.0.5" in got.message


def test_the_walk_names_every_url_in_order() -> None:
    body = chat_with(image_part(PNG), image_part("http://a/1"), {"image_url": {"url": "b"}})
    assert list(media_urls(body, ("messages",))) == [
        ("messages[0].content[1].image_url.url", PNG),
        ("messages[0].content[2].image_url.url", "http://a/1"),
        ("messages[0].content[3].image_url.url", "b"),
    ]


# ---- an engine's refusal in the gateway's shape --------------------------------------------
CONTEXT = (
    "This model's maximum context length is 1024 tokens. However, your prompt contains "
    "1502 input tokens, which exceeds this limit even without any output tokens. Please "
    "reduce the length of the input prompt. (parameter=input_tokens, value=1502)"
)
ENGINE_BODIES: list[tuple[str, int, Any, str, str | None, str]] = [
    ("vLLM 0.32", 400,
     {"error": {"message": "bad top_k", "type": "BadRequestError", "param": "top_k",
                "code": 400}}, "bad top_k", "top_k", "invalid_request"),
    ("vLLM 0.32 context length", 400,
     {"error": {"message": CONTEXT, "type": "BadRequestError", "param": None, "code": 400}},
     CONTEXT, None, "context_length_exceeded"),
    ("older object: error", 400,
     {"object": "error", "message": "bad n", "type": "BadRequestError", "param": "n",
      "code": 400}, "bad n", "n", "invalid_request"),
    ("vLLM's anthropic envelope", 400,
     {"type": "error", "error": {"type": "BadRequestError", "message": CONTEXT}},
     CONTEXT, None, "context_length_exceeded"),
    ("FastAPI detail text", 404, {"detail": "Not Found"}, "Not Found", None, "not_found"),
    ("FastAPI detail list", 422,
     {"detail": [{"loc": ["body", "n"], "msg": "Input should be a valid integer"}]},
     "Input should be a valid integer", None, "invalid_request"),
    ("not JSON", 400, "plain words", "plain words", None, "invalid_request"),
    ("empty", 400, "", "the engine refused the request (HTTP 400)", None, "invalid_request"),
    ("a JSON list", 400, [1], "the engine refused the request (HTTP 400)", None,
     "invalid_request"),
]  # fmt: skip


def doc(resp: web.Response) -> Any:
    assert resp.text is not None
    return json.loads(resp.text)


@pytest.mark.parametrize(
    ("status", "body", "message", "param", "code"),
    [r[1:] for r in ENGINE_BODIES],
    ids=[r[0] for r in ENGINE_BODIES],
)
def test_an_engines_refusal_comes_back_in_the_gateways_shape(
    status: int, body: Any, message: str, param: str | None, code: str
) -> None:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    resp = engine_refusal(status, raw)
    assert resp.status == status and resp.content_type == "application/json"
    error = doc(resp)["error"]
    assert error == {
        "message": message,
        "type": "invalid_request_error" if status != 404 else "not_found_error",
        "param": param,
        "code": code,
    }
    anthropic = doc(engine_refusal(status, raw, "anthropic"))
    assert anthropic["type"] == "error" and anthropic["error"]["message"] == message
    assert anthropic["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_a_long_engine_message_is_cut() -> None:
    resp = engine_refusal(400, json.dumps({"error": {"message": "x" * 100_000}}).encode())
    assert len(doc(resp)["error"]["message"]) == 4096


@pytest.mark.parametrize("status", [401, 403])
def test_an_engine_refusing_the_gateways_key_is_a_502_not_the_clients_401(status: int) -> None:
    """The engine's 401/403 is about the gateway's own per-start key (an engine restarted
    under the request): the client's key is fine, so no 401 with WWW-Authenticate."""
    raw = json.dumps({"error": "Unauthorized"}).encode()
    for shape in ("openai", "anthropic"):
        resp = engine_refusal(status, raw, shape)  # type: ignore[arg-type]
        assert resp.status == 502 and "WWW-Authenticate" not in resp.headers
        assert resp.headers["Retry-After"] == "1"
    assert doc(engine_refusal(status, raw))["error"]["code"] == "engine_error"
