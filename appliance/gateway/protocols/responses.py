"""OpenAI's Responses API: ``POST /v1/responses`` (its retrieve and cancel: relay/pinned.py).

- **input**: ``input`` is a text or a list of items (messages whose content is a text or
  parts, function calls and their outputs, ...), with ``instructions`` and ``tools``
  rendered by the chat template as for chat. ``max_output_tokens`` bounds the answer;
  without it vLLM 0.32 generates to the end of the context (``get_max_tokens``), so the
  gateway writes ``max_tokens_cap`` (never more than the context leaves) as it does
  ``max_completion_tokens`` for chat.
- **state**: vLLM keeps a stored response (``store``, true by default, with
  ``VLLM_ENABLE_RESPONSES_API_STORE=1``, which engine.py sets) in the memory of the
  engine that made it, under the response's id, which is the request's ``request_id``
  (a vLLM field). The gateway writes a ``request_id`` of its own into every request, so
  it knows the id before the answer (no stream parsing) and a client cannot choose
  another's; ``previous_response_id`` sends the request to the engine that holds it.
- **counts**: the whole answer's ``usage`` (``input_tokens``, ``output_tokens``); a
  stream always ends with ``response.completed`` carrying the same: nothing is asked
  for, nothing taken out. vLLM sends ``response.created`` and ``response.in_progress``
  before the first token's events.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols import prompt_text
from appliance.gateway.protocols.base import (
    COUNT,
    Route,
    StateRef,
    answer_json,
    bad_request,
    positive,
    sse_data,
    sse_event_name,
)
from appliance.gateway.protocols.cost import (
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
from appliance.gateway.protocols.tools import openai_calls_tools

ID_PREFIX = "resp_"
# The events that carry the response's final usage (the stream's last).
USAGE_EVENTS = frozenset((b"response.completed", b"response.incomplete", b"response.failed"))
# vLLM 0.32's final event ends with the response's usage and its last fields (pydantic's
# order), then the event's own two: matched from the last ``,"usage":{"input_tokens":``
# to the payload's end. Every quote in it is a key's or a plain string's, none escaped,
# so none of it can be generated text (whose quotes are escaped); the last ``}`` closes
# the event, so the object closed just before ``"sequence_number"`` is the event's last
# object value, its ``response`` (vLLM's event has no other), and "usage" is that
# object's own key, not a nested one. Any other shape (a vLLM with other fields, an
# echoed ``kv_transfer_params``, a ``user`` with an escape) fails the match and is parsed.
_USAGE_KEY = b',"usage":{"input_tokens":'
_DETAILS = rb'(?:null|\{(?:"[a-z_]+":(?:null|\d+|\[[\d,]*\])(?:,(?="))?)*\})'
_FLOAT = rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_VLLM_END = re.compile(
    re.escape(_USAGE_KEY) + COUNT + rb',"input_tokens_details":' + _DETAILS
    + rb',"output_tokens":' + COUNT + rb',"output_tokens_details":' + _DETAILS
    + rb',"total_tokens":\d+\},"user":(?:null|"[^"\\]*"),"presence_penalty":' + _FLOAT
    + rb',"frequency_penalty":' + _FLOAT
    + rb',"kv_transfer_params":null,"ec_transfer_params":null,"input_messages":null,'
    rb'"output_messages":null\},"sequence_number":\d+,'
    rb'"type":"response\.(?:completed|incomplete|failed)"\}\s*\Z'
)  # fmt: skip
MEDIA_TYPES = ("input_image", "input_file", "input_audio")  # not bounded by their bytes


def _check(body: Mapping[str, Any]) -> None:
    value = body.get("input")
    if not isinstance(value, (str, list)) or (isinstance(value, list) and not value):
        raise bad_request("'input' must be a text or a non-empty list of items", "input")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise bad_request("'previous_response_id' must be a string", "previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    if body.get("background") not in (None, False):
        raise _background_refused()


def _background_refused() -> GatewayError:
    """vLLM runs a background response in a task of its own, not tied to the request: its
    queued answer (or a stream the client leaves) ends the gateway's part while the
    engine goes on generating, outside admission (max_inflight, the queue, heat) and
    counted short (the events relayed)."""
    return GatewayError(
        400,
        "'background' responses are not served here: their generation would run outside "
        "the gateway's admission and token accounting; send the request without it "
        "(stream it to see a long answer as it comes)",
        param="background",
        code="background_not_supported",
        reason="bad_request",
    )


def _prompt_estimate(body: Mapping[str, Any]) -> int:
    value = body["input"]
    total = text_tokens(body.get("instructions") or "")
    if isinstance(value, str):
        total += TOKENS_PER_MESSAGE + text_tokens(value)
    else:
        total += sum(TOKENS_PER_MESSAGE + strings_tokens(item) for item in value)
    tools = body.get("tools")
    return total + (strings_tokens(tools) if tools is not None else 0)


def _cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    prompt = _prompt_estimate(body)
    cap = limits.max_tokens_cap
    asked = positive(body, "max_output_tokens", cap)
    write: tuple[str, int] | None = None
    if asked is None:
        room = max_model_len - prompt
        asked = min(cap, room) if room > 0 else min(cap, max_model_len)
        write = ("max_output_tokens", asked)
    return Cost(min(prompt + asked, max_model_len), write, asked)


def _has_media(value: Any) -> bool:
    """Whether an item holds a part the gateway cannot bound (an image, a file)."""
    text = json.dumps(value)
    return any(f'"{t}"' in text for t in MEDIA_TYPES)


def _bound(body: Mapping[str, Any], max_model_len: int) -> int:
    # The previous response's conversation and a stored prompt are the engine's to
    # render: nothing here bounds them.
    if body.get("previous_response_id") is not None or body.get("prompt") is not None:
        return max_model_len
    value = body.get("input")
    total = TEMPLATE_TOKENS + text_bound(body.get("instructions") or "")
    if isinstance(value, str):
        total += TOKENS_PER_MESSAGE + text_bound(value)
    elif isinstance(value, list):
        if _has_media(value):
            return max_model_len
        total += sum(TOKENS_PER_MESSAGE + json_bound(item) for item in value)
    tools = body.get("tools")
    if tools is not None:
        total += TOOLS_TOKENS + json_bound(tools)
    return min(total, max_model_len)


def _usage(obj: Any) -> Usage | None:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    if not (is_count(prompt) and is_count(completion)):
        return None
    return Usage(prompt, completion)


def _answer_usage(body: bytes) -> Usage | None:
    return _usage(answer_json(body))


def _event_usage(payload: bytes) -> EventUsage | None:
    """``response.completed`` (or ``.incomplete``/``.failed``) carries the response, and
    its ``usage``; the first events carry ``"usage":null`` and are skipped by their event
    line, unparsed. vLLM's own final event is read off its bytes (:data:`_VLLM_END`);
    any other shape is parsed."""
    name = sse_event_name(payload)
    if name is not None and name not in USAGE_EVENTS:
        return None
    at = payload.rfind(_USAGE_KEY)
    end = _VLLM_END.match(payload, at) if at >= 0 else None
    if end is not None:
        return EventUsage(int(end[1]), int(end[2]))
    obj = sse_data(payload)
    got = _usage(obj.get("response")) if isinstance(obj, dict) else None
    return None if got is None else EventUsage(got.prompt, got.completion)


def _prepare(body: dict[str, Any]) -> bool:
    """The response's id, chosen here (module docstring): a client's ``request_id`` is
    replaced, so no client can name another's stored response."""
    body["request_id"] = ID_PREFIX + secrets.token_hex(16)
    return True


def _state(body: Mapping[str, Any]) -> StateRef:
    stored = body.get("store") is not False  # true by default
    made = body.get("request_id") if stored else None
    prev = body.get("previous_response_id")
    return StateRef(
        made if isinstance(made, str) else None, prev if isinstance(prev, str) else None
    )


def error_event(status: int, message: str, code: str) -> bytes:
    """The Responses API's stream error event (``type: error``)."""
    data = {"type": "error", "code": code, "message": message, "param": None}
    return b"event: error\ndata: " + json.dumps(data).encode() + b"\n\n"


RESPONSES = Route(
    name="responses",
    client_paths=("/v1/responses",),
    tasks=("generate",),
    check=_check,
    cost=_cost,
    prompt_bound=_bound,
    answer_usage=_answer_usage,
    streams=True,
    event_usage=_event_usage,
    preamble=2,
    prepare=_prepare,
    state=_state,
    error_event=error_event,
    calls_tools=openai_calls_tools,
    media_fields=("input",),
    prompt=prompt_text.responses,
)
ROUTES = (RESPONSES,)
