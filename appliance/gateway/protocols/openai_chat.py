"""OpenAI's chat completions: ``POST /v1/chat/completions``.

The body needs ``messages``; its cost and bound are cost.py's chat rules (a prompt from
the messages and tools, ``max_completion_tokens`` or ``max_tokens``, written when
absent); a stream's counts come from the usage event the gateway asks for
(stream_tap.StreamTap), after one role event.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.protocols import prompt_text
from appliance.gateway.protocols.base import Route, bad_request
from appliance.gateway.protocols.cost import Cost, prompt_bound, request_cost
from appliance.gateway.protocols.counts import usage_of_answer
from appliance.gateway.protocols.logprobs import chat_prompt_logprobs
from appliance.gateway.protocols.tools import openai_calls_tools


def _check(body: Mapping[str, Any]) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")


def _cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    return request_cost("chat", body, limits, max_model_len)


def _bound(body: Mapping[str, Any], max_model_len: int) -> int:
    return prompt_bound("chat", body, max_model_len)


CHAT = Route(
    name="chat",
    client_paths=("/v1/chat/completions",),
    tasks=("generate",),
    check=_check,
    cost=_cost,
    prompt_bound=_bound,
    answer_usage=usage_of_answer,
    streams=True,
    preamble=1,
    calls_tools=openai_calls_tools,
    prompt_logprobs=chat_prompt_logprobs,
    media_fields=("messages",),
    prompt=prompt_text.chat,
)
ROUTES = (CHAT,)
