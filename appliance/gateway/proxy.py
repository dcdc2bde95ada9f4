"""The OpenAI routes: validate, limit, admit, relay to an engine, account.

The relay is the hot path. A streamed answer is passed on chunk by chunk as the engine's
bytes arrive (no parsing, no re-chunking, one write per chunk); a non-streamed body is
passed on untouched. The client's key never reaches the engine: the gateway sends the
engine's per-boot key instead.

Failure handling, by when it happens:

- before the engine sent a byte (connection refused, engine 5xx, reset): the request is
  retried once on another engine, so a crashing engine costs clients nothing; when no
  other engine is left, the client gets 504 if the engine timed out and 502 otherwise,
  decided by :class:`EngineFailure`'s ``timed_out``, set where the failure is caught;
- after the first byte of a stream: the client gets one SSE error event and the stream
  ends (the ``openai`` client raises ``APIError``), never a silently truncated answer;
- the supervisor declares the engine unresponsive (hung): :meth:`Relay.abandon` applies
  the two rules above at once to every request on it, rather than when the process is
  finally killed, so a request stuck on a frozen engine moves on at the verdict;
- the client goes away: the handler is cancelled, which closes the upstream connection,
  which makes vLLM abort the generation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError

from appliance.config import GatewayConfig
from appliance.endpoint import EngineAddress
from appliance.gateway.cost import request_cost
from appliance.gateway.errors import GatewayError, sse_error_event
from appliance.gateway.splice import AnswerTooLarge, UpstreamError, request_bytes
from appliance.policy.routing import session_key

if TYPE_CHECKING:
    from appliance.gateway.app import Gateway

log = logging.getLogger("appliance.gateway")

HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "server",
        "date",
    }
)
RETRYABLE_STATUS = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    route: str
    model: str
    stream: bool
    cost: int  # tokens, as appliance/gateway/cost.py counts them
    session: str | None
    body: bytes  # what the engine is sent: the client's bytes, unless a field had to be set


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """Why an engine failed before the first byte of its answer reached the client.

    The relay retries it on another engine; when none is left, the client gets 504 if
    ``timed_out``, else 502, with ``reason`` in the message.
    """

    reason: str  # the words clients and logs see
    timed_out: bool  # the engine did not answer in time (not: refused, reset, 5xx, given up)

    @classmethod
    def of_client_error(cls, exc: BaseException) -> EngineFailure:
        """An aiohttp or socket error, named by its class. aiohttp's connect and read
        timeouts (``ServerTimeoutError`` and its kinds) are ``TimeoutError``s."""
        return cls(type(exc).__name__, timed_out=isinstance(exc, TimeoutError))

    @classmethod
    def of_upstream(cls, exc: UpstreamError) -> EngineFailure:
        """A splice connection's failure, which says itself whether it timed out."""
        return cls(str(exc), timed_out=exc.timed_out)

    @classmethod
    def engine_answered(cls, status: int) -> EngineFailure:
        """An engine's own 5xx: it answered, so it did not time out (even a 504)."""
        return cls(f"engine answered {status}", timed_out=False)


@dataclass(eq=False, slots=True)
class _Attempt:
    """One request's try on one engine, so the engine can be abandoned mid-try."""

    task: asyncio.Task[Any] | None
    # Closes the engine connection of this try (pending reads then fail), once there is one.
    close: Callable[[], None] | None = None
    given_up: EngineFailure | None = None  # set by abandon(): the engine stopped answering

    @property
    def why(self) -> str:
        """Why the engine was given up on; "" while it was not."""
        return self.given_up.reason if self.given_up is not None else ""


def _stream_response(content_type: str) -> web.StreamResponse:
    return web.StreamResponse(
        status=200,
        headers={
            "Content-Type": content_type,
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )


async def _end_with_error_event(request: web.Request, resp: web.StreamResponse, why: str) -> None:
    """An engine broke after the client's first byte: say so in the stream, never truncate."""
    log.warning(
        "engine stream broke after the first byte (%s); ending the client's stream with "
        "an error event",
        why,
    )
    request["status"] = 502
    with contextlib.suppress(ConnectionError):
        await resp.write(
            sse_error_event(
                502, "the engine failed while generating; the answer is incomplete", "engine_error"
            )
        )


def _given_up(attempt: _Attempt) -> EngineFailure | None:
    """abandon()'s failure if the CancelledError being handled is abandon()'s own, and
    only that: then it is taken back and the try counts as an engine failure before the
    first byte (a client that went away cancels too, and that one must go on)."""
    task = asyncio.current_task()
    if attempt.given_up is None or task is None or task.uncancel() != 0:
        return None
    return attempt.given_up


async def _read_limited(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """aiohttp's ``read()``, holding no more than ``limit`` bytes."""
    if upstream.content_length is not None and upstream.content_length > limit:
        raise AnswerTooLarge(limit)  # said up front: read none of it
    chunks = []
    size = 0
    async for chunk in upstream.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _engine_error(failure: EngineFailure) -> GatewayError:
    """No engine left to try: 504 when the last one timed out, 502 otherwise."""
    return GatewayError(
        504 if failure.timed_out else 502,
        f"the engine failed before answering ({failure.reason})",
        code="engine_error",
        reason="engine_error",
    )


def _bad(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request", reason="bad_request")


def _dump(body: dict[str, Any]) -> bytes:
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate (from a \ud800 escape) stays escaped
        return json.dumps(body, separators=(",", ":")).encode()


def parse_body(
    route: str, raw: bytes, headers: Any, limits: GatewayConfig, max_model_len: int
) -> ParsedRequest:
    """Check what the gateway needs to know and what the request costs; the engine
    validates the rest. The body is re-serialized only when a field must be set."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise _bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    if route == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' must be a non-empty list", "messages")
    elif route == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            raise _bad("'prompt' must be a string or a non-empty list", "prompt")
    elif route == "embeddings":
        inp = body.get("input")
        if not isinstance(inp, (str, list)) or (isinstance(inp, list) and not inp):
            raise _bad("'input' must be a string or a non-empty list", "input")
    cost = request_cost(route, body, limits, max_model_len)
    if cost.write is not None:
        name, value = cost.write
        body[name] = value
        raw = _dump(body)
    user = body.get("user")
    session = session_key(user if isinstance(user, str) else None, headers.get("X-Session-Id"))
    return ParsedRequest(route, model, stream, cost.tokens, session, raw)


class Relay:
    """The /v1 handlers, bound to one Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._attempts: collections.defaultdict[int, set[_Attempt]] = collections.defaultdict(set)

    def abandon(self, engine_id: int, why: str) -> int:
        """Give up on every request on an engine that stopped answering; how many.

        One still waiting for the engine's answer (no byte sent to its client yet) is
        retried on another engine by the usual rule; a stream already under way ends with
        an error event. Both happen now rather than when the engine's process dies, which
        for a frozen engine is its stop grace later.
        """
        attempts = list(self._attempts.get(engine_id, ()))
        for attempt in attempts:
            # A verdict on the engine, not a timeout of this request: 502 if not retried.
            attempt.given_up = EngineFailure(why, timed_out=False)
            if attempt.close is not None:
                # Pending reads fail: handled like a broken engine.
                attempt.close()
            elif attempt.task is not None:
                attempt.task.cancel()  # still in session.post(): see _relay
        return len(attempts)

    async def models(self, request: web.Request) -> web.Response:
        created = int(self.gw.appliance.started_at)
        names = self.gw.model_names()
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": n, "object": "model", "created": created, "owned_by": "llm-appliance"}
                    for n in names
                ],
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", "/v1/completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "embeddings", "/v1/embeddings")

    async def _handle(self, request: web.Request, route: str, path: str) -> web.StreamResponse:
        gw = self.gw
        started = time.monotonic()
        record = request["key"]
        cfg = gw.appliance.config.gateway
        try:
            raw = await request.read()
        except web.HTTPException:
            raise  # 413 and friends: the middleware words them
        except (RequestPayloadError, aiohttp.ClientPayloadError, ValueError) as exc:
            # e.g. Content-Encoding: gzip on a body that is not gzip
            raise _bad(f"the request body could not be read ({type(exc).__name__})") from None
        parsed = parse_body(
            route, raw, request.headers, cfg, gw.appliance.config.engine.max_model_len
        )
        if parsed.model not in gw.model_names():
            raise GatewayError(
                404,
                f"The model '{parsed.model}' does not exist; GET /v1/models "
                "lists the served models",
                param="model",
                code="model_not_found",
                reason="model_not_found",
            )
        gw.admission.check_cost(parsed.cost)  # before tpm: never charge what cannot run
        limited = gw.ratelimiter.check(record.id, record.rpm, record.tpm, parsed.cost)
        if limited is not None:
            which, wait = limited
            gw.metrics.rate_limited.labels(record.id, which).inc()
            gw.metrics.rejections.labels(f"rate_limit_{which}").inc()
            raise GatewayError(
                429,
                f"rate limit reached for this key ({which}); retry in {wait:.1f} s",
                code=f"rate_limit_{which}",
                retry_after=wait,
                reason=f"rate_limit_{which}",
            )
        batch = record.priority == "batch"
        tried: frozenset[int] = frozenset()
        for attempt in (1, 2):
            queued = time.monotonic()
            engine_id = await gw.admission.acquire(
                parsed.cost, batch=batch, session=parsed.session, exclude=tried
            )
            gw.metrics.queue_wait.observe(time.monotonic() - queued)
            try:
                result = await self._relay(request, engine_id, path, parsed.body, parsed, started)
            finally:
                gw.admission.release(engine_id, parsed.cost)
            if isinstance(result, web.StreamResponse):
                return result
            # Failed before the first byte: try once more elsewhere.
            tried = tried | {engine_id}
            if attempt == 1 and gw.has_other_engine(tried):
                gw.metrics.failovers.inc()
                log.warning(
                    "engine%d failed before answering (%s); retrying on another engine",
                    engine_id,
                    result.reason,
                )
                continue
            raise _engine_error(result)
        raise AssertionError("unreachable")

    async def _read_whole(self, read: Callable[[int], Awaitable[bytes]]) -> bytes:
        """A non-streamed answer (both relay paths), which the daemon must hold whole
        before sending it on: never more than gateway.max_answer_bytes of it. Beyond,
        502, not a retry: another engine would answer the same."""
        limit = self.gw.appliance.config.gateway.max_answer_bytes
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

    async def _relay(
        self,
        request: web.Request,
        engine_id: int,
        path: str,
        raw: bytes,
        parsed: ParsedRequest,
        started: float,
    ) -> web.StreamResponse | EngineFailure:
        """The response sent, or why the engine failed before its first byte."""
        gw = self.gw
        snap = gw.appliance.engine(engine_id)
        headers = {"Authorization": f"Bearer {snap.api_key}", "Content-Type": "application/json"}
        attempt = _Attempt(asyncio.current_task())
        attempts = self._attempts[engine_id]
        attempts.add(attempt)
        try:
            if parsed.stream and request.version >= HttpVersion11:
                return await self._splice(
                    request, attempt, snap.address, path, headers, raw, parsed, started
                )
            return await self._via_client(
                request, attempt, snap.address, path, headers, raw, parsed, started
            )
        finally:
            attempts.discard(attempt)

    async def _via_client(
        self,
        request: web.Request,
        attempt: _Attempt,
        address: EngineAddress,
        path: str,
        headers: dict[str, str],
        raw: bytes,
        parsed: ParsedRequest,
        started: float,
    ) -> web.StreamResponse | EngineFailure:
        """A non-streamed request (or an HTTP/1.0 client's stream), through aiohttp."""
        try:
            upstream = await self.gw.session_for(address).post(
                address.base_url + path,
                data=raw,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            )
        except (aiohttp.ClientError, OSError) as exc:
            return EngineFailure.of_client_error(exc)
        except asyncio.CancelledError:
            failure = _given_up(attempt)
            if failure is None:
                raise
            return failure
        attempt.close = upstream.close
        try:
            if upstream.status in RETRYABLE_STATUS:
                return EngineFailure.engine_answered(upstream.status)
            if not parsed.stream or upstream.status != 200:
                body = await self._read_whole(lambda limit: _read_limited(upstream, limit))
                resp = web.Response(
                    status=upstream.status,
                    body=body,
                    content_type=upstream.content_type or "application/json",
                )
                self.gw.metrics.ttft.labels(parsed.route).observe(time.monotonic() - started)
                return resp
            return await self._stream(request, upstream, parsed, started)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return attempt.given_up or EngineFailure.of_client_error(exc)
        finally:
            if upstream.content.at_eof():
                upstream.release()  # keep the connection for the next request
            else:
                upstream.close()  # closing mid-answer is what makes vLLM abort it

    async def _splice(
        self,
        request: web.Request,
        attempt: _Attempt,
        address: EngineAddress,
        path: str,
        headers: dict[str, str],
        raw: bytes,
        parsed: ParsedRequest,
        started: float,
    ) -> web.StreamResponse | EngineFailure:
        """A streamed request, relayed by splice.py: the engine's chunks go to the
        client's socket as they arrive, without a task step per chunk."""
        pool = self.gw.upstreams
        try:
            conn = await pool.acquire(address)
        except UpstreamError as exc:
            return EngineFailure.of_upstream(exc)
        except asyncio.CancelledError:
            failure = _given_up(attempt)
            if failure is None:
                raise
            return failure
        attempt.close = lambda: conn.abort(attempt.why)
        resp: web.StreamResponse | None = None
        try:
            head = await conn.send(request_bytes(path, address.host, headers, raw))
            if head.status in RETRYABLE_STATUS:
                return EngineFailure.engine_answered(head.status)
            if head.status != 200 or not head.chunked:
                body = await self._read_whole(conn.read_body)
                self.gw.metrics.ttft.labels(parsed.route).observe(time.monotonic() - started)
                return web.Response(
                    status=head.status,
                    body=body,
                    content_type=head.headers.get("content-type", "application/json").split(";")[0],
                )
            # Headers go out with the first chunk: until then a failure can still be
            # retried elsewhere without the client knowing.
            await conn.wait_first_chunk()
            resp = _stream_response(head.headers.get("content-type", "text/event-stream"))
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(b"")  # the head now: the engine's chunks follow it as they are
            self.gw.metrics.ttft.labels(parsed.route).observe(time.monotonic() - started)
            transport = request.transport
            if transport is None:
                raise UpstreamError("the client disconnected")
            conn.splice_to(transport)  # a closing client transport aborts it at once
            await conn.wait_spliced()
        except UpstreamError as exc:
            if resp is None:
                return attempt.given_up or EngineFailure.of_upstream(exc)
            transport = request.transport
            if transport is None or transport.is_closing():
                request["status"] = 499  # the client went away: nothing to tell it
                return resp
            await _end_with_error_event(request, resp, str(exc))
        finally:
            pool.release(address, conn)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        parsed: ParsedRequest,
        started: float,
    ) -> web.StreamResponse:
        resp = _stream_response(upstream.headers.get("Content-Type", "text/event-stream"))
        first = True
        content = upstream.content
        try:
            async for chunk in content.iter_any():
                if first:
                    # Headers go out with the first chunk: until then a failure can still
                    # be retried elsewhere without the client knowing.
                    await resp.prepare(request)
                    self.gw.metrics.ttft.labels(parsed.route).observe(time.monotonic() - started)
                    first = False
                try:
                    await resp.write(chunk)
                except ConnectionError:
                    # The client went away: not an engine failure, nothing to retry.
                    # Returning closes the upstream mid-answer, so vLLM aborts it.
                    request["status"] = 499
                    return resp
        except (TimeoutError, aiohttp.ClientError) as exc:
            if first:
                raise
            await _end_with_error_event(request, resp, type(exc).__name__)
        if first:
            await resp.prepare(request)  # an empty stream: still a valid (empty) answer
        await resp.write_eof()
        return resp
