"""What one request may cost the box (issue 33), through the daemon, on fake engines.

Two generate models, one fake engine each: ``chat`` as the defaults leave it, and
``open``, which allows prompt logprobs and media from one host, and whose engine's
context is 64 tokens (the fake counts a word a token). As a client sees it:

- ``prompt_logprobs`` (and ``echo`` with logprobs) is a 400 naming the field and the key
  that allows it, and never reaches the engine; the model that allows it takes it;
- a media URL that is not ``data:`` is a 400 naming where it is (Anthropic's shape on
  /v1/messages), before any engine; a listed host passes on the model that lists it;
- a prompt longer than the engine's context is the engine's 400 in the gateway's shape,
  with a string code (vLLM's own has the integer 400), in Anthropic's on /v1/messages;
- /tokenize is charged to the key's tpm, so a key with a small tpm gets 429.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, run_appliance
from tests.integration.test_protocols import Box

pytestmark = pytest.mark.slow

MSGS = [{"role": "user", "content": "hi"}]
PNG = "data:image/png;base64,iVBORw0KGgo="
CONTEXT = 64  # the "open" model's engine: --max-model-len


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("bounds")
    cfg: dict[str, Any] = fake_engine_config(tmp, 2, health=STEADY_HEALTH)
    command = [*cfg["engine"]["command"]]
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {
            "name": "open",
            "cpu_engines": 1,
            "allow_prompt_logprobs": True,
            "allowed_media_domains": ["images.example.com"],
            "command": [*command[:2], "--max-model-len", str(CONTEXT), *command[2:]],
        },
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip())


def requests_to(box: Box, model: str) -> int:
    engine = next(e for e in box.engines() if e["model"] == model)
    return int((box.app.engine_stats(engine["id"]) or {}).get("requests", 0))


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": MSGS, "max_tokens": 2, **extra}


def image(url: str) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return {"messages": [{"role": "user", "content": content}]}


def test_prompt_logprobs_are_refused_before_the_engine_unless_allowed(box: Box) -> None:
    before = requests_to(box, "chat")
    for path, body, param in (
        ("/v1/chat/completions", chat("chat", prompt_logprobs=5), "prompt_logprobs"),
        ("/v1/chat/completions", chat("chat", echo=True), "echo"),
        (
            "/v1/completions",
            {"model": "chat", "prompt": "a b", "echo": True, "logprobs": 1},
            "echo",
        ),
    ):
        code, _, err = box.call("POST", path, body)
        assert code == 400, (path, err)
        assert err["error"]["code"] == "prompt_logprobs_not_allowed"
        assert err["error"]["param"] == param
        assert "models.chat.allow_prompt_logprobs" in err["error"]["message"]
    assert requests_to(box, "chat") == before
    code, _, answer = box.call("POST", "/v1/chat/completions", chat("open", prompt_logprobs=5))
    assert code == 200, answer


def test_media_urls_are_data_only_unless_the_model_lists_the_host(box: Box) -> None:
    before = requests_to(box, "chat")
    for url in ("http://169.254.169.254/latest/meta-data", "file:///etc/shadow"):
        code, _, err = box.call("POST", "/v1/chat/completions", chat("chat", **image(url)))
        assert code == 400, err
        assert err["error"]["code"] == "media_url_not_allowed"
        assert err["error"]["param"] == "messages[0].content[1].image_url.url"
    source = {"type": "url", "url": "https://images.example.com/a.png"}
    body = {
        "model": "chat",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }
    code, _, err = box.call("POST", "/v1/messages", body, headers={"x-api-key": box.alice})
    assert code == 400 and err["type"] == "error", err  # Anthropic's shape on its route
    assert "models.chat.allowed_media_domains" in err["error"]["message"]
    assert requests_to(box, "chat") == before
    # Inline data passes; a listed host passes on the model that lists it, no other.
    code, _, answer = box.call("POST", "/v1/chat/completions", chat("chat", **image(PNG)))
    assert code == 200, answer
    listed = image("https://images.example.com/cat.png")
    code, _, answer = box.call("POST", "/v1/chat/completions", chat("open", **listed))
    assert code == 200, answer
    code, _, err = box.call(
        "POST", "/v1/chat/completions", chat("open", **image("https://example.com/cat.png"))
    )
    assert code == 400 and "images.example.com" in err["error"]["message"], err


def test_a_prompt_longer_than_the_context_is_refused_in_the_gateways_shape(box: Box) -> None:
    long = " ".join(["word"] * (CONTEXT * 2))
    for path, body in (
        ("/v1/completions", {"model": "open", "prompt": long, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "open", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": long}]}),
        ("/v1/chat/completions", {"model": "open", "max_tokens": 2, "stream": True,
                                  "messages": [{"role": "user", "content": long}]}),
    ):  # fmt: skip
        code, _, err = box.call("POST", path, body)
        assert code == 400, (path, err)
        error = err["error"]
        assert error["code"] == "context_length_exceeded", (path, error)  # not vLLM's 400
        assert error["type"] == "invalid_request_error"
        assert "maximum context length is 64 tokens" in error["message"]
    body = {"model": "open", "max_tokens": 2, "messages": [{"role": "user", "content": long}]}
    code, _, err = box.call("POST", "/v1/messages", body, headers={"x-api-key": box.alice})
    assert code == 400, err
    # Anthropic's type names, not vLLM's exception name ("BadRequestError").
    assert err == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": err["error"]["message"]},
    }
    assert "maximum context length" in err["error"]["message"]


def test_tokenize_is_charged_to_the_keys_tpm(box: Box) -> None:
    code, _, made = box.call(
        "POST", "/admin/keys", {"name": "tokenizer", "scopes": ["user"], "tpm": 100}, key=box.admin
    )
    assert code == 201, made
    text = " ".join(["w"] * 40)  # the fake counts 40 tokens; the gateway estimates 20
    answers = []
    for _ in range(8):
        code, _, got = box.call(
            "POST", "/tokenize", {"model": "chat", "prompt": text}, key=made["key"]
        )
        answers.append(code)
        if code == 429:
            assert got["error"]["code"] == "rate_limit_tpm", got
            break
        assert code == 200 and got["count"] == 40, got
    # 100 tokens a minute hold two counts of 40 and part of a third: then 429.
    assert answers == [200, 200, 200, 429], answers
