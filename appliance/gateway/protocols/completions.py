"""OpenAI's (legacy) completions: ``POST /v1/completions``.

The body needs ``prompt`` (a string, a list of them, token ids or lists of them: each a
request of its own in vLLM); cost.py's completions rules; a stream's counts come from
the usage event the gateway asks for (stream_tap.StreamTap).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.protocols import prompt_text
from appliance.gateway.protocols.base import Route, bad_request
from appliance.gateway.protocols.cost import Cost, prompt_bound, request_cost
from appliance.gateway.protocols.counts import usage_of_answer
from appliance.gateway.protocols.logprobs import completions_prompt_logprobs


def _check(body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
        raise bad_request("'prompt' must be a string or a non-empty list", "prompt")


def _cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    return request_cost("completions", body, limits, max_model_len)


def _bound(body: Mapping[str, Any], max_model_len: int) -> int:
    return prompt_bound("completions", body, max_model_len)


COMPLETIONS = Route(
    name="completions",
    client_paths=("/v1/completions",),
    tasks=("generate",),
    check=_check,
    cost=_cost,
    prompt_bound=_bound,
    answer_usage=usage_of_answer,
    streams=True,
    prompt_logprobs=completions_prompt_logprobs,
    prompt=prompt_text.completions,
)
ROUTES = (COMPLETIONS,)
