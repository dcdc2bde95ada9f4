"""Tools, the response store and background responses, through the daemon on fake engines.

Three generate models, one fake engine each: ``chat`` without a tool-call parser,
``tooled`` with ``tool_call_parser = "hermes"``, ``nostore`` with ``responses_store =
false``. As a client sees it: ``tools`` with ``tool_choice`` "auto" (or none given) on a
model without a parser is a 400 in the route's own shape naming the key to set, and never
reaches an engine; "none" and structured output pass; the model with a parser takes the
same request. A model that keeps no responses refuses ``previous_response_id`` in words.
A background response is refused before it reaches an engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.appliance_proc import STEADY_HEALTH, fake_engine_config, run_appliance
from tests.integration.test_protocols import Box

pytestmark = pytest.mark.slow

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    tmp = tmp_path_factory.mktemp("tools")
    cfg: dict[str, Any] = fake_engine_config(tmp, 3, health=STEADY_HEALTH)
    cfg["models"] = [
        {"name": "chat", "cpu_engines": 1},
        {"name": "tooled", "cpu_engines": 1, "tool_call_parser": "hermes"},
        {"name": "nostore", "cpu_engines": 1, "responses_store": False},
    ]
    with run_appliance(tmp, cfg) as app:
        app.wait_all_ready()
        yield Box(app, (tmp / "admin.key").read_text().strip())


def requests_to(box: Box, model: str) -> int:
    engine = next(e for e in box.engines() if e["model"] == model)
    return int((box.app.engine_stats(engine["id"]) or {}).get("requests", 0))


def test_tools_without_a_parser_are_a_400_naming_the_key(box: Box) -> None:
    before = requests_to(box, "chat")
    for path, body in (
        ("/v1/chat/completions", {"messages": MSGS, "tools": [TOOL]}),
        ("/v1/chat/completions", {"messages": MSGS, "tools": [TOOL], "tool_choice": "auto"}),
        ("/v1/responses", {"input": "x", "tools": [TOOL["function"]]}),
    ):
        code, _, err = box.call("POST", path, {"model": "chat", **body})
        assert code == 400, (path, err)
        assert (
            err["error"]["code"] == "tools_not_enabled" and err["error"]["param"] == "tool_choice"
        )
        assert "models.chat.tool_call_parser" in err["error"]["message"]
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = {"model": "chat", "max_tokens": 4, "messages": MSGS, "tools": [tool]}
    code, _, err = box.call("POST", "/v1/messages", body)
    assert code == 400 and err["type"] == "error", err  # Anthropic's shape on its route
    assert err["error"]["type"] == "invalid_request_error"
    assert "models.chat.tool_call_parser" in err["error"]["message"]
    assert requests_to(box, "chat") == before  # refused before any engine


def test_tool_choice_none_and_structured_output_need_no_parser(box: Box) -> None:
    for extra in (
        {"tools": [TOOL], "tool_choice": "none"},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"structured_outputs": {"json": {"type": "object"}}},
    ):
        body = {"model": "chat", "messages": MSGS, "max_tokens": 2, **extra}
        code, _, answer = box.call("POST", "/v1/chat/completions", body)
        assert code == 200, (extra, answer)


def test_the_model_with_a_parser_takes_tools_with_auto_choice(box: Box) -> None:
    body = {"model": "tooled", "messages": MSGS, "max_tokens": 2, "tools": [TOOL]}
    code, _, answer = box.call("POST", "/v1/chat/completions", body)
    assert code == 200, answer
    body = {"model": "tooled", "input": "x", "max_output_tokens": 2, "tools": [TOOL["function"]]}
    code, _, answer = box.call("POST", "/v1/responses", body)
    assert code == 200, answer


def test_a_model_that_keeps_no_responses_says_so(box: Box) -> None:
    code, _, made = box.call(
        "POST", "/v1/responses", {"model": "nostore", "input": "x", "max_output_tokens": 1}
    )
    assert code == 200, made
    body = {"model": "nostore", "input": "y", "previous_response_id": made["id"]}
    code, _, err = box.call("POST", "/v1/responses", body)
    assert code == 400 and err["error"]["code"] == "response_store_off", err
    assert "models.nostore.responses_store = false" in err["error"]["message"]
    code, _, err = box.call("GET", f"/v1/responses/{made['id']}")
    assert code == 404 and err["error"]["code"] == "response_not_found", err


def test_a_background_response_is_refused_before_any_engine_runs_it(box: Box) -> None:
    """vLLM would go on generating a background response after its queued answer (or a
    stream the client leaves): outside admission and counted short. Refused instead."""
    before = box.tokens(box.alice_id)
    for stream in (False, True):
        body = {
            "model": "chat",
            "input": "a b",
            "max_output_tokens": 3,
            "stream": stream,
            "background": True,
        }
        code, _, err = box.call("POST", "/v1/responses", body)
        assert code == 400, err
        assert err["error"]["code"] == "background_not_supported", err
        assert err["error"]["param"] == "background"
    code, _, made = box.call(
        "POST",
        "/v1/responses",
        {"model": "chat", "input": "a b", "max_output_tokens": 3, "background": False},
    )
    assert code == 200 and made["object"] == "response", made
    assert box.tokens(box.alice_id) > before  # the plain one ran and was counted
