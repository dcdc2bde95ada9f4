"""Prompt logprobs: a log-probability for every prompt token, refused unless allowed.

vLLM 0.32 computes them when a request sets ``prompt_logprobs`` (chat and completions),
or sets ``echo`` with ``logprobs`` (completions) or ``top_logprobs`` (chat), which it
turns into ``prompt_logprobs`` (``to_sampling_params`` in
``entrypoints/openai/{completion,chat_completion}/protocol.py``). The engine then keeps
the logits of every prompt position over the whole vocabulary and answers with a dict
per prompt token: a ~3.3k-token prompt with ``prompt_logprobs: 20`` and ``max_tokens: 1``
took 55.7 s on CPU, grew the engine by 1.9 GB and answered 5.2 MB, charged as one cheap
request (its prompt). On a GPU it scales with the chunk size times the vocabulary.

So a model refuses them with a 400 unless its ``allow_prompt_logprobs`` is true (an
operator who wants them, on a box whose users they trust). Logprobs of the generated
tokens (``logprobs``/``top_logprobs`` without ``echo``) are bounded by ``max_tokens``
and vLLM's ``max_logprobs``, and pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from appliance.config import ServedModel
from appliance.gateway.errors import GatewayError

Reader = Callable[[Mapping[str, Any]], "str | None"]


def _asks(body: Mapping[str, Any], echoed: str, default: int | None) -> str | None:
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    # vLLM takes the echoed field's default when it is absent: null only when sent as
    # null. Its pydantic model reads echo leniently (1, 1.0, "true", "yes" are true),
    # so anything that is not one of its false spellings asks.
    if not _false(body.get("echo")) and body.get(echoed, default) is not None:
        return "echo"
    return None


# What pydantic's lax bool reads as false (besides None: the field's default).
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})


def _false(value: Any) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, str) and value.strip().lower() in _FALSE_WORDS


def completions_prompt_logprobs(body: Mapping[str, Any]) -> str | None:
    """The field of a /v1/completions body that asks for prompt logprobs, or None
    (``logprobs`` defaults to null there)."""
    return _asks(body, "logprobs", None)


def chat_prompt_logprobs(body: Mapping[str, Any]) -> str | None:
    """The field of a chat body that asks for prompt logprobs, or None: vLLM's chat
    defaults ``top_logprobs`` to 0, so ``echo`` alone asks for them (0: each prompt
    token's own logprob, which still takes the logits over the whole vocabulary)."""
    return _asks(body, "top_logprobs", 0)


def allow_key(model: ServedModel, tables: bool) -> str:
    """The config key that allows them for ``model``, as an admin writes it."""
    return (
        f"models.{model.name}.allow_prompt_logprobs" if tables else "engine.allow_prompt_logprobs"
    )


def prompt_logprobs_refusal(
    reader: Reader | None, body: Mapping[str, Any], model: ServedModel, tables: bool
) -> GatewayError | None:
    """The 400 for a request that asks ``model`` for prompt logprobs (``reader``: its
    route's; None: a route without them) when the model does not allow them; else None."""
    if reader is None or model.engine.allow_prompt_logprobs:
        return None
    field = reader(body)
    if field is None:
        return None
    what = "'prompt_logprobs'" if field == "prompt_logprobs" else "'echo' with logprobs"
    return GatewayError(
        400,
        f"{what} asks for a log-probability of every prompt token, which model "
        f"'{model.name}' does not allow here: it costs the engine memory and time far "
        f"beyond the request's tokens. Leave it out (logprobs of the generated tokens "
        f"need no prompt logprobs); the operator can allow it with "
        f"{allow_key(model, tables)} = true.",
        param=field,
        code="prompt_logprobs_not_allowed",
        reason="bad_request",
    )
