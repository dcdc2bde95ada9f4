"""A request's token counts as the engine reports them, and the readers of a whole answer's.

``Usage`` is what a key is charged (stream_tap.charged); ``EventUsage`` what one stream
event of another protocol carries (protocols/). A whole answer's counts are its ``usage``
object, read only when its bytes hold the mark (a body without it is never parsed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

USAGE_MARK = b'"usage"'


@dataclass(frozen=True, slots=True)
class Usage:
    prompt: int
    completion: int


@dataclass(frozen=True, slots=True)
class EventUsage:
    """The counts one stream event carries (a protocol's reader, protocols/)."""

    prompt: int
    completion: int | None  # None: the prompt's count only, so far (Anthropic's message_start)


def usage_of(obj: Any) -> Usage | None:
    """The counts in an answer's (or a usage event's) ``usage`` object, if well formed."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens") or 0  # embeddings: absent or null
    if not (is_count(prompt) and is_count(completion)):
        return None
    return Usage(prompt, completion)


def is_count(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def usage_of_answer(body: bytes) -> Usage | None:
    """The counts in a non-streamed answer body (chat, completions, embeddings)."""
    if USAGE_MARK not in body:
        return None
    try:
        return usage_of(json.loads(body))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
