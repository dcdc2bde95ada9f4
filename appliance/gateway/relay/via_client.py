"""The relay's aiohttp-client path: non-streamed requests, and HTTP/1.0 clients' streams.

A non-streamed answer is read whole (within ``gateway.max_answer_bytes``) and sent on
untouched; a stream is passed on chunk by chunk as aiohttp reads it. Streams from
HTTP/1.1 clients take the faster path in via_splice.py.

A stream's client that reads nothing for ``gateway.stall_timeout_s`` is cut off, as on
the splice path: a write is timed only when the client's transport already holds
unsent bytes (``TIMED_WRITE_BYTES``), the only case in which aiohttp's write can wait for
the client, so a client that keeps up costs no timer per chunk. A whole answer's slot
is given back before aiohttp writes it (the relay returns it), so a client that does
not read it holds no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11

from appliance.gateway.accounting.stream_tap import StreamTap
from appliance.gateway.admission.open_requests import STREAM_STARTED
from appliance.gateway.relay.answers import (
    EngineCall,
    answer_usage,
    end_with_error_event,
    read_whole,
    stream_response,
    whole_answer,
)
from appliance.gateway.relay.engine_ways import EngineWays
from appliance.gateway.relay.failures import RETRYABLE_STATUS, EngineFailure, failure_if_abandoned
from appliance.gateway.wire.http1 import MAX_CHUNK_BYTES, AnswerTooLarge

log = logging.getLogger("appliance.gateway")
# A write to a transport holding more than this may wait for the client (aiohttp drains
# above asyncio's high-water mark, 64 KiB): such a write is timed by stall_timeout_s.
TIMED_WRITE_BYTES = 16 * 1024


class EventTooLarge(aiohttp.ClientPayloadError):
    """One SSE event over ``MAX_CHUNK_BYTES`` (the splice path's cap on one chunk)."""

    said = True  # EngineFailure.of_client_error passes its words on


async def read_limited(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
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


async def relay_via_client(
    ways: EngineWays, call: EngineCall
) -> web.StreamResponse | EngineFailure:
    """A non-streamed request (or an HTTP/1.0 client's stream), through aiohttp."""
    upstream = await _post(ways, call)
    if isinstance(upstream, EngineFailure):
        return upstream
    call.attempt.close = upstream.close
    call.meter.status = upstream.status
    try:
        if upstream.status in RETRYABLE_STATUS:
            return EngineFailure.engine_answered(upstream.status)
        if not call.parsed.stream or upstream.status != 200:
            return await _answer_whole(ways, call, upstream)
        return await _stream(ways, call, upstream)
    except (TimeoutError, aiohttp.ClientError) as exc:
        return call.attempt.given_up or EngineFailure.of_client_error(exc)
    finally:
        if upstream.content.at_eof():
            upstream.release()  # keep the connection for the next request
        else:
            upstream.close()  # closing mid-answer is what makes vLLM abort it


async def _post(ways: EngineWays, call: EngineCall) -> aiohttp.ClientResponse | EngineFailure:
    """The engine's response head, or why there is none (abandon() included)."""
    address = call.address
    session = ways.sessions.session_for(address)
    send = session.post if call.method == "POST" else session.get  # GET: a retrieve
    try:
        return await send(
            address.base_url + call.path,
            data=call.parsed.body,
            headers=call.headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
    except (aiohttp.ClientError, OSError) as exc:
        # Before the response head: refused, no socket, or dropped unanswered.
        return EngineFailure.of_client_error(exc, unanswered=True)
    except asyncio.CancelledError:
        failure = failure_if_abandoned(call.attempt)
        if failure is None:
            raise
        return failure


async def _answer_whole(
    ways: EngineWays, call: EngineCall, upstream: aiohttp.ClientResponse
) -> web.Response:
    body = await read_whole(
        ways.config().gateway.max_answer_bytes,
        lambda limit: read_limited(upstream, limit),
    )
    resp = whole_answer(call, upstream.status, body, upstream.content_type or "application/json")
    ways.first_byte(call.parsed.route, call.parsed.model, call.started)
    call.meter.answer = answer_usage(call, body)  # counted by the relay, however it ends
    return resp


async def _stream(
    ways: EngineWays, call: EngineCall, upstream: aiohttp.ClientResponse
) -> web.StreamResponse:
    # The relay counts the stream from its tap, however it ends (stream_tap.charged).
    call.meter.tap = tap = StreamTap.for_plan(call.parsed.usage)
    return await _stream_events(ways, call, upstream, tap)


async def _stream_events(
    ways: EngineWays, call: EngineCall, upstream: aiohttp.ClientResponse, tap: StreamTap
) -> web.StreamResponse:
    """The engine's events, each written on as it came (whole events: ``tap`` may take
    the usage event out); raises before the first one (the caller retries), ends with
    an error event after it."""
    request = call.client
    resp = stream_response(upstream.headers.get("Content-Type", "text/event-stream"))
    if request.version < HttpVersion11:
        # No length and no chunks in HTTP/1.0: only the close ends the stream, and
        # aiohttp 3.14 keeps a keep-alive HTTP/1.0 connection open after it (the client
        # waited for KEEPALIVE_TIMEOUT_S, and read a pipelined answer as more stream).
        resp.force_close()
    first = True
    content = upstream.content
    pending = bytearray()  # a partial event
    try:
        async for data in content.iter_any():
            chunk = tap.sse(data, pending)
            if len(pending) > MAX_CHUNK_BYTES:
                # One event never ends: as on the splice path, hold no more than the cap.
                raise EventTooLarge(
                    f"an event from the engine is larger than {MAX_CHUNK_BYTES} bytes"
                )
            if not chunk:
                continue
            if first:
                # Headers go out with the first chunk: until then a failure can still
                # be retried elsewhere without the client knowing.
                request[STREAM_STARTED] = True  # from here only the stream reaches it
                await resp.prepare(request)
                ways.first_byte(call.parsed.route, call.parsed.model, call.started)
                first = False
            try:
                await _write(ways, call, resp, chunk)
            except (ConnectionError, TimeoutError):
                # The client went away, or read nothing for stall_timeout_s: not an
                # engine failure, nothing to retry. Returning closes the upstream
                # mid-answer, so vLLM aborts it.
                request["status"] = 499
                return resp
    except (TimeoutError, aiohttp.ClientError) as exc:
        if first:
            raise
        await _write_rest(resp, tap.flush_sse(pending, broken=True))
        await end_with_error_event(call, resp, type(exc).__name__)
    if first:
        await resp.prepare(request)  # an empty stream: still a valid (empty) answer
    await _write_rest(resp, tap.flush_sse(pending))
    await resp.write_eof()
    return resp


async def _write(
    ways: EngineWays, call: EngineCall, resp: web.StreamResponse, chunk: bytes
) -> None:
    """One chunk to the client; TimeoutError (and the client's connection aborted) when
    the write waited ``stall_timeout_s`` for a client that read nothing."""
    transport = call.client.transport
    if transport is None or transport.get_write_buffer_size() + len(chunk) <= TIMED_WRITE_BYTES:
        await resp.write(chunk)  # cannot wait for the client: untimed
        return
    stall_s = ways.config().gateway.stall_timeout_s
    try:
        await asyncio.wait_for(resp.write(chunk), stall_s)
    except TimeoutError:
        transport.abort()
        log.warning(
            "a %s stream of key %s ended: the client read nothing for %g s "
            "(gateway.stall_timeout_s); its engine slot is free again",
            call.parsed.route,
            call.client["key"].id,
            stall_s,
        )
        raise


async def _write_rest(resp: web.StreamResponse, rest: bytes) -> None:
    """What the tap still held when the engine's stream ended."""
    if rest:
        with contextlib.suppress(ConnectionError):
            await resp.write(rest)
