"""A non-streamed answer is read whole, but never past a limit, on both relay paths:
the splice connection's ``read_body`` and the aiohttp client's read (``via_client.read_limited``).
Each framing an engine may use (Content-Length, chunked, until close) is checked against
a real local server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from appliance.gateway.relay.via_client import read_limited
from appliance.gateway.wire.http1 import AnswerTooLarge
from appliance.gateway.wire.splice import UpstreamConnection

LIMIT = 64 * 1024
BIG = 4 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _chunked(total: int, piece: int = 16 * 1024) -> bytes:
    out = bytearray()
    for start in range(0, total, piece):
        n = min(piece, total - start)
        out += b"%x\r\n" % n + b"x" * n + b"\r\n"
    return bytes(out + b"0\r\n\r\n")


def _answer(framing: str, size: int) -> bytes:
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
    if framing == "length":
        return head + b"Content-Length: %d\r\n\r\n" % size + b"x" * size
    if framing == "chunked":
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked(size)
    return head + b"Connection: close\r\n\r\n" + b"x" * size


async def _serve_once(answer: bytes) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        with contextlib.suppress(ConnectionError):  # the reader gave up past the limit
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _splice_read(framing: str, size: int) -> tuple[UpstreamConnection, bytes | None]:
    server, port = await _serve_once(_answer(framing, size))
    try:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(UpstreamConnection, "127.0.0.1", port)
        head = await conn.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert head.status == 400
        try:
            return conn, await asyncio.wait_for(conn.read_body(LIMIT), 5)
        except AnswerTooLarge:
            return conn, None
    finally:
        server.close()


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_splice_read_body_stops_at_the_limit(framing: str) -> None:
    conn, body = await _splice_read(framing, BIG)
    assert body is None
    # Nothing of it is kept, and the connection is closed, never reused.
    assert not conn._collected and not conn.finished
    assert conn.transport is not None and conn.transport.is_closing()


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_splice_read_body_under_the_limit_is_whole(framing: str) -> None:
    _, body = await _splice_read(framing, LIMIT)
    assert body == b"x" * LIMIT


async def _client_read(handler: Handler) -> bytes:
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/") as resp,
        ):
            return await asyncio.wait_for(read_limited(resp, LIMIT), 5)
    finally:
        await runner.cleanup()


def _handler(framing: str, size: int) -> Handler:
    """An aiohttp handler answering ``size`` bytes, with a Content-Length or chunked."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if framing == "length":
            return web.Response(body=b"x" * size)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):  # the reader gave up past the limit
            for _ in range(size // 16384):
                await resp.write(b"x" * 16384)
        return resp

    return handle


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_client_read_stops_at_the_limit(framing: str) -> None:
    with pytest.raises(AnswerTooLarge) as ei:
        await _client_read(_handler(framing, BIG))
    assert ei.value.limit == LIMIT and str(LIMIT) in str(ei.value)
    assert await _client_read(_handler(framing, LIMIT)) == b"x" * LIMIT
