"""The gateway's HTTP server limits, through real sockets on an in-process server.

What a client sees: malformed requests get an OpenAI-shaped 400 that echoes nothing
back, and the log gets one short line per kind instead of a traceback quoting the
request; a request head or body that trickles in is cut off with 408; connections
beyond the cap get 503 while open ones carry on; and none of it touches a long answer
streamed to a slow reader. (tests/integration/test_gateway_hardening.py does the same
against a real daemon.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any

import pytest
from aiohttp import web

from appliance.gateway.errors import GatewayError
from appliance.gateway.http import server
from appliance.gateway.http.protocol_errors import ThrottledLog
from appliance.gateway.http.server import (
    BodyTimeout,
    ConnectionLimits,
    GatewayRunner,
    ensure_fd_room,
)

FAKE_KEY = b"sk-la-FAKEKEYDONOTLOG0123456789abcdef"
# serve runs on uvloop where it is installed, whose transports differ from asyncio's
# (they are not asyncio.Transport instances, for one): every test runs on both.
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
with contextlib.suppress(ImportError):
    import uvloop

    LOOPS["uvloop"] = uvloop.new_event_loop
Run = Callable[[Coroutine[Any, Any, None]], None]
CHUNKS = 8
CHUNK_GAP_S = 0.15


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Iterator[Run]:
    with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
        yield runner.run


@web.middleware
async def body_timeout_to_408(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    # What the gateway's middleware does with it (appliance/gateway/app.py).
    try:
        return await handler(request)
    except BodyTimeout as exc:
        return exc.response()
    except GatewayError as exc:
        return exc.response()


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response({"bytes": len(body)})


async def stream(request: web.Request) -> web.StreamResponse:
    """A long answer: CHUNKS chunks, CHUNK_GAP_S apart (a generation, streamed)."""
    resp = web.StreamResponse()
    await resp.prepare(request)
    for i in range(CHUNKS):
        await resp.write(f"chunk {i}\n".encode() + b"x" * 32768)
        await asyncio.sleep(CHUNK_GAP_S)
    await resp.write_eof()
    return resp


@contextlib.asynccontextmanager
async def gateway_server(limits: ConnectionLimits) -> AsyncIterator[tuple[int, GatewayRunner]]:
    app = web.Application(middlewares=[body_timeout_to_408])
    app.router.add_post("/echo", echo)
    app.router.add_get("/stream", stream)
    runner = GatewayRunner(
        app, limits, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], runner
    finally:
        await runner.cleanup()


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def openai_error(body: bytes) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


async def until(cond: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
    """Poll a condition on the server's side (no event to wait on there)."""
    for _ in range(int(within_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {within_s} s: {what}")


async def exchange(port: int, data: bytes, limit_s: float = 5.0) -> bytes:
    """Send data, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), limit_s)
    finally:
        writer.close()


async def trickle(
    port: int, first: bytes, step: bytes, stop_after_s: float = 30.0
) -> tuple[bytes, float]:
    """Send first, then step every 0.1 s (until stop_after_s) until the server answers
    and closes; return the answer and how long that took."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(first)
    answer = b""
    try:
        while time.monotonic() - started < 10:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 0.1)
            except TimeoutError:
                if time.monotonic() - started < stop_after_s:
                    writer.write(step)  # a byte now and then: each would reset an idle timer
                continue
            if not chunk:
                return answer, time.monotonic() - started
            answer += chunk
        raise AssertionError(f"still open after 10 s: {answer[:200]!r}")
    finally:
        writer.close()


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + FAKE_KEY + b"\rX\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\nX-Key: " + FAKE_KEY + b"a" * 9000 + b"\r\n\r\n",
    b"GET /" + FAKE_KEY + b"a" * 9000 + b" HTTP/1.1\r\nHost: t\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + FAKE_KEY + b"\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + FAKE_KEY,
]


def test_malformed_requests_get_an_openai_400_and_one_log_line_per_kind(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        caplog.set_level(logging.DEBUG)
        async with gateway_server(ConnectionLimits()) as (port, _):
            answers = await asyncio.gather(*(exchange(port, m) for m in MALFORMED * 50))
        for raw in answers:
            status, headers, body = parse(raw)
            assert status == 400, raw[:200]
            assert headers["content-type"].startswith("application/json")
            err = openai_error(body)
            assert err["type"] == "invalid_request_error"
            assert err["message"].startswith("malformed HTTP request: ")
            assert FAKE_KEY not in raw  # nothing of the request is echoed back
        text = caplog.text
        assert FAKE_KEY.decode() not in text
        assert "Traceback" not in text
        kinds = {r.getMessage().split("(")[1].split(":")[0] for r in caplog.records}
        # 300 bad requests, a handful of kinds: one line each (their repeats are only counted)
        assert len(caplog.records) == len(kinds) <= len(MALFORMED)
        assert all(len(r.getMessage()) < 200 for r in caplog.records)

    run(scenario())


def test_throttled_log_counts_repeats_and_reports_them_once_per_interval(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        caplog.set_level(logging.INFO)
        logger = logging.getLogger("test.throttled")
        notes = ThrottledLog(logger, interval_s=0.2)
        for _ in range(500):
            notes.note("junk", logging.INFO, "junk from %s", "10.0.0.1")
        notes.note("other", logging.INFO, "other thing")
        assert [r.getMessage() for r in caplog.records] == ["junk from 10.0.0.1", "other thing"]
        await until(lambda: len(caplog.records) == 3, "the count, when the interval ends")
        assert caplog.records[2].getMessage() == "499 more junk in the last 0.2 s"
        # A flood that goes on: counted again, one line per interval.
        notes.note("junk", logging.INFO, "junk from %s", "10.0.0.1")
        await until(lambda: len(caplog.records) == 4, "the next count")
        assert caplog.records[3].getMessage().startswith("1 more junk")
        # Once quiet for an interval, the next one is logged in full again.
        await asyncio.sleep(0.25)
        notes.note("junk", logging.INFO, "junk again")
        assert caplog.records[-1].getMessage() == "junk again"
        notes.note("junk", logging.INFO, "junk again")
        notes.close()  # at shutdown, what is held back is reported at once
        assert caplog.records[-1].getMessage().startswith("1 more junk")

    run(scenario())


def test_a_request_head_that_trickles_in_is_cut_off_with_408(run: Run) -> None:
    async def scenario() -> None:
        limits = ConnectionLimits(header_timeout_s=0.5)
        async with gateway_server(limits) as (port, _):
            # Still sending when the timeout strikes: the 408 reaches it all the same.
            raw, elapsed = await trickle(port, b"POST /echo HTTP/1.1\r\n", b"X")
        status, _, body = parse(raw)
        assert status == 408
        assert openai_error(body)["code"] == "header_timeout"
        # The lower bound is the point: cut at the timeout, counted from the first byte.
        # A byte comes every 0.1 s, so a timer that each byte resets would never fire
        # (trickle fails at 10 s); the upper bound only leaves a busy machine its room.
        assert 0.45 <= elapsed < 5.0

    run(scenario())


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(run: Run) -> None:
    async def scenario() -> None:
        async with gateway_server(ConnectionLimits(header_timeout_s=0.3)) as (port, runner):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            raw = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert parse(raw)[0] == 408
            server_ = runner.server
            assert isinstance(server_, server.GatewayServer)
            await until(lambda: server_.open_connections == 0, "its slot given back")

    run(scenario())


def test_keep_alive_idle_is_not_a_header_timeout_but_a_later_slow_head_is(run: Run) -> None:
    async def scenario() -> None:
        async with gateway_server(ConnectionLimits(header_timeout_s=0.3)) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(post("/echo", b"abc"))
            head = await asyncio.wait_for(reader.readuntil(b"}"), 5)
            assert parse(head)[0] == 200
            await asyncio.sleep(0.6)  # idle between requests: twice the header timeout
            writer.write(post("/echo", b"abcd"))
            head = await asyncio.wait_for(reader.readuntil(b"}"), 5)
            assert parse(head)[0] == 200
            assert json.loads(parse(head)[2]) == {"bytes": 4}
            # The next head starts but never ends: cut off after the timeout, counted
            # from its first byte.
            await asyncio.sleep(0.4)
            started = time.monotonic()
            writer.write(b"POST /echo HTTP/1.1\r\nHost")
            raw = await asyncio.wait_for(reader.read(), 5)
            writer.close()
        assert parse(raw)[0] == 408
        assert 0.25 <= time.monotonic() - started < 2.0

    run(scenario())


def test_a_body_that_trickles_in_gets_408_and_the_connection_closes(run: Run) -> None:
    async def scenario() -> None:
        limits = ConnectionLimits(header_timeout_s=5, body_timeout_s=2.0)
        head = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n"
        async with gateway_server(limits) as (port, _):
            # Sending until just before the timeout (a client still sending when its
            # connection closes may see a reset instead of the 408).
            raw, elapsed = await trickle(port, head, b"x", stop_after_s=1.8)
        status, headers, body = parse(raw)
        assert status == 408
        assert headers["connection"].lower() == "close"
        assert openai_error(body)["code"] == "body_timeout"
        # From the head, not from the last byte (an idle timer would give 3.8 s), and
        # not another 10 s of aiohttp's read-and-discard after the answer. A 2 s timeout
        # leaves a busy machine 1.5 s of room below what an idle timer would give.
        assert 1.95 <= elapsed < 3.5

    run(scenario())


@pytest.mark.parametrize("writes", [1, 2])
def test_a_bad_chunk_line_in_a_body_being_read_gets_400_at_once_and_a_close(
    run: Run, caplog: pytest.LogCaptureFixture, writes: int
) -> None:
    """A chunked body whose chunk line is bad, after a head the handler already has: in
    one read with it (the body's end after it makes two heads of it for _parse), that
    connection got no answer and no timer, for ever; in a read of its own, a 408 after
    body_timeout_s. Both are the 400 of a malformed request, at once, echoing nothing."""

    async def scenario() -> None:
        head = b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        bad = FAKE_KEY[:2] + b"\r\nhello\r\n0\r\n\r\n"
        async with gateway_server(ConnectionLimits(body_timeout_s=30.0)) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(head + bad if writes == 1 else head)
                if writes == 2:
                    await asyncio.sleep(0.2)  # the handler is reading the body by now
                    writer.write(bad)
                raw = await asyncio.wait_for(reader.read(), 5.0)  # until the server closes
            finally:
                writer.close()
        status, headers, body = parse(raw)
        assert status == 400, raw
        assert headers["connection"].lower() == "close"
        assert openai_error(body)["code"] == "bad_request"
        assert FAKE_KEY[:2] not in body

    with caplog.at_level(logging.INFO, logger="appliance.gateway"):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == "appliance.gateway"]
    assert any("malformed request" in line and "body's framing" in line for line in lines)


def test_a_whole_body_in_time_is_not_cut(run: Run, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        limits = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5)
        async with gateway_server(limits) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 200000\r\n\r\n")
            for _ in range(4):  # in pieces, well within the timeout
                await asyncio.sleep(0.05)
                writer.write(b"y" * 50000)
            head = await asyncio.wait_for(reader.readuntil(b"}"), 5)
            assert json.loads(parse(head)[2]) == {"bytes": 200000}
            await asyncio.sleep(0.7)  # past the body timer, had it been left running
            writer.write(post("/echo", b"z"))
            head = await asyncio.wait_for(reader.readuntil(b"}"), 5)
            assert json.loads(parse(head)[2]) == {"bytes": 1}
            writer.close()

    run(scenario())


def test_a_long_answer_to_a_slow_reader_outlives_every_timeout(run: Run) -> None:
    async def scenario() -> None:
        # The answer takes CHUNKS * CHUNK_GAP_S (1.2 s) and the reader is slower still;
        # both request timeouts are a fraction of that.
        limits = ConnectionLimits(header_timeout_s=0.2, body_timeout_s=0.2)
        async with gateway_server(limits) as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
            writer.transport.set_write_buffer_limits(0)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
            received = b""
            while True:
                await asyncio.sleep(0.1)
                chunk = await asyncio.wait_for(reader.read(16384), 5)
                if not chunk:
                    break
                received += chunk
                if received.endswith(b"0\r\n\r\n"):
                    break
            writer.close()
        assert received.startswith(b"HTTP/1.1 200")
        assert received.count(b"chunk ") == CHUNKS

    run(scenario())


def test_connections_beyond_the_cap_get_503_while_open_ones_carry_on(
    run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        caplog.set_level(logging.INFO)
        async with gateway_server(ConnectionLimits(max_connections=3, header_timeout_s=10)) as (
            port,
            runner,
        ):
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            server_ = runner.server
            assert isinstance(server_, server.GatewayServer)
            await until(lambda: server_.open_connections == 3, "three connections open")
            for _ in range(20):
                started = time.monotonic()
                raw = await exchange(port, post("/echo", b"hi"))
                # At once, not after the 10 s header timeout (the room is for a busy box).
                assert time.monotonic() - started < 5.0
                status, headers, body = parse(raw)
                assert status == 503
                assert headers["retry-after"] == "1"
                assert openai_error(body)["code"] == "too_many_connections"
            for reader, writer in held:  # the open ones still work
                writer.write(post("/echo", b"hello"))
                head = await asyncio.wait_for(reader.readuntil(b"}"), 5)
                assert json.loads(parse(head)[2]) == {"bytes": 5}
            held[0][1].close()
            await until(lambda: server_.open_connections == 2, "a slot given back")
            raw = await exchange(port, post("/echo", b"hi", b"Connection: close\r\n"))
            assert parse(raw)[0] == 200
            for _, writer in held[1:]:
                writer.close()
        # 20 refusals: one line, and the count of the rest when the server stops.
        refusals = [r.getMessage() for r in caplog.records if "max_connections" in r.getMessage()]
        assert refusals == [
            "refused a connection from 127.0.0.1: gateway.max_connections (3) are open",
            "19 more connections refused at gateway.max_connections in the last 60 s",
        ]

    run(scenario())


def test_fd_limit_is_raised_to_fit_max_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])

    def setrlimit(_: int, value: tuple[int, int]) -> None:
        limits["now"] = value

    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert ensure_fd_room(1024) is None
    assert limits["now"] == (1024 + server.MAX_LINGERING + server.FD_HEADROOM, 4096)
    warning = ensure_fd_room(10000)
    assert warning is not None and "gateway.max_connections = 10000" in warning
    assert limits["now"] == (4096, 4096)  # as far as the hard limit allows
