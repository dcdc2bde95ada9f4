"""What the gateway asks of the engine about a request's token counts, planned before it goes.

vLLM sends a stream's usage only when asked (``stream_options.include_usage``), so the
gateway asks for it on every streamed chat and completions request (:func:`plan_usage`);
when the client did not ask, the stream's tap takes that event out again
(stream_tap.StreamTap). vLLM's ``continuous_usage_stats`` is never turned on: it would
put a usage object in every token event. The plan also keeps what the upper bound needs
(:attr:`UsagePlan.prompt_bound`) for a request cut off before its count
(stream_tap.charged), and the route's own readers (protocols/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.config import ServedModel
from appliance.gateway.protocols.cost import prompt_bound
from appliance.gateway.protocols.counts import EventUsage, Usage, usage_of_answer

_LEADING_SPACE = re.compile(rb"[ \t\r\n]*")  # JSON's whitespace; no copy of the body
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
    per_event: int | None = 1  # the most completion tokens one stream event carries (Stepping)

    def produced_bound(self, token_events: int) -> int:
        """Completion tokens to count for a stream cut after ``token_events`` token events,
        never fewer than the engine made: one each when an event carries one token; when it
        may carry more (``per_event``), that many for each and for the tokens the engine
        made but had not sent yet, within what the request allowed; all it allowed when
        how many is unknown."""
        per = self.per_event
        if per == 1:
            return token_events
        if per is None:
            return self.completion_bound
        return min((token_events + 1) * per, self.completion_bound)

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


@dataclass(frozen=True, slots=True)
class Stepping:
    """How many tokens a model's engines put in one stream event, as vLLM 0.32 does it.

    One event goes out once ``stream_interval`` tokens are new (the larger of the
    engine's ``--stream-interval``, default 1, and the request's own ``stream_interval``,
    a vLLM field on chat and completions), and a speculative step adds up to
    ``num_speculative_tokens`` + 1 tokens at once: so an event carries at most interval +
    speculative tokens. None where the engine's figure cannot be read (an unparsable
    flag, a speculative table without ``num_speculative_tokens``): then a cut stream is
    counted everything it was allowed (UsagePlan.produced_bound).
    """

    interval: int | None = 1
    speculative: int | None = 0

    def per_event(self, body: Mapping[str, Any]) -> int | None:
        if self.interval is None or self.speculative is None:
            return None
        asked = body.get("stream_interval")
        interval = self.interval
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > interval:
            interval = asked  # vLLM refuses anything but an integer >= 1 itself
        return interval + self.speculative


ONE_TOKEN = Stepping()


def stepping_of(served: ServedModel) -> Stepping:
    """What ``served``'s engines do (Stepping), from its configuration."""
    return Stepping(_engine_interval(served.engine.extra_args), _speculative(served.speculative))


def _engine_interval(args: Sequence[str]) -> int | None:
    """vLLM's ``--stream-interval`` in the engine's extra arguments (1 without it; the
    last one given wins, as in argparse); None when it is not a whole number."""
    value: str | None = "1"
    for i, arg in enumerate(args):
        if arg == "--stream-interval":
            value = args[i + 1] if i + 1 < len(args) else None
        elif arg.startswith("--stream-interval="):
            value = arg.partition("=")[2]
    return int(value) if value is not None and value.isdigit() and int(value) >= 1 else None


def _speculative(table: Mapping[str, Any]) -> int | None:
    if not table:
        return 0
    n = table.get("num_speculative_tokens")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


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
    stepping: Stepping = ONE_TOKEN,
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
            stepping.per_event(body),
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
    return insert_first(raw, STREAM_USAGE)


def insert_first(raw: bytes, fields: bytes) -> bytes | None:
    """The client's bytes with ``fields`` (``"name":value,`` each, ASCII) added first, or
    None when the body is not plain UTF-8 JSON starting with ``{`` (then it is
    re-serialised). Only for names the body does not hold: of two equal keys vLLM reads
    the last, the client's."""
    start = _LEADING_SPACE.match(raw).end()  # type: ignore[union-attr]  # matches "" too
    if raw[start : start + 1] != b"{" or json.detect_encoding(raw) != "utf-8":
        return None  # json.loads also reads UTF-16 and UTF-32, where ASCII cannot go in
    # One copy of the body: a memoryview's slice is not one.
    return b"".join((raw[: start + 1], fields, memoryview(raw)[start + 1 :]))
