"""vLLM's scoring routes on embedding models: ``/score`` (and ``/v1/score``) and rerank
(``/rerank``, ``/v1/rerank``, ``/v2/rerank``: Cohere's and Jina's shape).

vLLM 0.32 serves them on a ``--runner pooling`` model whose pooling task is ``embed``
(``enable_scoring_api``: ``embed`` maps to the ``bi-encoder`` score type,
``vllm/entrypoints/pooling/scoring/io_processor.py`` ``BiEncoderIOProcessor``): it
embeds every query and every document once and scores each pair by the cosine of
their embeddings. So a request costs each text's tokens once, queries and documents
(``/score`` takes ``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``
or ``text_1``/``text_2``; rerank ``query`` and ``documents``). Each list is bounded by
``gateway.max_prompts``. The answer's ``usage.prompt_tokens`` is the engine's count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.protocols.base import Route, bad_request
from appliance.gateway.protocols.cost import MEDIA_PART_TOKENS, Cost, text_bound, text_tokens
from appliance.gateway.protocols.counts import usage_of_answer

SCORE_PAIRS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
RERANK_PAIR = ("query", "documents")


def _sides(body: Mapping[str, Any], pairs: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    for pair in pairs:
        if all(_is_input(body.get(name)) for name in pair):
            return pair
    names = " or ".join(f"'{a}' and '{b}'" for a, b in pairs)
    raise bad_request(f"{names} are required: each a text or a non-empty list", pairs[0][1])


def _is_input(value: Any) -> bool:
    return isinstance(value, (str, dict)) or (isinstance(value, list) and bool(value))


def _items(value: Any, name: str, limit: int) -> list[Any]:
    items = value if isinstance(value, list) else [value]
    if len(items) > limit:
        raise bad_request(f"'{name}' has {len(items)} items, above this server's limit of {limit}")
    return items


def _estimate(item: Any) -> int:
    return text_tokens(item) if isinstance(item, str) else MEDIA_PART_TOKENS


def _costing(pairs: tuple[tuple[str, str], ...]) -> Any:
    def cost(body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int) -> Cost:
        total = 0
        for name in _sides(body, pairs):
            for item in _items(body[name], name, limits.max_prompts):
                total += min(_estimate(item), max_model_len)
        return Cost(total)

    return cost


def _bounding(pairs: tuple[tuple[str, str], ...]) -> Any:
    def bound(body: Mapping[str, Any], max_model_len: int) -> int:
        total = 0
        for name in _sides(body, pairs):
            value = body[name]
            for item in value if isinstance(value, list) else [value]:
                text = isinstance(item, str)
                total += min(text_bound(item), max_model_len) if text else max_model_len
        return total

    return bound


def _checking(pairs: tuple[tuple[str, str], ...]) -> Any:
    def check(body: Mapping[str, Any]) -> None:
        _sides(body, pairs)

    return check


SCORE = Route(
    name="score",
    client_paths=("/score", "/v1/score"),
    tasks=("embed",),
    check=_checking(SCORE_PAIRS),
    cost=_costing(SCORE_PAIRS),
    prompt_bound=_bounding(SCORE_PAIRS),
    answer_usage=usage_of_answer,
    media_fields=tuple(name for pair in SCORE_PAIRS for name in pair),  # parts may be media
)
RERANK = Route(
    name="rerank",
    client_paths=("/rerank", "/v1/rerank", "/v2/rerank"),
    tasks=("embed",),
    check=_checking((RERANK_PAIR,)),
    cost=_costing((RERANK_PAIR,)),
    prompt_bound=_bounding((RERANK_PAIR,)),
    answer_usage=usage_of_answer,
    media_fields=RERANK_PAIR,
)
ROUTES = (SCORE, RERANK)
