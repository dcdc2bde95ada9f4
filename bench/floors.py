"""Two relays that do only what every streaming HTTP relay must: where the gateway's CPU
goes between a byte pipe and the appliance.

Both speak HTTP/1.1 to the client, send its POST to the engine's Unix socket on a
pooled keep-alive connection and splice the engine's chunks back with the appliance's own
engine side (``appliance.gateway.wire.splice``: the same ``UpstreamConnection``, pool and
head-with-the-first-chunk write). No key check, body check, cost, admission, routing,
usage accounting or metrics: the client's ``Authorization`` goes to the engine as it came.

- ``aiohttp``: an aiohttp application on uvloop with the gateway's server settings
  (``handler_cancellation``, no access log, no inflating), one handler doing the splice
  as ``via_splice.py`` does. Its distance to the appliance is what the appliance's own
  per-request work costs; its distance to ``raw`` is what aiohttp's server costs, the
  most a client side of the gateway's own (issue #24's "structural step") could give.
- ``raw``: an ``asyncio.Protocol`` that reads the request head and a Content-Length body
  and answers by the splice; one task per request. The floor of an HTTP relay in Python
  on this engine side. It is no server: it trusts the client's framing completely.

``bench.vs_nginx --floors`` puts both beside the appliance, nginx and the byte pipe.

    .venv/bin/python -m bench.floors --server aiohttp|raw --uds ENGINE.sock --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import uvloop
from aiohttp import web

from appliance.endpoint import EngineAddress
from appliance.gateway.wire.http1 import Head, request_bytes
from appliance.gateway.wire.splice import UpstreamConnection
from appliance.gateway.wire.stream_writes import (
    CHUNKED_END,
    HeldHeadResponse,
    ended_by_caller,
    take_head,
)
from appliance.gateway.wire.upstream_pool import UpstreamPool
from bench.pipe import RelayProcess, run_relay

SERVERS = ("aiohttp", "raw")
ENGINE_PATH = "/v1/completions"


async def _to_engine(
    pool: UpstreamPool, address: EngineAddress, auth: str, body: bytes
) -> tuple[UpstreamConnection, Head]:
    """The request sent on a pooled connection; its head once the first chunk is here."""
    conn = await pool.acquire(address)
    headers = {"Authorization": auth, "Content-Type": "application/json"}
    head = await conn.send(request_bytes(ENGINE_PATH, "localhost", headers, body))
    await conn.wait_first_chunk()
    return conn, head


# ---- aiohttp ---------------------------------------------------------------------------


def aiohttp_app(pool: UpstreamPool, address: EngineAddress) -> web.Application:
    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        conn, head = await _to_engine(pool, address, request.headers["Authorization"], body)
        resp = HeldHeadResponse(headers={"Content-Type": head.headers["content-type"]})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        assert request.transport is not None
        conn.splice_to(request.transport, take_head(resp), CHUNKED_END)
        try:
            await conn.wait_spliced()
        finally:
            pool.release(address, conn)
        ended_by_caller(resp)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(ENGINE_PATH, relay)
    return app


async def serve_aiohttp(address: EngineAddress, port: int) -> None:
    pool = UpstreamPool(lambda _: None)
    runner = web.AppRunner(
        aiohttp_app(pool, address),
        access_log=None,
        handler_cancellation=True,
        auto_decompress=False,
    )
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await asyncio.Event().wait()


# ---- raw -------------------------------------------------------------------------------


class _RawClient(asyncio.Protocol):
    """One client connection: a request at a time, answered by the splice."""

    def __init__(self, pool: UpstreamPool, address: EngineAddress) -> None:
        self.pool, self.address = pool, address
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next()

    def _next(self) -> None:
        if self.busy:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        auth, length = "", 0
        for line in bytes(self.buf[:end]).split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"authorization":
                auth = value.strip().decode("latin-1")
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        self.busy = True
        task = asyncio.get_running_loop().create_task(self._answer(auth, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, auth: str, body: bytes) -> None:
        conn, head = await _to_engine(self.pool, self.address, auth, body)
        out = (
            "HTTP/1.1 200 OK\r\n"
            f"Content-Type: {head.headers['content-type']}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        ).encode("latin-1")
        assert self.transport is not None
        conn.splice_to(self.transport, out, CHUNKED_END)
        try:
            await conn.wait_spliced()
        finally:
            self.pool.release(self.address, conn)
        self.busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self.tasks:
            task.cancel()


async def serve_raw(address: EngineAddress, port: int) -> None:
    pool = UpstreamPool(lambda _: None)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _RawClient(pool, address), "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


# ---- in a process of its own -------------------------------------------------------------


def run_floor(server: str, upstream_socket: str) -> contextlib.AbstractContextManager[RelayProcess]:
    """The relay in a process of its own on a free loopback port; stopped after."""
    return run_relay(["bench.floors", "--server", server], upstream_socket)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", choices=SERVERS, required=True)
    ap.add_argument("--uds", required=True, help="the engine's Unix socket")
    ap.add_argument("--port", type=int, required=True, help="loopback TCP port to listen on")
    args = ap.parse_args()
    address = EngineAddress(uds=args.uds)
    serve = serve_aiohttp if args.server == "aiohttp" else serve_raw
    uvloop.run(serve(address, args.port))


if __name__ == "__main__":
    main()
