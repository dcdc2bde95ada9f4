"""A request's prompt as one text, in the order the engine reads it: what prefix routing
hashes (``gateway/admission/prefix_index.py``).

Not the engine's prompt (the gateway applies no chat template and never tokenizes): a
text that grows the way the prompt does. A conversation's next turn resends the earlier
messages unchanged and adds to the end, so its text begins with the previous turn's
text; that is all prefix routing needs. Each piece of a message (its role, text parts,
tool call ids and arguments, tool results) is followed by a separator, so the text of a
list of messages is a prefix of the text of that list with more messages after it.

Left out, on purpose: tool definitions, sampling fields, Anthropic's ``cache_control``
markers (they move to the newest message every turn) and anything the gateway would
have to serialise (a tool call's input object): reading them costs per request, and
they change nothing about which conversation a request continues. Each function returns
None for a body it has no text for (token ids, several prompts): such a request is
placed by load alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SEP = "\x1f"  # after every piece: a piece never runs into the next one
# What of a message or content part (dict) is read, in this order; others are skipped.
FIELDS = ("role", "type", "id", "tool_call_id", "tool_use_id", "call_id", "name", "text")
NESTED = ("content", "tool_calls", "function", "arguments", "output", "image_url", "url")


def chat(body: Mapping[str, Any]) -> str | None:
    """``/v1/chat/completions``: its ``messages``."""
    return _text(None, body.get("messages"))


def completions(body: Mapping[str, Any]) -> str | None:
    """``/v1/completions``: a single text ``prompt`` (a list of one text too)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


def responses(body: Mapping[str, Any]) -> str | None:
    """``/v1/responses``: ``instructions``, then ``input`` (a text or a list of items)."""
    return _text(body.get("instructions"), body.get("input"))


def messages(body: Mapping[str, Any]) -> str | None:
    """Anthropic's ``/v1/messages``: ``system`` (a text or blocks), then ``messages``."""
    return _text(body.get("system"), body.get("messages"))


def _text(head: Any, items: Any) -> str | None:
    pieces: list[str] = []
    _walk(head, pieces)
    _walk(items, pieces)
    return SEP.join(pieces) + SEP if pieces else None


def _walk(value: Any, out: list[str]) -> None:
    """Append the text of ``value`` (a text, a list, a message or part) to ``out``. The
    depth is bounded by the body's own (``relay/json_bounds.py`` refused deeper)."""
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _walk(item, out)
    elif isinstance(value, dict):
        for name in FIELDS:
            v = value.get(name)
            if isinstance(v, str):
                out.append(v)
        for name in NESTED:
            v = value.get(name)
            if v is not None:
                _walk(v, out)
