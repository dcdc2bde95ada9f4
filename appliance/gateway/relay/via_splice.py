"""The relay's splice path: a streamed request from an HTTP/1.1 client.

The engine's chunks go to the client's socket as they arrive, without a task step per
chunk (splice.py says how). Until the first chunk is here nothing has reached the
client, so a failure is an :class:`EngineFailure` the relay can retry elsewhere; after
it, a failure ends the client's stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

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
from appliance.gateway.wire.http1 import Head, UpstreamError, request_bytes
from appliance.gateway.wire.splice import ClientStalled, UpstreamConnection
from appliance.gateway.wire.stream_writes import (
    CHUNKED_END,
    HeldHeadResponse,
    ended_by_caller,
    take_head,
)
from appliance.gateway.wire.upstream_pool import UpstreamPool

log = logging.getLogger("appliance.gateway")


async def relay_via_splice(
    ways: EngineWays, call: EngineCall
) -> web.StreamResponse | EngineFailure:
    """The response sent, or why the engine failed before its first chunk."""
    pool = ways.upstreams
    conn = await _connect(pool, call)
    if isinstance(conn, EngineFailure):
        return conn
    attempt = call.attempt
    attempt.close = lambda: conn.abort(attempt.why)
    try:
        head = await _until_first_chunk(ways, call, conn)
        if not isinstance(head, Head):
            return head  # a whole answer, or a failure to retry elsewhere
        call.client[STREAM_STARTED] = True  # from here only the stream reaches the client
        resp = stream_response(
            head.headers.get("content-type", "text/event-stream"), HeldHeadResponse
        )
        resp.enable_chunked_encoding()
        ended = await _splice_stream(ways, call, conn, resp)
    finally:
        pool.release(call.address, conn)
    if ended:
        if conn.ended_stream:  # the end went with the last chunk
            ended_by_caller(resp)
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
    return resp


async def _connect(pool: UpstreamPool, call: EngineCall) -> UpstreamConnection | EngineFailure:
    """A pooled or new engine connection, or why there is none (abandon() included)."""
    try:
        return await pool.acquire(call.address)
    except UpstreamError as exc:
        return EngineFailure.of_upstream(exc, unanswered=True)
    except asyncio.CancelledError:
        failure = failure_if_abandoned(call.attempt)
        if failure is None:
            raise
        return failure


async def _until_first_chunk(
    ways: EngineWays, call: EngineCall, conn: UpstreamConnection
) -> Head | web.Response | EngineFailure:
    """Send the request; the head once a stream's first chunk is here, the whole answer
    when it is not a stream, or why the engine failed (nothing reached the client)."""
    try:
        head = await conn.send(
            request_bytes(call.path, call.address.host, call.headers, call.parsed.body)
        )
        call.meter.status = head.status
        if head.status in RETRYABLE_STATUS:
            return EngineFailure.engine_answered(head.status)
        if head.status != 200 or not head.chunked:
            body = await read_whole(ways.config().gateway.max_answer_bytes, conn.read_body)
            ways.first_byte(call.parsed.route, call.parsed.model, call.started)
            call.meter.answer = answer_usage(call, body)
            content_type = head.headers.get("content-type", "application/json").split(";")[0]
            return whole_answer(call, head.status, body, content_type)
        # The relay counts the stream from its tap, however it ends (stream_tap.charged):
        # from the head on, so a stream cut before its first chunk is counted too.
        call.meter.tap = conn.tap = StreamTap.for_plan(call.parsed.usage)
        # Headers go out with the first chunk: until then a failure can still be
        # retried elsewhere without the client knowing.
        await conn.wait_first_chunk()
    except UpstreamError as exc:
        # No head yet (call.meter.status 0): the engine gave no answer at all.
        unanswered = call.meter.status == 0
        return call.attempt.given_up or EngineFailure.of_upstream(exc, unanswered)
    return head


async def _splice_stream(
    ways: EngineWays, call: EngineCall, conn: UpstreamConnection, resp: web.StreamResponse
) -> bool:
    """Send the head, then splice the engine's chunks to the client until the body ends;
    whether the client's stream is still to be ended (not when the client went away)."""
    request = call.client
    try:
        await resp.prepare(request)
        ways.first_byte(call.parsed.route, call.parsed.model, call.started)
        transport = request.transport
        if transport is None:
            raise UpstreamError("the client disconnected")
        # The head goes with the first chunk and the end with the last (stream_writes.py);
        # a closing client transport aborts the splice at once.
        conn.splice_to(transport, take_head(resp), CHUNKED_END)
        await conn.wait_spliced(ways.config().gateway.stall_timeout_s)
    except UpstreamError as exc:
        if isinstance(exc, ClientStalled):
            log.warning(
                "a %s stream of key %s ended: %s (gateway.stall_timeout_s); its engine "
                "slot is free again",
                call.parsed.route,
                request["key"].id,
                exc,
            )
        transport = request.transport
        if transport is None or transport.is_closing():
            request["status"] = 499  # the client went away: nothing to tell it
            return False
        head = conn.unsent_head()
        if head:  # failed before its first chunk went: the head goes before the error
            transport.write(head)
        await end_with_error_event(call, resp, str(exc))
    return True
