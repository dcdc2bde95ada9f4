"""The spliced stream relay's HTTP/1.1 reading, against real sockets on loopback.

A tiny raw server plays the engine: it writes exactly the bytes a test gives it, split
where the test says, so chunk framing, keep-alive, bad answers and a client that stops
reading are each checked without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from appliance.endpoint import EngineAddress
from appliance.gateway import splice, upstream_pool
from appliance.gateway.http1 import (
    UpstreamError,
    is_whole_chunks,
    parse_head,
    request_bytes,
    scan_chunks,
)
from appliance.gateway.upstream_pool import UpstreamPool
from tests.fakes.owners import in_process

OK_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


# ---- framing, pure -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "whole"),
    [
        (chunk(b"data: a\n\n"), True),
        (chunk(b"a") + chunk(b"bc"), True),
        (chunk(b"hello")[:-1], False),  # CRLF not here yet
        (b"5\r\nhel", False),
        (b"0\r\n\r\n", False),  # the terminal chunk is not forwarded as data
        (chunk(b"a") + b"0\r\n\r\n", False),
        (b"5;ext=1\r\nhello\r\n", False),  # extensions take the careful path
        (b"5\r\nhelloXX", False),
        (b"zz\r\nhello\r\n", False),
        (b"", True),
    ],
)
def test_is_whole_chunks(data: bytes, whole: bool) -> None:
    assert is_whole_chunks(data) is whole


def test_scan_chunks_finds_whole_chunks_and_the_end() -> None:
    body = chunk(b"ab") + chunk(b"cde")
    assert scan_chunks(body) == (len(body), [b"ab", b"cde"], -1)
    assert scan_chunks(body + b"3\r\nxy") == (len(body), [b"ab", b"cde"], -1)
    end = body + b"0\r\n\r\n"
    assert scan_chunks(end) == (len(end), [b"ab", b"cde"], len(body))
    trailers = body + b"0\r\nX-Trailer: 1\r\n\r\n"
    assert scan_chunks(trailers) == (len(trailers), [b"ab", b"cde"], len(body))
    assert scan_chunks(body + b"0\r\nX-Tr") == (len(body), [b"ab", b"cde"], -1)
    assert scan_chunks(b"2;name=v\r\nab\r\n") == (14, [b"ab"], -1)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"zz\r\nab\r\n", "bad chunk size"),
        (b"2\r\nabXX", "not followed by CRLF"),
        (b"1" * 2000, "too long"),
    ],
)
def test_scan_chunks_refuses_bad_framing(data: bytes, problem: str) -> None:
    with pytest.raises(UpstreamError, match=problem):
        scan_chunks(data)


def test_parse_head() -> None:
    head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nTRANSFER-encoding: chunked")
    assert head.status == 200 and head.chunked and head.keep_alive
    assert head.headers["content-type"] == "a/b"
    assert not parse_head(b"HTTP/1.1 400 Bad\r\nConnection: close").keep_alive
    for bad in (b"HTTP/2 200", b"SPDY 200 OK", b"HTTP/1.1 OK", b"HTTP/1.1 200 OK\r\nnocolon"):
        with pytest.raises(UpstreamError):
            parse_head(bad)


def test_request_bytes() -> None:
    raw = request_bytes("/v1/x", "127.0.0.1:8100", {"Authorization": "Bearer k"}, b"{}")
    assert raw == (
        b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1:8100\r\nContent-Length: 2\r\n"
        b"Authorization: Bearer k\r\n\r\n{}"
    )


# ---- a scripted engine on a real socket ---------------------------------------------------
class ScriptedEngine:
    """Answers each request on a connection with the next script: a list of byte pieces
    written with a pause between them; None closes the connection there."""

    def __init__(self, scripts: list[list[bytes | None]]) -> None:
        self.scripts = scripts
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_early = asyncio.Event()
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.scripts:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.scripts.pop(0):
                    if piece is None:
                        writer.close()
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
            await reader.read()  # until the gateway closes its end
            self.closed_early.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_early.set()
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def engine(scripts: list[list[bytes | None]]) -> AsyncIterator[ScriptedEngine]:
    eng = ScriptedEngine(scripts)
    server = await asyncio.start_server(eng.handle, "127.0.0.1", 0)
    eng.port = server.sockets[0].getsockname()[1]
    try:
        yield eng
    finally:
        server.close()


def req(port: int) -> bytes:
    return request_bytes("/v1/completions", f"127.0.0.1:{port}", {}, b'{"stream": true}')


async def streaming(eng: ScriptedEngine) -> splice.UpstreamConnection:
    """A connection whose stream has begun: head read, first whole chunk here."""
    conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
    await conn.send(req(eng.port))
    await conn.wait_first_chunk()
    return conn


@contextlib.asynccontextmanager
async def client_socket() -> AsyncIterator[tuple[asyncio.Transport, socket.socket]]:
    """A transport to splice into, and the plain socket at its other end."""
    near, far = socket.socketpair()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, near)
    far.setblocking(False)
    try:
        yield transport, far  # type: ignore[misc]
    finally:
        transport.close()
        far.close()


async def read_all(sock: socket.socket, until: bytes = b"", wait_s: float = 2.0) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    deadline = loop.time() + wait_s
    while loop.time() < deadline and (not until or not got.endswith(until)):
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            await asyncio.sleep(0.01)
            continue
        if not data:
            break
        got += data
    return got


async def test_a_stream_is_spliced_whole_chunks_only_and_the_connection_reused() -> None:
    events = [chunk(b"data: %d\n\n" % i) for i in range(5)]
    # Split mid-chunk and across chunks: the client must only ever see whole chunks.
    wire = OK_HEAD + b"".join(events) + b"0\r\n\r\n"
    pieces: list[bytes | None] = [wire[:30], wire[30:75], wire[75:76], wire[76:]]
    async with engine([pieces, [OK_HEAD, chunk(b"again"), b"0\r\n\r\n"]]) as eng:
        pool = UpstreamPool(in_process)
        conn = await pool.acquire(EngineAddress(port=eng.port))
        head = await conn.send(req(eng.port))
        assert head.status == 200 and head.chunked
        await conn.wait_first_chunk()
        async with client_socket() as (transport, far):
            conn.splice_to(transport)
            await conn.wait_spliced()
            got = await read_all(far, until=events[-1])
        assert got == b"".join(events)  # every event, not the engine's terminal chunk
        assert conn.finished
        pool.release(EngineAddress(port=eng.port), conn)
        again = await pool.acquire(EngineAddress(port=eng.port))
        assert again is conn  # kept alive
        head = await again.send(req(eng.port))
        assert await again.read_body() == b"again"
        assert eng.connections == 1 and len(eng.requests) == 2
        pool.close()


async def test_an_engine_on_a_unix_socket_is_spliced_and_its_connection_reused(
    tmp_path: Path,
) -> None:
    """engine.listen = "unix": the pool reaches the engine through its socket file."""
    path = str(tmp_path / "engine0.sock")
    eng = ScriptedEngine(
        [[OK_HEAD, chunk(b"data: 1\n\n"), b"0\r\n\r\n"], [OK_HEAD, chunk(b"two"), b"0\r\n\r\n"]]
    )
    server = await asyncio.start_unix_server(eng.handle, path)
    address = EngineAddress(uds=path)
    pool = UpstreamPool(in_process)
    try:
        conn = await pool.acquire(address)
        head = await conn.send(request_bytes("/v1/completions", address.host, {}, b"{}"))
        assert head.status == 200 and head.chunked
        assert await conn.read_body() == b"data: 1\n\n"
        pool.release(address, conn)
        again = await pool.acquire(address)
        assert again is conn  # kept alive, per socket path
        await again.send(request_bytes("/v1/completions", address.host, {}, b"{}"))
        assert await again.read_body() == b"two"
        assert eng.connections == 1
        assert eng.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
    finally:
        pool.close()
        server.close()


async def test_a_missing_engine_socket_is_an_upstream_error(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError, match="cannot connect to the engine"):
        await UpstreamPool(in_process).acquire(EngineAddress(uds=str(tmp_path / "gone.sock")))


async def test_engine_dying_mid_stream_is_an_error_after_whole_chunks() -> None:
    async with engine([[OK_HEAD, chunk(b"data: 1\n\n"), b"9\r\ndata:", None]]) as eng:
        pool = UpstreamPool(in_process)
        conn = await pool.acquire(EngineAddress(port=eng.port))
        await conn.send(req(eng.port))
        await conn.wait_first_chunk()
        async with client_socket() as (transport, far):
            conn.splice_to(transport)
            with pytest.raises(UpstreamError, match="closed the connection"):
                await conn.wait_spliced()
            # The half chunk never reached the client: its stream is at a boundary.
            assert await read_all(far, wait_s=0.3) == chunk(b"data: 1\n\n")
        assert not conn.finished
        pool.release(EngineAddress(port=eng.port), conn)  # closed, not pooled
        assert (await pool.acquire(EngineAddress(port=eng.port))) is not conn


async def test_failure_before_the_first_chunk_is_raised_before_anything_is_sent() -> None:
    async with engine([[OK_HEAD, None]]) as eng:
        conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
        await conn.send(req(eng.port))
        with pytest.raises(UpstreamError):
            await conn.wait_first_chunk()
    async with engine([[b"HTTP/1.1 200 OK\r\nContent-Le", None]]) as eng:
        conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
        with pytest.raises(UpstreamError, match="closed the connection"):
            await conn.send(req(eng.port))


@pytest.mark.parametrize(
    "answer",
    [
        [b'HTTP/1.1 400 Bad Request\r\nContent-Length: 10\r\n\r\n{"e": ', b'"x"}'],
        [
            b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n",
            chunk(b'{"e": "x"}'),
            b"0\r\n\r\n",
        ],
        [b'HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n{"e": "x"}', None],
    ],
    ids=["content-length", "chunked", "until-close"],
)
async def test_a_non_streamed_answer_is_read_whole(answer: list[bytes | None]) -> None:
    async with engine([answer]) as eng:
        conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
        head = await conn.send(req(eng.port))
        assert head.status == 400
        body = await conn.read_body()
        assert body == b'{"e": "x"}'


async def test_bad_http_from_the_engine_is_an_error_not_a_crash() -> None:
    for answer in (
        [b"garbage\r\n\r\n"],
        [OK_HEAD, b"zz\r\nxx\r\n"],
        [b"HTTP/1.1 200 OK\r\n" + b"X: " + b"a" * (splice.MAX_HEAD_BYTES + 10)],
    ):
        async with engine([list(answer)]) as eng:
            conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
            with pytest.raises(UpstreamError):
                await conn.send(req(eng.port))
                await conn.wait_first_chunk()


async def test_abort_fails_the_waiting_relay_and_closes_the_engine_connection() -> None:
    async with engine([[OK_HEAD, chunk(b"data: 1\n\n")]]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, _far):
            conn.splice_to(transport)
            waiting = asyncio.ensure_future(conn.wait_spliced())
            await asyncio.sleep(0.05)
            conn.abort("the engine stopped answering")
            with pytest.raises(UpstreamError, match="stopped answering"):
                await waiting
        await asyncio.wait_for(eng.closed_early.wait(), 2)  # vLLM sees the close: aborts


async def test_client_that_does_not_read_pauses_the_engine_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(splice, "HIGH_WATER", 64 * 1024)
    monkeypatch.setattr(splice, "LOW_WATER", 16 * 1024)
    big = [chunk(b"x" * 16000) for _ in range(200)]  # 3.2 MB the client will not read
    async with engine([[OK_HEAD, *big, b"0\r\n\r\n"]]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, far):
            conn.splice_to(transport)
            waiting = asyncio.ensure_future(conn.wait_spliced())
            await asyncio.sleep(0.5)
            assert conn.paused and not waiting.done()
            # What the gateway holds is bounded by the high-water mark (+ one read).
            assert transport.get_write_buffer_size() < 64 * 1024 + 300 * 1024
            got = 0
            while not waiting.done() or got < 200 * 16000:
                got += len(await read_all(far, wait_s=0.05))
                if waiting.done() and got >= 200 * 16000:
                    break
            await waiting
            assert got >= 200 * 16000


async def test_a_connection_idle_too_long_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM closes idle connections after 5 s: reusing one near that age races the close."""
    monkeypatch.setattr(upstream_pool, "MAX_IDLE_S", 0.1)
    answer: list[bytes | None] = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
    async with engine([list(answer), list(answer), list(answer)]) as eng:
        pool = UpstreamPool(in_process)
        first = await pool.acquire(EngineAddress(port=eng.port))
        await first.send(req(eng.port))
        assert await first.read_body() == b"ok"
        pool.release(EngineAddress(port=eng.port), first)
        assert await pool.acquire(EngineAddress(port=eng.port)) is first  # fresh: reused
        await first.send(req(eng.port))
        assert await first.read_body() == b"ok"
        pool.release(EngineAddress(port=eng.port), first)
        await asyncio.sleep(0.2)
        second = await pool.acquire(EngineAddress(port=eng.port))
        assert second is not first and first.transport is not None
        assert first.transport.is_closing()
        await second.send(req(eng.port))
        assert await second.read_body() == b"ok"
        assert eng.connections == 2
        pool.close()
