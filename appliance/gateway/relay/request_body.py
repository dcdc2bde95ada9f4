"""What the relay reads of a request body, and what the request costs.

The gateway checks only what it needs to route and limit a request (the model, whether
it streams, the route's required input); the engine validates the rest. Each refusal is
a 400 naming the field (``param``). What is particular to a route (its input, its cost,
its counts) is its protocol module's (:mod:`appliance.gateway.protocols`); this module
is the same for all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from appliance.config import GatewayConfig
from appliance.gateway.accounting.plan import (
    ONE_TOKEN,
    STREAM_USAGE,
    Stepping,
    UsagePlan,
    insert_first,
    plan_usage,
)
from appliance.gateway.admission.prefix_index import BLOCK_CHARS, Blocks, prompt_blocks
from appliance.gateway.errors import GatewayError
from appliance.gateway.protocols import ROUTES, StateRef
from appliance.gateway.relay.json_bounds import TooMuchStructure, check_structure, may_exceed
from appliance.policy.routing import session_key


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    route: str
    model: str  # the canonical name of the model it goes to (never an alias)
    stream: bool
    cost: int  # tokens, as appliance/gateway/protocols/cost.py counts them
    session: str | None
    body: bytes  # what the engine is sent: the client's bytes, unless a field had to be set
    usage: UsagePlan | None = None  # what token accounting asked of the engine (stream_tap)
    # What the key's tpm bucket was charged, when not ``cost``: a request sent to a
    # fallback is costed on that model's context, but was charged on the one it named.
    charged: int | None = None
    state: StateRef | None = None  # what of it lives in one engine (a stored response)
    lowered: int | None = None  # the max_tokens sent when lower than the client's (Messages)
    # The engine's scheduling priority sent as vLLM's X-Vllm-Priority header, on the
    # routes whose body has no priority field vLLM reads (Messages): see finish_body.
    priority_header: int | None = None
    # The chained hashes of its prompt's blocks, for prefix routing (prefix_index.py);
    # () when a hint pins it (``session``), prefix routing is off, or it has no prompt.
    prefix: Blocks = ()

    @property
    def tpm_charge(self) -> int:
        return self.cost if self.charged is None else self.charged


# Where vLLM 0.32 reads a request's scheduling priority (lower is served first): a body
# field on these routes (their request models' ``priority``), the X-Vllm-Priority header
# on Messages (converted to a chat request, whose serving reads the header). The other
# routes (tokenize, count_tokens) schedule nothing.
BODY_PRIORITY = frozenset({"chat", "completions", "responses", "embeddings", "score", "rerank"})
HEADER_PRIORITY = frozenset({"messages"})
PRIORITY_HEADER = "X-Vllm-Priority"
# The priority each key class is sent with: interactive first (0 is vLLM's default, so it
# is not written). Apart, so another class could go between them.
PRIORITY_OF_CLASS = {"interactive": 0, "batch": 10}


def engine_priority(scheduling: str, key_class: str) -> int | None:
    """The scheduling priority an engine is sent for a request of a key of ``key_class``
    (its ``priority``: interactive or batch) on a model whose ``engine.scheduling`` is
    ``scheduling``; None under fcfs (nothing is sent)."""
    return PRIORITY_OF_CLASS[key_class] if scheduling == "priority" else None


# On an answer whose max_tokens the gateway lowered: the value the engine was sent.
LOWERED_HEADER = "X-Appliance-Max-Tokens"
LOWERED = "max_tokens_lowered"  # request key, set when the request is relayed (relay/handlers.py)


async def add_lowered_header(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare``: an answer from an engine that was sent a lower
    max_tokens than the client asked says so in its head, streamed or not."""
    lowered = request.get(LOWERED)
    if lowered is not None:
        response.headers[LOWERED_HEADER] = str(lowered)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request", reason="bad_request")


async def read_body(request: web.Request) -> bytes:
    """The client's body, or a 400 when it cannot be read (413 and friends go through)."""
    try:
        return await request.read()
    except web.HTTPException:
        raise  # 413 and friends: the middleware words them
    except (RequestPayloadError, aiohttp.ClientPayloadError, ValueError) as exc:
        # e.g. Content-Encoding: gzip on a body that is not gzip
        raise bad_request(f"the request body could not be read ({type(exc).__name__})") from None


def _dump(body: dict[str, Any]) -> bytes:
    try:
        try:
            return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:  # a lone surrogate (from a \ud800 escape) stays escaped
            return json.dumps(body, separators=(",", ":")).encode()
    except RecursionError:  # json.loads read it, one level short of dumps' limit
        raise bad_request("the request body is nested too deeply") from None


@dataclass(frozen=True, slots=True)
class OpenedBody:
    """A request body checked for what routing needs before the model is known."""

    fields: dict[str, Any]
    model: str  # as the client wrote it: a name or an alias
    stream: bool
    raw: bytes  # the client's bytes


def open_body(route: str, raw: bytes) -> OpenedBody:
    """The body as JSON, with its model, stream flag and the route's required input."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if may_exceed(raw):
        try:
            check_structure(body)
        except TooMuchStructure as exc:
            raise bad_request(str(exc)) from None
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model")
    stream = body.get("stream")
    if stream is None:
        stream = False  # absent or null, as OpenAI and vLLM read it
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    _check_stream_options(body.get("stream_options"))
    spec = ROUTES[route]
    spec.check(body)
    # vLLM answers embeddings (and the other routes that do not stream) with one JSON
    # body whatever "stream" says: so does the relay.
    return OpenedBody(body, model, stream and spec.streams, raw)


def _check_stream_options(options: Any) -> None:
    """Whether the client asked for a stream's usage must be plain, as the gateway reads
    it to decide what to take out of the stream (vLLM would coerce "true" or 1)."""
    if not isinstance(options, dict):
        return  # absent, null, or not an object (vLLM refuses that itself)
    for name in ("include_usage", "continuous_usage_stats"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise bad_request(f"'stream_options.{name}' must be true or false", "stream_options")


def finish_body(
    route: str,
    opened: OpenedBody,
    headers: Any,
    limits: GatewayConfig,
    max_model_len: int,
    model: str | None = None,
    sent: str | None = None,
    stepping: Stepping = ONE_TOKEN,
    priority: int | None = None,
    choice: bool = True,
) -> ParsedRequest:
    """What the request costs on ``model``'s engines (whose context is ``max_model_len``,
    whose streams carry ``stepping``'s tokens per event) and what they are sent. The
    engine knows its model by its canonical name only, so a body naming an alias is
    rewritten to ``model`` (or to ``sent``: a LoRA adapter's name, which the engine
    serves too); the client's bytes go on untouched (no re-serialisation) unless a field
    must be set. ``priority``: the engine's scheduling priority for this request (None:
    the engine schedules first-come first-served, nothing is sent; 0, vLLM's default, is
    not written either); a client's own ``priority`` is always taken out. ``choice``:
    the model has more than one engine, so where the request goes is a choice, and its
    prompt's beginning is worth hashing for prefix routing (with one, it is not read)."""
    body = opened.fields
    canonical = model or opened.model
    wire = sent or canonical
    spec = ROUTES[route]
    cost = spec.cost(body, limits, max_model_len)
    raw = opened.raw
    # may add stream_options; keeps what a request cut off before its count is charged
    plan = plan_usage(
        route,
        opened.stream,
        body,
        max_model_len,
        cost.completion_bound,
        # The route's own readers of its counts (protocols/).
        preamble=spec.preamble,
        bound=spec.prompt_bound,
        reader=spec.event_usage,
        answer=spec.answer_usage,
        stepping=stepping,
    )
    rewrite = wire != opened.model or plan.rewrite
    if spec.prepare is not None and spec.prepare(body):
        rewrite = True
    if rewrite:
        body["model"] = wire
    if cost.write is not None:
        name, value = cost.write
        body[name] = value
        rewrite = True
    # A client's own priority never reaches the engine: the key's class decides it.
    if "priority" in body:
        del body["priority"]
        rewrite = True
    # 0 is vLLM's default: left out, so an interactive key's body goes on as it came.
    priority = priority or None
    in_body = priority if route in BODY_PRIORITY else None
    if in_body is not None:
        body["priority"] = in_body
    if rewrite:
        raw = _dump(body)
    elif plan.added or in_body is not None:
        # Added in front of the client's bytes, not re-serialised: the common case.
        first = (STREAM_USAGE if plan.added else b"") + (
            b'"priority":%d,' % in_body if in_body is not None else b""
        )
        raw = insert_first(raw, first) or _dump(body)
    session = session_key(
        _text(body.get("user")),
        headers.get("X-Session-Id"),
        _text(body.get("prompt_cache_key")),
        _text(meta.get("user_id")) if isinstance(meta := body.get("metadata"), dict) else None,
    )
    state = spec.state(body) if spec.state is not None else None
    # No hint and not pinned by a stored response: placed by its prompt's beginning.
    prefix: Blocks = ()
    pinned = state is not None and state.needs is not None
    if (
        choice
        and session is None
        and spec.prompt is not None
        and limits.prefix_routing
        and not pinned
    ):
        text = spec.prompt(body)
        # At most as many blocks as the request's cost could fill (about 4 characters a
        # token): text the cost does not count (ids, names) cannot make one cheap request
        # fill the index and flush everyone's entries. Seeded with the model it is sent
        # as: an adapter's prefix cache is not its base model's.
        limit = cost.tokens * 4 // BLOCK_CHARS + 1
        prefix = prompt_blocks(text, hash(wire), limit) if text else ()
    lowered = cost.write[1] if cost.lowered and cost.write is not None else None
    return ParsedRequest(
        route,
        canonical,
        opened.stream,
        cost.tokens,
        session,
        raw,
        plan,
        state=state,
        lowered=lowered,
        priority_header=priority if route in HEADER_PRIORITY else None,
        prefix=prefix,
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def parse_body(
    route: str, raw: bytes, headers: Any, limits: GatewayConfig, max_model_len: int
) -> ParsedRequest:
    """Check what the gateway needs to know and what the request costs, for a request
    whose model is taken as named; the engine validates the rest."""
    return finish_body(route, open_body(route, raw), headers, limits, max_model_len)
