"""What a request may cost an engine, in tokens, judged from its body before it is sent.

Admission (each engine's ``max_inflight_tokens``) and the key's tpm bucket are charged
this cost, so it counts what the engine will really do, not what the body weighs::

    cost = sum over prompts of  sequences x min(prompt estimate + max_tokens, max_model_len)

- **prompts**: a chat request is one prompt. ``/v1/completions`` ``prompt`` and
  ``/v1/embeddings`` ``input`` take a string, a list of strings, a list of token ids
  (one prompt) or a list of token-id lists; vLLM runs each prompt as a request of its own.
- **sequences**: ``max(n, best_of)`` answers per prompt. vLLM 0.32 ignores ``best_of``;
  other engines generate that many sequences and return the best ``n``, so it counts.
- **prompt estimate**: from the text fields only (message contents, list-of-parts
  content, tool calls and tool definitions, prompt strings, token-id list lengths,
  embedding inputs), never from the body's bytes, so JSON padding costs nothing. About
  4 characters a token for ASCII text, one token per 3 UTF-8 bytes otherwise (CJK is
  about a token a character). Exact counts need the model's tokenizer, in the engine.
- **max_tokens**: what the engine generates at most. vLLM 0.32 generates a chat answer
  without ``max_tokens``/``max_completion_tokens`` (or with null) to the end of the
  context, so the gateway writes ``max_tokens_cap`` into the body it forwards, never
  more than the context leaves after the prompt estimate. Completions default to 16
  (null too), which the gateway leaves alone unless the cap is lower.
- **max_model_len** bounds one sequence: vLLM clamps generation to the context and
  refuses a longer prompt, so text padding inside a prompt cannot make one sequence
  cost more than that.

Field errors are 400s that name the field. Everything else is the engine's to validate.

**When the engine's count never comes** (a stream cut before its usage event, a client
gone before a whole answer, an abandoned engine) the key is charged an upper bound
instead (:func:`prompt_bound`, ``Cost.completion_bound``), never the estimate above: the
estimate may be low (dense text is nearer a token per 2 characters than per 4), and a
count that is too low is free tokens. Why the bound holds, for the tokenizers vLLM runs:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): the base vocabulary is the 256 byte
  values and every merge joins two tokens into one, so a text of ``b`` UTF-8 bytes is at
  most ``b`` tokens; SentencePiece BPE with byte fallback (Llama 2, Mistral): each piece
  covers at least one character, an unknown character falls back to one token per byte,
  plus at most one dummy-prefix piece. So: UTF-8 bytes, plus :data:`TOKENS_PER_TEXT`;
- a chat template wraps each message in markers (:data:`TOKENS_PER_MESSAGE`, plus the
  role's bytes) and adds text of its own (a default system prompt, the generation
  prompt: :data:`TEMPLATE_TOKENS`; with tools, their instructions: :data:`TOOLS_TOKENS`);
  tools and tool calls are rendered as JSON, counted as the bytes of ``json.dumps`` with
  ``indent=4`` (the widest rendering templates use);
- what the gateway cannot bound (an image or audio part, a client-sent
  ``chat_template`` or ``documents``) counts as the whole context, and every prompt is
  capped at ``max_model_len``, which vLLM never lets a prompt pass.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.errors import GatewayError

ASCII_CHARS_PER_TOKEN = 4
UTF8_BYTES_PER_TOKEN = 3
TOKENS_PER_MESSAGE = 8  # role markers and separators a chat template puts around a message
MEDIA_PART_TOKENS = 1024  # an image or audio part: a flat guess, its size depends on the model
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's (and OpenAI's) when absent or null
TOKENS_PER_TEXT = 2  # a BOS and a SentencePiece dummy prefix, at most, around one text
TEMPLATE_TOKENS = 128  # a chat template's own text: default system prompt, generation prompt
TOOLS_TOKENS = 256  # a template's instructions around tool definitions
UNBOUNDED_FIELDS = ("chat_template", "documents")  # rendered by rules the gateway cannot see


@dataclass(frozen=True, slots=True)
class Cost:
    tokens: int  # what admission and the tpm bucket are charged
    # (field, value) the forwarded body must carry so the engine stops where counted
    write: tuple[str, int] | None = None
    # the most the engine may generate, all prompts and sequences: what a request cut off
    # with no answer is charged for its completion
    completion_bound: int = 0
    # ``write`` lowers a value the client sent (Messages' max_tokens above the cap): the
    # answer says so in its head (request_body.LOWERED_HEADER)
    lowered: bool = False


def _bad(message: str, param: str) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request", reason="bad_request")


def text_tokens(text: str) -> int:
    """Estimated tokens of a text (rounded up)."""
    if text.isascii():
        return -(-len(text) // ASCII_CHARS_PER_TOKEN)
    return -(-len(text.encode("utf-8", "surrogatepass")) // UTF8_BYTES_PER_TOKEN)


def strings_tokens(value: Any) -> int:
    """Estimated tokens of every string (keys too) inside a JSON value: a chat template
    renders tool calls and tool schemas into the prompt whole."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += text_tokens(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return text_tokens(content)
    if not isinstance(content, list):
        return 0
    total = 0
    for part in content:
        if isinstance(part, str):
            total += text_tokens(part)
        elif isinstance(part, dict):
            text = part.get("text")
            total += text_tokens(text) if isinstance(text, str) else MEDIA_PART_TOKENS
    return total


def chat_prompt_tokens(messages: list[Any], tools: Any = None) -> int:
    """Estimated prompt tokens of a chat request once its template is applied."""
    total = 0
    for message in messages:
        total += TOKENS_PER_MESSAGE
        if isinstance(message, dict):
            total += _content_tokens(message.get("content"))
            calls = message.get("tool_calls")
            if calls is not None:
                total += strings_tokens(calls)
    if tools is not None:
        total += strings_tokens(tools)
    return total


def prompt_tokens(value: str | list[Any], param: str, max_prompts: int) -> list[int]:
    """Estimated tokens of each prompt of a completions ``prompt`` or embeddings ``input``
    (a string or a non-empty list, as the caller checked)."""
    if isinstance(value, str):
        return [text_tokens(value)]
    if isinstance(value[0], int):
        return [len(value)]  # token ids: one prompt
    if len(value) > max_prompts:
        raise _bad(
            f"'{param}' has {len(value)} prompts, above this server's limit of {max_prompts}",
            param,
        )
    out = []
    for item in value:
        if isinstance(item, str):
            out.append(text_tokens(item))
        elif isinstance(item, list):
            out.append(len(item))
        else:
            out.append(1)  # not a prompt: the engine refuses it
    return out


def _positive(body: Mapping[str, Any], name: str, limit: int) -> int | None:
    """A positive integer field at most ``limit``, or None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"'{name}' must be a positive integer", name)
    if value > limit:
        # Refused, not clamped: a silently shorter answer is worse than a clear no.
        raise _bad(f"'{name}' = {value} is above this server's limit of {limit}", name)
    return value


def _sequences(body: Mapping[str, Any], limits: GatewayConfig) -> int:
    n = _positive(body, "n", limits.max_n) or 1
    best_of = _positive(body, "best_of", limits.max_best_of) or 1
    return max(n, best_of)


def _default_max_tokens(route: str, cap: int, room: int, max_model_len: int) -> int:
    """What an engine generates when the request names no max_tokens."""
    if route == "completions":
        return min(COMPLETIONS_DEFAULT_MAX_TOKENS, cap)
    # Chat: to the end of the context, which the cap bounds. vLLM 0.32 refuses a
    # max_tokens above max_model_len and clamps one the prompt leaves no room for.
    return min(cap, room) if room > 0 else min(cap, max_model_len)


def request_cost(
    route: str, body: Mapping[str, Any], limits: GatewayConfig, max_model_len: int
) -> Cost:
    """The cost of a request whose required fields the caller has checked."""
    if route == "embeddings":
        prompts = prompt_tokens(body["input"], "input", limits.max_prompts)
        return Cost(sum(min(p, max_model_len) for p in prompts))
    if route == "chat":
        prompts = [chat_prompt_tokens(body["messages"], body.get("tools"))]
    else:
        prompts = prompt_tokens(body["prompt"], "prompt", limits.max_prompts)
    sequences = _sequences(body, limits)
    cap = limits.max_tokens_cap
    completion = _positive(body, "max_completion_tokens", cap)
    plain = _positive(body, "max_tokens", cap)
    # vLLM's order: chat prefers max_completion_tokens; completions read only max_tokens.
    asked = plain if route == "completions" else (completion if completion is not None else plain)
    write: tuple[str, int] | None = None
    if asked is None:
        asked = _default_max_tokens(route, cap, max_model_len - max(prompts), max_model_len)
        if route == "chat":
            write = ("max_completion_tokens", asked)
        elif asked < COMPLETIONS_DEFAULT_MAX_TOKENS:
            write = ("max_tokens", asked)
    tokens = sum(sequences * min(p + asked, max_model_len) for p in prompts)
    return Cost(tokens, write, len(prompts) * sequences * asked)


# ---- the upper bound, for a request whose engine never said its count -------------------
def text_bound(text: str) -> int:
    """At most how many tokens a text is (see the module's docstring)."""
    return len(text.encode("utf-8", "surrogatepass")) + TOKENS_PER_TEXT


def json_bound(value: Any) -> int:
    """At most how many tokens a JSON value a template renders whole (tools, tool calls)."""
    try:
        rendered = json.dumps(value, ensure_ascii=False, indent=4)
    except (ValueError, RecursionError):  # json.loads read it: cannot happen, never fail here
        rendered = json.dumps(str(value))
    return text_bound(rendered)


def _message_bound(message: Any, context: int) -> int:
    if not isinstance(message, dict):
        return json_bound(message)
    total = TOKENS_PER_MESSAGE
    for name, value in message.items():
        if isinstance(value, str):
            total += text_bound(value)  # role, content, name, tool_call_id, ...
        elif name == "content" and isinstance(value, list):
            for part in value:
                text = part.get("text") if isinstance(part, dict) else part
                total += text_bound(text) if isinstance(text, str) else context
        elif value is not None:
            total += json_bound(value)
    return total


def _one_prompt_bound(prompt: Any, context: int) -> int:
    if isinstance(prompt, str):
        return min(text_bound(prompt), context)
    if isinstance(prompt, list):
        return min(len(prompt), context)  # token ids: exact
    return 1


def prompt_bound(route: str, body: Mapping[str, Any], max_model_len: int) -> int:
    """At most how many prompt tokens the engine counts for this request (all prompts)."""
    if route == "chat":
        if any(body.get(name) is not None for name in UNBOUNDED_FIELDS):
            return max_model_len
        tools = body.get("tools")
        total = TEMPLATE_TOKENS
        if tools is not None:
            total += TOOLS_TOKENS + json_bound(tools)
        for message in body.get("messages") or ():
            total += _message_bound(message, max_model_len)
        return min(total, max_model_len)
    value = body.get("prompt" if route == "completions" else "input")
    if isinstance(value, list) and value and not isinstance(value[0], int):
        return sum(_one_prompt_bound(p, max_model_len) for p in value)
    return _one_prompt_bound(value, max_model_len)
