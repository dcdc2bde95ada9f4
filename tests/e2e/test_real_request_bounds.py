"""What one request may make a real vLLM 0.32 engine do (issue 33), on CPU.

One daemon for the module, one SmolLM2 engine (``tool_call_parser = "hermes"``), so a
stalled engine cannot be hidden by a second one taking the next request.

- A JSON schema whose ``pattern`` nests counted repetition compiled for minutes (n = 9:
  never) under xgrammar, vLLM's default, in a pool of one worker per two cores, so every
  other structured request on the engine waited behind it. The engines now run with the
  ``guidance`` backend: the schema answers at once, and a ``json_object``, a json_schema,
  ``tool_choice: "required"`` and a named tool sent while it runs answer too. With the
  old command line (no ``--structured-outputs-config``) the victims time out here.
- ``prompt_logprobs`` (and ``echo`` with logprobs) is refused by the gateway before the
  engine sees it (its prompt-token counter does not move).
- A prompt longer than the context is vLLM's 400, in the gateway's shape with a string
  code (Anthropic's on /v1/messages), not vLLM's integer one.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import RealAppliance, missing_setup, serving
from tests.e2e.test_real_vllm import engine_metrics, wait_until
from tests.fakes.appliance_proc import real_engine_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CHAT = "chat"
# Long enough for a loaded 2-core box (a victim answers in a few seconds when nothing
# stalls it); far shorter than the evil compile under xgrammar, which never ends.
VICTIM_TIMEOUT_S = 120
MSGS = [{"role": "user", "content": "Give me a JSON object about a cat."}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def nested_pattern(levels: int) -> str:
    """``(([a-z]{1,9}){1,9}){1,9}`` for 3 levels: xgrammar's compile grows with each."""
    pattern = "[a-z]{1,9}"
    for _ in range(levels - 1):
        pattern = f"({pattern}){{1,9}}"
    return pattern


EVIL = {"type": "string", "pattern": nested_pattern(9)}


class Box:
    """A user key on the running daemon, with timed calls."""

    def __init__(self, real: RealAppliance) -> None:
        self.real = real
        self.port = int(real.app.config["gateway"]["port"])
        code, made, _ = self.call(
            "POST", "/admin/keys", {"name": "bounds", "scopes": ["user"]}, key=real.admin_key
        )
        assert code == 201, made
        self.key = made["key"]

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        key: str | None = None,
        timeout: float = VICTIM_TIMEOUT_S,
    ) -> tuple[int | None, Any, float]:
        """(status, JSON body, seconds); status None when no answer came in ``timeout``."""
        started = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key or self.key}"}
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, headers)
            resp = conn.getresponse()
            raw = resp.read()
        except TimeoutError:
            return None, None, time.monotonic() - started
        finally:
            conn.close()
        try:
            doc: Any = json.loads(raw)
        except ValueError:
            doc = raw.decode(errors="replace")
        return resp.status, doc, time.monotonic() - started

    def chat(self, extra: dict[str, Any], timeout: float = VICTIM_TIMEOUT_S) -> Any:
        body = {"model": CHAT, "messages": MSGS, "max_tokens": 24, "temperature": 0, **extra}
        return self.call("POST", "/v1/chat/completions", body, timeout=timeout)

    def prompt_tokens(self) -> float:
        return engine_metrics(self.real, 0).get("vllm:prompt_tokens_total", 0.0)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    reason = missing_setup()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("e2e-bounds")
    cfg = real_engine_config(tmp, 1)
    cfg["models"] = [
        {"name": CHAT, "model": "packaged:smollm2-135m-instruct", "tool_call_parser": "hermes"}
    ]
    with serving(tmp, cfg, engines=1) as real:
        print(f"\n[e2e] chat engine READY after {real.timings['all_ready_s']:.1f} s")
        yield Box(real)


def test_a_schema_that_stalls_xgrammar_leaves_structured_output_to_everyone(box: Box) -> None:
    evil_format = {"type": "json_schema", "json_schema": {"name": "evil", "schema": EVIL}}
    victims: dict[str, dict[str, Any]] = {
        "json_object": {"response_format": {"type": "json_object"}},
        "json_schema": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "cat", "schema": TOOL["function"]["parameters"]},
            }
        },
        "tool_choice required": {"tools": [TOOL], "tool_choice": "required"},
        "named tool": {
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    }
    with concurrent.futures.ThreadPoolExecutor(max_workers=1 + len(victims)) as pool:
        evil = pool.submit(box.chat, {"response_format": evil_format})
        # The victims go while the evil schema is on the engine (or already answered).
        wait_until(
            lambda: evil.done() or box.real.engine(0)["inflight"] >= 1, 30, "the evil request"
        )
        sent = {name: pool.submit(box.chat, extra) for name, extra in victims.items()}
        answers = {name: f.result() for name, f in sent.items()}
        evil_status, evil_doc, evil_s = evil.result()
    print(
        f"\n[e2e] evil schema: {evil_status} in {evil_s:.1f} s; victims: "
        + ", ".join(f"{n} {a[0]} in {a[2]:.1f} s" for n, a in answers.items())
    )
    for name, (status, doc, _) in answers.items():
        assert status == 200, (name, status, doc)  # None: no answer in VICTIM_TIMEOUT_S
        assert doc["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), doc
    # The evil request itself answers (guidance compiles it lazily) or is refused: it
    # never holds the engine.
    assert evil_status in (200, 400), (evil_status, evil_doc)
    # A named tool is answered as a call of that tool (vLLM parses the constrained JSON).
    call = answers["named tool"][1]["choices"][0]["message"]
    assert call["tool_calls"][0]["function"]["name"] == "get_weather", call


def test_prompt_logprobs_are_refused_before_the_engine(box: Box) -> None:
    before = box.prompt_tokens()
    for path, body, param in (
        ("/v1/chat/completions", {"messages": MSGS, "prompt_logprobs": 20}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "a b c", "echo": True, "logprobs": 5}, "echo"),
    ):
        status, doc, _ = box.call("POST", path, {"model": CHAT, "max_tokens": 1, **body})
        assert status == 400, doc
        error = doc["error"]
        assert error["code"] == "prompt_logprobs_not_allowed" and error["param"] == param
        assert "models.chat.allow_prompt_logprobs" in error["message"]
    assert box.prompt_tokens() == before  # nothing reached the engine
    # Logprobs of the generated tokens still pass.
    status, doc, _ = box.chat({"logprobs": True, "top_logprobs": 2, "max_tokens": 2})
    assert status == 200 and doc["choices"][0]["logprobs"], doc


def test_a_prompt_longer_than_the_context_is_refused_in_the_gateway_shape(box: Box) -> None:
    long_text = "word " * 1500  # max_model_len is 1024 (real_engine_config)
    too_long = {"model": CHAT, "prompt": long_text, "max_tokens": 4}
    # What vLLM itself answers (its /invocations takes a completions body without the
    # engine key): an integer code, which the gateway must not pass on.
    raw_status, raw = box.real.app.engine_request(
        0,
        "POST",
        "/invocations",
        json.dumps(too_long).encode(),
        {"Content-Type": "application/json"},
        timeout=60,
    )
    print(f"\n[e2e] vLLM's own answer: {raw_status} {json.dumps(raw)[:400]}")
    assert raw_status == 400 and raw["error"]["code"] == 400, raw
    assert "maximum context length" in raw["error"]["message"], raw
    status, doc, _ = box.call("POST", "/v1/completions", too_long)
    assert status == 400, doc
    error = doc["error"]
    assert error["code"] == "context_length_exceeded", error  # a string, not vLLM's 400
    assert error["type"] == "invalid_request_error"
    assert "maximum context length" in error["message"]
    body = {
        "model": CHAT,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": long_text}],
    }
    status, doc, _ = box.call("POST", "/v1/messages", body)
    assert status == 400, doc
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    assert "maximum context length" in doc["error"]["message"]
