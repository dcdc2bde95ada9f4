"""stream_writes.py against aiohttp's real response on a real socket: the head taken
from aiohttp is the one it would have sent, aiohttp then writes neither it nor the body's
end, and the connection stays alive for the next request. An aiohttp release that moves
the private attributes used there fails here."""

from __future__ import annotations

from aiohttp import ClientSession, TCPConnector, web
from aiohttp.test_utils import TestServer

from appliance.gateway.wire.stream_writes import (
    CHUNKED_END,
    HeldHeadResponse,
    ended_by_caller,
    take_head,
)

EVENT = b"data: hi\n\n"
PEERS: list[int] = []  # the client's port, as each handler saw it
WIRE = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


async def spliced(request: web.Request) -> web.StreamResponse:
    """What via_splice.py does: head, chunks and end in one write of its own."""
    resp = HeldHeadResponse(headers={"Content-Type": "text/event-stream"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    head = take_head(resp)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert take_head(resp) == b""  # taken once: aiohttp holds no head any more
    assert request.transport is not None
    PEERS.append(request.transport.get_extra_info("peername")[1])
    request.transport.write(head + WIRE + CHUNKED_END)
    ended_by_caller(resp)
    await resp.write_eof()  # writes nothing: the end went with the body
    return resp


async def written(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    resp.enable_chunked_encoding()
    await resp.prepare(request)  # a plain StreamResponse: aiohttp sent the head itself
    assert request.transport is not None
    PEERS.append(request.transport.get_extra_info("peername")[1])
    assert take_head(resp) == b""
    await resp.write(EVENT)
    await resp.write_eof()
    return resp


async def test_a_spliced_stream_is_whole_and_its_connection_kept_alive() -> None:
    app = web.Application()
    app.router.add_get("/spliced", spliced)
    app.router.add_get("/written", written)
    async with TestServer(app) as server:
        connector = TCPConnector(limit=1)
        async with ClientSession(connector=connector) as session:
            bodies = []
            PEERS.clear()
            for path in ("/spliced", "/spliced", "/written", "/spliced"):
                async with session.get(server.make_url(path)) as resp:
                    assert resp.status == 200
                    assert resp.headers["Transfer-Encoding"] == "chunked"
                    bodies.append(await resp.read())
            assert bodies == [EVENT] * 4
            assert len(PEERS) == 4 and len(set(PEERS)) == 1  # one connection, kept alive
