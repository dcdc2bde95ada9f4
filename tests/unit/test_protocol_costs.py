"""Each protocol's cost estimate, prompt bound and usage readers, as tables (protocols/).

The estimate is what admission and the tpm bucket are charged before the engine answers;
the bound is what a request cut off before its count is charged (never below what the
engine counted); the readers take the engine's own counts from a whole answer and from
stream events. Each row is one body or one answer, and what the gateway makes of it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.config import GatewayConfig
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols import ROUTES
from appliance.gateway.protocols.cost import TEMPLATE_TOKENS, TOKENS_PER_MESSAGE, Cost, text_tokens
from appliance.gateway.protocols.counts import EventUsage, Usage

LIMITS = GatewayConfig()  # max_tokens_cap 4096
CTX = 1024
M = TOKENS_PER_MESSAGE

COSTS: list[tuple[str, str, dict[str, Any], Cost]] = [
    # Responses: a text input, instructions, max_output_tokens; absent: the cap, written
    ("responses text", "responses", {"input": "abcdefgh", "max_output_tokens": 10},
     Cost(M + 2 + 10, None, 10)),
    ("responses instructions", "responses",
     {"input": "abcd", "instructions": "abcdefgh", "max_output_tokens": 1},
     Cost(2 + M + 1 + 1, None, 1)),
    ("responses items", "responses",
     {"input": [{"role": "user", "content": "abcd"}, {"role": "user", "content": "abcd"}],
      "max_output_tokens": 5},
     Cost(2 * M + 2 * (1 + 1 + 2 + 1) + 5, None, 5)),  # keys count: role, content
    ("responses no max: what the context leaves, written", "responses", {"input": "abcd"},
     Cost(CTX, ("max_output_tokens", CTX - M - 1), CTX - M - 1)),
    # Messages: system, content blocks, max_tokens (required)
    ("messages text", "messages",
     {"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 7},
     Cost(M + 2 + 7, None, 7)),
    ("messages system and blocks", "messages",
     {"system": "abcd", "max_tokens": 3,
      "messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]},
     Cost(1 + M + 4 + 3, None, 3)),  # a block's strings: type, text, text, abcd
    # above the cap (or the context, here the smaller): lowered to it and written, not refused
    ("messages max_tokens above the context: lowered", "messages",
     {"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": 32000},
     Cost(CTX, ("max_tokens", CTX), CTX, lowered=True)),
    ("messages max_tokens at the context: as sent", "messages",
     {"messages": [{"role": "user", "content": "abcdefgh"}], "max_tokens": CTX},
     Cost(CTX, None, CTX)),
    ("messages image block", "messages",
     {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     Cost(min(M + 1024 + 1, CTX), None, 1)),
    # count_tokens: its prompt only
    ("count_tokens", "count_tokens", {"messages": [{"role": "user", "content": "abcd"}]},
     Cost(M + 1)),
    # tokenizer: the text, or the chat rendering; detokenize: the ids
    ("tokenize prompt", "tokenize", {"prompt": "abcdefgh"}, Cost(2)),
    ("detokenize", "detokenize", {"tokens": [1, 2, 3]}, Cost(3)),
    # score and rerank: every query and document once
    ("score text_1/text_2", "score", {"text_1": "abcd", "text_2": ["abcd", "abcdefgh"]},
     Cost(1 + 1 + 2)),
    ("score queries/documents", "score", {"queries": ["abcd"], "documents": "abcd"}, Cost(2)),
    ("rerank", "rerank", {"query": "abcd", "documents": ["abcd", "abcd", "abcd"]}, Cost(4)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "expect"), [r[1:] for r in COSTS], ids=[r[0] for r in COSTS]
)
def test_cost(route: str, body: dict[str, Any], expect: Cost) -> None:
    spec = ROUTES[route]
    spec.check(body)
    assert spec.cost(body, LIMITS, CTX) == expect
    # The bound is never below the estimate's prompt part (a cut-off request pays it).
    prompt = expect.tokens - (expect.completion_bound or 0)
    assert spec.prompt_bound(body, CTX) >= min(prompt, CTX)


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("responses", {"input": []}, "input"),
    ("responses", {"input": "x", "previous_response_id": 3}, "previous_response_id"),
    ("responses", {"input": "x", "instructions": ["x"]}, "instructions"),
    ("messages", {"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ("messages", {"messages": []}, "messages"),
    ("messages", {"messages": [{"role": "user", "content": "x"}], "system": 3}, "system"),
    ("tokenize", {}, "prompt"),
    ("detokenize", {"tokens": "1 2"}, "tokens"),
    ("score", {"text_1": "x"}, "documents"),
    ("rerank", {"query": "x", "documents": []}, "documents"),
]


@pytest.mark.parametrize(("route", "body", "param"), REFUSED)
def test_a_body_without_its_input_is_a_400_naming_the_field(
    route: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(GatewayError) as info:
        ROUTES[route].check(body)
    assert info.value.status == 400 and info.value.param == param


def test_a_responses_answer_above_the_cap_is_refused_never_clamped() -> None:
    body = {"input": "x", "max_output_tokens": 4097}
    with pytest.raises(GatewayError) as info:
        ROUTES["responses"].cost(body, LIMITS, 8192)
    assert info.value.param == "max_output_tokens" and "4096" in info.value.message


def test_a_messages_answer_above_the_cap_is_lowered_to_it() -> None:
    """Claude Code's default 32000 (docs/connect-your-tools.md): the cap is sent instead."""
    body = {"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 32000}
    cost = ROUTES["messages"].cost(body, LIMITS, 8192)
    assert (cost.write, cost.lowered, cost.completion_bound) == (("max_tokens", 4096), True, 4096)
    assert ROUTES["messages"].cost({**body, "max_tokens": 4096}, LIMITS, 8192).write is None


def test_bounds_give_up_on_what_the_gateway_cannot_see() -> None:
    bound = ROUTES["responses"].prompt_bound
    assert bound({"input": "x", "previous_response_id": "resp_1"}, CTX) == CTX
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]
    assert bound({"input": image}, CTX) == CTX
    # at most a token per byte, plus 2 per text (no instructions: an empty one)
    assert bound({"input": "abcd"}, CTX) == TEMPLATE_TOKENS + 2 + M + 4 + 2
    image_block = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    assert ROUTES["messages"].prompt_bound({"messages": image_block}, CTX) == CTX


# ---- usage readers -----------------------------------------------------------------------
def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


ANSWERS: list[tuple[str, str, Any, Usage | None]] = [
    ("responses", "responses", {"usage": {"input_tokens": 5, "output_tokens": 7}}, Usage(5, 7)),
    ("responses no usage", "responses", {"usage": None}, None),
    ("responses bad count", "responses", {"usage": {"input_tokens": -1, "output_tokens": 1}},
     None),
    ("messages", "messages", {"usage": {"input_tokens": 4, "output_tokens": 2}}, Usage(4, 2)),
    ("messages cached", "messages",
     {"usage": {"input_tokens": 4, "output_tokens": 2, "cache_read_input_tokens": 6,
                "cache_creation_input_tokens": 1}}, Usage(11, 2)),
    # The tokenizer routes run no model, but their counts are charged like a prompt's.
    ("count_tokens", "count_tokens", {"input_tokens": 9}, Usage(9, 0)),
    ("count_tokens no count", "count_tokens", {"input_tokens": "9"}, None),
    ("tokenize", "tokenize", {"count": 3, "tokens": [1, 2, 3]}, Usage(3, 0)),
    ("tokenize bad count", "tokenize", {"count": -3}, None),
    ("detokenize: no count, charged its ids", "detokenize", {"prompt": "a b"}, None),
    ("score", "score", {"usage": {"prompt_tokens": 12, "total_tokens": 12}}, Usage(12, 0)),
    ("rerank", "rerank", {"usage": {"prompt_tokens": 8, "total_tokens": 8}}, Usage(8, 0)),
    ("not json", "responses", "<html>", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "answer", "expect"), [r[1:] for r in ANSWERS], ids=[r[0] for r in ANSWERS]
)
def test_answer_usage(route: str, answer: Any, expect: Usage | None) -> None:
    raw = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
    assert ROUTES[route].answer_usage(raw) == expect


EVENTS: list[tuple[str, str, bytes, EventUsage | None]] = [
    ("responses created: usage null", "responses",
     sse("response.created", {"type": "response.created", "response": {"usage": None}}), None),
    ("responses delta", "responses",
     sse("response.output_text.delta", {"type": "response.output_text.delta", "delta": "x"}),
     None),
    ("responses completed", "responses",
     sse("response.completed", {"type": "response.completed",
                                "response": {"usage": {"input_tokens": 3, "output_tokens": 4}}}),
     EventUsage(3, 4)),
    ("responses incomplete", "responses",
     sse("response.incomplete", {"type": "response.incomplete",
                                 "response": {"usage": {"input_tokens": 3, "output_tokens": 9}}}),
     EventUsage(3, 9)),
    ("messages start: the prompt", "messages",
     sse("message_start", {"type": "message_start",
                           "message": {"usage": {"input_tokens": 6, "output_tokens": 0}}}),
     EventUsage(6, None)),
    ("messages delta: the final counts", "messages",
     sse("message_delta", {"type": "message_delta",
                           "usage": {"input_tokens": 6, "output_tokens": 5}}),
     EventUsage(6, 5)),
    ("messages text delta", "messages",
     sse("content_block_delta", {"type": "content_block_delta", "delta": {"text": "usage"}}),
     None),
    ("not json", "messages", b"event: ping\ndata: {oops\n\n", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "payload", "expect"), [r[1:] for r in EVENTS], ids=[r[0] for r in EVENTS]
)
def test_event_usage(route: str, payload: bytes, expect: EventUsage | None) -> None:
    reader = ROUTES[route].event_usage
    assert reader is not None
    assert reader(payload) == expect


def test_text_tokens_is_what_the_tables_assume() -> None:
    assert (text_tokens("abcd"), text_tokens("abcdefgh"), text_tokens("abcde")) == (1, 2, 2)
