"""What the relay needs to know of one API route, whatever its protocol.

The relay (relay/handlers.py, via_*.py) is protocol-blind: it reads a body, costs it, admits it,
relays it and counts it by calling what the route's :class:`Route` says. Each protocol
is one module of this package giving its routes; the registry (``__init__``) lists them.
A new protocol is one new module, nothing in the relay.

What a route says:

- **where**: the paths clients call (``client_paths``) and the engine path each goes to;
  the model tasks that serve it (``tasks``: a route a model does not serve is a 400
  naming the routes it does);
- **the body**: the input it cannot do without (``check``: a 400 naming the field),
  what it costs an engine (``cost``: a :class:`appliance.gateway.protocols.cost.Cost`, with the
  field the forwarded body must carry, if any), the most prompt tokens the engine can
  count (``prompt_bound``: what a request cut off before its count is charged), and
  anything the gateway writes into the forwarded body (``prepare``), the fields that ask
  for a log-probability of every prompt token (``prompt_logprobs``) and those whose
  content parts may carry media URLs (``media_fields``): what a model may refuse
  (refusals.py); the prompt as one text in reading order (``prompt``: prefix routing,
  prompt_text.py);
- **the answer**: the engine's own counts in a whole answer (``answer_usage``) and in a
  stream's events (``event_usage``; None: chat and completions' own reader, which asks
  for the usage event and takes it out again, stream_tap.StreamTap), how many events
  come before the first token (``preamble``), and the error shape of the protocol
  (``shape``: OpenAI's or Anthropic's, errors.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.config import GatewayConfig
from appliance.gateway.errors import GatewayError, Shape, sse_error_event
from appliance.gateway.protocols.cost import Cost
from appliance.gateway.protocols.counts import EventUsage, Usage

Check = Callable[[Mapping[str, Any]], None]
Costing = Callable[[Mapping[str, Any], GatewayConfig, int], Cost]
Bound = Callable[[Mapping[str, Any], int], int]
AnswerUsage = Callable[[bytes], "Usage | None"]
EventReader = Callable[[bytes], "EventUsage | None"]
Prepare = Callable[[dict[str, Any]], bool]
ErrorEvent = Callable[[int, str, str], bytes]


@dataclass(frozen=True, slots=True)
class StateRef:
    """What of a request lives in one engine (a stored response): the id it stores
    there, and the id of what it reads there, which sends it to that engine."""

    made: str | None = None
    needs: str | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """One API route the gateway relays (the module's docstring says what each part is)."""

    name: str  # the relay's and the metrics' word for it: "chat", "responses", ...
    client_paths: tuple[str, ...]  # POST paths clients call; the first is its usual name
    tasks: tuple[str, ...]  # the model tasks that serve it ("generate", "embed")
    check: Check
    cost: Costing
    prompt_bound: Bound
    answer_usage: AnswerUsage
    streams: bool = False  # "stream": true gives an SSE stream
    event_usage: EventReader | None = None  # None: chat/completions' include_usage reader
    preamble: int = 0  # stream events before the first token's
    shape: Shape = "openai"
    prepare: Prepare | None = None  # writes into the forwarded body; True when it did
    state: Callable[[Mapping[str, Any]], StateRef] | None = None  # ids kept in one engine
    error_event: ErrorEvent = sse_error_event  # what ends a stream broken after its start
    engine_path: str = ""  # "": the path the client called (vLLM serves each of them)
    calls_tools: Callable[[Mapping[str, Any]], bool] | None = None  # needs a parser (tools.py)
    # The field that asks the engine for every prompt token's logprobs, or None (logprobs.py)
    prompt_logprobs: Callable[[Mapping[str, Any]], str | None] | None = None
    media_fields: tuple[str, ...] = ()  # fields whose content may hold media URLs (media.py)
    # The prompt as one text, for prefix routing (prompt_text.py); None: placed by load.
    prompt: Callable[[Mapping[str, Any]], str | None] | None = None

    @property
    def path(self) -> str:
        """The route's usual path, for messages."""
        return self.client_paths[0]


# A JSON count as a byte pattern: no sign, no leading zero, no fraction (the readers'
# patterns follow it with a fixed byte, so "3.5" or "1e3" never match).
COUNT = rb"(0|[1-9]\d*)"


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request", reason="bad_request")


def counted_tokens(field: str) -> Callable[[bytes], Usage | None]:
    """The reader of a route whose answer runs no model but counts tokens (``/tokenize``'s
    ``count``, count_tokens' ``input_tokens``): they are charged as prompt tokens, so a
    key's tpm bounds how much text it has tokenized; None (charged the route's prompt
    bound) when the answer does not say."""

    def read(body: bytes) -> Usage | None:
        obj = answer_json(body)
        count = obj.get(field) if isinstance(obj, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return None
        return Usage(count, 0)

    return read


def no_count(body: bytes) -> None:
    """A route whose answer carries no count (``/detokenize``): charged its prompt bound,
    which for it is exact (the token ids it was sent)."""
    return None


def require_list_or_text(body: Mapping[str, Any], name: str) -> None:
    """``name`` must be a string or a non-empty list (a prompt, an input, documents)."""
    value = body.get(name)
    if not isinstance(value, (str, list)) or (isinstance(value, list) and not value):
        raise bad_request(f"'{name}' must be a string or a non-empty list", name)


def positive(body: Mapping[str, Any], name: str, limit: int | None) -> int | None:
    """A positive integer field at most ``limit`` (None: any), or None when absent or
    null; refused, never clamped, above it (a silently shorter answer is worse than a
    clear no; Messages clamps visibly instead, protocols/messages.py)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"'{name}' must be a positive integer", name)
    if limit is not None and value > limit:
        raise bad_request(f"'{name}' = {value} is above this server's limit of {limit}", name)
    return value


def sse_event_name(payload: bytes) -> bytes | None:
    """The name on an SSE event's ``event:`` line when the event starts with one (vLLM
    writes it first on every Responses and Messages event), else None. Framing, never
    generated text (that is on the ``data:`` line): a reader skips by it, unparsed,
    the events that cannot carry its counts."""
    if not payload.startswith(b"event:"):
        return None
    end = payload.find(b"\n")
    return payload[6 : end if end >= 0 else len(payload)].strip()


def sse_data(payload: bytes) -> Any:
    """The JSON of one SSE event's ``data:`` line (after an ``event:`` line or not), or
    None: an event the gateway cannot read is passed on and counted as a token's."""
    at = payload.find(b"data:")
    if at < 0:
        return None
    try:
        return json.loads(payload[at + 5 :])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def answer_json(body: bytes) -> Any:
    """A whole answer's JSON, or None."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
