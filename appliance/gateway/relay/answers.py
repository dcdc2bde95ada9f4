"""What the relay sends a client, on either path (aiohttp's client or the splice).

:class:`EngineCall` is one try of one request on one engine: what the engine is sent and
what the client's answer needs. A non-streamed answer is held whole, so never more than
``gateway.max_answer_bytes`` of it (:func:`read_whole`); a stream's head goes out with
its first chunk (:func:`stream_response`); a stream that breaks after that ends with one
error event (:func:`end_with_error_event`), never silently truncated.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

from appliance.endpoint import EngineAddress
from appliance.gateway.accounting.stream_tap import Metering
from appliance.gateway.errors import GatewayError, engine_refusal
from appliance.gateway.protocols import ROUTES
from appliance.gateway.protocols.counts import Usage, usage_of_answer
from appliance.gateway.relay.failures import Attempt
from appliance.gateway.relay.request_body import ParsedRequest
from appliance.gateway.wire.http1 import AnswerTooLarge

log = logging.getLogger("appliance.gateway")


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One try of one client request on one engine."""

    client: web.Request
    parsed: ParsedRequest  # parsed.body is what the engine is sent
    attempt: Attempt
    address: EngineAddress
    path: str  # the engine's route, e.g. /v1/chat/completions
    headers: dict[str, str]  # the engine's key, not the client's
    started: float  # time.monotonic() when the request arrived, for the TTFT metric
    method: str = "POST"  # GET: a stored response's retrieve
    meter: Metering = field(default_factory=Metering)  # what the try got, for its usage


def stream_response(
    content_type: str, kind: type[web.StreamResponse] = web.StreamResponse
) -> web.StreamResponse:
    return kind(
        status=200,
        headers={
            "Content-Type": content_type,
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )


async def read_whole(limit: int, read: Callable[[int], Awaitable[bytes]]) -> bytes:
    """A non-streamed answer (both relay paths), which the daemon must hold whole
    before sending it on: never more than ``limit`` (gateway.max_answer_bytes) of it.
    Beyond, 502, not a retry: another engine would answer the same."""
    try:
        return await read(limit)
    except AnswerTooLarge:
        raise GatewayError(
            502,
            f"the engine's answer is larger than {limit} bytes, the most this server "
            'relays unstreamed (gateway.max_answer_bytes); ask for it with "stream": '
            "true, or for fewer tokens",
            code="answer_too_large",
            reason="answer_too_large",
        ) from None


def whole_answer(call: EngineCall, status: int, body: bytes, content_type: str) -> web.Response:
    """A whole answer from the engine as the client gets it: untouched, unless it is the
    engine's refusal (4xx), which is put in the gateway's error shape (errors.py)."""
    if 400 <= status < 500:
        return engine_refusal(status, body, ROUTES[call.parsed.route].shape)
    return web.Response(status=status, body=body, content_type=content_type)


def answer_usage(call: EngineCall, body: bytes) -> Usage | None:
    """The engine's counts in a whole answer, as the call's route writes them."""
    plan = call.parsed.usage
    return usage_of_answer(body) if plan is None else plan.answer_usage(body)


async def end_with_error_event(call: EngineCall, resp: web.StreamResponse, why: str) -> None:
    """An engine broke after the client's first byte: say so in the stream, never truncate,
    with the error event of the route's protocol (its SDK raises on it)."""
    request = call.client
    log.warning(
        "engine stream broke after the first byte (%s); ending the client's stream with "
        "an error event",
        why,
    )
    request["status"] = 502
    with contextlib.suppress(ConnectionError):
        await resp.write(
            ROUTES[call.parsed.route].error_event(
                502, "the engine failed while generating; the answer is incomplete", "engine_error"
            )
        )
