"""What the gateway asks of the engine about a request's token counts, planned before it goes.

vLLM sends a stream's usage only when asked (``stream_options.include_usage``), so the
gateway asks for it on every streamed chat and completions request (:func:`plan_usage`);
when the client did not ask, the stream's tap takes that event out again
(usage_events.StreamTap). vLLM's ``continuous_usage_stats`` is never turned on: it would
put a usage object in every token event. The plan also keeps what the upper bound needs
(:attr:`UsagePlan.prompt_bound`) for a request cut off before its count
(usage_events.charged), and the route's own readers (protocols/).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.gateway.cost import prompt_bound
from appliance.gateway.usage_counts import EventUsage, Usage, usage_of_answer

STREAM_USAGE = b'"stream_options":{"include_usage":true},'
ROUTES_WITH_STREAM_USAGE = ("chat", "completions")


@dataclass(frozen=True, slots=True)
class UsagePlan:
    """What the gateway does about a request's token counts."""

    added: bool  # the gateway asked for the stream's usage event: strip it from the client's
    fields: dict[str, Any]  # the request, for the upper bound (only needed when cut off)
    route: str
    stream: bool
    max_model_len: int  # of the model it goes to: no prompt is counted above it
    completion_bound: int = 0  # the most it may generate (cost.py): a whole answer cut off
    rewrite: bool = False  # the body must be re-serialised (the client sent stream_options)
    preamble: int = 0  # events before the first token: a chat stream's role event
    # The route's own readers (protocols/): its prompt bound, its stream events' counts,
    # a whole answer's counts. None: chat, completions and embeddings' (this module's).
    bound: Callable[[Mapping[str, Any], int], int] | None = None
    reader: Callable[[bytes], EventUsage | None] | None = None
    answer: Callable[[bytes], Usage | None] | None = None

    @property
    def prompt_bound(self) -> int:
        """The prompt tokens counted when the engine's count never comes: never fewer than
        the engine counted (cost.prompt_bound says why). Worked out only then."""
        try:
            if self.bound is not None:
                return self.bound(self.fields, self.max_model_len)
            return prompt_bound(self.route, self.fields, self.max_model_len)
        except Exception:  # already checked by request_cost: never fail a request here
            return self.max_model_len

    def answer_usage(self, body: bytes) -> Usage | None:
        """The engine's counts in a whole answer's body, as this route writes them."""
        return usage_of_answer(body) if self.answer is None else self.answer(body)


def plan_usage(
    route: str,
    stream: bool,
    body: dict[str, Any],
    max_model_len: int,
    completion_bound: int = 0,
    *,
    preamble: int | None = None,
    bound: Callable[[Mapping[str, Any], int], int] | None = None,
    reader: Callable[[bytes], EventUsage | None] | None = None,
    answer: Callable[[bytes], Usage | None] | None = None,
) -> UsagePlan:
    """Ask for the stream's usage event when the client did not (``body`` is updated);
    what the upper bound needs is kept, for a request cut off before its count. Routes
    whose streams always carry their counts (protocols/) are asked nothing. The route's
    own readers (``preamble`` .. ``answer``, see UsagePlan) go in the plan as it is made:
    one object per request, not a copy with them put in."""
    if preamble is None:
        preamble = 1 if route == "chat" else 0

    def plan(added: bool, rewrite: bool = False) -> UsagePlan:
        return UsagePlan(
            added,
            body,
            route,
            stream,
            max_model_len,
            completion_bound,
            rewrite,
            preamble,
            bound,
            reader,
            answer,
        )

    if not stream or route not in ROUTES_WITH_STREAM_USAGE:
        return plan(False)
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return plan(False)  # the client reads it too
    if isinstance(options, dict):
        # continuous_usage_stats would take effect with include_usage: keep it off.
        body["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": False}
        return plan(True, rewrite=True)
    if options is not None:
        return plan(False)  # not an object: vLLM refuses it
    # "stream_options": null in the client's bytes would win over a field put first (the
    # last of two equal keys wins): then the body is written anew.
    written = "stream_options" in body
    body["stream_options"] = {"include_usage": True}
    return plan(True, rewrite=written)


def insert_stream_usage(raw: bytes) -> bytes | None:
    """The client's bytes with ``stream_options`` added as the first field, or None when
    the body is not plain UTF-8 JSON starting with ``{`` (then it is re-serialised)."""
    start = len(raw) - len(raw.lstrip(b" \t\r\n"))
    if raw[start : start + 1] != b"{" or json.detect_encoding(raw) != "utf-8":
        return None  # json.loads also reads UTF-16 and UTF-32, where ASCII cannot go in
    return raw[: start + 1] + STREAM_USAGE + raw[start + 1 :]
