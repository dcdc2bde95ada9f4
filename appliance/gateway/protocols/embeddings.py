"""OpenAI's embeddings: ``POST /v1/embeddings``, on ``task = "embed"`` models.

The body needs ``input``; it costs its prompts (nothing is generated). vLLM answers with
one JSON body whatever ``stream`` says, and so does the relay (``streams`` False).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.protocols.base import Route, require_list_or_text
from appliance.gateway.protocols.cost import Cost, prompt_bound, request_cost
from appliance.gateway.protocols.counts import usage_of_answer


def _check(body: Mapping[str, Any]) -> None:
    require_list_or_text(body, "input")


def _cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    return request_cost("embeddings", body, limits, max_model_len)


def _bound(body: Mapping[str, Any], max_model_len: int) -> int:
    return prompt_bound("embeddings", body, max_model_len)


EMBEDDINGS = Route(
    name="embeddings",
    client_paths=("/v1/embeddings",),
    tasks=("embed",),
    check=_check,
    cost=_cost,
    prompt_bound=_bound,
    answer_usage=usage_of_answer,
    media_fields=("messages",),  # vLLM embeds chat-style messages too
)
ROUTES = (EMBEDDINGS,)
