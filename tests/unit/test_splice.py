"""The spliced stream relay's HTTP/1.1 reading, against real sockets on loopback.

A tiny raw server plays the engine: it writes exactly the bytes a test gives it, split
where the test says, so chunk framing, keep-alive, bad answers and a client that stops
reading are each checked without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from appliance.endpoint import EngineAddress
from appliance.gateway.wire import splice, upstream_pool
from appliance.gateway.wire.http1 import (
    MAX_CHUNK_BYTES,
    AnswerTooLarge,
    ChunkTooLarge,
    UpstreamError,
    count_whole_chunks,
    is_whole_chunks,
    parse_head,
    request_bytes,
    scan_chunks,
)
from appliance.gateway.wire.upstream_pool import UpstreamPool
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


class RecordingSink:
    """The client's transport, with each write kept: what went in which system call."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()


async def test_the_head_goes_with_the_first_chunk_and_the_end_with_the_last() -> None:
    """One write fewer at each end of a stream than aiohttp makes (stream_writes.py)."""
    events = [chunk(b"data: %d\n\n" % i) for i in range(3)]
    pieces: list[bytes | None] = [OK_HEAD + events[0], events[1], events[2] + b"0\r\n\r\n"]
    async with engine([pieces]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, far):
            sink = RecordingSink(transport)
            conn.splice_to(sink, b"HTTP/1.1 200 OK\r\n\r\n", b"0\r\n\r\n")  # type: ignore[arg-type]
            await conn.wait_spliced()
            got = await read_all(far, until=b"0\r\n\r\n")
        assert sink.writes == [
            b"HTTP/1.1 200 OK\r\n\r\n" + events[0],
            events[1],
            events[2] + b"0\r\n\r\n",
        ]
        assert got == b"".join(sink.writes)
        assert conn.ended_stream and conn.finished and conn.unsent_head() == b""


async def test_a_stream_cut_short_keeps_its_end_for_the_error_event() -> None:
    async with engine([[OK_HEAD, chunk(b"data: 1\n\n"), b"9\r\ndata:", None]]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, far):
            sink = RecordingSink(transport)
            conn.splice_to(sink, b"HEAD ", b"0\r\n\r\n")  # type: ignore[arg-type]
            with pytest.raises(UpstreamError):
                await conn.wait_spliced()
            assert await read_all(far, wait_s=0.3) == b"HEAD " + chunk(b"data: 1\n\n")
        # The relay appends the error event, then the end: neither went out here.
        assert not conn.ended_stream and conn.unsent_head() == b""


async def test_a_head_never_sent_is_the_relays_to_send() -> None:
    """The client went away before the first chunk could go: the head is still held."""
    async with engine([[OK_HEAD, chunk(b"data: 1\n\n"), b"0\r\n\r\n"]]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, _far):
            transport.close()
            conn.splice_to(transport, b"HEAD ", b"0\r\n\r\n")
            with pytest.raises(UpstreamError, match="client disconnected"):
                await conn.wait_spliced()
        assert conn.unsent_head() == b"HEAD " and not conn.ended_stream


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


# ---- the engine's framing is not trusted (security issue #20, item 5) --------------------
PLANTED = OK_HEAD + chunk(b"data: PLANTED\n\n") + b"0\r\n\r\n"  # an answer nobody asked for


async def until(cond: Callable[[], bool], what: str, wait_s: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while not cond():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("size", [b"+5", b"0x5", b"1_0", b" 5", b"5 ", b"-5", b"1" * 17, b""])
def test_a_chunk_size_is_strict_hex(size: bytes) -> None:
    """int(x, 16) took all of these but the last three; the first four reached clients."""
    wire = size + b"\r\nhello\r\n"
    assert count_whole_chunks(wire) == 0
    assert not is_whole_chunks(chunk(b"a") + wire)
    with pytest.raises(UpstreamError, match="bad chunk size line"):
        scan_chunks(wire)


@pytest.mark.parametrize(
    ("line", "size"),
    [(b"5", 5), (b"05", 5), (b"A", 10), (b"a;x=1", 10), (b"5 ;x", 5), (b"0000000000000005", 5)],
)
def test_strict_sizes_and_extensions_still_pass(line: bytes, size: int) -> None:
    wire = line + b"\r\n" + b"x" * size + b"\r\n"
    assert scan_chunks(wire) == (len(wire), [b"x" * size], -1)


def test_an_extension_with_a_stray_cr_or_lf_or_control_byte_is_bad_framing() -> None:
    """Extensions reach the client verbatim in the spliced stream: printable ASCII only."""
    for line in (b"5;a\nb", b"5;a\rb", b"5;a\x00"):
        with pytest.raises(UpstreamError, match="bad chunk size line"):
            scan_chunks(line + b"\r\nhello\r\n")


def test_a_chunk_over_the_cap_is_refused_at_its_size_line() -> None:
    cap = MAX_CHUNK_BYTES
    with pytest.raises(ChunkTooLarge, match=str(cap)):
        scan_chunks(b"%x\r\nxxx" % (cap + 1))  # none of its data is here yet
    assert scan_chunks(b"%x\r\nxxx" % cap) == (0, [], -1)  # at the cap: waits for the rest
    assert count_whole_chunks(chunk(b"x" * (cap + 1))) == 0  # the fast path leaves it
    with pytest.raises(ChunkTooLarge):
        scan_chunks(chunk(b"x" * 10), max_chunk=9)


def test_trailers_are_bounded_like_a_head() -> None:
    with pytest.raises(UpstreamError, match="trailers"):
        scan_chunks(b"0\r\nX: " + b"a" * (splice.MAX_HEAD_BYTES + 10))


@pytest.mark.parametrize("bad", [b"+5\r\nhello\r\n", b"0x5\r\nhello\r\n", b" 5\r\nhello\r\n"])
async def test_a_non_strict_size_mid_stream_ends_it_at_the_last_good_chunk(bad: bytes) -> None:
    async with engine([[OK_HEAD, chunk(b"data: 1\n\n"), bad, chunk(b"data: 2\n\n")]]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, far):
            conn.splice_to(transport)
            with pytest.raises(UpstreamError, match="bad chunk size line"):
                await asyncio.wait_for(conn.wait_spliced(), 2)
            assert await read_all(far, wait_s=0.3) == chunk(b"data: 1\n\n")
        await asyncio.wait_for(eng.closed_early.wait(), 2)


async def test_a_huge_chunk_mid_stream_fails_it_at_once_and_closes_the_engine() -> None:
    """Its size line is enough: nothing of it is held, and the close makes vLLM abort."""
    huge = b"%x\r\n" % (MAX_CHUNK_BYTES + 1) + b"x" * 100_000  # and the engine goes on...
    async with engine([[OK_HEAD, chunk(b"data: 1\n\n"), huge]]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, far):
            conn.splice_to(transport)
            with pytest.raises(UpstreamError, match=f"more than {MAX_CHUNK_BYTES}"):
                await asyncio.wait_for(conn.wait_spliced(), 2)
            assert await read_all(far, wait_s=0.3) == chunk(b"data: 1\n\n")
        await asyncio.wait_for(eng.closed_early.wait(), 2)


async def test_a_huge_first_chunk_fails_before_anything_reaches_the_client() -> None:
    huge = b"%x\r\n" % (200 * 2**20) + b"x" * 100_000
    async with engine([[OK_HEAD, huge]]) as eng:
        conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
        await conn.send(req(eng.port))
        with pytest.raises(UpstreamError, match=f"more than {MAX_CHUNK_BYTES}"):
            await asyncio.wait_for(conn.wait_first_chunk(), 2)
        await asyncio.wait_for(eng.closed_early.wait(), 2)


async def test_a_non_streamed_chunk_over_the_answer_limit_is_too_large_at_its_size_line() -> None:
    head = b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with engine([[head, chunk(b"ab"), b"%x\r\n" % 5000 + b"x" * 100]]) as eng:
        conn = await UpstreamPool(in_process).acquire(EngineAddress(port=eng.port))
        await conn.send(req(eng.port))
        with pytest.raises(AnswerTooLarge):
            await asyncio.wait_for(conn.read_body(limit=1000), 2)


async def test_bytes_after_a_spliced_answer_never_reach_its_client() -> None:
    """Whole chunks after the engine's terminal chunk used to go straight to the client's
    socket (the splice was still on): events after its stream's end."""
    events = [chunk(b"data: 1\n\n"), chunk(b"data: 2\n\n")]
    script: list[bytes | None] = [OK_HEAD, *events, b"0\r\n\r\n", chunk(b"data: PLANTED\n\n")]
    async with engine([script]) as eng:
        conn = await streaming(eng)
        async with client_socket() as (transport, far):
            conn.splice_to(transport)
            await conn.wait_spliced()
            await asyncio.wait_for(eng.closed_early.wait(), 2)  # the stray closed it
            assert await read_all(far, wait_s=0.3) == b"".join(events)
        assert not conn.finished


async def test_a_connection_the_engine_writes_to_while_idle_is_not_reused() -> None:
    """An engine that answers twice: the second answer lands on the pooled connection.
    Kept there, the next user's request would have read it as its own."""
    first: list[bytes | None] = [OK_HEAD, chunk(b"data: 1\n\n"), b"0\r\n\r\n", PLANTED]
    own: list[bytes | None] = [OK_HEAD, chunk(b"data: own\n\n"), b"0\r\n\r\n"]
    async with engine([first, own]) as eng:
        pool = UpstreamPool(in_process)
        address = EngineAddress(port=eng.port)
        conn = await pool.acquire(address)
        await conn.send(req(eng.port))
        assert await conn.read_body() == b"data: 1\n\n"
        assert conn.finished
        pool.release(address, conn)  # idle in the pool when the planted answer comes
        await asyncio.wait_for(eng.closed_early.wait(), 2)  # ...which closes it
        again = await pool.acquire(address)
        assert again is not conn
        await again.send(req(eng.port))
        assert await again.read_body() == b"data: own\n\n"
        assert eng.connections == 2
        pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        [OK_HEAD + chunk(b"data: 1\n\n") + b"0\r\n\r\n" + PLANTED],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + PLANTED],
    ],
    ids=["chunked", "content-length"],
)
async def test_bytes_beyond_an_answer_in_the_read_that_ends_it_make_it_unusable(
    answer: list[bytes | None],
) -> None:
    async with engine([answer]) as eng:
        pool = UpstreamPool(in_process)
        address = EngineAddress(port=eng.port)
        conn = await pool.acquire(address)
        await conn.send(req(eng.port))
        await conn.read_body()
        assert not conn.finished
        pool.release(address, conn)
        assert (await pool.acquire(address)) is not conn
        pool.close()


async def test_bytes_before_any_request_make_a_connection_unusable() -> None:
    server = await asyncio.start_server(
        lambda _r, w: w.write(PLANTED),
        "127.0.0.1",
        0,
    )
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await UpstreamPool(in_process).acquire(EngineAddress(port=port))
        assert conn.transport is not None
        transport = conn.transport
        await until(transport.is_closing, "the connection is closed")
        with pytest.raises(UpstreamError, match="closed"):  # at once, never a hang
            await asyncio.wait_for(conn.send(req(port)), 2)
    finally:
        server.close()
