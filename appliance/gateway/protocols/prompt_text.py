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


# What one request's walk may read: enough text for every block prefix routing hashes
# (index.BLOCK_CHARS x MAX_BLOCKS), and a bound on the JSON nodes visited, so a body of
# many tiny or empty parts costs the event loop no more than a long text. The bounds cut
# every turn of a conversation at the same place, so what is read still matches.
TEXT_BUDGET = 512 * 512
NODE_BUDGET = 8192


class _Walk:
    __slots__ = ("chars", "nodes", "out")

    def __init__(self) -> None:
        self.out: list[str] = []
        self.chars = TEXT_BUDGET
        self.nodes = NODE_BUDGET


def _text(head: Any, items: Any) -> str | None:
    walk = _Walk()
    _walk(head, walk)
    _walk(items, walk)
    return SEP.join(walk.out) + SEP if walk.out else None


def _walk(value: Any, walk: _Walk) -> None:
    """Append the text of ``value`` (a text, a list, a message or part) to the walk's
    pieces, until its budgets run out. The depth is bounded by the body's own
    (``relay/json_bounds.py`` refused deeper)."""
    walk.nodes -= 1
    if walk.nodes < 0 or walk.chars <= 0:
        return
    kind = type(value)
    if kind is str:
        walk.out.append(value)
        walk.chars -= len(value)
    elif kind is list:
        for item in value:
            if walk.nodes < 0 or walk.chars <= 0:
                return
            t = type(item)
            if t is str:
                walk.out.append(item)
                walk.chars -= len(item)
                walk.nodes -= 1
            elif t is dict or t is list:
                _walk(item, walk)
            else:
                walk.nodes -= 1  # a number, null or boolean: nothing to read
    elif kind is dict:
        if not value:
            return
        out = walk.out
        for name in FIELDS:
            v = value.get(name)
            if type(v) is str:
                out.append(v)
                walk.chars -= len(v)
        for name in NESTED:
            v = value.get(name)
            if v is not None:
                _walk(v, walk)
