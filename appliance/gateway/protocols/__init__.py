"""The API routes the gateway relays, one module per protocol (base.py says what a route
gives the relay). The relay looks a route up here by name; the app adds the POST path of
each; nothing else is ever relayed to an engine (no catch-all).

==================  =====================================================================
``openai_chat``     ``/v1/chat/completions``
``completions``     ``/v1/completions``
``embeddings``      ``/v1/embeddings`` (embed models)
``responses``       ``/v1/responses`` (retrieve and cancel: relay/pinned.py, by the stored id)
``messages``        Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``
``tokenize``        ``/tokenize``, ``/detokenize`` (any model)
``scoring``         ``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``
==================  =====================================================================
"""

from __future__ import annotations

from collections.abc import Mapping

from appliance.gateway.errors import Shape
from appliance.gateway.protocols import (
    completions,
    embeddings,
    messages,
    openai_chat,
    responses,
    scoring,
    tokenize,
)
from appliance.gateway.protocols.base import Route, StateRef

ALL: tuple[Route, ...] = (
    *openai_chat.ROUTES,
    *completions.ROUTES,
    *embeddings.ROUTES,
    *responses.ROUTES,
    *messages.ROUTES,
    *tokenize.ROUTES,
    *scoring.ROUTES,
)
ROUTES: Mapping[str, Route] = {r.name: r for r in ALL}
ANTHROPIC_PATHS = frozenset(p for r in ALL if r.shape == "anthropic" for p in r.client_paths)


def shape_of_path(path: str) -> Shape:
    """The error shape clients of ``path`` read: Anthropic's on its routes, else OpenAI's."""
    return "anthropic" if path in ANTHROPIC_PATHS else "openai"


def routes_of_task(task: str) -> tuple[Route, ...]:
    """The routes a model of ``task`` serves, in the registry's order."""
    return tuple(r for r in ALL if task in r.tasks)


__all__ = ["ALL", "ANTHROPIC_PATHS", "ROUTES", "Route", "Shape", "StateRef", "routes_of_task"]
