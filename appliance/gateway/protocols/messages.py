"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

What the ``anthropic`` SDK and Claude Code send. The key may come as ``x-api-key``
(app.py), and every refusal on these routes is in Anthropic's shape (errors.py).

- **input**: ``messages`` (content a text or blocks: text, images, tool uses and their
  results), ``system`` (a text or text blocks), ``tools``; ``max_tokens`` is required,
  as Anthropic's API requires it (vLLM's model too): a 400 without it, never a cap.
- **max_tokens above the cap is lowered to it** (``gateway.max_tokens_cap``, or the
  model's context when smaller), not refused as on the OpenAI routes: Claude Code asks
  32000 by default and gives up on any 400 but Anthropic's context-limit one, which it
  retries only when that leaves it 3000 tokens or more (checked in Claude Code
  2.1.197); the ``anthropic`` SDK retries none. An answer cut there ends with
  ``stop_reason: "max_tokens"``, as at the client's own limit, and its head carries
  ``X-Appliance-Max-Tokens`` with the value sent (request_body.py).
- **counts**: the whole answer's ``usage``; a stream's ``message_start`` carries the
  prompt's count and ``message_delta`` (just before ``message_stop``) the final ones
  (vLLM 0.32 asks its chat stream for usage on every Messages stream: they always come;
  nothing is added, nothing taken out). Anthropic's ``input_tokens`` leaves out cached
  tokens (``cache_read_input_tokens``, ``cache_creation_input_tokens``): the prompt the
  engine ran is their sum.
- ``count_tokens`` runs no model, but the tokenizer's work is charged to the key's tpm
  like a prompt: its answer's ``input_tokens`` (tokenize.py says why).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.errors import anthropic_error_body
from appliance.gateway.protocols import prompt_text
from appliance.gateway.protocols.base import (
    COUNT,
    Route,
    answer_json,
    bad_request,
    counted_tokens,
    positive,
    sse_data,
    sse_event_name,
)
from appliance.gateway.protocols.cost import (
    MEDIA_PART_TOKENS,
    TEMPLATE_TOKENS,
    TOKENS_PER_MESSAGE,
    TOOLS_TOKENS,
    Cost,
    json_bound,
    strings_tokens,
    text_bound,
    text_tokens,
)
from appliance.gateway.protocols.counts import EventUsage, Usage, is_count
from appliance.gateway.protocols.tools import anthropic_calls_tools

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
MEDIA_BLOCKS = ("image", "document")  # not bounded by their bytes
CACHE_FIELDS = ("cache_read_input_tokens", "cache_creation_input_tokens")
USAGE_EVENTS = frozenset((b"message_start", b"message_delta"))
# vLLM 0.32's two events with counts, whole, as it writes them (pydantic's field order,
# exclude_unset: the cache fields only when the engine counted them). Every quote is a
# key's or a plain string's, none escaped, so no generated text can match; any other
# shape (a stop sequence with an escape, other fields) is parsed.
_USAGE = (
    rb'"usage":\{"input_tokens":' + COUNT + rb',"output_tokens":' + COUNT
    + rb'(?:,"cache_creation_input_tokens":' + COUNT
    + rb')?(?:,"cache_read_input_tokens":' + COUNT + rb")?\}"
)  # fmt: skip
_VLLM_START = re.compile(
    rb'event: message_start\ndata: \{"type":"message_start","message":\{"id":"[^"\\]*",'
    rb'"type":"message","role":"assistant","content":\[\],"model":"[^"\\]*",'
    rb'"stop_reason":null,"stop_sequence":null,' + _USAGE + rb"\}\}\s*\Z"
)
_VLLM_DELTA = re.compile(
    rb'event: message_delta\ndata: \{"type":"message_delta","delta":\{"stop_reason":'
    rb'(?:null|"[a-z_]*"),"stop_sequence":(?:null|"[^"\\]*")\},' + _USAGE + rb"\}\s*\Z"
)


def _check_input(body: Mapping[str, Any]) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise bad_request("'system' must be a text or a list of blocks", "system")


def _check(body: Mapping[str, Any]) -> None:
    _check_input(body)
    if body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required", "max_tokens")


def _blocks_tokens(content: Any) -> int:
    if isinstance(content, str):
        return text_tokens(content)
    if not isinstance(content, list):
        return 0
    total = 0
    for block in content:
        if isinstance(block, dict) and block.get("type") in MEDIA_BLOCKS:
            total += MEDIA_PART_TOKENS
        else:
            total += strings_tokens(block)
    return total


def _prompt_estimate(body: Mapping[str, Any]) -> int:
    total = _blocks_tokens(body.get("system"))
    for message in body["messages"]:
        total += TOKENS_PER_MESSAGE
        if isinstance(message, dict):
            total += _blocks_tokens(message.get("content"))
    tools = body.get("tools")
    return total + (strings_tokens(tools) if tools is not None else 0)


def _cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    asked = positive(body, "max_tokens", None) or 0  # required: _check
    most = min(limits.max_tokens_cap, max_model_len)
    lowered = asked > most
    sent = most if lowered else asked
    prompt = _prompt_estimate(body)
    write = ("max_tokens", sent) if lowered else None
    return Cost(min(prompt + sent, max_model_len), write, sent, lowered=lowered)


def _count_cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    return Cost(min(_prompt_estimate(body), max_model_len))


def _blocks_bound(content: Any, context: int) -> int:
    if isinstance(content, str):
        return text_bound(content)
    if not isinstance(content, list):
        return 0 if content is None else json_bound(content)
    total = 0
    for block in content:
        if isinstance(block, dict) and block.get("type") in MEDIA_BLOCKS:
            return context
        text = block.get("text") if isinstance(block, dict) else None
        total += text_bound(text) if isinstance(text, str) else json_bound(block)
    return total


def _bound(body: Mapping[str, Any], max_model_len: int) -> int:
    total = TEMPLATE_TOKENS + _blocks_bound(body.get("system"), max_model_len)
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else message
        total += TOKENS_PER_MESSAGE + _blocks_bound(content, max_model_len)
    tools = body.get("tools")
    if tools is not None:
        total += TOOLS_TOKENS + json_bound(tools)
    return min(total, max_model_len)


def _usage(usage: Any) -> Usage | None:
    """Anthropic's usage object as (prompt the engine ran, output)."""
    if not isinstance(usage, dict):
        return None
    prompt, output = usage.get("input_tokens"), usage.get("output_tokens")
    cached = [usage.get(n) or 0 for n in CACHE_FIELDS]
    if not (is_count(prompt) and is_count(output) and all(is_count(c) for c in cached)):
        return None
    return Usage(prompt + sum(cached), output)


def _answer_usage(body: bytes) -> Usage | None:
    obj = answer_json(body)
    return _usage(obj.get("usage")) if isinstance(obj, dict) else None


def _event_usage(payload: bytes) -> EventUsage | None:
    """``message_start`` carries the prompt's count, ``message_delta`` the final ones;
    any other event is skipped by its event line, unparsed. vLLM's own two are read off
    their bytes (:data:`_VLLM_START`, :data:`_VLLM_DELTA`); any other shape is parsed."""
    name = sse_event_name(payload)
    if name is not None and name not in USAGE_EVENTS:
        return None
    m = _VLLM_DELTA.match(payload) or _VLLM_START.match(payload)
    if m is not None:
        prompt = int(m[1]) + int(m[3] or 0) + int(m[4] or 0)  # + cached: the prompt run
        return EventUsage(prompt, None if m.re is _VLLM_START else int(m[2]))
    return _parsed_event_usage(payload)


def _parsed_event_usage(payload: bytes) -> EventUsage | None:
    obj = sse_data(payload)
    if not isinstance(obj, dict):
        return None
    kind = obj.get("type")
    if kind == "message_delta":
        got = _usage(obj.get("usage"))
        return None if got is None else EventUsage(got.prompt, got.completion)
    if kind == "message_start" and isinstance(obj.get("message"), dict):
        got = _usage(obj["message"].get("usage"))
        return None if got is None else EventUsage(got.prompt, None)
    return None


def error_event(status: int, message: str, code: str) -> bytes:
    """Anthropic's stream error event: what its SDK raises on."""
    body = anthropic_error_body(status, message)
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"


MESSAGES = Route(
    name="messages",
    client_paths=(PATHS[0],),
    tasks=("generate",),
    check=_check,
    cost=_cost,
    prompt_bound=_bound,
    answer_usage=_answer_usage,
    streams=True,
    event_usage=_event_usage,
    preamble=1,
    shape="anthropic",
    error_event=error_event,
    calls_tools=anthropic_calls_tools,
    media_fields=("messages",),
    prompt=prompt_text.messages,
)
COUNT_TOKENS = Route(
    name="count_tokens",
    client_paths=(PATHS[1],),
    tasks=("generate",),
    check=_check_input,
    cost=_count_cost,
    prompt_bound=_bound,
    answer_usage=counted_tokens("input_tokens"),  # charged like a prompt (tokenize.py)
    shape="anthropic",
    media_fields=("messages",),
)
ROUTES = (MESSAGES, COUNT_TOKENS)
