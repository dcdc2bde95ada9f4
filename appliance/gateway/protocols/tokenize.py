"""vLLM's tokenizer routes: ``POST /tokenize`` and ``POST /detokenize``, per model.

Any model's engine serves them (generate and embed alike; vLLM attaches them to every
server). ``/tokenize`` takes a ``prompt`` (a text) or chat ``messages`` (rendered by the
chat template); ``/detokenize`` takes ``tokens``. No model runs, but the tokenizer's
work is charged to the key's tpm like a prompt's: ``/tokenize`` its answer's ``count``,
``/detokenize`` the ids it was sent (its answer has no count), so a key cannot tokenize
without end against a tpm that limits its chats.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.protocols.base import Route, bad_request, counted_tokens, no_count
from appliance.gateway.protocols.cost import (
    Cost,
    chat_prompt_tokens,
    prompt_bound,
    text_bound,
    text_tokens,
)

TASKS = ("generate", "embed")


def _check(body: Mapping[str, Any]) -> None:
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, str) or (isinstance(messages, list) and messages):
        return
    raise bad_request("'prompt' (a text) or 'messages' (a non-empty list) is required", "prompt")


def _cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Cost(min(text_tokens(prompt), max_model_len))
    return Cost(min(chat_prompt_tokens(body["messages"], body.get("tools")), max_model_len))


def _bound(body: Mapping[str, Any], max_model_len: int) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return min(text_bound(prompt), max_model_len)
    return prompt_bound("chat", body, max_model_len)


def _check_tokens(body: Mapping[str, Any]) -> None:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad_request("'tokens' must be a list of token ids", "tokens")


def _tokens_cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
    return Cost(min(len(body["tokens"]), max_model_len))


def _tokens_bound(body: Mapping[str, Any], max_model_len: int) -> int:
    tokens = body.get("tokens")
    return min(len(tokens), max_model_len) if isinstance(tokens, list) else 0


TOKENIZE = Route(
    name="tokenize",
    client_paths=("/tokenize",),
    tasks=TASKS,
    check=_check,
    cost=_cost,
    prompt_bound=_bound,
    answer_usage=counted_tokens("count"),
    media_fields=("messages",),  # rendered as a chat would be, media and all
)
DETOKENIZE = Route(
    name="detokenize",
    client_paths=("/detokenize",),
    tasks=TASKS,
    check=_check_tokens,
    cost=_tokens_cost,
    prompt_bound=_tokens_bound,
    answer_usage=no_count,
)
ROUTES = (TOKENIZE, DETOKENIZE)
